"""Point-to-point transport: the boundary tensors of a pipeline step, and the batched exchanges
of a migration round, over torch.distributed.

The schedule and the migration plan say what moves where and in which order; only this module
posts it. The engine takes a `StageTransport` factory, so another transport (e.g. one that checks
NCCL's ordering rules in tests) can stand in for `P2PTransport`. Messages between two ranks are
matched by the order they are posted in, never by tag (NCCL ignores tags; gloo gets them too).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

import torch
import torch.distributed as dist

from malleus_svc.runtime.groups import PipelinePeers, world_rank


class StageTransport(Protocol):
    """Moves one stage's boundary tensors; `comm_seconds` accumulates the time spent waiting."""

    comm_seconds: float

    def recv_activation(self, shape: tuple[int, ...], micro: int) -> torch.Tensor: ...
    def send_activation(self, x: torch.Tensor, micro: int) -> None: ...
    def recv_gradient(self, shape: tuple[int, ...], micro: int) -> torch.Tensor: ...
    def send_gradient(self, g: torch.Tensor, micro: int) -> None: ...
    def finish(self) -> None: ...


# Tags keep the two directions and the micro-batches apart where the backend honours them (gloo).
def _tag(kind: str, micro: int) -> int:
    return 2 * micro + (kind == "B")


@dataclass
class P2PTransport:
    """Sends and receives one stage's boundary tensors with isend/irecv.

    Receives are waited for at once (the compute needs them); sends are kept in flight and waited
    for at `finish()`, so no stage ever blocks on a peer that is itself waiting to send.
    Tensors travel contiguous (gloo needs it) in one fixed dtype, the parameters' (fp32 unless
    asked otherwise), so the receiver can allocate without being told.
    """

    peers: PipelinePeers
    device: torch.device
    dtype: torch.dtype = torch.float32  # of every boundary tensor: the parameters' dtype
    comm_seconds: float = 0.0

    def __post_init__(self) -> None:
        self._pending: list[dist.Work] = []
        self._keep: list[torch.Tensor] = []  # buffers of sends in flight

    def recv_activation(self, shape: tuple[int, ...], micro: int) -> torch.Tensor:
        return self._recv(self.peers.recv_activation_from, shape, _tag("F", micro))

    def send_activation(self, x: torch.Tensor, micro: int) -> None:
        self._send(x, self.peers.send_activation_to, _tag("F", micro))

    def recv_gradient(self, shape: tuple[int, ...], micro: int) -> torch.Tensor:
        return self._recv(self.peers.recv_gradient_from, shape, _tag("B", micro))

    def send_gradient(self, g: torch.Tensor, micro: int) -> None:
        self._send(g, self.peers.send_gradient_to, _tag("B", micro))

    def finish(self) -> None:
        start = time.perf_counter()
        for work in self._pending:
            work.wait()
        self.comm_seconds += time.perf_counter() - start
        self._pending.clear()
        self._keep.clear()

    def _recv(self, src: int | None, shape: tuple[int, ...], tag: int) -> torch.Tensor:
        if src is None:
            raise RuntimeError("this stage has no peer to receive from")
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        dist.irecv(buf, src=world_rank(src), tag=tag).wait()
        self.comm_seconds += time.perf_counter() - start
        return buf

    def _send(self, x: torch.Tensor, dsts: tuple[int, ...], tag: int) -> None:
        if not dsts:
            return
        buf = x.detach().to(self.dtype).contiguous()
        self._keep.append(buf)
        for dst in dsts:
            self._pending.append(dist.isend(buf, dst=world_rank(dst), tag=tag))


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
