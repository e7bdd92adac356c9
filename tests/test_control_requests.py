"""Client-call checks (control/requests.py): pure functions, one clear line for bad input."""
import math

import pytest

from malleus_svc.control import requests as check
from malleus_svc.control.requests import MalleusError


@pytest.mark.parametrize("d, want", [(3, 3), ("3", 3), (" 7 ", 7)])
def test_device_ids_accepted(d, want):
    assert check.check_device(d, 8, "j") == want


@pytest.mark.parametrize("d, says", [(8, "unknown device 8"), (-1, "unknown device -1"), (True, "ints"),
                                     ("²", "ints"), (1.0, "ints"), ("x", "ints"), (None, "ints")])
def test_device_ids_refused(d, says):
    with pytest.raises(MalleusError, match=says):
        check.check_device(d, 8, "j")


def test_rates():
    assert check.check_rates({"1": 2, 2: None}, 8, "j") == {1: 2.0, 2: None}
    for bad, says in (({}, "non-empty"), ([1], "non-empty"), ({1: math.nan}, "finite"), ({1: 0.5}, ">= 1.0 and at most 1e\\+06"),
                      ({1: 1e308}, ">= 1.0 and at most 1e\\+06"), ({1: True}, "finite"), ({9: 2.0}, "unknown device 9")):
        with pytest.raises(MalleusError, match=says):
            check.check_rates(bad, 8, "j")


def test_exclusions_and_inclusions():
    assert check.check_devices(3, "exclude", 8, "j") == [3]
    assert check.check_devices([3, "3", 1], "exclude", 8, "j") == [1, 3]
    with pytest.raises(MalleusError, match="non-empty"):
        check.check_devices([], "exclude", 8, "j")
    with pytest.raises(MalleusError, match="already excluded"):
        check.check_exclude([2], {2}, set(), 8, "j")
    with pytest.raises(MalleusError, match="no device"):
        check.check_exclude([0, 1], {2}, {3}, 4, "j")
    with pytest.raises(MalleusError, match="gone"):
        check.check_include([3], {3}, {3})
    with pytest.raises(MalleusError, match="not excluded"):
        check.check_include([1], {3}, set())
    check.check_include([3], {3}, set())


def test_reasons_steps_and_emulation():
    assert check.check_reason("  why ") == "why"
    for bad in ("", "  ", None, 3):
        with pytest.raises(MalleusError, match="non-empty string"):
            check.check_reason(bad)
    assert check.check_steps(5) == 5
    with pytest.raises(MalleusError, match="steps"):
        check.check_steps(0)
    assert check.check_emulation({3: 2}, 0.5, 8, "j") == ({3: 2.0}, 0.5)
    with pytest.raises(MalleusError, match="jitter"):
        check.check_emulation(None, 2.0, 8, "j")
    with pytest.raises(MalleusError, match=">= 1.0"):
        check.check_emulation({3: 0.5}, None, 8, "j")


def test_the_call_budget_allows_a_burst_then_the_steady_rate():
    now = [100.0]
    budget = check.CallBudget("j", rate=5.0, burst=20, clock=lambda: now[0])
    for _ in range(20):
        budget.take()
    with pytest.raises(MalleusError, match=r"at most 5 changing calls per second \(bursts of 20\); retry in 0.2 s"):
        budget.take()
    now[0] += 1.0                      # one second: five more
    for _ in range(5):
        budget.take()
    with pytest.raises(MalleusError, match="retry in"):
        budget.take()
    now[0] += 3600.0                   # idle for long: the burst again, never more
    for _ in range(20):
        budget.take()
    with pytest.raises(MalleusError):
        budget.take()


@pytest.mark.parametrize("call", [
    lambda: check.check_device("1" * 5000, 8, "j"), lambda: check.check_devices(["1" * 5000], "exclude", 8, "j"),
    lambda: check.check_rates({"1" * 5000: 2}, 8, "j"), lambda: check.check_rates({"9" * 6: 2}, 8, "j"),
    lambda: check.check_device(10 ** 5000, 8, "j"), lambda: check.check_rates({1: 10 ** 400}, 8, "j"),
    lambda: check.check_rates({1: "x" * 10 ** 5}, 8, "j"), lambda: check.check_devices("y" * 10 ** 5, "include", 8, "j"),
    lambda: check.check_emulation({1: 10 ** 400}, None, 8, "j"), lambda: check.check_reason(["z" * 10 ** 5]),
    lambda: check.check_reason("r" * (check.MAX_REASON + 1)), lambda: check.check_steps("s" * 10 ** 5),
], ids=["5000-digit-id", "5000-digit-exclude", "5000-digit-rate-key", "6-digit-id", "huge-int-id", "huge-int-rate",
        "long-rate", "long-devices", "huge-int-factor", "list-reason", "long-reason", "long-steps"])
def test_huge_values_are_refused_in_one_short_line(call):
    """Digit strings Python's int() refuses, ints beyond any float, long texts: a MalleusError
    (never Python's ValueError or OverflowError), whose message shows the value shortened."""
    with pytest.raises(MalleusError) as e:
        call()
    assert type(e.value) is MalleusError and len(str(e.value)) < 300 and "\n" not in str(e.value), str(e.value)[:500]


def test_reasons_are_capped():
    assert check.check_reason(" " + "r" * check.MAX_REASON + " ") == "r" * check.MAX_REASON
    with pytest.raises(MalleusError, match=f"at most {check.MAX_REASON} characters, got {check.MAX_REASON + 1}"):
        check.check_reason("r" * (check.MAX_REASON + 1))
