"""Every communication group and peer one device needs under a plan, derived from the plan alone.

* TP group: the devices of the device's stage.
* Pipeline peers: who sends which rows of the activations to whom, and of their gradients back
  (see `PipelinePeers`).
* Gradient pieces: each part (block, embedding, head) is held once per pipeline, possibly at a
  different TP size in each. Its sharded tensors are cut into the finest common partition of all
  holders' shards (fractions [a, b) of the sharded dim); a piece is all-reduced among its one
  holder per pipeline. Replicated tensors (norms) form one piece reduced among every device of
  every holding stage: under sequence parallelism each TP rank's gradient is its rows' share.
* Tied embedding: where the head is the embedding's matrix, its two copies' vocabulary rows are
  cut into the finest common partition of every embedding and head holder's shard, and each
  piece's gradient is summed among its holders in every stage holding either (Megatron's
  embedding group), in place of the two parts' own pieces.
* Active group: all devices with work, for the global grad norm and loss.

Groups are created with ``use_local_synchronization=True``: only members call `new_group`, so
suspended and excluded ranks build nothing. Every rank walks the same plan-ordered list and creates
the groups it belongs to in that order, which keeps the member-only barriers free of cycles.
Groups are cached by their sorted rank tuple, so a later plan reuses the groups it shares, and
`release_unused` destroys the ones it does not.

Device ids against world ranks. Plans name devices by their stable id (node-major); the
torch.distributed world holds only the devices that have a worker. Normally the two are the same;
after a device is gone for good (its node left the cluster) the world is rebuilt over the rest, so
every call that names a peer translates with `world_rank` (set by `set_world_devices`).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from malleus_svc.geometry import (EMBEDDING, HEAD, WHOLE, Part, finest_partition, holder_at, model_parts,
                                  sequence_rows, shard_map)
from malleus_svc.plan import Plan
from malleus_svc.runtime.tensor_parallel import TensorParallel

# Subgroups take the world's collective timeout (torch gives new groups its 30-minute default
# otherwise), so a collective that waits for a lost peer fails in bounded time (WorkerGroup.recover).
_TIMEOUT = None


def set_collective_timeout(timeout) -> None:
    global _TIMEOUT
    _TIMEOUT = timeout


_WORLD_RANK: dict[int, int] = {}   # device id -> rank in the current world; empty: the identity


def set_world_devices(devices) -> None:
    """The devices of the world just initialised, in rank order (sorted device ids)."""
    _WORLD_RANK.clear()
    _WORLD_RANK.update({int(d): r for r, d in enumerate(devices)})


def world_rank(device: int) -> int:
    """The torch.distributed rank of a device (plans, schedules and groups speak device ids)."""
    if not _WORLD_RANK:
        return device
    try:
        return _WORLD_RANK[device]
    except KeyError:
        raise RuntimeError(f"device {device} is not in the current world (devices {sorted(_WORLD_RANK)}): "
                           "a plan gave work to a device that is gone") from None


def prepare_world() -> None:
    """Call on every rank right after `init_process_group`, before any other communication.

    * Under NCCL, torch's `batch_isend_irecv` requires the first collective call on a group to
      involve all of its ranks; a pipeline's first post involves only two stages' ranks, so one
      all-reduce over the world makes that first call (gloo has no such rule).
    * A gloo group over the whole world carries the runtime's own small handshakes
      (`_agree_on_name_salt`): over the NCCL world each handshake pair would open an NCCL
      communicator of its own, never freed. Made on every backend, so CPU runs take this path too.
    """
    global _SIDE
    if "nccl" in str(dist.get_backend()):
        dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))
    _SIDE = dist.new_group(backend="gloo", timeout=_TIMEOUT)


_SIDE: "dist.ProcessGroup | None" = None   # the world's gloo side group (prepare_world)


_GROUP_CACHE: dict[tuple[int, tuple[int, ...]], "dist.ProcessGroup"] = {}


def abort_world() -> None:
    """End every communicator of this process's world now, from any thread, whatever is pending on
    them (the watchdog's abort). NCCL: `ncclCommAbort` on all of them, which ends their queued
    kernels with an error; the world is forgotten, so leaving it later destroys nothing. gloo needs
    none: its collectives raise at the group's timeout by themselves, and its abort does not
    release a pending wait."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        dist.distributed_c10d._abort_process_group()


def clear_group_cache() -> None:
    """Forget cached groups (after the default process group has been destroyed and re-made)."""
    global _SIDE
    _GROUP_CACHE.clear()
    _SIDE = None


@dataclass(frozen=True)
class Piece:
    """Fraction [start, end) of every sharded tensor of `part` (or the whole of its replicated
    ones), and the devices that reduce it: one holder per pipeline of a sharded piece; every device
    of each holding stage of a replicated one; for the tied embedding and head, one holder per
    stage holding either."""

    part: Part
    start: Fraction
    end: Fraction
    members: tuple[int, ...]  # in pipeline order; members[0] counts the piece in the grad norm


def sharded_pieces(plan: Plan, part: Part, tied: bool = False) -> list[Piece]:
    """The finest common partition of the holders' TP shards of a part, with who holds each piece
    (none for the embedding and the head when `tied`: `tied_pieces` reduces them)."""
    if tied and part in (EMBEDDING, HEAD):
        return []
    return _pieces(part, [st.devices for _, st in plan.holders(part)])


def _pieces(part: Part, groups: list[tuple[int, ...]]) -> list[Piece]:
    return [Piece(part, a, b, tuple(dict.fromkeys(holder_at(g, a) for g in groups)))
            for a, b in finest_partition(shard_map(groups).values())]


def replicated_piece(plan: Plan, part: Part) -> Piece:
    """The whole of a part's replicated tensors, reduced among every device of each holding stage
    (each TP rank's gradient is the share of its rows of the tokens)."""
    return Piece(part, *WHOLE, tuple(d for _, st in plan.holders(part) for d in st.devices))


def tied_pieces(plan: Plan) -> list[Piece]:
    """The tied embedding and head: the finest common partition of the vocabulary rows of every
    stage holding either, each piece reduced among its holders there (a device holding both
    copies counts once)."""
    return _pieces(EMBEDDING, [st.devices for part in (EMBEDDING, HEAD) for _, st in plan.holders(part)])


@dataclass(frozen=True)
class PipelinePeers:
    """Where this device's rows of a stage-boundary tensor come from and go to.

    Under sequence parallelism every TP rank holds its rows of a micro-batch's hidden states
    (`geometry.sequence_rows`), on both sides of a boundary: a receiving rank takes each part of its
    rows from the sending rank that holds it, and gradients return the same way. Groups of
    different sizes re-cut the rows: a rank of a smaller group talks to several of a larger one,
    and which ranks overlap depends on the micro-batch's token count.
    """

    tp_rank: int
    tp_size: int
    prev: tuple[int, ...]    # the previous stage's devices in TP rank order (none on the first stage)
    next: tuple[int, ...]    # the next stage's (none on the last)

    def rows(self, tokens: int) -> tuple[int, int]:
        return sequence_rows(tokens, self.tp_rank, self.tp_size)

    def pieces(self, tokens: int, other: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """(device, start, end): the rows of this rank that each rank of the `other` stage holds too,
        in row order."""
        lo, hi = self.rows(tokens)
        out = []
        for q, d in enumerate(other):
            a, b = sequence_rows(tokens, q, len(other))
            if max(a, lo) < min(b, hi):
                out.append((d, max(a, lo), min(b, hi)))
        return out


def pipeline_peers(plan: Plan, rank: int) -> PipelinePeers:
    role = plan.roles()[rank]
    stages = plan.pipelines[role.pipeline].stages
    return PipelinePeers(role.tp_rank, role.tp_size,
                         stages[role.stage - 1].devices if not role.is_first else (),
                         stages[role.stage + 1].devices if not role.is_last else ())


def ordered_group_ranks(plan: Plan, tied: bool = False) -> list[tuple[int, ...]]:
    """Every multi-member group the plan needs (for a model whose head is `tied` to its embedding:
    their group too), sorted ranks, deduplicated, in one global order."""
    out: dict[tuple[int, ...], None] = {}

    def add(ranks) -> None:
        key = tuple(sorted(ranks))
        if len(key) > 1:
            out.setdefault(key, None)

    for pipe in plan.pipelines:
        for st in pipe.stages:
            add(st.devices)
    for part in model_parts(plan.num_layers):
        add(replicated_piece(plan, part).members)
        for piece in sharded_pieces(plan, part, tied):
            add(piece.members)
    for piece in tied_pieces(plan) if tied else ():
        add(piece.members)
    add(plan.active_devices)
    return list(out)


class Groups:
    """The groups and peers of one device under one plan. Only members build a group."""

    def __init__(self, plan: Plan, rank: int, tied: bool = False):
        roles = plan.roles()
        if rank not in roles:
            raise ValueError(f"rank {rank} has no work in plan {plan.plan_id} "
                             f"(active devices: {list(plan.active_devices)})")
        self.plan, self.rank, self.role = plan, rank, roles[rank]
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks in ordered_group_ranks(plan, tied):
            if rank in ranks:
                self._groups[ranks] = _get_or_create(ranks)
        stage = plan.pipelines[self.role.pipeline].stages[self.role.stage]
        self.stage_devices = stage.devices
        self.tp = TensorParallel(stage.tp, self.role.tp_rank, self.group(stage.devices),
                                 group_ranks=tuple(sorted(stage.devices).index(d) for d in stage.devices))
        self.peers = pipeline_peers(plan, rank)
        self.active = self.group(plan.active_devices)

    def group(self, ranks) -> "dist.ProcessGroup | None":
        """The group of these ranks (None for a single rank: nothing to communicate)."""
        key = tuple(sorted(ranks))
        if len(key) <= 1:
            return None
        if key not in self._groups:
            raise KeyError(f"rank {self.rank} is not a member of group {key} under this plan")
        return self._groups[key]


class PlanPieces:
    """Every device's pieces under one plan, each part's computed once: what `GradientSync` reduces
    on one device, and what a migration's schedule derives for all of them."""

    def __init__(self, plan: Plan, tied: bool = False):
        self.plan, self.tied = plan, tied
        self.roles = plan.roles()
        self._parts: dict[int, list[Part]] = {}
        self._sharded: dict[Part, dict[int, list[Piece]]] = {}
        self._replicated: dict[Part, Piece] = {}
        for part in model_parts(plan.num_layers):
            held = {d for _, st in plan.holders(part) for d in st.devices}
            for d in sorted(held):
                self._parts.setdefault(d, []).append(part)
        self._tied = self._by_member(tied_pieces(plan) if tied else [])

    @staticmethod
    def _by_member(pieces: list[Piece]) -> dict[int, list[Piece]]:
        out: dict[int, list[Piece]] = {}
        for p in pieces:
            for d in dict.fromkeys(p.members):
                out.setdefault(d, []).append(p)
        return out

    def parts(self, rank: int) -> list[Part]:
        """The parts device `rank` holds, in model order."""
        return self._parts.get(rank, [])

    def local(self, rank: int) -> tuple[list[Piece], list[Piece]]:
        """(sharded pieces, replicated pieces) of the parts device `rank` holds, in global order.

        Sharded: the pieces inside its shard (with a tied head, those of the embedding and the head
        are `local_tied`). Replicated: one per held part.
        """
        sharded, replicated = [], []
        for part in self.parts(rank):
            if part not in self._sharded:
                self._sharded[part] = self._by_member(sharded_pieces(self.plan, part, self.tied))
                self._replicated[part] = replicated_piece(self.plan, part)
            replicated.append(self._replicated[part])
            sharded.extend(self._sharded[part].get(rank, ()))
        return sharded, replicated

    def local_tied(self, rank: int) -> list[Piece]:
        """The tied pieces inside device `rank`'s copies (none for a model whose head is not tied)."""
        return self._tied.get(rank, [])


def release_unused(plan: Plan, tied: bool = False) -> list[tuple[int, ...]]:
    """Shut down this rank's cached groups that `plan` does not use; returns their devices.

    Under NCCL each group holds a communicator (GPU memory, a proxy thread), so the groups of plans
    gone by would pile up across re-plans. Every rank calls this at the same plan boundary (with or
    without work under `plan`) and shuts down in one global order, so a shutdown that NCCL makes a
    collective call cannot wait in a cycle. The groups stay registered with torch, which salts a
    new group's name with the number registered: unregistering them would let a later group take
    a name (and the stale store keys) of an earlier one. Destroying the world shuts them down again,
    which torch's backends take as a no-op.
    """
    world, needed = id(dist.group.WORLD), set(ordered_group_ranks(plan, tied))
    unused = sorted(k for k in _GROUP_CACHE if k[0] == world and k[1] not in needed)
    for key in unused:
        _GROUP_CACHE.pop(key).shutdown()
    return [devices for _, devices in unused]


def cached_groups() -> list[tuple[int, ...]]:
    """The devices of each group this rank keeps for the current world, sorted."""
    world = id(dist.group.WORLD)
    return sorted(k[1] for k in _GROUP_CACHE if k[0] == world)


def member_group(devices) -> "dist.ProcessGroup":
    """The cached group of these devices; only its members call this, all in the same order."""
    return _get_or_create(tuple(sorted(int(d) for d in devices)))


def _get_or_create(devices: tuple[int, ...]) -> "dist.ProcessGroup":
    key = (id(dist.group.WORLD), devices)
    if key not in _GROUP_CACHE:
        ranks = tuple(world_rank(d) for d in devices)   # sorted too: ranks follow device order
        _agree_on_name_salt(ranks)
        _GROUP_CACHE[key] = dist.new_group(list(ranks), use_local_synchronization=True, timeout=_TIMEOUT)
    return _GROUP_CACHE[key]


_SALT_TAG = 0x6D616C  # keeps this handshake apart from any other point-to-point traffic


def _agree_on_name_salt(ranks: tuple[int, ...]) -> None:
    """Make the members' next member-only group get the same name.

    torch (up to at least 2.13) names a ``use_local_synchronization`` group by hashing its ranks
    salted with the number of groups THIS process has registered. After
    groups with different members, that number differs between ranks, the members compute
    different names, and gloo waits forever on store keys nobody writes. So the members tell the
    lowest member their counts, it answers with the largest, and every member pads up to it with
    single-rank groups (local, cheap) before creating the real group.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "pg_names"):
        return  # a torch without the salt: nothing to agree on
    if _SIDE is None:
        raise RuntimeError("groups.prepare_world() was not called after init_process_group")
    me, leader = dist.get_rank(), ranks[0]
    count = torch.tensor([len(world.pg_names)], dtype=torch.int64)   # host memory: the side group is gloo
    if me == leader:
        other = torch.empty_like(count)
        for r in ranks[1:]:
            dist.recv(other, src=r, tag=_SALT_TAG, group=_SIDE)
            count = torch.maximum(count, other)
        for r in ranks[1:]:
            dist.send(count, dst=r, tag=_SALT_TAG, group=_SIDE)
    else:
        dist.send(count, dst=leader, tag=_SALT_TAG, group=_SIDE)
        dist.recv(count, src=leader, tag=_SALT_TAG, group=_SIDE)
    while len(world.pg_names) < int(count):   # local single-rank groups, gloo: no NCCL communicator
        dist.new_group([me], use_local_synchronization=True, backend="gloo", timeout=_TIMEOUT)
