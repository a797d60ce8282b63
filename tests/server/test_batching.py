"""`verinfer serve --batching continuous`: greedy requests of one model share one running batch.

The batch runs the determinism scheduler's loop (same tokens as `Scheduler` on the same requests).
With `--deterministic best` every request's tokens and logprobs are its batch-of-one answer; with
`--deterministic margingate` its tokens are (the fixed-shape path's, best's); in bf16 the batch
effects flip near-ties. Streaming, stops, usage, limits, sampled requests (alone, seeded), loop
errors and shutdown. In process (httpx over ASGI, or the Batcher itself).
"""

from __future__ import annotations

import asyncio
import json
import queue

import pytest

pytest.importorskip("fastapi")

import httpx2 as httpx

from verinfer.determinism.invariant import fixed_shape_model
from verinfer.determinism.scheduler import Scheduler
from verinfer.engine.engine import Engine, Request
from verinfer.errors import VerinferError
from verinfer.models.prompts import prompts_for
from verinfer.models.testbed import TARGET_DIR
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams
from verinfer.server import app as server_app
from verinfer.server.app import ServeConfig, create_app
from verinfer.server.batching import PREFILL_CHUNK, Batcher, BatchError
from verinfer.server.protocol import Limits
from verinfer.server.registry import load_registry
from tests.server.test_inprocess import post_then_disconnect

MODEL = "target"
N = 8
MAX_TOKENS = (5, 17, 9, 30, 12, 3, 25, 20)   # mixed, with the prompts' mixed lengths (12-45 tokens)
TIMEOUT_S = 60
TAU_MARGINGATE = 0.5  # twice the paper's SmolLM2 tau: exact on these requests, about 1 step in 3 verified


@pytest.fixture(scope="module")
def prompts():
    return prompts_for(TARGET_DIR, N, seed=3)


class Registries(dict):
    """mode -> the testbed's registry, loaded at first use (best certifies its kernels: seconds);
    margingate serves the bf16 registry's models."""

    def __missing__(self, mode: str):
        self[mode] = (self["bf16"] if mode == "margingate"
                      else load_registry(TARGET_DIR, deterministic="best" if mode == "best" else None))
        return self[mode]


@pytest.fixture(scope="module")
def registries():
    return Registries()


def make_app(registries, mode: str, **cfg):
    """The app of `mode` ("bf16", "best" or "margingate") with the given ServeConfig fields."""
    det = None if mode == "bf16" else mode
    return create_app(registries[mode], ServeConfig(TARGET_DIR, deterministic=det, **cfg))


def batchers(app) -> list[Batcher]:
    return list(app.app.state.batchers.values())  # app is the BodyLimit middleware around FastAPI


@pytest.fixture
def apps(registries):
    """{(mode, batching): app}; every batch loop stopped after the test."""
    made = {}

    def get(mode: str, batching: str = "continuous", **cfg):
        key = (mode, batching, tuple(sorted(cfg.items())))
        if key not in made:
            made[key] = make_app(registries, mode, batching=batching, **cfg)
        return made[key]

    yield get
    for a in made.values():
        for b in batchers(a):
            b.stop()


def post_all(app, bodies: list[dict], path: str = "/v1/completions", concurrent: bool = True) -> list:
    """POST every body to the app (all in flight at once, or one after the other): the responses."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=TIMEOUT_S) as c:
            if concurrent:
                return await asyncio.gather(*[c.post(path, json=b) for b in bodies])
            return [await c.post(path, json=b) for b in bodies]
    return asyncio.run(go())


def greedy_bodies(prompts, **extra) -> list[dict]:
    return [dict(model=MODEL, prompt=p, max_tokens=m, temperature=0, **extra) for p, m in zip(prompts, MAX_TOKENS)]


def choice(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def sse_events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# --- the Batcher itself ---------------------------------------------------------------------------
def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def run_batcher(batcher: Batcher, reqs: list[tuple[str, list[int], int]], **kw) -> dict[str, list]:
    """Queue every (id, prompt, max_tokens) before the loop starts (so the first admission takes
    them in order, as Scheduler does), run, and return {id: [Step, ...]}."""
    q: queue.Queue = queue.Queue()
    for rid, p, m in reqs:
        batcher.submit(rid, p, greedy(m), lambda item, rid=rid: q.put((rid, item)), **kw)
    batcher.start()
    out: dict[str, list] = {rid: [] for rid, _, _ in reqs}
    open_ = set(out)
    while open_:
        rid, item = q.get(timeout=TIMEOUT_S)
        if isinstance(item, BatchError):
            raise item
        out[rid].append(item)
        if item.finish_reason is not None:
            open_.discard(rid)
    return out


def test_bf16_batch_gives_the_scheduler_bf16_tokens(registries, prompts):
    """The bf16 loop is Scheduler.steps with the bf16 policy (fast engine, chunked prefill): the
    same requests in the same order give the same tokens, as rows finish and newcomers join the
    running batch (max_batch 3 < 8 requests)."""
    max_batch = 3
    b = Batcher(registries["bf16"][MODEL], max_batch=max_batch)
    try:
        reqs = [(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
        got = run_batcher(b, reqs, ignore_eos=True)
    finally:
        b.stop()
    assert b.peak_rows == max_batch
    # determinism.scheduler.make_engines' fast engine, over the weights already loaded (same bits)
    fast = Engine(b.model.engine.model, Numerics(dtype="bf16", prefill_chunk=PREFILL_CHUNK), eos_token_id=None)
    want, _ = Scheduler(fast, fast, "bf16", max_batch=max_batch).run([Request(r, p, greedy(m)) for r, p, m in reqs])
    assert {r: [s.token_id for s in steps] for r, steps in got.items()} == want
    assert all(steps[-1].finish_reason == "length" for steps in got.values())


def test_bf16_batch_effects_flip_some_tokens_against_the_batch_of_one(registries, prompts):
    """The reason for batching: in bf16 a request decoded among others is not always its batch-of-one
    answer (a near-tie flips), alone in the batch it is."""
    model = registries["bf16"][MODEL]
    reqs = [(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
    b = Batcher(model, max_batch=16)
    try:
        together = run_batcher(b, reqs, ignore_eos=True)
        alone = {r: run_batcher(b, [(r, p, m)], ignore_eos=True)[r] for r, p, m in reqs}
    finally:
        b.stop()
    differ = [r for r in together if [s.token_id for s in together[r]] != [s.token_id for s in alone[r]]]
    assert 1 <= len(differ) < N


def test_each_row_stops_at_its_own_stop_token_unless_it_ignores_eos(registries, prompts):
    """A row stops at a stop token ("stop", the token included) unless its request ignores EOS;
    max_tokens ends it otherwise ("length"). The stop set is set to a token the greedy answer holds."""
    b = Batcher(registries["best"][MODEL], max_batch=4, deterministic="best")
    try:
        full = run_batcher(b, [("x", prompts[0], 20)], ignore_eos=True)["x"]
        tok = full[6].token_id
        cut = [s.token_id for s in full].index(tok) + 1
        b.eos_ids = frozenset({tok})
        stops = run_batcher(b, [("s", prompts[0], 20), ("o", prompts[1], 9)])
        ignores = run_batcher(b, [("i", prompts[0], 20)], ignore_eos=True)
    finally:
        b.stop()
    assert [s.token_id for s in stops["s"]] == [s.token_id for s in full][:cut]
    assert stops["s"][-1].finish_reason == "stop" and all(s.finish_reason is None for s in stops["s"][:-1])
    assert [s.token_id for s in ignores["i"]] == [s.token_id for s in full]
    assert ignores["i"][-1].finish_reason == "length"


def test_a_failing_step_fails_its_requests_with_a_clear_error_and_the_loop_goes_on(registries, prompts, monkeypatch):
    b = Batcher(registries["best"][MODEL], deterministic="best")
    try:
        with monkeypatch.context() as m:
            m.setattr(b.engine, "advance", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
            with pytest.raises(BatchError, match="batched decode step of model 'verinfer-testbed-target': RuntimeError: boom"):
                run_batcher(b, [("a", prompts[0], 5), ("b", prompts[1], 5)])
        assert b.running and b.rows == 0
        ok = run_batcher(b, [("c", prompts[0], 5)])
        assert len(ok["c"]) == 5
    finally:
        b.stop()
    assert not b.running


# --- over HTTP ------------------------------------------------------------------------------------
def test_best_batched_requests_equal_each_alone_tokens_and_logprobs(apps, prompts):
    """(a) --deterministic best: 8 concurrent greedy requests of mixed prompt lengths and
    max_tokens, decoded in one batch, give exactly their batch-of-one tokens, logprobs and top-k."""
    bodies = greedy_bodies(prompts, logprobs=3)
    alone = [choice(r) for r in post_all(apps("best", "alone"), bodies, concurrent=False)]
    app = apps("best")
    batched = [choice(r) for r in post_all(app, bodies)]
    assert batchers(app)[0].peak_rows > 1
    for a, b in zip(alone, batched):
        assert b["token_ids"] == a["token_ids"] and len(a["token_ids"]) in MAX_TOKENS
        assert b["logprobs"] == a["logprobs"]
        assert b["finish_reason"] == a["finish_reason"] == "length"


def test_margingate_batched_requests_get_the_deterministic_reference_tokens(apps, prompts):
    """--deterministic margingate: 8 concurrent greedy requests of mixed prompt lengths and
    max_tokens, decoded in one bf16 batch (split-K numerics: batch effects flip near-ties, see the
    bf16 test), give exactly the deterministic reference's tokens: the fixed-shape path's
    batch-of-one answer, what a `--deterministic best` server gives each alone. Streamed the same."""
    bodies = greedy_bodies(prompts, logprobs=1)
    reference = [choice(r)["token_ids"] for r in post_all(apps("best", "alone"), bodies, concurrent=False)]
    app = apps("margingate", tau=TAU_MARGINGATE)
    batched = [choice(r) for r in post_all(app, bodies)]
    (b,) = batchers(app)
    assert b.peak_rows > 1 and b.scheduler.policy_name == "margingate"
    assert [c["token_ids"] for c in batched] == reference
    assert all(c["finish_reason"] == "length" and c["logprobs"] is not None for c in batched)
    assert 0 < b.stats.triggered < b.stats.protected_steps / 2, b.stats.rates()  # sparse: most steps not verified
    assert b.stats.repaired > 0  # the bf16 batch flipped a near-tie (2 of these 8 requests differ in bf16)
    streams = post_all(app, greedy_bodies(prompts, stream=True))
    assert [[t for e in sse_events(r) if e["choices"] for t in e["choices"][0]["token_ids"]]
            for r in streams] == reference


def test_margingate_batch_is_the_scheduler_margingate_loop(registries, prompts):
    """The server's margingate batch is Scheduler.loop with the margingate policy on the same
    engines: the same requests in the same order give the same tokens and the same verifications
    (max_batch 3 < 8 requests: rows leave, newcomers join, the cache grows for them)."""
    b = Batcher(registries["bf16"][MODEL], max_batch=3, deterministic="margingate", tau=TAU_MARGINGATE)
    try:
        reqs = [(f"r{i}", p, m) for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
        got = run_batcher(b, reqs, ignore_eos=True)
    finally:
        b.stop()
    m = b.model.engine.model
    fast = Engine(m, b.model.engine.numerics.with_(prefill_chunk=PREFILL_CHUNK), eos_token_id=None)
    det = Engine(fixed_shape_model(m), b.model.engine.numerics.with_(prefill_chunk=None), eos_token_id=None)
    want, st = Scheduler(fast, det, "margingate", tau=TAU_MARGINGATE, max_batch=3).run(
        [Request(r, p, greedy(n)) for r, p, n in reqs])
    assert {r: [s.token_id for s in steps] for r, steps in got.items()} == want
    assert (b.stats.triggered, b.stats.repaired) == (st.triggered, st.repaired) and st.triggered > 0


def test_margingate_needs_continuous_batching_and_a_calibrated_tau(registries, tmp_path):
    with pytest.raises(VerinferError, match="--batching continuous"):
        ServeConfig(TARGET_DIR, deterministic="margingate")
    with pytest.raises(ValueError, match="determinism calibrate --policy margingate"):
        make_app(registries, "margingate", batching="continuous", tau_file=tmp_path / "none.json")


def test_streaming_and_non_streaming_in_one_batch(apps, prompts):
    """(c) completions and chat, streamed (SSE, with usage) and not, all in flight together: the
    streamed tokens are the non-streamed ones (best: the batch does not change them), usage counts
    them, the last chunk carries the finish reason."""
    app = apps("best")
    plain = [choice(r) for r in post_all(app, greedy_bodies(prompts[:4]))]
    streams = post_all(app, greedy_bodies(prompts[:4], stream=True, stream_options={"include_usage": True}))
    for i, (p, r) in enumerate(zip(plain, streams)):
        ev = sse_events(r)
        ids = [t for e in ev if e["choices"] for t in e["choices"][0]["token_ids"]]
        assert ids == p["token_ids"]
        assert [e["choices"][0]["finish_reason"] for e in ev if e["choices"]][-1] == "length"
        assert ev[-1]["usage"]["completion_tokens"] == MAX_TOKENS[i]
        assert ev[-1]["usage"]["prompt_tokens"] == len(prompts[i])
    msgs = [{"role": "user", "content": "hello there"}]
    chat = dict(model=MODEL, messages=msgs, max_tokens=7, temperature=0, ignore_eos=True)
    c_plain, c_stream = post_all(app, [chat, {**chat, "stream": True}], "/v1/chat/completions")
    assert c_plain.status_code == 200, c_plain.text
    body = c_plain.json()
    assert body["usage"]["completion_tokens"] == 7 and body["choices"][0]["finish_reason"] == "length"
    ids = [t for e in sse_events(c_stream) if e.get("choices") for t in e["choices"][0].get("token_ids", [])]
    assert ids == body["choices"][0]["token_ids"]


def test_several_prompts_in_one_completions_request_share_the_batch(apps, prompts):
    app = apps("best")
    r = post_all(app, [dict(model=MODEL, prompt=prompts[:3], max_tokens=6, temperature=0)])[0]
    assert r.status_code == 200, r.text
    one = [choice(x)["token_ids"] for x in post_all(app, [dict(model=MODEL, prompt=p, max_tokens=6, temperature=0)
                                                          for p in prompts[:3]])]
    assert [c["token_ids"] for c in r.json()["choices"]] == one
    assert r.json()["usage"]["completion_tokens"] == 18


def test_a_sampled_request_runs_alone_with_its_seeded_tokens(apps, prompts):
    """(d) a seeded sampled request in batching mode (sent among greedy ones) gets the tokens it gets
    from an unbatched server: it never joins the batch."""
    sampled = dict(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0.9, seed=7, top_k=50)
    want = choice(post_all(apps("bf16", "alone"), [sampled])[0])["token_ids"]
    app = apps("bf16")
    rs = post_all(app, [sampled, *greedy_bodies(prompts[1:4])])
    assert choice(rs[0])["token_ids"] == want
    assert rs[0].json()["sampling"]["seed"] == 7
    assert all(r.status_code == 200 for r in rs)


def test_queued_batch_requests_count_against_max_waiting(apps, prompts):
    """max_batch 1: one row runs, the others queue to join; past max_waiting queued, HTTP 503."""
    app = apps("best", max_batch=1, limits=Limits(max_waiting=2))
    rs = post_all(app, [dict(model=MODEL, prompt=prompts[0], max_tokens=40, temperature=0, ignore_eos=True)] * 6)
    codes = [r.status_code for r in rs]
    assert codes[:2] == [200, 200] and 503 in codes, codes  # the first two always find room to queue
    busy = next(r for r in rs if r.status_code == 503).json()["error"]
    assert busy["type"] == "server_busy" and "limit 2" in busy["message"]
    ok = [choice(r)["token_ids"] for r in rs if r.status_code == 200]
    assert all(t == ok[0] for t in ok) and len(ok[0]) == 40


def test_a_loop_error_is_a_clear_503_not_a_hang(apps, prompts, monkeypatch):
    app = apps("best")
    monkeypatch.setattr(batchers(app)[0].engine, "emit", lambda *a: (_ for _ in ()).throw(RuntimeError("kaput")))
    r, s = post_all(app, [greedy_bodies(prompts[:1])[0], {**greedy_bodies(prompts[:1])[0], "stream": True}])
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "batch_failed" and "RuntimeError: kaput" in err["message"] and "retry" in err["message"]
    assert s.status_code == 200 and "kaput" in s.text and s.text.endswith("data: [DONE]\n\n")


def test_server_shutdown_stops_the_batch_threads(registries, prompts):
    from fastapi.testclient import TestClient

    app = make_app(registries, "bf16", batching="continuous")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json=greedy_bodies(prompts[:1])[0])
        assert r.status_code == 200, r.text
        (b,) = batchers(app)
        assert b.running
    assert not b.running
    with pytest.raises(BatchError, match="shutting down"):
        b.submit("late", prompts[0], greedy(2), lambda item: None)


def test_alone_is_the_default_and_bad_settings_name_the_option(registries):
    assert ServeConfig(TARGET_DIR).batching == "alone"
    assert batchers(make_app(registries, "bf16")) == []
    with pytest.raises(VerinferError, match="--batching"):
        ServeConfig(TARGET_DIR, batching="dynamic")
    with pytest.raises(VerinferError, match="--max-batch"):
        ServeConfig(TARGET_DIR, batching="continuous", max_batch=0)
    with pytest.raises(ValueError, match="only greedy"):
        Batcher(registries["bf16"][MODEL]).submit("s", [1, 2], SamplingParams(1.0, seed=1, max_tokens=2),
                                                  lambda item: None)


def test_the_cli_passes_batching_and_max_batch_to_the_server(monkeypatch):
    from typer.testing import CliRunner

    from verinfer.cli.main import app as cli

    seen = {}
    monkeypatch.setattr(server_app, "serve", lambda cfg, **kw: seen.update(cfg=cfg))
    r = CliRunner().invoke(cli, ["serve", "--batching", "continuous", "--max-batch", "4"])
    assert r.exit_code == 0, r.output
    assert (seen["cfg"].batching, seen["cfg"].max_batch) == ("continuous", 4)
    r = CliRunner().invoke(cli, ["serve", "--batching", "continuous", "--deterministic", "margingate",
                                 "--tau-file", "t.json"])
    assert r.exit_code == 0, r.output
    assert (seen["cfg"].deterministic, str(seen["cfg"].tau_file)) == ("margingate", "t.json")
    r = CliRunner().invoke(cli, ["serve", "--batching", "dynamic"])
    assert r.exit_code == 2 and "continuous" in r.output


def test_a_disconnected_client_leaves_the_batch(apps, monkeypatch):
    """A non-streaming client that goes away right after its request: its row leaves the batch
    within a step or two (499), instead of decoding 200 tokens for nobody."""
    app = apps("best")
    b = batchers(app)[0]
    emitted = []
    real = b.engine.emit
    monkeypatch.setattr(b.engine, "emit", lambda batch, *a: emitted.append(1) or real(batch, *a))
    out = post_then_disconnect(app, "/v1/completions", {"model": MODEL, "prompt": [5, 6], "max_tokens": 200,
                                                        "temperature": 0, "ignore_eos": True})
    assert out[0]["status"] == 499
    b.stop()  # after the step in flight: no more steps for the cancelled row
    assert 1 <= len(emitted) <= 3, f"{len(emitted)} steps decoded for a client that was gone"


def test_serve_on_a_port_in_use_is_a_usage_error_before_any_model_loads():
    """Issue 45 (hostile-input 6): `verinfer serve` on a port another process listens on exited 3
    (uvicorn's own code, verinfer's "internal error"); now exit 2 naming --port, nothing loaded."""
    import socket

    from typer.testing import CliRunner

    from verinfer.cli.main import app as cli

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = CliRunner().invoke(cli, ["serve", "--port", str(port)])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.output and "--port" in r.output, r.output
