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

`FixedShapeLM` is the second deterministic path, and the one verinfer decodes with: instead of
replacing the library kernels it holds fixed every shape their reduction order depends on, after
checking on this machine which shapes those are (`certify`):
- attention reads a number of cache slots rounded up to a multiple of `slot_multiple` (64), masked
  past each row's position, and gives every row the bits it would get reading all `key_slots` (the
  model's context). The default path reads exactly as many slots as the longest row needs, and CPU
  flash attention then changes a row's bits when its neighbours change: the kernel vectorizes the
  softmax over the key block and computes a ragged tail with scalar code, so a row's last real keys
  fall in the tail or not depending on the block length. With the block a multiple of 64 every real
  key sits in a full vector and the masked ones add exact zeros (`certify` checks exactly this:
  every multiple of 64 up to key_slots gives the same bits);
- every query gets decode semantics, one query per attention item: a call with T > 1 tokens
  (prefill, LLM-42 verification) packs its queries into the head axis (q [B, G*rep*T, 1, E]; GQA
  maps each packed head to its kv head), so a token's attention is computed exactly as in a
  one-token decode step (the kernel's T=1 and T>=2 paths differ in the last bits);
- each linear layer is one GEMM over all rows (in chunks of at most `max_rows`): the per-row
  result of the library GEMM was checked not to depend on the number of rows, for every weight
  shape of the model at this dtype and thread count; a weight that fails the check falls back to
  fixed `ROW_TILE`-row tiles.
Its decode step costs about what the default decode step costs (benchmarks/margingate.py), so it
is the reference, the verifier of margingate / llm42, and the decode path of the `best` policy.

Shape key: B=batch, H=query heads, G=kv heads, T=tokens in a call, S=key slots, E=head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from verinfer.errors import NumericsError
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


# --- FixedShapeLM ---------------------------------------------------------------------------
_CERTIFIED: dict[tuple, bool] = {}
PROBE_ROWS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 65, 100, 128, 129, 256, 512, 1024)


def _gemm_row_invariant(out_f: int, in_f: int, dtype, device, seed: int = 0) -> bool:
    """Does F.linear give every row the same bits whatever the number of rows (1..1024)?"""
    key = ("gemm", out_f, in_f, dtype, str(device), torch.get_num_threads())
    if key not in _CERTIFIED:
        g = torch.Generator().manual_seed(seed)
        W = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype=dtype, device=device)
        X = torch.randn(max(PROBE_ROWS), in_f, generator=g).to(dtype=dtype, device=device)
        one = torch.cat([F.linear(X[i : i + 1], W) for i in range(8)])
        full = F.linear(X, W)
        ok = torch.equal(full[:8], one)
        for M in PROBE_ROWS:
            ok = ok and torch.equal(F.linear(X[:M], W), full[:M])
        _CERTIFIED[key] = ok
    return _CERTIFIED[key]


def _attention_item_invariant(heads: int, kv_heads: int, head_dim: int, slots: int, multiple: int, dtype,
                              device, seed: int = 0) -> bool:
    """Is a one-query attention item's result independent of the other items in the call, of
    the number of slots read (any multiple of `multiple` covering its keys, up to `slots`), and
    does head-packing T queries reproduce T one-query calls bitwise?"""
    key = ("sdpa", heads, kv_heads, head_dim, slots, multiple, dtype, str(device), torch.get_num_threads())
    if key not in _CERTIFIED:
        g = torch.Generator().manual_seed(seed)
        B, T = 6, 7
        rnd = lambda *s: torch.randn(*s, generator=g).to(dtype=dtype, device=device)  # noqa: E731
        k, v, q = rnd(B, kv_heads, slots, head_dim), rnd(B, kv_heads, slots, head_dim), rnd(B, heads, T, head_dim)
        last_B = torch.cat([torch.tensor([slots - 1, T - 1]), torch.randint(T, slots, (B - 2,), generator=g)])
        pos_BT = (last_B[:, None] - T + 1 + torch.arange(T)).to(device)
        mask_BTS = torch.arange(slots, device=device)[None, None] <= pos_BT[:, :, None]
        one = lambda b, t: _sdpa_one_query(q[b : b + 1, :, t : t + 1], k[b : b + 1], v[b : b + 1],  # noqa: E731
                                           mask_BTS[b : b + 1, t : t + 1])
        ref = torch.stack([torch.cat([one(b, t) for t in range(T)], 2)[0] for b in range(B)])
        ok = torch.equal(_sdpa_packed(q, k, v, mask_BTS), ref)
        ok = ok and torch.equal(_sdpa_one_query(q[:, :, :1], k, v, mask_BTS[:, :1]), ref[:, :, :1])
        for b in range(B):  # fewer slots read: every multiple of `multiple` that covers the row
            need = int(last_B[b]) + 1
            for S in range(-(-need // multiple) * multiple, slots, multiple):
                ok = ok and torch.equal(_sdpa_packed(q[b : b + 1], k[b : b + 1, :, :S], v[b : b + 1, :, :S],
                                                     mask_BTS[b : b + 1, :, :S]), ref[b : b + 1])
                ok = ok and torch.equal(_sdpa_one_query(q[b : b + 1, :, -1:], k[b : b + 1, :, :S],
                                                        v[b : b + 1, :, :S], mask_BTS[b : b + 1, -1:, :S]),
                                        ref[b : b + 1, :, -1:])
        _CERTIFIED[key] = ok
    return _CERTIFIED[key]


def _sdpa_one_query(q_BH1E, k_BGSE, v_BGSE, mask_B1S):
    return F.scaled_dot_product_attention(q_BH1E, k_BGSE, v_BGSE, attn_mask=mask_B1S[:, None],
                                          scale=1.0 / math.sqrt(q_BH1E.shape[-1]), enable_gqa=True)


def _sdpa_packed(q_BHTE, k_BGSE, v_BGSE, mask_BTS):
    """T queries per row as T one-query attention items (packed into the head axis)."""
    B, H, T, E = q_BHTE.shape
    G, S = k_BGSE.shape[1], k_BGSE.shape[2]
    rep = H // G
    q = q_BHTE.reshape(B, G * rep * T, 1, E)  # packed head g*rep*T + r*T + t -> kv head g
    m = mask_BTS[:, None, None].expand(B, G, rep, T, S).reshape(B, G * rep * T, 1, S)
    out = F.scaled_dot_product_attention(q, k_BGSE, v_BGSE, attn_mask=m, scale=1.0 / math.sqrt(E),
                                         enable_gqa=True)
    return out.reshape(B, H, T, E)


class FixedShapeLM(LlamaLM):
    """The same weights as `base`, computed by the library kernels at fixed shapes (module doc)."""

    def __init__(self, base: LlamaLM, key_slots: int | None = None, slot_multiple: int = 64, max_rows: int = 1024,
                 certify: bool = True):
        super().__init__(base.config, base.w, attn="sdpa")
        c = base.config
        self.key_slots = key_slots or c.max_position_embeddings
        self.slot_multiple = slot_multiple
        self.max_rows = max_rows
        self.tiled: set[str] = set()  # weights whose GEMM failed the row-invariance check
        if certify:
            self.certify()

    def certify(self) -> dict:
        """Check the kernel properties this path relies on, at the current dtype/threads/device.
        Weights whose GEMM fails get fixed tiles; attention failing is an error."""
        c = self.config
        self.tiled = {n for n, W in self.w.items() if W.dim() == 2 and n != "embed_tokens.weight"
                      and not _gemm_row_invariant(W.shape[0], W.shape[1], W.dtype, W.device)}
        if not _attention_item_invariant(c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.key_slots,
                                         self.slot_multiple, self.dtype, self.device):
            raise NumericsError(
                f"this machine's scaled_dot_product_attention is not item-invariant at {self.key_slots} key slots "
                f"read in multiples of {self.slot_multiple} ({self.dtype}, {torch.get_num_threads()} threads)",
                fix="use the tiled batch-invariant path (policy batch_invariant) or an always-on verifier (llm42)")
        return dict(tiled=sorted(self.tiled), threads=torch.get_num_threads(), dtype=str(self.dtype))

    def new_cache(self, batch: int, max_slots: int, write_hook=None) -> KVCache:
        return super().new_cache(batch, max(max_slots, self.key_slots), write_hook)

    def _slots_read(self, needed: int) -> int:
        """Key slots attention reads for `needed` slots: the next multiple of slot_multiple."""
        return min(self.key_slots, -(-needed // self.slot_multiple) * self.slot_multiple)

    def _key_slots(self, needed: int, cache: KVCache) -> int:
        if needed > self.key_slots:
            raise ValueError(f"position {needed - 1} is past the fixed-shape path's {self.key_slots} key slots")
        S = self._slots_read(needed)
        if cache.max_slots < S:
            raise ValueError(f"the fixed-shape path reads {S} key slots but the cache has {cache.max_slots}; "
                             f"create it with this model's new_cache")
        return S

    def _linear(self, x, name):
        W = self.w[name]
        b = self.w.get(name.replace(".weight", ".bias"))
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1])
        N = x_ND.shape[0]
        if name in self.tiled:
            R = ROW_TILE
            x_ND = F.pad(x_ND, (0, 0, 0, (-N) % R))
            y = torch.cat([F.linear(x_ND[i : i + R], W, b) for i in range(0, x_ND.shape[0], R)])[:N]
        elif N <= self.max_rows:
            y = F.linear(x_ND, W, b)
        else:
            y = torch.cat([F.linear(x_ND[i : i + self.max_rows], W, b) for i in range(0, N, self.max_rows)])
        return y.reshape(*lead, W.shape[0])

    def _attention(self, q_BHTE, k_BGSE, v_BGSE, mask_BTS):
        B, H, T, E = q_BHTE.shape
        S, Sf = k_BGSE.shape[2], self.key_slots
        if mask_BTS is None:  # no cache: this call's tokens, causal
            mask_BTS = torch.ones(T, T, dtype=torch.bool, device=q_BHTE.device).tril()[None].expand(B, -1, -1)
        Sm = self._slots_read(S)
        if S < Sm:  # cache-less call: pad the keys to a multiple of slot_multiple
            k_BGSE = F.pad(k_BGSE, (0, 0, 0, Sm - S))
            v_BGSE = F.pad(v_BGSE, (0, 0, 0, Sm - S))
            mask_BTS = F.pad(mask_BTS, (0, Sm - S), value=False)
        elif S > Sf:
            raise ValueError(f"{S} key slots exceed the fixed key_slots={Sf}")
        if T == 1:
            return _sdpa_one_query(q_BHTE, k_BGSE, v_BGSE, mask_BTS)
        return _sdpa_packed(q_BHTE, k_BGSE, v_BGSE, mask_BTS)


def fixed_shape(model: LlamaLM, **kw) -> FixedShapeLM:
    return model if isinstance(model, FixedShapeLM) else FixedShapeLM(model, **kw)


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
