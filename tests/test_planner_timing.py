"""The 'full' objective's closed form (planner.timing) against the 1F1B event simulator."""
from dataclasses import replace

import pytest

from benchmarks.ranks import spearman
from malleus_svc.costmodel.profile import CommCosts
from malleus_svc.planner import evaluate, plan
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.timing import BACKWARD_SHARE, PipelineTimes, fill_drain, iteration_time, pipeline_time
from malleus_svc.simulate import simulate
from malleus_svc.simulate.scenarios import paper_scenario


def _problem(grad: float = 0.0, layers: int = 8):
    p = build_problem(paper_scenario("70b-64gpu", "severe"))
    return replace(p, num_layers=layers, comm=CommCosts(grad_sync_per_block=grad))


def test_equal_stages_give_the_bubble_formula():
    # (m + S - 1) · z when every stage takes z
    assert pipeline_time(10, (3.0, 3.0, 3.0, 3.0)) == pytest.approx((10 + 4 - 1) * 3.0)


def test_a_short_stage_adds_only_its_own_time_to_fill_and_drain():
    assert fill_drain((1.0, 6.0, 2.0)) == pytest.approx(3.0)
    assert pipeline_time(4, (1.0, 6.0, 2.0)) == pytest.approx(4 * 6.0 + 3.0)


def test_one_pipeline_has_no_gradient_reduction():
    p = _problem(grad=5.0)
    one = [PipelineTimes(4, (2.0, 2.0), (4, 4), (8, 8))]
    assert iteration_time(p, one) == pytest.approx(pipeline_time(4, (2.0, 2.0)))


def test_a_late_stage_reduces_behind_the_drain():
    # Two identical pipelines of 2 stages, 4 blocks each: the first stage finishes last, the second
    # BACKWARD_SHARE · t earlier, so its reduction ends at w - BACKWARD_SHARE·t + 4g.
    p = _problem(grad=1.0)
    pipes = [PipelineTimes(4, (2.0, 2.0), (4, 4), (8, 8))] * 2
    w = pipeline_time(4, (2.0, 2.0))
    sync = 4 * 1.0 / 8
    assert iteration_time(p, pipes) == pytest.approx(w + sync)            # stage 0 is last: no overlap
    late = [PipelineTimes(4, (2.0, 2.0), (1, 7), (8, 8))] * 2               # the longer reduction is stage 1's
    expect = max(w + 1 / 8, w - BACKWARD_SHARE * 2.0 + 7 / 8)
    assert iteration_time(p, late) == pytest.approx(expect)
    assert iteration_time(p, late) < w + 7 / 8


def test_full_ranks_finalists_like_the_simulator():
    """On a straggler scenario, 'full' orders the planner's finalists as the event simulator does
    (the paper's objective, which ignores fill/drain and communication, does not)."""
    p = build_problem(paper_scenario("70b-64gpu", "severe"), objective="full")
    plans = {c.plan_id: c for o in ("paper", "full") for c in plan(replace(p, objective=o)).finalists}
    cands = list(plans.values())
    assert len(cands) >= 8
    sim = [simulate(c, p).iteration_t0 for c in cands]
    full = [evaluate(p, c) for c in cands]
    paper = [evaluate(replace(p, objective="paper"), c) for c in cands]
    assert spearman(full, sim) >= 0.9
    assert spearman(full, sim) > spearman(paper, sim)


@pytest.mark.parametrize("objective", ["bubble", "full"])
def test_fill_drain_lower_bound_holds_and_beats_the_papers(objective):
    """search.lower_bound with fill and drain, at the capacity of a plan's own groups: below the
    plan's objective, above the paper's M·L/C."""
    from malleus_svc.planner.grouping import group_rate
    from malleus_svc.planner.search import lower_bound

    for setup, situation in (("70b-64gpu", "authors"), ("32b-32gpu", "slow-node"), ("110b-64gpu", "mild")):
        p = build_problem(paper_scenario(setup, situation), objective=objective)
        for c in plan(p).finalists:
            capacity = sum(1 / group_rate(p, s.devices) for pipe in c.pipelines for s in pipe.stages)
            bound = lower_bound(p, capacity)
            assert p.num_micro_batches * p.num_layers / capacity < bound <= evaluate(p, c) + 1e-9
