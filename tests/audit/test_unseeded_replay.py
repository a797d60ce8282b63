"""Scoring unseeded claims (`"seed": null`) beside seeded and greedy ones: each row records its
audit mode, unseeded rows carry the PIT and the entropy, and seeded rows score as they did alone."""

import numpy as np
import pyarrow.compute as pc
from dataclasses import replace

from verinfer.audit.replay import score_claims
from verinfer.audit.score_file import verifier_engine
from verinfer.claims import Claim
from verinfer.models.testbed import TARGET_DIR
from verinfer.sampling.params import SamplingParams
from verinfer.scores import ENTROPY, MARGIN, MODE, PIT, read_scores


def test_mixed_modes_score_in_one_file(tmp_path):
    eng = verifier_engine(TARGET_DIR)
    seeded = SamplingParams(temperature=1.0, top_k=-1, top_p=0.95, seed=11, max_tokens=12)
    claims = [Claim(f"s{i}", "verinfer-testbed-target", [5 + i, 40, 41, 42], [50 + i, 60, 61, 62, 63, 64, 7, 8, 9, 10,
                                                                                  11, 12], seeded) for i in range(4)]
    unseeded = [replace(c, id="u" + c.id, sampling=replace(seeded, seed=None, unseeded=True)) for c in claims]
    greedy = [replace(claims[0], id="g", sampling=SamplingParams(temperature=0.0, max_tokens=12))]
    alone = score_claims(claims, eng, tmp_path / "alone.parquet").table()
    mixed = score_claims([*unseeded[:2], *claims, *unseeded[2:], *greedy], eng, tmp_path / "mixed.parquet")
    t = read_scores(mixed.path)
    modes = t[MODE].to_pylist()
    assert modes.count("unseeded") == 48 and modes.count("seeded") == 48 and modes.count("greedy") == 12
    seeded_rows = t.filter(pc.equal(t[MODE], "seeded"))
    assert seeded_rows.drop_columns([MODE]).equals(alone.drop_columns([MODE]))  # seeded scores unchanged
    assert seeded_rows[PIT].null_count == 48 and seeded_rows[ENTROPY].null_count == 48
    u = t.filter(pc.equal(t[MODE], "unseeded"))
    pit, ent = u[PIT].to_numpy(), u[ENTROPY].to_numpy()
    assert ((pit >= 0) & (pit <= 1)).all() and (ent > 0).all() and (u[MARGIN].to_numpy() >= 0).all()
    again = score_claims(unseeded, eng, tmp_path / "again.parquet").table()  # reproducible: keyed uniforms
    assert np.array_equal(np.sort(again[PIT].to_numpy()), np.sort(pit))


def test_gaps_and_honest_envelope_of_a_mixed_file(tmp_path):
    """`verinfer score --gaps` with honest references (issue: envelope_gap_columns sent unseeded
    claims to the seeded gap code, which crashed on the missing seed): a file mixing seeded and
    unseeded claims scores; unseeded rows have NaN gaps and envelope (no noise to gap, as greedy
    rows), seeded rows equal those of the seeded claims scored alone."""
    from verinfer.audit.score_file import reference_engines
    from verinfer.scores import ENVELOPE_PREFIX, gap_column_names

    eng = verifier_engine(TARGET_DIR)
    refs = reference_engines(TARGET_DIR, eng)
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=5, max_tokens=6)
    claims = [Claim(f"s{i}", "verinfer-testbed-target", [5 + i, 40, 41], [50 + i, 60, 61, 62, 63, 64], seeded)
              for i in range(2)]
    unseeded = [replace(c, id="u" + c.id, sampling=replace(seeded, seed=None, unseeded=True)) for c in claims]
    alone = score_claims(claims, eng, tmp_path / "alone.parquet", gaps=True, references=refs).table()
    t = score_claims([unseeded[0], *claims, unseeded[1]], eng, tmp_path / "mixed.parquet", gaps=True,
                     references=refs).table()
    cols = gap_column_names() + [ENVELOPE_PREFIX + c for c in gap_column_names()]
    u = t.filter(pc.equal(t[MODE], "unseeded"))
    assert u.num_rows == 12 and all(np.isnan(u[c].to_numpy()).all() for c in cols)
    s = t.filter(pc.equal(t[MODE], "seeded"))
    for c in cols:
        np.testing.assert_array_equal(s[c].to_numpy(), alone[c].to_numpy(), err_msg=c)
        assert not np.isnan(s[c].to_numpy()).any(), c
