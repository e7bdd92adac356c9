"""The 1F1B pipeline schedule, and the point-to-point transport that carries it out.

The schedule is a pure list of actions per stage; the transport moves tensors between stages.
Stage j of S with m micro-batches runs min(S - j - 1, m) warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. Every pipeline uses its own m.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from malleus_svc.runtime.groups import PipelinePeers, world_rank

Action = tuple[Literal["F", "B"], int]


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[Action]:
    """The ordered (kind, micro-batch index) actions of `stage` under 1F1B."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    if num_micro < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, got {num_micro}")
    warmup = min(num_stages - stage - 1, num_micro)
    actions: list[Action] = [("F", i) for i in range(warmup)]
    next_b = 0
    for i in range(warmup, num_micro):
        actions += [("F", i), ("B", next_b)]
        next_b += 1
    actions += [("B", i) for i in range(next_b, num_micro)]
    return actions


# Tags keep the two directions and the micro-batches apart where the backend honours them (gloo).
def _tag(kind: str, micro: int) -> int:
    return 2 * micro + (kind == "B")


@dataclass
class StageTransport:
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
