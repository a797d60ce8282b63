"""scores.py: the likelihood score and the divergence orientation of every score column."""

import numpy as np
import pyarrow as pa
import pytest
from scipy.stats import norm

from verinfer.scores import SCORES, divergence, likelihood_score


def test_likelihood_and_divergence():
    m = np.array([0.0, 0.1, 30.0, np.inf])
    ll = likelihood_score(m, 0.1)
    assert ll[0] == pytest.approx(np.log(0.5))
    assert ll[1] == pytest.approx(norm.logcdf(-0.1 / (np.sqrt(2) * 0.1)))
    assert np.isfinite(ll[2]) and ll[2] < -4000  # stable far in the tail (Phi underflows to 0)
    assert ll[3] == -np.inf
    t = pa.table({"margin": m, "likelihood": ll, "exact_match": [True, False, False, False],
                  "cross_entropy": [0.1, 1.0, 5.0, np.inf]})
    assert divergence(t, "exact_match").tolist() == [0.0, 1.0, 1.0, 1.0]
    assert np.array_equal(divergence(t, "likelihood"), -ll)
    assert np.array_equal(divergence(t.to_pydict(), "margin"), m)
    for s in SCORES:  # every orientation: the larger margin is at least as divergent
        d = divergence(t, s)
        assert np.all(np.diff(d) >= 0)
    with pytest.raises(ValueError):
        divergence(t, "bogus")


def _scores_file(path, modes, claim="c"):
    """A scores file of one claim per audit mode given (None: written before audit modes were recorded,
    without the audit_mode, pit and entropy columns), 150 tokens each."""
    import pyarrow.parquet as pq

    from verinfer.scores import ENTROPY, MODE, PIT, SCORE_SCHEMA

    n = 150
    cols = {name: [] for name in SCORE_SCHEMA.names}
    rng = np.random.default_rng(len(modes))
    for k, mode in enumerate(modes):
        un = mode == "unseeded"
        cols["claim_id"] += [f"{claim}{k}"] * n
        cols["provider"] += ["unknown"] * n
        cols["position"] += list(range(n))
        cols["token_id"] += [5] * n
        cols["replay_token_id"] += [5] * n
        cols["margin"] += [0.0] * n
        cols["exact_match"] += [True] * n
        cols["cross_entropy"] += list(rng.uniform(0.1, 3.0, n))
        cols["likelihood"] += [-0.5] * n
        cols["fp_l2"] += [None] * n
        cols[MODE] += [mode] * n
        cols[PIT] += list(rng.uniform(0, 1, n)) if un else [None] * n
        cols[ENTROPY] += list(rng.uniform(0.5, 2.0, n)) if un else [None] * n
    t = pa.table(cols, schema=SCORE_SCHEMA)
    if None in modes:
        t = t.drop_columns([MODE, PIT, ENTROPY])
    pq.write_table(t, path)
    return path


def test_old_scores_files_keep_the_unseeded_guard(tmp_path):
    """A scores file from before audit modes (no audit_mode, pit, entropy) read with a new one: the
    columns are kept (the old rows null: greedy or seeded, never unseeded), so a seeded detector still
    refuses the new file's unseeded rows and an unseeded detector reads those rows only."""
    from verinfer.detect.registry import make_detector
    from verinfer.errors import VerinferError
    from verinfer.scores import ENTROPY, MODE, PIT, load_score_tables

    old = _scores_file(tmp_path / "old.parquet", [None])
    new = _scores_file(tmp_path / "new.parquet", ["seeded", "unseeded", "greedy"])
    for paths in ([old, new], [new, old]):
        t = load_score_tables(paths)
        assert {MODE, PIT, ENTROPY} <= set(t.column_names)
        by = dict(zip(zip(t["provider"].to_pylist(), t["claim_id"].to_pylist()), t[MODE].to_pylist()))
        assert by == {("old", "c0"): None, ("new", "c0"): "seeded", ("new", "c1"): "unseeded",
                      ("new", "c2"): "greedy"}
        assert t.filter(pa.compute.equal(t["provider"], "old"))[PIT].null_count == 150
        with pytest.raises(VerinferError, match="150 scored tokens come from unseeded claims"):
            make_detector("clipped-mean", score_name="cross_entropy").require_columns(t)
        assert make_detector("pit-uniformity").token_rows(t).num_rows == 150
    t = load_score_tables([old])  # old files alone read as they did
    assert MODE not in t.column_names
    make_detector("clipped-mean", score_name="cross_entropy").require_columns(t)
