"""`malleus bench calibrate`: fit the simulator's cost coefficients on the real runtime, then
compare its predicted iteration time with the measured one for several hand-built plans.

Set-up: 2 CPU workers (one logical node of 2 devices, so each worker has its own core and wall
time measures the work, not the OS scheduler), the `small` preset (8 blocks), padded fixed-length
synthetic data (every micro-batch is `micro × seq_len` tokens, so compute per micro-batch is
constant). The scenario's baseline layout is TP2, so t0 is one block fwd+bwd for one micro-batch
on the TP2 group and tp_alpha = (1, t(TP1) / t(TP2)).

Profiling (short runs, disjoint from the validation plans) and fit:
  1. single-stage runs at TP1 (device 1 suspended) and TP2 for several micro-batch counts m;
     least squares on  T = m·L·t_g + opt·L·(tp/g) + D  gives t1, t2, the optimizer seconds per
     full-TP block (the simulator's `optimizer_per_block`) and D, a per-iteration constant the
     simulator does not model (Ray dispatch, argument/result transfer, zero_grad, the loss
     all-reduce);
  2. two PP2 runs (blocks 3/5, m = 4; 5/3, m = 6): p2p per boundary per micro-batch, by least
     squares on the residual (measured − D − simulated without p2p) against the simulator's d(iteration)/d(p2p);
  3. a DP2 run (two 1-stage TP1 pipelines, m = 2/2): grad_sync_per_block the same way.

Two fits from the same profiling runs: A constrains D = 0 (every second lands in a term the
simulator has; its prediction is plain `simulate()`), B fits D and predicts `simulate() + D`.

Validation (plans not used in the fit): uniform PP2, uneven-layers PP2, DP2 uneven data,
TP2 vs split (TP1 with the other device suspended), each at m = 8 (DP: 5 + 3). Reported:
measured iteration seconds (minimum over the timed steps after a warm-up step; the median is shown
beside it), `simulate(plan, problem).iteration_seconds`
and the error (fit A), and fit B's `simulate() + D` and its error.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..plan import Pipeline, Plan, Stage
from .planner import write_section

LAYERS = 8       # the `small` preset
DEVICES = 2
TARGET = 0.15


# ----------------------------------------------------------------------------- plans
def make_plan(pipes, suspended=(), micro_batch_size: int = 1) -> Plan:
    """pipes: [([(devices, (start, end)), ...], micro_batches), ...] on 2 devices, 1 node, 8 blocks."""
    return Plan(num_devices=DEVICES, num_layers=LAYERS, micro_batch_size=micro_batch_size, gpus_per_node=DEVICES,
                pipelines=tuple(Pipeline(tuple(Stage(tuple(d), tuple(l)) for d, l in stages), m)
                                for stages, m in pipes),
                suspended=tuple(suspended))


def single_stage(group: int, m: int, mbs: int = 1) -> Plan:
    if group == 2:
        return make_plan([([((0, 1), (0, LAYERS))], m)], micro_batch_size=mbs)
    return make_plan([([((0,), (0, LAYERS))], m)], suspended=(1,), micro_batch_size=mbs)


def pp2(split: int, m: int, mbs: int = 1) -> Plan:
    return make_plan([([((0,), (0, split)), ((1,), (split, LAYERS))], m)], micro_batch_size=mbs)


def dp2(m0: int, m1: int, mbs: int = 1) -> Plan:
    return make_plan([([((0,), (0, LAYERS))], m0), ([((1,), (0, LAYERS))], m1)], micro_batch_size=mbs)


def profile_plans(mbs: int = 1) -> dict[str, tuple[str, Plan]]:
    """name -> (kind, plan); kind: 'single' (compute fit), 'p2p', 'sync'."""
    out: dict[str, tuple[str, Plan]] = {}
    for g in (1, 2):
        for m in (2, 4, 6):
            out[f"tp{g} 1-stage m={m}"] = ("single", single_stage(g, m, mbs))
    out["PP2 3/5 m=4"] = ("p2p", pp2(3, 4, mbs))
    out["PP2 5/3 m=6"] = ("p2p", pp2(5, 6, mbs))
    out["DP2 m=2/2"] = ("sync", dp2(2, 2, mbs))
    return out


def validation_plans(mbs: int = 1) -> dict[str, Plan]:
    return {
        "uniform PP2 (4/4 blocks, m=8)": pp2(4, 8, mbs),
        "uneven layers PP2 (2/6 blocks, m=8)": pp2(2, 8, mbs),
        "uneven data DP2 (m=5/3)": dp2(5, 3, mbs),
        "TP2 group (8 blocks, m=8)": single_stage(2, 8, mbs),
        "split: TP1 + 1 suspended (8 blocks, m=8)": single_stage(1, 8, mbs),
    }


# ----------------------------------------------------------------------------- fitting (pure)
@dataclass(frozen=True)
class ComputeFit:
    t1: float              # s, one block fwd+bwd for one micro-batch on 1 device
    t2: float              # s, the same on the TP2 group
    opt_per_block: float   # s, optimizer step of one block at full TP (2); a TP1 device pays 2x
    dispatch: float        # s, per-iteration constant outside the simulator
    residual_rms: float


def fit_compute(rows: Sequence[tuple[int, int, int, float]], tp: int = 2, constant: bool = True) -> ComputeFit:
    """Least squares on single-stage runs. rows: (group size g in {1, tp}, blocks L, micro-batches m,
    measured iteration seconds). Model: T = m·L·t_g + opt·L·(tp/g) + D, with D = 0 when not
    `constant` (every second then lands in a term the simulator has)."""
    A, y = [], []
    for g, L, m, T in rows:
        if g not in (1, tp):
            raise ValueError(f"group size {g} is neither 1 nor {tp}")
        A.append([m * L if g == 1 else 0.0, m * L if g == tp else 0.0, L * tp / g] + ([1.0] if constant else []))
        y.append(T)
    A, y = np.asarray(A, float), np.asarray(y, float)
    if np.linalg.matrix_rank(A) < A.shape[1]:
        raise ValueError("the runs do not determine t1, t2, optimizer (and constant): need >= 2 micro-batch "
                         "counts per group size and both group sizes, with different tp/g·L")
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    res = y - A @ coef
    coef = [float(c) for c in coef] + ([] if constant else [0.0])
    return ComputeFit(*coef, residual_rms=float(np.sqrt(np.mean(res ** 2))))


def fit_scalar(residuals: Sequence[float], slopes: Sequence[float]) -> float:
    """Least-squares c in residual ≈ c·slope (one coefficient through the origin), clipped at 0."""
    r, s = np.asarray(residuals, float), np.asarray(slopes, float)
    den = float(s @ s)
    if den <= 0:
        raise ValueError("all slopes are zero: the runs do not depend on this coefficient")
    return max(0.0, float(r @ s) / den)


def scenario_dict(fit: ComputeFit, mbs: int, seq_len: int, p2p_s: float = 0.0, sync_s: float = 0.0) -> dict:
    return {"name": "calibrated-cpu", "cluster": {"nodes": 1, "gpus_per_node": DEVICES, "gpu_memory_mb": 16000},
            "model": "small", "parallel": {"dp": 1, "tp": 2, "pp": 1},
            "batch": {"global": 8 * mbs, "micro": mbs},
            "profile": {"tp_alpha": [1.0, fit.t1 / fit.t2], "t0_seconds": fit.t2},
            "_comm_t0": {"p2p": p2p_s / fit.t2, "sync": sync_s / fit.t2}}


def build_problem(fit: ComputeFit, mbs: int, seq_len: int, p2p_s: float = 0.0, sync_s: float = 0.0):
    """(PlannerProblem, SimOptions) carrying the fitted coefficients (comm in t0 units)."""
    import dataclasses

    from ..config.scenario import Scenario
    from ..planner.problem import CommCosts
    from ..simulate.timeline import SimOptions

    d = scenario_dict(fit, mbs, seq_len, p2p_s, sync_s)
    comm_t0 = d.pop("_comm_t0")
    sc = Scenario.from_dict(d)
    sc = dataclasses.replace(sc, comm=CommCosts(p2p_intra_node=comm_t0["p2p"], p2p_inter_node=comm_t0["p2p"],
                                                grad_sync_per_block=comm_t0["sync"]))
    return sc.problem(), SimOptions(optimizer_per_block=max(0.0, fit.opt_per_block) / fit.t2)


def sim_seconds(plan: Plan, fit: ComputeFit, mbs: int, seq_len: int, p2p_s: float = 0.0, sync_s: float = 0.0) -> float:
    from ..simulate.timeline import simulate

    problem, opts = build_problem(fit, mbs, seq_len, p2p_s, sync_s)
    return simulate(plan, problem, options=opts).iteration_seconds


def slope(plan: Plan, fit: ComputeFit, mbs: int, seq_len: int, which: str, p2p_s: float = 0.0) -> float:
    """d(simulated seconds)/d(coefficient seconds), by a small finite difference."""
    h = 0.01 * fit.t2
    kw0 = {"p2p_s": p2p_s, "sync_s": 0.0}
    kw1 = dict(kw0)
    kw1["p2p_s" if which == "p2p" else "sync_s"] += h
    return (sim_seconds(plan, fit, mbs, seq_len, **kw1) - sim_seconds(plan, fit, mbs, seq_len, **kw0)) / h


# ----------------------------------------------------------------------------- measuring
def measure(group, plan: Plan, shape, sampler, steps: int, optim) -> tuple[float, float]:
    """(min, median) iteration seconds of `steps` steps after one warm-up step. The minimum is the
    estimate used: on a shared machine other processes only ever add time to a step."""
    group.apply_plan(plan, shape, seed=0, optim=optim)
    times = []
    for k in range(steps + 1):
        ids = [sampler.next_index() for _ in range(plan.global_batch)]
        rec = group.step(ids)
        if k:
            times.append(rec.iteration_seconds)
    return min(times), statistics.median(times)


class _Sampler:
    def __init__(self, n: int):
        self.n, self.i = n, 0

    def next_index(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


def calibrate_from(prof: dict, mbs: int, seq_len: int, constant: bool) -> tuple[ComputeFit, float, float]:
    """(compute fit, p2p s, grad sync s per block) from profiling results {name: (kind, plan, seconds)}."""
    rows = [(plan.pipelines[0].stages[0].tp, LAYERS, plan.pipelines[0].micro_batches, T)
            for kind, plan, T in prof.values() if kind == "single"]
    fit = fit_compute(rows, constant=constant)
    p_runs = [v for v in prof.values() if v[0] == "p2p"]
    p2p = fit_scalar([T - fit.dispatch - sim_seconds(plan, fit, mbs, seq_len) for _, plan, T in p_runs],
                     [slope(plan, fit, mbs, seq_len, "p2p") for _, plan, _ in p_runs])
    s_runs = [v for v in prof.values() if v[0] == "sync"]
    sync = fit_scalar([T - fit.dispatch - sim_seconds(plan, fit, mbs, seq_len, p2p_s=p2p) for _, plan, T in s_runs],
                      [slope(plan, fit, mbs, seq_len, "sync", p2p_s=p2p) for _, plan, _ in s_runs])
    return fit, p2p, sync


def _coeff_dict(fit: ComputeFit, p2p: float, sync: float) -> dict:
    return {"t1_s": fit.t1, "t2_s": fit.t2, "tp_alpha": [1.0, fit.t1 / fit.t2], "t0_seconds": fit.t2,
            "optimizer_per_block_s": fit.opt_per_block, "dispatch_s": fit.dispatch,
            "p2p_s": p2p, "grad_sync_per_block_s": sync, "fit_rms_s": fit.residual_rms}


def run(steps: int, mbs: int, seq_len: int) -> tuple[dict, list[dict]]:
    from ..config.presets import PRESETS
    from ..runtime.cluster import WorkerGroup
    from ..runtime.engine import OptimConfig

    shape = PRESETS["small"]
    spec = {"source": "synthetic", "seq_len": seq_len, "num_samples": 1024, "vocab": shape.vocab, "seed": 0}
    sampler = _Sampler(1024)
    optim = OptimConfig()
    with WorkerGroup(DEVICES, DEVICES) as group:
        group.set_data(spec, "pad", seq_len)
        prof = {}
        for name, (kind, plan) in profile_plans(mbs).items():
            print(f"[bench calibrate] profile {name} ...", file=sys.stderr, flush=True)
            prof[name] = (kind, plan, measure(group, plan, shape, sampler, steps, optim)[0])
        fits = {c: calibrate_from(prof, mbs, seq_len, constant=c) for c in (False, True)}
        coeffs = {("with_constant" if c else "simulator_terms"): _coeff_dict(*f) for c, f in fits.items()}
        coeffs["profile"] = {k: v[2] for k, v in prof.items()}
        out = []
        for name, plan in validation_plans(mbs).items():
            print(f"[bench calibrate] validate {name} ...", file=sys.stderr, flush=True)
            T, med = measure(group, plan, shape, sampler, steps, optim)
            a, a_p2p, a_sync = fits[False]
            b, b_p2p, b_sync = fits[True]
            pred = sim_seconds(plan, a, mbs, seq_len, p2p_s=a_p2p, sync_s=a_sync)
            pred_d = sim_seconds(plan, b, mbs, seq_len, p2p_s=b_p2p, sync_s=b_sync) + b.dispatch
            out.append({"plan": name, "measured_s": T, "median_s": med, "load1": os.getloadavg()[0],
                        "predicted_s": pred, "error": (pred - T) / T,
                        "predicted_with_constant_s": pred_d, "error_with_constant": (pred_d - T) / T})
    return coeffs, out


def _describe(c: dict) -> str:
    return (f"t0 (TP2 block, 1 micro-batch) = {c['t0_seconds'] * 1e3:.2f} ms, tp_alpha = [1, {c['tp_alpha'][1]:.3f}] "
            f"(TP1 block {c['t1_s'] * 1e3:.2f} ms), optimizer {c['optimizer_per_block_s'] * 1e3:.2f} ms per full-TP "
            f"block{' (negative: used as 0)' if c['optimizer_per_block_s'] < 0 else ''}, p2p {c['p2p_s'] * 1e3:.2f} ms per boundary per micro-batch, "
            f"grad sync {c['grad_sync_per_block_s'] * 1e3:.2f} ms per block, unmodelled per-iteration constant "
            f"D = {c['dispatch_s'] * 1e3:.1f} ms; single-stage fit RMS {c['fit_rms_s'] * 1e3:.1f} ms")


def table(coeffs: dict, rows: list[dict]) -> str:
    prof = " · ".join(f"{k}: {v:.3f} s" for k, v in coeffs["profile"].items())
    head = (f"Fit A (simulator terms only, D = 0): {_describe(coeffs['simulator_terms'])}.\n\n"
            f"Fit B (with a per-iteration constant D outside the simulator): {_describe(coeffs['with_constant'])}.\n\n"
            f"Profiling runs (min iteration s): {prof}.\n\n")
    out = ["| plan | measured s (min) | median s | load1 | simulate() s, fit A | error A | simulate() + D s, fit B "
           "| error B | A within 15% |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['plan']} | {r['measured_s']:.3f} | {r['median_s']:.3f} | {r['load1']:.1f} | "
                   f"{r['predicted_s']:.3f} | {r['error']:+.1%} | {r['predicted_with_constant_s']:.3f} | "
                   f"{r['error_with_constant']:+.1%} | {'yes' if abs(r['error']) <= TARGET else 'no'} |")
    notes = []
    for label, key in (("A", "simulator_terms"), ("B", "with_constant")):
        c = coeffs[key]
        small = [n for n, v in (("optimizer", c["optimizer_per_block_s"] * LAYERS), ("D", c["dispatch_s"]))
                 if v != 0.0 and (v < 0 or abs(v) < 3 * c["fit_rms_s"])]
        if small:
            notes.append(f"fit {label}: {' and '.join(small)} within 3x the fit RMS ({c['fit_rms_s'] * 1e3:.1f} ms) "
                         "of zero, or negative: not identified by these runs")
    tail = ("\n\nNot identified: " + "; ".join(notes) + ".") if notes else ""
    return head + "\n".join(out) + tail


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (one more warms up)")
    ap.add_argument("--micro", type=int, default=1, help="samples per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--write", metavar="MD", help="update this markdown file's calibrate section")
    ap.add_argument("--json", metavar="PATH", help="also dump the fitted coefficients and rows as JSON")
    args = ap.parse_args(argv)
    import ray

    from ..runtime.cluster import start_local_ray

    start_local_ray(DEVICES, include_dashboard=False, log_to_driver=False)
    try:
        coeffs, rows = run(args.steps, args.micro, args.seq_len)
    finally:
        ray.shutdown()
    load = os.getloadavg()
    md = table(coeffs, rows)
    print(md)
    if args.json:
        import json
        Path(args.json).write_text(json.dumps({"coefficients": coeffs, "rows": rows}, indent=1))
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", file=sys.stderr)
    if args.write:
        cmd = ("malleus bench calibrate " + " ".join(argv)).strip()
        write_section(f"Command: `{cmd}` — {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core CPU machine, "
                      f"2 CPU worker actors (one per core), `small` preset, padded seq_len {args.seq_len}, "
                      f"micro-batch {args.micro}; load average at the end {load[0]:.2f}.\n\n{md}",
                      Path(args.write), "bench:calibrate")
    return 0
