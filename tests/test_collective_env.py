"""The NCCL error handling a worker sets before its world exists: survivors of a lost peer must
see an exception at the timeout, not a process teardown (torch's NCCL default)."""
import logging

from malleus_svc.runtime.collective_env import SURVIVABLE_NCCL_ENV, prepare_collective_env


def test_nccl_gets_abort_only_error_handling_and_blocking_waits():
    env: dict[str, str] = {"PATH": "/bin"}
    assert prepare_collective_env("nccl", env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
                                                   "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert env == {"PATH": "/bin", **SURVIVABLE_NCCL_ENV}


def test_gloo_is_left_alone():
    env: dict[str, str] = {}
    assert prepare_collective_env("gloo", env) == {} and env == {}


def test_a_value_the_job_set_is_kept_and_a_fatal_one_is_named(caplog):
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    with caplog.at_level(logging.WARNING, logger="malleus_svc.runtime.collective_env"):
        got = prepare_collective_env("nccl", env)
    assert got == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert len(caplog.records) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="malleus_svc.runtime.collective_env"):
        prepare_collective_env("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert not caplog.records
