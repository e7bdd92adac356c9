"""The job's record: plan history (every round and every plan change, once), recent events, and
the per-step metrics lines."""
from __future__ import annotations

import logging
import time
from collections import deque

from malleus_svc.plan import Plan

log = logging.getLogger("malleus_svc.control.coordinator")


class History:
    def __init__(self, job_name: str):
        self.job_name = job_name
        self.entries: list[dict] = []
        self.events: deque = deque(maxlen=200)
        self.records: list[dict] = []              # metrics lines, one per step
        self.failures: list[dict] = []             # lost devices and how the job recovered
        self.plan_version = 0                      # plans adopted after the first
        self.t_start: float | None = None          # when the first iteration started (perf_counter)
        self.tokens_total = 0

    def started(self) -> None:
        if self.t_start is None:
            self.t_start = time.perf_counter()

    def add_record(self, line: dict, tokens: int) -> None:
        self.records.append(line)
        self.tokens_total += tokens

    def event(self, step: int, kind: str, text: str) -> None:
        self.events.append({"time": time.time(), "step": step, "kind": kind, "text": text})
        log.info("[%s] %s: %s", self.job_name, kind, text)

    def migrations(self) -> int:
        return sum(1 for h in self.entries if h["outcome"] == "applied")

    def plan_change(self, step: int, round_id: int | None, outcome: str, reason: str, old_plan_id: str | None,
                    new: Plan, basis: dict[int, float], **extra) -> None:
        """A plan that took effect outside a re-plan round (the first, membership changes)."""
        self.entries.append({"round": round_id, "outcome": outcome, "time": time.time(), "step": step,
                             "reason": reason, "requests": [], "old_plan_id": old_plan_id,
                             "new_plan_id": new.plan_id, "new_plan": new.to_dict(),
                             "rates": {str(d): r for d, r in sorted(basis.items())},
                             "excluded": sorted(new.excluded), **extra})

    def round_ended(self, step: int, rnd, outcome: str, migration: dict | None = None,
                    old_plan_id: str | None = None) -> dict:
        """A round's one entry: applied, kept, failed or superseded."""
        new = rnd.new_plan if outcome == "applied" else None
        entry = {
            "round": rnd.id, "outcome": outcome, "time": time.time(), "step": step, "requested_step": rnd.step,
            "reason": rnd.reason(), "requests": [r.to_dict() for r in rnd.requests],
            "decision": rnd.decision, "rates": {str(d): r for d, r in sorted(rnd.rates.items())},
            "excluded": sorted(rnd.excluded), "latency_seconds": time.perf_counter() - rnd.started,
        }
        if new is not None:
            entry.update(old_plan_id=old_plan_id, new_plan_id=new.plan_id, new_plan=new.to_dict(),
                         migration=migration)
        self.entries.append(entry)
        decision = rnd.decision or {}
        self.event(step, outcome, f"round {rnd.id} ({entry['reason']}): "
                   + (f"{old_plan_id} -> {new.plan_id}, moved {migration['moved_bytes'] / 1e6:.1f} MB "
                      f"in {migration['seconds']:.2f} s" if new is not None else
                      str(decision.get("error") or decision.get("option"))))
        return entry
