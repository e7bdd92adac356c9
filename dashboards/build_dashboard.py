"""Writes dashboards/malleus.json, the Grafana dashboard of malleus-svc jobs.

    python dashboards/build_dashboard.py          # rewrite malleus.json
    python dashboards/build_dashboard.py --check  # exit 1 if malleus.json is not what this writes

Panels are declared compactly below and expanded into Grafana's JSON model (schemaVersion 39,
Grafana >= 10), so the queries stay readable and reviewable here; tests/test_service_e2e.py runs
every PromQL expression of the JSON against a real Prometheus scraping a real job.
Variables: `datasource` (a Prometheus data source) and `job` (the malleus job name).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("malleus.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
J = '{job="$job"}'


def q(expr: str, legend: str = "", **extra) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "range": True, **extra}


def panel(kind: str, title: str, targets: list[dict], w: int, h: int, desc: str = "", **extra) -> dict:
    return {"type": kind, "title": title, "description": desc, "datasource": DS, "targets": targets,
            "gridPos": {"w": w, "h": h}, **extra}


def unit(u: str, **defaults) -> dict:
    return {"fieldConfig": {"defaults": {"unit": u, **defaults}, "overrides": []}}


ROWS: list[tuple[str, list[dict]]] = [
    ("Stragglers and throughput", [
        panel("heatmap", "Straggling rate per device", [q(f"malleus_straggling_rate{J}", "{{device}}")], 12, 9,
              "Effective straggling rate of every device over time (1 = healthy; external set_rates override "
              "measured; a gap while a CPU worker's ops miss their pace: not measured). One row per device.",
              options={"calculate": False, "cellGap": 1, "yAxis": {"axisLabel": "device"},
                       "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "min": 1},
                       "tooltip": {"mode": "single", "yHistogram": False}, "legend": {"show": True}}),
        panel("timeseries", "Throughput against the capacity bound", [
            q(f"malleus_tokens_per_second{J}", "tokens/s (last iteration)"),
            q(f"rate(malleus_tokens_total{J}[$__rate_interval])", "tokens/s (wall clock, incl. re-plans)"),
            q(f"malleus_capacity_tokens_per_second{J}", "capacity bound: healthy x sum(1/rate)/N"),
        ], 12, 9, "What the job trains per second, and what a perfect plan could reach on these devices "
                  "(healthy throughput scaled by the capacity bound).", **unit("none")),
        panel("stat", "Efficiency against the bound", [
            q(f"rate(malleus_tokens_total{J}[$__rate_interval]) / malleus_capacity_tokens_per_second{J}",
              "efficiency")], 4, 5, "Wall-clock tokens/s over the capacity bound.", **unit("percentunit")),
        panel("stat", "Samples consumed", [q(f"malleus_samples_total{J}", "samples")], 4, 5,
              "Samples trained on so far; each is used exactly once per epoch.", **unit("none")),
        panel("timeseries", "Loss", [q(f"malleus_loss{J}", "loss"), q(f"malleus_eval_loss{J}", "eval loss")], 8, 5,
              "Mean loss of each global batch, and on the held-out samples at each evaluation.", **unit("none")),
        panel("timeseries", "Iteration time", [
            q(f"histogram_quantile(0.5, sum by (le) (rate(malleus_iteration_seconds_bucket{J}[$__rate_interval])))",
              "p50"),
            q(f"histogram_quantile(0.9, sum by (le) (rate(malleus_iteration_seconds_bucket{J}[$__rate_interval])))",
              "p90"),
            q(f"rate(malleus_iteration_seconds_sum{J}[$__rate_interval]) / "
              f"rate(malleus_iteration_seconds_count{J}[$__rate_interval])", "mean"),
        ], 8, 8, "Wall time of one training iteration.", **unit("s")),
        panel("timeseries", "Memory per device", [
            q(f"malleus_device_memory_bytes{J}", "{{device}}"),
            q(f"malleus_device_peak_memory_bytes{J}", "{{device}} peak"),
        ], 8, 8, "CUDA memory allocated on GPUs; worker resident set on CPU.", **unit("bytes")),
        panel("timeseries", "Sequence-length quantiles", [
            q(f"malleus_sequence_length_quantile_tokens{J}", "q{{quantile}}")], 8, 8,
              "Quantiles of the sequence lengths of each global batch.", **unit("none")),
        panel("timeseries", "Ops that kept pace per device", [q(f"malleus_pace_held_ratio{J}", "{{device}}")], 24, 6,
              "CPU workers only: the share of each device's ops in the rate window that kept its emulated "
              "accelerator's pace. An op that overran was timed by the host's load; when most of a device's "
              "iterations in the window had one, its rate is not measured (it starts no re-plan) until its "
              "ops keep pace again.", **unit("percentunit", min=0, max=1)),
    ]),
    ("Training", [
        panel("timeseries", "Learning rate", [q(f"malleus_learning_rate{J}", "lr")], 8, 6,
              "The learning rate of each update: the job's schedule (warm-up, then its decay).", **unit("none")),
        panel("timeseries", "Gradient norm", [q(f"malleus_grad_norm{J}", "grad norm")], 8, 6,
              "Global gradient norm of each step, before clipping.", **unit("none")),
        panel("timeseries", "Model FLOPs utilization", [q(f"malleus_mfu{J}", "MFU")], 8, 6,
              "The model's FLOPs per second over the peak of every device the job holds (suspended ones "
              "too); on CPU workers over their emulated accelerator's pace.", **unit("percentunit", min=0)),
    ]),
    ("Plan", [
        panel("table", "Stages of the plan in force", [
            q(f"malleus_plan_stage_layers{J}", "", instant=True, range=False, format="table")], 12, 9,
              "One row per stage: pipeline, stage, its devices (a TP group), first layer and layer count.",
              transformations=[{"id": "organize", "options": {
                  "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True},
                  "renameByName": {"Value": "layers", "first_layer": "first layer"},
                  "indexByName": {"pipeline": 0, "stage": 1, "devices": 2, "first_layer": 3, "Value": 4}}}]),
        panel("bargauge", "Micro-batches per pipeline", [
            q(f"malleus_plan_pipeline_micro_batches{J}", "pipeline {{pipeline}}", instant=True, range=False)],
              6, 9, "How the global batch is split across the pipelines of the plan in force.",
              options={"orientation": "horizontal", "displayMode": "basic"}),
        panel("stat", "Plan version", [q(f"malleus_plan_version{J}", "version")], 3, 4,
              "Plans applied since the start (0 = the initial plan)."),
        panel("stat", "Suspended devices", [q(f"malleus_plan_suspended_devices{J}", "suspended")], 3, 5,
              "Devices the plan gives no work (too slow to help)."),
        panel("timeseries", "Layers per stage over time", [
            q(f"malleus_plan_stage_layers{J}", "p{{pipeline}} s{{stage}} [{{devices}}]")], 12, 8,
              "Layer counts of every stage; steps show re-plans.", **unit("none")),
        panel("timeseries", "Re-plan rounds by reason and outcome", [
            q(f"sum by (reason, outcome) (increase(malleus_replans_total{J}[$__rate_interval]))",
              "{{reason}} -> {{outcome}}")], 12, 8,
              "Rounds ended per interval: measured rates, external rates, membership or user requests; "
              "applied (migrated), kept, failed.", **unit("none"), options={"legend": {"displayMode": "table"}}),
    ]),
    ("Planner and migration", [
        panel("timeseries", "Planner time per round", [
            q(f"histogram_quantile(0.9, sum by (le) (rate(malleus_planner_solve_seconds_bucket{J}[$__rate_interval])))",
              "p90"),
            q(f"rate(malleus_planner_solve_seconds_sum{J}[$__rate_interval]) / "
              f"rate(malleus_planner_solve_seconds_count{J}[$__rate_interval])", "mean"),
        ], 8, 8, "Time to compute keep / rebalance / re-plan options and choose (off the training path).",
              **unit("s")),
        panel("timeseries", "Migration time", [
            q(f"increase(malleus_migration_seconds_sum{J}[$__rate_interval])", "seconds migrating"),
        ], 8, 8, "Seconds spent migrating model and optimizer state per interval.", **unit("s")),
        panel("timeseries", "Migration bytes", [
            q(f"increase(malleus_migration_bytes_total{J}[$__rate_interval])", "bytes moved"),
            q(f"malleus_migration_bytes_total{J}", "total"),
        ], 8, 8, "State moved between devices by live migrations.", **unit("bytes")),
        panel("heatmap", "Sequence-length distribution", [
            q(f"sum by (le) (increase(malleus_sequence_length_tokens_bucket{J}[$__rate_interval]))", "{{le}}",
              format="heatmap")], 24, 8, "Lengths of the sequences sampled (tokens), per interval.",
              options={"calculate": False, "yAxis": {"unit": "none", "axisLabel": "tokens"},
                       "color": {"mode": "scheme", "scheme": "Blues", "steps": 64}}),
    ]),
]

ANNOTATIONS = [
    ("Plan change", f"changes(malleus_plan_version{J}[1m]) > 0", "orange",
     "A new plan took effect (live migration)"),
    ("Re-plan round", f"sum(increase(malleus_replans_total{J}[1m])) > 0", "blue",
     "A re-plan round ended (applied, kept or failed)"),
]


def build() -> dict:
    panels, y, pid = [], 0, 1
    for title, row in ROWS:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in row:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append({**p, "id": pid, "gridPos": {"x": x, "y": y, "w": w, "h": h}})
            for i, t in enumerate(panels[-1]["targets"]):
                t["refId"] = chr(ord("A") + i)
            pid, x, row_h = pid + 1, x + w, max(row_h, h)
        y += row_h
    annotations = [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                    "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                    "type": "dashboard"}]
    for name, expr, color, text in ANNOTATIONS:
        annotations.append({"name": name, "datasource": DS, "enable": True, "iconColor": color, "expr": expr,
                            "step": "10s", "titleFormat": name, "textFormat": text, "useValueForTime": False})
    return {
        "title": "malleus-svc job", "uid": "malleus-job", "description": "Straggling rates, throughput against "
        "the capacity bound, the plan in force, re-plans and migrations of one malleus-svc training job.",
        "tags": ["malleus", "ray", "training"], "timezone": "browser", "schemaVersion": 39, "version": 1,
        "editable": True, "graphTooltip": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": annotations},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "job", "label": "malleus job", "type": "query", "datasource": DS,
             "query": {"query": "label_values(malleus_plan_version, job)", "refId": "job"},
             "definition": "label_values(malleus_plan_version, job)", "refresh": 2, "sort": 1, "current": {},
             "hide": 0},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        ok = OUT.exists() and OUT.read_text() == text
        print("dashboards/malleus.json is up to date" if ok else "dashboards/malleus.json is stale: run "
              "python dashboards/build_dashboard.py")
        sys.exit(0 if ok else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")
