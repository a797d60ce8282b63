"""Tokens/s of the model forward before and after the one-forward refactor (issue 13: "FastLM's
speed is now what `verinfer generate` and `verinfer score` get").

    .venv/bin/python -m benchmarks.forward_speed --old-src /path/to/checkout-at-621fd5b/src
        # -> results/forward_speed.{json,md}

Two source trees are timed in ONE run: a worker process per tree (PYTHONPATH = that tree's src)
builds that tree's forwards on the shipped testbed target (4 layers, d 256, vocab 2048) and times
one job at a time; the parent interleaves every job over every forward of both trees, repeat
after repeat, and reports medians (the machine is shared: interleaving spreads the load over all).
  old tree (621fd5b): LlamaLM, and speculative/fast.py's FastLM (fused paths in fp32 cached decode
                      only; anything else fell back to LlamaLM)
  new tree:           LlamaLM with its default kernels (what every command runs) and with Fused
Jobs, fp32 and bf16:
  decode  greedy decode at batch 1 and 16: prefill a 32-token prompt per row, then 64 steps of
          one token per row; tokens/s = batch * steps / decode seconds
  replay  packed cache-free replay (what `verinfer score` runs per batch): 64 right-padded rows of
          48..127 tokens, logits at every real token, padding skipped (lengths_B);
          tokens/s = real tokens / seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from benchmarks.markdown import write_markdown

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
PROMPT_T, DECODE_STEPS = 32, 64
REPLAY_ROWS, REPLAY_LENGTHS = 64, (48, 128)


def tree_models(dtype: torch.dtype) -> dict:
    """name -> model to time, from the verinfer this process imports: before the refactor LlamaLM
    and FastLM; after it LlamaLM with its default kernels and with Fused."""
    from verinfer.models.llama import LlamaLM
    from verinfer.models.testbed import TARGET_DIR

    lm = LlamaLM.from_pretrained(TARGET_DIR, dtype=dtype)
    try:
        from verinfer.speculative.fast import FastLM
    except ImportError:
        from verinfer.numerics.kernels import Fused

        return {"new LlamaLM default": lm, "new LlamaLM fused": lm.with_kernels(Fused())}
    return {"old LlamaLM": lm, "old FastLM": FastLM(lm)}


@torch.no_grad()
def decode_seconds(model, batch: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds): a PROMPT_T-token prompt per row, then DECODE_STEPS greedy
    steps of one token per row through a KV cache."""
    g = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(3, model.config.vocab_size, (batch, PROMPT_T), generator=g)
    cache = model.new_cache(batch, PROMPT_T + DECODE_STEPS + 1)
    t0 = time.perf_counter()
    logits_BTV, _ = model(tokens_BT, torch.arange(PROMPT_T).expand(batch, -1), cache)
    t1 = time.perf_counter()
    next_B = logits_BTV[:, -1].argmax(-1)
    for s in range(DECODE_STEPS):
        logits_BTV, _ = model(next_B[:, None], torch.full((batch, 1), PROMPT_T + s), cache)
        next_B = logits_BTV[:, -1].argmax(-1)
    return t1 - t0, time.perf_counter() - t1


@torch.no_grad()
def replay_seconds(model) -> tuple[float, int]:
    """(seconds, real tokens) of one packed cache-free replay of REPLAY_ROWS rows."""
    g = torch.Generator().manual_seed(1)
    lengths_B = torch.randint(*REPLAY_LENGTHS, (REPLAY_ROWS,), generator=g).sort(descending=True).values
    T = int(lengths_B[0])
    tokens_BT = torch.randint(3, model.config.vocab_size, (REPLAY_ROWS, T), generator=g)
    b_N = torch.cat([torch.full((int(n),), b) for b, n in enumerate(lengths_B)])
    t_N = torch.cat([torch.arange(int(n)) for n in lengths_B])
    t0 = time.perf_counter()
    model(tokens_BT, torch.arange(T).expand(REPLAY_ROWS, -1), select=(b_N, t_N), lengths_B=lengths_B)
    return time.perf_counter() - t0, int(lengths_B.sum())


def worker(threads: int) -> None:
    """Answer timing jobs from stdin (one JSON object a line) with the verinfer on PYTHONPATH."""
    torch.set_num_threads(threads)
    models = {d: tree_models(dt) for d, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    print(json.dumps(sorted(models["fp32"])), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        m = models[job["dtype"]][job["model"]]
        if job["what"] == "decode":
            pre, dec = decode_seconds(m, job["batch"])
            out = dict(seconds=dec, prefill_s=pre, tokens=job["batch"] * DECODE_STEPS)
        else:
            s, n = replay_seconds(m)
            out = dict(seconds=s, tokens=n)
        print(json.dumps(out), flush=True)


def compare(trees: dict[str, str], repeats: int, threads: int, log=print) -> list[dict]:
    """Every job on every forward of every tree, interleaved within each repeat; medians."""
    procs, names = {}, {}
    for tree, src in trees.items():
        procs[tree] = subprocess.Popen([sys.executable, __file__, "--worker", "--threads", str(threads)],
                                       env=dict(os.environ, PYTHONPATH=src), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        names[tree] = json.loads(procs[tree].stdout.readline())

    def ask(tree: str, job: dict) -> dict:
        procs[tree].stdin.write(json.dumps(job) + "\n")
        procs[tree].stdin.flush()
        return json.loads(procs[tree].stdout.readline())

    jobs = [dict(what="decode", dtype=d, batch=b) for d in ("fp32", "bf16") for b in (1, 16)]
    jobs += [dict(what="replay", dtype=d, batch=REPLAY_ROWS) for d in ("fp32", "bf16")]
    rows = []
    for job in jobs:
        runs = {(t, n): [] for t in trees for n in names[t]}
        for t, n in runs:  # warm-up
            ask(t, dict(job, model=n))
        for _ in range(repeats):
            for (t, n), rs in runs.items():
                rs.append(ask(t, dict(job, model=n)))
        for (t, n), rs in runs.items():
            med = statistics.median(r["seconds"] for r in rs)
            row = dict(model=n, src=t, **job, tokens=rs[0]["tokens"], tokens_per_s=rs[0]["tokens"] / med,
                       seconds_repeats=[round(r["seconds"], 5) for r in rs])
            if job["what"] == "decode":
                row["prefill_ms"] = 1e3 * statistics.median(r["prefill_s"] for r in rs)
            rows.append(row)
            log(f"  {job['what']:6s} {job['dtype']} batch {job['batch']:2d}  {n:20s} {row['tokens_per_s']:8.0f} tok/s")
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return rows


def write(res: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "forward_speed.json").write_text(json.dumps(res, indent=1))
    m = res["meta"]
    md = ["# Forward speed: before (621fd5b) and after the one-forward refactor", "",
          f"`{m['command']}`; torch {m['torch']}, {m['threads']} threads, {m['cpu_model']} ({os.cpu_count()} cores, "
          f"shared; 1-min load average at start / end {m['load_average_1min_start_end']}). One run, the forwards' "
          f"repeats interleaved, medians of {m['repeats']}.", "",
          f"decode: {PROMPT_T}-token prompt then {DECODE_STEPS} greedy steps, decode tokens/s. replay: packed "
          f"cache-free replay of {REPLAY_ROWS} rows of {REPLAY_LENGTHS[0]}..{REPLAY_LENGTHS[1] - 1} tokens "
          "(what `verinfer score` runs), real tokens/s.", ""]
    keys = sorted({(r["what"], r["dtype"], r["batch"]) for r in res["rows"]}, key=lambda k: (k[0], k[1] != "fp32", k[2]))
    models = list(dict.fromkeys(r["model"] for r in res["rows"]))
    md += ["| job | dtype | batch | " + " | ".join(models) + " |", "|---|---|---:|" + "---:|" * len(models)]
    for k in keys:
        cells = {r["model"]: r["tokens_per_s"] for r in res["rows"] if (r["what"], r["dtype"], r["batch"]) == k}
        md.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(f"{cells[n]:.0f}" for n in models) + " |")
    md += [""] + [f"- {n}" for n in res.get("notes", [])]
    write_markdown(OUT / "forward_speed.md", "\n".join(md) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-src", help="src/ of a checkout at the commit before the refactor (621fd5b)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats per job (medians)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.threads)
    if not a.old_src:
        ap.error("--old-src is required")
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), platform.machine())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = dict(commit=commit, torch=torch.__version__, threads=a.threads, cpu_model=cpu, repeats=a.repeats,
                command=f"python -m benchmarks.forward_speed --old-src CHECKOUT_AT_621fd5b/src --repeats {a.repeats} --threads {a.threads}")
    load0 = os.getloadavg()[0]
    rows = compare({"old": str(Path(a.old_src).resolve()), "new": str(ROOT / "src")}, a.repeats, a.threads)
    meta["load_average_1min_start_end"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    notes = ["old FastLM's fused path ran only in fp32 cached decode; in bf16 and in replay it fell back to "
             "LlamaLM, so those cells time the old LlamaLM code again: their difference is this run's noise",
             "new LlamaLM default is bitwise equal to old LlamaLM (logits and hidden states, every path); "
             "new LlamaLM fused is bitwise equal to old FastLM on the cached path and within 2e-5 of LlamaLM"]
    write(dict(meta=meta, rows=rows, notes=notes))
    print(f"wrote {OUT / 'forward_speed.json'} and .md")


if __name__ == "__main__":
    main()
