"""The job's record: plan history (every round and every plan change, once), recent events, and
the per-step metrics lines.

Held in bounded memory whatever the job's length or its clients' call rate: the newest
MAX_ENTRIES history entries and MAX_RECORDS metrics lines (drivers read lines as they come;
checkpoints keep the last ones), with running totals so that counts and the run's summary stay
whole."""
from __future__ import annotations

import logging
import time
from collections import deque

from malleus_svc.plan import Plan

log = logging.getLogger("malleus_svc.control.coordinator")

MAX_ENTRIES = 1_000        # plan-history entries held
MAX_RECORDS = 10_000       # metrics lines held


def _trim(items: list, keep: int) -> None:
    """Drop the oldest items beyond `keep`, a tenth at a time (amortised O(1) per append)."""
    if len(items) > keep + keep // 10:
        del items[:len(items) - keep]


def totals_of(records: list[dict]) -> dict:
    """The running totals of these metrics lines (steps, tokens, seconds, the first loss)."""
    return {"steps": len(records), "tokens": sum(r["tokens"] for r in records),
            "seconds": sum(r["iteration_seconds"] for r in records),
            "first_loss": records[0]["loss"] if records else None}


class History:
    def __init__(self, job_name: str):
        self.job_name = job_name
        self.entries: list[dict] = []              # the newest MAX_ENTRIES
        self.entries_total = 0
        self.migrations_total = 0
        self.events: deque = deque(maxlen=200)
        self.records: list[dict] = []              # metrics lines, one per step: the newest MAX_RECORDS
        self.totals = totals_of([])                # over every step recorded, trimmed or not
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
        t = self.totals
        t["steps"] += 1
        t["tokens"] += line["tokens"]
        t["seconds"] += line["iteration_seconds"]
        if t["first_loss"] is None:
            t["first_loss"] = line["loss"]
        _trim(self.records, MAX_RECORDS)

    def rewind(self, step: int) -> None:
        """Forget the lines of steps >= `step` (they are trained again after a restore)."""
        undone = [r for r in self.records if r["step"] >= step]
        self.records = [r for r in self.records if r["step"] < step]
        t = self.totals
        t["steps"] -= len(undone)
        t["tokens"] -= sum(r["tokens"] for r in undone)
        t["seconds"] -= sum(r["iteration_seconds"] for r in undone)
        if t["steps"] == 0:
            t["first_loss"] = None

    def resume(self, records: list[dict], totals: dict | None, start_step: int) -> None:
        """A restarted job's lines (those a checkpoint carried) and totals. Totals that do not
        count `start_step` steps are not the checkpoint's own: recounted from the lines."""
        self.records = [r for r in records if r["step"] < start_step]
        keys = ("steps", "tokens", "seconds", "first_loss")
        ok = isinstance(totals, dict) and totals.get("steps") == start_step and all(
            isinstance(totals.get(k), (int, float)) and not isinstance(totals.get(k), bool) for k in keys)
        self.totals = {k: totals[k] for k in keys} if ok else totals_of(self.records)

    def _add_entry(self, entry: dict) -> None:
        self.entries.append(entry)
        self.entries_total += 1
        self.migrations_total += entry["outcome"] == "applied"
        _trim(self.entries, MAX_ENTRIES)

    def event(self, step: int, kind: str, text: str) -> None:
        self.events.append({"time": time.time(), "step": step, "kind": kind, "text": text})
        log.info("[%s] %s: %s", self.job_name, kind, text)

    def plan_change(self, step: int, round_id: int | None, outcome: str, reason: str, old_plan_id: str | None,
                    new: Plan, basis: dict[int, float], **extra) -> None:
        """A plan that took effect outside a re-plan round (the first, membership changes)."""
        self._add_entry({"round": round_id, "outcome": outcome, "time": time.time(), "step": step,
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
        self._add_entry(entry)
        decision = rnd.decision or {}
        self.event(step, outcome, f"round {rnd.id} ({entry['reason']}): "
                   + (f"{old_plan_id} -> {new.plan_id}, moved {migration['moved_bytes'] / 1e6:.1f} MB "
                      f"in {migration['seconds']:.2f} s" if new is not None else
                      str(decision.get("error") or decision.get("option"))))
        return entry
