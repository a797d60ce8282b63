"""Replay claims with the trusted model and write one Parquet row per claimed output token.

The rows and columns are the scores contract (`verinfer.scores`: what each column means, the
writer and the reader). With `gaps=True` (needed by the perturbation-GLRT detector, `verinfer
score --gaps`) also the signed-gap columns and, with honest references, their envelope
(`audit.references`: per token the minimum over the primary replay and the other honest
reference kernels of REFERENCES).

Long runs resume: claims are scored in chunks, each written atomically as a part file under
`<out>.parts/` beside a manifest of what is being scored; a rerun skips finished parts; the
final file is assembled atomically and the parts removed.

Speed and memory: every per-token score (filters, noise regeneration, the gap, cross-entropy,
exact match) is computed on the replay device, one forward batch at a time
(`Engine.replay_batches`); only [tokens]-long columns cross to the host, never a tokens x
vocabulary tensor. Claims stream in chunks and the parts are concatenated into the output one
at a time, so memory is bounded by a chunk (and the [rows, V] logits of one batch, at most
LOGITS_BUDGET elements), not by the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch

from verinfer.claims import Claim
from verinfer.io import ResumableParts
from verinfer.engine.engine import Engine, Replay
from verinfer.errors import VerinferError
from verinfer.retokenize import Retokenizer
from verinfer.sampling.gap import block_gaps, score_claimed
from verinfer.sampling.pit import pit_uniforms, unseeded_rows
from verinfer.fingerprint import check_layer, l2_distances, parse_fingerprint
from verinfer.scores import (CLAIM_ID, CROSS_ENTROPY, DEFAULT_SIGMA, ENTROPY, ENVELOPE_PREFIX, EXACT_MATCH, FP_L2,
                             GAP_TEMPERATURE_FACTORS, GAP_TOP_P_SLACK, LIKELIHOOD, MARGIN, MODE, PIT, POSITION,
                             PROVIDER,
                             REPLAY_TOKEN_ID, SCORE_SCHEMA, TOKEN_ID, UNKNOWN_PROVIDER, Provenance, gap_column_names,
                             likelihood_score, make_provenance, part_is_readable, read_part, read_scores,
                             schema as scores_schema,
                             write_part, write_scores)

# Replay batch sizes by device: claims per resumable part, padded tokens per forward batch, and
# elements of one batch's [rows, V] logits. CPU: parts of 64 claims; 2048 tokens keep the
# activations in cache (1.2x faster than 8192 on 2 cores); 2^25 elements = 128 MiB in fp32. Any
# other device (a GPU) needs larger batches to be busy: parts of 1024 claims, and a logits budget
# of 1/64 of a CUDA device's memory in elements (at least 2^28; scoring holds a few fp32/fp64
# copies of a batch's logits): benchmarks/real_model.py speed --device cuda sweeps batch_tokens
# (benchmarks/results/real_model.md).
CHUNK_CLAIMS, BATCH_TOKENS, LOGITS_BUDGET = 64, 2048, 1 << 25
ACCELERATOR_CHUNK_CLAIMS, ACCELERATOR_BATCH_TOKENS, ACCELERATOR_LOGITS_BUDGET = 1024, 16384, 1 << 28


def replay_batch_size(device: str | torch.device) -> tuple[int, int, int]:
    """(chunk_claims, batch_tokens, logits_budget) that `score_claims` uses on `device` (above)."""
    d = torch.device(device)
    if d.type == "cpu":
        return CHUNK_CLAIMS, BATCH_TOKENS, LOGITS_BUDGET
    budget = ACCELERATOR_LOGITS_BUDGET
    if d.type == "cuda":
        budget = max(budget, torch.cuda.get_device_properties(d).total_memory // 64)
    return ACCELERATOR_CHUNK_CLAIMS, ACCELERATOR_BATCH_TOKENS, budget


def gap_args(claims: list[Claim], replays: list[Replay]) -> tuple[list, list, list, list]:
    """What `sampling.gap` takes of replayed claims: logits, claimed ids, params, start positions."""
    dev = replays[0].logits_TV.device if replays else None
    return ([r.logits_TV for r in replays],
            [torch.tensor(c.output_token_ids, dtype=torch.long, device=dev) for c in claims],
            [c.sampling for c in claims], [len(c.prompt_token_ids) for c in claims])


def gap_columns_of(claims: list[Claim], replays: list[Replay], factors=GAP_TEMPERATURE_FACTORS,
                   top_p_slack: float = GAP_TOP_P_SLACK) -> dict:
    """{"gap{s}": [N], "gapT_{r}{s}": [N] per factor}: `sampling.gap.block_gaps` at 1 and each factor
    with that top-p slack (suffix s = "_s{slack}" when the slack is not 0)."""
    g = block_gaps(*gap_args(claims, replays), (1.0, *factors), 1, top_p_slack)[:, :, 0].numpy()
    return dict(zip(gap_column_names(factors, top_p_slack), g.T))


def envelope_gap_columns(claims: list[Claim], primary: dict, references: dict) -> dict:
    """{"env_" + c: envelope} of every signed-gap column c of `primary` (the primary replay's
    `gap_columns_of`) and of each reference's replay of the same claims (references: name ->
    (Reference, Engine with the reference's numerics); `audit.references.replay`). Unseeded claims
    have no noise to gap: they are not replayed again, their rows stay NaN (as in `primary`)."""
    from verinfer.audit.references import envelope, replay

    seeded_i = np.array([not c.sampling.unseeded for c in claims], dtype=bool)
    rows_N = np.repeat(seeded_i, [len(c.output_token_ids) for c in claims])
    gapped = [c for c, s in zip(claims, seeded_i) if s]
    cols = [{c: v[rows_N] for c, v in primary.items()}]
    if gapped:
        cols += [gap_columns_of(gapped, replay(ref, eng, gapped)) for ref, eng in references.values()]
    out = {}
    for c in primary:
        out[ENVELOPE_PREFIX + c] = np.full(rows_N.size, np.nan)
        out[ENVELOPE_PREFIX + c][rows_N] = envelope([k[c] for k in cols])
    return out


def fingerprints_of(claims: list[Claim], config, first=None) -> tuple[list, int | None, object]:
    """Parse and validate the chunk's claims' `activations` before it is replayed (bad input fails fast,
    naming file:line and field; a layer the model (`config`: hidden_size, num_hidden_layers) does
    not have included); return them (None where absent), the hidden layer to replay and the first
    fingerprint seen. first: one of earlier claims of the same file, whose spec all must share."""
    fps, layer = [], first.spec.layer if first is not None else None
    for i, c in enumerate(claims):
        obj = c.extra.get("activations")
        if obj is None:
            fps.append(None)
            continue
        where = c.source or f"claim {c.id!r}"
        fp = parse_fingerprint(obj, where, n_output=len(c.output_token_ids), hidden_size=config.hidden_size,
                               expect=first.spec if first is not None else None)
        check_layer(fp, config.num_hidden_layers, where)
        first = first or fp
        layer = fp.spec.layer
        fps.append(fp)
    return fps, layer, first


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
    (-log p_y under the verifier's filtered sampling distribution, +inf if filtered out),
    the likelihood score and the row's audit mode. All claims of the chunk are scored in one
    vectorized pass per mode. Unseeded claims (`SamplingParams.unseeded`) are scored from the
    distribution alone (`unseeded_columns`): they add pit and entropy, and their margin, replay and
    exact match are the noise-free ones. gaps: also the signed-gap columns (module docstring;
    NaN in unseeded rows, which have no noise to gap)."""
    n_i = [len(c.output_token_ids) for c in claims]
    N = sum(n_i)
    token_N = (np.concatenate([np.asarray(c.output_token_ids, dtype=np.int32) for c in claims]) if claims
               else np.zeros(0, np.int32))
    unseeded_i = np.array([c.sampling.unseeded for c in claims], dtype=bool)
    unseeded_N = np.repeat(unseeded_i, n_i)
    margin, replay, kept, logp = (np.empty(N, np.float64), np.empty(N, np.int64), np.empty(N, bool),
                                  np.empty(N, np.float64))
    pit, ent = np.full(N, np.nan), np.full(N, np.nan)
    for sel, fn in ((~unseeded_i, _seeded_columns), (unseeded_i, unseeded_columns)):
        if sel.any():
            idx = np.flatnonzero(sel)
            rows = np.repeat(sel, n_i)
            cols = fn([claims[i] for i in idx], [replays[i] for i in idx])
            margin[rows], replay[rows], kept[rows], logp[rows] = cols[:4]
            if fn is unseeded_columns:
                pit[rows], ent[rows] = cols[4:]
    xent = np.where(kept, -logp, math.inf)
    table = pa.table({
        CLAIM_ID: np.repeat(np.array([c.id for c in claims], dtype=object), n_i),
        PROVIDER: np.repeat(np.array([c.provider or UNKNOWN_PROVIDER for c in claims], dtype=object), n_i),
        POSITION: np.concatenate([np.arange(n, dtype=np.int32) for n in n_i]) if claims else np.zeros(0, np.int32),
        TOKEN_ID: token_N,
        REPLAY_TOKEN_ID: replay.astype(np.int32),
        MARGIN: margin,
        EXACT_MATCH: replay == token_N,
        CROSS_ENTROPY: xent,
        LIKELIHOOD: likelihood_score(margin, sigma),
        FP_L2: (pa.array(fp_l2, mask=np.isnan(fp_l2), type=pa.float64()) if fp_l2 is not None
                else pa.nulls(token_N.size, pa.float64())),
        MODE: np.repeat(np.array([c.sampling.audit_mode for c in claims], dtype=object), n_i),
        PIT: pa.array(pit, mask=~unseeded_N, type=pa.float64()),
        ENTROPY: pa.array(ent, mask=~unseeded_N, type=pa.float64()),
    }, schema=SCORE_SCHEMA)
    if gaps:
        cols = {name: np.full(N, np.nan) for name in gap_column_names()}
        if (~unseeded_i).any():
            idx = np.flatnonzero(~unseeded_i)
            for name, col in gap_columns_of([claims[i] for i in idx], [replays[i] for i in idx]).items():
                cols[name][~unseeded_N] = col
        for name, col in cols.items():
            table = table.append_column(pa.field(name, pa.float64()), pa.array(col, pa.float64()))
    return table


def _seeded_columns(claims: list[Claim], replays: list[Replay]) -> tuple[np.ndarray, ...]:
    """(margin, replay, kept, log p_y) of seeded and greedy claims (`sampling.gap.score_claimed`)."""
    return tuple(x.cpu().numpy() for x in score_claimed(*gap_args(claims, replays)))


def unseeded_columns(claims: list[Claim], replays: list[Replay]) -> tuple[np.ndarray, ...]:
    """(margin, replay, kept, log p_y, pit, entropy) of unseeded claims (`sampling.pit.unseeded_rows`:
    noise-free margin and replay; the PIT's uniforms from `pit_uniforms`, keyed by claim id), computed
    on the replay's device, [N] each to the host."""
    l_NV = torch.cat([r.logits_TV for r in replays])
    x_N = torch.cat([torch.tensor(c.output_token_ids, dtype=torch.long) for c in claims])
    v_N = torch.cat([pit_uniforms(c.id, len(c.output_token_ids)) for c in claims])
    params_N = [c.sampling for c in claims for _ in c.output_token_ids]
    r = unseeded_rows(l_NV, x_N, params_N, v_N)
    return tuple(t.cpu().numpy() for t in (r.margin, r.replay, r.kept, r.logp, r.pit, r.entropy))


def _manifest(model_sha: str, numerics: dict, sigma: float, chunk: int, gaps: bool = False, references=()) -> dict:
    """What every part of a scores job shares; each part's own claims are named by its `part_key`."""
    m = {"model_weights_sha256": model_sha, "numerics": numerics, "sigma": sigma, "chunk_claims": chunk, "format": 4}
    if gaps:
        m["gaps"] = list(GAP_TEMPERATURE_FACTORS)
    if references:
        m["references"] = sorted(references)
    return m


def replay_identity(engine) -> dict:
    """What replayed the claims, for a scores job's manifest and provenance: an Engine's (or a Ray
    pool's) Numerics, a remote reference's URL spec (`RemoteReference.reference_spec`)."""
    spec = getattr(engine, "reference_spec", None)
    return (spec if spec is not None else engine.numerics).to_dict()


def part_key(chunk: list[Claim]) -> str:
    """The identity of a part's claims (sha256 of their JSON, 16 hex digits): a finished part is
    reused wherever the same claims come at the same place of a file, however the file has grown."""
    h = hashlib.sha256()
    for c in chunk:
        h.update(json.dumps(c.to_json(), sort_keys=True).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Scored:
    """What `score_claims` wrote: the Parquet file and its size (read it with `table()`)."""

    path: Path
    claims: int
    tokens: int
    parts: tuple[Path, ...] = ()  # growing=True: every part, in claim order (`path` is not written)

    def table(self) -> pa.Table:
        if self.parts:
            return pa.concat_tables([read_part(p) for p in self.parts])
        return read_scores(self.path)


class StreamRows:
    """The rows of a growing claims file's claims, each claim replayed once: `scores(claims)` is a
    `score_claims(..., growing=True)` over the claims so far (it replays the claims no part holds
    yet); each call returns the rows of the parts it has not returned before (None: none)."""

    def __init__(self, scores: Callable[[list[Claim]], Scored]):
        self.scores, self.returned = scores, 0

    def __call__(self, claims: list[Claim]) -> pa.Table | None:
        parts = self.scores(claims).parts
        new, self.returned = parts[self.returned:], len(parts)
        return pa.concat_tables([read_part(p) for p in new]) if new else None


def score_chunk(claims: list[Claim], engine: Engine, *, sigma: float = DEFAULT_SIGMA, fps: list | None = None,
                layer: int | None = None, gaps: bool = False, batch_tokens: int | None = None,
                logits_budget: int | None = None, references: dict | None = None,
                retokenizer: Retokenizer | None = None) -> pa.Table:
    """`scores_table` of the claims, in their order, computed batch by batch on the engine's
    device: each forward batch of `Engine.replay_batches` is scored where its logits are and
    dropped before the next one. batch_tokens / logits_budget: `replay_batch_size` of the
    engine's device unless given. With gaps and references (name -> (Reference, Engine)): also the
    envelope columns (`envelope_gap_columns`), the claims replayed once more per reference.
    retokenizer: claims whose ids were derived from text are re-cut where the replay segments the
    same text differently (`recut_claims`); the table holds the ids that were scored."""
    kwargs = dict(sigma=sigma, gaps=gaps, batch_tokens=batch_tokens, logits_budget=logits_budget)
    per_claim = _score_each(claims, engine, fps, layer, **kwargs)
    if retokenizer is not None and any(c.derived for c in claims):
        claims = list(claims)
        fp_of = {c.id: fp for c, fp in zip(claims, fps)} if fps is not None else None
        recut_claims(claims, per_claim, retokenizer,
                     lambda cs: _score_each(cs, engine, None if fp_of is None else [fp_of[c.id] for c in cs], layer,
                                            **kwargs))
    if not claims:
        return scores_schema(gaps, bool(references)).empty_table()
    table = pa.concat_tables(per_claim)
    if gaps and references:
        primary = {c: table[c].to_numpy() for c in gap_column_names()}
        for name, col in envelope_gap_columns(claims, primary, references).items():
            table = table.append_column(pa.field(name, pa.float64()), pa.array(col, pa.float64()))
    return table


MAX_RECUTS = 64  # re-cut steps per claim (each proposes, extends or decides one re-cut; honest replies need 0-4)
MAX_UNSUPPORTED_RECUTS = 4  # out-of-set positions `recut_unsupported` tries per claim (honest replies: 0-1)
RECUT_TOLERANCE = 1e-9  # logits: a re-cut is kept only if its span's summed margin is lower by more than this


def rejoin(base: list[int], cand: list[int], t: int) -> tuple[int, int]:
    """(end in base, end in cand) of the span two segmentations of one text differ on, from t: the
    ids after it are the same in both (their longest common suffix, which leaves each its token
    at t: a token inserted at t spans it and the claimed token after it)."""
    k, n = 0, min(len(base), len(cand)) - t - 1
    while k < n and base[-1 - k] == cand[-1 - k]:
        k += 1
    return len(base) - k, len(cand) - k


def span_cost(table: pa.Table, start: int, end: int) -> tuple[float, float]:
    """(summed margin, summed cross-entropy) of a claim's rows [start, end): how far the reference
    is from emitting that span greedily, then how unlikely it finds it."""
    sl = table.slice(start, max(0, end - start))
    return (float(np.sum(sl[MARGIN].to_numpy(zero_copy_only=False))),
            float(np.sum(sl[CROSS_ENTROPY].to_numpy(zero_copy_only=False))))


def outside_cost(table: pa.Table, start: int, end: int) -> tuple[int, float, float]:
    """(tokens outside the kept set, summed margin and cross-entropy of the others) of a claim's
    rows [start, end): `span_cost` that counts out-of-set tokens first."""
    sl = table.slice(start, max(0, end - start))
    m, x = (sl[c].to_numpy(zero_copy_only=False) for c in (MARGIN, CROSS_ENTROPY))
    inside = np.isfinite(m)
    return int(np.sum(~inside)), float(np.sum(m[inside])), float(np.sum(x[inside]))


@dataclass
class _Recut:
    start: int = 0                    # where the next re-cut may begin (in the kept claim)
    t: int = 0                        # where the open candidate leaves the kept claim
    cand: Claim | None = None         # the open candidate (a re-segmentation of the kept claim's text)
    table: pa.Table | None = None     # its scores, once replayed


def recut_claims(claims: list[Claim], per_claim: list[pa.Table], retokenizer: Retokenizer,
                 rescore: Callable[[list[Claim]], list[pa.Table]]) -> None:
    """Re-cut derived claims in place to the segmentation of their text the reference finds most
    consistent with greedy decoding; claims[i] and per_claim[i] are replaced.

    At the first position t where the replay's token r_t differs from the claimed one and spells a
    prefix of the claimed text (`Retokenizer.resegment_at`), a candidate is cut there, replayed
    (`rescore(candidates)` -> their tables) and cut further inside the span it differs on while the
    replay keeps spelling the text otherwise. The span ends where the two segmentations rejoin
    (`rejoin`: the same ids to the end). The candidate replaces the claim only if its span's summed
    margin is lower (ties: its summed cross-entropy), so a re-cut never scores an honest span
    worse than the segmentation it replaces: where the model wrote " binary" and the reference's
    argmax is " b" by a near-tie, the canonical span costs that near-tie, while " b" + "inary"
    costs the reference's 14-logit margin against "inary", and the claim is kept. Where the model
    wrote " `" + "_" and the tokenizer writes " `_", the canonical span costs the reference's
    margin against " `_" and the re-cut costs 0. Search goes on after the span (kept) or after t
    (refused) until no position re-cuts. Every derived claim's text may have been stripped by the
    vendor (`resegment_at(stripped=True)`): whitespace the replay writes at its two ends is
    inserted back, on the same terms."""
    state = {i: _Recut() for i, c in enumerate(claims) if c.derived}
    for _ in range(MAX_RECUTS):
        todo = []
        for i in list(state):
            st = state[i]
            if st.cand is not None:
                base, cand = claims[i].output_token_ids, st.cand.output_token_ids
                end_base, end_cand = rejoin(base, cand, st.t)
                hit = retokenizer.resegment_at(cand, st.table[REPLAY_TOKEN_ID].to_pylist(), st.t + 1,
                                               claims[i].stop_strings, stripped=True)
                if hit is not None and hit[0] < end_cand:   # the replay re-cuts the candidate inside its span
                    st.cand = _with_ids(st.cand, hit[1])
                    todo.append(i)
                    continue
                new, old = span_cost(st.table, st.t, end_cand), span_cost(per_claim[i], st.t, end_base)
                if new[0] < old[0] - RECUT_TOLERANCE or (abs(new[0] - old[0]) <= RECUT_TOLERANCE and new[1] < old[1]):
                    claims[i], per_claim[i], st.start = st.cand, st.table, max(st.t + 1, end_cand)
                else:
                    st.start = st.t + 1
                st.cand = st.table = None
            hit = retokenizer.resegment_at(claims[i].output_token_ids, per_claim[i][REPLAY_TOKEN_ID].to_pylist(),
                                           st.start, claims[i].stop_strings, stripped=True)
            if hit is None:
                del state[i]
                continue
            st.t, st.cand = hit[0], _with_ids(claims[i], hit[1])
            todo.append(i)
        if not todo:
            break
        for i, t in zip(todo, rescore([state[i].cand for i in todo])):
            state[i].table = t
    recut_unsupported(claims, per_claim, retokenizer, rescore)


def recut_unsupported(claims: list[Claim], per_claim: list[pa.Table], retokenizer: Retokenizer,
                      rescore: Callable[[list[Claim]], list[pa.Table]]) -> None:
    """Re-cut unseeded derived claims in place where a claimed token lies outside the reference's
    kept set (margin +inf, u = 1) although another segmentation of the same text does not.

    A sampled model writes non-canonical pieces ("p" + "op" where the tokenizer writes "pop"), and
    the canonical token may be one the claimed top-p / top-k / min-p filters drop: its u = 1 reads
    as the least likely value there is, and the argmax-guided re-cut (`recut_claims`) does not see
    it (the reference's argmax rarely spells the text there). At the first such position t, every
    token that spells another prefix of the text from t (`Retokenizer.prefix_recuts`, the rest
    encoded) is replayed; among those whose span (up to where it rejoins the claim, `rejoin`) holds
    fewer out-of-set tokens than the span it replaces, the one with the fewest, then the least
    summed margin (then cross-entropy) of the others (`outside_cost`), replaces the claim. Search
    goes on after t until no position is left, so a model's "ar" + "t" + "k" where the tokenizer
    writes "art" + "kday" is reached in two steps (the first re-cut may leave an out-of-set token
    for the next). The token before t is re-cut the same way (its candidates replayed beside t's):
    the cut that matters where the model wrote "ord" + "i" + "fic" and the claim held "or" + "di".
    Honest and vendor claims go through the same re-cut (the unseeded calibration's local runs
    are claimed from their text, `core.local_runs.chat_run_claims`), so the null sees what is left.
    At most MAX_UNSUPPORTED_RECUTS positions are tried per claim: an honest reply needs 0-1 (the
    testbed's honest calibration: 75 out-of-set tokens in 12,571, about one claim in five), while a
    substitute model's reply can hold dozens, each costing a replay per candidate (measured on real
    vLLM, 4-bit weights at temperature 1.0 / top-p 0.95: 0.14 claims/s uncapped against 1.3 for the
    same claims seeded); the positions left untried stay evidence."""
    start = {i: 0 for i, c in enumerate(claims) if c.derived and c.sampling.unseeded}
    tried = dict.fromkeys(start, 0)
    for _ in range(MAX_RECUTS):
        asked: list[tuple[int, int, Claim]] = []
        for i in list(start):
            margin = per_claim[i][MARGIN].to_numpy(zero_copy_only=False)
            outside = [t for t in np.flatnonzero(np.isposinf(margin)) if t >= start[i]]
            cands = []
            while outside and not cands:
                t = int(outside.pop(0))
                cands = retokenizer.prefix_recuts(claims[i].output_token_ids, t)
            if not cands or tried[i] >= MAX_UNSUPPORTED_RECUTS:
                del start[i]
                continue
            start[i], tried[i] = t + 1, tried[i] + 1
            asked += [(i, t, _with_ids(claims[i], ids)) for ids in cands]
            if t > 0:  # the cut that matters may be the token before ("or" + "di" where the model wrote "ord" + "i")
                asked += [(i, t - 1, _with_ids(claims[i], ids))
                          for ids in retokenizer.prefix_recuts(claims[i].output_token_ids, t - 1)]
        if not asked:
            return
        best: dict[int, tuple[tuple[int, float, float], Claim, pa.Table]] = {}
        for (i, t, cand), table in zip(asked, rescore([c for _, _, c in asked])):
            end_base, end_cand = rejoin(claims[i].output_token_ids, cand.output_token_ids, t)
            cost = outside_cost(table, t, end_cand)
            if cost[0] < outside_cost(per_claim[i], t, end_base)[0] and (i not in best or cost < best[i][0]):
                best[i] = (cost, cand, table)
        for i, (_, cand, table) in best.items():
            claims[i], per_claim[i] = cand, table


def resegmentation(claims: list[Claim], table: pa.Table) -> tuple[float | None, float | None]:
    """(fraction of derived claims the replay re-cut, fraction of derived claims whose canonical
    ids differ from the ids the endpoint returned, where it returned them: re-tokenization drift)."""
    derived = [c for c in claims if c.derived]
    if not derived:
        return None, None
    scored: dict[str, list[int]] = {}
    for cid, tok in zip(table[CLAIM_ID].to_pylist(), table[TOKEN_ID].to_pylist()):
        scored.setdefault(cid, []).append(tok)
    recut = float(np.mean([scored.get(c.id) != c.output_token_ids for c in derived]))
    known = [c for c in derived if "returned_output_token_ids" in c.chat]
    drift = float(np.mean([c.chat["returned_output_token_ids"] != c.output_token_ids for c in known])) if known else None
    return recut, drift


def _with_ids(c: Claim, ids: list[int]) -> Claim:
    return dataclasses.replace(c, output_token_ids=ids, sampling=dataclasses.replace(c.sampling, max_tokens=len(ids)))


def _score_each(claims: list[Claim], engine: Engine, fps: list | None, layer: int | None, *, sigma: float,
                gaps: bool, batch_tokens: int | None, logits_budget: int | None) -> list[pa.Table]:
    """One `scores_table` per claim, the claims replayed in `Engine.replay_batches` batches."""
    pairs = [(c.prompt_token_ids, c.output_token_ids) for c in claims]
    _, default_tokens, default_budget = replay_batch_size(engine.device)
    batch_tokens, logits_budget = batch_tokens or default_tokens, logits_budget or default_budget
    max_rows = max(1, logits_budget // engine.model.config.vocab_size)
    per_claim: list[pa.Table | None] = [None] * len(claims)
    for group, logits_NV, hidden_ND in engine.replay_batches(pairs, batch_tokens, layer, max_rows):
        cs = [claims[i] for i in group]
        n = [len(c.output_token_ids) for c in cs]
        hidden = hidden_ND.float().cpu().split(n) if hidden_ND is not None else [None] * len(cs)
        replays = [Replay(l_TV, h_TD) for l_TV, h_TD in zip(logits_NV.split(n), hidden)]
        fp_l2 = fingerprint_distances(cs, replays, [fps[i] for i in group]) if layer is not None else None
        t = scores_table(cs, replays, sigma, fp_l2=fp_l2, gaps=gaps)
        for i, o, k in zip(group, itertools.accumulate([0] + n), n):
            per_claim[i] = t.slice(o, k)
    return per_claim


def model_config(engine):
    """The model config (hidden_size, num_hidden_layers, vocab_size) of an Engine or a RayReplayPool."""
    return engine.model.config if isinstance(engine, Engine) else engine.config


def score_claims(claims: Iterable[Claim], engine, out: str | Path, *, model_sha: str = "",
                 sigma: float = DEFAULT_SIGMA, chunk_claims: int | None = None,
                 batch_tokens: int | None = None, logits_budget: int | None = None, progress=None,
                 gaps: bool = False, on_part: Callable[[int], None] | None = None,
                 provenance: Provenance | None = None, references: dict | None = None, info=None,
                 check: Callable[[list[Claim]], None] | None = None,
                 retokenizer: Retokenizer | None = None, growing: bool = False,
                 keep_parts: bool = False) -> Scored:
    """Score every claim into `out` (Parquet), resuming the finished parts of an earlier run
    (verinfer.io.ResumableParts: `<out>.parts/`, under a lock on `out`, so a second writer of the
    same output is refused). A part is reused where the same claims (its `part_key`) come at the
    same place: a file that has grown since (a sequential audit's claims as they arrive) replays
    only its new claims. growing: the claims so far of a file still being collected: the parts
    are kept for the next call and `out` is not written (`Scored.parts`; a later call without
    growing writes it and removes them, unless keep_parts: a file a later command may extend). gaps: add the signed-gap columns (see `scores_table`); with
    references (name -> (Reference, Engine), an Engine only) also their envelope (`score_chunk`).

    engine: an Engine (parts scored here, one after another), an `audit.ray_pool.RayReplayPool`
    (parts scored by its actors, written here as they return: the same parts, bitwise) or an
    `audit.remote_reference.RemoteReference` (a vLLM server's prompt logprobs; its `extra_fields`
    columns are added). on_part(k): called after part k is written (tests interrupt or kill workers
    from it). provenance: what replayed the claims (`verinfer.scores.Provenance`), written into the Parquet
    schema metadata; or info (the model's `models.load.ModelInfo`): the provenance of this engine's
    numerics and device and the noise backends of the claims scored.

    claims may be a stream (`claims.iter_claims`), read once, part by part: each part is checked
    (`check(chunk)`, then its fingerprints) just before it is scored, so bad input stops the run
    with the finished parts kept. retokenizer: claims derived from text are re-cut where the
    reference segments their text differently (`recut_claims`). progress(n): called with the
    claims of each finished part. chunk_claims (claims in a new part), batch_tokens, logits_budget:
    `replay_batch_size` of the engine's device unless given."""
    out = Path(out)
    chunk_claims = chunk_claims or replay_batch_size(engine.device)[0]
    references = references if gaps else None
    if references and not isinstance(engine, Engine):
        raise VerinferError("the honest-reference replays of --gaps run in this process, not on a Ray pool",
                            fix="score with --gaps without --workers / --ray-address")
    manifest = _manifest(model_sha, replay_identity(engine), sigma, chunk_claims, gaps, references or ())
    if retokenizer is not None:
        manifest["recut"] = True
    schema = scores_schema(gaps, bool(references), getattr(engine, "extra_fields", ()))
    kwargs = dict(sigma=sigma, gaps=gaps, batch_tokens=batch_tokens, logits_budget=logits_budget,
                  retokenizer=retokenizer)
    with ResumableParts(out, manifest) as parts:
        plan = PartPlan(parts, chunk_claims, model_config(engine), check, progress)
        if isinstance(engine, Engine):
            results = ((k, score_chunk(chunk, engine, fps=fps, layer=layer, references=references, **kwargs))
                       for k, chunk, fps, layer in plan.to_replay(claims))
        else:
            results = engine.map_parts(plan.to_replay(claims), **kwargs)
        for k, t in results:
            plan.write(k, t)
            del t
            if on_part is not None:
                on_part(k)
        if provenance is None and info is not None:
            provenance = make_provenance(info, replay_identity(engine), engine.device, plan.noise)
        every = tuple(parts.path(k) for k in range(plan.parts))
        if growing:
            return Scored(out, plan.claims, plan.tokens, every)
        write_scores(out, (read_part(p) for p in every), schema, provenance)
        if not keep_parts:
            parts.finish()
    return Scored(out, plan.claims, plan.tokens)


class PartPlan:
    """A scores job's parts as its claims are read: a finished part is reused where the same claims
    (`part_key`) come at the same place, else it and every later part are discarded; new parts hold
    `chunk_claims` claims. Counts the parts, claims and tokens read and the claims' noise backends."""

    def __init__(self, parts: ResumableParts, chunk_claims: int, config, check=None, progress=None):
        self.store, self.chunk_claims, self.config, self.check, self.progress = parts, chunk_claims, config, check, \
            progress
        self.parts = self.claims = self.tokens = 0
        self.noise: set[str] = set()
        self.keys: dict[int, str] = {}
        self.pending: dict[int, int] = {}  # part -> its claims, while it is being replayed

    def to_replay(self, claims: Iterable[Claim]) -> Iterator[tuple]:
        """(k, claims, fingerprints, layer) of every part no earlier run finished."""
        first_fp, it, k = None, iter(claims), 0
        while True:
            known = self.store.meta(k)
            chunk = list(itertools.islice(it, known["claims"] if known else self.chunk_claims))
            if not chunk:
                return
            if self.check is not None:
                self.check(chunk)
            self.noise.update(c.sampling.noise for c in chunk if c.sampling.noise is not None)  # unseeded: none
            self.parts, self.claims = k + 1, self.claims + len(chunk)
            self.tokens += sum(len(c.output_token_ids) for c in chunk)
            fps, layer, first_fp = fingerprints_of(chunk, self.config, first_fp)
            self.keys[k] = part_key(chunk)
            if self.store.done(k) and (known != {"claims": len(chunk), "key": self.keys[k]}
                                       or not part_is_readable(self.store.path(k))):
                self.store.discard_from(k)  # other claims here (or a truncated part): this and later ones
            if self.store.done(k):
                if self.progress is not None:
                    self.progress(len(chunk))
            else:
                self.pending[k] = len(chunk)
                yield k, chunk, fps, layer
            k += 1

    def write(self, k: int, table: pa.Table) -> None:
        """Part k's score rows, written atomically with its claims' key."""
        n = self.pending.pop(k)
        self.store.write(k, lambda tmp: write_part(table, tmp), {"claims": n, "key": self.keys[k]})
        if self.progress is not None:
            self.progress(n)
