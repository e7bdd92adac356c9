"""The Plan value: who does what. The contract between the planner and the runtime.

A plan says, for one training iteration:
  * pipelines, each an ordered list of stages; a stage is one tensor-parallel (TP) group of
    devices (the position of a device in `devices` is its TP rank) holding a contiguous,
    half-open range of transformer blocks ``[start, end)``;
  * how many micro-batches each pipeline runs (of `micro_batch_size` samples each); the global
    batch is ``micro_batch_size * sum(micro_batches)``;
  * `suspended` devices: alive but given no work (they run probes so the coordinator can see
    when they heal); `excluded` devices: not part of the job at all (dead, or removed by a user).

The first stage of every pipeline also holds the token embedding, the last stage the final norm
and the LM head. How a stage's TP group splits what it holds is `geometry`'s to say (blocks are
sharded, embedding and head replicated).

This module imports no solver, Ray or torch: the runtime reads plans without the planner.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from malleus_svc.config.errors import ConfigError, shorten
from malleus_svc.config.files import parse_document, read_document
from malleus_svc.config.limits import MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_LAYERS
from malleus_svc.config.presets import ModelShape
from malleus_svc.geometry import (EMBEDDING, HEAD, Cuts, Part, Span, finest_partition, holder_at, model_parts,
                                  part_tensors, shard_map)

PLAN_FORMAT_VERSION = 1


class PlanError(ValueError):
    """A plan that is malformed or inconsistent; the message says what and where."""


def _check_count(what: str, value: int, top: int) -> None:
    if value < 1:
        raise PlanError(f"{what} must be >= 1, got {value}")
    if value > top:
        raise PlanError(f"{what} must be <= {top} (config.limits), got {value}")


def _finite(x: float | None) -> float | None:
    """An informative number as written to JSON: None where it is not finite (no standard JSON for it)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# Activation recomputation of a stage: "none" keeps what every block's forward saves for backward;
# "selective" recomputes in backward only the blocks' elementwise outputs (the norms', SwiGLU's
# product); "full" keeps only each block's input and runs the block's forward again in backward.
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MARK = {"none": "", "selective": " s", "full": " r"}   # in tables, after a stage's block count


@dataclass(frozen=True)
class Stage:
    devices: tuple[int, ...]
    layers: tuple[int, int]
    recompute: str = "none"

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def holds(self, layer: int) -> bool:
        return self.layers[0] <= layer < self.layers[1]


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    micro_batches: int

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)


@dataclass(frozen=True)
class DeviceRole:
    """Where one device sits in a plan."""

    pipeline: int
    stage: int
    tp_rank: int
    tp_size: int
    layers: tuple[int, int]
    is_first: bool
    is_last: bool


@dataclass(frozen=True)
class Plan:
    num_devices: int
    num_layers: int
    micro_batch_size: int
    pipelines: tuple[Pipeline, ...]
    suspended: tuple[int, ...] = ()
    excluded: tuple[int, ...] = ()
    gpus_per_node: int = 8
    # Prediction and provenance: informative, never part of the plan's identity.
    objective: str = "paper"
    objective_value: float | None = field(default=None, compare=False)
    predicted_iteration_seconds: float | None = field(default=None, compare=False)
    ideal_iteration_seconds: float | None = field(default=None, compare=False)
    solve_seconds: float | None = field(default=None, compare=False)
    inputs: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ identity
    @property
    def plan_id(self) -> str:
        """Short content hash of the structure (pipelines, stages, data, suspended, excluded)."""
        core = json.dumps(self._structure(), sort_keys=True).encode()
        return hashlib.sha256(core).hexdigest()[:12]

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * sum(p.micro_batches for p in self.pipelines)

    @property
    def num_micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.pipelines)

    @property
    def active_devices(self) -> tuple[int, ...]:
        return tuple(sorted(d for p in self.pipelines for d in p.devices))

    def node_of(self, device: int) -> int:
        return device // self.gpus_per_node

    def roles(self) -> dict[int, DeviceRole]:
        """device -> its role, for every device that has work."""
        out: dict[int, DeviceRole] = {}
        for i, pipe in enumerate(self.pipelines):
            last = len(pipe.stages) - 1
            for j, st in enumerate(pipe.stages):
                for r, d in enumerate(st.devices):
                    out[d] = DeviceRole(i, j, r, st.tp, st.layers, j == 0, j == last)
        return out

    def holders(self, part: Part) -> list[tuple[int, Stage]]:
        """(pipeline index, stage) of every stage that holds `part` (a block index, EMBEDDING or HEAD)."""
        out = []
        for i, pipe in enumerate(self.pipelines):
            if part == EMBEDDING:
                out.append((i, pipe.stages[0]))
            elif part == HEAD:
                out.append((i, pipe.stages[-1]))
            else:
                out.extend((i, s) for s in pipe.stages if s.holds(int(part)))
        return out

    def sample_slices(self) -> list[tuple[int, int]]:
        """Per pipeline, the contiguous half-open range of sample offsets it takes in each global batch."""
        out, start = [], 0
        for pipe in self.pipelines:
            n = pipe.micro_batches * self.micro_batch_size
            out.append((start, start + n))
            start += n
        return out

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        # Sizes first: validation builds sets as large as num_devices.
        _check_count("num_devices", self.num_devices, MAX_DEVICES)
        _check_count("num_layers", self.num_layers, MAX_LAYERS)
        _check_count("micro_batch_size", self.micro_batch_size, MAX_GLOBAL_BATCH)
        _check_count("gpus_per_node", self.gpus_per_node, MAX_DEVICES)
        if not self.pipelines:
            raise PlanError("a plan needs at least one pipeline")
        seen: dict[int, str] = {}

        def claim(device: int, where: str) -> None:
            if not isinstance(device, int) or not 0 <= device < self.num_devices:
                raise PlanError(f"{where}: device {device!r} is not in 0..{self.num_devices - 1}")
            if device in seen:
                raise PlanError(f"{where}: device {device} is already used by {seen[device]}")
            seen[device] = where

        for i, pipe in enumerate(self.pipelines):
            if not pipe.stages:
                raise PlanError(f"pipeline {i} has no stages")
            _check_count(f"pipeline {i}: micro_batches", pipe.micro_batches, MAX_GLOBAL_BATCH)
            expected = 0
            for j, st in enumerate(pipe.stages):
                where = f"pipeline {i} stage {j}"
                if not st.devices:
                    raise PlanError(f"{where} has no devices")
                if st.recompute not in RECOMPUTE:
                    raise PlanError(f"{where}: recompute must be one of {', '.join(RECOMPUTE)}, got {shorten(st.recompute)}")
                start, end = st.layers
                if start != expected or end <= start:
                    raise PlanError(
                        f"{where}: layers [{start}, {end}) do not continue the previous stage "
                        f"(expected a non-empty range starting at {expected})")
                expected = end
                for d in st.devices:
                    claim(d, where)
            if expected != self.num_layers:
                raise PlanError(f"pipeline {i}: stages cover layers [0, {expected}), the model has {self.num_layers}")
        for d in self.suspended:
            claim(d, "suspended")
        for d in self.excluded:
            claim(d, "excluded")
        missing = sorted(set(range(self.num_devices)) - set(seen))
        if missing:
            raise PlanError(f"devices {missing} are neither in a stage, suspended nor excluded")

    # ------------------------------------------------------------------ JSON round trip
    def _structure(self) -> dict[str, Any]:
        return {
            "num_devices": self.num_devices,
            "num_layers": self.num_layers,
            "micro_batch_size": self.micro_batch_size,
            "gpus_per_node": self.gpus_per_node,
            "pipelines": [
                {"micro_batches": p.micro_batches,
                 "stages": [{"devices": list(s.devices), "layers": list(s.layers),
                             # only where it is on: the plans (and ids) of stages without it stay as they were
                             **({"recompute": s.recompute} if s.recompute != "none" else {})} for s in p.stages]}
                for p in self.pipelines
            ],
            "suspended": sorted(self.suspended),
            "excluded": sorted(self.excluded),
        }

    def to_dict(self) -> dict[str, Any]:
        d = {"format_version": PLAN_FORMAT_VERSION, "plan_id": self.plan_id, **self._structure()}
        d.update(
            global_batch=self.global_batch,
            objective=self.objective,
            objective_value=_finite(self.objective_value),
            predicted_iteration_seconds=_finite(self.predicted_iteration_seconds),
            ideal_iteration_seconds=_finite(self.ideal_iteration_seconds),
            solve_seconds=_finite(self.solve_seconds),
            inputs=dict(self.inputs),
        )
        return d

    def to_json(self, indent: int | None = 2) -> str:
        # Standard JSON only: readers (ours included) refuse NaN and Infinity.
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(d).__name__}")
        version = d.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format_version {shorten(version)} is not supported (this build reads {PLAN_FORMAT_VERSION})")
        pipelines = tuple(_pipeline(x, f"pipelines[{i}]") for i, x in enumerate(_list(_get(d, "pipelines"), "pipelines")))
        plan = cls(
            num_devices=_int(_get(d, "num_devices"), "num_devices"),
            num_layers=_int(_get(d, "num_layers"), "num_layers"),
            micro_batch_size=_int(_get(d, "micro_batch_size"), "micro_batch_size"),
            gpus_per_node=_int(_get(d, "gpus_per_node", 8), "gpus_per_node"),
            pipelines=pipelines,
            suspended=_ints(_get(d, "suspended", ()), "suspended"),
            excluded=_ints(_get(d, "excluded", ()), "excluded"),
            objective=_text(_get(d, "objective", "paper"), "objective"),
            objective_value=_number(_get(d, "objective_value", None), "objective_value"),
            predicted_iteration_seconds=_number(_get(d, "predicted_iteration_seconds", None), "predicted_iteration_seconds"),
            ideal_iteration_seconds=_number(_get(d, "ideal_iteration_seconds", None), "ideal_iteration_seconds"),
            solve_seconds=_number(_get(d, "solve_seconds", None), "solve_seconds"),
            inputs=_inputs(_get(d, "inputs", None)),
        )
        stated = _int(_get(d, "global_batch", plan.global_batch), "global_batch")
        if stated != plan.global_batch:
            raise PlanError(f"global_batch {stated} disagrees with micro_batch_size x "
                            f"sum(micro_batches) = {plan.global_batch}")
        return plan

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        try:
            return cls.from_dict(parse_document(text, "json", "plan"))
        except ConfigError as e:
            raise PlanError(str(e)) from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file {str(p)!r} does not exist")
        try:
            return cls.from_dict(read_document(p, "json"))
        except ConfigError as e:
            raise PlanError(str(e)) from None
        except PlanError as e:
            raise PlanError(f"{p}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    # ------------------------------------------------------------------ diffs
    @staticmethod
    def diff(old: "Plan", new: "Plan", sizes: "StateSizes | None" = None,
             unavailable: Iterable[int] = ()) -> "PlanDiff":
        """The state slices that must move so that `new` can run where `old` ran.

        This is the migration schedule at the level of plan units (runtime/migrate.py expands each
        move into tensor rows). Each part's sharded state is cut into the finest common partition
        of its old and new shards; replicated state is one piece per needer. A needer that already
        holds a piece keeps it; every other (piece, needer) pair is one move, so the total is the
        minimum any migration must send. Sharded state of every block goes first, then replicated
        state part by part. The source is an old holder on the needer's node if there is one,
        else any old holder, choosing the one that has sent the fewest bytes so far (ties: lowest
        device id). `unavailable` devices (dead) cannot send; pieces only they held are reported
        in `missing`.
        """
        if old.num_layers != new.num_layers:
            raise PlanError(f"plans have different layer counts ({old.num_layers} vs {new.num_layers})")
        sizes = sizes or StateSizes()
        dead = set(unavailable)
        moves: list[SliceMove] = []
        missing: list[SliceMove] = []
        kept: list[SliceMove] = []
        sent: dict[int, float] = {}
        parts = model_parts(new.num_layers)
        for sharded, phase in ((True, parts), (False, parts)):
            for part in phase:
                part_bytes = sizes.bytes_of(part, sharded)
                if part_bytes <= 0:
                    continue  # state the sizes do not count (e.g. the embedding in 'whole blocks' units)
                owned = shard_map((st.devices for _, st in old.holders(part)), sharded=sharded, exclude=dead)
                needed = shard_map((st.devices for _, st in new.holders(part)), sharded=sharded)
                sources = _Sources(owned, new.node_of, sent)
                for dst, span in sorted(needed.items()):
                    for a, b in sources.cuts.partition(span):
                        nbytes = float((b - a) * part_bytes)
                        if dst in owned and owned[dst][0] <= a and b <= owned[dst][1]:
                            kept.append(SliceMove(part, a, b, dst, dst, nbytes, sharded))
                            continue
                        src = sources.pick(a, b, new.node_of(dst))
                        if src is None:
                            missing.append(SliceMove(part, a, b, None, dst, nbytes, sharded))
                            continue
                        sent[src] = sent.get(src, 0.0) + nbytes
                        moves.append(SliceMove(part, a, b, src, dst, nbytes, sharded))
        return PlanDiff(tuple(moves), tuple(missing), tuple(kept), new.gpus_per_node)

    @staticmethod
    def moved_bytes(old: "Plan", new: "Plan", sizes: "StateSizes | None" = None) -> float:
        """The bytes a migration from `old` to `new` moves with every device available. With the
        optimizer sharded (`sizes.sharded`) each element's state moves by owner
        (`_owner_moved_bytes`). Otherwise this is `Plan.diff(old, new, sizes).moved_bytes` without
        the schedule: what each needer lacks of its new parts. Every old TP group holds all of its
        parts' shards, so some old holder always has the rest, and where it comes from does not
        change the bytes. Device by device, not part by part (a re-plan compares its finalists'
        migrations over thousands of devices), and summed exactly: `diff` adds one rounded float
        per move, so the two may differ in the last bits, and equal migrations compare equal here."""
        if old.num_layers != new.num_layers:
            raise PlanError(f"plans have different layer counts ({old.num_layers} vs {new.num_layers})")
        sizes = sizes or StateSizes()
        if sizes.sharded:
            return _owner_moved_bytes(old, new, sizes)
        held = {d: (st, r, j == 0, j == len(pipe.stages) - 1)
                for pipe in old.pipelines for j, st in enumerate(pipe.stages) for r, d in enumerate(st.devices)}
        # exact shares of a part's sharded tensors (in blocks, the embedding, the head) and counts of
        # whole replicated copies, priced once at the end
        blocks = embedding = head = Fraction(0)
        replicated_blocks = replicated_heads = 0
        for pipe in new.pipelines:
            last = len(pipe.stages) - 1
            for j, st in enumerate(pipe.stages):
                t, (lo, hi) = st.tp, st.layers
                for r, d in enumerate(st.devices):
                    was, rank, first, final = held.get(d, (None, 0, False, False))
                    # blocks it held before, and the share of its new shard its old one covers
                    both = 0 if was is None else max(0, min(hi, was.layers[1]) - max(lo, was.layers[0]))
                    share = Fraction(0) if was is None else _shared(rank, was.tp, r, t)
                    blocks += Fraction(hi - lo, t) - both * share
                    replicated_blocks += hi - lo - both
                    if j == 0:
                        embedding += Fraction(1, t) - (share if first else 0)
                    if j == last:
                        head += Fraction(1, t) - (share if final else 0)
                        replicated_heads += not final
        return (sizes.block * float(blocks) + sizes.embedding * float(embedding) + sizes.head * float(head)
                + sizes.block_replicated * replicated_blocks + sizes.head_replicated * replicated_heads)


def _owner_moved_bytes(old: Plan, new: Plan, sizes: StateSizes) -> float:
    """A sharded optimizer's migration: each element's master and moments go from its owner under
    `old` to its owner under `new`, where the two differ (nothing else moves: the new holders
    all-gather their weights from the owners, as every step does). A piece of a part is owned in
    equal shares by its holders, in device order: the runtime's chunks (`runtime/state_owners.py`),
    exactly so where each gradient bucket holds one piece, as a large model's do. A tied head
    (`sizes.tied`) is the embedding's weight, owned among the holders of either."""
    total, shares = 0.0, {}
    for part in model_parts(old.num_layers):
        parts = (part, HEAD) if sizes.tied and part == EMBEDDING else (part,)
        holders = tuple(tuple(st.devices for p in parts for _, st in plan.holders(p)) for plan in (old, new))
        for sharded in (True, False):
            nbytes = 0.0 if sizes.tied and sharded and part == HEAD else sizes.bytes_of(part, sharded)
            if nbytes:     # the blocks of a stage share their holders: each pair is measured once
                if (holders, sharded) not in shares:
                    shares[holders, sharded] = float(_differ(*(_owners(g, sharded) for g in holders)))
                total += nbytes * shares[holders, sharded]
    return total


def _owners(groups: Sequence[tuple[int, ...]], sharded: bool) -> list[tuple[Fraction, Fraction, int]]:
    """(start, end, owner) tiling [0, 1) of a part's sharded (or replicated) tensors held by these
    TP groups."""
    if sharded:
        pieces = [(a, b, sorted({holder_at(g, a) for g in groups}))
                  for a, b in finest_partition(shard_map(groups).values())]
    else:
        pieces = [(Fraction(0), Fraction(1), sorted({d for g in groups for d in g}))]
    out = []
    for a, b, members in pieces:
        width = (b - a) / len(members)
        out += [(a + i * width, a + (i + 1) * width, d) for i, d in enumerate(members)]
    return out


def _differ(before: list[tuple[Fraction, Fraction, int]], after: list[tuple[Fraction, Fraction, int]]) -> Fraction:
    """The share of [0, 1) whose owner differs between two tilings."""
    i = j = 0
    at, out = Fraction(0), Fraction(0)
    while i < len(before) and j < len(after):
        end = min(before[i][1], after[j][1])
        if before[i][2] != after[j][2]:
            out += end - at
        at = end
        i += before[i][1] == end
        j += after[j][1] == end
    return out


def _shared(rank_a: int, size_a: int, rank_b: int, size_b: int) -> Fraction:
    """The share of a sharded tensor that TP rank a of a group of size_a and rank b of size_b both
    hold (`shard_of`), in integers over size_a · size_b."""
    lo = max(rank_a * size_b, rank_b * size_a)
    hi = min((rank_a + 1) * size_b, (rank_b + 1) * size_a)
    return Fraction(max(0, hi - lo), size_a * size_b)


class _Sources:
    """The old holders of one part, indexed for `Plan.diff`: its pieces and sources without a scan
    over every holder per needer (thousands of pipelines hold each block). Holders are grouped by
    their span (a few distinct TP shards); across nodes the least-loaded holder comes from a heap
    per span whose stale entries (`sent` only grows) are refreshed when they surface."""

    def __init__(self, owned: dict[int, Span], node_of, sent: dict[int, float]):
        self.sent = sent
        self.cuts = Cuts(set(owned.values()))
        self.on_node: dict[tuple[Span, int], list[int]] = {}
        self.heaps: dict[Span, list[tuple[float, int]]] = {}
        for d, span in sorted(owned.items()):
            self.on_node.setdefault((span, node_of(d)), []).append(d)
            self.heaps.setdefault(span, []).append((sent.get(d, 0.0), d))
        for h in self.heaps.values():
            heapq.heapify(h)

    def pick(self, a: Fraction, b: Fraction, node: int) -> int | None:
        """A holder of [a, b): on `node` if one is, else any; the fewest bytes sent so far, then
        the lowest id. None if no live holder has it."""
        spans = [sp for sp in self.heaps if sp[0] <= a and b <= sp[1]]
        key = lambda d: (self.sent.get(d, 0.0), d)      # noqa: E731
        local = [d for sp in spans for d in self.on_node.get((sp, node), ())]
        if local:
            return min(local, key=key)
        tops = [self._top(self.heaps[sp]) for sp in spans]
        return min(tops, key=key) if tops else None

    def _top(self, heap: list[tuple[float, int]]) -> int:
        while heap[0][0] != self.sent.get(heap[0][1], 0.0):
            _, d = heapq.heappop(heap)
            heapq.heappush(heap, (self.sent.get(d, 0.0), d))
        return heap[0][1]


# Reading a plan file: every field of the type the writer gives it, or one line naming the field.
_REQUIRED = object()


def _get(d: Mapping[str, Any], key: str, default: Any = _REQUIRED, where: str = "") -> Any:
    if key in d:
        return d[key]
    if default is _REQUIRED:
        raise PlanError(f"plan is missing the field {where + key!r}")
    return default


def _wrong(where: str, v: Any, expected: str) -> PlanError:
    return PlanError(f"plan field {where} must be {expected}, got {shorten(v)}")


def _int(v: Any, where: str) -> int:
    """An int as written (device ids, counts, layers): not a fraction, a bool or a numeric string."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise _wrong(where, v, "an integer")
    return v


def _number(v: Any, where: str) -> float | None:
    """An informative number: a finite int or float, or null."""
    try:
        ok = v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v))
    except OverflowError:     # an int beyond any float
        ok = False
    if not ok:
        raise _wrong(where, v, "a finite number or null")
    return v


def _text(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _wrong(where, v, "a string")
    return v


def _list(v: Any, where: str) -> Sequence[Any]:
    if not isinstance(v, (list, tuple)):
        raise _wrong(where, v, "a list")
    return v


def _object(v: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise _wrong(where, v, "an object")
    return v


def _inputs(v: Any) -> dict[str, Any]:
    """What the plan was made from (informative): an object, or null for none."""
    return {} if v is None else dict(_object(v, "inputs"))


def _ints(v: Any, where: str) -> tuple[int, ...]:
    return tuple(_int(x, f"{where}[{i}]") for i, x in enumerate(_list(v, where)))


def _pipeline(p: Any, where: str) -> Pipeline:
    p = _object(p, where)
    stages = []
    for j, st in enumerate(_list(_get(p, "stages", where=where + "."), where + ".stages")):
        at = f"{where}.stages[{j}]"
        st = _object(st, at)
        layers = _ints(_get(st, "layers", where=at + "."), at + ".layers")
        if len(layers) != 2:
            raise _wrong(at + ".layers", list(layers), "[start, end)")
        stages.append(Stage(_ints(_get(st, "devices", where=at + "."), at + ".devices"), (layers[0], layers[1]),
                            _text(_get(st, "recompute", "none"), at + ".recompute")))
    return Pipeline(stages=tuple(stages), micro_batches=_int(_get(p, "micro_batches", where=where + "."),
                                                            where + ".micro_batches"))


@dataclass(frozen=True)
class StateSizes:
    """Bytes of model + optimizer state of each part at full (unsharded) size.

    The default unit (1.0 per block) makes diffs count in 'whole blocks'; the planner fills in
    real bytes from the cost model (fp32 params + grads + Adam moments). A part's state is counted
    as sharded with its TP shard (`block`, `embedding`, `head`: the embedding and the head are split
    by vocabulary rows), except its replicated tensors (`block_replicated`, `head_replicated`: norm
    weights), which move whole and only to needers that held none of them.
    """

    block: float = 1.0
    embedding: float = 0.0
    head: float = 0.0
    block_replicated: float = 0.0
    head_replicated: float = 0.0
    sharded: bool = False    # the optimizer's state split among a piece's holders: moves by owner (`Plan.moved_bytes`)
    tied: bool = False       # the head is the embedding's weight (`ModelShape.tie_embeddings`)

    @classmethod
    def of(cls, shape: ModelShape, bytes_per_param: float) -> "StateSizes":
        """A model's sizes from its tensor table, at `bytes_per_param` (what moves of each parameter)."""
        def size(part: Part, sharded: bool) -> float:
            return bytes_per_param * sum(t.numel for t in part_tensors(shape, part) if (t.split_dim is not None) == sharded)

        return cls(block=size(0, True), block_replicated=size(0, False), embedding=size(EMBEDDING, True),
                   head=size(HEAD, True), head_replicated=size(HEAD, False), tied=shape.tie_embeddings)

    def bytes_of(self, part: Part, sharded: bool | None = None) -> float:
        """The part's state: all of it (`sharded` None), or only its sharded or replicated share."""
        split, kept = {EMBEDDING: (self.embedding, 0.0), HEAD: (self.head, self.head_replicated)}.get(
            part, (self.block, self.block_replicated))
        if sharded is None:
            return split + kept
        return split if sharded else kept


@dataclass(frozen=True)
class SliceMove:
    part: Part               # block index, EMBEDDING or HEAD
    start: Fraction          # shard range [start, end) as fractions of the part's sharded tensors
    end: Fraction
    src: int | None          # None: no surviving holder (restore from a replica-less checkpoint)
    dst: int
    bytes: float
    sharded: bool = True     # False: the part's replicated state, whole ([0, 1))

    def to_dict(self) -> dict[str, Any]:
        return {"part": self.part, "shard": [str(self.start), str(self.end)], "sharded": self.sharded,
                "src": self.src, "dst": self.dst, "bytes": self.bytes}


@dataclass(frozen=True)
class PlanDiff:
    moves: tuple[SliceMove, ...]
    missing: tuple[SliceMove, ...]
    kept: tuple[SliceMove, ...]    # pieces a needer already holds (src == dst)
    gpus_per_node: int

    @property
    def moved_bytes(self) -> float:
        return sum(m.bytes for m in self.moves)

    @property
    def reused_bytes(self) -> float:
        return sum(m.bytes for m in self.kept)

    @property
    def inter_node_bytes(self) -> float:
        g = self.gpus_per_node
        return sum(m.bytes for m in self.moves if m.src // g != m.dst // g)

    def max_bytes_per_device(self) -> tuple[float, float]:
        """(largest bytes any device sends, largest bytes any device receives)."""
        sent: dict[int, float] = {}
        recv: dict[int, float] = {}
        for m in self.moves:
            sent[m.src] = sent.get(m.src, 0.0) + m.bytes
            recv[m.dst] = recv.get(m.dst, 0.0) + m.bytes
        return max(sent.values(), default=0.0), max(recv.values(), default=0.0)

    def summary(self) -> dict[str, float]:
        s, r = self.max_bytes_per_device()
        return {"moves": len(self.moves), "moved_bytes": self.moved_bytes,
                "inter_node_bytes": self.inter_node_bytes, "reused_bytes": self.reused_bytes,
                "missing_bytes": sum(m.bytes for m in self.missing),
                "max_send_bytes": s, "max_recv_bytes": r}
