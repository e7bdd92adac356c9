"""Rank correlation helpers of the benchmarks (benchmarks/ranks.py)."""
import math
import random

import pytest

from benchmarks.ranks import average_ranks, kendall, spearman


def test_average_ranks_share_ties():
    assert average_ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]


def test_perfect_and_reversed_orders():
    xs = [1.0, 2.5, 3.0, 7.0]
    assert spearman(xs, [2 * x + 1 for x in xs]) == pytest.approx(1.0)
    assert kendall(xs, [-x ** 3 for x in xs]) == pytest.approx(-1.0)


def test_monotone_transform_does_not_change_them():
    rng = random.Random(3)
    xs = [rng.random() for _ in range(12)]
    ys = [x + rng.gauss(0, 0.3) for x in xs]
    assert spearman(xs, ys) == pytest.approx(spearman([math.exp(5 * x) for x in xs], ys))
    assert kendall(xs, ys) == pytest.approx(kendall(xs, [y ** 3 for y in ys]))


def test_known_values_with_ties():
    # worked by hand: ranks x = 1, 2.5, 2.5, 4; y = 1, 2, 3, 4 -> rho = 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    # C = 5, D = 0, ties in x = 1 pair: tau-b = 5 / sqrt(5 * 6)
    assert kendall([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    # one swapped pair of 4: C = 5, D = 1
    assert kendall([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_constant_or_short_input_is_nan_and_mismatch_raises():
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(kendall([1], [2]))
    with pytest.raises(ValueError):
        spearman([1, 2], [1, 2, 3])
