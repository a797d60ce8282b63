"""Benchmark harness pieces: threshold selection, metrics, the cost model's lean-vs-transformers check."""

import pytest

from verinfer.models.testbed import DRAFT_DIR, load_tokenizer
from verinfer.speculative.bench import GRIDS, accuracy, agreement, cost_model, select_thresholds, summarize
from verinfer.speculative.loop import SpecOutput


def _row(rule, thr, g, mat, acc):
    return {"rule": rule, "threshold": thr, "gamma": g, "mat": mat, "accuracy": acc}


def test_select_thresholds_max_mat_within_half_a_point():
    sweep = [_row("standard", 0.0, 4, 1.3, 0.050),
             _row("kl", 0.005, 4, 1.3, 0.050), _row("kl", 0.01, 4, 1.6, 0.045), _row("kl", 0.02, 4, 2.5, 0.041),
             _row("kl", 0.05, 4, 3.0, 0.030),
             _row("topk", 2, 4, 1.5, 0.020)]
    best = select_thresholds(sweep, {4: 0.050})
    assert best["standard"] == {4: 0.0}
    assert best["kl"] == {4: 0.01}      # 0.05 loses 2 points, 0.02 loses 0.9; 0.01 loses 0.5 (the margin)
    assert best["topk"] == {}           # nothing qualifies
    assert set(best) == set(GRIDS)


def test_accuracy_agreement_and_mat():
    tok = load_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    problems = [("Q: 1+1=\nA: ", "2"), ("Q: 5*5=\nA: ", "25"), ("Q: 9-3=\nA: ", "6")]
    outs = [SpecOutput([], enc("2\n"), "ab", "stop", target_forwards=1),
            SpecOutput([], enc("250\n"), "aaar", "stop", target_forwards=2),
            SpecOutput([], enc("6"), "t", "length", target_forwards=1)]
    ref = [SpecOutput([], enc("2\n"), "tt", "stop"), SpecOutput([], enc("25\n"), "ttt", "stop"),
           SpecOutput([], enc("7\n"), "tt", "stop")]
    assert accuracy(tok, problems, outs) == pytest.approx(2 / 3)   # "250" is not "25"
    assert agreement(tok, outs, ref) == pytest.approx(1 / 3)
    s = summarize(tok, problems, outs, ref)
    assert s["mat"] == pytest.approx((2 + 4 + 1) / 4) and s["tokens"] == 7


def test_cost_model_lean_and_fast_match_transformers():
    c = cost_model({"draft": str(DRAFT_DIR)}, batch_sizes=(2,), ctxs=(8,), n=2)
    r = c["draft_b2_ctx8"]
    assert r["max_abs_logit_diff_T1"] < 1e-4 and r["max_abs_logit_diff_T5"] < 1e-4
    assert r["fast_max_abs_logit_diff_T1"] < 1e-4 and r["fast_max_abs_logit_diff_T5"] < 1e-4
    assert r["lean_T1_ms"] > 0 and r["hf_T1_ms"] > 0 and r["fast_T5_ms"] > 0
    assert c["draft_params"] == 625_280  # the model card's count (tied embeddings counted once)


def test_fresh_problems_are_unseen_and_splits_disjoint():
    import json

    from verinfer.models import corpus
    from verinfer.models.testbed import TESTBED_DIR
    from verinfer.speculative.bench import fresh_problems, splits

    fresh = fresh_problems(500)
    info = json.loads((TESTBED_DIR / "build_info.json").read_text())
    seen = {q for q, _ in corpus.heldout_problems()} | {
        q for q, _ in corpus.train_problems(info["corpus"]["train_problems"], info["seed"])}
    qs = [q for q, _ in fresh]
    assert len(set(qs)) == 500 and not set(qs) & seen
    assert fresh_problems(200) == fresh[:200]          # a prefix: larger splits extend smaller ones
    for q, a in fresh[:50]:                             # answers are right
        x, op, y = next((q[3:q.index(o, 4)], o, q[q.index(o, 4) + 1:q.index("=")]) for o in "+-*" if o in q[4:])
        assert str(eval(f"{x}{op}{y}")) == a
    val, test = splits(400, 900)
    held = corpus.heldout_problems()
    assert val[:300] == held[:300] and test[:700] == held[300:1000]
    assert len(val) == 400 and len(test) == 900
    # the fresh parts repeat no question of either split (the held-out set itself repeats a few
    # short questions between its validation and test parts: models/corpus.py draws with replacement)
    assert not {q for q, _ in val[300:]} & {q for q, _ in test} and not {q for q, _ in test[700:]} & {q for q, _ in val}
