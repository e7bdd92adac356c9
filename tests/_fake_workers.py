"""A fake of the cluster for driving the coordinator without Ray: the worker-group surface the
coordinator uses (control/workers.py WorkerGroupLike), with per-device compute times the test
controls through the coordinator's own emulation call. Deterministic: a device does its stage's
blocks over its pipeline's micro-batches (its TP share of them), in t0 units, and its device time
is `UNIT` seconds per t0 unit, times its slowdown factor. A host that misses a paced device's pace
is `overrun[d] = (share, stretch)`: that share of the device's ops overran, and its device time
reads `stretch` times too long; every device reports its paced ops' counts as a worker does."""
from __future__ import annotations

from malleus_svc.control.workload import t0_flops
from malleus_svc.costmodel.profile import LinkTimes
from malleus_svc.costmodel.scenario import scenario_costs
from malleus_svc.plan import Plan
from malleus_svc.runtime.cluster import MigrationReport, StepRecord

UNIT = 0.01       # seconds per t0 unit on a healthy device
PROBE = 0.05      # a healthy device's probe seconds
OPS = 20          # paced ops a device times per step
UPDATE_BYTES, SECONDS_PER_UPDATE_BYTE = 1e6, 2e-9   # each device's update, on a healthy device
LINKS = LinkTimes(p2p_intra_node_s=0.0002, p2p_inter_node_s=0.001, grad_sync_per_block_s=0.0005, reducers=2)


class FakeWorkers:
    def __init__(self, job):
        self.job, self.num_devices = job, job.num_devices
        self.plan: Plan | None = None
        self.gone: set[int] = set()
        self.dataset = None
        self.infos = [{"device": d, "pid": 0, "node_id": "fake"} for d in range(self.num_devices)]
        self.cpus_per_worker, self.use_gpu, self.last_recovery_error = 1.0, False, None
        self.slowdown: dict[int, float] = {}
        self.overrun: dict[int, tuple[float, float]] = {}
        self.pace_counts: dict[int, list[int]] = {}       # device -> [ops, on pace], cumulative
        self.migrated: list[tuple[str, str]] = []     # (old plan id, new plan id)

    @property
    def live(self) -> list[int]:
        return [d for d in range(self.num_devices) if d not in self.gone]

    def start(self):
        return self

    def shutdown(self) -> None:
        pass

    def set_data(self, spec: dict, mode: str, seq_len: int) -> int:
        return int(spec["num_samples"])

    def apply_plan(self, plan: Plan, shape, *, seed: int = 0, optim=None, init: bool = True) -> list:
        self.plan, self.optim = plan, optim
        return []

    def set_slowdowns(self, factors: dict[int, float]) -> None:
        self.slowdown.update(factors)

    def pace(self, tokens, flops_per_second=None, bytes_per_second=None, block_seconds=None):
        return None      # device time is modelled directly

    def time_links(self, shape, boundary_tokens: int) -> LinkTimes:
        self.links_timed = getattr(self, "links_timed", 0) + 1
        return LINKS

    def step(self, sample_ids, assignment=None, lr=None) -> StepRecord:
        unit = t0_flops(self.job.scenario, self.plan)
        devices = {d: {"compute_seconds": UNIT * w * self.slowdown.get(d, 1.0) * self.overrun.get(d, (0, 1.0))[1],
                       "flops": w * unit, "update_bytes": UPDATE_BYTES,
                       "update_seconds": UPDATE_BYTES * SECONDS_PER_UPDATE_BYTE * self.slowdown.get(d, 1.0),
                       **self._paced(d)}
                   for d, w in plan_work(self.plan).items()}
        return StepRecord(step=0, plan_id=self.plan.plan_id, loss=1.0, loss_tokens=len(sample_ids),
                          tokens=len(sample_ids) * self.job.data.seq_len, samples=len(sample_ids),
                          iteration_seconds=max(s["compute_seconds"] for s in devices.values()), grad_norm=None,
                          lr=lr, devices=devices)

    def evaluate(self, batches) -> float:
        self.evaluated = getattr(self, "evaluated", 0) + 1
        return 1.0

    def probe(self, devices):
        out = [{"device": d, "compute_seconds": PROBE * self.slowdown.get(d, 1.0), **self._paced(d)} for d in devices]
        return lambda: out

    def _paced(self, device: int) -> dict:
        """This step's paced ops of `device`, added to its cumulative counts."""
        counts = self.pace_counts.setdefault(device, [0, 0])
        counts[0] += OPS
        counts[1] += round(OPS * (1 - self.overrun.get(device, (0.0, 1.0))[0]))
        return {"pace_ops": counts[0], "pace_on": counts[1]}

    def migrate(self, new_plan: Plan, *, bucket_bytes: int) -> MigrationReport:
        old, self.plan = self.plan, new_plan
        self.migrated.append((old.plan_id, new_plan.plan_id))
        moved = Plan.diff(old, new_plan, scenario_costs(self.job.scenario).state_sizes).moved_bytes
        return MigrationReport(old.plan_id, new_plan.plan_id, int(moved), 0, 1, 1, 0.01, {})

    def recover(self, plan_for=None):
        raise AssertionError("the fake cluster never loses a device")

    def rejoinable(self) -> list[int]:
        return []

    def rejoin(self, devices, plan_for) -> list[int]:
        return []


def plan_work(plan: Plan) -> dict[int, float]:
    """device -> its work in t0 units under `plan`: blocks x micro-batches / TP size."""
    return {d: (r.layers[1] - r.layers[0]) * plan.pipelines[r.pipeline].micro_batches / r.tp_size
            for d, r in plan.roles().items()}
