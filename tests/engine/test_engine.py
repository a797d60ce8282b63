import pytest
import torch

from verinfer.engine.engine import Engine, Request
from verinfer.models.load import load_model
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams

FP32 = Numerics(dtype="fp32")


def _prompts(n, seed=0, lo=3, hi=14):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _engine(d, numerics=FP32):
    return Engine(load_model(d, numerics), numerics, eos_token_id=None)


def test_greedy_fp32_equals_transformers_generate(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    eng = _engine(tiny_llama_dir)
    prompts = _prompts(5, seed=1)
    reqs = [Request(str(i), p, SamplingParams(temperature=0.0, max_tokens=20)) for i, p in enumerate(prompts)]
    got = eng.generate(reqs, batch_size=3)
    for p, c in zip(prompts, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=20)[0, len(p):].tolist()
        assert c.output_token_ids == ref


@pytest.mark.parametrize("numerics,tol", [(FP32, 1e-4), (Numerics(dtype="bf16"), 0.1)])
def test_batched_equals_one_at_a_time(tiny_llama_dir, numerics, tol):
    eng = _engine(tiny_llama_dir, numerics)
    prompts = _prompts(6, seed=2)
    reqs = [Request(str(i), p, SamplingParams(temperature=0.0, max_tokens=8)) for i, p in enumerate(prompts)]
    batch = eng.prefill(reqs)
    singles = [eng.prefill([r]) for r in reqs]
    for b, s in enumerate(singles):
        assert (batch.logits_BV[b] - s.logits_BV[0]).abs().max() < tol
    # and the whole greedy decode, token by token
    for _ in range(7):
        eng.decode_step(batch)
        for s in singles:
            eng.decode_step(s)
        for b, s in enumerate(singles):
            assert (batch.logits_BV[b] - s.logits_BV[0]).abs().max() < tol
    if numerics.dtype == "fp32":
        assert [batch.outputs[b] for b in range(6)] == [s.outputs[0] for s in singles]


def test_seeded_sampling_independent_of_batch_neighbours(tiny_llama_dir):
    eng = _engine(tiny_llama_dir)
    prompts = _prompts(4, seed=3)
    mk = lambda i, p: Request(str(i), p, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=100 + i, max_tokens=12))
    together = eng.generate([mk(i, p) for i, p in enumerate(prompts)], batch_size=4)
    alone = [eng.generate([mk(i, p)], batch_size=1)[0] for i, p in enumerate(prompts)]
    assert [c.output_token_ids for c in together] == [c.output_token_ids for c in alone]


def test_score_replays_the_decode_logits(tiny_llama_dir):
    eng = _engine(tiny_llama_dir)
    prompts = _prompts(5, seed=4)
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, seed=i, max_tokens=10)) for i, p in enumerate(prompts)]
    batch = eng.prefill(reqs)
    step_logits = []
    while not batch.finished:
        step_logits.append(batch.logits_BV.clone())
        eng.decode_step(batch)
    replays = eng.replay([(r.prompt_token_ids, batch.outputs[b]) for b, r in enumerate(reqs)], batch_tokens=40)
    for b, rp in enumerate(replays):
        assert rp.logits_TV.shape == (10, 97)
        ref = torch.stack([s[b] for s in step_logits])
        assert torch.allclose(rp.logits_TV, ref, atol=1e-4)


def test_score_hidden_states_and_rollback(tiny_llama_dir):
    eng = _engine(tiny_llama_dir)
    p, o = _prompts(1, seed=5)[0], [5, 6, 7, 8]
    rp = eng.replay([(p, o)], hidden_layer=-1)[0]
    assert rp.hidden_TD.shape == (4, 64)
    # rollback + re-extend reproduces the same logits (speculative decoding relies on this)
    batch = eng.prefill([Request("a", p, SamplingParams(temperature=0.0, max_tokens=8))])
    l1, _ = eng.extend(batch, torch.tensor([[5, 6, 7]]))
    eng.rollback(batch, torch.tensor([2]))
    l2, _ = eng.extend(batch, torch.tensor([[6, 7]]))
    assert torch.allclose(l1[:, 1:], l2, atol=1e-5)
    # KV column read / overwrite round trip
    k, v = batch.cache.read_column(0, 0, len(p))
    batch.cache.write_column(0, 0, len(p), k * 0, v * 0)
    assert batch.cache.read_column(0, 0, len(p))[0].abs().sum() == 0


def test_prompt_over_context_is_refused(tiny_llama_dir):
    eng = _engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="context"):
        eng.prefill([Request("x", [3] * 120, SamplingParams(temperature=0.0, max_tokens=20))])


def test_unseeded_params_are_refused_at_the_entry(tiny_llama_dir):
    """A sampled generation draws noise from a seed; unseeded is an audit mode of received claims.
    generate (before any batch is run) and prefill name the request and say what to do."""
    from verinfer.errors import VerinferError

    eng = _engine(tiny_llama_dir)
    ok = Request("ok", [3, 4, 5], SamplingParams(temperature=1.0, seed=1, max_tokens=2))
    bad = Request("r7", [3, 4, 5], SamplingParams(temperature=1.0, seed=None, max_tokens=2, unseeded=True))
    calls = []
    for call in (lambda: eng.generate([ok, bad], batch_size=1, progress=calls.append), lambda: eng.prefill([bad])):
        with pytest.raises(VerinferError) as e:
            call()
        msg = e.value.message
        assert "request 'r7'" in msg and "unseeded" in msg and "seed" in e.value.fix, msg
    assert calls == []  # refused before the first batch


def test_nan_logits_are_a_clear_error(tiny_llama_dir):
    from verinfer.errors import NumericsError

    eng = _engine(tiny_llama_dir)
    eng.model.w["layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    with pytest.raises(NumericsError, match="replay of claim #0"):
        eng.replay([([3, 4, 5], [6, 7])])
    with pytest.raises(NumericsError, match="prefill logits"):
        eng.prefill([Request("r", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=2))])


@pytest.mark.parametrize("layer", [-1, 1])
def test_generate_records_the_hidden_states_score_replays(tiny_llama_dir, layer):
    """Hidden row t of a generation is the state that produced output token t: the same row
    teacher-forced `score` returns (fp32: equal up to float reordering)."""
    eng = _engine(tiny_llama_dir)
    prompts = _prompts(4, seed=3)
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, seed=i, max_tokens=7)) for i, p in enumerate(prompts)]
    got = eng.generate(reqs, batch_size=3, hidden_layer=layer)
    reps = eng.replay([(c.prompt_token_ids, c.output_token_ids) for c in got], hidden_layer=layer)
    for c, r in zip(got, reps):
        assert c.hidden_TD.shape == r.hidden_TD.shape == (7, eng.model.config.hidden_size)
        torch.testing.assert_close(c.hidden_TD, r.hidden_TD, atol=1e-4, rtol=1e-4)
    assert eng.generate(reqs[:1])[0].hidden_TD is None


@pytest.mark.parametrize("lean", [False, True])
def test_prefill_extend_is_prefill_then_extend(tiny_llama_dir, lean):
    """The fused prefill + extend gives the logits of prefill followed by extend (fp32: equal up
    to float reordering), the batch state of both, and the same logits as plain prefill at A=0;
    a chunked prefill returns the same positions."""
    eng = Engine(load_model(tiny_llama_dir, FP32), FP32, lean_prefill=lean)
    prompts = _prompts(4, seed=6)
    reqs = [Request(str(i), p, SamplingParams(temperature=0.0, max_tokens=6)) for i, p in enumerate(prompts)]
    app_BA = torch.tensor([[5, 6, 7]] * 4)
    fused, logits_BTV, hidden_BTD = eng.prefill_extend(reqs, app_BA, hidden_layer=-1)
    plain = eng.prefill(reqs, hidden_layer=-1)
    ext_BTV, ext_hidden = eng.extend(plain, app_BA, hidden_layer=-1)
    assert logits_BTV.shape == (4, 4, 97) and hidden_BTD.shape == (4, 4, 64)
    torch.testing.assert_close(logits_BTV[:, 0], eng.prefill(reqs).logits_BV, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits_BTV[:, 1:], ext_BTV, atol=1e-4, rtol=0)
    torch.testing.assert_close(hidden_BTD[:, 1:], ext_hidden, atol=1e-4, rtol=0)
    assert torch.equal(fused.len_B, plain.len_B) and torch.equal(fused.logits_BV, logits_BTV[:, -1])
    chunked = Engine(eng.model, FP32.with_(prefill_chunk=3), lean_prefill=lean)
    _, chunk_BTV, _ = chunked.prefill_extend(reqs, app_BA)
    torch.testing.assert_close(chunk_BTV, logits_BTV, atol=1e-4, rtol=0)


def test_join_select_rows_keep_every_field(tiny_llama_dir):
    """Continuous batching: rows joined from two prefills and cut back decode exactly as the
    original batches do, hidden states included (the fields a scheduler must not drop)."""
    from verinfer.engine.engine import join, select_rows

    eng = _engine(tiny_llama_dir)
    prompts = _prompts(5, seed=7)
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, seed=i, max_tokens=6)) for i, p in enumerate(prompts)]
    pre = lambda rs: eng.prefill(rs, extra_slots=30 - max(len(r.prompt_token_ids) for r in rs),  # noqa: E731
                                 hidden_layer=-1)  # the same slot count whatever the longest prompt
    a, b, ref = pre(reqs[:2]), pre(reqs[2:]), pre(reqs[2:])
    both = join(a, b)
    assert both.hidden_BD.shape == (5, 64) and len(both.hiddens) == len(both.streams) == 5
    eng.decode_step(both)
    eng.decode_step(ref)
    cut = select_rows(both, [2, 3, 4])
    assert cut.hidden_layer == -1 and [r.id for r in cut.requests] == ["2", "3", "4"]
    for _ in range(3):
        eng.decode_step(cut)
        eng.decode_step(ref)
    assert cut.outputs == ref.outputs
    torch.testing.assert_close(cut.logits_BV, ref.logits_BV, atol=1e-4, rtol=0)
    torch.testing.assert_close(cut.hidden_BD, ref.hidden_BD, atol=1e-4, rtol=0)
    assert [len(h) for h in cut.hiddens] == [4, 4, 4]


def test_recompute_and_rollback_row(tiny_llama_dir):
    """A verifier recomputes a row's last two steps on a private copy of its cache (the batch is
    untouched until commit) and rolls the row back to its first output: the row then decodes as
    a fresh batch fed the same tokens does."""
    eng = _engine(tiny_llama_dir)
    prompts = _prompts(2, seed=8)
    reqs = [Request(str(i), p, SamplingParams(temperature=0.0, max_tokens=5)) for i, p in enumerate(prompts)]
    batch = eng.prefill(reqs, extra_slots=8)
    for _ in range(3):
        eng.decode_step(batch)
    P, outs = len(prompts[1]), list(batch.outputs[1])
    before = batch.cache.k[0].clone()
    tokens_NT = torch.tensor([[prompts[1][-1], outs[0]]])
    logits_NTV, scratch = eng.recompute(batch, [1], tokens_NT, torch.tensor([[P - 1, P]]))
    assert torch.equal(batch.cache.k[0], before)  # private copy
    assert logits_NTV[0].argmax(-1).tolist() == outs[:2]
    scratch.commit(0, P - 1, P + 1)
    eng.rollback_row(batch, 1, 1, logits_NTV[0, 1])
    assert batch.outputs[1] == outs[:1] and int(batch.len_B[1]) == P + 1 and not batch.done_B[1]
    eng.decode_step(batch)
    assert batch.outputs[1] == outs[:2]
