"""A decode-speed forward for speculative decoding: the same weights and the same math as
models/llama.py's LlamaLM (itself checked against transformers), with fewer framework ops per
call, because on this CPU a small model's decode step is almost all per-op overhead (issue 7's
cost model: the 0.6M-parameter draft spends ~0.6 ms per step in ~110 eager ops).

What differs from LlamaLM.forward with a KV cache (and only that path; anything else falls back
to LlamaLM.forward):
  - q/k/v and gate/up each run as ONE GEMM over weights concatenated once at wrap time;
  - RoPE cos/sin come from a table over all positions (built once) and rotate q and k together;
  - the cache is slot-major, k[l] is [B, S, G, E], so a write is one index_put_ at (row, slot)
    and attention reads a transposed view (no scatter index tensors per layer);
  - RMSNorm without the dtype round trips (fp32 weights only; other dtypes fall back).
The concatenated GEMMs may sum in another order than three separate ones, so logits agree with
LlamaLM / transformers to fp32 rounding (tests/speculative/test_fast.py bounds the difference
and checks that greedy decoding gives the same tokens); they are not bitwise equal.

Target-only decoding and every speculative method use the same wrapped models in the benchmark
(bench.py), so no decoder gets a fast path the others lack.

Shape key: B=batch, T=tokens in this call, S=cache slots, H=query heads, G=kv heads,
E=head dim, D=model dim, F=MLP dim, V=vocab, N=selected (row, time) pairs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from verinfer.models.llama import KVCache, LlamaLM


class SlotMajorCache:
    """Per-layer K/V, k[l] is [B, S, G, E]; the interface the speculative loop uses of KVCache
    (write at (row, slot), select_rows)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_slots: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (batch, max_slots, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_slots = max_slots

    def select_rows(self, rows: torch.Tensor) -> None:
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]


class FastLM(LlamaLM):
    """LlamaLM over the same weight tensors with a leaner cached forward (see module docstring)."""

    def __init__(self, model: LlamaLM):
        super().__init__(model.config, model.w, attn=model.attn)
        c, w = self.config, self.w
        self.fast = (c.model_type == "llama" and not c.attention_bias and not c.qk_norm and self.attn == "sdpa"
                     and self.dtype == torch.float32 and getattr(model, "w32", None) is None)
        if not self.fast:
            return
        self.wqkv = [torch.cat([w[f"layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"])
                     for i in range(c.num_hidden_layers)]
        self.wgu = [torch.cat([w[f"layers.{i}.mlp.gate_proj.weight"], w[f"layers.{i}.mlp.up_proj.weight"]])
                    for i in range(c.num_hidden_layers)]
        E = c.head_dim
        # the same float ops as models.llama.rope_cos_sin, for every position at once
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, E, 2, dtype=torch.int64).float() / E))
        freqs = torch.arange(c.max_position_embeddings).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).to(self.device)
        self.cos_PE, self.sin_PE = emb.cos(), emb.sin()
        self.slots = torch.arange(c.max_position_embeddings, device=self.device)

    def new_cache(self, batch: int, max_slots: int, write_hook=None):
        if not self.fast or write_hook is not None:
            return super().new_cache(batch, max_slots, write_hook)
        c = self.config
        return SlotMajorCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_slots, c.head_dim,
                              self.dtype, self.device)

    def forward(self, tokens_BT, pos_BT, cache=None, hidden_layer=None, select=None, lengths_B=None):
        if not self.fast or cache is None or isinstance(cache, KVCache) or lengths_B is not None:
            return super().forward(tokens_BT, pos_BT, cache, hidden_layer=hidden_layer, select=select,
                                   lengths_B=lengths_B)
        c, w = self.config, self.w
        B, T = tokens_BT.shape
        H, G, E, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        half = E // 2
        S = int(pos_BT.max()) + 1
        x = F.embedding(tokens_BT, w["embed_tokens.weight"])
        cos, sin = self.cos_PE[pos_BT][:, :, None], self.sin_PE[pos_BT][:, :, None]   # [B, T, 1, E]
        mask_B1TS = (self.slots[:S][None, None, :] <= pos_BT[:, :, None])[:, None]
        rows_BT = torch.arange(B, device=x.device)[:, None].expand(B, T)
        scale = 1.0 / math.sqrt(E)
        hidden = None
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[p + "input_layernorm.weight"]
            qk, v = F.linear(h, self.wqkv[i]).view(B, T, H + 2 * G, E).split([H + G, G], dim=2)
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            kc, vc = cache.k[i], cache.v[i]
            kc[rows_BT, pos_BT] = qk[:, :, H:]
            vc[rows_BT, pos_BT] = v
            a = F.scaled_dot_product_attention(qk[:, :, :H].transpose(1, 2), kc[:, :S].transpose(1, 2),
                                               vc[:, :S].transpose(1, 2), attn_mask=mask_B1TS, scale=scale,
                                               enable_gqa=H > G)
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * E), w[p + "self_attn.o_proj.weight"])
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[p + "post_attention_layernorm.weight"]
            gate, up = F.linear(h, self.wgu[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
            if hidden_layer == i:
                hidden = x
        if select is not None:
            x = x[select]
            hidden = hidden[select] if hidden is not None else None
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w["norm.weight"]
        if hidden_layer == -1:
            hidden = x
        return F.linear(x, w["lm_head.weight"]), hidden
