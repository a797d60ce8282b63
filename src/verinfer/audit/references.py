"""Honest reference kernels: the verifier replays a claim under several honest numerics and keeps,
per token, the best explanation any of them gives (the *honest envelope*).

Why: a single bf16 replay carries its own rounding noise, and honest providers compute
differently from it (fp32, eager attention, token-by-token decode through a KV cache, padded
batches). A token that one honest kernel does not reproduce at a near tie is usually reproduced by
another. Measured on the detection lab's claim sets (benchmarks/detection_lab.py, ~20k tokens per
honest set): the bf16 teacher-forced replay does not reproduce 0.24-0.68% of each honest
configuration's tokens; no reference of `REFERENCES` (bf16, fp32, bf16 eager, bf16 decode one
claim at a time and in random batches of 8) fails to reproduce 0-0.015% (0-0.02% on held-out
configurations; 0 for fp32, eager and batch-1 providers). Pooled over the honest calibration sets
the unreproduced fraction falls ~65x (0.39% -> 0.006%); a 4-bit-weight / fp8-KV-cache /
temperature-1.1 provider's only by 11-31% (2.2 / 1.5 / 3.5% -> 1.71 / 1.05 / 3.11%).

Envelope: per token and per signed-gap column (`variants.block_gaps`; d > 0 = the replay does not
reproduce the claimed token, by a margin d; d < 0 = it does, with runner-up gap -d), the minimum
of d over the references: the claimed token is as plausible as the honest kernel that explains
it best makes it. Everything downstream (the perturbation GLRT, its honest fit and null) takes
the envelope gaps as it took one replay's gaps; only honest kernels are used.

All references are real PyTorch kernels; none is a misconfiguration.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from verinfer.numerics import Numerics
from verinfer.registry import Registry
from verinfer.scores import score_column
from verinfer.engine.engine import Replay, Request


@dataclass(frozen=True)
class Reference:
    """One honest reference replay: the numerics it computes with, and whether it replays
    token by token through the KV cache (`decode=True`, as a provider decodes; `batch` claims at a
    time, grouped in a seeded random order so that the companions in a batch have nothing to do
    with the provider's own batching) or teacher-forced in one forward per claim (`Engine.replay`)."""

    numerics: Numerics
    decode: bool = False
    batch: int = 1
    group_seed: int = 0


# name -> each honest reference replay; "bf16" is the verifier's primary replay (Engine.replay)
REFERENCES: Registry[Reference] = Registry("honest reference", {
    "bf16": Reference(Numerics(dtype="bf16", attn="sdpa")),
    "fp32": Reference(Numerics(dtype="fp32", attn="sdpa")),
    "bf16-eager": Reference(Numerics(dtype="bf16", attn="eager")),
    "bf16-decode": Reference(Numerics(dtype="bf16", attn="sdpa"), decode=True),
    "bf16-decode-b8": Reference(Numerics(dtype="bf16", attn="sdpa"), decode=True, batch=8, group_seed=1),
})


@torch.no_grad()
def decode_replay(engine, claims, batch: int = 1, group_seed: int = 0) -> list:
    """Teacher-forced replay token by token: prefill the prompts, then feed the claimed tokens
    through `Engine.extend` (the KV-cache decode path a provider samples from), `batch` claims at a
    time (right-padded mixed-length prompts, as `Engine.generate` batches them; with batch > 1 the
    claims are grouped in the random order of `group_seed`; a row whose claim has ended is fed
    token 0, which no other row sees). Returns `engine.Replay`s like `Engine.replay`."""
    out: list = [None] * len(claims)
    order = np.arange(len(claims)) if batch <= 1 else np.random.default_rng(group_seed).permutation(len(claims))
    for s in range(0, len(order), max(1, batch)):
        group = [int(i) for i in order[s : s + max(1, batch)] if claims[int(i)].output_token_ids]
        for i in order[s : s + max(1, batch)]:
            if not claims[int(i)].output_token_ids:
                out[int(i)] = Replay(torch.zeros(0, engine.vocab_size))
        if not group:
            continue
        cs = [claims[i] for i in group]
        reqs = [Request(c.id, list(c.prompt_token_ids),
                        replace(c.sampling, max_tokens=max(c.sampling.max_tokens, len(c.output_token_ids))))
                for c in cs]
        b = engine.prefill(reqs)
        rows = [[b.logits_BV[j].float().clone()] for j in range(len(cs))]
        for t in range(max(len(c.output_token_ids) for c in cs) - 1):
            tok_B1 = torch.tensor([[c.output_token_ids[t] if t < len(c.output_token_ids) else 0] for c in cs],
                                  dtype=torch.long)
            logits_BTV, _ = engine.extend(b, tok_B1)
            for j, c in enumerate(cs):
                if t + 1 < len(c.output_token_ids):
                    rows[j].append(logits_BTV[j, -1].float())
        for j, i in enumerate(group):
            out[i] = Replay(torch.stack(rows[j]).cpu())
    return out


def replay(reference: Reference, engine, claims) -> list:
    """The reference's replays of claims (engine built with reference.numerics)."""
    if reference.decode:
        return decode_replay(engine, claims, reference.batch, reference.group_seed)
    return engine.replay([(c.prompt_token_ids, c.output_token_ids) for c in claims])


def envelope(gaps: list[np.ndarray]) -> np.ndarray:
    """Element-wise minimum of the signed-gap arrays of the same claims under several reference
    replays (same shape each; NaN rows, i.e. claims without Gumbel noise, stay NaN)."""
    if not gaps:
        raise ValueError("no reference gaps")
    arrs = [np.asarray(g, dtype=np.float64) for g in gaps]
    shape = arrs[0].shape
    for a in arrs[1:]:
        if a.shape != shape:
            raise ValueError(f"reference gaps of shapes {shape} and {a.shape}: replays of different claims?")
    return np.minimum.reduce(arrs)


def envelope_table(tables: list, columns) -> dict:
    """{column: envelope of that column over the tables} for the named signed-gap columns of
    several features / score tables of the same claims (rows in the same order, checked by
    claim_id and position when the tables carry them)."""
    if not tables:
        raise ValueError("no reference tables")

    def raw(t, key):
        names = t.column_names if hasattr(t, "column_names") else list(t)
        if key not in names:
            return None
        v = t[key]
        return np.asarray(v.to_pylist() if hasattr(v, "to_pylist") else v)

    for key in ("claim_id", "position"):
        ref = raw(tables[0], key)
        for t in tables[1:]:
            other = raw(t, key)
            if ref is not None and other is not None and not np.array_equal(ref, other):
                raise ValueError(f"reference tables disagree on {key}: replays of different claims or order")
    return {c: envelope([score_column(t, c) for t in tables]) for c in columns}
