"""What a detector file records besides its fit, validated on load (pydantic).

    "provenance":  the model and settings that replayed its honest calibration scores
                   (`verinfer.scores.Provenance`; `verinfer audit` refuses scores of others)
    "calibration": its calibration data's size (tokens and claims per honest configuration) and
                   the false-positive rate measured on honest claims held out of the fit (`Heldout`)

Both are optional (a detector fit in code, or a file of an older verinfer, has neither; `audit`
then says the settings are not recorded). Every number of a detector's "fitted" part is checked
finite (`check_numbers`, +inf allowed where a detector stores it, never NaN), and float64 arrays
(*_f8_base64) decoded and checked the same way; each detector checks its own ranges on top.
"""

from __future__ import annotations

import base64
import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from verinfer.errors import VerinferError
from verinfer.scores import Provenance, parse_provenance


class Heldout(BaseModel):
    """Held-out false-positive rate at calibration time: `folds` folds of each honest
    configuration's claims, each fold audited (in disjoint batches of `batch_tokens` tokens of whole
    claims) by a detector fit without it; the final detector is fit on every claim."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    folds: int = Field(ge=2)
    batch_tokens: int = Field(ge=1)
    batches: int = Field(ge=0)
    flagged: int = Field(ge=0)
    fpr: float | None = Field(default=None, ge=0, le=1)
    fpr_upper95: float | None = Field(default=None, ge=0, le=1)

    @model_validator(mode="after")
    def _counts(self):
        if self.flagged > self.batches:
            raise ValueError(f"{self.flagged} flagged of {self.batches} batches")
        return self


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tokens: dict[str, int] = Field(description="calibration tokens per honest configuration")
    claims: dict[str, int] = Field(description="calibration claims per honest configuration")
    heldout: Heldout | None = None

    @model_validator(mode="after")
    def _positive(self):
        if not self.tokens or min(self.tokens.values()) < 1 or min(self.claims.values(), default=0) < 1:
            raise ValueError("every honest configuration needs >= 1 token and >= 1 claim")
        return self


def to_json(det) -> dict:
    out = {}
    if getattr(det, "provenance_", None) is not None:
        out["provenance"] = det.provenance_.model_dump(mode="json")
    if getattr(det, "calibration_", None) is not None:
        out["calibration"] = det.calibration_.model_dump(mode="json")
    return out


def read(d: dict, where: str, fix: str) -> tuple[Provenance | None, Calibration | None]:
    """The provenance and calibration a detector file's JSON records (validated; None where absent)."""
    provenance = parse_provenance(d["provenance"], where, fix) if "provenance" in d else None
    if "calibration" not in d:
        return provenance, None
    try:
        return provenance, Calibration.model_validate(d["calibration"])
    except ValidationError as e:
        err = e.errors()[0]
        raise VerinferError(f"bad calibration field {'.'.join(map(str, err['loc']))}: {err['msg']}",
                            where=where, fix=fix) from None


def check_numbers(fitted, path: str = "fitted") -> None:
    """A ValueError naming the first NaN in the fitted JSON (numbers, lists, base64 float64 arrays)."""
    if isinstance(fitted, dict):
        for k, v in fitted.items():
            if isinstance(k, str) and k.endswith("_f8_base64"):
                for i, text in enumerate(v if isinstance(v, list) else [v]):
                    a = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f8")
                    if np.isnan(a).any():
                        raise ValueError(f"{path}.{k}[{i}] holds NaN at value {int(np.flatnonzero(np.isnan(a))[0])}")
            else:
                check_numbers(v, f"{path}.{k}")
    elif isinstance(fitted, list):
        for i, v in enumerate(fitted):
            check_numbers(v, f"{path}[{i}]")
    elif isinstance(fitted, float) and math.isnan(fitted):
        raise ValueError(f"{path} is NaN")
