"""What a job that has ended leaves behind, so `malleus status` still answers after it: the
driver's record (`control.outcome`) and what only Ray's Jobs API knows (SUCCEEDED / FAILED /
STOPPED, its message, a run whose driver died before it could record anything). `ended` and
`recent` combine the two as they are passed in (`ray_jobs`, `control.outcome.recorded`).
"""
from __future__ import annotations

import time

from .submit import TERMINAL, job_client

# Why a run that Ray knows has no record, by Ray's final state (the driver records on every exit it
# controls: only a SIGKILL, a lost node or a failure before training leaves none).
NO_RECORD = {
    "STOPPED": "Ray stopped the job before its driver recorded one (before its training started, or the "
               "driver outlived Ray's grace after SIGTERM and was killed)",
    "FAILED": "its driver exited before recording one (it failed before its training started, or was killed)",
    "SUCCEEDED": "its driver exited without recording one",
}


def ray_jobs(address: str | None) -> list[dict]:
    """The malleus jobs Ray's Jobs API knows (any state), newest first; [] where it cannot answer."""
    try:
        jobs = job_client(address).list_jobs()
    except Exception:  # a cluster without the Jobs API (no dashboard): the records alone answer
        return []
    out = [{"job": j.metadata["malleus_job"], "submission_id": j.submission_id, "ray_job_id": j.job_id,
            "status": getattr(j.status, "value", str(j.status)), "message": j.message,
            "start_time": j.start_time, "end_time": j.end_time}
           for j in jobs if (j.metadata or {}).get("malleus_job")]
    return sorted(out, key=lambda j: j["start_time"] or 0, reverse=True)


def ended(job: str, runs: list[dict], records: dict[str, dict]) -> dict | None:
    """The outcome of `job` (a name, a submission id or a Ray job id) from Ray's runs (`ray_jobs`,
    newest first) and the drivers' records (by job name): {"job", "state", "submission_id",
    "summary" (the driver's record, or None), "ray" (Ray's job info, or None)}; None if neither
    knows it. A name means its newest run; a record left by an earlier run of it does not count."""
    run = next((r for r in runs if job in (r["submission_id"], r["ray_job_id"])), None) \
        or next((r for r in runs if r["job"] == job), None)
    name = run["job"] if run else job
    rec = records.get(name) or next((r for r in records.values() if job in (r.get("submission_id"),
                                                                            r.get("ray_job_id"))), None)
    if rec and run and rec.get("submission_id") != run["submission_id"]:
        rec = None      # the record is an earlier run's; this run ended before recording (or still starts)
    if not (rec or run):
        return None
    state = run["status"] if run else rec["state"]
    return {"job": (run or rec)["job"], "state": state, "submission_id": (run or rec).get("submission_id"),
            "summary": rec, "ray": run}


def recent(runs: list[dict], records: dict[str, dict], limit: int = 5) -> list[str]:
    """'name (STATE, submission id)' of the newest runs, one per name, then the names only a record
    knows (a driver run outside Ray Jobs); for an unknown name."""
    seen, out = set(), []
    for r in runs:
        if r["job"] not in seen:
            seen.add(r["job"])
            out.append(f"{r['job']} ({r['status']}, {r['submission_id']})")
    for name, rec in sorted(records.items(), key=lambda kv: -kv[1]["ended"]):
        if name not in seen:
            seen.add(name)
            out.append(f"{name} ({rec['state']})")
    return out[:limit]


def format_ended(o: dict) -> str:
    s, run = o["summary"] or {}, o["ray"] or {}
    head = f"job {o['job']}" + (f" (Ray job {o['submission_id']})" if o.get("submission_id") else "")
    if o["state"] not in TERMINAL and not s:
        return head + f": {o['state']}, its coordinator is not up yet"
    lines = [head + f": {o['state']}"
             + (f", {s['steps']}/{s['steps_requested']} steps" if s else "")
             + (f", ended {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s['ended']))}" if s else "")]
    if s.get("ended_by"):
        lines.append(f"  ended by {s['ended_by']}")
    if s.get("error") or (o["state"] == "FAILED" and run.get("message")):
        lines.append(f"  error: {s.get('error') or _first_and_last_line(run['message'])}")
    if s.get("last_loss") is not None:
        lines.append(f"  loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}; "
                     f"{s['tokens_per_second'] or 0:,.0f} tok/s average over {s['train_seconds']:.1f} s of training")
    if s:
        lines.append(f"  plan changes: {s['migrations'] if s['migrations'] is not None else '?'} migrations in "
                     f"{s['replans']} re-plan rounds; final plan {s['plan_id']}")
    else:
        lines.append("  no summary recorded: " + NO_RECORD.get(o["state"], "its driver recorded none"))
    return "\n".join(lines)


def _first_and_last_line(message: str) -> str:
    """Ray's message for a failed driver is a line and the log's tail: the line and the log's last line."""
    lines = [x.strip() for x in message.splitlines() if x.strip()]
    return " ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else message.strip()
