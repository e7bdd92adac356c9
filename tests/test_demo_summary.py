"""The demo's summary against the metrics lines it is made from: a static and a malleable run of
the demo's schedule, as the coordinator would report them (records, history, status)."""
from __future__ import annotations

import argparse

import pytest

from malleus_svc.control.demo import HEALTHY_STEPS, schedule_for, summarize, true_factors

STEPS = HEALTHY_STEPS + 3 * 5
TOKENS = 512


def _run(seconds_at, plans_at, migrations=(), pace_held=0.99) -> dict:
    records = [{"step": s, "tokens": TOKENS, "iteration_seconds": seconds_at(s), "plan_id": plans_at(s),
                "loss": 5.0 - 0.01 * s, "time": 100.0 + s, "pace_held": pace_held} for s in range(STEPS)]
    history = [{"step": s, "outcome": "applied", "reason": "rates", "old_plan_id": "a", "new_plan_id": "b",
                "migration": {"seconds": secs, "moved_bytes": 1e6}, "decision": {"option": "replan"}}
               for s, secs in migrations]
    return {"records": records, "history": history,
            "status": {"healthy_tokens_per_second": TOKENS / 1.0, "device_pace": {"gflops": 1.0, "gbps": 0.3}}}


def test_the_summary_is_the_metrics_lines_added_up():
    emulate = schedule_for(STEPS, 3.0)
    shifts = sorted({e["at_step"] for e in emulate} | {e["until_step"] for e in emulate if e["until_step"]})

    def slowest(s):
        return max(true_factors(emulate, s))

    static = _run(lambda s: 1.0 * (2.4 if slowest(s) > 1 else 1.0), lambda s: "a", pace_held=0.97)
    # malleable: 3 iterations to react to each shift, then 1.2 s steps under a new plan (migration 0.5 s)
    new_plan = {s + 3 for s in shifts}
    plan = lambda s: str(sum(1 for n in new_plan if n <= s))           # noqa: E731
    reacting = lambda s: any(x <= s < x + 3 for x in shifts[:2])         # noqa: E731
    mal = _run(lambda s: 2.4 if reacting(s) else (1.2 if s >= shifts[0] else 1.0), plan,
               migrations=[(n, 0.5) for n in sorted(new_plan)])
    args = argparse.Namespace(steps=STEPS, nodes=1, global_batch=16)
    s = summarize({"static": static, "malleable": mal}, emulate, args, wall=1.0)

    measured = range(s["measured_from_step"], STEPS)
    mal_secs = sum(mal["records"][k]["iteration_seconds"] for k in measured) + 0.5 * len(new_plan)
    assert s["malleable_tokens_per_second"] == pytest.approx(TOKENS * len(measured) / mal_secs)
    static_secs = sum(static["records"][k]["iteration_seconds"] for k in measured)
    assert s["static_tokens_per_second"] == pytest.approx(TOKENS * len(measured) / static_secs)
    assert s["malleable_over_static"] == pytest.approx(static_secs / mal_secs)
    assert s["pace_held"] == 0.97                                        # the lower of the two runs
    # the bound: every measured step at the healthy throughput x sum(1/x)/N, harmonically
    bound_secs = sum(8 / sum(1 / x for x in true_factors(emulate, k)) for k in measured)
    assert s["capacity_bound_tokens_per_second"] == pytest.approx(TOKENS * len(measured) / bound_secs)
    assert s["static_over_bound"] == pytest.approx(bound_secs / static_secs)
    # steady state: from each new plan (its migration not counted) to the next shift, 1.2 s steps
    assert [lat["iterations"] for lat in s["replan_latency"]] == [3, 3, 3]
    assert s["steady_steps"] == sum(min([x for x in shifts if x > n] or [STEPS]) - n for n in new_plan)
    assert s["malleable_steady_tokens_per_second"] == pytest.approx(TOKENS / 1.2)
    steady = [k for k in range(STEPS) if any(n <= k < min([x for x in shifts if x > n - 3] + [STEPS])
                                             for n in new_plan)]
    steady_bound = TOKENS * len(steady) / sum(8 / sum(1 / x for x in true_factors(emulate, k)) for k in steady)
    assert s["malleable_steady_over_bound"] == pytest.approx((TOKENS / 1.2) / steady_bound)
    assert s["healthy_malleable_over_static"] == pytest.approx(1.0)


def test_a_shift_the_planner_answers_by_keeping_its_plan_counts_as_steady_from_that_round():
    emulate = schedule_for(STEPS, 3.0)
    shifts = sorted({e["at_step"] for e in emulate} | {e["until_step"] for e in emulate if e["until_step"]})
    heal = shifts[-1]
    # new plans 3 iterations after the two slowdowns; the heal's round (at heal + 3) keeps the plan
    new_plan = [s + 3 for s in shifts[:2]]
    mal = _run(lambda s: 1.2, lambda s: str(sum(1 for n in new_plan if n <= s)), migrations=[(n, 0.5) for n in new_plan])
    mal["history"].append({"step": heal + 3, "outcome": "kept", "reason": "rates", "decision": {"option": "keep"}})
    args = argparse.Namespace(steps=STEPS, nodes=1, global_batch=16)
    s = summarize({"malleable": mal}, emulate, args, wall=1.0)
    last = s["replan_latency"][-1]
    assert last["new_plan_step"] is None and last["kept_step"] == heal + 3
    assert s["steady_steps"] == sum(min([x for x in shifts if x > n] or [STEPS]) - n for n in new_plan) + STEPS - heal - 3
    # a kept round outside the shift's phase is not this shift's answer
    mal["history"][-1]["step"] = heal - 1
    assert summarize({"malleable": mal}, emulate, args, wall=1.0)["replan_latency"][-1]["kept_step"] is None
