"""What one pipeline stage does in a training step, in order: the 1F1B computations and, between
them, the *posts* that move boundary tensors. Pure: `transport.py` moves the tensors, the engine
computes.

A post is one batch of sends and receives issued together (one `batch_isend_irecv`). Between two
computations a stage makes exactly one post: the sends of the computation just done and the
receives of the one about to run. In steady state that is "send activation of F_i + receive the
gradient for B_j", then "send gradient of B_j + receive the activation for F_i+1", as Megatron's
batched p2p does. Batching matters under NCCL, which matches the calls between two ranks in posting
order on one stream and does not buffer sends: posted one by one, a stage's send waits for its
neighbour's receive while the neighbour's own send waits for ours, and both hang; posted as one
group, each batch's ops progress together and neighbours' batches pair up one for one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from malleus_svc.geometry import one_f_one_b


@dataclass(frozen=True)
class StageStep:
    kind: Literal["F", "B"]
    micro: int
    receive: bool   # F: the activation from the previous stage; B: the gradient from the next one
    send: bool      # F: the output to the next stage; B: the input's gradient to the previous one


def stage_steps(num_stages: int, stage: int, num_micro: int, forward_only: bool = False) -> list[StageStep]:
    """The steps of `stage` of a pipeline of `num_stages` running `num_micro` micro-batches: 1F1B,
    or (`forward_only`, an evaluation) the forwards in order."""
    has_prev, has_next = stage > 0, stage < num_stages - 1
    order = [("F", i) for i in range(num_micro)] if forward_only else one_f_one_b(num_stages, stage, num_micro)
    return [StageStep(kind, i, receive=has_prev if kind == "F" else has_next,
                      send=has_next if kind == "F" else has_prev)
            for kind, i in order]


@dataclass(frozen=True)
class Transfer:
    """One boundary tensor of one micro-batch, seen from this stage.

    activation: sent to the next stage after F, received from the previous one before F;
    gradient: sent to the previous stage after B, received from the next one before B.
    """

    direction: Literal["send", "recv"]
    tensor: Literal["activation", "gradient"]
    micro: int


@dataclass(frozen=True)
class Post:
    """Transfers issued together as one batch; receives first, then sends (the order of a pair's
    ops in one batch only matters per direction, and each batch holds at most one per direction)."""

    transfers: tuple[Transfer, ...]

    @property
    def receives(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.direction == "recv")

    @property
    def sends(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.direction == "send")


@dataclass(frozen=True)
class Compute:
    kind: Literal["F", "B"]
    micro: int


Instruction = Union[Post, Compute]


def _boundary(step: StageStep, direction: str) -> Transfer:
    # F takes in and gives out activations; B takes in and gives out gradients
    tensor = "activation" if step.kind == "F" else "gradient"
    return Transfer(direction, tensor, step.micro)  # type: ignore[arg-type]


def stage_program(num_stages: int, stage: int, num_micro: int, forward_only: bool = False) -> list[Instruction]:
    """The stage's computations (`stage_steps`) with one post between each two (and one before the
    first and after the last), each post holding the previous step's send and the next step's
    receive. Empty posts are left out. Forward only, post k of stage s pairs with post k - 1 of
    stage s + 1 (the same activation), so neighbours' posts match one for one as in 1F1B."""
    steps = stage_steps(num_stages, stage, num_micro, forward_only)
    program: list[Instruction] = []
    previous: StageStep | None = None
    for step in [*steps, None]:
        transfers = []
        if step is not None and step.receive:
            transfers.append(_boundary(step, "recv"))
        if previous is not None and previous.send:
            transfers.append(_boundary(previous, "send"))
        if transfers:
            program.append(Post(tuple(transfers)))
        if step is not None:
            program.append(Compute(step.kind, step.micro))
        previous = step
    return program
