import pytest

from verinfer.determinism.invariant import fixed_shape_model, tiled_model
from verinfer.engine.engine import Engine
from verinfer.models.load import load_model
from verinfer.models.testbed import TARGET_DIR
from verinfer.numerics import Numerics

BF16 = Numerics(dtype="bf16")


@pytest.fixture(scope="session")
def bf16_model():
    return load_model(TARGET_DIR, BF16)


@pytest.fixture(scope="session")
def det_engine(bf16_model):
    """The fixed-shape deterministic path: reference and verifier of every policy."""
    return Engine(fixed_shape_model(bf16_model), BF16, eos_token_id=None)


@pytest.fixture(scope="session")
def tiled_engine(bf16_model):
    """The op-level batch-invariant path (fixed-shape tiles): the batch_invariant baseline."""
    return Engine(tiled_model(bf16_model), BF16, eos_token_id=None)


@pytest.fixture(scope="session", params=["fixed_shape", "tiled"])
def any_det_engine(request):
    return request.getfixturevalue({"fixed_shape": "det_engine", "tiled": "tiled_engine"}[request.param])


@pytest.fixture(scope="session")
def fast_engine(bf16_model):
    return Engine(bf16_model, BF16.with_(prefill_chunk=16), eos_token_id=None)
