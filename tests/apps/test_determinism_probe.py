"""`verinfer determinism probe`: the comparison and classification on hand-made sequences, the
conditions' waves, the whole probe against scripted endpoints whose numerics depend on the batch
(near-tie flips) or that sample when asked for greedy (large-margin divergences), and real
`verinfer serve` processes on loopback (bf16 and --deterministic best)."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from typer.testing import CliRunner

from verinfer.apps import determinism_probe as P
from verinfer.apps.determinism_probe import ProbeConfig
from verinfer.cli.main import app
from verinfer.determinism import probe_plan
from verinfer.determinism.probe import (LARGE_CLASS, NEAR_TIE_CLASS, NO_MARGIN_CLASS, Reply, classify, compare,
                                        condition_result, first_divergence, top2_margin)
from verinfer.errors import VerinferError
from verinfer.providers import logprobs_http


def reply(tokens, margins) -> Reply:
    return Reply(tuple(tokens), tuple(f"t{t}" for t in tokens), tuple(margins))


# --- comparison and classification ----------------------------------------------------------------
def test_top2_margin_is_top1_minus_top2_logprob():
    assert top2_margin({"a": -0.1, "b": -2.6, "c": -3.0}) == pytest.approx(2.5)
    assert top2_margin({"b": -2.6, "a": -0.1}) == pytest.approx(2.5)   # order of the dict does not matter
    assert top2_margin({"a": -0.1}) is None and top2_margin(None) is None


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2          # one sequence ended first
    assert first_divergence([], []) is None


def test_identical_sequences_are_no_flip():
    assert compare(0, reply([5, 6, 7], [3.0, 0.2, 4.0]), reply([5, 6, 7], [3.0, 0.2, 4.0])) is None


def test_a_near_tie_flip_is_reported_at_its_first_divergence_with_the_reference_margin():
    ref = reply([5, 6, 7, 8], [3.0, 0.25, 4.0, 2.0])
    got = reply([5, 9, 7, 1], [3.0, 0.1, 4.0, 2.0])  # later differences do not move the first one
    f = compare(3, ref, got)
    assert (f.prompt, f.position, f.reference_token, f.token) == (3, 1, 6, 9)
    assert (f.reference_text, f.text) == ("t6", "t9")
    assert f.margin == pytest.approx(0.25) and f.margin_here == pytest.approx(0.1)
    assert f.cls == NEAR_TIE_CLASS


def test_a_large_margin_divergence_and_an_unknown_margin():
    f = compare(0, reply([5, 6, 7], [3.0, 6.5, 4.0]), reply([5, 6, 2], [3.0, 6.5, 0.0]))
    assert (f.position, f.margin, f.cls) == (2, pytest.approx(4.0), LARGE_CLASS)
    g = compare(0, reply([5, 6], [3.0, None]), reply([5, 1], [3.0, 0.5]))
    assert (g.position, g.margin, g.cls) == (1, None, NO_MARGIN_CLASS)
    h = compare(0, reply([5, 6, 7], [3.0, 6.5, 0.5]), reply([5, 6], [3.0, 6.5]))  # stopped early
    assert (h.position, h.reference_token, h.token, h.text, h.cls) == (2, 7, None, None, NEAR_TIE_CLASS)


def test_classify_threshold():
    assert [classify(m) for m in (0.0, 0.999, 1.0, 7.0, None)] == [NEAR_TIE_CLASS, NEAR_TIE_CLASS, LARGE_CLASS,
                                                                  LARGE_CLASS, NO_MARGIN_CLASS]
    assert classify(1.5, near_tie=2.0) == NEAR_TIE_CLASS


def test_condition_result_counts_sequences_divergent_and_classes():
    refs = [reply([1, 2], [0.5, 0.5]), reply([3, 4], [2.0, 9.0]), reply([5], [1.0])]
    got = [reply([1, 9], [0.5, 0.5]), reply([8, 4], [2.0, 9.0]), reply([5], [1.0])]
    c = condition_result(refs, got)
    assert (c.sequences, c.divergent_sequences) == (3, 2)
    assert [(f["prompt"], f["position"], f["class"]) for f in c.flips] == [(0, 1, NEAR_TIE_CLASS), (1, 0, LARGE_CLASS)]
    assert c.classes == {NEAR_TIE_CLASS: 1, LARGE_CLASS: 1}


# --- the conditions' waves ------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_concurrent_waves_hold_batch_requests_and_every_probe_prompt_once(batch):
    waves = probe_plan.concurrent_waves(10, 8, batch, n_fillers=8)
    assert all(len(w) == batch for w in waves)
    ours = sorted(j.ours for w in waves for j in w if j.ours is not None)
    assert ours == list(range(10))
    assert all(sum(j.ours is not None for j in w) <= max(1, (batch + 1) // 2) for w in waves)


def test_the_plan_sends_every_probe_prompt_once_per_condition():
    cfg = ProbeConfig("http://x/v1", "m", n=6, batch_sizes=(1, 4))
    conds = probe_plan.plan(cfg.n, cfg.max_tokens, cfg.batch_sizes, n_fillers=8, seed=cfg.seed)
    assert list(conds) == ["reference", "alone", "concurrent-1", "concurrent-4", "shared-prefix", "mixed-traffic"]
    for name, waves in conds.items():
        assert sorted(j.ours for w in waves for j in w if j.ours is not None) == list(range(6)), name
    assert all(len(w) == 1 for w in conds["alone"])
    mixed = [j for w in conds["mixed-traffic"] for j in w if j.ours is None]
    assert all(j.temperature == 1.0 and j.max_tokens == probe_plan.MIXED_LENGTH_FACTOR * cfg.max_tokens for j in mixed)
    shared = [j for w in conds["shared-prefix"] for j in w if j.ours is None]
    assert {j.prompt[0] for j in shared} == {"extend"}


def test_bad_settings_are_refused_naming_the_option():
    with pytest.raises(VerinferError, match="--batch-sizes"):
        P.parse_batch_sizes("1,x")
    assert P.parse_batch_sizes("1, 4,16,4") == (1, 4, 16)
    with pytest.raises(VerinferError, match="--batch-sizes"):
        ProbeConfig("http://x/v1", "m", batch_sizes=(0,))
    with pytest.raises(VerinferError, match="--n"):
        ProbeConfig("http://x/v1", "m", n=0)


# --- scripted endpoints ---------------------------------------------------------------------------
VOCAB = 40


class ScriptedEndpoint:
    """A stand-in for the openai client: a deterministic toy 'model' whose logits are a hash of the
    prompt and prefix. With `batch_noise`, a request that finds others in flight gets its logits
    moved by up to that much (batch-variant kernels: only near-ties can flip); with `bug_rate`, such
    a request picks the runner-up at that rate wherever its margin is over 3 (a large-margin bug).
    Every third position is confident (one token 8 logits up)."""

    def __init__(self, batch_noise: float = 0.0, bug_rate: float = 0.0, logprobs: bool = True):
        self.batch_noise, self.bug_rate, self.logprobs = batch_noise, bug_rate, logprobs
        self.in_flight, self.lock, self.calls = 0, threading.Lock(), 0
        self.completions, self.models = self, self

    def list(self):
        return [type("M", (), {"id": "toy"})()]

    def create(self, *, model, prompt, max_tokens, temperature, logprobs, seed=None, extra_body=None):
        with self.lock:
            self.in_flight += 1
            self.calls += 1
            batched = self.in_flight > 1
        try:
            time.sleep(0.03)  # a wave's requests overlap
            with self.lock:
                batched = batched or self.in_flight > 1
            return self._reply(prompt, max_tokens, batched, temperature, seed)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _reply(self, prompt, max_tokens, batched, temperature, seed):
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        noise = random.Random()
        ids, tops = [], []
        for t in range(max_tokens):
            rng = random.Random(hash((key, tuple(ids))))
            logits = [rng.gauss(0, 2) for _ in range(VOCAB)]
            if t % 3 == 0:  # a confident position: margins of several logits
                logits[rng.randrange(VOCAB)] += 8
            if batched:
                logits = [x + noise.uniform(-self.batch_noise, self.batch_noise) for x in logits]
            order = sorted(range(VOCAB), key=lambda i: -logits[i])
            tok = order[0]
            if temperature > 0:
                tok = random.Random(hash((seed, t))).choice(order[:5])
            elif batched and logits[order[0]] - logits[order[1]] > 3 and noise.random() < self.bug_rate:
                tok = order[1]
            lse = max(logits)
            ids.append(tok)
            tops.append({f"t{i}": logits[i] - lse for i in order[:2]})
        choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": ids,
                  "logprobs": {"tokens": [f"t{i}" for i in ids], "top_logprobs": tops} if self.logprobs else None}
        return type("R", (), {"model_dump": lambda self_: {"choices": [choice]}})()


def probe_with(monkeypatch, tmp_path, endpoint, **kw):
    monkeypatch.setattr(logprobs_http, "openai_client", lambda e: endpoint)
    cfg = ProbeConfig("http://toy/v1", "toy", tmp_path / "probe", **{"n": 8, "max_tokens": 24, **kw})
    return P.run_probe(cfg, show_progress=False)


def test_a_deterministic_endpoint_shows_no_divergence(monkeypatch, tmp_path):
    res = probe_with(monkeypatch, tmp_path, ScriptedEndpoint())
    assert res.sequences == 8 * 6 and res.divergent_sequences == 0
    doc = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert doc["divergent_sequences"] == 0 and doc["flips"] == [] and doc["compared_on"] == "token_ids"
    assert "deterministic on this probe" in (tmp_path / "probe" / "probe.md").read_text()


def test_batch_variant_numerics_give_near_tie_flips_only_under_concurrency(monkeypatch, tmp_path):
    noise = 0.15
    res = probe_with(monkeypatch, tmp_path, ScriptedEndpoint(batch_noise=noise), n=12, batch_sizes=(1, 4, 16))
    conds = res.conditions
    assert conds["alone"].divergent_sequences == 0 and conds["concurrent-1"].divergent_sequences == 0
    assert conds["concurrent-16"].divergent_sequences > 0
    flips = [f for c in conds.values() for f in c.flips]
    # every divergent sequence has a first divergence with a margin, under twice the noise
    assert len(flips) == res.divergent_sequences
    assert all(f["margin"] is not None and 0 <= f["margin"] < 2 * noise for f in flips)
    assert {f["class"] for f in flips} == {NEAR_TIE_CLASS}
    doc = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert doc["divergent_sequences"] == res.divergent_sequences == len(doc["flips"])
    html = (tmp_path / "probe" / "probe.html").read_text()
    assert 'id="flips"' in html and "near-tie" in html


def test_a_sampling_bug_shows_as_large_margin_divergences(monkeypatch, tmp_path):
    res = probe_with(monkeypatch, tmp_path, ScriptedEndpoint(bug_rate=0.2), n=8, batch_sizes=(8,))
    flips = [f for c in res.conditions.values() for f in c.flips]
    assert res.conditions["alone"].divergent_sequences == 0 and flips
    assert all(f["class"] == LARGE_CLASS and f["margin"] > 3 for f in flips)


def test_an_endpoint_without_logprobs_is_refused_with_the_fix(monkeypatch, tmp_path):
    with pytest.raises(VerinferError, match="no top logprobs") as e:
        probe_with(monkeypatch, tmp_path, ScriptedEndpoint(logprobs=False))
    assert "--max-logprobs" in e.value.message


def test_an_unreachable_endpoint_is_an_error_naming_it(tmp_path):
    from tests.server.serverproc import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(VerinferError, match="cannot reach") as e:
        P.run_probe(ProbeConfig(url, "m", tmp_path / "p", n=1, max_tokens=1, timeout=5), show_progress=False)
    assert url in e.value.message and "--base-url" in e.value.message


def test_cli_exits_1_on_divergence_and_0_when_deterministic(monkeypatch, tmp_path):
    runner = CliRunner()
    args = ["determinism", "probe", "--base-url", "http://toy/v1", "--model", "toy", "--n", "4", "--max-tokens", "16",
            "--batch-sizes", "8", "--quiet"]
    monkeypatch.setattr(logprobs_http, "openai_client", lambda e: ScriptedEndpoint())
    r = runner.invoke(app, [*args, "-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(logprobs_http, "openai_client", lambda e: ScriptedEndpoint(bug_rate=0.5))
    r = runner.invoke(app, [*args, "-o", str(tmp_path / "b")])
    assert r.exit_code == 1, r.output
    assert "NOT deterministic" in r.output and "large-margin" in r.output


# --- real `verinfer serve` on loopback ------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """bf16 and --deterministic best servers of the testbed with continuous batching, started together."""
    pytest.importorskip("fastapi")
    from tests.server.serverproc import Launched

    d = tmp_path_factory.mktemp("probe-servers")
    batching = ("--max-concurrent", "4", "--batching", "continuous")
    launched = {"bf16": Launched(d, *batching),
                "best": Launched(d, *batching, "--deterministic", "best")}
    try:
        yield {k: s.ready() for k, s in launched.items()}
    finally:
        for s in launched.values():
            s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "best"])
def test_verinfer_serve_with_continuous_batching_flips_in_bf16_and_never_with_best(served, mode, tmp_path):
    """verinfer serve --batching continuous decodes concurrent greedy requests in one batch: in bf16
    the batch changes near-ties (>= 1 divergent sequence, each flip at a known reference margin;
    measured: 3 of 40 sequences, margin 0, in about 9 s), with --deterministic best nothing diverges.
    Alone and concurrent-1 (a batch of one either way) never diverge. The probe sees what the server
    answers: token ids compared, every condition filled."""
    from verinfer.models.testbed import TARGET_DIR

    cfg = ProbeConfig(served[mode].base_url, "target", tmp_path / mode, model_dir=TARGET_DIR, n=8, max_tokens=24,
                      batch_sizes=(1, 8))
    res = P.run_probe(cfg, show_progress=False)
    flips = res.to_json()["flips"]
    assert res.compared_on == "token_ids"
    assert {k: c.sequences for k, c in res.conditions.items()} == dict.fromkeys(
        ["alone", "concurrent-1", "concurrent-8", "shared-prefix", "mixed-traffic"], 8)
    assert res.conditions["alone"].divergent_sequences == res.conditions["concurrent-1"].divergent_sequences == 0
    if mode == "best":
        assert res.divergent_sequences == 0, flips
    else:
        assert res.divergent_sequences >= 1
        assert all(f["margin"] is not None and f["class"] == NEAR_TIE_CLASS for f in flips), flips


@pytest.mark.slow
def test_a_model_the_server_does_not_serve_is_named_with_what_it_serves(served, tmp_path):
    with pytest.raises(VerinferError, match="HTTP 404") as e:
        P.run_probe(ProbeConfig(served["bf16"].base_url, "no-such-model", tmp_path / "p", n=1, max_tokens=1),
                    show_progress=False)
    assert "check --model" in e.value.message and "'target'" in e.value.message
