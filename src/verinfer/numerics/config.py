"""Ways a model can compute: dtype, attention implementation, threads, prefill chunking, and the
misconfigurations of the DiFR paper. A `Numerics` is a frozen description; `apply_weights`
turns a checkpoint's fp32 weights into what a provider with that numerics would run, and
`kv_write_hook` what its KV cache would store.

What is simulated and what is a real kernel:
- dtype bf16/fp32, attention sdpa/eager, thread count, chunked prefill: real PyTorch kernels
  (they change the floating-point reduction order, honest numerical noise).
- int4 / int8 weights: *simulated* (fake-quant) group-wise round-to-nearest with a zero point,
  dequantized back to the compute dtype; the matmuls stay bf16/fp32.
- fp8 e4m3 KV cache: *simulated* by casting each written K/V to torch.float8_e4m3fn and back
  (per-tensor scale 1.0, vLLM's default when no scales are calibrated).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, replace

import torch

from verinfer.numerics.quant import fake_quant_fp8_e4m3, rtn_fake_quant

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


VERIFIER_MATMULS = ("native", "fp32")  # what a verifier computes with (--matmul): the dtype's own kernels, or
# fp32 GEMMs on dtype-rounded operands
MATMULS = VERIFIER_MATMULS + ("split-k",)  # Numerics.matmul; split-k: a GPU library's split-K for GEMMs of a few
# rows (numerics/kernels.split_k_parts), the testbed's serving numerics, never a verifier's


@dataclass(frozen=True)
class Numerics:
    dtype: str = "bf16"
    attn: str = "sdpa"             # sdpa | eager
    threads: int | None = None     # torch.set_num_threads during the run (None = leave as is)
    prefill_chunk: int | None = None  # split prompts into chunks of this many tokens
    weight_bits: int | None = None  # 4 or 8: group-wise RTN fake-quant of the linear weights
    weight_group: int = 32
    kv_cache: str | None = None    # None | "fp8_e4m3"
    # "native": matmuls in `dtype` (PyTorch's bf16 kernels). "fp32": linear layers and attention
    # take the `dtype`-rounded operands, compute in fp32 and round their outputs back to `dtype`:
    # what a bf16 kernel with fp32 accumulation computes, in another summation order (honest
    # noise), and about 2x faster than bf16 GEMMs on CPUs without AMX. Activations stay `dtype`.
    # "split-k": native, except that GEMMs of 2..15 rows split their reduction as GPU libraries do
    # for small batches: batch effects on every CPU (the testbed's serving engines use it).
    matmul: str = "native"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attn not in ("sdpa", "eager"):
            raise ValueError(f"attn must be 'sdpa' or 'eager', got {self.attn!r}")
        if self.weight_bits not in (None, 4, 8):
            raise ValueError(f"weight_bits must be None, 4 or 8, got {self.weight_bits}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {', '.join(MATMULS)}, got {self.matmul!r}")
        if self.kv_cache not in (None, "fp8_e4m3"):
            raise ValueError(f"kv_cache must be None or 'fp8_e4m3', got {self.kv_cache!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def with_(self, **kw) -> "Numerics":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    def apply_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weights as this numerics would hold them (cast, and fake-quantized if asked)."""
        out = {}
        for name, t in weights.items():
            if self.weight_bits and t.ndim == 2 and any(f"{p}.weight" in name for p in QUANT_TARGETS):
                t = rtn_fake_quant(t.float(), self.weight_bits, self.weight_group)
            out[name] = t.to(self.torch_dtype)
        return out

    def kv_write_hook(self):
        if self.kv_cache == "fp8_e4m3":
            return lambda k, v: (fake_quant_fp8_e4m3(k), fake_quant_fp8_e4m3(v))
        return None

    @contextlib.contextmanager
    def threads_ctx(self):
        if self.threads is None:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)
