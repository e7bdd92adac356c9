"""A plan as a table a person reads: pipelines, stages, devices, layers, micro-batches, times."""
from __future__ import annotations

import math

from ..costmodel.profile import recompute_time_factor
from ..plan import RECOMPUTE_MARK, Plan, PlanDiff, StateSizes
from .problem import PlannerProblem


def ranges(devices) -> str:
    """Compact device list: 0-3,5,8-11."""
    out, run = [], []
    for d in sorted(devices):
        if run and d == run[-1] + 1:
            run.append(d)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)))
        run = [d]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)))
    return ",".join(out) or "-"


def stage_rate(problem: PlannerProblem, devices) -> float:
    """y_g = alpha(|g|) * slowest member's rate (the Malleus time model), without the τ snap."""
    return problem.alpha(len(devices)) * max(problem.rates[d] for d in devices)


def plan_table(plan: Plan, problem: PlannerProblem) -> str:
    rows = [("pipeline", "stage", "devices", "tp", "layers", "blocks", "rate", "stage time", "micro-batches")]
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            y = stage_rate(problem, st.devices)
            rows.append((str(i) if j == 0 else "", str(j), ranges(st.devices), str(st.tp),
                         f"[{st.layers[0]}, {st.layers[1]})", f"{st.num_layers}{RECOMPUTE_MARK[st.recompute]}", f"{y:.2f}",
                         f"{y * st.num_layers * recompute_time_factor(st.recompute):.1f}",
                         str(pipe.micro_batches) if j == 0 else ""))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"suspended: {ranges(plan.suspended)}    excluded: {ranges(plan.excluded)}")
    modes = {st.recompute for pipe in plan.pipelines for st in pipe.stages}
    if "selective" in modes:
        lines.append("blocks marked s: the stage recomputes their norms' and SwiGLU's outputs in backward "
                     "(a few elementwise passes, about 45% fewer activations)")
    if "full" in modes:
        lines.append("blocks marked r: the stage recomputes them in backward (a third more compute, far less memory)")
    return "\n".join(lines)


def summary_line(plan: Plan, ideal: float | None, solve_seconds: float | None, candidates: int | None) -> str:
    obj = plan.objective_value
    parts = [f"objective ({plan.objective}) {obj:.1f} t0"]
    if ideal and math.isfinite(ideal):
        parts.append(f"straggler-free {ideal:.1f} t0 ({obj / ideal:.3f}x)")
    elif ideal:   # the layout as given does not fit memory even without stragglers
        parts.append("straggler-free: the given layout does not fit")
    if plan.predicted_iteration_seconds is not None:
        parts.append(f"predicted iteration {plan.predicted_iteration_seconds:.3f} s")
    if solve_seconds is not None:
        parts.append(f"solved in {solve_seconds:.3f} s" + (f" over {candidates} candidates" if candidates else ""))
    return "; ".join(parts)


def migration_summary(previous: Plan, plan: Plan, sizes: StateSizes) -> str:
    """What a migration from `previous` moves: the diff's slices, or with the optimizer sharded, each
    element's state from its old owner to its new one."""
    if not sizes.sharded:
        return diff_summary(Plan.diff(previous, plan, sizes))
    return (f"migration from previous plan (optimizer sharded): {Plan.moved_bytes(previous, plan, sizes) / 1024.0 ** 3:.2f} "
            "GiB of masters and moments move, each element from its old owner to its new one")


def diff_summary(diff: PlanDiff) -> str:
    s = diff.summary()
    gib = 1024.0 ** 3
    text = (f"migration from previous plan: {s['moves']} slice moves, {s['moved_bytes'] / gib:.2f} GiB moved "
            f"({s['inter_node_bytes'] / gib:.2f} GiB across nodes), {s['reused_bytes'] / gib:.2f} GiB kept in place; "
            f"largest per device: send {s['max_send_bytes'] / gib:.2f} GiB, receive {s['max_recv_bytes'] / gib:.2f} GiB")
    if s["missing_bytes"]:
        text += f"; {s['missing_bytes'] / gib:.2f} GiB held only by unavailable devices (restore from checkpoint)"
    return text
