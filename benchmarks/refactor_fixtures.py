"""Behaviour fixtures for the one-core refactor (issue 13): record what the CURRENT code computes
on the shipped testbed, then check that the refactored code computes the same bits.

    PYTHONPATH=src .venv/bin/python -m benchmarks.refactor_fixtures record   # before the refactor
    PYTHONPATH=src .venv/bin/python -m benchmarks.refactor_fixtures check    # after: table, exit 1 on a diff
    ... record --fixtures tests/fixtures/refactor-NAME    # another machine's recording: run from a
                      # checkout of the pre-refactor commit 621fd5b with this script and
                      # src/verinfer/numerics/machine.py copied into it, PYTHONPATH=src
    ... check --only gen/ --only replay/                                      # a subset (name prefixes)

What is recorded (tests/fixtures/refactor*/fixtures.json + replay_logits.safetensors; one
directory per recording machine, `check` compares against the one recorded on this CPU and torch):
  gen/<provider>, gen/noise-<backend>, gen/fingerprint  `verinfer generate` output token ids
                      per claim (and the `activations` payload); prompts too
  det/<policy>        `verinfer generate --deterministic <policy>` greedy token ids
  spec/<rule>-t0|t1   `verinfer generate --speculative <rule>` token ids and spec.events;
                      the temperature-1 ones are reported but NOT must-equal (speculative sampling
                      moves onto the sampling/ noise streams in the refactor)
  score/<name>        `verinfer score --gaps` Parquet: every column's values (exact) + sha256
  replay/<config>     teacher-forced replay logits (fp32) of 4 claims, padded and packed, for
                      bf16, bf16 with fp32 matmuls, and fp32: sha256 per claim + full rows at a
                      few positions (the only part that uses internal API: `replay_logits`)

Everything else runs the `verinfer` command (the typer app `verinfer.cli:app`) in a temp dir, at the
recorded torch thread count (OMP_NUM_THREADS / MKL_NUM_THREADS), in a few fresh processes that each run
their share of the items one after another (start-up, ~8 of an item's ~9 CPU seconds, paid once per
process; a command that leaked state into the next would show as a difference). Bitwise results
can depend on the CPU ISA, thread count and torch build: `check` on another CPU or torch version
says so and exits 3 (the test skips) instead of reporting differences.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from verinfer.numerics.machine import fingerprint_mismatch, machine_fingerprint
from verinfer.providers.simulated import PROVIDERS

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "refactor"  # the first recording (record's default)
N, MAX_TOKENS, SEED = 8, 32, 0
TAU = 0.0625  # fixed MarginGate tau (calibrated testbed eps_pert p99 is 0.0625): no calibration run
JUDGE = ROOT / "benchmarks" / "results" / "kl_judge_testbed_autojudge.json"
HONEST = ("honest-bf16-b8", "honest-bf16-b1", "honest-fp32-b4", "honest-bf16-eager-t1", "honest-bf16-chunk16")
MISCONFIGURED = ("int4", "fp8-kv", "temp-1.1", "wrong-seed", "sampling-bug")
NOISES = ("vllm-cpu", "vllm-v1-exponential", "keyed", "inverse-cdf")
POLICIES = ("best", "margingate_live_cache", "llm42", "gated_llm42", "batch_invariant", "layercast", "bf16")
RECORDED_AS = {"margingate_live_cache": "margingate"}  # fixture names from before the policy rename (issue 44)
SPEC_RULES = ("standard", "kl", "topk", "target_entropy", "draft_entropy", "autojudge")
SCORED = {"honest": "gen/honest-bf16-b8", "int4": "gen/int4", "wrong-seed": "gen/wrong-seed"}
REPLAY_CLAIMS = 4        # claims of gen/honest-bf16-b8 replayed for the logits fixture
REPLAY_ROWS = (0, 15, -1)  # output positions whose full logits rows are stored, per claim (first 2 claims)


# --- the items ---------------------------------------------------------------------------------
def items() -> list[dict]:
    """Every fixture item: name, the CLI argv after `verinfer`, and whether it must be equal."""
    base = ["--n", str(N), "--max-tokens", str(MAX_TOKENS), "--seed", str(SEED)]
    # providers removed after the recording are not rerun (check lists them): honest-bf16-chunk16
    # reproduced honest-bf16-b8 bitwise and became honest-bf16-chunk13 (issue 16 item 10)
    out = [dict(name=f"gen/{p}", argv=["generate", p, *base]) for p in HONEST + MISCONFIGURED if p in PROVIDERS]
    out += [dict(name=f"gen/noise-{z}", argv=["generate", "honest-bf16-b8", *base, "--noise", z])
            for z in NOISES if z != "vllm-cpu"]  # vllm-cpu is the default: gen/honest-bf16-b8
    out.append(dict(name="gen/fingerprint", argv=["generate", "honest-bf16-b8", *base, "--fingerprint",
                                                  "k=8,stride=4"]))
    out += [dict(name=f"det/{RECORDED_AS.get(p, p)}", argv=["generate", "--deterministic", p, "--tau-file", "{tau}",
                                                           *base])
            for p in POLICIES]
    for rule in SPEC_RULES:
        judge = ["--judge", str(JUDGE)] if rule == "autojudge" else []
        if rule == "autojudge" and not JUDGE.is_file():
            continue
        for t in (0, 1):
            out.append(dict(name=f"spec/{rule}-t{t}", argv=["generate", "--speculative", rule, *judge, *base,
                                                            "--temperature", str(float(t))],
                            must_equal=t == 0,
                            note=None if t == 0 else "sampled speculative tokens are expected to change "
                                                     "(speculative sampling moves onto sampling/ noise streams)"))
    out += [dict(name=f"score/{k}", argv=["score", "{claims:" + src + "}", "--gaps"]) for k, src in SCORED.items()]
    out.append(dict(name="score/honest-matmul-fp32",
                    argv=["score", "{claims:gen/honest-bf16-b8}", "--gaps", "--matmul", "fp32"]))
    for it in out:
        it.setdefault("must_equal", True)
        it.setdefault("note", None)
    return out


# a fresh process that runs `verinfer` commands one after another: stdin a JSON list of [argv, out];
# the last stdout line the seconds each took
_WORKER = """
import json, os, sys, time
from verinfer.cli import app
seconds = []
for argv, out in json.loads(sys.stdin.read()):
    os.chdir(os.path.dirname(out))
    t0 = time.time()
    try:
        app([*argv, "-o", out], prog_name="verinfer")
    except SystemExit as e:
        if e.code not in (0, None):
            sys.exit(f"`verinfer {' '.join(argv)}` exited {e.code}")
    seconds.append(time.time() - t0)
print(json.dumps(seconds))
"""


def run_cli(jobs: list[tuple[list[str], Path]], threads: int) -> list[float]:
    """`verinfer <argv> -o out` for each (argv, out), one after another in ONE fresh process at
    `threads` torch threads; the seconds each took."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-c", _WORKER], input=json.dumps([[a, str(o)] for a, o in jobs]),
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"the fixture worker exited {r.returncode}:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def claims_record(path: Path) -> list[dict]:
    """Per claim (file order): id, prompt and output token ids, activations / spec if present."""
    rows = []
    for line in path.read_text().splitlines():
        c = json.loads(line)
        r = dict(id=c["id"], prompt=c["prompt_token_ids"], tokens=c["output_token_ids"])
        if "activations" in c:
            r["activations"] = c["activations"]
        if "spec" in c:  # the rng description text is documentation, not behaviour
            r["spec"] = {k: v for k, v in c["spec"].items() if k != "rng"}
        rows.append(r)
    return rows


def _canon(col) -> bytes:
    """A column's values as bytes, independent of Parquet chunking and encoding."""
    a = col.to_numpy()
    if a.dtype == object:
        return json.dumps([None if v is None else str(v) for v in a]).encode()
    return np.ascontiguousarray(a).tobytes() + a.dtype.str.encode()


def scores_record(path: Path) -> dict:
    """Every column of a scores Parquet, rows sorted by (claim_id, position): values + sha256."""
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    order = sorted(range(t.num_rows), key=lambda i: (t["claim_id"][i].as_py(), t["position"][i].as_py()))
    t = t.take(order)
    return {name: dict(sha256=hashlib.sha256(_canon(t[name])).hexdigest(), values=t[name].to_pylist())
            for name in t.column_names}


# --- replay logits: the ONE place that uses internal API (update these lines in the refactor) -----
REPLAY_CONFIGS = {  # name -> (dtype, matmul, packed)
    "bf16-padded": ("bf16", "native", False), "bf16-packed": ("bf16", "native", True),
    "bf16-matmul-fp32-padded": ("bf16", "fp32", False), "bf16-matmul-fp32-packed": ("bf16", "fp32", True),
    "fp32-padded": ("fp32", "native", False), "fp32-packed": ("fp32", "native", True),
}


def replay_logits(pairs: list[tuple[list[int], list[int]]], dtype: str, matmul: str, packed: bool) -> list:
    """Teacher-forced replay logits_TV (fp32) of each (prompt, output) pair on the testbed target,
    as `verinfer score` computes them (Engine.replay: claims batched, padded or packed)."""
    from verinfer.engine.engine import Engine
    from verinfer.models.load import load_model
    from verinfer.models.testbed import TARGET_DIR
    from verinfer.numerics import Numerics

    num = Numerics(dtype=dtype, attn="sdpa", matmul=matmul)
    engine = Engine(load_model(TARGET_DIR, num, "cpu"), num, packed_replay=packed)
    return [r.logits_TV for r in engine.replay(pairs)]
# ------------------------------------------------------------------------------------------------


def replay_record(pairs, threads: int) -> tuple[dict, dict]:
    """Per config: sha256 of each claim's logits bytes; tensors: full rows at REPLAY_ROWS."""
    import torch

    torch.set_num_threads(threads)
    meta, tensors = {}, {}
    for name, (dtype, matmul, packed) in REPLAY_CONFIGS.items():
        logits = [x.contiguous().float() for x in replay_logits(pairs, dtype, matmul, packed)]
        meta[f"replay/{name}"] = dict(sha256=[hashlib.sha256(x.numpy().tobytes()).hexdigest() for x in logits],
                                      shape=[list(x.shape) for x in logits])
        tensors[name] = torch.stack([x[t] for x in logits[:2] for t in REPLAY_ROWS])
    return meta, tensors


# --- environment ---------------------------------------------------------------------------------
def environment(threads: int) -> dict:
    """The machine fingerprint (verinfer.numerics.machine) plus the commit, python and date."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout
    return dict(machine_fingerprint(threads), commit=commit, src_modified=bool(dirty.strip()),
                python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def env_mismatch(rec: dict, now: dict) -> str | None:
    """Why bitwise comparison is not meaningful here (another CPU / ISA / torch / BLAS), or None."""
    return fingerprint_mismatch(rec, now)


# --- record / check ------------------------------------------------------------------------------
def compute(selected: list[dict], threads: int, log, jobs: int | None = None) -> tuple[dict, dict]:
    """Run the selected items (and the items they read); returns (results, tensors). `jobs` fresh
    processes at `threads` torch threads (default: one per CPU) share the items and run side by side
    without changing a bit: first every item that reads no other item's output, then the rest."""
    results, tensors = {}, {}
    with tempfile.TemporaryDirectory(prefix="verinfer-fixtures-") as tmp:
        d = Path(tmp)
        tau = d / "tau.json"
        tau.write_text(json.dumps({"verinfer-testbed-target": {"bf16": {
            "model": "verinfer-testbed-target", "dtype": "bf16", "tau": TAU}}}))
        files: dict[str, Path] = {}
        needed = {src for it in selected for a in it["argv"] if a.startswith("{claims:") for src in [a[8:-1]]}
        todo = [it for it in items() if it["name"] in needed and it not in selected] + selected

        def out_path(it: dict) -> Path:
            return d / (it["name"].replace("/", "_") + (".parquet" if it["argv"][0] == "score" else ".jsonl"))

        def argv(it: dict) -> list[str]:
            return [str(tau) if a == "{tau}" else str(files[a[8:-1]]) if a.startswith("{claims:") else a
                    for a in it["argv"]]

        reads = lambda it: any(a.startswith("{claims:") for a in it["argv"])  # noqa: E731
        n = max(1, jobs or os.cpu_count() or 1)
        with ThreadPoolExecutor(n) as pool:
            for wave in ([it for it in todo if not reads(it)], [it for it in todo if reads(it)]):
                shares = [s for s in (wave[i::n] for i in range(n)) if s]
                done = pool.map(lambda share: run_cli([(argv(it), out_path(it)) for it in share], threads), shares)
                for share, seconds in zip(shares, done):
                    for it, sec in zip(share, seconds):
                        out = files[it["name"]] = out_path(it)
                        if it in selected:
                            results[it["name"]] = scores_record(out) if it["argv"][0] == "score" else claims_record(out)
                        log(f"  {it['name']:32s} {sec:5.1f} s")
    return results, tensors


def replay_pairs(fixture_results: dict) -> list[tuple[list[int], list[int]]]:
    return [(c["prompt"], c["tokens"]) for c in fixture_results["gen/honest-bf16-b8"][:REPLAY_CLAIMS]]


def record(threads: int, dest: Path = FIXTURES, log=print) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    its = items()
    results, _ = compute(its, threads, log)
    t0 = time.time()
    replay_meta, tensors = replay_record(replay_pairs(results), threads)
    log(f"  {'replay/* (6 configs)':32s} {time.time() - t0:5.1f} s")
    from safetensors.torch import save_file

    save_file(tensors, str(dest / "replay_logits.safetensors"))
    doc = dict(meta=dict(environment(threads), n=N, max_tokens=MAX_TOKENS, seed=SEED, tau=TAU,
                         replay_claims=REPLAY_CLAIMS, replay_rows=list(REPLAY_ROWS),
                         notes=["spec/*-t1 (sampled speculative tokens) are EXPECTED to change in the refactor: "
                                "speculative sampling moves onto the sampling/ noise streams; check reports them "
                                "but only spec/*-t0 (greedy) must be equal",
                                "claims JSON formatting and `spec.rng` text are not compared, only values"]),
               items={it["name"]: dict(argv=it["argv"], must_equal=it["must_equal"], note=it["note"]) for it in its},
               results={**results, **replay_meta})
    (dest / "fixtures.json").write_text(json.dumps(doc, separators=(",", ":")))
    log(f"wrote {dest}/fixtures.json and replay_logits.safetensors")


def diff_claims(old: list[dict], new: list[dict]) -> str | None:
    if [c["id"] for c in old] != [c["id"] for c in new]:
        return f"claim ids differ ({len(old)} recorded, {len(new)} now)"
    parts = []
    for key in ("prompt", "tokens", "activations", "spec"):
        bad = [i for i, (a, b) in enumerate(zip(old, new)) if a.get(key) != b.get(key)]
        if bad:
            extra = ""
            if key == "tokens":
                nt = sum(sum(x != y for x, y in zip(old[i][key], new[i][key])) + abs(len(old[i][key]) - len(new[i][key]))
                         for i in bad)
                extra = f", {nt}/{sum(len(c['tokens']) for c in old)} tokens"
            parts.append(f"{key}: {len(bad)}/{len(old)} claims{extra}")
    return "; ".join(parts) or None


def diff_scores(old: dict, new: dict) -> str | None:
    parts = []
    for col, rec in old.items():
        if col not in new:
            parts.append(f"{col} missing")
        elif new[col]["sha256"] != rec["sha256"]:
            a, b = rec["values"], new[col]["values"]
            n = sum(not (x == y or (x != x and y != y)) for x, y in zip(a, b)) + abs(len(a) - len(b))
            parts.append(f"{col} {n}/{len(a)}")
    return ("values differ: " + ", ".join(parts)) if parts else None


def diff_replay(name: str, old: dict, new: dict, old_t, new_t) -> str | None:
    bad = sum(a != b for a, b in zip(old["sha256"], new["sha256"])) + abs(len(old["sha256"]) - len(new["sha256"]))
    if not bad:
        return None
    k = name.split("/", 1)[1]
    d = (old_t[k] - new_t[k]).abs()
    return (f"{bad}/{len(old['sha256'])} claims' logits; stored rows: {int((d != 0).sum())}/{d.numel()} values "
            f"differ, max |diff| {float(d.max()):.3g}")


def recordings(dirs: list[Path] | None = None) -> list[Path]:
    """The recording directories: tests/fixtures/refactor*/ holding a fixtures.json."""
    dirs = dirs or sorted((ROOT / "tests" / "fixtures").glob("refactor*"))
    return [d for d in dirs if (d / "fixtures.json").is_file()]


def check(only: list[str] | None, dirs: list[Path] | None = None, log=print) -> int:
    """Rerun and compare against the recording made on this CPU and torch; prints a table.
    0: all must-equal items equal; 1: a difference; 3: no recording from this CPU / torch
    (comparison not meaningful)."""
    from safetensors.torch import load_file

    why_not = []
    for src in recordings(dirs):
        doc = json.loads((src / "fixtures.json").read_text())
        meta = doc["meta"]
        why = env_mismatch(meta, environment(meta["threads"]))
        if not why:
            break
        why_not.append(f"{src.relative_to(ROOT) if src.is_relative_to(ROOT) else src}: {why}")
    else:
        log(f"NOT COMPARABLE: no fixtures were recorded on this machine and torch ({'; '.join(why_not) or 'none found'}); "
            f"bitwise results depend on the CPU ISA and torch build, so nothing is compared. Re-record here from "
            f"the pre-refactor commit 621fd5b (record --fixtures tests/fixtures/refactor-NAME) to compare here.")
        return 3
    log(f"comparing against {src} (recorded at {meta['commit'][:7]} on {meta['cpu_model']}, torch {meta['torch']})")
    sel = lambda name: not only or any(name.startswith(p) for p in only)  # noqa: E731
    its = [it for it in items() if sel(it["name"])]
    new, _ = compute(its, meta["threads"], log)
    if any(sel(f"replay/{k}") for k in REPLAY_CONFIGS):
        pairs = [(c["prompt"], c["tokens"]) for c in doc["results"]["gen/honest-bf16-b8"][:REPLAY_CLAIMS]]
        replay_meta, tensors = replay_record(pairs, meta["threads"])
        new.update({k: v for k, v in replay_meta.items() if sel(k)})
    old_t = load_file(str(src / "replay_logits.safetensors"))
    rows, failed = [], 0
    for name in sorted(new):
        old = doc["results"].get(name)
        spec = doc["items"].get(name, dict(must_equal=True))
        if old is None:
            d = "no recorded fixture"
        elif name.startswith("replay/"):
            d = diff_replay(name, old, new[name], old_t, tensors)
        elif name.startswith("score/"):
            d = diff_scores(old, new[name])
        else:
            d = diff_claims(old, new[name])
        must = spec["must_equal"]
        failed += bool(d) and must
        rows.append((name, "equal" if d is None else "DIFFERS", "yes" if must else "no (expected to change)", d or ""))
    w = max(len(r[0]) for r in rows)
    log(f"\n{'item':{w}s}  {'result':8s} {'must equal':24s} detail")
    for r in rows:
        log(f"{r[0]:{w}s}  {r[1]:8s} {r[2]:24s} {r[3]}")
    gone = sorted(n for n in doc["results"] if n.startswith("gen/") and sel(n) and n not in new)
    if gone:
        log(f"not rerun (the provider no longer exists): {', '.join(gone)}")
    log(f"\n{len(rows)} items, {sum(r[1] == 'equal' for r in rows)} equal, {failed} must-equal items differ "
        f"(threads {meta['threads']}, recorded at {meta['commit'][:7]})")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads when recording (check uses the recorded); "
                    "1: 2 threads on a shared 2-core machine run up to 25x slower (spinning OpenMP threads)")
    ap.add_argument("--only", action="append", help="check only items whose name starts with this (repeatable)")
    ap.add_argument("--fixtures", type=Path, help="record: the directory to write (default tests/fixtures/refactor); "
                    "check: compare against this directory only (default: every tests/fixtures/refactor*/, "
                    "the one recorded on this CPU and torch)")
    a = ap.parse_args()
    if a.mode == "record":
        record(a.threads, a.fixtures or FIXTURES)
        return 0
    return check(a.only, [a.fixtures] if a.fixtures else None)


if __name__ == "__main__":
    sys.exit(main())
