"""Numbers as the report prints them: significant digits, not a fixed count of decimals (a pooled
margin of 3.1e-05 is not `0.0000`), and p-values in the CLI's words (`<1e-300` where the tail
probability underflows to 0, as `cli.render.verdicts` prints it).

    sig(3.14159e-05)  -> "3.14e-05"      sig(0.012345) -> "0.0123"     sig(1234.5) -> "1234"
    p_value(0.0)      -> "<1e-300"       p_value(0.00712) -> "0.0071"  p_value(1.0) -> "1"
    tokens(10147)     -> "10,147"        share(0.00021) -> "0.021%"

None prints as an em dash (not measured), +inf as "inf", NaN as "n/a".
"""

from __future__ import annotations

import math

DASH = "\u2014"
P_FLOOR = "<1e-300"  # a p-value that underflowed to 0: smaller than any double the null can resolve


def _special(x) -> str | None:
    if x is None:
        return DASH
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return None


def sig(x, digits: int = 3) -> str:
    """x to `digits` significant digits, trailing zeros dropped: fixed-point for
    1e-4 <= |x| < 1e6 (integer digits never cut), scientific outside that range."""
    if (s := _special(x)) is not None:
        return s
    x = float(x)
    if x == 0:
        return "0"
    exp = math.floor(math.log10(abs(x)))
    if -4 <= exp < 6:
        decimals = max(digits - 1 - exp, 0)
        out = f"{x:.{decimals}f}"
        return out.rstrip("0").rstrip(".") if "." in out else out
    mantissa, e = f"{x:.{digits - 1}e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.') if '.' in mantissa else mantissa}e{e}"


def p_value(p, digits: int = 2) -> str:
    """A tail probability: `<1e-300` for 0 (underflow), else `sig(p, digits)`."""
    if (s := _special(p)) is not None:
        return s
    return P_FLOOR if float(p) <= 0 else sig(p, digits)


def tokens(n) -> str:
    """A token count with thousands separators."""
    return DASH if n is None else f"{int(n):,}"


def share(x, digits: int = 2) -> str:
    """A fraction in [0, 1] as a percentage to `digits` significant digits (0 -> "0%")."""
    if (s := _special(x)) is not None:
        return s
    return f"{sig(100 * float(x), digits)}%"
