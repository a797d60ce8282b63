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
