"""sampling/params.py: the one sampling validation, the one stop rule, the one misconfiguration rule."""

import pytest

from verinfer.errors import UnknownNameError
from verinfer.sampling.params import SamplingParamError, SamplingParams, check_sampling, misconfigured, stop_reason

OK = dict(temperature=1.0, top_p=0.95, min_p=0.0, seed=3, noise="keyed")


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", -0.1, r"temperature must be in \[0, 100\]"), ("temperature", 1e308, "temperature must be in"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"), ("top_p", 1.5, "top_p"), ("min_p", 1.1, r"min_p must be in \[0, 1\]"),
    ("seed", None, "seed is missing but temperature > 0"), ("seed", 2**63, r"seed must be in \[0, 2\*\*63\)"),
])
def test_check_sampling_names_the_field(field, value, msg):
    with pytest.raises(SamplingParamError, match=msg) as e:
        check_sampling(**{**OK, field: value})
    assert e.value.field == field
    with pytest.raises(ValueError, match=msg):  # SamplingParams runs the same check
        SamplingParams(**{**OK, field: value})


def test_check_sampling_accepts_greedy_without_seed_and_refuses_unknown_noise_and_zero_tokens():
    check_sampling(**{**OK, "temperature": 0.0, "seed": None})
    with pytest.raises(UnknownNameError, match="unknown noise backend 'mystery'"):
        SamplingParams(seed=1, noise="mystery")
    with pytest.raises(SamplingParamError, match="max_tokens must be >= 1"):
        SamplingParams(seed=1, max_tokens=0)


def test_stop_reason_checks_the_stop_token_before_the_length():
    assert stop_reason(7, 3, 3, {7}) == "stop"
    assert stop_reason(8, 3, 3, {7}) == "length"
    assert stop_reason(8, 2, 3, {7}) is None and stop_reason(7, 1, 3, ()) is None


def test_misconfigured_changes_temperature_and_seed_and_leaves_greedy_requests_alone():
    claimed = SamplingParams(1.0, 50, 0.95, 0.0, 41, 8)
    assert misconfigured(claimed) == claimed
    assert misconfigured(claimed, 1.1).temperature == 1.1 and misconfigured(claimed, 1.1).seed == 41
    assert misconfigured(claimed, seed_offset=1).seed == 42
    assert misconfigured(SamplingParams(1.0, seed=2**63 - 1), seed_offset=1).seed == 0
    greedy = SamplingParams(0.0, max_tokens=8)
    assert misconfigured(greedy, 1.1, 1) == greedy
