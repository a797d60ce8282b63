import base64
import json

import numpy as np
import pytest
import torch

from verinfer import fingerprint as fpm
from verinfer.claims import read_claims, write_claims
from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.providers.simulated import ProviderConfig, run_provider
from verinfer.audit.replay import score_claims
from verinfer.scores import divergence
from verinfer.engine.engine import Engine
from verinfer.errors import ClaimError
from verinfer.models.load import load_model
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams

FP32 = Numerics(dtype="fp32")
SPEC = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=0, max_tokens=16)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _slow_projection(D, k, seed):
    """Gram-Schmidt on the same seeded Gaussian columns, one column at a time (float64)."""
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(D, k, generator=g, dtype=torch.float64)
    cols = []
    for j in range(k):
        v = G[:, j].clone()
        for q in cols:
            v -= (q @ G[:, j]) * q  # classical GS: same as QR with positive diag(R)
        cols.append(v / v.norm())
    return torch.stack(cols, 1)


@pytest.mark.parametrize("D,k,seed", [(64, 8, 0), (256, 16, 7), (32, 32, 3)])
def test_projection_matches_slow_reference(D, k, seed):
    P = fpm.projection_matrix(D, k, seed)
    ref = _slow_projection(D, k, seed)
    torch.testing.assert_close(P.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(P.T @ P, torch.eye(k), atol=1e-5, rtol=0)
    h = torch.randn(10, D)
    spec = fpm.FingerprintSpec(k=k, stride=3, seed=seed)
    slow = torch.stack([torch.tensor([float(h[t].double() @ ref[:, j]) for j in range(k)], dtype=torch.float64) for t in (0, 3, 6, 9)])
    torch.testing.assert_close(fpm.project(h, spec).double(), slow, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [("fp16", 2e-3), ("int8", 2e-2)])
def test_encode_parse_round_trip_and_bytes(dtype, tol):
    spec = fpm.FingerprintSpec(k=8, stride=2, dtype=dtype)
    h = torch.randn(7, 64)
    obj = json.loads(json.dumps(fpm.encode(h, spec)))
    fp = fpm.parse_fingerprint(obj, "f.jsonl:1", n_output=7, hidden_size=64)
    assert fp.positions == [0, 2, 4, 6]
    assert len(base64.b64decode(obj["data"])) + len(base64.b64decode(obj.get("scales", ""))) == 4 * spec.bytes_per_vector
    assert spec.bytes_per_token == (8 * 2 if dtype == "fp16" else 8 + 2) / 2
    full = fpm.project(h, spec)
    assert float((fp.fp_NK - full).abs().max() / full.abs().max()) < tol
    assert fpm.l2_distances(fp, h).max() < 1e-6  # same hidden states, same storage precision


def test_spec_parse():
    s = fpm.FingerprintSpec.parse("k=16,stride=4,dtype=int8")
    assert (s.k, s.stride, s.layer, s.dtype) == (16, 4, -1, "int8")
    with pytest.raises(ValueError, match="unknown key"):
        fpm.FingerprintSpec.parse("k=4,strde=2")


def _obj(**over):
    obj = fpm.encode(torch.randn(6, 64), fpm.FingerprintSpec(k=4, stride=2))
    obj.update(over)
    return obj


@pytest.mark.parametrize("over,field", [
    (dict(k=8), "activations.data"),                       # wrong dimension
    (dict(dtype="int8"), "activations.data"),              # wrong dtype (size no longer fits)
    (dict(dtype="bf16"), "activations.dtype"),
    (dict(positions=[0, 2, 9]), "activations.positions"),  # not in the claim
    (dict(hidden_size=128), "activations.hidden_size"),
    (dict(format="x"), "activations.format"),
])
def test_bad_fingerprints_name_line_and_field(over, field):
    with pytest.raises(ClaimError) as e:
        fpm.parse_fingerprint(_obj(**over), "claims.jsonl:3", n_output=6, hidden_size=64)
    assert "claims.jsonl:3" in e.value.message and field in e.value.message


def test_truncated_data_and_seed_mismatch():
    obj = _obj()
    obj["data"] = obj["data"][: len(obj["data"]) // 2]
    with pytest.raises(ClaimError, match="activations.data"):
        fpm.parse_fingerprint(obj, "c.jsonl:1", n_output=6, hidden_size=64)
    with pytest.raises(ClaimError, match="activations.seed"):
        fpm.parse_fingerprint(_obj(seed=5), "c.jsonl:1", n_output=6, hidden_size=64,
                              expect=fpm.FingerprintSpec(k=4, stride=2, seed=0))


def test_score_reports_bad_fingerprint_by_file_line(tiny_llama_dir, tmp_path):
    claims = run_provider(ProviderConfig("p", FP32, batch_size=2), tiny_llama_dir, _prompts(3), SPEC,
                          fingerprint=fpm.FingerprintSpec(k=4, stride=2))
    claims[1].extra["activations"]["seed"] = 99  # does not match the first claim's projection
    write_claims(tmp_path / "c.jsonl", claims)
    eng = Engine(load_model(tiny_llama_dir, FP32), FP32)
    with pytest.raises(ClaimError) as e:
        score_claims(read_claims(tmp_path / "c.jsonl"), eng, tmp_path / "s.parquet")
    assert "c.jsonl:2" in e.value.message and "activations.seed" in e.value.message
    assert not (tmp_path / "s.parquet").exists()


def test_honest_replay_at_another_batch_size_not_flagged_int4_flagged(tiny_llama_dir, tmp_path):
    """Calibrate on an honest bf16 provider at batch size 1; an honest bf16 provider at batch
    size 5 (other padding, other float order) passes; 4-bit weights are flagged."""
    eng = Engine(load_model(tiny_llama_dir, Numerics(dtype="bf16")), Numerics(dtype="bf16"))
    spec = fpm.FingerprintSpec(k=16, stride=1)
    prompts = _prompts(8, seed=1)
    vals, tables = {}, {}
    for cfg in (ProviderConfig("cal", Numerics(dtype="bf16"), batch_size=1),
                ProviderConfig("other-batch", Numerics(dtype="bf16"), batch_size=5),
                ProviderConfig("int4", Numerics(dtype="bf16", weight_bits=4), batch_size=4, honest=False)):
        claims = run_provider(cfg, tiny_llama_dir, prompts, SPEC, fingerprint=spec, base_seed=3)
        t = score_claims(claims, eng, tmp_path / f"{cfg.name}.parquet").table()
        vals[cfg.name] = divergence(t, "fp_l2")
        tables[cfg.name] = t
        assert vals[cfg.name].size > 64  # one distance per output token (stride 1; EOS may end a claim early)
    det = ClippedMeanDetector(score_name="fp_l2", clip_quantile=0.999, target_fpr=0.01).fit(tables["cal"])
    assert not det.verdict(tables["other-batch"]).flagged
    assert det.verdict(tables["int4"]).flagged
    assert vals["int4"].mean() > 3 * vals["other-batch"].mean()


@pytest.mark.parametrize("over,field", [(dict(seed=2**70), "activations.seed"), (dict(seed=-1), "activations.seed"),
                                        (dict(layer=-2), "activations.layer")])
def test_out_of_range_seed_and_layer_name_line_and_field(over, field):
    with pytest.raises(ClaimError) as e:
        fpm.parse_fingerprint(_obj(**over), "claims.jsonl:3", n_output=6, hidden_size=64)
    assert "claims.jsonl:3" in e.value.message and field in e.value.message
    with pytest.raises(ClaimError, match="activations.layer"):
        fpm.parse_fingerprint(_obj(layer=2), "claims.jsonl:3", n_output=6, hidden_size=64, n_layers=2)


def test_sampling_seed_2_pow_70_is_a_claim_error_with_line_and_field():
    from verinfer.claims import parse_claim

    obj = {"id": 1, "model": "m", "prompt_token_ids": [1], "output_token_ids": [2],
           "sampling": {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "noise": "vllm-cpu", "seed": 2**70}}
    with pytest.raises(ClaimError) as e:
        parse_claim(obj, "c.jsonl:7")
    assert "c.jsonl:7" in e.value.message and "sampling.seed" in e.value.message


def test_score_refuses_a_fingerprint_layer_the_model_lacks_before_any_replay(tiny_llama_dir, tmp_path, monkeypatch):
    """Bad fields stop before their chunk is replayed: a `layer` past the model's decoder layers is
    refused by the chunk's check, naming file:line and field, and no replay runs."""
    from verinfer.apps import pipeline

    claims = run_provider(ProviderConfig("p", FP32, batch_size=2), tiny_llama_dir, _prompts(3), SPEC,
                          fingerprint=fpm.FingerprintSpec(k=4, stride=2))
    for c in claims:
        c.extra["activations"]["layer"] = 2  # the tiny model has layers 0 and 1
    write_claims(tmp_path / "c.jsonl", claims)

    def no_replay(*a, **k):
        raise AssertionError("replay started before the layer was checked")

    monkeypatch.setattr(Engine, "replay_batches", no_replay)
    with pytest.raises(ClaimError) as e:
        pipeline.score(tmp_path / "c.jsonl", tiny_llama_dir, tmp_path / "s.parquet", show_progress=False)
    assert "c.jsonl:1" in e.value.message and "activations.layer" in e.value.message
    assert not (tmp_path / "s.parquet").exists()
