"""Job files: a scenario (cluster, model, layout, batch, ...) plus what a training run needs.

Format (YAML or JSON); every scenario section (see scenario.py) plus:

    data:    {source: synthetic, seq_len: 64, num_samples: 512, vocab: 256, mode: pack, seed: 0,
              assignment: fixed}   # or length-aware: sequences dealt by predicted time (control/assign.py)
             # python-stdlib also takes corpus_split (pack | documents) and max_files
             # tokens (files from `malleus prepare-data`, Megatron .bin/.idx or plain .bin) takes
             # files: [PREFIX, {path: PREFIX, weight: 2.0}, {path: F.bin, dtype: uint16, offsets: F.npy}]
    train:   {steps: 10, seed: 0, lr: 3.0e-4, warmup_steps: 0, decay: constant, decay_steps: null, min_lr: 0.0,
              decay_fraction: 0.2, weight_decay: 0.1, decay_embeddings: true, grad_clip: 1.0,
              betas: [0.9, 0.95], eps: 1.0e-8, compile: null}
             # compile: each block compiled (regional torch.compile; null: on CUDA, not on CPU). lr: the peak; the schedule (lr_schedule.py): constant | linear | cosine | wsd, reaching
             # min_lr at update decay_steps (null: the job's steps). Weight decay never applies to
             # norm weights, and to the embedding only with decay_embeddings
    eval:    {every: 0, batches: 1, holdout: 0.0}
             # every `every` steps (0: never) the loss on `batches` global batches of held-out samples,
             # forward only under the plan in force; `holdout`: the share of the dataset's samples held
             # out (a seeded choice, never trained on), or (source tokens) a list of files as
             # data.files has them, whose samples are the held-out ones
    emulate: [{device: 3, factor: 3.0, at_step: 2, until_step: 6}]   # demos/tests only, default none
    ray:     {address: null}          # null: start a local Ray cluster; "auto" or host:port: join one
    metrics: {enabled: true, host: 127.0.0.1, port: 0, sd_dir: null}
             # Prometheus endpoint of the job's coordinator; port 0 = any free port; sd_dir: where the
             # file-SD target is written (null: <Ray temp dir>/malleus/metrics_sd)
    logging: {tensorboard: null}
             # a directory for TensorBoard event files (loss, eval loss, lr, grad norm, tokens/s, MFU,
             # straggling rates, plan changes), written by the job's driver
    checkpoint: {dir: null, every: 0, keep: 3}
             # plan-agnostic checkpoints every `every` steps under `dir` (null/0: none); a job that finds
             # one there resumes from it, and its coordinator restarts from it if it dies. Each worker
             # writes its own files there: `dir` is a file system every node sees, or an object
             # store's URI (s3://bucket/prefix, gs://, abfs://; endpoint and credentials from the
             # driver's environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)
    control: {window: 3, skip: 3, calibrate: 3, skip_after_migration: 2, band: 0.3, threshold: 1.2,
              confirm: 2, min_interval: 3, grace: 0.1, migration_overhead_s: 2.0,
              seconds_per_byte: 2.0e-8, bucket_mb: 64, collective_timeout_s: 120, replace_timeout_s: 60,
              rejoin_check_s: 5, length_window: 50}
             # the coordinator's knobs (control/): measuring, when to re-plan, migration cost, failures

Unknown keys and bad values raise ConfigError naming the field, the value and what is accepted.
This module knows nothing of Ray or torch; the runtime turns `DataConfig` into a dataset spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .fields import Section, key_name
from .locations import ACCEPTED, location
from .lr_schedule import DECAYS, LrSchedule
from .limits import MAX_MEMORY_MB, MAX_PORT, MAX_RATE, MAX_SAMPLES, MAX_SECONDS, MAX_TOKEN_FILES, MAX_WEIGHT
from .files import read_mapping
from .scenario import SCENARIO_KEYS, Scenario

JOB_KEYS = ("data", "train", "eval", "emulate", "ray", "metrics", "logging", "checkpoint", "control")
DATA_SOURCES = ("synthetic", "python-stdlib", "tokens")
TOKEN_DTYPES = ("uint16", "uint32")   # a plain .bin's ids (Megatron files say theirs)
# How samples become a micro-batch (datasets.collate): "pack" concatenates variable-length samples
# into one row (no padding), "pad" pads every sample to seq_len.
DATA_MODES = ("pack", "pad")
# How a global batch is dealt to pipelines and micro-batches: the plan's fixed split (contiguous
# slices, micro_batch_size samples each) or length-aware (control/assign.py: balance time, not samples).
ASSIGNMENTS = ("fixed", "length-aware")
# How the python-stdlib corpus is cut into samples: fixed chunks ("pack") or one file per sample,
# split at seq_len + 1 ("documents": variable lengths).
CORPUS_SPLITS = ("pack", "documents")


@dataclass(frozen=True)
class TokenFileConfig:
    """One file of a `tokens` corpus: a Megatron prefix or a plain .bin, and its weight in the blend."""
    path: str
    weight: float = 1.0     # times its samples appear per epoch (0.5: a seeded half)
    dtype: str = "uint16"   # plain .bin only
    offsets: str | None = None   # plain .bin only: .npy of document start offsets (none: one stream)

    def spec(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"
    seq_len: int = 64
    num_samples: int | None = 1024   # synthetic: the dataset size; python-stdlib: a cap (None = all)
    vocab: int = 256
    mode: str = "pack"
    seed: int = 0
    corpus_split: str = "pack"        # python-stdlib only
    max_files: int | None = None      # python-stdlib only: use the first files (sorted), for speed
    assignment: str = "fixed"         # fixed | length-aware (pack mode only)
    files: tuple[TokenFileConfig, ...] = ()   # tokens only

    def spec(self) -> dict[str, Any]:
        """The dataset spec `runtime.datasets.build_dataset` reads."""
        if self.source == "synthetic":
            return {"source": "synthetic", "seq_len": self.seq_len, "num_samples": self.num_samples,
                    "vocab": self.vocab, "seed": self.seed}
        if self.source == "tokens":
            return {"source": "tokens", "seq_len": self.seq_len, "files": [f.spec() for f in self.files],
                    "vocab": self.vocab, "seed": self.seed}
        return {"source": "python-stdlib", "seq_len": self.seq_len, "mode": self.corpus_split,
                "max_files": self.max_files, "num_samples": self.num_samples, "vocab": self.vocab}


@dataclass(frozen=True)
class TrainConfig:
    """A run's optimisation: its defaults are the project's (the runtime's OptimConfig takes them)."""
    steps: int = 10
    seed: int = 0
    lr: float = 3e-4                  # the peak learning rate
    schedule: LrSchedule = LrSchedule()
    weight_decay: float = 0.1
    decay_embeddings: bool = True     # norm weights are never decayed
    grad_clip: float | None = 1.0     # max global grad norm; None: no clipping
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    compile: bool | None = None       # regional torch.compile of each block; None: on CUDA only

    def lr_at(self, step: int) -> float:
        return self.schedule.lr_at(step, self.lr)


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0          # steps between evaluations; 0: none
    batches: int = 1        # global batches of held-out samples per evaluation
    holdout: float = 0.0    # the share of the dataset's samples held out, never trained on
    files: tuple[TokenFileConfig, ...] = ()   # or held-out files (source tokens), appended to the corpus

    @property
    def enabled(self) -> bool:
        return self.every > 0


@dataclass(frozen=True)
class EmulateEntry:
    """Slow `device` by `factor` for steps at_step <= step < until_step (None: to the end)."""

    device: int
    factor: float
    at_step: int = 0
    until_step: int | None = None


@dataclass(frozen=True)
class EmulatedDevice:
    """The accelerator a CPU worker stands in for: its FLOP/s, memory bandwidth and the fixed time
    of an op per block it runs through (launches). None (`auto`): sized at start so that the host
    keeps pace with all its workers computing at once."""

    tflops: float | None = None
    gbps: float | None = None
    block_ms: float | None = None

    @property
    def block_seconds(self) -> float | None:
        return None if self.block_ms is None else self.block_ms / 1e3

    @property
    def flops_per_second(self) -> float | None:
        return None if self.tflops is None else self.tflops * 1e12

    @property
    def bytes_per_second(self) -> float | None:
        return None if self.gbps is None else self.gbps * 1e9


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    host: str = "127.0.0.1"   # loopback unless the operator opens it: metrics reveal the job's shape
    port: int = 0             # 0: any free port (several jobs per node never collide)
    sd_dir: str | None = None


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: str | None = None     # a directory for TensorBoard event files


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 0          # steps between checkpoints; 0: none (a dir alone still resumes)
    keep: int = 3

    @property
    def enabled(self) -> bool:
        return self.dir is not None


@dataclass(frozen=True)
class ControlConfig:
    """The coordinator's knobs; these defaults are the only ones."""
    window: int = 3                      # iterations in a device's rate window (median of them)
    skip: int = 3                        # first iterations not measured (allocator, caches warm up)
    calibrate: int = 3                   # measured iterations that calibrate the healthy unit time
    skip_after_migration: int = 2        # new engines warm up too: their first iterations are not measured
    band: float = 0.3                    # a rate must move this much to trigger a re-plan
    threshold: float = 1.2               # rates below it are healthy (1.0) for the planner
    confirm: int = 2                     # checks in a row a shift below twice the band must persist
    min_interval: int = 3                # iterations between re-plans triggered by rates
    grace: float = 0.1                   # a boundary waits up to grace x an iteration for a plan being made
    migration_overhead_s: float = 2.0    # fixed cost of a migration until one was measured
    seconds_per_byte: float = 2e-8       # 50 MB/s: conservative until a migration was measured
    bucket_mb: int = 64                  # migration transfer bucket
    collective_timeout_s: float = 120.0  # a collective slower than this is a failure
    replace_timeout_s: float = 60.0      # a lost (or, at start, unplaced) device with no worker by then is gone
    rejoin_check_s: float = 5.0          # while devices are gone, how often to look for them
    length_window: int = 50              # batches of length statistics kept

    def with_overrides(self, overrides: dict[str, Any], source: str | None = "overrides") -> "ControlConfig":
        """These knobs with some replaced (checked like the job file's `control` section)."""
        return parse_control(Section({**self.__dict__, **overrides}, "control", source))


@dataclass(frozen=True)
class JobConfig:
    name: str
    scenario: Scenario
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig = EvalConfig()
    emulate: tuple[EmulateEntry, ...] = ()          # emulated stragglers
    emulated_device: EmulatedDevice = EmulatedDevice()
    emulation_allowed: bool = False                 # the file has an `emulate` section: the `emulate` call works
    ray: RayConfig = RayConfig()
    metrics: MetricsConfig = MetricsConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    control: ControlConfig = ControlConfig()
    source: str | None = None

    @property
    def shape(self):
        return self.scenario.shape

    @property
    def num_devices(self) -> int:
        return self.scenario.num_devices

    def dataset_spec(self) -> dict[str, Any]:
        """The workers' dataset (`runtime.datasets.build_dataset`): the data's, and after its files
        the held-out ones, if the evaluation names files."""
        spec = self.data.spec()
        if self.eval.files:
            spec["files"] = spec["files"] + [f.spec() for f in self.eval.files]
        return spec

    @classmethod
    def from_dict(cls, d: Any, source: str | None = None) -> "JobConfig":
        if not isinstance(d, dict):
            raise ConfigError("job", d, "expected a mapping at the top level", source)
        known = set(SCENARIO_KEYS) | set(JOB_KEYS)
        for k in d:
            if k not in known:
                raise ConfigError(key_name(k), d[k], f"unknown top-level field; known fields: {', '.join(sorted(known))}",
                                  source)
        scenario = Scenario.from_dict({k: v for k, v in d.items() if k in SCENARIO_KEYS}, source=source)
        shape = scenario.shape
        if shape is None:
            raise ConfigError("model", d.get("model"), "training needs a full model shape (a preset name, or "
                              "layers, hidden, heads, ffn, vocab, seq_len), not only `layers`", source)
        data = _parse_data(Section(d.get("data"), "data", source), shape)
        train = _parse_train(Section(d.get("train"), "train", source))
        evaluation = _parse_eval(Section(d.get("eval"), "eval", source), data)
        emulate, emulated_device = _parse_emulate(d.get("emulate"), scenario.num_devices, source)
        ray_cfg = _parse_ray(Section(d.get("ray"), "ray", source))
        metrics = parse_metrics(Section(d.get("metrics"), "metrics", source))
        logging = _parse_logging(Section(d.get("logging"), "logging", source))
        checkpoint = parse_checkpoint(Section(d.get("checkpoint"), "checkpoint", source))
        control = parse_control(Section(d.get("control"), "control", source))
        return cls(name=scenario.name if "name" in d else "job", scenario=scenario, data=data, train=train,
                   eval=evaluation,
                   emulate=emulate, emulated_device=emulated_device, emulation_allowed="emulate" in d,
                   ray=ray_cfg, metrics=metrics, logging=logging,
                   checkpoint=checkpoint, control=control, source=source)


def load_job_config(path: str | Path) -> JobConfig:
    return JobConfig.from_dict(read_mapping(path), source=str(path))


def load_scenario_of(path: str | Path) -> Scenario:
    """The scenario of a scenario file, or of a job file (checked whole, as `malleus train` would)."""
    d = read_mapping(path)
    if isinstance(d, dict) and set(map(str, d)) & set(JOB_KEYS):
        return JobConfig.from_dict(d, source=str(path)).scenario
    return Scenario.from_dict(d, source=str(path))


# ---------------------------------------------------------------------- sections
def _parse_data(s: Section, shape) -> DataConfig:
    d = DataConfig()    # the defaults; seq_len and vocab default to the model's
    source = s.choice("source", DATA_SOURCES, d.source)
    seq_len = s.int("seq_len", shape.seq_len, minimum=2)
    if seq_len > shape.seq_len:
        raise s.error("seq_len", seq_len, f"at most the model's seq_len ({shape.seq_len})")
    vocab = s.int("vocab", 256 if source == "python-stdlib" else shape.vocab, minimum=2)
    if vocab > shape.vocab:
        raise s.error("vocab", vocab, f"at most the model's vocab ({shape.vocab}): token ids must fit the embedding")
    if source == "python-stdlib" and vocab < 256:
        raise s.error("vocab", vocab, "python-stdlib is byte-level: vocab must be >= 256 (and the model's vocab too)")
    if source == "synthetic":
        num_samples = s.int("num_samples", d.num_samples, minimum=1, maximum=MAX_SAMPLES)
    elif source == "tokens":
        if s.has("num_samples"):
            raise s.error("num_samples", s.raw("num_samples"), "not for source tokens (its files set the count; "
                          "a weight below 1 takes a part of a file)")
        num_samples = None
    else:
        num_samples = s.raw("num_samples", None)
        num_samples = None if num_samples is None else s.int("num_samples", minimum=1, maximum=MAX_SAMPLES)
    max_files = s.raw("max_files", None)
    if max_files is not None:
        if source != "python-stdlib":
            raise s.error("max_files", max_files, "only for source python-stdlib")
        max_files = s.int("max_files", minimum=1)
    split = s.choice("corpus_split", CORPUS_SPLITS, d.corpus_split)
    if s.has("corpus_split") and source != "python-stdlib":
        raise s.error("corpus_split", split, "only for source python-stdlib")
    cfg = DataConfig(
        source=source,
        seq_len=seq_len,
        num_samples=num_samples,
        vocab=vocab,
        mode=s.choice("mode", DATA_MODES, d.mode),
        seed=s.int("seed", d.seed, minimum=0),
        corpus_split=split,
        max_files=max_files,
        assignment=s.choice("assignment", ASSIGNMENTS, d.assignment),
        files=_parse_token_files(s) if source == "tokens" else (),
    )
    if cfg.assignment == "length-aware" and cfg.mode != "pack":
        raise s.error("assignment", cfg.assignment, "length-aware needs mode: pack (padded rows all cost the same)")
    s.done()
    return cfg


def _parse_token_files(s: Section, key: str = "files") -> tuple[TokenFileConfig, ...]:
    files = s.raw(key)
    if not isinstance(files, list) or not files or len(files) > MAX_TOKEN_FILES:
        raise s.error(key, files, f"a list of 1 to {MAX_TOKEN_FILES} files: a path (Megatron prefix or .bin) "
                      "or {path, weight, dtype, offsets}")
    out = []
    for i, entry in enumerate(files):
        f = Section({"path": entry} if isinstance(entry, str) else entry, f"{s.path}.{key}[{i}]", s.source)
        path = f.raw("path")
        if not isinstance(path, str) or not path:
            raise f.error("path", path, "a non-empty path: a Megatron prefix (PREFIX.bin + PREFIX.idx) or a plain .bin")
        offsets = f.raw("offsets", None)
        if offsets is not None and not isinstance(offsets, str):
            raise f.error("offsets", offsets, "a path to a .npy of document start offsets")
        out.append(TokenFileConfig(path=path, weight=f.float("weight", 1.0, minimum=0, exclusive=True, maximum=MAX_WEIGHT),
                                   dtype=f.choice("dtype", TOKEN_DTYPES, "uint16"), offsets=offsets))
        f.done()
    return tuple(out)


def _parse_train(s: Section) -> TrainConfig:
    d = TrainConfig()
    clip = s.raw("grad_clip", d.grad_clip)
    if clip is not None:
        clip = s.float("grad_clip", clip, minimum=0, exclusive=True)
    betas = s.float_list("betas", list(d.betas), minimum=0)
    if betas is None or len(betas) != 2 or not all(b < 1.0 for b in betas):
        raise s.error("betas", None if betas is None else list(betas), "expected two numbers in [0, 1), e.g. [0.9, 0.95]")
    steps = s.int("steps", d.steps, minimum=1)
    lr = s.float("lr", d.lr, minimum=0, exclusive=True)
    cfg = TrainConfig(
        steps=steps,
        seed=s.int("seed", d.seed, minimum=0),
        lr=lr,
        schedule=_parse_schedule(s, steps, lr),
        weight_decay=s.float("weight_decay", d.weight_decay, minimum=0),
        decay_embeddings=s.bool("decay_embeddings", d.decay_embeddings),
        grad_clip=clip,
        betas=(betas[0], betas[1]),
        eps=s.float("eps", d.eps, minimum=0, exclusive=True),
        compile=None if s.raw("compile", d.compile) is None else s.bool("compile", False),
    )
    s.done()
    return cfg


def _parse_schedule(s: Section, steps: int, lr: float) -> LrSchedule:
    d = LrSchedule()
    warmup = s.int("warmup_steps", d.warmup_steps, minimum=0)
    decay = s.choice("decay", DECAYS, d.decay)
    decay_steps = s.int("decay_steps", steps, minimum=1)
    if decay != "constant" and decay_steps <= warmup:
        raise s.error("decay_steps", decay_steps, f"expected more steps than warmup_steps ({warmup}) "
                                                  f"for a {decay} decay")
    min_lr = s.float("min_lr", d.min_lr, minimum=0)
    if min_lr > lr:
        raise s.error("min_lr", min_lr, f"expected at most lr ({lr:g})")
    fraction = s.float("decay_fraction", d.decay_fraction, minimum=0, exclusive=True, maximum=1.0)
    return LrSchedule(warmup_steps=warmup, decay=decay, decay_steps=None if decay == "constant" else decay_steps,
                      min_lr=min_lr, decay_fraction=fraction)


def _parse_emulate(v: Any, num_devices: int, source: str | None) -> tuple[tuple[EmulateEntry, ...], EmulatedDevice]:
    """`emulate`: a list of straggler entries, or {device: auto | {tflops, gbps, block_ms}, stragglers: [...]}."""
    if isinstance(v, dict):
        s = Section(v, "emulate", source)
        device = _parse_emulated_device(s.raw("device", "auto"), source)
        stragglers = s.raw("stragglers", None)
        s.done()
        return _parse_stragglers(stragglers, "emulate.stragglers", num_devices, source), device
    return _parse_stragglers(v, "emulate", num_devices, source), EmulatedDevice()


def _parse_emulated_device(v: Any, source: str | None) -> EmulatedDevice:
    if v == "auto":
        return EmulatedDevice()
    if not isinstance(v, dict):
        raise ConfigError("emulate.device", v, '"auto" (sized to the host) or {tflops: T, gbps: G, block_ms: L} '
                          "(any may be auto)", source)
    s = Section(v, "emulate.device", source)
    out = {k: None if s.raw(k, "auto") == "auto" else s.float(k, minimum=0.0, exclusive=True) for k in ("tflops", "gbps")}
    out["block_ms"] = None if s.raw("block_ms", "auto") == "auto" else s.float("block_ms", minimum=0.0)
    s.done()
    return EmulatedDevice(**out)


def _parse_stragglers(v: Any, where: str, num_devices: int, source: str | None) -> tuple[EmulateEntry, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ConfigError(where, v, "expected a list of {device, factor, at_step, until_step} entries", source)
    out = []
    for i, raw in enumerate(v):
        s = Section(raw, f"{where}[{i}]", source)
        dev = s.int("device")
        if not 0 <= dev < num_devices:
            raise s.error("device", dev, f"expected a device id in 0..{num_devices - 1}")
        factor = s.float("factor", minimum=1.0, maximum=MAX_RATE)
        at = s.int("at_step", 0, minimum=0)
        until = s.raw("until_step", None)
        if until is not None:
            until = s.int("until_step", minimum=at + 1)
        s.done()
        out.append(EmulateEntry(dev, factor, at, until))
    return tuple(out)


def _parse_ray(s: Section) -> RayConfig:
    addr = s.raw("address", None)
    if addr is not None and (not isinstance(addr, str) or not addr.strip()):
        raise s.error("address", addr, 'expected null (start a local cluster), "auto", or "host:port"')
    s.done()
    return RayConfig(address=addr)


def parse_metrics(s: Section) -> MetricsConfig:
    d = MetricsConfig()
    host = s.raw("host", d.host)
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
        raise s.error("host", host, 'an address to bind, e.g. "127.0.0.1" (default) or "0.0.0.0" (all interfaces)')
    port = s.int("port", d.port, minimum=0)
    if port > MAX_PORT:
        raise s.error("port", port, f"a TCP port in 0..{MAX_PORT} (0: any free port)")
    sd_dir = s.raw("sd_dir", None)
    if sd_dir is not None and (not isinstance(sd_dir, str) or not sd_dir.strip()):
        raise s.error("sd_dir", sd_dir, "a directory path, or null for <Ray temp dir>/malleus/metrics_sd")
    cfg = MetricsConfig(enabled=s.bool("enabled", d.enabled), host=host.strip(), port=port, sd_dir=sd_dir)
    s.done()
    return cfg


def parse_checkpoint(s: Section) -> CheckpointConfig:
    d = CheckpointConfig()
    path = s.raw("dir", None)
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise s.error("dir", path, "a directory path (created if missing), an object-store URI, or null "
                                   "for no checkpoints")
    if path is not None:
        try:
            location(path)
        except ValueError:
            raise s.error("dir", path, ACCEPTED) from None
    every = s.int("every", d.every, minimum=0)
    if every and path is None:
        raise s.error("every", every, "0 unless checkpoint.dir is set (where would they go?)")
    cfg = CheckpointConfig(dir=path, every=every, keep=s.int("keep", d.keep, minimum=1))
    s.done()
    return cfg


def _parse_eval(s: Section, data: DataConfig) -> EvalConfig:
    d = EvalConfig()
    every, batches = s.int("every", d.every, minimum=0), s.int("batches", d.batches, minimum=1)
    if isinstance(s.raw("holdout", None), list):
        if data.source != "tokens":
            raise s.error("holdout", s.raw("holdout"), "a share of the samples: held-out files are for data.source "
                                                       "tokens")
        files = _parse_token_files(s, "holdout")
        trained = {f.path for f in data.files} & {f.path for f in files}
        if trained:
            raise s.error("holdout", sorted(trained)[0], "a file that data.files does not name: held-out samples "
                                                         "are never trained on")
        cfg = EvalConfig(every=every, batches=batches, files=files)
    else:
        cfg = EvalConfig(every=every, batches=batches, holdout=s.float("holdout", d.holdout, minimum=0, maximum=0.5))
    if cfg.every and not (cfg.holdout or cfg.files):
        raise s.error("holdout", cfg.holdout, "a share of the samples above 0 (at most 0.5), or a list of files, when "
                                              "eval.every is set: the evaluation needs samples the job never trains on")
    s.done()
    return cfg


def _parse_logging(s: Section) -> LoggingConfig:
    tensorboard = s.raw("tensorboard", None)
    if tensorboard is not None and (not isinstance(tensorboard, str) or not tensorboard.strip()):
        raise s.error("tensorboard", tensorboard, "a directory path for TensorBoard event files, or null")
    s.done()
    return LoggingConfig(tensorboard=tensorboard)


def parse_control(s: Section) -> ControlConfig:
    d = ControlConfig()
    if s.has("warmup"):
        raise s.error("warmup", s.raw("warmup"), "renamed control.calibrate (the iterations that calibrate the "
                                                 "healthy unit time); train.warmup_steps is the learning-rate warm-up")
    cfg = ControlConfig(
        window=s.int("window", d.window, minimum=1),
        skip=s.int("skip", d.skip, minimum=0),
        calibrate=s.int("calibrate", d.calibrate, minimum=1),
        skip_after_migration=s.int("skip_after_migration", d.skip_after_migration, minimum=0),
        band=s.float("band", d.band, minimum=0, exclusive=True),
        threshold=s.float("threshold", d.threshold, minimum=1.0, maximum=MAX_RATE),
        confirm=s.int("confirm", d.confirm, minimum=1),
        min_interval=s.int("min_interval", d.min_interval, minimum=0),
        grace=s.float("grace", d.grace, minimum=0),
        migration_overhead_s=s.float("migration_overhead_s", d.migration_overhead_s, minimum=0, maximum=MAX_SECONDS),
        seconds_per_byte=s.float("seconds_per_byte", d.seconds_per_byte, minimum=0),
        bucket_mb=s.int("bucket_mb", d.bucket_mb, minimum=1, maximum=MAX_MEMORY_MB),
        collective_timeout_s=s.float("collective_timeout_s", d.collective_timeout_s, minimum=0, exclusive=True, maximum=MAX_SECONDS),
        replace_timeout_s=s.float("replace_timeout_s", d.replace_timeout_s, minimum=0, exclusive=True, maximum=MAX_SECONDS),
        rejoin_check_s=s.float("rejoin_check_s", d.rejoin_check_s, minimum=0, maximum=MAX_SECONDS),
        length_window=s.int("length_window", d.length_window, minimum=1),
    )
    s.done()
    return cfg
