"""Tau calibration for MarginGate (paper section 4 / appendix A) and the shared harness pieces.

1. eps_pert: along each calibration sequence's synchronous prefix (steps before its first
   divergence from the reference), max |logits_bf16_batched - logits_ref| over the reference's
   top-50 tokens.
2. sweep tau over [0, 2 * max eps_pert] (extended if no point reaches 1.0), run the gated policy
   (`margingate`, or its `margingate_live_cache` ablation) end to end on the calibration prompts,
   and pick the smallest tau whose sequence-level determinism is 1.0. The chosen tau is then fixed
   for held-out prompts of another kind.

Tau files: {model: {key: record}}, key "bf16" for `margingate_live_cache` (and gated_llm42, which
reads its tau; the first tau files held only that policy's, then called `margingate`, and a record
without a `policy` field is its) and "bf16/<policy>" for another gated policy (`tau_key`; `read_tau`
also finds `margingate`'s under "bf16/margingate_contract", its key before the rename). A record's
`tau` is the paper's choice; `margingate` decodes at CONTRACT_SAFETY times it (`read_tau`): on SmolLM2 the
paper's tau (0.25, from arithmetic prompts) left 1 of 32 held-out code sequences divergent, and
twice it was exact on 32 code prompts that choice never saw (benchmarks/results/margingate_smollm2-135m-instruct.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verinfer.determinism.scheduler import Engines, Scheduler, make_engines, policy_name
from verinfer.engine.engine import Engine, Request
from verinfer.io import atomic_write_json
from verinfer.models.load import model_info
from verinfer.models.prompts import split_prompts
from verinfer.numerics.machine import machine_fingerprint
from verinfer.sampling.params import SamplingParams

TOP_K_EPS = 50


def make_requests(prompts, tag: str, max_tokens: tuple[int, int], seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = max_tokens
    return [Request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=int(torch.randint(lo, hi + 1, (1,),
                                                                                                  generator=g))))
            for i, p in enumerate(prompts)]


def reference(eng: Engines, reqs, max_batch: int = 16, det: Engine | None = None, progress=None) -> dict[str, list[int]]:
    """The batch-size-1 answer of the deterministic path (`det`, default eng.det). Computed
    batched: the path is batch-invariant (tests/determinism/test_invariant.py checks it bitwise).
    progress(1) after each finished request."""
    det = det or eng.det
    out, _ = Scheduler(det, det, "batch_invariant", max_batch=max_batch).run(reqs, progress=progress)
    return out


def determinism(out: dict, ref: dict, ids) -> float:
    ids = list(ids)
    return sum(out[i] == ref[i] for i in ids) / max(len(ids), 1)


def flip_stats(out: dict, ref: dict, ids) -> dict:
    """Flip rate per synchronous step: first divergences / steps compared while prefixes agreed."""
    sync, flips, where = 0, 0, []
    for i in ids:
        a, b = out[i], ref[i]
        j = next((t for t in range(min(len(a), len(b))) if a[t] != b[t]), None)
        sync += (j + 1) if j is not None else min(len(a), len(b))
        if j is not None:
            flips += 1
            where.append(j)
    return dict(flip_rate=flips / max(sync, 1), diverged=flips, synchronous_steps=sync, first_flip_steps=where)


def eps_pert(eng: Engines, reqs, ref: dict, max_batch: int, progress=None) -> list[float]:
    """Per-step eps over the reference's top-50, along the synchronous prefix of bf16 batched runs.
    progress(1) after each finished request of the batched run."""
    seen: dict[str, list[torch.Tensor]] = {}

    def capture(logits_BV, params, noises, batch):
        for b, r in enumerate(batch.requests):
            if not batch.done_B[b]:
                seen.setdefault(r.id, []).append(logits_BV[b].clone())
        return logits_BV.argmax(-1)

    out, _ = Scheduler(eng.fast, eng.det, "bf16", max_batch=max_batch).run(reqs, sampler=capture, progress=progress)
    by_id = {r.id: r for r in reqs}
    eps: list[float] = []
    for rid, logits in seen.items():
        r, a, b = by_id[rid], out[rid], ref[rid]
        j = next((t for t in range(len(a)) if a[t] != b[t]), len(a))
        n = min(j + 1, len(logits))
        # the reference's logits at the first n output steps: its prompt + first n-1 tokens, one forward
        one = Request(rid, r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=1))
        _, lg, _ = eng.det.prefill_extend([one], torch.tensor([b[: n - 1]], dtype=torch.long), extra_slots=0)
        ref_TV = lg[0]
        for t in range(n):
            top = ref_TV[t].topk(TOP_K_EPS).indices
            eps.append(float((logits[t][top] - ref_TV[t][top]).abs().max()))
    return eps


GATED = ("margingate", "margingate_live_cache")  # the policies a tau is calibrated for
CONTRACT_SAFETY = 2.0  # margingate decodes at this times the calibrated tau (module docstring)
LEGACY_KEYS = {"margingate": "margingate_contract"}  # where a tau file written before the rename keeps it


def sweep_tau(eng: Engines, reqs, ref: dict, taus, max_batch: int, progress=None,
              policy: str = "margingate") -> list[dict]:
    """The gated `policy` end to end at each tau; progress(1) after each finished request of each run."""
    rows = []
    for tau in taus:
        out, st = Scheduler(eng.fast, eng.det, policy, tau=float(tau), max_batch=max_batch).run(
            reqs, progress=progress)
        rows.append(dict(tau=float(tau), determinism=determinism(out, ref, ref), **st.rates()))
    return rows


def calibration_requests(n: int, points: int = 9) -> int:
    """The requests `calibrate` runs (its progress total): reference, eps_pert, then `points` sweep
    runs of n each (a widened sweep runs n more per extra point)."""
    return (2 + points) * n


def calibrate(model_dir, n: int = 16, max_tokens=(48, 128), max_batch: int = 16, seed: int = 0, points: int = 9,
              device="cpu", eng: Engines | None = None, progress=None, policy: str = "margingate") -> dict:
    """Calibrate the gated `policy`'s tau on arithmetic prompts. Returns the full record (eps,
    sweep, chosen tau). progress(1) after each finished request of every phase
    (`calibration_requests` in all)."""
    policy = policy_name(policy)
    if policy not in GATED:
        raise ValueError(f"tau is calibrated for {' or '.join(GATED)}, not {policy!r}")
    eng = eng or make_engines(model_dir, device)
    _, arith = split_prompts(model_dir, n, seed)
    reqs = make_requests(arith, "cal", max_tokens, seed)
    ref = reference(eng, reqs, max_batch, progress=progress)
    eps = eps_pert(eng, reqs, ref, max_batch, progress=progress)
    hi = 2 * max(eps)
    taus = [hi * i / (points - 1) for i in range(points)]
    sweep = sweep_tau(eng, reqs, ref, taus, max_batch, progress, policy)
    ok = [r for r in sweep if r["determinism"] == 1.0]
    while not ok and hi < 64:  # no point of the paper's range is deterministic: widen it
        hi *= 2
        more = sweep_tau(eng, reqs, ref, [hi], max_batch, progress, policy)
        sweep += more
        ok = [r for r in more if r["determinism"] == 1.0]
    return dict(model=model_info(model_dir).name, dtype="bf16", policy=policy, calibration="arithmetic",
                n_prompts=len(reqs),
                max_batch=max_batch, eps_pert_max=max(eps), eps_pert_mean=sum(eps) / len(eps),
                eps_pert_p99=sorted(eps)[int(0.99 * (len(eps) - 1))], sweep_range=2 * max(eps), sweep=sweep,
                tau=min(r["tau"] for r in ok) if ok else None,
                machine=machine_fingerprint(device=eng.fast.device))  # near-tie margins are this machine's


def tau_key(dtype: str = "bf16", policy: str = "margingate") -> str:
    """Where a tau file keeps a policy's tau for a dtype (module docstring)."""
    return dtype if policy in ("margingate_live_cache", "gated_llm42") else f"{dtype}/{policy}"


def write_tau(path, record: dict) -> None:
    """Merge {model: {tau_key: record}} into a JSON file."""
    p = Path(path)
    data = json.loads(p.read_text()) if p.is_file() else {}
    policy = policy_name(record.get("policy", "margingate_live_cache"))  # no policy: the live-cache ablation's
    data.setdefault(record["model"], {})[tau_key(record["dtype"], policy)] = record
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(p, data)


def read_tau(path, model: str, dtype: str = "bf16", policy: str = "margingate") -> float:
    """The tau `policy` decodes at: the calibrated one (x CONTRACT_SAFETY for margingate)."""
    p = Path(path)
    policy = policy_name(policy)
    factor = CONTRACT_SAFETY if policy == "margingate" else 1.0
    try:
        taus = json.loads(p.read_text())[model]
        key = tau_key(dtype, policy)
        if key not in taus and policy in LEGACY_KEYS:
            key = tau_key(dtype, LEGACY_KEYS[policy])
        return factor * float(taus[key]["tau"])
    except (FileNotFoundError, KeyError, TypeError) as e:
        raise ValueError(f"no calibrated tau for model {model!r} dtype {dtype} policy {policy} in {p}; "
                         f"run `verinfer determinism calibrate --policy {policy}` first") from e
