"""TOPLOC baseline (Ong et al. 2025) through the PyPI `toploc` package (0.1.6), not a rewrite.

Install: `pip install setuptools wheel && pip install --no-build-isolation --no-binary toploc
toploc==0.1.6` (its prebuilt wheel is compiled against an older torch; built from the sdist it
links against the installed torch 2.13). The extra `verinfer[toploc]` pins the version.

What is proven: the provider's hidden states that produced each output token (final-norm output,
what TOPLOC hooks: `model.norm`), cast to bf16, decode steps only (`skip_prefill=True`), grouped
in chunks of `chunk` tokens; per chunk `toploc.build_proofs_base64` keeps the top-`topk` |values|
as a polynomial. Proof size is the package's own serialization (`ProofPoly.to_bytes` in
toploc/C/csrc/poly.cpp: a 2-byte modulus, then one 2-byte Newton coefficient per point): 2 + 2*topk
bytes per chunk, i.e. (2 + 2*topk)/chunk bytes per output token (base64 text is 4/3 of that; we
count raw bytes, as for fingerprints). The package accepts any topk >= 1 and any chunk
(`decode_batching_size`); its authors use topk=128, chunk=32 (258 bytes per 32 tokens).
The verifier recomputes the hidden states by replay and calls `toploc.verify_proofs_base64`,
which returns per chunk (exp_mismatches, mant_err_mean, mant_err_median).

Thresholds: TOPLOC's published acceptance rule for topk=128 (toploc-experiments,
vllm_validate_poly.py: TEXP=90 exponent intersections, TMEAN=10, TMEDIAN=8): a chunk passes iff
exp_mismatches <= 128 - 90 = 38, mant_err_mean <= 10 and mant_err_median <= 8. For other topk
the exponent allowance is scaled proportionally (floor(38/128 * topk)); the mantissa thresholds
are per-value and kept as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

TEXP_128, TMEAN, TMEDIAN = 90, 10.0, 8.0


def require_toploc():
    try:
        import toploc
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            f"the TOPLOC baseline needs the `toploc` package ({e}); install it from source against the "
            "installed torch: .venv/bin/pip install setuptools wheel && .venv/bin/pip install "
            "--no-build-isolation --no-binary toploc toploc==0.1.6") from e
    return toploc


@dataclass(frozen=True)
class ToplocSpec:
    topk: int = 128
    chunk: int = 32

    @property
    def bytes_per_chunk(self) -> int:
        return 2 + 2 * self.topk

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_chunk / self.chunk

    @property
    def max_exp_mismatches(self) -> int:
        return math.floor((128 - TEXP_128) / 128 * self.topk)


def _rows(hidden_TD: torch.Tensor) -> list[torch.Tensor]:
    return list(hidden_TD.to(torch.bfloat16).unbind(0))


def build(hidden_TD: torch.Tensor, spec: ToplocSpec) -> list[str]:
    """Base64 proofs, one per chunk of `spec.chunk` output tokens."""
    return require_toploc().build_proofs_base64(_rows(hidden_TD), spec.chunk, spec.topk, skip_prefill=True)


def verify(hidden_TD: torch.Tensor, proofs: list[str], spec: ToplocSpec) -> np.ndarray:
    """(n_chunks, 3) float64: exp_mismatches, mant_err_mean, mant_err_median per chunk."""
    n_chunks = math.ceil(hidden_TD.shape[0] / spec.chunk)
    if len(proofs) != n_chunks:
        raise ValueError(f"TOPLOC: {len(proofs)} proofs for {hidden_TD.shape[0]} tokens in chunks of {spec.chunk} "
                         f"(expected {n_chunks})")
    res = require_toploc().verify_proofs_base64(_rows(hidden_TD), proofs, spec.chunk, spec.topk, skip_prefill=True)
    return np.array([[r.exp_mismatches, r.mant_err_mean, r.mant_err_median] for r in res], dtype=np.float64)


def passes(results_C3: np.ndarray, spec: ToplocSpec) -> np.ndarray:
    """TOPLOC's own per-chunk acceptance (thresholds in the module docstring)."""
    r = np.asarray(results_C3)
    return (r[:, 0] <= spec.max_exp_mismatches) & (r[:, 1] <= TMEAN) & (r[:, 2] <= TMEDIAN)
