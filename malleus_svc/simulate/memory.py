"""Per-device peak memory of a plan, from the cost model and the simulated schedule.

Why separate from the planner's memory rows: the planner assumes S_i - j micro-batches in flight
at stage j (the Malleus memory model), an upper bound. The simulator reports what the schedule actually
reaches, min(m_i, S_i - j) under 1F1B, so a plan that runs fewer micro-batches than stages is
not flagged for memory it never uses, and a schedule bug that keeps more alive would show up.

Per device of stage j of pipeline i, in MB (the planner's formula with the reached depth d):
    h · (K[d] · l + E · [first or last stage]) + X0,   h = tp / |g|
(E of the first and of the last stage where the profile tells them apart)
(the parts a group does not split unscaled: `MemoryProfile.block_mb`, `ends_mb`)
flagged `oom` when above the device's memory C, and `over_budget` when above C - δ (the margin
the planner keeps).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from ..planner.problem import PlannerProblem
from .timeline import SimResult


@dataclass(frozen=True)
class StageMemory:
    pipeline: int
    stage: int
    devices: tuple[int, ...]
    blocks: int
    in_flight: int
    peak_mb: float

    def to_dict(self) -> dict:
        return {"pipeline": self.pipeline, "stage": self.stage, "devices": list(self.devices),
                "blocks": self.blocks, "in_flight": self.in_flight, "peak_mb": round(self.peak_mb, 1)}


def device_peak_mb(problem: PlannerProblem, tp_size: int, blocks: int, in_flight: int, ends: tuple[bool, bool],
                   pipelines: int = 1, recompute: str = "none") -> float:
    """Peak MB on one device of a group of `tp_size` holding `blocks` blocks with `in_flight` micro-batches
    alive, its stage the (first, last) of its pipeline or neither (`ends`), in a plan of `pipelines`
    pipelines (they share a sharded optimizer's state), the stage of recompute mode `recompute`."""
    mem = problem.memory.over(pipelines)
    h = problem.tp / tp_size
    per_block = mem.block_mb(h, max(1, in_flight), recompute)   # every stage runs >= 1 micro-batch
    # the block being recomputed
    once = mem.activations_mb(h) if recompute == "full" and mem.activation_mb else 0.0
    return per_block * blocks + once + mem.ends_mb(h, *ends) + mem.reserved_mb


def stage_memory(plan: Plan, problem: PlannerProblem, sim: SimResult) -> list[StageMemory]:
    out = []
    for i, (pipe, pres) in enumerate(zip(plan.pipelines, sim.pipelines)):
        last = len(pipe.stages) - 1
        for j, (st, sres) in enumerate(zip(pipe.stages, pres.stages)):
            peak = device_peak_mb(problem, st.tp, st.num_layers, sres.max_in_flight, (j == 0, j == last), len(plan.pipelines),
                                  st.recompute)
            out.append(StageMemory(i, j, st.devices, st.num_layers, sres.max_in_flight, peak))
    return out


@dataclass(frozen=True)
class MemoryReport:
    stages: tuple[StageMemory, ...]
    capacity_mb: float
    budget_mb: float          # C - δ

    @property
    def peak_mb(self) -> float:
        return max(s.peak_mb for s in self.stages)

    @property
    def oom(self) -> list[StageMemory]:
        return [s for s in self.stages if s.peak_mb > self.capacity_mb]

    @property
    def over_budget(self) -> list[StageMemory]:
        return [s for s in self.stages if s.peak_mb > self.budget_mb + 1e-6]


def memory_report(plan: Plan, problem: PlannerProblem, sim: SimResult) -> MemoryReport:
    mem = problem.memory
    return MemoryReport(tuple(stage_memory(plan, problem, sim)), mem.gpu_memory_mb,
                        mem.gpu_memory_mb - mem.safety_margin_mb)
