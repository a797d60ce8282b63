"""Verdicts an auditor can trust (issue 15 items 1 and 6) on the detection lab's data.

    .venv/bin/python -m benchmarks.verdicts        # needs the lab cache: benchmarks/detection_lab.py --stage
                                                   # data, features, references (resumable)

1. power: per detector of the lab x misconfiguration, the fraction of N_BATCHES batches of n tokens
   (resampled from the misconfiguration's test half) above the detector's 1%-FPR threshold, at
   n = 1k, 2k, 4k, 8k, 16k. Thresholds: `best` (PerturbationGLRTDetector, = `verinfer calibrate
   --detector glrt`) and glrt_single_replay their own nulls; the per-token score variants (margin
   clipped at 99/99.9/99.99/99.999%, likelihood, exact match, cross-entropy, MC-DiFR, tail,
   lr_combined) the stratified null of ClippedMeanDetector: the worst honest calibration group's
   99% quantile of resampled batch means. Must never decrease in n.
2. sequential: `detect.sequential.SequentialAudit(best, alpha=0.01)`, `best` fitted on every whole claim
   of the honest calibration configurations (claim_id: the e-process bets once per claim on its
   summed, uncapped evidence against the honest claims' log-MGF). Honest audits: N_AUDITS streams
   of up to STREAM_TOKENS tokens from held-out honest configurations (never fitted), whole claims
   drawn with replacement in random order (within-claim dependence kept); the false-positive rate is
   the fraction flagged at any point. Misconfigured audits: N_MISCONF_AUDITS streams per
   misconfiguration, the tokens at which each flags (median; undecided within STREAM_TOKENS count as
   beyond). Beside it the fixed-size test's tokens: the smallest n of FIXED_SIZES at which `best`'s
   power reaches 0.99 (the lab's "tokens to detect" criterion; also 0.5).

Without held-out honest sets in the cache the honest audits stream each calibration configuration
against a detector fitted on the others (leave one configuration out). `--single-replay` (before the
references stage has run): `best` is left out and the sequential audit runs on glrt_single_replay.

Writes benchmarks/results/verdicts.{json,md} and verdicts.png.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import numpy as np

from benchmarks.markdown import write_markdown
from benchmarks import detection_lab as lab

RESULTS = lab.RESULTS
POWER_SIZES = (1000, 2000, 4000, 8000, 16000)
FIXED_SIZES = (100, 200, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 6000, 8000, 12000, 16000)
N_BATCHES = 1000
N_AUDITS = 1000
N_MISCONF_AUDITS = 200
STREAM_TOKENS = 20_000
ALPHA = 0.01
SEQUENTIAL_TARGETS = ("int4", "fp8-kv")


def split(key: str, n: int):
    """The token-level 50/50 split of a configuration (seeded by its name: independent of which
    other sets are cached)."""
    from verinfer.detect.metrics import split_tokens

    return split_tokens(n, np.random.default_rng([0, zlib.crc32(key.encode())]))


def claim_starts(key: str) -> np.ndarray:
    """Row offsets of each claim in the features table of `key` (rows are grouped by claim), plus the end."""
    import pyarrow.parquet as pq

    ids = pq.read_table(lab.features_path(key), columns=["claim_id"])["claim_id"].to_numpy(zero_copy_only=False)
    change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    return np.concatenate([[0], change, [len(ids)]])


def stratified_threshold(groups: list[np.ndarray], n: int, fpr: float, rng) -> float:
    """The worst group's (1 - fpr)-quantile of N_BATCHES resampled batch means of n tokens."""

    return max(float(np.quantile(bootstrap_means(g, n, rng), 1.0 - fpr)) for g in groups)


def bootstrap_means(values: np.ndarray, n: int, rng) -> np.ndarray:
    """N_BATCHES batch means of n values: `metrics.batch_means`, or, for a batch larger than the
    values (16k tokens from a group's 10k train tokens), drawn with replacement."""
    from verinfer.detect.metrics import batch_means

    v = np.asarray(values, dtype=np.float64)
    if n <= v.size:
        return batch_means(v, n, N_BATCHES, rng)
    return np.array([v[rng.integers(0, v.size, n)].mean() for _ in range(N_BATCHES)])


def power_table(det_values: dict, misconf: list, sizes=POWER_SIZES, fpr: float = 0.01, seed: int = 0) -> dict:
    """{detector: {misconf: {n: power}}}. det_values[name] = (honest train groups or a fitted
    ColumnStatistics detector, {misconf: per-token values / evidence of its test half})."""
    from verinfer.detect.base import ColumnStatistics

    out = {}
    for name, (null, vals) in det_values.items():
        rng = np.random.default_rng(seed)
        out[name] = {m: {} for m in misconf if m in vals}
        for n in sizes:
            if isinstance(null, ColumnStatistics):
                thr = null.threshold(n)
                for m in out[name]:
                    out[name][m][n] = float(np.mean(null.batch_statistics(vals[m], n, N_BATCHES, rng) > thr))
            else:
                thr = stratified_threshold(null, n, fpr, rng)
                for m in out[name]:
                    out[name][m][n] = float(np.mean(bootstrap_means(vals[m], n, rng) > thr))
    return out


def monotone_violations(table: dict, slack: float = 0.0) -> list[str]:
    """Cells where power at a larger n is below power at the previous n by more than `slack`."""
    bad = []
    for name, by in table.items():
        for m, curve in by.items():
            ns = sorted(curve)
            for a, b in zip(ns, ns[1:]):
                if curve[b] < curve[a] - slack:
                    bad.append(f"{name}/{m}: {curve[a]:.3f} at {a} -> {curve[b]:.3f} at {b}")
    return bad


def stream(evidence: np.ndarray, starts: np.ndarray, rng, tokens: int = STREAM_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """Evidence rows of whole claims drawn with replacement until `tokens` tokens, and each row's
    position in the stream's claim order (its claim label for the e-process's blocks)."""
    n_claims = len(starts) - 1
    lens = np.diff(starts)
    picks = rng.integers(0, n_claims, 4 * tokens // max(1, int(lens.mean())) + 8)
    keep = picks[: int(np.searchsorted(np.cumsum(lens[picks]), tokens)) + 1]
    idx = np.concatenate([np.arange(starts[c], starts[c + 1]) for c in keep])[:tokens]
    return evidence[idx], np.repeat(np.arange(keep.size), lens[keep])[:tokens]


def stopping_times(seq, evidence: np.ndarray, starts: np.ndarray, n_audits: int, rng) -> list:
    return [seq.stopping_time(*stream(evidence, starts, rng)) for _ in range(n_audits)]


def run(log=print, single_replay: bool = False) -> dict:
    from verinfer.detect.glrt import PerturbationGLRTDetector
    from verinfer.detect.likelihood_ratio import LikelihoodRatioDetector
    from verinfer.detect.sequential import SequentialAudit

    t0 = time.perf_counter()
    configs = {c["key"]: c for c in lab.lab_configs()}
    refs = [] if single_replay else _extra_references()
    have = lambda k: lab.features_path(k).is_file() and all(  # noqa: E731
        lab.reference_features_path(r, k).is_file() for r in refs)
    honest = [k for k, c in configs.items() if c["role"] == "honest" and have(k)]
    misconf = [k for k, c in configs.items() if c["role"] == "misconf" and have(k)]
    heldout = [k for k, c in configs.items() if c["role"] == "heldout" and have(k)]
    if len(honest) < 3 or not misconf:
        raise SystemExit(f"the lab cache has {len(honest)} honest and {len(misconf)} misconfigured sets with "
                         f"features and references: run python -m benchmarks.detection_lab --stage data/features/references")
    data = {k: lab.load_features(k) for k in [*honest, *misconf, *heldout]}
    halves = {k: split(k, len(d["margin"])) for k, d in data.items()}
    tr = {k: lab.take(d, halves[k][0]) for k, d in data.items()}
    te = {k: lab.take(d, halves[k][1]) for k, d in data.items()}
    h_tr = lab.cat([tr[k] for k in honest])
    groups = np.concatenate([np.full(len(tr[k]["margin"]), k) for k in honest])
    log(f"honest {honest}, misconfigured {misconf}, held out {heldout}")

    view = (lambda d: d) if single_replay else lab.env_view  # noqa: E731
    config = lab.SINGLE_CONFIG if single_replay else lab.BEST_CONFIG
    seq_name = "glrt_single_replay" if single_replay else "best"
    single = PerturbationGLRTDetector(**lab.SINGLE_CONFIG).fit(h_tr, groups=groups)
    best = single if single_replay else PerturbationGLRTDetector(**config).fit(view(h_tr), groups=groups)
    sc = lab.Scorer(h_tr)
    det_values = {"glrt_single_replay": (single, {m: single.token_scores(te[m]) for m in misconf})}
    if not single_replay:
        det_values["best"] = (best, {m: best.token_scores(view(te[m])) for m in misconf})
    for n in sc.names:
        det_values[n] = ([sc.values(n, tr[k]) for k in honest], {m: sc.values(n, te[m]) for m in misconf})
    lr = {}
    for m in misconf:  # leave-one-misconfiguration-out, as in the lab
        d = LikelihoodRatioDetector().fit(h_tr, alternatives=[tr[o] for o in misconf if o != m])
        lr[m] = ([d.token_scores(tr[k]) for k in honest], d.token_scores(te[m]))
    power = power_table(det_values, misconf)
    for m in misconf:
        power.setdefault("lr_combined", {}).update(power_table({"lr": (lr[m][0], {m: lr[m][1]})}, [m])["lr"])
    log("power: " + json.dumps({k: {m: list(c.values()) for m, c in v.items()} for k, v in power.items()}))

    # fixed-size test of the sequential audit's detector on a finer grid, then the sequential audit
    fixed = power_table({seq_name: det_values[seq_name]}, misconf, sizes=FIXED_SIZES, seed=1)[seq_name]
    fixed_tokens = {m: {str(q): next((n for n in FIXED_SIZES if fixed[m][n] >= q), None) for q in (0.99, 0.5)}
                    for m in misconf}
    # the e-process's allowance is the honest claims' log-MGF (`detect.sequential`): it is fitted on
    # whole claims (claim_id), every claim of the honest calibration configurations (the honest
    # audits stream held-out configurations, never fitted)
    def with_claims(keys: list) -> tuple[dict, np.ndarray]:
        lengths = {k: np.diff(claim_starts(k)) for k in keys}
        d = {**view(lab.cat([data[k] for k in keys])),
             "claim_id": np.concatenate([np.repeat([f"{k}/{i}" for i in range(len(lengths[k]))], lengths[k])
                                         for k in keys])}
        return d, np.concatenate([np.full(len(data[k]["margin"]), k) for k in keys])

    seq_best = PerturbationGLRTDetector(**config).fit(*with_claims(honest))
    seq = SequentialAudit(seq_best, alpha=ALPHA)
    rng = np.random.default_rng(7)
    honest_streams = heldout or honest
    source = ("held-out honest configurations" if heldout else
              "each calibration configuration against a detector fitted on the other ones (no held-out set cached)")
    ev = {k: seq_best.sequential_evidence(view(data[k]))[0] for k in [*heldout, *misconf]}  # uncapped
    starts = {k: claim_starts(k) for k in [*honest_streams, *misconf]}
    flags_by = {}
    per = -(-N_AUDITS // len(honest_streams))
    for k in honest_streams:
        seq_k = seq
        if not heldout:  # leave configuration k out of the fit
            others = [o for o in honest if o != k]
            det_k = PerturbationGLRTDetector(**config).fit(*with_claims(others))
            seq_k, ev[k] = SequentialAudit(det_k, alpha=ALPHA), det_k.sequential_evidence(view(data[k]))[0]
        ts = stopping_times(seq_k, ev[k], starts[k], per, rng)
        flags_by[k] = {"audits": per, "flagged": int(sum(t is not None for t in ts)),
                       "flag_tokens": sorted(t for t in ts if t is not None)}
        log(f"sequential honest {k}: {flags_by[k]['flagged']}/{per} flagged")
    n_audits = sum(v["audits"] for v in flags_by.values())
    fpr = sum(v["flagged"] for v in flags_by.values()) / n_audits
    seq_misconf = {}
    for m in misconf:
        ts = stopping_times(seq, ev[m], starts[m], N_MISCONF_AUDITS, rng)
        decided = np.array([t for t in ts if t is not None])
        med = float(np.median([t if t is not None else np.inf for t in ts]))
        f99 = fixed_tokens[m]["0.99"]
        seq_misconf[m] = {"audits": N_MISCONF_AUDITS, "decided": int(decided.size),
                          "median_tokens": None if not np.isfinite(med) else med,
                          "p10_p90_tokens": [float(np.quantile(decided, 0.1)), float(np.quantile(decided, 0.9))]
                          if decided.size else None,
                          "fixed_tokens_power_0.99": f99, "fixed_tokens_power_0.5": fixed_tokens[m]["0.5"],
                          "ratio_to_fixed_0.99": (med / f99) if f99 and np.isfinite(med) else None,
                          "stopping_tokens": sorted(int(t) for t in decided)}
        log(f"sequential {m}: {seq_misconf[m]}")
    result = {
        "power": {k: {m: {str(n): p for n, p in c.items()} for m, c in v.items()} for k, v in power.items()},
        "power_monotone_violations": monotone_violations(power),
        "fixed_best_power_fine": {m: {str(n): p for n, p in c.items()} for m, c in fixed.items()},
        "sequential": {"alpha": ALPHA, "stream_tokens": STREAM_TOKENS, "honest_source": source,
                       "honest_audits": n_audits, "honest_fpr": fpr, "honest_by_config": flags_by,
                       "misconfigured": seq_misconf, "lambdas": list(seq.lambdas), "detector": seq_name,
                       "targets": {m: seq_misconf[m]["ratio_to_fixed_0.99"] for m in SEQUENTIAL_TARGETS
                                   if m in seq_misconf}},
        "setup": {"honest": honest, "misconfigured": misconf, "heldout": heldout, "batches": N_BATCHES,
                  "single_replay_only": single_replay,
                  "best": lab.BEST_DESCRIPTION, "best_allowance_per_token": best.allowance_.tolist(),
                  "best_alternatives": [best.describe(g) for g in range(len(best.grid_))],
                  "split": "token-level 50/50 per configuration, seeded by its name",
                  "command": "python -m benchmarks.verdicts", "seconds": time.perf_counter() - t0},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    from verinfer.io import atomic_write_text

    atomic_write_text(RESULTS / "verdicts.json", json.dumps(result, indent=1, default=float))
    write_markdown(RESULTS / "verdicts.md", markdown(result))
    plot(result, RESULTS / "verdicts.png")
    log(markdown(result))
    return result


def _extra_references() -> list[str]:
    from verinfer.audit.references import REFERENCES

    return [r for r in REFERENCES if r != lab.PRIMARY_REFERENCE]


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def markdown(r: dict) -> str:
    s = r["sequential"]
    L = ["# Verdicts: power that grows with tokens, and sequential anytime-valid audits", "",
         f"Command: `{r['setup']['command']}` (on the detection lab's cache). Honest calibration: "
         f"{', '.join(r['setup']['honest'])} (train halves); misconfigurations' test halves.", "",
         "## Power at a 1% FPR threshold (fraction of 1,000 resampled batches flagged)", "",
         f"Never decreasing in tokens: {'yes' if not r['power_monotone_violations'] else 'NO: ' + '; '.join(r['power_monotone_violations'])}", ""]
    ms = list(next(iter(r["power"].values())))
    L += ["| detector | " + " | ".join(f"{m} {n // 1000}k" for m in ms for n in POWER_SIZES) + " |",
          "|---|" + "---|" * (len(ms) * len(POWER_SIZES))]
    for name, by in r["power"].items():
        L.append(f"| {name} | " + " | ".join(f"{by[m][str(n)]:.3f}" if m in by else "-" for m in ms for n in POWER_SIZES) + " |")
    L += ["", f"## Sequential audit (alpha {s['alpha']}, streams of up to {s['stream_tokens']:,} tokens)", "",
          f"False-positive rate over {s['honest_audits']} audits of {s['honest_source']}: **{s['honest_fpr']:.4f}** "
          f"(flagged at any point; " + ", ".join(f"{k} {v['flagged']}/{v['audits']}" for k, v in s["honest_by_config"].items()) + ").", "",
          "| misconfiguration | sequential median tokens | 10-90% | decided | fixed test, power 0.99 | fixed, power 0.5 | ratio (<= 0.6) |",
          "|---|---|---|---|---|---|---|"]
    for m, c in s["misconfigured"].items():
        pr = c["p10_p90_tokens"]
        L.append(f"| {m} | {_fmt(c['median_tokens'])} | {'-' if pr is None else f'{pr[0]:.0f}-{pr[1]:.0f}'} | "
                 f"{c['decided']}/{c['audits']} | {_fmt(c['fixed_tokens_power_0.99'])} | {_fmt(c['fixed_tokens_power_0.5'])} | "
                 f"{_fmt(c['ratio_to_fixed_0.99'])} |")
    L += ["", f"Fixed test: `{s['detector']}` at its 1%-FPR threshold, the smallest n of " + str(FIXED_SIZES) + " with that power "
          "(batches resampled from the test half). Sequential: whole claims drawn with replacement; undecided "
          "audits count as beyond the stream in the median.", "", "![verdicts](verdicts.png)", ""]
    return "\n".join(L) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = list(next(iter(r["power"].values())))
    fig, axes = plt.subplots(1, len(ms) + 1, figsize=(3.6 * (len(ms) + 1), 3.4))
    for ax, m in zip(axes, ms):
        for name, by in r["power"].items():
            if m in by:
                style = dict(color="black", lw=2.2) if name == r["sequential"]["detector"] else dict(lw=0.9)
                ax.plot(POWER_SIZES, [by[m][str(n)] for n in POWER_SIZES], marker="o", ms=3, label=name, **style)
        ax.set_xscale("log")
        ax.set_title(m)
        ax.set_xlabel("tokens per batch")
        ax.set_ylim(-0.02, 1.02)
    axes[0].set_ylabel("power at 1% FPR")
    axes[len(ms) - 1].legend(fontsize=5, loc="lower right")
    ax = axes[-1]
    for m, c in r["sequential"]["misconfigured"].items():
        t = np.array(c["stopping_tokens"], dtype=float)
        if t.size:
            line, = ax.step(t, np.arange(1, t.size + 1) / c["audits"], where="post", lw=1.2, label=m)
            if c["fixed_tokens_power_0.99"]:
                ax.axvline(c["fixed_tokens_power_0.99"], color=line.get_color(), lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlim(10, STREAM_TOKENS)
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("fraction of audits flagged")
    ax.legend(fontsize=6, loc="upper left")
    ax.set_title("sequential (dashed: fixed test, power 0.99)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=None, help="the detection lab's cache directory")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--single-replay", action="store_true", help="without the reference replays: no `best`, the "
                    "sequential audit on glrt_single_replay (a partial run)")
    a = ap.parse_args(argv)
    global RESULTS
    if a.cache:
        lab.CACHE = a.cache
    RESULTS = a.out or RESULTS
    run(lambda s: print(s, flush=True), single_replay=a.single_replay)


if __name__ == "__main__":
    main()
