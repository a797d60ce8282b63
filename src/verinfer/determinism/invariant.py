"""Deterministic reference forwards: per-token logits bitwise independent of batch size, of the
requests sharing the batch, and of how a sequence is split into prefill chunks / decode steps.

The forward is models/llama.py's LlamaLM; what makes it deterministic is its kernel strategy
(numerics/kernels.py):
- `fixed_shape_model(model)`: library kernels at fixed shapes, certified on this machine
  (kernels.FixedShape, `model.kernels.certify()`). The reference, the verifier of margingate /
  llm42 and the decode path of the `best` policy; its decode step costs about what the default
  decode step costs (benchmarks/margingate.py).
- `tiled_model(model)`: every matmul in fixed-shape tiles (kernels.Tiled), the engine of the
  `batch_invariant` policy (policies.py).
- `layercast_model(model)`: the engine of the `layercast` policy, bf16-rounded weights computed in fp32
  (kernels.LayerCast).
Whether a library kernel gives a row the same bits at every position of a fixed-shape tile is
checked, not assumed: tests/determinism/test_invariant.py compares batch sizes 1..32, other
co-batched requests, chunked prefill and token-by-token decode bitwise.

"""

from __future__ import annotations

from verinfer.models.llama import LlamaLM
from verinfer.numerics.kernels import FixedShape, LayerCast, Tiled


def fixed_shape_model(model: LlamaLM, **options) -> LlamaLM:
    """The model on the certified fixed-shape kernels (options: kernels.FixedShape's)."""
    return model if isinstance(model.kernels, FixedShape) else model.with_kernels(FixedShape(**options))


def tiled_model(model: LlamaLM, **options) -> LlamaLM:
    """The model on the tiled batch-invariant kernels (options: kernels.Tiled's)."""
    return model if isinstance(model.kernels, Tiled) else model.with_kernels(Tiled(**options))


def layercast_model(model: LlamaLM) -> LlamaLM:
    """LayerCast: keep the (bf16-rounded) weights, compute every layer in fp32."""
    return model.with_kernels(LayerCast())
