"""Memory of a stage measured on the meta device (runtime/memory.py) and `malleus memory`."""
import json

import pytest
import torch

from malleus_svc.cli import main
from malleus_svc.config import preset
from malleus_svc.config.presets import ModelShape
from malleus_svc.runtime.memory import (META, build_stage, saved_for_backward, stage_footprint,
                                        stage_inputs)

GQA = ModelShape(layers=6, hidden=96, heads=8, ffn=160, vocab=120, seq_len=16, kv_heads=2)


def _closed_form_params(s: ModelShape, layers: int, first: bool, last: bool, tp: int) -> int:
    kv = s.n_kv_heads * s.head_dim
    block = (2 * s.hidden * s.hidden + 2 * s.hidden * kv + 3 * s.hidden * s.ffn) // tp + 2 * s.hidden
    return layers * block + first * s.vocab * s.hidden + last * (s.vocab * s.hidden + s.hidden)


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
        x, positions, cu_seqlens, targets = stage_inputs(shape, 2, 24, first, device)
        seen.append(saved_for_backward(model, x, positions, cu_seqlens, targets if last else None))
    assert seen[0] == seen[1]
    assert seen[0].activations > 0 and seen[0].bf16_weights > 0 and (seen[0].logits > 0) == last


@pytest.mark.parametrize("first,last", [(True, False), (False, True)])
def test_autocast_stand_in_saves_what_torch_autocast_saves(first, last):
    """The stand-in (which also runs on meta) against torch.autocast on real CPU tensors: the same
    saved bytes, a bf16 copy of every matmul weight included, per micro-batch."""
    shape = ModelShape(layers=2, hidden=48, heads=4, ffn=80, vocab=72, seq_len=20, kv_heads=2)
    model = build_stage(shape, 2, has_embedding=first, has_head=last, tp=1, device=torch.device("cpu"))
    model.init_from_seed(0)
    x, positions, cu_seqlens, targets = stage_inputs(shape, 2, 20, first, torch.device("cpu"))
    targets = targets if last else None
    ours = saved_for_backward(model, x, positions, cu_seqlens, targets)
    real = saved_for_backward(model, x, positions, cu_seqlens, targets,
                              precision=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    matmul_weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n)
    assert ours.bf16_weights == 2 * matmul_weights
    assert sum(vars(ours).values()) == sum(vars(real).values())


def test_depth_multiplies_what_each_micro_batch_keeps():
    fp = stage_footprint(GQA, 2, has_embedding=False, has_head=False, tp=2, micro_batch=2)
    one, three = fp.at_depth(1), fp.at_depth(3)
    assert three.activations == 3 * one.activations and three.bf16 == 3 * one.bf16
    assert (one.params, one.adam) == (three.params, three.adam)
    tokens_hidden_fp32 = 2 * GQA.seq_len * GQA.hidden * 4
    assert one.boundary == 2 * 2 * tokens_hidden_fp32 and three.boundary == 4 * 2 * tokens_hidden_fp32


def test_cli_on_llama70b_reports_every_stage(capsys):
    rc = main(["memory", "llama70b-64gpu", "--json"])
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("\n["):])
    assert len(rows) == 14 and {r["layers"] for r in rows} and sum(r["layers"] for r in rows) == 160
    for r in rows:
        terms = sum(r[f"{k}_mb"] for k in ("params", "grads", "adam", "bf16", "activations", "boundary", "logits"))
        assert r["total_mb"] == pytest.approx(terms + r["reserved_mb"], abs=1)
        assert r["fits"] == (r["total_mb"] <= r["capacity_mb"])
    # What the runtime holds today: autocast's per-micro-batch bf16 weights and fp32 residual stream
    # do not fit the 70B plan, and the authors' measured profile promises far less (see BENCHMARKS.md).
    assert rc == (0 if all(r["fits"] for r in rows) else 1)
    assert sum(not r["fits"] for r in rows) == 11
    assert max(abs(r["planner_gap"]) for r in rows) == pytest.approx(0.60, abs=0.02)
    assert "11 of 14 stages OVER" in out


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
    from malleus_svc.cli import BUNDLED
    from malleus_svc.service.memory import measured_profile, plan_memory

    d = read_mapping(BUNDLED / "llama70b-64gpu.yaml")
    d["profile"]["layer_memory_mb"], d["profile"]["embedding_memory_mb"] = measured_profile(Scenario.from_dict(d))
    sc = Scenario.from_dict(d)
    rows = plan_memory(sc, plan(build_problem(sc)).plan)
    assert all(r.fits for r in rows)
    full = [r for r in rows if r.tp == sc.tp and 0 < r.stage]
    assert full and all(abs(r.gap(r.planner_mb)) < 0.03 for r in full)
    assert all(r.gap(r.planner_mb) > -0.03 for r in rows)   # smaller groups: the planner over-counts, safely
