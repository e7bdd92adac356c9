"""The 'full' objective's closed form (planner.timing) against the 1F1B event simulator."""
from dataclasses import replace

import pytest

from benchmarks.ranks import spearman
from malleus_svc.costmodel.profile import CommCosts
from malleus_svc.planner import evaluate, plan
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.timing import PipelineTimes, backward_share, fill_drain, iteration_time, pipeline_time
from malleus_svc.simulate import simulate
from malleus_svc.simulate.scenarios import paper_scenario


def _problem(grad: float = 0.0, layers: int = 8):
    p = build_problem(paper_scenario("70b-64gpu", "severe"))
    return replace(p, num_layers=layers, comm=CommCosts(grad_sync_per_block=grad), optimizer_per_block=0.0)


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


def test_reductions_hide_behind_the_last_backward_and_the_drain():
    # Two identical pipelines of 2 stages (t = 2, m = 4), TP 8. The last backward of a stage passes
    # a block every backward_share() · t / blocks; each block reduces in g / 8 once passed.
    p = _problem(grad=1.0)
    w = pipeline_time(4, (2.0, 2.0))
    beta = backward_share() * 2.0 / 4
    # 4 blocks a stage, reductions (1/8) shorter than a block's backward (1/3): only stage 0's first
    # block's is left after w
    assert iteration_time(p, [PipelineTimes(4, (2.0, 2.0), (4, 4), (8, 8))] * 2) == pytest.approx(w + 1 / 8)
    # Stage 1 holds 7 blocks and finishes backward_share() · t before w; its reductions keep pace with
    # its backward and end one reduction later, hidden behind stage 0's drain (1 block, done at w + 1/8)
    late = [PipelineTimes(4, (2.0, 2.0), (1, 7), (8, 8))] * 2
    assert iteration_time(p, late) == pytest.approx(w + 1 / 8)
    # Reductions slower than the backward (g = 8: one block in 1 > beta): they queue, and the stage's
    # end is its last block passed plus all its reductions, or its first passed plus one
    slow = _problem(grad=8.0)
    first_passed = w - 3 * beta
    assert iteration_time(slow, [PipelineTimes(4, (2.0, 2.0), (4, 4), (8, 8))] * 2) == pytest.approx(
        max(first_passed + 4 * 1.0, w + 1.0))


@pytest.mark.parametrize("optimizer, sharded", [(0.0, False), (0.3, False), (0.3, True)])
def test_the_closed_form_equals_the_simulator_where_its_stages_are_even(optimizer, sharded):
    """Pipelines of equal stages (the closed form's finish times are then exact), different TP
    degrees and depths side by side, reductions faster and slower than the backward, and the
    optimizer step after them at each stage's rate (one pipeline's devices 1.5x slow), over the
    pipelines' shards of the optimizer state or the whole."""
    from malleus_svc.plan import Pipeline, Plan, Stage

    base = build_problem(paper_scenario("70b-64gpu", "severe"))
    plan = Plan(num_devices=base.num_devices, num_layers=8, micro_batch_size=1, pipelines=(
        Pipeline((Stage(tuple(range(0, 8)), (0, 4)), Stage(tuple(range(8, 16)), (4, 8))), micro_batches=6),
        Pipeline((Stage(tuple(range(16, 20)), (0, 2)), Stage(tuple(range(20, 24)), (2, 4)),
                  Stage(tuple(range(24, 28)), (4, 6)), Stage(tuple(range(28, 32)), (6, 8))), micro_batches=3),
    ), excluded=tuple(range(32, base.num_devices)))
    recomputing = replace(plan, pipelines=tuple(replace(pipe, stages=tuple(replace(s, recompute="full")
                                                                           for s in pipe.stages))
                                                for pipe in plan.pipelines))
    rates = (1.0,) * 16 + (1.5,) * 16 + (1.0,) * (base.num_devices - 32)
    for grad in (0.5, 4.0, 40.0):
        p = replace(base, num_layers=8, rates=rates, comm=CommCosts(grad_sync_per_block=grad),
                    optimizer_per_block=optimizer, memory=replace(base.memory, sharded_layer_mb=100.0 * sharded))
        sim = simulate(plan, p)
        ys = [[p.alpha(s.tp) * max(rates[d] for d in s.devices) for s in pipe.stages] for pipe in plan.pipelines]
        pipes = [PipelineTimes(pipe.micro_batches, tuple(y * s.num_layers for y, s in zip(row, pipe.stages)),
                               tuple(s.num_layers for s in pipe.stages), tuple(s.tp for s in pipe.stages),
                               rates=tuple(row))
                 for pipe, row in zip(plan.pipelines, ys)]
        assert iteration_time(p, pipes) == pytest.approx(sim.iteration_t0, rel=1e-9), grad
        assert sim.iteration_t0 > max(pipeline_time(x.micro_batches, x.times) for x in pipes)
        if optimizer:   # the step is on the critical path: sharding it shortens the iteration
            whole = replace(p, memory=replace(p.memory, sharded_layer_mb=0.0))
            assert (iteration_time(p, pipes) < iteration_time(whole, pipes)) == sharded
        # stages that recompute: longer, and their backward the larger share of them
        sim = simulate(recomputing, p)
        assert evaluate(replace(p, objective="full"), recomputing) == pytest.approx(sim.iteration_t0, rel=1e-9), grad


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
