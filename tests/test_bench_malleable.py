"""`malleus bench malleable` without Ray: the DDP baseline's step on the device clock over a gloo world
of 2 (a worker at rate 3 takes 3× the device time, its healthy peer waits for it outside its ops,
the losses are those of an unpaced run bit for bit), its whole loop on the demo's data, and the
table, section and plot from a synthetic run."""
from __future__ import annotations

import math
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from _host import require_pace
from _mp import run_on_gloo
from benchmarks import malleable as bench
from benchmarks.planner import write_section
from malleus_svc.config.presets import ModelShape
from malleus_svc.runtime.batch import MicroBatch
from malleus_svc.runtime.device_clock import Pace, PacedClock
from malleus_svc.runtime.engine import OptimConfig, update_bytes
from malleus_svc.runtime.model import full_model

SHAPE = ModelShape(layers=2, hidden=64, heads=2, ffn=128, vocab=64, seq_len=32)
# device seconds per op: several times what the host spends on them after a paced wait (up to 11 ms
# for the update on a cold core, 2 ms warm), so the host keeps pace
STEPS, MICRO, FORWARD_SECONDS, UPDATE_SECONDS = 3, 2, 0.04, 0.04


def _micro_batches(seed: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(MICRO):
        tokens = torch.randint(SHAPE.vocab, (32,), generator=g)
        out.append(MicroBatch(tokens=tokens, targets=torch.randint(SHAPE.vocab, (32,), generator=g),
                              cu_seqlens=torch.tensor([0, 12, 32], dtype=torch.int32), sample_ids=(i,)))
    return out


def _train(clock: PacedClock) -> dict:
    """STEPS DDP steps of the tiny model on the same micro-batches on every rank."""
    model = DistributedDataParallel(full_model(SHAPE, seed=0))
    optimizer = OptimConfig(lr=1e-2, grad_clip=1.0).make(dict(model.module.named_parameters()))
    mbs, losses, spans, device = _micro_batches(0), [], [], []
    loss_tokens = dist.get_world_size() * sum(mb.num_loss_tokens for mb in mbs)
    for _ in range(STEPS):
        dist.barrier()
        t0 = time.perf_counter()      # the system's monotonic clock: comparable across the two processes
        losses.append(bench.ddp_step(model, optimizer, clock, mbs, loss_tokens, 1.0))
        spans.append((t0, time.perf_counter()))
        device.append(clock.read())
    return {"losses": losses, "spans": spans, "device": device, "host_flops": clock.host.flops,
            "ops": clock.pace_count.ops, "on_pace": clock.pace_count.on_pace,
            "params": {k: v.detach().clone() for k, v in model.module.named_parameters()},
            "forward_flops": [model.module.forward_flops(mb.cu_seqlens) for mb in mbs]}


def _paced_pair(rank: int, world: int) -> dict:
    model = full_model(SHAPE, seed=0)
    flops = model.forward_flops(_micro_batches(0)[0].cu_seqlens)
    pace = Pace(flops / FORWARD_SECONDS, update_bytes(model.parameters()) / UPDATE_SECONDS)
    unpaced = _train(PacedClock())
    paced = _train(PacedClock(pace, rate=3.0 if rank == 1 else 1.0))
    return {"unpaced": unpaced, "paced": paced, "nominal": STEPS * (3 * MICRO * FORWARD_SECONDS + UPDATE_SECONDS)}


@pytest.fixture(scope="module")
def pair():
    return run_on_gloo(_paced_pair, 2)


def _require_every_op_on_pace(pair) -> None:
    """Device time is exact only where the host kept pace; else the timings are the host's."""
    require_pace(sum(r["paced"]["on_pace"] for r in pair), sum(r["paced"]["ops"] for r in pair), floor=1.0)


def test_rate_3_takes_three_times_the_device_time(pair):
    healthy, slow = pair
    _require_every_op_on_pace(pair)
    seconds = [sum(sum(d.values()) for d in r["paced"]["device"]) for r in pair]
    assert seconds[0] == pytest.approx(healthy["nominal"])
    assert seconds[1] / seconds[0] == pytest.approx(3.0)


def test_the_healthy_worker_waits_for_the_slow_one_outside_its_ops(pair):
    healthy, slow = pair
    for step in range(STEPS):
        # the all-reduce holds the healthy worker until the slow one's compute is done, and that
        # compute holds the wall for at least its device time, whatever the host does
        slow_start, healthy_end = slow["paced"]["spans"][step][0], healthy["paced"]["spans"][step][1]
        assert healthy_end >= slow_start + slow["paced"]["device"][step]["compute"], step
    _require_every_op_on_pace(pair)
    for step in range(STEPS):
        slow_device = sum(slow["paced"]["device"][step].values())
        healthy_device = sum(healthy["paced"]["device"][step].values())
        assert healthy_device == pytest.approx(slow_device / 3)     # the wait is not the healthy one's


def test_paced_losses_and_weights_equal_the_unpaced_run_bitwise(pair):
    for r in pair:
        assert r["paced"]["losses"] == r["unpaced"]["losses"]
        assert all(torch.equal(r["paced"]["params"][k], v) for k, v in r["unpaced"]["params"].items())
    a, b = (r["paced"]["params"] for r in pair)
    assert all(torch.equal(a[k], b[k]) for k in a), "the workers' replicas drifted apart"
    assert all(math.isfinite(x) for x in pair[0]["paced"]["losses"])


def test_flops_are_the_models_rule(pair):
    r = pair[0]["paced"]
    assert r["host_flops"] == pytest.approx(STEPS * 3 * sum(r["forward_flops"]))


def _worker_loop(rank: int, world: int) -> dict:
    from malleus_svc.control.demo import job_dict
    job = job_dict("t", 1, 8, 3, [])
    job["model"] = {**job["model"], "layers": 2}     # quick: the loop, not the model, is under test
    job["data"]["max_files"] = 20
    config = {"job": job, "steps": 3, "shift_at": 1, "factor": 3.0, "slow_rank": 1,
              "pace": None}
    return bench.ddp_worker(rank, world, config, wrap=DistributedDataParallel)


def test_the_worker_loop_on_the_demo_data():
    a, b = run_on_gloo(_worker_loop, 2)
    assert [r["step"] for r in a["records"]] == [0, 1, 2]
    assert all(r["tokens"] > 0 and r["iteration_seconds"] > 0 for r in a["records"])
    assert a["last_loss"] == b["last_loss"] == pytest.approx(a["records"][-1]["local_loss"]
                                                             + b["records"][-1]["local_loss"])
    assert 0 < a["last_loss"] < 10 and a["pace_held"] is None and a["device_seconds"] == b["device_seconds"]


# ---------------------------------------------------------------------------- figures, table, section
def _summary(ddp: bool = True, malleus_tps: float = 420.0) -> dict:
    per = [(s, 500.0 if s < 9 else 300.0) for s in range(30)]
    systems = {
        "static": {"tokens_per_second": 210.0, "healthy_tokens_per_second": 520.0, "pace_held": 0.99,
                   "last_loss": 3.1, "per_step": per},
        "malleus": {"tokens_per_second": malleus_tps, "healthy_tokens_per_second": 515.0, "pace_held": 0.98,
                    "last_loss": 3.1, "per_step": per},
    }
    if ddp:
        systems["ray-ddp"] = {"tokens_per_second": 190.0, "healthy_tokens_per_second": 600.0, "pace_held": 0.97,
                              "last_loss": 3.1, "per_step": per}
    bound = 458.3
    for v in systems.values():
        v["over_bound"] = v["tokens_per_second"] / bound
        v["whole_over_bound"] = min(1.0, 1.05 * v["over_bound"])
        v["over_static"] = v["tokens_per_second"] / 210.0
    return {"command": "malleus bench malleable --write BENCHMARKS.md", "date": "2026-11-24", "workers": 8,
            "host_cores": 2, "steps": 30, "shift_at": 9, "measured_from": 3, "factor": 3.0, "slow_device": 3, "global_batch": 16,
            "device_pace": {"gflops": 1.02, "gbps": 0.355}, "healthy_tokens_per_second": 500.0,
            "bound_tokens_per_second": bound, "capacity_fraction": 0.9167, "systems": systems,
            "ddp_skipped": None if ddp else "skipped (--no-ddp)",
            "malleus_steady_tokens_per_second": 440.0, "steady_steps": 17, "malleus_steady_over_bound": 0.96,
            "replan_latency": [{"shift_step": 9, "what": "device 3 x3", "iterations": 3, "seconds": 7.9,
                                "new_plan_step": 12}],
            "replans": [{"step": 12, "option": "replan", "planning_seconds": 0.05, "migration_bytes": 2.1e7,
                         "migration_seconds": 0.6}],
            "ddp_device_seconds": [10.0, 10.0, 10.0, 28.0, 10.0, 10.0, 10.0, 10.0] if ddp else None,
            "wall_seconds": {"total": 300.0}}


def test_section_has_every_system_and_the_verdicts():
    md = bench.render(_summary(), bench.PLOT)
    for label in ("(a) static", "(b) malleus", "(c) Ray Train", "(d) capacity bound", "steady state"):
        assert label in md
    assert "| 420 | 0.92 | 2.00× | 0.96 |" in md and "| 190 | 0.41 | 0.90× | 0.44 |" in md
    assert "DDP no better than static: 0.90× static (met)" in md
    assert "after 3 iterations (7.9 s)" in md and "worker 3 28.0 s" in md
    assert "NOT met" not in md and bench.PLOT in md


def test_a_missed_target_says_so():
    md = bench.render(_summary(malleus_tps=300.0))
    assert "malleus over the slowed steps ≥ 0.8 of bound: 0.65 (NOT met)" in md
    assert "malleus over the whole run (steps 3–29) ≥ 0.8 of bound: 0.69 (NOT met)" in md


def test_skipped_ddp_is_one_clear_row():
    md = bench.render(_summary(ddp=False))
    assert "| (c) Ray Train TorchTrainer, DDP × 8 | skipped (--no-ddp) |" in md
    assert "DDP no better" not in md


def test_write_replaces_only_the_benchs_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\nintro\n\n<!-- bench:malleable -->\nold table\n<!-- /bench:malleable -->\n\nafter\n")
    write_section(bench.render(_summary()), path, "bench:malleable")
    text = path.read_text()
    assert "old table" not in text and "intro" in text and text.rstrip().endswith("after")
    assert text.count("<!-- bench:malleable -->") == 1 and "(d) capacity bound" in text


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = bench.plot(_summary(), tmp_path / "plots" / "malleable.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ddp_without_ray_train_is_skipped_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)     # as if ray[train] could not be imported
    why = bench.ddp_skip_reason(False)
    assert why.startswith("skipped: ray.train cannot be imported (") and "\n" not in why
    assert bench.ddp_skip_reason(True) == "skipped (--no-ddp)"


def test_the_pace_travels_as_numbers():
    assert bench.pace_numbers({"tflops": 1.02e-3, "gbps": 0.355, "block_ms": 2.5}) == pytest.approx(
        {"flops_per_second": 1.02e9, "bytes_per_second": 0.355e9, "block_seconds": 2.5e-3})
    assert bench.pace_numbers("auto") is None
