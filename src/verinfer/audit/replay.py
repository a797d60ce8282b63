"""Replay claims with the trusted model and write one Parquet row per claimed output token.

Columns: claim_id, provider, position, token_id, replay_token_id, margin (Token-DiFR post-Gumbel
margin; +inf if the claimed token was filtered out), exact_match, cross_entropy (-log p_y under
the verifier's filtered sampling distribution; +inf if filtered out), likelihood
(log Phi(-margin / (sqrt(2) sigma))).

Long runs resume: claims are scored in chunks, each written atomically as a part file under
`<out>.parts/` beside a manifest of what is being scored; a rerun skips finished parts; the
final file is assembled atomically and the parts removed.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from verinfer.audit.claims import Claim, atomic_write_text
from verinfer.audit.scores import likelihood_score
from verinfer.engine.engine import Engine, Replay
from verinfer.errors import VerinferError
from verinfer.sampling.filters import filter_logits
from verinfer.sampling.sampler import postgumbel_margin

SCORE_SCHEMA = pa.schema([
    ("claim_id", pa.string()), ("provider", pa.string()), ("position", pa.int32()), ("token_id", pa.int32()),
    ("replay_token_id", pa.int32()), ("margin", pa.float64()), ("exact_match", pa.bool_()),
    ("cross_entropy", pa.float64()), ("likelihood", pa.float64()),
])
DEFAULT_SIGMA = 0.1


@dataclass
class TokenScores:
    margin_T: np.ndarray
    replay_T: np.ndarray
    exact_T: np.ndarray
    xent_T: np.ndarray


def token_scores(replay: Replay, claim: Claim) -> TokenScores:
    """Per-token Token-DiFR margin, replayed token, exact match and cross-entropy of one claim."""
    p = claim.sampling
    logits_TV = replay.logits_TV
    claimed_T = torch.tensor(claim.output_token_ids, dtype=torch.long)
    margin_T, replay_T, kept_T = postgumbel_margin(logits_TV, claimed_T, p, len(claim.prompt_token_ids))
    if p.greedy:
        logp_TV = torch.log_softmax(logits_TV.double(), -1)
    else:
        logp_TV = torch.log_softmax(replay.filtered(p).double(), -1)
    xent_T = -logp_TV.gather(1, claimed_T[:, None])[:, 0]
    xent_T = torch.where(kept_T, xent_T, torch.full_like(xent_T, math.inf))
    return TokenScores(np.asarray(margin_T, dtype=np.float64), replay_T.numpy(),
                       (replay_T == claimed_T).numpy(), xent_T.numpy())


def scores_table(claims: list[Claim], replays: list[Replay], sigma: float = DEFAULT_SIGMA) -> pa.Table:
    cols = {k: [] for k in SCORE_SCHEMA.names}
    for c, r in zip(claims, replays):
        s = token_scores(r, c)
        n = len(c.output_token_ids)
        cols["claim_id"] += [c.id] * n
        cols["provider"] += [c.provider or "unknown"] * n
        cols["position"].append(np.arange(n, dtype=np.int32))
        cols["token_id"].append(np.asarray(c.output_token_ids, dtype=np.int32))
        cols["replay_token_id"].append(s.replay_T.astype(np.int32))
        cols["margin"].append(s.margin_T)
        cols["exact_match"].append(s.exact_T)
        cols["cross_entropy"].append(s.xent_T)
        cols["likelihood"].append(likelihood_score(s.margin_T, sigma))
    arrays = {k: (np.concatenate(v) if v and isinstance(v[0], np.ndarray) else v) for k, v in cols.items()}
    return pa.table(arrays, schema=SCORE_SCHEMA)


def atomic_write_parquet(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


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


def _manifest(claims_sha: str, model_sha: str, numerics: dict, sigma: float, chunk: int) -> dict:
    return {"claims_sha256": claims_sha, "model_weights_sha256": model_sha, "numerics": numerics,
            "sigma": sigma, "chunk_claims": chunk, "format": 1}


def score_claims(claims: list[Claim], engine: Engine, out: str | Path, *, claims_sha: str | None = None,
                 model_sha: str = "", sigma: float = DEFAULT_SIGMA, chunk_claims: int = 64,
                 batch_tokens: int = 8192, progress=None) -> pa.Table:
    """Score every claim into `out` (Parquet), resuming finished chunks of an earlier run."""
    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    if claims_sha is None:
        claims_sha = hashlib.sha256("".join(json.dumps(c.to_json()) for c in claims).encode()).hexdigest()[:16]
    manifest = _manifest(claims_sha, model_sha, engine.numerics.to_dict(), sigma, chunk_claims)
    mpath = parts / "manifest.json"
    if parts.is_dir():
        try:
            old = json.loads(mpath.read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old != manifest:  # a different job left these parts: start over
            shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    atomic_write_text(mpath, json.dumps(manifest, indent=1))
    tables = []
    for k, start in enumerate(range(0, len(claims), chunk_claims)):
        chunk = claims[start : start + chunk_claims]
        part = parts / f"part-{k:05d}.parquet"
        t = None
        if part.is_file():
            try:
                t = pq.read_table(part)
            except Exception:
                t = None  # a broken part from a killed run: recompute it
        if t is None:
            replays = engine.score([(c.prompt_token_ids, c.output_token_ids) for c in chunk], batch_tokens=batch_tokens)
            t = scores_table(chunk, replays, sigma)
            atomic_write_parquet(t, part)
        tables.append(t)
        if progress is not None:
            progress(sum(len(c.output_token_ids) for c in chunk))
    table = pa.concat_tables(tables) if tables else SCORE_SCHEMA.empty_table()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_parquet(table, out)
    shutil.rmtree(parts)
    return table
