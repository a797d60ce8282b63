"""verinfer.registry: the one name -> entry table every named choice uses."""

import pytest

from verinfer.errors import UnknownNameError, VerinferError
from verinfer.registry import Registry


def test_get_names_and_the_error_naming_the_choices():
    reg = Registry[int]("widget", {"a": 1, "b": 2})
    reg.add("c", 3)
    assert reg.get("b") == 2 and reg["c"] == 3 and reg.names() == ("a", "b", "c")
    with pytest.raises(UnknownNameError) as e:
        reg.get("zz")
    assert isinstance(e.value, VerinferError) and isinstance(e.value, ValueError)
    assert e.value.what == "unknown widget 'zz'" and e.value.fix == "choose one of a, b, c"
    with pytest.raises(UnknownNameError, match="unknown widget"):
        reg["zz"]
    assert reg.get("zz", None) is None and reg.get("a", 0) == 1


def test_a_registry_is_a_read_only_mapping_in_registration_order():
    reg = Registry[int]("widget", {"b": 2, "a": 1})
    assert list(reg) == ["b", "a"] and len(reg) == 2 and "a" in reg and "z" not in reg
    assert dict(reg) == {"b": 2, "a": 1} and {**reg} == {"b": 2, "a": 1} and list(reg.items()) == [("b", 2), ("a", 1)]
    with pytest.raises(TypeError):
        reg["c"] = 3  # type: ignore[index]


def test_register_decorator_names_and_refuses_a_second_entry_of_a_name():
    reg = Registry("rule")

    @reg.register()
    def plain():
        return 1

    @reg.register("other")
    def named():
        return 2

    class Kernel:
        name = "fast"

    reg.register()(Kernel)
    assert reg.names() == ("plain", "other", "fast") and reg.get("other") is named and reg["fast"] is Kernel
    with pytest.raises(ValueError, match="rule 'plain' is registered twice"):
        reg.add("plain", None)


def test_the_converted_registries_keep_their_names_and_errors():
    from verinfer.detect.registry import DETECTORS, FORMATS
    from verinfer.determinism.scheduler import POLICIES
    from verinfer.numerics.kernels import KERNELS, get_kernels
    from verinfer.providers.simulated import HONEST, MISCONFIGURED, PROVIDERS, get_provider
    from verinfer.sampling.noise import NOISE_BACKENDS, get_backend
    from verinfer.sampling.params import NOISE_BACKENDS as PARAMS_NOISE
    from verinfer.speculative.rules import RELAX, RULES

    assert PARAMS_NOISE is NOISE_BACKENDS
    assert NOISE_BACKENDS.names() == ("vllm-cpu", "vllm-v1-exponential", "keyed", "inverse-cdf", "speculative-keyed",
                                      "vllm-mrv2-gumbel-fp32", "vllm-mrv2-gumbel-fp64", "vllm-mrv2-philox-fp32",
                                      "vllm-mrv2-philox-fp64", "sglang-seeded", "sglang-seeded-sorted")
    assert RULES == RELAX.names() == ("standard", "kl", "topk", "target_entropy", "draft_entropy", "autojudge")
    assert PROVIDERS.names() == HONEST.names() + MISCONFIGURED.names()
    assert set(KERNELS) == {"native", "fused", "fixed_shape", "tiled", "layercast"} and get_kernels("tiled").name == "tiled"
    assert set(POLICIES) == {"bf16", "batch_invariant", "layercast", "margingate", "margingate_live_cache", "llm42",
                             "gated_llm42", "best"}
    assert DETECTORS.names() == ("clipped-mean", "greedy", "glrt", "likelihood-ratio", "xent-excess", "pit-uniformity")
    assert [c.NAME for c in FORMATS.values()] == list(DETECTORS)
    for fn, kind in ((get_backend, "noise backend"), (get_provider, "provider"), (get_kernels, "kernel strategy"),
                     (POLICIES.get, "determinism policy"), (RELAX.get, "acceptance rule"),
                     (DETECTORS.get, "detector")):
        with pytest.raises(UnknownNameError, match=f"unknown {kind} 'nope'") as e:
            fn("nope")
        assert e.value.fix.startswith("choose one of ")
