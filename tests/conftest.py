"""Shared fixtures: a tiny random Llama checkpoint (GQA) saved with save_pretrained."""

from __future__ import annotations

import os

import pytest
import torch

# `pytest -n auto` (pytest-xdist, the README's test command): each worker computes on one thread,
# and so do the servers and CLI processes its tests start (they inherit OMP_NUM_THREADS), so the
# workers share the cores instead of oversubscribing them.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharpen the random model a little so greedy decoding is not all ties
        model.lm_head.weight.mul_(8.0)
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d, safe_serialization=True)
    return d


# The slow tier: tests over ~10 s (measured on the 2-core CI machine, `pytest --durations=0`) carry
# `@pytest.mark.slow` (or a module's `pytestmark = pytest.mark.slow`), so the mark moves with a
# test when it is renamed or moved. The fast tier `pytest -m "not slow"` leaves them out; the full
# suite (what .ci/run runs) keeps them. `--strict-markers` (pyproject) fails a misspelled mark.
# The guard below names, at the end of any run, each test not marked slow that took longer than
# FAST_TIER_LIMIT_S (setup, call and teardown: an expensive module fixture counts against the
# first test that asks for it), so a slow test cannot join the fast tier unnoticed.
FAST_TIER_LIMIT_S = 10.0
_fast_tier_seconds: dict[str, float] = {}  # node id -> setup + call + teardown


def pytest_runtest_logreport(report):
    if "slow" not in report.keywords:
        _fast_tier_seconds[report.nodeid] = _fast_tier_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((t, n) for n, t in _fast_tier_seconds.items() if t > FAST_TIER_LIMIT_S), reverse=True)
    if over:
        terminalreporter.write_sep("=", f"not marked slow but over {FAST_TIER_LIMIT_S:.0f} s", yellow=True)
        for t, nodeid in over:
            terminalreporter.write_line(f"{t:7.1f} s  {nodeid}  (mark it @pytest.mark.slow or make it faster)")
