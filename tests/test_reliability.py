"""Fault injection on a real local Ray cluster: the job's coordinator is killed (mid-iteration,
and in the middle of a live migration); Ray restarts it, it resumes from its newest checkpoint,
and the job ends with the same losses, step for step, as a run that was never interrupted, with
every global batch of the data order used exactly once in the history that counts, and the
learning rate of its schedule at every step."""
from __future__ import annotations

import json
import threading
import time

import pytest

from malleus_svc.config.job import JobConfig

from _plans import make_plan

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, GLOBAL, SAMPLES = 12, 8, 512


def job(name: str, ckpt_dir=None, every: int = 0, parallel=None, shard_optimizer: bool = False) -> JobConfig:
    d = {"name": name, "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_mb": 16000}, "model": "tiny",
         "parallel": {**(parallel or {"dp": 2, "tp": 1, "pp": 2}), "shard_optimizer": shard_optimizer},
         "batch": {"global": GLOBAL, "micro": 2},
         "data": {"source": "synthetic", "seq_len": 64, "num_samples": SAMPLES, "vocab": 256},
         "train": {"steps": STEPS, "lr": 1e-3, "warmup_steps": 3, "decay": "cosine", "min_lr": 1e-4},
         "metrics": {"enabled": False}}
    if ckpt_dir is not None:
        d["checkpoint"] = {"dir": str(ckpt_dir), "every": every, "keep": 2}
    return JobConfig.from_dict(d)


def run(cfg: JobConfig, out, fault=None, plan=None, steps: int = STEPS, **kwargs) -> tuple[int, list[dict]]:
    """Train through the coordinator on a thread, from `plan` (default: the planner's); `fault(handle)`
    runs beside it."""
    import ray

    from malleus_svc.control.coordinator import NAMESPACE, actor_name
    from malleus_svc.train import run_through_coordinator

    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(run_through_coordinator(
        cfg, plan, steps, metrics_out=str(out), say=lambda m: None, **kwargs)))
    t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while True:
            try:
                fault(ray.get_actor(actor_name(cfg.name), namespace=NAMESPACE))
                break
            except ValueError:  # not created yet
                assert time.monotonic() < deadline
                time.sleep(0.2)
    t.join(600)
    assert not t.is_alive() and rc, "the job did not finish"
    return rc[0], [json.loads(x) for x in out.read_text().splitlines()]


def kill_at_step(step: int, phase: str | None = None):
    def fault(h):
        import ray
        while True:
            st = ray.get(h.status.remote())
            assert st["state"] not in ("done", "failed"), st
            if st["step"] >= step and (phase is None or (st["planning"] or {}).get("phase") == phase):
                ray.kill(h, no_restart=False)       # the process dies; Ray restarts the actor
                return
            time.sleep(0.01)
    return fault


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    rc, lines = run(job("rel-ref"), tmp_path_factory.mktemp("ref") / "m.jsonl", static=True)
    assert rc == 0 and [x["step"] for x in lines] == list(range(STEPS))
    return lines


def check_history(lines: list[dict], reference: list[dict], rtol: float) -> None:
    assert [x["step"] for x in lines] == list(range(STEPS)), "each step once in the metrics, in order"
    schedule = job("any").train      # the learning rate is a function of the step, whoever ran it
    for x, r in zip(lines, reference):
        assert x["lr"] == schedule.lr_at(x["step"]) == r["lr"], x["step"]
        assert x["loss"] == pytest.approx(r["loss"], rel=rtol), (x["step"], x["loss"], r["loss"])
        # the data order: step i consumed the i-th global batch, so none was skipped or repeated
        assert (x["epoch"], x["sampler_position"]) == (r["epoch"], r["sampler_position"]), x["step"]
        assert x["samples"] == GLOBAL


def test_coordinator_killed_mid_iteration_resumes_from_its_checkpoint(reference, tmp_path):
    """An operator's health signal (set_rates) given before the crash is still in force after it:
    checkpoints carry external rates and exclusions, like the model."""
    def fault(h):
        import ray
        while ray.get(h.status.remote())["step"] < 2:
            time.sleep(0.01)
        ray.get(h.set_rates.remote({1: 1.5}))
        kill_at_step(7)(h)

    rc, lines = run(job("rel-kill", tmp_path / "ckpt", every=3), tmp_path / "m.jsonl", fault=fault, static=True)
    assert rc == 0
    check_history(lines, reference, rtol=1e-6)     # the same plan after the restart: the same arithmetic
    resumed = [x for x in lines if x["step"] >= 6]
    assert all(x["rates"].get("1") == 1.5 for x in resumed), [x["rates"] for x in resumed]
    assert len(list((tmp_path / "ckpt").glob("step-*"))) == 2    # keep: 2, the final state included


def test_coordinator_killed_during_a_migration_never_loads_a_torn_state(reference, tmp_path):
    """A forced re-plan whose migration a test hook holds; the coordinator dies while migrating.
    The restarted one resumes from the checkpoint, which predates the migration and verifies."""
    def fault(h):
        import ray
        while ray.get(h.status.remote())["step"] < 4:
            time.sleep(0.01)
        ray.get(h.set_rates.remote({1: 4.0}))       # device 1 four times slower ...
        ray.get(h.replan.remote("test: migrate now", True))   # ... and a forced re-plan: a migration follows
        kill_at_step(4, phase="migrating")(h)
        # the restarted coordinator's migrations are held too: let them through
        threading.Thread(target=release_migrations, args=(h,), daemon=True).start()

    def release_migrations(h):
        import ray
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                ray.get(h.release_delay.remote("migrate"), timeout=30)
                if ray.get(h.status.remote(), timeout=30)["state"] in ("done", "failed"):
                    return
            except Exception:   # restarting, or gone with the job
                if done.is_set():
                    return
            time.sleep(0.5)

    done = threading.Event()
    try:
        rc, lines = run(job("rel-mig", tmp_path / "ckpt", every=2), tmp_path / "m.jsonl", fault=fault,
                        migrate_delay_s=120.0)
    finally:
        done.set()
    assert rc == 0
    check_history(lines, reference, rtol=1e-4)     # plans may differ after the restart: fp32 sums reorder


# DP 2 x PP 2, and one pipeline of 4 stages over the same 4 devices, the same global batch (4 x 2 = 8).
DP_PP = make_plan([([((0,), (0, 2)), ((1,), (2, 4))], 2), ([((2,), (0, 2)), ((3,), (2, 4))], 2)],
                  num_devices=4, layers=4, gpn=4, mbs=2)
PP4 = make_plan([([((3,), (0, 1)), ((2,), (1, 2)), ((1,), (2, 3)), ((0,), (3, 4))], 4)],
                num_devices=4, layers=4, gpn=4, mbs=2)


def test_a_run_resumed_from_object_storage_under_another_plan_continues_it(ray_cluster, s3, tmp_path):
    """A real run's trainer: warm-up over 5 steps, a cosine decay to min_lr at step 40, evaluation
    every 10 steps on a held-out 5%, checkpoints every 10 steps to an S3 server (the workers upload
    their own pieces and read their own rows back). The run as it stood at step 20 (its later
    checkpoint removed), resumed under another plan, goes on with the uninterrupted run's learning
    rates, samples, losses and eval losses."""
    import boto3

    steps, root = 30, f"{s3}/real-run"
    cfg = JobConfig.from_dict({
        "name": "rel-s3", "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_memory_mb": 16000}, "model": "tiny",
        "parallel": {"dp": 2, "tp": 1, "pp": 2},
        "batch": {"global": GLOBAL, "micro": 2},
        "data": {"source": "synthetic", "seq_len": 64, "num_samples": SAMPLES, "vocab": 256},
        "train": {"steps": steps, "lr": 1e-3, "warmup_steps": 5, "decay": "cosine", "decay_steps": 40, "min_lr": 1e-4},
        "eval": {"every": 10, "batches": 2, "holdout": 0.05},
        "checkpoint": {"dir": root, "every": 10, "keep": 3}, "metrics": {"enabled": False}})
    rc, full = run(cfg, tmp_path / "full.jsonl", plan=DP_PP, static=True, steps=steps)
    assert rc == 0 and [x["step"] for x in full] == list(range(steps))
    assert all(x["lr"] == cfg.train.lr_at(x["step"]) for x in full)
    assert full[4]["lr"] == 1e-3 and full[-1]["lr"] > 1e-4           # warmed up; mid-decay at the end
    assert [x["step"] for x in full if "eval_loss" in x] == [9, 19, 29]
    client, bucket = boto3.client("s3"), s3.removeprefix("s3://")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="real-run/")["Contents"]]
    assert {k for k in keys if k.endswith("manifest.json")} == {
        f"real-run/step-{n:08d}/manifest.json" for n in (10, 20, 30)}
    assert {k.rsplit("/", 1)[1] for k in keys if k.startswith("real-run/step-00000020/")} == {   # each worker's own
        "embedding.d0000.safetensors", "block-0000.d0002.safetensors", "block-0001.d0000.safetensors",
        "block-0002.d0003.safetensors", "block-0003.d0001.safetensors", "head.d0003.safetensors", "manifest.json"}
    for key in keys:             # the run as it stood at step 20
        if key.startswith("real-run/step-00000030/"):
            client.delete_object(Bucket=bucket, Key=key)

    rc, resumed = run(cfg, tmp_path / "resumed.jsonl", plan=PP4, static=True, steps=steps)
    assert rc == 0 and [x["step"] for x in resumed] == list(range(steps))
    assert resumed[:20] == full[:20]          # the history up to the checkpoint, as it was recorded
    assert {x["plan_id"] for x in resumed[20:]} == {PP4.plan_id} != {x["plan_id"] for x in full}
    for x, r in zip(resumed[20:], full[20:]):
        assert x["lr"] == r["lr"] and x["sampler_position"] == r["sampler_position"], x["step"]
        assert x["loss"] == pytest.approx(r["loss"], rel=1e-5), (x["step"], x["loss"], r["loss"])
    assert resumed[-1]["eval_loss"] == pytest.approx(full[-1]["eval_loss"], rel=1e-5)


def kill_worker_at_step(device: int, step: int, sig=None):
    """SIGKILL a worker's process while a step is in flight (a crash, not a polite ray.kill);
    SIGSTOP freezes it instead (a hang: alive, holding its peers in their collectives). The fault
    returns every worker's pid as it was just before the signal."""
    def fault(h):
        import os
        import signal

        import ray
        while True:
            st = ray.get(h.status.remote())
            assert st["state"] not in ("done", "failed"), st
            if st["step"] >= step:
                time.sleep(0.02)   # into the next step
                os.kill(st["workers"]["pids"][str(device)], sig or signal.SIGKILL)
                return st["workers"]["pids"]
            time.sleep(0.01)
    return fault


@pytest.mark.parametrize("how", ["crash", "hang"])
def test_worker_lost_mid_iteration_is_replaced_from_a_replica(reference, tmp_path, how):
    """Device 3 dies; pipeline 0 holds every layer too (DP2), so nothing needs a checkpoint: the
    survivors stay up, a new actor takes device 3's bundle, the state is rebuilt from the replicas
    and the interrupted global batch is trained again (no survivor applied its update). A hang
    (SIGSTOP) is found by the collective timeout: the device that never finished its step is the
    lost one, not the peers that waited for it."""
    import signal

    import ray

    status, pids_before = {}, {}

    def fault(h):
        pids_before.update(kill_worker_at_step(3, 5, signal.SIGSTOP if how == "hang" else signal.SIGKILL)(h))
        deadline = time.monotonic() + 120
        while not (st := ray.get(h.status.remote()))["failures"]:
            assert time.monotonic() < deadline and st["state"] not in ("done", "failed"), st
            time.sleep(0.1)
        status.update(st)

    rc, lines = run(job(f"rel-{how}"), tmp_path / "m.jsonl", fault=fault, static=True, collective_timeout_s=20)
    assert rc == 0
    failure = status["failures"][0]
    print(f"\nRELIABILITY worker {how}: {failure}")
    assert failure["lost"] == [3] and failure["source"] == "replicas", failure
    after = status["workers"]["pids"]    # taken once the recovery is recorded
    assert set(after) == set(pids_before) == {"0", "1", "2", "3"}, (pids_before, after)
    assert all(after[d] == pids_before[d] for d in after if d != "3"), ("survivors restarted", pids_before, after)
    assert after["3"] != pids_before["3"], "device 3 was not replaced by a new process"
    check_history(lines, reference, rtol=1e-6)


@pytest.mark.parametrize("layout", ["one-pipeline", "sharded-optimizer"])
def test_worker_without_replica_is_restored_from_the_checkpoint(reference, tmp_path, layout):
    """Device 2's state exists nowhere else, so the job goes back to its newest checkpoint, redoes
    the steps since, and ends on the same curve. One pipeline of four stages: its layers are its
    own. Two pipelines with the optimizer sharded: the layers have a replica, but its share of the
    Adam moments has none."""
    import ray

    status = {}

    def fault(h):
        kill_worker_at_step(2, 5)(h)
        deadline = time.monotonic() + 120
        while not (st := ray.get(h.status.remote()))["failures"]:
            assert time.monotonic() < deadline and st["state"] != "done", st
            time.sleep(0.1)
        status.update(st)

    from malleus_svc.planner import baseline_plan
    from malleus_svc.planner.build import build_problem

    sharded = layout == "sharded-optimizer"
    cfg = job(f"rel-{layout}", tmp_path / "ckpt", every=2, parallel={"dp": 2 if sharded else 1, "tp": 1,
                                                                     "pp": 2 if sharded else 4},
              shard_optimizer=sharded)
    plan = baseline_plan(build_problem(cfg.scenario))
    rc, lines = run(cfg, tmp_path / "m.jsonl", fault=fault, plan=plan, static=True, collective_timeout_s=20)
    assert rc == 0
    failure = status["failures"][0]
    print(f"\nRELIABILITY worker without replica ({layout}): {failure}")
    assert failure["lost"] == [2] and failure["source"] == "none", failure
    check_history(lines, reference, rtol=1e-4)     # another plan than the reference's: fp32 sums reorder
