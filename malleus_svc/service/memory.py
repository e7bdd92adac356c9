"""`malleus memory SCENARIO [--plan PLAN]`: per-device peak memory of a plan, measured on the real
modules built on the meta device (`runtime.memory`), beside the planner's memory model.

The planner's figure is its memory row for the stage at the same depth,
h · (K[d] · l + E · [first or last stage]) + X0 with what a group does not split left unscaled
(`simulate.memory.device_peak_mb`), with K and E as the planner got them: the scenario's `profile:`
where it gives them, this runtime's model (`costmodel.analytic`) otherwise. The `analytic` column is
that row with the runtime's model, whatever the scenario says. Each distinct stage shape is built once.
"""
from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

from malleus_svc.config import ConfigError
from malleus_svc.config.presets import ModelShape
from malleus_svc.config.scenario import Scenario
from malleus_svc.costmodel import analytic
from malleus_svc.plan import RECOMPUTE_MARK, Plan, PlanError
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.describe import ranges
from malleus_svc.planner.problem import PlannerProblem
from malleus_svc.planner.search import check_plan_fits
from malleus_svc.runtime.engine import validate_plan_for_model
from malleus_svc.runtime.memory import StageFootprint, StageMemory, stage_footprint
from malleus_svc.simulate.memory import device_peak_mb

GB = 1024.0 ** 3
MB = 1024.0 ** 2
GAP_TARGET = 0.10    # the planner's model should be within 10% of the measured figure


@dataclasses.dataclass(frozen=True)
class StageReport:
    pipeline: int
    stage: int
    devices: tuple[int, ...]
    layers: int
    tp: int
    in_flight: int
    measured: StageMemory
    reserved_mb: float
    planner_mb: float
    analytic_mb: float
    capacity_mb: float
    unsharded: int           # the fp32 masters' and Adam moments' bytes were the optimizer not sharded
    recompute: str = "none"  # the stage's recompute mode (`plan.RECOMPUTE`)

    @property
    def total_mb(self) -> float:
        return self.measured.total / MB + self.reserved_mb

    def gap(self, model_mb: float) -> float:
        """(model - measured) / measured: negative when the model promises less than the stage takes."""
        return model_mb / self.total_mb - 1.0

    @property
    def fits(self) -> bool:
        return self.total_mb <= self.capacity_mb

    def to_dict(self) -> dict:
        return {"pipeline": self.pipeline, "stage": self.stage, "devices": list(self.devices),
                "layers": self.layers, "tp": self.tp, "in_flight": self.in_flight, "recompute": self.recompute,
                **{f"{k}_mb": round(v / MB, 1) for k, v in self.measured.terms()},
                "reserved_mb": self.reserved_mb, "total_mb": round(self.total_mb, 1),
                "planner_mb": round(self.planner_mb, 1), "planner_gap": round(self.gap(self.planner_mb), 4),
                "analytic_mb": round(self.analytic_mb, 1), "analytic_gap": round(self.gap(self.analytic_mb), 4),
                "capacity_mb": self.capacity_mb, "fits": self.fits}


def _analytic_problem(sc: Scenario, problem: PlannerProblem) -> PlannerProblem:
    mem = problem.memory
    auto = analytic.memory_profile(sc.shape, sc.tp, sc.pp, sc.micro_batch, mem.gpu_memory_mb, mem.reserved_mb,
                                   mem.safety_margin_mb, sc.device, bool(sc.shard_optimizer))
    return dataclasses.replace(problem, memory=auto)


def plan_memory(sc: Scenario, plan: Plan) -> list[StageReport]:
    """One row per stage of `plan`: measured terms at its 1F1B depth, the planner's and analytic rows."""
    if sc.shape is None:
        raise ConfigError("model", sc.num_layers, "a model shape (a preset or hidden/heads/ffn/vocab/seq_len): "
                                                  "memory is measured on the modules built from it")
    problem = build_problem(sc)
    check_plan_fits(problem, plan)
    try:
        validate_plan_for_model(sc.shape, plan)
    except ValueError as e:
        raise PlanError(str(e)) from None
    auto = _analytic_problem(sc, problem)
    rows, pipelines = [], len(plan.pipelines)
    for i, pipe in enumerate(plan.pipelines):
        last = len(pipe.stages) - 1
        for j, st in enumerate(pipe.stages):
            depth = min(len(pipe.stages) - j, pipe.micro_batches)
            ends = (j == 0, j == last)
            recompute = st.recompute
            measured = _footprint(sc.shape, st.num_layers, j == 0, j == last, st.tp, sc.micro_batch,
                                  recompute).at_depth(depth)
            rows.append(StageReport(
                i, j, tuple(st.devices), st.num_layers, st.tp, depth,
                measured.sharded_over(pipelines) if sc.shard_optimizer else measured, problem.memory.reserved_mb,
                device_peak_mb(problem, st.tp, st.num_layers, depth, ends, pipelines, recompute),
                device_peak_mb(auto, st.tp, st.num_layers, depth, ends, pipelines, recompute), sc.gpu_memory_mb,
                measured.params + measured.adam, recompute))
    return rows


@lru_cache(maxsize=64)
def _footprint(shape: ModelShape, layers: int, first: bool, last: bool, tp: int, micro_batch: int,
               recompute: str = "none") -> StageFootprint:
    return stage_footprint(shape, layers, has_embedding=first, has_head=last, tp=tp, micro_batch=micro_batch,
                           recompute=recompute)


_TERMS = ("params", "grads", "adam", "working", "activations", "boundary", "logits")


def memory_table(rows: list[StageReport]) -> str:
    head = ("pipe", "stage", "devices", "layers", "tp", "in flight", *_TERMS, "reserved", "measured",
            "planner", "gap", "analytic", "gap", "device", "")
    table = [head]
    for r in rows:
        terms = dict(r.measured.terms())
        table.append((str(r.pipeline) if r.stage == 0 else "", str(r.stage), ranges(r.devices),
                      f"{r.layers}{RECOMPUTE_MARK[r.recompute]}",
                      str(r.tp), str(r.in_flight), *(f"{terms[t] / GB:.1f}" for t in _TERMS),
                      f"{r.reserved_mb * MB / GB:.1f}", f"{r.total_mb * MB / GB:.1f}",
                      f"{r.planner_mb * MB / GB:.1f}", f"{100 * r.gap(r.planner_mb):+.0f}%",
                      f"{r.analytic_mb * MB / GB:.1f}", f"{100 * r.gap(r.analytic_mb):+.0f}%",
                      f"{r.capacity_mb * MB / GB:.1f}", "OK" if r.fits else "OVER"))
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(rows: list[StageReport]) -> str:
    over = [r for r in rows if not r.fits]
    worst = max(rows, key=lambda r: r.total_mb)
    planner = max(rows, key=lambda r: abs(r.gap(r.planner_mb)))
    auto = max(rows, key=lambda r: abs(r.gap(r.analytic_mb)))
    fit = (f"every device fits (largest {worst.total_mb / 1024:.1f} of {worst.capacity_mb / 1024:.1f} GB)" if not over
           else f"{len(over)} of {len(rows)} stages OVER device memory (largest {worst.total_mb / 1024:.1f} GB on "
                f"pipeline {worst.pipeline} stage {worst.stage}, devices have {worst.capacity_mb / 1024:.1f} GB)")
    return (f"{fit}; planner's model within {100 * abs(planner.gap(planner.planner_mb)):.0f}% of the measured figure "
            f"(worst: pipeline {planner.pipeline} stage {planner.stage}), analytic model within "
            f"{100 * abs(auto.gap(auto.analytic_mb)):.0f}%; target {100 * GAP_TARGET:.0f}%")


def _spread(values) -> str:
    values = [v / GB for v in values]
    return f"{min(values):.1f}-{max(values):.1f}"


def measured_profile(sc: Scenario) -> tuple[list[float], float]:
    """`layer_memory_mb` (d = max(pp, 2)..1) and `embedding_memory_mb` for the scenario's `profile:`,
    measured: a block is the difference of 2- and 1-block stages at the scenario's TP (boundary
    tensors cancel), E the larger extra of the first and the last stage over a 1-block middle one."""
    def total_mb(layers: int, first: bool, last: bool, depth: int) -> float:
        return _footprint(sc.shape, layers, first, last, sc.tp, sc.micro_batch).at_depth(depth).total / MB

    depths = range(max(sc.pp, 2), 0, -1)
    layer_mb = [round(total_mb(2, False, False, d) - total_mb(1, False, False, d), 1) for d in depths]
    ends = max(total_mb(1, True, False, 1), total_mb(1, False, True, 1)) - total_mb(1, False, False, 1)
    return layer_mb, round(ends, 1)


def vocab_split_line(sc: Scenario, plan: Plan) -> str:
    """What the embedding and the head (with its loss) add to a device at each TP size the plan's
    first and last stages have: 1/t of their state and logits, as they are split by vocabulary rows."""
    def extra_gb(tp: int, first: bool, last: bool) -> float:
        one = _footprint(sc.shape, 1, first, last, tp, sc.micro_batch).at_depth(1).total
        return (one - _footprint(sc.shape, 1, False, False, tp, sc.micro_batch).at_depth(1).total) / GB

    ends = sorted({pipe.stages[0].tp for pipe in plan.pipelines} | {pipe.stages[-1].tp for pipe in plan.pipelines})
    sizes = ", ".join(f"TP {t} {extra_gb(t, True, False):.1f} / {extra_gb(t, False, True):.1f}" for t in ends)
    return f"embedding / head and loss per device, split by vocabulary rows: {sizes} GB"


def print_memory(sc: Scenario, plan: Plan, as_json: bool = False) -> int:
    """The table and the verdict of `malleus memory`; 0 if every device fits, 1 if not."""
    rows = plan_memory(sc, plan)
    print(f"memory of plan {plan.plan_id} for {sc.name}: micro-batch {sc.micro_batch} x {sc.shape.seq_len} tokens; "
          f"GB per device (2^30 bytes); gap = planner / measured - 1")
    print(memory_table(rows))
    if any(r.recompute == "selective" for r in rows):
        print("layers marked s: the stage recomputes its blocks' norm and SwiGLU outputs in backward (it keeps "
              "neither)")
    if any(r.recompute == "full" for r in rows):
        print("layers marked r: the stage recomputes its blocks in backward (it keeps each block's input, "
              "and one block's activations while it is recomputed)")
    if sc.shard_optimizer:
        print(f"optimizer sharded among the plan's {len(plan.pipelines)} pipelines: fp32 masters and Adam moments "
              f"{_spread(r.unsharded for r in rows)} GB per device unsharded, "
              f"{_spread(r.measured.params + r.measured.adam for r in rows)} GB sharded")
    print(vocab_split_line(sc, plan))
    print(verdict(rows))
    if as_json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    return 0 if all(r.fits for r in rows) else 1
