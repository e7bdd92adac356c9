"""Live migration of model + optimizer state between two plans (the Malleus paper's "hot switch").

Two halves:

* `plan_migration(old, new, shape)` — pure (no Ray, no torch.distributed): the tensor-level
  transfer schedule. Every worker derives the same schedule from the two plans, so no coordination
  messages are needed (`execute_migration` still checks, with one all-reduce of its digest, that
  every rank derived the same one before any byte moves).
* `execute_migration(schedule, rank, old_states)` — run on every rank of the existing world at an
  iteration boundary: send/receive the bucket rounds with p2p ops on the default group, and return
  this rank's ShardStates for the new plan, ready for `Engine.load_state`.

Algorithm (planning)
--------------------
The schedule is `Plan.diff` expanded into tensor rows: the diff is given this model's state
sizes (each part's sharded and replicated tensors apart), and each of
its moves and kept pieces becomes, for every tensor of the part on that side of the split
(`geometry.part_tensors`), the rows its fraction covers. So the migration moves exactly what the
diff says: same pieces, same senders, same totals. In the diff's order:

* sharded tensors, per (part, fraction piece, needer): all sharded tensors of a part (a block's
  by heads and ffn rows, the embedding's and the head's by vocabulary rows) move together, cut by
  the finest common partition of old and new shards;
* replicated tensors (norm weights), per (part, needer): every TP rank of a
  holder stage needs the whole tensor, so a needer that held ANY shard of the part keeps its
  copy, and one that held none receives the whole tensor from one old holder.

Payload of a slice: the param rows and the same rows of Adam's exp_avg and exp_avg_sq
(3 x numel x itemsize bytes: `moved_bytes`), plus the slice's Adam step count in a small int64
message beside each bucket (8 bytes per slice chunk, not counted in the byte totals). Step counts
must agree between every piece a device assembles (checked; raises otherwise).

Buckets and rounds. Slices are grouped per (src, dst) pair, in planning order, and packed into
buckets of at most `bucket_bytes` (a slice larger than the room left is cut into row chunks; a
single row larger than `bucket_bytes` travels alone, in a bucket of its own, the one case where a
bucket exceeds the bound). Buckets are then assigned greedily to rounds so that in one round a
device sends at most `bucket_bytes` and receives at most `bucket_bytes` (at most one bucket per
pair per round); so the buffers a device holds for communication at any time are bounded by
2 x bucket_bytes, whatever the number of peers.

A sharded optimizer (`plan_migration(..., sharded=True)`, `_plan_owned`). Each element of the
optimizer's state has one owner under each plan (`state_owners`): its fp32 master and Adam moments
move from the old owner to the new one, only where the owner changes, as runs of the tensor's
axis-major elements; nothing is gathered whole first (a device never holds more than its own state
and the round's buffers). The new engines all-gather their chunks into their weights, as a step
publishes its update (`Engine.load_owned`).

Execution. Each round, a rank posts all its isends/irecvs of the round in one
`batch_isend_irecv` (NCCL: one group, no deadlock between a pair that sends both ways; gloo: plain
isend/irecv with a per-round tag), waits, and unpacks what it received. Each pair exchanges at
most two messages per round per direction (buffer, then steps), matched by order, so it is also
correct where tags are ignored (NCCL). Buffers are contiguous, on the communication device
(`cuda` for NCCL, CPU for gloo).
"""
from __future__ import annotations

import hashlib
from bisect import bisect_right
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Mapping

from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import (Part, TensorSpec, model_parts, part_of, part_tensors,
                                  tensor_spec, tp_divisibility_error)
from malleus_svc.plan import Plan, SliceMove, StateSizes
from malleus_svc.runtime.gradient_sync import GRAD_BUCKET_BYTES
from malleus_svc.runtime.state_owners import Run, RunState, find, owners

DEFAULT_BUCKET_BYTES = 64 << 20
_TAG_BASE = 0x4D470000  # gloo tags of migration rounds (apart from groups.py's handshake tag)


class MigrationError(ValueError):
    """The two plans cannot be migrated between (the message says what and where)."""


@dataclass(frozen=True)
class Slice:
    """Rows [start, end) along `axis` of tensor `name`, sent from `src` to `dst`.

    `dim` is the tensor's TP split dim (None: replicated); rows run along `axis` = dim, or 0 for
    replicated tensors. `nbytes` counts param + exp_avg + exp_avg_sq.
    """

    name: str
    dim: int | None
    start: int
    end: int
    src: int
    dst: int
    numel: int
    nbytes: int

    @property
    def axis(self) -> int:
        return 0 if self.dim is None else self.dim

    @property
    def part(self) -> Part:
        return part_of(self.name)


@dataclass(frozen=True)
class Keep:
    """Rows [start, end) of `name` that `device` holds under both plans: copied locally."""

    device: int
    name: str
    start: int
    end: int
    nbytes: int


@dataclass(frozen=True)
class Holding:
    """What one device holds of one tensor under the new plan."""

    dim: int | None
    start: int
    end: int
    full_shape: tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    src: int
    dst: int
    index: int                 # position among this pair's buckets
    round: int
    chunks: tuple[Slice, ...]  # slices or row-chunks of slices, in packing order
    nbytes: int


@dataclass(frozen=True)
class MigrationSchedule:
    old_plan_id: str
    new_plan_id: str
    gpus_per_node: int
    bucket_bytes: int
    itemsize: int
    slices: tuple[Slice, ...]          # the planned transfers (before cutting into buckets)
    kept: tuple[Keep, ...]
    buckets: tuple[Bucket, ...]        # sorted by (round, src, dst)
    holdings: Mapping[int, Mapping[str, Holding]] = field(compare=False)  # new holder -> name -> rows
    # A sharded optimizer's: new owner -> the runs it owns (`state_owners`); slices then name runs of
    # a tensor's axis-major elements and carry fp32 masters with the moments. None: rows, as above.
    owned: Mapping[int, tuple[Run, ...]] | None = field(default=None, compare=False)

    # ------------------------------------------------------------------ totals
    @property
    def rounds(self) -> int:
        return 1 + max((b.round for b in self.buckets), default=-1)

    @property
    def moved_bytes(self) -> int:
        return sum(s.nbytes for s in self.slices)

    @property
    def reused_bytes(self) -> int:
        return sum(k.nbytes for k in self.kept)

    def _node(self, d: int) -> int:
        return d // self.gpus_per_node

    @property
    def inter_node_bytes(self) -> int:
        return sum(s.nbytes for s in self.slices if self._node(s.src) != self._node(s.dst))

    def sent_bytes(self, device: int) -> int:
        return sum(s.nbytes for s in self.slices if s.src == device)

    def received_bytes(self, device: int) -> int:
        return sum(s.nbytes for s in self.slices if s.dst == device)

    def flows(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for s in self.slices:
            out[(s.src, s.dst)] = out.get((s.src, s.dst), 0) + s.nbytes
        return out

    def digest(self) -> int:
        """A 63-bit hash of everything that must match between ranks."""
        h = hashlib.sha256(f"{self.old_plan_id}/{self.new_plan_id}/{self.bucket_bytes}/{self.itemsize}/"
                           f"{self.owned is not None}".encode())
        for b in self.buckets:
            h.update(repr((b.src, b.dst, b.round, [(c.name, c.start, c.end) for c in b.chunks])).encode())
        return int.from_bytes(h.digest()[:8], "little") & (2**63 - 1)

    def summary(self) -> dict[str, Any]:
        sent = {d: self.sent_bytes(d) for d in {s.src for s in self.slices}}
        recv = {d: self.received_bytes(d) for d in {s.dst for s in self.slices}}
        return {"old_plan_id": self.old_plan_id, "new_plan_id": self.new_plan_id,
                "moves": len(self.slices), "buckets": len(self.buckets), "rounds": self.rounds,
                "moved_bytes": self.moved_bytes, "inter_node_bytes": self.inter_node_bytes,
                "reused_bytes": self.reused_bytes,
                "max_send_bytes": max(sent.values(), default=0), "max_recv_bytes": max(recv.values(), default=0)}


# ---------------------------------------------------------------------------- planning
def _check(old: Plan, new: Plan, shape: ModelShape) -> None:
    if old.num_layers != new.num_layers or new.num_layers != shape.layers:
        raise MigrationError(f"layer counts differ: old plan {old.num_layers}, new plan {new.num_layers}, "
                             f"model {shape.layers}")
    if old.num_devices != new.num_devices:
        raise MigrationError(f"plans are for different worlds ({old.num_devices} vs {new.num_devices} devices)")
    if old.gpus_per_node != new.gpus_per_node:
        raise MigrationError(f"plans disagree on gpus_per_node ({old.gpus_per_node} vs {new.gpus_per_node})")
    for which, plan in (("old", old), ("new", new)):
        for i, pipe in enumerate(plan.pipelines):
            for j, st in enumerate(pipe.stages):
                err = tp_divisibility_error(shape, st.tp)
                if err:
                    raise MigrationError(f"{which} plan pipeline {i} stage {j}: {err}")


def plan_migration(old: Plan, new: Plan, shape: ModelShape, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   itemsize: int = 4, unavailable: Iterable[int] = (), sharded: bool = False,
                   grad_bucket_bytes: int = GRAD_BUCKET_BYTES) -> MigrationSchedule:
    """The transfer schedule that moves every state slice `new` places where `old` did not have it
    (`sharded`: the optimizer's state, by owner, the chunks cut from the engines' gradient buckets
    of `grad_bucket_bytes`; see `_plan_owned`).

    `unavailable` devices never send (nor keep); raises MigrationError listing every slice that
    then has no surviving source.
    """
    if bucket_bytes < 1:
        raise MigrationError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    _check(old, new, shape)
    dead = set(unavailable)
    if sharded:
        return _plan_owned(old, new, shape, bucket_bytes, itemsize, dead, grad_bucket_bytes)
    tensors = {part: part_tensors(shape, part) for part in model_parts(shape.layers)}

    def side(part: Part, sharded: bool) -> list[TensorSpec]:
        return [t for t in tensors[part] if (t.split_dim is not None) == sharded]

    diff = Plan.diff(old, new, StateSizes.of(shape, 3 * itemsize), unavailable=dead)   # param, exp_avg, exp_avg_sq
    if diff.missing:
        what = [f"{_part_label(m.part)} fraction [{m.start}, {m.end}) for device {m.dst}" if m.sharded
                else f"{_part_label(m.part)} replicated tensors for device {m.dst}" for m in diff.missing]
        shown = "; ".join(what[:12]) + (f"; ... ({len(what)} in all)" if len(what) > 12 else "")
        raise MigrationError(
            f"no surviving source (unavailable devices {sorted(dead)}) for: {shown}. "
            "Restoring such state from a checkpoint is not supported by live migration.")

    def rows(move: SliceMove):
        for t in side(move.part, move.sharded):
            start, end = t.rows((move.start, move.end))
            numel = (end - start) * t.row_numel
            yield t, start, end, numel, 3 * numel * itemsize

    slices = tuple(Slice(t.name, t.split_dim, s, e, m.src, m.dst, numel, nbytes)
                   for m in diff.moves for t, s, e, numel, nbytes in rows(m))
    kept = tuple(Keep(m.dst, t.name, s, e, nbytes) for m in diff.kept for t, s, e, _, nbytes in rows(m))
    holdings: dict[int, dict[str, Holding]] = {}
    for part, specs in tensors.items():
        for _, st in new.holders(part):
            for r, d in enumerate(st.devices):
                for t in specs:
                    holdings.setdefault(d, {})[t.name] = Holding(t.split_dim, *t.held_rows(r, st.tp), t.shape)
    return MigrationSchedule(old.plan_id, new.plan_id, new.gpus_per_node, bucket_bytes, itemsize, slices, kept,
                             _pack(slices, bucket_bytes, itemsize), holdings)


def _part_label(part: Part) -> str:
    return part if isinstance(part, str) else f"block {part}"


def _plan_owned(old: Plan, new: Plan, shape: ModelShape, bucket_bytes: int, itemsize: int,
                dead: set[int], grad_bucket_bytes: int) -> MigrationSchedule:
    """A sharded optimizer's migration: each element's fp32 master and moments go from its owner
    under `old` to its owner under `new` (`state_owners.owners`), and only where the owner changes;
    nothing is gathered whole. The new engines then all-gather their chunks into the weights
    (`Engine.load_owned`), as a step publishes its update."""
    before, after = (owners(plan, shape, itemsize=itemsize, bucket_bytes=grad_bucket_bytes) for plan in (old, new))
    slices, kept, missing = [], [], []
    for name, runs in after.items():
        sources = before[name]
        starts = [s for s, _, _ in sources]
        for start, end, dst in runs:
            i = bisect_right(starts, start) - 1
            while i < len(sources) and sources[i][0] < end:
                a, e, src = max(start, sources[i][0]), min(end, sources[i][1]), sources[i][2]
                i += 1
                n = e - a
                if src in dead:
                    missing.append(f"{name} elements [{a}, {e}) for device {dst}, owned by device {src}")
                elif src == dst:
                    kept.append(Keep(dst, name, a, e, 3 * n * itemsize))
                else:
                    slices.append(Slice(name, None, a, e, src, dst, n, 3 * n * itemsize))
    if missing:
        shown = "; ".join(missing[:12]) + (f"; ... ({len(missing)} in all)" if len(missing) > 12 else "")
        raise MigrationError(
            f"no surviving source (unavailable devices {sorted(dead)}) for: {shown}. The optimizer state is "
            "sharded: each element's master and moments had one owner. Restore a checkpoint instead.")
    owned: dict[int, list[Run]] = {}
    for name, runs in after.items():
        for start, end, d in runs:
            owned.setdefault(d, []).append(Run(name, start, end))
    return MigrationSchedule(old.plan_id, new.plan_id, new.gpus_per_node, bucket_bytes, itemsize, tuple(slices),
                             tuple(kept), _pack(tuple(slices), bucket_bytes, itemsize), {},
                             {d: tuple(runs) for d, runs in owned.items()})


def _pack(slices: tuple[Slice, ...], bucket_bytes: int, itemsize: int) -> tuple[Bucket, ...]:
    """Per (src, dst) pair, in planning order: buckets of <= bucket_bytes; then greedy rounds."""
    by_pair: dict[tuple[int, int], list[Slice]] = {}
    for s in slices:
        by_pair.setdefault((s.src, s.dst), []).append(s)
    pair_buckets: dict[tuple[int, int], list[list[Slice]]] = {}
    for pair, items in sorted(by_pair.items()):
        out: list[list[Slice]] = []
        cur: list[Slice] = []
        cur_bytes = 0
        for s in items:
            rows = s.end - s.start
            per_row = s.nbytes // rows if rows else 0
            pos = s.start
            while pos < s.end:
                room = bucket_bytes - cur_bytes
                fit = max(room, 0) // per_row if per_row else s.end - pos
                if fit == 0:
                    if cur:
                        out.append(cur)
                        cur, cur_bytes = [], 0
                        continue
                    fit = 1  # one row larger than a bucket: it travels alone
                take = min(fit, s.end - pos)
                numel = s.numel * take // rows
                cur.append(Slice(s.name, s.dim, pos, pos + take, s.src, s.dst, numel, 3 * numel * itemsize))
                cur_bytes += 3 * numel * itemsize
                pos += take
        if cur:
            out.append(cur)
        pair_buckets[pair] = out

    # Rounds: per round a device sends <= bucket_bytes and receives <= bucket_bytes (a lone
    # oversize bucket excepted), at most one bucket per pair.
    queues = {pair: list(bs) for pair, bs in pair_buckets.items() if bs}
    taken = {pair: 0 for pair in queues}
    buckets: list[Bucket] = []
    rnd = 0
    while queues:
        send: dict[int, int] = {}
        recv: dict[int, int] = {}
        for pair in sorted(queues):
            src, dst = pair
            chunks = queues[pair][0]
            n = sum(c.nbytes for c in chunks)
            fits = (lambda used: used == 0 or used + n <= bucket_bytes)
            if fits(send.get(src, 0)) and fits(recv.get(dst, 0)):
                send[src] = send.get(src, 0) + n
                recv[dst] = recv.get(dst, 0) + n
                buckets.append(Bucket(src, dst, taken[pair], rnd, tuple(chunks), n))
                taken[pair] += 1
                queues[pair].pop(0)
        queues = {p: q for p, q in queues.items() if q}
        rnd += 1
    return tuple(buckets)


def sharded_moves_by_fraction(schedule: MigrationSchedule, shape: ModelShape) -> set[tuple[Part, Fraction, Fraction, int, int]]:
    """(block, fraction start, fraction end, src, dst) of every sharded-tensor slice: comparable with
    Plan.diff's moves for blocks."""
    out = set()
    for s in schedule.slices:
        if s.dim is None:
            continue
        full = tensor_spec(shape, s.name).shape[s.dim]
        out.add((s.part, Fraction(s.start, full), Fraction(s.end, full), s.src, s.dst))
    return out


# ---------------------------------------------------------------------------- execution
@dataclass
class MigrationStats:
    device: int
    sent_bytes: int = 0
    received_bytes: int = 0
    sent_inter_node_bytes: int = 0
    kept_bytes: int = 0
    slices_sent: int = 0
    buckets_sent: int = 0
    buckets_received: int = 0
    rounds: int = 0
    comm_seconds: float = 0.0
    seconds: float = 0.0


def execute_migration(schedule: MigrationSchedule, rank: int, old_states: Mapping[str, Any] | None, *,
                      comm_device=None, check_digest: bool = True, exchange=None):
    """Run this rank's part of `schedule` over the default process group.

    Every rank of the world must call this (also ranks with nothing to send or receive): it starts
    with one world all-reduce that checks that every rank derived the same schedule. `old_states`
    is this rank's `Engine.export_state(copy=False)`, or with a sharded schedule its
    `Engine.export_owned()` (None if it had no engine): its live tensors on `comm_device`, where
    buckets are packed and unpacked into the new buffers, so no state passes through host memory on
    a GPU. Returns (this rank's new ShardStates, or RunStates by tensor for `Engine.load_owned`; {}
    if it holds nothing; MigrationStats).

    `exchange(messages, tag)` posts one round's messages as one batch and waits for them
    (`transport.exchange` unless given: e.g. `nccl_rules.rules_exchange` checks NCCL's rules on CPU).
    """
    import torch
    import torch.distributed as dist

    from malleus_svc.runtime.transport import Message, exchange as batched_exchange

    exchange = exchange or batched_exchange

    t0 = time.perf_counter()
    comm_device = comm_device or torch.device("cpu")
    stats = MigrationStats(rank, rounds=schedule.rounds)
    dtype = torch.float32 if schedule.itemsize == 4 else {8: torch.float64, 2: torch.bfloat16}[schedule.itemsize]

    if check_digest:
        d = schedule.digest()
        probe = torch.tensor([d, -d], dtype=torch.int64, device=comm_device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        if int(probe[0]) != d or -int(probe[1]) != d:
            raise MigrationError(f"rank {rank}: the ranks derived different migration schedules "
                                 f"({schedule.old_plan_id} -> {schedule.new_plan_id}); every worker must "
                                 "migrate from the same old plan to the same new plan with the same bucket size")

    state = (_Runs if schedule.owned is not None else _Rows)(schedule, rank, old_states, dtype, comm_device)

    # Kept rows: a local copy.
    for k in schedule.kept:
        if k.device != rank:
            continue
        state.write(k.name, k.start, k.end, *state.read(k.name, k.start, k.end))
        stats.kept_bytes += k.nbytes

    # Rounds.
    by_round: dict[int, list[Bucket]] = {}
    for b in schedule.buckets:
        if rank in (b.src, b.dst):
            by_round.setdefault(b.round, []).append(b)
    g = schedule.gpus_per_node
    for rnd in sorted(by_round):
        messages, recvs = [], []
        for b in by_round[rnd]:  # sorted by (src, dst): the same order on both ends
            if b.src == rank:
                parts, steps = [], []
                for c in b.chunks:
                    tensors, step = state.read(c.name, c.start, c.end)
                    for t in tensors:
                        if t.dtype != dtype:
                            raise MigrationError(f"rank {rank}: {c.name} is {t.dtype}, the schedule moves {dtype}")
                        parts.append(t.contiguous().reshape(-1))
                    steps.append(step)
                buf = torch.cat(parts).to(comm_device)   # packed where the state lives
                step_buf = torch.tensor(steps, dtype=torch.int64, device=comm_device)
                if buf.numel() * buf.element_size() != b.nbytes:
                    raise MigrationError(f"rank {rank}: bucket to {b.dst} has {buf.numel() * buf.element_size()} "
                                         f"bytes, planned {b.nbytes}")
                messages += [Message("send", buf, b.dst), Message("send", step_buf, b.dst)]
                stats.sent_bytes += b.nbytes
                stats.buckets_sent += 1
                stats.slices_sent += len(b.chunks)
                if b.src // g != b.dst // g:
                    stats.sent_inter_node_bytes += b.nbytes
            else:
                buf = torch.empty(b.nbytes // schedule.itemsize, dtype=dtype, device=comm_device)
                step_buf = torch.empty(len(b.chunks), dtype=torch.int64, device=comm_device)
                messages += [Message("recv", buf, b.src), Message("recv", step_buf, b.src)]
                recvs.append((b, buf, step_buf))
        c0 = time.perf_counter()
        exchange(messages, tag=_TAG_BASE + rnd)
        stats.comm_seconds += time.perf_counter() - c0
        for b, buf, step_buf in recvs:
            steps = step_buf.tolist()
            off = 0
            for c, step in zip(b.chunks, steps):
                size = state.shape(c.name, c.start, c.end)
                ts = []
                for _ in range(3):
                    ts.append(buf[off:off + c.numel].view(size))
                    off += c.numel
                state.write(c.name, c.start, c.end, ts, step)
            stats.received_bytes += b.nbytes
            stats.buckets_received += 1

    out = state.result()
    stats.seconds = time.perf_counter() - t0
    return out, stats


class _Rows:
    """A migration's state by tensor rows (the replicated optimizer's): what this rank sends, read
    from its ShardStates, and the new ShardStates it fills."""

    def __init__(self, schedule: MigrationSchedule, rank: int, old_states, dtype, device):
        import torch

        self.rank, self.old = rank, old_states or {}
        self.new: dict[str, dict[str, Any]] = {}
        for name, h in schedule.holdings.get(rank, {}).items():
            axis = 0 if h.dim is None else h.dim
            size = list(h.full_shape)
            size[axis] = h.end - h.start
            self.new[name] = {"t": [torch.empty(size, dtype=dtype, device=device) for _ in range(3)],
                              "cover": torch.zeros(h.end - h.start, dtype=torch.int32), "steps": set(),
                              "axis": axis, "h": h}

    def read(self, name: str, start: int, end: int):
        st = self.old.get(name)
        if st is None:
            raise MigrationError(f"rank {self.rank}: the schedule expects it to hold {name} rows [{start}, {end}), "
                                 "but it has no such state (is its engine built for the old plan?)")
        if not (st.start <= start and end <= st.end):
            raise MigrationError(f"rank {self.rank}: holds {name} rows [{st.start}, {st.end}), the schedule "
                                 f"expects [{start}, {end})")
        axis = 0 if st.dim is None else st.dim
        return [t.narrow(axis, start - st.start, end - start) for t in (st.param, st.exp_avg, st.exp_avg_sq)], st.step

    def _slot(self, name: str) -> dict[str, Any]:
        slot = self.new.get(name)
        if slot is None:
            raise MigrationError(f"rank {self.rank}: received {name}, which it does not hold under the new plan")
        return slot

    def shape(self, name: str, start: int, end: int) -> list[int]:
        slot = self._slot(name)
        size = list(slot["h"].full_shape)
        size[slot["axis"]] = end - start
        return size

    def write(self, name: str, start: int, end: int, tensors, step: int) -> None:
        slot = self._slot(name)
        h, axis = slot["h"], slot["axis"]
        for dst, src in zip(slot["t"], tensors):
            dst.narrow(axis, start - h.start, end - start).copy_(src)
        slot["cover"][start - h.start:end - h.start] += 1
        slot["steps"].add(int(step))

    def result(self):
        from malleus_svc.runtime.engine import ShardState

        out = {}
        for name, slot in self.new.items():
            _check_filled(self.rank, name, slot)
            h = slot["h"]
            out[name] = ShardState(h.dim, h.start, h.end, *slot["t"], slot["steps"].pop(), tuple(h.full_shape))
        return out


class _Runs:
    """A migration's state by owned runs (a sharded optimizer's): fp32 masters and moments, read from
    this rank's `Engine.export_owned()`, and the runs it owns under the new plan."""

    def __init__(self, schedule: MigrationSchedule, rank: int, old_states, dtype, device):
        import torch

        self.rank, self.old = rank, {}
        for st in old_states or ():
            self.old.setdefault(st.run.name, []).append(st)
        self.new: dict[str, list[dict[str, Any]]] = {}
        for run in schedule.owned.get(rank, ()):
            n = run.end - run.start
            self.new.setdefault(run.name, []).append(
                {"run": run, "t": [torch.empty(n, dtype=dtype, device=device) for _ in range(3)],
                 "filled": [], "steps": set()})     # [a, e) received: a run is billions of elements

    def read(self, name: str, start: int, end: int):
        try:
            return find(self.old, Run(name, start, end))
        except KeyError as e:
            raise MigrationError(f"rank {self.rank}: the schedule expects it to own {e.args[0]} "
                                 "(is its engine built for the old plan, with the optimizer sharded?)") from None

    def shape(self, name: str, start: int, end: int) -> list[int]:
        return [end - start]

    def write(self, name: str, start: int, end: int, tensors, step: int) -> None:
        for slot in self.new.get(name, ()):
            run = slot["run"]
            if run.start <= start and end <= run.end:
                for dst, src in zip(slot["t"], tensors):
                    dst[start - run.start:end - run.start].copy_(src)
                slot["filled"].append((start, end))
                slot["steps"].add(int(step))
                return
        raise MigrationError(f"rank {self.rank}: received {name} elements [{start}, {end}), which it does not "
                             "own under the new plan")

    def result(self) -> dict[str, list[RunState]]:
        out: dict[str, list[RunState]] = {}
        for name, slots in self.new.items():
            for slot in slots:
                run, at = slot["run"], slot["run"].start
                for a, e in sorted(slot["filled"]) + [(run.end, run.end)]:
                    if a != at:
                        raise MigrationError(f"rank {self.rank}: {name} elements [{min(a, at)}, {max(a, at)}) were "
                                             f"{'filled twice' if a < at else 'never filled'}, expected exactly once")
                    at = e
                _check_steps(self.rank, name, slot["steps"])
                out.setdefault(name, []).append(RunState(run, tuple(slot["t"]), slot["steps"].pop()))
        return out


def _check_filled(rank: int, name: str, slot: dict[str, Any]) -> None:
    cover = slot["cover"]
    if not bool((cover == 1).all()):
        bad = (cover != 1).nonzero().flatten().tolist()[:8]
        raise MigrationError(f"rank {rank}: {name} rows {bad}... were filled {cover[bad].tolist()} times, "
                             "expected exactly once")
    _check_steps(rank, name, slot["steps"])


def _check_steps(rank: int, name: str, steps: set[int]) -> None:
    if len(steps) != 1:
        raise MigrationError(f"rank {rank}: pieces of {name} come at different Adam steps {sorted(steps)}")
