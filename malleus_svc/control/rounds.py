"""Re-plan rounds and their requests, coalesced: at most one round in flight (planning, decided
and waiting for the iteration boundary, or migrating) and at most one pending batch of requests;
a request arriving meanwhile joins the pending batch, which becomes one new round with fresh
inputs once the current one is over. Every request ends in exactly one round."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from malleus_svc.plan import Plan

from .state import RequestKind, RoundState


@dataclass
class Request:
    id: int
    kind: RequestKind
    detail: str
    step: int
    time: float
    force: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind.value, "detail": self.detail, "step": self.step,
                "time": self.time, "force": self.force}


@dataclass
class Round:
    id: int
    requests: list[Request]
    started: float
    step: int
    rates: dict[int, float] = field(default_factory=dict)
    excluded: frozenset = frozenset()     # wanted exclusions and gone devices, as the round plans them
    gone: frozenset = frozenset()
    decision: dict | None = None
    new_plan: Plan | None = None

    @property
    def forced(self) -> bool:
        return any(r.force for r in self.requests)

    def reason(self) -> str:
        return "; ".join(f"{r.kind.value}: {r.detail}" for r in self.requests)


class Rounds:
    """The round state machine: IDLE -> PLANNING -> (IDLE | DECIDED -> MIGRATING -> IDLE).
    Not thread-safe by itself: the coordinator calls it under its lock."""

    def __init__(self):
        self.state = RoundState.IDLE
        self.current: Round | None = None
        self.pending: list[Request] = []
        self._request_ids = itertools.count(1)
        self._round_ids = itertools.count(1)

    def add(self, kind: RequestKind, detail: str, step: int, force: bool = False) -> Request:
        req = Request(next(self._request_ids), kind, detail, step, time.time(), force)
        self.pending.append(req)
        return req

    def begin(self, step: int, rates: dict[int, float], excluded: frozenset, gone: frozenset) -> Round:
        """IDLE -> PLANNING with every pending request."""
        assert self.state is RoundState.IDLE and self.pending
        self.current = Round(next(self._round_ids), self.pending, time.perf_counter(), step, rates=rates,
                             excluded=excluded, gone=gone)
        self.pending = []
        self.state = RoundState.PLANNING
        return self.current

    def decided(self, plan: Plan) -> None:
        """PLANNING -> DECIDED: `plan` waits for the training thread."""
        self.current.new_plan = plan
        self.state = RoundState.DECIDED

    def take_decided(self) -> Round | None:
        """DECIDED -> MIGRATING (the training thread, at an iteration boundary)."""
        if self.state is not RoundState.DECIDED:
            return None
        self.state = RoundState.MIGRATING
        return self.current

    def finish(self) -> bool:
        """The round in flight is over; True if pending requests should start the next one."""
        self.current, self.state = None, RoundState.IDLE
        return bool(self.pending)

    def status(self) -> dict | None:
        if self.current is None:
            return None
        return {"round": self.current.id, "phase": self.state.value, "requests": [r.id for r in self.current.requests]}
