import pytest
import torch

from verinfer.errors import ModelError
from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_model


def _hf(d):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_lean_forward_matches_transformers_fp32(tiny_llama_dir):
    hf = _hf(tiny_llama_dir)
    lean = LlamaLM.from_pretrained(tiny_llama_dir)
    tokens = torch.randint(3, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got, _ = lean(tokens, torch.arange(17).expand(3, -1))
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cached_decode_equals_full_forward(tiny_llama_dir, attn):
    lean = LlamaLM.from_pretrained(tiny_llama_dir, attn=attn)
    tokens = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = lean(tokens, torch.arange(12).expand(2, -1))
        cache = lean.new_cache(2, 16)
        lg, _ = lean(tokens[:, :5], torch.arange(5).expand(2, -1), cache)
        steps = [lg[:, -1]]
        for t in range(5, 12):
            lg, _ = lean(tokens[:, t : t + 1], torch.full((2, 1), t), cache)
            steps.append(lg[:, -1])
    dec = torch.stack(steps[:-1], 1)
    assert torch.allclose(dec, full[:, 4:11], atol=1e-5), (dec - full[:, 4:11]).abs().max()


def test_hidden_states_match_transformers(tiny_llama_dir):
    hf = _hf(tiny_llama_dir)
    lean = LlamaLM.from_pretrained(tiny_llama_dir)
    tokens = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(tokens, output_hidden_states=True)
        _, h0 = lean(tokens, torch.arange(9)[None], hidden_layer=0)
        _, hlast = lean(tokens, torch.arange(9)[None], hidden_layer=-1)
    assert torch.allclose(h0, out.hidden_states[1], atol=1e-5)
    assert torch.allclose(hlast, out.hidden_states[-1], atol=1e-5)  # HF's last entry is post-norm


def test_bf16_and_int4_change_logits_a_little_and_a_lot(tiny_llama_dir):
    from verinfer.numerics import Numerics

    tokens = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(20)[None]
    f32, _ = load_model(tiny_llama_dir, Numerics(dtype="fp32"))(tokens, pos)
    b16, _ = load_model(tiny_llama_dir, Numerics(dtype="bf16"))(tokens, pos)
    i4, _ = load_model(tiny_llama_dir, Numerics(dtype="fp32", weight_bits=4))(tokens, pos)
    d_bf16 = (f32 - b16).abs().max().item()
    d_int4 = (f32 - i4).abs().max().item()
    assert 0 < d_bf16 < d_int4


def test_refuses_pickle_only_and_truncated_dirs(tiny_llama_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(ModelError, match="truncated"):
        LlamaLM.from_pretrained(d)
    w.unlink()
    with pytest.raises(ModelError, match="safetensors"):
        LlamaLM.from_pretrained(d)


def test_packed_replay_equals_padded_and_one_at_a_time(tiny_llama_dir):
    """lengths_B drops the padding from the per-token ops; the real tokens keep their values."""
    lean = LlamaLM.from_pretrained(tiny_llama_dir)
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([11, 4, 17])
    tokens = torch.randint(3, 97, (3, 17), generator=g)
    for b, n in enumerate(lengths.tolist()):
        tokens[b, n:] = 0
    b_N = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths.tolist())])
    t_N = torch.cat([torch.arange(n) for n in lengths.tolist()])
    pos = torch.arange(17).expand(3, -1)
    with torch.no_grad():
        padded, hp = lean(tokens, pos, hidden_layer=1, select=(b_N, t_N))
        packed, hk = lean(tokens, pos, hidden_layer=1, select=(b_N, t_N), lengths_B=lengths)
        alone = torch.cat([lean(tokens[b : b + 1, :n], torch.arange(n)[None])[0][0] for b, n in enumerate(lengths.tolist())])
    assert packed.shape == (int(lengths.sum()), lean.config.vocab_size)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hk, hp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cache-free"):
        lean(tokens, pos, lean.new_cache(3, 17), lengths_B=lengths)


def test_fp32_matmul_rounds_like_an_exact_bf16_kernel(tiny_llama_dir):
    """matmul='fp32': each linear layer's output is the fp64 product of the bf16 operands,
    rounded to bf16, except where fp32 accumulation lands on the other side of a rounding
    boundary (at most one bf16 step); the whole forward stays within bf16 noise of native."""
    from verinfer.numerics import Numerics

    fast = load_model(tiny_llama_dir, Numerics(dtype="bf16", matmul="fp32"))
    native = load_model(tiny_llama_dir, Numerics(dtype="bf16"))
    assert fast.w32 is not None and load_model(tiny_llama_dir, Numerics(dtype="fp32", matmul="fp32")).w32 is None
    x = torch.randn(64, fast.config.hidden_size, generator=torch.Generator().manual_seed(6)).bfloat16()
    name = "layers.0.mlp.gate_proj.weight"
    got = fast._linear(x, name)
    exact = (x.double() @ fast.w[name].double().T).bfloat16()
    assert got.dtype == torch.bfloat16
    assert (got == exact).float().mean() > 0.99
    ulp = torch.finfo(torch.bfloat16).eps * exact.double().abs().clamp_min(1e-30)
    assert ((got.double() - exact.double()).abs() <= ulp * 1.01).all()
    q, k = fast._linears(x, ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight"))  # fused GEMM
    for fused, name in ((q, "layers.0.self_attn.q_proj.weight"), (k, "layers.0.self_attn.k_proj.weight")):
        torch.testing.assert_close(fused, fast._linear(x, name), atol=0, rtol=2**-7)  # <= 1 bf16 step
    tokens = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(20).expand(2, -1)
    with torch.no_grad():
        a, _ = fast(tokens, pos)
        b, _ = native(tokens, pos)
    assert 0 < (a - b).abs().max() < 0.1
    with pytest.raises(ValueError, match="matmul"):
        Numerics(matmul="tf32")
