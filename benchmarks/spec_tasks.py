"""The tasks of the speculative-decoding benchmark (benchmarks/kl_judge_bench.py), each with its
target/draft pair, its validation and test problems, its grader and its agreement key.

  arithmetic  the shipped testbed pair (4M target, 0.6M draft) on held-out arithmetic
              (models/corpus.py): validation heldout[0:300], test heldout[300:1000], prompt
              "Q: 37+45=\\nA: ", stop at a newline token, max_tokens 8; correct = the continuation
              starts with the exact answer followed by a non-digit; agreement key = the first line.
  nextline    SmolLM2-135M-Instruct and its distilled draft (models/draft.py) on next-line
              completion of held-out stdlib code (models/nextline.py): 256-token context ending
              `given` tokens into the line, stop at a newline token, max_tokens 48; correct = the
              line's rest exactly; agreement key = the generated line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from verinfer.speculative.decoder import SpecOutput

NEXTLINE_CONTEXT = 256
NEXTLINE_GIVEN = 4
NEXTLINE_MAX_TOKENS = 48
NEXTLINE_VAL, NEXTLINE_TEST = 400, 1000
MULTILINE_VAL, MULTILINE_TEST = 80, 240
# tokens of the first line in the prompt: 6, as the committed next-line run; on the first 80 validation problems
# the target's per-line accuracy was 9.5% with 4 given tokens, 17.7% with 6 (17.7% too with a 768-token context)
# and 12.0% with 8 (kl_judge_feasibility_multiline.md measures 4 and 6 again)
MULTILINE_GIVEN = 6


@dataclass
class SpecTask:
    name: str
    tokenizer: Any
    target_dir: Path
    draft_dir: Path
    val: list
    test: list
    val_prompts: list[list[int]]
    test_prompts: list[list[int]]
    stop: tuple[int, ...]
    max_tokens: int
    is_correct: Callable[[Any, list[int]], bool]   # (problem, output ids) -> exact answer?
    key: Callable[[list[int]], str]                # output ids -> what agreement compares
    train_prompts: Callable[[int], list[list[int]]]  # AutoJudge mining (the task's training distribution)
    setup: dict = field(default_factory=dict)      # descriptions for the results' `setup`
    dtype: str = "fp32"                            # of target and draft in every method
    cache_tag: str = ""                            # the task's parameters, in the benchmark's run-cache keys
    score: Callable[[Any, list[int]], float] | None = None  # (problem, output ids) -> share correct; None: is_correct
    head_dir: Path | None = None                   # the target's feature-level draft head (feature_head.py)

    def correct_indices(self, problems: list, outs: list[SpecOutput]) -> list[int]:
        return [i for i, (p, o) in enumerate(zip(problems, outs)) if self.is_correct(p, o.output_token_ids)]

    def scores(self, problems: list, outs: list[SpecOutput]) -> list[float]:
        """Per problem, its score in [0, 1] (1/0 for a task graded right/wrong): accuracy is their mean."""
        if self.score is None:
            return [float(self.is_correct(p, o.output_token_ids)) for p, o in zip(problems, outs)]
        return [self.score(p, o.output_token_ids) for p, o in zip(problems, outs)]

    def head(self, target):
        """The feature-level draft head on `target` (sharing its embedding and lm_head), or None."""
        if self.head_dir is None:
            return None
        from verinfer.speculative.feature_head import FeatureHead

        return FeatureHead.from_target(self.head_dir, target)

    def models(self, device: str = "cpu"):
        """Target and draft on the forward every method runs (LlamaLM, default kernels, self.dtype)."""
        import torch

        from verinfer.models.llama import LlamaLM

        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]
        return (LlamaLM.from_pretrained(self.target_dir, device=device, dtype=dt),
                LlamaLM.from_pretrained(self.draft_dir, device=device, dtype=dt))


def newline_tokens(tokenizer) -> tuple[int, ...]:
    """The stop set of both tasks: every token holding a newline (models/nextline.py)."""
    from verinfer.models.nextline import newline_token_ids

    return tuple(sorted(newline_token_ids(tokenizer)))


def arithmetic_task(n_val: int = 300, n_test: int = 700) -> SpecTask:
    from verinfer.models.corpus import heldout_problems, train_problems
    from verinfer.models.load import load_tokenizer
    from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
    from verinfer.speculative.autojudge import final_answer

    if n_val > 300 or n_test > 700:
        raise ValueError(f"the held-out set has 300 validation and 700 test problems (asked {n_val}, {n_test})")
    tok = load_tokenizer(TOKENIZER_DIR)
    held = heldout_problems(1000)
    val, test = held[:n_val], held[300:300 + n_test]
    enc = lambda ps: [tok.encode(q, add_special_tokens=False) for q, _ in ps]  # noqa: E731

    def is_correct(problem, ids):
        s, a = tok.decode(ids), problem[1]
        return s.startswith(a) and not s[len(a):len(a) + 1].isdigit()

    return SpecTask("arithmetic", tok, TARGET_DIR, DRAFT_DIR, val, test, enc(val), enc(test), newline_tokens(tok), 8,
                    is_correct, lambda ids: final_answer(tok.decode(ids)),
                    lambda n: enc(train_problems(n, seed=1)),
                    {"task": "held-out arithmetic (models/corpus.py), zero-shot 'Q: a op b=\\nA: ', greedy, stop at a "
                             "newline token, max_tokens 8",
                     "validation_problems": f"heldout[0:{n_val}]", "test_problems": f"heldout[300:{300 + n_test}]"})


def nextline_task(n_val: int = NEXTLINE_VAL, n_test: int = NEXTLINE_TEST, target: str = "smollm2-135m-instruct",
                  draft_dir: Path | None = None, given: int = NEXTLINE_GIVEN) -> SpecTask:
    from verinfer.models import nextline
    from verinfer.models.catalog import resolve_model
    from verinfer.models.draft import default_out
    from verinfer.models.load import load_tokenizer

    target_dir = resolve_model(target)
    draft_dir = Path(draft_dir) if draft_dir is not None else default_out(target_dir)
    if not (draft_dir / "config.json").is_file():
        raise FileNotFoundError(f"no draft at {draft_dir}: build it with `verinfer testbed build-draft --model {target}`")
    tok = load_tokenizer(target_dir)
    if not 1 <= given < NEXTLINE_CONTEXT:
        raise ValueError(f"given must be between 1 and {NEXTLINE_CONTEXT - 1} tokens of the line, got {given}")
    kw = dict(context=NEXTLINE_CONTEXT, given=given)
    val, test = nextline.splits(tok, n_val, n_test, **kw)
    stop = newline_tokens(tok)

    def key(ids):
        return tok.decode(ids).split("\n", 1)[0]

    return SpecTask("nextline", tok, target_dir, draft_dir, val, test, [list(p.prompt_ids) for p in val],
                    [list(p.prompt_ids) for p in test], stop, NEXTLINE_MAX_TOKENS,
                    lambda p, ids: nextline.correct(tok, p, ids), key,
                    lambda n: [list(p.prompt_ids) for p in nextline.problems(tok, n, files="train", **kw)],
                    {"task": f"next-line completion of held-out stdlib code (models/nextline.py): the file tokenized "
                             f"whole, {NEXTLINE_CONTEXT}-token context ending {given} tokens into the line, "
                             f"greedy, stop at a newline token, max_tokens {NEXTLINE_MAX_TOKENS}; correct = the rest of "
                             "the line exactly",
                     "validation_problems": f"nextline problems[0:{n_val}]",
                     "test_problems": f"nextline problems[{n_val}:{n_val + n_test}]", "given": given},
                    dtype="bf16", cache_tag=f"ctx{NEXTLINE_CONTEXT}-given{given}", head_dir=_head_dir(target_dir))


def _head_dir(target_dir: Path) -> Path:
    from verinfer.speculative.head_build import default_out

    d = default_out(target_dir)
    if not (d / "head.safetensors").is_file():
        raise FileNotFoundError(f"no draft head at {d}: build it with `verinfer models build-head --model "
                                f"{target_dir.name}`")
    return d


def multiline_task(n_val: int = MULTILINE_VAL, n_test: int = MULTILINE_TEST, target: str = "smollm2-135m-instruct",
                   draft_dir: Path | None = None, given: int = MULTILINE_GIVEN) -> SpecTask:
    from verinfer.models import multiline
    from verinfer.models.catalog import resolve_model
    from verinfer.models.draft import default_out, separator_id
    from verinfer.models.load import load_tokenizer

    target_dir = resolve_model(target)
    draft_dir = Path(draft_dir) if draft_dir is not None else default_out(target_dir)
    tok = load_tokenizer(target_dir)
    kw = dict(context=NEXTLINE_CONTEXT, given=given)
    val, test = multiline.splits(tok, n_val, n_test, **kw)
    stop = tuple(sorted({separator_id(tok), tok.eos_token_id} - {None}))
    enc = lambda ps: [list(p.prompt_ids) for p in ps]  # noqa: E731
    return SpecTask("multiline", tok, target_dir, draft_dir, val, test, enc(val), enc(test), stop, multiline.MAX_TOKENS,
                    lambda p, ids: multiline.score(tok, p, ids) == 1.0, lambda ids: tok.decode(ids),
                    lambda n: enc(multiline.problems(tok, n, files="train", **kw)),
                    {"task": f"multi-line completion of held-out stdlib code (models/multiline.py): the file tokenized "
                             f"whole, {NEXTLINE_CONTEXT}-token context ending {given} tokens into a line, greedy, "
                             f"{multiline.MAX_TOKENS} tokens (stop only at the end-of-text tokens {list(stop)}); scored "
                             f"per line: the rest of the line and the following whole lines ending within "
                             f"{multiline.ANSWER_TOKENS} tokens (at least {multiline.MIN_LINES}), each exactly; a "
                             "problem scores its share of correct lines",
                     "validation_problems": f"multiline problems[0:{n_val}]",
                     "test_problems": f"multiline problems[{n_val}:{n_val + n_test}]", "given": given,
                     "mean_reference_lines": sum(len(p.lines) for p in val + test) / len(val + test)},
                    dtype="bf16", cache_tag=f"ctx{NEXTLINE_CONTEXT}-given{given}-mt{multiline.MAX_TOKENS}",
                    score=lambda p, ids: multiline.score(tok, p, ids), head_dir=_head_dir(target_dir))


TASKS = {"arithmetic": arithmetic_task, "nextline": nextline_task, "multiline": multiline_task}
