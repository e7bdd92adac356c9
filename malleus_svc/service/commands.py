"""`malleus status | replan | rates | stop JOB`: talk to a running job's coordinator.

JOB is the malleus job name or the Ray Jobs submission id (raysubmit_...). The command joins the
Ray cluster at --address (default: RAY_ADDRESS, else the local cluster `ray start` made) with the
client API (control/client.py), so every request is validated by the coordinator and a refused
one changes nothing. Authentication: service/ray_auth.py. `status` of a job that has ended
reports its outcome (service/outcome.py); of an unknown one, the jobs that ran recently.
"""
from __future__ import annotations

import argparse
import json

from malleus_svc.config.errors import shorten
from malleus_svc.config.scenario import parse_device_id, parse_rate_assignments

from . import outcome
from .ray_auth import AuthRefused, connecting

# The coordinator's modules (and Ray) are imported where a command talks to a job: every other
# `malleus` command (plan, memory, ...) builds these parsers and should not pay for them.


def add_parsers(sub) -> None:
    def job_parser(name: str, help: str):
        p = sub.add_parser(name, help=help)
        p.add_argument("job", help="the malleus job name, or its Ray Jobs submission id")
        p.add_argument("--address", default=None,
                       help="Ray cluster (GCS) address, e.g. head:6379 (default: RAY_ADDRESS, else the local cluster)")
        p.add_argument("--json", action="store_true", help="print the coordinator's answer as JSON")
        return p

    job_parser("status", "state, plan, rates and throughput of a running job; the outcome of an ended one").set_defaults(
        func=cmd_status)
    p = job_parser("replan", "ask a running job to re-plan now (coalesced with any re-plan in flight)")
    p.add_argument("--reason", default="operator request", help="recorded in the job's history and metrics")
    p.add_argument("--force", action="store_true", help="adopt the planner's plan even if keeping the current "
                   "one is predicted to finish sooner (after the job's min_interval since its last plan change)")
    p.add_argument("--urgent", action="store_true", help="with --force: do not wait for min_interval")
    p.set_defaults(func=cmd_replan)
    p = job_parser("rates", "show a job's straggling rates, or set/clear external ones")
    p.add_argument("--set", action="append", default=[], metavar="DEVICE=RATE",
                   help="external straggling rate (>= 1.0) that overrides the measured one, e.g. --set 3=2.5")
    p.add_argument("--clear", action="append", default=[], metavar="DEVICE",
                   help="drop the external rate of DEVICE (the measured one counts again)")
    p.add_argument("--clear-all", action="store_true", help="drop every external rate")
    p.set_defaults(func=cmd_rates)
    job_parser("stop", "stop a job at its next iteration boundary (its Ray job then succeeds)").set_defaults(
        func=cmd_stop)


def _client(args: argparse.Namespace):
    from malleus_svc.control.client import MalleusError, connect

    try:
        with connecting():
            return connect(args.job, address=args.address)
    except AuthRefused:               # its line names the cause already
        raise
    except ConnectionError as e:
        raise MalleusError(f"cannot reach a Ray cluster at {args.address or 'RAY_ADDRESS / the local cluster'}: {e}; "
                           "pass --address HEAD:6379") from None


def _print(args: argparse.Namespace, answer, text: str) -> int:
    print(json.dumps(answer, indent=2, default=str) if args.json else text)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from malleus_svc.control.client import MalleusError
    from malleus_svc.control.outcome import recorded

    try:
        client = _client(args)
    except MalleusError:            # no coordinator by that name or id: a job that has ended, or none
        runs, records = outcome.ray_jobs(args.address), recorded()
        ended = outcome.ended(args.job, runs, records)
        if ended is None:
            raise MalleusError(f"no malleus job {shorten(args.job)} on this Ray cluster; recent jobs: "
                               f"{', '.join(outcome.recent(runs, records)) or '(none)'}") from None
        return _print(args, ended, outcome.format_ended(ended))
    st = client.status()
    return _print(args, st, format_status(st))


def cmd_replan(args: argparse.Namespace) -> int:
    ans = _client(args).replan(reason=args.reason, force=args.force, urgent=args.urgent)
    return _print(args, ans, f"re-plan requested (request #{ans['request']}); "
                             f"`malleus status {args.job}` shows the round, the history its outcome")


def cmd_rates(args: argparse.Namespace) -> int:
    changes: dict[int, float | None] = parse_rate_assignments(args.set)
    for d in args.clear:
        changes[parse_device_id(d, "--clear", d)] = None
    client = _client(args)
    if args.clear_all:
        client.clear_rates()
    if changes:
        client.set_rates(changes)
    r = client.rates()
    external = {str(d) for d in r["external"]}
    unmeasured = {str(d) for d in r.get("unmeasured") or {}}
    eff = r["effective"]
    text = "rates (device=rate, * = set externally, ? = not measured): " + (
        " ".join(f"{d}={float(v):.2f}{'*' if str(d) in external else '?' if str(d) in unmeasured else ''}"
                 for d, v in sorted(eff.items(), key=lambda kv: int(kv[0])))
        if eff else "(not calibrated yet: all devices count as healthy)")
    return _print(args, r, text)


def cmd_stop(args: argparse.Namespace) -> int:
    ans = _client(args).stop()
    return _print(args, ans, f"stopping {args.job} at the next iteration boundary (step {ans['step']})")


# ---------------------------------------------------------------------- parsing and formatting
def format_status(st: dict) -> str:
    from malleus_svc.control.coordinator import describe_plan

    def num(v, fmt="{:,.0f}"):
        return "-" if v is None else fmt.format(v)

    lines = [f"job {st['job']}" + (f" (Ray job {st['submission_id']})" if st.get("submission_id") else "")
             + f": {st['state']}, step {st['step']}/{st['steps']}" + (" [static plan]" if st.get("static") else "")]
    if st.get("error"):
        lines.append(f"  error: {st['error']}")
    if st.get("plan"):
        lines.append(f"  plan {st['plan_id']} (version {st.get('plan_version', 0)}): {describe_plan(st['plan'])}")
    lines.append(f"  throughput: {num(st.get('tokens_per_second'))} tok/s (average {num(st.get('avg_tokens_per_second'))}, "
                 f"healthy {num(st.get('healthy_tokens_per_second'))})")
    if st.get("lr") is not None or st.get("eval"):
        ev = st.get("eval")
        lines.append(f"  learning rate: {num(st.get('lr'), '{:.3g}')}; eval loss: "
                     + (f"{ev['loss']:.4f} (after step {ev['step']})" if ev else "not evaluated yet"))
    if st.get("last_checkpoint"):
        lines.append(f"  last checkpoint: {st['last_checkpoint']['path']} (step {st['last_checkpoint']['step']})")
    ext = set(st.get("external_rates") or {})
    rates = st.get("rates") or {}
    unmeasured = st.get("unmeasured") or {}
    lines.append("  rates: " + (" ".join(f"{d}={v:.2f}{'*' if d in ext else '?' if d in unmeasured else ''}"
                                         for d, v in rates.items())
                                if rates else "not calibrated yet") + (" (* external)" if ext else ""))
    if unmeasured:
        lines.append("  not measured (? above; their ops missed the emulated device's pace, so their rates are "
                     "the plan's): " + ", ".join(f"device {d} kept pace on {s:.0%} of its ops"
                                                 for d, s in unmeasured.items()))
    if st.get("excluded"):
        lines.append(f"  excluded: {st['excluded']}")
    if st.get("planning"):
        p = st["planning"]
        lines.append(f"  re-plan round {p['round']}: {p['phase']} (requests {p['requests']})")
    lines.append(f"  plan changes: {st.get('migrations', 0)} migrations, {st.get('history', 0)} history entries")
    if st.get("metrics_endpoint"):
        lines.append(f"  metrics: http://{st['metrics_endpoint']}/metrics")
    for ev in (st.get("events") or [])[-5:]:
        lines.append(f"  [step {ev['step']}] {ev['kind']}: {ev['text'].splitlines()[0]}")
    return "\n".join(lines)
