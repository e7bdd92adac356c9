"""The training loop on the driver: plan -> workers -> N steps -> metrics and progress.

`Trainer` owns the sampler (the single source of sample order: a global batch is the next B
samples of a seeded stream), the straggler emulation schedule (demos/tests only, off unless the
job lists `emulate` entries) and the output: one JSON line per step and a progress line on stderr
that reads well in a non-TTY log (plain lines, no carriage returns).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any, Callable

from malleus_svc.config.job import JobConfig
from malleus_svc.plan import Plan, PlanError

from .cluster import StepRecord, WorkerGroup
from .data import GlobalSampler
from .straggler import EmulationSchedule


def optim_config(job: JobConfig):
    from .engine import OptimConfig

    t = job.train
    return OptimConfig(lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay, grad_clip=t.grad_clip)


def check_plan_for_job(plan: Plan, job: JobConfig, where: str = "plan") -> Plan:
    """A plan given by the user must fit the job: device count, node size, layers, global batch."""
    sc = job.scenario
    problems = []
    if plan.num_devices != sc.num_devices:
        problems.append(f"it is for {plan.num_devices} devices, the job has {sc.num_devices} "
                        f"(cluster.nodes {sc.nodes} x cluster.gpus_per_node {sc.gpus_per_node})")
    if plan.gpus_per_node != sc.gpus_per_node:
        problems.append(f"it assumes gpus_per_node {plan.gpus_per_node}, the job has {sc.gpus_per_node}")
    if plan.num_layers != sc.num_layers:
        problems.append(f"its stages cover {plan.num_layers} layers, the model has {sc.num_layers}")
    if plan.global_batch != sc.global_batch:
        problems.append(f"its global batch is {plan.global_batch} (micro_batch_size {plan.micro_batch_size} x "
                        f"{plan.num_micro_batches} micro-batches), the job's batch.global is {sc.global_batch}")
    if problems:
        raise PlanError(f"{where} {plan.plan_id} does not match the job {job.name!r}: " + "; ".join(problems))
    return plan


def make_plan(job: JobConfig) -> Plan:
    """The planner's plan for the scenario (its rates and exclusions)."""
    from malleus_svc.planner import plan as solve

    return check_plan_for_job(solve(job.scenario.problem()).plan, job, "the planner's plan")


class Trainer:
    def __init__(self, job: JobConfig, plan: Plan, group: WorkerGroup, *,
                 metrics_out: str | Path | None = None, progress: IO[str] | None = sys.stderr,
                 progress_every: int | None = None, on_step: Callable[[StepRecord], None] | None = None):
        self.job, self.group = job, group
        self.plan = check_plan_for_job(plan, job)
        self.metrics_path = Path(metrics_out) if metrics_out else None
        self.progress, self.progress_every, self.on_step = progress, progress_every, on_step
        self.schedule = EmulationSchedule(job.emulate)
        self.sampler: GlobalSampler | None = None
        self._factors: dict[int, float] = {}
        self.records: list[StepRecord] = []

    def setup(self) -> None:
        d = self.job.data
        n = self.group.set_data(d.spec(), d.mode, d.seq_len)
        self.sampler = GlobalSampler(n, self.plan.global_batch, seed=self.job.train.seed)
        self.group.apply_plan(self.plan, self.job.shape, seed=self.job.train.seed, optim=optim_config(self.job))

    def _emulate(self, step: int) -> None:
        want = self.schedule.factors_at(step, range(self.group.num_devices))
        changed = {dev: f for dev, f in want.items() if self._factors.get(dev, 1.0) != f}
        if changed:
            self.group.set_slowdowns(changed)
            self._factors.update(changed)

    def run(self, steps: int | None = None) -> list[StepRecord]:
        steps = self.job.train.steps if steps is None else steps
        if self.sampler is None:
            self.setup()
        every = self.progress_every or max(1, steps // 50)
        out = self.metrics_path.open("a") if self.metrics_path else None
        t_start, tokens_total = time.perf_counter(), 0
        try:
            for i in range(steps):
                step = len(self.records)
                if self.schedule.entries:
                    self._emulate(step)
                rec = self.group.step(self.sampler.next_global_batch(self.plan.global_batch))
                rec.step = step
                self.records.append(rec)
                tokens_total += rec.tokens
                if out is not None:
                    line = rec.metrics()
                    line.update(epoch=self.sampler.epoch, sampler_position=self.sampler.position)
                    out.write(json.dumps(line) + "\n")
                    out.flush()
                if self.progress is not None and (i % every == 0 or i == steps - 1):
                    elapsed = time.perf_counter() - t_start
                    self.progress.write(
                        f"[{self.job.name}] step {step + 1}/{steps} loss {rec.loss:.4f} "
                        f"tok/s {rec.tokens / rec.iteration_seconds:,.0f} (avg {tokens_total / elapsed:,.0f}) "
                        f"iter {rec.iteration_seconds:.3f}s plan {rec.plan_id}\n")
                    self.progress.flush()
                if self.on_step is not None:
                    self.on_step(rec)
        finally:
            if out is not None:
                out.close()
        return self.records


def describe_group(group: WorkerGroup) -> str:
    nodes: dict[str, list[int]] = {}
    for info in group.infos:
        nodes.setdefault(info["ip"], []).append(info["device"])
    where = ", ".join(f"{ip}: devices {devs}" for ip, devs in nodes.items())
    return (f"{group.num_devices} workers ({'GPU' if group.use_gpu else f'{group.cpus_per_worker:g} CPU each'}, "
            f"{group.backend}) on {where}; rendezvous {group.rendezvous}")


def summary(records: list[StepRecord]) -> dict[str, Any]:
    if not records:
        return {"steps": 0}
    return {"steps": len(records), "first_loss": records[0].loss, "last_loss": records[-1].loss,
            "mean_iteration_seconds": sum(r.iteration_seconds for r in records) / len(records)}
