"""benchmarks/real_model.py section `detection` on synthetic score tables (no vLLM, no model):
per-run statistics, AUC@1%FPR curves / tokens to detect with the detection lab's protocol, the
calibrated verdicts and the rendered table."""

import numpy as np
import pyarrow as pa
import pytest

from benchmarks import real_model as rm

GAP_COLUMNS = ("env_gap_s0.01", *(f"env_gapT_{r:g}_s0.01" for r in (0.8, 0.9, 1.1, 1.2)))


def synthetic_table(n: int, flip_scale: float, seed: int, provider: str, ce_shift: float = 0.0) -> pa.Table:
    """Claims of 50 tokens; per token a signed gap d: |d| ~ Exp(1), positive (a token the replay does
    not reproduce, margin d) with probability 0.5 exp(-|d| / flip_scale); every envelope column = d."""
    rng = np.random.default_rng(seed)
    a = rng.exponential(1.0, n)
    d = np.where(rng.random(n) < 0.5 * np.exp(-a / flip_scale), a, -a)
    margin = np.where(d > 0, d, 0.0)
    margin[np.flatnonzero(d > 0)[::10]] = np.inf  # a tenth of the mismatches outside the top-k/top-p set
    cols = {"claim_id": [f"{provider}-{i // 50}" for i in range(n)], "provider": [provider] * n,
            "position": np.arange(n) % 50, "token_id": np.zeros(n, dtype=np.int64), "margin": margin,
            "exact_match": d <= 0, "cross_entropy": rng.exponential(1.0, n) + ce_shift}
    return pa.table({**cols, **{c: d for c in GAP_COLUMNS}})


@pytest.fixture(scope="module")
def summary():
    tables = {f"calib-{r}": synthetic_table(4000, s, i, r) for i, (r, s) in enumerate(zip(rm.CALIB_RUNS, (0.04, 0.05, 0.06)))}
    tables["honest"] = synthetic_table(6000, 0.05, 10, "vllm-honest")
    tables["wrong-seed"] = synthetic_table(6000, 3.0, 11, "vllm-wrong-seed", ce_shift=1.0)   # flips half its tokens
    tables["int4"] = synthetic_table(6000, 0.2, 12, "vllm-int4")
    return rm.detection_summary(tables, seed=0)


def test_run_stats_counts_mismatches_and_infinite_margins():
    d = {"exact_match": np.array([True, True, False, False, True]), "margin": np.array([0, 0, 0.3, np.inf, 0]),
         "cross_entropy": np.array([1.0, 2.0, 3.0, np.inf, 4.0])}
    assert rm.run_stats(d) == {"tokens": 5, "exact_match": 0.6, "mismatch_rate": 0.4, "infinite_margin_rate": 0.2,
                               "infinite_margin_share_of_mismatches": 0.5, "mean_cross_entropy": 2.5}
    assert rm.run_stats({**d, "exact_match": np.ones(5, bool), "margin": np.zeros(5)})[
        "infinite_margin_share_of_mismatches"] is None


def test_detection_summary_statistics_and_tokens_to_detect(summary):
    runs = summary["runs"]
    assert [k for k, v in runs.items() if v["role"] == "calibration"] == [f"calib-{r}" for r in rm.CALIB_RUNS]
    assert runs["honest"]["role"] == "honest, held out" and runs["int4"]["role"] == "misconfigured"
    # flip probability 0.5 E[exp(-a / s)] = 0.5 s / (1 + s): 0.0238 at s = 0.05, 0.3 at s = 3
    assert runs["honest"]["mismatch_rate"] == pytest.approx(0.5 * 0.05 / 1.05, abs=0.005)
    assert runs["wrong-seed"]["mismatch_rate"] == pytest.approx(0.5 * 3 / 4, abs=0.02)
    assert runs["honest"]["infinite_margin_share_of_mismatches"] == pytest.approx(0.1, abs=0.03)
    assert summary["honest_exact_match"] == {"batched": runs["honest"]["exact_match"], "one_at_a_time": None}
    assert summary["honest_pool_tokens"] == {"train": 6000, "test": 6000}
    ttd = summary["tokens_to_detect"]
    assert set(ttd) == set(rm.SCORES)
    # wrong seed (38% of tokens flipped, cross-entropy 1 nat higher): every score within 30 tokens
    assert all(ttd[s]["wrong-seed"] <= 30 for s in rm.SCORES)
    # int4 (flip scale 0.2 vs 0.05: 8% of tokens flipped, by wider margins): the margin needs hundreds of
    # tokens, best (max-z over its alternatives, guarding an unseen honest configuration between 0.04 and
    # 0.06) within 1000, the mismatch rate (blind to the margin) no fewer; cross-entropy carries nothing
    assert 100 <= ttd["margin_clip99.9"]["int4"] <= 1000 and ttd["best"]["int4"] <= 1000
    assert ttd["exact_match"]["int4"] >= ttd["margin_clip99.9"]["int4"] and ttd["cross_entropy"]["int4"] is None
    # the held-out honest run, drawn like the pool, is never detected
    assert all(ttd[s]["honest"] is None for s in rm.SCORES)
    auc = summary["auc_at_1pct_fpr"]["honest"]["best"]
    assert list(auc) == [str(b) for b in rm.DETECT_LADDER] and max(auc.values()) < 0.99


def test_detection_summary_verdicts(summary):
    assert summary["honest_flagged"] is False
    assert summary["honest_flagged_by_detector"] == {d: {"honest": False} for d in rm.DETECTORS}
    assert summary["misconfigured_flagged"] == {"int4": {d: True for d in rm.DETECTORS},
                                                "wrong-seed": {d: True for d in rm.DETECTORS}}
    for d in rm.DETECTORS:
        v = summary["verdicts"][d]
        assert v["calibration_tokens"] == {f"calib-{r}": 4000 for r in rm.CALIB_RUNS}
        assert v["runs"]["honest"]["tokens_to_flag"] is None and v["runs"]["honest"]["n_tokens"] == 6000
        assert v["runs"]["wrong-seed"]["tokens_to_flag"] <= 30
        assert v["runs"]["int4"]["tokens_to_flag"] <= 300
    # int4, fp8-kv, temp-1.1 were not in these tables: that target is not met
    assert summary["targets"] == {"honest_flagged false": True,
                                  "int4, fp8-kv, temp-1.1, wrong-seed flagged by every detector": False}


def test_render_detection_table(summary):
    r = {**summary, "model": "m", "vllm": "0", "command": "python -m benchmarks.real_model detection", "sampling": "T=1",
         "prompts_per_audited_run": 120, "calib_prompts_per_config": 80, "max_tokens": 50, "plot": "real_model_auc.png",
         "runs_vllm_could_not_run_here": {"fp8-kv": "no AVX-512"}, "seconds_shared_machine": {"total": 1.0}}
    text = "\n".join(rm.render_detection(r))
    ttd = summary["tokens_to_detect"]
    assert f"| best (glrt on the envelope) | - | {ttd['best']['int4']} | {ttd['best']['wrong-seed']} |" in text
    assert "| fp8-kv | | vLLM could not run it on this machine: no AVX-512 |" in text
    assert "![AUC@1%FPR vs tokens](real_model_auc.png)" in text
    assert f"batched **{summary['runs']['honest']['exact_match']:.4f}**, one at a time **-**" in text


def test_runs_of_the_section_are_distinct_vllm_engines():
    runs = {r: rm.vllm_run(r) for r in (*rm.CALIB_RUNS, *rm.AUDITED_RUNS)}
    assert (runs["honest-b1"].max_num_seqs, runs["honest-b1"].dtype) == (1, "bfloat16")
    assert (runs["honest-fp32"].name, runs["honest-fp32"].dtype, runs["honest-fp32"].max_num_seqs) == \
        ("honest-fp32", "float32", None)
    keys = {r: v.engine_key for r, v in runs.items()}
    assert len({keys[r] for r in (*rm.CALIB_RUNS, "int4", "fp8-kv")}) == 5  # one LLM each
    assert keys["temp-1.1"] == keys["wrong-seed"] == keys["honest"]        # sampling only: they share it
    assert rm.vllm_run("honest-bf16-b8").name == "honest"                  # other honest names: vLLM's batching


def test_render_vllm_speed_section():
    """The `vllm-speed` section's table: the ratio as computed from the medians and the target's verdict."""
    v = {"model": "smollm2-135m-instruct", "vllm": "0.32", "cpu": "cpu x", "command": "python -m benchmarks.real_model "
         "vllm-speed", "prompts": 64, "max_tokens": 64, "tokens": 4000, "sampling": "T=1", "rounds": 3,
         "vllm_generate_tokens_per_s": 200.0, "vllm_generate_cores": 2.0, "score_tokens_per_s": 600.0,
         "score_cores": 1.9, "replay_tokens_per_s": 700.0, "replay_vs_vllm_generate": 3.0,
         "replay_only_vs_vllm_generate": 3.5, "meets_target": False}
    md = rm.render({"vllm_speed": v})
    assert "replay_vs_vllm_generate = 3.00 (target >= 5: NOT met)" in md and "| 200 | 2.00 |" in md
    assert "met)" in rm.render({"vllm_speed": {**v, "replay_vs_vllm_generate": 6.0, "meets_target": True}})
