"""Scored once (issue 44): a sequential chat audit of several vendors, run by the code before the
one-replay change and by today's, on the same vendors in one run; how often and how long each
replays the vendors' claims.

    .venv/bin/python -m benchmarks.audit_core [--n 64] [--before REV]

Vendors: `verinfer serve` on loopback over the shipped testbed: honest, --misconfig int4,
--misconfig fp8-kv, and the testbed's draft model claimed as the target ("small-model"). Each audit
is `verinfer audit-vendors` (sequential, the default) in a child process whose
`verinfer.audit.replay.score_chunk` (the replay of a list of claims, wherever a module imported it)
is wrapped to record which claims each call replayed and how long it took. "before" runs the
source tree of REV (default: the commit before the change, `git archive`), "after" this checkout;
both audit the same vendors, which answer greedy requests deterministically (each decoded alone).

Writes benchmarks/results/audit_core.{json,md}: `replays_per_claim` (replays of a vendor claim /
vendor claims), `replay_time_vs_before` (seconds replaying vendors' claims, after / before),
`phases_before` / `phases_after` (the audits' own timings plus that replay time), both runs' verdicts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.determinism_probe import verinfer_serve
from benchmarks.markdown import write_markdown
from verinfer.io import atomic_write_text
from verinfer.models.testbed import DRAFT_DIR

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
CHANGE = "1806f5a"  # "audit: each claim replayed once"
VENDORS = {"honest": (), "int4": ("--misconfig", "int4"), "fp8-kv": ("--misconfig", "fp8-kv"),
           "small-model": ("--model", str(DRAFT_DIR))}
SERVED = {"small-model": "verinfer-testbed-draft"}


# --- the child: one audit with its replays recorded -------------------------------------------------
def inner(out: Path, cli_args: list[str]) -> None:
    """Run `verinfer CLI_ARGS` here with every score_chunk call recorded in out/replays.json."""
    import importlib

    from verinfer.audit import replay

    calls, real = [], replay.score_chunk

    def recorded(claims, *a, **kw):
        t0 = time.perf_counter()
        try:
            return real(claims, *a, **kw)
        finally:
            calls.append({"ids": [c.id for c in claims], "s": time.perf_counter() - t0})

    replay.score_chunk = recorded
    for name in ("verinfer.apps.audit_chat", "verinfer.apps.audit_api"):
        mod = importlib.import_module(name)
        if hasattr(mod, "score_chunk"):  # the code before imported it by name
            mod.score_chunk = recorded
    from verinfer.cli.main import app

    try:
        app(cli_args, standalone_mode=False)
    finally:
        (out / "replays.json").write_text(json.dumps(calls))


# --- the parent ---------------------------------------------------------------------------------------
def source_tree(rev: str, into: Path) -> Path:
    """src/ of git revision `rev`, unpacked into `into`; its path."""
    into.mkdir(parents=True, exist_ok=True)
    tar = into / "src.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(tar), rev, "src"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def vendors_file(urls: dict[str, str], path: Path) -> Path:
    lines = []
    for name, url in urls.items():
        lines += ["[[vendor]]", f'name = "{name}"', f'base_url = "{url}"',
                  f'model = "{SERVED.get(name, "verinfer-testbed-target")}"', "concurrency = 4", ""]
    path.write_text("\n".join(lines))
    return path


def run_audit(label: str, src: Path | None, vendors: Path, out: Path, args) -> dict:
    """One sequential audit-vendors in a child process (src: the source tree it imports verinfer
    from, None for this checkout); its phases, replays and verdicts."""
    out.mkdir(parents=True, exist_ok=True)
    cli = ["audit-vendors", str(vendors), "--out", str(out), "--n", str(args.n), "--max-tokens",
           str(args.max_tokens), "--calib-n", str(args.calib_n), "--bands", "bf16"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src or REPO / "src"), str(REPO)])
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "benchmarks.audit_core", "--inner", str(out), "--", *cli], cwd=REPO,
                       env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{label} audit failed ({p.returncode}): {p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    doc = json.loads((out / "vendors.json").read_text())
    calls = json.loads((out / "replays.json").read_text())
    claim_ids = {json.loads(line)["id"] for v in VENDORS for line in (out / "vendors" / v / "claims.jsonl").open()}
    vendor_calls = [c for c in calls if set(c["ids"]) <= claim_ids]
    replays = sum(len(c["ids"]) for c in vendor_calls)
    replay_s = sum(c["s"] for c in vendor_calls)
    return {"wall_s": round(wall, 2), "vendor_claims": len(claim_ids), "vendor_replays": replays,
            "replays_per_claim": replays / len(claim_ids), "vendor_replay_calls": len(vendor_calls),
            "phases": {**{k: round(v, 2) for k, v in doc["timings"].items()}, "vendor_replay_s": round(replay_s, 2)},
            "verdicts": {v["name"]: {"flagged": v["verdict"]["flagged"], "p_value": v["verdict"]["p_value"],
                                     "n_requests": v["n_requests"], "tokens_to_decide": v["tokens_to_decide"]}
                         for v in doc["vendors"]}}


def markdown(r: dict) -> str:
    b, a = r["before"], r["after"]
    lines = ["# One replay per claim (issue 44)", "",
             f"A sequential `verinfer audit-vendors` of {len(VENDORS)} `verinfer serve` vendors on loopback "
             f"(testbed; {r['settings']['n']} conversations, {r['settings']['max_tokens']} tokens, calibration "
             f"{r['settings']['calib_n']}), run by the code before the change ({r['before_rev']}) and by "
             f"{r['after_rev']}, one after the other in one run on {r['machine']}. Replays are counted and timed "
             "around `audit.replay.score_chunk` in each audit's process.", "",
             "| | vendor claims | replays of them | replays per claim | replaying them (s) | audit total (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, x in (("before", b), ("after", a)):
        lines.append(f"| {label} | {x['vendor_claims']} | {x['vendor_replays']} | {x['replays_per_claim']:.2f} | "
                     f"{x['phases']['vendor_replay_s']:.1f} | {x['phases']['total_s']:.1f} |")
    lines += ["", f"**replay_time_vs_before = {r['replay_time_vs_before']:.3f}**, replays_per_claim = "
              f"{r['replays_per_claim']:.2f} (before {b['replays_per_claim']:.2f}).", "",
              "| vendor | flagged before | flagged after | requests before | requests after |", "|---|---|---|---:|---:|"]
    for name in VENDORS:
        vb, va = b["verdicts"].get(name, {}), a["verdicts"].get(name, {})
        lines.append(f"| {name} | {vb.get('flagged')} | {va.get('flagged')} | {vb.get('n_requests')} | "
                     f"{va.get('n_requests')} |")
    lines += ["", "Phases (s, each audit's own `timings` plus the vendor replay time):", "",
              "| phase | before | after |", "|---|---:|---:|"]
    for k in dict.fromkeys([*b["phases"], *a["phases"]]):
        cell = lambda x: "-" if k not in x["phases"] else f"{x['phases'][k]:.1f}"  # noqa: E731
        lines.append(f"| {k} | {cell(b)} | {cell(a)} |")
    lines += ["", "The code before timed both calibrations under one key (`calibration_greedy_s`: the mismatch test's "
              "fit, which reuses the greedy detector's replayed runs, overwrote it); today each has its own."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inner"]:
        return inner(Path(argv[1]), argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--calib-n", type=int, default=32)
    ap.add_argument("--before", default=f"{CHANGE}^", help="git revision of the code before (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "audit_core.json")
    ap.add_argument("--work", type=Path, default=None, help="keep the audits' directories here (default: a temporary one)")
    args = ap.parse_args(argv)
    found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "--verify", "--quiet",
                            args.before + "^{commit}"], capture_output=True, text=True)
    if found.returncode != 0:
        ap.error(f"--before {args.before!r} is not a commit of this repository (git log --oneline names them)")
    rev = found.stdout.strip()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    from verinfer.numerics.machine import machine_fingerprint

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = args.work or Path(tmp)
        if args.work:
            shutil.rmtree(tmp, ignore_errors=True)
        before_src = source_tree(rev, tmp / "before")
        urls = {name: stack.enter_context(verinfer_serve(*extra, log=tmp / f"{name}.log", max_concurrent=4))
                for name, extra in VENDORS.items()}
        vendors = vendors_file(urls, tmp / "vendors.toml")
        before = run_audit("before", before_src, vendors, tmp / "audit-before", args)
        after = run_audit("after", None, vendors, tmp / "audit-after", args)
    r = {"before_rev": rev, "after_rev": head, "machine": f"{machine_fingerprint()['cpu_model']} ({machine_fingerprint()['threads']} threads)",
         "settings": {"n": args.n, "max_tokens": args.max_tokens, "calib_n": args.calib_n, "vendors": list(VENDORS)},
         "replays_per_claim": after["replays_per_claim"],
         "replay_time_vs_before": after["phases"]["vendor_replay_s"] / before["phases"]["vendor_replay_s"],
         "phases_before": before["phases"], "phases_after": after["phases"], "before": before, "after": after}
    atomic_write_text(args.out, json.dumps(r, indent=1) + "\n")
    write_markdown(args.out.with_suffix(".md"), markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
