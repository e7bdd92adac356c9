"""`malleus bench detect` counts from a run's history and metrics lines: only rounds that measured
rates started, adoptions apart from rounds that kept the plan, detection as `malleus demo` counts it."""
from __future__ import annotations

from benchmarks import detect


def _run(history: list[dict], plans: list[str], rates: dict[int, dict] | None = None) -> dict:
    records = [{"step": s, "plan_id": p, "time": 10.0 + s, "iteration_seconds": 1.0, "pace_held": 0.97,
                "rates": (rates or {}).get(s, {})} for s, p in enumerate(plans)]
    return {"history": history, "records": records,
            "status": {"workers": {"devices": 4}, "unmeasured": {"2": 0.4}}}


def _round(step: int, outcome: str, kind: str = "rates") -> dict:
    return {"step": step, "outcome": outcome, "requests": [{"kind": kind, "detail": "x"}]}


def test_a_healthy_run_counts_rounds_from_rates_and_adoptions_per_thousand_steps():
    history = [_round(6, "kept", "links"), _round(20, "kept"), _round(30, "applied"), _round(40, "kept", "user")]
    row = detect.healthy_row("tiny", _run(history, ["a"] * 31 + ["b"] * 469))
    assert (row["rounds_kept"], row["adopted"], row["steps"]) == (1, 1, 500)
    assert row["false_replans_per_1000"] == 2.0 and row["unmeasured_at_end"] == {"2": 0.4}


def test_a_straggler_is_detected_when_a_new_plan_is_in_force_and_missed_otherwise():
    late = ["a"] * 12 + ["b"] * 3
    rates = {10: {"3": 1.2}, 11: {"3": 1.5}, 12: {"3": 1.5}}
    found = detect.straggler_row("demo", 1.5, 0, 3, 9, 0.3, _run([_round(11, "applied")], late, rates))
    assert (found["detected"], found["planned"], found["adopted_before_shift"]) == (2, 3, 0)
    assert found["decided"] == (2, "applied")
    missed = detect.straggler_row("demo", 1.25, 1, 2, 9, 0.3, _run([_round(4, "applied")], ["a"] * 15,
                                                                    {s: {"2": 1.25} for s in range(9, 15)}))
    assert (missed["detected"], missed["planned"], missed["adopted_before_shift"], missed["decided"]) == (None, None, 1, None)


def test_a_straggler_run_ends_once_a_new_plan_is_in_force_or_the_window_has_passed():
    recs = _run([], ["a"] * 12 + ["b"])["records"]
    assert detect.settled(recs, 9, 10) and not detect.settled(recs[:12], 9, 10)
    assert detect.settled(_run([], ["a"] * 20)["records"], 9, 10)
    assert not detect.settled([], 9, 10)


def test_the_coordinators_knobs_reach_the_job_and_the_benchs_own_window_does_not():
    """`--window` is how long the bench waits for a plan; `--rate-window` is the coordinator's."""
    args = detect.build_parser().parse_args(["--window", "7", "--rate-confirm", "1"])
    assert args.window == 7 and detect.control_of(args) == {"confirm": 1}
    assert detect.control_of(detect.build_parser().parse_args([])) == {}


def test_each_job_has_the_devices_the_bench_draws_its_straggler_from():
    for name in detect.JOBS:
        d = detect.job_for(name, 30, [{"device": 0, "factor": 2.0, "at_step": 9}], 1, {"band": 0.2})
        assert d["cluster"]["nodes"] * d["cluster"]["gpus_per_node"] == detect.num_devices(name)
        assert d["control"]["band"] == 0.2 and d["train"]["steps"] == 30 and d["emulate"]["device"] == "auto"
