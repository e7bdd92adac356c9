"""Point-to-point transport: the posts of a pipeline step, and the batched exchanges of a
migration round, over torch.distributed.

The schedule and the migration plan say what moves where and in which order; only this module
posts it. Every post goes out as ONE `batch_isend_irecv`: NCCL runs a rank's p2p calls in posting
order on one stream and does not buffer sends, so sends posted one by one can wait on each other
across a pair of stages forever, while one group per post lets its sends and receives progress
together. Messages between two ranks are matched by the order they are posted in, never by tag
(NCCL ignores tags; gloo gets them too). The engine takes a `StageTransport` factory, so another
transport (`nccl_rules.RulesTransport`, which enforces NCCL's rules on CPU) can stand in.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from malleus_svc.runtime.groups import PipelinePeers, world_rank
from malleus_svc.runtime.schedule import Post, Transfer


class StageTransport(Protocol):
    """Moves one stage's boundary tensors; `comm_seconds` accumulates the time spent waiting."""

    comm_seconds: float

    def post(self, post: Post, sends: Mapping[Transfer, torch.Tensor],
             shapes: Mapping[Transfer, tuple[int, int]]) -> dict[Transfer, torch.Tensor]:
        """Issue the post as one batch (each send this rank's rows of a micro-batch's boundary
        tensor, whose whole shape, tokens x hidden, `shapes` gives for every transfer); return this
        rank's rows of each tensor received, once they have arrived."""
        ...

    def finish(self) -> None:
        """Wait for every send still in flight."""
        ...


PeerOp = tuple[Transfer, int, torch.Tensor]   # a transfer, the peer (device id) it goes to or comes from, its buffer


# Tags keep the two directions and the micro-batches apart where the backend honours them (gloo).
def _tag(t: Transfer) -> int:
    return 2 * t.micro + (t.tensor == "gradient")


class BatchedStageTransport:
    """Turns a post into this rank's ops (for each transfer, one receive or send per rank of the
    neighbouring stage that shares rows with this one: `PipelinePeers.pieces`) and issues them as
    one batch; subclasses issue and wait. Received pieces are put together in row order.

    A post with receives is waited for at once (the next compute needs them); one with only sends
    stays in flight until a later wait or `finish()`. Tensors travel contiguous (gloo needs it) in
    one fixed dtype, the parameters', so the receiver can allocate without being told.
    """

    def __init__(self, peers: PipelinePeers, device: torch.device, dtype: torch.dtype = torch.float32):
        self.peers, self.device, self.dtype = peers, device, dtype
        self.comm_seconds = 0.0
        self._in_flight: list[Any] = []   # handles of send-only batches, with their buffers

    def post(self, post: Post, sends: Mapping[Transfer, torch.Tensor],
             shapes: Mapping[Transfer, tuple[int, int]]) -> dict[Transfer, torch.Tensor]:
        ops: list[PeerOp] = []
        received: dict[Transfer, list[torch.Tensor]] = {t: [] for t in post.receives}
        for t, peer, a, b in post_pieces(self.peers, post, lambda t: shapes[t][0]):
            if t.direction == "recv":
                buf = torch.empty((b - a, shapes[t][1]), dtype=self.dtype, device=self.device)
                received[t].append(buf)
            else:
                first = self.peers.rows(shapes[t][0])[0]
                buf = sends[t].detach()[a - first:b - first].to(self.dtype).contiguous()
            ops.append((t, peer, buf))
        if ops:
            start = time.perf_counter()
            handle = self._issue(ops)
            if received:
                self._wait(handle)
            else:
                self._in_flight.append(handle)
            self.comm_seconds += time.perf_counter() - start
        return {t: _joined(bufs, shapes[t][1], self.dtype, self.device) for t, bufs in received.items()}

    def finish(self) -> None:
        start = time.perf_counter()
        for handle in self._in_flight:
            self._wait(handle)
        self._in_flight.clear()
        self.comm_seconds += time.perf_counter() - start

    def _issue(self, ops: Sequence[PeerOp]) -> Any:
        raise NotImplementedError

    def _wait(self, handle: Any) -> None:
        raise NotImplementedError


def post_pieces(peers: PipelinePeers, post: Post, tokens: Callable[[Transfer], int]
                ) -> Iterator[tuple[Transfer, int, int, int]]:
    """(transfer, peer, start, end): every op of a post in order, each the rows [start, end) of a
    micro-batch of `tokens(transfer)` tokens that this rank and one rank of the stage on the other
    side both hold (activations come from the previous stage and go to the next, gradients the
    other way)."""
    for t in post.transfers:
        other = peers.prev if (t.tensor == "activation") == (t.direction == "recv") else peers.next
        if not other:
            raise RuntimeError(f"this stage has no peer to {t.direction} {t.tensor} {t.micro} with")
        for peer, a, b in peers.pieces(tokens(t), other):
            yield t, peer, a, b


def _joined(pieces: list[torch.Tensor], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Received pieces of rows, in row order, as one tensor (none: a rank holding no rows)."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty((0, width), dtype=dtype, device=device)


class P2PTransport(BatchedStageTransport):
    """The stage transport over torch.distributed's default group: one `batch_isend_irecv` per post."""

    def _issue(self, ops: Sequence[PeerOp]) -> Any:
        p2p = [dist.P2POp(dist.isend if t.direction == "send" else dist.irecv, buf, world_rank(peer), tag=_tag(t))
               for t, peer, buf in ops]
        return dist.batch_isend_irecv(p2p), [buf for _, _, buf in ops]   # buffers live until waited

    def _wait(self, handle: Any) -> None:
        works, _ = handle
        for work in works:
            work.wait()


@dataclass(frozen=True)
class Message:
    """One send or receive of a batched exchange; `peer` is a device id."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


def exchange(messages: Sequence[Message], tag: int) -> None:
    """Post every message in one `batch_isend_irecv`, in the given order, and wait for all.

    NCCL runs the batch as one group, so a pair that sends both ways cannot deadlock; gloo posts
    plain isend/irecv with `tag`. Both ends must post their messages to each other in one order.
    """
    ops = [dist.P2POp(dist.isend if m.kind == "send" else dist.irecv, m.tensor, world_rank(m.peer), tag=tag)
           for m in messages]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
