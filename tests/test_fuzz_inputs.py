"""Property-based fuzzing of every user-facing input: job and scenario files, rate arguments, and
the coordinator's client calls. The only acceptable outcomes are success or the project's own
clear error (ConfigError naming the field / MalleusError saying why); a refused call changes
nothing. Any other exception is a traceback from deep inside, and fails."""
from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from _host import Section
from malleus_svc.config import ConfigError
from malleus_svc.config.job import JOB_KEYS, JobConfig
from malleus_svc.config.scenario import SCENARIO_KEYS, Scenario
from malleus_svc.control.coordinator import JobCoordinator, MalleusError
from malleus_svc.control.requests import CallBudget
from malleus_svc.control.state import JobState, RoundState
from malleus_svc.config.scenario import parse_rate_assignments
from malleus_svc.planner.build import build_problem

REPO = Path(__file__).resolve().parent.parent
BASE = yaml.safe_load((REPO / "examples/tiny_job.yaml").read_text())
BASE["checkpoint"] = {"dir": "/tmp/x", "every": 2, "keep": 2}
BASE["metrics"] = {"host": "127.0.0.1", "port": 0}
BASE["rates"] = {1: 2.0}
BASE["emulate"] = [{"device": 3, "factor": 3.0, "at_step": 4, "until_step": 8}]

# Keys of any type a YAML file can give (not only text), numbers up to 10**400 and every float
# (1e308, nan, inf), as well as the small values a careless edit gives.
keys = st.text(max_size=8) | st.integers() | st.floats() | st.booleans() | st.none()
numbers = (st.integers(-10**6, 10**6) | st.integers(-10**400, 10**400) | st.floats()
           | st.sampled_from([1e308, -1e308, math.nan, math.inf, -math.inf, 10**400, 2**63, 0.5, -0.0]))
junk = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=8)


def _paths(d, prefix=()):
    """Every key path of a nested mapping/list (the places a mutation can hit)."""
    out = [prefix] if prefix else []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _paths(v, prefix + (i,))
    return out


PATHS = _paths(BASE)


@st.composite
def mutated_job(draw):
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            if draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(path[-1], None)                 # a missing field
            else:
                parent[path[-1]] = draw(junk)               # a wrong value
        except (KeyError, IndexError, TypeError):           # an earlier mutation removed the parent
            pass
    if draw(st.integers(0, 3)) == 0:
        doc[draw(keys)] = draw(junk)                # an unknown key, of any type
    return doc


def _section(e: ConfigError) -> str:
    """The top-level section an error is in ("data" for "data.seq_len")."""
    return re.split(r"[.\[]", str(e.field))[0]


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_job_files_either_load_or_name_the_field():
    """Each mutated job file loads or names the field; and the job sections are parsed whatever
    happened to the scenario sections: each example runs again with the scenario sections intact.
    A good share of the runs must reach the job sections (else this fuzzes nothing of them)."""
    reached: list[bool] = []     # per run: were the job sections parsed (a job, or an error in one)?

    @FUZZ
    @given(mutated_job())
    def one(doc):
        job_only = {**{k: v for k, v in doc.items() if k in JOB_KEYS}, **{k: BASE[k] for k in SCENARIO_KEYS if k in BASE}}
        for d in (doc, job_only):
            try:
                job = JobConfig.from_dict(d)
            except ConfigError as e:
                assert e.field and e.accepted, e
                reached.append(_section(e) in JOB_KEYS)
                continue
            assert job.num_devices >= 1 and job.train.steps >= 1
            reached.append(True)

    one()
    assert len(reached) >= 200 and sum(reached) >= 0.4 * len(reached), (sum(reached), len(reached))


def test_scenarios_either_load_and_plan_or_name_the_field():
    """Every scenario that validates is planned: a plan (finite, standard JSON) or a documented
    error (InfeasibleError, ConfigError) saying why. A good share of the examples must validate and
    reach plan(), else this tests nothing of the planner."""
    from malleus_svc.planner import InfeasibleError, plan
    outcomes: list[str] = []

    @FUZZ
    @given(mutated_job())
    def one(doc):
        try:
            problem = build_problem(Scenario.from_dict({k: v for k, v in doc.items() if k not in JOB_KEYS}))
        except ConfigError as e:
            assert e.field and e.accepted, e
            outcomes.append("refused")
            return
        try:
            result = plan(problem)
        except (InfeasibleError, ConfigError) as e:     # a valid file no plan can satisfy: says why
            assert str(e)
            outcomes.append("infeasible")
            return
        assert problem.num_devices >= 1 and result.plan.num_devices == problem.num_devices
        assert math.isfinite(result.plan.objective_value) and json.loads(result.plan.to_json())
        outcomes.append("planned")

    one()
    reached = len(outcomes) - outcomes.count("refused")
    assert len(outcomes) >= 200 and reached >= 0.25 * len(outcomes) and outcomes.count("planned") >= 0.2 * len(outcomes), \
        {k: outcomes.count(k) for k in set(outcomes)}


@st.composite
def large_layout(draw):
    """A valid layout of 2^4 .. 2^16 devices (8 per node) of any dp x tp x pp that fills them, with
    a few stragglers anywhere."""
    devices = 2 ** draw(st.integers(4, 16))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    model = draw(st.sampled_from(["gpt-1.3b", "llama-70b"]))
    layers = {"gpt-1.3b": 24, "llama-70b": 80}[model]
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8, 16) if p <= layers and tp * p <= devices]))
    dp = devices // (tp * pp)
    rates = draw(st.dictionaries(st.integers(0, devices - 1), st.sampled_from([1.5, 3.0, 8.0, 1e6]), max_size=4))
    return {"name": "large", "cluster": {"nodes": devices // 8, "gpus_per_node": 8, "gpu_memory_mb": 81920},
            "model": model, "parallel": {"dp": dp, "tp": tp, "pp": pp},
            "batch": {"global": dp * pp * draw(st.sampled_from([1, 2, 4])), "micro": 1}, "rates": rates,
            "planner": {"time_budget_s": 1}}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(large_layout())
@example({"name": "largest", "cluster": {"nodes": 8192, "gpus_per_node": 8, "gpu_memory_mb": 81920},
          "model": "gpt-1.3b", "parallel": {"dp": 16384, "tp": 1, "pp": 4}, "batch": {"global": 65536, "micro": 1},
          "rates": {5: 3.0, 29: 2.0, 100: 5.0}, "planner": {"time_budget_s": 1}})
@example({"name": "dead-beside-thousands", "cluster": {"nodes": 1024, "gpus_per_node": 8, "gpu_memory_mb": 81920},
          "model": "gpt-1.3b", "parallel": {"dp": 4096, "tp": 1, "pp": 2}, "batch": {"global": 32768, "micro": 1},
          "rates": {7851: 1.5, 1835: 1e6, 258: 1e6, 80: 8.0}, "planner": {"time_budget_s": 1}})
def test_any_valid_layout_up_to_the_device_limit_plans_within_its_time_budget(doc):
    """The planner end to end at up to 65,536 devices: a plan or a documented error, in about its
    1 s budget (plus the concretisation of its finalists), never a hang or another exception."""
    from malleus_svc.planner import InfeasibleError, plan
    try:
        with Section() as t:
            result = plan(build_problem(Scenario.from_dict(doc)))
    except InfeasibleError as e:
        assert str(e)
        return
    finally:
        # CPU seconds: a hang or runaway work shows there, another process's load does not
        assert t.cpu < 30, (doc["parallel"], t.cpu)
    assert math.isfinite(result.plan.objective_value) and result.plan.num_devices == doc["cluster"]["nodes"] * 8


@FUZZ
@given(st.lists(st.text(max_size=10) | st.builds(lambda d, r: f"{d}={r}", st.integers(-5, 20),
                                                   st.floats(allow_nan=True, allow_infinity=True)), max_size=4))
def test_rate_arguments_either_parse_or_name_the_item(items):
    try:
        out = parse_rate_assignments(items)
    except ConfigError as e:
        assert e.value in items
        return
    assert all(d >= 0 and math.isfinite(r) and r >= 1.0 for d, r in out.items())


@pytest.fixture(scope="module")
def coordinator():
    """The real coordinator on a fake cluster (tests/_fake_workers.py: the worker-group surface,
    no Ray), trained a few iterations: an accepted call goes through a real round (policy,
    planner, migration into the fake cluster)."""
    from _fake_workers import FakeWorkers
    job = JobConfig.from_dict({**{k: v for k, v in BASE.items() if k not in ("checkpoint", "rates")},
                               "metrics": {"enabled": False}, "train": {"steps": 100000}})
    c = JobCoordinator(job, workers=FakeWorkers, grace=1000.0)
    c.calls = CallBudget(job.name, rate=1e9, burst=10**9)   # every example reaches the checks (the limit has its own tests)
    c.setup()
    c.state = JobState.TRAINING
    for _ in range(3):
        c._iteration()
    return c


def settle(c) -> None:
    """Train until no round is in flight or pending (each decided round applied or kept)."""
    for _ in range(50):
        if c.rounds.state is RoundState.IDLE and not c.rounds.pending:
            return
        c._iteration()
    raise AssertionError(f"rounds did not settle: {c.status()['planning']}")


def state(c):
    return (c.plan.plan_id, dict(c.measurement.external), set(c.excluded), len(c.rounds.pending),
            len(c.history.entries), dict(c.hooks.emulation.manual))


calls = st.sampled_from(["set_rates", "exclude", "include", "replan", "emulate"])


@FUZZ
@given(calls, junk, junk)
@example("set_rates", {"²": None}, None)   # isdigit() but not int(): found by CI
@example("exclude", [1], None)
@example("set_rates", {2: 3.0}, None)
def test_client_calls_are_validated_and_refused_calls_change_nothing(coordinator, method, a, b):
    c = coordinator
    before = state(c)
    try:
        getattr(c, method)(a) if method != "replan" else c.replan(a, bool(b))
    except MalleusError as e:
        assert str(e)
        assert state(c) == before
        return
    settle(c)       # what was accepted reaches the planner and the plan the cluster runs
    assert c.group.plan is c.plan and not (set(c.plan.excluded) - c.excluded - c.gone())
    rounds = len(c.history.entries) - before[4]
    assert rounds >= (method in ("set_rates", "exclude", "include", "replan"))   # each request got a round
    # undo, so that every example starts from the same wanted state
    c.hooks.emulation.manual.clear()
    if c.measurement.external:
        c.clear_rates()
    if c.excluded:
        c.include(sorted(c.excluded))
    settle(c)
