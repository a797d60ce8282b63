"""Activation-DiFR fingerprints (DiFR paper section 4.3): a seeded random orthogonal projection
of hidden states to K dimensions, logged every `stride`-th output token, compared by L2 distance.

Projection recipe (exact, so any implementation can reproduce it):

    g = torch.Generator().manual_seed(seed)
    G_DK = torch.randn(D, K, generator=g, dtype=torch.float64)      # i.i.d. N(0, 1)
    Q_DK, R_KK = torch.linalg.qr(G_DK)                              # reduced QR
    P_DK = Q_DK * sign(diag(R_KK))   (sign 0 -> +1)                 # Haar-uniform, unique
    fingerprint_K = float32(hidden_D) @ float32(P_DK)

Logged positions: output positions t = 0, s, 2s, ... (0-based) of each claim, where the hidden
state at output position t is the one that produced output token t (the position before it):
the final-norm output for layer -1 (default), the residual stream after decoder layer i for i >= 0.

Storage precision: `fp16` (2 bytes per value) or `int8` (symmetric per-vector absmax, one fp16
scale per logged vector: K + 2 bytes). Bytes per output token = bytes per logged vector / s,
i.e. K*2/s for fp16 and (K+2)/s for int8.

Wire format: the claim field `activations` (JSON, inside the claims JSONL line; no sidecar):

    {"format": "verinfer-fingerprint/1", "k": K, "stride": s, "layer": -1, "seed": int,
     "dtype": "fp16" | "int8", "hidden_size": D, "positions": [t0, t1, ...],
     "data": base64(little-endian values, row-major n x K),
     "scales": base64(fp16, n)   # int8 only}

`parse_fingerprint` validates all of it and raises a ClaimError naming file:line and the field.

Shape key: T=output tokens, D=model dim, K=projection dim, N=logged tokens.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from verinfer.errors import ClaimError

FORMAT = "verinfer-fingerprint/1"
DTYPES = {"fp16": 2, "int8": 1}


@dataclass(frozen=True)
class FingerprintSpec:
    k: int = 16
    stride: int = 1
    layer: int = -1
    seed: int = 0
    dtype: str = "fp16"

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"fingerprint k must be >= 1, got {self.k}")
        if self.stride < 1:
            raise ValueError(f"fingerprint stride must be >= 1, got {self.stride}")
        if self.dtype not in DTYPES:
            raise ValueError(f"fingerprint dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def bytes_per_vector(self) -> int:
        return self.k * DTYPES[self.dtype] + (2 if self.dtype == "int8" else 0)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_vector / self.stride

    @classmethod
    def parse(cls, text: str) -> "FingerprintSpec":
        """`k=16,stride=4[,layer=-1,seed=0,dtype=fp16]` (the CLI's --fingerprint)."""
        kw: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ValueError(f"--fingerprint: expected key=value, got {part!r} (e.g. k=16,stride=4)")
            key, val = (x.strip() for x in part.split("=", 1))
            if key not in ("k", "stride", "layer", "seed", "dtype"):
                raise ValueError(f"--fingerprint: unknown key {key!r}; use k, stride, layer, seed, dtype")
            try:
                kw[key] = val if key == "dtype" else int(val)
            except ValueError:
                raise ValueError(f"--fingerprint: {key} must be an integer, got {val!r}") from None
        return cls(**kw)


@lru_cache(maxsize=32)
def projection_matrix(hidden_size: int, k: int, seed: int) -> torch.Tensor:
    """P_DK with orthonormal columns (see the module docstring for the exact recipe)."""
    if k > hidden_size:
        raise ValueError(f"projection dim k={k} exceeds the hidden size {hidden_size}")
    g = torch.Generator().manual_seed(seed)
    G_DK = torch.randn(hidden_size, k, generator=g, dtype=torch.float64)
    Q_DK, R_KK = torch.linalg.qr(G_DK)
    sign_K = torch.sign(torch.diagonal(R_KK))
    sign_K[sign_K == 0] = 1.0
    return (Q_DK * sign_K).float()


def logged_positions(n_tokens: int, stride: int) -> list[int]:
    return list(range(0, n_tokens, stride))


def project(hidden_TD: torch.Tensor, spec: FingerprintSpec) -> torch.Tensor:
    """Full-precision fingerprints of the logged rows: (N, K) fp32."""
    P_DK = projection_matrix(hidden_TD.shape[-1], spec.k, spec.seed)
    pos = logged_positions(hidden_TD.shape[0], spec.stride)
    return hidden_TD[pos].float() @ P_DK


def quantize(fp_NK: torch.Tensor, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    if dtype == "fp16":
        return fp_NK.numpy().astype("<f2"), None
    scale_N = (fp_NK.abs().amax(-1) / 127.0).clamp_min(1e-8).numpy().astype("<f2")
    q = np.clip(np.rint(fp_NK.numpy() / np.maximum(scale_N.astype(np.float32), 1e-8)[:, None]), -127, 127)
    return q.astype(np.int8), scale_N


def dequantize(values: np.ndarray, scales: np.ndarray | None) -> torch.Tensor:
    v = values.astype(np.float32)
    if scales is not None:
        v = v * scales.astype(np.float32)[:, None]
    return torch.from_numpy(v)


def encode(hidden_TD: torch.Tensor, spec: FingerprintSpec) -> dict:
    """The claim's `activations` field for these hidden states (row t produced output token t)."""
    fp_NK = project(hidden_TD, spec)
    values, scales = quantize(fp_NK, spec.dtype)
    d = {"format": FORMAT, "k": spec.k, "stride": spec.stride, "layer": spec.layer, "seed": spec.seed,
         "dtype": spec.dtype, "hidden_size": int(hidden_TD.shape[-1]),
         "positions": logged_positions(hidden_TD.shape[0], spec.stride),
         "data": base64.b64encode(values.tobytes()).decode("ascii")}
    if scales is not None:
        d["scales"] = base64.b64encode(scales.tobytes()).decode("ascii")
    return d


@dataclass(frozen=True)
class Fingerprint:
    spec: FingerprintSpec
    positions: list[int]
    fp_NK: torch.Tensor  # dequantized fp32


def parse_fingerprint(obj, where: str, *, n_output: int, hidden_size: int | None = None,
                      expect: FingerprintSpec | None = None, n_layers: int | None = None) -> Fingerprint:
    """Validate a claim's `activations` field; errors name `where` (file:line) and the field.
    n_layers: the verifier model's decoder layer count (`layer` must be -1 or below it)."""
    def bad(msg: str, fld: str, fix: str = "regenerate the claims with `verinfer generate --fingerprint ...`"):
        return ClaimError(f"`activations.{fld}`: {msg}", where=where, fix=fix)

    if not isinstance(obj, dict):
        raise bad("must be an object", "")
    if obj.get("format") != FORMAT:
        raise bad(f"unknown format {obj.get('format')!r}, expected {FORMAT!r}", "format")
    for fld in ("k", "stride", "layer", "seed", "dtype", "positions", "data"):
        if fld not in obj:
            raise bad("missing", fld)
    for fld in ("k", "stride", "layer", "seed"):
        if not isinstance(obj[fld], int) or isinstance(obj[fld], bool):
            raise bad(f"must be an integer, got {obj[fld]!r}", fld)
    if not 0 <= obj["seed"] < 2**63:
        raise bad(f"seed {obj['seed']} is outside [0, 2**63)", "seed")
    if obj["layer"] < -1 or (n_layers is not None and obj["layer"] >= n_layers):
        raise bad(_layer_problem(obj["layer"], n_layers), "layer", LAYER_FIX)
    if obj["dtype"] not in DTYPES:
        raise bad(f"dtype {obj['dtype']!r} is not supported; use one of {', '.join(DTYPES)}", "dtype")
    try:
        spec = FingerprintSpec(obj["k"], obj["stride"], obj["layer"], obj["seed"], obj["dtype"])
    except ValueError as e:
        raise bad(str(e), "k") from e
    if hidden_size is not None and obj.get("hidden_size", hidden_size) != hidden_size:
        raise bad(f"hidden size {obj['hidden_size']} does not match the verifier model's {hidden_size}",
                  "hidden_size", "audit with the model the provider claims to serve")
    if hidden_size is not None and spec.k > hidden_size:
        raise bad(f"k={spec.k} exceeds the model's hidden size {hidden_size}", "k")
    if expect is not None:
        for fld in ("seed", "k", "layer", "dtype"):
            if getattr(spec, fld) != getattr(expect, fld):
                raise bad(f"{fld}={getattr(spec, fld)!r} does not match the verifier's expected "
                          f"{getattr(expect, fld)!r}", fld,
                          "the provider must fingerprint with the agreed projection (seed, k, layer, dtype)")
    pos = obj["positions"]
    if not isinstance(pos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in pos):
        raise bad("must be a list of integer output positions", "positions")
    outside = [t for t in pos if not 0 <= t < n_output]
    if outside:
        raise bad(f"position {outside[0]} is not in the claim (it has {n_output} output tokens)", "positions",
                  "fingerprints must be for the claim's own output positions")
    if pos != logged_positions(n_output, spec.stride):
        raise bad(f"positions do not follow stride {spec.stride} from 0 over {n_output} tokens", "positions")
    n, width = len(pos), DTYPES[spec.dtype]
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise bad(f"not valid base64 ({e})", "data", "the field looks truncated or corrupted") from e
    if len(raw) != n * spec.k * width:
        raise bad(f"holds {len(raw)} bytes but {n} positions x k={spec.k} x {width} bytes ({spec.dtype}) need "
                  f"{n * spec.k * width}", "data",
                  "wrong dimension or dtype, or a truncated field: regenerate the fingerprints")
    values = np.frombuffer(raw, dtype="<f2" if spec.dtype == "fp16" else np.int8).reshape(n, spec.k)
    scales = None
    if spec.dtype == "int8":
        if "scales" not in obj:
            raise bad("missing (int8 fingerprints carry one fp16 scale per position)", "scales")
        try:
            sraw = base64.b64decode(obj["scales"], validate=True)
        except (binascii.Error, TypeError, ValueError) as e:
            raise bad(f"not valid base64 ({e})", "scales") from e
        if len(sraw) != 2 * n:
            raise bad(f"holds {len(sraw)} bytes, expected {2 * n} (one fp16 per position)", "scales")
        scales = np.frombuffer(sraw, dtype="<f2")
    fp = dequantize(values, scales)
    if not torch.isfinite(fp).all():
        raise bad("contains NaN or inf", "data")
    return Fingerprint(spec, list(pos), fp)


def l2_distances(claimed: Fingerprint, hidden_TD: torch.Tensor) -> np.ndarray:
    """L2 distance per logged token between the claimed fingerprint and the verifier's
    recomputation from its own hidden states (same projection, same storage precision)."""
    values, scales = quantize(project(hidden_TD, claimed.spec), claimed.spec.dtype)
    mine_NK = dequantize(values, scales)
    return torch.linalg.vector_norm(mine_NK - claimed.fp_NK, dim=-1).double().numpy()


LAYER_FIX = "fingerprint a layer the verifier model has (-1, the default, is the final norm)"


def _layer_problem(layer: int, n_layers: int | None) -> str:
    has = f"the model has {n_layers} decoder layers: " if n_layers is not None else ""
    return f"layer {layer} is out of range ({has}-1 = final norm, i >= 0 = after decoder layer i)"


def check_layer(fp: Fingerprint, n_layers: int, where: str) -> None:
    """Refuse a fingerprint of a layer the verifier model does not have (before any compute)."""
    if not -1 <= fp.spec.layer < n_layers:
        raise ClaimError(f"`activations.layer`: {_layer_problem(fp.spec.layer, n_layers)}", where=where, fix=LAYER_FIX)
