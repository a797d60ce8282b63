import numpy as np
import pyarrow as pa
import pytest
import torch

from verinfer.audit.references import REFERENCES, decode_replay, envelope, envelope_table, replay
from verinfer.engine.engine import Engine, Request
from verinfer.models.load import load_model
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams


def test_envelope_is_the_elementwise_min_and_keeps_nan():
    a = np.array([[0.3, -0.1], [np.inf, np.nan], [-0.2, 0.05]])
    b = np.array([[-0.01, 0.2], [0.5, np.nan], [-0.3, np.inf]])
    e = envelope([a, b])
    np.testing.assert_array_equal(e[[0, 2]], [[-0.01, -0.1], [-0.3, 0.05]])
    assert e[1, 0] == 0.5 and np.isnan(e[1, 1])
    with pytest.raises(ValueError, match="shapes"):
        envelope([a, b[:2]])
    with pytest.raises(ValueError, match="no reference"):
        envelope([])


def test_envelope_table_checks_rows_line_up():
    t1 = pa.table({"claim_id": ["a", "a", "b"], "position": [0, 1, 0], "gap_0": [0.1, -0.2, np.inf]})
    t2 = pa.table({"claim_id": ["a", "a", "b"], "position": [0, 1, 0], "gap_0": [-0.05, 0.3, 0.4]})
    np.testing.assert_array_equal(envelope_table([t1, t2], ["gap_0"])["gap_0"], [-0.05, -0.2, 0.4])
    t3 = pa.table({"claim_id": ["a", "b", "a"], "position": [0, 0, 1], "gap_0": [0.0, 0.0, 0.0]})
    with pytest.raises(ValueError, match="claim_id"):
        envelope_table([t1, t3], ["gap_0"])


@pytest.mark.slow
def test_decode_replay_reproduces_a_batch_one_provider_bit_for_bit(tiny_llama_dir):
    numerics = Numerics(dtype="bf16")
    engine = Engine(load_model(tiny_llama_dir, numerics), numerics, eos_token_id=None)
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=5, max_tokens=12, noise="vllm-cpu")
    reqs = [Request(f"r{i}", [1, 5 + i, 9, 13 + 2 * i], p) for i in range(3)]
    done = []
    for r in reqs:     # a provider decoding one request at a time, recording each step's logits
        b = engine.prefill([r])
        rows = []
        while not b.finished:
            rows.append(b.logits_BV[0].float().clone())
            engine.decode_step(b)
        done.append((r, b.outputs[0], torch.stack(rows)))

    class C:  # the claim fields decode_replay reads
        def __init__(self, r, out):
            self.id, self.prompt_token_ids, self.sampling = r.id, r.prompt_token_ids, r.params
            self.output_token_ids = out

    claims = [C(r, out) for r, out, _ in done]
    for (_, out, rows), rep in zip(done, decode_replay(engine, claims)):
        assert rep.logits_TV.shape == (len(out), engine.vocab_size)
        assert torch.equal(rep.logits_TV, rows)
    assert REFERENCES["bf16-decode"].decode and not REFERENCES["bf16"].decode
    # the teacher-forced path returns the same shapes
    for rep, c in zip(replay(REFERENCES["bf16"], engine, claims), claims):
        assert rep.logits_TV.shape == (len(c.output_token_ids), engine.vocab_size)


def test_batched_decode_replay_reproduces_a_batched_provider(tiny_llama_dir):
    numerics = Numerics(dtype="bf16")
    engine = Engine(load_model(tiny_llama_dir, numerics), numerics, eos_token_id=None)
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=5 + i, max_tokens=m, noise="vllm-cpu")
              for i, m in enumerate((12, 9, 5))]
    reqs = [Request(f"r{i}", [1, 5 + i, 9, 13 + 2 * i][: 2 + i], p) for i, p in enumerate(params)]
    order = np.random.default_rng(3).permutation(3)

    class C:
        def __init__(self, r, out):
            self.id, self.prompt_token_ids, self.sampling = r.id, r.prompt_token_ids, r.params
            self.output_token_ids = out

    # the provider decodes the three requests as one padded batch, in the replay's group order
    b = engine.prefill([reqs[i] for i in order])
    rows = {int(i): [] for i in order}
    while not b.finished:
        for j, i in enumerate(order):
            if not b.done_B[j]:
                rows[int(i)].append(b.logits_BV[j].float().clone())
        engine.decode_step(b)
    claims = [None] * 3
    for j, i in enumerate(order):
        claims[int(i)] = C(reqs[int(i)], b.outputs[j])
    reps = decode_replay(engine, claims, batch=3, group_seed=3)
    for i, rep in enumerate(reps):
        assert rep.logits_TV.shape[0] == len(claims[i].output_token_ids) == reqs[i].params.max_tokens
        assert torch.equal(rep.logits_TV, torch.stack(rows[i]))
