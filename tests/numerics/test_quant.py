import torch

from verinfer.numerics.quant import fake_quant_fp8_e4m3, rtn_fake_quant


def _slow_rtn(w, bits, group):
    out = torch.empty_like(w)
    qmax = 2**bits - 1
    for o in range(w.shape[0]):
        for s in range(0, w.shape[1], group):
            g = w[o, s : s + group]
            scale = max((g.max() - g.min()).item() / qmax, 1e-12)
            zero = round(-g.min().item() / scale)
            for j, x in enumerate(g.tolist()):
                q = min(max(round(x / scale) + zero, 0), qmax)
                out[o, s + j] = (q - zero) * scale
    return out


def test_rtn_matches_slow_loop_including_remainder_group():
    w = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    for bits, group in ((4, 16), (4, 32), (8, 8)):
        assert torch.allclose(rtn_fake_quant(w, bits, group), _slow_rtn(w, bits, group), atol=1e-5)


def test_rtn_has_at_most_2_pow_bits_levels_and_bounded_error():
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    q = rtn_fake_quant(w, 4, 32)
    for o in range(3):
        for s in (0, 32):
            g, qg = w[o, s : s + 32], q[o, s : s + 32]
            assert len(torch.unique(qg)) <= 16
            assert (g - qg).abs().max() <= (g.max() - g.min()) / 15 * 0.5 + 1e-6


def test_fp8_round_trip_is_lossy_but_close():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    y = fake_quant_fp8_e4m3(x)
    normal = x.abs() > 2**-6  # e4m3's smallest normal; below it the spacing is absolute (2**-9)
    rel = ((x - y).abs() / x.abs())[normal].max()
    assert 0 < rel <= 2**-4  # 3 mantissa bits: half-ulp relative error at most 1/16
    assert (x - y)[~normal].abs().max() <= 2**-10
    assert len(torch.unique(y)) < len(torch.unique(x))
