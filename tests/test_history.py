"""The job's record stays bounded whatever the job's length or its clients' call rate, and its
counts and summary stay whole."""
from __future__ import annotations

from types import SimpleNamespace

from malleus_svc.control.history import MAX_ENTRIES, MAX_RECORDS, History, totals_of
from malleus_svc.plan import Pipeline, Plan, Stage


def line(step: int) -> dict:
    return {"step": step, "tokens": 100, "iteration_seconds": 0.5, "loss": 10.0 - step * 1e-4}


def test_metrics_lines_are_bounded_and_the_totals_count_every_step():
    h = History("t")
    for i in range(3 * MAX_RECORDS):
        h.add_record(line(i), 100)
    assert MAX_RECORDS <= len(h.records) <= MAX_RECORDS * 1.1 and h.records[-1]["step"] == 3 * MAX_RECORDS - 1
    assert h.totals == {"steps": 3 * MAX_RECORDS, "tokens": 300 * MAX_RECORDS, "seconds": 1.5 * MAX_RECORDS,
                        "first_loss": 10.0}


def test_a_rewind_takes_the_redone_steps_out_of_the_totals():
    h = History("t")
    for i in range(10):
        h.add_record(line(i), 100)
    h.rewind(6)
    assert [r["step"] for r in h.records] == list(range(6)) and h.totals == totals_of(h.records)
    h.rewind(0)
    assert h.totals == totals_of([])


def test_a_resume_takes_the_checkpoints_totals_only_when_they_count_its_steps():
    kept = [line(i) for i in range(700, 800)]                  # the lines a checkpoint carried
    h = History("t")
    h.resume(kept, {"steps": 800, "tokens": 80_000, "seconds": 400.0, "first_loss": 10.0}, 800)
    assert h.totals["steps"] == 800 and h.totals["tokens"] == 80_000
    for bad in (None, {"steps": 799, "tokens": 1, "seconds": 1.0, "first_loss": 1.0},
                {"steps": 800, "tokens": "many", "seconds": 1.0, "first_loss": 1.0}):
        h.resume(kept, bad, 800)
        assert h.totals == totals_of(kept)


def test_history_entries_are_bounded_and_the_counts_stay_whole():
    h = History("t")
    plan = Plan(2, 2, 1, (Pipeline((Stage((0,), (0, 2)),), 1),), (1,), (), 2)
    rnd = SimpleNamespace(new_plan=plan, id=0, step=0, requests=[], decision={"option": "replan"}, rates={},
                          excluded=(), started=0.0, reason=lambda: "test")
    for i in range(3 * MAX_ENTRIES):
        h.round_ended(i, rnd, "applied" if i % 2 else "kept", {"moved_bytes": 0, "seconds": 0.0}, "old")
    assert MAX_ENTRIES <= len(h.entries) <= MAX_ENTRIES * 1.1 and h.entries[-1]["step"] == 3 * MAX_ENTRIES - 1
    assert h.entries_total == 3 * MAX_ENTRIES and h.migrations_total == 3 * MAX_ENTRIES // 2
