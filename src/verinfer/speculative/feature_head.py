"""A feature-level draft head (EAGLE; Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty", section 3): one decoder layer that reads the TARGET's own last
hidden state and the next token, predicts the target's next hidden state, and drafts through the
target's own lm_head. It has no embedding or output matrix of its own (the target's are shared),
so it is ~4M parameters on SmolLM2-135M (d 576) where a separate draft spends 12.6M on its embedding.

Pipeline, per head position t (the feature f_t is the target's final-norm output at position t,
what its lm_head reads; e() the target's token embedding):
  x_t      = fc([e(s_{t+1}); f_t])                 fc: 2D -> D, no bias
  f^_{t+1} = norm(layer(x_<=t))                    one Llama decoder layer with its own KV cache
                                                   (causal over the head's positions) and its own norm
  q_{t+2}  = softmax(lm_head(f^_{t+1}) / T)        the target's lm_head (optionally its FR-Spec rows)
Drafting (chain, speculative/drafters.py): after a verification the head catches up on the committed
tokens with the TARGET's features of that verification forward (no extra target pass), and its
output drafts x_1; each further draft step feeds back the head's own f^ (EAGLE's autoregression
at the feature level). Training (speculative/head_build.py): teacher forcing on the target's features,
EAGLE's loss  L = SmoothL1(f^_{t+1}, f_{t+1}) + W_CLS * CE(q_{t+2}, p_{t+2}),  with noise on the
input features so that the head tolerates its own predictions.

Shape key: B rows, T positions, D = the target's hidden size.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from verinfer.errors import ModelError
from verinfer.models.llama import LlamaConfig, LlamaLM

HEAD_FILE = "head.safetensors"
HEAD_CONFIG = "head_config.json"
FC = "fc.weight"
SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, never stored with the head


def head_config(target: LlamaConfig) -> LlamaConfig:
    """The head's LlamaConfig: the target's shapes with one decoder layer."""
    return replace(target, num_hidden_layers=1)


class FeatureHead(LlamaLM):
    """A one-layer LlamaLM whose first-layer input is fc([e(token); feature]) (module docstring).
    Runs through Engine like any model: Engine.prefill_extend/extend pass features_BTD."""

    def embed(self, tokens_BT: torch.Tensor, features_BTD: torch.Tensor | None = None) -> torch.Tensor:
        if features_BTD is None:
            raise ValueError("a feature-level draft head reads the target's hidden states: pass features_BTD")
        e_BTD = F.embedding(tokens_BT, self.w["embed_tokens.weight"])
        return F.linear(torch.cat([e_BTD, features_BTD.to(e_BTD.dtype)], -1), self.w[FC])

    def with_kernels(self, kernels) -> "FeatureHead":
        return FeatureHead(self.config, self.w, attn=self.attn, kernels=kernels)

    @classmethod
    def from_target(cls, head_dir: str | Path, target: LlamaLM) -> "FeatureHead":
        """The head in head_dir (HEAD_FILE + HEAD_CONFIG) on `target`'s device and dtype, sharing the
        target's embedding and lm_head tensors."""
        from safetensors.torch import load_file

        d = Path(head_dir)
        if not (d / HEAD_FILE).is_file():
            raise ModelError(f"no {HEAD_FILE}", where=str(d),
                             fix="build the head with `verinfer models build-head --model <target>`")
        try:
            meta = json.loads((d / HEAD_CONFIG).read_text())
            if not isinstance(meta, dict):
                raise ValueError(f"a JSON object expected, got {type(meta).__name__}")
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot read the head's config ({e})", where=str(d / HEAD_CONFIG),
                             fix="rebuild the head with `verinfer models build-head`") from e
        tc = target.config
        if (meta.get("hidden_size"), meta.get("vocab_size")) != (tc.hidden_size, tc.vocab_size):
            raise ModelError(f"head built for hidden {meta.get('hidden_size')} / vocab {meta.get('vocab_size')}, "
                             f"target has {tc.hidden_size} / {tc.vocab_size}", where=str(d),
                             fix="use the head built for this target")
        try:
            raw = load_file(str(d / HEAD_FILE), device="cpu")
        except Exception as e:
            raise ModelError(f"cannot read the head's weights ({e})", where=str(d / HEAD_FILE),
                             fix="the file may be truncated; rebuild it with `verinfer models build-head`") from e
        w = {k: t.to(device=target.device, dtype=target.dtype) for k, t in raw.items()}
        for k in SHARED:
            w[k] = target.w[k]
        cfg = head_config(tc)
        missing = [n for n in cls.expected_weight_names(cfg) + [FC] if n not in w]
        if missing:
            raise ModelError(f"missing weights {missing[:3]}", where=str(d / HEAD_FILE), fix="rebuild the head")
        return cls(cfg, w, attn=target.attn)


def head_weights(target: LlamaLM, seed: int) -> dict[str, torch.Tensor]:
    """Fresh fp32 trainable weights of a head for `target` (Llama init: normal(0, 0.02); norms 1;
    fc starts as [0, I]: the feature passes through, the token is learned)."""
    c = head_config(target.config)
    g = torch.Generator().manual_seed(seed)
    D, Dq, Dkv, M = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    shapes = {"self_attn.q_proj.weight": (Dq, D), "self_attn.k_proj.weight": (Dkv, D),
              "self_attn.v_proj.weight": (Dkv, D), "self_attn.o_proj.weight": (D, Dq),
              "mlp.gate_proj.weight": (M, D), "mlp.up_proj.weight": (M, D), "mlp.down_proj.weight": (D, M)}
    w = {f"layers.0.{k}": torch.randn(*s, generator=g) * 0.02 for k, s in shapes.items()}
    w["layers.0.input_layernorm.weight"] = torch.ones(D)
    w["layers.0.post_attention_layernorm.weight"] = torch.ones(D)
    w["norm.weight"] = target.w["norm.weight"].float().clone()
    w[FC] = torch.cat([torch.randn(D, D, generator=g) * 0.02, torch.eye(D)], 1)
    return w


def trainable(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's own weights (what HEAD_FILE stores): everything but the target's shared tensors."""
    return {k: t for k, t in w.items() if k not in SHARED}
