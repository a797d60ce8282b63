"""KL-judge speculative decoding vs vanilla speculative sampling and the judge baselines.

    .venv/bin/python benchmarks/kl_judge.py [--quick] [--device cpu] [--repeats 5]
    .venv/bin/python benchmarks/kl_judge.py --all-gamma-timing   # then: every gamma timed in one run

Writes benchmarks/results/kl_judge.{json,md}, kl_judge_frontier.png and the trained AutoJudge
head (kl_judge_autojudge.json). The protocol and the metric definitions are in
src/verinfer/speculative/bench.py (also `verinfer bench speculative`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from verinfer.speculative.bench import run, timing_all_gammas  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run (not the committed results)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--all-gamma-timing", action="store_true",
                    help="only re-time vanilla and the KL judge at every gamma (one interleaved run) and update "
                         "the existing kl_judge.json/md")
    a = ap.parse_args()
    if a.all_gamma_timing:
        timing_all_gammas(a.out / "kl_judge.json", device=a.device, repeats=a.repeats, log=lambda s: print(s, flush=True))
        sys.exit(0)
    res = run(a.out, device=a.device, quick=a.quick, repeats=a.repeats, log=lambda s: print(s, flush=True))
    print(res.get("criteria"))
