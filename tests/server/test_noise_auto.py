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
    assert best == noise, json.dumps(rates)
    assert rates[noise] >= 15 / 16 and max(r for n, r in rates.items() if n != noise) < rates[noise], rates
