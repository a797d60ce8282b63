"""report.format: significant digits instead of a fixed 4 decimals, p-values in the CLI's words."""

import math

import pytest

from verinfer.report import format as fmt


@pytest.mark.parametrize("x, digits, text", [
    (3.14159e-05, 3, "3.14e-05"),  # the old report printed pooled values like this as 0.0000
    (0.00012345, 3, "0.000123"),
    (0.012345, 3, "0.0123"),
    (0.9962, 4, "0.9962"),
    (0.5, 3, "0.5"),
    (1234.5, 3, "1234"),  # integer digits are never cut
    (2.5e6, 3, "2.5e+06"),
    (1.0e-7, 3, "1e-07"),
    (-0.0421, 2, "-0.042"),
    (0.0, 3, "0"),
    (None, 3, "\u2014"),
    (math.inf, 3, "inf"),
    (math.nan, 3, "n/a"),
])
def test_sig(x, digits, text):
    assert fmt.sig(x, digits) == text


@pytest.mark.parametrize("p, text", [
    (0.0, "<1e-300"),  # underflow: what `verinfer audit` prints (cli.render.verdicts)
    (5e-324, "4.9e-324"),  # the smallest double is still a number
    (1.3e-12, "1.3e-12"),
    (0.00712, "0.0071"),
    (0.25, "0.25"),
    (1.0, "1"),
])
def test_p_value(p, text):
    assert fmt.p_value(p) == text


def test_tokens_and_share():
    assert fmt.tokens(10147) == "10,147" and fmt.tokens(None) == "\u2014"
    assert fmt.share(0.01) == "1%" and fmt.share(0.00021) == "0.021%" and fmt.share(0.0) == "0%"
