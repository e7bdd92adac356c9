"""`WorkerGroup`: the set of device actors of one job, their placement, world and steps.

Placement. A plan numbers devices node-major (device d is on node d // gpus_per_node) and keeps
each TP group inside one node, so the group reserves ONE placement group PER LOGICAL NODE with the
STRICT_PACK strategy: node n's devices land together on one Ray node (their TP and intra-node
traffic stays local), while different logical nodes may share a Ray node (a laptop emulating two
nodes) or not. A single PACK placement group would only *prefer* co-location and could split a
logical node across machines.

Resources. On GPUs each bundle is {GPU: 1, CPU: 1} and workers use nccl. On CPU each bundle is
{CPU: cpus_per_worker}; by default 1.0 when the cluster declares at least one CPU per device,
otherwise the cluster's CPUs shared evenly (fractional). A local cluster started by this package
(`start_local_ray`) declares max(cores, devices + 1) logical CPUs, so 8 one-CPU workers fit on a
2-core laptop: the OS time-slices the real cores (which is why compute is timed per thread, see
NOTES.md "Measuring on CPU").

World. The world holds every device that has a worker (suspended and excluded ones included, so
a re-plan never needs a new world); ranks follow device ids. The first worker opens a port on its
node's cluster address (runtime/rendezvous.py: the store listens there only); every worker then
joins the world concurrently. A failed rendezvous is retried.

Devices gone for good. A lost device whose bundle cannot host a new worker within
`replace_timeout_s` (its node left the cluster: Ray re-places the node's placement group only once
a node with room joins) is *gone*: the world is rebuilt over the rest (groups.world_rank maps
device ids to the denser ranks) and the caller supplies a plan without it. At start, a logical
node that cannot be placed within the same time starts out gone. When its placement group is
placed again, `rejoin` brings it back the same way.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import time
from dataclasses import astuple, dataclass, field
from typing import Any, Callable, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from malleus_svc.plan import Plan

from .data import check_assignment, split_for_plan
from .worker import WORKER

log = logging.getLogger(__name__)

HANG_MARGIN_S = 10.0   # past the collective timeout, a step that has neither returned nor failed hangs
ANSWER_MARGIN_S = 30.0   # past the collective timeout, a call not answered is checked for progress
PROGRESS_ANSWER_S = 2.0  # a live worker's control thread answers `progress` at once
# The workers are the job: at Ray's default niceness (15) any other process on the host takes their
# cores first, and a paced CPU worker misses its pace. A cluster of our own runs them at 0.
LOCAL_RAY_SYSTEM_CONFIG = {"worker_niceness": 0}


class WorkerGroupError(RuntimeError):
    """The group cannot be placed, initialised or stepped; the message says which device and why."""


def start_local_ray(num_devices: int, **kwargs: Any) -> dict:
    """ray.init() of a new local cluster with enough logical CPUs for one CPU per worker (see above)."""
    num_cpus = max(os.cpu_count() or 1, num_devices + 1)
    # a cluster of our own, even when another one (`ray start`) runs on this machine
    kwargs.setdefault("address", "local")
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", True)
    kwargs.setdefault("_system_config", LOCAL_RAY_SYSTEM_CONFIG)
    return ray.init(num_cpus=num_cpus, **kwargs)


@dataclass
class StepRecord:
    step: int
    plan_id: str
    loss: float
    loss_tokens: int
    tokens: int
    samples: int
    iteration_seconds: float
    grad_norm: float | None
    lr: float | None = None                                            # of this step's update
    devices: dict[int, dict[str, Any]] = field(default_factory=dict)   # device -> its StepStats + extras
    sample_ids: list[list[int]] = field(default_factory=list)          # per pipeline, as the workers saw them

    def metrics(self) -> dict[str, Any]:
        """One JSON-able line for --metrics-out."""
        def per(key):
            return {str(d): s.get(key) for d, s in sorted(self.devices.items())}
        return {
            "step": self.step, "plan_id": self.plan_id, "loss": self.loss, "loss_tokens": self.loss_tokens,
            "tokens": self.tokens, "samples": self.samples, "iteration_seconds": self.iteration_seconds,
            "tokens_per_second": self.tokens / self.iteration_seconds if self.iteration_seconds > 0 else None,
            "grad_norm": self.grad_norm, "lr": self.lr,
            "model_flops": sum(s.get("model_flops") or 0.0 for s in self.devices.values()),
            "compute_seconds": per("compute_seconds"), "wall_seconds": per("wall_seconds"),
            "comm_seconds": per("comm_seconds"), "slowdown": per("slowdown"),
            "pace_held": pace_held(self.devices.values()),
        }


def pace_held(reports) -> float | None:
    """Share of paced ops that kept pace, over the workers' cumulative counts; None if unpaced."""
    ops = sum(r.get("pace_ops") or 0 for r in reports)
    return sum(r.get("pace_on") or 0 for r in reports) / ops if ops else None


@dataclass
class RecoveryReport:
    """What `WorkerGroup.recover` did after a failed step."""

    lost: list[int]                 # devices whose worker died or hung
    source: str                     # "replicas": state rebuilt from survivors; "none": restore a checkpoint
    seconds: float
    gone: list[int] = field(default_factory=list)   # of `lost`, those that could not be replaced
    plan_id: str | None = None                      # the plan the group runs now


@dataclass
class MigrationReport:
    """What `WorkerGroup.migrate` did. Bytes count param + exp_avg + exp_avg_sq payload (the
    per-slice Adam step counts travel beside them, 8 bytes each, uncounted)."""

    old_plan_id: str
    new_plan_id: str
    moved_bytes: int                       # sent over the world (== the planned total)
    inter_node_bytes: int                  # of which between logical nodes
    moves: int                             # tensor slices moved (before cutting into buckets)
    buckets: int
    seconds: float                         # driver wall time of the whole migration
    per_device_seconds: dict[int, float]   # each worker's migrate() wall time
    reused_bytes: int = 0                  # state that stayed where it was
    rounds: int = 0
    per_device: dict[int, dict[str, Any]] = field(default_factory=dict)  # each worker's stats


class WorkerGroup:
    """One actor per device; see the module docstring for placement and the world."""

    def __init__(self, num_devices: int, gpus_per_node: int, *, use_gpu: bool | None = None,
                 cpus_per_worker: float | None = None, timeout_s: float = 120.0, name: str = "malleus",
                 replace_timeout_s: float = 60.0):
        if num_devices < 1 or gpus_per_node < 1:
            raise WorkerGroupError(f"need num_devices >= 1 and gpus_per_node >= 1, got {num_devices}, {gpus_per_node}")
        if not ray.is_initialized():
            raise WorkerGroupError("Ray is not initialised: call ray.init() (or start_local_ray) first")
        self.num_devices, self.gpus_per_node = num_devices, gpus_per_node
        self.timeout_s, self.name = timeout_s, name
        self.replace_timeout_s = float(replace_timeout_s)
        res = ray.cluster_resources()
        self.use_gpu = res.get("GPU", 0) >= num_devices if use_gpu is None else use_gpu
        if self.use_gpu and res.get("GPU", 0) < num_devices:
            raise WorkerGroupError(f"{num_devices} devices need {num_devices} GPUs; the Ray cluster has {res.get('GPU', 0):g}")
        if cpus_per_worker is None:
            cpus = res.get("CPU", 0)
            cpus_per_worker = 1.0 if self.use_gpu or cpus >= num_devices else math.floor(100 * cpus / num_devices) / 100
        if cpus_per_worker <= 0:
            raise WorkerGroupError(f"the Ray cluster has {res.get('CPU', 0):g} CPUs, too few for {num_devices} workers; "
                                   "start it with more (logical) CPUs, e.g. ray start --num-cpus N")
        self.cpus_per_worker = cpus_per_worker
        self.placement_groups: list = []
        self.workers: list = []              # by device id; None for a device that is gone
        self.gone: set[int] = set()
        self.infos: list[dict] = []
        self.backend: str | None = None
        self.rendezvous: str | None = None   # tcp://ip:port of the torch.distributed store
        self.plan: Plan | None = None
        self.dataset = None      # the driver's copy: lengths for token counts, never shipped
        self._step = 0
        self._started = False
        self._data_args: tuple | None = None   # (spec, mode, seq_len): a replacement worker needs them too
        self._inflight: dict = {}              # train_step refs of the step in progress -> device
        self._inflight_since = 0.0             # when they were dispatched (time.monotonic)
        self._longest_step_s = 0.0             # the longest step so far: how late a collective may be posted
        self._updates: dict = {}               # apply_update refs of the last finished step -> device
        self.last_recovery_error: str | None = None
        self.device_pace = None                # the emulated accelerator's speed (CPU workers), once paced
        self._pace_given = (True, True, True)  # which of its terms the job gave (not refitted)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "WorkerGroup":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> "WorkerGroup":
        try:
            self._place()
            self._spawn()
            self._init_world()
        except BaseException:
            self.shutdown()
            raise
        self._started = True
        return self

    def _bundle(self) -> dict[str, float]:
        return {"CPU": 1.0, "GPU": 1.0} if self.use_gpu else {"CPU": self.cpus_per_worker}

    def _place(self) -> None:
        nodes = math.ceil(self.num_devices / self.gpus_per_node)
        self._remove_stale(nodes)
        for n in range(nodes):
            k = min(self.gpus_per_node, self.num_devices - n * self.gpus_per_node)
            self.placement_groups.append(placement_group([self._bundle()] * k, strategy="STRICT_PACK",
                                                         name=f"{self.name}-node{n}"))
        # Elastic start: logical nodes that cannot be placed within replace_timeout_s (the same wait
        # after which a lost device's bundle counts as gone) start out gone (their placement groups
        # stay pending; `rejoin` brings them in once Ray places them). The job waits up to
        # timeout_s for its first node.
        start = time.monotonic()
        deadline = start + self.replace_timeout_s
        unplaced = [n for n, pg in enumerate(self.placement_groups)
                    if not pg.wait(timeout_seconds=max(0.0, deadline - time.monotonic()))]
        if len(unplaced) == nodes:
            ray.wait([pg.ready() for pg in self.placement_groups], num_returns=1,
                     timeout=max(0.0, start + self.timeout_s - time.monotonic()))
            unplaced = [n for n, pg in enumerate(self.placement_groups) if not pg.wait(timeout_seconds=0)]
        if len(unplaced) == nodes:
            pg = self.placement_groups[0]
            raise WorkerGroupError(
                f"no logical node could be placed within {self.timeout_s:g} s (each needs {len(pg.bundle_specs)} "
                f"bundles of {self._bundle()} on one Ray node); the cluster has {ray.available_resources()} "
                "available. Lower gpus_per_node or add resources.")
        if unplaced:
            self.gone = {d for d in range(self.num_devices) if d // self.gpus_per_node in unplaced}
            log.warning("logical nodes %s could not be placed within %g s: starting without devices %s; they join "
                        "when Ray can place them", unplaced, self.replace_timeout_s, sorted(self.gone))

    def _remove_stale(self, nodes: int) -> None:
        """Placement groups of this name left by a predecessor that died (a coordinator that Ray
        restarted): the names are ours, so they are stale; removing them frees their bundles."""
        from ray.util import get_placement_group
        for n in range(nodes):
            try:
                stale = get_placement_group(f"{self.name}-node{n}")
            except ValueError:  # none: the normal case
                continue
            log.warning("removing stale placement group %s-node%d", self.name, n)
            remove_placement_group(stale)
            deadline = time.monotonic() + 10   # removal is asynchronous: the name frees a moment later
            while time.monotonic() < deadline:
                try:
                    get_placement_group(f"{self.name}-node{n}")
                except ValueError:
                    break
                time.sleep(0.1)

    def _new_worker(self, d: int):
        pg = self.placement_groups[d // self.gpus_per_node]
        return WORKER.options(
            num_cpus=self._bundle()["CPU"], num_gpus=1 if self.use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=d % self.gpus_per_node),
            max_restarts=0,  # a lost device is the coordinator's decision, not a silent restart
        ).remote(d, self.use_gpu)

    @property
    def live(self) -> list[int]:
        """The devices that have a worker (all but the gone ones), sorted."""
        return [d for d, w in enumerate(self.workers) if w is not None]

    def _spawn(self) -> None:
        self.workers = [None if d in self.gone else self._new_worker(d) for d in range(self.num_devices)]
        self.infos = self._each("info")

    def _each(self, method: str, *args, devices: Sequence[int] | None = None) -> list:
        """Call `method(*args)` on these devices' workers (default: every live one), in device order."""
        devices = self.live if devices is None else list(devices)
        return self._get([getattr(self.workers[d], method).remote(*args) for d in devices], method, devices=devices)

    def _init_world(self, attempts: int = 3) -> None:
        last: Exception | None = None
        live = self.live
        for _ in range(attempts):
            addr, port = ray.get(self.workers[live[0]].pick_port.remote(), timeout=self.timeout_s)
            try:
                self.backend = self._each("init_world", addr, port, live, self.timeout_s)[0]
                self.rendezvous = f"tcp://{addr}:{port}"
                return
            except WorkerGroupError as e:  # e.g. a worker that could not reach the port in time
                last = e
                # A half-initialised world cannot be re-entered: close what did come up and retry.
                self._each("close", True)   # keeping any shards a recovery or rejoin is carrying over
        raise WorkerGroupError(f"torch.distributed rendezvous failed {attempts} times: {last}")

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already dead (or gone: None): nothing to release
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.workers, self.placement_groups, self._started = [], [], False

    # ------------------------------------------------------------------ data and plan
    def set_data(self, spec: dict, mode: str, seq_len: int) -> int:
        """Every worker builds the dataset from `spec` once (steps then ship only sample ids), with
        what the driver's build learnt (`worker_spec`: no worker rescans a token file)."""
        from .datasets import build_dataset, worker_spec

        self.dataset = build_dataset(spec)
        spec = worker_spec(spec, self.dataset)
        self._data_args = (spec, mode, int(seq_len))
        sizes = self._each("set_data", spec, mode, seq_len)
        if any(n != len(self.dataset) for n in sizes):
            raise WorkerGroupError(f"workers built datasets of sizes {sorted(set(sizes))}, the driver {len(self.dataset)}: "
                                   "the dataset must be the same everywhere (same files, same spec)")
        return len(self.dataset)

    def check_plan(self, plan: Plan, shape) -> None:
        if plan.num_devices != self.num_devices:
            raise WorkerGroupError(f"plan {plan.plan_id} is for {plan.num_devices} devices, this job has "
                                   f"{self.num_devices} (nodes x gpus_per_node)")
        if plan.num_layers != shape.layers:
            raise WorkerGroupError(f"plan {plan.plan_id} covers {plan.num_layers} layers, the model has {shape.layers}")
        if plan.gpus_per_node != self.gpus_per_node:
            raise WorkerGroupError(f"plan {plan.plan_id} assumes {plan.gpus_per_node} devices per node, this job has "
                                   f"{self.gpus_per_node}")
        gone = sorted(self.gone & set(plan.roles()))
        if gone:
            raise WorkerGroupError(f"plan {plan.plan_id} gives work to devices {gone}, which are gone "
                                   f"(their node left the cluster); plan without them")

    def apply_plan(self, plan: Plan, shape, *, seed: int = 0, optim=None, init: bool = True) -> list[dict]:
        """Every worker builds its Engine for `plan` (fresh parameters from `seed`, or none when
        `init` is False: `load_full_state` comes next); devices without work build none. All
        workers take part, because building an Engine creates process groups."""
        from .engine import OptimConfig, validate_plan_for_model

        self.check_plan(plan, shape)
        try:  # fail here, not in one worker while the others wait for it in new_group
            validate_plan_for_model(shape, plan)
        except ValueError as e:
            raise WorkerGroupError(f"plan {plan.plan_id} cannot run this model: {e}") from None
        optim = optim or OptimConfig()
        d = plan.to_dict()
        out = self._each("apply_plan", shape, d, seed, optim, init)
        self.plan = plan
        self.shape, self.seed, self.optim = shape, seed, optim  # what migrate() builds engines with
        return out

    def migrate(self, new_plan: Plan, *, bucket_bytes: int = 64 << 20,
                unavailable: Sequence[int] = ()) -> "MigrationReport":
        """Live migration to `new_plan` at an iteration boundary (no step in flight), see migrate.py.

        Every worker sends/receives exactly the parameter and Adam slices (param, exp_avg,
        exp_avg_sq, step) the new plan places elsewhere, over the existing world, in buckets of at
        most `bucket_bytes`; then builds its Engine for the new plan from them (or drops it, if it
        is now suspended/excluded). No worker restarts; the world is not re-initialised.
        `unavailable` devices hold no state (lost, or fresh workers in their place): every slice
        comes from another holder, or the migration is refused before a byte moves.
        """
        from .engine import validate_plan_for_model
        from .migrate import MigrationError, plan_migration

        if self.plan is None or getattr(self, "shape", None) is None:
            raise WorkerGroupError("apply_plan must run before migrate (there is no state to migrate)")
        old, shape = self.plan, self.shape
        self.check_plan(new_plan, shape)
        try:  # fail here, before any worker starts exchanging
            validate_plan_for_model(shape, new_plan)
            schedule = plan_migration(old, new_plan, shape, bucket_bytes=bucket_bytes, unavailable=unavailable,
                                      sharded=self.optim.shard_optimizer)
        except (ValueError, MigrationError) as e:
            raise WorkerGroupError(f"cannot migrate {old.plan_id} -> {new_plan.plan_id}: {e}") from None
        t0 = time.perf_counter()
        od, nd = old.to_dict(), new_plan.to_dict()
        results = self._each("migrate", od, nd, shape, self.seed, self.optim, bucket_bytes, sorted(unavailable))
        seconds = time.perf_counter() - t0
        self.plan = new_plan  # the workers run it now (also if the byte check below fails)
        sent = sum(r["sent_bytes"] for r in results)
        received = sum(r["received_bytes"] for r in results)
        if not sent == received == schedule.moved_bytes:
            raise WorkerGroupError(f"migration moved {sent} bytes sent / {received} received, "
                                   f"planned {schedule.moved_bytes}")
        return MigrationReport(
            old_plan_id=old.plan_id, new_plan_id=new_plan.plan_id, moved_bytes=sent,
            inter_node_bytes=sum(r["sent_inter_node_bytes"] for r in results),
            moves=len(schedule.slices), buckets=len(schedule.buckets), seconds=seconds,
            per_device_seconds={r["device"]: r["seconds"] for r in results},
            reused_bytes=schedule.reused_bytes, rounds=schedule.rounds,
            per_device={r["device"]: r for r in results})

    def load_pretrained(self, folder) -> None:
        """Every worker with work reads its own shards of a Hugging Face LLaMA folder (one they all
        see); nothing passes through the driver. `runtime.pretrained.check_pretrained` first."""
        if self.plan is None:
            raise WorkerGroupError("apply_plan must run before load_pretrained")
        self._each("load_pretrained", str(folder), devices=sorted(self.plan.roles()))

    def load_full_state(self, full) -> None:
        """Load whole tensors (as `full_state()` gives them) into every active worker's Engine."""
        from .engine import full_shard_states

        if self.plan is None:
            raise WorkerGroupError("apply_plan must run before load_full_state")
        self._each("load_state", ray.put(full_shard_states(full)), devices=sorted(self.plan.roles()))

    def write_checkpoint(self, folder) -> "Callable[[], dict[str, dict]]":
        """Every active worker snapshots its pieces of a checkpoint (one replica of each) and writes
        them into `folder`, one every worker sees, from a thread of its own; returns once the
        snapshots are taken (at an iteration boundary), so training goes on meanwhile. The function
        returned waits for the files and gives their manifest entries (file -> part, sha256, bytes,
        rows and step of each tensor). No tensor passes through the driver."""
        if self.plan is None:
            raise WorkerGroupError("apply_plan must run before write_checkpoint")
        devices = sorted(self.plan.roles())
        self._each("write_checkpoint", str(folder), self.plan.to_dict(), devices=devices)
        workers = {d: self.workers[d] for d in devices}

        def written() -> dict[str, dict]:
            refs = {w.checkpoint_written.remote(): d for d, w in workers.items()}
            entries: dict[str, dict] = {}
            for ref, d in refs.items():   # no deadline: a large shard takes what the disk takes
                try:
                    entries.update(ray.get(ref))
                except Exception as e:
                    cause = getattr(e, "cause", None)    # a worker's own exception, not Ray's wrapper
                    cause = cause if isinstance(cause, BaseException) else e
                    last = (str(cause).strip().splitlines() or [""])[-1]
                    raise WorkerGroupError(f"the checkpoint files of device {d} were not written: "
                                           f"{type(cause).__name__}: {last}") from e
            return entries

        return written

    def load_checkpoint(self, folder, table) -> None:
        """Every active worker reads its own rows of a checkpoint's shard files (in `folder`, one they
        all see; `table` as `checkpoint.Checkpoint.table()` gives it), verifying each file it opens.
        No tensor passes through the driver."""
        if self.plan is None:
            raise WorkerGroupError("apply_plan must run before load_checkpoint")
        self._each("load_checkpoint", str(folder), table, devices=sorted(self.plan.roles()))

    # ------------------------------------------------------------------ steps
    def count_tokens(self, ids: Sequence[int]) -> tuple[int, int]:
        """(input tokens, loss tokens) of these samples under the collate mode, from lengths alone."""
        _, mode, seq_len = self._data_args
        lengths = getattr(self.dataset, "lengths", None)
        if lengths is None:  # a dataset without a length table: collate to count
            from .datasets import collate
            mb = collate(self.dataset, list(ids), mode, seq_len)
            return mb.num_tokens, mb.num_loss_tokens
        loss = int(sum(int(lengths[i]) - 1 for i in ids))
        tokens = len(ids) * seq_len if mode == "pad" else loss
        return tokens, loss

    def step(self, sample_ids: Sequence[int], assignment=None, lr: float | None = None) -> StepRecord:
        """One iteration on the global batch `sample_ids` under the applied plan: the plan's fixed
        split, or `assignment` (per pipeline, per micro-batch, sample ids; checked exactly-once); the
        update at learning rate `lr` (None: the optimizer's peak)."""
        if self.plan is None or self.dataset is None:
            raise WorkerGroupError("apply_plan and set_data must run before step")
        plan = self.plan
        t0 = time.perf_counter()
        if assignment is None:
            splits = split_for_plan(sample_ids, plan)
        else:
            check_assignment(sample_ids, assignment, plan)
            splits = [[list(map(int, mb)) for mb in pipe] for pipe in assignment]
        tokens, loss_tokens = self.count_tokens(sample_ids)
        roles = plan.roles()
        devices = sorted(roles)
        refs = [self.workers[d].train_step.remote(splits[roles[d].pipeline], loss_tokens) for d in devices]
        self._inflight, self._inflight_since = dict(zip(refs, devices)), time.monotonic()
        per = {r["device"]: r for r in self._get(refs, f"train_step {self._step}", devices=devices)}
        # Each worker ran the last step's update before this step (below): part of this iteration.
        for d, u in self._take_updates().items():
            if d in per:
                per[d]["wall_seconds"] += u["update_seconds"]
        self._inflight = {}
        # Two phases: no device applies its optimizer update before every device has finished the
        # step. A collective can complete on some ranks before a peer dies, so with the update inside
        # train_step a loss could leave the survivors at different steps, which only a checkpoint
        # could reconcile. Not waited for: Ray runs one caller's calls to an actor in order (the
        # worker allows no out-of-order execution), so every later call sees the update applied.
        self._updates = {self.workers[d].apply_update.remote(lr): d for d in devices}
        self._longest_step_s = max(self._longest_step_s, time.perf_counter() - t0)
        rec = self._record(plan, per, sample_ids, time.perf_counter() - t0)
        rec.lr = self.optim.lr if lr is None else lr
        return rec

    def evaluate(self, batches: Sequence[Sequence[int]]) -> float:
        """The mean token loss over global batches of held-out samples, under the applied plan and
        its fixed split, forward only, on the weights after the last step's update."""
        if self.plan is None or self.dataset is None:
            raise WorkerGroupError("apply_plan and set_data must run before evaluate")
        plan, roles = self.plan, self.plan.roles()
        devices = sorted(roles)
        loss_tokens = sum(self.count_tokens(ids)[1] for ids in batches)   # every batch's share of one mean
        total = 0.0
        for ids in batches:
            splits = split_for_plan(ids, plan)
            refs = [self.workers[d].eval_step.remote(splits[roles[d].pipeline], loss_tokens) for d in devices]
            total += self._get(refs, "eval_step", devices=devices)[0]["loss"]
        return total

    def _take_updates(self) -> dict[int, dict]:
        """The answers of the last step's apply_update calls, {device: answer}; a failure is left for
        `recover` to find."""
        answers = self._get(list(self._updates), "apply_update", devices=list(self._updates.values()))
        out, self._updates = dict(zip(self._updates.values(), answers)), {}
        return out

    def _record(self, plan: Plan, per: dict[int, dict], sample_ids: Sequence[int], dt: float) -> StepRecord:
        tokens, loss_tokens = self.count_tokens(sample_ids)
        # Per pipeline, what its first stage's TP rank 0 actually trained on (every rank of the
        # pipeline collates the same list; the test audits this, not the driver's intention).
        seen = []
        for pipe in plan.pipelines:
            holder = next((d for st in pipe.stages for d in st.devices if d in per), None)  # after a loss: any
            seen.append([s for mb in per[holder]["sample_ids"] for s in mb] if holder is not None else [])
        loss = _global_loss(plan, per)
        gn = per[min(per)].get("grad_norm")
        rec = StepRecord(step=self._step, plan_id=plan.plan_id, loss=loss, loss_tokens=loss_tokens,
                         tokens=tokens, samples=len(sample_ids), iteration_seconds=dt,
                         grad_norm=None if gn is None else float(gn),
                         devices=per,
                         sample_ids=seen)
        self._step += 1
        return rec

    # ------------------------------------------------------------------ failures
    def recover(self, plan_for: "Callable[[frozenset[int]], Plan] | None" = None) -> "RecoveryReport":
        """After a failed step: find the lost devices, replace them, rebuild the world, restore state.

        Lost = a worker whose actor died (RayActorError), or whose step neither returned nor failed
        within the collective timeout and then stopped finishing ops (a hang: the device that did not
        arrive; it is killed). The others are NOT restarted: they finish their failed step (a
        collective with a lost peer errors out, at the latest at the timeout), leave the old world
        keeping their shards, and join a new one with a fresh actor in each lost device's bundle.
        A lost device whose bundle cannot host one (see the module docstring) is gone: then
        `plan_for(gone devices)` gives the plan to run on the rest. When every slice has a
        surviving copy (data parallelism keeps replicas), the
        survivors send their shards where the plan needs them, worker to worker (a migration with
        the lost devices unavailable as sources; nothing passes through the driver):
        `source="replicas"`. Otherwise `source="none"` and the caller restores a checkpoint. No
        survivor has applied the failed step's update (see `step`): they are all at the state
        before it, and it is redone.
        """
        t0 = time.perf_counter()
        refs, self._inflight = self._inflight, {}
        # Every survivor's train_step ends by the collective timeout (it errors out), counted from
        # when it posted the collective, which is within about a step's time of the dispatch; what
        # has not ended by then, with a margin, hangs. Anchored at the dispatch, not now: the
        # caller has already waited for the first error, most of a timeout.
        deadline = self._inflight_since + self.timeout_s + HANG_MARGIN_S + 2 * self._longest_step_s
        done, stuck = (ray.wait(list(refs), num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
                       if refs else ([], []))
        while stuck and self._stall({r: refs[r] for r in stuck}) is None:   # slow, not hung: its ops still finish
            more, stuck = ray.wait(stuck, num_returns=len(stuck), timeout=0)
            done = [*done, *more]
        lost = {refs[r] for r in stuck}
        for r in done:
            try:
                ray.get(r)
            except ray.exceptions.RayActorError:
                lost.add(refs[r])
            except Exception:  # a collective that failed because of a lost peer: a survivor
                pass
        # The last finished step's update: a device that did not apply it would disagree with the rest.
        updates, self._updates = {r: d for r, d in self._updates.items() if d not in lost}, {}
        lost |= self._settle(updates, timeout=30)[1]
        # Dead, or not answering even on its control thread. A worker whose node is going down may
        # still answer one call and fail the next: every call below counts its failures as lost too.
        lost |= self._answers("ping", [d for d in self.live if d not in lost], timeout=30)[1]
        old = self.plan
        lost |= self._answers("close", [d for d in self.live if d not in lost], True)[1]   # keeping their shards
        for d in sorted(lost):
            try:
                ray.kill(self.workers[d])
            except Exception:  # already gone
                pass
        gone = self._start_workers(lost)
        plan = old
        if self.gone & set(old.roles()):
            if plan_for is None:
                raise WorkerGroupError(f"devices {sorted(gone)} are gone (no worker could start in their bundles "
                                       f"within {self.replace_timeout_s:g} s) and no plan without them was given")
            plan = plan_for(frozenset(self.gone))
        source = self._restart_world(plan, sorted(lost - gone), lost)
        return RecoveryReport(lost=sorted(lost), source=source, seconds=time.perf_counter() - t0,
                              gone=sorted(gone), plan_id=plan.plan_id)

    def _answers(self, method: str, devices: Sequence[int], *args,
                 timeout: float | None = None) -> tuple[dict, set[int]]:
        """`method(*args)` on each device: {device: result} of those that answered, and the set of those
        that failed or did not answer in time (during a recovery: lost as well)."""
        refs = {getattr(self.workers[d], method).remote(*args): d for d in devices}
        return self._settle(refs, self.timeout_s + ANSWER_MARGIN_S if timeout is None else timeout)

    def _stall(self, calls: dict) -> str | None:
        """Why the devices of these calls in flight ({ref: device}) have stopped working, or None while
        they work: within one collective timeout some call returns, or some device's clock finishes
        ops (read on its control thread, which answers mid-step). One hung, stopped or dead does not
        answer: when none answers the first read, at once. A device that answers the second read
        only may have been late on a loaded host: it counts as working; one that answers the first
        only has stopped answering."""
        devices = sorted(set(calls.values()))
        before = self._answers("progress", devices, timeout=PROGRESS_ANSWER_S)[0]
        if not before:
            return "; ".join(f"device {d} does not answer (hung, stopped or dead)" for d in devices)
        ready, _ = ray.wait(list(calls), num_returns=1, timeout=self.timeout_s)
        after = self._answers("progress", devices, timeout=PROGRESS_ANSWER_S)[0]
        if ready or any(d in after and after[d] != before.get(d) for d in devices):
            return None
        return "; ".join(f"device {d} finished no op in {self.timeout_s:g} s" if d in after else
                         f"device {d} does not answer (hung, stopped or dead)" for d in devices)

    @staticmethod
    def _settle(refs: dict, timeout: float) -> tuple[dict, set[int]]:
        """Calls in flight ({ref: device}): {device: result} of those that returned within `timeout`,
        and the set of devices whose call failed or did not return."""
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout) if refs else ([], [])
        out, failed = {}, {refs[r] for r in pending}
        for r in ready:
            try:
                out[refs[r]] = ray.get(r)
            except Exception:
                failed.add(refs[r])
        return out, failed

    def rejoinable(self) -> list[int]:
        """Gone devices whose logical node's placement group Ray has placed again (a node with room
        joined the cluster): `rejoin` can bring them back."""
        from ray.util import placement_group_table

        placed = {n for n, pg in enumerate(self.placement_groups) if placement_group_table(pg).get("state") == "CREATED"}
        return [d for d in sorted(self.gone) if d // self.gpus_per_node in placed]

    def rejoin(self, devices: Sequence[int], plan_for: "Callable[[frozenset[int]], Plan]") -> list[int]:
        """Bring gone devices back at an iteration boundary: fresh workers in their bundles, a world
        over all live devices, `plan_for(still gone)` applied, the state carried over from the
        running workers, worker to worker (no checkpoint, nothing through the driver). Returns the
        devices that came back (those whose worker did not start stay gone; with none, nothing
        changes)."""
        devices = set(devices) & self.gone
        if not devices:
            return []
        back = devices - self._start_workers(devices)
        if not back:
            return []
        running = [d for d in self.live if d not in back]
        self._each("close", True, devices=running)
        source = self._restart_world(plan_for(frozenset(self.gone)), sorted(back), back)
        if source != "replicas":   # every running worker kept its shards: this cannot lose state
            raise WorkerGroupError(f"rejoin of {sorted(back)}: the running workers' state did not reassemble "
                                   f"({self.last_recovery_error})")
        return sorted(back)

    def _start_workers(self, devices) -> set[int]:
        """Fresh actors in these devices' bundles. Those that do not start within replace_timeout_s
        (their node left: the bundle has nowhere to run until Ray places it again) are gone; returns them."""
        fresh = sorted(devices)
        for d in fresh:
            self.workers[d] = self._new_worker(d)
        # not started in time, or died starting (its node went away under it)
        failed = self._answers("info", fresh, timeout=self.replace_timeout_s)[1]
        for d in failed:
            ray.kill(self.workers[d])     # cancels a creation still waiting for its bundle
            self.workers[d] = None
            log.warning("device %d is gone: no worker started in its bundle within %g s", d, self.replace_timeout_s)
        self.gone = (self.gone - set(fresh)) | failed
        self.infos = self._each("info")
        if self.device_pace is not None:
            self._each("set_pace", *astuple(self.device_pace), devices=[d for d in fresh if d not in failed])
        return failed

    def _restart_world(self, plan: Plan, fresh: Sequence[int], unavailable) -> str:
        """A new world over the live devices (the old one is closed, each worker kept its shards of
        the running plan), data for the fresh workers, and the state migrated to
        `plan` with the `unavailable` devices' shards lost. "replicas" if the others held every
        slice; "none" if not: then `plan` is applied without state and the caller restores a checkpoint."""
        from .migrate import MigrationError, plan_migration

        self._init_world()
        if fresh:
            self._each("set_data", *self._data_args, devices=fresh)
        # The survivors agree on the step (updates are applied only after every device finished it),
        # so their shards either cover the whole model or lack a slice that only lost devices held:
        # the schedule says which before a byte moves.
        self.last_recovery_error = None
        try:
            plan_migration(self.plan, plan, self.shape, unavailable=unavailable, sharded=self.optim.shard_optimizer)
        except MigrationError as e:
            self.last_recovery_error = str(e).splitlines()[0]
            log.warning("state cannot be rebuilt from the survivors: %s", self.last_recovery_error)
            self.apply_plan(plan, self.shape, seed=self.seed, optim=self.optim, init=False)
            return "none"
        self.migrate(plan, unavailable=unavailable)
        return "replicas"

    # ------------------------------------------------------------------ state and control
    def export_states(self) -> dict[int, Any]:
        if self.plan is None:
            raise WorkerGroupError("no plan applied: nothing to export")
        active = sorted(self.plan.roles())
        return dict(zip(active, self._each("export_state", devices=active)))

    def full_state(self):
        """The whole model's parameters and optimizer state, assembled from every worker's slice."""
        from .engine import assemble_full

        return assemble_full(list(self.export_states().values()))

    def length_sweep(self, shape, tps: Sequence[int], seq_len: int, link_gbps: float, repeats: int = 9):
        """The length sweep on the job's first live device (`DeviceWorker.length_sweep`), for a job on
        accelerators, whose head has none; between steps."""
        return self._each("length_sweep", shape, list(tps), seq_len, link_gbps, 2, repeats, devices=self.live[:1])[0]

    def time_links(self, shape, boundary_tokens: int, repeats: int = 9):
        """The job's links timed by its workers under the plan applied (runtime/link_probe.py), as
        `costmodel.profile.LinkTimes`: a round trip of one boundary tensor (`boundary_tokens` ×
        hidden) between two devices of one node and between the first devices of two nodes (none
        on one node; with no two devices on one node, the round trip across nodes stands for
        both); k = 2, 4, ... pairs at once, each with 1/k of it (a boundary between TP groups of k),
        across two nodes of k devices and within one of 2k, up to a node's size; and the
        all-reduce of one block's gradients among the holders of the first block (one per pipeline;
        with one pipeline, the first device of each node, or two devices). Between steps."""
        from malleus_svc.costmodel.profile import LinkTimes

        from .gradient_sync import GRAD_BUCKET_BYTES

        if self.plan is None:
            raise WorkerGroupError("no plan applied: nothing to time the links under")
        by_node: dict[int, list[int]] = {}
        for d in self.live:
            by_node.setdefault(d // self.gpus_per_node, []).append(d)
        firsts = [ds[0] for ds in by_node.values()]
        intra = next(((ds[0], ds[1]) for ds in by_node.values() if len(ds) > 1), None)
        inter = (firsts[0], firsts[1]) if len(firsts) > 1 else None
        rounds = [[p] for p in (intra, inter) if p is not None]
        single = {"intra": 0 if intra else None, "inter": len(rounds) - 1 if inter else None}
        parallel = []    # (link, k, its round, the round of the one pair it is compared with)
        for k in (2 ** i for i in range(1, self.gpus_per_node.bit_length())):
            wide = [ds for ds in by_node.values() if len(ds) >= k]
            if len(wide) > 1:
                parallel.append(("inter", k, len(rounds), single["inter"]))
                rounds.append(list(zip(wide[0][:k], wide[1][:k])))
            roomy = next((ds for ds in by_node.values() if len(ds) >= 2 * k), None)
            if roomy:
                parallel.append(("intra", k, len(rounds), single["intra"]))
                rounds.append([(roomy[2 * i], roomy[2 * i + 1]) for i in range(k)])
        holders = [p.stages[0].devices[0] for p in self.plan.pipelines]
        reducers = holders if len(holders) > 1 else firsts if len(firsts) > 1 else list(intra or ())
        block = shape.block_params()
        elements = min(self.plan.num_layers * block, GRAD_BUCKET_BYTES // 4)   # one bucket, as GradientSync sends
        answers = self._each("time_links", rounds, reducers, boundary_tokens * shape.hidden, elements, repeats)
        led: dict[int, float] = {}      # a round takes as long as its slowest pair
        for a in answers:
            for i, t in a["pairs"].items():
                led[i] = max(led.get(i, 0.0), t)
        reduce_s = max((a["all_reduce"] for a in answers if a["all_reduce"] is not None), default=0.0)
        inter_s = led[single["inter"]] if inter is not None else None
        intra_s = led[single["intra"]] if intra is not None else inter_s or 0.0
        shares = tuple((link, k, led[i] / led[one]) for link, k, i, one in parallel if led.get(one))
        return LinkTimes(p2p_intra_node_s=intra_s, p2p_inter_node_s=inter_s,
                         grad_sync_per_block_s=reduce_s * block / elements, reducers=len(reducers), p2p_shares=shares)

    def pace(self, tokens: int, flops_per_second: float | None = None, bytes_per_second: float | None = None,
             block_seconds: float | None = None):
        """Give CPU workers the speed of an emulated accelerator (GPUs keep their own; returns None).

        What is not given is sized from a rehearsal of every device's ops under the plan applied
        (`tokens`: one micro-batch), so that each host keeps pace with all its devices computing
        at once (device_clock.fit_pace), the slowest host setting it, and refitted on the job's own
        ops once they ran (`keep_op_costs`, then `refit_pace`). Replacement workers get the same pace."""
        from .device_clock import AUTO_UTILIZATION, Pace, fit_pace

        if self.use_gpu:
            return None
        given = (flops_per_second, bytes_per_second, block_seconds)
        self._pace_given = tuple(g is not None for g in given)
        if None in given:
            costs = self._op_costs_per_host("rehearse", tokens)
            cores = {i["node_id"]: i["host_cores"] for i in self.infos}
            workers = collections.Counter(i["node_id"] for i in self.infos)
            self._set_pace([fit_pace(c, cores[node], workers[node], AUTO_UTILIZATION, *given)
                            for node, c in costs.items()])
        else:
            self._set_pace([Pace(*given)])
        return self.device_pace

    def keep_op_costs(self) -> None:
        """From now on, every CPU worker keeps what its ops cost the host on the pace (for `refit_pace`)."""
        if self.device_pace is not None and not all(self._pace_given):
            self._each("keep_op_costs", True)

    def refit_pace(self):
        """The pace slowed where a host's devices did not hold it on the ops they ran since
        `keep_op_costs` (device_clock.refit_pace; what the job gave stays), given to every worker;
        the pace in force (None on GPUs)."""
        from .device_clock import AUTO_UTILIZATION, refit_pace

        if self.device_pace is None or all(self._pace_given):
            return self.device_pace
        costs = self._op_costs_per_host("keep_op_costs", False)
        if costs:
            self._set_pace([refit_pace(self.device_pace, c, AUTO_UTILIZATION, self._pace_given)
                            for c in costs.values()])
        return self.device_pace

    def _op_costs_per_host(self, method: str, *args) -> dict[str, list[list]]:
        """Ray node -> per live device with ops, what `method` returned of their costs (OpCost)."""
        from .device_clock import OpCost

        live, node = self.live, {i["device"]: i["node_id"] for i in self.infos}
        costs: dict[str, list[list[OpCost]]] = {}
        for d, ops in zip(live, self._each(method, *args, devices=live)):
            if ops:
                costs.setdefault(node[d], []).append([OpCost(**op) for op in ops])
        return costs

    def _set_pace(self, paces: list) -> None:
        """The slowest of the hosts' paces, given to every worker."""
        from .device_clock import Pace

        self.device_pace = Pace(min(p.flops_per_second for p in paces), min(p.bytes_per_second for p in paces),
                                max(p.block_seconds for p in paces))
        self._each("set_pace", *astuple(self.device_pace))

    def set_slowdown(self, device: int, factor: float) -> float:
        """Emulation only: the device's rate on its clock. Served by the worker's control thread, so it works mid-step."""
        return ray.get(self.workers[device].set_slowdown.remote(factor), timeout=self.timeout_s)

    def set_slowdowns(self, factors: dict[int, float]) -> None:
        ray.get([self.workers[d].set_slowdown.remote(f) for d, f in factors.items() if d not in self.gone],
                timeout=self.timeout_s)

    # ------------------------------------------------------------------ helpers
    def _get(self, refs: list, what: str, devices: Sequence[int] | None = None) -> list:
        """ray.get that names the failing device and does not hang on the others (which would wait in
        a collective for the failed one until the torch.distributed timeout). Past the collective
        timeout and a margin, a call still out fails only once its device stops working (`_stall`):
        a slow step, a long migration or checkpoint load whose calls keep returning, is waited for."""
        devices = list(range(len(refs))) if devices is None else list(devices)
        index = {r: i for i, r in enumerate(refs)}
        start = time.monotonic()
        pending, deadline = list(refs), start + self.timeout_s + ANSWER_MARGIN_S
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                why = self._stall({r: devices[index[r]] for r in pending})
                if why is None:
                    deadline = time.monotonic()
                    continue
                late = [devices[index[r]] for r in pending]
                raise WorkerGroupError(f"{what}: devices {late} have not answered after "
                                       f"{time.monotonic() - start:.0f} s: {why}")
            try:
                ray.get(ready[0])
            except Exception as e:
                raise WorkerGroupError(f"{what} failed on device {devices[index[ready[0]]]}: {e}") from e
        return ray.get(refs)


def _global_loss(plan: Plan, per: dict[int, dict]) -> float:
    """The global batch's mean loss. The Engine all-reduces it over the active devices
    (`global_loss`, the same everywhere); `loss` is only each pipeline's share on its last stage."""
    any_device = per[min(per)]
    if "global_loss" in any_device:
        return float(any_device["global_loss"])
    return sum(float(per[p.stages[-1].devices[0]]["loss"]) for p in plan.pipelines)
