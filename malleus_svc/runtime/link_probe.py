"""How long a job's own links take: the pipeline hand-off and the gradient all-reduce, timed on
the devices, the transport and the backend the job trains with.

The planner's 'full' objective prices a stage boundary and a block's gradient reduction in t0
units (`costmodel.profile.CommCosts`). A scenario's analytic terms describe a GPU cluster from its
datasheet; a running job measures instead (`WorkerGroup.time_links`), and the coordinator turns the
seconds into t0 units with its measured healthy block time (`LinkTimes.comm_costs`):

  * hand-off: a ping-pong of one boundary tensor (micro-batch × seq_len × hidden, in the dtype the
    stage transport sends) between two devices: the activation forward and its gradient back, what
    one micro-batch moves across one stage boundary. Each message is one batched post, as the stage
    transport's are, so the probe keeps NCCL's rules (`exchange` takes `nccl_rules.rules_exchange`
    in the tests);
  * the hand-off between TP groups: k disjoint pairs at once, each with 1/k of the tensor, what a
    boundary between groups of k devices moves under sequence parallelism. On GPUs each pair has
    links of its own; CPU stand-ins on one host share its memory and cores;
  * gradient all-reduce: one bucket of fp32 gradients (a block's, or as many blocks as the runtime's
    bucket holds) all-reduced among the devices given (one holder per pipeline, as GradientSync
    reduces), its time scaled to one block.

Wall time on the host, after the device's stream has drained on a GPU; the median of `repeats`
timed rounds after one untimed round (the first use of a link sets it up).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from malleus_svc.runtime.transport import Message, exchange as batched_exchange

_TAG = 0x6C696E   # apart from the pipeline's and the migration's tags (gloo honours tags)

Exchange = Callable[[Sequence[Message], int], None]


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ping_pong_seconds(me: int, first: int, second: int, tensor: torch.Tensor, repeats: int,
                      exchange: Exchange = batched_exchange) -> float | None:
    """One round trip of `tensor` from `first` to `second` and back, median of `repeats` (timed on
    `first`; None on `second`, which only answers)."""
    peer = second if me == first else first
    reply = torch.empty_like(tensor)
    times = []
    for r in range(repeats + 1):
        _drain(tensor.device)
        start = time.perf_counter()
        if me == first:
            exchange([Message("send", tensor, peer)], _TAG)
            exchange([Message("recv", reply, peer)], _TAG)
        else:
            exchange([Message("recv", reply, peer)], _TAG)
            exchange([Message("send", reply, peer)], _TAG)
        _drain(tensor.device)
        if r:
            times.append(time.perf_counter() - start)
    return statistics.median(times) if me == first else None


def all_reduce_seconds(tensor: torch.Tensor, group: "dist.ProcessGroup", repeats: int) -> float:
    """One all-reduce of `tensor` over `group`, median of `repeats`, as this member saw it."""
    times = []
    for r in range(repeats + 1):
        _drain(tensor.device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        _drain(tensor.device)
        if r:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_links(me: int, rounds: Sequence[Sequence[tuple[int, int]]], reducers: Sequence[int],
               boundary_elements: int, reduce_elements: int, dtype: torch.dtype, device: torch.device,
               repeats: int = 9, exchange: Exchange = batched_exchange,
               barrier: Callable[[], None] | None = None) -> dict:
    """This device's part of the probe; every device of the world calls it with the same arguments.

    The rounds are timed one after another, each starting at a `barrier` of the whole world
    (default: torch.distributed's), so that no pair of one round runs beside another round's; a
    round's disjoint pairs run at once, each with 1/k of the boundary tensor in a round of k. Then
    the all-reduce among `reducers` (if two or more).
    Returns {"pairs": {round: seconds}} for the rounds where this device led a pair (its first
    device) and "all_reduce": this member's seconds (None when it is not a reducer)."""
    from malleus_svc.runtime.groups import member_group

    out: dict = {"pairs": {}, "all_reduce": None}
    for i, pairs in enumerate(rounds):
        (barrier or dist.barrier)()
        mine = [p for p in pairs if me in p]
        if mine:
            boundary = torch.ones(max(1, boundary_elements // len(pairs)), dtype=dtype, device=device)
            t = ping_pong_seconds(me, *mine[0], boundary, repeats, exchange)
            if t is not None:
                out["pairs"][i] = t
    if len(reducers) > 1 and me in reducers:
        grads = torch.ones(reduce_elements, dtype=torch.float32, device=device)
        out["all_reduce"] = all_reduce_seconds(grads, member_group(reducers), repeats)
    return out
