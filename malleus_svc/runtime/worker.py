"""One Ray actor per device: owns that device's torch.distributed rank and its Engine.

Lifecycle, driven by `cluster.WorkerGroup`:
  1. `info()` — where it landed (node, IP, pid, device);
  2. the first worker `pick_port()`; every worker `init_world(addr, port, devices)` (TCP
     rendezvous; the world's devices, so a world can lack devices that are gone for good);
  3. `set_data(spec, mode, seq_len)` once — the worker builds its own dataset, so steps ship only
     sample ids, never tensors;
  4. `apply_plan(...)` whenever the plan changes: (re)build the Engine, or none when the device is
     suspended/excluded;
  5. `train_step(micro_batch_ids, loss_tokens)` then `apply_update()` per iteration (the update
     waits until every device has finished the step); `export_state()` on demand.

Concurrency: the actor declares a `control` concurrency group (one thread of its own) for
`set_slowdown`, `ping`, `progress` and `info`, so a driver can reach a worker while `train_step` holds the
default group. Everything else runs in the default group with max_concurrency 1, so training
calls stay strictly serial and never race each other. (A threaded actor with max_concurrency=2
would also reach set_slowdown, but would let two train_steps overlap if a caller ever misbehaved.)
A `checkpoint` group of its own serves `checkpoint_written`, which waits for this device's
checkpoint files while training goes on in the default group.

Time: every compute op runs on the worker's DeviceClock (device_clock.py): CUDA events on a GPU;
on CPU a paced clock that makes the worker behave like an accelerator of its own once the group
gives it a pace (`rehearse`, then `set_pace`; refitted on the warm-up's ops, `keep_op_costs`). An
emulated straggler is a rate on that clock.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from dataclasses import asdict, is_dataclass
from typing import Any, Sequence

import ray

from .device_clock import Pace, check_rate, host_cores, make_clock


class DeviceWorker:
    """The plain class; `WORKER` below is its Ray actor form (kept separate so it stays importable
    and readable without Ray decorators in the way)."""

    def __init__(self, device: int, use_gpu: bool = False):
        import torch

        self.device_id = int(device)
        self.use_gpu = bool(use_gpu)
        if self.use_gpu:
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is always cuda:0 here.
            self.torch_device = torch.device("cuda", 0)
            torch.cuda.set_device(self.torch_device)
        else:
            self.torch_device = torch.device("cpu")
            # Several workers share few cores: one intra-op thread each keeps them from thrashing
            # and makes per-device compute time a property of the work, not of the contention.
            torch.set_num_threads(1)
        self.clock = make_clock(self.use_gpu)
        self.engine = None
        self.plan_id: str | None = None
        self._held = None            # this device's shards kept across a new world (close(keep_state=True))
        self.dataset = None
        self.mode: str | None = None
        self.seq_len: int | None = None
        self.world_ready = False
        self._listener = None        # rank 0's rendezvous socket, from pick_port to init_world
        self._shard_write = None     # this device's checkpoint files being written
        self.watchdog = None         # times this world's communication (init_world to close)

    # ------------------------------------------------------------------ where am I
    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "device": self.device_id,
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "torch_device": str(self.torch_device),
            "gpu_ids": ray.get_gpu_ids() if self.use_gpu else [],
            "plan_id": self.plan_id,
            "has_engine": self.engine is not None,
            "slowdown": self.clock.rate,
            "host_cores": host_cores(),
        }

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return self.device_id

    @ray.method(concurrency_group="control")
    def progress(self) -> int:
        """Ops this device's clock has finished so far: while the count moves, a step is working,
        however long it takes (a slow pace, more micro-batches after a device was lost)."""
        return self.clock.finished()

    # ------------------------------------------------------------------ world
    def pick_port(self) -> tuple[str, int]:
        """Rank 0: this node's cluster address and a port listening there, held until init_world
        hands it to the rendezvous store (runtime/rendezvous.py)."""
        from .rendezvous import listen

        if self._listener is not None:
            self._listener.close()
        ip = ray.util.get_node_ip_address()
        self._listener = listen(ip)
        return ip, self._listener.getsockname()[1]

    def init_world(self, addr: str, port: int, devices: Sequence[int], timeout_s: float = 120.0) -> str:
        """Join the world of these devices (sorted ids); this device's rank is its place among them."""
        import torch.distributed as dist

        from .collective_env import group_timeout, prepare_collective_env
        from .groups import abort_world, prepare_world, set_collective_timeout, set_world_devices
        from .rendezvous import join
        from .watchdog import Watchdog

        if dist.is_initialized():
            raise RuntimeError(f"device {self.device_id}: torch.distributed is already initialised; "
                               "create a new WorkerGroup instead of re-initialising a worker")
        backend = "nccl" if self.use_gpu else "gloo"
        prepare_collective_env(backend, os.environ)
        rank, listener, self._listener = list(devices).index(self.device_id), self._listener, None
        timeout = datetime.timedelta(seconds=float(timeout_s))
        join(backend, addr, port, rank, len(devices), timeout, listener, group_timeout(backend, timeout))
        set_world_devices(devices)
        set_collective_timeout(group_timeout(backend, timeout))
        prepare_world()
        self.watchdog = Watchdog(float(timeout_s), abort_world, progress=self.clock.finished)
        self.world_ready = True
        return backend

    # ------------------------------------------------------------------ data and plan
    def set_data(self, spec: Any, mode: str, seq_len: int) -> int:
        from .datasets import build_dataset

        self.dataset = build_dataset(spec)
        self.mode, self.seq_len = mode, int(seq_len)
        return len(self.dataset)

    def apply_plan(self, shape, plan_dict: dict, seed: int, optim, init: bool = True) -> dict[str, Any]:
        """Build this device's Engine for the plan (fresh state), or drop it when the device has no
        work. Migrating state between plans is the migration layer's job, not this one's."""
        from malleus_svc.plan import Plan

        from .engine import Engine
        from .groups import release_unused

        if not self.world_ready:
            raise RuntimeError(f"device {self.device_id}: init_world must run before apply_plan")
        plan = Plan.from_dict(plan_dict)
        self._drop_engine()
        self._held = None
        role = plan.roles().get(self.device_id)
        if role is not None:
            self.engine = Engine(shape, plan, self.device_id, seed=seed, optim=optim,
                                 device=self.torch_device, clock=self.clock, init=init)
        release_unused(plan, shape.tie_embeddings)
        self.plan_id = plan.plan_id
        return {"device": self.device_id, "plan_id": self.plan_id,
                "role": None if role is None else asdict(role)}

    def _drop_engine(self) -> None:
        eng, self.engine = self.engine, None
        close = getattr(eng, "close", None)
        if callable(close):
            close()

    # ------------------------------------------------------------------ training
    def train_step(self, micro_batch_ids: Sequence[Sequence[int]], loss_tokens: int) -> dict[str, Any]:
        """Collate this pipeline's micro-batches from sample ids and run one step.

        Returns the Engine's StepStats (as a dict) plus the sample ids this worker actually trained
        on, so the driver can audit exactly-once consumption from what the workers saw. The
        optimizer update waits for `apply_update()`, which the group sends once every device has
        returned from this step (a step that fails anywhere is applied nowhere). On GPU the peak
        memory read here covers the previous step's update, which ran after the last reading.
        """
        self._check_ready("train")
        t0 = time.perf_counter()
        with self._leaving_world_on_failure("a train step"):
            mbs = self._collate(micro_batch_ids)
            collate_s = time.perf_counter() - t0
            stats = self.engine.train_step(mbs, int(loss_tokens), apply=False)
        out = _as_dict(stats)
        out.update(
            device=self.device_id,
            plan_id=self.plan_id,
            sample_ids=[list(mb.sample_ids) for mb in mbs],
            tokens=sum(mb.num_tokens for mb in mbs),
            collate_seconds=collate_s,
            slowdown=self.clock.rate,
            pace_ops=self.clock.pace_count.ops,          # cumulative: the share that kept pace
            pace_on=self.clock.pace_count.on_pace,
            **self._memory(),
        )
        return out

    def eval_step(self, micro_batch_ids: Sequence[Sequence[int]], loss_tokens: int) -> dict[str, Any]:
        """The loss of this pipeline's share of held-out samples on the weights as they are (after
        the last update: Ray runs one caller's calls in order), forward only; see Engine.eval_step."""
        self._check_ready("evaluate")
        with self._leaving_world_on_failure("an evaluation"):
            loss = self.engine.eval_step(self._collate(micro_batch_ids), int(loss_tokens))
        return {"device": self.device_id, "loss": loss}

    def _check_ready(self, what: str) -> None:
        if self.engine is None:
            raise RuntimeError(f"device {self.device_id} has no work under plan {self.plan_id} "
                               f"(suspended, excluded, or no plan applied yet): nothing to {what}")
        if self.dataset is None:
            raise RuntimeError(f"device {self.device_id}: set_data must run before it can {what}")

    def _collate(self, micro_batch_ids: Sequence[Sequence[int]]) -> list:
        from .datasets import collate

        return [collate(self.dataset, list(ids), self.mode, self.seq_len) for ids in micro_batch_ids]

    def _watched(self, what: str):
        """Communication under the watchdog: a peer lost inside it raises PeerLost at the collective
        timeout, also where the host would otherwise wait on the device forever (NCCL)."""
        return self.watchdog.watch(what) if self.watchdog is not None else contextlib.nullcontext()

    def _kicking(self, exchange):
        """A migration's exchange that tells the watchdog of each round the host saw end (on gloo it
        waits for it; on NCCL it only enqueues, and a lost peer stalls the next step instead)."""
        def run(messages, tag: int) -> None:
            exchange(messages, tag)
            if self.watchdog is not None:
                self.watchdog.kick()
        return run

    @contextlib.contextmanager
    def _leaving_world_on_failure(self, what: str):
        """A failed step (a collective that lost a peer, data that would not collate) ends in a
        recovery, which starts by every survivor leaving the world with its state (`close`). Leaving
        now closes this device's connections, so the peers still waiting on it fail at once instead
        of at their collective timeout. On NCCL only once the watchdog has aborted the communicators:
        tearing down one with work pending may block."""
        try:
            with self._watched(what):
                yield
        except Exception:
            if not self.use_gpu or (self.watchdog is not None and self.watchdog.fired):
                self.close(keep_state=True)
            raise

    def apply_update(self, lr: float | None = None) -> dict[str, Any]:
        """The optimizer update of the last train_step at `lr` (None: the peak), and its seconds."""
        if self.engine is None:
            raise RuntimeError(f"device {self.device_id} has no work under plan {self.plan_id}: no update to apply")
        with self._watched("an optimizer update"):
            return {"update_seconds": self.engine.apply_update(lr)}

    def _memory(self) -> dict[str, int]:
        """Memory of this device now and at its peak over this step: CUDA allocations on GPU, the
        worker process's resident set on CPU (each worker is its own process)."""
        import torch

        if self.use_gpu:
            out = {"memory_bytes": torch.cuda.memory_allocated(), "peak_memory_bytes": torch.cuda.max_memory_allocated()}
            torch.cuda.reset_peak_memory_stats()
            return out
        return self.host_memory(reset=True)

    def host_memory(self, reset: bool = False) -> dict[str, int]:
        """This worker process's resident bytes now and at their peak since the last reset; `reset`
        starts a new peak (to measure one operation, e.g. a migration)."""
        from .host_memory import peak, reset_peak, resident

        out = {"memory_bytes": resident(), "peak_memory_bytes": peak()}
        if reset:
            reset_peak()
        return out

    def export_state(self):
        if self.engine is None:
            return None
        with self._watched("a state export"):
            return self.engine.export_state()

    def _migration_state(self):
        """What a migration sends from: the live shards, or a sharded optimizer's owned runs (neither
        communicates, so a device whose peers are lost can still give it)."""
        return self.engine.export_owned() if self.engine.optim.shard_optimizer else self.engine.export_state(copy=False)

    def load_pretrained(self, folder: str) -> bool:
        """Read this device's shards of a Hugging Face folder's weights into its Engine, if any."""
        if self.engine is None:
            return False
        self.engine.load_pretrained(folder)
        return True

    def load_state(self, states) -> bool:
        """Load ShardStates (e.g. `engine.full_shard_states(full)`) into this device's Engine, if any."""
        if self.engine is None:
            return False
        self.engine.load_state(states)
        return True

    # ------------------------------------------------------------------ checkpoints
    def write_checkpoint(self, folder: str, plan_dict: dict) -> int:
        """Snapshot this device's pieces of a checkpoint (`shard_files.pieces_written`: one replica
        of each) and write them into `folder` from a thread of their own, so training goes on;
        `checkpoint_written` waits for the files. Returns the number of files."""
        from malleus_svc.plan import Plan

        from .shard_files import ShardWrite, pieces_written, snapshot

        self._shard_write = None     # one not collected belonged to a save its coordinator gave up
        parts = {}
        if self.engine is not None:
            with self._watched("a checkpoint's state export"):
                live = self.engine.export_state(copy=False)
            written = pieces_written(Plan.from_dict(plan_dict), self.device_id, self.engine.shape)
            parts = {part: {n: snapshot(live[n]) for n in names} for part, names in written.items()}
        self._shard_write = ShardWrite(folder, self.device_id, parts)
        return len(parts)

    @ray.method(concurrency_group="checkpoint")
    def checkpoint_written(self) -> dict[str, dict]:
        """The manifest entries of the files `write_checkpoint` started, once written (on a thread of
        its own, so training calls are not held up while the files are written)."""
        write, self._shard_write = self._shard_write, None
        if write is None:
            raise RuntimeError(f"device {self.device_id}: no checkpoint write in progress (a fresh worker?)")
        return write.result()

    def load_checkpoint(self, folder: str, table: dict) -> bool:
        """Read this device's own rows out of a checkpoint's shard files (a `shard_files.ShardReader`
        table), verifying each file it opens; False without work."""
        from .shard_files import ShardReader

        if self.engine is None:
            return False
        with ShardReader(folder, self.engine.shape, table) as reader:
            self.engine.load_checkpoint(reader)
        return True

    # ------------------------------------------------------------------ live migration
    def migrate(self, old_plan_dict: dict, new_plan_dict: dict, shape, seed: int, optim,
                bucket_bytes: int, unavailable: Sequence[int] = ()) -> dict[str, Any]:
        """Move this device's state to where `new_plan_dict` needs it (see migrate.py), then build
        the Engine for the new plan from the migrated state, or none when the device has no work.

        Every worker of the world must call this at the same iteration boundary (those idle under
        both plans too: they take part in the schedule check and do nothing else). The state moved
        is the running engine's or, in the first world after a recovery or a rejoin, the shards
        `close(keep_state=True)` kept. `unavailable` devices lost theirs: they send nothing, and
        one that runs this call is a fresh worker that receives all it needs.
        """
        from malleus_svc.plan import Plan

        from .engine import Engine
        from .groups import release_unused
        from .migrate import execute_migration, plan_migration
        from .transport import exchange

        t0 = time.perf_counter()
        if not self.world_ready:
            raise RuntimeError(f"device {self.device_id}: init_world must run before migrate")
        old, new = Plan.from_dict(old_plan_dict), Plan.from_dict(new_plan_dict)
        fresh = self.device_id in set(unavailable)
        if not fresh and old.plan_id != self.plan_id:
            raise RuntimeError(f"device {self.device_id} runs plan {self.plan_id}, asked to migrate from {old.plan_id}")
        schedule = plan_migration(old, new, shape, bucket_bytes=int(bucket_bytes), unavailable=unavailable,
                                  sharded=optim.shard_optimizer)
        old_states = None if fresh else self._migration_state() if self.engine is not None else self._held
        export_s = time.perf_counter() - t0
        with self._watched("a migration"):
            states, stats = execute_migration(schedule, self.device_id, old_states, comm_device=self.torch_device,
                                              exchange=self._kicking(exchange))
        del old_states
        self._held = None    # only now: a migration that failed leaves the kept shards for another try
        t1 = time.perf_counter()
        self._drop_engine()
        role = new.roles().get(self.device_id)
        if role is not None:
            self.engine = Engine(shape, new, self.device_id, seed=seed, optim=optim,
                                 device=self.torch_device, clock=self.clock, init=False)
            with self._watched("loading the migrated state"):
                (self.engine.load_owned if optim.shard_optimizer else self.engine.load_state)(states)
        release_unused(new, shape.tie_embeddings)
        self.plan_id = new.plan_id
        out = _as_dict(stats)
        out.update(plan_id=self.plan_id, role=None if role is None else asdict(role), export_seconds=export_s,
                   build_seconds=time.perf_counter() - t1, seconds=time.perf_counter() - t0)
        return out

    def probe(self) -> dict[str, float]:
        """A fixed matmul workload on the device clock, for a device without work (suspended) to keep
        its straggling rate measured (control/measure.py): ~10 ms or more of GEMMs on a GPU."""
        import torch

        size, repeats = (4096, 8) if self.use_gpu else (128, 16)
        g = torch.Generator().manual_seed(1234)
        a = torch.randn(size, size, generator=g).to(self.torch_device)
        b = torch.randn(size, size, generator=g).to(self.torch_device) / size ** 0.5
        self.clock.read()
        with self.clock.op("probe", flops=2.0 * size ** 3 * repeats, blocks=1):   # launches like one block
            for _ in range(repeats):
                a = torch.tanh(a @ b)
        return {"device": self.device_id, "compute_seconds": self.clock.read().get("probe", 0.0),
                "pace_ops": self.clock.pace_count.ops, "pace_on": self.clock.pace_count.on_pace}

    def time_links(self, rounds: Sequence[Sequence[tuple[int, int]]], reducers: Sequence[int],
                   boundary_elements: int, reduce_elements: int, repeats: int = 9) -> dict:
        """This device's part of the job's link probe (runtime/link_probe.py); boundary tensors in
        the dtype the stage transport sends (the engine's working dtype)."""
        import torch

        from .link_probe import time_links
        from .precision import compute_dtype_for
        with self._watched("a link probe"):
            return time_links(self.device_id, [[tuple(p) for p in r] for r in rounds], list(reducers), int(boundary_elements),
                              int(reduce_elements), compute_dtype_for(self.torch_device, torch.float32),
                              self.torch_device, int(repeats))

    def length_sweep(self, shape, tps: Sequence[int], seq_len: int, link_gbps: float, layers: int = 2,
                     repeats: int = 9):
        """The length sweep on this worker's own device, between steps (runtime/length_sweep.py): the
        job's lengths up to `seq_len`, its compute dtype and kernels, a fresh clock of the device's
        kind (healthy, whatever this worker's emulated rate), each TP degree's shard alone and its
        collectives priced at `link_gbps`. Returns the fitted `LengthCost` and a report per degree."""
        from .length_sweep import device_sweeps
        return device_sweeps(shape, tps, seq_len=seq_len, device=self.torch_device, link_gbps=link_gbps,
                             layers=layers, repeats=repeats)

    # ------------------------------------------------------------------ the device's pace (CPU)
    def rehearse(self, tokens: int) -> list[dict] | None:
        """What each of this device's ops cost the host, unpaced (`device_clock.OpCost`, see
        Engine.rehearse); None without work."""
        if self.engine is None or self.use_gpu:
            return None
        pace, self.clock.pace, self.clock.op_costs = self.clock.pace, None, []
        try:
            self.engine.rehearse(int(tokens))
            return [asdict(op) for op in self.clock.op_costs]
        finally:
            self.clock.pace, self.clock.op_costs = pace, None

    def keep_op_costs(self, keep: bool) -> list[dict] | None:
        """From now on (`keep`), what each op of this device costs the host on its pace is kept;
        without `keep`, keeping stops and what was kept is returned (`device_clock.OpCost`): the
        warm-up's ops, to refit the pace. None on a GPU, or when nothing was being kept."""
        if self.use_gpu:
            return None
        kept, self.clock.op_costs = self.clock.op_costs, ([] if keep else None)
        return None if keep or kept is None else [asdict(op) for op in kept]

    def set_pace(self, flops_per_second: float, bytes_per_second: float, block_seconds: float = 0.0) -> None:
        """Emulate an accelerator of this speed (CPU workers; a GPU keeps its own)."""
        if not self.use_gpu:
            self.clock.pace = Pace(float(flops_per_second), float(bytes_per_second), float(block_seconds))

    # ------------------------------------------------------------------ straggler control
    @ray.method(concurrency_group="control")
    def set_slowdown(self, factor: float) -> float:
        """Emulation only: this device runs at `factor` times its ops' device time from its next op."""
        self.clock.rate = check_rate(factor)
        return self.clock.rate

    def close(self, keep_state: bool = False) -> None:
        """Leave the world. With `keep_state` this device's shards (parameters and Adam state) stay in
        memory, the engine does not: the next world's `migrate` sends them on, so a recovery or a
        rejoin moves state worker to worker and never through the driver."""
        import torch.distributed as dist

        from .groups import clear_group_cache

        if self.engine is not None:    # a second close (a rendezvous retry) keeps what the first kept
            self._held = self._migration_state() if keep_state else None
        self._drop_engine()
        if self.watchdog is not None:    # first: an abort under way ends before the world is torn down
            self.watchdog.close()
            self.watchdog = None
        if dist.is_initialized():       # not after an NCCL abort, which forgot the world
            dist.destroy_process_group()
        clear_group_cache()  # cached subgroups belonged to the world just destroyed
        self.world_ready = False


def _as_dict(stats: Any) -> dict[str, Any]:
    if is_dataclass(stats):
        return asdict(stats)
    if isinstance(stats, dict):
        return dict(stats)
    return dict(vars(stats))


# The actor: the methods marked with a concurrency group ("control", "checkpoint") run on that
# group's own thread; the default group keeps max_concurrency=1 so train_step, apply_plan and export_state never overlap.
# In order: the group sends apply_update without waiting and relies on it running before the next call.
WORKER = ray.remote(concurrency_groups={"control": 1, "checkpoint": 1},
                    allow_out_of_order_execution=False)(DeviceWorker)
