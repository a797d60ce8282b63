"""Entry points the CLI (and later the server) call: calibrate tau, deterministic greedy generation."""

from __future__ import annotations

from pathlib import Path

from verinfer.determinism.scheduler import POLICIES, Scheduler, make_engines, policy_name
from verinfer.determinism.tau import GATED, calibrate, calibration_requests, read_tau, write_tau
from verinfer.engine.engine import Request
from verinfer.claims import Claim, write_claims
from verinfer.io import output
from verinfer.progress import progress_bar
from verinfer.models.load import model_info
from verinfer.models.prompts import split_prompts
from verinfer.sampling.params import SamplingParams

DEFAULT_TAU_FILE = Path("runs/margingate_tau.json")


def run_calibrate(model_dir, out=DEFAULT_TAU_FILE, n: int = 16, max_batch: int = 16, seed: int = 0,
                  device: str = "cpu", show_progress: bool = True, policy: str = "margingate") -> dict:
    with output(out, "tau file"):  # merged by model: read, then written, under the lock
        with progress_bar("determinism calibrate (reference, eps_pert, tau sweep)", calibration_requests(n),
                          show_progress) as adv:
            rec = calibrate(model_dir, n=n, max_batch=max_batch, seed=seed, device=device, progress=adv,
                            policy=policy)
        if rec["tau"] is None:
            raise ValueError("no swept tau reached sequence determinism 1.0 on the calibration prompts")
        write_tau(out, rec)
    return rec


def generate(model_dir, out, *, policy: str = "margingate", n: int = 8, max_tokens: int = 64, seed: int = 0,
             max_batch: int = 16, tau: float | None = None, tau_file=DEFAULT_TAU_FILE, protect_every: int = 1,
             window: int = 64, device: str = "cpu") -> list[Claim]:
    """Greedy generation with a determinism policy; every `protect_every`-th request is protected
    (the others share the batch on the bf16 path). Writes the claims (claims.write_claims), each
    with the extra field `deterministic`: the policy for a protected request, else null."""
    with output(out, "completions file", inputs=[tau_file]):
        return _generate(model_dir, out, policy=policy, n=n, max_tokens=max_tokens, seed=seed, max_batch=max_batch,
                         tau=tau, tau_file=tau_file, protect_every=protect_every, window=window, device=device)


def _generate(model_dir, out, *, policy, n, max_tokens, seed, max_batch, tau, tau_file, protect_every, window,
              device) -> list[Claim]:
    policy = policy_name(policy)
    POLICIES.get(policy)  # an unknown policy fails before the model loads, naming the policies
    info = model_info(model_dir)
    if policy in (*GATED, "gated_llm42") and tau is None:
        tau = read_tau(tau_file, info.name, policy=policy)
    eng = make_engines(model_dir, device)
    code, arith = split_prompts(model_dir, (n + 1) // 2, seed)
    prompts = [p for pair in zip(code, arith) for p in pair][:n]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    reqs = [Request(f"req-{i}", p, params) for i, p in enumerate(prompts)]
    protected = {r.id for r in reqs[::protect_every]}
    fast = eng.layercast if policy == "layercast" else eng.fast
    det = eng.tiled if policy == "batch_invariant" else eng.det
    outs, st = Scheduler(fast, det, policy, tau=tau or 0.0, window=window, max_batch=max_batch).run(reqs, protected)
    claims = [Claim(r.id, info.name, r.prompt_token_ids, outs[r.id], params,
                    extra={"deterministic": policy if r.id in protected else None}) for r in reqs]
    write_claims(out, claims)
    return claims
