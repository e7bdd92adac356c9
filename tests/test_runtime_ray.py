"""The runtime on a real local Ray cluster: worker actors, gloo, placement, steps, emulation, CLI.

One 7-worker group (2 logical nodes of 4 and 3 devices) is shared by the tests of this module, so
actors and the torch.distributed world start once; each test applies its own plan.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from _host import inconclusive, kept_pace
from malleus_svc.config.errors import ConfigError
from malleus_svc.config.job import JobConfig, load_job_config
from malleus_svc.plan import Pipeline, Plan, PlanError, Stage

REPO = Path(__file__).resolve().parent.parent
TINY_JOB = REPO / "examples" / "tiny_job.yaml"
NUM_DEVICES, GPUS_PER_NODE = 7, 4


def make_plan(pipes, micro_batch_size=2, suspended=(), num_layers=4):
    """pipes: [(micro_batches, [(devices, (start, end)), ...]), ...]"""
    return Plan(num_devices=NUM_DEVICES, num_layers=num_layers, micro_batch_size=micro_batch_size,
                gpus_per_node=GPUS_PER_NODE, suspended=tuple(suspended),
                pipelines=tuple(Pipeline(tuple(Stage(tuple(d), tuple(l)) for d, l in stages), m)
                                for m, stages in pipes))


# Two pipelines with different stage counts, uneven layer ranges and micro-batch counts, a TP=2
# group beside TP=1 groups, one suspended device. Global batch 2 x (3 + 2) = 10.
HETERO = make_plan([
    (3, [((0, 1), (0, 1)), ((2,), (1, 4))]),
    (2, [((4,), (0, 2)), ((5,), (2, 3)), ((6,), (3, 4))]),
], suspended=(3,))
# The same global batch under another layout (for a re-plan mid-epoch): 3 pipelines, TP=2 last.
OTHER = make_plan([
    (1, [((0,), (0, 4))]),
    (2, [((1,), (0, 3)), ((2,), (3, 4))]),
    (2, [((3,), (0, 2)), ((4, 5), (2, 4))]),
], suspended=(6,))
# One device alone: its wall time is its own work (no pipeline or gradient peers to wait for).
SOLO = make_plan([(4, [((0,), (0, 4))])], suspended=(1, 2, 3, 4, 5, 6))


# --------------------------------------------------------------------------- config (no Ray)
def _tiny_dict():
    return yaml.safe_load(TINY_JOB.read_text())


def test_job_config_loads_and_rejects_bad_fields():
    job = load_job_config(TINY_JOB)
    assert job.num_devices == 4 and job.data.mode == "pack" and job.train.betas == (0.9, 0.95)
    cases = [
        ({"trian": {}}, "trian"),
        ({"data": {"source": "wikipedia"}}, "data.source"),
        ({"data": {"seq_len": 4096}}, "data.seq_len"),
        ({"train": {"lr": 0}}, "train.lr"),
        ({"train": {"stpes": 3}}, "train.stpes"),
        ({"emulate": [{"device": 4, "factor": 2.0}]}, "emulate[0].device"),
        ({"emulate": [{"device": 1, "factor": 2.0, "at_step": 3, "until_step": 2}]}, "emulate[0].until_step"),
        ({"ray": {"adress": "auto"}}, "ray.adress"),
        ({"emulate": {"device": {"tflops": 1e-3, "block_ms": -1}}}, "emulate.device.block_ms"),
    ]
    device = JobConfig.from_dict({**_tiny_dict(), "emulate": {"device": {"tflops": 1e-3, "block_ms": 2}}}).emulated_device
    assert (device.flops_per_second, device.bytes_per_second, device.block_seconds) == (1e9, None, 2e-3)
    for patch, field in cases:
        d = _tiny_dict()
        d.update(patch)
        with pytest.raises(ConfigError) as e:
            JobConfig.from_dict(d, source="job.yaml")
        assert e.value.field == field, (patch, str(e.value))


def test_plan_that_does_not_fit_the_job_is_rejected():
    from malleus_svc.runtime.trainer import check_plan_for_job

    job = load_job_config(TINY_JOB)
    with pytest.raises(PlanError, match="7 devices, the job has 4"):
        check_plan_for_job(HETERO, job)
    four = Plan(num_devices=4, num_layers=3, micro_batch_size=2, gpus_per_node=4,
                pipelines=(Pipeline((Stage((0,), (0, 3)),), 4),), suspended=(1, 2, 3))
    with pytest.raises(PlanError, match="3 layers, the model has 4"):
        check_plan_for_job(four, job)


# --------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def group(ray_cluster):
    from malleus_svc.runtime.cluster import WorkerGroup

    g = WorkerGroup(NUM_DEVICES, GPUS_PER_NODE, name="test-runtime").start()
    try:
        yield g
    finally:
        g.shutdown()


def _shape():
    from malleus_svc.config.presets import PRESETS

    return PRESETS["tiny"]


@pytest.mark.ray
def test_a_worker_sweeps_lengths_on_its_own_device(group):
    """The call a job on GPUs makes to fit its length cost, here on a CPU worker: the sweep runs in
    the worker's process, on its device, up to the job's sequence length."""
    cost, reports = group.length_sweep(_shape(), [1], 24, 1.0, repeats=1)
    assert sorted(cost.coeffs) == [1] and cost.at(1).a >= 0 and cost.predict([24]) > cost.predict([6])
    assert max(max(r["lengths"]) for r in reports[1]["train"]) == 24 and reports[1]["clock"] == "device"


@pytest.mark.ray
def test_group_placement_and_world(group):
    infos = group.infos
    assert [i["device"] for i in infos] == list(range(NUM_DEVICES))
    assert len({i["pid"] for i in infos}) == NUM_DEVICES          # one process per device
    assert group.backend == "gloo" and group.rendezvous.startswith("tcp://")
    # STRICT_PACK per logical node: each node's devices share one Ray node.
    for n in range(2):
        assert len({i["node_id"] for i in infos if i["device"] // GPUS_PER_NODE == n}) == 1


@pytest.mark.ray
def test_exact_against_reference_on_bundled_data(group):
    """Heterogeneous plan on Ray == single-process reference: per-step losses and final state, with
    the learning rate of each step from a schedule (warm-up, then cosine) and no decay of norm gains."""
    import torch

    from malleus_svc.config.lr_schedule import LrSchedule
    from malleus_svc.runtime.data import GlobalSampler, split_for_plan
    from malleus_svc.runtime.datasets import build_dataset, collate
    from malleus_svc.runtime.engine import OptimConfig
    from malleus_svc.runtime.reference import reference_loss, reference_train

    shape, seed, steps = _shape(), 3, 3
    optim = OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.5,
                        schedule=LrSchedule(warmup_steps=2, decay="cosine", decay_steps=4, min_lr=1e-4))
    assert len({optim.lr_at(step) for step in range(steps)}) == steps
    spec = {"source": "python-stdlib", "seq_len": 64, "mode": "documents", "max_files": 40}
    n = group.set_data(spec, "pack", 64)
    group.apply_plan(HETERO, shape, seed=seed, optim=optim)
    sampler = GlobalSampler(n, HETERO.global_batch, seed=11)
    dataset = build_dataset(spec)

    losses, batches = [], []
    for step in range(steps):
        ids = sampler.next_global_batch()
        rec = group.step(ids, lr=optim.lr_at(step))
        assert rec.lr == optim.lr_at(step)
        losses.append(rec.loss)
        batches.append([collate(dataset, mb, "pack", 64) for pipe in split_for_plan(ids, HETERO) for mb in pipe])
        assert [s for pipe in rec.sample_ids for s in pipe] == ids
    ref_losses, ref_params, ref_optim = reference_train(shape, seed, optim, batches)
    assert losses == pytest.approx(list(ref_losses), rel=1e-5)
    assert losses[-1] < losses[0]  # it learns (sanity)
    # Two batches it never trained on, evaluated through the pipelines == one process on the weights.
    held_out = [sampler.next_global_batch() for _ in range(2)]
    collated = [[collate(dataset, mb, "pack", 64) for pipe in split_for_plan(ids, HETERO) for mb in pipe]
                for ids in held_out]
    expected_eval = (sum(reference_loss(shape, ref_params, b) * sum(mb.num_loss_tokens for mb in b) for b in collated)
                     / sum(mb.num_loss_tokens for b in collated for mb in b))
    assert group.evaluate(held_out) == pytest.approx(expected_eval, rel=1e-5)

    # Parameters and Adam state, assembled from the workers' slices (flat: name, name:exp_avg, ...).
    full = group.full_state()
    expected = {**ref_params, **ref_optim}
    assert set(full) == set(expected)
    # rtol 1e-5 (atol 1e-7) for essentially every element. A handful of elements may differ by a
    # little more: where a gradient element is about Adam's eps (1e-8), the update
    # lr * m / (sqrt(v) + eps) turns fp32 summation-order noise (pipelines add the gradient in
    # another order than one process) into up to ~lr of difference. Seen: 1 element in 10^4,
    # 2e-7 = 2e-4 x lr. Bound those by 1e-3 x lr and count them.
    for name, ref in expected.items():
        got = full[name].to(ref.dtype)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3 * optim.lr,
                                   msg=lambda m, name=name: f"{name}: {m}")
        strict = torch.isclose(got, ref, rtol=1e-5, atol=1e-7)
        assert int((~strict).sum()) <= max(1, ref.numel() // 1000), f"{name}: {int((~strict).sum())} elements off"


@pytest.mark.ray
def test_every_sample_once_per_epoch_across_a_replan(group):
    """Re-plan mid-epoch (fresh engines: this checks only the sample accounting, not migration)."""
    from malleus_svc.runtime.data import GlobalSampler

    shape, num_samples = _shape(), 50  # 5 global batches of 10
    spec = {"source": "synthetic", "seq_len": 32, "num_samples": num_samples, "vocab": 256, "seed": 5}
    group.set_data(spec, "pack", 32)
    sampler = GlobalSampler(num_samples, HETERO.global_batch, seed=7)
    seen = Counter()
    for plan, steps in ((HETERO, 2), (OTHER, 3)):
        group.apply_plan(plan, shape, seed=1)
        for _ in range(steps):
            rec = group.step(sampler.next_global_batch())
            # Every rank of a pipeline trained on the same samples; count each pipeline once.
            for i, pipe in enumerate(plan.pipelines):
                lists = {tuple(map(tuple, rec.devices[d]["sample_ids"])) for d in pipe.devices}
                assert len(lists) == 1, f"pipeline {i} ranks disagree on their samples"
            seen.update(s for pipe in rec.sample_ids for s in pipe)
    assert sampler.epoch == 1
    assert sorted(seen) == list(range(num_samples)) and set(seen.values()) == {1}


@pytest.mark.ray
def test_a_prepared_corpus_trains_to_the_same_losses_under_two_plans(group, tmp_path):
    """`malleus prepare-data` output (real stdlib text, a BPE tokenizer trained on it) as a job's data:
    two plans from the same initial weights train to the reference's losses, step for step."""
    import dataclasses
    import sysconfig

    from malleus_svc.prepare_data import prepare
    from malleus_svc.runtime.data import GlobalSampler, split_for_plan
    from malleus_svc.runtime.datasets import build_dataset, collate
    from malleus_svc.runtime.engine import OptimConfig
    from malleus_svc.runtime.reference import reference_train

    docs = tmp_path / "docs"
    docs.mkdir()
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]:
        (docs / f"{p.stem}.txt").write_text(p.read_text(errors="replace"))
    prepare([str(docs)], str(tmp_path / "tokenizer.json"), str(tmp_path / "corpus"), train_vocab=400, workers=1)
    shape = dataclasses.replace(_shape(), vocab=512)
    spec = {"source": "tokens", "seq_len": 64, "files": [{"path": str(tmp_path / "corpus")}], "vocab": 512}
    optim, seed, steps = OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, grad_clip=1.0), 2, 2
    dataset = build_dataset(spec)
    losses = {}
    for name, plan in (("hetero", HETERO), ("other", OTHER)):
        n = group.set_data(spec, "pack", 64)
        group.apply_plan(plan, shape, seed=seed, optim=optim)
        sampler = GlobalSampler(n, plan.global_batch, seed=5)
        losses[name], batches = [], []
        for _ in range(steps):
            ids = sampler.next_global_batch()
            losses[name].append(group.step(ids).loss)
            batches.append([collate(dataset, mb, "pack", 64) for pipe in split_for_plan(ids, plan) for mb in pipe])
    ref_losses, _, _ = reference_train(shape, seed, optim, batches)
    assert losses["hetero"] == pytest.approx(losses["other"], rel=1e-5)
    assert losses["other"] == pytest.approx(list(ref_losses), rel=1e-5)
    assert losses["other"][0] == pytest.approx(math.log(512), rel=0.1)   # random init over the 512 ids


@pytest.mark.ray
def test_a_straggler_is_a_rate_on_the_paced_device_clock(group):
    import ray

    shape = _shape()
    spec = {"source": "synthetic", "seq_len": 64, "num_samples": 64, "vocab": 256, "seed": 0}
    group.set_data(spec, "pad", 64)  # fixed-size micro-batches: every step does the same work
    group.apply_plan(SOLO, shape, seed=0)
    pace = group.pace(SOLO.micro_batch_size * 64)
    assert pace is not None and pace.flops_per_second > 0
    ids = list(range(SOLO.global_batch))

    def run(factor, reps=3):
        group.set_slowdown(0, factor)
        return [group.step(ids).devices[0] for _ in range(reps)]

    try:
        before = run(1.0, reps=1)[-1]  # warm-up
        # the pace refitted on the steps' own ops: never faster; the workers keep costs only when asked
        group.keep_op_costs()
        run(1.0, reps=1)
        kept_ops = ray.get(group.workers[0].keep_op_costs.remote(False), timeout=30)
        assert {op["kind"] for op in kept_ops} == {"compute", "update"}
        assert all(op["cpu_seconds"] > 0 and op["wall_seconds"] > 0 for op in kept_ops)
        group.keep_op_costs()
        run(1.0, reps=2)
        refit = group.refit_pace()
        assert refit is group.device_pace
        assert refit.flops_per_second <= pace.flops_per_second and refit.bytes_per_second <= pace.bytes_per_second
        assert refit.block_seconds >= pace.block_seconds
        assert ray.get(group.workers[0].keep_op_costs.remote(False), timeout=30) is None   # keeping stopped
        before = run(1.0, reps=1)[-1]
        healthy = run(1.0)
        slow = run(3.0)
        kept = kept_pace(healthy + slow, before)
        dev1 = [r["compute_seconds"] for r, k in zip(healthy, kept[:3]) if k]
        dev3 = [r["compute_seconds"] for r, k in zip(slow, kept[3:]) if k]
        print(f"steps on pace: {kept}; device seconds healthy {dev1}, x3 {dev3}")
        if not (dev1 and dev3):
            inconclusive(f"{sum(kept[:3])} healthy and {sum(kept[3:])} slowed steps of 3 kept their pace")
        # device time, on steps whose every op kept its pace: exactly the rate
        assert statistics.median(dev3) / statistics.median(dev1) == pytest.approx(3.0, rel=1e-6)
        # and the wall holds it: a step takes at least its ops' device time, whatever the host does
        for rec in healthy + slow:
            assert rec["wall_seconds"] >= rec["compute_seconds"], rec
        dev1 = statistics.median(dev1)

        # The control is reachable while a step runs (the worker's control thread): start a step at a
        # huge rate, set it back mid-step; the answer is immediate and the ops after it run healthy.
        big = 400.0
        group.set_slowdown(0, big)
        mbs = [ids[i:i + SOLO.micro_batch_size] for i in range(0, len(ids), SOLO.micro_batch_size)]
        ref = group.workers[0].train_step.remote(mbs, group.count_tokens(ids)[1])
        time.sleep(0.3)
        assert ray.get(group.workers[0].set_slowdown.remote(1.0), timeout=30) == 1.0
        mid = ray.get(ref)
        assert mid["slowdown"] == 1.0      # read as the step ended: the call was not queued behind it
        assert mid["compute_seconds"] < 0.5 * big * dev1, (mid["compute_seconds"], dev1)
    finally:   # the group is shared: leave device 0 healthy even when an assertion failed
        group.set_slowdown(0, 1.0)


def _solo_on_pace(group) -> list[int]:
    """One device training a synthetic set on the paced clock; the ids of one global batch."""
    spec = {"source": "synthetic", "seq_len": 64, "num_samples": 64, "vocab": 256, "seed": 0}
    group.set_data(spec, "pad", 64)
    group.apply_plan(SOLO, _shape(), seed=0)
    if group.device_pace is None:
        group.pace(SOLO.micro_batch_size * 64)
    return list(range(SOLO.global_batch))


def test_a_step_slower_than_the_answer_deadline_is_waited_for_while_its_ops_finish(group, monkeypatch):
    """A step's answer is due within the collective timeout and a margin; one that takes longer but
    keeps finishing ops (a slow pace, the work of a lost pipeline) is waited for, not called lost:
    here a deadline of 1 s against a step of about 4 s, each op well inside the 1 s window."""
    from malleus_svc.runtime import cluster

    ids = _solo_on_pace(group)
    group.step(ids)
    healthy = group.step(ids).devices[0]["compute_seconds"]
    monkeypatch.setattr(cluster, "ANSWER_MARGIN_S", 0.0)
    monkeypatch.setattr(group, "timeout_s", 1.0)
    try:
        group.set_slowdown(0, 4.0 / healthy)      # ~4 s a step, over 9 ops (4 forward, 4 backward, the update)
        t0 = time.monotonic()
        rec = group.step(ids).devices[0]
        assert time.monotonic() - t0 > 2.0 and rec["compute_seconds"] > 2.0, rec
    finally:
        group.set_slowdown(0, 1.0)


def test_a_step_whose_live_device_finishes_no_op_is_not_waited_for(group, monkeypatch):
    """The other side of the slow step: a device that answers on its control thread but finishes no
    op within the window (here one op paced to last about 8 s against a 1 s window) stops the wait,
    and the error says what the device showed."""
    import ray

    from malleus_svc.runtime import cluster

    ids = _solo_on_pace(group)
    healthy = group.step(ids).devices[0]["compute_seconds"]
    mbs = [ids[i:i + SOLO.micro_batch_size] for i in range(0, len(ids), SOLO.micro_batch_size)]
    monkeypatch.setattr(cluster, "ANSWER_MARGIN_S", 0.0)
    monkeypatch.setattr(group, "timeout_s", 1.0)
    group.set_slowdown(0, 8.0 / (healthy / 9))      # the step's first op: ~8 s (9 ops a step)
    ref = group.workers[0].train_step.remote(mbs, group.count_tokens(ids)[1])
    try:
        t0 = time.monotonic()
        with pytest.raises(cluster.WorkerGroupError, match=r"train_step: devices \[0\] have not answered after "
                                                            r"\d+ s: device 0 finished no op in 1 s"):
            group._get([ref], "train_step", devices=[0])
        assert time.monotonic() - t0 < 8.0
    finally:   # the group is shared: device 0 healthy again, its step run out
        ray.get(group.workers[0].set_slowdown.remote(1.0), timeout=30)
        ray.get(ref, timeout=120)


@pytest.mark.ray
def test_train_entry_point_against_the_shared_cluster(ray_cluster, tmp_path):
    """The CLI against a running cluster: a metrics line per step, with the schedule's learning rate,
    and the same figures in TensorBoard's event files; Ctrl-C stops the job at a step boundary,
    writes its checkpoint there, says so and exits 130."""
    import signal

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = yaml.safe_load(TINY_JOB.read_text())
    job["train"].update(warmup_steps=3, decay="linear", min_lr=1e-4)      # to min_lr at the file's steps
    job["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every": 1000}
    job["logging"] = {"tensorboard": str(tmp_path / "tb")}
    job["metrics"] = {"enabled": False}
    path, out = tmp_path / "job.yaml", tmp_path / "metrics.jsonl"
    path.write_text(yaml.safe_dump(job))
    cmd = [sys.executable, "-m", "malleus_svc.train", str(path), "--steps", "100000",
           "--metrics-out", str(out), "--address", ray_cluster]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while not (out.exists() and len(out.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.monotonic() < deadline, "the job did not reach step 6"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    steps, schedule = len(lines), load_job_config(path).train
    assert [x["step"] for x in lines] == list(range(steps))
    for x in lines:
        for key in ("loss", "tokens", "samples", "iteration_seconds", "plan_id", "compute_seconds", "grad_norm"):
            assert key in x, key
        assert x["samples"] == 8 and x["tokens"] > 0 and x["iteration_seconds"] > 0
        assert len(x["compute_seconds"]) >= 1
        assert x["lr"] == schedule.lr_at(x["step"])
        assert ("eval_loss" in x) == ((x["step"] + 1) % 5 == 0) and x.get("eval_loss", 1.0) > 0   # eval.every: 5
    ckpt = tmp_path / "ckpt" / f"step-{steps:08d}"
    assert f"interrupted after {steps} of 100000 steps; last checkpoint: {ckpt} (step {steps})" in err, err[-3000:]
    assert (ckpt / "manifest.json").exists()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("mfu", "throughput/mfu")):
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == list(range(steps)), tag
        assert [e.value for e in scalars] == pytest.approx([x[key] for x in lines], rel=1e-6), tag
    assert 0 < lines[-1]["mfu"] <= 1
    evaluated = [x for x in lines if "eval_loss" in x]
    assert [e.step for e in events.Scalars("eval/loss")] == [x["step"] for x in evaluated] != []
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([x["eval_loss"] for x in evaluated], rel=1e-6)
    assert {f"rates/device_{d}" for d in range(4)} <= set(events.Tags()["scalars"])


def test_train_cli_rejects_a_plan_that_does_not_fit(tmp_path, capsys):
    from malleus_svc import train

    bad = tmp_path / "plan.json"
    HETERO.save(bad)
    assert train.main([str(TINY_JOB), "--plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "7 devices, the job has 4" in err and "global batch is 10" in err


def test_emulation_schedule_windows():
    from malleus_svc.config.job import EmulateEntry
    from malleus_svc.control.hooks import EmulationSchedule
    from malleus_svc.runtime.device_clock import check_rate

    s = EmulationSchedule([EmulateEntry(1, 3.0, 2, 4), EmulateEntry(2, 2.0)])
    assert [s.factors_at(k, range(3)) for k in (0, 2, 4)] == [
        {0: 1.0, 1: 1.0, 2: 2.0}, {0: 1.0, 1: 3.0, 2: 2.0}, {0: 1.0, 1: 1.0, 2: 2.0}]
    with pytest.raises(ValueError, match=">= 1.0"):
        check_rate(0.5)
