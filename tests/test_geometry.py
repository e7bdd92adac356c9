"""The plan's geometry (malleus_svc/geometry): shard splitting, the tensor table, the 1F1B order,
and the places that must agree with them (the torch model, Plan.diff, the simulator)."""
from __future__ import annotations

import dataclasses

import subprocess
import sys
from fractions import Fraction as F

import pytest
from hypothesis import given, settings, strategies as st

from _plans import BASELINE, PLAN_1
from malleus_svc.config.presets import PRESETS, ModelShape
from malleus_svc.geometry import (EMBEDDING, HEAD, WHOLE, finest_partition, holder_at, model_parts, one_f_one_b,
                                  part_of, part_tensors, rows_of, shard_map, shard_of, shard_rows, split_dim,
                                  tensor_spec, tp_divisibility_error)
from malleus_svc.plan import Pipeline, Plan, Stage, StateSizes

GQA = ModelShape(layers=3, hidden=96, heads=6, ffn=192, vocab=84, seq_len=32, kv_heads=3)
SHAPES = [PRESETS["tiny"], GQA]


def test_geometry_imports_no_torch_planner_or_runtime():
    code = ("import sys, malleus_svc.geometry; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('malleus_svc.planner', "
            "'malleus_svc.runtime', 'malleus_svc.simulate'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------- shard splitting
def test_shard_map_of_mixed_tp_sizes():
    got = shard_map([(4, 5), (0, 1, 2), (7,)])
    assert got == {4: (F(0), F(1, 2)), 5: (F(1, 2), F(1)), 0: (F(0), F(1, 3)), 1: (F(1, 3), F(2, 3)),
                   2: (F(2, 3), F(1)), 7: WHOLE}
    assert shard_map([(4, 5), (7,)], exclude=[5]) == {4: (F(0), F(1, 2)), 7: WHOLE}
    assert shard_map([(4, 5), (0, 1, 2)], sharded=False) == {d: WHOLE for d in (4, 5, 0, 1, 2)}


def test_finest_common_partition_of_tp_2_and_3_and_its_holders():
    groups = [(4, 5), (0, 1, 2)]
    pieces = finest_partition(shard_map(groups).values())
    assert pieces == [(F(0), F(1, 3)), (F(1, 3), F(1, 2)), (F(1, 2), F(2, 3)), (F(2, 3), F(1))]
    assert [tuple(holder_at(g, a) for g in groups) for a, _ in pieces] == [(4, 0), (4, 1), (5, 1), (5, 2)]
    # cut inside one needer's shard only: the pieces a device of a TP 2 group gets from TP 3 holders
    assert finest_partition(shard_map([(0, 1, 2)]).values(), within=(F(1, 2), F(1))) == \
        [(F(1, 2), F(2, 3)), (F(2, 3), F(1))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=4))
def test_every_piece_lies_in_exactly_one_shard_of_every_group(sizes):
    groups, next_dev = [], 0
    for t in sizes:
        groups.append(tuple(range(next_dev, next_dev + t)))
        next_dev += t
    shards = shard_map(groups)
    pieces = finest_partition(shards.values())
    assert pieces[0][0] == 0 and pieces[-1][1] == 1
    assert all(a < b and b == c for (a, b), (c, _) in zip(pieces, pieces[1:]))
    for a, b in pieces:
        for g in groups:
            inside = [d for d in g if shards[d][0] <= a and b <= shards[d][1]]
            assert inside == [holder_at(g, a)]


def test_rows_of_a_fraction_round_down_so_that_uneven_splits_meet_as_their_fractions_do():
    assert shard_of(2, 4) == (F(1, 2), F(3, 4))
    assert shard_rows(12, 1, 3) == (4, 8)
    assert rows_of((F(1, 3), F(1, 2)), 12) == (4, 6)
    assert rows_of((F(1, 3), F(1, 2)), 10) == (3, 5)
    # a size no group divides (an odd vocabulary): sizes one row apart at most, every row once, and
    # the overlap of two groups' shards is the rows of their fractions' overlap
    for size in (85, 50257, 7):
        for t in (2, 3, 4, 8):
            rows = [shard_rows(size, r, t) for r in range(t)]
            assert rows[0][0] == 0 and rows[-1][1] == size and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
            assert max(e - s for s, e in rows) - min(e - s for s, e in rows) <= 1
            for u in (1, 2, 3, 4):
                for r in range(t):
                    for q in range(u):
                        (a, b), (c, d) = shard_of(r, t), shard_of(q, u)
                        lo, hi = max(a, c), min(b, d)
                        (s1, e1), (s2, e2) = shard_rows(size, r, t), shard_rows(size, q, u)
                        overlap = max(s1, s2), min(e1, e2)
                        if lo < hi:
                            assert overlap == rows_of((lo, hi), size)
                        else:
                            assert overlap[1] <= overlap[0]
    with pytest.raises(ValueError, match="TP rank 3 is outside a group of size 3"):
        shard_of(3, 3)


def test_tp_sizes_must_split_heads_kv_heads_and_ffn_not_the_vocabulary():
    assert tp_divisibility_error(GQA, 3) is None
    assert "TP size 2 does not divide kv_heads=3" in tp_divisibility_error(GQA, 2)
    assert "1, 3" in tp_divisibility_error(GQA, 2)
    assert tp_divisibility_error(dataclasses.replace(GQA, vocab=85), 3) is None   # split by rows, unevenly


def test_plan_diff_moves_replicated_block_state_whole_and_only_to_devices_without_a_shard():
    diff = Plan.diff(BASELINE, PLAN_1, StateSizes(block=0.0, block_replicated=1.0))
    assert diff.moves and all(not m.sharded and (m.start, m.end) == WHOLE for m in diff.moves)
    for m in diff.moves:
        assert m.dst not in {d for _, s in BASELINE.holders(m.part) for d in s.devices}
        assert m.src in {d for _, s in BASELINE.holders(m.part) for d in s.devices}
    # each needer of a block gets one copy: kept or moved
    for b in range(BASELINE.num_layers):
        needers = sorted(d for _, s in PLAN_1.holders(b) for d in s.devices)
        got = sorted(m.dst for m in (*diff.moves, *diff.kept) if m.part == b)
        assert got == needers


# ---------------------------------------------------------------------------- the tensor table
@pytest.mark.parametrize("shape", SHAPES, ids=["tiny", "gqa"])
def test_tensor_table_matches_the_torch_model(shape):
    import torch

    from malleus_svc.runtime.batch import MicroBatch
    from malleus_svc.runtime.model import full_model, take_shard

    model = full_model(shape, seed=3)
    params = dict(model.named_parameters())
    table = [t for p in model_parts(shape.layers) for t in part_tensors(shape, p)]
    assert [t.name for t in table] == list(params)
    for t in table:
        assert tuple(params[t.name].shape) == t.shape, t.name
        assert tensor_spec(shape, t.name) == t and split_dim(t.name) == t.split_dim
        assert part_of(t.name) in model_parts(shape.layers)
    # the table's sizes are the cost model's
    assert sum(t.numel for t in part_tensors(shape, 0)) == shape.block_params()
    assert sum(t.numel for t in part_tensors(shape, EMBEDDING)) == shape.embedding_params()
    assert sum(t.numel for t in part_tensors(shape, HEAD)) == shape.head_params()
    # the shapes compute: tokens in, logits out
    n = 7
    mb = MicroBatch(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                    torch.tensor([0, n], dtype=torch.int32), (0,))
    assert model(mb.tokens, mb.positions(), mb.cu_seqlens).shape == (n, shape.vocab)
    # every TP size that splits the model: shards have the table's shard shape and tile the tensor
    for tp in (t for t in (2, 3, 4) if tp_divisibility_error(shape, t) is None):
        for t in table:
            shards = [take_shard(t.name, params[t.name], r, tp) for r in range(tp)]
            assert all(tuple(s.shape) == t.shard_shape(tp) for s in shards), (t.name, tp)
            if t.split_dim is not None:
                assert torch.equal(torch.cat(shards, t.split_dim), params[t.name])


def test_unknown_tensors_and_parts_are_clear_errors():
    with pytest.raises(KeyError, match="'blocks.0.attn.wz' is not a tensor of this model"):
        split_dim("blocks.0.attn.wz")
    with pytest.raises(KeyError, match="'lm.weight' is not a tensor of this model"):
        part_of("lm.weight")
    with pytest.raises(ValueError, match="part 4 is not 'embedding', 'head' or a block in 0..3"):
        part_tensors(PRESETS["tiny"], 4)


# ---------------------------------------------------------------------------- the 1F1B order
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8).flatmap(lambda s: st.tuples(st.just(s), st.integers(0, s - 1), st.integers(1, 12))))
def test_one_f_one_b_invariants(case):
    stages, stage, micro = case
    acts = one_f_one_b(stages, stage, micro)
    assert sorted(acts) == sorted([("B", i) for i in range(micro)] + [("F", i) for i in range(micro)])
    for i in range(micro):
        assert acts.index(("F", i)) < acts.index(("B", i))
    assert [i for k, i in acts if k == "F"] == [i for k, i in acts if k == "B"] == list(range(micro))
    warmup = min(stages - stage - 1, micro)
    assert acts[:warmup] == [("F", i) for i in range(warmup)]
    # after the warm-up, one forward then one backward while forwards remain, then the drain
    steady = acts[warmup:warmup + 2 * (micro - warmup)]
    assert [k for k, _ in steady] == ["F", "B"] * (micro - warmup)
    assert all(k == "B" for k, _ in acts[warmup + 2 * (micro - warmup):])


def test_one_f_one_b_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="stage 3 is outside a pipeline of 3 stages"):
        one_f_one_b(3, 3, 2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        one_f_one_b(3, 0, 0)


@pytest.mark.parametrize("stages,micro", [(1, 1), (1, 4), (2, 1), (2, 5), (3, 2), (4, 4), (4, 7), (6, 3)])
def test_simulator_and_runtime_run_the_same_per_stage_order(stages, micro):
    from malleus_svc.planner.problem import CommCosts, MemoryProfile, PlannerProblem
    from malleus_svc.runtime.schedule import stage_steps
    from malleus_svc.simulate import SimOptions, simulate

    plan = Plan(num_devices=stages, num_layers=stages, micro_batch_size=1,
                pipelines=(Pipeline(tuple(Stage((j,), (j, j + 1)) for j in range(stages)), micro),))
    problem = PlannerProblem(
        num_nodes=1, gpus_per_node=stages, num_layers=stages, dp=1, tp=1, pp=stages, num_micro_batches=micro,
        micro_batch_size=1, rates=(1.0,) * stages, tp_alpha=(1.0,),
        memory=MemoryProfile(layer_mb=(1000,), embedding_mb=100, reserved_mb=100, safety_margin_mb=0,
                             gpu_memory_mb=10 ** 6),
        comm=CommCosts(p2p_intra_node=0.3, p2p_inter_node=0.3))
    sim = simulate(plan, problem, options=SimOptions(record_ops=True))
    for j in range(stages):
        ran = sorted((start, label[0], label[3]) for label, start, _ in sim.ops
                     if label[0] in ("F", "B") and label[2] == j)
        steps = stage_steps(stages, j, micro)
        assert [(k, i) for _, k, i in ran] == [(s.kind, s.micro) for s in steps]
        # the runtime receives and sends exactly at the pipeline's inner boundaries
        assert all(s.receive == (j > 0 if s.kind == "F" else j < stages - 1) for s in steps)
        assert all(s.send == (j < stages - 1 if s.kind == "F" else j > 0) for s in steps)
