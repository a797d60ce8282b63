"""KL-judge speculative decoding vs vanilla speculative sampling and the judge baselines.

    .venv/bin/python benchmarks/kl_judge.py [--quick] [--device cpu] [--repeats 5]

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

from verinfer.speculative.bench import run  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run (not the committed results)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    res = run(a.out, device=a.device, quick=a.quick, repeats=a.repeats, log=lambda s: print(s, flush=True))
    print(res.get("criteria"))
