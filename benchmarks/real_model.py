"""Replay speed on a real pretrained model (issue 14, first part): `replay_vs_forward`.

    .venv/bin/verinfer models get smollm2-135m-instruct
    .venv/bin/verinfer generate honest-bf16-b8 --model smollm2-135m-instruct -o runs/smol-honest.jsonl --n 32
    .venv/bin/python benchmarks/real_model.py speed runs/smol-honest.jsonl

For the same claims, same device and threads, interleaved rounds (medians):
  score     `audit.replay.score_claims`: replay + every Token-DiFR score + Parquet (what `verinfer
            score` runs after reading the file)
  forward   the same model's plain teacher-forced forward over the same claims, no scoring: one
            LlamaLM forward per batch of `Engine.replay_batches` (logits of the claimed positions)
  hf        transformers' LlamaForCausalLM forward over the same padded batches (logits of every
            position, as a plain `model(input_ids)` call computes them), same dtype
replay_vs_forward = score tokens/s / forward tokens/s (>= 0.7 is the issue's target on CPU).

    .venv/bin/python benchmarks/real_model.py memory runs/smol-honest.jsonl --sizes 5000 12500 50000

Bounded memory: a file of N claims (the real claims cycled under new ids, each output cut to
--tokens-per-claim tokens) is scored by `verinfer score` in a fresh process; peak RSS (the child's
ru_maxrss) and wall time per N, and time per token (linear in N if it stays flat).
Writes benchmarks/results/real_model.{json,md} (its section; other sections are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from verinfer.apps.pipeline import VERIFIER_NUMERICS, verifier_engine
from verinfer.audit.replay import replay_batch_size, score_claims
from verinfer.claims import read_claims
from verinfer.io import atomic_write_text, sha256_files, update_json_section
from verinfer.models.catalog import resolve_model
from verinfer.models.load import model_info
from verinfer.numerics.machine import machine_fingerprint

RESULTS = Path(__file__).resolve().parent / "results"


def _forward_only(engine, pairs, batch_tokens: int, logits_budget: int) -> None:
    max_rows = max(1, logits_budget // engine.model.config.vocab_size)
    for _ in engine.replay_batches(pairs, batch_tokens, max_rows=max_rows):
        pass


def _hf_forward(hf, pairs, batch_tokens: int, device: str) -> None:
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    group: list[list[int]] = []

    def run():
        T = max(len(s) for s in group)
        ids = torch.zeros(len(group), T, dtype=torch.long)
        mask = torch.zeros(len(group), T, dtype=torch.long)
        for b, s in enumerate(group):
            ids[b, : len(s)], mask[b, : len(s)] = torch.tensor(s), 1
        with torch.inference_mode():
            hf(input_ids=ids.to(device), attention_mask=mask.to(device))
        group.clear()

    for i in order:
        s = pairs[i][0] + pairs[i][1][:-1]
        if group and max(len(s), *(len(g) for g in group)) * (len(group) + 1) > batch_tokens:
            run()
        group.append(s)
    if group:
        run()


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: str) -> str:
    fp = machine_fingerprint(device=device)
    return fp["device_name"] or f"{fp['cpu_model']} ({fp['machine']})"


def speed(claims_path: Path, model: str, rounds: int, threads: int, out: Path, device: str = "cpu",
          batch_tokens: list[int] | None = None) -> dict:
    """score, forward and hf at each batch size (interleaved rounds, medians). The headline
    replay_vs_forward is at the device's default batch size (`replay_batch_size`), and also
    against the fastest forward over every batch size tried (`replay_vs_best_forward`)."""
    from transformers import LlamaForCausalLM

    model_dir = resolve_model(model)
    torch.set_num_threads(threads)
    claims = read_claims(claims_path)
    pairs = [(c.prompt_token_ids, c.output_token_ids) for c in claims]
    tokens = sum(len(o) for _, o in pairs)
    numerics = VERIFIER_NUMERICS.with_(threads=threads)
    engine = verifier_engine(model_dir, numerics, device=device)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=numerics.torch_dtype).to(device).eval()
    info = model_info(model_dir)
    chunk, default_bt, budget = replay_batch_size(device)
    sizes = sorted(set(batch_tokens or []) | {default_bt})
    times: dict[str, list[float]] = {}
    jobs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for bt in sizes:
            def run_score(bt=bt):
                p = Path(tmp) / "s.parquet"
                p.unlink(missing_ok=True)
                score_claims(claims, engine, p, model_sha=info.weights_sha256, batch_tokens=bt)

            jobs[f"score@{bt}"] = run_score
            jobs[f"forward@{bt}"] = lambda bt=bt: _forward_only(engine, pairs, bt, budget)
            jobs[f"hf@{bt}"] = lambda bt=bt: _hf_forward(hf, pairs, bt, device)
        for fn in jobs.values():  # warm-up
            fn()
            _sync(device)
        for r in range(rounds):
            for name, fn in jobs.items():
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times.setdefault(name, []).append(time.perf_counter() - t0)
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    best_forward = max(v for k, v in tps.items() if k.startswith("forward@"))
    res = {
        "model": info.name, "claims_file": str(claims_path), "claims_sha256": sha256_files([claims_path]),
        "claims": len(claims), "tokens": tokens, "device": torch.device(device).type, "device_name": _device_name(device),
        "threads": threads, "rounds": rounds, "numerics": numerics.to_dict(), "cpu": machine_fingerprint()["cpu_model"],
        "torch": torch.__version__, "batch_tokens": default_bt, "logits_budget": budget, "chunk_claims": chunk,
        "batch_tokens_tried": sizes, "seconds": times, "tokens_per_s": tps,
        "replay_vs_forward": tps[f"score@{default_bt}"] / tps[f"forward@{default_bt}"],
        "replay_vs_best_forward": tps[f"score@{default_bt}"] / best_forward,
        "replay_vs_hf_forward": tps[f"score@{default_bt}"] / tps[f"hf@{default_bt}"],
    }
    section = "speed" if res["device"] == "cpu" else f"speed_{res['device']}"
    return _save(out, section, res)


def _save(out: Path, section: str, res: dict) -> dict:
    atomic_write_text(out / "real_model.md", render(update_json_section(out / "real_model.json", section, res)))
    return res


def memory(claims_path: Path, model: str, sizes: list[int], tokens_per_claim: int, out: Path,
           device: str = "cpu") -> dict:
    """Peak RSS and time of `verinfer score` on files of N claims (module docstring)."""
    model_dir = resolve_model(model)
    base = [json.loads(line) for line in claims_path.read_text().splitlines() if line.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            f = Path(tmp) / f"claims-{n}.jsonl"
            with open(f, "w") as w:
                for i in range(n):
                    c = dict(base[i % len(base)])
                    c["id"], c["output_token_ids"] = f"m{i}", c["output_token_ids"][:tokens_per_claim]
                    w.write(json.dumps(c, separators=(",", ":")) + "\n")
            tokens = sum(min(len(base[i % len(base)]["output_token_ids"]), tokens_per_claim) for i in range(n))
            t0 = time.perf_counter()
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            r = subprocess.run([sys.executable, "-m", "verinfer.cli", "score", str(f), "--model", str(model_dir),
                                "-o", str(Path(tmp) / f"s-{n}.parquet"), "--device", device], capture_output=True, text=True,
                               env={**os.environ, "TERM": "dumb"})
            wall = time.perf_counter() - t0
            if r.returncode != 0:
                raise SystemExit(f"verinfer score failed on {n} claims:\n{r.stderr[-2000:]}")
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child so far
            rows.append({"claims": n, "tokens": tokens, "file_mb": f.stat().st_size / 1e6, "wall_s": wall,
                         "ms_per_token": 1e3 * wall / tokens, "peak_rss_gb": peak / 2**20,
                         "peak_rss_is_new_max": peak > before})
            print(json.dumps(rows[-1]), flush=True)
    section = "memory" if torch.device(device).type == "cpu" else f"memory_{torch.device(device).type}"
    return _save(out, section, {"model": model_info(model_dir).name, "tokens_per_claim": tokens_per_claim,
                                 "cpu": machine_fingerprint()["cpu_model"], "device": device,
                                 "device_name": _device_name(device), "runs": rows,
                                 "peak_rss_gb": max(r["peak_rss_gb"] for r in rows)})


def render(doc: dict) -> str:
    lines = ["# Real model (SmolLM2-135M-Instruct)", ""]
    for key in sorted(k for k in doc if k.startswith("speed")):
        s = doc[key]
        where = s.get("device_name") or s["cpu"]
        lines += [f"## Replay speed: {s['model']}, {s['claims']} claims, {s['tokens']} tokens, {s['device']} ({where}), "
                  f"{s['threads']} threads, {s['numerics']['dtype']}, median of {s['rounds']} interleaved rounds", "",
                  "| job | tokens/s |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in s["tokens_per_s"].items()]
        lines += ["", f"replay_vs_forward (score / LlamaLM forward, at the default {s.get('batch_tokens', 2048)} "
                      f"padded tokens a batch) = {s['replay_vs_forward']:.3f}; score / transformers forward = "
                      f"{s['replay_vs_hf_forward']:.3f}"
                  + (f"; score / the fastest forward at any batch size = {s['replay_vs_best_forward']:.3f}"
                     if "replay_vs_best_forward" in s else ""), ""]
    for key in sorted(k for k in doc if k.startswith("memory")):
        m = doc[key]
        lines += [f"## Bounded memory: `verinfer score --device {m.get('device', 'cpu')}` on N claims of {m['model']} "
                  f"({m['tokens_per_claim']} output tokens each at most; {m.get('device_name') or m['cpu']}), "
                  "one fresh process per N", "",
                  "| claims | tokens | file MB | wall s | ms/token | peak RSS GB |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['claims']} | {r['tokens']} | {r['file_mb']:.1f} | {r['wall_s']:.1f} | "
                  f"{r['ms_per_token']:.2f} | {r['peak_rss_gb']:.2f} |" for r in m["runs"]]
        lines += ["", "Peak RSS is the largest of the child processes so far (getrusage), so sizes run in "
                      "increasing order.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    sp = sub.add_parser("speed", help="replay_vs_forward on a claims file")
    sp.add_argument("claims", type=Path)
    sp.add_argument("--model", default="smollm2-135m-instruct")
    sp.add_argument("--rounds", type=int, default=3)
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--batch-tokens", type=int, nargs="*", default=[],
                    help="padded tokens a batch to time besides the device's default")
    sp.add_argument("--out", type=Path, default=RESULTS)
    mp = sub.add_parser("memory", help="peak RSS and time of `verinfer score` on files of N claims")
    mp.add_argument("claims", type=Path)
    mp.add_argument("--model", default="smollm2-135m-instruct")
    mp.add_argument("--sizes", type=int, nargs="+", default=[5000, 12500, 50000])
    mp.add_argument("--tokens-per-claim", type=int, default=64)
    mp.add_argument("--device", default="cpu")
    mp.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.stage == "memory":
        res = memory(a.claims, a.model, sorted(a.sizes), a.tokens_per_claim, a.out, a.device)
        print(json.dumps({k: res[k] for k in ("peak_rss_gb",)}))
        return
    res = speed(a.claims, a.model, a.rounds, a.threads, a.out, a.device, a.batch_tokens)
    print(json.dumps({k: res[k] for k in ("tokens_per_s", "replay_vs_forward", "replay_vs_best_forward", "replay_vs_hf_forward")}, indent=1))


if __name__ == "__main__":
    main()
