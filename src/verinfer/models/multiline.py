"""Multi-line completion of held-out Python standard-library code: the decode-heavy task of the
speculative-decoding benchmark (answers of MAX_TOKENS tokens, where next-line answers are ~11).

One problem, from a held-out stdlib file (models/corpus.py: never in any draft's or head's training
data), tokenized WHOLE with the target's tokenizer, built on models/nextline.py's problems (the same
lines in the same fixed order):

  prompt  = the `context` tokens ending `given` tokens into a line (nextline.problems);
  lines   = the rest of that line, then the following lines of the file, as many WHOLE lines as end
            within the first ANSWER_TOKENS tokens after the prompt (file tokenization), at least
            MIN_LINES;
  decode  = MAX_TOKENS tokens (no stop token but the tokenizer's EOS): every answer is MAX_TOKENS
            long unless the model ends the text, so the benchmark times decoding, not prefill;
  score   = per line: line i of the continuation (its text split at newlines) equals lines[i]
            exactly (whitespace included); a problem scores the share of its lines, the task's
            accuracy is the mean over problems (paired intervals compare two methods per problem).
"""

from __future__ import annotations

from dataclasses import dataclass

from verinfer.models import nextline

ANSWER_TOKENS = 48
MAX_TOKENS = 64
MIN_LINES = 2


@dataclass(frozen=True)
class LinesProblem:
    file: str
    prompt_ids: tuple[int, ...]
    lines: tuple[str, ...]   # the rest of the prompt's line, then whole lines


def problems(tokenizer, n: int, *, context: int = 256, given: int = 4, files: str = "heldout") -> list[LinesProblem]:
    """The first `n` problems (module docstring) in nextline's fixed order."""
    from verinfer.models import corpus

    nl = nextline.newline_token_ids(tokenizer)
    docs = dict((d.split("\n", 1)[0][len(corpus.FILE_HEADER):], d)
                for d in corpus.stdlib_split()[0 if files == "train" else 1])
    ids_of: dict[str, list[int]] = {}
    out: list[LinesProblem] = []
    # nextline's order over its eligible lines; more candidates than needed, since some lack MIN_LINES
    for p in nextline.problems(tokenizer, 3 * n + 50, context=context, given=given, files=files):
        ids = ids_of.setdefault(p.file, tokenizer.encode(docs[p.file], add_special_tokens=False))
        cut = _cut(ids, p.prompt_ids, context)
        ends = [k for k in range(cut, min(len(ids), cut + ANSWER_TOKENS)) if ids[k] in nl]
        if len(ends) < MIN_LINES:
            continue
        text = tokenizer.decode(ids[cut:ends[-1] + 1])
        lines = tuple(text.split("\n")[:text.count("\n")])
        if len(lines) < MIN_LINES:
            continue
        out.append(LinesProblem(p.file, p.prompt_ids, lines))
        if len(out) == n:
            return out
    raise ValueError(f"the held-out stdlib files give {len(out)} multi-line problems, fewer than the {n} asked")


def _cut(ids: list[int], prompt: tuple[int, ...], context: int) -> int:
    """Where in the file's token ids the prompt ends (its last `context` tokens end there)."""
    n = len(prompt)
    for k in range(n, len(ids) + 1):
        if tuple(ids[k - n:k]) == prompt:
            return k
    raise ValueError("a prompt is not a span of its file's tokenization")


def splits(tokenizer, n_val: int, n_test: int, **kw) -> tuple[list[LinesProblem], list[LinesProblem]]:
    ps = problems(tokenizer, n_val + n_test, **kw)
    return ps[:n_val], ps[n_val:]


def line_scores(tokenizer, problem: LinesProblem, output_ids: list[int]) -> list[bool]:
    """Per reference line: is line i of the continuation equal to it? A line the continuation never
    finished (no newline after it) is wrong."""
    got = tokenizer.decode(output_ids).split("\n")[:-1]  # complete lines only
    return [i < len(got) and got[i] == ref for i, ref in enumerate(problem.lines)]


def score(tokenizer, problem: LinesProblem, output_ids: list[int]) -> float:
    s = line_scores(tokenizer, problem, output_ids)
    return sum(s) / len(s)
