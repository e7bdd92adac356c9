"""Shared fixtures. ONE local Ray cluster per pytest session, started only by tests that ask for it.

`ray_cluster` declares more logical CPUs than the machine has cores (16 on any machine): worker
actors take one CPU each, so a 7- or 8-device group fits even on 2 cores, and a job started by a
subprocess can join beside the test's own group. The OS time-slices the real cores.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RAY_TEST_CPUS = 16


@pytest.fixture(scope="session")
def ray_cluster():
    """A started local Ray cluster; yields its GCS address (for subprocesses that join it)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # someone else started one in this process: reuse it, do not own it
        yield ray.get_runtime_context().gcs_address
        return
    # Workers import malleus_svc from the working tree, also when it is not installed.
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    from malleus_svc.runtime.cluster import LOCAL_RAY_SYSTEM_CONFIG

    # address="local": always a cluster of our own, even when another `ray start` runs on this machine;
    # its workers at the niceness `malleus train` gives its own cluster's
    ray.init(address="local", num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": env}, configure_logging=False, _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's) on loopback for the session; yields the environment a
    client reads (endpoint, credentials, region), as a user's shell would hold it."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)    # not a line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "malleus-test",
               "AWS_SECRET_ACCESS_KEY": "malleus-test", "AWS_DEFAULT_REGION": "us-east-1"}
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """A fresh bucket on that server, with its settings in this process's environment; yields
    ``s3://<bucket>``."""
    import re
    import uuid

    import boto3

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    bucket = f"{re.sub('[^a-z0-9]+', '-', request.node.name.lower())[:40].strip('-')}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}"


@pytest.fixture(scope="session")
def python_exe() -> str:
    return sys.executable


def pytest_collection_modifyitems(items):
    """The node-loss tests last (after pytest-randomly's shuffle, which keeps its seed): their
    scenario runs in the background from the session's start, so by then it is over and they read
    its outcome; drawn early, the session would wait for it with nothing else to do."""
    def node_loss(item) -> bool:
        try:
            return getattr(item, "module", None) is not None and item.module.__name__ == "test_node_loss"
        except (ImportError, pytest.Collector.CollectError):   # as pytest-randomly guards it
            return False
    items.sort(key=node_loss)


# Idle cores at the session's start from which the node-loss scenario runs beside the other tests.
# It mostly waits, so beside them it costs little where a core is spare; on a host that other work
# already keeps busy, it would slow every load-sensitive test it overlaps, and runs last instead.
BACKGROUND_IDLE_CORES = 1.5


def pytest_collection_finish(session):
    """The node-loss scenario (tests/test_node_loss.py) starts in the background as soon as the
    session is known to run a test of it, where the host has idle cores; it is stopped at the end if
    no test waited for it. Without them, its tests (drawn last) start it when they need it."""
    from _host import idle_cores

    if session.config.option.collectonly:
        return
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ == "test_node_loss":
            idle = idle_cores()
            background = idle >= BACKGROUND_IDLE_CORES
            session.config.stash[NODE_LOSS] = f"{'in the background' if background else 'last'} " \
                                              f"({idle:.1f} idle cores at the start)"
            if background:
                module.launch()
                session.config.add_cleanup(module.stop)
            return


NODE_LOSS = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, config):
    """The random order's seed also under -q (pytest-randomly prints it only in the header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and getattr(config.option, "randomly_reorganize", False):
        terminalreporter.write_line(f"test order: --randomly-seed={seed} reproduces it (-p no:randomly: file order)")
    if NODE_LOSS in config.stash:
        terminalreporter.write_line(f"node-loss scenario: {config.stash[NODE_LOSS]}")
