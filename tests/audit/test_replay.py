import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verinfer.audit import replay as replay_mod
from verinfer.providers.simulated import ProviderConfig, run_provider
from verinfer.audit.replay import score_claims
from verinfer.scores import read_scores
from verinfer.engine.engine import Engine
from verinfer.errors import VerinferError
from verinfer.models.load import load_model
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams

FP32 = Numerics(dtype="fp32")
SPEC = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=0, max_tokens=16)


def _prompts(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 97, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def verifier(tiny_llama_dir):
    return Engine(load_model(tiny_llama_dir, FP32), FP32)


@pytest.mark.slow
def test_honest_fp32_provider_replays_exactly(tiny_llama_dir, verifier, tmp_path):
    cfg = ProviderConfig("same", FP32, batch_size=1)
    claims = run_provider(cfg, tiny_llama_dir, _prompts(6), SPEC)
    t = score_claims(claims, verifier, tmp_path / "s.parquet").table()
    assert t.num_rows == 6 * 16
    assert np.all(t["exact_match"].to_numpy(zero_copy_only=False))
    assert np.allclose(t["margin"].to_numpy(), 0.0)
    assert np.all(np.isfinite(t["cross_entropy"].to_numpy()))


def test_wrong_seed_and_int4_diverge(tiny_llama_dir, verifier, tmp_path):
    honest = score_claims(run_provider(ProviderConfig("h", FP32, batch_size=3), tiny_llama_dir, _prompts(8), SPEC),
                          verifier, tmp_path / "h.parquet").table()
    wrong = score_claims(run_provider(ProviderConfig("w", FP32, seed_offset=1, honest=False), tiny_llama_dir,
                                      _prompts(8), SPEC), verifier, tmp_path / "w.parquet").table()
    em = lambda t: t["exact_match"].to_numpy(zero_copy_only=False).mean()  # noqa: E731
    assert em(honest) > 0.95 and em(wrong) < 0.8
    assert np.mean(np.minimum(wrong["margin"].to_numpy(), 10)) > np.mean(honest["margin"].to_numpy())


def test_resume_skips_finished_parts_and_output_is_atomic(tiny_llama_dir, verifier, tmp_path, monkeypatch):
    claims = run_provider(ProviderConfig("h", FP32, batch_size=4), tiny_llama_dir, _prompts(8), SPEC)
    out = tmp_path / "s.parquet"
    calls = {"n": 0}
    real = replay_mod.scores_table

    def dying(c, r, sigma, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        return real(c, r, sigma, **kw)

    monkeypatch.setattr(replay_mod, "scores_table", dying)
    with pytest.raises(KeyboardInterrupt):
        score_claims(claims, verifier, out, chunk_claims=4)
    assert not out.exists()  # nothing half-written
    assert len(list(out.with_name(out.name + ".parts").glob("part-*.parquet"))) == 1
    calls["n"] = 10  # the rerun must only compute the missing chunk
    full = score_claims(claims, verifier, out, chunk_claims=4).table()
    assert calls["n"] == 11 and full.num_rows == 8 * 16
    assert pq.read_table(out).equals(full)


def test_truncated_parquet_is_a_clear_error(tmp_path, tiny_llama_dir, verifier):
    claims = run_provider(ProviderConfig("h", FP32), tiny_llama_dir, _prompts(2), SPEC)
    out = tmp_path / "s.parquet"
    score_claims(claims, verifier, out)
    out.write_bytes(out.read_bytes()[:200])
    with pytest.raises(VerinferError, match="truncated or not Parquet"):
        read_scores(out)


@pytest.mark.slow
def test_fp32_matmul_verifier_reproduces_a_bf16_provider_like_the_native_one(tiny_llama_dir, tmp_path):
    """The faster verifier (bf16 operands, fp32 GEMMs, bf16 outputs) replays an honest bf16
    provider about as exactly as the native bf16 verifier, and still separates a wrong seed."""
    bf16 = Numerics(dtype="bf16")
    claims = run_provider(ProviderConfig("h", bf16, batch_size=4), tiny_llama_dir, _prompts(16), SPEC)
    wrong = run_provider(ProviderConfig("w", bf16, batch_size=4, seed_offset=1), tiny_llama_dir, _prompts(16), SPEC)
    match = {}
    for mm in ("native", "fp32"):
        v = Engine(load_model(tiny_llama_dir, bf16.with_(matmul=mm)), bf16.with_(matmul=mm))
        match[mm] = float(np.mean(score_claims(claims, v, tmp_path / f"{mm}.parquet").table()["exact_match"].to_numpy()))
        assert np.mean(score_claims(wrong, v, tmp_path / f"w{mm}.parquet").table()["exact_match"].to_numpy()) < 0.8
    assert match["fp32"] >= 0.97 and abs(match["fp32"] - match["native"]) <= 0.02, match


def test_streamed_claims_and_small_batches_score_the_same(tiny_llama_dir, verifier, tmp_path, monkeypatch):
    """A stream of claims (read chunk by chunk) scored one small device batch at a time gives the
    same Parquet as the whole list scored in large batches."""
    claims = run_provider(ProviderConfig("h", FP32, batch_size=4), tiny_llama_dir, _prompts(10), SPEC)
    whole = score_claims(claims, verifier, tmp_path / "a.parquet").table()
    monkeypatch.setattr(replay_mod, "LOGITS_BUDGET", 20 * verifier.model.config.vocab_size)  # <= 20 rows a batch
    r = score_claims(iter(claims), verifier, tmp_path / "b.parquet", chunk_claims=3)
    assert (r.claims, r.tokens) == (10, sum(len(c.output_token_ids) for c in claims))
    got = r.table()
    # cross-entropy's log-normalizer is summed over the top-k block, or over the whole vocabulary
    # when a row of the batch has a tie run past the block (sampling.gap.topk_block): which one a
    # row gets depends on its batch, so it may move in the last bits; everything else is bitwise
    for c in whole.column_names:
        if c != "cross_entropy":
            assert got[c].equals(whole[c]), c
    np.testing.assert_allclose(got["cross_entropy"].to_numpy(), whole["cross_entropy"].to_numpy(), rtol=1e-6)


def test_a_grown_claims_file_replays_only_its_new_claims(tiny_llama_dir, verifier, tmp_path, monkeypatch):
    """growing=True: a sequential audit scores its claims file as it grows (StreamRows). Each call
    replays only the claims no finished part holds (parts are named by their claims, `part_key`)
    and returns the rows it had not returned; the final call (growing=False) replays nothing and
    writes every claim once, in order, bitwise the rows the parts gave; a part whose claims changed
    is replayed again, with every part after it."""
    from verinfer.audit.replay import StreamRows

    claims = run_provider(ProviderConfig("h", FP32, batch_size=4), tiny_llama_dir, _prompts(10), SPEC)
    real, replayed = replay_mod.score_chunk, []

    def counting(chunk, *a, **kw):
        replayed.append([c.id for c in chunk])
        return real(chunk, *a, **kw)

    monkeypatch.setattr(replay_mod, "score_chunk", counting)
    out = tmp_path / "s.parquet"
    rows = StreamRows(lambda cs: score_claims(cs, verifier, out, chunk_claims=3, growing=True))
    first = rows(claims[:5])
    assert replayed == [[c.id for c in claims[:3]], [c.id for c in claims[3:5]]] and not out.exists()
    second = rows(claims[:10])
    assert replayed[2:] == [[c.id for c in claims[5:8]], [c.id for c in claims[8:10]]]
    assert rows(claims[:10]) is None and len(replayed) == 4  # nothing new: nothing replayed, no rows
    final = score_claims(claims[:10], verifier, out, chunk_claims=3)
    assert len(replayed) == 4 and final.claims == 10
    t = final.table()
    assert t.equals(pa.concat_tables([first, second]))
    assert t["claim_id"].unique().to_pylist() == [c.id for c in claims]
    assert not out.with_name(out.name + ".parts").exists()  # written: the parts are removed
    score_claims(claims[:5], verifier, out, chunk_claims=3, growing=True)
    changed = claims[:4] + [claims[5]] + claims[5:10]
    score_claims(changed, verifier, out, chunk_claims=3)
    # part [0:3] kept; the part at [3:5] now holds other claims: it and every later one replayed
    assert replayed[6:] == [[c.id for c in changed[3:5]], [c.id for c in changed[5:8]], [c.id for c in changed[8:11]]]
