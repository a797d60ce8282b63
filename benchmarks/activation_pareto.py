"""Activation-DiFR vs TOPLOC: AUC@1%FPR against communication cost (bytes per output token).

    .venv/bin/python -m benchmarks.activation_pareto [--n 64] [--max-tokens 448]

On the testbed target: every honest provider configuration (HONEST, pooled as the honest set,
as in the detection study) and the misconfigurations int4 (4-bit RTN weights) and fp8-kv (fp8
e4m3 KV cache) generate claims of up to --max-tokens output tokens (448 = the testbed's 512
positions minus the longest prompt, 48, rounded down to a multiple of 64) while recording the
hidden states that produced each output token (final-norm output); the verifier (bf16, sdpa,
teacher-forced prefill replay) recomputes them. From the same cached hidden states:

- Activation-DiFR: seeded orthogonal projection to k dims (audit/fingerprint.py) of the output
  tokens 0, s, 2s, ..., fp16 or int8+fp16 scale; per logged token the L2 distance; sweep k x s x dtype.
  Bytes per token: 2k/s (fp16), (k+2)/s (int8).
- TOPLOC: `toploc.build_proofs_base64` / `verify_proofs_base64` (the PyPI package) over bf16 hidden
  states in chunks of c output tokens; sweep topk x c. Proof size is the package's own:
  `ProofPoly.to_bytes` = 2 (modulus) + 2*topk (Newton coefficients) bytes per chunk, so
  (2 + 2*topk)/c bytes per token. Per chunk its three statistics (exponent mismatches, mantissa
  error mean, median) and its own pass/fail rule; the AUC reported for a TOPLOC config is the best
  over those four scores at each batch size (favours the baseline).

Grids. The unit length (stride s = chunk c) takes the same values for both methods: powers of two
up to the claim length L, every floor(1000/N) for N = 2..16 (the longest unit that fits N units
into the 1000-token budget, so neither method loses to grid coarseness) and L itself (one unit
per claim: neither a fingerprint window nor a TOPLOC chunk can span two generations). k runs
1..64 (k = 1 is the smallest fingerprint); topk runs 1..128 (topk = 1 is the smallest proof the
package builds; 128 is its authors' setting, with chunk 32). TOPLOC chunks start at 8 tokens
(as in the first version of this benchmark): proving 1-4 tokens per chunk costs >= 1 byte/token
even at topk=1, far above either method's cost at AUC 0.99, and would take most of the run time
(one toploc call per chunk); Activation-DiFR strides start at 1.

Detector for every method: the DiFR protocol of audit/metrics.py (50/50 split per unit = logged
token window or chunk, winsorize at the 0.999 honest-train quantile, batch mean). Both methods use
the same stream accounting: a unit covers s (= c) consecutive output tokens of one claim, only
complete units are scored (the last partial window / chunk of a claim is dropped), and a batch of b
output tokens holds floor(b/s) units (b >= s).
Outputs: benchmarks/results/activation_pareto.{json,md,png} and activation_difr.json
(bytes_per_token_at_auc99: method -> misconfiguration -> smallest bytes per token reaching
AUC@1%FPR >= 0.99 within 1000 tokens, plus where that configuration sits in its grid). Data are
cached under benchmarks/.cache/ (resumable).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.markdown import write_markdown
from verinfer.fingerprint import projection_matrix, quantize, dequantize, DTYPES
from verinfer.detect.metrics import auc_vs_tokens
from verinfer.providers.simulated import HONEST, MISCONFIGURED, claimed_params, provider_generate
from verinfer.audit import toploc_baseline as tl

CACHE = ROOT / "benchmarks" / ".cache" / "activation_pareto"
RESULTS = ROOT / "benchmarks" / "results"
MISCONF = ["int4", "fp8-kv"]
BUDGET = 1000
BATCH_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, BUDGET]
KS = [1, 2, 4, 8, 16, 32, 64]
FP_DTYPES = ["fp16", "int8"]
TOPKS = [1, 2, 4, 8, 16, 32, 64, 128]
MIN_CHUNK = 8  # TOPLOC chunks shorter than this are skipped (see the docstring)
N_BATCHES = 400
ROBUSTNESS_SEEDS = list(range(101, 111))


def unit_grid(claim_tokens: int) -> list[int]:
    """Stride / chunk values (tokens per unit), the same for both methods (module docstring)."""
    g = {2 ** i for i in range(12) if 2 ** i <= claim_tokens}
    g |= {BUDGET // n for n in range(2, 17) if BUDGET // n <= claim_tokens}
    return sorted(g | {claim_tokens})


def toploc_chunks(topk: int, units: list[int]) -> list[int]:
    return [c for c in units if c >= MIN_CHUNK]


def collect(name: str, n: int, max_tokens: int, seed: int) -> dict:
    """Provider hidden states (T x D per claim) and the verifier's replayed ones; cached."""
    path = CACHE / f"{name}_n{n}_t{max_tokens}_s{seed}.safetensors"
    if path.is_file():
        return _with_bf16(_load_hidden(path))
    from verinfer.apps.pipeline import DEFAULT_SPEC, prompts_for, verifier_engine
    from verinfer.models.testbed import TARGET_DIR
    from verinfer.sampling.params import SamplingParams

    cfg = {**HONEST, **MISCONFIGURED}[name]
    prompts = prompts_for(TARGET_DIR, n, seed)
    t0 = time.perf_counter()
    advertised = SamplingParams(seed=0, max_tokens=max_tokens, **DEFAULT_SPEC)
    claims = provider_generate(cfg, TARGET_DIR, prompts, claimed_params(prompts, advertised, seed), base_seed=seed,
                               hidden_layer=-1)  # Completions: hidden_TD is the provider's own (fp32, T x D)
    gen_s = time.perf_counter() - t0
    reps = verifier_engine(TARGET_DIR).replay([(c.prompt_token_ids, c.output_token_ids) for c in claims],
                                              hidden_layer=-1)
    d = {"provider": [c.hidden_TD.float() for c in claims], "verifier": [r.hidden_TD.float() for r in reps],
         "gen_seconds": gen_s}
    _save_hidden(d, path)
    print(f"  collected {name}: {len(claims)} claims, {sum(h.shape[0] for h in d['provider'])} tokens, "
          f"{gen_s:.0f} s", flush=True)
    return _with_bf16(d)


def _save_hidden(d: dict, path: Path) -> None:
    """Cache as safetensors (never pickle), written atomically."""
    from safetensors.torch import save_file

    tensors = {f"{side}.{i}": h.contiguous() for side in ("provider", "verifier") for i, h in enumerate(d[side])}
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"gen_seconds": repr(d["gen_seconds"])})
    tmp.replace(path)


def _load_hidden(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        n = sum(k.startswith("provider.") for k in keys)
        return {"provider": [f.get_tensor(f"provider.{i}") for i in range(n)],
                "verifier": [f.get_tensor(f"verifier.{i}") for i in range(n)],
                "gen_seconds": float(f.metadata()["gen_seconds"])}


def _with_bf16(d: dict) -> dict:
    """TOPLOC proves bf16 hidden states: cast once, not once per configuration."""
    d["provider_bf16"] = [h.to(torch.bfloat16) for h in d["provider"]]
    d["verifier_bf16"] = [h.to(torch.bfloat16) for h in d["verifier"]]
    return d


def full_windows(n_tokens: int, unit: int) -> list[int]:
    """Start positions 0, unit, 2*unit, ... of the complete windows of `unit` tokens in a claim."""
    return list(range(0, n_tokens - unit + 1, unit))


def fp_all_positions(data: dict, k: int, dtype: str, seed: int = 0) -> list[np.ndarray]:
    """Per claim, the L2 distance at every output position (fingerprints are quantized per row,
    so a stride only selects rows of this)."""
    D = data["provider"][0].shape[-1]
    P = projection_matrix(D, k, seed)
    out = []
    for hp, hv in zip(data["provider"], data["verifier"]):
        a = dequantize(*quantize(hp @ P, dtype))
        b = dequantize(*quantize(hv @ P, dtype))
        out.append(torch.linalg.vector_norm(a - b, dim=-1).double().numpy())
    return out


def fp_distances(per_claim: list[np.ndarray], stride: int) -> np.ndarray:
    return np.concatenate([d[full_windows(d.shape[0], stride)] for d in per_claim])


def toploc_stats(data: dict, spec: tl.ToplocSpec) -> np.ndarray:
    """(complete chunks, 4): exp mismatches, mantissa mean, mantissa median, 1 - TOPLOC's own pass."""
    rows = []
    for hp, hv in zip(data["provider_bf16"], data["verifier_bf16"]):
        n_full = hp.shape[0] // spec.chunk
        if n_full == 0:
            continue
        r = tl.verify(hv, tl.build(hp, spec), spec)[:n_full]  # drop a short last chunk
        rows.append(np.c_[r, 1.0 - tl.passes(r, spec)])
    return np.concatenate(rows) if rows else np.empty((0, 4))


def toploc_all(data: dict, names: list[str], topk: int, chunks: list[int], tag: str) -> dict:
    """{name: {chunk: stats}} for one topk, cached (the slow part of the benchmark)."""
    from safetensors.numpy import load_file, save_file

    path = CACHE / f"toploc_{tag}_topk{topk}.safetensors"
    if path.is_file():  # keys "name|chunk" -> (chunks, 4) statistics
        cached: dict = {}
        for key, v in load_file(str(path)).items():
            nm, c = key.rsplit("|", 1)
            cached.setdefault(nm, {})[int(c)] = v
        if all(c in cached.get(nm, {}) for nm in names for c in chunks):
            return cached
    out = {nm: {c: toploc_stats(data[nm], tl.ToplocSpec(topk, c)) for c in chunks} for nm in names}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file({f"{nm}|{c}": np.ascontiguousarray(v, dtype=np.float64) for nm, cs in out.items() for c, v in cs.items()},
              str(tmp))
    tmp.replace(path)
    return out


def auc_curve(h_units: np.ndarray, m_units: np.ndarray, tokens_per_unit: int, seed: int) -> dict[int, float | None]:
    sizes = {b: b // tokens_per_unit for b in BATCH_TOKENS if b >= tokens_per_unit}
    if min(len(h_units), len(m_units)) < 2:
        return {b: None for b in sizes}
    aucs = auc_vs_tokens(h_units, m_units, sorted(set(sizes.values())), n_batches=N_BATCHES,
                         rng=np.random.default_rng(seed))
    return {b: aucs[u] for b, u in sizes.items()}


def auc_at_budget_by_seed(h_units: np.ndarray, m_units: np.ndarray, tokens_per_unit: int) -> list[float | None]:
    """AUC@1%FPR of batches of BUDGET tokens under other random train/test splits and batch draws
    (seeds ROBUSTNESS_SEEDS): how much the headline depends on one split."""
    u = BUDGET // tokens_per_unit
    if min(len(h_units), len(m_units)) < 2:
        return [None] * len(ROBUSTNESS_SEEDS)
    return [auc_vs_tokens(h_units, m_units, [u], n_batches=N_BATCHES, rng=np.random.default_rng(sd))[u]
            for sd in ROBUSTNESS_SEEDS]


def tokens_to_99(curve: dict[int, float | None]) -> int | None:
    ok = [b for b, a in sorted(curve.items()) if a is not None and a >= 0.99]
    return ok[0] if ok else None


def main() -> None:
    global RESULTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64, help="claims per provider")
    ap.add_argument("--max-tokens", type=int, default=448, help="output tokens per claim (EOS may end one early)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--collect-only", nargs="*", metavar="PROVIDER", default=None,
                    help="only generate and cache these providers' hidden states (all if none given)")
    ap.add_argument("--toploc-only", nargs="+", type=int, metavar="TOPK", default=None,
                    help="only compute and cache TOPLOC statistics for these topk (to share the work between "
                         "processes; a later full run reads the cache)")
    ap.add_argument("--results-dir", type=Path, default=RESULTS, help="where the json/md/png go")
    args = ap.parse_args()
    RESULTS = args.results_dir
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    names = list(HONEST) + MISCONF
    if args.collect_only is not None:
        for nm in args.collect_only or names:
            collect(nm, args.n, args.max_tokens, args.seed)
        return
    data = {nm: collect(nm, args.n, args.max_tokens, args.seed) for nm in names}
    lengths = [h.shape[0] for nm in names for h in data[nm]["provider"]]
    units = unit_grid(args.max_tokens)
    tag = f"n{args.n}_t{args.max_tokens}_s{args.seed}"
    if args.toploc_only:
        for topk in args.toploc_only:
            toploc_all(data, names, topk, toploc_chunks(topk, units), tag)
            print(f"  toploc topk={topk} cached ({time.perf_counter() - t_start:.0f} s)", flush=True)
        return
    print(f"  {len(lengths)} claims, {sum(lengths)} output tokens; unit grid {units}", flush=True)
    points = []
    # --- Activation-DiFR ---
    for k in KS:
        for dt in FP_DTYPES:
            bpv = k * DTYPES[dt] + (2 if dt == "int8" else 0)
            per_claim = {nm: fp_all_positions(data[nm], k, dt) for nm in names}
            for s in units:
                h = np.concatenate([fp_distances(per_claim[nm], s) for nm in HONEST])
                for mc in MISCONF:
                    m = fp_distances(per_claim[mc], s)
                    curve = auc_curve(h, m, s, args.seed)
                    points.append({"method": "activation_difr", "misconfiguration": mc, "k": k, "stride": s,
                                   "dtype": dt, "bytes_per_token": bpv / s, "auc_by_tokens": curve,
                                   "tokens_to_auc99": tokens_to_99(curve), "units": [int(h.size), int(m.size)],
                                   "auc_at_budget_other_splits": auc_at_budget_by_seed(h, m, s),
                                   "honest_mean_l2": float(h.mean()), "misconf_mean_l2": float(m.mean())})
        print(f"  activation_difr k={k} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    # --- TOPLOC ---
    for topk in TOPKS:
        chunks = toploc_chunks(topk, units)
        stats = toploc_all(data, names, topk, chunks, tag)
        for ch in chunks:
            spec = tl.ToplocSpec(topk, ch)
            h = np.concatenate([stats[nm][ch] for nm in HONEST])
            for mc in MISCONF:
                m = stats[mc][ch]
                curves = {stat: auc_curve(h[:, j], m[:, j], ch, args.seed)
                          for j, stat in enumerate(["exp_mismatches", "mant_err_mean", "mant_err_median", "fails"])}
                best = {b: max((c[b] for c in curves.values() if c[b] is not None), default=None) for b in curves["fails"]}
                points.append({"method": "toploc", "misconfiguration": mc, "topk": topk, "chunk": ch,
                               "bytes_per_token": spec.bytes_per_token, "auc_by_tokens": best,
                               "auc_by_tokens_per_statistic": curves, "tokens_to_auc99": tokens_to_99(best),
                               "units": [int(h.shape[0]), int(m.shape[0])],
                               "auc_at_budget_other_splits": [
                                   max((a for a in col if a is not None), default=None) for col in zip(
                                       *[auc_at_budget_by_seed(h[:, j], m[:, j], ch) for j in range(4)])],
                               "own_threshold_chunk_fail_rate": {"honest": float(h[:, 3].mean()),
                                                                 "misconfigured": float(m[:, 3].mean())}})
        print(f"  toploc topk={topk} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    write_results(points, args, units, lengths, time.perf_counter() - t_start)


def frontier(pts: list[dict], budget: int) -> list[tuple[float, float]]:
    """(bytes/token, best AUC@1%FPR at <= budget tokens) Pareto frontier (max AUC at each cost)."""
    best_at: dict[float, float] = {}
    for p in pts:
        y = max([a for b, a in p["auc_by_tokens"].items() if b <= budget and a is not None], default=0.5)
        best_at[p["bytes_per_token"]] = max(best_at.get(p["bytes_per_token"], 0.0), y)
    out, best = [], -1.0
    for x, y in sorted(best_at.items()):
        if y > best:
            out.append((x, y))
            best = y
    return out


GRID_PARAMS = {"activation_difr": (("k", "k"), ("stride", "units")), "toploc": (("topk", "topk"), ("chunk", "units"))}
LIMITS = {"k": "k=1 is the smallest fingerprint (one value per logged token)",
          "topk": "topk=1 is the smallest proof toploc builds (modulus + one coefficient, 4 bytes)",
          "stride": "stride = claim length: one fingerprint per claim (a window cannot span two generations; "
                    "the testbed's 512-position context minus a 48-token prompt caps claims at 448 tokens)",
          "chunk": "chunk = claim length: one proof per claim (a TOPLOC chunk groups decode steps of one "
                   "generation; the testbed's 512-position context minus a 48-token prompt caps claims at 448 tokens)"}


def grid_position(method: str, cfg: dict, units: list[int]) -> dict:
    """Where a configuration sits in its grid: interior, or which edge and whose limit that edge is."""
    out = {}
    for name, grid_key in GRID_PARAMS[method]:
        grid = units if grid_key == "units" else (KS if name == "k" else TOPKS)
        if name == "chunk":
            grid = toploc_chunks(cfg["topk"], units)
        v = cfg[name]
        if grid[0] < v < grid[-1]:
            out[name] = "interior"
        else:
            edge = "grid minimum" if v == grid[0] else "grid maximum"
            own = (name in ("k", "topk") and v == 1) or (name in ("stride", "chunk") and v == units[-1])
            out[name] = f"{edge} ({v}); " + (f"the method's own limit: {LIMITS[name]}" if own else "NOT a limit")
    return out


def best_config(points: list[dict], **match) -> dict | None:
    ok = [p for p in points if all(p[k] == v for k, v in match.items()) and p["tokens_to_auc99"] is not None]
    if not ok:
        return None
    best = min(ok, key=lambda p: (p["bytes_per_token"], p["tokens_to_auc99"]))
    return {k: v for k, v in best.items() if k not in ("auc_by_tokens", "auc_by_tokens_per_statistic")}


def write_results(points: list[dict], args, units: list[int], lengths: list[int], seconds: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    at99, configs, positions, per_size = {}, {}, {}, {}
    for method, size_key, sizes in (("activation_difr", "k", KS), ("toploc", "topk", TOPKS)):
        at99[method], configs[method], positions[method], per_size[method] = {}, {}, {}, {}
        for mc in MISCONF:
            c = best_config(points, method=method, misconfiguration=mc)
            at99[method][mc] = None if c is None else c["bytes_per_token"]
            configs[method][mc] = c
            positions[method][mc] = None if c is None else grid_position(method, c, units)
            per_size[method][mc] = {str(v): best_config(points, method=method, misconfiguration=mc, **{size_key: v})
                                    for v in sizes}
    ratio = {mc: (at99["activation_difr"][mc] / at99["toploc"][mc]
                  if at99["activation_difr"][mc] is not None and at99["toploc"][mc] else None) for mc in MISCONF}
    robust: dict = {}
    for method in ("activation_difr", "toploc"):
        robust[method] = {}
        for mc in MISCONF:
            pts = [p for p in points if p["method"] == method and p["misconfiguration"] == mc]
            robust[method][mc] = [min((p["bytes_per_token"] for p in pts if p["auc_at_budget_other_splits"][i] is not None
                                       and p["auc_at_budget_other_splits"][i] >= 0.99), default=None)
                                  for i in range(len(ROBUSTNESS_SEEDS))]
    robust_ratio = {mc: [None if a is None or t is None else a / t
                         for a, t in zip(robust["activation_difr"][mc], robust["toploc"][mc])] for mc in MISCONF}
    out = {"bytes_per_token_at_auc99": at99,
           "config_at_auc99": configs,
           "grid_position_at_auc99": positions,
           "activation_over_toploc_bytes_ratio": ratio,
           "target_ratio_int4": 0.25,
           "meets_target_int4": None if ratio["int4"] is None else bool(ratio["int4"] <= 0.25),
           "smallest_bytes_per_k_or_topk": per_size,
           "other_splits": {"seeds": ROBUSTNESS_SEEDS, "note": f"smallest bytes/token with AUC@1%FPR >= 0.99 at "
                            f"{BUDGET} tokens under other random train/test splits and batch draws",
                            "bytes_per_token_at_auc99": robust, "activation_over_toploc_bytes_ratio": robust_ratio},
           "setup": {"model": "testbed target (hidden size 256)", "honest_pool": list(HONEST),
                     "misconfigurations": MISCONF, "claims_per_provider": args.n, "max_tokens_per_claim": args.max_tokens,
                     "output_tokens_total": int(sum(lengths)), "claims_shorter_than_max": int(sum(
                         1 for n in lengths if n < args.max_tokens)),
                     "verifier": "bf16 sdpa teacher-forced replay", "layer": "final norm output (-1)",
                     "budget_tokens": BUDGET, "batch_tokens": BATCH_TOKENS, "n_batches": N_BATCHES, "max_fpr": 0.01,
                     "unit_grid_tokens": units, "ks": KS, "fp_dtypes": FP_DTYPES, "topks": TOPKS,
                     "toploc_chunks": f"unit grid values >= {MIN_CHUNK}",
                     "accounting": "activation_difr 2k/s (fp16) or (k+2)/s (int8) bytes/token; toploc "
                                   "(2 + 2*topk)/chunk (ProofPoly.to_bytes); only complete windows/chunks are "
                                   "scored; a batch of b tokens holds floor(b/unit) units",
                     "toploc": "PyPI toploc 0.1.6 built from sdist; AUC = best of its 3 statistics and its own "
                               "pass/fail at each batch size; thresholds TEXP=90/128 (scaled), TMEAN=10, TMEDIAN=8",
                     "projection": "QR of seeded float64 Gaussian (seed 0), sign-fixed; see audit/fingerprint.py",
                     "seconds": round(seconds, 1)},
           "points": points}
    text = json.dumps(out, indent=1, default=float)
    (RESULTS / "activation_pareto.json").write_text(text)
    (RESULTS / "activation_difr.json").write_text(text)

    def cell(m: str, c: dict | None) -> str:
        if c is None:
            return "not reached"
        if m == "toploc":
            return f"{c['bytes_per_token']:.4g} (topk={c['topk']}, chunk={c['chunk']}, {c['tokens_to_auc99']} tok)"
        return f"{c['bytes_per_token']:.4g} (k={c['k']}, s={c['stride']}, {c['dtype']}, {c['tokens_to_auc99']} tok)"

    lines = ["# Activation-DiFR vs TOPLOC on the testbed", "",
             f"`.venv/bin/python -m benchmarks.activation_pareto --n {args.n} --max-tokens {args.max_tokens}` "
             f"({args.n} claims x up to {args.max_tokens} output tokens per provider, {sum(lengths)} tokens in all; "
             f"honest pool = {', '.join(HONEST)})", "",
             f"Unit grid (stride = chunk, tokens, both methods): {units}; k: {KS} x {FP_DTYPES}; topk: {TOPKS}.", "",
             f"Smallest bytes per output token reaching AUC@1%FPR >= 0.99 within {BUDGET} tokens:", "",
             "| misconfiguration | Activation-DiFR B/token (config, tokens) | TOPLOC B/token (config, tokens) | ratio |",
             "|---|---|---|---|"]
    for mc in MISCONF:
        r = ratio[mc]
        lines.append(f"| {mc} | {cell('activation_difr', configs['activation_difr'][mc])} | "
                     f"{cell('toploc', configs['toploc'][mc])} | {'-' if r is None else f'{r:.3f}'} |")
    lines += ["", "Where those configurations sit in their grids:", ""]
    for mc in MISCONF:
        for m in ("activation_difr", "toploc"):
            pos = positions[m][mc]
            if pos:
                lines.append(f"- {mc} {m}: " + "; ".join(f"{k}: {v}" for k, v in pos.items()))
    lines += ["", f"The same at {BUDGET} tokens under {len(ROBUSTNESS_SEEDS)} other random train/test splits "
              "(bytes/token, Activation-DiFR / TOPLOC = ratio):", ""]
    for mc in MISCONF:
        lines.append(f"- {mc}: " + ", ".join(
            "-" if a is None or t is None else f"{a:.3g}/{t:.3g}={a / t:.2f}"
            for a, t in zip(robust["activation_difr"][mc], robust["toploc"][mc])))
    lines += ["", f"Smallest bytes per token reaching AUC@1%FPR >= 0.99 within {BUDGET} tokens, per projection "
              "dimension k (Activation-DiFR) and per topk (TOPLOC):", "",
              "| misconfiguration | method | size | B/token (config, tokens) |", "|---|---|---|---|"]
    for mc in MISCONF:
        for m, key in (("activation_difr", "k"), ("toploc", "topk")):
            for v, c in per_size[m][mc].items():
                lines.append(f"| {mc} | {m} | {key}={v} | {cell(m, c)} |")
    lines += ["", "TOPLOC with its own thresholds (topk=128): fraction of chunks failing, honest / misconfigured:", ""]
    for p in points:
        if p["method"] == "toploc" and p["topk"] == 128 and p["chunk"] in (32, units[-1]):
            fr = p["own_threshold_chunk_fail_rate"]
            lines.append(f"- {p['misconfiguration']} chunk={p['chunk']}: {fr['honest']:.3f} / {fr['misconfigured']:.3f}")
    lines += ["", "Pareto frontier at a 32-token budget (bytes/token -> AUC@1%FPR):", ""]
    for mc in MISCONF:
        for m in ("activation_difr", "toploc"):
            f = frontier([p for p in points if p["method"] == m and p["misconfiguration"] == mc], 32)
            lines.append(f"- {mc} {m}: " + ", ".join(f"{x:.3g}->{y:.3f}" for x, y in f))
    write_markdown(RESULTS / "activation_pareto.md", "\n".join(lines) + "\n")
    plot(points)
    print("\n".join(lines))


def plot(points: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [8, 32, BUDGET]
    fig, axes = plt.subplots(len(MISCONF), len(budgets), figsize=(4.2 * len(budgets), 3.4 * len(MISCONF)),
                             squeeze=False)
    for i, mc in enumerate(MISCONF):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            for m, style, color in (("activation_difr", "-o", "tab:blue"), ("toploc", "--s", "tab:red")):
                pts = [p for p in points if p["method"] == m and p["misconfiguration"] == mc]
                xs = [p["bytes_per_token"] for p in pts]
                ys = [max([a for b, a in p["auc_by_tokens"].items() if b <= budget and a is not None], default=0.5)
                      for p in pts]
                ax.scatter(xs, ys, s=8, alpha=0.3, color=color)
                f = frontier(pts, budget)
                ax.step([x for x, _ in f], [y for _, y in f], style, where="post", color=color, ms=3,
                        label="Activation-DiFR" if m == "activation_difr" else "TOPLOC")
            ax.set_xscale("log")
            ax.set_ylim(0.45, 1.02)
            ax.axhline(0.99, color="gray", lw=0.6, ls=":")
            ax.set_title(f"{mc}, <= {budget} tokens", fontsize=9)
            ax.set_xlabel("bytes per output token")
            ax.set_ylabel("AUC@1%FPR")
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "activation_pareto.png", dpi=120)


if __name__ == "__main__":
    main()
