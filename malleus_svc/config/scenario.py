"""Scenario files: a cluster, a model, a baseline layout, a batch, rates; validated, nothing derived.

`planner.build` turns a scenario into the planner's input; `costmodel.scenario` fills in the profile
terms a scenario leaves out.

Format (YAML or JSON; see README "Scenario format"):

    cluster:  {nodes: 2, gpus_per_node: 8, gpu_memory_mb: 40536}
    model:    llama-70b                  # a preset name, or a mapping:
              # {preset: llama-70b, layers: 40}   (override fields of a preset), or
              # {layers: 32, hidden: 4096, heads: 32, ffn: 11008, vocab: 32000, seq_len: 4096}, or
              # {layers: 32}   (only when `profile` gives tp_alpha, layer_memory_mb and embedding_memory_mb)
    parallel: {dp: 2, tp: 4, pp: 2, shard_optimizer: true}
              # shard_optimizer: fp32 masters and Adam moments split among the pipelines holding each piece
              # (ZeRO-1). Absent: sharded where the job's workers are GPUs, replicated on CPU workers; the
              # first plan, and any plan made offline, assume replicated state (the larger)
    batch:    {global: 64, micro: 1}
    profile:  {tp_alpha: [1, 2, 4], layer_memory_mb: [1500, 1270, 1040, 810], embedding_memory_mb: 600,
               reserved_memory_mb: 4500, safety_margin_mb: 4096, t0_seconds: 0.05, optimizer_seconds: 0.002}
    device:   {peak_tflops: 312, efficiency: 0.45, intra_node_gbps: 200, inter_node_gbps: 25, memory_gbps: 1600}
    rates:    {5: 8.0, 10: 2.0}          # device id -> straggling rate; missing means 1.0
    excluded: [3]                        # devices not part of the job (dead, drained)
    planner:  {objective: paper, straggler_threshold: 1.2, time_limit_s: 10, time_budget_s: 60, mip_gap: 0,
               solver: closed_form, allow_split: true, allow_reshape: true, search: default}
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, get_args

from .device import DeviceSpec
from .errors import ConfigError
from .fields import Section, check_float
from .files import read_mapping
from .hf_config import shape_of_folder
from .limits import (MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_MEMORY_MB, MAX_MODEL_DIM, MAX_NAME,
                     MAX_RATE, MAX_SECONDS)
from .presets import PRESETS, SIZE_FIELDS, ModelShape, RopeScaling

SCENARIO_KEYS = ("name", "cluster", "model", "parallel", "batch", "profile", "device", "rates",
                 "excluded", "planner")
NAME_PATTERN = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAME}}}")   # safe in actor names, paths, logs
Objective = Literal["paper", "bubble", "full"]   # the planner's objectives (planner.problem)
OBJECTIVES: tuple[str, ...] = get_args(Objective)
# 'full' ranks plans as the event simulator times them (1F1B fill and drain, p2p, gradient reduction;
# BENCHMARKS.md, objectives). A scenario prices its communication with the analytic model of its
# `device:`; a running job with the links its workers timed (runtime/link_probe.py). 'paper' is the
# Malleus paper's m_i·z_i.
DEFAULT_OBJECTIVE = "full"

Solver = Literal["closed_form", "highs", "both"]   # how the planner's lower level is solved (planner.lower)
SOLVERS: tuple[str, ...] = get_args(Solver)
Search = Literal["default", "exhaustive"]          # the planner's upper level (planner.search, planner.exhaustive)
SEARCHES: tuple[str, ...] = get_args(Search)


def tp_sizes(tp: int) -> tuple[int, ...]:
    """The TP group sizes a plan may use, largest first: tp, tp/2, ..., 1 (a re-plan splits groups
    to isolate stragglers; tp is a power of two)."""
    return tuple(tp >> r for r in range(tp.bit_length()))


@dataclass(frozen=True)
class Profile:
    """The `profile:` section as given; None means "derive it from the model" (costmodel.scenario)."""

    tp_alpha: tuple[float, ...] | None = None
    layer_memory_mb: tuple[float, ...] | None = None
    embedding_memory_mb: float | None = None
    reserved_memory_mb: float = 4500.0
    safety_margin_mb: float = 4096.0
    t0_seconds: float | None = None
    optimizer_seconds: float | None = None   # one block's optimizer step on a healthy full-size group
    tp_weight: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    nodes: int
    gpus_per_node: int
    gpu_memory_mb: float
    num_layers: int
    shape: ModelShape | None            # None when only `layers` and a full profile are given
    dp: int
    tp: int
    pp: int
    global_batch: int
    micro_batch: int
    profile: Profile = Profile()
    rates: Mapping[int, float] = field(default_factory=dict)
    excluded: frozenset[int] = frozenset()
    planner: Mapping[str, Any] = field(default_factory=dict)
    device: DeviceSpec = field(default_factory=DeviceSpec)   # what the derived profile terms assume
    pretrained: str | None = None       # model.from_pretrained: a Hugging Face LLaMA folder the job starts from
    shard_optimizer: bool | None = None  # the optimizer's state split among the pipelines holding each piece
                                         # (ZeRO-1); None: as the job's workers decide (`sharding_on`)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return tp_sizes(self.tp)

    def sharding_on(self, use_gpu: bool) -> "Scenario":
        """The scenario as a job on these workers runs it: the optimizer's state sharded by default on
        GPUs (where memory binds), replicated on CPU workers, as written where the file says."""
        return self if self.shard_optimizer is not None else dataclasses.replace(self, shard_optimizer=use_gpu)

    def rate_vector(self, rates: Mapping[int, float] | None = None) -> tuple[float, ...]:
        r = self.rates if rates is None else rates
        return tuple(float(r.get(d, 1.0)) for d in range(self.num_devices))

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: Any, source: str | None = None) -> "Scenario":
        root = Section(d, "", source)
        name = parse_name(root)

        cl = root.section("cluster", required=True)
        nodes = cl.int("nodes", minimum=1, maximum=MAX_DEVICES)
        gpn = cl.int("gpus_per_node", minimum=1, maximum=MAX_DEVICES)
        if nodes * gpn > MAX_DEVICES:
            raise cl.error("nodes", nodes, f"nodes x gpus_per_node at most {MAX_DEVICES} devices (limits.MAX_DEVICES)")
        mem_mb = cl.float("gpu_memory_mb", 81920.0, minimum=0, exclusive=True, maximum=MAX_MEMORY_MB)
        cl.done()

        shape, num_layers, pretrained = _parse_model(root, source)

        par = root.section("parallel", required=True)
        dp, tp, pp = par.int("dp", minimum=1), par.int("tp", minimum=1), par.int("pp", minimum=1)
        shard_optimizer = None if par.raw("shard_optimizer", None) is None else par.bool("shard_optimizer")
        par.done()
        if tp & (tp - 1):
            raise ConfigError("parallel.tp", tp, "expected a power of two (groups split into tp/2, tp/4, ..., 1)", source)
        if gpn % tp:
            raise ConfigError("parallel.tp", tp, f"a TP group never spans nodes: tp must divide gpus_per_node = {gpn}", source)
        if dp * tp * pp != nodes * gpn:
            raise ConfigError("parallel", {"dp": dp, "tp": tp, "pp": pp},
                              f"dp x tp x pp = {dp * tp * pp} must equal the device count nodes x gpus_per_node = {nodes * gpn}", source)
        if pp > num_layers:
            raise ConfigError("parallel.pp", pp, f"at most one stage per block: pp <= {num_layers} layers", source)
        if shape is not None:
            for what, n in (("heads", shape.heads), ("kv_heads", shape.n_kv_heads), ("ffn", shape.ffn)):
                if n % tp:
                    raise ConfigError("parallel.tp", tp, f"tp must divide the model's {what} ({n})", source)

        bt = root.section("batch", required=True)
        gb = bt.int("global", minimum=1, maximum=MAX_GLOBAL_BATCH)
        mb = bt.int("micro", 1, minimum=1, maximum=MAX_GLOBAL_BATCH)
        bt.done()
        if gb % mb:
            raise ConfigError("batch.global", gb, f"must be a multiple of batch.micro = {mb}", source)
        if gb // mb < dp * pp:
            raise ConfigError("batch.global", gb, f"needs at least dp x pp = {dp * pp} micro-batches of {mb} "
                              f"(1F1B keeps every stage busy), i.e. global >= {dp * pp * mb}", source)

        dev = _parse_device(root.section("device"))
        prof = root.section("profile")
        tp_alpha = prof.float_list("tp_alpha", None, minimum=1.0, maximum=MAX_RATE)
        n_alpha = int(math.log2(tp)) + 1
        if tp_alpha is None:
            if shape is None:
                raise ConfigError("profile.tp_alpha", None, "required when the model gives only `layers`", source)
        elif len(tp_alpha) < n_alpha:
            raise ConfigError("profile.tp_alpha", list(tp_alpha), f"needs {n_alpha} values, for group sizes "
                              f"{', '.join(str(tp >> r) for r in range(n_alpha))}", source)
        elif abs(tp_alpha[0] - 1.0) > 1e-9:
            raise ConfigError("profile.tp_alpha", list(tp_alpha), "the first value (full-size group) must be 1", source)
        elif any(b < a for a, b in zip(tp_alpha, tp_alpha[1:])):
            raise ConfigError("profile.tp_alpha", list(tp_alpha), "non-decreasing: a smaller TP group is never "
                              "faster per block", source)
        reserved = prof.float("reserved_memory_mb", Profile.reserved_memory_mb, minimum=0, maximum=MAX_MEMORY_MB)
        safety = prof.float("safety_margin_mb", Profile.safety_margin_mb, minimum=0, maximum=MAX_MEMORY_MB)
        layer_mb = prof.float_list("layer_memory_mb", None, minimum=0, exclusive=True, maximum=MAX_MEMORY_MB)
        emb = (prof.float("embedding_memory_mb", minimum=0, maximum=MAX_MEMORY_MB)
               if prof.has("embedding_memory_mb") else None)
        if shape is None:
            for key, v in (("layer_memory_mb", layer_mb), ("embedding_memory_mb", emb)):
                if v is None:
                    raise ConfigError(f"profile.{key}", None, "required when the model gives only `layers`", source)
        t0 = (prof.float("t0_seconds", minimum=0, exclusive=True, maximum=MAX_SECONDS)
              if prof.has("t0_seconds") else None)
        opt = (prof.float("optimizer_seconds", minimum=0, maximum=MAX_SECONDS)
               if prof.has("optimizer_seconds") else None)
        tp_weight = prof.float_list("tp_weight", None, minimum=0, exclusive=True, maximum=MAX_RATE)
        prof.done()
        profile = Profile(tp_alpha=None if tp_alpha is None else tuple(tp_alpha[:n_alpha]),
                          layer_memory_mb=None if layer_mb is None else tuple(layer_mb), embedding_memory_mb=emb,
                          reserved_memory_mb=reserved, safety_margin_mb=safety, t0_seconds=t0,
                          optimizer_seconds=opt,
                          tp_weight=None if tp_weight is None else tuple(tp_weight))

        n = nodes * gpn
        rates = validate_rates(root.raw("rates", {}) or {}, n, source=source)
        excluded = _parse_devices(root.raw("excluded", []) or [], n, "excluded", source)
        planner = _parse_planner(root.section("planner"))
        root.done()
        return cls(name=name, nodes=nodes, gpus_per_node=gpn, gpu_memory_mb=mem_mb, num_layers=num_layers,
                   shape=shape, dp=dp, tp=tp, pp=pp, global_batch=gb, micro_batch=mb, profile=profile,
                   rates=rates, excluded=frozenset(excluded), planner=planner, device=dev, pretrained=pretrained,
                   shard_optimizer=shard_optimizer)


def parse_shape_variant(s: Section) -> dict[str, Any]:
    """A shape's optional generation numbers: `norm_eps`, `rope_theta`, `rope_scaling` (Llama 3's:
    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings; null: none) and
    `tie_embeddings`."""
    out: dict[str, Any] = {}
    if s.has("tie_embeddings"):
        out["tie_embeddings"] = s.bool("tie_embeddings", False)
    if s.has("norm_eps"):
        out["norm_eps"] = s.float("norm_eps", minimum=0, exclusive=True, maximum=1.0)
    if s.has("rope_theta"):
        out["rope_theta"] = s.float("rope_theta", minimum=0, exclusive=True)
    if s.has("rope_scaling"):
        out["rope_scaling"] = None
        if s.raw("rope_scaling") is not None:
            r = s.section("rope_scaling")
            low = r.float("low_freq_factor", minimum=0, exclusive=True)
            high = r.float("high_freq_factor", minimum=low, exclusive=True)
            out["rope_scaling"] = RopeScaling(
                factor=r.float("factor", minimum=0, exclusive=True), low_freq_factor=low, high_freq_factor=high,
                original_max_position_embeddings=r.int("original_max_position_embeddings", minimum=1,
                                                       maximum=MAX_MODEL_DIM))
            r.done()
    return out


def _parse_model(root: Section, source: str | None) -> tuple[ModelShape | None, int, str | None]:
    """(shape, layers, the pretrained folder or None): a preset name, an explicit shape, or
    `from_pretrained: DIR` (the shape from its config.json; `seq_len` may be given beside it)."""
    raw = root.raw("model")
    if isinstance(raw, str):
        if raw not in PRESETS:
            raise ConfigError("model", raw, f"unknown preset; known presets: {', '.join(sorted(PRESETS))}", source)
        return PRESETS[raw], PRESETS[raw].layers, None
    m = Section(raw, "model", source)
    if m.has("from_pretrained"):
        folder = m.raw("from_pretrained")
        if not isinstance(folder, str) or not folder.strip():
            raise m.error("from_pretrained", folder, "a folder path (config.json and *.safetensors)")
        if source and not Path(folder).is_absolute():     # relative to the file that names it
            folder = str(Path(source).parent / folder)
        seq_len = m.int("seq_len", minimum=1, maximum=MAX_MODEL_DIM) if m.has("seq_len") else None
        m.done()
        shape = shape_of_folder(folder, seq_len)
        return shape, shape.layers, folder
    base: dict[str, Any] = {}
    if m.has("preset"):
        name = m.raw("preset")
        if name not in PRESETS:
            raise m.error("preset", name, f"unknown preset; known presets: {', '.join(sorted(PRESETS))}")
        base = PRESETS[name].to_dict()
    for f in SIZE_FIELDS:
        if m.has(f):
            top = MAX_LAYERS if f == "layers" else MAX_MODEL_DIM
            base[f] = None if (f == "kv_heads" and m.raw(f) is None) else m.int(f, minimum=1, maximum=top)
    base.update(parse_shape_variant(m))
    m.done()
    if "layers" not in base:
        raise ConfigError("model.layers", None, "required (or name a preset)", source)
    missing = [f for f in SIZE_FIELDS if f not in base and f != "kv_heads"]
    if missing:
        if len(missing) == len(SIZE_FIELDS) - 2:  # only `layers`: the profile must carry the numbers
            return None, base["layers"], None
        raise ConfigError(f"model.{missing[0]}", None,
                          f"required with an explicit shape (give all of {', '.join(SIZE_FIELDS[:-1])}, or only layers plus a full profile)", source)
    shape = ModelShape(**base)
    if shape.hidden % shape.heads:
        raise ConfigError("model.hidden", shape.hidden, f"must be divisible by heads = {shape.heads}", source)
    if shape.heads % shape.n_kv_heads:
        raise ConfigError("model.kv_heads", shape.kv_heads, f"must divide heads = {shape.heads}", source)
    return shape, shape.layers, None


def _parse_device(s: Section) -> DeviceSpec:
    d = DeviceSpec()
    spec = DeviceSpec(**{f.name: s.float(f.name, getattr(d, f.name), minimum=0, exclusive=True)
                         for f in dataclasses.fields(DeviceSpec)})
    s.done()
    return spec


def _parse_planner(s: Section) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s.has("objective"):
        out["objective"] = s.choice("objective", OBJECTIVES)
    if s.has("solver"):
        out["solver"] = s.choice("solver", SOLVERS)
    if s.has("search"):
        out["search"] = s.choice("search", SEARCHES)
    if s.has("straggler_threshold"):
        out["straggler_threshold"] = s.float("straggler_threshold", minimum=1.0, maximum=MAX_RATE)
    for seconds in ("time_limit_s", "time_budget_s"):
        if s.has(seconds):
            out[seconds] = s.float(seconds, minimum=0, exclusive=True, maximum=MAX_SECONDS)
    if s.has("mip_gap"):
        out["mip_gap"] = s.float("mip_gap", minimum=0)
    for flag in ("allow_split", "allow_reshape"):
        if s.has(flag):
            out[flag] = s.bool(flag)
    s.done()
    return out


def validate_rates(rates: Any, num_devices: int, source: str | None = None,
                   field_name: str = "rates") -> dict[int, float]:
    """device -> rate, each device in range and each rate a number in [1, MAX_RATE] (1 = healthy)."""
    if not isinstance(rates, Mapping):
        raise ConfigError(field_name, rates, "expected a mapping of device id -> straggling rate, e.g. {5: 3.0}", source)
    out: dict[int, float] = {}
    for k, v in rates.items():
        dev = _device_id(k, num_devices, f"{field_name} key", source)
        rate = check_float(v, f"{field_name}[{dev}]", minimum=0, exclusive=True, maximum=MAX_RATE, source=source)
        if rate < 1.0:
            raise ConfigError(f"{field_name}[{dev}]", v, "a straggling rate is time on this device / time on a healthy one, so >= 1.0", source)
        out[dev] = rate
    return out


def parse_device_id(text: str, flag: str, item: str) -> int:
    """A device id typed on a command line (the item it came in, for the error)."""
    try:
        d = int(text)
    except ValueError:
        raise ConfigError(flag, item, "a device id is a non-negative integer, e.g. 3") from None
    if d < 0:
        raise ConfigError(flag, item, "a device id is a non-negative integer, e.g. 3")
    return d


def parse_rate_assignments(items: list[str], flag: str = "--set") -> dict[int, float]:
    """DEVICE=RATE strings -> {device: rate}; finite rates >= 1.0 (the coordinator re-checks devices)."""
    out: dict[int, float] = {}
    for item in items:
        dev, sep, rate = item.partition("=")
        if not sep:
            raise ConfigError(flag, item, "DEVICE=RATE, e.g. 3=2.5")
        d = parse_device_id(dev.strip(), flag, item)
        try:
            r = float(rate)
        except ValueError:
            raise ConfigError(flag, item, "a rate is a number >= 1.0 (1 = healthy, 3 = three times slower)") from None
        if not math.isfinite(r) or not 1.0 <= r <= MAX_RATE:
            raise ConfigError(flag, item, f"a rate is a finite number >= 1.0 and at most {MAX_RATE:g} (1 = healthy, "
                                          "3 = three times slower)")
        out[d] = r
    return out


def _device_id(k: Any, n: int, field_name: str, source: str | None) -> int:
    try:
        dev = int(k) if not isinstance(k, bool) and str(k).strip().lstrip("-").isdigit() else None
    except (TypeError, ValueError):
        dev = None
    if dev is None or not 0 <= dev < n:
        raise ConfigError(field_name, k, f"expected a device id in 0..{n - 1}", source)
    return dev


def _parse_devices(v: Any, n: int, field_name: str, source: str | None) -> list[int]:
    if not isinstance(v, (list, tuple)):
        raise ConfigError(field_name, v, "expected a list of device ids", source)
    return [_device_id(x, n, field_name, source) for x in v]


def parse_name(root: Section) -> str:
    name = root.raw("name", "scenario")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise root.error("name", name, f"1 to {MAX_NAME} letters, digits, '.', '_' or '-' (limits.MAX_NAME)")
    return name


def load_scenario(path: str | Path) -> Scenario:
    return Scenario.from_dict(read_mapping(path), source=str(path))


BUNDLED = Path(__file__).resolve().parent.parent / "scenarios"    # the scenarios that ship with the package


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.yaml"))


def find_scenario(name: str) -> Path | None:
    """A scenario file by its path, or a bundled one by its name (with or without .yaml)."""
    for cand in (Path(name), BUNDLED / name, BUNDLED / f"{name}.yaml"):
        if cand.is_file():
            return cand
    return None
