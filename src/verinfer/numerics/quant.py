"""Simulated (fake-quant) weight and KV-cache quantization used as misconfigurations.

rtn_fake_quant: group-wise round-to-nearest along the input dimension with a per-group scale
and zero point (asymmetric, as GPTQ/AWQ 4-bit checkpoints store them), then dequantized.
fake_quant_fp8_e4m3: a round trip through torch.float8_e4m3fn (saturating at +-448).
"""

from __future__ import annotations

import torch


def rtn_fake_quant(w_OI: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Quantize each row's groups of `group` input columns to `bits` bits and dequantize."""
    O, I = w_OI.shape
    if I % group:
        raise ValueError(f"input dim {I} is not divisible by the quantization group {group}")
    g = w_OI.reshape(O, I // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-12)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(g / scale) + zero, 0, qmax)
    return ((q - zero) * scale).reshape(O, I)


def fake_quant_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    finfo = torch.finfo(torch.float8_e4m3fn)
    return x.float().clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn).to(x.dtype)
