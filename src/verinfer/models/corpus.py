"""The testbed training corpus: Python standard-library source plus synthetic arithmetic.

Everything here is deterministic. The held-out split does NOT depend on the build seed: a
stdlib file is held out when a hash of its relative path says so, and held-out arithmetic
problems come from a fixed seed. So `eval_prompts(..., seed)` draws from text the shipped
testbed never trained on, whatever seed the audit uses.

Text format of one arithmetic problem: ``"Q: 37+45=\\nA: 82\\n"`` (question ``"Q: 37+45=\\nA: "``,
answer ``"82"``). Documents (one stdlib file, or a block of problems) are separated by the
``<|eos|>`` token in the training stream.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

EOS_TEXT = "<|eos|>"
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3"})
# _sysconfigdata_*.py is generated per build of Python (paths, compiler flags): machine-specific.
EXCLUDED_PREFIXES = ("_sysconfigdata",)
FILE_HEADER = "# file: "
DEFAULT_MAX_BYTES = 16_000_000  # more than the whole 3.11 stdlib (~12 MB): no truncation by default
HELDOUT_FILE_PERCENT = 5        # of stdlib files, chosen by path hash
HELDOUT_ARITH_SEED = 1_000_003  # fixed: held-out problems are the same for every build seed
N_HELDOUT_PROBLEMS = 1000
N_TRAIN_PROBLEMS = 60_000       # ~20% of the training tokens
PROBLEMS_PER_DOC = 32
OPS = ("+", "-", "*")

Problem = tuple[str, str]


# ----------------------------------------------------------------------------- stdlib source

def _stdlib_files() -> list[tuple[str, Path]]:
    """(relative posix path, path) of the stdlib *.py files, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib directory not found: {root}")
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith(EXCLUDED_PREFIXES):
            continue
        out.append((rel.as_posix(), p))
    out.sort(key=lambda t: t[0])
    if not out:
        raise FileNotFoundError(f"no stdlib *.py files under {root}")
    return out


@lru_cache(maxsize=2)
def _stdlib_docs() -> tuple[tuple[str, str], ...]:
    """(relpath, '# file: relpath\\n' + source) for every stdlib file, in sorted order."""
    docs = []
    for rel, p in _stdlib_files():
        src = p.read_bytes().decode("utf-8", errors="replace")
        if not src.endswith("\n"):
            src += "\n"
        docs.append((rel, f"{FILE_HEADER}{rel}\n{src}"))
    return tuple(docs)


def stdlib_source(max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Stdlib *.py source, files sorted by relative path, each prefixed by ``# file: <relpath>``,
    concatenated and truncated to at most `max_bytes` UTF-8 bytes (at a character boundary)."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    text = "".join(doc for _, doc in _stdlib_docs())
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def is_heldout_file(relpath: str) -> bool:
    """Whether a stdlib file belongs to the held-out split (by SHA-256 of its relative path)."""
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:4], "big")
    return h % 100 < HELDOUT_FILE_PERCENT


def stdlib_split(max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[list[str], list[str]]:
    """(train_files, heldout_files): the file documents of the first `max_bytes` of
    `stdlib_source`, split by `is_heldout_file`. A truncated last file is kept, truncated."""
    train, held, used = [], [], 0
    for rel, doc in _stdlib_docs():
        if used >= max_bytes:
            break
        b = doc.encode("utf-8")
        if used + len(b) > max_bytes:
            doc = b[: max_bytes - used].decode("utf-8", errors="ignore")
        used += len(b)
        (held if is_heldout_file(rel) else train).append(doc)
    return train, held


# ----------------------------------------------------------------------------- arithmetic

def _operand(rng: random.Random) -> int:
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def arithmetic_problems(n: int, seed: int) -> list[Problem]:
    """`n` (question, answer) pairs like ("Q: 37+45=\\nA: ", "82"), mixing +, -, * on 1-3 digit
    operands; subtraction is ordered so answers are never negative. Reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        op = rng.choice(OPS)
        a, b = _operand(rng), _operand(rng)
        if op == "-" and b > a:
            a, b = b, a
        ans = a + b if op == "+" else a - b if op == "-" else a * b
        out.append((f"Q: {a}{op}{b}=\nA: ", str(ans)))
    return out


def format_problem(problem: Problem) -> str:
    q, a = problem
    return f"{q}{a}\n"


def heldout_problems(n: int = N_HELDOUT_PROBLEMS) -> list[Problem]:
    """The fixed held-out problems (independent of any build seed); `n` <= N_HELDOUT_PROBLEMS."""
    if n > N_HELDOUT_PROBLEMS:
        raise ValueError(f"at most {N_HELDOUT_PROBLEMS} held-out problems, asked for {n}")
    return arithmetic_problems(N_HELDOUT_PROBLEMS, HELDOUT_ARITH_SEED)[:n]


def train_problems(n: int, seed: int) -> list[Problem]:
    """Training problems from `seed`, minus any whose question is a held-out question."""
    held = {q for q, _ in heldout_problems()}
    return [p for p in arithmetic_problems(n, seed) if p[0] not in held]


def arithmetic_accuracy(generate_fn: Callable[[str], str], problems: Sequence[Problem]) -> float:
    """Fraction of problems where `generate_fn(question)` (the greedy continuation text) starts
    with the right answer followed by a non-digit (or by nothing)."""
    if not problems:
        raise ValueError("no problems")
    ok = 0
    for q, a in problems:
        out = generate_fn(q)
        ok += out.startswith(a) and not out[len(a) : len(a) + 1].isdigit()
    return ok / len(problems)


# ----------------------------------------------------------------------------- corpus

def _problem_docs(problems: Sequence[Problem]) -> list[str]:
    return ["".join(format_problem(p) for p in problems[i : i + PROBLEMS_PER_DOC])
            for i in range(0, len(problems), PROBLEMS_PER_DOC)]


def corpus_documents(seed: int, max_bytes: int = DEFAULT_MAX_BYTES,
                     n_problems: int = N_TRAIN_PROBLEMS) -> tuple[list[str], list[str]]:
    """(train_docs, heldout_docs). Train docs are stdlib files and blocks of 32 problems,
    shuffled by `seed`; held-out docs are the held-out files then the held-out problems."""
    train_files, held_files = stdlib_split(max_bytes)
    train = train_files + _problem_docs(train_problems(n_problems, seed))
    random.Random(seed).shuffle(train)
    return train, held_files + _problem_docs(heldout_problems())


def build_corpus(seed: int, max_bytes: int = DEFAULT_MAX_BYTES,
                 n_problems: int = N_TRAIN_PROBLEMS) -> tuple[str, str]:
    """(train_text, heldout_text): stdlib source plus arithmetic problems, documents joined by
    ``<|eos|>``. The held-out part of both kinds is fixed (see module docstring)."""
    train, held = corpus_documents(seed, max_bytes, n_problems)
    return EOS_TEXT.join(train), EOS_TEXT.join(held)


# ----------------------------------------------------------------------------- prompts

def _code_snippet(tokenizer, rng: random.Random, files: Sequence[str], max_tokens: int) -> list[int] | None:
    """Whole lines from a random place in a random held-out file, as many as fit in max_tokens."""
    lines = rng.choice(files).splitlines(keepends=True)
    start = rng.randrange(1, max(2, len(lines)))  # skip the '# file:' header line
    if start >= len(lines) or not lines[start].strip():
        return None
    ids: list[int] = []
    for line in lines[start:]:
        nxt = tokenizer.encode(line, add_special_tokens=False)
        if len(ids) + len(nxt) > max_tokens:
            break
        ids += nxt
    return ids if len(ids) >= min(8, max_tokens) else None


def eval_prompts(tokenizer, n: int, seed: int, max_prompt_tokens: int = 48) -> list[list[int]]:
    """`n` prompt token-id lists for audits and demos, deterministic in `seed`: alternately a
    held-out stdlib code snippet (whole lines, at most `max_prompt_tokens` tokens) and a held-out
    arithmetic question."""
    if n < 0 or max_prompt_tokens < 1:
        raise ValueError(f"need n >= 0 and max_prompt_tokens >= 1, got {n}, {max_prompt_tokens}")
    rng = random.Random(seed)
    _, files = stdlib_split()
    problems = heldout_problems()
    out: list[list[int]] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * (n + 1):
            raise RuntimeError("could not cut enough code snippets; raise max_prompt_tokens")
        if len(out) % 2 == 0:
            ids = _code_snippet(tokenizer, rng, files, max_prompt_tokens)
        else:
            ids = tokenizer.encode(rng.choice(problems)[0], add_special_tokens=False)[:max_prompt_tokens]
        if ids:
            out.append(ids)
    return out
