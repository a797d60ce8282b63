"""Tokens/s of the `verinfer generate` and `verinfer score` commands before (621fd5b) and after the
one-core refactor, in ONE run: each command runs in a fresh process (model loading included) with
PYTHONPATH at one tree's src; old and new alternate, repeat after repeat; medians are reported.

    .venv/bin/python -m benchmarks.command_speed --old-src /path/to/checkout-at-621fd5b/src
        # -> results/command_speed.{json,md}

generate: `verinfer generate honest-bf16-b8 -o c.jsonl --n N --max-tokens 64` (token-by-token decode
          in batches of 8, bf16); tokens/s = output tokens / wall seconds of the process.
score:    `verinfer score c.jsonl -o s.parquet` on the claims the new tree generated (bf16 packed
          replay + Token-DiFR scores + Parquet); tokens/s = scored tokens / wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.markdown import write_markdown
from verinfer.io import atomic_write_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
CLI = "from verinfer.cli import app; app()"


def timed(src: Path, argv: list[str], threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", CLI, *argv], env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-src", type=Path, required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    trees = {"before (621fd5b)": a.old_src.resolve(), "after": (ROOT / "src").resolve()}
    secs: dict[str, dict[str, list[float]]] = {t: {"generate": [], "score": []} for t in trees}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        claims = Path(d) / "claims.jsonl"
        gen = ["generate", "honest-bf16-b8", "--n", str(a.n), "--max-tokens", "64"]
        for r in range(a.repeats):
            for tree, src in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                secs[tree]["generate"].append(timed(src, [*gen, "-o", str(Path(d) / f"g-{r}.jsonl")], a.threads))
                if not claims.exists():
                    timed(trees["after"], [*gen, "-o", str(claims)], a.threads)
                secs[tree]["score"].append(timed(src, ["score", str(claims), "-o", str(Path(d) / f"s-{r}.parquet")],
                                                 a.threads))
        tokens = sum(len(json.loads(line)["output_token_ids"]) for line in claims.read_text().splitlines())
    # the command as run, naming no path of this machine
    args = [("CHECKOUT_AT_621fd5b/src" if prev == "--old-src" else x) for prev, x in zip([""] + sys.argv[1:], sys.argv[1:])]
    res = {"command": "python -m benchmarks.command_speed " + " ".join(args), "tokens": tokens,
           "threads": a.threads, "cpu": platform.processor() or platform.machine(),
           "load_average_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
           "seconds": secs,
           "tokens_per_s": {t: {c: tokens / statistics.median(v) for c, v in cs.items()} for t, cs in secs.items()}}
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT / "command_speed.json", res)
    tp = res["tokens_per_s"]
    rows = [f"| {c} | {tp['before (621fd5b)'][c]:.0f} | {tp['after'][c]:.0f} | "
            f"{tp['after'][c] / tp['before (621fd5b)'][c]:.2f}x |" for c in ("generate", "score")]
    write_markdown(OUT / "command_speed.md", "\n".join([
        "# `verinfer generate` / `verinfer score` tokens/s, before and after the one-core refactor", "",
        f"`{res['command']}`: {tokens} tokens, {a.threads} threads, medians of {a.repeats} interleaved runs per "
        f"tree, each a fresh process (model load included); 1-min load average {res['load_average_start_end']}.", "",
        "| command | before (621fd5b) | after | after / before |", "|---|---:|---:|---:|", *rows, ""]))
    print((OUT / "command_speed.md").read_text())


if __name__ == "__main__":
    main()
