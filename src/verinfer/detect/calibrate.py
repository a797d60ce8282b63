"""Calibration: a detector fit on honest scores, with everything its file records besides the fit.

    det = calibrate(table, honest, detector="clipped-mean", seed=0, **options)

fits `DETECTORS[detector]` on every honest token (each honest provider one group of its null),
giving its fit what `verinfer audit` reads from the detector file (`detect.record`): the provenance
(the model and settings that replayed the honest scores, from the table's schema metadata,
`verinfer.scores.PARQUET_KEY`), the calibration (tokens and claims per honest provider, and the
false-positive rate on held-out honest claims, `heldout_fpr`) and warnings (appended to the fit's
own): the detector's `fit` sets them as `provenance_`, `calibration_` and `warnings_`.
`split_claims` splits honest claims into a calibration part and an audited part (the demo);
`claim_folds` / `claim_batches` deal claims into folds and batches of whole claims.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from verinfer.detect import record
from verinfer.detect.base import Detector
from verinfer.detect.registry import make_detector
from verinfer.errors import ClaimError, VerinferError
from verinfer.scores import CLAIM_ID, PROVIDER, provenance_of_schema


def claim_folds(table: pa.Table, folds: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(fold, order) per row: each claim (claim_id) in one of `folds` folds, its claims in a random
    order (row order within a claim kept): rows sorted by `order` read the claims one after another."""
    ids = np.asarray(table[CLAIM_ID].to_pylist())
    uniq, inv = np.unique(ids, return_inverse=True)
    rank = np.empty(uniq.size, dtype=np.int64)
    rank[rng.permutation(uniq.size)] = np.arange(uniq.size)
    order = np.empty(ids.size, dtype=np.int64)
    order[np.lexsort((np.arange(ids.size), rank[inv]))] = np.arange(ids.size)
    return rank[inv] % folds, order


def claim_batches(rows: np.ndarray, order: np.ndarray, tokens: int) -> list[np.ndarray]:
    """Disjoint batches of `tokens` of these rows, read in `order` (whole claims one after another,
    the last one cut, as `audit --max-tokens` reads a provider); a shorter rest is dropped."""
    rows = rows[np.argsort(order[rows], kind="stable")]
    return [rows[i:i + tokens] for i in range(0, rows.size - tokens + 1, tokens)]


def split_claims(table: pa.Table, honest: list[str], frac: float = 0.5,
                 seed: int = 0) -> tuple[pa.Table, dict[str, pa.Table]]:
    """Each honest provider's claims split at random: (the first `frac` of them, all providers in
    one table; {provider: the rest}) to calibrate on one part and audit honest providers on the
    other (the demo)."""
    rng = np.random.default_rng(seed)
    train, test = [], {}
    for name in honest:
        rows = table.filter(pc.equal(table[PROVIDER], name))
        if rows.num_rows == 0:
            raise ClaimError(f"no scored tokens for honest provider {name!r}", fix="score its claims first")
        ids = np.asarray(rows[CLAIM_ID].to_pylist())
        uniq = np.unique(ids)
        mask = np.isin(ids, uniq[rng.permutation(uniq.size)[:round(frac * uniq.size)]])
        train.append(rows.filter(pa.array(mask)))
        test[name] = rows.filter(pa.array(~mask))
    return pa.concat_tables(train), test


def calibrate(table: pa.Table, honest: list[str], *, detector: str = "clipped-mean", seed: int = 0,
              folds: int = 5, fpr_batch_tokens: int = 250, **options) -> Detector:
    """Fit a detector (`detect.DETECTORS[detector]`, made with these config options and
    random_state=seed) on every honest token given, each honest provider one group of its null
    (every honest configuration must pass at the target FPR, not just their pool).

    Held-out FPR (`det.calibration_.heldout`): each honest provider's claims are dealt into `folds`
    folds; a detector fit on the other folds audits each fold in disjoint batches of
    `fpr_batch_tokens` tokens of whole claims (`claim_batches`), and the flagged fraction over
    every fold and provider is the false-positive rate measured on honest claims the fit did not
    see (with a 95% Clopper-Pearson upper bound). It measures the procedure on (folds-1)/folds of
    the data, so it is if anything pessimistic for the final detector, fit on all of it. The
    calibration's size (tokens and claims per honest provider) is recorded beside it, and the
    provenance the table's schema records (None when it records none) as `det.provenance_`."""
    det = make_detector(detector, random_state=seed, **options)
    parts, groups, fold_of, order_of, tokens, claims = [], [], [], [], {}, {}
    rng = np.random.default_rng(seed)
    for name in honest:
        rows = det.token_rows(table.filter(pc.equal(table[PROVIDER], name)))
        if rows.num_rows == 0:
            raise ClaimError(f"no scored tokens for honest provider {name!r}", fix="score its claims first")
        fold, order = claim_folds(rows, folds, rng)
        parts.append(rows)
        groups += [name] * rows.num_rows
        fold_of.append(fold)
        order_of.append(order + sum(len(o) for o in order_of))  # rows of the providers one after another
        tokens[name], claims[name] = rows.num_rows, len(set(rows[CLAIM_ID].to_pylist()))
    honest_rows = pa.concat_tables(parts)
    fold, order, groups = np.concatenate(fold_of), np.concatenate(order_of), np.asarray(groups)
    heldout, warnings = heldout_fpr(honest_rows, groups, fold, order, folds, fpr_batch_tokens, detector, seed, options)
    return det.fit(honest_rows, groups=groups, provenance=provenance_of_schema(table.schema, "the honest scores"),
                   calibration=record.Calibration(tokens=tokens, claims=claims, heldout=heldout,
                                                  config=det.json_config()), warnings=warnings)


def heldout_fpr(rows: pa.Table, groups: np.ndarray, fold: np.ndarray, order: np.ndarray, folds: int, batch_tokens: int,
                detector: str, seed: int, options: dict) -> tuple["record.Heldout | None", list[str]]:
    """`calibrate`'s held-out false-positive rate and what it warns: None, with a warning, when a
    fold's complement is too small to fit; no batches, with a warning, when no fold holds a whole
    batch."""
    flagged = batches = 0
    for f in range(folds):
        test = np.flatnonzero(fold == f)
        per_provider = [claim_batches(test[groups[test] == g], order, batch_tokens) for g in np.unique(groups)]
        if not any(per_provider):
            continue
        train = np.flatnonzero(fold != f)
        try:
            det_f = make_detector(detector, random_state=seed, **options).fit(rows.take(train), groups=groups[train])
        except (VerinferError, ValueError) as e:
            return None, [f"no held-out FPR: a detector fit without fold {f + 1}/{folds} fails ({e})"]
        for b in (b for bs in per_provider for b in bs):
            flagged += bool(det_f.verdict(rows.take(b)).flagged)
            batches += 1
    if batches == 0:
        return record.Heldout(folds=folds, batch_tokens=batch_tokens, batches=0, flagged=0), [
            f"no held-out FPR: no fold of an honest configuration holds {batch_tokens} tokens "
            f"(calibrate on more claims, or a smaller --fpr-batch-tokens)"]
    return record.Heldout(folds=folds, batch_tokens=batch_tokens, batches=batches, flagged=flagged,
                          fpr=flagged / batches, fpr_upper95=record.upper95(flagged, batches)), []
