import numpy as np
import pytest
import torch

pytest.importorskip("toploc", reason="TOPLOC baseline: install the [toploc] extra from source (README)")

from verinfer.audit import toploc_baseline as tl  # noqa: E402


def test_toploc_round_trip_accepts_same_and_rejects_other_states():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 64, generator=g)
    spec = tl.ToplocSpec(topk=32, chunk=8)
    proofs = tl.build(h, spec)
    assert len(proofs) == 3  # chunks of 8, 8, 4
    import base64

    assert all(len(base64.b64decode(p)) == spec.bytes_per_chunk for p in proofs)
    same = tl.verify(h, proofs, spec)
    assert (same[:, 0] == 0).all() and (same[:, 1] == 0).all()
    assert tl.passes(same, spec).all()
    noisy = tl.verify(h * (1 + 0.003 * torch.randn(20, 64, generator=g)), proofs, spec)
    assert tl.passes(noisy, spec).all()  # bf16-level noise: TOPLOC accepts
    other = tl.verify(torch.randn(20, 64, generator=g), proofs, spec)
    assert not tl.passes(other, spec).any()
    with pytest.raises(ValueError, match="expected 3"):
        tl.verify(h, proofs[:2], spec)


def test_thresholds_scale_with_topk():
    assert tl.ToplocSpec(128, 32).max_exp_mismatches == 38
    assert tl.ToplocSpec(128, 32).bytes_per_token == 258 / 32
    assert np.isclose(tl.ToplocSpec(8, 64).bytes_per_token, 18 / 64)


@pytest.mark.parametrize("topk,chunk,T", [(1, 448, 448), (2, 333, 448), (128, 32, 70)])
def test_proof_bytes_are_the_package_format(topk, chunk, T):
    """bytes_per_chunk is what toploc serializes (ProofPoly.to_bytes: 2-byte modulus + 2 bytes per
    Newton coefficient), down to topk=1 and for one chunk per long claim."""
    import base64

    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(topk))
    spec = tl.ToplocSpec(topk=topk, chunk=chunk)
    proofs = tl.build(h, spec)
    assert len(proofs) == -(-T // chunk)
    assert all(len(base64.b64decode(p)) == 2 + 2 * topk == spec.bytes_per_chunk for p in proofs)
    assert spec.bytes_per_token == (2 + 2 * topk) / chunk
    assert tl.passes(tl.verify(h, proofs, spec), spec).all()
