"""`verinfer score --gaps` writes the honest-reference envelope the detection lab's `best` reads
(issue 15 item 1): the same columns as the lab's path (variants.features_table per reference replay,
then references.envelope_table), so `calibrate --detector glrt` is the lab's detector."""

import numpy as np
import pytest

from verinfer.apps.pipeline import VERIFIER_NUMERICS, reference_engines, verifier_engine
from verinfer.audit.references import REFERENCES, envelope_table, replay
from benchmarks.difr_variants import features_table
from verinfer.audit.replay import score_claims
from verinfer.scores import ENVELOPE_PREFIX, GAP_TEMPERATURE_FACTORS, gap_column, gap_column_names, temperature_column
from verinfer.detect.glrt import ENVELOPE_PREFIX as DETECTOR_PREFIX
from verinfer.models.prompts import prompts_for
from verinfer.models.testbed import TARGET_DIR
from verinfer.providers.simulated import HONEST, run_provider
from verinfer.sampling.params import SamplingParams


def test_score_gaps_envelope_equals_the_labs_envelope(tmp_path):
    assert ENVELOPE_PREFIX == DETECTOR_PREFIX
    advertised = SamplingParams(1.0, 50, 0.95, 0.0, 0, 12, "vllm-cpu")
    claims = run_provider(HONEST["honest-bf16-b1"], TARGET_DIR, prompts_for(TARGET_DIR, 5, 3), advertised, base_seed=3)
    engine = verifier_engine(TARGET_DIR, VERIFIER_NUMERICS)
    refs = reference_engines(TARGET_DIR, engine)
    assert set(refs) == set(REFERENCES) - {"bf16"}
    t = score_claims(claims, engine, tmp_path / "s.parquet", gaps=True, references=refs).table()
    lab = [features_table(claims, replay(REFERENCES["bf16"], engine, claims), temperature_factors=GAP_TEMPERATURE_FACTORS,
                          top_p_slacks=(0.01,))]
    lab += [features_table(claims, replay(ref, eng, claims), temperature_factors=GAP_TEMPERATURE_FACTORS,
                           top_p_slacks=(0.01,)) for ref, eng in refs.values()]
    lab_cols = [gap_column(0.01), *(temperature_column(r, 0.01) for r in GAP_TEMPERATURE_FACTORS)]
    env = envelope_table(lab, lab_cols)
    for ours, theirs in zip(gap_column_names(), lab_cols):
        np.testing.assert_array_equal(t[ENVELOPE_PREFIX + ours].to_numpy(), env[theirs])
        assert (t[ENVELOPE_PREFIX + ours].to_numpy() <= t[ours].to_numpy()).all()
    # the envelope explains more honest tokens than the primary replay alone
    assert (t[ENVELOPE_PREFIX + "gap_s0.01"].to_numpy() > 0).sum() <= (t["gap_s0.01"].to_numpy() > 0).sum()
    with pytest.raises(Exception, match="Ray pool"):
        score_claims(claims, object(), tmp_path / "r.parquet", gaps=True, references=refs,
                     chunk_claims=4)
