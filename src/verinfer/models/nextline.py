"""Next-line completion of held-out Python standard-library code: a task with checkable answers
for a real code-capable target (the speculative-decoding benchmark on SmolLM2).

One problem, from a held-out stdlib file (models/corpus.py: never in the draft's training data),
tokenized WHOLE with the target's tokenizer (so every prompt ends where the file's own tokenization
puts a boundary; BPE tokenizers merge a newline with the next line's indentation, e.g. "\\n   "):

  prompt  = the `context` tokens ending at a line start: the token holding the newline that ends the
            previous line, followed by the first `given` tokens of the line (none of them a newline);
  answer  = the rest of that line: the text from there up to (not including) the next newline;
  correct = the greedy continuation, decoded, has a newline and its text before that first newline
            equals the answer exactly (whitespace included).

Lines are drawn uniformly over every eligible line of the held-out files (a non-blank rest of line
of at most MAX_LINE_TOKENS tokens, after at least MIN_CONTEXT tokens of the file), without
replacement, in a fixed order (seed): validation = the first `n_val`, test = the next `n_test`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from verinfer.models import corpus

MIN_CONTEXT = 32
MAX_LINE_TOKENS = 48
SEED = 20_261_124


@dataclass(frozen=True)
class LineProblem:
    file: str                # held-out stdlib path
    prompt_ids: tuple[int, ...]
    answer: str              # the rest of the line (no newline)
    answer_tokens: int       # in the file's tokenization, before the newline token


def newline_token_ids(tokenizer) -> frozenset[int]:
    """Every token whose text holds a newline: a line ends at one (the stop set of the task)."""
    return frozenset(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))


def eligible(ids: list[int], nl: frozenset[int], given: int) -> list[int]:
    """Indices j of newline tokens after which the next line's first `given` tokens hold no newline and
    are followed by 1..MAX_LINE_TOKENS more tokens before the next newline token."""
    out = []
    for j in range(MIN_CONTEXT - 1, len(ids) - 1):
        if ids[j] not in nl:
            continue
        k = j + 1
        while k < len(ids) and ids[k] not in nl and k - j - 1 < given + MAX_LINE_TOKENS + 1:
            k += 1
        n_line = k - j - 1
        if k < len(ids) and given < n_line <= given + MAX_LINE_TOKENS:
            out.append(j)
    return out


def problems(tokenizer, n: int, *, context: int = 256, given: int = 4, seed: int = SEED,
             files: str = "heldout") -> list[LineProblem]:
    """The first `n` problems of the task's fixed order (see the module docstring). files="train":
    the same construction on the stdlib TRAINING files (training data of a learned judge)."""
    if files not in ("heldout", "train"):
        raise ValueError(f"files must be 'heldout' or 'train', got {files!r}")
    nl = newline_token_ids(tokenizer)
    train, held = corpus.stdlib_split()
    if files == "train":
        held = train
    cands: list[tuple[str, list[int], int]] = []
    for doc in held:
        rel = doc.split("\n", 1)[0][len(corpus.FILE_HEADER):]
        ids = tokenizer.encode(doc, add_special_tokens=False)
        cands += [(rel, ids, j) for j in eligible(ids, nl, given)]
    order = random.Random(seed).sample(range(len(cands)), len(cands))
    out: list[LineProblem] = []
    for c in order:
        rel, ids, j = cands[c]
        cut = j + 1 + given
        k = cut
        while ids[k] not in nl:
            k += 1
        rest = tokenizer.decode(ids[cut:k + 1])
        answer = rest.split("\n", 1)[0]
        if not answer.strip():
            continue
        out.append(LineProblem(rel, tuple(ids[max(0, cut - context):cut]), answer, k - cut))
        if len(out) == n:
            return out
    raise ValueError(f"the held-out stdlib files give {len(out)} next-line problems, fewer than the {n} asked")


def splits(tokenizer, n_val: int, n_test: int, **kw) -> tuple[list[LineProblem], list[LineProblem]]:
    """(validation, test): disjoint, the first n_val and the next n_test problems."""
    ps = problems(tokenizer, n_val + n_test, **kw)
    return ps[:n_val], ps[n_val:]


def line_of(text: str) -> str | None:
    """The completed line a continuation gives: its text before the first newline; None when it
    never ended the line (ran out of tokens)."""
    return text.split("\n", 1)[0] if "\n" in text else None


def correct(tokenizer, problem: LineProblem, output_ids: list[int]) -> bool:
    return line_of(tokenizer.decode(output_ids)) == problem.answer
