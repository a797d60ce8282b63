"""`audit-api --mode auto` recognises the noise backend an endpoint samples with: `verinfer serve`
(the app in process, reached through the official openai client) started with each of its noise
backends; the seed probe's reply replayed by the trusted model under every known backend picks
that one (issue 36)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient

from verinfer.core.completions import ApiAuditConfig, PLAIN_NOISES, probe_params, recognise_noise
from verinfer.apps.pipeline import verifier_engine
from verinfer.models.load import model_info
from verinfer.models.prompts import prompts_for
from verinfer.models.testbed import TARGET_DIR
from verinfer.providers.openai_http import probe_seed_replies
from verinfer.server import app as server_app
from verinfer.server.registry import load_registry

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")
MODEL = "verinfer-testbed-target"


@pytest.fixture(scope="module")
def served():
    return load_registry(TARGET_DIR)


@pytest.fixture(scope="module")
def engine():
    return verifier_engine(TARGET_DIR)


@pytest.mark.parametrize("noise", PLAIN_NOISES)
def test_auto_mode_recognises_the_servers_noise(noise, served, engine, tmp_path):
    assert {"vllm-mrv2-gumbel-fp32", "vllm-mrv2-philox-fp64", "keyed", "vllm-cpu"} <= set(PLAIN_NOISES)
    app = server_app.create_app(served, server_app.ServeConfig(TARGET_DIR, noise=noise))
    cfg = ApiAuditConfig("http://testserver/v1", MODEL, TARGET_DIR, tmp_path)  # --noise left at its default
    client = openai.OpenAI(base_url=cfg.base_url, api_key="EMPTY", http_client=TestClient(app), max_retries=0)
    info = model_info(TARGET_DIR)
    probe = probe_params(cfg)
    p_ids, a, b = probe_seed_replies(client, cfg.endpoint, prompts_for(TARGET_DIR, 1, cfg.seed)[0], probe,
                                     vocab_size=info.vocab_size)
    assert a == b and len(a) == 16  # the server honours seeds: auto mode goes seeded
    candidates = (cfg.noise,) + tuple(n for n in PLAIN_NOISES if n != cfg.noise)  # as audit_api orders them
    best, rates = recognise_noise(p_ids, a, probe, engine, info.name, candidates)
    # SGLang's two backends are one sampler when the request filters (both take its sorted path):
    # the probe (top_k 50, top_p 0.95) cannot tell them apart, and names the first of the two
    same = {noise}
    if noise.startswith("sglang-seeded") and (probe.top_k > 0 or probe.top_p < 1):
        same = {"sglang-seeded", "sglang-seeded-sorted"}
        assert rates["sglang-seeded"] == rates["sglang-seeded-sorted"], rates
    assert best in same and best == min(same), json.dumps(rates)
    assert rates[noise] >= 15 / 16 and max(r for n, r in rates.items() if n not in same) < rates[noise], rates


def test_auto_mode_tells_sglang_paths_apart_without_filters(served, engine, tmp_path):
    """Unfiltered requests: SGLang's unfiltered and sorted paths draw different tokens, and the probe
    names the one the server samples with; a probe with min-p leaves SGLang's backends out (they
    refuse it) instead of failing. The sorted path reads the noise by rank over the whole vocabulary,
    so the verifier's replay (logits within ~0.1 of the server's decode here) reproduces fewer of its
    tokens than of the unfiltered path's (14 of 16 against 16): a tail token's rank moves with tiny
    logit differences, and its noise with it."""
    for noise in ("sglang-seeded", "sglang-seeded-sorted"):
        app = server_app.create_app(served, server_app.ServeConfig(TARGET_DIR, noise=noise))
        cfg = ApiAuditConfig("http://testserver/v1", MODEL, TARGET_DIR, tmp_path, top_k=-1, top_p=1.0, noise=noise)
        client = openai.OpenAI(base_url=cfg.base_url, api_key="EMPTY", http_client=TestClient(app), max_retries=0)
        info = model_info(TARGET_DIR)
        probe = probe_params(cfg)
        p_ids, a, b = probe_seed_replies(client, cfg.endpoint, prompts_for(TARGET_DIR, 1, cfg.seed)[0], probe,
                                         vocab_size=info.vocab_size)
        assert a == b
        best, rates = recognise_noise(p_ids, a, probe, engine, info.name, ("sglang-seeded", "sglang-seeded-sorted"))
        other = "sglang-seeded" if noise == "sglang-seeded-sorted" else "sglang-seeded-sorted"
        floor = 0.8 if noise == "sglang-seeded-sorted" else 15 / 16   # rank-addressed: see the docstring
        assert best == noise and rates[noise] >= floor and rates[other] < 0.5, rates
    with_min_p = probe_params(ApiAuditConfig("http://testserver/v1", MODEL, TARGET_DIR, tmp_path, min_p=0.05))
    _, rates = recognise_noise(p_ids, a, with_min_p, engine, info.name, PLAIN_NOISES)
    assert set(rates) == set(PLAIN_NOISES) - {"sglang-seeded", "sglang-seeded-sorted"}
