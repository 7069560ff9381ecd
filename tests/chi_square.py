"""Chi-square goodness-of-fit p-values without scipy (the regularized upper incomplete gamma)."""

from __future__ import annotations

import math

import numpy as np


def gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a) (Numerical Recipes: series below a + 1, else Lentz)."""
    if x <= 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for P(a, x)
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-16 * abs(total):
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300  # continued fraction for Q(a, x)
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi_square_pvalue(observed, expected) -> float:
    """P-value of Pearson's chi-square test that ``observed`` counts follow ``expected`` counts
    (same total); degrees of freedom = cells - 1."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return gamma_q((observed.size - 1) / 2, statistic / 2)
