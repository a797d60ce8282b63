"""The decode-heavy multi-line task (models/multiline.py) on the testbed tokenizer: problems are the
next-line problems' prompts followed by the file's own whole lines; scoring is per line, exact."""

import pytest

from verinfer.models import corpus, multiline, nextline
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def test_problems_continue_with_the_files_own_lines(tok):
    ps = multiline.problems(tok, 12, context=64, given=2)
    held = {doc.split("\n", 1)[0][len(corpus.FILE_HEADER):]: doc for doc in corpus.stdlib_split()[1]}
    firsts = {p.prompt_ids: p for p in nextline.problems(tok, 3 * 12 + 50, context=64, given=2)}
    for p in ps:
        assert corpus.is_heldout_file(p.file) and len(p.lines) >= multiline.MIN_LINES
        assert p.prompt_ids in firsts and p.lines[0] == firsts[p.prompt_ids].answer  # nextline's problem, its answer first
        text = tok.decode(list(p.prompt_ids)) + "\n".join(p.lines) + "\n"
        assert text in held[p.file]
        # whole lines ending within ANSWER_TOKENS tokens of the file's tokenization
        n = len(tok.encode("\n".join(p.lines) + "\n", add_special_tokens=False))
        assert n <= multiline.ANSWER_TOKENS + 2
    val, test = multiline.splits(tok, 4, 8, context=64, given=2)
    assert val + test == ps  # deterministic, disjoint, in order


def test_scores_each_line_exactly_in_order(tok):
    p = multiline.LinesProblem("x.py", (1, 2), ("a = 1", "", "    return a"))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert multiline.line_scores(tok, p, enc("a = 1\n\n    return a\nmore")) == [True, True, True]
    assert multiline.score(tok, p, enc("a = 1\n\n    return b\n")) == pytest.approx(2 / 3)
    assert multiline.line_scores(tok, p, enc("a = 1\n    return a\n")) == [True, False, False]  # shifted: wrong
    assert multiline.line_scores(tok, p, enc("a = 1\n\n    return a")) == [True, True, False]    # never ended
    assert multiline.score(tok, p, enc("a = 1 \n\n    return a\n")) == pytest.approx(2 / 3)     # trailing space
