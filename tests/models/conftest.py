"""Tiny random checkpoints of every supported architecture (save_pretrained into tmp dirs)."""

from __future__ import annotations

import pytest
import torch

@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_llama_dir):
    """arch -> directory of a randomly initialised tiny model of that architecture (GQA 4/2;
    Qwen2 with q/k/v biases, Qwen3 with q/k norms and head_dim 24 != hidden/heads; biases and
    norm weights perturbed away from their zero / one init so that they matter)."""
    import transformers as tf

    made = {"llama": tiny_llama_dir}
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    specs = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(rope_theta=1e6)),
             "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=24)),
             "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=None))}

    def get(arch: str):
        if arch not in made:
            config_cls, model_cls, extra = specs[arch]
            torch.manual_seed(0)
            model = model_cls(config_cls(**common, **extra))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias") or "norm" in name:
                        p.add_(torch.randn_like(p) * 0.1)
                model.lm_head.weight.mul_(8.0)
            made[arch] = tmp_path_factory.mktemp(f"tiny_{arch}")
            model.save_pretrained(made[arch], safe_serialization=True)
        return made[arch]

    return get
