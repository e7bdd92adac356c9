"""The device clock: CPU workers that behave like accelerators of their own, and device time on
CUDA, checked on CPU against a fake that keeps CUDA's event rules.

The multi-process tests spawn one process per device (one torch thread each), as many as the
demo has workers where the point is contention (8 on this machine's cores)."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _host import inconclusive, require_pace
from _mp import run_on_gloo
from malleus_svc.config.presets import preset
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.control.workload import device_work, t0_flops
from malleus_svc.runtime.device_clock import (REFIT_QUANTILE, CudaClock, HostCost, OpCost, Pace, PacedClock,
                                              allowed_cores, fit_pace, host_cores, pace_for, refit_pace)
from malleus_svc.runtime.engine import Engine, OptimConfig
from test_engine import SEED, global_batches

TINY = preset("tiny")


# ---------------------------------------------------------------------------- a fake CUDA stream
class FakeStream:
    """Events recorded in order; an event completes when it, or an event recorded after it, is
    synchronised (a stream runs in order). `now` stamps them: the wall clock where real work and
    real waits run between them, or a virtual clock that only the test advances."""

    def __init__(self, now=time.perf_counter):
        self.recorded = self.completed = self.synchronizations = 0
        self.now = now


class FakeEvent:
    """A timing CUDA event as the CUDA clock uses it: stamped when recorded, and its time readable
    only once it completed (CUDA answers cudaErrorNotReady otherwise)."""

    def __init__(self, stream: FakeStream):
        self.stream, self.index, self.t = stream, None, None

    def record(self) -> None:
        self.stream.recorded += 1
        self.index, self.t = self.stream.recorded, self.stream.now()

    def synchronize(self) -> None:
        self.stream.synchronizations += 1
        self.stream.completed = max(self.stream.completed, self.index)

    def query(self) -> bool:
        return self.index is not None and self.index <= self.stream.completed

    def elapsed_time(self, end: "FakeEvent") -> float:
        for e in (self, end):
            if e.index is None or e.index > self.stream.completed:
                raise RuntimeError("CUDA error: device not ready (an event read before it completed)")
        return (end.t - self.t) * 1e3


class VirtualTime:
    """A device's own time, advanced only by the work the test says it does."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def run(self, seconds: float) -> None:
        self.t += seconds


def fake_cuda_clock(now=None) -> tuple[CudaClock, FakeStream]:
    """A CUDA clock on a fake stream: on the wall clock, the sleep kernel keeps the (fake) device
    busy by having the host itself wait; on a `VirtualTime`, it advances that time."""
    stream = FakeStream(now or time.perf_counter)
    sleep = (lambda cycles: now.run(cycles / 1e9)) if now is not None else (lambda cycles: time.sleep(cycles / 1e9))
    return CudaClock(events=lambda: FakeEvent(stream), sleep_kernel=sleep, cycles_per_second=1e9), stream


def test_the_cuda_clock_reads_once_per_step_and_leaves_collectives_out():
    device = VirtualTime()
    clock, stream = fake_cuda_clock(device)
    for _ in range(3):
        with clock.op("compute"):
            device.run(0.02)
            with clock.collective():
                device.run(0.05)            # waiting for a TP peer: not this device's compute
    with pytest.raises(RuntimeError, match="not ready"):      # the fake keeps CUDA's rule
        clock._ops[0].start.elapsed_time(clock._ops[0].end)
    seconds = clock.read()["compute"]
    assert stream.synchronizations == 1                       # one synchronisation for the whole step
    assert seconds == pytest.approx(0.06)
    clock.rate = 3.0                                          # an emulated straggler: 3x the op's own time
    with clock.op("compute"):
        device.run(0.02)
    assert clock.read()["compute"] == pytest.approx(0.06)


def test_the_clocks_count_the_ops_the_device_has_finished_without_waiting():
    """The watchdog's progress: a CUDA clock counts ops whose last event completed (queried, never
    waited for), across reads; a paced clock an op as it returns."""
    device = VirtualTime()
    clock, stream = fake_cuda_clock(device)
    for _ in range(3):
        with clock.op("compute"):
            device.run(0.01)
    assert clock.finished() == 0 and stream.synchronizations == 0     # queued, none known done
    clock._ops[1].end.synchronize()                                   # the GPU got past the second
    assert clock.finished() == 2
    clock.read()
    with clock.op("compute"):
        device.run(0.01)
    assert clock.finished() == 3                                      # read ones stay counted
    paced = PacedClock()
    for n in range(1, 3):
        with paced.op("compute"):
            pass
        assert paced.finished() == n


def test_an_op_that_does_not_hold_the_wall_keeps_its_device_time(monkeypatch):
    from malleus_svc.runtime import device_clock

    slow = Pace(flops_per_second=1e-3, bytes_per_second=1e9)   # 1 flop: 1000 s, a deadline no stall reaches
    for hold in (True, False):
        waits = []
        monkeypatch.setattr(device_clock, "_sleep_until", lambda deadline: waits.append(deadline))
        clock = PacedClock(pace=slow, hold=hold)
        t0 = time.perf_counter()
        with clock.op("compute", flops=1):
            pass
        t1 = time.perf_counter()
        assert clock.read() == {"compute": pytest.approx(1000)} and clock.pace_count.on_pace == 1
        # held: the op waits until its deadline, 1000 s after it began; not held: it returns at once
        assert len(waits) == hold and all(t0 + 1000 <= w <= t1 + 1000 for w in waits), (hold, t0, t1, waits)
    monkeypatch.undo()
    pace = Pace(flops_per_second=1e3, bytes_per_second=1e9)     # 50 flops: 50 ms of device time
    clock = PacedClock(pace=pace)
    t0 = time.perf_counter()
    with clock.op("compute", flops=50):
        pass
    assert time.perf_counter() - t0 >= 0.05     # the wait itself: the wall holds the device time, at least


# ---------------------------------------------------------------------------- pacing many workers
def _matmul_op(n: int = 160, repeats: int = 16):
    """An op long enough (tens of ms once paced) that a busy host's wake-up latency (a few ms at
    worst) is small beside it, on matrices small enough to stay in cache with 8 processes."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g) / n ** 0.5

    def op():
        for _ in range(repeats):
            torch.tanh(a @ b)
    return op, 2.0 * n ** 3 * repeats


def _host_cost(ops: int = 40) -> HostCost:
    torch.set_num_threads(1)
    clock, (op, flops) = PacedClock(), _matmul_op()
    x, y = torch.zeros(1 << 20), torch.ones(1 << 20)
    for _ in range(ops):
        with clock.op("compute", flops=flops):
            op()
        with clock.op("update", nbytes=3 * x.numel() * 4):
            x.add_(y)
    return clock.host


def _paced_device(rank: int, pace: Pace, ops: int, out_dir: str) -> None:
    from malleus_svc.runtime import device_clock

    torch.set_num_threads(1)
    late, sleep_until = [], device_clock._sleep_until

    def woken(deadline: float) -> None:     # how late the host woke this process: its doing, not the clock's
        sleep_until(deadline)
        late.append(time.perf_counter() - deadline)

    device_clock._sleep_until = woken
    clock, (op, flops) = PacedClock(pace=pace, rate=2.0 if rank == 0 else 1.0), _matmul_op()
    walls = []
    for _ in range(ops):
        t0 = time.perf_counter()
        with clock.op("compute", flops=flops):
            op()
        walls.append(time.perf_counter() - t0)
    torch.save({"walls": walls, "late": late, "ops": clock.pace_count.ops, "on_pace": clock.pace_count.on_pace,
                "nominal": pace.nominal(flops)}, os.path.join(out_dir, f"{rank}.pt"))


def test_a_device_at_rate_two_takes_twice_the_wall_time_with_eight_workers_sharing_the_cores():
    workers = 8
    # a wide margin (0.4 of each worker's share of the cores): the suite may run beside other work
    pace = pace_for([_host_cost()], host_cores(), workers, utilization=0.4)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_paced_device, args=(pace, 40, tmp), nprocs=workers, join=True)
        res = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(workers)]
    # lower quartiles: other work on the host only ever adds time, in bursts that can cover half of
    # one worker's 40 ops
    slow = statistics.quantiles(res[0]["walls"], n=4)[0]
    healthy = statistics.quantiles([w for r in res[1:] for w in r["walls"]], n=4)[0]
    nominal = res[0]["nominal"]
    print(f"rate 2: {slow * 1e3:.2f} ms per op, rate 1: {healthy * 1e3:.2f} ms (nominal {nominal * 1e3:.2f} ms)")
    require_pace(sum(r["on_pace"] for r in res), sum(r["ops"] for r in res))
    # Every device, the slowed one too, was woken on time from the deadlines its clock set: judged
    # on how late each sleep returned (the host's doing), not on the wall times, so that a wrong
    # deadline for the slowed device still fails below.
    late = max(statistics.quantiles(r["late"], n=4)[0] for r in res)
    if late > 0.025 * nominal:
        inconclusive(f"the host woke a device {late / nominal:.1%} of an op past its deadline "
                     "(lower quartile; needs 2.5%)")
    assert slow / healthy == pytest.approx(2.0, rel=0.05)


def test_the_host_cores_are_the_affinity_capped_by_a_containers_cpu_quota(tmp_path):
    cores = len(os.sched_getaffinity(0))
    assert allowed_cores(tmp_path) == cores                        # no quota files: the affinity
    v2 = tmp_path / "cpu.max"
    for text, expected in (("max 100000", cores), ("100000 100000", 1), ("150000 100000", 1),
                           (f"{cores + 4}00000 100000", cores), ("50000 100000", 1)):
        v2.write_text(text + "\n")
        assert allowed_cores(tmp_path) == expected, text
    v2.unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    for quota, expected in (("-1", cores), ("100000", 1)):      # cgroup v1
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
        assert allowed_cores(tmp_path) == expected, quota


def test_a_pace_is_sized_for_the_costliest_device_and_needs_both_kinds_of_op():
    cheap = HostCost(flops=1e9, flop_cpu_seconds=0.5, nbytes=1e9, byte_cpu_seconds=0.1)
    dear = HostCost(flops=1e9, flop_cpu_seconds=1.0, nbytes=1e9, byte_cpu_seconds=0.2)
    pace = pace_for([cheap, dear], cores=2, workers=8, utilization=0.5)
    assert pace.flops_per_second == pytest.approx(0.125 / 1e-9) and pace.bytes_per_second == pytest.approx(0.125 / 2e-10)
    with pytest.raises(ValueError, match="memory-bound"):
        pace_for([HostCost(flops=1e9, flop_cpu_seconds=1.0)], cores=2, workers=8)
    # a host busy with other work: all devices at once took 5x their CPU time, not the 4x of their share
    busy = HostCost(flops=1e9, flop_cpu_seconds=1.0, nbytes=1e9, byte_cpu_seconds=0.2,
                    flop_wall_seconds=5.0, byte_wall_seconds=0.5)
    pace = pace_for([cheap, busy], cores=2, workers=8, utilization=0.5)
    assert pace.flops_per_second == pytest.approx(0.5 / 5e-9) and pace.bytes_per_second == pytest.approx(0.125 / 2e-10)


def _host_op(kind: str, blocks: int, flops: float, first: bool) -> OpCost:
    """An op as a host runs it: a fixed cost per op (more on the first stage: the embedding's
    lookup), one per block, and a cost per FLOP; the wall time is the CPU time."""
    cpu = (3e-4 if first else 2e-4) + 1e-3 * blocks + 2e-11 * flops
    return OpCost(kind, flops, 0.0, blocks, cpu, cpu)


def test_a_fitted_pace_holds_every_op_of_any_stage_the_planner_may_cut_and_stays_proportional_in_blocks():
    """The rehearsal of two stages of 4 blocks (each op at two sizes, then its first block alone)
    sizes a pace whose time per block covers a one-block stage's fixed cost too: every op of a
    stage of 1-6 blocks at any size keeps pace, and a stage's nominal time is proportional to its
    blocks (what the planner's time model assumes)."""
    def rehearsal(first: bool) -> list[OpCost]:
        ops = []
        for blocks, flops in ((4, 4e8), (4, 1e8), (1, 2.5e7)):
            ops += [_host_op("forward", blocks, flops, first), _host_op("backward", blocks, 2 * flops, first)] * 3
        return ops + [OpCost("update", 0.0, 1e6, 0, 1e-3, 1e-3)] * 3
    utilization, share = 0.5, 2 / 4     # four devices computing at once on two cores
    pace = fit_pace([rehearsal(True), rehearsal(False)], cores=2, workers=4, utilization=utilization)
    assert pace.flops_per_second == pytest.approx(utilization * share / 2e-11)
    assert pace.block_seconds == pytest.approx((3e-4 + 1e-3) / share / utilization)   # the first stage's one block
    assert pace.bytes_per_second == pytest.approx(1e6 * utilization * share / 1e-3)
    for blocks in range(1, 7):
        for tokens_share in (0.01, 0.1, 1.0, 3.0):
            op = _host_op("forward", blocks, 1e8 * blocks * tokens_share, first=True)
            assert pace.nominal(op.flops, blocks=blocks) >= op.cpu_seconds / share / utilization, (blocks, tokens_share)
    one = pace.nominal(1e8, blocks=1)
    assert pace.nominal(5e8, blocks=5) == pytest.approx(5 * one)
    given = fit_pace([rehearsal(True)], cores=2, workers=4, flops_per_second=1e12, block_seconds=0.01)
    assert (given.flops_per_second, given.block_seconds) == (1e12, 0.01)
    with pytest.raises(ValueError, match="memory-bound"):
        fit_pace([rehearsal(True)[:-3]], cores=2, workers=4)


def test_a_refit_on_the_steps_own_ops_covers_what_a_cheap_rehearsal_missed_and_never_speeds_up():
    """A rehearsal's pace with too little time per block, and steps whose ops cost the host a fixed
    part per block, a part per FLOP and their micro-batches' spread of FLOPs, with a contention
    that stretches the wall time of most ops 1.5x and of one in twenty 3x: the refit fits the CPU
    costs exactly and gives each op its CPU times the contention at REFIT_QUANTILE over the
    utilization, so that every op stretched 1.5x keeps pace; terms the job gave stay, a pace already
    slow enough is kept, and ops of one kind leave the other kind's term alone."""
    rehearsed = Pace(flops_per_second=1e10, bytes_per_second=1e9, block_seconds=1e-4)

    def step_ops(stretch_every: int = 20) -> list[OpCost]:
        ops = []
        for i in range(40):
            flops = 1e7 * (1 + i % 7)
            cpu = 7e-4 * 4 + 4e-11 * flops
            stretch = 3.0 if i % stretch_every == 0 else 1.5
            ops.append(OpCost("compute", flops, 0.0, 4, cpu, cpu * stretch))
            ops.append(OpCost("update", 0.0, 5e6, 0, 4e-3, 4e-3 * stretch))
        return ops
    utilization = 0.75
    pace = refit_pace(rehearsed, [step_ops(), step_ops()], utilization)
    contention = 1.5 / utilization            # REFIT_QUANTILE of the stretches, over the utilization
    assert REFIT_QUANTILE < 1 - 1 / 20
    assert pace.block_seconds == pytest.approx(contention * 7e-4)
    assert pace.flops_per_second == pytest.approx(rehearsed.flops_per_second)   # 1 / (contention x 4e-11) is faster
    assert pace.bytes_per_second == pytest.approx(5e6 / (contention * 4e-3))
    for op in step_ops():
        if op.wall_seconds <= 1.5 * op.cpu_seconds:
            assert pace.nominal(op.flops, op.nbytes, op.blocks) >= op.wall_seconds
    assert refit_pace(pace, [step_ops()], utilization) == pace                   # held: nothing changes
    slow = Pace(1e9, 1e8, 1e-2)
    assert refit_pace(slow, [step_ops()], utilization) == slow                   # never faster
    kept = refit_pace(rehearsed, [step_ops()], utilization, keep=(True, True, True))
    assert kept == rehearsed
    compute_only = refit_pace(rehearsed, [[op for op in step_ops() if op.flops]], utilization)
    assert compute_only.bytes_per_second == rehearsed.bytes_per_second


def test_work_units_under_a_time_per_block_give_every_healthy_device_the_same_unit_time():
    """Devices with different blocks, micro-batch sizes and TP shares of a healthy cluster: each one's
    device time over its work is t0's time, so none reads as a straggler, and a device at rate 3
    reads exactly 3."""
    job = types.SimpleNamespace(shape=TINY)    # what the work units read of a scenario
    plan = Plan(num_devices=4, num_layers=TINY.layers, micro_batch_size=2,
                pipelines=(Pipeline((Stage((0,), (0, 1)), Stage((1,), (1, TINY.layers))), micro_batches=3),
                           Pipeline((Stage((2, 3), (0, TINY.layers)),), micro_batches=1)))
    unit = t0_flops(job, plan)
    pace = Pace(unit / 1e-3, 1e9, block_seconds=1e-3)    # t0: 1 ms of FLOPs and 2 ms of block passes
    reports = {0: (1, 0.3 * unit), 1: (TINY.layers - 1, 2.1 * unit), 2: (TINY.layers, 0.7 * unit),
               3: (TINY.layers, 0.7 * unit)}   # (blocks per op, forward FLOPs of one op)
    rates = {0: 1.0, 1: 3.0, 2: 1.0, 3: 1.0}
    devices = {}
    for d, (blocks, flops) in reports.items():
        ops = 2 * 3      # three micro-batches, a forward and a backward each
        busy = rates[d] * 3 * (pace.nominal(flops, blocks=blocks) + pace.nominal(2 * flops, blocks=blocks))
        devices[d] = {"flops": 3 * 3 * flops, "block_ops": ops * blocks, "compute_seconds": busy}
    work = device_work(plan, job, devices, pace=pace)
    t0 = pace.nominal(unit, blocks=2)
    for d, s in devices.items():
        assert s["compute_seconds"] / work[d] == pytest.approx(rates[d] * t0, rel=1e-12), d
    # what the FLOPs alone would say: device 2's ops carry few FLOPs per block, a false straggler
    flops_only = device_work(plan, job, devices)
    assert devices[2]["compute_seconds"] / flops_only[2] > 1.4 * devices[0]["compute_seconds"] / flops_only[0]


# ---------------------------------------------------------------------------- engines on the clock
TP2 = Plan(num_devices=2, num_layers=TINY.layers, micro_batch_size=2,
           pipelines=(Pipeline((Stage((0, 1), (0, TINY.layers)),), micro_batches=2),))
PP2 = Plan(num_devices=2, num_layers=TINY.layers, micro_batch_size=2,
           pipelines=(Pipeline((Stage((0,), (0, 2)), Stage((1,), (2, TINY.layers))), micro_batches=3),))


# A later stage at TP 2, its devices out of id order: its rehearsal takes its rows of the tokens.
LATER_TP2 = Plan(num_devices=3, num_layers=TINY.layers, micro_batch_size=2,
                 pipelines=(Pipeline((Stage((0,), (0, 2)), Stage((2, 1), (2, TINY.layers))), micro_batches=2),))


def _rehearsed_flops(rank: int, world: int) -> float:
    engine = Engine(TINY, LATER_TP2, rank, seed=SEED, optim=OptimConfig(lr=1e-3), clock=PacedClock())
    engine.rehearse(13)       # odd: the two ranks hold 6 and 7 rows
    return engine.clock.host.flops


def test_every_stage_rehearses_on_the_rows_its_ranks_hold():
    assert all(f > 0 for f in run_on_gloo(_rehearsed_flops, 3))


def _shared_pace(engine: Engine, batches, utilization: float = 0.4) -> Pace:
    """One pace for every rank: rehearsed on each at the batches' mean micro-batch size, sized for
    the costliest rank (as WorkerGroup.pace does), with a wide margin: the suite may run beside
    other work."""
    clock = engine.clock
    micro = [mb for batch in batches for mb in batch]
    engine.rehearse(sum(mb.num_tokens for mb in micro) // len(micro))
    c = clock.host
    worst = torch.tensor([c.flop_cpu_seconds / c.flops, c.byte_cpu_seconds / c.nbytes], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return pace_for([HostCost(1.0, float(worst[0]), 1.0, float(worst[1]))], host_cores(), dist.get_world_size(),
                    utilization)


def _tp_pair(rank: int, world: int, kind: str):
    """Per step: this member's device seconds, and whether every one of its ops kept its pace."""
    clock = fake_cuda_clock()[0] if kind == "cuda" else PacedClock()
    engine = Engine(TINY, TP2, rank, seed=SEED, optim=OptimConfig(lr=1e-3), clock=clock)
    batches = global_batches(1, 2, 2) * 15     # one batch again and again: every step is the same work
    if kind == "paced":
        clock.pace = _shared_pace(engine, batches)
    seconds, kept = [], []
    for step, batch in enumerate(batches):
        if rank == 1:
            clock.rate = 3.0 if _peer_slow(step) else 1.0
        tokens = sum(mb.num_loss_tokens for mb in batch)
        ops, on_pace = clock.pace_count.ops, clock.pace_count.on_pace
        seconds.append(engine.train_step(batch, tokens).compute_seconds)
        kept.append(clock.pace_count.ops - ops == clock.pace_count.on_pace - on_pace)
    return seconds, kept


def _peer_slow(step: int) -> bool:
    """Step 0 warms up; after it the peer is slow on every other step, so each slow step has a
    healthy neighbour run under the same host load."""
    return step > 0 and step % 2 == 0


@pytest.mark.parametrize("kind", ["paced", "cuda"])
def test_a_healthy_member_of_a_tp_group_does_not_take_on_its_slow_peers_time(kind):
    (healthy, kept0), (slowed, kept1) = run_on_gloo(_tp_pair, 2, kind)
    pairs = [(s - 1, s) for s in range(len(healthy)) if _peer_slow(s)]        # (peer healthy, peer slow)
    if kind == "paced":
        # device time is exact on steps whose every op, on both members, kept its pace
        pairs = [(a, b) for a, b in pairs if kept0[a] and kept0[b] and kept1[a] and kept1[b]]
        if len(pairs) < 3:
            inconclusive(f"{len(pairs)} pairs of neighbouring steps kept their pace on both members (needs 3)")
    grew = [healthy[slow] - healthy[fast] for fast, slow in pairs]
    peer_grew = [slowed[slow] - slowed[fast] for fast, slow in pairs]
    print(f"{kind}: healthy member's step grew {statistics.median(grew) * 1e3:+.1f} ms when its peer's grew "
          f"{statistics.median(peer_grew) * 1e3:+.1f} ms (medians of {len(pairs)} neighbouring pairs)")
    if kind == "paced":
        # on pace, the slowed member takes exactly 3x, and the healthy one exactly its own time
        assert all(slowed[s] == pytest.approx(3.0 * slowed[f]) for f, s in pairs), (slowed, pairs)
        assert all(healthy[s] == pytest.approx(healthy[f]) for f, s in pairs), (healthy, pairs)
        return
    # The fake CUDA stream stamps its events on the wall clock around real compute on a shared CPU.
    # Neighbouring steps see the same load, so their difference leaves the host's drift out, as long
    # as the host's own noise (the healthy member's steps while its peer was healthy too, step to
    # step) is well below the effect judged.
    fast = [healthy[f] for f, _ in pairs]
    noise = statistics.median(abs(a - b) for a, b in zip(fast, fast[1:]))
    if noise > 0.1 * statistics.median(peer_grew):
        inconclusive(f"the healthy member's steps moved {noise * 1e3:.1f} ms from one to the next, against "
                     f"{statistics.median(peer_grew) * 1e3:.1f} ms of the peer's growth (needs 10%)")
    # The slowed member is clearly slower than its healthy peer over the same steps (the rate
    # itself is checked on the virtual stream above and on a GPU by gpu_check).
    assert statistics.median(slowed[s] / healthy[s] for _, s in pairs) > 2.0
    # Had the healthy member's clock taken in its wait for the peer, its step would have grown as
    # much as the peer's (2x its compute).
    assert statistics.median(grew) < 0.25 * statistics.median(peer_grew), (grew, peer_grew)


def _pp_losses(rank: int, world: int):
    out = {}
    for kind in ("unpaced", "paced"):
        clock = PacedClock()
        engine = Engine(TINY, PP2, rank, seed=SEED, optim=OptimConfig(lr=1e-3), clock=clock)
        batches = global_batches(3, 3, 2)
        if kind == "paced":
            clock.pace, clock.rate = _shared_pace(engine, batches), 2.0 if rank == 1 else 1.0
        losses = []
        for batch in batches:
            tokens = sum(mb.num_loss_tokens for mb in batch)
            losses.append(engine.train_step(batch, tokens).global_loss)
        out[kind] = (losses, {k: v.param for k, v in engine.export_state().items()})
    return out


def test_pacing_leaves_the_losses_and_the_weights_bitwise_unchanged():
    for res in run_on_gloo(_pp_losses, 2):
        assert res["paced"][0] == res["unpaced"][0]
        assert all(torch.equal(res["paced"][1][k], v) for k, v in res["unpaced"][1].items())
