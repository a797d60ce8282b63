"""`verinfer calibrate --detector glrt` on the demo, through the CLI as a user runs it (issue 15,
"Done when": the CLI glrt flags int4 and fp8-kv in the demo at <= 1,000 tokens; before issue 15 it
passed both, p = 1 at about 8,000 tokens each, where the default flagged both at 1,000).

    .venv/bin/python -m benchmarks.demo_glrt    # reuses runs/demo/claims when `verinfer demo` ran

Steps (each a `verinfer` command; outputs under runs/demo_glrt/, resumable):
  1. the demo's claims (`verinfer demo`: 10 providers x 128 claims x 64 tokens, seed 0), generated
     with `verinfer generate` where runs/demo has none;
  2. `verinfer score --gaps` (the honest-reference envelope glrt reads) and plain `verinfer score`;
  3. `verinfer calibrate --detector glrt` and the default `verinfer calibrate` on the five honest
     providers' scores;
  4. `verinfer audit --max-tokens N --json` of the five misconfigurations at N = 100 ... 1000 and of
     fresh honest claims (`verinfer generate --seed 1 --n 32`, never calibrated on) at 1,000; the
     audited files are scored on their first 24 claims (~1,500 tokens: an audit of N tokens reads the
     first N).
Writes benchmarks/results/demo_glrt.{json,md}: per detector, provider and N, flagged and p.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.markdown import write_markdown
from verinfer.providers.simulated import HONEST, MISCONFIGURED
from verinfer.report import format as fmt

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
SIZES = (100, 200, 300, 500, 700, 1000)
AUDIT_CLAIMS = 24  # x ~63 tokens > max(SIZES)
VERINFER = str(Path(sys.executable).parent / "verinfer")


def sh(*args: str) -> None:
    print("$ verinfer " + " ".join(args), flush=True)
    r = subprocess.run([VERINFER, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"verinfer {args[0]} exited {r.returncode}:\n{r.stderr[-2000:]}")


def ensure(path: Path, *args: str) -> Path:
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        sh(*args)
    return path


def head(src: Path, dst: Path) -> Path:
    """The first AUDIT_CLAIMS claims of `src` (audits read at most max(SIZES) tokens, in file order:
    scoring the rest with --gaps, ~5x the replay, would change no verdict)."""
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text("".join(src.read_text().splitlines(keepends=True)[:AUDIT_CLAIMS]))
    return dst


def run(work: Path, demo: Path) -> dict:
    t0 = time.perf_counter()
    claims, fresh = {}, {}
    for p in [*HONEST, *MISCONFIGURED]:
        src = demo / "claims" / f"{p}.jsonl"
        claims[p] = src if src.is_file() else ensure(work / "claims" / f"{p}.jsonl", "generate", p, "-o",
                                                      str(work / "claims" / f"{p}.jsonl"), "--n", "128")
    for p in HONEST:
        fresh[p] = ensure(work / "fresh" / f"{p}.jsonl", "generate", p, "-o", str(work / "fresh" / f"{p}.jsonl"),
                          "--n", "32", "--seed", "1")
    audited = {p: head(claims[p], work / "audited" / f"{p}.jsonl") for p in MISCONFIGURED}
    audited.update({f"fresh-{p}": head(c, work / "audited" / f"fresh-{p}.jsonl") for p, c in fresh.items()})
    scores = {}
    for kind, extra in (("gaps", ["--gaps"]), ("plain", [])):
        for p, c in [*((p, claims[p]) for p in HONEST), *audited.items()]:
            out = work / kind / f"{p}.parquet"
            scores[kind, p] = ensure(out, "score", str(c), "-o", str(out), *extra)
    dets = {"glrt": ensure(work / "glrt.json", "calibrate", *(str(scores["gaps", p]) for p in HONEST), "--detector",
                           "glrt", "-o", str(work / "glrt.json")),
            "clipped-mean (default)": ensure(work / "default.json", "calibrate",
                                             *(str(scores["plain", p]) for p in HONEST), "-o", str(work / "default.json"))}
    res = {}
    for label, det in dets.items():
        kind = "gaps" if label == "glrt" else "plain"
        res[label] = {}
        audits = [(n, list(MISCONFIGURED)) for n in SIZES] + [(1000, [f"fresh-{p}" for p in HONEST])]
        for n, provs in audits:
            out = work / f"audit-{kind}-{n}-{provs[0]}.json"
            cmd = ["audit", *(str(scores[kind, p]) for p in provs), "-d", str(det), "--max-tokens", str(n),
                   "--json", str(out)]
            print("$ verinfer " + " ".join(cmd), flush=True)
            rc = subprocess.run([VERINFER, *cmd], stdout=subprocess.DEVNULL).returncode
            if rc not in (0, 1):
                raise SystemExit(f"verinfer audit exited {rc}")
            for v in json.loads(out.read_text()):
                key = v["provider"] if provs[0] in MISCONFIGURED else f"fresh-{v['provider']}"
                res[label].setdefault(key, {})[str(n)] = {"flagged": v["flagged"], "p_value": v["p_value"],
                                                                    "n_tokens": v["n_tokens"]}
    first = {label: {p: next((int(n) for n, v in by.items() if v["flagged"]), None) for p, by in r.items()
                     if p in MISCONFIGURED} for label, r in res.items()}
    doc = {"verdicts": res, "first_flagged_tokens": first,
           "targets": {"glrt flags int4 at <= 1000": res["glrt"]["int4"]["1000"]["flagged"],
                       "glrt flags fp8-kv at <= 1000": res["glrt"]["fp8-kv"]["1000"]["flagged"],
                       "fresh honest passes (glrt)": not any(res["glrt"][f"fresh-{p}"]["1000"]["flagged"] for p in HONEST)},
           "setup": {"claims": "the demo's: 128 claims x 64 tokens per provider, seed 0; fresh honest: 32 claims, seed 1",
                     "sizes": list(SIZES), "command": "python -m benchmarks.demo_glrt",
                     "seconds": time.perf_counter() - t0}}
    from verinfer.io import atomic_write_json

    atomic_write_json(RESULTS / "demo_glrt.json", doc)
    write_markdown(RESULTS / "demo_glrt.md", markdown(doc))
    print(markdown(doc))
    return doc


def markdown(doc: dict) -> str:
    L = ["# `verinfer calibrate --detector glrt` on the demo (CLI)", "",
         f"Command: `{doc['setup']['command']}`. Claims: {doc['setup']['claims']}. Both detectors calibrated on the "
         "five honest providers' scores (glrt on `score --gaps`); `audit --max-tokens N` per misconfiguration.", "",
         "| detector | provider | " + " | ".join(f"{n} tokens" for n in doc["setup"]["sizes"]) + " | first flagged |",
         "|---|---|" + "---|" * (len(doc["setup"]["sizes"]) + 1)]
    for label, r in doc["verdicts"].items():
        for p, by in r.items():
            cells = [(f"{'**flagged**' if by[str(n)]['flagged'] else 'ok'} ({fmt.p_value(by[str(n)]['p_value'])})"
                      if str(n) in by else "") for n in doc["setup"]["sizes"]]
            first = doc["first_flagged_tokens"][label].get(p, "")
            L.append(f"| {label} | {p} | " + " | ".join(cells) + f" | {first if first is not None else '-'} |")
    L += ["", "Targets: " + ", ".join(f"{k}: {v}" for k, v in doc["targets"].items()), ""]
    return "\n".join(L)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--render", action="store_true", help="only rewrite demo_glrt.md from demo_glrt.json")
    ap.add_argument("--work", type=Path, default=Path("runs/demo_glrt"))
    ap.add_argument("--demo", type=Path, default=Path("runs/demo"), help="a `verinfer demo` output to reuse")
    a = ap.parse_args(argv)
    if a.render:

        write_markdown(RESULTS / "demo_glrt.md", markdown(json.loads((RESULTS / "demo_glrt.json").read_text())))
        return
    run(a.work, a.demo)


if __name__ == "__main__":
    main()
