"""Deterministic reference forward: per-token logits bitwise independent of batch size, of the
requests sharing the batch, and of how a sequence is split into prefill chunks / decode steps.

Idea (in the spirit of thinking-machines' batch_invariant_ops): a reduction gives the same bits
when it runs with the same shape and order. So every matmul here runs with a FIXED shape,
whatever the batch:
- linear layers: the token rows are cut into tiles of `row_tile` rows (zero-padded) and each
  tile is one F.linear of shape [row_tile, D_in] x [D_in, D_out];
- attention: each row's keys are padded to a fixed `key_slots` (the model's context; padded and
  future slots masked to probability exactly 0), queries are cut into tiles of `query_tile`
  and each (row, kv-head, tile) is one bmm item of shape [rep*query_tile, E] x [E, key_slots];
  softmax in fp32 over the fixed key_slots (as transformers' eager attention);
- RMSNorm / RoPE / SiLU are row-wise or elementwise already.
Whether a library kernel gives a row the same bits at every position of a fixed-shape tile is
checked, not assumed: tests/determinism/test_invariant.py compares batch sizes 1..32, other
co-batched requests, chunked prefill and token-by-token decode bitwise.

`layercast(model)` is the LayerCast baseline: bf16-rounded weights, fp32 compute.

Shape key: B=batch, H=query heads, G=kv heads, T=tokens in a call, S=key slots, E=head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from verinfer.models.llama import KVCache, LlamaLM

ROW_TILE = 64
QUERY_TILE = 8


class BatchInvariantLM(LlamaLM):
    """The same weights as `base`, computed with fixed-shape (batch-invariant) kernels."""

    def __init__(self, base: LlamaLM, row_tile: int = ROW_TILE, query_tile: int = QUERY_TILE,
                 key_slots: int | None = None):
        super().__init__(base.config, base.w, attn="eager")
        self.row_tile = row_tile
        self.query_tile = query_tile
        self.key_slots = key_slots or base.config.max_position_embeddings

    def _linear(self, x, name):
        W = self.w[name]
        b = self.w.get(name.replace(".weight", ".bias"))
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1])
        N, R = x_ND.shape[0], self.row_tile
        pad = (-N) % R
        if pad:
            x_ND = torch.cat([x_ND, x_ND.new_zeros(pad, x_ND.shape[1])])
        y = torch.cat([F.linear(x_ND[i : i + R], W, b) for i in range(0, x_ND.shape[0], R)])
        return y[:N].reshape(*lead, W.shape[0])

    def _attention(self, q_BHTE, k_BGSE, v_BGSE, mask_BTS):
        c = self.config
        B, H, T, E = q_BHTE.shape
        G, S = k_BGSE.shape[1], k_BGSE.shape[2]
        rep, Sf, Q = H // G, self.key_slots, self.query_tile
        if S > Sf:
            raise ValueError(f"{S} key slots exceed the fixed key_slots={Sf}")
        if mask_BTS is None:
            mask_BTS = torch.ones(T, T, dtype=torch.bool, device=q_BHTE.device).tril()[None].expand(B, -1, -1)
        Tp = -(-T // Q) * Q
        nT = Tp // Q
        k = F.pad(k_BGSE, (0, 0, 0, Sf - S))
        v = F.pad(v_BGSE, (0, 0, 0, Sf - S))
        mask = F.pad(mask_BTS, (0, Sf - S, 0, Tp - T), value=False)
        mask[:, T:, 0] = True  # padded queries attend to slot 0 only (no all-masked NaN rows)
        q = F.pad(q_BHTE, (0, 0, 0, Tp - T))
        # [B, G, rep, nT, Q, E] -> [B, G, nT, rep*Q, E]
        q = q.view(B, G, rep, nT, Q, E).permute(0, 1, 3, 2, 4, 5).reshape(B * G * nT, rep * Q, E)
        k = k[:, :, None].expand(B, G, nT, Sf, E).reshape(B * G * nT, Sf, E)
        v = v[:, :, None].expand(B, G, nT, Sf, E).reshape(B * G * nT, Sf, E)
        m = mask.view(B, 1, nT, 1, Q, Sf).expand(B, G, nT, rep, Q, Sf).reshape(B * G * nT, rep * Q, Sf)
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(c.head_dim))
        scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.bmm(probs, v)  # [B*G*nT, rep*Q, E]
        out = out.view(B, G, nT, rep, Q, E).permute(0, 1, 3, 2, 4, 5).reshape(B, H, Tp, E)
        return out[:, :, :T]


def batch_invariant(model: LlamaLM, **kw) -> BatchInvariantLM:
    return model if isinstance(model, BatchInvariantLM) else BatchInvariantLM(model, **kw)


def layercast(model: LlamaLM) -> LlamaLM:
    """LayerCast: keep the (bf16-rounded) weights, compute every layer in fp32."""
    return LlamaLM(model.config, {k: t.float() for k, t in model.w.items()}, attn=model.attn)


class RowsCache(KVCache):
    """A private copy of some rows of a KV cache: a verifier computes on it without touching the
    live cache; `commit(rows_i, slots)` copies chosen columns back (native K/V column repair)."""

    def __init__(self, parent: KVCache, rows: list[int]):
        idx = torch.tensor(rows, device=parent.k[0].device)
        self.parent, self.rows = parent, list(rows)
        self.k = [k.index_select(0, idx) for k in parent.k]
        self.v = [v.index_select(0, idx) for v in parent.v]
        self.max_slots = parent.max_slots
        self.write_hook = parent.write_hook

    def commit(self, i: int, slot0: int, slot1: int) -> None:
        """Copy slots [slot0, slot1) of local row i into the parent's row."""
        r = self.rows[i]
        for pk, pv, k, v in zip(self.parent.k, self.parent.v, self.k, self.v):
            pk[r, :, slot0:slot1] = k[i, :, slot0:slot1]
            pv[r, :, slot0:slot1] = v[i, :, slot0:slot1]
