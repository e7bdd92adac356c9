"""Scenario files: presets, defaults from the cost model, and clear errors for bad input."""
import copy
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from malleus_svc.config import ConfigError, PRESETS, Scenario, load_scenario
from malleus_svc.config.presets import ModelShape
from malleus_svc.costmodel import analytic
from malleus_svc.config.scenario import BUNDLED
from malleus_svc.planner.build import build_problem

GOOD = {
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_memory_mb": 81920},
    "model": "llama-32b",
    "parallel": {"dp": 2, "tp": 4, "pp": 2},
    "batch": {"global": 64, "micro": 1},
    "rates": {3: 2.5, "12": 1.5},
}


def test_bundled_scenarios_load_and_build_problems():
    names = sorted(p.stem for p in BUNDLED.glob("*.yaml"))
    assert {"paper-fig4-16gpu", "llama70b-64gpu", "llama110b-64gpu"} <= set(names)
    for name in names:
        s = load_scenario(BUNDLED / f"{name}.yaml")
        p = build_problem(s)
        assert len(p.rates) == s.num_devices == p.num_devices
        assert p.num_micro_batches * p.micro_batch_size == s.global_batch


def test_fig4_scenario_matches_the_worked_example():
    p = build_problem(load_scenario(BUNDLED / "paper-fig4-16gpu.yaml"))
    assert p.tp_alpha == (1.0, 2.0, 4.0) and p.memory.budget_mb == 40536 - 4096 - 4500
    assert p.rates[5] == 8.0 and p.rates[10] == 2.0 and p.rates[13] == 5.0 and p.rates[0] == 1.0
    assert p.memory.per_layer_mb(4) == 1500 and p.memory.per_layer_mb(1) == 810


def test_defaults_come_from_the_model_shape():
    s = Scenario.from_dict(GOOD)
    p = build_problem(s)
    assert p.rates[3] == 2.5 and p.rates[12] == 1.5
    # Halving a TP group roughly doubles block time (less TP communication makes it a bit less).
    assert p.tp_alpha[0] == 1.0 and 1.5 < p.tp_alpha[1] < 2.0 and p.tp_alpha[1] < p.tp_alpha[2]
    # More micro-batches in flight need more memory; the list is for d = pp..1.
    assert list(p.memory.layer_mb) == sorted(p.memory.layer_mb, reverse=True)
    assert p.t0_seconds == pytest.approx(analytic.block_seconds(PRESETS["llama-32b"], 4, 1, analytic.DeviceSpec()))
    sizes, shape = p.state_sizes, PRESETS["llama-32b"]
    assert sizes.block + sizes.block_replicated == shape.block_params() * 12 and sizes.block_replicated == 2 * shape.hidden * 12


def test_the_optimizer_step_comes_from_the_memory_bandwidth_or_the_profile():
    """A block's AdamW traffic (28 bytes a parameter over the group) over `device.memory_gbps`, in
    t0 units; a measured `profile.optimizer_seconds` over the profile's t0 instead."""
    shape, spec = PRESETS["llama-32b"], analytic.DeviceSpec()
    want = 28 * shape.block_params() / 4 / (spec.memory_gbps * 1e9) / analytic.block_seconds(shape, 4, 1, spec)
    assert build_problem(Scenario.from_dict(GOOD)).optimizer_per_block == pytest.approx(want)
    faster = copy.deepcopy(GOOD) | {"device": {"memory_gbps": 2 * spec.memory_gbps}}
    assert build_problem(Scenario.from_dict(faster)).optimizer_per_block == pytest.approx(want / 2)
    measured = copy.deepcopy(GOOD) | {"profile": {"t0_seconds": 0.05, "optimizer_seconds": 0.004}}
    assert build_problem(Scenario.from_dict(measured)).optimizer_per_block == pytest.approx(0.08)
    with pytest.raises(ConfigError, match="optimizer_seconds"):
        Scenario.from_dict(copy.deepcopy(GOOD) | {"profile": {"optimizer_seconds": -1}})


def test_the_default_objective_is_the_one_fact_and_full_is_available():
    from malleus_svc.planner import PlannerProblem
    from malleus_svc.config.scenario import DEFAULT_OBJECTIVE

    assert build_problem(Scenario.from_dict(GOOD)).objective == DEFAULT_OBJECTIVE    # no planner section
    fields = {f.name: f for f in dataclasses.fields(PlannerProblem)}
    assert fields["objective"].default == DEFAULT_OBJECTIVE
    d = copy.deepcopy(GOOD)
    for objective in ("full", "paper"):
        d["planner"] = {"objective": objective}
        assert build_problem(Scenario.from_dict(d)).objective == objective


def test_memory_extrapolates_beyond_the_listed_depths():
    p = build_problem(load_scenario(BUNDLED / "paper-fig4-16gpu.yaml"))
    step = 1500 - 1270
    assert p.memory.per_layer_mb(6) == 1500 + 2 * step


def test_model_overrides_and_layers_only():
    d = copy.deepcopy(GOOD)
    d["model"] = {"preset": "llama-32b", "layers": 30}
    assert Scenario.from_dict(d).num_layers == 30
    d["model"] = {"layers": 30}
    with pytest.raises(ConfigError, match="profile.tp_alpha"):
        Scenario.from_dict(d)
    # a Llama 3 preset with another rotary base and no scaling; its numbers survive to_dict/from_dict
    d["model"] = {"preset": "llama3.1-8b", "layers": 16, "rope_theta": 1e6, "rope_scaling": None, "norm_eps": 1e-6}
    shape = Scenario.from_dict(d).shape
    assert (shape.rope_theta, shape.rope_scaling, shape.norm_eps, shape.vocab) == (1e6, None, 1e-6, 128256)
    llama3 = PRESETS["llama3.2-1b"]
    assert ModelShape.from_dict(llama3.to_dict()) == llama3 and llama3.rope_scaling.factor == 32.0


def bad(path, value):
    d = copy.deepcopy(GOOD)
    node = d
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize("scenario, field, hint", [
    (bad(["cluster", "nodes"], 0), "cluster.nodes", ">= 1"),
    (bad(["cluster", "gpus_per_node"], "eight"), "cluster.gpus_per_node", "integer"),
    (bad(["model"], "gpt-9000"), "model", "known presets"),
    (bad(["parallel", "tp"], 3), "parallel.tp", "power of two"),
    (bad(["parallel", "dp"], 4), "parallel", "must equal the device count"),
    (bad(["batch", "global"], 3), "batch.global", "at least"),
    (bad(["batch"], KeyError), "batch", "required"),
    (bad(["rates"], {3: -1}), "rates[3]", "> 0"),
    (bad(["rates"], {3: 0.5}), "rates[3]", ">= 1.0"),
    (bad(["rates"], {3: float("nan")}), "rates[3]", "finite"),
    (bad(["rates"], {99: 2.0}), "rates key", "0..15"),
    (bad(["rates"], [2.0]), "rates", "mapping"),
    (bad(["planner"], {"objective": "fastest"}), "planner.objective", "paper, bubble, full"),
    (bad(["cluster", "gpu_mem"], 1), "cluster.gpu_mem", "unknown field"),
    (bad(["profile"], {"tp_alpha": [1, 2]}), "profile.tp_alpha", "needs 3 values"),
    (bad(["profile"], {"tp_alpha": [2, 3, 4]}), "profile.tp_alpha", "must be 1"),
    (bad(["model"], {"preset": "llama3.1-8b", "rope_theta": 0}), "model.rope_theta", "> 0"),
    (bad(["model"], {"preset": "llama3.1-8b", "rope_scaling": {"factor": 8, "low_freq_factor": 4,
                                                                "high_freq_factor": 1,
                                                                "original_max_position_embeddings": 8192}}),
     "model.rope_scaling.high_freq_factor", "> 4"),
    (bad(["model"], {"preset": "llama3.1-8b", "rope_scaling": {"factor": 8}}), "model.rope_scaling.low_freq_factor",
     "required"),
    (bad(["parallel", "shard_optimizer"], "yes"), "parallel.shard_optimizer", "true or false"),
])
def test_bad_scenarios_name_the_field_and_what_is_accepted(scenario, field, hint):
    with pytest.raises(ConfigError) as e:
        Scenario.from_dict(scenario)
    assert e.value.field == field and hint in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_scenario(tmp_path / "missing.yaml")
    f = tmp_path / "broken.yaml"
    f.write_text("cluster: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_scenario(f)


_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.floats(allow_nan=True),
                    st.text(max_size=5), st.lists(st.integers(-2, 20), max_size=4))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([("cluster", "nodes"), ("cluster", "gpus_per_node"), ("cluster", "gpu_memory_mb"),
                        ("parallel", "dp"), ("parallel", "tp"), ("parallel", "pp"), ("batch", "global"),
                        ("batch", "micro"), ("rates", 3), ("model", None), ("planner", "objective"),
                        ("profile", "tp_alpha"), ("profile", "layer_memory_mb"), ("excluded", None)]),
       _values)
def test_fuzzed_fields_give_config_errors_only(path, value):
    d = copy.deepcopy(GOOD)
    if path[1] is None:
        d[path[0]] = value
    else:
        d.setdefault(path[0], {})[path[1]] = value
    try:
        s = Scenario.from_dict(d)
    except ConfigError as e:
        assert e.field and str(e)
    else:
        build_problem(s)  # whatever parses must also build a problem


def test_the_optimizer_state_is_sharded_as_written_or_as_the_workers_decide():
    """`parallel.shard_optimizer` absent leaves it to the job's workers (GPUs shard); a plan made
    offline then assumes the replicated state, the larger."""
    absent = Scenario.from_dict(GOOD)
    assert absent.shard_optimizer is None
    assert absent.sharding_on(True).shard_optimizer is True and absent.sharding_on(False).shard_optimizer is False
    assert not build_problem(absent).memory.sharded and not build_problem(absent).state_sizes.sharded
    for written in (True, False):
        sc = Scenario.from_dict(bad(["parallel", "shard_optimizer"], written))
        assert sc.shard_optimizer is written and sc.sharding_on(not written).shard_optimizer is written
        assert build_problem(sc).memory.sharded is written and build_problem(sc).state_sizes.sharded is written


def test_tp_sizes_are_the_halvings_of_tp_and_the_planner_groups_by_them():
    from malleus_svc.config.scenario import tp_sizes
    from malleus_svc.planner.grouping import group_sizes
    from malleus_svc.planner.build import build_problem

    assert tp_sizes(1) == (1,) and tp_sizes(16) == (16, 8, 4, 2, 1)
    sc = Scenario.from_dict({"name": "t16", "cluster": {"nodes": 1, "gpus_per_node": 16, "gpu_memory_mb": 80000},
                             "model": {"layers": 2, "hidden": 256, "heads": 16, "ffn": 512, "vocab": 256, "seq_len": 32},
                             "parallel": {"dp": 1, "tp": 16, "pp": 1}, "batch": {"global": 8, "micro": 1}})
    assert sc.tp_sizes == (16, 8, 4, 2, 1)
    assert group_sizes(build_problem(sc)) == list(sc.tp_sizes)
