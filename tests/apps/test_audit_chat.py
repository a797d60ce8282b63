"""Audits of chat endpoints at temperature 0 (apps.audit_chat): the vendors file, and real `verinfer
serve` processes audited side by side from their text replies: an honest server passes, a smaller
model served under the claimed name is flagged by the sequential audit before all prompts are
sent, a dead vendor is an error row (exit 2) that costs the others nothing; a rerun resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verinfer.apps.audit_chat import read_vendors
from verinfer.errors import VerinferError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "vendors.toml"
    p.write_text(text)
    return p


def test_vendors_file(tmp_path):
    vs = read_vendors(write(tmp_path, '''
[[vendor]]
name = "acme"
base_url = "https://api.acme.example/v1"
model = "org/model"
api_key_env = "ACME_KEY"
concurrency = 8
extra = { provider = { order = ["acme"], allow_fallbacks = false } }
[[vendor]]
name = "self"
base_url = "http://127.0.0.1:8000/v1"
model = "m"
'''))
    assert [v.name for v in vs] == ["acme", "self"] and vs[0].concurrency == 8 and vs[1].api_key_env is None
    assert vs[0].extra == {"provider": {"order": ["acme"], "allow_fallbacks": False}}


@pytest.mark.parametrize("text, message", [
    ('[[vendor]]\nname = "a"\nbase_url = "http://h/v1"\n', "vendor 1: `model` Field required"),
    ('[[vendor]]\nname = "../x"\nbase_url = "http://h/v1"\nmodel = "m"\n', "vendor 1: `name`"),
    ('[[vendor]]\nname = "a"\nbase_url = "ftp://h"\nmodel = "m"\n', "`base_url`"),
    ('[[vendor]]\nname = "a"\nbase_url = "http://h/v1"\nmodel = "m"\napi_key = "sk-1"\n', "`api_key` Extra inputs"),
    ('[[vendor]]\nname = "a"\nbase_url = "http://h/v1"\nmodel = "m"\n[[vendor]]\nname = "a"\n'
     'base_url = "http://h/v1"\nmodel = "m"\n', "vendor names repeat"),
    ("vendor = [", "not valid TOML"),
    ("", "`vendor` Field required"),
])
def test_vendors_file_errors_name_the_vendor_and_field(tmp_path, text, message):
    with pytest.raises(VerinferError, match=message):
        read_vendors(write(tmp_path, text))


def test_exchanges_a_greedy_replay_cannot_use(tmp_path):
    """Kept by the log reader, refused by the replay: another template, a field the chat contract does
    not know (unless declared neutral); a sampled exchange is not refused (judged seeded or recorded
    unseeded by core.sources). A reasoning block is the contract's to render
    (tests/providers/test_chat_contract.py)."""
    from verinfer.providers.chat_log import unusable_for_replay
    from verinfer.providers.chat_log import read_chat_log

    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    resp = {"id": "r", "choices": [{"message": {"content": "Hello"}, "finish_reason": "stop"}]}
    lines = [{"request": req, "response": resp},
             {"request": {**req, "temperature": 0.7}, "response": {**resp, "id": "r2"}},
             {"request": req, "response": {"id": "r3", "choices": [{"message": {"content": "Hi", "reasoning_content":
                                                                                 "think"}, "finish_reason": "stop"}]}},
             {"request": {**req, "chat_template_kwargs": {"enable_thinking": False}}, "response": {**resp, "id": "r4"}},
                 {"request": {**req, "x_gateway_trace": "t-1"}, "response": {**resp, "id": "r5"}}]
    p = tmp_path / "log.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    exchanges = read_chat_log(p)
    kinds = [getattr(unusable_for_replay(ex), "kind", None) for ex in exchanges]
    assert kinds == [None, None, None, "template-fields", "unknown-field"]
    assert "--neutral-field x_gateway_trace" in unusable_for_replay(exchanges[4]).fix
    assert unusable_for_replay(exchanges[4], ("x_gateway_trace",)) is None


# --- real servers (slow) -----------------------------------------------------------------------
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from typer.testing import CliRunner  # noqa: E402

from tests.server.serverproc import Launched  # noqa: E402
from verinfer.cli.main import app  # noqa: E402
from verinfer.models.testbed import DRAFT_DIR  # noqa: E402

ARGS = ["--n", "24", "--max-tokens", "32", "--calib-n", "24", "--honest", "honest-bf16-b8", "--honest",
        "honest-fp32-b4", "--honest", "honest-bf16-eager-t1", "--bands", "bf16", "--bands", "int4"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-servers")
    launched = {"honest": Launched(d, "--max-concurrent", "4"), "draft": Launched(d, "--model", str(DRAFT_DIR))}
    try:
        yield {k: v.ready() for k, v in launched.items()}
    finally:
        for s in launched.values():
            s.stop()


@pytest.mark.slow
def test_vendors_side_by_side(servers, tmp_path, monkeypatch):
    """...and each vendor claim is replayed exactly once (issue 44): the stop rule's replays are the
    parts the final verdict reads."""
    from verinfer.audit import replay

    monkeypatch.setenv("HONEST_VENDOR_KEY", "sk-never-written-anywhere")
    real, replayed = replay.score_chunk, []

    def counting(claims, *a, **kw):
        replayed.extend(c.id for c in claims)
        return real(claims, *a, **kw)

    monkeypatch.setattr(replay, "score_chunk", counting)
    cfg = write(tmp_path, f'''
[[vendor]]
name = "honest"
base_url = "{servers['honest'].base_url}"
model = "verinfer-testbed-target"
api_key_env = "HONEST_VENDOR_KEY"
[[vendor]]
name = "small-model"
base_url = "{servers['draft'].base_url}"
model = "verinfer-testbed-draft"
concurrency = 2
[[vendor]]
name = "dead"
base_url = "http://127.0.0.1:9/v1"
model = "verinfer-testbed-target"
max_retries = 0
''')
    out = tmp_path / "audit"
    r = CliRunner().invoke(app, ["audit-vendors", str(cfg), "--out", str(out), *ARGS])
    assert r.exit_code == 2, r.output  # a vendor could not be audited: an error, never a verdict
    doc = json.loads((out / "vendors.json").read_text())
    rows = {v["name"]: v for v in doc["vendors"]}
    assert not rows["honest"]["verdict"]["flagged"] and rows["honest"]["exact_match"] >= 0.99
    assert rows["honest"]["n_requests"] == 24 and rows["honest"]["nearest_band"] == "bf16"
    small = rows["small-model"]
    assert small["verdict"]["flagged"] and small["requests_to_decide"] <= small["n_requests"] < 24
    assert small["tokens_to_decide"] <= small["n_tokens"] and small["exact_match"] < 0.95
    # the calibrated mismatch-rate test beside it, on the same few claims: never stronger (its fixed-size
    # p-value at least verinfer's; measured 0.015 against 3.4e-5 on 5 replies), never sooner
    mm = small["mismatch_test"]
    assert mm["fixed_n"]["p_value"] >= small["verdict"]["fixed_n"]["p_value"], json.dumps(small)
    assert (mm["tokens_to_decide"] is None or mm["tokens_to_decide"] >= small["tokens_to_decide"])
    assert not rows["honest"]["mismatch_test"]["flagged"] and not rows["honest"]["mismatch_test"]["fixed_n"]["flagged"]
    assert rows["dead"]["verdict"] is None and "cannot reach" in rows["dead"]["error"]
    assert set(doc["bands"]) == {"bf16", "int4"}
    saved = {json.loads(line)["id"] for v in ("honest", "small-model")
             for line in (out / "vendors" / v / "claims.jsonl").read_text().splitlines()}
    vendor_ids = [i for i in replayed if i in saved]
    assert sorted(vendor_ids) == sorted(saved) and len(saved) >= 24 + small["requests_to_decide"], replayed
    for f in out.rglob("*"):  # the key is read from the environment, never written
        if f.is_file():
            assert b"sk-never-written-anywhere" not in f.read_bytes(), f
    claims = (out / "vendors" / "honest" / "claims.jsonl").read_text()
    first = json.loads(claims.splitlines()[0])
    assert first["chat"]["tokens"] == "derived" and first["chat"]["messages"][0]["role"] == "user"
    # rerun with the honest vendor moved to a dead address: every reply is on disk, nothing is
    # requested again, the same verdicts
    cfg.write_text(cfg.read_text().replace(servers["honest"].base_url, "http://127.0.0.1:9/v1"))
    r2 = CliRunner().invoke(app, ["audit-vendors", str(cfg), "--out", str(out), *ARGS])
    again = {v["name"]: v for v in json.loads((out / "vendors.json").read_text())["vendors"]}
    assert again["honest"]["verdict"]["flagged"] is False and again["honest"]["n_requests"] == 24, r2.output
    assert [i for i in replayed if i in saved] == vendor_ids  # nothing replayed again
    assert (out / "vendors" / "honest" / "claims.jsonl").read_text() == claims


def record(base_url: str, model: str, conversations: list, max_tokens: int = 32) -> list[str]:
    """Chat exchanges as a gateway logs them: the request body and the response body, one per line."""
    import httpx2 as httpx

    lines = []
    for msgs in conversations:
        req = {"model": model, "messages": msgs, "temperature": 0, "max_tokens": max_tokens}
        resp = httpx.post(base_url + "/chat/completions", json=req, timeout=120).json()
        lines.append(json.dumps({"request": req, "response": resp}))
    return lines


@pytest.mark.slow
def test_log_audits_end_to_end(servers, tmp_path):
    """`verinfer audit-log`: a row per model the log names (the smaller model's replies flagged), the
    unusable exchanges skipped and counted, the same claims scored by `verinfer score` unchanged."""
    from verinfer.models.prompts import chat_messages

    conv = chat_messages(24, 7)
    lines = record(servers["honest"].base_url, "verinfer-testbed-target", conv)
    lines += record(servers["draft"].base_url, "verinfer-testbed-draft", conv[:12])
    sampled = json.loads(lines[0])
    sampled["request"]["temperature"] = 0.7
    lines += [json.dumps(sampled), json.dumps({"request": {**sampled["request"], "tools": [{"type": "function"}]},
                                               "response": sampled["response"]})]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "audit"
    args = ["audit-log", str(path), "--out", str(out), "--calib-n", "24", "--honest", "honest-bf16-b8", "--honest",
            "honest-fp32-b4", "--honest", "honest-bf16-eager-t1", "--bands", "bf16", "--bands", "int4"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "tools" in r.output  # unusable exchanges stop it, saying which and where
    r = CliRunner().invoke(app, [*args, "--skip-unusable"])
    assert r.exit_code == 1, r.output  # the smaller model's replies are flagged
    assert "skipped 1 exchange(s) of the log: 1 tool-calls" in r.output  # counted on screen too
    # the sampled exchange (no seed) is judged unseeded, in a row of its own (not refused)
    assert "claims by mode: 36 greedy, 0 seeded, 1 unseeded" in r.output
    doc = json.loads((out / "vendors.json").read_text())
    rows = {v["name"]: v for v in doc["vendors"]}
    assert not rows["verinfer-testbed-target"]["verdict"]["flagged"] and rows["verinfer-testbed-target"]["n_requests"] == 24
    assert rows["verinfer-testbed-draft"]["verdict"]["flagged"]
    assert sorted(k for _, k, _ in doc["skipped"]) == ["tool-calls"] and doc["exchanges"] == 37
    assert doc["modes"] == {"greedy": 36, "seeded": 0, "unseeded": 1}
    # its reply is a greedy one claimed at temperature 0.7: too probable for a 0.7 sample, which the fixed-size
    # PIT test on its 32 tokens sees (measured p 6e-12; the anytime-valid one, p 0.046, needs more tokens)
    u = rows["verinfer-testbed-target [unseeded-t0.7-p1-k-1-m0]"]
    assert u["mode"] == "unseeded" and u["n_claims"] == 1 and u["verdict"]["fixed_n"]["flagged"], json.dumps(u)
    claims = out / "vendors" / "verinfer-testbed-target" / "claims.jsonl"
    saved = claims.read_text()
    r = CliRunner().invoke(app, ["score", str(claims), "-o", str(tmp_path / "s.parquet")])
    assert r.exit_code == 0, r.output
    import pyarrow.parquet as pq

    mine = pq.read_table(out / "vendors" / "verinfer-testbed-target" / "scores.parquet")
    assert pq.read_table(tmp_path / "s.parquet")["token_id"].equals(mine["token_id"])
    # the same directory for a changed log: its claims go through the one collector, which refuses a
    # directory holding another collection's claims before any calibration, and keeps what was saved
    path.write_text("\n".join(lines[1:]) + "\n")
    r = CliRunner().invoke(app, [*args, "--skip-unusable"])
    assert r.exit_code == 2 and "holds claims of another audit" in r.output and "new output path" in r.output, r.output
    assert claims.read_text() == saved


@pytest.mark.slow
def test_readme_chat_audit_runs_on_the_shipped_testbed(tmp_path):
    """README "Auditing chat APIs that return text", as a newcomer runs it: `verinfer serve` honest
    and misconfigured (4-bit weights) as two vendors, `verinfer audit-vendors` with every default
    honest configuration and band. The testbed's honest greedy runs agree exactly (no honest
    mismatch to calibrate on): the greedy detector's floored null still gives verdicts, the honest
    vendor passes and the 4-bit one is flagged (exit 1). --no-sequential: every reply is collected and
    judged once; with the sequential stop the in-stream replay (claim by claim) flagged int4 after 34
    requests where the final replay of the same claims in one batch did not (the replay is not batch
    invariant on every machine, and a floored null makes one near-tie count): issue 44's scored-once core."""
    launched = {"honest": Launched(tmp_path), "int4": Launched(tmp_path, "--misconfig", "int4")}
    try:
        urls = {k: v.ready().base_url for k, v in launched.items()}
        cfg = write(tmp_path, "".join(f'[[vendor]]\nname = "{k}"\nbase_url = "{u}"\nmodel = "verinfer-testbed-target"\n'
                                      for k, u in urls.items()))
        out = tmp_path / "audit"
        r = CliRunner().invoke(app, ["audit-vendors", str(cfg), "--out", str(out), "--n", "128", "--max-tokens", "32",
                                     "--no-sequential"])
    finally:
        for s in launched.values():
            s.stop()
    assert r.exit_code == 1, r.output
    doc = json.loads((out / "vendors.json").read_text())
    rows = {v["name"]: v for v in doc["vendors"]}
    assert not rows["honest"]["verdict"]["flagged"] and rows["int4"]["verdict"]["flagged"]
    assert "greedy" in doc["detector"]["summary"]
