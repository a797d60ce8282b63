"""Scale-out (issue 18): replay on a Ray pool -> benchmarks/results/scale_out.{json,md}.

    .venv/bin/pip install -e ".[ray,gguf]" && .venv/bin/verinfer models get smollm2-135m-instruct
    .venv/bin/python -m benchmarks.scale_out ray            # alone on the machine: it times

Section `ray`: the same SmolLM2-135M-Instruct claims (verinfer's honest-bf16-b8 provider, cached under
benchmarks/.cache/scale_out/) scored by `audit.replay.score_claims` on a `RayReplayPool` of 1 worker
and of 2 workers, 1 torch thread each, in one local Ray runtime of 2 CPUs; rounds interleaved
(1, 2, 2, 1, ...), medians. Timed: the scoring of every part (the workers already started, their model
loaded and one small part scored, so start-up is reported apart). Every output must be bitwise equal
(Parquet tables compared row for row) to the others and to the single-process score at 1 thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from verinfer.apps.pipeline import VERIFIER_NUMERICS, generate, verifier_engine
from verinfer.audit.ray_pool import RayReplayPool, import_ray
from verinfer.audit.replay import score_claims
from verinfer.claims import read_claims
from verinfer.io import atomic_write_json, atomic_write_text, sha256_files
from verinfer.models.catalog import resolve_model
from verinfer.models.load import model_info
from verinfer.numerics.machine import machine_fingerprint

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
CACHE = ROOT / ".cache" / "scale_out"


def _save(out: Path, section: str, res: dict) -> dict:
    doc = json.loads((out / "scale_out.json").read_text()) if (out / "scale_out.json").is_file() else {}
    doc[section] = res
    atomic_write_json(out / "scale_out.json", doc)
    atomic_write_text(out / "scale_out.md", render(doc))
    return res


def timed_pool_run(claims, model_dir: Path, workers: int, chunk: int, out: Path) -> dict:
    """Start a pool, warm every worker on a small part, then time the scoring of all parts."""
    t0 = time.perf_counter()
    with RayReplayPool(str(model_dir), VERIFIER_NUMERICS, workers=workers, threads=1) as pool:
        pool.pids()  # blocks until every actor has loaded the model
        ray = import_ray()
        ray.get([a.score.remote(-1, claims[:2], [None, None], None, {}) for a in pool.actors])
        start_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        r = score_claims(claims, pool, out, chunk_claims=chunk)
        score_s = time.perf_counter() - t1
    return {"workers": workers, "start_s": start_s, "score_s": score_s, "tokens": r.tokens,
            "tokens_per_s": r.tokens / score_s}


def ray_section(model: str, n: int, max_tokens: int, chunk: int, rounds: int, out: Path) -> dict:
    model_dir = resolve_model(model)
    info = model_info(model_dir)
    cpath = CACHE / f"{info.name.replace('/', '_')}-{info.weights_sha256}-n{n}-t{max_tokens}.jsonl"
    if not cpath.is_file():
        generate("honest-bf16-b8", model_dir, cpath, n=n, max_tokens=max_tokens)
    claims = read_claims(cpath)
    tokens = sum(len(c.output_token_ids) for c in claims)
    ray = import_ray()
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    init_s = time.perf_counter() - t0
    runs, tables = [], {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            order = [w for r in range(rounds) for w in ((1, 2) if r % 2 == 0 else (2, 1))]
            for i, w in enumerate(order):
                p = Path(tmp) / f"r{i}-w{w}.parquet"
                runs.append(timed_pool_run(claims, model_dir, w, chunk, p))
                tables.setdefault(w, []).append(pq.read_table(p))
                print(json.dumps(runs[-1]), flush=True)
            ref = Path(tmp) / "single.parquet"
            engine = verifier_engine(model_dir, VERIFIER_NUMERICS.with_(threads=1))
            t1 = time.perf_counter()
            score_claims(claims, engine, ref, chunk_claims=chunk)
            single_s = time.perf_counter() - t1
            single = pq.read_table(ref)
    finally:
        ray.shutdown()
    equal = all(t.equals(single) for ts in tables.values() for t in ts)
    med = {w: statistics.median(r["tokens_per_s"] for r in runs if r["workers"] == w) for w in (1, 2)}
    res = {"model": info.name, "weights_sha256": info.weights_sha256, "claims": len(claims), "tokens": tokens,
           "chunk_claims": chunk, "parts": -(-len(claims) // chunk), "rounds": rounds,
           "machine": machine_fingerprint(), "logical_cpus": os.cpu_count(), "ray_version": ray.__version__, "ray_init_s": init_s,
           "runs": runs, "tokens_per_s_1_worker": med[1], "tokens_per_s_2_workers": med[2],
           "speedup_2_vs_1": med[2] / med[1], "single_process_1_thread_tokens_per_s": tokens / single_s,
           "bitwise_equal": equal, "claims_sha256": sha256_files([cpath]),
           "command": "python -m benchmarks.scale_out ray"}
    res["targets"] = {"speedup_2_vs_1 >= 1.7": res["speedup_2_vs_1"] >= 1.7, "bitwise_equal": equal}
    return _save(out, "ray", res)


def render(doc: dict) -> str:
    lines = ["# Scale-out", ""]
    if "ray" in doc:
        r = doc["ray"]
        m = r["machine"]
        lines += [f"## Ray pool: {r['model']}, {r['claims']} claims, {r['tokens']} tokens, {r['parts']} parts of "
                  f"{r['chunk_claims']} claims", "",
                  f"`{r['command']}` on {m['cpu_model']} ({r['logical_cpus']} logical CPUs), torch "
                  f"{m['torch']}, Ray {r['ray_version']}; 1 torch thread per worker; {r['rounds']} interleaved "
                  "rounds, medians; timed: scoring every part with the workers started and warm.", "",
                  "| workers | tokens/s (median) | start-up s (median) |", "|---|---|---|"]
        for w in (1, 2):
            start = statistics.median(x["start_s"] for x in r["runs"] if x["workers"] == w)
            lines.append(f"| {w} | {r[f'tokens_per_s_{w}_worker' + ('s' if w > 1 else '')]:.0f} | {start:.1f} |")
        lines += ["", f"- speedup 2 vs 1 worker: **{r['speedup_2_vs_1']:.2f}x** (target >= 1.7: "
                      f"{'met' if r['targets']['speedup_2_vs_1 >= 1.7'] else 'NOT met'})",
                  f"- every output bitwise equal to the single-process score at 1 thread: **{r['bitwise_equal']}**",
                  f"- single process, 1 thread, no Ray: {r['single_process_1_thread_tokens_per_s']:.0f} tokens/s; "
                  f"ray.init: {r['ray_init_s']:.1f} s", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="section", required=True)
    rp = sub.add_parser("ray", help="1 vs 2 Ray workers of 1 thread on SmolLM2 claims")
    rp.add_argument("--model", default="smollm2-135m-instruct")
    rp.add_argument("--n", type=int, default=128, help="claims")
    rp.add_argument("--max-tokens", type=int, default=64)
    rp.add_argument("--chunk-claims", type=int, default=16, help="claims per part")
    rp.add_argument("--rounds", type=int, default=3)
    rp.add_argument("--out", type=Path, default=RESULTS)
    sub.add_parser("render", help="rewrite scale_out.md from scale_out.json")
    a = ap.parse_args()
    if a.section == "render":
        atomic_write_text(RESULTS / "scale_out.md", render(json.loads((RESULTS / "scale_out.json").read_text())))
        return
    ray_section(a.model, a.n, a.max_tokens, a.chunk_claims, a.rounds, a.out)


if __name__ == "__main__":
    main()
