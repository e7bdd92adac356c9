"""Failure detection that never holds the host (runtime/watchdog.py): the watchdog aborts work that
outlives the collective timeout and the step raises PeerLost; a stage's host runs ahead of a stalled
peer under NCCL's rules, and the survivor trains on in its next plan."""
from __future__ import annotations

import functools
import os
import threading
import time

import pytest
import torch

from _mp import run_on_gloo
from malleus_svc.config.presets import preset
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime.nccl_rules import CommunicatorAborted, Op, RulesHub
from malleus_svc.runtime.watchdog import PeerLost, Watchdog

TINY = preset("tiny")


def test_work_that_outlives_the_timeout_is_aborted_and_raises_peer_lost():
    released = threading.Event()
    aborts = []

    def abort():
        aborts.append(time.monotonic())
        released.set()             # as ncclCommAbort ends the kernels the host waits on

    dog = Watchdog(0.3, abort, poll_s=0.02)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="a train step made no progress for the collective timeout of 0.3 s"):
            with dog.watch("a train step"):
                assert released.wait(30), "the abort never released the blocked host"
        assert len(aborts) == 1 and 0.3 <= aborts[0] - t0 < 10
        with pytest.raises(PeerLost):   # the world it watched is gone: nothing more runs in it
            with dog.watch("an optimizer update"):
                pytest.fail("ran in an aborted world")
    finally:
        dog.close()


def test_work_that_finishes_in_time_is_never_aborted_and_its_own_errors_pass_through():
    aborts = []
    dog = Watchdog(1.0, lambda: aborts.append(1), poll_s=0.01)
    try:
        for _ in range(20):
            with dog.watch("a train step"):
                time.sleep(0.01)
        with pytest.raises(ValueError, match="bad data"):
            with dog.watch("a train step"):
                raise ValueError("bad data")
        time.sleep(1.5)                # disarmed between steps: an idle world is not a lost peer
        assert not aborts and dog.fired is None
    finally:
        dog.close()


def test_a_slow_step_that_keeps_finishing_ops_is_not_a_lost_peer():
    """Progress (the device's finished ops) moves the deadline on: work two timeouts long that
    finishes an op every twentieth of one is never aborted; once its ops stop, it is."""
    done, aborts = [0], []
    released = threading.Event()
    dog = Watchdog(1.0, lambda: (aborts.append(1), released.set()), progress=lambda: done[0], poll_s=0.01)
    try:
        with dog.watch("a slow train step"):
            for _ in range(40):
                time.sleep(0.05)
                done[0] += 1
        assert not aborts
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="a stalled step made no progress"):
            with dog.watch("a stalled step"):
                done[0] += 1
                assert released.wait(30)
        assert aborts == [1] and time.monotonic() - t0 >= 1.0
    finally:
        dog.close()


def test_kicks_are_progress_and_a_broken_progress_or_abort_still_ends_the_work():
    """A migration's rounds that the host saw end keep it alive; a progress read that raises counts
    as none, an abort that raises still lets the work raise PeerLost, and an interrupt disarms."""
    aborts = []
    dog = Watchdog(1.0, lambda: aborts.append(1), poll_s=0.01)
    try:
        with dog.watch("a migration"):
            for _ in range(40):
                time.sleep(0.05)
                dog.kick()
        with pytest.raises(KeyboardInterrupt):
            with dog.watch("a step"):
                raise KeyboardInterrupt
        time.sleep(1.5)
        assert not aborts and dog.fired is None      # disarmed by the interrupt too
    finally:
        dog.close()

    def broken_progress() -> int:
        raise RuntimeError("CUDA error: an illegal memory access")

    def broken_abort() -> None:
        raise RuntimeError("ncclCommAbort failed")

    released = threading.Event()
    dog = Watchdog(0.2, lambda: (released.set(), broken_abort()), progress=broken_progress, poll_s=0.01)
    try:
        with pytest.raises(PeerLost):
            with dog.watch("a train step"):
                assert released.wait(30)
    finally:
        dog.close()


def test_an_error_the_abort_caused_is_raised_as_peer_lost_from_it():
    hub = RulesHub(world=2, timeout=60)
    dog = Watchdog(0.2, lambda: hub.abort(0), poll_s=0.02)
    try:
        seq = hub.post(0, [Op("recv", 1, (4,), "float32")], [None])
        with pytest.raises(PeerLost) as err:
            with dog.watch("a pipeline receive"):
                hub.wait(0, seq)       # rank 1 never sends
        assert isinstance(err.value.__cause__, CommunicatorAborted)
        with pytest.raises(CommunicatorAborted):
            hub.post(0, [Op("send", 1, (4,), "float32")], [torch.zeros(4)])
    finally:
        dog.close()


def test_a_watchdog_needs_a_positive_timeout():
    with pytest.raises(ValueError, match="positive"):
        Watchdog(0, lambda: None)


# ---------------------------------------------------------------------------- a stalled peer
TWO_STAGES = Plan(num_devices=2, num_layers=TINY.layers, micro_batch_size=2,
                  pipelines=(Pipeline((Stage((0,), (0, 1)), Stage((1,), (1, TINY.layers))), micro_batches=4),))
ALONE = Plan(num_devices=2, num_layers=TINY.layers, micro_batch_size=2,
             pipelines=(Pipeline((Stage((0,), (0, TINY.layers)),), micro_batches=4),), excluded=(1,))
TIMEOUT_S = 2.0


def _stalled_peer(rank: int, world: int, hub, flag: str, batches):
    """Rank 1 stalls (alive, posting nothing) until rank 0 is done; rank 0 steps under the watchdog,
    as a worker does (its device clock's finished ops as progress; its communicator's abort), then
    trains alone on the next plan."""
    from malleus_svc.runtime.engine import Engine
    from malleus_svc.runtime.nccl_rules import RulesTransport
    from test_engine import OPTIM, SEED

    engine = Engine(TINY, TWO_STAGES, rank, seed=SEED, optim=OPTIM, dtype=torch.float64,
                    transport=functools.partial(RulesTransport, hub=hub, rank=rank))
    if rank == 1:              # built its share with rank 0, then stalls before its first step
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    try:
        dog = Watchdog(TIMEOUT_S, lambda: hub.abort(0), progress=engine.clock.finished, poll_s=0.05)
        t0 = time.monotonic()
        try:
            with dog.watch("a train step"):
                engine.train_step(batches[0], sum(mb.num_loss_tokens for mb in batches[0]))
            raised = None
        except PeerLost as e:
            raised = (str(e), type(e.__cause__).__name__)
        seconds = time.monotonic() - t0
        posted = hub.posted(0)
        dog.close()
        # the survivor lives on: the next plan, without the stalled device, trains like one process
        alone = Engine(TINY, ALONE, 0, seed=SEED, optim=OPTIM, dtype=torch.float64)
        loss = alone.train_step(batches[0], sum(mb.num_loss_tokens for mb in batches[0])).global_loss
        return {"raised": raised, "seconds": seconds, "posted": posted, "loss": loss}
    finally:
        open(flag, "w").close()


def test_a_stalled_peer_never_holds_the_host_and_the_survivor_raises_then_trains_on(tmp_path):
    from malleus_svc.runtime.nccl_rules import serve_hub
    from malleus_svc.runtime.reference import reference_train
    from test_engine import OPTIM, SEED, global_batches

    batches = global_batches(steps=1, micro_batches=4, micro_batch_size=2)
    manager, hub = serve_hub(2, timeout=300)     # the stand-in's own deadlock timer stays out of it
    try:
        out = run_on_gloo(_stalled_peer, 2, hub, str(tmp_path / "done"), batches)[0]
    finally:
        manager.shutdown()
    assert out["raised"] is not None, "the step with a stalled peer returned"
    message, cause = out["raised"]
    assert "a train step made no progress for the collective timeout of 2 s" in message
    assert cause == "CommunicatorAborted"
    # raised at the watchdog's timeout, long before the stand-in's own (300 s) or the world's (120 s)
    assert TIMEOUT_S <= out["seconds"] < 60
    # 1F1B's first stage posts its first activation and computes the next micro-batch while the
    # peer has received nothing: the pending send did not hold the host
    assert out["posted"] >= 2
    ref_losses, _, _ = reference_train(TINY, SEED, OPTIM, batches, torch.float64)
    assert out["loss"] == pytest.approx(ref_losses[0], rel=1e-9)
