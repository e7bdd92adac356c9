"""The coordinator's answers to status(), summary() and how plans read in one line."""
from __future__ import annotations

import dataclasses
import time

from malleus_svc.plan import RECOMPUTE_MARK, Plan
from malleus_svc.runtime.device_clock import host_cores


def plan_summary(plan: Plan) -> dict:
    d = plan.to_dict()
    return {"pipelines": d["pipelines"], "suspended": list(plan.suspended), "excluded": list(plan.excluded),
            "global_batch": plan.global_batch}


def describe_plan(plan: Plan | dict) -> str:
    """One line: pipelines as stage devices[layers] x micro-batches."""
    d = plan.to_dict() if isinstance(plan, Plan) else plan
    pipes = []
    for p in d["pipelines"]:
        st = " > ".join(f"{','.join(map(str, s['devices']))}[{s['layers'][0]}:{s['layers'][1]}]"
                        f"{RECOMPUTE_MARK[s.get('recompute', 'none')].strip()}" for s in p["stages"])
        pipes.append(f"({st})x{p['micro_batches']}")
    extra = f" susp {list(d.get('suspended') or [])}" if d.get("suspended") else ""
    extra += f" excl {list(d.get('excluded') or [])}" if d.get("excluded") else ""
    return " ".join(pipes) + extra


def workers_status(group) -> dict | None:
    if group is None:
        return None
    return {"devices": group.num_devices, "cpus_per_worker": group.cpus_per_worker, "use_gpu": group.use_gpu,
            "host_cores": host_cores(), "pids": {str(i["device"]): i["pid"] for i in group.infos},
            "nodes": {str(i["device"]): i["node_id"] for i in group.infos}}


def status(c) -> dict:
    """(the coordinator's lock held) Everything a client or `malleus status` shows."""
    plan, hist, lengths = c.plan, c.history, c.lengths
    last = hist.records[-1] if hist.records else None
    elapsed = (time.perf_counter() - hist.t_start) if hist.t_start else 0.0
    return {
        "job": c.job.name, "state": c.state.value, "error": c.error, "static": not c.policy.replans,
        "step": c.step, "steps": c.steps_total, "submission_id": c.origin["submission_id"],
        "resumed_from": c.origin["resumed_from"], "restarted": c.origin["restarted"], "failures": list(hist.failures),
        "last_checkpoint": last_checkpoint(c), "eval": c.evaluation.last,
        "lr": last.get("lr") if last else None,
        "plan_id": plan.plan_id if plan else None, "plan_version": hist.plan_version,
        "plan": plan_summary(plan) if plan else None,
        "excluded": sorted(c.excluded), "gone": sorted(c.gone()),
        "rates": {str(d): r for d, r in sorted(c.measurement.effective(c.basis).items())},
        "unmeasured": unmeasured(c),
        "external_rates": {str(d): r for d, r in sorted(c.measurement.external.items())},
        "calibrated": c.measurement.calibrated,
        "planning": c.rounds.status(),
        "pending_requests": [r.to_dict() for r in c.rounds.pending],
        "iteration_seconds": last["iteration_seconds"] if last else None,
        "tokens_per_second": (last["tokens"] / last["iteration_seconds"]) if last else None,
        "avg_tokens_per_second": hist.tokens_total / elapsed if elapsed > 0 else None,
        "healthy_tokens_per_second": c.measurement.healthy_tokens_per_second,
        "length_stats": lengths.last_stats, "length_drift": lengths.last_drift,
        "history": hist.entries_total, "migrations": hist.migrations_total,
        "events": list(hist.events)[-10:],
        "metrics_endpoint": c.metrics_export.endpoint if c.metrics_export else None,
        "workers": workers_status(c.group),
        "device_pace": device_pace(c.measurement.device_pace),
        "pace_held": last.get("pace_held") if last else None,
        "links": dataclasses.asdict(c.measurement.links) if c.measurement.links is not None else None,
    }


def last_checkpoint(c) -> dict | None:
    """{path, step} of the newest checkpoint of this job: written by this run, or resumed from."""
    resumed = c.origin["resumed_from"]
    return c.checkpoints.last_written() or (resumed and {"path": resumed["path"], "step": resumed["step"]})


def device_pace(pace) -> dict | None:
    """The accelerator CPU workers emulate (None on GPUs, or before they are paced)."""
    return None if pace is None else {"gflops": pace.flops_per_second / 1e9, "gbps": pace.bytes_per_second / 1e9,
                                      "block_ms": pace.block_seconds * 1e3}


def summary(c) -> dict:
    """(lock held) The run in numbers."""
    recs, t = c.history.records, c.history.totals
    secs, tokens, steps = t["seconds"], t["tokens"], t["steps"]
    return {"job": c.job.name, "state": c.state.value, "error": c.error, "steps": steps,
            "first_loss": t["first_loss"], "last_loss": recs[-1]["loss"] if recs else None,
            "tokens": tokens, "train_seconds": secs, "tokens_per_second": tokens / secs if secs > 0 else None,
            "mean_iteration_seconds": secs / steps if steps else None,
            "migrations": c.history.migrations_total,
            "healthy_tokens_per_second": c.measurement.healthy_tokens_per_second,
            "device_pace": device_pace(c.measurement.device_pace),
            "pace_held": recs[-1].get("pace_held") if recs else None, "unmeasured": unmeasured(c),
            "eval": c.evaluation.last}


def unmeasured(c) -> dict[str, float]:
    """Devices without a measured rate (their ops missed their pace), with the share that kept it."""
    return {str(d): round(s, 3) for d, s in sorted(c.measurement.pace.unmeasured().items())}
