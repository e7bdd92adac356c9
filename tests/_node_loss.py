"""A logical node's Ray node leaves the cluster mid-training and a new one joins later.

Run as a script (tests/test_node_loss.py does): it needs a Ray cluster of several nodes
(`ray.cluster_utils.Cluster`: real raylets on this machine), which cannot share a process with
the session's single-node cluster. Prints one JSON object: the reference run's and the faulted
run's metrics lines, the faulted run's status and history.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS, GLOBAL = 30, 8
LEAVE_AT = 4


def job(name: str, ckpt: Path | None = None):
    """The tiny model on 2 logical nodes of 2 devices, DP2 x PP2 (one pipeline per node). The faulted
    runs keep checkpoints, as a real job would; recovery must not need them (the other pipeline
    is a whole replica, and survivors always agree on the step: NOTES.md, Reliability)."""
    from malleus_svc.config.job import JobConfig
    extra = {"checkpoint": {"dir": str(ckpt), "every": 2, "keep": 2}} if ckpt else {}
    return JobConfig.from_dict({**extra,
        "name": name, "cluster": {"nodes": 2, "gpus_per_node": 2, "gpu_memory_mb": 16000}, "model": "tiny",
        "parallel": {"dp": 2, "tp": 1, "pp": 2}, "batch": {"global": GLOBAL, "micro": 2},
        "data": {"source": "synthetic", "seq_len": 64, "num_samples": 512, "vocab": 256},
        "train": {"steps": STEPS, "lr": 1e-3}, "metrics": {"enabled": False}, "emulate": []})


def train(cfg, out: Path, **kwargs) -> tuple[int, list[dict]]:
    from malleus_svc.train import run_through_coordinator
    rc = run_through_coordinator(cfg, None, STEPS, metrics_out=str(out), say=mark, static=True, **kwargs)
    return rc, [json.loads(x) for x in out.read_text().splitlines()]


T0 = time.monotonic()


def mark(what: str) -> None:
    """Progress on stderr (the test shows its tail if the scenario fails): where the time goes."""
    print(f"[node-loss {time.monotonic() - T0:6.1f} s] {what}", file=sys.stderr, flush=True)


SLOW = 40.0   # the most emulated slowdown (sleeps only) that keeps a job running while a node starts
COLLECTIVE_TIMEOUT_S = 20.0


def remove(cluster, node) -> None:
    """Kill a node's raylet and wait until the cluster knows it is dead (else Ray may still
    schedule onto it for a few seconds)."""
    import ray

    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 60
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the removed node is still alive after 60 s"
        time.sleep(0.2)


def start_job(cfg, out: Path) -> dict:
    """Train on a thread (Ray starts nodes from the main thread only: it sets signal handlers);
    the dict gets rc and lines when the job ends, and has its coordinator's handle now."""
    import ray

    from malleus_svc.control.coordinator import NAMESPACE, actor_name

    run: dict = {}
    run["thread"] = threading.Thread(target=lambda: run.update(zip(("rc", "lines"), train(
        cfg, out, collective_timeout_s=COLLECTIVE_TIMEOUT_S, replace_timeout_s=10, rejoin_check_s=0.5,
        cpus_per_worker=1.0))), daemon=True)   # one CPU each, as on GPUs: a node holds one logical node
    run["thread"].start()
    while "handle" not in run:
        try:
            run["handle"] = ray.get_actor(actor_name(cfg.name), namespace=NAMESPACE)
        except ValueError:
            time.sleep(0.2)
    return run


def slowdown(h) -> float:
    """How much to slow the devices that run while a node starts. An op of a slowed step must end
    well inside the collective timeout, or the watchdog rightly counts its device as hung: a step
    at full speed bounds its ops' time, a device may hold twice the blocks without the node, and
    the host's load varies, so a quarter of the timeout over twice the step. On a loaded host,
    where the pace is fitted to slow ops, that is far less than SLOW. The step read is one run on
    the pace the warm-up refits (before step `skip`; a refit only slows it)."""
    import ray

    from malleus_svc.config.job import ControlConfig

    while (st := ray.get(h.status.remote()))["step"] <= ControlConfig.skip:
        assert st["state"] not in ("done", "failed"), st
        time.sleep(0.05)
    return max(1.0, min(SLOW, COLLECTIVE_TIMEOUT_S / 4 / (2 * st["iteration_seconds"])))


def watch(run: dict) -> None:
    """Until the job ends: its error events in full (the driver says their first lines only)."""
    import ray

    seen: set = set()
    while run["thread"].is_alive():
        try:
            events = ray.get(run["handle"].status.remote(), timeout=10)["events"]
        except Exception:  # noqa: BLE001 - the job ended and its coordinator with it
            events = []
        for ev in events:
            if ev["kind"] == "error" and (ev["time"], ev["text"]) not in seen:
                seen.add((ev["time"], ev["text"]))
                mark(f"error event at step {ev['step']}:\n{ev['text']}")
        time.sleep(0.2)
    run["thread"].join()


def grow(cluster, run: dict) -> dict:
    """Add a node while the job runs without some devices; wait for them to rejoin and the job to end."""
    import ray

    h, out = run["handle"], {}
    gone = ray.get(h.status.remote())["gone"]
    assert gone, ("nothing to rejoin", ray.get(h.status.remote()))
    # Slower steps (emulation only: sleeps, the arithmetic is unchanged) so that the job is still
    # running when the new node is up; back to full speed once the devices are back.
    slow = slowdown(h)
    ray.get(h.emulate.remote({d: slow for d in range(4) if d not in gone}))
    mark(f"devices slowed {slow:.1f}x while a node starts")
    cluster.add_node(num_cpus=2)
    out["added_at_step"] = ray.get(h.status.remote())["step"]
    # done when the coordinator has booked the rejoin of the last gone device (the group's own `gone`
    # empties earlier). The devices come back together, or one by one on a busy host: a fresh worker
    # that does not start within replace_timeout_s is taken back at a later iteration boundary.
    added, events = time.monotonic(), {}
    while True:
        st = ray.get(h.status.remote())         # before the history: a rejoin in between is still seen
        events.update(((e["time"], e["text"]), e) for e in st["events"])   # the status holds the last few
        hist = ray.get(h.get_history.remote())
        if any("rejoined" in e["reason"] and e.get("gone") == [] for e in hist):
            break
        assert st["state"] != "failed", st
        if st["state"] == "done":   # a host too slow to start a node within the job's slowed steps
            out["inconclusive"] = (f"the job ended {time.monotonic() - added:.0f} s after the node was added, "
                                   "before its devices rejoined: the node took longer to start than the job "
                                   "had left to train")
            break
        time.sleep(0.1)
    out.update(rejoined=ray.get(h.status.remote()), history=hist,
               job_events=sorted(events.values(), key=lambda e: e["time"]))
    ray.get(h.emulate.remote({d: 1.0 for d in range(4)}))
    watch(run)      # the driver ends the job and its coordinator: read nothing from it after
    out.update(rc=run.get("rc"), lines=run.get("lines"))
    return out


def main() -> int:
    import ray
    from ray.cluster_utils import Cluster

    # The head runs the driver and the coordinators (0 CPUs: no worker lands there); each other
    # Ray node has room for exactly one logical node's two workers.
    # A killed raylet is declared dead after 3 failed health checks a second apart (Ray's defaults:
    # 5, 3 s apart), so the test waits less for what it is not testing.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    tmp = Path(tempfile.mkdtemp(prefix="malleus-node-loss-"))
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
                 log_to_driver=False)
        cluster.wait_for_nodes()
        mark("cluster of 3 nodes up")
        rc_ref, reference = train(job("nl-ref"), tmp / "ref.jsonl")
        mark("reference run done")
        result = {"rc_ref": rc_ref, "reference": reference, "events": []}

        faulted = start_job(job("nl-fault", tmp / "ckpt-fault"), tmp / "fault.jsonl")
        h = faulted["handle"]
        while (st := ray.get(h.status.remote()))["step"] < LEAVE_AT:
            time.sleep(0.02)
        result["before"] = st
        # The Ray node of one logical node; not the coordinator's (the driver may have joined the
        # cluster through a worker node's raylet, and the coordinator sits beside the driver).
        here = ray.get(h.job_info.remote())["node_id"]
        victim = next(st["workers"]["nodes"][d] for d in ("2", "0") if st["workers"]["nodes"][d] != here)
        node = next(n for n in cluster.list_all_nodes() if n.node_id == victim)
        cluster.remove_node(node, allow_graceful=False)   # while the job runs: no waiting
        result["events"].append({"removed": victim, "at_step": st["step"], "time": time.time(),
                                 "devices": sorted(int(d) for d, n in st["workers"]["nodes"].items() if n == victim)})
        while not (st := ray.get(h.status.remote()))["failures"]:     # recovered: over the survivors
            assert st["state"] not in ("done", "failed"), st
            time.sleep(0.1)
        result["shrunk"] = st
        mark("recovered over the survivors")
        result.update(grow(cluster, faulted))
        mark("node rejoined, faulted run done")

        # Elastic start: one logical node cannot be placed at start-up; it joins later.
        driver = ray.get_runtime_context().get_node_id()    # the coordinators sit beside the driver
        spare = next(n for n in cluster.list_all_nodes() if not n.is_head() and n.node_id != driver)
        remove(cluster, spare)
        mark("spare node removed")
        grown = start_job(job("nl-grow", tmp / "ckpt-grow"), tmp / "grow.jsonl")
        while (st := ray.get(grown["handle"].status.remote()))["state"] != "training":
            assert st["state"] not in ("done", "failed"), st
            time.sleep(0.2)
        result["grow_start"] = st
        mark("elastic start training")
        result["grow"] = grow(cluster, grown)
        mark("grown, elastic run done")
        print("RESULT " + json.dumps(result, default=str))
        return 0
    except BaseException:
        # now: a daemon thread still in a Ray call can end the process while the raylets go below
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        ray.shutdown()
        for node in cluster.list_all_nodes():   # every raylet this script started, head last
            node.kill_all_processes(check_alive=False, allow_graceful=False)
        # as Cluster.shutdown does: a plain ray.init() on this machine must not look for this cluster
        ray._common.utils.reset_ray_address()


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
