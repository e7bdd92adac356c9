"""Time and memory of a micro-batch as a function of the lengths of the sequences packed into it.

Time (Hydraulis App. B.2). One block, forward + backward, one micro-batch packed from
sequences of lengths l_1..l_n, on a TP group of degree t:

    per_layer(t) = a_t·Σ l_i² + b_t·Σ l_i + d_t·n + c_t

* a: attention, quadratic in each sequence's own length (varlen attention never crosses a
  packing boundary, so 32 packed 1K sequences cost far less than one 32K sequence);
* b: GEMMs, norms, TP collectives: linear in tokens;
* d: a per-sequence overhead. Zero for flash-attn varlen (one kernel per micro-batch); real on the
  CPU stand-in, where attention is one SDPA call per packed sequence. Setting c = 0 and d = c
  also reproduces the paper's own convention (c charged per original sequence);
* c: fixed cost of one micro-batch (launches, Python). Charged once per micro-batch, as the
  authors' code does: charging it per sequence makes packing look worse than it is.

A stage holding `layers` blocks on devices slowed by straggling rate ρ (the slowest device of its
TP group) takes ρ · layers · per_layer. A pipeline's 1F1B time for micro-batches w_1..w_V, with
w_1 the one whose slowest stage is slowest (generalising the paper's (PP − 1 + V)·max):

    T = Σ_v max_s τ_s(w_v) + (Σ_s τ_s(w_1) − max_s τ_s(w_1))

For identical stages this is the authors' Σ_v w_v + (PP − 1)·w_max, exactly the makespan of a
proportionate flow shop in any micro-batch order. For stages of one TP degree that differ in
κ = ρ·layers it reads κ*·Σ_v f(w_v) + (Σ_s κ_s − κ*)·f(w_max) and never falls below the flow-shop
makespan in any order (checked by simulation in the tests). It is a forward-flow model of 1F1B,
not a schedule simulation. `eq1_time` is the paper's looser max_v w_v · (PP − 1 + V) (Eq. 1),
kept for the published test vectors.

Memory (Hydraulis App. B.1) is linear in tokens: a stage keeps its activations for every micro-batch in
flight, and under 1F1B stage s (0-based) of S has S − s of them. `max_tokens_per_stage` turns
that into the most tokens one micro-batch may hold on each stage (so the longest sequence a
pipeline can take is the minimum over its stages), for uneven layer splits too.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..config.errors import ConfigError


class LengthError(ConfigError):
    """A sequence, micro-batch or length-model input that cannot be used (field, value, accepted)."""


# ---------------------------------------------------------------------------- coefficients
@dataclass(frozen=True)
class Coeffs:
    """Per-layer forward+backward seconds of one micro-batch: a·Σl² + b·Σl + d·n + c."""

    a: float
    b: float
    c: float = 0.0
    d: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise LengthError(f"Coeffs.{name}", v, "a finite number >= 0 (times cannot fall with length)")

    def seq(self, length: float) -> float:
        """What one sequence adds to a micro-batch (everything but c)."""
        return self.a * length * length + self.b * length + self.d

    def micro_batch(self, lengths: Iterable[float]) -> float:
        ls = list(lengths)
        if not ls:
            return 0.0
        return sum(self.seq(x) for x in ls) + self.c

    def to_dict(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c, "d": self.d}


# ---------------------------------------------------------------------------- pipeline shapes
@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage as the length model sees it: blocks held, straggling rate, TP degree."""

    layers: int
    rate: float = 1.0
    tp: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.layers, int) and self.layers >= 0):
            raise LengthError("StageSpec.layers", self.layers, "an integer >= 0")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise LengthError("StageSpec.rate", self.rate, "a finite number > 0 (1.0 = healthy)")
        if not (isinstance(self.tp, int) and self.tp >= 1):
            raise LengthError("StageSpec.tp", self.tp, "an integer >= 1")

    @property
    def weight(self) -> float:
        """κ = ρ·layers: how many healthy-layer times one micro-batch costs on this stage."""
        return self.rate * self.layers


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline: its stages in order and the most tokens one micro-batch may hold (memory)."""

    stages: tuple[StageSpec, ...]
    max_tokens: float = math.inf

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise LengthError("PipelineSpec.stages", self.stages, "at least one stage")
        if not (self.max_tokens > 0):
            raise LengthError("PipelineSpec.max_tokens", self.max_tokens, "a number > 0 (tokens per micro-batch)")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def uniform(cls, stages: int, layers_per_stage: int = 1, tp: int = 1, rates: Sequence[float] | None = None,
                max_tokens: float = math.inf) -> "PipelineSpec":
        rates = list(rates) if rates is not None else [1.0] * stages
        if len(rates) != stages:
            raise LengthError("rates", rates, f"one rate per stage ({stages})")
        return cls(tuple(StageSpec(layers_per_stage, r, tp) for r in rates), max_tokens)

    @classmethod
    def from_plan(cls, pipeline, rates: Mapping[int, float] | Sequence[float] | None = None,
                  max_tokens: float = math.inf) -> "PipelineSpec":
        """From a `plan.Pipeline`: a stage's rate is its slowest device's (1.0 where unknown)."""
        def rate(dev: int) -> float:
            if rates is None:
                return 1.0
            if isinstance(rates, Mapping):
                return float(rates.get(dev, 1.0))
            return float(rates[dev])
        return cls(tuple(StageSpec(st.num_layers, max(rate(d) for d in st.devices), st.tp)
                         for st in pipeline.stages), max_tokens)


# ---------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class LengthCost:
    """Per-layer micro-batch time by TP degree; stage and 1F1B pipeline times built from it."""

    coeffs: Mapping[int, Coeffs] = field(hash=False)
    unit: str = "s"
    meta: Mapping[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.coeffs:
            raise LengthError("LengthCost.coeffs", dict(self.coeffs), "one Coeffs per TP degree, at least one")
        object.__setattr__(self, "coeffs", {int(k): v for k, v in dict(self.coeffs).items()})

    @classmethod
    def single(cls, a: float, b: float, c: float = 0.0, d: float = 0.0, tp: int = 1, unit: str = "s") -> "LengthCost":
        return cls({tp: Coeffs(a, b, c, d)}, unit)

    def at(self, tp: int | None = None) -> Coeffs:
        if tp is None and len(self.coeffs) == 1:
            return next(iter(self.coeffs.values()))
        try:
            return self.coeffs[tp]  # type: ignore[index]
        except KeyError:
            raise LengthError("tp", tp, f"a TP degree this model was fitted for: {sorted(self.coeffs)}") from None

    def merged(self, other: "LengthCost") -> "LengthCost":
        return LengthCost({**self.coeffs, **other.coeffs}, self.unit)

    # -- one micro-batch
    def predict(self, lengths: Iterable[float], layers: int = 1, rate: float = 1.0, tp: int | None = None) -> float:
        """Time of one micro-batch packed from `lengths` on `layers` blocks slowed by `rate`."""
        return rate * layers * self.at(tp).micro_batch(lengths)

    def stage_time(self, lengths: Sequence[float], stage: StageSpec) -> float:
        return self.predict(lengths, stage.layers, stage.rate, stage.tp)

    def stage_times(self, lengths: Sequence[float], stages: Sequence[StageSpec]) -> list[float]:
        return [self.stage_time(lengths, s) for s in stages]

    # -- one pipeline
    def pipeline_time(self, micro_batches: Sequence[Sequence[float]], stages: Sequence[StageSpec]) -> float:
        """1F1B time of `micro_batches` (each a list of lengths) through `stages` (module docstring)."""
        taus = [self.stage_times(mb, stages) for mb in micro_batches if len(mb)]
        if not taus:
            return 0.0
        first = max(taus, key=max)   # the micro-batch with the slowest bottleneck fills the pipeline
        return sum(max(t) for t in taus) + sum(first) - max(first)

    def eq1_time(self, micro_batches: Sequence[Sequence[float]], stages: Sequence[StageSpec]) -> float:
        """The paper's Eq. 1 bound: slowest (stage, micro-batch) slot × (stages − 1 + V)."""
        taus = [self.stage_times(mb, stages) for mb in micro_batches if len(mb)]
        if not taus:
            return 0.0
        return max(max(t) for t in taus) * (len(stages) - 1 + len(taus))

    # -- per-sequence terms used by stage-1 dispatch (no c: it belongs to micro-batches)
    def seq_stage_costs(self, length: float, stages: Sequence[StageSpec]) -> list[float]:
        """What one sequence adds to each stage's time."""
        return [s.weight * self.at(s.tp).seq(length) for s in stages]

    def fill_cost(self, length: float, stages: Sequence[StageSpec]) -> float:
        """Pipeline fill/drain of a micro-batch holding only this sequence: all stages but the slowest."""
        costs = self.seq_stage_costs(length, stages)
        return sum(costs) - max(costs)

    def micro_batch_overhead(self, stages: Sequence[StageSpec]) -> float:
        """c of one micro-batch through every stage: the least any non-empty pipeline pays for it."""
        return sum(s.weight * self.at(s.tp).c for s in stages)

    # -- serialisation
    def to_dict(self) -> dict:
        return {"unit": self.unit, "coeffs": {str(k): v.to_dict() for k, v in sorted(self.coeffs.items())}}

    @classmethod
    def from_dict(cls, data: Mapping) -> "LengthCost":
        return cls({int(k): Coeffs(**v) for k, v in data["coeffs"].items()}, data.get("unit", "s"))

    # -- fitting
    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[float], float]], *, tp: int = 1, layers: int = 1,
            per_sequence: bool = True, relative: bool = True) -> tuple["LengthCost", list[float]]:
        """Least-squares fit of one TP degree's coefficients from (lengths, seconds) measurements.

        `seconds` is the time of one micro-batch through `layers` blocks; coefficients are per
        layer. `relative` weights each row by 1/seconds, so the fit minimises relative errors
        (what a planner comparing pipelines cares about) rather than letting the longest
        micro-batches dominate. Coefficients are constrained >= 0 (`nnls`). Returns the model and
        the relative error (predicted / measured − 1) of every sample.
        """
        if len(samples) < 2:
            raise LengthError("samples", len(samples), "at least 2 (lengths, seconds) measurements")
        rows, ys = [], []
        for i, (ls, secs) in enumerate(samples):
            ls = [float(x) for x in ls]
            if not ls or min(ls) <= 0:
                raise LengthError(f"samples[{i}].lengths", ls, "a non-empty list of positive lengths")
            if not (math.isfinite(secs) and secs > 0):
                raise LengthError(f"samples[{i}].seconds", secs, "a finite time > 0")
            rows.append(features(ls))
            ys.append(secs / layers)
        x, y = np.array(rows), np.array(ys)
        cols = [0, 1, 2, 3] if per_sequence else [0, 1, 3]
        w = 1.0 / y if relative else np.ones_like(y)
        coef = np.zeros(4)
        coef[cols] = nnls(x[:, cols] * w[:, None], y * w)
        model = cls({tp: Coeffs(a=float(coef[0]), b=float(coef[1]), d=float(coef[2]), c=float(coef[3]))})
        errs = [float(p / t - 1.0) for p, t in zip(x @ coef, y)]
        return model, errs


def features(lengths: Sequence[float]) -> list[float]:
    """[Σl², Σl, n, 1]: the regressors of one micro-batch, in Coeffs order a, b, d, c."""
    return [sum(x * x for x in lengths), float(sum(lengths)), float(len(lengths)), 1.0]


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares, exactly, for the handful of columns a cost model has.

    scipy is not a dependency, and with k <= 4 columns the optimum can be found by brute force:
    it is the unconstrained least-squares fit on some support set whose coefficients are all
    >= 0, so solving all 2^k supports and keeping the best feasible one is exact.
    """
    k = x.shape[1]
    if k > 10:
        raise LengthError("nnls columns", k, "at most 10 (brute force over supports)")
    # Scale columns so Σl² (1e5) and 1 (1) are solved at comparable magnitudes.
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_res = np.zeros(k), float(np.sum(y * y))
    for r in range(1, k + 1):
        for support in itertools.combinations(range(k), r):
            sol, *_ = np.linalg.lstsq(xs[:, support], y, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((xs[:, support] @ sol - y) ** 2))
            if res < best_res - 1e-15 * max(1.0, best_res):
                best_res = res
                best = np.zeros(k)
                best[list(support)] = sol
    return best / scale


# ---------------------------------------------------------------------------- memory
def max_tokens_per_stage(layers: Sequence[int], bytes_per_token_per_layer: float | Sequence[float],
                         static_bytes: float | Sequence[float], capacity_bytes: float | Sequence[float],
                         extra_bytes_per_token: float | Sequence[float] = 0.0,
                         micro_batches: int | None = None) -> list[int]:
    """The most tokens one micro-batch may hold on each stage of a pipeline under 1F1B.

    Stage s (0-based) of S keeps min(S − s, V) micro-batches of activations alive, each
    layers_s · tokens · bytes_per_token_per_layer_s bytes; `static_bytes` (weights, gradients,
    optimizer states, embedding, reserved) and `capacity_bytes` (usable memory after any safety
    margin) are per stage or one number for all. `extra_bytes_per_token` is charged once, not per
    in-flight micro-batch (e.g. the last stage's logits, live only while its micro-batch is there).
    The longest sequence a pipeline can take is min() of the result. 0 means the stage's static
    memory alone does not fit.
    """
    s_count = len(layers)
    if s_count == 0:
        raise LengthError("layers", list(layers), "one layer count per stage, at least one stage")

    def per_stage(name: str, v: float | Sequence[float]) -> list[float]:
        vals = [float(v)] * s_count if isinstance(v, (int, float)) else [float(x) for x in v]
        if len(vals) != s_count or any(not math.isfinite(x) or x < 0 for x in vals):
            raise LengthError(name, v, f"a number >= 0 or one per stage ({s_count})")
        return vals

    bpt = per_stage("bytes_per_token_per_layer", bytes_per_token_per_layer)
    static = per_stage("static_bytes", static_bytes)
    cap = per_stage("capacity_bytes", capacity_bytes)
    extra = per_stage("extra_bytes_per_token", extra_bytes_per_token)
    if micro_batches is not None and micro_batches < 1:
        raise LengthError("micro_batches", micro_batches, "an integer >= 1 or None (as many as the stages)")
    out = []
    for s in range(s_count):
        in_flight = s_count - s if micro_batches is None else min(s_count - s, micro_batches)
        per_token = in_flight * layers[s] * bpt[s] + extra[s]
        free = cap[s] - static[s]
        if free <= 0:
            out.append(0)
        elif per_token <= 0:
            out.append(2**62)   # nothing grows with tokens: unbounded, as a large int
        else:
            out.append(int(math.floor(free / per_token)))
    return out


def analytic_bytes_per_token_per_layer(shape, tp: int, device=None) -> float:
    """Activation bytes one block keeps per token for backward, from `costmodel.analytic`."""
    from ..costmodel.analytic import MB, DeviceSpec, activation_mb
    device = device or DeviceSpec()
    return activation_mb(shape, tp, 1, device) * MB / shape.seq_len
