"""Token-DiFR audit of the shipped testbed: honest exact match, tokens to detect each
misconfiguration (margin score, clipped at the 99.9th honest-train percentile, AUC@1%FPR >= 0.99),
and the replay speedup over generation.

    .venv/bin/python -m benchmarks.audit_testbed [--n 160] [--max-tokens 64]
    .venv/bin/python -m benchmarks.audit_testbed --speed-only   # re-measure the speedup alone (quiet machine)

Writes benchmarks/results/audit_testbed.{json,md} and audit_testbed_auc.png. Claims and scores are
cached under benchmarks/.cache/audit_testbed/ so an interrupted run resumes; the speedup is always
measured fresh, generation and replay of the same claims in one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from benchmarks.markdown import write_markdown
from verinfer.io import atomic_write_text
from verinfer.numerics.machine import machine_fingerprint
from verinfer.scores import load_score_tables
from verinfer.apps.pipeline import (DEFAULT_SPEC, generate, prompts_for, score,
                                     verifier_engine)
from verinfer.providers.simulated import HONEST, MISCONFIGURED, PROVIDERS, run_provider
from verinfer.audit.replay import scores_table
from verinfer.report.html import compute_auc_curves
from verinfer.detect.metrics import tokens_to_detect
from verinfer.models.testbed import TARGET_DIR
from verinfer.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parent
BATCH_SIZES = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)


def measure_speedup(n: int, max_tokens: int, seed: int, repeats: int = 3) -> dict:
    """Generate n claims as the honest bf16 batch-8 provider, then replay the same claims with the
    verifier (forward + every per-token score); both timed in this process with models loaded
    beforehand, each the median of `repeats` runs."""
    cfg = HONEST["honest-bf16-b8"]
    prompts = prompts_for(TARGET_DIR, n, seed + 1000)
    advertised = SamplingParams(seed=0, max_tokens=max_tokens, **DEFAULT_SPEC)
    engine = verifier_engine(TARGET_DIR)
    run_provider(cfg, TARGET_DIR, prompts[:2], advertised, base_seed=seed)  # warm-up
    t_gen, t_score = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        claims = run_provider(cfg, TARGET_DIR, prompts, advertised, base_seed=seed)
        t_gen.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        replays = engine.replay([(c.prompt_token_ids, c.output_token_ids) for c in claims])
        scores_table(claims, replays)
        t_score.append(time.perf_counter() - t0)
    tokens = sum(len(c.output_token_ids) for c in claims)
    tg, ts = float(np.median(t_gen)), float(np.median(t_score))
    return {"tokens": tokens, "repeats": repeats, "generate_seconds": tg, "score_seconds": ts,
            "generate_seconds_all": t_gen, "score_seconds_all": t_score,
            "generate_tokens_per_s": tokens / tg, "score_tokens_per_s": tokens / ts, "speedup": tg / ts}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=160, help="requests per provider")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speed-n", type=int, default=128)
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "audit_testbed")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--speed-only", action="store_true",
                    help="re-measure only the replay speedup and update it in the existing audit_testbed.json/md")
    a = ap.parse_args(argv)
    command = "python -m benchmarks.audit_testbed " + " ".join(argv or sys.argv[1:])
    fp = machine_fingerprint()
    machine = f"{fp['cpu_model']} ({platform.machine()}), {fp['threads']} threads, torch {fp['torch']}"
    if a.speed_only:
        result = json.loads((a.out / "audit_testbed.json").read_text())
        speed = measure_speedup(a.speed_n, result["setup"]["max_tokens"], result["setup"]["seed"])
        result.update(replay_speedup_vs_generate=speed["speedup"], speed=dict(speed, command=command, machine=machine))
        atomic_write_text(a.out / "audit_testbed.json", json.dumps(result, indent=1, default=float))
        write_markdown(a.out / "audit_testbed.md", markdown(result))
        print(markdown(result))
        return result

    engine = verifier_engine(TARGET_DIR)
    paths = []
    for name in PROVIDERS:
        cp = a.cache / f"n{a.n}-t{a.max_tokens}-s{a.seed}" / f"{name}.jsonl"
        sp = cp.with_suffix(".parquet")
        if not cp.is_file():
            generate(name, TARGET_DIR, cp, n=a.n, max_tokens=a.max_tokens, seed=a.seed)
        if not sp.is_file():
            score(cp, TARGET_DIR, sp, engine=engine)
        paths.append(sp)
    table = load_score_tables(paths)
    honest = list(HONEST)
    is_honest = pc.is_in(table["provider"], value_set=__import__("pyarrow").array(honest))
    honest_em = float(np.mean(table.filter(is_honest)["exact_match"].to_numpy(zero_copy_only=False)))
    per_provider_em = {p: float(np.mean(table.filter(pc.equal(table["provider"], p))["exact_match"]
                                        .to_numpy(zero_copy_only=False))) for p in PROVIDERS}
    curves = compute_auc_curves(table, honest, batch_sizes=BATCH_SIZES, seed=a.seed)
    ttd = {m: tokens_to_detect(curves[m]["margin"]) for m in MISCONFIGURED}
    ttd_all = {m: {s: tokens_to_detect(c) for s, c in curves[m].items()} for m in MISCONFIGURED}
    speed = dict(measure_speedup(a.speed_n, a.max_tokens, a.seed), command=command, machine=machine)

    result = {
        "honest_exact_match": honest_em,
        "tokens_to_detect": ttd,
        "replay_speedup_vs_generate": speed["speedup"],
        "exact_match_by_provider": per_provider_em,
        "tokens_to_detect_by_score": ttd_all,
        "auc_at_1pct_fpr": curves,
        "speed": speed,
        "setup": {"requests_per_provider": a.n, "max_tokens": a.max_tokens, "seed": a.seed,
                  "tokens_by_provider": {p: int(pc.sum(pc.equal(table["provider"], p)).as_py()) for p in PROVIDERS},
                  "spec": DEFAULT_SPEC, "verifier": "bf16 sdpa, one prefill per claim",
                  "score_for_tokens_to_detect": "margin clipped at the 99.9th percentile of honest train tokens",
                  "machine": machine, "command": command},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out / "audit_testbed.json", json.dumps(result, indent=1, default=float))
    write_markdown(a.out / "audit_testbed.md", markdown(result))
    plot(curves, a.out / "audit_testbed_auc.png")
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    lines = ["# Token-DiFR audit on the shipped testbed", "",
             f"Command: `{r['setup']['command']}`  ", f"Machine: {r['setup']['machine']}", "",
             "| metric | value |", "|---|---|",
             f"| honest exact match | {r['honest_exact_match']:.4f} |",
             f"| replay speedup vs generate | {r['replay_speedup_vs_generate']:.1f}x "
             f"({r['speed']['score_tokens_per_s']:.0f} vs {r['speed']['generate_tokens_per_s']:.0f} tokens/s) |", "",
             f"Speedup: generation and replay of the same {r['speed']['tokens']} tokens in one process, median of "
             f"{r['speed']['repeats']}; `{r['speed'].get('command', r['setup']['command'])}` on "
             f"{r['speed'].get('machine', r['setup']['machine'])}.", "",
             "Tokens to detect (smallest batch reaching AUC@1%FPR >= 0.99; '-' = not within the tokens available):", "",
             "| misconfiguration | " + " | ".join(next(iter(r["tokens_to_detect_by_score"].values())).keys()) + " |",
             "|---|" + "---|" * len(next(iter(r["tokens_to_detect_by_score"].values())))]
    for m, by in r["tokens_to_detect_by_score"].items():
        lines.append(f"| {m} | " + " | ".join("-" if v is None else str(v) for v in by.values()) + " |")
    lines += ["", "Exact match by provider:", "", "| provider | exact match | tokens |", "|---|---|---|"]
    for p, v in r["exact_match_by_provider"].items():
        lines.append(f"| {p} | {v:.4f} | {r['setup']['tokens_by_provider'][p]} |")
    return "\n".join(lines) + "\n"


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.4), sharey=True)
    for ax, (m, by_score) in zip(np.atleast_1d(axes), curves.items()):
        for s, c in by_score.items():
            xs = [b for b, v in c.items() if v is not None]
            ax.plot(xs, [c[b] for b in xs], marker="o", ms=3, label=s)
        ax.set_xscale("log")
        ax.axhline(0.99, color="grey", lw=0.8, ls="--")
        ax.set_title(m)
        ax.set_xlabel("tokens per batch")
    np.atleast_1d(axes)[0].set_ylabel("AUC @ 1% FPR")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
