"""Benchmark harness pieces: threshold selection, metrics, the cost model's lean-vs-transformers check."""

import pytest
from rich.console import Console

from benchmarks.kl_judge import ROOT, criteria_table, parser
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import DRAFT_DIR, TOKENIZER_DIR
from benchmarks.kl_judge_bench import GRIDS, accuracy, agreement, cost_model, select_thresholds, summarize
from benchmarks.spec_tasks import arithmetic_task
from verinfer.speculative.decoder import SpecOutput


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
    tok = load_tokenizer(TOKENIZER_DIR)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    problems = [("Q: 1+1=\nA: ", "2"), ("Q: 5*5=\nA: ", "25"), ("Q: 9-3=\nA: ", "6")]
    outs = [SpecOutput([], enc("2\n"), "ab", "stop", target_forwards=1),
            SpecOutput([], enc("250\n"), "aaar", "stop", target_forwards=2),
            SpecOutput([], enc("6"), "t", "length", target_forwards=1)]
    ref = [SpecOutput([], enc("2\n"), "tt", "stop"), SpecOutput([], enc("25\n"), "ttt", "stop"),
           SpecOutput([], enc("7\n"), "tt", "stop")]
    task = arithmetic_task(3, 3)
    assert accuracy(task, problems, outs) == pytest.approx(2 / 3)   # "250" is not "25"
    assert agreement(task, outs, ref) == pytest.approx(1 / 3)
    s = summarize(task, problems, outs, ref)
    assert s["mat"] == pytest.approx((2 + 4 + 1) / 4) and s["tokens"] == 7


def test_cost_model_lean_and_fast_match_transformers():
    c = cost_model({"draft": str(DRAFT_DIR)}, batch_sizes=(2,), ctxs=(8,), n=2)
    r = c["draft_b2_ctx8"]
    assert r["max_abs_logit_diff_T1"] < 1e-4 and r["max_abs_logit_diff_T5"] < 1e-4
    assert r["fast_max_abs_logit_diff_T1"] < 1e-4 and r["fast_max_abs_logit_diff_T5"] < 1e-4
    assert c["draft_params"] == 625_280  # the model card's count (tied embeddings counted once)


def test_fresh_problems_are_unseen_and_splits_are_the_heldout_set():
    import json

    from verinfer.models import corpus
    from verinfer.models.testbed import TESTBED_DIR
    from benchmarks.kl_judge_bench import fresh_problems, operand_class, paired_accuracy_difference

    fresh = fresh_problems(500)
    info = json.loads((TESTBED_DIR / "build_info.json").read_text())
    seen = {q for q, _ in corpus.heldout_problems()} | {
        q for q, _ in corpus.train_problems(info["corpus"]["train_problems"], info["seed"])}
    qs = [q for q, _ in fresh]
    assert len(set(qs)) == 500 and not set(qs) & seen
    assert fresh_problems(200) == fresh[:200]
    assert "11+" not in {operand_class(q) for q in qs}   # every 1-digit + 1-digit question is seen
    assert operand_class("Q: 7*245=\nA: ") == "13*" and operand_class("Q: 13-5=\nA: ") == "12-"
    t = arithmetic_task(300, 700)
    val, test = t.val, t.test
    held = corpus.heldout_problems()
    assert val == held[:300] and test == held[300:1000]
    with pytest.raises(ValueError, match="held-out set"):
        arithmetic_task(400, 700)
    d = paired_accuracy_difference([1, 2, 3, 4], [1, 5], 100)   # 3 only-first, 1 only-second
    assert d["difference_points"] == pytest.approx(2.0) and (d["only_first"], d["only_second"]) == (3, 1)
    se = ((4 / 100 - 0.02 ** 2) / 100) ** 0.5
    assert d["ci95_points"] == pytest.approx([100 * (0.02 - 1.96 * se), 100 * (0.02 + 1.96 * se)])


def test_kl_judge_writes_into_runs_by_default_and_ends_with_a_table():
    """`python -m benchmarks.kl_judge` wrote into the committed benchmarks/results/ by default and
    ended by printing a raw dict: it defaults to runs/kl_judge and prints the criteria as a table."""
    assert parser().parse_args([]).out == ROOT / "runs" / "kl_judge"
    assert parser().parse_args(["--out", "benchmarks/results"]).out.parts[-1] == "results"
    c = {"threshold": 0.01, "mat_ratio": 1.0269240452002868, "mat_ge_1.5x": False,
         "accuracy_difference_vanilla_minus_kl": {"difference_points": 0.0, "ci95_points": [-0.5, 0.25]}}
    con = Console(width=120, record=True)
    con.print(criteria_table(c))
    text = con.export_text()
    assert "{" not in text and "criterion" in text
    assert "mat_ratio" in text and "1.027" in text and "mat_ge_1.5x" in text and " no " in text
    assert "accuracy_difference_vanilla_minus_kl.ci95_points" in text and "[-0.5, 0.25]" in text


def test_point_cache_shards_split_the_runs_and_share_the_results(tmp_path):
    import subprocess
    import sys
    import threading
    import time

    from benchmarks.kl_judge_bench import PointCache

    calls: dict[int, list[int]] = {0: [], 1: []}

    def items(s):
        def compute(j):
            time.sleep(0.02)
            calls[s].append(j)
            return {"v": j}
        return [(f"key:{j}", lambda j=j: compute(j)) for j in range(6)]

    out: dict[int, list] = {}

    def go(s):
        out[s] = PointCache(tmp_path, (s, 2), poll_s=0.01, log=lambda m: None).get_many(items(s))

    threads = [threading.Thread(target=go, args=(s,)) for s in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert out[0] == out[1] == [{"v": j} for j in range(6)]
    assert sorted(calls[0] + calls[1]) == list(range(6))   # each run exactly once, by whichever claimed it
    assert not list(tmp_path.glob("*.lock"))                # locks released
    again = PointCache(tmp_path, (0, 1)).get_many([(f"key:{j}", lambda: 1 / 0) for j in range(6)])
    assert again == out[0]                                  # a re-run computes nothing
    # a lock left by a process that is gone is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cache = PointCache(tmp_path, (0, 2), poll_s=0.01, log=lambda m: None)
    cache.path("orphan").with_suffix(".lock").write_text(str(dead.pid))
    assert cache.get_many([("orphan", lambda: 7)]) == [7]
    # owners and wait=False: shard 1 computes what it owns and returns at once
    got = PointCache(tmp_path, (1, 2)).get_many([("new:a", lambda: 1), ("new:b", lambda: 2)], owners=[0, 1], wait=False)
    assert got == [None, 2]
    with pytest.raises(ValueError, match="I/N"):
        PointCache(tmp_path, (2, 2))


def test_fr_spec_method_is_standard_verification_with_the_counted_head(tmp_path):
    """The harness's 'fr_spec' point: standard verification, the draft head cut to the N most frequent
    tokens of the counts beside the draft; greedy, its lines are target-only decoding's."""
    import torch

    from benchmarks.kl_judge_bench import LABELS, NEXTLINE_GRIDS, Method, method_for
    from verinfer.models.draft import save_counts, token_counts
    from verinfer.models.llama import LlamaLM
    from verinfer.models.testbed import TARGET_DIR

    tok = load_tokenizer(TOKENIZER_DIR)
    texts = ["import os\nimport ", "    def __init__(self", "Q: 12+30=\nA: "]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    target, draft = LlamaLM.from_pretrained(TARGET_DIR), LlamaLM.from_pretrained(DRAFT_DIR)
    ref = Method("target_only", None).run(target, draft, prompts, 12, (), 3)
    stream = torch.tensor([t for p in prompts for t in p] + [t for o in ref for t in o.output_token_ids])
    save_counts(tmp_path, token_counts(stream, target.config.vocab_size))
    m = method_for("vanilla_fr@4", "fr_spec", 16, 4, None, tmp_path)
    assert m.rule.name == "standard" and len(m.draft_vocab) == 16
    assert set(m.draft_vocab.tolist()) <= set(stream.tolist())
    outs = m.run(target, draft, prompts, 12, (), 3)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    assert LABELS["fr_spec"] == "vanilla_fr" and NEXTLINE_GRIDS["fr_spec"] == [16384]
    # the time breakdown counts the cut-head copy of the draft as the draft, not as loop time
    from benchmarks.kl_judge_bench import time_breakdown

    for meth in (m, method_for("vanilla@4", "standard", 0.0, 4)):
        b = time_breakdown(meth, target, draft, prompts, 12, (), 3)
        assert b["draft_steps_ms"] > 0 and b["draft_prefill_ms"] > 0 and b["target_steps_ms"] > 0
        assert b["loop_ms"] < b["total_ms"] - b["draft_steps_ms"] - b["target_prefill_ms"]
    assert LlamaLM.forward.__name__ == "forward"  # the class's own forward is back
    with pytest.raises(ValueError, match="draft's directory"):
        method_for("vanilla_fr@4", "fr_spec", 16, 4)


def test_paired_score_difference_is_mcnemars_on_right_wrong_scores_and_exact_on_shares():
    from benchmarks.kl_judge_bench import paired_accuracy_difference, paired_rows, paired_score_difference

    a = paired_accuracy_difference([1, 2, 3, 4], [1, 5], 100)
    b = paired_score_difference([float(i in (1, 2, 3, 4)) for i in range(100)], [float(i in (1, 5)) for i in range(100)])
    assert a == b
    # shares of lines: differences 0.5, -0.25, 0, 0.25 -> mean 0.125, var = mean(d^2) - mean^2
    d = paired_score_difference([1.0, 0.25, 0.5, 0.75], [0.5, 0.5, 0.5, 0.5])
    var = (0.25 + 0.0625 + 0 + 0.0625) / 4 - 0.125 ** 2
    assert d["difference_points"] == pytest.approx(12.5) and (d["only_first"], d["only_second"]) == (2, 1)
    assert d["ci95_points"] == pytest.approx([100 * (0.125 - 1.96 * (var / 4) ** 0.5), 100 * (0.125 + 1.96 * (var / 4) ** 0.5)])
    assert paired_rows({"scores": [1.0, 0.25, 0.5, 0.75], "correct_idx": []}, {"scores": [0.5] * 4}, 4) == d
    with pytest.raises(ValueError, match="same problems"):
        paired_score_difference([1.0], [1.0, 0.0])


def test_head_methods_and_criteria():
    """'head_<rule>' points run the rule with the feature-level head (greedy standard == target-only);
    head_criteria reads the decode-heavy task's keys from one run's methods, timing and lossless check."""
    from benchmarks.kl_judge_bench import LABELS, MULTILINE_GRIDS, Method, head_criteria, method_for
    from verinfer.models.llama import LlamaLM
    from verinfer.models.testbed import TARGET_DIR
    from verinfer.speculative import feature_head as fh

    tok = load_tokenizer(TOKENIZER_DIR)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["import os\nimport ", "Q: 12+30=\nA: "]]
    target = LlamaLM.from_pretrained(TARGET_DIR)
    head = fh.FeatureHead(fh.head_config(target.config), {**fh.trainable(fh.head_weights(target, 0)),
                                                          **{k: target.w[k] for k in fh.SHARED}})
    ref = Method("target_only", None).run(target, None, prompts, 10, (), 2)
    m = method_for("sd_head@4", "head_standard", 0.0, 4, head=head)
    assert m.drafter is head and m.rule.name == "standard"
    assert [o.output_token_ids for o in m.run(target, None, prompts, 10, (), 2)] == [o.output_token_ids for o in ref]
    assert method_for("kl_head@4", "head_kl", 0.5, 4, head=head).rule.threshold == 0.5
    with pytest.raises(ValueError, match="feature-level draft head"):
        method_for("kl_head@4", "head_kl", 0.5, 4)
    assert {LABELS[k] for k in MULTILINE_GRIDS} >= {"sd_head", "kl_head", "vanilla", "ngram", "sd_head_fr"}
    rows = {("head_kl", 2.0, 4): {"scores": [1.0, 0.5, 0.0, 1.0]}}
    res = {"target_only_test": {"accuracy": 0.625, "problems": 4, "scores": [1.0, 0.5, 0.5, 1.0]},
           "lossless": {"sd_head": {"p_value": 0.4}},
           "timing": {"b1": {"fastest": {"sd_head": "sd_head@4", "kl_head": "kl_head@4"},
                             "configs": {"target_only": {"tokens_per_s": 10.0, "tokens_per_s_repeats": [10.0, 10.0, 10.0]},
                                         "sd_head@4": {"tokens_per_s": 15.0, "tokens_per_s_repeats": [14.0, 15.0, 16.0]},
                                         "kl_head@4": {"tokens_per_s": 18.0, "tokens_per_s_repeats": [18.0, 18.0, 18.0]}}}}}
    methods = {"sd_head": {"mat": 2.0}, "kl_head": {"mat": 2.4, "threshold": 2.0, "agreement": 0.9}}
    c = head_criteria(res, methods, rows, 4)
    # the smaller of the ratio of medians (18 / 15) and the paired median (median of 18/14, 18/15, 18/16)
    assert c["sd_head_vs_target_b1"] == pytest.approx(1.5) and c["kl_head_vs_sd_head_b1"] == pytest.approx(1.2)
    assert c["kl_accuracy_drop_points"] == pytest.approx(12.5) and c["sd_head_chi2_p"] == 0.4
    assert c["target_accuracy"] == 0.625 and c["passes"]["sd_head_vs_target_b1 >= 1.3"]
    assert not c["passes"]["kl_accuracy_drop_points <= 1"]
    # standard with the head = SD_HEAD_METHOD (its FR-Spec rows), fixed before the run, whichever is
    # faster in it (no pick of the faster of two noisy numbers); both chi-squares must pass
    res["timing"]["b1"]["fastest"]["sd_head_fr"] = "sd_head_fr@4"
    res["timing"]["b1"]["configs"]["sd_head_fr@4"] = {"tokens_per_s": 12.0, "tokens_per_s_repeats": [12.0, 12.0, 12.0]}
    res["lossless"]["sd_head_fr"] = {"p_value": 0.01}
    methods["sd_head_fr"] = {"mat": 1.9}
    c = head_criteria(res, methods, rows, 4)
    assert c["sd_head_method"] == "sd_head_fr" and c["sd_head_vs_target_b1"] == pytest.approx(1.2)
    assert c["sd_head_full_vs_target_b1"] == pytest.approx(1.5) and c["sd_head_mat"] == 1.9
    res["timing"]["b1"]["configs"]["sd_head_fr@4"] = {"tokens_per_s": 16.0, "tokens_per_s_repeats": [16.0, 16.0, 16.0]}
    c = head_criteria(res, methods, rows, 4)
    assert c["kl_head_vs_sd_head_b1"] == pytest.approx(18 / 16) and c["sd_head_chi2_p"] == 0.01
