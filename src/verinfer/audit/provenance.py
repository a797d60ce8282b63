"""What produced a scores file or a detector, recorded and checked (issue 15 item 4).

`verinfer score` writes a `Provenance` into the Parquet schema metadata (key PARQUET_KEY);
`verinfer calibrate` copies the honest scores' provenance into the detector JSON ("provenance",
with the calibration data's size); `verinfer audit` refuses scores whose settings differ from the
detector's (`mismatch` names the fields and both values). Checked: the model (name, weights and
tokenizer sha256), the claims' noise backends, the verifier's numerics (all but its thread count,
which changes no result: score parts are bitwise equal across --worker-threads) and device type.
Recorded, not checked: the verinfer version and the device's full name.
"""

from __future__ import annotations

import json

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from verinfer import __version__
from verinfer.errors import VerinferError

PARQUET_KEY = b"verinfer.provenance"
CHECKED = ("model", "weights_sha256", "tokenizer_sha256", "noise", "numerics", "device_type")
NOT_CHECKED_NUMERICS = ("threads",)


class Provenance(BaseModel):
    """The model and settings that replayed the claims."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    weights_sha256: str = Field(min_length=1)
    tokenizer_sha256: str | None = None
    noise: tuple[str, ...] = Field(description="the claims' noise backends, sorted")
    numerics: dict = Field(description="the verifier's Numerics.to_dict()")
    device: str = Field(min_length=1)
    verinfer_version: str = __version__

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def checked(self) -> dict:
        """The fields `mismatch` compares."""
        num = {k: v for k, v in self.numerics.items() if k not in NOT_CHECKED_NUMERICS}
        return {"model": self.model, "weights_sha256": self.weights_sha256,
                "tokenizer_sha256": self.tokenizer_sha256, "noise": list(self.noise), "numerics": num,
                "device_type": self.device_type}


def make(info, numerics, device, noise) -> Provenance:
    """The provenance of scores replayed with the model `info` (`models.load.ModelInfo`), these
    numerics (a Numerics or its dict) on `device`, of claims with these noise backends."""
    num = numerics if isinstance(numerics, dict) else numerics.to_dict()
    return Provenance(model=info.name, weights_sha256=info.weights_sha256, tokenizer_sha256=info.tokenizer_sha256,
                      noise=tuple(sorted(set(noise))), numerics=num, device=str(device))


def parse(d, where: str, fix: str) -> Provenance:
    """A Provenance from JSON (a dict), or a VerinferError naming the bad field."""
    try:
        return Provenance.model_validate(d)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "provenance"
        raise VerinferError(f"bad provenance field {field}: {err['msg']}", where=where, fix=fix) from None


def to_metadata(p: Provenance) -> dict[bytes, bytes]:
    return {PARQUET_KEY: p.model_dump_json().encode()}


def of_schema(schema: pa.Schema, where: str) -> Provenance | None:
    """The provenance a scores file records (None: written by a verinfer that did not record it)."""
    raw = (schema.metadata or {}).get(PARQUET_KEY)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise VerinferError(f"its provenance metadata is not JSON ({e})", where=where,
                            fix="rescore the claims with `verinfer score`") from None
    return parse(d, where, "rescore the claims with `verinfer score`")


def mismatch(a: Provenance, b: Provenance) -> list[str]:
    """'field: a-value vs b-value' for every checked field where a and b differ."""
    ca, cb = a.checked(), b.checked()
    return [f"{k}: {_short(ca[k])} vs {_short(cb[k])}" for k in CHECKED if ca[k] != cb[k]]


def _short(v) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items())
    return json.dumps(v) if isinstance(v, list) else str(v)
