"""Memory of a stage measured on the meta device (runtime/memory.py) and `malleus memory`."""
import dataclasses
import json
import re

import pytest
import torch

from malleus_svc.cli import main
from malleus_svc.config import preset
from malleus_svc.config.device import DeviceSpec
from malleus_svc.config.presets import ModelShape
from malleus_svc.costmodel import analytic
from malleus_svc.runtime.memory import (META, build_stage, saved_for_backward, stage_footprint,
                                        stage_inputs)

GQA = ModelShape(layers=6, hidden=96, heads=8, ffn=160, vocab=120, seq_len=16, kv_heads=2)


def _closed_form_params(s: ModelShape, layers: int, first: bool, last: bool, tp: int) -> int:
    kv = s.n_kv_heads * s.head_dim
    block = (2 * s.hidden * s.hidden + 2 * s.hidden * kv + 3 * s.hidden * s.ffn) // tp + 2 * s.hidden
    return layers * block + first * s.vocab * s.hidden // tp + last * (s.vocab * s.hidden // tp + s.hidden)


@pytest.mark.parametrize("shape,layers,first,last,tp", [
    (GQA, 3, True, False, 2), (GQA, 2, False, True, 1), (GQA, 6, True, True, 2),
    (preset("tiny"), 2, False, False, 4), (preset("llama-70b"), 2, True, False, 8),
])
def test_state_bytes_equal_the_closed_form(shape, layers, first, last, tp):
    fp = stage_footprint(shape, layers, has_embedding=first, has_head=last, tp=tp, micro_batch=1, seq_len=8)
    n = _closed_form_params(shape, layers, first, last, tp)
    assert (fp.params, fp.grads, fp.adam) == (4 * n, 4 * n, 8 * n)


@pytest.mark.parametrize("first,last,tp", [(True, False, 1), (False, False, 2), (False, True, 1), (True, True, 4)])
def test_meta_measurement_equals_real_tensors(first, last, tp):
    shape = preset("tiny")
    seen = []
    for device in (META, torch.device("cpu")):
        model = build_stage(shape, 2, has_embedding=first, has_head=last, tp=tp, device=device)
        if device.type == "cpu":
            model.init_from_seed(0)
        x, positions, cu_seqlens, targets = stage_inputs(shape, 2, 24, first, device, tp=tp)
        saved, working = saved_for_backward(model, x, positions, cu_seqlens, targets if last else None)
        seen.append((saved, working.nbytes))
    assert seen[0] == seen[1]
    assert seen[0][0] > 0
    assert seen[0][1] == 2 * sum(p.numel() for p in model.parameters())    # one bf16 copy of every weight


@pytest.mark.parametrize("selective", [False, True])
@pytest.mark.parametrize("shape,tp", [(GQA, 1), (GQA, 2), (preset("tiny"), 4), (preset("llama-70b"), 8)])
def test_a_blocks_activations_are_what_the_analytic_model_counts(shape, tp, selective):
    """The cost model's per-block activation bytes (replicated + split) are exactly what the runtime's
    forward saves for backward, measured as the difference of a 2- and a 1-block middle stage, with
    selective recomputation too."""
    seq_len = 8 if shape.seq_len > 64 else shape.seq_len
    mode = "selective" if selective else "none"
    one, two = (stage_footprint(shape, n, has_embedding=False, has_head=False, tp=tp, micro_batch=2, seq_len=seq_len,
                                recompute=mode) for n in (1, 2))
    kept, split = analytic.block_activation_bytes(shape, tp, DeviceSpec(), selective)
    assert two.saved - one.saved == pytest.approx(2 * seq_len * (kept + split), rel=1e-9)
    if selective:   # neither norm's output, nor silu(gate) and the product: its rows, its ffn columns
        a = DeviceSpec().act_bytes
        assert sum(analytic.block_activation_bytes(shape, tp, DeviceSpec())) - (kept + split) == \
            2 * a * (shape.hidden + shape.ffn) / tp


def test_depth_multiplies_what_each_micro_batch_keeps():
    fp = stage_footprint(GQA, 2, has_embedding=False, has_head=False, tp=2, micro_batch=2)
    one, three = fp.at_depth(1), fp.at_depth(3)
    assert three.activations == 3 * one.activations
    assert (one.params, one.adam, one.working) == (three.params, three.adam, three.working)   # one working copy
    assert one.working * 2 == one.params
    rows_hidden_bf16 = 2 * GQA.seq_len * GQA.hidden * 2 // 2      # TP 2: each rank's half of the rows
    assert one.boundary == 2 * 2 * rows_hidden_bf16 and three.boundary == 4 * 2 * rows_hidden_bf16


def test_cli_on_llama70b_reports_every_stage(capsys):
    from malleus_svc.config.job import load_scenario_of
    from malleus_svc.config.scenario import find_scenario
    from malleus_svc.planner import plan
    from malleus_svc.planner.build import build_problem
    rc = main(["memory", "llama70b-64gpu", "--json"])
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("\n["):])
    planned = plan(build_problem(load_scenario_of(find_scenario("llama70b-64gpu")))).plan
    assert [(r["pipeline"], r["stage"], r["layers"]) for r in rows] == [
        (i, j, s.num_layers) for i, pipe in enumerate(planned.pipelines) for j, s in enumerate(pipe.stages)]
    assert len(rows) >= 8 and sum(r["layers"] for r in rows) == 160       # two pipelines of 80 blocks
    for r in rows:
        terms = sum(r[f"{k}_mb"] for k in ("params", "grads", "adam", "working", "activations", "boundary", "logits"))
        assert r["total_mb"] == pytest.approx(terms + r["reserved_mb"], abs=1)
        assert r["fits"] == (r["total_mb"] <= r["capacity_mb"])
    # bf16 working weights and activations fit the 70B plan, and the planner's memory model (this
    # runtime's, with what a TP group does not split left unscaled) agrees on every stage, at every TP size
    assert rc == 0 and all(r["fits"] for r in rows) and "every device fits" in out
    assert {r["tp"] for r in rows} >= {1, 2, 4, 8}
    # short by the boundary tensors it leaves out
    assert all(abs(r["planner_gap"]) < 0.03 for r in rows)
    # the embedding and the head split by vocabulary rows: a TP-t end holds about 1/t of a TP-1 end's
    ends = {int(t): (float(e), float(h)) for t, e, h in re.findall(r"TP (\d+) ([\d.]+) / ([\d.]+)", out)}
    assert 1 in ends and 8 in ends and all(t * ends[t][k] < 1.5 * ends[1][k] for t in ends for k in (0, 1)), ends


def test_cli_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["memory", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("malleus: error: scenario") and "\n" not in err
    assert main(["memory", "llama70b-64gpu", "--plan", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_measured_profile_makes_the_planner_fit_and_agree_on_full_groups():
    from malleus_svc.config import Scenario
    from malleus_svc.config.scenario import read_mapping
    from malleus_svc.planner import plan
    from malleus_svc.planner.build import build_problem
    from malleus_svc.config.scenario import BUNDLED
    from malleus_svc.service.memory import measured_profile, plan_memory

    d = read_mapping(BUNDLED / "llama70b-64gpu.yaml")
    d["profile"]["layer_memory_mb"], d["profile"]["embedding_memory_mb"] = measured_profile(Scenario.from_dict(d))
    sc = Scenario.from_dict(d)
    rows = plan_memory(sc, plan(build_problem(sc)).plan)
    assert all(r.fits for r in rows)
    full = [r for r in rows if r.tp == sc.tp and 0 < r.stage]
    assert full and all(abs(r.gap(r.planner_mb)) < 0.03 for r in full)
    assert all(r.gap(r.planner_mb) > -0.03 for r in rows)   # smaller groups: the planner over-counts, safely


def test_a_smaller_group_multiplies_only_what_it_splits():
    from malleus_svc.costmodel.profile import MemoryProfile

    paper = MemoryProfile((100.0, 80.0), 50.0, 0.0, 0.0, 1000.0)
    ours = MemoryProfile((100.0, 80.0), 50.0, 0.0, 0.0, 1000.0, replicated_layer_mb=(30.0, 20.0),
                         replicated_embedding_mb=40.0)
    assert (paper.block_mb(2.0, 1), paper.ends_mb(2.0, True, False)) == (160.0, 100.0)    # h · (K, E)
    assert (ours.block_mb(2.0, 1), ours.ends_mb(2.0, True, False)) == (140.0, 60.0)       # h · (K - R) + R
    assert paper.ends_mb(2.0, True, True) == paper.ends_mb(2.0, False, True) == 100.0    # the paper's one E
    assert paper.ends_mb(2.0, False, False) == 0.0
    # this runtime's model tells the embedding's end from the head's: a one-stage pipeline holds both
    ends = MemoryProfile((100.0, 80.0), 50.0, 0.0, 0.0, 1000.0, replicated_embedding_mb=40.0, head_mb=70.0,
                         replicated_head_mb=10.0)
    assert (ends.ends_mb(2.0, True, False), ends.ends_mb(2.0, False, True)) == (60.0, 130.0)
    assert ends.ends_mb(2.0, True, True) == 190.0
    assert ours.block_mb(1.0, 2) == 100.0 and ours.block_mb(2.0, 3) == 2 * (120.0 - 40.0) + 40.0   # depth 3 extrapolated


def test_a_sharded_optimizer_keeps_one_pipelines_share_of_the_moments():
    from malleus_svc.costmodel.profile import MemoryProfile

    base = MemoryProfile((100.0, 80.0), 50.0, 0.0, 0.0, 1000.0, replicated_layer_mb=(30.0, 20.0),
                         replicated_embedding_mb=40.0)
    sharded = MemoryProfile(base.layer_mb, 50.0, 0.0, 0.0, 1000.0, replicated_layer_mb=(30.0, 20.0),
                            replicated_embedding_mb=40.0, sharded_layer_mb=24.0, sharded_embedding_mb=8.0)
    assert sharded.over(1) == sharded and base.over(4) is base     # one pipeline, or nothing sharded: as before
    assert (sharded.block_mb(2.0, 1), sharded.ends_mb(2.0, True, False)) == (base.block_mb(2.0, 1),
                                                                              base.ends_mb(2.0, True, False))
    four = sharded.over(4)        # 3/4 of the sharded parts gone, the layer's split by the group like the rest
    assert four.block_mb(2.0, 1) == base.block_mb(2.0, 1) - 2.0 * 24.0 * 0.75
    assert four.ends_mb(2.0, True, False) == base.ends_mb(2.0, True, False) - 2.0 * 8.0 * 0.75   # split by vocab rows


def test_cli_shows_the_sharded_moments_and_the_model_still_agrees(capsys):
    """`--shard-optimizer` on the 70B plan of two pipelines: each device keeps half of the fp32
    masters and Adam moments it would hold unsharded, and the planner's model of that stays within
    3% of the stage."""
    rc = main(["memory", "llama70b-64gpu", "--json", "--plan", _plan_file(), "--shard-optimizer"])
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("\n["):])
    assert rc == 0 and "optimizer sharded among the plan's 2 pipelines: fp32 masters and Adam moments" in out
    main(["memory", "llama70b-64gpu", "--json", "--plan", _plan_file()])
    plain = capsys.readouterr().out
    unsharded = json.loads(plain[plain.index("\n["):])
    for r, u in zip(rows, unsharded):
        assert r["adam_mb"] == pytest.approx(u["adam_mb"] / 2, abs=0.1)
        assert r["params_mb"] == pytest.approx(u["params_mb"] / 2, abs=0.1) and r["grads_mb"] == u["grads_mb"]
        assert r["total_mb"] == pytest.approx(u["total_mb"] - (u["adam_mb"] + u["params_mb"]) / 2, abs=0.2)
        assert abs(r["planner_gap"]) < 0.03


def _plan_file(cache={}):
    if "path" not in cache:
        import tempfile

        from malleus_svc.config.job import load_scenario_of
        from malleus_svc.config.scenario import find_scenario
        from malleus_svc.planner import plan
        from malleus_svc.planner.build import build_problem

        path = tempfile.mkdtemp() + "/plan.json"
        plan(build_problem(load_scenario_of(find_scenario("llama70b-64gpu")))).plan.save(path)
        cache["path"] = path
    return cache["path"]


def test_the_planner_uses_memory_only_a_sharded_optimizer_frees():
    """70B on 64 GiB devices: memory binds, and the planner, told the optimizer's state is sharded,
    finds a better plan than it can without (0.7% better since boundaries between TP groups are
    priced as sequence parallelism moves them: BENCHMARKS.md), one that would not fit unsharded."""
    from pathlib import Path

    from malleus_svc.config.job import load_scenario_of
    from malleus_svc.planner import plan
    from malleus_svc.planner.build import build_problem
    from malleus_svc.planner.search import memory_violations

    sc = load_scenario_of(Path(__file__).parents[1] / "examples" / "llama70b_64gb.yaml")
    plain = build_problem(sc)
    sharded = build_problem(dataclasses.replace(sc, shard_optimizer=True))
    best, best_sharded = plan(plain), plan(sharded)
    assert best_sharded.objective < best.objective * 0.995
    assert not memory_violations(sharded, best_sharded.plan) and not memory_violations(plain, best.plan)
    assert memory_violations(plain, best_sharded.plan)


@pytest.mark.parametrize("first,last,tp", [(True, False, 1), (False, False, 2), (False, True, 1)])
def test_a_recomputing_stage_keeps_its_blocks_inputs_and_one_blocks_activations(first, last, tp):
    """Measured as the engine runs it (the checkpoint's saved inputs are what the hooks see): per
    micro-batch in flight each block's input, its rows at TP 2 (less the received one, counted as boundary), in place
    of its activations, and one block's activations while it is recomputed, on meta as on real tensors."""
    shape, layers, mb = preset("tiny"), 3, 2

    def measure(n: int, recompute: bool):
        return stage_footprint(shape, n, has_embedding=first, has_head=last, tp=tp, micro_batch=mb,
                               recompute="full" if recompute else "none")

    plain, rc, rc_more = measure(layers, False), measure(layers, True), measure(layers + 1, True)
    one_block = stage_footprint(shape, 1, has_embedding=False, has_head=False, tp=tp, micro_batch=mb).saved
    assert rc_more.saved - rc.saved == rc.boundary_tensor    # a block more: its input (this rank's rows) more
    assert measure(layers + 1, False).saved - plain.saved > 4 * rc.boundary_tensor
    assert rc.recomputed == one_block
    assert rc.at_depth(4).activations == 4 * rc.saved + one_block < plain.at_depth(4).activations / 2
    seen = []
    for device in (META, torch.device("cpu")):
        model = build_stage(shape, layers, has_embedding=first, has_head=last, tp=tp, device=device, recompute="full")
        if device.type == "cpu":
            model.init_from_seed(0)
        x, positions, cu_seqlens, targets = stage_inputs(shape, mb, shape.seq_len, first, device, tp=tp)
        seen.append(saved_for_backward(model, x, positions, cu_seqlens, targets if last else None)[0])
    assert seen[0] == seen[1] == rc.saved


def test_cli_prices_recomputing_stages_and_the_models_agree(capsys):
    """A plan whose first pipeline recomputes its blocks and whose second recomputes selectively:
    the first's stages keep a fraction of the activations, the second's a little over half, the
    others are as they were, and the planner's and analytic models follow within 3%."""
    plan = json.loads(open(_plan_file()).read())
    for i, mode in enumerate(("full", "selective")):
        for st in plan["pipelines"][i]["stages"]:
            st["recompute"] = mode
    del plan["plan_id"]
    import tempfile
    path = tempfile.mkdtemp() + "/rc.json"
    with open(path, "w") as f:
        json.dump(plan, f)
    main(["memory", "llama70b-64gpu", "--json", "--plan", _plan_file()])
    out = capsys.readouterr().out
    base = json.loads(out[out.index("\n["):])
    assert main(["memory", "llama70b-64gpu", "--json", "--plan", path]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("\n["):])
    assert "layers marked r: the stage recomputes its blocks" in out and "layers marked s:" in out
    for r, b in zip(rows, base):
        assert r["recompute"] == {0: "full", 1: "selective"}.get(r["pipeline"], "none")
        if r["recompute"] == "full":
            assert r["activations_mb"] < b["activations_mb"] / 4 and r["params_mb"] == b["params_mb"]
        elif r["recompute"] == "selective":
            assert 0.5 < r["activations_mb"] / b["activations_mb"] < 0.6 and r["params_mb"] == b["params_mb"]
        else:
            assert r["total_mb"] == b["total_mb"]
        assert abs(r["planner_gap"]) < 0.03 and abs(r["analytic_gap"]) < 0.03
