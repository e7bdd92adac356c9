"""A Ray node leaves for good mid-training and a new one joins later: the job re-plans
over the survivors without restarting them, takes the new node's devices back into the plan, and
ends on the uninterrupted run's losses with every global batch used exactly once.

The cluster is several real raylets on this machine (`ray.cluster_utils.Cluster`), so the scenario
runs in a subprocess (tests/_node_loss.py): a process joins one Ray cluster only. It starts when
the session does, beside the other tests (`launch`)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from _host import inconclusive

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_node_loss.py")
_run: dict = {}


def launch() -> None:
    """Start the scenario (once per session). It mostly waits (Ray nodes starting, timeouts running
    out), so conftest starts it as soon as the session is known to need it, and other tests run
    meanwhile. Output goes to files: a full pipe would stall it."""
    if not _run:
        out, err = (tempfile.TemporaryFile("w+") for _ in range(2))
        _run.update(out=out, err=err, proc=subprocess.Popen([sys.executable, str(SCRIPT)], stdout=out, stderr=err))


def stop() -> None:
    """An interrupted session: end the scenario as Ctrl-C would (it then removes its Ray nodes)."""
    if _run and _run["proc"].poll() is None:
        _run["proc"].send_signal(signal.SIGINT)
        try:
            _run["proc"].wait(timeout=60)
        except subprocess.TimeoutExpired:
            _run["proc"].kill()


@pytest.fixture(scope="module")
def outcome() -> dict:
    launch()
    proc, out, err = _run["proc"], _run["out"], _run["err"]
    proc.wait(timeout=900)
    out.seek(0)
    err.seek(0)
    lines = [x for x in out.read().splitlines() if x.startswith("RESULT ")]
    log = err.read()
    assert proc.returncode == 0 and lines, log[-16000:]   # the jobs' progress lines before the failure too
    # the scenario's progress and each job's own lines (its errors): shown where a job's verdict fails
    return {**json.loads(lines[-1][len("RESULT "):]), "log": log[-12000:]}


def test_survivors_carry_on_without_the_lost_node(outcome):
    assert outcome["rc_ref"] == 0 and outcome["rc"] == 0, outcome["log"]
    lost = outcome["events"][0]["devices"]
    assert len(lost) == 2
    failure = outcome["shrunk"]["failures"][0]
    print(f"\nRELIABILITY node lost: {failure}")
    assert failure["lost"] == lost and failure["gone"] == lost, failure
    # the other pipeline is a whole replica, and the survivors agree on the step (two-phase update)
    assert failure["source"] == "replicas", failure
    shrunk = outcome["shrunk"]
    assert shrunk["gone"] == lost
    roles = {d for p in shrunk["plan"]["pipelines"] for st in p["stages"] for d in st["devices"]}
    assert roles and not roles & set(lost) and set(lost) <= set(shrunk["plan"]["excluded"])
    survivors = [str(d) for d in range(4) if d not in lost]
    before, after = outcome["before"]["workers"]["pids"], shrunk["workers"]["pids"]
    assert all(before[d] == after[d] for d in survivors), "survivors were restarted"


def judged(run: dict) -> None:
    """A rejoin is judged only where the new node started while the job still trained."""
    if "inconclusive" in run:
        inconclusive(run["inconclusive"])


def test_a_new_node_is_taken_back_into_the_plan(outcome):
    judged(outcome)
    lost = outcome["events"][0]["devices"]
    final = outcome["rejoined"]
    assert final["gone"] == [] and outcome["rc"] == 0, outcome["log"]
    roles = {d for p in final["plan"]["pipelines"] for st in p["stages"] for d in st["devices"]}
    assert set(lost) <= roles, final["plan"]
    kinds = [(h["outcome"], h["reason"]) for h in outcome["history"]]
    assert [k[0] for k in kinds[:2]] == ["initial", "membership"] and "gone" in kinds[1][1], kinds
    assert _rejoins(outcome["history"][2:]), kinds
    # the rejoined devices run in fresh processes; the survivors in the same ones as at the start
    before, after = outcome["before"]["workers"]["pids"], final["workers"]["pids"]
    assert all(after[str(d)] != before[str(d)] for d in lost)
    assert all(after[d] == before[d] for d in before if int(d) not in lost), "survivors were restarted"


def _rejoins(entries: list[dict]) -> bool:
    """Membership changes that bring the lost devices back, together or one by one (a fresh worker
    that does not start within replace_timeout_s on a busy host comes back at a later boundary),
    the last leaving none gone."""
    return bool(entries) and all(e["outcome"] == "membership" and "rejoined" in e["reason"] for e in entries) \
        and entries[-1]["gone"] == []


def _plan_segments(lines: list[dict]) -> int:
    return 1 + sum(a["plan_id"] != b["plan_id"] for a, b in zip(lines, lines[1:]))


def test_the_losses_continue_the_uninterrupted_curve(outcome):
    assert outcome["rc"] == 0, outcome["log"]
    check_losses(outcome["lines"], outcome["reference"])
    judged(outcome)
    # before, without the node, with it again (one plan per rejoin): each plan change the history books
    assert _plan_segments(outcome["lines"]) == len(outcome["history"]) >= 3, _story(outcome)


def _story(run: dict) -> str:
    """What a failed verdict shows: each step's plan, the plan changes booked and the job's events."""
    steps = [(x["step"], x["plan_id"]) for x in run["lines"]]
    booked = [(h["step"], h["outcome"], h["reason"]) for h in run["history"]]
    events = [f"{e['step']} {e['kind']}: {e['text'][:300]}" for e in run["job_events"]]
    return "\n".join([f"steps: {steps}", f"booked: {booked}", *events])


def check_losses(got: list[dict], ref: list[dict]) -> None:
    assert [x["step"] for x in got] == list(range(len(ref))), "each step once in the metrics, in order"
    for x, r in zip(got, ref):
        assert x["loss"] == pytest.approx(r["loss"], rel=1e-4), (x["step"], x["loss"], r["loss"])
        assert (x["epoch"], x["sampler_position"]) == (r["epoch"], r["sampler_position"]), x["step"]
        assert x["samples"] == r["samples"]


def test_a_job_starts_on_the_nodes_there_are_and_grows_when_one_joins(outcome):
    """Elastic start: one of the two logical nodes cannot be placed at start-up; the job starts on
    the other, and takes the late node in when it joins, losing nothing."""
    start, grown = outcome["grow_start"], outcome["grow"]
    assert start["gone"] == [2, 3] and set(start["plan"]["excluded"]) >= {2, 3}, start
    assert grown["rc"] == 0, outcome["log"]
    check_losses(grown["lines"], outcome["reference"])
    judged(grown)
    assert grown["rejoined"]["gone"] == []
    roles = {d for p in grown["rejoined"]["plan"]["pipelines"] for st in p["stages"] for d in st["devices"]}
    assert roles == {0, 1, 2, 3}, grown["rejoined"]["plan"]
    assert grown["history"][0]["outcome"] == "initial" and _rejoins(grown["history"][1:]), grown["history"]
    assert grown["history"][0]["excluded"] == [2, 3]
