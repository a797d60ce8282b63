"""Replay claims with the trusted model and write one Parquet row per claimed output token.

Columns: claim_id, provider, position, token_id, replay_token_id, margin (Token-DiFR post-Gumbel
margin; +inf if the claimed token was filtered out), exact_match, cross_entropy (-log p_y under
the verifier's filtered sampling distribution; +inf if filtered out), likelihood
(log Phi(-margin / (sqrt(2) sigma))), fp_l2 (Activation-DiFR: L2 distance between the claim's
fingerprint and the verifier's recomputation at logged positions; null at unlogged positions and
for claims without `activations`). With `gaps=True` (needed by the perturbation-GLRT detector,
`verinfer score --gaps`): gap (signed post-Gumbel gap of the claimed token to its strongest
competitor: > 0 the margin of a token the replay does not reproduce, < 0 minus the runner-up gap
of one it does, +inf if filtered out; NaN for non-Gumbel claims) and gapT_{r} (the same at r x the
claimed temperature, r in GAP_TEMPERATURE_FACTORS).

Long runs resume: claims are scored in chunks, each written atomically as a part file under
`<out>.parts/` beside a manifest of what is being scored; a rerun skips finished parts; the
final file is assembled atomically and the parts removed.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from verinfer.claims import Claim
from verinfer.io import ResumableParts, atomic_write_parquet
from verinfer.audit.scores import likelihood_score
from verinfer.engine.engine import Engine, Replay
from verinfer.errors import VerinferError
from verinfer.sampling.gap import block_gaps, score_claimed
from verinfer.fingerprint import l2_distances, parse_fingerprint

SCORE_SCHEMA = pa.schema([
    ("claim_id", pa.string()), ("provider", pa.string()), ("position", pa.int32()), ("token_id", pa.int32()),
    ("replay_token_id", pa.int32()), ("margin", pa.float64()), ("exact_match", pa.bool_()),
    ("cross_entropy", pa.float64()), ("likelihood", pa.float64()), ("fp_l2", pa.float64()),
])
DEFAULT_SIGMA = 0.1
GAP_TEMPERATURE_FACTORS = (0.8, 0.9, 1.1, 1.2)
GAP_TOP_P_SLACK = 0.01  # = PerturbationGLRTDetector.top_p_slack


def temperature_column(factor: float, top_p_slack: float = 0.0) -> str:
    """Name of the signed-gap column at `factor` times the claimed temperature (with a top-p
    slack: `sampling.gap.block_gaps(..., top_p_slack)`)."""
    return f"gapT_{float(factor):g}" + (f"_s{float(top_p_slack):g}" if top_p_slack else "")


def gap_column(top_p_slack: float = 0.0) -> str:
    """Name of the signed-gap column at the claimed temperature in a features table."""
    return "gap_0" + (f"_s{float(top_p_slack):g}" if top_p_slack else "")


def gap_args(claims: list[Claim], replays: list[Replay]) -> tuple[list, list, list, list]:
    """What `sampling.gap` takes of replayed claims: logits, claimed ids, params, start positions."""
    return ([r.logits_TV for r in replays], [torch.tensor(c.output_token_ids, dtype=torch.long) for c in claims],
            [c.sampling for c in claims], [len(c.prompt_token_ids) for c in claims])


def gap_columns_of(claims: list[Claim], replays: list[Replay], factors=GAP_TEMPERATURE_FACTORS,
                   top_p_slack: float = GAP_TOP_P_SLACK) -> dict:
    """{"gap{s}": [N], "gapT_{r}{s}": [N] per factor}: `sampling.gap.block_gaps` at 1 and each factor
    with that top-p slack (suffix s = "_s{slack}" when the slack is not 0)."""
    g = block_gaps(*gap_args(claims, replays), (1.0, *factors), 1, top_p_slack)[:, :, 0].numpy()
    first = "gap" + gap_column(top_p_slack)[len("gap_0"):]
    return {first: g[:, 0], **{temperature_column(r, top_p_slack): g[:, j + 1] for j, r in enumerate(factors)}}


def fingerprints_of(claims: list[Claim], hidden_size: int) -> tuple[list, int | None]:
    """Parse and validate every claim's `activations` before any compute (bad input fails fast,
    naming file:line and field); return them (None where absent) and the hidden layer to replay."""
    fps, layer, first = [], None, None
    for i, c in enumerate(claims):
        obj = c.extra.get("activations")
        if obj is None:
            fps.append(None)
            continue
        where = c.source or f"claim {c.id!r}"
        fp = parse_fingerprint(obj, where, n_output=len(c.output_token_ids), hidden_size=hidden_size,
                               expect=first.spec if first is not None else None)
        first = first or fp
        layer = fp.spec.layer
        fps.append(fp)
    return fps, layer


def fingerprint_distances(claims: list[Claim], replays: list[Replay], fps: list) -> np.ndarray:
    out = []
    for c, r, fp in zip(claims, replays, fps):
        d = np.full(len(c.output_token_ids), np.nan)
        if fp is not None:
            d[fp.positions] = l2_distances(fp, r.hidden_TD)
        out.append(d)
    return np.concatenate(out) if out else np.zeros(0)


def scores_table(claims: list[Claim], replays: list[Replay], sigma: float = DEFAULT_SIGMA,
                 fp_l2: np.ndarray | None = None, gaps: bool = False) -> pa.Table:
    """One row per claimed token: Token-DiFR margin, replayed token, exact match, cross-entropy
    (-log p_y under the verifier's filtered sampling distribution, +inf if filtered out) and
    the likelihood score. All claims of the chunk are scored in one vectorized pass.
    gaps: also the signed-gap columns (module docstring)."""
    margin_N, replay_N, kept_N, logp_N = score_claimed(*gap_args(claims, replays))
    n_i = [len(c.output_token_ids) for c in claims]
    token_N = np.concatenate([np.asarray(c.output_token_ids, dtype=np.int32) for c in claims]) if claims else np.zeros(0, np.int32)
    margin = margin_N.numpy()
    xent = np.where(kept_N.numpy(), -logp_N.numpy(), math.inf)
    table = pa.table({
        "claim_id": np.repeat(np.array([c.id for c in claims], dtype=object), n_i),
        "provider": np.repeat(np.array([c.provider or "unknown" for c in claims], dtype=object), n_i),
        "position": np.concatenate([np.arange(n, dtype=np.int32) for n in n_i]) if claims else np.zeros(0, np.int32),
        "token_id": token_N,
        "replay_token_id": replay_N.numpy().astype(np.int32),
        "margin": margin,
        "exact_match": replay_N.numpy() == token_N,
        "cross_entropy": xent,
        "likelihood": likelihood_score(margin, sigma),
        "fp_l2": (pa.array(fp_l2, mask=np.isnan(fp_l2), type=pa.float64()) if fp_l2 is not None
                  else pa.nulls(token_N.size, pa.float64())),
    }, schema=SCORE_SCHEMA)
    if gaps:
        for name, col in gap_columns_of(claims, replays).items():
            table = table.append_column(pa.field(name, pa.float64()), pa.array(col, pa.float64()))
    return table


def read_scores(path: str | Path) -> pa.Table:
    p = Path(path)
    if not p.is_file():
        raise VerinferError("no such scores file", where=str(p), fix="run `verinfer score` first")
    try:
        t = pq.read_table(p)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError on truncated files
        raise VerinferError(f"cannot read Parquet ({e})", where=str(p),
                            fix="the file is truncated or not Parquet; rerun `verinfer score` to rebuild it") from e
    missing = [c for c in ("claim_id", "provider", "margin", "exact_match", "cross_entropy") if c not in t.column_names]
    if missing:
        raise VerinferError(f"missing score columns {missing}", where=str(p), fix="rerun `verinfer score`")
    return t


def _manifest(claims_sha: str, model_sha: str, numerics: dict, sigma: float, chunk: int, gaps: bool = False) -> dict:
    m = {"claims_sha256": claims_sha, "model_weights_sha256": model_sha, "numerics": numerics,
         "sigma": sigma, "chunk_claims": chunk, "format": 2}
    if gaps:
        m["gaps"] = list(GAP_TEMPERATURE_FACTORS)
    return m


def score_claims(claims: list[Claim], engine: Engine, out: str | Path, *, claims_sha: str | None = None,
                 model_sha: str = "", sigma: float = DEFAULT_SIGMA, chunk_claims: int = 64,
                 batch_tokens: int = 2048, progress=None, gaps: bool = False) -> pa.Table:
    """Score every claim into `out` (Parquet), resuming finished chunks of an earlier run
    (verinfer.io.ResumableParts: `<out>.parts/`, under a lock on `out`, so a second writer of the
    same output is refused). gaps: add the signed-gap columns (see `scores_table`)."""
    out = Path(out)
    if claims_sha is None:
        claims_sha = hashlib.sha256("".join(json.dumps(c.to_json()) for c in claims).encode()).hexdigest()[:16]
    manifest = _manifest(claims_sha, model_sha, engine.numerics.to_dict(), sigma, chunk_claims, gaps)
    fps, layer = fingerprints_of(claims, engine.model.config.hidden_size)
    tables = []
    with ResumableParts(out, manifest) as parts:
        for k, start in enumerate(range(0, len(claims), chunk_claims)):
            chunk = claims[start : start + chunk_claims]
            t = None
            if parts.done(k):
                try:
                    t = pq.read_table(parts.path(k))
                except Exception:
                    parts.discard(k)  # unreadable: recompute it
            if t is None:
                replays = engine.score([(c.prompt_token_ids, c.output_token_ids) for c in chunk],
                                       batch_tokens=batch_tokens, hidden_layer=layer)
                fp_l2 = fingerprint_distances(chunk, replays, fps[start : start + chunk_claims]) if layer is not None \
                    else None
                extra = {k: v for k, v in (("fp_l2", fp_l2), ("gaps", gaps)) if v is not None and v is not False}
                t = scores_table(chunk, replays, sigma, **extra)
                parts.write(k, lambda tmp: pq.write_table(t, tmp))
            tables.append(t)
            if progress is not None:
                progress(sum(len(c.output_token_ids) for c in chunk))
        table = pa.concat_tables(tables) if tables else SCORE_SCHEMA.empty_table()
        atomic_write_parquet(table, out)
        parts.finish()
    return table
