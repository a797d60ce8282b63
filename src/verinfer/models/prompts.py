"""Prompt sets drawn from the testbed corpus (held-out standard-library code and arithmetic), the
same for every command that needs prompts: the audit demo, `generate`, MarginGate calibration,
speculative claims."""

from __future__ import annotations

from pathlib import Path

from verinfer.models.corpus import eval_prompts
from verinfer.models.load import load_tokenizer


# The seed offset of an audit's calibration and reference-band prompts: another sample of the same
# distribution as the audited prompts (seed), never the same prompts.
CALIB_SEED_OFFSET = 1_000_003


def prompts_for(model_dir: str | Path, n: int, seed: int, max_prompt_tokens: int = 48) -> list[list[int]]:
    """n token-id prompts for the model in `model_dir`, alternating code and arithmetic."""
    return eval_prompts(load_tokenizer(model_dir), n, seed, max_prompt_tokens)


def split_prompts(model_dir: str | Path, n: int, seed: int, max_prompt_tokens: int = 48) -> tuple[list, list]:
    """(code prompts, arithmetic prompts), n of each (eval_prompts alternates the two kinds)."""
    ps = prompts_for(model_dir, 2 * n, seed, max_prompt_tokens)
    return ps[0::2], ps[1::2]


CODE_ASKS = ("What does this Python code do?", "Explain this code in two sentences.",
             "Write a docstring for this code.", "Suggest one improvement to this code.",
             "Rewrite this code with clearer variable names.")


def chat_messages(n: int, seed: int, system_prompt: str | None = None, max_code_lines: int = 8) -> list[list[dict]]:
    """n chat conversations (one user turn each) for audits of chat endpoints, deterministic in
    `seed`: alternately a question about a held-out stdlib code snippet (at most max_code_lines
    whole lines, in a fenced block) and a held-out arithmetic question; `system_prompt` first when
    given (the auditor's own; None sends none, so the endpoint's template applies its default)."""
    import random

    from verinfer.models.corpus import heldout_problems, stdlib_split

    if n < 0:
        raise ValueError(f"need n >= 0, got {n}")
    rng = random.Random(seed)
    _, files = stdlib_split()
    problems = heldout_problems()
    head = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    out: list[list[dict]] = []
    while len(out) < n:
        if len(out) % 2 == 0:
            lines = rng.choice(files).splitlines()[1:]
            start = rng.randrange(max(1, len(lines)))
            snippet = "\n".join(lines[start : start + max_code_lines]).strip("\n")
            if len(snippet.strip()) < 20:
                continue
            text = f"{rng.choice(CODE_ASKS)}\n\n```python\n{snippet}\n```"
        else:
            a, _ = rng.choice(problems)
            text = f"What is {a.removeprefix('Q: ').split('=')[0]}? Answer with the number only."
        out.append([*head, {"role": "user", "content": text}])
    return out
