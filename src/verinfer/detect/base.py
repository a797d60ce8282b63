"""The detector protocol every verinfer detector follows (sklearn style).

    det = Detector(**config)              config: plain attributes, fixed once constructed
    det.fit(table, groups=None)           learn from honest score rows only; learned attributes end in `_`,
                                          set by the detector's own methods only (fit, from_json)
    det.score(table, max_tokens=None)     the batch statistic of the rows (higher = more divergent)
    det.verdict(table, max_tokens=None)   a `verdict.Verdict`: flagged, pooled (= the statistic),
                                          threshold, p_value, n_tokens, target_fpr, threshold_fpr,
                                          more_tokens_needed, decision, score (what the statistic
                                          is), + detector extras
    det.to_json() / det.save(path)        the fitted detector as JSON (atomic write); no pickle
    Detector.load(path)                   the inverse (`registry.load_detector` picks the class, and
                                          refuses a file without its calibration record)

A table is a pyarrow Table of `verinfer score` rows or a dict of equal-length columns. A detector
reads the columns it names in `columns()` and raises a VerinferError naming the missing ones and
the command that writes them. `token_rows(table)` keeps the rows that carry a token for the
detector (Activation-DiFR distances exist only on logged tokens); `max_tokens` keeps the first
max_tokens of those. `requires_gaps` says whether the columns come from `verinfer score --gaps`.
"""

from __future__ import annotations

import abc
import base64
import json
from collections.abc import Mapping
from dataclasses import FrozenInstanceError, dataclass, field, fields
from pathlib import Path
from typing import ClassVar, TypeVar

import numpy as np
import pyarrow.compute as pc
from verinfer.detect import record
from verinfer.detect.tail import MIN_RESAMPLED_HITS, compress, mean_tail
from verinfer.detect.verdict import Verdict
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_text
from verinfer.sampling.params import UNSEEDED
from verinfer.scores import CLAIM_ID, MODE, Provenance

D = TypeVar("D", bound="Detector")


def read_detector_json(path: str | Path, fix: str = "refit the detector with `verinfer calibrate`") -> dict:
    """A detector file's JSON, or a VerinferError naming the file and what to do."""
    p = Path(path)
    if not p.is_file():
        raise VerinferError("no such detector file", where=str(p), fix="fit one with `verinfer calibrate`")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VerinferError(f"detector file is not valid JSON ({e}); it is probably truncated or corrupt",
                            where=str(p), fix=fix) from e


def column_names(table) -> list[str]:
    """The column names of a pyarrow Table / RecordBatch or a dict of columns."""
    if hasattr(table, "column_names"):
        return list(table.column_names)
    if isinstance(table, Mapping):
        return list(table)
    raise TypeError(f"expected a score table (pyarrow.Table or a dict of columns), got {type(table).__name__}")


def num_rows(table) -> int:
    if hasattr(table, "num_rows"):
        return int(table.num_rows)
    return len(next(iter(table.values()))) if table else 0


def head(table, n: int | None):
    """The first n rows (all when n is None or 0)."""
    if not n:
        return table
    if hasattr(table, "slice"):
        return table.slice(0, n)
    return {k: v[:n] for k, v in table.items()}


def decision_text(flagged: bool, more_tokens: int | None, power: dict | None = None) -> str:
    """The verdict in words. power (`ClippedMeanDetector.power`): what an ok verdict established,
    the probability that a stated deviation would have been flagged at the audited tokens."""
    if flagged:
        return "flagged: inconsistent with honest inference"
    text = "ok: consistent with honest inference"
    if power is not None:
        text += (f"; a deviation of {power['alternative']} would have been caught at these {power['n_tokens']} "
                 f"tokens with probability {power['probability']:.2f}")
    if more_tokens is None:
        return text + " (no excess over the honest null)"
    return text + (f" (a small excess over honest: only if it persisted would ~{more_tokens} more tokens flag it)")


def encode_f8(a: np.ndarray) -> str:
    """An array's values as base64 of little-endian float64 (exact; decode with `decode_f8`)."""
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f8").tobytes()).decode("ascii")


def decode_f8(text: str, n_columns: int | None = None) -> np.ndarray:
    """float64 values from `encode_f8` text ([N] or, with n_columns, [N, n_columns])."""
    a = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f8").astype(np.float64)
    return a if n_columns is None else a.reshape(-1, n_columns)


def decode_groups(texts: list[str], n_columns: int) -> list[np.ndarray]:
    """Per-group [N_g, n_columns] null samples; a ValueError if there is none or one is empty."""
    out = [decode_f8(t, n_columns) for t in texts]
    if not out or min(len(x) for x in out) < 1:
        raise ValueError("empty null sample")
    return out


def stratified_subsample(x: np.ndarray, labels: np.ndarray, cap_total: int, seed: int,
                         sort_values: bool = False) -> list[np.ndarray]:
    """Per group (labels 0..k-1), its rows of x, or cap_total // k of them drawn without replacement
    by default_rng(seed) (one draw per group, in label order): in row order, or sorted by value
    when sort_values."""
    rng = np.random.default_rng(seed)
    n_groups = int(labels.max()) + 1
    cap = max(1, cap_total // n_groups)
    parts = []
    for k in range(n_groups):
        xk = x[labels == k]
        if len(xk) > cap:
            pick = rng.choice(len(xk), cap, replace=False)
            xk = np.sort(xk[pick]) if sort_values else xk[np.sort(pick)]
        parts.append(xk)
    return parts


def claim_labels(table, n: int) -> np.ndarray | None:
    """Integer claim labels of a table's rows (from `claim_id`, in row order), None without the column."""
    if CLAIM_ID not in column_names(table):
        return None
    col = table[CLAIM_ID]
    ids = np.asarray(col.to_pylist() if hasattr(col, "to_pylist") else col)
    if ids.size != n:
        raise ValueError(f"claim_id has {ids.size} rows for {n} scored tokens")
    return np.unique(ids, return_inverse=True)[1].ravel()


def block_sizes(claims: np.ndarray | None, n: int) -> np.ndarray:
    """Lengths of the runs of consecutive rows of one claim (every row its own block without claims)."""
    if claims is None:
        return np.ones(n, dtype=np.int64)
    c = np.asarray(claims)
    starts = np.concatenate([[0], np.flatnonzero(c[1:] != c[:-1]) + 1, [c.size]])
    return np.diff(starts).astype(np.int64)


def group_labels(groups, n: int) -> np.ndarray:
    """Integer labels 0..k-1 of the honest groups (one group when groups is None)."""
    labels = np.zeros(n, dtype=np.int64) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    if labels.size != n:
        raise ValueError(f"groups has {labels.size} labels for {n} tokens")
    return labels


@dataclass(eq=True)
class Detector(abc.ABC):
    """Base of every detector: the protocol above, persistence, column checks, and config
    attributes that cannot be reassigned once constructed (a fitted null depends on them).

    Config every detector shares (keyword-only): target_fpr, the false-positive rate its threshold
    is set at; n_null_batches, resampled honest batches per batch size; random_state, the seed of
    its subsampling and resampling (results are deterministic).

    Subclasses are dataclasses whose init fields are the config; they define NAME (registry name),
    FORMAT / FORMAT_VERSION (the JSON "format" and "version" fields), columns(), _fit() (what fit learns),
    token_scores() (per-token evidence, [N] or [N, C]), statistic_of(evidence), threshold(n),
    verdict(), _fitted_json() / _load_fitted() (the "fitted" part of the JSON)."""

    NAME: ClassVar[str]
    FORMAT: ClassVar[str]
    FORMAT_VERSION: ClassVar[int]
    requires_gaps: ClassVar[bool] = False
    REFIT: ClassVar[str] = "refit the detector with `verinfer calibrate`"
    COLUMNS_FIX: ClassVar[str] = "rescore the claims with `verinfer score`"
    JSON_NAMES: ClassVar[dict] = {}  # config attribute -> its key in the JSON "config" (kept for old files)
    UNSEEDED_ROWS: ClassVar[bool] = False  # whether the detector judges rows scored in unseeded mode

    target_fpr: float = field(default=0.01, kw_only=True)
    n_null_batches: int = field(default=2000, kw_only=True)
    random_state: int = field(default=0, kw_only=True)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.target_fpr, bool) or not isinstance(self.target_fpr, (int, float)) \
                or not 0.0 < self.target_fpr < 1.0:
            raise ValueError(f"target_fpr must be a number in (0, 1), got {self.target_fpr!r}")
        for name, low in (("n_null_batches", 10), ("random_state", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 2**63:
                raise ValueError(f"{name} must be an integer in [{low}, 2**63), got {v!r}")

    def __setattr__(self, name, value):
        if name in self.__dict__ and name in self._config_names():
            raise FrozenInstanceError(f"cannot assign to config field {name!r}: construct a new detector")
        super().__setattr__(name, value)

    @classmethod
    def _config_names(cls) -> tuple[str, ...]:
        """The config fields in __init__'s order: the detector's own, then the shared keyword-only ones."""
        init = [f for f in fields(cls) if f.init]
        return tuple(f.name for f in init if not f.kw_only) + tuple(f.name for f in init if f.kw_only)

    # -- the columns a detector reads ------------------------------------------------------------
    @abc.abstractmethod
    def columns(self, table=None) -> tuple[str, ...]:
        """The score columns this detector reads (of `table`, where names have alternatives)."""

    def require_columns(self, table) -> None:
        """A VerinferError naming the columns the detector reads that `table` lacks, or (a seeded or
        greedy detector) rows scored in unseeded mode: their margins are not Token-DiFR's."""
        names = set(column_names(table))
        missing = [c for c in self.columns(table) if c not in names]
        if missing:
            raise VerinferError(f"the scores lack the column{'s' if len(missing) > 1 else ''} "
                                f"{', '.join(missing)} that the {self.NAME} detector reads", fix=self.COLUMNS_FIX)
        if not self.UNSEEDED_ROWS and MODE in names:
            modes = table[MODE]
            n = int(pc.sum(pc.equal(modes, UNSEEDED)).as_py() or 0) if hasattr(modes, "type") else \
                int(np.count_nonzero(np.asarray(modes, dtype=object) == UNSEEDED))
            if n:
                raise VerinferError(f"{n} scored tokens come from unseeded claims (`\"seed\": null`), which the "
                                    f"{self.NAME} detector cannot judge: without the seed their margins are not "
                                    "Token-DiFR's", fix="audit unseeded claims with the xent-excess and pit-uniformity "
                                                        "detectors, seeded and greedy claims in other scores files")

    def token_rows(self, table):
        """The rows of `table` that carry a token for this detector (all rows unless overridden)."""
        self.require_columns(table)
        return table

    # -- fitting and scoring ---------------------------------------------------------------------
    def fit(self: D, table, groups=None, *, provenance: Provenance | None = None,
            calibration: record.Calibration | None = None, warnings: tuple[str, ...] | list[str] = (),
            **options) -> D:
        """Learn from honest rows (`_fit`, with the detector's own `options`); `groups` (one label per
        row of token_rows(table), e.g. the honest configuration) makes the null guard every honest
        group, not only their pool. What the detector file records besides the fit (`detect.record`;
        `detect.calibrate` gives them, a fit in code has neither): `provenance_`, the model and
        settings that replayed the honest rows, and `calibration_`, its size and held-out FPR.
        `warnings_`: the fit's own warnings, then `warnings`."""
        self.warnings_: list[str] = []
        self._fit(table, groups, **options)
        self._set_record(provenance, calibration)
        self.warnings_ = [*self.warnings_, *warnings]
        return self

    def _fit(self, table, groups=None) -> None:
        """Set the learned attributes from honest rows (each detector defines it; fit calls it, after
        which `warnings_` holds what the fit warns about)."""
        raise NotImplementedError(f"{type(self).__name__} defines no _fit")

    def _set_record(self, provenance: Provenance | None, calibration: record.Calibration | None,
                    unrecorded: str | None = None) -> None:
        """The record; `unrecorded_`: what a file loaded without its calibration record lacks (None:
        nothing, or a fit)."""
        self.provenance_, self.calibration_, self.unrecorded_ = provenance, calibration, unrecorded

    @abc.abstractmethod
    def token_scores(self, table) -> np.ndarray:
        """Per-token evidence of every row of token_rows(table): [N] or [N, C]."""

    @abc.abstractmethod
    def statistic_of(self, evidence: np.ndarray) -> float:
        """The batch statistic of the evidence of a batch of tokens."""

    @abc.abstractmethod
    def threshold(self, n_tokens: int) -> float:
        """Flag a batch of n_tokens tokens when its statistic exceeds this."""

    @abc.abstractmethod
    def verdict(self, table, max_tokens: int | None = None) -> Verdict:
        """Everything a report states about the first max_tokens tokens of `table`."""

    def evidence(self, table, max_tokens: int | None = None) -> np.ndarray:
        """token_scores of the first max_tokens token rows; a ValueError when there are none."""
        x = self.token_scores(head(self.token_rows(table), max_tokens))
        if len(x) == 0:
            raise ValueError("the batch is empty: no scored tokens")
        return x

    def score(self, table, max_tokens: int | None = None) -> float:
        """The batch statistic (higher = more divergent)."""
        return self.statistic_of(self.evidence(table, max_tokens))

    def predict(self, table) -> bool:
        """True (flagged as misconfigured) iff score(table) > threshold(number of tokens)."""
        x = self.evidence(table)
        return bool(self.statistic_of(x) > self.threshold(len(x)))

    def summary(self) -> str:
        """One line describing the fitted detector (printed by `verinfer calibrate`)."""
        return f"{self.NAME}, FPR {self.target_fpr}"

    @abc.abstractmethod
    def _check_fitted(self) -> None:
        """A VerinferError unless fit() or load() has set the learned attributes."""

    def _per_batch_size(self, n_tokens: int, compute):
        """compute(n, rng) once per batch size n (cached), rng = default_rng([random_state, n])."""
        self._check_fitted()
        n = int(n_tokens)
        if n < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        if n not in self._cache:
            self._cache[n] = compute(n, np.random.default_rng([self.random_state, n]))
        return self._cache[n]

    # -- persistence -----------------------------------------------------------------------------
    def config(self) -> dict:
        return {n: getattr(self, n) for n in self._config_names()}

    @abc.abstractmethod
    def _fitted_json(self) -> dict:
        """The learned attributes as JSON values."""

    @abc.abstractmethod
    def _load_fitted(self, fitted: dict) -> None:
        """Set the learned attributes from `_fitted_json`'s output (raise ValueError if inconsistent)."""

    def json_config(self) -> dict:
        """The config as the file's "config" writes it (JSON names and values)."""
        return {self.JSON_NAMES.get(k, k): list(v) if isinstance(v, tuple) else v for k, v in self.config().items()}

    def to_json(self) -> dict:
        return {"format": self.FORMAT, "version": self.FORMAT_VERSION, "config": self.json_config(),
                "fitted": self._fitted_json(), **record.to_json(self)}

    def save(self, path: str | Path) -> None:
        """Write the detector as JSON (atomically: temp file + os.replace). No pickle."""
        atomic_write_text(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, d: dict, where: str = "<dict>", *, allow_unrecorded: bool = True) -> "Detector":
        """The detector of a file's JSON, its fitted values and config checked against its
        calibration record (`detect.record`). allow_unrecorded=False (the audits' loader,
        `registry.load_detector`): a file without that record is refused (`UnrecordedCalibration`);
        a detector loaded without it says so in `unrecorded_`."""
        def bad(what: str) -> VerinferError:
            return VerinferError(what, where=where, fix=cls.REFIT)

        if not isinstance(d, dict) or d.get("format") != cls.FORMAT:
            raise bad(f"not a {cls.NAME} detector file (expected \"format\": \"{cls.FORMAT}\")")
        if d.get("version") != cls.FORMAT_VERSION:
            raise bad(f"detector format version {d.get('version')!r}; this verinfer reads version {cls.FORMAT_VERSION}")
        try:
            attr = {v: k for k, v in cls.JSON_NAMES.items()}
            det = cls(**{attr.get(k, k): tuple(v) if isinstance(v, list) else v for k, v in d["config"].items()})
            record.check_numbers(d["fitted"])
            det._load_fitted(d["fitted"])
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"malformed detector ({type(e).__name__}: {e})") from e
        provenance, calibration = record.read(d, where, cls.REFIT)
        unrecorded = record.unrecorded(calibration)
        if unrecorded is not None and not allow_unrecorded:
            raise record.UnrecordedCalibration(
                f"{unrecorded}: verinfer cannot check the detector's settings and fitted values against what its "
                "calibration produced", where=where,
                fix=f"recalibrate with `verinfer calibrate`, or pass {record.ALLOW_UNRECORDED_CALIBRATION} to "
                    "`verinfer audit` to use it anyway (each verdict then says the calibration was not checked)")
        det._set_record(provenance, calibration, unrecorded=None if unrecorded is None else
                        f"{unrecorded}: calibration not checked ({record.ALLOW_UNRECORDED_CALIBRATION})")
        try:
            if det.calibration_ is not None and det.calibration_.config is not None:
                record.check_config(det.json_config(), det.calibration_)
            det._check_record()
        except ValueError as e:
            raise bad(f"inconsistent detector ({e}): it was edited or corrupted") from e
        return det

    def _check_record(self) -> None:
        """A ValueError when the learned values disagree with what the recorded calibration
        (`calibration_`, None when unrecorded) can produce (detectors that can check it override this)."""

    @classmethod
    def load(cls, path: str | Path, *, allow_unrecorded: bool = True) -> "Detector":
        return cls.from_json(read_detector_json(path, fix=cls.REFIT), where=str(path),
                             allow_unrecorded=allow_unrecorded)


class ColumnStatistics(Detector):
    """Detectors whose per-token evidence is a few columns (token_scores: [N, C]) and whose batch
    statistic is a function of the column means (statistic_of_means), with a resampled null: per
    honest group, n_null_batches batches resampled with replacement; the worst group's
    (1 - target_fpr)-quantile plus `allowance(n)` for the spread between honest groups."""

    @abc.abstractmethod
    def statistic_of_means(self, means_BC: np.ndarray, n_tokens: int) -> np.ndarray:
        """The statistic of rows of column means of batches of n_tokens tokens."""

    @abc.abstractmethod
    def allowance(self, n_tokens: int) -> float:
        """What the null adds for an honest configuration it did not see (0 without groups)."""

    @abc.abstractmethod
    def _more_tokens(self, stat: float, thr: float, n_tokens: int) -> int | None:
        """Tokens a decision would need beyond n_tokens if the per-token excess persisted."""

    def _verdict_extra(self, x: np.ndarray) -> dict:
        """What the verdict reports after `decision` (`Verdict.of` values: score, extras)."""
        return {}

    def _check_fitted(self) -> None:
        if not hasattr(self, "null_samples_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")

    def statistic_of(self, evidence: np.ndarray) -> float:
        return float(self.statistic_of_means(evidence.mean(axis=0), len(evidence)))

    def statistic(self, table) -> float:
        return self.score(table)

    def batch_statistics(self, columns_NC: np.ndarray, n_tokens: int, n_batches: int,
                         rng: np.random.Generator) -> np.ndarray:
        """Statistics of n_batches batches of n_tokens rows drawn with replacement from columns_NC."""
        x = np.asarray(columns_NC, dtype=np.float64)
        n = int(n_tokens)
        per = max(1, 4_000_000 // (n * x.shape[1]))
        out = []
        for s in range(0, n_batches, per):
            k = min(per, n_batches - s)
            out.append(self.statistic_of_means(x[rng.integers(0, len(x), (k, n))].mean(axis=1), n))
        return np.concatenate(out)

    def null_statistics(self, n_tokens: int) -> np.ndarray:
        """Resampled honest batch statistics of the group whose (1 - fpr)-quantile is highest,
        shifted by `allowance(n)` (0 without groups). Deterministic in (random_state, n); cached."""
        def compute(n: int, rng: np.random.Generator) -> np.ndarray:
            per = [self.batch_statistics(xg, n, self.n_null_batches, rng) for xg in self.null_samples_]
            return per[int(np.argmax([np.quantile(p, 1.0 - self.target_fpr) for p in per]))] + self.allowance(n)

        return self._per_batch_size(n_tokens, compute)

    def threshold(self, n_tokens: int) -> float:
        return float(np.quantile(self.null_statistics(n_tokens), 1.0 - self.target_fpr))

    def verdict(self, table, max_tokens: int | None = None) -> Verdict:
        """flagged, the statistic and threshold, the FPR the threshold was set at and its rate on
        the resampled honest null, the tail probability (p-value) under the honest null (resampled,
        worst group plus allowance), and, when not flagged, how many more tokens a decision would
        need if the per-token excess persisted (None = no excess over honest)."""
        x = self.evidence(table, max_tokens)
        n = len(x)
        stat = self.statistic_of(x)
        null = self.null_statistics(n)
        thr = float(np.quantile(null, 1.0 - self.target_fpr))
        p, method = self._p_value(stat, n, null)
        flagged = stat > thr
        more = None if flagged else self._more_tokens(stat, thr, n)
        return Verdict.of(flagged=bool(flagged), pooled=stat, threshold=thr, p_value=p, tail_probability=p,
                          p_value_method=method, n_tokens=n, target_fpr=self.target_fpr,
                          threshold_fpr=float(np.mean(null > thr)), more_tokens_needed=more,
                          decision=decision_text(flagged, more), **self._verdict_extra(x))

    def _p_value(self, stat: float, n: int, null: np.ndarray) -> tuple[float, str]:
        """Resampled, (1 + #null >= stat) / (1 + B), where at least MIN_RESAMPLED_HITS resampled
        statistics reach `stat`; beyond, the union bound over columns of each column's saddle-point
        tail (`detect.tail.mean_tail`): P(max_c f_c(mean_c) + allowance >= stat) <= sum_c P(mean_c >=
        m_c), m_c the column mean at which column c alone reaches stat - allowance (the statistic is
        a max of increasing affine functions f_c of the column means), largest over the honest groups."""
        k = int(np.count_nonzero(null >= stat))
        if k >= MIN_RESAMPLED_HITS:
            return (k + 1) / (null.size + 1), "resampled"
        level = stat - self.allowance(n)
        if "columns" not in self._cache:
            self._cache["columns"] = [[compress(xg[:, c]) for c in range(xg.shape[1])] for xg in self.null_samples_]
        c_count = self.null_samples_[0].shape[1]
        at = [np.full(c_count, -np.inf) for _ in range(2)]
        f0, f1 = [], []
        for c in range(c_count):  # f_c at column means 0 and 1 (every other column -inf)
            at[0][c], at[1][c] = 0.0, 1.0
            f0.append(float(self.statistic_of_means(at[0], n)))
            f1.append(float(self.statistic_of_means(at[1], n)))
            at[0][c] = at[1][c] = -np.inf
        p = max(min(1.0, sum(mean_tail(v, s, n, (level - a) / (b - a)) for (v, s), a, b in zip(cols, f0, f1)))
                for cols in self._cache["columns"])
        return p, "saddle-point (union over columns)"

    def group_evidence(self) -> list[np.ndarray]:
        """Per honest group, its tokens' evidence [n_k, C] as fitted."""
        self._check_fitted()
        return self.null_samples_

    def sequential_blocks(self) -> list[np.ndarray]:
        """Per honest group, [n_blocks_k, C] sums of the evidence `detect.sequential` streams over
        its blocks (claims where the fit knew them; here every token its own block)."""
        return self.group_evidence()

    def sequential_evidence(self, table, max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The evidence `detect.sequential` streams ([N, C], in row order) and the claim label of
        each row (None: every token its own block)."""
        return self.evidence(table, max_tokens), None
