"""Prompt sets drawn from the testbed corpus (held-out standard-library code and arithmetic), the
same for every command that needs prompts: the audit demo, `generate`, MarginGate calibration,
speculative claims."""

from __future__ import annotations

from pathlib import Path

from verinfer.models.corpus import eval_prompts
from verinfer.models.load import load_tokenizer


def prompts_for(model_dir: str | Path, n: int, seed: int, max_prompt_tokens: int = 48) -> list[list[int]]:
    """n token-id prompts for the model in `model_dir`, alternating code and arithmetic."""
    return eval_prompts(load_tokenizer(model_dir), n, seed, max_prompt_tokens)


def split_prompts(model_dir: str | Path, n: int, seed: int, max_prompt_tokens: int = 48) -> tuple[list, list]:
    """(code prompts, arithmetic prompts), n of each (eval_prompts alternates the two kinds)."""
    ps = prompts_for(model_dir, 2 * n, seed, max_prompt_tokens)
    return ps[0::2], ps[1::2]
