"""KL-judge speculative decoding vs vanilla speculative sampling and the judge baselines.

    nice -n 15 .venv/bin/python -m benchmarks.kl_judge --no-timing        # quality: sweeps, selection, test
    flock /tmp/verinfer-timing.lock .venv/bin/python -m benchmarks.kl_judge --timing   # cost model, tokens/s
    .venv/bin/python -m benchmarks.kl_judge [--quick]                      # both in one process

Writes benchmarks/results/kl_judge.{json,md}, kl_judge_frontier.png and the trained AutoJudge
head (kl_judge_autojudge.json). The protocol and the metric definitions are in
benchmarks/kl_judge_bench.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.kl_judge_bench import run, timing_run

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run (not the committed results)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    stage = ap.add_mutually_exclusive_group()
    stage.add_argument("--no-timing", action="store_true", help="quality half only (no wall-clock numbers)")
    stage.add_argument("--timing", action="store_true",
                       help="timing half only: cost model and tokens/s of every method at every gamma in one "
                            "interleaved run; updates the kl_judge.json of a --no-timing run")
    a = ap.parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if a.timing:
        res = timing_run(a.out / "kl_judge.json", device=a.device, repeats=a.repeats, log=log)
    else:
        res = run(a.out, device=a.device, quick=a.quick, repeats=a.repeats, log=log, timing=not a.no_timing)
    print(res.get("criteria"))
