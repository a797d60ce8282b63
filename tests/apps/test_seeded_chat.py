"""Seeded chat audits (issue 46) on the shipped testbed served by `verinfer serve`: vendors audited at
temperature 0.7 / top-p 0.95 with per-request seeds, the sampler picked by the seed probe, Token-DiFR
on the ids re-cut from the reply text; a vendor that serves another temperature or seed is flagged;
one that ignores seeds (or samples with one no known sampler reproduces) is judged unseeded, by the
PIT-uniformity detector calibrated on verinfer's own honest sampled runs: flagged when it also serves
another temperature. Misbehaving vendors are the same honest server behind a rewriting proxy
(`Proxy`): what a serving layer does to the request, the model untouched. A log mixing greedy, seeded
and unseeded exchanges gets verdicts in all three modes from the CLI and the Python API."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

import pyarrow.parquet as pq  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tests.server.serverproc import HOST, Launched  # noqa: E402
from verinfer.cli.main import app  # noqa: E402
from verinfer.models.testbed import TARGET_DIR  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")]
MODEL = "verinfer-testbed-target"
ARGS = ["--n", "12", "--max-tokens", "32", "--calib-n", "12", "--honest", "honest-bf16-b8", "--honest",
        "honest-fp32-b4", "--honest", "honest-bf16-eager-t1", "--bands", "bf16", "--bands", "int4"]


def hot(body: dict) -> dict:       # serves temperature 0.8 when asked 0.7
    return {**body, "temperature": 0.8} if body.get("temperature") == 0.7 else body


def seed_offset(body: dict) -> dict:  # samples with seed + 1
    return {**body, "seed": body["seed"] + 1} if "seed" in body else body


SEEN: dict = {}


def no_seed(body: dict) -> dict:   # ignores seeds: its own, one per conversation and request (reproducible
    key = json.dumps(body.get("messages"), sort_keys=True)   # whatever order requests come in): the k-th request
    SEEN[key] = SEEN.get(key, -1) + 1                        # of conversation c gets 7000 + 1000 h(c) + k
    own = 7_000 + 1_000 * (int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100_000) + SEEN[key]
    return {**{k: v for k, v in body.items() if k != "seed"}, **({"seed": own} if "seed" in body else {})}


def hot_no_seed(body: dict) -> dict:  # ignores seeds and serves temperature 1.0 when asked 0.7
    body = no_seed(body)
    return {**body, "temperature": 1.0} if body.get("temperature") == 0.7 else body


def wide_no_seed(body: dict) -> dict:  # ignores seeds and serves top-p 1.0 when asked 0.95
    body = no_seed(body)
    return {**body, "top_p": 1.0} if body.get("top_p") == 0.95 else body


REWRITES = {"honest": lambda b: b, "hot": hot, "seed-offset": seed_offset, "no-seed": no_seed,
            "hot-no-seed": hot_no_seed, "wide-no-seed": wide_no_seed}


def fixed_seed(seed: int):  # samples every request with one seed of its own, whatever the request's (SGLang's
    return lambda body: {**body, "seed": seed} if body.get("temperature") else body  # deterministic mode: 42)


FIXED = {"fixed-42": fixed_seed(42), "fixed-777": fixed_seed(777)}  # served too, audited apart (test_fixed_seed_...)


class Proxy:
    """http://HOST:port/<rewrite>/v1/... -> the server's /v1/..., the JSON request body rewritten."""

    def __init__(self, upstream: str):
        import httpx2 as httpx

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                _, name, rest = self.path.split("/", 2)
                body = {**REWRITES, **FIXED}[name](json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                r = httpx.post(f"{upstream}/{rest}", json=body, timeout=120)
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://{HOST}:{self.server.server_address[1]}/{name}/v1"

    def stop(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    server = Launched(tmp_path_factory.mktemp("seeded-chat"), "--max-concurrent", "4")
    p = None
    try:
        server.ready()
        p = Proxy(server.root)
        yield p
    finally:
        if p is not None:
            p.stop()
        server.stop()


def vendors_toml(proxy: Proxy, names) -> str:
    return "".join(f'[[vendor]]\nname = "{n}"\nbase_url = "{proxy.url(n)}"\nmodel = "{MODEL}"\nconcurrency = 2\n'
                   for n in names)


def test_seeded_vendors_side_by_side(proxy, tmp_path):
    """At temperature 0.7 / top-p 0.95 (mode auto): the honest vendor is recognised as sampling with
    vllm-cpu, every token matches (exact match 1.0: the re-cut restores the server's own ids) and it is
    not flagged; 0.8 for 0.7 is flagged; a vendor dropping seeds, and one sampling with seed + 1 (it
    honours seeds, but no known sampler reproduces it: never judged as if it were another sampler), are
    judged unseeded and not flagged; one dropping seeds and serving temperature 1.0 for 0.7 is flagged
    by the unseeded detector (PIT uniformity, its betting e-process)."""
    cfg = tmp_path / "vendors.toml"
    cfg.write_text(vendors_toml(proxy, REWRITES))
    out = tmp_path / "audit"
    r = CliRunner().invoke(app, ["audit-vendors", str(cfg), "--out", str(out), "--temperature", "0.7",
                                 "--top-p", "0.95", *ARGS])
    assert r.exit_code == 1, r.output
    assert "no-seed: unseeded, judged from the reference's distribution alone: the same seeded" in r.output
    doc = json.loads((out / "vendors.json").read_text())
    rows = {v["name"]: v for v in doc["vendors"]}
    assert set(rows) == set(REWRITES) and doc["mode"] == "mixed" and "unseeded" not in doc
    honest = rows["honest"]
    assert honest["mode"] == "seeded" and honest["sampling"] == {"temperature": 0.7, "top_p": 0.95, "top_k": -1,
                                                                 "min_p": 0.0, "noise": "vllm-cpu"}
    assert honest["probe"]["honours_seeds"] and honest["probe"]["noise"] == "vllm-cpu"
    assert honest["probe"]["probe_exact_match"]["vllm-cpu"] == 1.0
    assert max(v for k, v in honest["probe"]["probe_exact_match"].items() if k != "vllm-cpu") < 0.75
    assert honest["exact_match"] == 1.0 and not honest["verdict"]["flagged"], json.dumps(honest)
    assert honest["n_requests"] == 12 and honest["nearest_band"] == "bf16"
    # the ids scored are the server's own (it returns them beside the text): the re-cut restored every one
    scored: dict = {}
    table = pq.read_table(out / "vendors" / "honest" / "scores.parquet")
    for cid, tok in zip(table["claim_id"].to_pylist(), table["token_id"].to_pylist()):
        scored.setdefault(cid, []).append(tok)
    claims = [json.loads(x) for x in (out / "vendors" / "honest" / "claims.jsonl").read_text().splitlines()]
    assert all(c["mode"] == "seeded" and c["sampling"]["temperature"] == 0.7 for c in claims)
    assert len({c["sampling"]["seed"] for c in claims}) == 12  # a seed per request
    assert all(scored[c["id"]] == c["chat"]["returned_output_token_ids"] for c in claims)
    # ...one of which the text re-encodes otherwise (measured 1 of 12): re-cut at the seeded sample
    assert honest["drift"] == honest["resegmented"] == 1 / 12
    assert rows["hot"]["verdict"]["flagged"] and rows["hot"]["exact_match"] < 0.95, json.dumps(rows["hot"])
    assert rows["hot"]["probe"]["noise"] == "vllm-cpu"  # the probe (at temperature 1) is served as asked
    u, offset, wrong, wide = rows["no-seed"], rows["seed-offset"], rows["hot-no-seed"], rows["wide-no-seed"]
    assert offset["mode"] == "unseeded" and offset["probe"]["honours_seeds"]
    assert not offset["probe"]["recognised"] and max(offset["probe"]["probe_exact_match"].values()) < 0.5
    assert "no known sampler reproduces its seeded reply" in offset["note"]
    assert u["mode"] == "unseeded" and not u["probe"]["same_seed_same_reply"]
    assert u["note"].startswith("unseeded, judged from the reference's distribution alone: the same seeded "
                                "request twice gave two")
    key = "unseeded-t0.7-p0.95-k-1-m0"
    for row in (u, offset, wrong, wide):
        assert row["sampling"] == {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "noise": None}
        assert row["verdict"]["score"] == "sequential-e-process" and row["mismatch_test"] is None
        assert row["verdict"]["fixed_n"]["score"] == "pit-uniformity", json.dumps(row)
    # the honest unseeded vendors: every request, not flagged, neither by the anytime-valid verdict nor by the
    # fixed-size test (measured anytime-valid p: no-seed 0.98, seed-offset 0.99; fixed-size 0.82, 0.43;
    # docs/chat-audits.md: over --seed 0..10 the no-seed vendor's fixed-size p 0.05-0.99, anytime-valid >= 0.40)
    for row in (u, offset):
        assert not row["verdict"]["flagged"] and row["n_requests"] == 12 and row["n_claims"] == 12, json.dumps(row)
        assert row["tokens_to_decide"] is None
        assert row["verdict"]["p_value"] > 0.3 and row["verdict"]["fixed_n"]["p_value"] > 0.1, json.dumps(row)
    # temperature 1.0 for 0.7, seeds dropped: flagged by the betting e-process, requests stopped (measured: after
    # 45 tokens, 2 requests; 3 sent at concurrency 2; fixed-size p 1e-37 on its 53 tokens)
    assert wrong["verdict"]["flagged"] and wrong["verdict"]["fixed_n"]["flagged"], json.dumps(wrong)
    assert wrong["requests_to_decide"] <= 6 and wrong["n_requests"] < 12
    # top-p 1.0 for 0.95, seeds dropped (a smaller change at 0.7: the nucleus's tail is thin): the fixed-size test
    # on all 12 replies flags it (measured p 0.0075, 385 tokens), the anytime-valid verdict needs more replies than
    # 12 (measured p 0.28: not flagged)
    assert wide["verdict"]["fixed_n"]["flagged"] and wide["verdict"]["p_value"] < 0.5, json.dumps(wide)
    claims = [json.loads(x) for x in (out / "vendors" / "no-seed" / "claims.jsonl").read_text().splitlines()]
    assert len(claims) == 12 and all(c["mode"] == "unseeded" and c["sampling"]["seed"] is None
                                     and c["sampling"]["noise"] is None for c in claims)
    table = pq.read_table(out / "vendors" / "no-seed" / "scores.parquet")
    assert set(table["audit_mode"].to_pylist()) == {"unseeded"} and table["pit"].null_count == 0
    # calibrated on verinfer's own honest sampled runs, claimed without their seeds: cached per sampling key
    assert doc["detectors"][key].startswith("PIT uniformity")
    saved = json.loads((out / f"detector-{key}.json").read_text())["calibration"]
    assert saved["tokens"] == {h: 384 for h in ARGS[7:12:2]} and set(saved["claims"].values()) == {12}
    calib = [json.loads(x) for x in (out / f"calibration-{key}" / "honest-bf16-b8.jsonl").read_text().splitlines()]
    assert len(calib) == 12 and all(c["sampling"]["seed"] is None for c in calib)
    # ...and claimed from their text, as a vendor's replies are (the model's ids kept beside, never scored)
    assert all(c["chat"]["tokens"] == "derived" and "returned_output_token_ids" in c["chat"] for c in calib)
    assert doc["modes"] == {"greedy": 0, "seeded": rows["honest"]["n_claims"] + rows["hot"]["n_claims"],
                            "unseeded": 24 + wrong["n_claims"] + wide["n_claims"]}
    md = (out / "vendors.md").read_text()
    assert "Not scored" not in md and "| no-seed | ok | unseeded |" in md and "| hot-no-seed | FLAGGED | unseeded |" in md


def sampled_log(proxy: Proxy, n: int = 8) -> list[str]:
    """A gateway's log: greedy exchanges, seeded ones at 0.7 / 0.95, and sampled ones without a seed."""
    import httpx2 as httpx

    from verinfer.models.prompts import chat_messages

    lines = []
    for i, msgs in enumerate(chat_messages(3 * n, 11)):
        req = {"model": MODEL, "messages": msgs, "max_tokens": 24, "temperature": 0}
        if i % 3 == 1:
            req.update(temperature=0.7, top_p=0.95, seed=1000 + i)
        if i % 3 == 2:
            req.update(temperature=0.7)
        sent = {**req, "seed": 5_000 + i} if i % 3 == 2 else req  # logged without it (reproducible replies)
        resp = {**httpx.post(proxy.url("honest") + "/chat/completions", json=sent, timeout=120).json(),
                "id": f"exchange-{i}"}  # the claim's id (the server's is random; it keys the PIT's uniforms)
        lines.append(json.dumps({"request": req, "response": resp}))
    return lines


def test_a_mixed_log_from_the_cli_and_the_api(proxy, tmp_path):
    """A verdict per mode: greedy and seeded exchanges (the seeded ones with the declared sampler: exact
    match 1.0), and the unseeded ones (no seed: judged by the PIT-uniformity detector calibrated on the
    log's own conversations sampled again locally), none flagged; the same from `verinfer.audit_log`.
    Declaring a wrong sampler flags the seeded ones."""
    import verinfer

    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(sampled_log(proxy)) + "\n")
    out = tmp_path / "audit"
    args = ["audit-log", str(log), "--out", str(out), "--noise", "vllm-cpu", *ARGS[4:]]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "claims by mode: 8 greedy, 8 seeded, 8 unseeded" in r.output
    doc = json.loads((out / "vendors.json").read_text())
    assert doc["modes"] == {"greedy": 8, "seeded": 8, "unseeded": 8} and doc["mode"] == "mixed"
    rows = {v["name"]: v for v in doc["vendors"]}
    key, ukey = f"{MODEL} [seeded-t0.7-p0.95-k-1-m0-vllm-cpu]", f"{MODEL} [unseeded-t0.7-p1-k-1-m0]"
    assert set(rows) == {MODEL, key, ukey} and "unseeded" not in doc
    assert [rows[k]["mode"] for k in (MODEL, key, ukey)] == ["greedy", "seeded", "unseeded"]
    for row in rows.values():
        assert not row["verdict"]["flagged"] and row["n_claims"] == 8, json.dumps(row)
    # seeded: every token (measured 1.0); greedy: one split-K near-tie of 192 tokens (measured 0.9948)
    assert rows[key]["exact_match"] == 1.0 and rows[MODEL]["exact_match"] >= 0.99
    u = rows[ukey]
    assert "8 sampled without a seed" in u["note"] and u["verdict"]["fixed_n"]["score"] == "pit-uniformity"
    assert u["verdict"]["p_value"] > 0.3, json.dumps(u)  # measured 0.55 (fixed-size 0.11)
    claims = (out / "vendors" / f"{MODEL}--unseeded-t0.7-p1-k-1-m0" / "claims.jsonl").read_text().splitlines()
    assert len(claims) == 8 and all(json.loads(x)["sampling"]["seed"] is None for x in claims)
    # the Python API, another directory, the wrong sampler declared: the seeded claims are flagged
    res = verinfer.audit_log(log, out_dir=tmp_path / "api", noise="keyed", calib_n=12,
                             honest=["honest-bf16-b8", "honest-fp32-b4", "honest-bf16-eager-t1"],
                             bands=["bf16", "int4"], unseeded_detector="xent-excess", show_progress=False)
    assert res.modes == {"greedy": 8, "seeded": 8, "unseeded": 8}
    wrong = res.vendor(f"{MODEL} [seeded-t0.7-p0.95-k-1-m0-keyed]")
    assert wrong.flagged and wrong.exact_match < 0.5 and not res.vendor(MODEL).flagged
    # the unseeded exchanges judged by the other unseeded detector, asked by name (measured anytime-valid p 0.09;
    # its fixed-size test, 0.0095, is below 1%: docs/chat-audits.md, unseeded audits, says why)
    judged = res.vendor(ukey)
    assert judged.mode == "unseeded" and judged.flagged is False and judged.verdict["fixed_n"]["score"] == "xent-excess"
    assert res.path.parent.joinpath("detector-unseeded-t0.7-p1-k-1-m0.json").read_text().count("CrossEntropyExcess")


def test_audit_api_chat_at_a_temperature(proxy, tmp_path):
    """`audit-api --chat --temperature 0.7 --top-p 0.95`: one vendor, probed and judged seeded (its
    defaults otherwise the chat audit's: top-k off); the same command at --temperature 0 stays greedy."""
    out = tmp_path / "api"
    args = ["audit-api", "--chat", "--base-url", proxy.url("honest"), "--model", MODEL, "--n", "6", *ARGS[4:]]
    r = CliRunner().invoke(app, [*args, "--out", str(out), "--temperature", "0.7", "--top-p", "0.95"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads((out / "vendors.json").read_text())["vendors"]
    assert row["mode"] == "seeded" and row["probe"]["noise"] == "vllm-cpu" and row["exact_match"] == 1.0
    assert row["sampling"]["top_k"] == -1 and row["n_requests"] == 6 and not row["verdict"]["flagged"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "greedy"), "--max-tokens", "16"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads((tmp_path / "greedy" / "vendors.json").read_text())["vendors"]
    assert row["mode"] == "greedy" and row["probe"] is None and row["sampling"] is None


def test_a_vendor_that_samples_every_request_with_one_seed(proxy, tmp_path):
    """A vendor that overwrites every request's seed with its own (the reply does not change with the seed:
    the probe's `fixed_noise`): at 42 (SGLang deterministic mode's seed, a candidate) it is recognised and
    judged seeded at 42 on every claim, every token matching, not flagged; at 777 (no candidate) it is not
    judged: no verdict, nothing more sent, the note (why, and what to declare) as its error, exit 2 and
    "could not be audited" everywhere, never flagged nor ok; declared in the vendors file (mode seeded,
    fixed_seed 777) it is judged seeded at 777. Before fixed noise was told apart, both were judged unseeded,
    their replies taken for independent draws."""
    cfg = tmp_path / "vendors.toml"
    cfg.write_text(vendors_toml(proxy, FIXED) + f'[[vendor]]\nname = "declared-777"\nbase_url = "{proxy.url("fixed-777")}"'
                   f'\nmodel = "{MODEL}"\nconcurrency = 2\nmode = "seeded"\nnoise = "vllm-cpu"\nfixed_seed = 777\n')
    out = tmp_path / "audit"
    r = CliRunner().invoke(app, ["audit-vendors", str(cfg), "--out", str(out), "--temperature", "0.7",
                                 "--top-p", "0.95", *ARGS])
    assert r.exit_code == 2, r.output  # fixed-777 could not be audited (never 1: nothing is flagged)
    rows = {v["name"]: v for v in json.loads((out / "vendors.json").read_text())["vendors"]}
    f42, f777, declared = rows["fixed-42"], rows["fixed-777"], rows["declared-777"]
    for row in (f42, f777):
        p = row["probe"]
        assert p["fixed_noise"] and p["same_seed_same_reply"] and not p["other_seed_other_reply"], json.dumps(p)
        assert not p["honours_seeds"] and list(p["fixed_seed_exact_match"])[0] == "42"
    assert f42["probe"]["fixed_seed"] == 42 and f42["probe"]["noise"] == "vllm-cpu"
    assert f42["probe"]["fixed_seed_exact_match"]["42"]["vllm-cpu"] == 1.0
    assert f42["mode"] == "seeded" and f42["sampling"] == {"temperature": 0.7, "top_p": 0.95, "top_k": -1,
                                                           "min_p": 0.0, "noise": "vllm-cpu", "fixed_seed": 42}
    # every token but one near-tie of 384 (measured 383 / 384 = 0.9974, as at 777 below), a seeded verdict
    assert round(f42["exact_match"] * 384) >= 383 and not f42["verdict"]["flagged"], json.dumps(f42)
    assert f42["n_requests"] == f42["n_claims"] == 12 and f42["nearest_band"] == "bf16"
    assert f42["note"].startswith("samples every request with seed 42 whatever the request's")
    claims = [json.loads(x) for x in (out / "vendors" / "fixed-42" / "claims.jsonl").read_text().splitlines()]
    assert len(claims) == 12 and {(c["mode"], c["sampling"]["seed"]) for c in claims} == {("seeded", 42)}
    # 777: no candidate seed reproduces its reply (measured best exact match 0.12 at 42, 0.09 at 0) -> not judged
    assert f777["probe"]["fixed_seed"] is None and list(f777["probe"]["fixed_seed_exact_match"]) == ["42", "0"]
    assert max(v for m in f777["probe"]["fixed_seed_exact_match"].values() for v in m.values()) < 0.5
    assert f777["verdict"] is None and f777["exact_match"] is None and f777["n_requests"] == 0
    assert f777["note"].startswith("not judged: its replies do not change with the seed") and f777["error"] == f777["note"]
    assert "an unseeded test, which assumes independent draws, would be invalid" in f777["note"]
    assert 'mode = "seeded", noise = "<its sampler>" and fixed_seed = <the seed' in f777["note"]
    assert not (out / "vendors" / "fixed-777" / "claims.jsonl").exists()
    assert declared["mode"] == "seeded" and declared["probe"] is None and declared["sampling"]["fixed_seed"] == 777
    assert round(declared["exact_match"] * 384) >= 383 and not declared["verdict"]["flagged"], json.dumps(declared)
    md = (out / "vendors.md").read_text()
    assert "| fixed-777 | error: not judged" in md and "| fixed-42 | ok | seeded |" in md and "FLAGGED" not in md
    assert "2 of 3 vendors consistent with honest inference" in (out / "vendors.html").read_text()
    assert "1 could not be audited (fixed-777)" in (out / "vendors.html").read_text()
