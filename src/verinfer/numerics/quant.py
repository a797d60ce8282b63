"""Simulated (fake-quant) weight and KV-cache quantization used as misconfigurations.

rtn_fake_quant: group-wise round-to-nearest along the input dimension with a per-group scale
and zero point (asymmetric, as GPTQ/AWQ 4-bit checkpoints store them), then dequantized.
fake_quant_fp8_e4m3: a round trip through torch.float8_e4m3fn (saturating at +-448).
"""

from __future__ import annotations

import torch


def rtn_fake_quant(w_OI: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Quantize each row's groups of `group` input columns to `bits` bits and dequantize.
    When the input dim is not a multiple of `group`, the last group is the shorter remainder."""
    O, I = w_OI.shape
    full = (I // group) * group
    parts = []
    if full:
        parts.append(_rtn_groups(w_OI[:, :full].reshape(O, I // group, group), bits).reshape(O, full))
    if full < I:
        parts.append(_rtn_groups(w_OI[:, full:].reshape(O, 1, I - full), bits).reshape(O, I - full))
    return torch.cat(parts, dim=1)


def _rtn_groups(g: torch.Tensor, bits: int) -> torch.Tensor:
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-12)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(g / scale) + zero, 0, qmax)
    return (q - zero) * scale


def fake_quant_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    finfo = torch.finfo(torch.float8_e4m3fn)
    return x.float().clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn).to(x.dtype)
