"""In-process pieces of the server: misconfigurations, the model table, generation steps."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

import torch

from verinfer.errors import ModelError
from verinfer.models.testbed import TARGET_DIR, TESTBED_DIR
from verinfer.sampling.params import SamplingParams
from verinfer.server.generation import generate_steps
from verinfer.server.registry import load_registry


@pytest.fixture(scope="module")
def registries():
    return {m: load_registry(TARGET_DIR, misconfig=m) for m in (None, "temp-1.1", "wrong-seed", "sampling-bug")}


def test_misconfigurations_change_what_is_sampled_not_what_is_claimed(registries):
    claimed = SamplingParams(1.0, 50, 0.95, 0.0, 41, 8)
    greedy = SamplingParams(0.0, max_tokens=8)
    get = lambda m: registries[m]["target"]  # noqa: E731
    run_params = lambda model, p: model.provider.run_params(p)  # noqa: E731
    assert run_params(get(None), claimed) == claimed
    assert run_params(get("temp-1.1"), claimed).temperature == pytest.approx(1.1)
    assert run_params(get("wrong-seed"), claimed).seed == 42
    assert run_params(get("temp-1.1"), greedy) == greedy  # greedy requests draw no noise: nothing to change


def test_sampling_bug_changes_some_tokens_reproducibly(registries):
    prompt = [483, 289, 81, 81, 10, 90, 308, 201]
    params = SamplingParams(1.0, 50, 0.95, 0.0, 5, 200)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        honest = [s.token_id for s in generate_steps(registries[None]["target"], "a", prompt, params, ignore_eos=True)]
        bug1 = [s.token_id for s in generate_steps(registries["sampling-bug"]["target"], "b", prompt, params,
                                                   ignore_eos=True)]
        bug2 = [s.token_id for s in generate_steps(registries["sampling-bug"]["target"], "c", prompt, params,
                                                   ignore_eos=True)]
    finally:
        torch.set_num_threads(threads)
    assert len(honest) == len(bug1) == 200
    assert bug1 == bug2  # the bug RNG is the request's own, seeded from its seed
    assert bug1 != honest


def test_a_directory_of_models_is_served_by_name():
    table = load_registry(TESTBED_DIR)
    assert {"target", "draft", "verinfer-testbed-target"} <= set(table)
    assert table["target"] is table["verinfer-testbed-target"]
    assert "tokenizer" not in table  # no config.json: not a model


def test_unknown_misconfiguration_and_missing_directory():
    with pytest.raises(ModelError, match="unknown misconfiguration 'int3'"):
        load_registry(TARGET_DIR, misconfig="int3")
    with pytest.raises(ModelError, match="no such model directory"):
        load_registry(TARGET_DIR / "nope")
