"""The worker group as the coordinator uses it: what it calls, and the Ray implementation.

`WorkerGroupLike` is the whole surface the coordinator needs from the cluster; `RayWorkers` is
runtime.cluster.WorkerGroup plus a batched probe. Tests drive the coordinator with a fake of
this surface (a fake of the cluster, not of the coordinator)."""
from __future__ import annotations

import statistics
from typing import Any, Callable, Protocol, Sequence

from malleus_svc.plan import Plan
from malleus_svc.runtime.cluster import WorkerGroup, WorkerGroupError

from .workload import busy_seconds


class WorkerGroupLike(Protocol):
    num_devices: int
    plan: Plan | None
    gone: set[int]
    dataset: Any                    # the driver's copy; `lengths` when samples vary in length
    infos: list[dict]
    cpus_per_worker: float
    use_gpu: bool
    last_recovery_error: str | None

    @property
    def live(self) -> list[int]: ...
    def start(self) -> Any: ...
    def shutdown(self) -> None: ...
    def set_data(self, spec: dict, mode: str, seq_len: int) -> int: ...
    def apply_plan(self, plan: Plan, shape, *, seed: int = 0, optim=None, init: bool = True) -> Any: ...
    def load_pretrained(self, folder) -> None: ...
    def step(self, sample_ids: Sequence[int], assignment=None, lr: float | None = None) -> Any: ...  # a StepRecord
    def evaluate(self, batches: Sequence[Sequence[int]]) -> float: ...
    def migrate(self, new_plan: Plan, *, bucket_bytes: int) -> Any: ...           # a MigrationReport
    def probe(self, devices: Sequence[int]) -> Callable[[], list[dict]]: ...
    def set_slowdowns(self, factors: dict[int, float]) -> None: ...
    def pace(self, tokens: int, flops_per_second: float | None = None, bytes_per_second: float | None = None,
             block_seconds: float | None = None) -> Any: ...                    # a device_clock.Pace, or None
    def keep_op_costs(self) -> None: ...
    def refit_pace(self) -> Any: ...                                            # the Pace in force, or None
    def time_links(self, shape, boundary_tokens: int) -> Any: ...                 # a costmodel.profile.LinkTimes
    def length_sweep(self, shape, tps: Sequence[int], seq_len: int,
                     link_gbps: float) -> Any: ...                              # (LengthCost, reports), GPU jobs
    def recover(self, plan_for: Callable[[frozenset], Plan] | None = None) -> Any: ...   # a RecoveryReport
    def rejoinable(self) -> list[int]: ...
    def rejoin(self, devices: Sequence[int], plan_for: Callable[[frozenset], Plan]) -> list[int]: ...


class RayWorkers(WorkerGroup):
    def probe(self, devices: Sequence[int]) -> Callable[[], list[dict]]:
        """Start a fixed probe on each device; the returned function waits for their results
        (WorkerGroupError: one did not answer within the collective timeout, or its worker died)."""
        import ray
        refs = [self.workers[d].probe.remote() for d in devices]

        def results() -> list[dict]:
            try:
                return ray.get(refs, timeout=self.timeout_s) if refs else []
            except ray.exceptions.RayError as e:   # a timeout (GetTimeoutError) or a dead worker
                raise WorkerGroupError(f"the probes of devices {list(devices)} did not return: "
                                       f"{str(e).splitlines()[0]}") from None
        return results


def ray_workers(job, control, cpus_per_worker: float | None) -> RayWorkers:
    return RayWorkers(job.num_devices, job.scenario.gpus_per_node, name=f"malleus-{job.name}",
                      timeout_s=control.collective_timeout_s, replace_timeout_s=control.replace_timeout_s,
                      cpus_per_worker=cpus_per_worker)


def probe_baselines(group: WorkerGroupLike, devices: Sequence[int], rounds: int) -> dict[int, float]:
    """device -> median probe seconds over `rounds` probes."""
    out: dict[int, list[float]] = {}
    for _ in range(rounds):
        for r in group.probe(list(devices))():
            out.setdefault(r["device"], []).append(busy_seconds(r))
    return {d: statistics.median(v) for d, v in out.items()}
