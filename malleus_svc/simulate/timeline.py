"""One training iteration of a Plan under TRUE straggling rates, as a discrete-event simulation.

Why a simulation and not the planner's closed form: the planner scores plans with
(m_i + S_i - 1)·z_i plus a gradient term (the Malleus time model, `planner.lower`), which is exact only
for uniform stages without communication. Real pipelines have uneven stages, p2p transfers that
are intra- or inter-node, a gradient all-reduce that waits for the slowest pipeline holding the
same blocks, and rates that the planner snapped to 1.0 below τ. The simulator replays the 1F1B
schedule op by op, so its answer is the reference the planner (and the baselines) are judged by.

Time model (all in t0 units: forward+backward of one block, one micro-batch, healthy full-size
TP group; `problem.t0_seconds` converts):
  * compute of stage (i, j) per micro-batch: c_ij = l_ij · α(|g_ij|) · max_{d ∈ g_ij} x_d, TP
    collectives included in α; no τ snap (true rates). Forward takes c/(1+r), backward c·r/(1+r),
    with r = `SimOptions.backward_ratio` (2: backward ≈ 2× forward), and c/(1+r) more on a stage
    that recomputes its blocks (`Stage.recompute`);
  * p2p between stage j and j+1: `CommCosts.p2p_intra_node` or `p2p_inter_node` per micro-batch
    for forward + backward, split evenly between the activation (forward) and its gradient
    (backward), since both have the same size. With `p2p="blocking"` (default) the transfer
    occupies the SENDER's stream right after the op that produced it (Megatron's 1F1B waits on
    its batched isend/irecv before the next compute op); with `p2p="overlapped"` it occupies a
    FIFO link per (boundary, direction) and compute goes on;
  * gradient reduction, behind the last backward (`SimOptions.overlap_grad_reduce`, as the runtime
    does it): the last micro-batch's backward of a stage runs block by block, from its last block
    to its first, and block b's reduction may start once every stage holding b (in any pipeline)
    has passed b there. It lasts grad_sync_per_block / min_{holders h of b} |g_h| (each device
    all-reduces its 1/|g| shard over its own link; a block held by a small group in some pipeline
    is as slow as that group's shard), 0 for a block one pipeline holds, and a stage's
    reductions run one after another on its link, in backward's order. Without the overlap a
    stage's reductions start when every stage sharing a block with it has finished its last op;
  * optimizer step of stage (i, j) after its reduction: `optimizer_per_block` · l_ij ·
    (tp/|g_ij|) · max rate, over P with the optimizer sharded among the P pipelines (Adam is
    memory-bound on the device's state shard; by default the problem's `optimizer_per_block`, as
    the planner prices it);
  * pipeline hand-off (`SimOptions.handoff`, default 0): a latency per micro-batch per boundary,
    one value for the forward activation and one for the backward gradient, from the end of the
    op that produced the tensor (or of its blocking send) to the moment the next stage may use it.
    It occupies no stream: the runtime posts an isend and goes on, the receiver blocks in its
    irecv (the receiver waits only if it is already idle, so the latency costs time exactly where
    the hand-off is on the critical path: at every boundary crossing of a balanced 1F1B, rarely in
    an unbalanced one). Independent of, and added after, the CommCosts p2p term above;
  * co-run interference (`SimOptions.corun_slowdown` κ, default 0): devices of one node share the
    host (cores, memory bandwidth, the OS's other work). While k devices of OTHER stages on the
    same node compute, a compute op (forward, backward, optimizer step) progresses at 1/(1 + κ·k)
    of its speed alone: processor sharing with piecewise-constant rates, simulated exactly (an
    op's remaining work is re-timed whenever a neighbour starts or stops). Devices of the op's own
    TP group do not count: their contention is part of α(|g|). On a GPU cluster κ ≈ 0; on a CPU
    machine with one core per device it is what the OS's other threads steal once every core is
    busy (see `bench/calibrate.py`);
  * per-micro-batch sizes (`simulate(..., work=, volume=)`, default all 1): micro-batch k of
    pipeline i may differ from the planner's fixed-size one, as packed variable-length
    micro-batches do (length-aware assignment). Its compute on every stage is c_ij · work[i][k] and its p2p
    transfers are the boundary's time · volume[i][k] (activation bytes follow its tokens); the
    hand-off latency, gradient reduction and optimizer step do not depend on it. One factor per
    micro-batch for all stages is exact when a micro-batch's time scales alike on every stage
    (one TP degree per pipeline, as `lengths.LengthCost` with stages of one TP degree);
  * embedding and head compute are not modelled (as in the planner). The iteration ends when
    every stage has stepped.

Memory: see `memory.py`; the in-flight micro-batch count per stage is read off the simulated
schedule (forwards issued minus backwards done, maximised), not assumed.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from ..costmodel.profile import BACKWARD_RATIO, RECOMPUTED_FORWARD
from ..geometry import one_f_one_b
from ..plan import Plan
from ..planner.problem import PlannerProblem

P2PMode = Literal["blocking", "overlapped"]


class SimulationError(RuntimeError):
    """The schedule could not complete (a dependency cycle): a bug in the schedule, not bad input."""


@dataclass(frozen=True)
class SimOptions:
    backward_ratio: float = BACKWARD_RATIO   # backward time / forward time
    p2p: P2PMode = "blocking"
    optimizer_per_block: float | None = None   # t0 per block at full TP on a healthy device (None: the problem's)
    record_ops: bool = False           # keep every op's (start, end) in the result (for plots and tests)
    handoff: tuple[float, float] = (0.0, 0.0)   # t0 per micro-batch per boundary: (activation, gradient) latency
    corun_slowdown: float = 0.0        # κ: compute takes 1 + κ·k times longer while k devices of other stages
                                       # on its node compute
    overlap_grad_reduce: bool = True   # a block's reduction starts as its last backward passes it (the runtime's)

    def __post_init__(self) -> None:
        if self.backward_ratio <= 0:
            raise ValueError(f"backward_ratio must be > 0, got {self.backward_ratio}")
        if self.p2p not in ("blocking", "overlapped"):
            raise ValueError(f"p2p must be 'blocking' or 'overlapped', got {self.p2p!r}")
        if self.optimizer_per_block is not None and self.optimizer_per_block < 0:
            raise ValueError(f"optimizer_per_block must be >= 0, got {self.optimizer_per_block}")
        if len(self.handoff) != 2 or min(self.handoff) < 0:
            raise ValueError(f"handoff must be (forward, backward) latencies >= 0, got {self.handoff}")
        if self.corun_slowdown < 0:
            raise ValueError(f"corun_slowdown must be >= 0, got {self.corun_slowdown}")


# ----------------------------------------------------------------------------- the event engine
@dataclass
class _Op:
    label: tuple            # (kind, pipeline, stage, micro-batch); kind: F B sendF sendB handoffF handoffB sync step
    resource: tuple
    duration: float         # work: seconds (t0) it takes when it runs alone
    deps: list[int] = field(default_factory=list)
    start: float = -1.0
    end: float = -1.0
    share: tuple | None = None   # (host key, devices): a compute op that shares its host with other stages' ops


class EventEngine:
    """Ops on serial resources, each resource running its ops in a fixed order, each op waiting
    for its dependencies. Completions are processed in time order from a heap; an op starts the
    moment it is at the head of its resource's queue, the resource is idle and all its
    dependencies have completed.

    With `corun_slowdown` κ > 0, ops added with a `share` = (host, devices) progress at
    1/(1 + κ·k), k = the devices of the OTHER running shared ops on the same host; the rates are
    piecewise constant, so the remaining work of every running op of a host is re-timed whenever
    an op of that host starts or ends (exact processor sharing, no time step). κ = 0 runs the
    plain algorithm: every op lasts its duration."""

    def __init__(self, corun_slowdown: float = 0.0) -> None:
        if corun_slowdown < 0:
            raise ValueError(f"corun_slowdown must be >= 0, got {corun_slowdown}")
        self.ops: list[_Op] = []
        self.queues: dict[tuple, list[int]] = {}
        self.corun_slowdown = float(corun_slowdown)

    def add(self, label: tuple, resource: tuple, duration: float, share: tuple | None = None) -> int:
        if duration < 0:
            raise ValueError(f"op {label} has a negative duration {duration}")
        if share is not None and (len(share) != 2 or share[1] < 1):
            raise ValueError(f"op {label}: share must be (host, devices >= 1), got {share}")
        self.ops.append(_Op(label, resource, float(duration), share=share))
        self.queues.setdefault(resource, []).append(len(self.ops) - 1)
        return len(self.ops) - 1

    def depend(self, op: int, on: int) -> None:
        self.ops[op].deps.append(on)

    def run(self) -> None:
        ops = self.ops
        waiting = [len(o.deps) for o in ops]
        dependents: list[list[int]] = [[] for _ in ops]
        for i, o in enumerate(ops):
            for d in o.deps:
                dependents[d].append(i)
        head = {r: 0 for r in self.queues}
        busy = {r: False for r in self.queues}
        heap: list[tuple] = []   # (end, op), or (end, op, version) when sharing: stale versions are skipped
        done = 0
        kappa = self.corun_slowdown
        fluid = kappa > 0 and any(o.share is not None and o.duration > 0 for o in ops)
        if fluid:   # processor sharing state
            running: dict = {}                 # host -> running shared ops
            load: dict = {}                    # host -> devices of its running shared ops
            left = [o.duration for o in ops]   # remaining work
            rate = [1.0] * len(ops)
            since = [0.0] * len(ops)           # time of the last re-timing
            version = [0] * len(ops)

        def shared(i: int) -> bool:
            return fluid and ops[i].share is not None and ops[i].duration > 0

        def retime(host, now: float) -> None:
            for j in running[host]:
                left[j] = max(0.0, left[j] - (now - since[j]) * rate[j])
                since[j] = now
            for j in running[host]:
                rate[j] = 1.0 / (1.0 + kappa * (load[host] - ops[j].share[1]))
                version[j] += 1
                heapq.heappush(heap, (now + left[j] / rate[j], j, version[j]))

        def try_start(resource: tuple, now: float) -> None:
            q, k = self.queues[resource], head[resource]
            if busy[resource] or k >= len(q) or waiting[q[k]]:
                return
            i = q[k]
            op = ops[i]
            op.start = now
            busy[resource] = True
            if shared(i):
                host = op.share[0]
                running.setdefault(host, set()).add(i)
                load[host] = load.get(host, 0) + op.share[1]
                since[i] = now
                retime(host, now)
            else:
                op.end = now + op.duration
                heapq.heappush(heap, (op.end, i, version[i]) if fluid else (op.end, i))

        for r in self.queues:
            try_start(r, 0.0)
        while heap:
            if fluid:
                now, i, ver = heapq.heappop(heap)
                if ver != version[i]:
                    continue
                ops[i].end = now
                if shared(i):
                    host = ops[i].share[0]
                    running[host].discard(i)
                    load[host] -= ops[i].share[1]
                    retime(host, now)
            else:
                now, i = heapq.heappop(heap)
            done += 1
            r = ops[i].resource
            busy[r] = False
            head[r] += 1
            touched = {r}
            for j in dependents[i]:
                waiting[j] -= 1
                if not waiting[j]:
                    touched.add(ops[j].resource)
            for res in sorted(touched, key=repr):
                try_start(res, now)
        if done != len(ops):
            stuck = [ops[q[head[r]]].label for r, q in self.queues.items() if head[r] < len(q)]
            raise SimulationError(f"{len(ops) - done} ops never ran; blocked heads: {stuck[:6]}")


@dataclass(frozen=True)
class StageResult:
    pipeline: int
    stage: int
    devices: tuple[int, ...]
    layers: tuple[int, int]
    rate: float               # α(|g|) · max true rate in the group
    compute_per_mb: float     # t0, forward + backward of one micro-batch (of work 1)
    busy: float               # t0 of compute and blocking sends (work: without co-run interference)
    last_backward_end: float
    sync_start: float
    sync_end: float
    step_end: float
    max_in_flight: int        # micro-batches whose activations were alive at once


@dataclass(frozen=True)
class PipelineResult:
    micro_batches: int
    stages: tuple[StageResult, ...]

    @property
    def compute_end(self) -> float:
        return max(s.last_backward_end for s in self.stages)

    @property
    def end(self) -> float:
        return max(s.step_end for s in self.stages)


@dataclass(frozen=True)
class SimResult:
    iteration_t0: float
    t0_seconds: float
    pipelines: tuple[PipelineResult, ...]
    ops: tuple[tuple[tuple, float, float], ...] = ()   # (label, start, end) when record_ops

    @property
    def iteration_seconds(self) -> float:
        return self.iteration_t0 * self.t0_seconds

    def stages(self) -> list[StageResult]:
        return [s for p in self.pipelines for s in p.stages]


def stage_rate(problem: PlannerProblem, devices: Sequence[int], rates: Sequence[float]) -> float:
    """α(|g|) · max true rate: time of one block for one micro-batch on this group, in t0."""
    return problem.alpha(len(devices)) * max(rates[d] for d in devices)


# What `malleus simulate` and the planner's exact judge simulate at most: forward and backward ops
# of one iteration (each op is an event: about 10 s and 400 MB for this many here).
MAX_SIMULATED_OPS = 100_000


def simulated_ops(plan: Plan) -> int:
    """Forward and backward ops of one iteration of `plan`: micro-batches x stages x 2 per pipeline."""
    return sum(2 * p.micro_batches * len(p.stages) for p in plan.pipelines)


def simulate(plan: Plan, problem: PlannerProblem, rates: Sequence[float] | Mapping[int, float] | None = None,
             options: SimOptions = SimOptions(), work: Sequence[Sequence[float]] | None = None,
             volume: Sequence[Sequence[float]] | None = None) -> SimResult:
    """Simulate one iteration of `plan` under `rates` (default: the problem's rates, which are
    then taken as true). `rates` may be a full per-device sequence or a {device: rate} mapping.
    `work[i][k]` / `volume[i][k]` scale the compute / p2p of micro-batch k of pipeline i (module
    docstring; default 1: every micro-batch the planner's fixed size)."""
    x = _rate_vector(problem, rates)
    if plan.num_devices != problem.num_devices or plan.num_layers != problem.num_layers:
        raise ValueError(f"plan is for {plan.num_devices} devices and {plan.num_layers} layers, the problem has "
                         f"{problem.num_devices} and {problem.num_layers}")
    work = _per_micro_batch(plan, work, "work")
    volume = _per_micro_batch(plan, volume, "volume")
    comm = problem.comm
    fwd_share = 1.0 / (1.0 + options.backward_ratio)
    eng = EventEngine(options.corun_slowdown)
    # Per stage: compute time, p2p time of its outgoing boundary (half per direction).
    info = []
    for i, pipe in enumerate(plan.pipelines):
        row = []
        for j, st in enumerate(pipe.stages):
            y = stage_rate(problem, st.devices, x)
            row.append((y, y * st.num_layers))
        info.append(row)

    def host(st) -> tuple | None:
        """(node, devices) of a stage, for co-run interference (a TP group never spans nodes)."""
        return (plan.node_of(st.devices[0]), len(st.devices)) if options.corun_slowdown > 0 else None

    def boundary(pipe_idx: int, j: int) -> float:
        """p2p per micro-batch (fwd + bwd) between stage j and j+1."""
        a, b = plan.pipelines[pipe_idx].stages[j:j + 2]
        same = plan.node_of(a.devices[0]) == plan.node_of(b.devices[0])
        return (comm.p2p_intra_node if same else comm.p2p_inter_node) * comm.p2p_share(min(a.tp, b.tp), same)

    holders: list[list[tuple[int, int]]] = [[] for _ in range(plan.num_layers)]
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            for b in range(*st.layers):
                holders[b].append((i, j))

    def block_sync(b: int) -> float:
        if len({h[0] for h in holders[b]}) < 2:
            return 0.0
        return comm.grad_sync_per_block / min(plan.pipelines[a].stages[c].tp for a, c in holders[b])

    def overlapped(st) -> bool:
        """The stage's reductions go behind its last backward: some block of it is reduced."""
        return overlap and any(block_sync(b) > 0 for b in range(*st.layers))

    compute_ids: dict[tuple, int] = {}     # ("F"/"B", i, j, k) -> op (its last part)
    entry: dict[tuple, int] = {}           # ("F"/"B", i, j, k) -> its first part, which waits for its input
    passed: dict[tuple[int, int, int], int] = {}   # (i, j, block) -> the part of the last backward that passes it
    arrive: dict[tuple, int] = {}          # ("F"/"B", i, j, k) -> op after which the output has arrived
    last_op: dict[tuple[int, int], int] = {}
    in_flight: dict[tuple[int, int], int] = {}
    blocking = options.p2p == "blocking"
    overlap = options.overlap_grad_reduce
    optimizer_per_block = (problem.optimizer_per_block if options.optimizer_per_block is None
                           else options.optimizer_per_block)
    shared = len(plan.pipelines) if problem.memory.sharded else 1   # ZeRO-1: each pipeline updates 1/P
    for i, pipe in enumerate(plan.pipelines):
        S, m = len(pipe.stages), pipe.micro_batches
        for j in range(S):
            c = info[i][j][1]
            down = boundary(i, j) / 2 if j < S - 1 else 0.0   # forward output to j+1
            up = boundary(i, j - 1) / 2 if j > 0 else 0.0     # backward gradient to j-1
            live = peak = 0
            share = host(pipe.stages[j])
            first, end = pipe.stages[j].layers
            split = overlapped(pipe.stages[j])
            for kind, k in one_f_one_b(S, j, m):
                # a recomputing stage runs (some of) the forward again in each backward
                part = fwd_share if kind == "F" else \
                    1 - fwd_share + fwd_share * RECOMPUTED_FORWARD[pipe.stages[j].recompute]
                dur = c * work[i][k] * part
                # 1F1B's backwards run in micro-batch order: the last one finalises the gradients, block
                # by block, where an overlapped reduction needs to see it
                blocks = range(end - 1, first - 1, -1) if kind == "B" and k == m - 1 and split else (None,)
                for b in blocks:
                    op = eng.add((kind, i, j, k), ("gpu", i, j), dur / len(blocks), share=share)
                    entry.setdefault((kind, i, j, k), op)
                    passed[(i, j, b)] = op
                compute_ids[(kind, i, j, k)] = arrive[(kind, i, j, k)] = last_op[(i, j)] = op
                send = (down if kind == "F" else up) * volume[i][k]
                if send > 0 and blocking:
                    s_op = eng.add(("send" + kind, i, j, k), ("gpu", i, j), send)
                    eng.depend(s_op, op)
                    arrive[(kind, i, j, k)] = last_op[(i, j)] = s_op
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            in_flight[(i, j)] = peak
        if not blocking:   # link ops in micro-batch order per (boundary, direction)
            for j in range(S):
                for kind, send, ok in (("F", boundary(i, j) / 2 if j < S - 1 else 0.0, j < S - 1),
                                       ("B", boundary(i, j - 1) / 2 if j > 0 else 0.0, j > 0)):
                    if not ok or send <= 0:
                        continue
                    for k in range(m):
                        s_op = eng.add(("send" + kind, i, j, k), ("link", i, j, kind), send * volume[i][k])
                        eng.depend(s_op, compute_ids[(kind, i, j, k)])
                        arrive[(kind, i, j, k)] = s_op
        for j in range(S):   # hand-off latency: a delay on a private resource, after any transfer
            for kind, lat, ok in (("F", options.handoff[0], j < S - 1), ("B", options.handoff[1], j > 0)):
                if not ok or lat <= 0:
                    continue
                for k in range(m):
                    h_op = eng.add(("handoff" + kind, i, j, k), ("handoff", i, j, kind, k), lat)
                    eng.depend(h_op, arrive[(kind, i, j, k)])
                    arrive[(kind, i, j, k)] = h_op
        for j in range(S):
            for k in range(m):
                if j > 0:
                    eng.depend(entry[("F", i, j, k)], arrive[("F", i, j - 1, k)])
                if j < S - 1:
                    eng.depend(entry[("B", i, j, k)], arrive[("B", i, j + 1, k)])
                else:
                    eng.depend(entry[("B", i, j, k)], compute_ids[("F", i, j, k)])
    # Gradient reduction and optimizer step.

    sync_ids, step_ids = {}, {}   # (i, j) -> (first, last) reduction op; the optimizer step
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            if overlapped(st):    # one reduction per block, in backward's order, as each is passed everywhere
                syncs = []
                for b in range(st.layers[1] - 1, st.layers[0] - 1, -1):
                    syncs.append(eng.add(("sync", i, j, -1), ("net", i, j), block_sync(b)))
                    for a, c in holders[b]:
                        eng.depend(syncs[-1], passed[(a, c, b)])
            else:          # one reduction for the stage, once every stage sharing a block has finished
                syncs = [eng.add(("sync", i, j, -1), ("net", i, j), sum(map(block_sync, range(*st.layers))))]
                for p in sorted({(i, j)} | {h for b in range(*st.layers) for h in holders[b]}):
                    eng.depend(syncs[0], last_op[p])
            sync_ids[(i, j)] = (syncs[0], syncs[-1])
            opt = (optimizer_per_block * st.num_layers * (problem.tp / st.tp) / shared
                   * max(x[d] for d in st.devices))
            t_op = eng.add(("step", i, j, -1), ("gpu", i, j), opt, share=host(st))
            eng.depend(t_op, syncs[-1])
            step_ids[(i, j)] = t_op
    eng.run()
    ops = eng.ops
    pipes = []
    for i, pipe in enumerate(plan.pipelines):
        rows = []
        for j, st in enumerate(pipe.stages):
            q = eng.queues[("gpu", i, j)]
            busy = sum(ops[o].duration for o in q if ops[o].label[0] != "step")
            rows.append(StageResult(
                pipeline=i, stage=j, devices=st.devices, layers=st.layers, rate=info[i][j][0],
                compute_per_mb=info[i][j][1], busy=busy,
                last_backward_end=ops[last_op[(i, j)]].end, sync_start=ops[sync_ids[(i, j)][0]].start,
                sync_end=ops[sync_ids[(i, j)][1]].end, step_end=ops[step_ids[(i, j)]].end,
                max_in_flight=in_flight[(i, j)]))
        pipes.append(PipelineResult(pipe.micro_batches, tuple(rows)))
    end = max(p.end for p in pipes)
    recorded = _merged(ops) if options.record_ops else ()
    return SimResult(end, problem.t0_seconds, tuple(pipes), recorded)


def _merged(ops: Sequence[_Op]) -> tuple[tuple[tuple, float, float], ...]:
    """(label, start, end) per label: the parts of a block-by-block backward, and a stage's reductions,
    as one op each."""
    spans: dict[tuple, tuple[float, float]] = {}
    for o in ops:
        start, end = spans.get(o.label, (o.start, o.end))
        spans[o.label] = (min(start, o.start), max(end, o.end))
    return tuple((label, start, end) for label, (start, end) in spans.items())


def _per_micro_batch(plan: Plan, factors, name: str) -> list[list[float]]:
    """One factor >= 0 per micro-batch of every pipeline (default 1.0)."""
    if factors is None:
        return [[1.0] * p.micro_batches for p in plan.pipelines]
    out = [[float(v) for v in row] for row in factors]
    if [len(r) for r in out] != [p.micro_batches for p in plan.pipelines]:
        raise ValueError(f"{name}: {[len(r) for r in out]} factors per pipeline, the plan runs "
                         f"{[p.micro_batches for p in plan.pipelines]} micro-batches")
    if any(not (math.isfinite(v) and v >= 0) for r in out for v in r):
        raise ValueError(f"{name}: factors must be finite and >= 0")
    return out


def _rate_vector(problem: PlannerProblem, rates) -> list[float]:
    n = problem.num_devices
    if rates is None:
        out = list(problem.rates)
    elif isinstance(rates, Mapping):
        out = [1.0] * n
        for d, v in rates.items():
            if not 0 <= int(d) < n:
                raise ValueError(f"rates: device {d} is not in 0..{n - 1}")
            out[int(d)] = float(v)
    else:
        out = [float(v) for v in rates]
        if len(out) != n:
            raise ValueError(f"rates has {len(out)} entries, the cluster has {n} devices")
    bad = [d for d, v in enumerate(out) if not v > 0]
    if bad:
        raise ValueError(f"rates must be > 0; devices {bad[:8]} are not")
    return out
