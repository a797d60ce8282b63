"""Entry points the CLI (and later the server) call: calibrate tau, deterministic greedy generation."""

from __future__ import annotations

import json
from pathlib import Path

from verinfer.determinism.scheduler import POLICIES, Scheduler, make_engines
from verinfer.determinism.tau import calibrate, calibration_requests, read_tau, write_tau
from verinfer.engine.engine import Request
from verinfer.io import atomic_write_text, check_writable, progress_bar
from verinfer.models.load import model_info
from verinfer.models.prompts import split_prompts
from verinfer.sampling.params import SamplingParams

DEFAULT_TAU_FILE = Path("runs/margingate_tau.json")


def run_calibrate(model_dir, out=DEFAULT_TAU_FILE, n: int = 16, max_batch: int = 16, seed: int = 0,
                  device: str = "cpu", show_progress: bool = True) -> dict:
    check_writable(out, "tau file")
    with progress_bar("determinism calibrate (reference, eps_pert, tau sweep)", calibration_requests(n),
                      show_progress) as adv:
        rec = calibrate(model_dir, n=n, max_batch=max_batch, seed=seed, device=device, progress=adv)
    if rec["tau"] is None:
        raise ValueError("no swept tau reached sequence determinism 1.0 on the calibration prompts")
    write_tau(out, rec)
    return rec


def generate(model_dir, out, *, policy: str = "margingate", n: int = 8, max_tokens: int = 64, seed: int = 0,
             max_batch: int = 16, tau: float | None = None, tau_file=DEFAULT_TAU_FILE, protect_every: int = 1,
             window: int = 64, device: str = "cpu") -> list[dict]:
    """Greedy generation with a determinism policy; every `protect_every`-th request is protected
    (the others share the batch on the bf16 path). Writes one JSON line per request."""
    check_writable(out, "completions file")
    if policy not in POLICIES:
        raise ValueError(f"--deterministic must be one of {tuple(POLICIES)}, got {policy!r}")
    info = model_info(model_dir)
    if policy in ("margingate", "gated_llm42") and tau is None:
        tau = read_tau(tau_file, info.name)
    eng = make_engines(model_dir, device)
    code, arith = split_prompts(model_dir, (n + 1) // 2, seed)
    prompts = [p for pair in zip(code, arith) for p in pair][:n]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    reqs = [Request(f"req-{i}", p, params) for i, p in enumerate(prompts)]
    protected = {r.id for r in reqs[::protect_every]}
    fast = eng.layercast if policy == "layercast" else eng.fast
    det = eng.tiled if policy == "batch_invariant" else eng.det
    outs, st = Scheduler(fast, det, policy, tau=tau or 0.0, window=window, max_batch=max_batch).run(reqs, protected)
    rows = [dict(id=r.id, model=info.name, prompt_token_ids=r.prompt_token_ids, output_token_ids=outs[r.id],
                 sampling=dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=None, noise="vllm-cpu"),
                 deterministic=policy if r.id in protected else None) for r in reqs]
    atomic_write_text(out, "".join(json.dumps(x) + "\n" for x in rows))
    return rows
