"""The NCCL settings a worker makes before its world exists: survivors of a lost peer must see an
exception at the timeout, not a process teardown (torch's NCCL default), and `wait()` must not
hold the host (the runtime's watchdog detects a lost peer instead)."""
import logging

import pytest

from malleus_svc.runtime.collective_env import SURVIVABLE_NCCL_ENV, prepare_collective_env

LOGGER = "malleus_svc.runtime.collective_env"


def test_nccl_gets_abort_only_error_handling_and_non_blocking_waits():
    env: dict[str, str] = {"PATH": "/bin"}
    assert prepare_collective_env("nccl", env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert env == {"PATH": "/bin", **SURVIVABLE_NCCL_ENV} and "TORCH_NCCL_BLOCKING_WAIT" not in env


def test_gloo_is_left_alone():
    env: dict[str, str] = {}
    assert prepare_collective_env("gloo", env) == {} and env == {}


@pytest.mark.parametrize("key, value, says", [
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "take the survivors down"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "take the survivors down"),
    ("TORCH_NCCL_BLOCKING_WAIT", "1", "holds the host"),
])
def test_a_value_the_job_set_is_kept_and_a_costly_one_is_named(caplog, key, value, says):
    env = {key: value}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = prepare_collective_env("nccl", env)
    assert got[key] == value and env[key] == value
    assert len(caplog.records) == 1 and f"{key}={value}" in caplog.text and says in caplog.text


def test_harmless_values_say_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        prepare_collective_env("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"})
    assert not caplog.records


def test_nccls_own_timeout_is_a_backstop_behind_the_watchdogs_and_gloos_is_the_detection():
    import datetime

    from malleus_svc.runtime.collective_env import NCCL_BACKSTOP, group_timeout

    t = datetime.timedelta(seconds=20)
    assert group_timeout("gloo", t) == t
    assert group_timeout("nccl", t) == NCCL_BACKSTOP * t > t
