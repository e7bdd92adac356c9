"""`malleus bench lengths-runtime` in a tiny mode (one round, two timed step pairs per block): its
outputs are consistent with each other and with what the workers trained."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROUNDS, STEPS, WARMUP, BATCH = 1, 2, 1, 16


def test_tiny_bench_is_consistent(ray_cluster, tmp_path):
    from benchmarks import lengths_runtime as b

    result = b.run(ROUNDS, STEPS, WARMUP, global_batch=BATCH, sweep_repeats=3, time_limit_s=0.1, log=lambda m: None)
    variants = {v.key: v for v in result["variants"]}
    cases = [(d, s) for d in b.DATASETS for s in (False, True)]
    assert sorted(variants) == sorted((d, s, a) for d, s in cases for a in b.ASSIGNMENTS)
    # The slow device runs pipeline 0 in the planner's plan, which gives that pipeline less data.
    slow = result["plans"][True]
    assert any(b.STRAGGLER in p.devices for p in slow.pipelines[:1])
    assert slow.pipelines[0].micro_batches < slow.pipelines[1].micro_batches
    for v in variants.values():
        # exactly-once (checked per step against the workers' report during the run): every
        # sample of every batch, none twice, warm-up steps included
        assert len(v.steps) == ROUNDS * STEPS
        assert len(v.consumed) == ROUNDS * (STEPS + WARMUP) * BATCH
        assert all(len(s.ids) == BATCH and len(s.busy) == 2 and s.iteration_s > 0 for s in v.steps)
        if v.assignment == b.FIXED:
            assert all(s.planning_s == 0 and s.waited_s == 0 for s in v.steps)
        else:
            assert all(s.planning_s > 0 for s in v.steps)
        if v.assignment == b.AHEAD:
            assert all(s.waited_s == 0 for s in v.steps)

    rows = b.summarise(result)
    assert len(rows) == len(variants)
    for r in rows:
        fixed = variants[(r["dataset"], r["straggler"], b.FIXED)]
        mine = variants[(r["dataset"], r["straggler"], r["assignment"])]
        # the same batches in the same rounds: step k of every assignment trained the same samples
        assert [(s.round, s.k, s.ids) for s in mine.steps] == [(s.round, s.k, s.ids) for s in fixed.steps]
        if r["assignment"] == b.FIXED:
            assert "wall_ratio" not in r
            continue
        wall = sum(s.iteration_s for s in mine.steps) / sum(s.iteration_s for s in fixed.steps)
        busy = sum(max(s.busy) for s in mine.steps) / sum(max(s.busy) for s in fixed.steps)
        assert r["wall_ratio"][0] == pytest.approx(wall) and r["busy_ratio"][0] == pytest.approx(busy)
        assert r["wall_ratio"][1] <= r["wall_ratio"][0] <= r["wall_ratio"][2]   # one round: all equal
        assert 0 <= r["gap_mean"] < 1

    md = b.table(rows)
    for r in rows:
        assert f"| {r['dataset']} | {'device 1 slowed' if r['straggler'] else 'none'} | {r['assignment']} |" in md
    png = b.plot(rows, tmp_path / "plot.png")
    assert png.stat().st_size > 10_000
    text = b.render(result, rows, "malleus bench lengths-runtime --rounds 1", "2026-11-22", 1.0, str(png))
    assert md in text and "2026-11-22" in text
