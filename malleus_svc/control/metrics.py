"""Prometheus metrics of one job, served over HTTP by its coordinator.

Names follow Prometheus conventions: a `malleus_` prefix, base units in the name (`_seconds`,
`_bytes`, `_tokens`), `_total` for counters, histograms for durations. Every series carries the
label `job` (the malleus job name; the scrape config sets `honor_labels: true` so Prometheus keeps
it instead of renaming it `exported_job`), per-device series also `device` and `node` (the
plan's logical node, = the physical node on a GPU cluster).

Counters with a fixed label set (re-plans by reason and outcome) are created at zero when the job
starts, so `increase()` and `rate()` see their first event instead of a series that appears at 1.

Discovery works like Ray's own metrics: the coordinator writes a Prometheus file-SD target list
`<dir>/<job>.json` (default dir: `<Ray temp dir>/malleus/metrics_sd`, i.e. /tmp/ray/malleus/metrics_sd
on a default install) and removes it when the job ends; deploy/prometheus/prometheus.yml globs that
directory. The endpoint binds to 127.0.0.1 unless the job's `metrics.host` says otherwise.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from .state import RequestKind

log = logging.getLogger(__name__)

# Why a round was asked for (the coordinator's request kinds), and how it ended.
REPLAN_REASONS = tuple(k.value for k in RequestKind)
REPLAN_OUTCOMES = ("applied", "kept", "failed", "superseded")
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LENGTH_BUCKETS = tuple(float(2 ** k) for k in range(3, 18))  # 8 .. 128K tokens


class JobMetrics:
    """The job's metric families in a registry of their own (never the process-global one, so two
    jobs in one process, or a test, never collide)."""

    def __init__(self, job: str, gpus_per_node: int):
        self.job, self.gpus_per_node = job, max(1, int(gpus_per_node))
        disable_created_metrics()   # no *_created series: they double the output and no panel reads them
        self._paced: set[int] = set()   # devices with a pace share exported
        self.registry = r = CollectorRegistry(auto_describe=True)
        dev = ("job", "device", "node")
        self.rate = Gauge("malleus_straggling_rate", "Effective straggling rate per device (1 = healthy; "
                          "external set_rates override measured; NaN while not measured)", dev, registry=r)
        self.pace_held = Gauge("malleus_pace_held_ratio", "Share of a CPU worker's ops in the rate window that "
                               "kept its emulated device's pace (when most of its iterations had an op that "
                               "overran, its rate is not measured)", dev, registry=r)
        self.memory = Gauge("malleus_device_memory_bytes", "Memory in use per device at the end of the last "
                            "iteration (CUDA allocated on GPU, worker RSS on CPU)", dev, registry=r)
        self.peak_memory = Gauge("malleus_device_peak_memory_bytes", "Peak memory per device (CUDA max allocated "
                                 "in the last iteration on GPU, worker peak RSS on CPU)", dev, registry=r)
        self.iteration = Histogram("malleus_iteration_seconds", "Wall time of one training iteration", ("job",),
                                   buckets=_SECONDS_BUCKETS, registry=r)
        self.tokens_per_second = Gauge("malleus_tokens_per_second", "Tokens per second of the last iteration",
                                       ("job",), registry=r)
        self.samples_per_second = Gauge("malleus_samples_per_second", "Samples per second of the last iteration",
                                        ("job",), registry=r)
        self.capacity = Gauge("malleus_capacity_tokens_per_second", "Capacity bound: healthy tokens/s x "
                              "sum(1/rate)/N over the job's devices (what a perfect plan could reach)",
                              ("job",), registry=r)
        self.tokens = Counter("malleus_tokens", "Tokens trained on", ("job",), registry=r)
        self.samples = Counter("malleus_samples", "Samples consumed (each exactly once per epoch)", ("job",),
                               registry=r)
        self.iterations = Counter("malleus_iterations", "Training iterations completed", ("job",), registry=r)
        self.loss = Gauge("malleus_loss", "Mean loss of the last global batch", ("job",), registry=r)
        self.lr = Gauge("malleus_learning_rate", "Learning rate of the last update (the job's schedule)", ("job",),
                        registry=r)
        self.grad_norm = Gauge("malleus_grad_norm", "Global gradient norm of the last step, before clipping",
                               ("job",), registry=r)
        self.eval_loss = Gauge("malleus_eval_loss", "Mean loss on the held-out samples at the last evaluation",
                               ("job",), registry=r)
        self.mfu = Gauge("malleus_mfu", "Model FLOPs utilization of the last iteration: the model's FLOPs per "
                         "second over the peak of every device the job holds (CPU workers: their emulated pace)",
                         ("job",), registry=r)
        self.plan_version = Gauge("malleus_plan_version", "Plans applied so far (0 = the initial plan)", ("job",),
                                  registry=r)
        self.plan_info = Gauge("malleus_plan_info", "The plan in force (value 1)", ("job", "plan_id"), registry=r)
        self.stage_layers = Gauge("malleus_plan_stage_layers", "Layers held by each stage of the plan in force",
                                  ("job", "pipeline", "stage", "devices", "first_layer"), registry=r)
        self.pipeline_micro_batches = Gauge("malleus_plan_pipeline_micro_batches", "Micro-batches per pipeline "
                                            "of the plan in force", ("job", "pipeline"), registry=r)
        self.suspended = Gauge("malleus_plan_suspended_devices", "Devices the plan in force gives no work",
                               ("job",), registry=r)
        self.replans = Counter("malleus_replans", "Re-planning rounds by request kind and outcome",
                               ("job", "reason", "outcome"), registry=r)
        self.solve = Histogram("malleus_planner_solve_seconds", "Planner time of one round (all options)",
                               ("job",), buckets=_SECONDS_BUCKETS, registry=r)
        self.migration = Histogram("malleus_migration_seconds", "Wall time of one live migration", ("job",),
                                   buckets=_SECONDS_BUCKETS, registry=r)
        self.migration_bytes = Counter("malleus_migration_bytes", "Bytes of model and optimizer state moved "
                                       "between devices by migrations", ("job",), registry=r)
        self.lengths = Histogram("malleus_sequence_length_tokens", "Lengths of the sequences sampled", ("job",),
                                 buckets=_LENGTH_BUCKETS, registry=r)
        self.length_quantiles = Gauge("malleus_sequence_length_quantile_tokens", "Quantiles of the sequence "
                                      "lengths in the last global batch", ("job", "quantile"), registry=r)
        for reason in REPLAN_REASONS:
            for outcome in REPLAN_OUTCOMES:
                self.replans.labels(job, reason, outcome)
        for fam in (self.iteration, self.tokens, self.samples, self.iterations, self.solve, self.migration,
                    self.migration_bytes, self.lengths):
            fam.labels(job)
        self.plan_version.labels(job).set(0)
        self._server = None
        self._sd_file: Path | None = None
        self.endpoint: str | None = None

    def _dev(self, device: int) -> tuple[str, str, str]:
        return self.job, str(device), str(device // self.gpus_per_node)

    # ------------------------------------------------------------------ updates
    def on_plan(self, plan, version: int) -> None:
        """The plan in force changed (or is the first): its shape replaces the previous one's series."""
        j = self.job
        self.plan_version.labels(j).set(version)
        for fam in (self.plan_info, self.stage_layers, self.pipeline_micro_batches):
            fam.clear()
        self.plan_info.labels(j, plan.plan_id).set(1)
        for p, pipe in enumerate(plan.pipelines):
            self.pipeline_micro_batches.labels(j, str(p)).set(pipe.micro_batches)
            for s, st in enumerate(pipe.stages):
                first, end = st.layers
                self.stage_layers.labels(j, str(p), str(s), ",".join(map(str, st.devices)), str(first)).set(end - first)
        self.suspended.labels(j).set(len([d for d in plan.suspended if d not in plan.excluded]))

    def on_iteration(self, line: Mapping[str, Any], devices: Mapping[int, Mapping[str, Any]],
                     rates: Mapping[int, float], num_devices: int, excluded: Iterable[int],
                     healthy_tokens_per_second: float | None, lengths: Iterable[int] | None,
                     length_quantiles: Mapping[float, float] | None,
                     pace_held: Mapping[int, float] | None = None, unmeasured: Iterable[int] = ()) -> None:
        j, secs = self.job, float(line["iteration_seconds"])
        self.iteration.labels(j).observe(secs)
        self.iterations.labels(j).inc()
        self.tokens.labels(j).inc(line["tokens"])
        self.samples.labels(j).inc(line["samples"])
        self.loss.labels(j).set(line["loss"])
        for gauge, key in ((self.lr, "lr"), (self.grad_norm, "grad_norm"), (self.mfu, "mfu"),
                           (self.eval_loss, "eval_loss")):
            if line.get(key) is not None:
                gauge.labels(j).set(line[key])
        if secs > 0:
            self.tokens_per_second.labels(j).set(line["tokens"] / secs)
            self.samples_per_second.labels(j).set(line["samples"] / secs)
        excluded = set(excluded)
        members = [d for d in range(num_devices) if d not in excluded]
        unmeasured = set(unmeasured)
        for d in range(num_devices):
            self.rate.labels(*self._dev(d)).set(math.nan if d in unmeasured else float(rates.get(d, 1.0)))
        pace_held = pace_held or {}
        for d in self._paced - set(pace_held):   # a device that left: no stale share
            self.pace_held.remove(*self._dev(d))
        for d, share in pace_held.items():
            self.pace_held.labels(*self._dev(d)).set(share)
        self._paced = set(pace_held)
        if healthy_tokens_per_second and members:
            bound = sum(1.0 / max(float(rates.get(d, 1.0)), 1.0) for d in members) / num_devices
            self.capacity.labels(j).set(healthy_tokens_per_second * bound)
        for d, s in devices.items():
            if s.get("memory_bytes") is not None:
                self.memory.labels(*self._dev(d)).set(s["memory_bytes"])
            if s.get("peak_memory_bytes") is not None:
                self.peak_memory.labels(*self._dev(d)).set(s["peak_memory_bytes"])
        if lengths is not None:
            h = self.lengths.labels(j)
            for n in lengths:
                h.observe(float(n))
        for q, v in (length_quantiles or {}).items():
            self.length_quantiles.labels(j, f"{q:g}").set(float(v))

    def on_round(self, kinds: Iterable[str], outcome: str, planning_seconds: float | None) -> None:
        for kind in sorted(set(kinds)):
            self.replans.labels(self.job, kind, outcome).inc()
        if planning_seconds is not None:
            self.solve.labels(self.job).observe(planning_seconds)

    def on_migration(self, seconds: float, moved_bytes: float) -> None:
        self.migration.labels(self.job).observe(seconds)
        self.migration_bytes.labels(self.job).inc(max(float(moved_bytes), 0.0))

    # ------------------------------------------------------------------ serving
    def serve(self, host: str = "127.0.0.1", port: int = 0, sd_dir: str | None = None) -> str:
        """Start the HTTP endpoint (port 0: any free port) and write the file-SD entry; host:port."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound_port = self._server.server_address[1]
        # A wildcard bind is scraped through this node's address, not through 0.0.0.0.
        target_host = host if host not in ("0.0.0.0", "::", "") else _node_ip()
        self.endpoint = f"{target_host}:{bound_port}"
        if sd_dir:
            self._sd_file = write_sd_entry(Path(sd_dir), self.job, self.endpoint)
        return self.endpoint

    def close(self) -> None:
        if self._sd_file is not None:
            self._sd_file.unlink(missing_ok=True)
            self._sd_file = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def write_sd_entry(sd_dir: Path, job: str, target: str) -> Path:
    """Prometheus file-SD: [{"targets": [...], "labels": {...}}], written atomically (Prometheus
    re-reads the file on change and must never see half of it)."""
    sd_dir.mkdir(parents=True, exist_ok=True)
    path = sd_dir / f"{_safe(job)}.json"
    tmp = path.with_suffix(f".json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps([{"targets": [target], "labels": {}}]))
    os.replace(tmp, path)
    return path


def default_sd_dir() -> str | None:
    """<Ray temp dir>/malleus/metrics_sd on this node, beside Ray's own prom_metrics_service_discovery.json."""
    try:
        import ray
        return str(Path(ray.get_runtime_context().get_temp_dir()) / "malleus" / "metrics_sd")
    except Exception:  # not in a Ray process
        return None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _node_ip() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def serve_job_metrics(job, plan, plan_version: int) -> JobMetrics | None:
    """Serve a job's metrics as its `metrics` section says (None when disabled); a port that cannot
    be bound fails the job at start-up, with the reason, rather than leaving it running unobserved."""
    cfg = job.metrics
    if not cfg.enabled:
        return None
    from .requests import MalleusError
    m = JobMetrics(job.name, job.scenario.gpus_per_node)
    try:
        m.serve(cfg.host, cfg.port, cfg.sd_dir or default_sd_dir())
    except OSError as e:
        raise MalleusError(f"metrics: cannot serve on {cfg.host}:{cfg.port} ({e}); set metrics.port to a free "
                           "port, or 0 for any") from None
    m.on_plan(plan, plan_version)
    return m
