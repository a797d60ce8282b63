"""The next-line task (models/nextline.py) on the testbed tokenizer: prompts end inside the file's own
tokenization, answers are the rest of the line, grading is exact."""

import pytest

from verinfer.models import corpus, nextline
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_DIR)


def test_problems_are_the_files_own_lines_and_deterministic(tok):
    ps = nextline.problems(tok, 60, context=64, given=2)
    assert ps == nextline.problems(tok, 60, context=64, given=2)
    nl = nextline.newline_token_ids(tok)
    held = {doc.split("\n", 1)[0][len(corpus.FILE_HEADER):]: doc for doc in corpus.stdlib_split()[1]}
    for p in ps:
        assert corpus.is_heldout_file(p.file) and len(p.prompt_ids) <= 64
        assert p.prompt_ids[-3] in nl and not set(p.prompt_ids[-2:]) & nl  # a line start, then 2 tokens of it
        assert p.answer.strip() and "\n" not in p.answer
        text = tok.decode(list(p.prompt_ids)) + p.answer + "\n"
        assert text in held[p.file]  # the prompt's text continues with the answer in the file
    val, test = nextline.splits(tok, 20, 40, context=64, given=2)
    assert val + test == ps[:60] and not set(map(id, val)) & set(map(id, test))


def test_grading_is_exact_and_needs_the_line_to_end(tok):
    p = nextline.problems(tok, 1, context=64, given=2)[0]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert nextline.correct(tok, p, enc(p.answer + "\n    x"))
    assert not nextline.correct(tok, p, enc(p.answer))              # never ended the line
    assert not nextline.correct(tok, p, enc(p.answer + " \n"))      # a trailing space is a different line
    assert not nextline.correct(tok, p, enc(p.answer[:-1] + "\n"))


def test_training_problems_come_from_training_files(tok):
    ps = nextline.problems(tok, 30, context=64, given=2, files="train")
    assert not any(corpus.is_heldout_file(p.file) for p in ps)
    with pytest.raises(ValueError, match="files"):
        nextline.problems(tok, 1, files="test")
