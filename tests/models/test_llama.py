import pytest
import torch

from verinfer.errors import ModelError
from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_model
from verinfer.numerics.kernels import Fused, Native

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def _hf(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


KERNELS = {"native": Native, "fused": Fused}


@pytest.mark.parametrize("kernels", sorted(KERNELS))
@pytest.mark.parametrize("arch", ARCHS)
def test_lean_forward_matches_transformers_fp32(tiny_checkpoint, arch, kernels):
    """Prefill logits of every supported architecture against transformers, both kernel strategies."""
    d = tiny_checkpoint(arch)
    hf = _hf(d)
    lean = LlamaLM.from_pretrained(d, kernels=KERNELS[kernels]())
    assert lean.config.model_type == arch
    tokens = torch.randint(3, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got, _ = lean(tokens, torch.arange(17).expand(3, -1))
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("kernels", sorted(KERNELS))
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decode_matches_transformers_fp32(tiny_checkpoint, arch, kernels):
    """Chunked prefill then one-token decode steps through the KV cache, rows at different
    lengths, against transformers' full forward of each row's sequence so far."""
    d = tiny_checkpoint(arch)
    hf = _hf(d)
    lean = LlamaLM.from_pretrained(d, kernels=KERNELS[kernels]())
    g = torch.Generator().manual_seed(2)
    lens = [9, 4, 6]
    seqs = [torch.randint(3, 97, (n,), generator=g).tolist() for n in lens]
    B, T = len(seqs), max(lens)
    tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    cache = lean.new_cache(B, 16)
    with torch.no_grad():
        for c0, c1 in ((0, 3), (3, T)):
            lean(tokens[:, c0:c1], torch.arange(c0, c1).expand(B, -1), cache)
        for step in range(4):  # row b writes slot len(seq b); the padding slots are overwritten or never read
            nxt = torch.randint(3, 97, (B, 1), generator=g)
            got, _ = lean(nxt, torch.tensor([[len(s)] for s in seqs]), cache)
            for b, s in enumerate(seqs):
                s.append(int(nxt[b]))
                ref = hf(torch.tensor([s])).logits[0, -1]
                assert torch.allclose(got[b, 0], ref, atol=1e-5, rtol=1e-5), (arch, step, (got[b, 0] - ref).abs().max())


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
    assert fast.kernels.w32 is not None and load_model(tiny_llama_dir, Numerics(dtype="fp32", matmul="fp32")).kernels.w32 is None
    x = torch.randn(64, fast.config.hidden_size, generator=torch.Generator().manual_seed(6)).bfloat16()
    name = "layers.0.mlp.gate_proj.weight"
    got = fast.kernels.linear(x, name)
    exact = (x.double() @ fast.w[name].double().T).bfloat16()
    assert got.dtype == torch.bfloat16
    assert (got == exact).float().mean() > 0.99
    ulp = torch.finfo(torch.bfloat16).eps * exact.double().abs().clamp_min(1e-30)
    assert ((got.double() - exact.double()).abs() <= ulp * 1.01).all()
    q, k = fast.kernels.linears(x, ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight"))  # fused GEMM
    for fused, name in ((q, "layers.0.self_attn.q_proj.weight"), (k, "layers.0.self_attn.k_proj.weight")):
        torch.testing.assert_close(fused, fast.kernels.linear(x, name), atol=0, rtol=2**-7)  # <= 1 bf16 step
    tokens = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(20).expand(2, -1)
    with torch.no_grad():
        a, _ = fast(tokens, pos)
        b, _ = native(tokens, pos)
    assert 0 < (a - b).abs().max() < 0.1
    with pytest.raises(ValueError, match="matmul"):
        Numerics(matmul="tf32")


@pytest.mark.parametrize("field, value, match", [
    ("model_type", "gpt2", "model_type"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_parameters"),
    ("sliding_window", 64, "sliding_window"),
])
def test_refuses_configs_the_forward_does_not_implement(tiny_checkpoint, tmp_path, field, value, match):
    """What the lean forward does not compute (other architectures, scaled RoPE, sliding-window
    attention) is refused with the config field named, never computed wrongly."""
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("mistral"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=match) as e:
        LlamaLM.from_pretrained(d)
    assert "impl=" not in str(e.value)  # no pointer to the removed transformers loader


def test_rope_table_has_the_bits_of_a_per_call_computation(tiny_llama_dir):
    """The forward gathers cos/sin from a table over positions; each entry equals the previous
    per-call computation (transformers' ops on the call's positions), fp32 and bf16, whatever
    the table's size (it grows by doubling)."""
    from verinfer.models.llama import rope_table

    def per_call(pos, E, theta, dtype):
        inv_freq = 1.0 / (theta ** (torch.arange(0, E, 2, dtype=torch.int64).float() / E))
        freqs = pos.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    g = torch.Generator().manual_seed(8)
    for E, theta, P in ((16, 1e4, 64), (32, 1e4, 512), (24, 1e6, 1024), (64, 1e5, 8192)):
        for dtype in (torch.float32, torch.bfloat16):
            cos_PE, sin_PE = rope_table(P, E, theta, dtype, "cpu")
            for shape in ((1, 1), (16, 1), (3, 17), (97,)):
                pos = torch.randint(0, P, shape, generator=g)
                c, s = per_call(pos, E, theta, dtype)
                assert torch.equal(cos_PE[pos], c) and torch.equal(sin_PE[pos], s), (E, P, dtype, shape)
    lean = LlamaLM.from_pretrained(tiny_llama_dir)
    tokens = torch.randint(3, 97, (2, 100), generator=g)
    with torch.no_grad():
        a, _ = lean(tokens, torch.arange(100).expand(2, -1))   # grows the table from 64 to 128 positions
        assert lean._cos_PE.shape[0] == 128
        b, _ = LlamaLM.from_pretrained(tiny_llama_dir)(tokens, torch.arange(100).expand(2, -1))
    assert torch.equal(a, b)


def test_with_kernels_shares_the_weights_and_fused_stays_close(tiny_llama_dir):
    """with_kernels gives another strategy over the same weight tensors; the fused GEMMs agree
    with native to fp32 rounding."""
    lean = LlamaLM.from_pretrained(tiny_llama_dir)
    fused = lean.with_kernels(Fused())
    assert fused.w is lean.w and fused.kernels.name == "fused" and lean.kernels.name == "native"
    tokens = torch.randint(3, 97, (3, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a, _ = lean(tokens, torch.arange(20).expand(3, -1))
        b, _ = fused(tokens, torch.arange(20).expand(3, -1))
    assert (a - b).abs().max() < 2e-5
    with pytest.raises(ValueError, match="matmul"):
        LlamaLM(lean.config, lean.w, matmul="fp32", kernels=Fused())


@pytest.mark.parametrize("drop", ["vocab_size", "hidden_size"])
def test_config_missing_a_size_is_a_model_error_naming_file_and_key(tiny_llama_dir, tmp_path, drop):
    """A config.json without vocab_size or hidden_size is refused by model_info and the loader
    with the file and the key named (it was a bare KeyError)."""
    import json
    import shutil

    from verinfer.models.load import model_info

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg[drop]
    (d / "config.json").write_text(json.dumps(cfg))
    for load in (model_info, LlamaLM.from_pretrained):
        with pytest.raises(ModelError) as e:
            load(d)
        assert str(d / "config.json") in str(e.value) and f"`{drop}`" in str(e.value)


def test_truncated_config_is_a_model_error_naming_the_file(tiny_llama_dir, tmp_path):
    import shutil

    from verinfer.models.load import model_info

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])
    for load in (model_info, LlamaLM.from_pretrained):
        with pytest.raises(ModelError, match="not valid JSON") as e:
            load(d)
        assert str(d / "config.json") in str(e.value)


def test_rope_tables_only_grow_when_requests_grow_them_at_once(tiny_llama_dir, monkeypatch):
    """`verinfer serve` runs requests in threads: a short request that began growing the RoPE table
    (to 128) before a long one (to 256) finished after it, and left the smaller table, so the long one
    indexed past it (IndexError, HTTP 500; seen in the chat-audit tests under load). The table never
    shrinks now, whatever the interleaving forced here."""
    import threading

    from verinfer.models import llama

    lean = LlamaLM.from_pretrained(tiny_llama_dir)
    assert lean._arange_P.numel() == 64
    real, short_started, long_done = llama.rope_table, threading.Event(), threading.Event()

    def interleaved(n_pos, *a, **kw):
        if n_pos == 128:  # the short request: start, then wait until the long one has grown the table
            short_started.set()
            long_done.wait(timeout=2)
        return real(n_pos, *a, **kw)

    monkeypatch.setattr(llama, "rope_table", interleaved)
    short = threading.Thread(target=lean._grow, args=(65,))
    short.start()
    assert short_started.wait(timeout=10)
    long = threading.Thread(target=lean._grow, args=(129,))
    long.start()
    long.join(timeout=1)  # with the lock it waits for the short one (the event times out), then grows
    long_done.set()
    short.join(timeout=10)
    long.join(timeout=10)
    assert lean._arange_P.numel() >= 129 and lean._cos_PE.shape[0] >= 129 and lean._sin_PE.shape[0] >= 129
