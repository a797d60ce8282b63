"""Testbed corpus and builder: determinism, correct arithmetic, a tiny build that loads, and
the shipped testbed (when present) loads and agrees with its model card."""

from __future__ import annotations

import json
import re

import pytest
import torch

from verinfer.models import corpus, load, testbed


def test_stdlib_source_is_deterministic_and_truncated():
    a, b = corpus.stdlib_source(50_000), corpus.stdlib_source(50_000)
    assert a == b
    assert len(a.encode()) <= 50_000
    assert a.startswith(corpus.FILE_HEADER)
    assert "/test/" not in a and "idlelib/" not in a and "_sysconfigdata" not in a


def test_corpus_is_deterministic_and_split_is_disjoint():
    kw = dict(max_bytes=300_000, n_problems=500)
    assert corpus.build_corpus(3, **kw) == corpus.build_corpus(3, **kw)
    train, held = corpus.corpus_documents(3, **kw)
    assert not set(train) & set(held)
    assert corpus.build_corpus(4, **kw)[0] != corpus.build_corpus(3, **kw)[0]  # the order follows the seed
    assert corpus.build_corpus(4, **kw)[1] == corpus.build_corpus(3, **kw)[1]  # held-out does not
    held_q = {q for q, _ in corpus.heldout_problems()}
    assert not held_q & {q for q, _ in corpus.train_problems(5000, 3)}


def test_arithmetic_problems_are_correct_and_reproducible():
    probs = corpus.arithmetic_problems(300, seed=7)
    assert probs == corpus.arithmetic_problems(300, seed=7)
    assert probs != corpus.arithmetic_problems(300, seed=8)
    ops = set()
    for q, a in probs:
        m = re.fullmatch(r"Q: (\d{1,3})([-+*])(\d{1,3})=\nA: ", q)
        assert m, q
        ops.add(m.group(2))
        assert int(a) == eval(m.group(1) + m.group(2) + m.group(3))  # noqa: S307 - digits and one operator
    assert ops == {"+", "-", "*"}


def test_arithmetic_accuracy_checks_answer_then_non_digit():
    probs = [("Q: 2+2=\nA: ", "4"), ("Q: 5*3=\nA: ", "15"), ("Q: 9-1=\nA: ", "8")]
    answers = {"Q: 2+2=\nA: ": "4\nQ: 1", "Q: 5*3=\nA: ": "150", "Q: 9-1=\nA: ": "8"}
    assert corpus.arithmetic_accuracy(answers.__getitem__, probs) == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("testbed")
    return out, testbed.build(0, out, budget="tiny", progress=False)


def test_tiny_build_produces_loadable_safetensors_dirs(tiny_build):
    from transformers import AutoTokenizer, LlamaForCausalLM

    out, info = tiny_build
    assert not (out / ".ckpt").exists()
    assert json.loads((out / "build_info.json").read_text()) == json.loads(json.dumps(info))
    assert info["models"]["target"]["parameters"] > 4 * info["models"]["draft"]["parameters"]
    for name in ("target", "draft"):
        d = out / name
        assert (d / "model.safetensors").is_file() and not list(d.glob("*.bin"))
        model = LlamaForCausalLM.from_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d)
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
        assert tok.eos_token == "<|eos|>" and model.config.eos_token_id == tok.eos_token_id
        ids = tok.encode("def f(x):\n    return 12\n", add_special_tokens=False)
        assert tok.decode(ids) == "def f(x):\n    return 12\n"
        with torch.no_grad():
            assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tok))
    assert load.load_tokenizer(out / "tokenizer").get_vocab() == tok.get_vocab()


def test_tiny_build_is_reproducible(tiny_build, tmp_path):
    _, info = tiny_build
    again = testbed.build(0, tmp_path, budget="tiny", progress=False)
    for name in ("target", "draft"):
        assert again["models"][name]["weights_sha256"] == info["models"][name]["weights_sha256"]


def test_eval_prompts_are_deterministic_and_bounded(tiny_build):
    out, _ = tiny_build
    tok = load.load_tokenizer(out / "tokenizer")
    a = corpus.eval_prompts(tok, 8, seed=1, max_prompt_tokens=40)
    assert a == corpus.eval_prompts(tok, 8, seed=1, max_prompt_tokens=40)
    assert len(a) == 8 and all(0 < len(p) <= 40 for p in a)
    texts = [tok.decode(p) for p in a]
    assert all(t.endswith("\n") for t in texts[0::2])  # code cut at a line boundary
    assert all(t.startswith("Q: ") and t.endswith("A: ") for t in texts[1::2])


def _card_table(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] and not set(cells[1]) <= set("-:"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


@pytest.mark.skipif(not (testbed.TESTBED_DIR / "build_info.json").is_file(), reason="no shipped testbed")
def test_shipped_testbed_loads_and_matches_its_card():
    from transformers import AutoTokenizer, LlamaForCausalLM

    info = json.loads((testbed.TESTBED_DIR / "build_info.json").read_text())
    rows = _card_table((testbed.TESTBED_DIR / "MODEL_CARD.md").read_text())
    for label, key, fmt in testbed.CARD_ROWS:
        want = tuple(fmt.format(info["models"][m][key]) if info["models"][m][key] is not None else "n/a"
                     for m in ("target", "draft"))
        assert rows[label] == want, label
    assert f"verinfer testbed build --seed {info['seed']}" in (testbed.TESTBED_DIR / "MODEL_CARD.md").read_text()
    m = info["models"]
    assert m["target"]["heldout_loss"] < m["draft"]["heldout_loss"]
    for d in (testbed.TARGET_DIR, testbed.DRAFT_DIR):
        files = list(d.iterdir())
        assert (d / "model.safetensors").is_file() and not list(d.glob("*.bin"))
        assert all(f.stat().st_size < 30_000_000 for f in files)
        model = LlamaForCausalLM.from_pretrained(d)
        assert sum(p.numel() for p in model.parameters()) == m[d.name]["parameters"]
        assert AutoTokenizer.from_pretrained(d).get_vocab() == load.load_tokenizer(testbed.TOKENIZER_DIR).get_vocab()
