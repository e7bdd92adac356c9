"""Streaming statistics of the sequence lengths actually sampled, and drift in their tail.

The coordinator sees every global batch before it runs (the sampler is deterministic). It feeds
the lengths here to keep:

* `LengthHistogram`: counts in log-spaced buckets (`buckets_per_octave` per doubling, so every
  quantile is known to within one bucket, 2^(1/8) − 1 ≈ 9% by default, at any length scale and
  in O(log(max length)) memory); exact count, total, min and max; mergeable across windows or
  workers; plain JSON.
* `DriftDetector`: a reference window (the first batches) against the most recent batches;
  drift = the two windows differ significantly (a two-sample Kolmogorov-Smirnov test on the
  histograms at level `alpha`) and some high quantile (p90, p99 by default) moved by more than
  `threshold` relative. The tail is what decides memory limits and the slowest pipeline, so that
  is what is watched; the test keeps the sampling noise of small windows (a p90 of 64 lengths
  moves 30% by chance) from counting as drift, and the threshold keeps tiny but significant shifts
  of huge windows from counting either.

  A window is `window` batches and at least `min_samples` lengths, as many batches as that takes:
  at the coordinator's 8 batches and 256 lengths, 8 batches from a global batch of 32 up and 32
  batches at a global batch of 8. Sized in lengths, not batches, because the test's power is: with
  windows of 8 batches of 8 (64 lengths a side) a doubled mean length was found after 5 to 163
  batches (20 seeds), with 32 batches of 8 after 13 to 23. Detection bound (the coordinator's
  settings, the runtime's long-tailed lengths, mean length doubled or halved, every seed tested):
  within one window of the shift, i.e. 32 steps at a global batch of 8, 8 steps at 32, 5 at 256
  (tests/test_lengths_stats.py). Until the reference window has filled, nothing is declared.
"""
from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .cost import LengthError

DEFAULT_QUANTILES = (0.9, 0.99)
# The check runs after every batch on overlapping windows, so a long run makes many looks at the
# same data: a strict level keeps a run of thousands of steps on one distribution free of alarms.
DEFAULT_ALPHA = 1e-3


class LengthHistogram:
    """Log-bucketed counts of positive lengths: bucket k holds [2^(k/B), 2^((k+1)/B)), B per octave."""

    def __init__(self, buckets_per_octave: int = 8):
        if not (isinstance(buckets_per_octave, int) and 1 <= buckets_per_octave <= 1024):
            raise LengthError("buckets_per_octave", buckets_per_octave, "an integer in 1..1024")
        self.buckets_per_octave = buckets_per_octave
        self.counts: dict[int, int] = {}
        self.count = 0
        self.total = 0
        self.min: int | None = None
        self.max: int | None = None

    # -- building
    def bucket(self, length: float) -> int:
        # The small epsilon keeps exact powers (e.g. 2^(k/B) itself) in their own bucket despite rounding.
        return math.floor(math.log2(length) * self.buckets_per_octave + 1e-9)

    def edges(self, k: int) -> tuple[float, float]:
        b = self.buckets_per_octave
        return 2.0 ** (k / b), 2.0 ** ((k + 1) / b)

    def add(self, length: int, n: int = 1) -> None:
        if not (isinstance(length, numbers.Integral) and length >= 1):
            raise LengthError("length", length, "a positive integer token count")
        length = int(length)
        if n < 0:
            raise LengthError("n", n, "a count >= 0")
        if n == 0:
            return
        k = self.bucket(length)
        self.counts[k] = self.counts.get(k, 0) + n
        self.count += n
        self.total += length * n
        self.min = length if self.min is None else min(self.min, length)
        self.max = length if self.max is None else max(self.max, length)

    def update(self, lengths: Iterable[int]) -> "LengthHistogram":
        for x in lengths:
            self.add(x)
        return self

    @classmethod
    def of(cls, lengths: Iterable[int], buckets_per_octave: int = 8) -> "LengthHistogram":
        return cls(buckets_per_octave).update(lengths)

    def merge(self, other: "LengthHistogram") -> "LengthHistogram":
        """A new histogram of both (same bucketing required)."""
        out = self.copy()
        out.absorb(other)
        return out

    def absorb(self, other: "LengthHistogram") -> None:
        if other.buckets_per_octave != self.buckets_per_octave:
            raise LengthError("buckets_per_octave", other.buckets_per_octave,
                              f"the same as the histogram merged into ({self.buckets_per_octave})")
        for k, c in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + c
        self.count += other.count
        self.total += other.total
        if other.count:
            self.min = other.min if self.min is None else min(self.min, other.min)  # type: ignore[type-var]
            self.max = other.max if self.max is None else max(self.max, other.max)  # type: ignore[type-var]

    def copy(self) -> "LengthHistogram":
        out = LengthHistogram(self.buckets_per_octave)
        out.counts, out.count, out.total = dict(self.counts), self.count, self.total
        out.min, out.max = self.min, self.max
        return out

    # -- reading
    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """The q-quantile (nearest rank), interpolated geometrically inside its bucket and clipped
        to the exact min and max; within one bucket width of the exact value."""
        if not 0.0 <= q <= 1.0:
            raise LengthError("q", q, "a quantile in [0, 1]")
        if not self.count:
            raise LengthError("histogram", "empty", "at least one length before asking for quantiles")
        if q == 1.0:
            return float(self.max)  # type: ignore[arg-type]
        if q == 0.0:
            return float(self.min)  # type: ignore[arg-type]
        rank = max(1, math.ceil(q * self.count))   # 1-based rank of the answer
        seen = 0
        for k in sorted(self.counts):
            c = self.counts[k]
            if seen + c >= rank:
                lo, hi = self.edges(k)
                frac = (rank - seen - 0.5) / c
                est = lo * (hi / lo) ** frac
                return float(min(max(est, self.min), self.max))  # type: ignore[type-var]
            seen += c
        return float(self.max)  # type: ignore[arg-type]

    def quantiles(self, qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float]:
        out = {_qname(q): self.quantile(q) for q in qs}
        out["max"] = float(self.max) if self.max is not None else 0.0
        return out

    def summary(self) -> dict:
        if not self.count:
            return {"count": 0}
        return {"count": self.count, "total": self.total, "min": self.min, "mean": self.mean,
                **self.quantiles()}

    # -- JSON
    def to_dict(self) -> dict:
        return {"buckets_per_octave": self.buckets_per_octave, "count": self.count, "total": self.total,
                "min": self.min, "max": self.max, "counts": {str(k): c for k, c in sorted(self.counts.items())}}

    @classmethod
    def from_dict(cls, data: Mapping) -> "LengthHistogram":
        out = cls(int(data["buckets_per_octave"]))
        out.counts = {int(k): int(c) for k, c in data["counts"].items()}
        out.count, out.total = int(data["count"]), int(data["total"])
        out.min, out.max = data.get("min"), data.get("max")
        if sum(out.counts.values()) != out.count:
            raise LengthError("counts", data["counts"], f"bucket counts that add up to count = {out.count}")
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LengthHistogram) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"LengthHistogram({self.summary()})"


def _qname(q: float) -> str:
    return f"p{q * 100:g}"


def ks_statistic(a: LengthHistogram, b: LengthHistogram) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs,
    read at bucket edges (the only points where binned data knows them; this makes it conservative)."""
    if not (a.count and b.count):
        raise LengthError("histogram", "empty", "lengths on both sides of a two-sample test")
    ca = cb = 0
    d = 0.0
    for k in sorted(a.counts.keys() | b.counts.keys()):
        ca += a.counts.get(k, 0)
        cb += b.counts.get(k, 0)
        d = max(d, abs(ca / a.count - cb / b.count))
    return d


def ks_critical(n: int, m: int, alpha: float) -> float:
    """The asymptotic critical value of the two-sample KS statistic for sizes n, m at level alpha:
    c(alpha) * sqrt((n + m) / (n m)), c(alpha) = sqrt(-ln(alpha / 2) / 2)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


@dataclass(frozen=True)
class DriftReport:
    drifted: bool
    shifts: Mapping[str, Mapping[str, float]]   # quantile name -> {"reference", "recent", "relative"}
    reference_count: int
    recent_count: int
    reason: str
    ks: Mapping[str, float] | None = None       # {"statistic", "critical", "alpha"} once both windows are full

    def to_dict(self) -> dict:
        return {"drifted": self.drifted, "shifts": {k: dict(v) for k, v in self.shifts.items()},
                "reference_count": self.reference_count, "recent_count": self.recent_count, "reason": self.reason,
                "ks": dict(self.ks) if self.ks else None}


class DriftDetector:
    """Reference window vs the recent one (each `window` batches and at least `min_samples` lengths):
    drift when the two differ significantly (KS at level `alpha`) and a high quantile moved by more
    than `threshold`."""

    def __init__(self, window: int = 8, threshold: float = 0.25, quantiles: Sequence[float] = DEFAULT_QUANTILES,
                 min_samples: int = 256, buckets_per_octave: int = 8, alpha: float = DEFAULT_ALPHA):
        if not (isinstance(window, int) and window >= 1):
            raise LengthError("window", window, "a number of batches >= 1")
        if not (threshold > 0):
            raise LengthError("threshold", threshold, "a relative shift > 0 (0.25 = 25%)")
        # A shift smaller than one bucket cannot be told from bucketing error.
        width = 2.0 ** (1.0 / buckets_per_octave) - 1.0
        if threshold <= width:
            raise LengthError("threshold", threshold, f"more than one bucket width ({width:.3f}); raise it or "
                                                      "use more buckets_per_octave")
        if not quantiles or any(not 0 < q <= 1 for q in quantiles):
            raise LengthError("quantiles", list(quantiles), "quantiles in (0, 1], at least one")
        if not (isinstance(alpha, float) and 0 < alpha < 1):
            raise LengthError("alpha", alpha, "a significance level in (0, 1), e.g. 0.001")
        self.window, self.threshold, self.quantile_levels = window, float(threshold), tuple(quantiles)
        self.alpha = alpha
        self.min_samples, self.buckets_per_octave = int(min_samples), buckets_per_octave
        self.reference = LengthHistogram(buckets_per_octave)
        self.reference_batches = 0
        self.recent: deque[LengthHistogram] = deque()
        self.lifetime = LengthHistogram(buckets_per_octave)

    def observe(self, lengths: Iterable[int]) -> DriftReport:
        """Add one batch's lengths; returns the check after it."""
        h = LengthHistogram.of(lengths, self.buckets_per_octave)
        self.lifetime.absorb(h)
        if not self._full(self.reference_batches, self.reference.count):   # still filling the reference
            self.reference.absorb(h)
            self.reference_batches += 1
        self.recent.append(h)
        while len(self.recent) > self.window and \
                self._full(len(self.recent) - 1, sum(x.count for x in self.recent) - self.recent[0].count):
            self.recent.popleft()
        return self.check()

    def _full(self, batches: int, count: int) -> bool:
        """A window of `batches` batches holding `count` lengths is full."""
        return batches >= self.window and count >= self.min_samples

    def recent_histogram(self) -> LengthHistogram:
        out = LengthHistogram(self.buckets_per_octave)
        for h in self.recent:
            out.absorb(h)
        return out

    def check(self) -> DriftReport:
        recent = self.recent_histogram()
        if not self._full(self.reference_batches, self.reference.count):
            return DriftReport(False, {}, self.reference.count, recent.count, "reference window still filling")
        if min(self.reference.count, recent.count) < self.min_samples:
            return DriftReport(False, {}, self.reference.count, recent.count,
                               f"fewer than {self.min_samples} lengths in a window")
        shifts, moved = {}, []
        for q in self.quantile_levels:
            ref, now = self.reference.quantile(q), recent.quantile(q)
            rel = now / ref - 1.0
            shifts[_qname(q)] = {"reference": ref, "recent": now, "relative": rel}
            if abs(rel) > self.threshold:
                moved.append(f"{_qname(q)} {ref:g} -> {now:g} ({rel:+.0%})")
        d, crit = ks_statistic(self.reference, recent), ks_critical(self.reference.count, recent.count, self.alpha)
        ks = {"statistic": d, "critical": crit, "alpha": self.alpha}
        test = f"KS D = {d:.3f} {'>' if d > crit else '<='} {crit:.3f} (alpha {self.alpha:g}, n = {self.reference.count}, {recent.count})"
        if not moved:
            reason = f"within ±{self.threshold:.0%}"
        else:
            reason = "; ".join(moved) + f" beyond ±{self.threshold:.0%}, " + (
                test if d > crit else f"but within sampling noise: {test}")
        return DriftReport(bool(moved) and d > crit, shifts, self.reference.count, recent.count, reason, ks)

    def to_dict(self) -> dict:
        return {"window": self.window, "threshold": self.threshold, "quantiles": list(self.quantile_levels),
                "min_samples": self.min_samples, "buckets_per_octave": self.buckets_per_octave, "alpha": self.alpha,
                "reference": self.reference.to_dict(), "reference_batches": self.reference_batches,
                "recent": [h.to_dict() for h in self.recent], "lifetime": self.lifetime.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping) -> "DriftDetector":
        out = cls(int(data["window"]), float(data["threshold"]), tuple(data["quantiles"]), int(data["min_samples"]),
                  int(data["buckets_per_octave"]), float(data["alpha"]))
        out.reference = LengthHistogram.from_dict(data["reference"])
        out.reference_batches = int(data["reference_batches"])
        out.recent.extend(LengthHistogram.from_dict(h) for h in data["recent"])
        out.lifetime = LengthHistogram.from_dict(data["lifetime"])
        return out
