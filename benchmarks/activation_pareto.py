"""Activation-DiFR vs TOPLOC: AUC@1%FPR against communication cost (bytes per output token).

    .venv/bin/python benchmarks/activation_pareto.py [--n 64] [--max-tokens 64]

On the testbed target: every honest provider configuration (HONEST, pooled as the honest set,
as in the detection study) and the misconfigurations int4 (4-bit RTN weights) and fp8-kv (fp8
e4m3 KV cache) generate claims while recording the hidden states that produced each output token
(final-norm output); the verifier (bf16, sdpa, teacher-forced prefill replay) recomputes them.
From the same cached hidden states:

- Activation-DiFR: seeded orthogonal projection to k dims (audit/fingerprint.py), every s-th
  output token, fp16 or int8+scale; per logged token the L2 distance; sweep k x s x dtype.
- TOPLOC: `toploc.build_proofs_base64` / `verify_proofs_base64` (the PyPI package) over bf16 hidden
  states in chunks; sweep topk x chunk. Per chunk its three statistics (exponent mismatches,
  mantissa error mean, median) and its own pass/fail rule; the AUC reported for a TOPLOC config is
  the best over those four scores (favours the baseline).

Detector for every method: the DiFR protocol of audit/metrics.py (50/50 split per unit = logged
token or chunk, winsorize at the 0.999 honest-train quantile, batch mean). A batch of b output
tokens holds floor(b/s) fingerprints or floor(b/chunk) TOPLOC chunks (b >= s, resp. chunk).
Outputs: benchmarks/results/activation_pareto.{json,md,png} and activation_difr.json
(bytes_per_token_at_auc99: method -> misconfiguration -> smallest bytes per token reaching
AUC@1%FPR >= 0.99 within 1000 tokens). Data are cached under benchmarks/.cache/ (resumable).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from verinfer.audit.fingerprint import projection_matrix, quantize, dequantize, DTYPES  # noqa: E402
from verinfer.audit.metrics import auc_vs_tokens  # noqa: E402
from verinfer.audit.providers import HONEST, MISCONFIGURED, run_provider  # noqa: E402
from verinfer.audit import toploc_baseline as tl  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache" / "activation_pareto"
RESULTS = ROOT / "benchmarks" / "results"
MISCONF = ["int4", "fp8-kv"]
BATCH_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]
KS = [1, 2, 4, 8, 16, 32, 64]
STRIDES = [1, 2, 4, 8, 16, 32, 64]
FP_DTYPES = ["fp16", "int8"]
TOPKS = [4, 8, 16, 32, 64, 128]
CHUNKS = [8, 16, 32, 64]
N_BATCHES = 400


def collect(name: str, n: int, max_tokens: int, seed: int) -> dict:
    """Provider hidden states (T x D per claim) and the verifier's replayed ones; cached."""
    path = CACHE / f"{name}_n{n}_t{max_tokens}_s{seed}.pt"
    if path.is_file():
        return torch.load(path)
    from verinfer.audit.pipeline import DEFAULT_SPEC, prompts_for, verifier_engine
    from verinfer.models.testbed import TARGET_DIR
    from verinfer.sampling.params import SamplingParams

    cfg = {**HONEST, **MISCONFIGURED}[name]
    prompts = prompts_for(TARGET_DIR, n, seed)
    t0 = time.perf_counter()
    claims = run_provider(cfg, TARGET_DIR, prompts, SamplingParams(seed=0, max_tokens=max_tokens, **DEFAULT_SPEC),
                          base_seed=seed, keep_hidden=True)
    gen_s = time.perf_counter() - t0
    reps = verifier_engine(TARGET_DIR).score([(c.prompt_token_ids, c.output_token_ids) for c in claims],
                                             hidden_layer=-1)
    d = {"provider": [c.hidden_TD.float() for c in claims], "verifier": [r.hidden_TD.float() for r in reps],
         "gen_seconds": gen_s}
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(d, tmp)
    tmp.replace(path)
    print(f"  collected {name}: {len(claims)} claims, {sum(h.shape[0] for h in d['provider'])} tokens, "
          f"{gen_s:.0f} s", flush=True)
    return d


def fp_distances(data: dict, k: int, stride: int, dtype: str, seed: int = 0) -> np.ndarray:
    D = data["provider"][0].shape[-1]
    P = projection_matrix(D, k, seed)
    out = []
    for hp, hv in zip(data["provider"], data["verifier"]):
        pos = list(range(0, hp.shape[0], stride))
        a = dequantize(*quantize(hp[pos] @ P, dtype))
        b = dequantize(*quantize(hv[pos] @ P, dtype))
        out.append(torch.linalg.vector_norm(a - b, dim=-1).double().numpy())
    return np.concatenate(out)


def toploc_stats(data: dict, spec: tl.ToplocSpec) -> np.ndarray:
    """(chunks, 4): exp mismatches, mantissa mean, mantissa median, 1 - TOPLOC's own pass."""
    rows = []
    for hp, hv in zip(data["provider"], data["verifier"]):
        r = tl.verify(hv, tl.build(hp, spec), spec)
        # drop a short last chunk so that every unit covers `chunk` tokens
        if hp.shape[0] % spec.chunk:
            r = r[:-1]
        rows.append(np.c_[r, 1.0 - tl.passes(r, spec)])
    return np.concatenate(rows)


def auc_curve(h_units: np.ndarray, m_units: np.ndarray, tokens_per_unit: int, seed: int) -> dict[int, float | None]:
    sizes = {b: b // tokens_per_unit for b in BATCH_TOKENS if b >= tokens_per_unit}
    aucs = auc_vs_tokens(h_units, m_units, sorted(set(sizes.values())), n_batches=N_BATCHES,
                         rng=np.random.default_rng(seed))
    return {b: aucs[u] for b, u in sizes.items()}


def tokens_to_99(curve: dict[int, float | None]) -> int | None:
    ok = [b for b, a in sorted(curve.items()) if a is not None and a >= 0.99]
    return ok[0] if ok else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.perf_counter()
    names = list(HONEST) + MISCONF
    data = {nm: collect(nm, args.n, args.max_tokens, args.seed) for nm in names}
    points = []
    # --- Activation-DiFR ---
    for k in KS:
        for s in STRIDES:
            for dt in FP_DTYPES:
                bpv = k * DTYPES[dt] + (2 if dt == "int8" else 0)
                h = np.concatenate([fp_distances(data[nm], k, s, dt) for nm in HONEST])
                for mc in MISCONF:
                    m = fp_distances(data[mc], k, s, dt)
                    curve = auc_curve(h, m, s, args.seed)
                    points.append({"method": "activation_difr", "misconfiguration": mc, "k": k, "stride": s,
                                   "dtype": dt, "bytes_per_token": bpv / s, "auc_by_tokens": curve,
                                   "tokens_to_auc99": tokens_to_99(curve),
                                   "honest_mean_l2": float(h.mean()), "misconf_mean_l2": float(m.mean())})
        print(f"  activation_difr k={k} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    # --- TOPLOC ---
    for topk in TOPKS:
        for ch in CHUNKS:
            spec = tl.ToplocSpec(topk, ch)
            h = np.concatenate([toploc_stats(data[nm], spec) for nm in HONEST])
            for mc in MISCONF:
                m = toploc_stats(data[mc], spec)
                curves = {stat: auc_curve(h[:, j], m[:, j], ch, args.seed)
                          for j, stat in enumerate(["exp_mismatches", "mant_err_mean", "mant_err_median", "fails"])}
                best = {b: max((c[b] for c in curves.values() if c[b] is not None), default=None) for b in curves["fails"]}
                points.append({"method": "toploc", "misconfiguration": mc, "topk": topk, "chunk": ch,
                               "bytes_per_token": spec.bytes_per_token, "auc_by_tokens": best,
                               "auc_by_tokens_per_statistic": curves, "tokens_to_auc99": tokens_to_99(best),
                               "own_threshold_chunk_fail_rate": {"honest": float(h[:, 3].mean()),
                                                                 "misconfigured": float(m[:, 3].mean())}})
        print(f"  toploc topk={topk} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    write_results(points, args, time.perf_counter() - t_start)


def frontier(pts: list[dict], budget: int) -> list[tuple[float, float]]:
    """(bytes/token, best AUC@1%FPR at <= budget tokens) Pareto frontier (max AUC at each cost)."""
    xy = sorted((p["bytes_per_token"], max([a for b, a in p["auc_by_tokens"].items() if b <= budget and a is not None],
                                           default=0.5)) for p in pts)
    out, best = [], -1.0
    for x, y in xy:
        if y > best:
            out.append((x, y))
            best = y
    return out


def write_results(points: list[dict], args, seconds: float) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    at99: dict = {}
    for method in ("activation_difr", "toploc"):
        at99[method] = {}
        for mc in MISCONF:
            ok = [p for p in points if p["method"] == method and p["misconfiguration"] == mc
                  and p["tokens_to_auc99"] is not None]
            best = min(ok, key=lambda p: (p["bytes_per_token"], p["tokens_to_auc99"])) if ok else None
            at99[method][mc] = None if best is None else best["bytes_per_token"]
            at99.setdefault("config_at_auc99", {}).setdefault(method, {})[mc] = (
                None if best is None else {k: v for k, v in best.items() if k not in ("auc_by_tokens",
                                                                                     "auc_by_tokens_per_statistic")})
    ratio = {mc: (at99["activation_difr"][mc] / at99["toploc"][mc]
                  if at99["activation_difr"][mc] is not None and at99["toploc"][mc] else None) for mc in MISCONF}
    out = {"bytes_per_token_at_auc99": {m: at99[m] for m in ("activation_difr", "toploc")},
           "config_at_auc99": at99["config_at_auc99"],
           "activation_over_toploc_bytes_ratio": ratio,
           "setup": {"model": "testbed target (hidden size 256)", "honest_pool": list(HONEST),
                     "misconfigurations": MISCONF, "claims_per_provider": args.n, "tokens_per_claim": args.max_tokens,
                     "verifier": "bf16 sdpa teacher-forced replay", "layer": "final norm output (-1)",
                     "batch_tokens": BATCH_TOKENS, "n_batches": N_BATCHES, "max_fpr": 0.01,
                     "toploc": "PyPI toploc 0.1.6 built from sdist; AUC = best of its 3 statistics and its own "
                               "pass/fail; thresholds TEXP=90/128 (scaled), TMEAN=10, TMEDIAN=8",
                     "projection": "QR of seeded float64 Gaussian (seed 0), sign-fixed; see audit/fingerprint.py",
                     "seconds": round(seconds, 1)},
           "points": points}
    text = json.dumps(out, indent=1, default=float)
    (RESULTS / "activation_pareto.json").write_text(text)
    (RESULTS / "activation_difr.json").write_text(text)
    lines = ["# Activation-DiFR vs TOPLOC on the testbed", "",
             "`.venv/bin/python benchmarks/activation_pareto.py` "
             f"({args.n} claims x {args.max_tokens} tokens per provider; honest pool = {', '.join(HONEST)})", "",
             "Smallest bytes per output token reaching AUC@1%FPR >= 0.99 within 1000 tokens:", "",
             "| misconfiguration | Activation-DiFR B/token (config, tokens) | TOPLOC B/token (config, tokens) | ratio |",
             "|---|---|---|---|"]
    for mc in MISCONF:
        cells = []
        for m in ("activation_difr", "toploc"):
            c = out["config_at_auc99"][m][mc]
            if c is None:
                cells.append("not reached")
            elif m == "toploc":
                cells.append(f"{c['bytes_per_token']:.4g} (topk={c['topk']}, chunk={c['chunk']}, {c['tokens_to_auc99']} tok)")
            else:
                cells.append(f"{c['bytes_per_token']:.4g} (k={c['k']}, s={c['stride']}, {c['dtype']}, "
                             f"{c['tokens_to_auc99']} tok)")
        r = ratio[mc]
        lines.append(f"| {mc} | {cells[0]} | {cells[1]} | {'-' if r is None else f'{r:.3f}'} |")
    lines += ["", "TOPLOC with its own thresholds (topk=128): fraction of chunks failing, honest / misconfigured:", ""]
    for p in points:
        if p["method"] == "toploc" and p["topk"] == 128:
            fr = p["own_threshold_chunk_fail_rate"]
            lines.append(f"- {p['misconfiguration']} chunk={p['chunk']}: {fr['honest']:.3f} / {fr['misconfigured']:.3f}")
    lines += ["", "Pareto frontier at a 32-token budget (bytes/token -> AUC@1%FPR):", ""]
    for mc in MISCONF:
        for m in ("activation_difr", "toploc"):
            f = frontier([p for p in points if p["method"] == m and p["misconfiguration"] == mc], 32)
            lines.append(f"- {mc} {m}: " + ", ".join(f"{x:.3g}->{y:.3f}" for x, y in f))
    (RESULTS / "activation_pareto.md").write_text("\n".join(lines) + "\n")
    plot(points)
    print("\n".join(lines))


def plot(points: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [8, 32, 1000]
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
