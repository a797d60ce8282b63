"""Shared fixtures: a tiny random Llama checkpoint (GQA) saved with save_pretrained."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharpen the random model a little so greedy decoding is not all ties
        model.lm_head.weight.mul_(8.0)
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d, safe_serialization=True)
    return d


# The slow tier: tests over ~10 s (measured on the 2-core CI machine, `pytest --durations=0`).
# The fast tier `pytest -m "not slow"` leaves them out; the full suite (what .ci/run runs) keeps
# them. Kept here by file and name prefix, one list, rather than as decorators spread over files.
SLOW = (
    "tests/determinism/test_scheduler.py::test_continuous_batching_bf16_matches_engine_generate_token_counts",
    "tests/determinism/test_scheduler.py::test_best_equals_the_reference_without_verifying",
    "tests/determinism/test_scheduler.py::test_llm42_and_gated_llm42_at_infinite_tau_are_exact",
    "tests/determinism/test_scheduler.py::test_server_deterministic_best_gives_the_reference_tokens",
    "tests/determinism/test_invariant.py::test_prefill_and_decode_bitwise_equal_for_batch_sizes_1_to_32",
    "tests/determinism/test_invariant.py::test_other_cobatched_requests_do_not_change_bits",
    "tests/audit/test_replay.py::test_fp32_matmul_verifier_reproduces_a_bf16_provider_like_the_native_one",
    "tests/audit/test_replay.py::test_honest_fp32_provider_replays_exactly",
    "tests/audit/test_references.py::test_decode_replay_reproduces_a_batch_one_provider_bit_for_bit",
    # the remote reference's comparison with local replay: 24 claims generated, replayed and served
    "tests/audit/test_remote_reference.py::test_remote_scores_equal_local_replay",
    "tests/audit/test_remote_reference.py::test_retries_then_resumes_without_refetching",
    "tests/audit/test_remote_reference.py::test_cli_reports_exact_and_approximate_rows",
    "tests/server/test_audit_api.py::",
    "tests/server/test_concurrency.py::test_concurrent_clients_equal_sequential",
    "tests/speculative/test_decoder.py::test_standard_speculative_sampling_is_lossless",
    # every honest provider on 24 prompts x 64 tokens (honest-bf16-b1 and -eager-t1 decode one claim at a time)
    "tests/providers/test_honest_variation.py::",
    # the real model (skipped where it is not cached): transformers' GGUF load alone takes ~17 s
    "tests/models/test_smollm2.py::test_weights_are_the_gguf_weights_rounded_to_bf16",
    "tests/models/test_smollm2.py::test_llamalm_logits_match_transformers_gguf_model_fp32",
    "tests/models/test_smollm2.py::test_cli_generates_and_scores_by_name_and_alias",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
