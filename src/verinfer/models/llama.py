"""The model forward: one lean Llama-family forward (gpt-fast style) that loads a Hugging Face
checkpoint directory. Every command (generate, score, the server, determinism, speculative)
runs this class; the transformers model stays only as the reference tests compare it against.

Why: on CPU, per-call framework overhead dominates small models (benchmarks/results/forward_speed.md). This
module computes exactly what `transformers.LlamaForCausalLM` computes (RMSNorm in fp32, RoPE,
grouped-query attention, SiLU-gated MLP), over a caller-owned KV cache, with explicit hooks
for the hidden states and the KV columns. How the linear layers, attention and logits are
computed (kernels, shapes, precision) is a pluggable strategy, numerics/kernels.py: `Native`
by default, `Fused`, `FixedShape` (certified), `Tiled`, `LayerCast`; `with_kernels` gives
another strategy over the same weights.

Per-op overhead is kept low where it costs no bits (each measured bitwise equal to the
previous forward on this CPU, tests/models/test_llama.py): RoPE cos/sin gathered from a table
built with the same float ops and applied to q and k heads in one rotation, the KV cache slot-major ([B, S, G, E], one index_put_ per write
instead of a scatter with an expanded index), the attention mask from a cached arange, fp32
RMSNorm without its no-op dtype casts, weight names built once. Fusing q/k/v and gate/up into one
GEMM changes bits (it is the opt-in `Fused` strategy).

Supported configs: `model_type` in {llama, mistral, qwen2, qwen3} with default RoPE (no
rope_scaling), no sliding window. Anything else raises a ModelError naming the field.

Shape key: B=batch, T=time (tokens in this call), S=cache slots, P=positions, H=query heads,
G=kv heads, E=head dim, D=model dim, F=MLP dim, V=vocab, N=packed or selected tokens,
L=any leading shape.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from verinfer.errors import ModelError
from verinfer.numerics.kernels import Native

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def read_model_config(local_dir: str | Path) -> dict:
    """The JSON object in `local_dir`/config.json (the one reader of it), or a ModelError that
    names the file and says what to do."""
    cfg_path = Path(local_dir) / "config.json"
    if not cfg_path.is_file():
        raise ModelError("no config.json here", where=str(local_dir), fix="pass a save_pretrained directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"config.json is not valid JSON ({e.msg} at column {e.colno})", where=f"{cfg_path}:{e.lineno}",
                         fix="the file looks truncated or hand-edited: re-save the model with save_pretrained") from None
    if not isinstance(cfg, dict):
        raise ModelError("config.json must hold a JSON object", where=str(cfg_path),
                         fix="re-save the model with save_pretrained")
    return cfg


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
    def from_dir(cls, local_dir: str | Path) -> "LlamaConfig":
        """The config of a save_pretrained directory (read_model_config, then from_dict)."""
        return cls.from_dict(read_model_config(local_dir), where=str(Path(local_dir) / "config.json"))

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config.json") -> "LlamaConfig":
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_TYPES:
            raise ModelError(
                f"model_type {mtype!r} is not supported by the lean forward",
                where=f"{where}: model_type",
                fix=f"use a checkpoint of one of {SUPPORTED_TYPES} (other architectures are not implemented)",
            )
        for field in ("rope_scaling", "rope_parameters"):
            rope = cfg.get(field) or {}
            if rope.get("rope_type", rope.get("type")) not in (None, "default"):
                raise ModelError(f"{field} type {rope.get('rope_type', rope.get('type'))!r} is not supported by the "
                                 "lean forward (default RoPE only)", where=f"{where}: {field}",
                                 fix="use a checkpoint with default RoPE")
        window = cfg.get("sliding_window") if mtype == "mistral" or cfg.get("use_sliding_window") else None
        if window and window < cfg.get("max_position_embeddings", 2048):
            raise ModelError(f"sliding_window {window} is not supported by the lean forward (full attention only)",
                             where=f"{where}: sliding_window",
                             fix="use a checkpoint without a sliding window shorter than max_position_embeddings")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool):
                raise ModelError(f"`{key}` is missing or not an integer (got {cfg.get(key)!r})",
                                 where=f"{where}: {key}",
                                 fix="re-save the model with save_pretrained (a Hugging Face config.json has it)")
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


def rms_norm(x_LD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: statistics in fp32, weight applied in input dtype.
    fp32 input skips the casts (no-ops: the same ops, the same bits)."""
    if x_LD.dtype == torch.float32:
        return weight_D * (x_LD * torch.rsqrt(x_LD.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x_LD.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * x32.to(x_LD.dtype)


_GROW_LOCK = threading.RLock()  # LlamaLM._grow: the RoPE tables of every model grow one at a time


def rope_table(n_pos: int, head_dim: int, theta: float, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_PE, sin_PE for positions 0..n_pos-1, with transformers' float ops (inv_freq from int64
    exponents, fp32 angles, cos/sin in fp32, then the cast to dtype): element p of the table has
    the bits a per-call computation at position p has (elementwise ops)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    freqs_Pe = torch.arange(n_pos, device=device).float()[:, None] * inv_freq
    emb_PE = torch.cat((freqs_Pe, freqs_Pe), dim=-1)
    return emb_PE.cos().to(dtype), emb_PE.sin().to(dtype)


def apply_rope_heads(x_LHE: torch.Tensor, cos_LE: torch.Tensor, sin_LE: torch.Tensor) -> torch.Tensor:
    """RoPE where cos/sin broadcast against x over a heads axis (L = any leading shape)."""
    half = x_LHE.shape[-1] // 2
    rotated = torch.cat((-x_LHE[..., half:], x_LHE[..., :half]), dim=-1)
    return x_LHE * cos_LE + rotated * sin_LE


class KVCache:
    """Preallocated per-layer K/V, slot-major: k[l] is [B, S, G, E]. Rows own their slots; the
    caller passes the slot (= absolute position) each new token is written to, and a write is
    one index_put_ at (row, slot). Attention reads [B, G, S, E] views (`keys`, `values`).

    `write_hook(k, v)` is applied on every write (numerics: fp8 KV cache simulation).
    `read_column` / `write_column` expose single K/V columns (MarginGate repair)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, write_hook=None):
        shape = (batch, max_slots, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_slots = max_slots
        self.write_hook = write_hook

    def write(self, layer: int, k_BTGE: torch.Tensor, v_BTGE: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]):
        """Store the tokens' K/V at index = (rows_BT, slots_BT)."""
        if self.write_hook is not None:
            k_BTGE, v_BTGE = self.write_hook(k_BTGE, v_BTGE)
        self.k[layer].index_put_(index, k_BTGE)
        self.v[layer].index_put_(index, v_BTGE)

    def keys(self, layer: int, slots: int) -> torch.Tensor:
        """k_BGSE: the first `slots` slots of every row (a view)."""
        return self.k[layer][:, :slots].transpose(1, 2)

    def values(self, layer: int, slots: int) -> torch.Tensor:
        return self.v[layer][:, :slots].transpose(1, 2)

    def read_column(self, layer: int, row: int, slot: int):
        return self.k[layer][row, slot].clone(), self.v[layer][row, slot].clone()

    def write_column(self, layer: int, row: int, slot: int, k_GE: torch.Tensor, v_GE: torch.Tensor):
        self.k[layer][row, slot] = k_GE
        self.v[layer][row, slot] = v_GE

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (in this order): finished requests leave the batch."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]


class LayerNames(NamedTuple):
    """Checkpoint names of one decoder layer's weights (built once)."""

    input_norm: str
    qkv: tuple[str, str, str]
    q_norm: str
    k_norm: str
    o: str
    post_norm: str
    gate_up: tuple[str, str]
    down: str

    @classmethod
    def of(cls, i: int) -> "LayerNames":
        p = f"layers.{i}."
        return cls(p + "input_layernorm.weight", tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv"),
                   p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight", p + "self_attn.o_proj.weight",
                   p + "post_attention_layernorm.weight", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                   p + "mlp.down_proj.weight")


class LlamaLM(torch.nn.Module):
    """Causal LM forward over a KV cache. Parameters are plain tensors named as in the HF
    checkpoint, so `from_pretrained` loads the same safetensors the reference model loads."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], attn: str = "sdpa",
                 matmul: str = "native", kernels: Native | None = None):
        """kernels: the kernel strategy (numerics/kernels.py; default Native(matmul)).
        matmul='fp32': linear layers and attention compute in fp32 from the weights' dtype values
        and round their outputs back to it (Numerics.matmul); 'native' computes in it."""
        super().__init__()
        if kernels is None:
            kernels = Native(matmul)
        elif matmul != "native":
            raise ValueError("pass matmul to the kernel strategy (e.g. Native('fp32')), not beside it")
        self.config = config
        self.attn = attn
        self.kernels = kernels.bind(weights, config, attn)
        self.w = self.kernels.w
        self.layers = config.num_hidden_layers
        self.names = [LayerNames.of(i) for i in range(config.num_hidden_layers)]
        self._grow(0)

    def with_kernels(self, kernels: Native) -> "LlamaLM":
        """This model (the same weight tensors) computed with another kernel strategy."""
        return LlamaLM(self.config, self.w, attn=self.attn, kernels=kernels)

    @property
    def matmul(self) -> str:
        return self.kernels.matmul

    # --- loading -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, local_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", attn: str = "sdpa",
                        weight_transform=None, matmul: str = "native", kernels: Native | None = None) -> "LlamaLM":
        """Load config.json + *.safetensors. weight_transform(dict) -> dict runs on the fp32
        weights before the cast to `dtype` (numerics: fake-quantization)."""
        d = Path(local_dir)
        config = LlamaConfig.from_dir(d)
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
        return cls(config, weights, attn=attn, matmul=matmul, kernels=kernels)

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
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, self.kernels.cache_slots(max_slots),
                       c.head_dim, self.dtype, self.device, write_hook)

    # --- forward -----------------------------------------------------------------------
    def _grow(self, n_pos: int) -> None:
        """Make the RoPE table and the position arange cover n_pos positions (doubling). They only
        ever grow, under a lock: `verinfer serve` runs requests in threads, and two that grew at once
        could leave the smaller table in place (a 500 on a position past it), as it once did."""
        have = getattr(self, "_arange_P", None)
        if have is not None and have.numel() >= n_pos:
            return
        with _GROW_LOCK:
            have = getattr(self, "_arange_P", None)
            if have is not None and have.numel() >= n_pos:
                return
            P = max(64, 1 << max(0, n_pos - 1).bit_length())
            c = self.config
            self._cos_PE, self._sin_PE = rope_table(P, c.head_dim, c.rope_theta, self.dtype, self.device)
            self._arange_P = torch.arange(P, device=self.device)  # last: a reader that sees it sees the tables

    def _layer(self, i: int, x_LD: torch.Tensor, cos_LE, sin_LE, attend) -> torch.Tensor:
        """Decoder layer i over tokens with any leading shape L ([B, T] padded, [N] packed);
        attend(i, q_LHE, k_LGE, v_LGE) -> attention output [*L, H*E]."""
        c, w, n, K = self.config, self.w, self.names[i], self.kernels
        L = x_LD.shape[:-1]
        h = rms_norm(x_LD, w[n.input_norm], c.rms_norm_eps)
        q, k, v = K.linears(h, n.qkv)
        H = c.num_attention_heads
        q = q.reshape(*L, H, c.head_dim)
        k = k.reshape(*L, c.num_key_value_heads, c.head_dim)
        v = v.reshape(*L, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w[n.q_norm], c.rms_norm_eps)
            k = rms_norm(k, w[n.k_norm], c.rms_norm_eps)
        qk = apply_rope_heads(torch.cat((q, k), dim=-2), cos_LE, sin_LE)  # one rotation of q and k heads
        q, k = qk[..., :H, :], qk[..., H:, :]
        x_LD = x_LD + K.linear(attend(i, q, k, v), n.o)
        h = rms_norm(x_LD, w[n.post_norm], c.rms_norm_eps)
        gate, up = K.linears(h, n.gate_up)
        return x_LD + K.linear(F.silu(gate) * up, n.down)

    def _layers_and_head(self, x, cos, sin, attend, hidden_layer, select, hidden_all: bool = False):
        """Every decoder layer, then logits (and hidden states) at `select` (an index into x's
        leading dims, None = all); hidden_all: hidden states at every position, logits at `select`."""
        hidden = None
        for i in range(self.config.num_hidden_layers):
            x = self._layer(i, x, cos, sin, attend)
            if hidden_layer == i:
                hidden = x
        if select is not None and not hidden_all:
            x = x[select]
            hidden = hidden[select] if hidden is not None else None
        x = rms_norm(x, self.w["norm.weight"], self.config.rms_norm_eps)
        if hidden_layer == -1:
            hidden = x
        if select is not None and hidden_all:
            x = x[select]
        return self.kernels.logits(x), hidden

    def embed(self, tokens_BT: torch.Tensor, features_BTD: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input: the token embeddings (a feature-level draft head,
        speculative/feature_head.py, also reads the target's hidden states)."""
        if features_BTD is not None:
            raise ValueError("this model reads tokens only; features_BTD is a feature-level draft head's input")
        return F.embedding(tokens_BT, self.w["embed_tokens.weight"])

    def forward(self, tokens_BT: torch.Tensor, pos_BT: torch.Tensor, cache: KVCache | None = None,
                hidden_layer: int | None = None, select: tuple[torch.Tensor, torch.Tensor] | None = None,
                lengths_B: torch.Tensor | None = None, features_BTD: torch.Tensor | None = None,
                hidden_all: bool = False):
        """Run tokens at absolute positions pos_BT. With a cache, their K/V are written to
        slots pos_BT and each query attends to slots <= its position; without one, to the
        tokens of this call (causal). Returns (logits_BTV fp32, hidden_BTD or None).

        hidden_layer: None = no hidden states; -1 = the final-norm output (what lm_head sees);
        i >= 0 = the residual stream after layer i.
        select=(b_N, t_N): compute logits (and hidden states) only at these (row, time) pairs and
        return them flattened, logits_NV and hidden_ND (replay needs only the output positions).
        lengths_B (no cache, positions 0..T-1): row b holds lengths_B[b] real tokens followed by
        padding; the per-token work skips the padding (see `_forward_packed`).
        features_BTD: a feature-level draft head's second input (`embed`); hidden_all: with select,
        the hidden states at every position (a draft head's prefill reads the target's)."""
        if lengths_B is not None:
            if cache is not None:
                raise ValueError("lengths_B is for cache-free replay of whole sequences")
            return self._forward_packed(tokens_BT, lengths_B, hidden_layer, select)
        B, T = tokens_BT.shape
        x = self.embed(tokens_BT, features_BTD)
        needed = int(pos_BT.max()) + 1
        if cache is None:  # keys are this call's tokens; plain causal when positions are 0..T-1
            self._grow(max(needed, T))
            arange = needed == T and bool((pos_BT == self._arange_P[:T]).all())
            mask_BTS = None if arange else pos_BT[:, None, :] <= pos_BT[:, :, None]

            def attend(i, q_BTHE, k_BTGE, v_BTGE):
                a_BHTE = self.kernels.attention(q_BTHE.transpose(1, 2), k_BTGE.transpose(1, 2),
                                                v_BTGE.transpose(1, 2), mask_BTS)
                return a_BHTE.transpose(1, 2).reshape(B, T, -1)
        else:
            S = self.kernels.slots_to_read(needed, cache.max_slots)
            self._grow(max(S, B))
            mask_BTS = self._arange_P[:S][None, None, :] <= pos_BT[:, :, None]
            index = (self._arange_P[:B, None].expand(B, T), pos_BT)

            def attend(i, q_BTHE, k_BTGE, v_BTGE):
                cache.write(i, k_BTGE, v_BTGE, index)
                a_BHTE = self.kernels.attention(q_BTHE.transpose(1, 2), cache.keys(i, S), cache.values(i, S), mask_BTS)
                return a_BHTE.transpose(1, 2).reshape(B, T, -1)

        cos, sin = self._cos_PE[pos_BT][:, :, None], self._sin_PE[pos_BT][:, :, None]
        return self._layers_and_head(x, cos, sin, attend, hidden_layer, select, hidden_all)

    def _forward_packed(self, tokens_BT, lengths_B, hidden_layer, select):
        """Replay of right-padded rows with the padding removed from every per-token op (linear
        layers, norms, RoPE): only attention sees the padded [B, T] layout. A padded token never
        reaches a real one (causal, padding is at the end), so real tokens get the values of the
        padded forward up to GEMM row order (honest numerical noise)."""
        B, T = tokens_BT.shape
        dev = tokens_BT.device
        lengths_B = lengths_B.to(dev)
        self._grow(T)
        keep_BT = self._arange_P[:T][None, :] < lengths_B[:, None]
        flat_N = keep_BT.reshape(-1).nonzero().squeeze(1)  # packed token -> index into B*T
        x = F.embedding(tokens_BT.reshape(-1)[flat_N], self.w["embed_tokens.weight"])
        pos_N = flat_N % T
        cos, sin = self._cos_PE[pos_N][:, None], self._sin_PE[pos_N][:, None]

        def pad(t_NHE):
            buf = t_NHE.new_zeros(B * T, *t_NHE.shape[1:])
            buf[flat_N] = t_NHE
            return buf.view(B, T, *t_NHE.shape[1:]).transpose(1, 2)

        def attend(i, q_NHE, k_NGE, v_NGE):
            a_BHTE = self.kernels.attention(pad(q_NHE), pad(k_NGE), pad(v_NGE), None)
            return a_BHTE.transpose(1, 2).reshape(B * T, -1)[flat_N]

        if select is not None:  # (row, time) -> packed index
            b_N, t_N = (t.to(dev) for t in select)
            select = (torch.cumsum(lengths_B, 0) - lengths_B)[b_N] + t_N
        return self._layers_and_head(x, cos, sin, attend, hidden_layer, select)
