"""A stand-in for NCCL's point-to-point rules, to check on CPU that a communication schedule cannot
hang on GPUs. gloo buffers sends and honours tags, so a schedule that is fine on gloo can still
deadlock under NCCL; this fake does what NCCL does and reports where it would hang.

The rules (what `RulesMatcher` enforces):
  * one stream per rank: a rank's batches run one after another in posting order (every batch of
    ours goes through the world communicator, whose ops share one stream); a batch starts only
    once the rank's previous batch has completed;
  * a batch is a group: its ops are issued together and progress in any order across peers; the
    batch completes when every one of its ops has been matched;
  * one FIFO per ordered rank pair (src -> dst): the k-th send src posts to dst matches the k-th
    receive dst posts from src, whatever the tags;
  * no buffering: a send completes only when its matching receive has been issued;
  * a matched send and receive must agree on shape and dtype (NCCL would hang or corrupt), and on
    what they carry where both ends label it (NCCL cannot know: the schedule paired the wrong ones).
A mismatch raises `NcclRuleError` at once; so does a deadlock, when every rank is waiting and
nothing can match, or when nothing has matched for `timeout` seconds. Both name the ranks and
their pending ops.

Single (unbatched) isend/irecv calls are stricter here than under torch's NCCL, which puts the
calls between each pair of ranks on that pair's own stream: this fake serialises all of a rank's
calls. A schedule this fake passes cannot hang for that reason.

Three ways in: `run_programs` simulates whole per-rank programs of batches (no threads, no
tensors); `RulesHub` lets ranks running as threads (or, through `serve_hub`, as processes) post
real tensors and wait; `RulesTransport` and `rules_exchange` put the hub behind the engine's
transport and the migration's exchange.
"""
from __future__ import annotations

import io
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.managers import BaseManager
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

from malleus_svc.runtime.groups import PipelinePeers
from malleus_svc.runtime.schedule import Post, stage_program
from malleus_svc.runtime.transport import BatchedStageTransport, Message, PeerOp, post_pieces


class NcclRuleError(RuntimeError):
    """A schedule broke NCCL's p2p rules: a mismatched pair of ops, or a deadlock."""


class CommunicatorAborted(RuntimeError):
    """The rank's communicator was aborted (`RulesHub.abort`): its pending and later ops fail."""


@dataclass(frozen=True)
class Op:
    kind: Literal["send", "recv"]
    peer: int
    shape: tuple[int, ...] = ()
    dtype: str = ""
    label: str = ""          # what it carries: named in messages, and must agree where both ends name it

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        what = f" {self.label}" if self.label else ""
        return f"{self.kind}{arrow}{self.peer}{what} {list(self.shape)} {self.dtype}".rstrip()


@dataclass
class _Batch:
    rank: int
    seq: int
    ops: list[Op]
    payloads: list[Any]                  # sends: what they carry; receives: filled on match
    matched: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.matched = [False] * len(self.ops)

    @property
    def complete(self) -> bool:
        return all(self.matched)


class RulesMatcher:
    """The rules as a pure state machine: post batches, `progress()`, ask what completed."""

    def __init__(self) -> None:
        self._streams: dict[int, deque[_Batch]] = {}
        self._posted: dict[int, int] = {}
        self._done: dict[int, int] = {}      # per rank: batches completed (they complete in order)
        self._results: dict[tuple[int, int], list[Any]] = {}

    def post(self, rank: int, ops: Sequence[Op], payloads: Sequence[Any] | None = None) -> int:
        """Queue one batch on `rank`'s stream; returns its sequence number on that rank."""
        seq = self._posted.get(rank, 0)
        self._posted[rank] = seq + 1
        self._done.setdefault(rank, 0)
        payloads = list(payloads) if payloads is not None else [None] * len(ops)
        self._streams.setdefault(rank, deque()).append(_Batch(rank, seq, list(ops), payloads))
        return seq

    def completed(self, rank: int, seq: int) -> bool:
        return seq < self._done.get(rank, 0)

    def received(self, rank: int, seq: int) -> list[Any]:
        """The payloads of a completed batch's receives, in op order."""
        return self._results.pop((rank, seq))

    def idle(self, rank: int) -> bool:
        return not self._streams.get(rank)

    def posted(self, rank: int) -> int:
        return self._posted.get(rank, 0)

    def drop(self, rank: int) -> None:
        """Forget `rank`'s pending batches (its communicator is gone); peers' ops with it never match."""
        self._streams.pop(rank, None)

    def progress(self) -> bool:
        """Match every op that can match now; True if any did."""
        any_matched, again = False, True
        while again:
            again = False
            for rank, stream in self._streams.items():
                if not stream:
                    continue
                batch = stream[0]
                for i, op in enumerate(batch.ops):
                    if op.kind != "send" or batch.matched[i] or not self._first_unmatched(batch, i):
                        continue
                    j, peer_batch = self._head_recv(op.peer, rank)
                    if peer_batch is None:
                        continue
                    recv = peer_batch.ops[j]
                    if (recv.shape, recv.dtype) != (op.shape, op.dtype) or (op.label and recv.label
                                                                             and op.label != recv.label):
                        raise NcclRuleError(
                            f"mismatch: rank {rank} sends {op} in its batch #{batch.seq}, rank {op.peer} "
                            f"receives {recv} in its batch #{peer_batch.seq}\n{self.describe()}")
                    batch.matched[i] = peer_batch.matched[j] = True
                    peer_batch.payloads[j] = batch.payloads[i]
                    any_matched = again = True
            for stream in self._streams.values():
                while stream and stream[0].complete:
                    b = stream.popleft()
                    self._results[(b.rank, b.seq)] = [p for o, p in zip(b.ops, b.payloads) if o.kind == "recv"]
                    self._done[b.rank] = b.seq + 1
                    again = True
        return any_matched

    @staticmethod
    def _first_unmatched(batch: _Batch, i: int) -> bool:
        """Op i is at the head of its pair's FIFO: no earlier op of the batch to the same peer and
        of the same kind is still unmatched (earlier batches have completed)."""
        op = batch.ops[i]
        return not any(not batch.matched[k] and batch.ops[k].kind == op.kind and batch.ops[k].peer == op.peer
                       for k in range(i))

    def _head_recv(self, rank: int, src: int) -> tuple[int, _Batch | None]:
        stream = self._streams.get(rank)
        if not stream:
            return -1, None
        batch = stream[0]
        for j, op in enumerate(batch.ops):
            if op.kind == "recv" and op.peer == src and not batch.matched[j]:
                return j, batch
        return -1, None

    def describe(self, waiting: Mapping[int, str] | None = None) -> str:
        """Every rank's pending batches, the active one's unmatched ops marked, and pairs whose heads
        both wait to send to each other."""
        lines = []
        for rank in sorted(self._streams):
            stream = self._streams[rank]
            if not stream:
                continue
            head = stream[0]
            ops = ", ".join(f"{op}{'' if m else ' (unmatched)'}" for op, m in zip(head.ops, head.matched))
            queued = [f"#{b.seq} [{', '.join(map(str, b.ops))}]" for b in list(stream)[1:4]]
            queued += ["..."] if len(stream) > 4 else []
            more = f"; queued behind it: {', '.join(queued)}" if queued else ""
            where = f" [{waiting[rank]}]" if waiting and rank in waiting else ""
            lines.append(f"  rank {rank}{where}: batch #{head.seq} [{ops}]{more}")
        for a in sorted(self._streams):
            for b in sorted(self._streams):
                if a < b and self._sends_to(a, b) and self._sends_to(b, a):
                    lines.append(f"  ranks {a} and {b} each wait to send to the other before receiving")
        return "\n".join(lines) or "  (no pending ops)"

    def _sends_to(self, a: int, b: int) -> bool:
        stream = self._streams.get(a)
        return bool(stream) and any(op.kind == "send" and op.peer == b and not m
                                    for op, m in zip(stream[0].ops, stream[0].matched)) \
            and self._head_recv(b, a)[1] is None


# ---------------------------------------------------------------------------- simulation
Program = Sequence[tuple[Sequence[Op], bool]]   # batches in order; True: wait for it before going on


def run_programs(programs: Mapping[int, Program]) -> None:
    """Run each rank's batches under the rules, each rank waiting where its program says and for
    everything at its end; raises NcclRuleError on a mismatch or a deadlock."""
    m = RulesMatcher()
    pos = {r: 0 for r in programs}
    blocked: dict[int, int | None] = {r: None for r in programs}   # the seq a rank waits for
    while True:
        moved = False
        for r, prog in programs.items():
            while blocked[r] is None or m.completed(r, blocked[r]):
                blocked[r] = None
                if pos[r] == len(prog):
                    break
                ops, wait = prog[pos[r]]
                pos[r] += 1
                moved = True
                seq = m.post(r, ops)
                if wait:
                    blocked[r] = seq
        moved |= m.progress()
        if all(pos[r] == len(p) and blocked[r] is None and m.idle(r) for r, p in programs.items()):
            return
        if not moved:
            waiting = {r: f"at post {pos[r]} of {len(p)}" if pos[r] < len(p) or blocked[r] is not None
                       else "finished, its sends unmatched" for r, p in programs.items()}
            raise NcclRuleError("deadlock: every rank waits and no op can match\n" + m.describe(waiting))


def pipeline_programs(stage_peers: Sequence[Mapping[int, PipelinePeers]], num_micro: int, tokens: int = 7,
                      width: int = 1) -> dict[int, Program]:
    """Each rank's batches under `stage_program`: stage_peers[j] maps stage j's ranks to their peers.
    Every boundary tensor is `tokens` x `width`, of which each op carries the rows two ranks share
    (`transport.post_pieces`); ops are labelled with what they carry, so a crossed pair is a mismatch."""
    programs: dict[int, Program] = {}
    n = len(stage_peers)
    for j, ranks in enumerate(stage_peers):
        program = stage_program(n, j, num_micro)
        for rank, peers in ranks.items():
            batches = []
            for ins in program:
                if isinstance(ins, Post):
                    ops = [Op(t.direction, peer, (b - a, width), "float32", f"{t.tensor} {t.micro} rows {a}:{b}")
                           for t, peer, a, b in post_pieces(peers, ins, lambda _: tokens)]
                    if ops:
                        batches.append((ops, bool(ins.receives)))
            programs[rank] = batches
    return programs


# ---------------------------------------------------------------------------- live ranks
class RulesHub:
    """The matcher shared by ranks that run for real (threads, or processes via `serve_hub`).

    `world` ranks take part; a rank's `wait` fails when all of them are waiting (or have called
    `close`) and nothing can match, or when nothing has matched for `timeout` seconds. The first
    failure is kept and raised in every rank's next call, so all of them stop. `abort(rank)` is
    `ncclCommAbort` on that rank's communicator: from any thread, its pending wait and every later
    call fail at once, and its ops are gone, so a peer's op with it never completes.
    """

    def __init__(self, world: int, timeout: float = 30.0):
        self.world, self.timeout = world, timeout
        self._m = RulesMatcher()
        self._cv = threading.Condition()
        self._waiting: dict[int, int] = {}
        self._closed: set[int] = set()
        self._aborted: set[int] = set()
        self._error: str | None = None
        self._last_progress = time.monotonic()

    def post(self, rank: int, ops: Sequence[Op], payloads: Sequence[Any]) -> int:
        with self._cv:
            self._check(rank)
            seq = self._m.post(rank, ops, payloads)
            self._advance()
            return seq

    def wait(self, rank: int, seq: int) -> list[Any]:
        """Block until batch `seq` of `rank` completed; the payloads of its receives."""
        with self._cv:
            self._waiting[rank] = seq
            try:
                while True:
                    self._check(rank)
                    self._advance()
                    if self._m.completed(rank, seq):
                        return self._m.received(rank, seq)
                    stuck = {r: s for r, s in self._waiting.items() if not self._m.completed(r, s)}
                    if len(stuck) + len(self._closed - set(stuck)) >= self.world:
                        self._fail("deadlock: every rank waits and no op can match", stuck)
                    idle = time.monotonic() - self._last_progress
                    if idle >= self.timeout:
                        self._fail(f"deadlock: no op matched for {idle:.0f} s", stuck)
                    self._cv.wait(timeout=min(1.0, self.timeout - idle))
            finally:
                self._waiting.pop(rank, None)

    def close(self, rank: int) -> None:
        """`rank` posts nothing more (its posted batches may still complete)."""
        with self._cv:
            self._closed.add(rank)
            self._cv.notify_all()

    def abort(self, rank: int) -> None:
        with self._cv:
            self._aborted.add(rank)
            self._closed.add(rank)
            self._m.drop(rank)
            self._cv.notify_all()

    def posted(self, rank: int) -> int:
        """How many batches `rank` has posted."""
        with self._cv:
            return self._m.posted(rank)

    def _advance(self) -> None:
        try:
            if self._m.progress():
                self._last_progress = time.monotonic()
                self._cv.notify_all()
        except NcclRuleError as e:
            self._error = str(e)
            self._cv.notify_all()
            raise

    def _fail(self, what: str, stuck: Mapping[int, int]) -> None:
        self._error = what + "\n" + self._m.describe({r: f"waits for its batch #{s}" for r, s in stuck.items()})
        self._cv.notify_all()
        raise NcclRuleError(self._error)

    def _check(self, rank: int) -> None:
        if rank in self._aborted:
            raise CommunicatorAborted(f"rank {rank}'s communicator was aborted")
        if self._error is not None:
            raise NcclRuleError(self._error)


class _HubManager(BaseManager):
    pass


_HubManager.register("RulesHub", RulesHub)


def serve_hub(world: int, timeout: float = 30.0):
    """(manager, hub proxy): a RulesHub in a server process, for ranks that are processes. The proxy
    pickles into spawned children; shut the manager down when done."""
    manager = _HubManager()
    manager.start()
    return manager, manager.RulesHub(world, timeout)


def _pack(hub: Any, t: torch.Tensor) -> Any:
    """What a send carries: a copy (a send's buffer may change once it completes); serialised
    when the hub is in another process (a proxy), so it crosses by value."""
    if isinstance(hub, RulesHub):
        return t.detach().clone()
    buf = io.BytesIO()
    torch.save(t.detach().cpu().clone(), buf)
    return buf.getvalue()


def _unpack(data: Any) -> torch.Tensor:
    return data if isinstance(data, torch.Tensor) else torch.load(io.BytesIO(data), weights_only=True)


def _op(kind: str, peer: int, t: torch.Tensor, label: str = "") -> Op:
    return Op(kind, peer, tuple(t.shape), str(t.dtype).removeprefix("torch."), label)  # type: ignore[arg-type]


class RulesTransport(BatchedStageTransport):
    """The engine's stage transport over a RulesHub: `transport=functools.partial(RulesTransport,
    hub=hub, rank=rank)`. Ranks are device ids."""

    def __init__(self, peers: PipelinePeers, device: torch.device, dtype: torch.dtype = torch.float32, *,
                 hub: Any, rank: int):
        super().__init__(peers, device, dtype)
        self.hub, self.rank = hub, rank

    def _issue(self, ops: Sequence[PeerOp]) -> Any:
        rule_ops = [_op(t.direction, peer, buf, f"{t.tensor} {t.micro}") for t, peer, buf in ops]
        payloads = [_pack(self.hub, buf) if t.direction == "send" else None for t, _, buf in ops]
        return self.hub.post(self.rank, rule_ops, payloads), [buf for t, _, buf in ops if t.direction == "recv"]

    def _wait(self, handle: Any) -> None:
        seq, bufs = handle
        for buf, data in zip(bufs, self.hub.wait(self.rank, seq)):
            buf.copy_(_unpack(data))


def rules_exchange(hub: Any, rank: int) -> Callable[[Sequence[Message], int], None]:
    """A drop-in for `transport.exchange` on `rank` (a device id) that posts through the hub."""

    def exchange(messages: Sequence[Message], tag: int) -> None:
        ops = [_op(m.kind, m.peer, m.tensor) for m in messages]
        seq = hub.post(rank, ops, [_pack(hub, m.tensor) if m.kind == "send" else None for m in messages])
        for m, data in zip([m for m in messages if m.kind == "recv"], hub.wait(rank, seq)):
            m.tensor.copy_(_unpack(data))

    return exchange


def run_threads(fns: Mapping[int, Callable[[], Any]], hub: RulesHub) -> dict[int, Any]:
    """Run one function per rank in its own thread; each rank is closed on the hub when its function
    returns. Returns the results; re-raises the first error (a rule error before any other)."""
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(rank: int, fn: Callable[[], Any]) -> None:
        try:
            results[rank] = fn()
        except BaseException as e:   # noqa: BLE001 - handed to the caller
            errors[rank] = e
        finally:
            hub.close(rank)

    threads = [threading.Thread(target=run, args=(r, f), daemon=True) for r, f in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        rule = [e for e in errors.values() if isinstance(e, NcclRuleError)]
        raise (rule or list(errors.values()))[0]
    return results


__all__ = ["NcclRuleError", "CommunicatorAborted", "Op", "RulesMatcher", "run_programs", "pipeline_programs", "RulesHub",
           "serve_hub", "RulesTransport", "rules_exchange", "run_threads"]
