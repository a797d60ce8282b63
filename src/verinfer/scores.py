"""The scores contract: one Parquet row per claimed output token, what replaying a claim says about it.

Replay (`audit/`) writes scores only through this module; detectors (`detect/`), the report and the
apps read them only through it. Columns (every name a constant of this module):

    claim_id, provider, position, token_id   the row's key: claim, who served it, 0-based output
                                             position, the claimed token
    replay_token_id  the token the verifier's replay sampled at that position
    margin           Token-DiFR post-Gumbel margin delta >= 0 (DiFR eq. 1):
                     max_{v in S} (l_v + T G_v) - (l_y + T G_y); +inf if the claimed token y was
                     filtered out at verification time
    exact_match      the replay sampled the claimed token
    cross_entropy    -log p_y under the verifier's filtered sampling distribution; +inf if filtered
    likelihood       log Phi(-margin / (sqrt(2) sigma)) <= 0 (DiFR appendix A; `likelihood_score`)
    fp_l2            Activation-DiFR: L2 distance between the claim's fingerprint and the
                     verifier's recomputation; null at unlogged positions / claims without one
    audit_mode       the audit mode the claim was scored in (`sampling.params.AUDIT_MODES`):
                     "seeded", "greedy" or "unseeded" (sampled, no usable seed: `"seed": null`)
    pit, entropy     unseeded rows only (null elsewhere; `sampling.pit`): the randomized
                     probability integral transform u in [0, 1] of the claimed token under the
                     verifier's filtered distribution (descending probability, u = 1 if filtered
                     out) and that distribution's entropy H (nats); cross_entropy - entropy is the
                     cross-entropy excess. In unseeded rows margin, replay_token_id and
                     exact_match are the noise-free ones (replay = the argmax of the filtered
                     distribution, margin = its raw logit minus the claimed token's): no seed
                     regenerates the sampler's noise, so they are not Token-DiFR's

With `verinfer score --gaps`, the signed gaps the perturbation GLRT reads: `gap{s}` (signed
post-Gumbel gap of the claimed token to its strongest competitor: > 0 the margin of a token the
replay does not reproduce, < 0 minus the runner-up gap of one it does, +inf if filtered out; NaN
for non-Gumbel claims) and `gapT_{r}{s}` at r x the claimed temperature for r in
GAP_TEMPERATURE_FACTORS (s = "_s{slack}", the top-p slack GAP_TOP_P_SLACK), and the same columns
prefixed ENVELOPE_PREFIX: their honest-reference envelope. A remote reference (a vLLM server's
prompt logprobs) adds REMOTE_FIELDS: whether a row is approximate and why.

Speculative claims (`spec` field) are scored into their own table (SPEC_SCHEMA): per token the
event (a accepted / r correction / b bonus) and the checks of standard speculative sampling.

Provenance: every scores file written by `write_scores` records in its schema metadata (key
PARQUET_KEY) the model and settings that replayed it (`Provenance`); `verinfer calibrate` copies
the honest scores' provenance into the detector, and `verinfer audit` refuses scores whose
checked fields differ (`mismatch`). Checked: the model (name, weights and tokenizer sha256), the
claims' noise backends, the verifier's numerics (all but its thread count, which changes no
result) and device type. Recorded, not checked: the verinfer version and the device's full name.

Reading: `read_scores` (one file, checked) and `load_score_tables` (several files keyed by
provider and merged, each read once); `divergence` / `score_column` give a column as float64.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from scipy.special import log_ndtr

from verinfer._version import __version__
from verinfer.errors import VerinferError
from verinfer.io import atomic_write
from verinfer.sampling.params import AUDIT_MODES

# -- column names ---------------------------------------------------------------------------------
CLAIM_ID, PROVIDER, POSITION, TOKEN_ID, REPLAY_TOKEN_ID = "claim_id", "provider", "position", "token_id", \
    "replay_token_id"
MARGIN, EXACT_MATCH, CROSS_ENTROPY, LIKELIHOOD, FP_L2 = "margin", "exact_match", "cross_entropy", "likelihood", \
    "fp_l2"
MODE, PIT, ENTROPY = "audit_mode", "pit", "entropy"  # the audit mode of every row; unseeded rows' features
SCORES = (MARGIN, LIKELIHOOD, EXACT_MATCH, CROSS_ENTROPY)  # Token-DiFR family (one per token)
ACTIVATION_SCORES = (FP_L2,)  # Activation-DiFR: one per logged token (null elsewhere)
ALL_SCORES = SCORES + ACTIVATION_SCORES
REQUIRED = (CLAIM_ID, PROVIDER, MARGIN, EXACT_MATCH, CROSS_ENTROPY)  # what a readable scores file must hold
UNKNOWN_PROVIDER = "unknown"  # the provider of a claim without a `provider` field

SCORE_SCHEMA = pa.schema([
    (CLAIM_ID, pa.string()), (PROVIDER, pa.string()), (POSITION, pa.int32()), (TOKEN_ID, pa.int32()),
    (REPLAY_TOKEN_ID, pa.int32()), (MARGIN, pa.float64()), (EXACT_MATCH, pa.bool_()),
    (CROSS_ENTROPY, pa.float64()), (LIKELIHOOD, pa.float64()), (FP_L2, pa.float64()),
    (MODE, pa.string()), (PIT, pa.float64()), (ENTROPY, pa.float64()),
])
DEFAULT_SIGMA = 0.1  # the likelihood score's noise scale when none is fitted

GAP, GAP_FEATURE = "gap", "gap_0"  # signed gap at the claimed temperature: scores table, features table
LOGIT_GAP = "logit_gap"  # features table (benchmarks/difr_variants.py): replayed minus claimed token's raw logit
GAP_TEMPERATURE_FACTORS = (0.8, 0.9, 1.1, 1.2)
GAP_TOP_P_SLACK = 0.01  # the perturbation GLRT's default top_p_slack
ENVELOPE_PREFIX = "env_"  # the honest-reference envelope's gap columns
APPROXIMATE = "approximate"  # a remote reference's row that is not the exact replay (REMOTE_FIELDS)
REMOTE_FIELDS = (pa.field(APPROXIMATE, pa.bool_()), pa.field("approximate_reason", pa.string()))


def slack_suffix(top_p_slack: float = 0.0) -> str:
    """"_s{slack}" for a non-zero top-p slack (`sampling.gap.block_gaps(..., top_p_slack)`), else ""."""
    return f"_s{float(top_p_slack):g}" if top_p_slack else ""


def temperature_column(factor: float, top_p_slack: float = 0.0) -> str:
    """Name of the signed-gap column at `factor` times the claimed temperature."""
    return f"gapT_{float(factor):g}" + slack_suffix(top_p_slack)


def gap_column(top_p_slack: float = 0.0) -> str:
    """Name of the signed-gap column at the claimed temperature in a features table."""
    return GAP_FEATURE + slack_suffix(top_p_slack)


def gap_column_names(factors=GAP_TEMPERATURE_FACTORS, top_p_slack: float = GAP_TOP_P_SLACK) -> list[str]:
    """The signed-gap columns of a scores table: at 1 x the temperature, then each factor."""
    return [GAP + slack_suffix(top_p_slack)] + [temperature_column(r, top_p_slack) for r in factors]


def schema(gaps: bool = False, envelope: bool = False, extra: tuple = ()) -> pa.Schema:
    """The columns a scores file holds: SCORE_SCHEMA, the signed gaps with `gaps` (and their
    honest-reference envelope with `envelope`), then a reference's own (`extra`, e.g. REMOTE_FIELDS)."""
    names = gap_column_names() if gaps else []
    if gaps and envelope:
        names += [ENVELOPE_PREFIX + c for c in names]
    return pa.schema(list(SCORE_SCHEMA) + [pa.field(c, pa.float64()) for c in names] + list(extra))


# -- speculative claims ---------------------------------------------------------------------------
SPEC_SCHEMA = pa.schema([
    (CLAIM_ID, pa.string()), (PROVIDER, pa.string()), (POSITION, pa.int32()), (TOKEN_ID, pa.int32()),
    ("event", pa.string()), ("spec_accept_nll", pa.float64()), ("spec_violation", pa.bool_()),
    ("spec_score", pa.float64()), ("spec_replay_match", pa.bool_()), ("spec_margin", pa.float64()),
    ("spec_accept_gap", pa.float64()),
])


def spec_table(rows: Mapping[str, np.ndarray], claims: list) -> pa.Table:
    """The SPEC_SCHEMA table of `speculative.spec_claims.verify_spec_claims` rows (claim index,
    position, event, accept_nll, violation, score, replay_match, margin, accept_gap) of `claims`."""
    cs = [claims[i] for i in rows["claim"]]
    return pa.table({
        CLAIM_ID: [c.id for c in cs], PROVIDER: [c.provider or UNKNOWN_PROVIDER for c in cs],
        POSITION: np.asarray(rows["position"], np.int32),
        TOKEN_ID: np.asarray([c.output_token_ids[t] for c, t in zip(cs, rows["position"])], np.int32),
        "event": rows["event"], "spec_accept_nll": rows["accept_nll"], "spec_violation": rows["violation"],
        "spec_score": rows["score"], "spec_replay_match": rows["replay_match"], "spec_margin": rows["margin"],
        "spec_accept_gap": rows["accept_gap"]}, schema=SPEC_SCHEMA)


# -- score values ---------------------------------------------------------------------------------
def likelihood_score(margin, sigma: float) -> np.ndarray:
    """log Phi(-margin / (sqrt(2) sigma)): the log-probability that Gaussian logit noise of std
    sigma on each of two logits closes a gap of `margin` (DiFR appendix A). 0 for margin 0,
    -inf for margin +inf; `log_ndtr` keeps large margins finite (about -z^2/2) instead of log(0)."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    m = np.asarray(margin, dtype=np.float64)
    return log_ndtr(-m / (np.sqrt(2.0) * sigma))


def score_column(table_or_dict, name: str) -> np.ndarray:
    """Column `name` of a scores table (or a dict of arrays) as float64; KeyError / ValueError when
    it is missing or holds nulls."""
    if isinstance(table_or_dict, (pa.Table, pa.RecordBatch)):
        if name not in table_or_dict.column_names:
            raise KeyError(f"score column {name!r} not in table (columns: {', '.join(table_or_dict.column_names)})")
        col = table_or_dict[name]
        if col.null_count:
            raise ValueError(f"score column {name!r} has {col.null_count} null values")
        return np.asarray(col.to_numpy(), dtype=np.float64) if isinstance(col, pa.ChunkedArray) else \
            np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
    if isinstance(table_or_dict, Mapping):
        if name not in table_or_dict:
            raise KeyError(f"score column {name!r} not in columns {', '.join(map(str, table_or_dict))}")
        return np.asarray(table_or_dict[name], dtype=np.float64)
    raise TypeError(f"expected a pyarrow.Table or a dict of arrays, got {type(table_or_dict).__name__}")


def divergence(table_or_dict, score_name: str) -> np.ndarray:
    """The score column `score_name` as float64, oriented so that higher = more divergent from the
    honest reference (DiFR 5.2 multiplies features by -1 where needed): margin, cross_entropy as is;
    1 - exact_match; -likelihood (>= 0, +inf where the likelihood is -inf); fp_l2 only where logged."""
    if score_name not in ALL_SCORES:
        raise ValueError(f"unknown score {score_name!r}; choose one of {', '.join(ALL_SCORES)}")
    if score_name == FP_L2:
        if isinstance(table_or_dict, (pa.Table, pa.RecordBatch)):
            if FP_L2 not in table_or_dict.column_names:
                raise KeyError("score column 'fp_l2' not in table: the claims carried no fingerprints")
            v = table_or_dict[FP_L2].drop_null().to_numpy().astype(np.float64)
        else:
            v = np.asarray(table_or_dict[FP_L2], dtype=np.float64)
        return v[~np.isnan(v)]
    v = score_column(table_or_dict, score_name)
    if score_name == EXACT_MATCH:
        return 1.0 - v
    if score_name == LIKELIHOOD:
        return -v
    return v


# -- provenance -----------------------------------------------------------------------------------
PARQUET_KEY = b"verinfer.provenance"
CHECKED = ("model", "weights_sha256", "tokenizer_sha256", "noise", "numerics", "device_type")
NOT_CHECKED_NUMERICS = ("threads",)
RESCORE = "rescore the claims with `verinfer score`"


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


def make_provenance(info, numerics, device, noise) -> Provenance:
    """The provenance of scores replayed with the model `info` (`models.load.ModelInfo`), these
    numerics (a Numerics or its dict) on `device`, of claims with these noise backends."""
    num = numerics if isinstance(numerics, dict) else numerics.to_dict()
    return Provenance(model=info.name, weights_sha256=info.weights_sha256, tokenizer_sha256=info.tokenizer_sha256,
                      noise=tuple(sorted(set(noise))), numerics=num, device=str(device))


def parse_provenance(d, where: str, fix: str) -> Provenance:
    """A Provenance from JSON (a dict), or a VerinferError naming the bad field."""
    try:
        return Provenance.model_validate(d)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "provenance"
        raise VerinferError(f"bad provenance field {field}: {err['msg']}", where=where, fix=fix) from None


def provenance_metadata(p: Provenance | None) -> dict[bytes, bytes] | None:
    """The Parquet schema metadata that records `p` (None records nothing)."""
    return {PARQUET_KEY: p.model_dump_json().encode()} if p is not None else None


def provenance_of_schema(schema_: pa.Schema, where: str) -> Provenance | None:
    """The provenance a scores schema records (None: written by a verinfer that did not record it)."""
    raw = (schema_.metadata or {}).get(PARQUET_KEY)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise VerinferError(f"its provenance metadata is not JSON ({e})", where=where, fix=RESCORE) from None
    return parse_provenance(d, where, RESCORE)


def mismatch(a: Provenance, b: Provenance) -> list[str]:
    """'field: a-value vs b-value' for every checked field where a and b differ."""
    ca, cb = a.checked(), b.checked()
    return [f"{k}: {_short(ca[k])} vs {_short(cb[k])}" for k in CHECKED if ca[k] != cb[k]]


def _short(v) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items())
    return json.dumps(v) if isinstance(v, list) else str(v)


def scores_provenance(path: str | Path) -> Provenance | None:
    """What replayed a scores file (None: not recorded, an older verinfer)."""
    return provenance_of_schema(_read(path, pq.read_schema), str(path))


def common_provenance(paths: list[str | Path], strict: bool = True) -> Provenance | None:
    """The provenance every scores file records (None when one records none). Files replayed with
    another model or settings are a VerinferError naming both (strict) or give None."""
    first, out = None, None
    for p in paths:
        prov = scores_provenance(p)
        if prov is None:
            return None
        if out is None:
            first, out = p, prov
        elif mismatch(out, prov):
            if not strict:
                return None
            raise VerinferError(f"replayed with other settings than {first} ({'; '.join(mismatch(out, prov))})",
                                where=str(p), fix="calibrate on honest scores of one model and settings")
    return out


ALLOW_UNRECORDED = "--allow-unrecorded-provenance"


def check_provenance(want: Provenance | None, source: str | Path, paths: list[str | Path],
                     allow_unrecorded: bool = False) -> list[str]:
    """Refuse scores replayed with another model or settings than `want` (the provenance of the
    honest calibration scores of the detector file `source`): a VerinferError naming both and every
    differing field. Provenance missing on either side (deleted from a detector, stripped from a
    Parquet file, or written by an older verinfer) is refused too, unless `allow_unrecorded`: then
    it is returned as notes, which the verdicts carry."""
    def unrecorded(where, what: str) -> list[str]:
        if not allow_unrecorded:
            raise VerinferError(f"{what}: verinfer cannot check that the scores and the detector come from the same "
                                "model and settings", where=str(where),
                                fix=f"rescore the claims and recalibrate with this verinfer, or pass {ALLOW_UNRECORDED} "
                                    "to audit anyway (each verdict then says the model was not checked)")
        return [f"{where}: {what}: model and settings not checked ({ALLOW_UNRECORDED})"]

    if want is None:
        return unrecorded(source, "the detector records no provenance")
    notes = []
    for p in paths:
        have = scores_provenance(p)
        if have is None:
            notes += unrecorded(p, "the scores record no provenance")
            continue
        diff = mismatch(want, have)
        if diff:
            raise VerinferError(f"scores of model {have.model} (weights {have.weights_sha256}) cannot be audited with "
                                f"the detector {source}, calibrated on model {want.model} (weights "
                                f"{want.weights_sha256}): they differ in {'; '.join(diff)} (detector vs scores)",
                                where=str(p), fix="calibrate a detector on honest scores replayed with the same model "
                                "and settings, or rescore the claims with the detector's model (`verinfer score "
                                "--model`)")
    return notes


# -- writing --------------------------------------------------------------------------------------
def write_part(table: pa.Table, path: str | Path) -> None:
    """One part of a scores file being built (`io.ResumableParts` writes it atomically)."""
    pq.write_table(table, path)


def read_part(path: str | Path) -> pa.Table:
    return pq.read_table(path)


def part_is_readable(path: str | Path) -> bool:
    """False for a part left truncated by a killed writer (recompute it)."""
    try:
        pq.read_metadata(path)
    except Exception:  # pyarrow raises ArrowInvalid / OSError on truncated files
        return False
    return True


def write_scores(out: str | Path, tables: pa.Table | Iterable[pa.Table], schema_: pa.Schema,
                 provenance: Provenance | None) -> Path:
    """Write a scores file atomically: the tables one after another, each cast to `schema_`, with
    the provenance of the replay in the schema metadata (None only for scores computed in code
    outside `verinfer score`, e.g. tests; `verinfer audit` then warns that it cannot check them)."""
    full = schema_.with_metadata(provenance_metadata(provenance)) if provenance is not None else schema_

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, full) as w:
            for t in [tables] if isinstance(tables, pa.Table) else tables:
                w.write_table(t.cast(full))

    return atomic_write(out, write)


# -- reading --------------------------------------------------------------------------------------
def read_scores(path: str | Path) -> pa.Table:
    """One scores file, checked to be Parquet with the key and Token-DiFR columns and validated
    (`validate_scores`)."""
    t = _read(path, pq.read_table)
    missing = [c for c in REQUIRED if c not in t.column_names]
    if missing:
        raise VerinferError(f"missing score columns {missing}", where=str(path), fix="rerun `verinfer score`")
    validate_scores(t, str(path))
    return t


# The values each score column can hold (`verinfer score` writes nothing else): (low, high, nulls allowed).
# NaN is never a score (fp_l2's unlogged positions are null).
COLUMN_RANGES = {MARGIN: (0.0, np.inf, False), CROSS_ENTROPY: (0.0, np.inf, False),
                 LIKELIHOOD: (-np.inf, 0.0, True), FP_L2: (0.0, np.inf, True), PIT: (0.0, 1.0, True),
                 ENTROPY: (0.0, np.inf, True),
                 POSITION: (0, None, False), TOKEN_ID: (0, None, False), REPLAY_TOKEN_ID: (-1, None, True)}


def validate_scores(t: pa.Table, where: str) -> None:
    """A VerinferError naming the file, column and first bad row when a scores table cannot be what
    `verinfer score` wrote: no rows; a value outside its column's range (COLUMN_RANGES: a margin
    below 0, a NaN, ...); a null exact_match, claim or provider; or a (provider, claim, position)
    twice (its token would count twice)."""
    fix = "rescore the claims with `verinfer score` (the file was edited, or not written by verinfer)"
    if t.num_rows == 0:
        raise VerinferError("the scores file holds no scored tokens", where=where, fix="score at least one claim")
    for name in (CLAIM_ID, PROVIDER, EXACT_MATCH):
        if t[name].null_count:
            raise VerinferError(f"column {name} holds {t[name].null_count} nulls", where=where, fix=fix)
    for name, (low, high, nulls) in COLUMN_RANGES.items():
        if name not in t.column_names:
            continue
        col = t[name]
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise VerinferError(f"column {name}: {col.type}, not a number", where=where, fix=fix)
        if col.null_count and not nulls:
            raise VerinferError(f"column {name} holds {col.null_count} nulls", where=where, fix=fix)
        v = np.asarray(col.to_numpy(zero_copy_only=False) if not col.null_count else col.fill_null(low).to_numpy(),
                       dtype=np.float64)
        bad = np.isnan(v) | (v < low) | ((v > high) if high is not None else False)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise VerinferError(f"column {name} holds {v[i]!r} at row {i} ({int(bad.sum())} such rows): a {name} lies "
                                f"in [{low}, {'inf' if high is None else high}]", where=where, fix=fix)
    if MODE in t.column_names:
        bad_modes = set(t[MODE].unique().to_pylist()) - set(AUDIT_MODES)
        if bad_modes:
            raise VerinferError(f"column {MODE} holds {sorted(map(str, bad_modes))}: a mode is one of "
                                f"{', '.join(AUDIT_MODES)}", where=where, fix=fix)
    if POSITION in t.column_names:
        keys = t.select([PROVIDER, CLAIM_ID, POSITION])
        if keys.group_by(keys.column_names).aggregate([]).num_rows != t.num_rows:
            raise VerinferError("a (provider, claim, position) appears on more than one row: its token would count "
                                "twice", where=where, fix=fix)


def _read(path: str | Path, read):
    """read(path) (pq.read_table or pq.read_schema), or a VerinferError for a missing or unreadable file."""
    p = Path(path)
    if not p.is_file():
        raise VerinferError("no such scores file", where=str(p), fix="run `verinfer score` first")
    try:
        return read(p)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError on truncated files
        raise VerinferError(f"cannot read Parquet ({e})", where=str(p),
                            fix="the file is truncated or not Parquet; rerun `verinfer score` to rebuild it") from e


def load_score_tables(paths: list[str | Path], *, labels: list[str] | None = None, provider: str | None = None,
                      merge: bool = False) -> pa.Table:
    """The rows of every scores file in one table, on the columns all of them have (files scored
    with and without --gaps or fingerprints read together; a detector that needs a dropped column
    says so). Columns of another type than the first file's are an error naming the file. The
    table's metadata records the provenance the files share (none when they differ).

    Inputs are keyed: a row's provider is its claim's, else `provider`, else the file's label
    (`labels[i]`, default the file's stem). The same file twice, or a claim id of a provider that
    another file also holds, is an error (it would count the same tokens twice). A provider found
    in several files is reported per file ("name (label)") unless `merge` pools them.

    Files scored before audit modes were recorded (no audit_mode, pit, entropy) read with newer ones
    keep those columns (`_fill_modes`): their rows' audit_mode is null (greedy or seeded: the rows
    do not say which, but never unseeded), their pit and entropy null, so the seeded detectors'
    refusal of unseeded rows and the unseeded detectors' row selection still see the newer files'."""
    labels = labels or [Path(p).stem for p in paths]
    _refuse_repeated_files(paths)
    tables = [_keyed(read_scores(p), provider or label) for p, label in zip(paths, labels)]
    if not tables:
        raise VerinferError("no scores files given", fix="pass the Parquet files `verinfer score` wrote")
    tables = _common_columns(paths, _fill_modes(tables))
    files_of = _providers_by_file(paths, tables)
    if not merge:
        for name, ks in files_of.items():
            for k in ks if len(ks) > 1 else ():
                t = tables[k]
                prov = pc.if_else(pc.equal(t[PROVIDER], name), f"{name} ({labels[k]})", t[PROVIDER])
                tables[k] = t.set_column(t.column_names.index(PROVIDER), PROVIDER, prov)
    common = common_provenance(paths, strict=False)
    return pa.concat_tables(tables).replace_schema_metadata(provenance_metadata(common))


def _fill_modes(tables: list[pa.Table]) -> list[pa.Table]:
    """Null audit_mode / pit / entropy columns in the tables that lack them where another table has
    them (`load_score_tables`): a file without audit_mode predates unseeded scoring, so none of its
    rows is unseeded; greedy and seeded rows hold the same columns, and nothing in them tells the two
    apart (a scores row records no temperature), so the mode stays null rather than guessed."""
    for name, typ in ((MODE, pa.string()), (PIT, pa.float64()), (ENTROPY, pa.float64())):
        if any(name in t.column_names for t in tables):
            tables = [t if name in t.column_names else t.append_column(pa.field(name, typ), pa.nulls(t.num_rows, typ))
                      for t in tables]
    return tables


def _refuse_repeated_files(paths) -> None:
    seen: dict[Path, str | Path] = {}
    for p in paths:
        key = Path(p).resolve()
        if key in seen:
            raise VerinferError(f"given twice (also as {seen[key]}): its tokens would count twice",
                                where=str(p), fix="pass each scores file once")
        seen[key] = p


def _keyed(t: pa.Table, default_provider: str) -> pa.Table:
    """Rows of claims that name no provider get `default_provider`."""
    named = pc.if_else(pc.equal(t[PROVIDER], UNKNOWN_PROVIDER), default_provider, t[PROVIDER])
    return t.set_column(t.column_names.index(PROVIDER), PROVIDER, named)


def _common_columns(paths, tables: list[pa.Table]) -> list[pa.Table]:
    common = [c for c in tables[0].column_names if all(c in t.column_names for t in tables[1:])]
    out = [tables[0].select(common)]
    for p, t in zip(paths[1:], tables[1:]):
        t = t.select(common)
        try:
            out.append(t.cast(out[0].schema))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            diff = [f"{a.name}: {a.type} vs {b.type}" for a, b in zip(out[0].schema, t.schema) if a.type != b.type]
            raise VerinferError(f"its score columns do not fit those of {paths[0]} ({'; '.join(diff) or e})",
                                where=str(p), fix="rescore the claims with this verinfer (`verinfer score`)") from None
    return out


def _providers_by_file(paths, tables: list[pa.Table]) -> dict[str, list[int]]:
    """{provider: indices of the files holding it}; a (provider, claim) pair in two files is an error."""
    claims_of: dict[tuple[str, str], str | Path] = {}
    files_of: dict[str, list[int]] = {}
    for k, (p, t) in enumerate(zip(paths, tables)):
        pairs = set(zip(t[PROVIDER].to_pylist(), t[CLAIM_ID].to_pylist()))
        for pair in pairs:
            if pair in claims_of:
                raise VerinferError(f"claim {pair[1]!r} of provider {pair[0]!r} is also in {claims_of[pair]}: its "
                                    f"tokens would count twice", where=str(p),
                                    fix="pass each claim once (claim ids must be unique per provider across inputs)")
            claims_of[pair] = p
        for name in {pr for pr, _ in pairs}:
            files_of.setdefault(name, []).append(k)
    return files_of
