"""A detector's verdict on a batch of tokens: `Verdict`, typed and frozen, and `combine_verdicts`.

Every detector's `verdict` (`detect.base`, `detect.sequential`) returns one; the audit adds whom
it judged (`with_(provider=..., honest=..., heldout_fpr=...)`), combines several detectors'
(`combine_verdicts`), `cli.render` draws them in the terminal, `report.html` on the page, and
`to_dict()` is the JSON `verinfer audit --json` and the demo's verdicts.json write.

Fields every verdict may report (typed attributes, FIELDS; None where a verdict does not report one):

    flagged, pooled, threshold   the decision: the batch statistic `pooled` exceeds `threshold`
    p_value, tail_probability    the statistic's tail probability under the honest null (the same
                                 number), and how it was computed (p_value_method)
    n_tokens, target_fpr         tokens judged; the false-positive rate the threshold is set at
    threshold_fpr                the threshold's rate on the resampled honest null
    more_tokens_needed           not flagged: tokens a decision would still need if the excess
                                 persisted (None: no excess over honest; not reported: unknown)
    decision, score              the verdict in words; what the statistic is
    provider, honest             whom it judged, and its truth where known (simulated providers)
    heldout_fpr(_batch_tokens)   the detector's FPR on held-out honest claims at calibration

and detector-specific `extra` values (JSON values: e.g. clip, power, p_value_bound,
detectable_excess, strongest_alternative, decided_at_tokens, tokens_available, nearest_band).
`reported` lists the keys the verdict reports, in the order its JSON lists them: a key can be
reported with the value None (more_tokens_needed: "no excess") or not reported at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

JSONValue = Union[None, bool, int, float, str, list, dict]  # what an `extra` value may be

REQUIRED = ("flagged", "pooled", "threshold", "p_value", "n_tokens", "target_fpr", "decision")


@dataclass(frozen=True)
class Verdict:
    """One verdict (module docstring). Build it with `Verdict.of(**values)` (the keys reported in
    the order given; unknown keys go to `extra`) or the constructor (the required fields, then
    every optional one that is not None, then the extras); change it with `with_` / `without`."""

    flagged: bool
    pooled: float
    threshold: float
    p_value: float
    n_tokens: int
    target_fpr: float
    decision: str
    tail_probability: float | None = None
    p_value_method: str | None = None
    threshold_fpr: float | None = None
    more_tokens_needed: int | None = None
    score: str | None = None
    provider: str | None = None
    honest: bool | None = None
    heldout_fpr: float | None = None
    heldout_fpr_batch_tokens: int | None = None
    extra: Mapping[str, JSONValue] = field(default_factory=dict)
    reported: tuple[str, ...] = ()

    def __post_init__(self):
        clash = [k for k in self.extra if k in FIELDS or k in ("extra", "reported")]
        if clash:
            raise ValueError(f"extra values {clash} are Verdict fields: pass them as fields")
        object.__setattr__(self, "extra", dict(self.extra))
        if not self.reported:
            keys = [k for k in FIELDS if k in REQUIRED or getattr(self, k) is not None]
            object.__setattr__(self, "reported", tuple(keys) + tuple(self.extra))
        unknown = [k for k in self.reported if k not in FIELDS and k not in self.extra]
        missing = [k for k in REQUIRED if k not in self.reported] + [k for k in self.extra if k not in self.reported]
        if unknown or missing or len(set(self.reported)) != len(self.reported):
            raise ValueError(f"reported keys {self.reported} must name each required field and extra value once "
                             f"(unknown {unknown}, missing {missing})")
        unreported = [k for k in FIELDS if k not in self.reported and getattr(self, k) is not None]
        if unreported:
            raise ValueError(f"fields {unreported} have values but are not reported")

    @classmethod
    def of(cls, **values) -> "Verdict":
        """A verdict reporting these values in this order (keys that are not fields go to `extra`)."""
        return cls(**{k: v for k, v in values.items() if k in FIELDS},
                   extra={k: v for k, v in values.items() if k not in FIELDS}, reported=tuple(values))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Verdict":
        """The inverse of `to_dict` (the JSON `verinfer audit --json` writes)."""
        return cls.of(**d)

    def get(self, key: str, default: Any = None) -> Any:
        """The reported value of `key` (a field or an extra), `default` when it is not reported."""
        if key not in self.reported:
            return default
        return self.extra[key] if key in self.extra else getattr(self, key)

    def to_dict(self) -> dict:
        """The verdict as JSON values: its reported keys in order (what `audit --json` writes)."""
        return {k: self.get(k) for k in self.reported}

    def with_(self, **changes) -> "Verdict":
        """A copy with these values (fields or extras); keys it did not report are added at the end."""
        return dataclasses.replace(
            self, **{k: v for k, v in changes.items() if k in FIELDS},
            extra={**self.extra, **{k: v for k, v in changes.items() if k not in FIELDS}},
            reported=self.reported + tuple(k for k in changes if k not in self.reported))

    def without(self, *keys: str) -> "Verdict":
        """A copy that does not report these keys (a required field cannot be dropped)."""
        required = [k for k in keys if k in REQUIRED]
        if required:
            raise ValueError(f"a verdict always reports {', '.join(required)}")
        return dataclasses.replace(self, **{k: None for k in keys if k in FIELDS},
                                   extra={k: v for k, v in self.extra.items() if k not in keys},
                                   reported=tuple(k for k in self.reported if k not in keys))


# the typed fields a verdict may report (its other values are `extra`)
FIELDS = tuple(f.name for f in dataclasses.fields(Verdict) if f.name not in ("extra", "reported"))


def combine_verdicts(per_detector: list[list[Verdict]]) -> list[Verdict]:
    """Token-DiFR + Activation-DiFR (or any detectors) on the same providers: one row per
    provider and detector (provider shown as `name [score]`) plus a `name [combined]` row that is
    flagged when any detector flags it (union bound: its false-positive rate is at most the sum of
    the detectors' targets, so calibrate each at target/m) with Bonferroni p = min(1, m * min p)."""
    if len(per_detector) == 1:
        return per_detector[0]
    m, rows = len(per_detector), []
    for name_rows in zip(*per_detector):
        rows += [v.with_(provider=f"{v.provider} [{v.get('score', '?')}]") for v in name_rows]
        best = min(name_rows, key=lambda v: v.p_value)
        rows.append(best.with_(provider=f"{best.provider} [combined]", flagged=any(v.flagged for v in name_rows),
                               p_value=min(1.0, m * best.p_value), target_fpr=sum(v.target_fpr for v in name_rows),
                               n_tokens=max(v.n_tokens for v in name_rows),
                               scores=[v.get("score") for v in name_rows])
                    .without("threshold_fpr", "more_tokens_needed", "heldout_fpr", "power"))
    return rows
