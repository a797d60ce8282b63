"""KL-judge speculative decoding vs vanilla speculative sampling and the judge baselines.

    nice -n 15 .venv/bin/python -m benchmarks.kl_judge --no-timing --out benchmarks/results   # quality: sweeps, selection, test
        (on 2 cores: the same command twice, with --shard 0/2 and --shard 1/2, splits the quality runs)
    flock runs/timing.lock .venv/bin/python -m benchmarks.kl_judge --timing --out benchmarks/results   # cost model, tokens/s
    .venv/bin/python -m benchmarks.kl_judge [--quick]                      # both in one process, into runs/kl_judge

Writes <out>/<stem>.{json,md}, <stem>_frontier.png and the trained AutoJudge head
(<stem>_autojudge.json; not for multiline), stem kl_judge for --task multiline (SmolLM2 with its
feature-level head and its draft, the decode-heavy task; a committed run also regenerates the
README's speculative paragraph), kl_judge_nextline for --task nextline and kl_judge_testbed for
--task arithmetic (the testbed); <out> is runs/kl_judge unless --out says otherwise (the committed
results are benchmarks/results: name it to regenerate them). Ends with issue 7's criteria as a
table. The protocol and the metric definitions are in benchmarks/kl_judge_bench.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.kl_judge_bench import STEM, run, timing_run

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "runs" / "kl_judge"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run (not the committed results)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--task", choices=["multiline", "nextline", "arithmetic"], default="arithmetic",
                    help="multiline: SmolLM2-135M-Instruct with its feature-level draft head, its distilled draft and "
                         "n-gram lookup on 64-token completions of held-out stdlib code (the decode-heavy task; results "
                         "kl_judge.*); nextline: the same models on next-line completion (kl_judge_nextline.*); "
                         "arithmetic: the testbed pair (kl_judge_testbed.*)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--given", type=int, default=None,
                    help="nextline/multiline: tokens of the line given in the prompt (default 4, spec_tasks.NEXTLINE_GIVEN); "
                         "the --timing half reads it from the JSON")
    ap.add_argument("--shard", default="0/1", metavar="I/N",
                    help="split the quality half over N processes started with I = 0..N-1 (they share the run cache "
                         "in benchmarks/.cache/kl_judge; shard 0 waits for the others and writes the results)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="output directory (default runs/kl_judge; benchmarks/results holds the committed results)")
    stage = ap.add_mutually_exclusive_group()
    stage.add_argument("--no-timing", action="store_true", help="quality half only (no wall-clock numbers)")
    stage.add_argument("--timing", action="store_true",
                       help="timing half only: cost model and tokens/s of every method at every gamma in one "
                            "interleaved run; updates the JSON of a --no-timing run")
    return ap


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows = []
    for k, v in d.items():
        rows += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return rows


def _shown(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_shown(x) for x in v) + "]"
    return str(v)


def criteria_table(criteria: dict | None) -> Table:
    """Issue 7's criteria (KL judge vs vanilla, `run`'s result["criteria"]) as a two-column table."""
    t = Table(title="KL judge vs vanilla speculative sampling: issue 7 criteria")
    t.add_column("criterion", no_wrap=True)
    t.add_column("value", justify="right")
    for k, v in _flat(criteria or {}):
        t.add_row(k, _shown(v))
    return t


if __name__ == "__main__":
    a = parser().parse_args()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if a.timing:
        res = timing_run(a.out / f"{STEM[a.task]}.json", device=a.device, repeats=a.repeats, log=log)
    else:
        try:
            shard = tuple(int(x) for x in a.shard.split("/"))
            if len(shard) != 2:
                raise ValueError
        except ValueError:
            raise SystemExit(f"--shard: expected I/N such as 0/2, got {a.shard!r}")
        res = run(a.out, device=a.device, quick=a.quick, repeats=a.repeats, log=log, timing=not a.no_timing,
                  task_name=a.task, shard=shard, given=a.given)
        if res is None:
            raise SystemExit(0)
    Console().print(criteria_table(res.get("criteria")))
    print(f"results -> {a.out}")
