"""What a detector file records besides its fit, validated on load (pydantic).

    "provenance":  the model and settings that replayed its honest calibration scores
                   (`verinfer.scores.Provenance`; `verinfer audit` refuses scores of others)
    "calibration": its calibration data's size (tokens and claims per honest configuration), the
                   false-positive rate measured on honest claims held out of the fit (`Heldout`),
                   and the config the fit used ("config", as the file's "config" writes it)

A detector fit in code, or a file of an older verinfer, has neither. Loading checks the fitted
values against the calibration (each detector's `_check_record`: what the recorded claims and
tokens can produce) and the file's config against the recorded one: an edited setting is refused,
whether the detector uses it (target_fpr: the thresholds move, the held-out FPR does not) or not
(clip_quantile: clip_ is fitted). Without a calibration that records its config, the audits'
loader (`registry.load_detector`) refuses the file (`UnrecordedCalibration`) unless the user
passes ALLOW_UNRECORDED_CALIBRATION; the detector's `unrecorded_` then says so, and so does every
verdict. Every number of a detector's "fitted" part is checked finite (`check_numbers`, +inf
allowed where a detector stores it, never NaN), and float64 arrays (*_f8_base64) decoded and
checked the same way; each detector checks its own ranges on top.
"""

from __future__ import annotations

import base64
import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from scipy.stats import beta

from verinfer.errors import VerinferError
from verinfer.scores import Provenance, parse_provenance

ALLOW_UNRECORDED_CALIBRATION = "--allow-unrecorded-calibration"


class UnrecordedCalibration(VerinferError):
    """A detector file without the calibration record its values are checked against."""


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
        fpr, upper = (None, None) if self.batches == 0 else (self.flagged / self.batches, upper95(self.flagged,
                                                                                                  self.batches))
        for name, have, want in (("fpr", self.fpr, fpr), ("fpr_upper95", self.fpr_upper95, upper)):
            if have != want and (have is None or want is None or not math.isclose(have, want, rel_tol=1e-9)):
                raise ValueError(f"heldout.{name} is {have!r}, but {self.flagged} of {self.batches} held-out batches "
                                 f"flagged make it {want!r}")
        return self


def upper95(flagged: int, batches: int) -> float:
    """The 95% Clopper-Pearson upper bound of a rate of `flagged` of `batches`."""
    return float(beta.ppf(0.95, flagged + 1, batches - flagged)) if flagged < batches else 1.0


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tokens: dict[str, int] = Field(description="calibration tokens per honest configuration")
    claims: dict[str, int] = Field(description="calibration claims per honest configuration")
    heldout: Heldout | None = None
    config: dict | None = Field(default=None, description="the detector's config at the fit (JSON names)")

    @model_validator(mode="after")
    def _positive(self):
        if not self.tokens or min(self.tokens.values()) < 1 or min(self.claims.values(), default=0) < 1:
            raise ValueError("every honest configuration needs >= 1 token and >= 1 claim")
        if set(self.claims) != set(self.tokens):
            raise ValueError(f"claims name the honest configurations {sorted(self.claims)}, tokens "
                             f"{sorted(self.tokens)}")
        if any(self.claims[k] > self.tokens[k] for k in self.tokens):
            raise ValueError("an honest configuration records more claims than tokens")
        return self

    def groups(self) -> list[tuple[str, int, int]]:
        """(name, tokens, claims) per honest configuration, in the order of the null's groups
        (`base.group_labels`: the names sorted)."""
        return [(k, self.tokens[k], self.claims[k]) for k in sorted(self.tokens)]


def to_json(det) -> dict:
    out = {}
    if getattr(det, "provenance_", None) is not None:
        out["provenance"] = det.provenance_.model_dump(mode="json")
    if getattr(det, "calibration_", None) is not None:
        out["calibration"] = det.calibration_.model_dump(mode="json")
        if out["calibration"]["config"] is None:  # a fit in code given a calibration without it
            del out["calibration"]["config"]
    return out


def unrecorded(cal: Calibration | None) -> str | None:
    """What the calibration record lacks to check a detector against (None: nothing)."""
    if cal is None:
        return "the detector records no calibration (its \"calibration\" block is missing)"
    if cal.config is None:
        return ("the detector's calibration record holds no config (a file of an older verinfer, or the block was "
                "edited)")
    return None


def check_config(config: dict, cal: Calibration) -> None:
    """A ValueError naming the first field of the file's "config" that differs from the config the
    calibration recorded (the fit, its thresholds and its held-out FPR hold for that one only)."""
    for key in sorted(set(config) | set(cal.config)):
        have, want = config.get(key), cal.config.get(key)
        if have != want:
            raise ValueError(f"config.{key} is {have!r}, but the detector was calibrated with {want!r} "
                             f"(calibration.config.{key}): its fit, thresholds and held-out FPR hold for that value "
                             "only")


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
