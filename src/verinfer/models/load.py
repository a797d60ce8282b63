"""Load a causal LM and its tokenizer from a local Hugging Face directory (safetensors only).

`load_model(dir, numerics, device, kernels)` returns the model forward (models/llama.py LlamaLM)
as `numerics` computes it. `model_info(dir)` identifies a model and tokenizer by name, the other
names the checkpoint answers to, and content hash, so claims made for another model are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from verinfer.errors import ModelError
from verinfer.io import sha256_files
from verinfer.models.llama import LlamaLM, read_model_config
from verinfer.numerics import Numerics
from verinfer.numerics.kernels import Native


@dataclass(frozen=True)
class ModelInfo:
    name: str            # what claims put in their `model` field
    path: str
    vocab_size: int
    max_positions: int
    weights_sha256: str  # of the safetensors bytes (first 16 hex digits)
    tokenizer_sha256: str | None
    eos_token_id: int | None
    aliases: tuple[str, ...] = ()  # every name claims may use for it: `name` first, then what the
    #                                checkpoint records (config.json verinfer_aliases, a hub id in _name_or_path)


def model_info(local_dir: str | Path) -> ModelInfo:
    d = Path(local_dir)
    cfg = read_model_config(d)
    cfg_path = d / "config.json"
    for key in ("vocab_size", "hidden_size"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool):
            raise ModelError(f"`{key}` is missing or not an integer (got {cfg.get(key)!r})", where=f"{cfg_path}: {key}",
                             fix="re-save the model with save_pretrained (a Hugging Face config.json has it)")
    tok = d / "tokenizer.json"
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    hub = cfg.get("_name_or_path") or ""  # a hub id (org/name), not a local path
    hub = hub if hub and not hub.startswith("/") else ""
    name = cfg.get("verinfer_name", hub or d.name)
    recorded = cfg.get("verinfer_aliases") or []
    if not isinstance(recorded, list) or not all(isinstance(a, str) and a for a in recorded):
        raise ModelError("`verinfer_aliases` must be a list of non-empty strings", where=f"{d / 'config.json'}",
                         fix='e.g. "verinfer_aliases": ["HuggingFaceTB/SmolLM2-135M-Instruct"]')
    return ModelInfo(
        name=name,
        path=str(d),
        vocab_size=int(cfg["vocab_size"]),
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        weights_sha256=sha256_files(sorted(d.glob("*.safetensors"))),
        tokenizer_sha256=sha256_files([tok]) if tok.is_file() else None,
        eos_token_id=eos,
        aliases=tuple(dict.fromkeys([name, *recorded, *([hub] if hub else [])])),
    )


def load_model(local_dir: str | Path, numerics: Numerics = Numerics(), device: str | torch.device = "cpu",
               kernels: Native | None = None) -> LlamaLM:
    """The model as `numerics` would compute it (dtype, attention, fake-quant weights, matmul).
    kernels: another kernel strategy than Native(numerics.matmul) (numerics/kernels.py)."""
    if kernels is not None and numerics.matmul != "native":
        raise ValueError(f"numerics.matmul={numerics.matmul!r} with kernels={kernels!r}: "
                         "set matmul on the kernel strategy instead (e.g. Fused('fp32'))")
    return LlamaLM.from_pretrained(Path(local_dir), dtype=numerics.torch_dtype, device=device, attn=numerics.attn,
                                   weight_transform=numerics.apply_weights, matmul=numerics.matmul, kernels=kernels)


def has_tokenizer(local_dir: str | Path) -> bool:
    d = Path(local_dir)
    return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()


def load_tokenizer(local_dir: str | Path):
    from transformers import AutoTokenizer

    d = Path(local_dir)
    if not has_tokenizer(d):
        raise ModelError("no tokenizer here", where=str(d), fix="save the tokenizer with save_pretrained beside the model")
    return AutoTokenizer.from_pretrained(d)
