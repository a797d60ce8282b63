"""A lean Llama-family forward (gpt-fast style) that loads a Hugging Face checkpoint directory.

Why: on CPU, per-call framework overhead dominates small models (DESIGN.md "Speed"). This
module computes exactly what `transformers.LlamaForCausalLM` computes (RMSNorm in fp32, RoPE,
grouped-query attention, SiLU-gated MLP), over a caller-owned KV cache, with explicit hooks
for the hidden states and the KV columns. The transformers model stays the reference that
tests compare it against.

Supported configs: `model_type` in {llama, mistral, qwen2, qwen3} with default RoPE (no
rope_scaling), no sliding window. Anything else raises a ModelError naming the field.

Shape key: B=batch, T=time (tokens in this call), S=cache slots, H=query heads,
G=kv heads, E=head dim, D=model dim, F=MLP dim, V=vocab, L=layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from verinfer.errors import ModelError

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    model_type: str

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config.json") -> "LlamaConfig":
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_TYPES:
            raise ModelError(
                f"model_type {mtype!r} is not supported by the lean forward",
                where=f"{where}: model_type",
                fix=f"use one of {SUPPORTED_TYPES}, or load with impl='hf'",
            )
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ModelError("rope_scaling is not supported by the lean forward",
                             where=f"{where}: rope_scaling", fix="load with impl='hf'")
        heads = cfg["num_attention_heads"]
        rope_params = cfg.get("rope_parameters") or {}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
            qk_norm=mtype == "qwen3",
            model_type=mtype,
        )


def rms_norm(x_BTD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: statistics in fp32, weight applied in input dtype."""
    x32 = x_BTD.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * x32.to(x_BTD.dtype)


def rope_cos_sin(pos_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos_BT.device, dtype=torch.int64).float() / head_dim))
    freqs_BTe = pos_BT.float()[..., None] * inv_freq
    emb_BTE = torch.cat((freqs_BTe, freqs_BTe), dim=-1)
    return emb_BTE.cos().to(dtype), emb_BTE.sin().to(dtype)


def apply_rope(x_BHTE: torch.Tensor, cos_BTE: torch.Tensor, sin_BTE: torch.Tensor) -> torch.Tensor:
    return apply_rope_heads(x_BHTE, cos_BTE[:, None], sin_BTE[:, None])


def apply_rope_heads(x_LHE: torch.Tensor, cos_LE: torch.Tensor, sin_LE: torch.Tensor) -> torch.Tensor:
    """RoPE where cos/sin broadcast against x over a heads axis (L = any leading shape)."""
    half = x_LHE.shape[-1] // 2
    rotated = torch.cat((-x_LHE[..., half:], x_LHE[..., :half]), dim=-1)
    return x_LHE * cos_LE + rotated * sin_LE


class KVCache:
    """Preallocated per-layer K/V: k[l] is [B, G, S, E]. Rows own their slots; the caller
    passes the slot (= absolute position) each new token is written to.

    `write_hook(k, v)` is applied on every write (numerics: fp8 KV cache simulation).
    `read_column` / `write_column` expose single K/V columns (MarginGate repair)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, write_hook=None):
        shape = (batch, n_kv_heads, max_slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_slots = max_slots
        self.write_hook = write_hook

    def write(self, layer: int, k_BGTE: torch.Tensor, v_BGTE: torch.Tensor, pos_BT: torch.Tensor):
        if self.write_hook is not None:
            k_BGTE, v_BGTE = self.write_hook(k_BGTE, v_BGTE)
        B, G, T, E = k_BGTE.shape
        idx = pos_BT[:, None, :, None].expand(B, G, T, E)
        self.k[layer].scatter_(2, idx, k_BGTE)
        self.v[layer].scatter_(2, idx, v_BGTE)

    def read_column(self, layer: int, row: int, slot: int):
        return self.k[layer][row, :, slot].clone(), self.v[layer][row, :, slot].clone()

    def write_column(self, layer: int, row: int, slot: int, k_GE: torch.Tensor, v_GE: torch.Tensor):
        self.k[layer][row, :, slot] = k_GE
        self.v[layer][row, :, slot] = v_GE

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (in this order): finished requests leave the batch."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]


class LlamaLM(torch.nn.Module):
    """Causal LM forward over a KV cache. Parameters are plain tensors named as in the HF
    checkpoint, so `from_pretrained` loads the same safetensors the reference model loads."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], attn: str = "sdpa",
                 matmul: str = "native"):
        """matmul='fp32': linear layers and attention compute in fp32 from the weights' dtype
        values and round their outputs back to it (Numerics.matmul); 'native' computes in it."""
        super().__init__()
        self.config = config
        self.attn = attn
        self.w = weights
        self.layers = config.num_hidden_layers
        if matmul not in ("native", "fp32"):
            raise ValueError(f"matmul must be 'native' or 'fp32', got {matmul!r}")
        self.matmul = matmul
        upcast = matmul == "fp32" and self.dtype != torch.float32
        self.w32 = {k: t.float() for k, t in weights.items() if t.ndim == 2 or k.endswith(".bias")} if upcast else None

    # --- loading -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, local_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", attn: str = "sdpa",
                        weight_transform=None, matmul: str = "native") -> "LlamaLM":
        """Load config.json + *.safetensors. weight_transform(dict) -> dict runs on the fp32
        weights before the cast to `dtype` (numerics: fake-quantization)."""
        d = Path(local_dir)
        cfg_path = d / "config.json"
        if not cfg_path.is_file():
            raise ModelError("no config.json", where=str(d), fix="point at a save_pretrained directory")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"config.json is not valid JSON ({e.msg})", where=f"{cfg_path}:{e.lineno}") from e
        config = LlamaConfig.from_dict(cfg, where=str(cfg_path))
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise ModelError("no *.safetensors weights (pickle checkpoints are refused)", where=str(d),
                             fix="re-save the model with save_pretrained(..., safe_serialization=True)")
        raw: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                raw.update(load_file(str(f), device="cpu"))
            except Exception as e:  # safetensors raises its own error types on truncation
                raise ModelError(f"cannot read weights ({e})", where=str(f),
                                 fix="the file may be truncated; rebuild or re-copy it") from e
        weights = {(k[len("model."):] if k.startswith("model.") else k): t.float() for k, t in raw.items()}
        if "lm_head.weight" not in weights:
            if not config.tie_word_embeddings:
                raise ModelError("lm_head.weight missing and embeddings are not tied", where=str(d))
            weights["lm_head.weight"] = weights["embed_tokens.weight"]
        missing = [n for n in cls.expected_weight_names(config) if n not in weights]
        if missing:
            raise ModelError(f"missing weights {missing[:3]}{'...' if len(missing) > 3 else ''}", where=str(d))
        if weight_transform is not None:
            weights = weight_transform(weights)
        weights = {k: t.to(device=device, dtype=dtype) for k, t in weights.items()}
        return cls(config, weights, attn=attn, matmul=matmul)

    @staticmethod
    def expected_weight_names(c: LlamaConfig) -> list[str]:
        names = ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                      "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
        return names

    @property
    def dtype(self) -> torch.dtype:
        return self.w["embed_tokens.weight"].dtype

    @property
    def device(self) -> torch.device:
        return self.w["embed_tokens.weight"].device

    def new_cache(self, batch: int, max_slots: int, write_hook=None) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_slots, c.head_dim,
                       self.dtype, self.device, write_hook)

    # --- forward -----------------------------------------------------------------------
    def _key_slots(self, needed: int, cache: KVCache) -> int:
        """How many cache slots attention reads (>= needed). The default reads just what the
        call needs, so the attention shape depends on the longest row in the batch."""
        return needed

    def _linear(self, x, name):
        bname = name.replace(".weight", ".bias")
        if self.w32 is not None:  # matmul='fp32'
            return F.linear(x.float(), self.w32[name], self.w32.get(bname)).to(x.dtype)
        return F.linear(x, self.w[name], self.w.get(bname))

    def _linears(self, x, names: tuple[str, ...]):
        """Several linear layers of one input. matmul='fp32' runs them as one GEMM (weights
        concatenated once): one input cast and one bigger call."""
        if self.w32 is None or len(names) == 1:
            return tuple(self._linear(x, n) for n in names)
        key = "+".join(names)
        if key not in self.w32:
            if any(n.replace(".weight", ".bias") in self.w32 for n in names):
                return tuple(self._linear(x, n) for n in names)
            self.w32[key] = torch.cat([self.w32[n] for n in names])
        y = F.linear(x.float(), self.w32[key]).to(x.dtype)
        return y.split([self.w32[n].shape[0] for n in names], dim=-1)

    def _attention(self, q_BHTE, k_BGSE, v_BGSE, mask_BTS):
        """mask_BTS None means plain causal over this call's tokens (replay of whole sequences)."""
        if self.w32 is not None:  # matmul='fp32'
            dt = q_BHTE.dtype
            return self._attention_native(q_BHTE.float(), k_BGSE.float(), v_BGSE.float(), mask_BTS).to(dt)
        return self._attention_native(q_BHTE, k_BGSE, v_BGSE, mask_BTS)

    def _attention_native(self, q_BHTE, k_BGSE, v_BGSE, mask_BTS):
        c = self.config
        rep = c.num_attention_heads // c.num_key_value_heads
        scale = 1.0 / math.sqrt(c.head_dim)
        if self.attn == "sdpa":
            if mask_BTS is None:
                return F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSE, is_causal=True, scale=scale,
                                                      enable_gqa=rep > 1)
            return F.scaled_dot_product_attention(q_BHTE, k_BGSE, v_BGSE, attn_mask=mask_BTS[:, None], scale=scale,
                                                  enable_gqa=rep > 1)
        if rep > 1:
            k_BGSE = k_BGSE.repeat_interleave(rep, dim=1)
            v_BGSE = v_BGSE.repeat_interleave(rep, dim=1)
        if mask_BTS is None:
            T = q_BHTE.shape[2]
            mask_BTS = torch.ones(T, T, dtype=torch.bool, device=q_BHTE.device).tril()[None]
        if self.attn == "eager":  # transformers' eager path: softmax in fp32, cast back
            scores = torch.matmul(q_BHTE, k_BGSE.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask_BTS[:, None], torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores.float(), dim=-1).to(q_BHTE.dtype)
            return torch.matmul(probs, v_BGSE)
        raise ValueError(f"unknown attention implementation {self.attn!r} (sdpa | eager)")

    def _layer(self, i: int, x_LD: torch.Tensor, cos_LE, sin_LE, attend) -> torch.Tensor:
        """Decoder layer i over tokens with any leading shape L ([B, T] padded, [N] packed);
        attend(i, q_LHE, k_LGE, v_LGE) -> attention output [*L, H*E]."""
        c, w, p = self.config, self.w, f"layers.{i}."
        L = x_LD.shape[:-1]
        h = rms_norm(x_LD, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q, k, v = self._linears(h, tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv"))
        q = q.reshape(*L, c.num_attention_heads, c.head_dim)
        k = k.reshape(*L, c.num_key_value_heads, c.head_dim)
        v = v.reshape(*L, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        cos, sin = cos_LE.unsqueeze(-2), sin_LE.unsqueeze(-2)
        q, k = apply_rope_heads(q, cos, sin), apply_rope_heads(k, cos, sin)
        x_LD = x_LD + self._linear(attend(i, q, k, v), p + "self_attn.o_proj.weight")
        h = rms_norm(x_LD, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = self._linears(h, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"))
        return x_LD + self._linear(F.silu(gate) * up, p + "mlp.down_proj.weight")

    def _layers_and_head(self, x, cos, sin, attend, hidden_layer, select):
        """Every decoder layer, then logits (and hidden states) at `select` (an index into x's
        leading dims, None = all)."""
        hidden = None
        for i in range(self.config.num_hidden_layers):
            x = self._layer(i, x, cos, sin, attend)
            if hidden_layer == i:
                hidden = x
        if select is not None:
            x = x[select]
            hidden = hidden[select] if hidden is not None else None
        return self._head(x, hidden, hidden_layer)

    def _head(self, x_ND: torch.Tensor, hidden, hidden_layer):
        x_ND = rms_norm(x_ND, self.w["norm.weight"], self.config.rms_norm_eps)
        if hidden_layer == -1:
            hidden = x_ND
        if self.w32 is not None:  # matmul='fp32'; logits rounded as a native head's are
            return F.linear(x_ND.float(), self.w32["lm_head.weight"]).to(x_ND.dtype).float(), hidden
        return F.linear(x_ND, self.w["lm_head.weight"]).float(), hidden

    def forward(self, tokens_BT: torch.Tensor, pos_BT: torch.Tensor, cache: KVCache | None = None,
                hidden_layer: int | None = None, select: tuple[torch.Tensor, torch.Tensor] | None = None,
                lengths_B: torch.Tensor | None = None):
        """Run tokens at absolute positions pos_BT. With a cache, their K/V are written to
        slots pos_BT and each query attends to slots <= its position; without one, to the
        tokens of this call (causal). Returns (logits_BTV fp32, hidden_BTD or None).

        hidden_layer: None = no hidden states; -1 = the final-norm output (what lm_head sees);
        i >= 0 = the residual stream after layer i.
        select=(b_N, t_N): compute logits (and hidden states) only at these (row, time) pairs and
        return them flattened, logits_NV and hidden_ND (replay needs only the output positions).
        lengths_B (no cache, positions 0..T-1): row b holds lengths_B[b] real tokens followed by
        padding; the per-token work skips the padding (see `_forward_packed`)."""
        if lengths_B is not None:
            if cache is not None:
                raise ValueError("lengths_B is for cache-free replay of whole sequences")
            return self._forward_packed(tokens_BT, lengths_B, hidden_layer, select)
        c, w = self.config, self.w
        B, T = tokens_BT.shape
        x = F.embedding(tokens_BT, w["embed_tokens.weight"])
        cos, sin = rope_cos_sin(pos_BT, c.head_dim, c.rope_theta, x.dtype)
        if cache is None:  # keys are this call's tokens; plain causal when positions are 0..T-1
            arange = bool((pos_BT == torch.arange(T, device=pos_BT.device)).all())
            mask_BTS = None if arange else pos_BT[:, None, :] <= pos_BT[:, :, None]
        else:
            S = self._key_slots(int(pos_BT.max().item()) + 1, cache)
            mask_BTS = torch.arange(S, device=x.device)[None, None, :] <= pos_BT[:, :, None]

        def attend(i, q_BTHE, k_BTGE, v_BTGE):
            keys, vals = k_BTGE.transpose(1, 2), v_BTGE.transpose(1, 2)
            if cache is not None:
                cache.write(i, keys, vals, pos_BT)
                keys, vals = cache.k[i][:, :, :S], cache.v[i][:, :, :S]
            return self._attention(q_BTHE.transpose(1, 2), keys, vals, mask_BTS).transpose(1, 2).reshape(B, T, -1)

        return self._layers_and_head(x, cos, sin, attend, hidden_layer, select)

    def _forward_packed(self, tokens_BT, lengths_B, hidden_layer, select):
        """Replay of right-padded rows with the padding removed from every per-token op (linear
        layers, norms, RoPE): only attention sees the padded [B, T] layout. A padded token never
        reaches a real one (causal, padding is at the end), so real tokens get the values of the
        padded forward up to GEMM row order (the honest noise of DESIGN.md)."""
        c, w = self.config, self.w
        B, T = tokens_BT.shape
        dev = tokens_BT.device
        lengths_B = lengths_B.to(dev)
        keep_BT = torch.arange(T, device=dev)[None, :] < lengths_B[:, None]
        flat_N = keep_BT.reshape(-1).nonzero().squeeze(1)  # packed token -> index into B*T
        x = F.embedding(tokens_BT.reshape(-1)[flat_N], w["embed_tokens.weight"])
        cos, sin = rope_cos_sin(flat_N % T, c.head_dim, c.rope_theta, x.dtype)

        def pad(t_NHE):
            buf = t_NHE.new_zeros(B * T, *t_NHE.shape[1:])
            buf[flat_N] = t_NHE
            return buf.view(B, T, *t_NHE.shape[1:]).transpose(1, 2)

        def attend(i, q_NHE, k_NGE, v_NGE):
            a_BHTE = self._attention(pad(q_NHE), pad(k_NGE), pad(v_NGE), None)
            return a_BHTE.transpose(1, 2).reshape(B * T, -1)[flat_N]

        if select is not None:  # (row, time) -> packed index
            b_N, t_N = (t.to(dev) for t in select)
            select = (torch.cumsum(lengths_B, 0) - lengths_B)[b_N] + t_N
        return self._layers_and_head(x, cos, sin, attend, hidden_layer, select)
