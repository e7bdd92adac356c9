"""Rank correlation between two scorings of the same items (how well one predicts the other's order).

Small and exact, ties handled as scipy.stats does: Spearman's ρ is Pearson's r of average ranks;
Kendall's τ-b counts concordant minus discordant pairs over the pairs untied in each variable.
Both are NaN when a variable is constant (no order to predict) or there are fewer than 2 items.
"""
from __future__ import annotations

import math
from typing import Sequence


def average_ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks; tied values share the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _check(xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"need paired values: {len(xs)} vs {len(ys)}")


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    _check(xs, ys)
    if len(xs) < 2:
        return math.nan
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def kendall(xs: Sequence[float], ys: Sequence[float]) -> float:
    """τ-b: (C - D) / sqrt((n0 - tx)(n0 - ty)), n0 all pairs, tx / ty pairs tied in x / y."""
    _check(xs, ys)
    n = len(xs)
    c = d = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            a = (xs[i] > xs[j]) - (xs[i] < xs[j])
            b = (ys[i] > ys[j]) - (ys[i] < ys[j])
            tx += a == 0
            ty += b == 0
            if a and b:
                c += a == b
                d += a != b
    n0 = n * (n - 1) // 2
    den = math.sqrt((n0 - tx) * (n0 - ty))
    return (c - d) / den if den > 0 else math.nan
