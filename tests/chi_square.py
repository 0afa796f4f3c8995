"""Pearson's chi-square test for the sampling-law tests (no scipy: the survival function is computed here)."""

from __future__ import annotations

import math


def chi_square_p_value(observed: list[float], expected: list[float]) -> tuple[float, float, int]:
    """Pearson's statistic, its p-value and degrees of freedom; cells expecting < 5 are pooled."""
    pooled_o = pooled_e = 0.0
    obs, exp = [], []
    for o, e in zip(observed, expected):
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
        else:
            obs.append(o)
            exp.append(e)
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return stat, upper_gamma_regularized(df / 2, stat / 2), df


def upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): the chi-square survival function at 2x with 2a degrees of freedom."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # series for P(a, x)
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1
            term *= x / n
            total += term
        return 1.0 - total * math.exp(log_front)
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)  # Lentz's continued fraction for Q(a, x)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h * math.exp(log_front)
