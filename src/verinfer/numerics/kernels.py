"""Kernel strategies: how the one model forward (models/llama.py LlamaLM) computes its linear
layers, its attention and its logits. The forward fixes the math (RMSNorm, RoPE, GQA attention,
SiLU-gated MLP); a strategy fixes the kernels, shapes and precision those ops run with, which is
where implementations differ in their last bits.

- `Native(matmul)`: PyTorch's kernels at the weights' dtype. matmul='fp32' computes linear layers
  and attention in fp32 from the dtype-rounded operands and rounds outputs back (Numerics.matmul),
  running the linear layers of one input (q/k/v, gate/up) as one GEMM over concatenated weights.
  matmul='split-k' emulates a GPU GEMM library's split-K (`split_k_parts`): a GEMM of a few rows
  (2-15, a batched decode step, a short prefill chunk) splits its reduction into parts whose sums
  are written in the dtype between parts (CUTLASS's serial split-K), so a row's bits depend on how many rows share its GEMM on every CPU (bf16
  GEMMs with AMX or AVX512-BF16 are row-invariant: there batching alone changed nothing). One row
  and 16+ rows run the library kernel, bitwise Native's. The default of every command is 'native'.
- `Fused()`: Native plus q/k/v and gate/up as ONE GEMM each at any dtype (weights concatenated once,
  biases too). Fewer, bigger calls (faster decode on CPU) but not bitwise equal to Native: a GEMM's
  per-column sums may take another order when the output width changes (measured on this CPU: the
  draft's fp32 gate/up at 4 rows differs by 1.7e-6), so it is opt-in.
- `FixedShape(...)`: library kernels at shapes held fixed so that a row's bits do not depend on
  its batch neighbours or on prefill chunking; `certify()` checks the kernel properties it relies
  on at the current dtype / threads / device. The deterministic reference of determinism/.
- `Tiled(...)`: op-level batch invariance: every matmul cut into fixed-shape tiles (the
  batch_invariant baseline).
- `LayerCast()`: bf16-rounded weights held in fp32, every layer computed in fp32.

A strategy is a spec (its options) until `bind(weights, shape, attn)` returns a copy holding
per-model state (upcast or concatenated weights, certified shapes). This module sits below
models/: it sees tensors and the config values named in `ModelShape`, never a model class.

Shape key: N=rows (tokens), B=batch, H=query heads, G=kv heads, T=queries in a call,
S=key slots, E=head dim.
"""

from __future__ import annotations

import copy
import math
from typing import Protocol

import torch
import torch.nn.functional as F

from verinfer.errors import NumericsError
from verinfer.registry import Registry

ROW_TILE = 64
QUERY_TILE = 8
SPLIT_K_MAX_ROWS = 15  # matmul='split-k': GEMMs of 2..15 rows split K; 1 row and 16+ rows do not


def split_k_parts(rows: int) -> int:
    """How many parts matmul='split-k' cuts a GEMM's reduction into, by its row count: a GPU library
    splits K when the rows are too few to fill the device (4 parts below 8 rows, 2 up to 15), and
    not for one row here, so that a request decoded alone keeps the library kernel's bits."""
    if rows <= 1 or rows > SPLIT_K_MAX_ROWS:
        return 1
    return 4 if rows < 8 else 2


def split_k_linear(x, W32, b32, parts: int):
    """F.linear with the reduction over the input axis cut into `parts` contiguous parts, as CUTLASS's
    serial split-K: each part is an fp32 GEMM whose epilogue adds the partial output already written
    (in x's dtype) and writes the sum back in x's dtype; the bias comes with the first part."""
    xs, Ws = x.float().tensor_split(parts, dim=-1), W32.tensor_split(parts, dim=1)
    y = F.linear(xs[0], Ws[0], b32).to(x.dtype)
    for xp, Wp in zip(xs[1:], Ws[1:]):
        y = (y.float() + F.linear(xp, Wp)).to(x.dtype)
    return y


class ModelShape(Protocol):
    """The config values a strategy reads (models.llama.LlamaConfig has them)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int


def _bias_name(name: str) -> str:
    return name.replace(".weight", ".bias")


def causal_mask(B: int, T: int, device) -> torch.Tensor:
    """mask_BTS for T queries over the same T keys, causal."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None].expand(B, -1, -1)


def native_attention(q_BHTE, k_BGSE, v_BGSE, mask_BTS, attn: str):
    """softmax(q k^T / sqrt(E)) v with GQA. attn='sdpa': torch's scaled_dot_product_attention;
    'eager': transformers' eager path (matmuls in the input dtype, softmax in fp32, cast back).
    mask_BTS None = plain causal over this call's tokens."""
    H, G, E = q_BHTE.shape[1], k_BGSE.shape[1], q_BHTE.shape[-1]
    scale = 1.0 / math.sqrt(E)
    if attn == "sdpa":
        if mask_BTS is None:
            return F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSE, is_causal=True, scale=scale,
                                                  enable_gqa=H > G)
        return F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSE, attn_mask=mask_BTS[:, None], scale=scale,
                                              enable_gqa=H > G)
    if attn != "eager":
        raise ValueError(f"unknown attention implementation {attn!r} (sdpa | eager)")
    if H > G:
        k_BGSE = k_BGSE.repeat_interleave(H // G, dim=1)
        v_BGSE = v_BGSE.repeat_interleave(H // G, dim=1)
    if mask_BTS is None:
        T = q_BHTE.shape[2]
        mask_BTS = torch.ones(T, T, dtype=torch.bool, device=q_BHTE.device).tril()[None]
    scores = torch.matmul(q_BHTE, k_BGSE.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask_BTS[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q_BHTE.dtype)
    return torch.matmul(probs, v_BGSE)


class Native:
    """PyTorch's kernels at the weights' dtype (see the module docstring for matmul='fp32')."""

    name = "native"

    def __init__(self, matmul: str = "native"):
        if matmul not in ("native", "fp32", "split-k"):
            raise ValueError(f"matmul must be 'native', 'fp32' or 'split-k', got {matmul!r}")
        self.matmul = matmul
        self.w: dict[str, torch.Tensor] = {}
        self.w32: dict[str, torch.Tensor] | None = None
        self.wsplit: dict[str, torch.Tensor] | None = None  # matmul='split-k': fp32 copies for split GEMMs
        self.cat: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.matmul!r})" if self.matmul != "native" else f"{type(self).__name__}()"

    # --- binding -----------------------------------------------------------------------
    def bind(self, weights: dict[str, torch.Tensor], shape: ModelShape, attn: str = "sdpa") -> "Native":
        """A copy of this strategy holding per-model state for these weights."""
        k = copy.copy(self)
        k.shape, k.attn, k.cat = shape, attn, {}
        k.w = k.model_weights(weights)
        dtype = k.w["embed_tokens.weight"].dtype
        upcast = k.matmul == "fp32" and dtype != torch.float32
        k.w32 = {n: t.float() for n, t in k.w.items() if t.ndim == 2 or n.endswith(".bias")} if upcast else None
        k.wsplit = ({n: t.float() for n, t in k.w.items() if t.ndim == 2 or n.endswith(".bias")}
                    if k.matmul == "split-k" else None)
        k.on_bind()
        return k

    def model_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights the model holds (the same tensors, unless a strategy recasts them)."""
        return weights

    def on_bind(self) -> None:
        """Per-model preparation after bind (certification, tiles)."""

    # --- linear layers -----------------------------------------------------------------
    def linear(self, x, name: str):
        if self.w32 is not None:  # matmul='fp32'
            return F.linear(x.float(), self.w32[name], self.w32.get(_bias_name(name))).to(x.dtype)
        if self.wsplit is not None and (parts := split_k_parts(x.numel() // x.shape[-1])) > 1:
            return split_k_linear(x, self.wsplit[name], self.wsplit.get(_bias_name(name)), parts)
        return F.linear(x, self.w[name], self.w.get(_bias_name(name)))

    def linears(self, x, names: tuple[str, ...]):
        """Several linear layers of one input. matmul='fp32' runs them as one GEMM over weights
        concatenated once (one input cast, one bigger call), separately when they have biases."""
        if self.w32 is None or len(names) == 1 or any(_bias_name(n) in self.w32 for n in names):
            return tuple(self.linear(x, n) for n in names)
        return self._concatenated(x, names, self.w32)

    def _concatenated(self, x, names: tuple[str, ...], w: dict[str, torch.Tensor]):
        """One GEMM over the names' weights (and biases) concatenated along the output axis."""
        if names not in self.cat:
            biases = [w.get(_bias_name(n)) for n in names]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else w[n].new_zeros(w[n].shape[0]) for n, b in zip(names, biases)])
            self.cat[names] = (torch.cat([w[n] for n in names]), bias)
        W, b = self.cat[names]
        y = F.linear(x.to(W.dtype), W, b).to(x.dtype)
        return y.split([w[n].shape[0] for n in names], dim=-1)

    def logits(self, x_ND):
        """lm_head, fp32 logits (under matmul='fp32' rounded to the dtype first, as a native head's)."""
        if self.w32 is not None:
            return F.linear(x_ND.float(), self.w32["lm_head.weight"]).to(x_ND.dtype).float()
        if self.wsplit is not None and (parts := split_k_parts(x_ND.numel() // x_ND.shape[-1])) > 1:
            return split_k_linear(x_ND, self.wsplit["lm_head.weight"], None, parts).float()
        return F.linear(x_ND, self.w["lm_head.weight"]).float()

    # --- attention ---------------------------------------------------------------------
    def slots_to_read(self, needed: int, cache_slots: int) -> int:
        """How many cache slots attention reads (>= needed). Native reads just what the call
        needs, so the attention shape depends on the longest row in the batch."""
        return needed

    def cache_slots(self, max_slots: int) -> int:
        """Slots a new cache gets when a caller asks for max_slots."""
        return max_slots

    def attention(self, q_BHTE, k_BGSE, v_BGSE, mask_BTS):
        """mask_BTS None means plain causal over this call's tokens (replay of whole sequences)."""
        if self.w32 is not None:  # matmul='fp32'
            dt = q_BHTE.dtype
            return native_attention(q_BHTE.float(), k_BGSE.float(), v_BGSE.float(), mask_BTS, self.attn).to(dt)
        return native_attention(q_BHTE, k_BGSE, v_BGSE, mask_BTS, self.attn)


class Fused(Native):
    """Native with q/k/v and gate/up each as ONE GEMM at any dtype (not bitwise equal to Native)."""

    name = "fused"

    def linears(self, x, names: tuple[str, ...]):
        if len(names) == 1:
            return (self.linear(x, names[0]),)
        return self._concatenated(x, names, self.w32 if self.w32 is not None else self.w)


class LayerCast(Native):
    """LayerCast: keep the (bf16-rounded) weights, hold them in fp32, compute every layer in fp32."""

    name = "layercast"

    def __init__(self):
        super().__init__("native")

    def model_weights(self, weights):
        return {k: t.float() for k, t in weights.items()}


class Tiled(Native):
    """Op-level batch invariance (in the spirit of thinking-machines' batch_invariant_ops): every
    matmul runs with a FIXED shape, whatever the batch.
    - linear layers: the token rows are cut into tiles of `row_tile` rows (zero-padded) and each
      tile is one F.linear of shape [row_tile, D_in] x [D_in, D_out];
    - attention: each row's keys are padded to a fixed `key_slots` (the model's context; padded
      and future slots masked to probability exactly 0), queries are cut into tiles of
      `query_tile` and each (row, kv-head, tile) is one bmm item of shape [rep*query_tile, E] x
      [E, key_slots]; softmax in fp32 over the fixed key_slots (as transformers' eager attention);
    - RMSNorm / RoPE / SiLU are row-wise or elementwise already."""

    name = "tiled"

    def __init__(self, row_tile: int = ROW_TILE, query_tile: int = QUERY_TILE, key_slots: int | None = None):
        super().__init__("native")
        self.row_tile, self.query_tile, self.key_slots = row_tile, query_tile, key_slots

    def on_bind(self):
        self.attn = "eager"
        self.key_slots = self.key_slots or self.shape.max_position_embeddings

    def linear(self, x, name):
        return _tiled_linear(x, self.w[name], self.w.get(_bias_name(name)), self.row_tile)

    def logits(self, x_ND):
        return self.linear(x_ND, "lm_head.weight").float()

    def attention(self, q_BHTE, k_BGSE, v_BGSE, mask_BTS):
        B, H, T, E = q_BHTE.shape
        G, S = k_BGSE.shape[1], k_BGSE.shape[2]
        rep, Sf, Q = H // G, self.key_slots, self.query_tile
        if S > Sf:
            raise ValueError(f"{S} key slots exceed the fixed key_slots={Sf}")
        if mask_BTS is None:
            mask_BTS = causal_mask(B, T, q_BHTE.device)
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
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(E))
        scores = scores.masked_fill(~m, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.bmm(probs, v)  # [B*G*nT, rep*Q, E]
        out = out.view(B, G, nT, rep, Q, E).permute(0, 1, 3, 2, 4, 5).reshape(B, H, Tp, E)
        return out[:, :, :T]


def _tiled_linear(x, W, b, R: int):
    """F.linear over the rows of x in fixed tiles of R rows (the last one zero-padded)."""
    lead = x.shape[:-1]
    x_ND = x.reshape(-1, x.shape[-1])
    N = x_ND.shape[0]
    x_ND = F.pad(x_ND, (0, 0, 0, (-N) % R))
    y = torch.cat([F.linear(x_ND[i : i + R], W, b) for i in range(0, x_ND.shape[0], R)])[:N]
    return y.reshape(*lead, W.shape[0])


# --- FixedShape: certified library kernels at fixed shapes ----------------------------------
_CERTIFIED: dict[tuple, bool] = {}
PROBE_ROWS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 64, 65, 100, 128, 129, 256, 512, 1024)


PROBE_SHIFTS = (0, 5, 31)  # where in the input a probed block of rows starts
SLOT_MULTIPLES = (16, 32, 64)  # FixedShape's attention reads slots in the first multiple that certifies


def _gemm_min_rows(out_f: int, in_f: int, dtype, device, seed: int = 0) -> int | None:
    """The fewest rows from which F.linear gives every row the same bits whatever the number of rows
    (up to 1024) and the row's place among them: 1 (any call), 2 (one-row calls take another
    kernel, e.g. MKL's bf16 gemv for the 576x1536 down_proj of SmolLM2, and are padded to two rows),
    or None (not row-invariant: fixed tiles)."""
    key = ("gemm", out_f, in_f, dtype, str(device), torch.get_num_threads())
    if key not in _CERTIFIED:
        g = torch.Generator().manual_seed(seed)
        W = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype=dtype, device=device)
        X = torch.randn(max(PROBE_ROWS) + max(PROBE_SHIFTS), in_f, generator=g).to(dtype=dtype, device=device)
        full = F.linear(X, W)

        def invariant_from(m: int) -> bool:
            return all(torch.equal(F.linear(X[s : s + M], W), full[s : s + M])
                       for M in PROBE_ROWS if M >= m for s in PROBE_SHIFTS)

        one = torch.cat([F.linear(X[i : i + 1], W) for i in range(16)])
        _CERTIFIED[key] = (1 if torch.equal(one, full[:16]) and invariant_from(1) else
                           2 if invariant_from(2) else None)
    return _CERTIFIED[key]


def _linear_rows(x_ND, W, b, min_rows: int):
    """F.linear of x_ND's rows, a call of fewer than `min_rows` rows padded with copies of its last row."""
    N = x_ND.shape[0]
    if N >= min_rows:
        return F.linear(x_ND, W, b)
    return F.linear(torch.cat([x_ND, x_ND[-1:].expand(min_rows - N, -1)]), W, b)[:N]


def _probe_slots(need: int, slots: int, multiple: int) -> list[int]:
    """Slot counts a certification reads for a row needing `need` slots: the first 16 multiples of
    `multiple` covering it (where a block tail moves), then every 13th (a stride odd in multiples, so
    every residue of the longer blocks comes up), below `slots` (read in full as the reference)."""
    first = -(-need // multiple) * multiple
    near = range(first, min(slots, first + 16 * multiple), multiple)
    return sorted(set(near) | set(range(first, slots, 13 * multiple)))


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
        # keys and values as the KV cache holds them (slot-major [B, S, G, E]), read as [B, G, S, E] views
        k, v = (rnd(B, slots, kv_heads, head_dim).transpose(1, 2) for _ in range(2))
        q = rnd(B, heads, T, head_dim)
        last_B = torch.cat([torch.tensor([slots - 1, T - 1]), torch.randint(T, slots, (B - 2,), generator=g)])
        pos_BT = (last_B[:, None] - T + 1 + torch.arange(T)).to(device)
        mask_BTS = torch.arange(slots, device=device)[None, None] <= pos_BT[:, :, None]
        one = lambda b, t: _sdpa_one_query(q[b : b + 1, :, t : t + 1], k[b : b + 1], v[b : b + 1],  # noqa: E731
                                           mask_BTS[b : b + 1, t : t + 1])
        ref = torch.stack([torch.cat([one(b, t) for t in range(T)], 2)[0] for b in range(B)])
        ok = torch.equal(_sdpa_packed(q, k, v, mask_BTS), ref)
        ok = ok and torch.equal(_sdpa_one_query(q[:, :, :1], k, v, mask_BTS[:, :1]), ref[:, :, :1])
        for b in range(B):  # fewer slots read: multiples of `multiple` that cover the row (`_probe_slots`)
            need = int(last_B[b]) + 1
            for S in _probe_slots(need, slots, multiple):
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


class FixedShape(Native):
    """Library kernels at fixed shapes: instead of replacing the kernels (Tiled), hold fixed every
    shape their reduction order depends on, after checking on this machine which shapes those
    are (`certify`):
    - attention reads a number of cache slots rounded up to a multiple of `slot_multiple` (the
      smallest of SLOT_MULTIPLES, 16 / 32 / 64, that certifies on this machine: 16 on AVX-512, whose
      fp32 vectors hold 16 keys), masked past each row's position, and gives every row the bits it
      would get reading all `key_slots` (the model's context), so the multiple changes no bit, only
      how many masked slots are read. Native attention reads exactly as many slots as the
      longest row needs, and CPU flash attention then changes a row's bits when its neighbours
      change: the kernel vectorizes the softmax over the key block and computes a ragged tail with
      scalar code, so a row's last real keys fall in the tail or not depending on the block
      length. With the block a multiple of 64 every real key sits in a full vector and the masked
      ones add exact zeros (`certify` checks exactly this: every multiple of 64 up to key_slots
      gives the same bits);
    - every query gets decode semantics, one query per attention item: a call with T > 1 tokens
      (prefill, LLM-42 verification) packs its queries into the head axis (q [B, G*rep*T, 1, E];
      GQA maps each packed head to its kv head), so a token's attention is computed exactly as in
      a one-token decode step (the kernel's T=1 and T>=2 paths differ in the last bits);
    - each linear layer is one GEMM over all rows (in chunks of at most `max_rows`): the per-row
      result of the library GEMM was checked not to depend on the number of rows nor on the row's
      place, for every weight shape of the model at this dtype and thread count (`_gemm_min_rows`);
      a weight whose one-row calls take another kernel (a gemv) gets them padded to two rows (its
      `padded` set: the cost of one more row, where fixed tiles cost 64 rows per call), and a
      weight that fails from two rows on falls back to fixed `ROW_TILE`-row tiles."""

    name = "fixed_shape"

    def __init__(self, key_slots: int | None = None, slot_multiple: int | None = None, max_rows: int = 1024,
                 certify: bool = True):
        super().__init__("native")
        self.key_slots, self.max_rows = key_slots, max_rows
        self.multiples = SLOT_MULTIPLES if slot_multiple is None else (slot_multiple,)
        self.slot_multiple = self.multiples[-1]
        self.certify_on_bind = certify
        self.tiled: set[str] = set()  # weights whose GEMM failed the row-invariance check
        self.padded: set[str] = set()  # weights whose one-row GEMM calls are padded to two rows

    def on_bind(self):
        self.attn = "sdpa"
        self.key_slots = self.key_slots or self.shape.max_position_embeddings
        self.tiled, self.padded = set(), set()
        if self.certify_on_bind:
            self.certify()

    def certify(self) -> dict:
        """Check the kernel properties this path relies on, at the current dtype/threads/device.
        Weights whose GEMM fails get fixed tiles; attention failing is an error."""
        s, W0 = self.shape, self.w["embed_tokens.weight"]
        rows = {n: _gemm_min_rows(W.shape[0], W.shape[1], W.dtype, W.device) for n, W in self.w.items()
                if W.dim() == 2 and n != "embed_tokens.weight"}
        self.tiled = {n for n, m in rows.items() if m is None}
        self.padded = {n for n, m in rows.items() if m == 2}
        ok = [m for m in self.multiples if _attention_item_invariant(
            s.num_attention_heads, s.num_key_value_heads, s.head_dim, self.key_slots, m, W0.dtype, W0.device)][:1]
        if not ok:
            raise NumericsError(
                f"this machine's scaled_dot_product_attention is not item-invariant at {self.key_slots} key slots "
                f"read in multiples of {' or '.join(map(str, self.multiples))} ({W0.dtype}, "
                f"{torch.get_num_threads()} threads)",
                fix="use the tiled batch-invariant path (policy batch_invariant) or an always-on verifier (llm42)")
        self.slot_multiple = ok[0]
        return dict(tiled=sorted(self.tiled), padded=sorted(self.padded), slot_multiple=self.slot_multiple,
                    threads=torch.get_num_threads(), dtype=str(W0.dtype))

    def cache_slots(self, max_slots: int) -> int:
        """Rounded up to a multiple of slot_multiple: attention reads whole multiples of it. The bits
        depend on the slots read, never on how many the cache holds, so a cache sized for its
        requests (not the model's whole context: 8,192 positions of SmolLM2 are 189 MB per row)
        gives the same tokens."""
        return -(-max_slots // self.slot_multiple) * self.slot_multiple

    def _slots_read(self, needed: int) -> int:
        """Key slots attention reads for `needed` slots: the next multiple of slot_multiple."""
        return min(self.key_slots, -(-needed // self.slot_multiple) * self.slot_multiple)

    def slots_to_read(self, needed: int, cache_slots: int) -> int:
        if needed > self.key_slots:
            raise ValueError(f"position {needed - 1} is past the fixed-shape path's {self.key_slots} key slots")
        S = self._slots_read(needed)
        if cache_slots < S:
            raise ValueError(f"the fixed-shape path reads {S} key slots but the cache has {cache_slots}; "
                             f"create it with this model's new_cache")
        return S

    def linear(self, x, name):
        W, b = self.w[name], self.w.get(_bias_name(name))
        if name in self.tiled:
            return _tiled_linear(x, W, b, ROW_TILE)
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1])
        N = x_ND.shape[0]
        if N <= self.max_rows:
            y = _linear_rows(x_ND, W, b, 2 if name in self.padded else 1)
        else:
            y = torch.cat([F.linear(x_ND[i : i + self.max_rows], W, b) for i in range(0, N, self.max_rows)])
        return y.reshape(*lead, W.shape[0])

    def logits(self, x_ND):
        return self.linear(x_ND, "lm_head.weight").float()

    def attention(self, q_BHTE, k_BGSE, v_BGSE, mask_BTS):
        B, H, T, E = q_BHTE.shape
        S, Sf = k_BGSE.shape[2], self.key_slots
        if mask_BTS is None:  # no cache: this call's tokens, causal
            mask_BTS = causal_mask(B, T, q_BHTE.device)
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


KERNELS: Registry[type[Native]] = Registry("kernel strategy",
                                           {k.name: k for k in (Native, Fused, FixedShape, Tiled, LayerCast)})


def get_kernels(name: str, **options) -> Native:
    """A strategy by name: native | fused | fixed_shape | tiled | layercast."""
    return KERNELS.get(name)(**options)
