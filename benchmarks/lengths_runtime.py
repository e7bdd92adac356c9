"""`malleus bench lengths-runtime`: length-oblivious against length-aware data assignment in the
real CPU runtime (the simulator-scale part is `malleus bench lengths`).

One job (the tiny CPU model with a 256-token context, 4 workers as DP2×PP2, global batch 32 in
micro-batches of 2 sequences) trains with `data.assignment` fixed and length-aware (two ways of
scheduling the planning, below), on

  lognormal  the runtime's SyntheticVarLen at seq_len 255: lognormal lengths, mean 64, σ 1,
             clipped to [8, 256] (median 38, p90 137): Hydraulis's 32K tail scaled to the
             256-token context the CPU cost model is swept over (`runtime/length_sweep.py`);
  python     the bundled Python-source corpus (the first 400 stdlib files), one sequence per
             256-byte piece of each file (corpus_split: documents): mostly full pieces, and each
             file's short remainder;

each healthy and with one straggler (device 1 slowed `--factor`× by the runtime's emulation hook,
the one the job's `emulate` schedule drives). Under the straggler both assignments run the plan
the Malleus planner makes for that rate (pipeline 0 keeps 6 of the 16 micro-batches), and the
length-aware dispatch is given the same rate; so both know as much about the straggler and
differ only in how they use the lengths.

  fixed                    `runtime.data.split_for_plan`: sampler order, 2 sequences per
                           micro-batch, the plan's micro-batch count per pipeline (fixed-length
                           packing);
  aware, planned ahead     `control.assign.assign` (dispatch + packing on the cost model the
                           coordinator fits, `runtime.length_sweep.run_sweep(shape, layers=2, repeats=9)`),
                           computed for the whole block before it runs, as a pool of planners
                           working several steps ahead would (Hydraulis, App. E): the step runs
                           with its assignment ready, and the planning time is reported beside it;
  aware, 1-step lookahead  the same, computed for step t+1 on a thread while step t trains, as
                           the coordinator's `Lookahead` does: here the thread competes with the
                           workers for the cores, and a plan not ready in time is waited for.

Steps go straight to the `WorkerGroup` (the calls the coordinator makes, without its re-planning
loop, so no migration or rate noise lands in a timed step). Noise control on a shared host with
fewer cores than workers: each assignment has its own sampler with the same seed, so step k of
every assignment trains the same global batch, and they take turns step by step, in reversed
order every other step (ABC CBA), inside every block of (dataset, straggler); blocks are
re-ordered every round; `--rounds` rounds; each block's first `--warmup` steps are not timed. A
sample of length l trains l − 1 tokens (inputs seq[:-1]): `assign` gets those counts, so two full
pieces fill a 510-token micro-batch, as in the fixed split.

Reported per variant (aware/fixed from the same paired steps: ratio of sums, and the range of the
per-round ratios):
  iteration s   the driver's wall time of the step, plus for the 1-step lookahead any wait for
                an assignment it had not finished (the coordinator would wait that long);
  slowest busy  the slowest pipeline's busy seconds, a pipeline's being its busiest device's
                compute CPU time + injected stall (`control.workload.busy_seconds`): what the
                iteration would take if every device had a core of its own;
  gap           (slowest − fastest)/slowest of those pipeline busy times, per iteration;
  planning      seconds of one `assign` call (wall, on the driver), against the iteration.
Each step is checked: every sample of the global batch was trained exactly once (the workers'
own report of what they collated), and no variant sees a sample twice.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from malleus_svc.config.limits import MAX_SECONDS
from malleus_svc.config.options import number_option
from .planner import write_section
from malleus_svc.planner.build import build_problem

MODEL = {"layers": 4, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 256, "seq_len": 256}  # tiny, 256-token context
DATASETS = {
    "lognormal": {"source": "synthetic", "seq_len": 255, "num_samples": 8192, "vocab": 256},
    "python": {"source": "python-stdlib", "seq_len": 255, "corpus_split": "documents", "max_files": 400},
}
FIXED, AHEAD, LOOKAHEAD = "fixed", "aware, planned ahead", "aware, 1-step lookahead"
ASSIGNMENTS = (FIXED, AHEAD, LOOKAHEAD)
WORKERS = 4            # one CPU worker actor per device of the DP2×PP2 job
STRAGGLER = 1          # device 1: pipeline 0's second stage in the healthy DP2×PP2 plan
PLOT = "benchmarks/plots/lengths_runtime.png"
MARKER = "bench:lengths-runtime"


def job_config(dataset: str, assignment: str = "length-aware", global_batch: int = 32, micro: int = 2):
    """The bench's job (its `data.assignment` is what the coordinator would read; the bench drives
    the same calls itself, the fixed split and `assign`, and runs all assignments on one group)."""
    from malleus_svc.config.job import JobConfig
    return JobConfig.from_dict({
        "name": f"lengths-{dataset}-{assignment}", "model": MODEL,
        "cluster": {"nodes": 1, "gpus_per_node": WORKERS, "gpu_memory_mb": 16000},
        "parallel": {"dp": 2, "tp": 1, "pp": 2}, "batch": {"global": global_batch, "micro": micro},
        "data": {**DATASETS[dataset], "assignment": assignment}, "train": {"seed": 0, "lr": 1e-3},
        # the plans of the recorded figures: DP2×PP2 healthy, pipeline 0 with less data under the
        # straggler ('full' with its links unpriced would run this tiny model as DP4)
        "planner": {"objective": "paper"}, "metrics": {"enabled": False}})


@dataclass
class Step:
    """One timed step of one variant."""

    round: int
    k: int                      # step index within its block (pairs the assignments)
    ids: tuple[int, ...]
    iteration_s: float
    busy: list[float]           # per pipeline: its busiest device's busy seconds
    micro_batches: int          # over all pipelines
    planning_s: float = 0.0     # aware: this step's `assign` call
    waited_s: float = 0.0       # 1-step lookahead: wait for an assignment not ready in time


@dataclass
class Variant:
    dataset: str
    straggler: bool
    assignment: str
    steps: list[Step] = field(default_factory=list)
    consumed: set = field(default_factory=set)

    @property
    def key(self) -> tuple[str, bool, str]:
        return self.dataset, self.straggler, self.assignment

    @property
    def label(self) -> str:
        return f"{self.dataset} / {'straggler' if self.straggler else 'healthy'} / {self.assignment}"


def pipeline_busy(rec, plan) -> list[float]:
    from malleus_svc.control.workload import busy_seconds
    return [max(busy_seconds(rec.devices[d]) for st in p.stages for d in st.devices) for p in plan.pipelines]


def gap(busy: list[float]) -> float:
    return (max(busy) - min(busy)) / max(busy) if max(busy) > 0 else 0.0


def check_consumed(v: Variant, ids: list[int], rec) -> None:
    """Every sample of the batch trained exactly once (as the workers report it), none twice in the
    run (`run` keeps a run inside one epoch)."""
    seen = sorted(i for pipe in rec.sample_ids for i in pipe)
    if seen != sorted(ids) or len(set(ids)) != len(ids):
        raise AssertionError(f"{v.label}: the workers trained {len(seen)} samples, the batch has {len(ids)}")
    if v.consumed & set(ids):
        raise AssertionError(f"{v.label}: samples {sorted(v.consumed & set(ids))[:5]} trained twice")
    v.consumed |= set(ids)


def run(rounds: int = 4, steps: int = 8, warmup: int = 1, factor: float = 3.0, datasets=tuple(DATASETS),
        global_batch: int = 32, sweep_repeats: int = 9, time_limit_s: float | None = None, log=print) -> dict:
    """Measure every variant (module docstring); Ray must be initialised. Returns variants and setup.
    `time_limit_s`: assign()'s MILP limit; None: the coordinator's, from the last iteration's time."""
    from malleus_svc.control.assign import assign, planning_time_limit
    from malleus_svc.runtime.length_sweep import run_sweep
    from malleus_svc.planner import plan as solve
    from malleus_svc.runtime.cluster import WorkerGroup
    from malleus_svc.runtime.data import GlobalSampler
    from malleus_svc.runtime.trainer import check_plan_for_job, make_plan, optim_config

    jobs = {ds: job_config(ds, "length-aware", global_batch) for ds in datasets}
    job = jobs[datasets[0]]
    shape = job.shape
    t0 = time.perf_counter()
    cost, sweep = run_sweep(shape, layers=min(2, shape.layers), repeats=sweep_repeats)   # as the coordinator does
    log(f"cost model fitted in {time.perf_counter() - t0:.1f} s: {sweep['coeffs_per_layer']}, held-out max error "
        f"{sweep['test_max_abs_error']:.1%}")
    healthy = make_plan(job)
    slow = {STRAGGLER: factor}
    plans = {False: healthy, True: check_plan_for_job(solve(build_problem(job.scenario, rates=slow), previous=healthy).plan, job)}
    budget = healthy.micro_batch_size * job.data.seq_len   # the fixed split's micro-batch tokens (memory)
    variants = {(ds, s, a): Variant(ds, s, a) for ds in datasets for s in (False, True) for a in ASSIGNMENTS}
    samplers: dict = {}
    pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lookahead")

    limits: list[float] = []

    def timed_assign(ids, lengths, plan, rates, last_iteration):
        t = time.perf_counter()   # lengths − 1: the tokens a sample trains (module docstring)
        limit = planning_time_limit(last_iteration) if time_limit_s is None else time_limit_s
        limits.append(limit)
        out = assign(ids, [int(lengths[i]) - 1 for i in ids], plan, cost, rates, budget, limit)
        return out, time.perf_counter() - t

    group = WorkerGroup(job.num_devices, job.scenario.gpus_per_node, name="malleus-bench-lengths").start()
    try:
        for rnd in range(rounds):
            order = [(ds, s) for ds in datasets for s in (False, True)]
            for ds, s in (order if rnd % 2 == 0 else order[::-1]):   # a load drift favours no block
                d = jobs[ds].data
                n = group.set_data(d.spec(), d.mode, d.seq_len)
                if rounds * (warmup + steps) * global_batch > n:
                    raise ValueError(f"{ds}: {rounds} rounds of {warmup + steps} steps need more than its {n} samples")
                lengths, plan, rates = group.dataset.lengths, plans[s], (slow if s else {})
                group.apply_plan(plan, shape, seed=0, optim=optim_config(job))
                group.set_slowdowns({STRAGGLER: factor if s else 1.0})
                for a in ASSIGNMENTS:
                    samplers.setdefault((ds, s, a), GlobalSampler(n, plan.global_batch, seed=job.train.seed))
                log(f"round {rnd + 1}/{rounds}: {ds}, {'straggler' if s else 'healthy'}")
                # planned ahead: this block's batches, before it runs (the sampler is deterministic)
                fixed = variants[(ds, s, ASSIGNMENTS[0])].steps
                last = fixed[-1].iteration_s if fixed else None   # the coordinator's view, roughly
                ahead = [timed_assign(b, lengths, plan, rates, last)
                         for b in (samplers[(ds, s, AHEAD)].peek(j) for j in range(warmup + steps))]
                pending = None        # the 1-step lookahead: the next step's assignment, prepared during this one
                for k in range(warmup + steps):
                    for a in (ASSIGNMENTS if k % 2 == 0 else ASSIGNMENTS[::-1]):   # ABC CBA: drift favours none
                        v, sampler = variants[(ds, s, a)], samplers[(ds, s, a)]
                        ids = sampler.next_global_batch()
                        assignment, planning, waited = None, 0.0, 0.0
                        if a == AHEAD:
                            assignment, planning = ahead[k]
                        elif a == LOOKAHEAD:   # as the coordinator: this step's (prepared), then the next one's
                            w = time.perf_counter()
                            last = v.steps[-1].iteration_s if v.steps else None
                            assignment, planning = (pending or pool.submit(timed_assign, ids, lengths, plan,
                                                                           rates, last)).result()
                            pending = pool.submit(timed_assign, sampler.peek(0), lengths, plan, rates, last)
                            waited = time.perf_counter() - w
                        rec = group.step(ids, assignment)
                        if a == LOOKAHEAD:
                            # The lookahead finishes inside this step's time, not the next variant's: what it
                            # still needs is a wait the coordinator would see before its next step.
                            w = time.perf_counter()
                            pending.result()
                            waited += time.perf_counter() - w
                        check_consumed(v, ids, rec)
                        if k >= warmup:
                            mbs = sum(map(len, assignment)) if assignment else plan.num_micro_batches
                            v.steps.append(Step(rnd, k, tuple(ids), rec.iteration_seconds + waited,
                                                pipeline_busy(rec, plan), mbs, planning, waited))
    finally:
        pool.shutdown(wait=True)
        group.shutdown()
    return {"variants": list(variants.values()), "sweep": sweep, "plans": plans, "factor": factor,
            "time_limit_s": (min(limits), max(limits)) if limits else None,
            "rounds": rounds, "steps": steps, "warmup": warmup,
            "global_batch": global_batch}


# ---------------------------------------------------------------------------- report
def _ratios(aware: Variant, fixed: Variant, metric) -> tuple[float, float, float]:
    """aware/fixed as a ratio of sums over the paired steps, and the range of the per-round ratios."""
    pairs = [(a, f) for a, f in zip(aware.steps, fixed.steps)]
    if [(a.round, a.k, a.ids) for a, _ in pairs] != [(f.round, f.k, f.ids) for _, f in pairs] \
            or len(aware.steps) != len(fixed.steps):
        raise AssertionError(f"{aware.label}: its steps do not pair with {fixed.label}'s (same rounds, same batches)")
    per_round = []
    for r in sorted({a.round for a, _ in pairs}):
        rp = [(a, f) for a, f in pairs if a.round == r]
        per_round.append(sum(metric(a) for a, _ in rp) / sum(metric(f) for _, f in rp))
    return sum(metric(a) for a, _ in pairs) / sum(metric(f) for _, f in pairs), min(per_round), max(per_round)


def summarise(result: dict) -> list[dict]:
    """One row per variant; aware rows carry the ratios against the fixed row of the same case."""
    by_key = {v.key: v for v in result["variants"]}
    rows = []
    for v in result["variants"]:
        st = v.steps
        row = {"dataset": v.dataset, "straggler": v.straggler, "assignment": v.assignment, "steps": len(st),
               "samples": len(v.consumed),
               "iteration_s": statistics.mean(s.iteration_s for s in st),
               "slowest_busy_s": statistics.mean(max(s.busy) for s in st),
               "gap_mean": statistics.mean(gap(s.busy) for s in st),
               "gap_p90": sorted(gap(s.busy) for s in st)[int(0.9 * (len(st) - 1))],
               "micro_batches": statistics.mean(s.micro_batches for s in st),
               "planning_s": statistics.mean(s.planning_s for s in st),
               "waited_s": statistics.mean(s.waited_s for s in st)}
        if v.assignment != FIXED:
            fixed = by_key[(v.dataset, v.straggler, FIXED)]
            row["wall_ratio"] = _ratios(v, fixed, lambda s: s.iteration_s)
            row["busy_ratio"] = _ratios(v, fixed, lambda s: max(s.busy))
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    def ratio(r, key):
        return f"{r[key][0]:.3f} ({r[key][1]:.2f}–{r[key][2]:.2f})" if key in r else "1 (reference)"

    out = ["| data | straggler | assignment | timed steps | micro-batches per step | iteration s "
           "| aware / fixed (per-round range) | slowest pipeline busy s | aware / fixed (per-round range) "
           "| pipeline gap mean (p90) | planning s per iteration (waited) | planning / iteration |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        aware = r["assignment"] != FIXED
        out.append(f"| {r['dataset']} | {'device 1 slowed' if r['straggler'] else 'none'} | {r['assignment']} "
                   f"| {r['steps']} | {r['micro_batches']:.1f} | {r['iteration_s']:.3f} | {ratio(r, 'wall_ratio')} | {r['slowest_busy_s']:.3f} "
                   f"| {ratio(r, 'busy_ratio')} | {r['gap_mean']:.3f} ({r['gap_p90']:.3f}) "
                   + (f"| {r['planning_s']:.3f} ({r['waited_s']:.3f}) | {r['planning_s'] / r['iteration_s']:.2f} |"
                      if aware else "| – | – |"))
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(r["dataset"], r["straggler"]) for r in rows if r["assignment"] == FIXED]
    get = {(r["dataset"], r["straggler"], r["assignment"]): r for r in rows}
    names = [f"{d}\n{'straggler' if s else 'healthy'}" for d, s in cases]
    xs = range(len(cases))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, metric, title in ((axes[0], "iteration_s", "iteration wall s"),
                              (axes[1], "slowest_busy_s", "slowest pipeline busy s"),
                              (axes[2], "gap_mean", "slowest-to-fastest pipeline gap")):
        for j, a in enumerate(ASSIGNMENTS):
            ax.bar([x + (j - 1) * 0.27 for x in xs], [get[(d, s, a)][metric] for d, s in cases], 0.27, label=a)
        ax.set_xticks(list(xs), names)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"Length-aware vs fixed assignment, {WORKERS} CPU workers (DP2×PP2), tiny model, 256-token context")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(result: dict, rows: list[dict], command: str, date: str, seconds: float, plot_path: str | None) -> str:
    sweep, plans = result["sweep"], result["plans"]
    c = sweep["coeffs_per_layer"]
    lo, hi = result["time_limit_s"]
    mb = lambda p: "/".join(str(q.micro_batches) for q in p.pipelines)   # noqa: E731
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    cores = os.cpu_count() or 1
    ahead = [r for r in rows if r["assignment"] == AHEAD]
    per_data = "; ".join(f"{r['dataset']} {'straggler' if r['straggler'] else 'healthy'}: "
                         f"{r['planning_s']:.2f} s, {r['planning_s'] / r['iteration_s']:.1f}× its iteration"
                         for r in ahead)
    # where the wall and the busy ratios disagree, the difference is outside the devices' compute
    off = [f"{r['dataset']} {'straggler' if r['straggler'] else 'healthy'}, {r['assignment']}: wall "
           f"{r['wall_ratio'][0]:.3f}, busy {r['busy_ratio'][0]:.3f}"
           for r in ahead if abs(r["wall_ratio"][0] - r["busy_ratio"][0]) > 0.05]
    return "\n".join([
        "## Length-aware data assignment in the CPU runtime", "",
        f"Command: `{command}` — {date}, {cores}-core CPU machine (load average {load} at the end), "
        f"{seconds:.0f} s. Setup, pairing and metrics: `benchmarks/lengths_runtime.py`."
        + (f" Plot: `{plot_path}`." if plot_path else ""), "",
        f"Job: tiny model with a 256-token context ({MODEL}), {WORKERS} CPU worker actors over gloo as DP2×PP2, global "
        f"batch {result['global_batch']}, fixed micro-batches of 2 sequences; every assignment keeps micro-batches "
        f"to at most 510 tokens (the fixed split's memory bound). Micro-batches per pipeline: healthy "
        f"{mb(plans[False])}; with device 1 at {result['factor']:g}× the planner's plan {mb(plans[True])} "
        f"(pipeline 0 = device 1 with 1 layer + device 3 with 3), used by every assignment. {result['rounds']} "
        f"rounds × {result['steps']} timed steps per (data, straggler) block and assignment, the assignments "
        f"alternating step by step on the same global batches. Cost model fitted as the coordinator does (TP 1, "
        f"2 layers, 9 repeats): a {c['a']:.3g} s/token², b {c['b']:.3g} s/token, d {c['d']:.3g} s/sequence, "
        f"c {c['c']:.3g} s/micro-batch, per layer; held-out max error {sweep['test_max_abs_error']:.1%}. "
        f"`assign` MILP time limit {lo:g}–{hi:g} s (the coordinator's rule, `control.assign.planning_time_limit`: "
        "5% of the last iteration, 0.02–0.5 s; under it the greedy incumbents stand, and below 0.05 s the MILPs "
        "are skipped: greedy dispatch and LPT packing only).", "",
        table(rows), "",
        "Iteration s: wall time of the step (+ for the 1-step lookahead, any wait for an assignment not ready in "
        "time). Slowest pipeline busy: per iteration, max over pipelines of their busiest device's compute CPU "
        "seconds + injected stall; the gap compares those pipeline times. Ratios are sums over the same paired "
        "steps, the range is over rounds. Every step trained each sample of its global batch exactly once (the "
        "workers' report), and no variant saw a sample twice.", "",
        f"Planning (one `assign` call, dispatch + packing MILPs, on the driver): {per_data}. The coordinator "
        "plans one step ahead on one thread, which hides planning only when it is shorter than the iteration; "
        "here the thread also takes CPU from the workers, so the 1-step lookahead rows are what the coordinator "
        "as built would get on this machine, and the planned-ahead rows what the assignment itself is worth "
        "when planning keeps up (Hydraulis plans 10 iterations ahead in 10 processes).", "",
        "What limits the gain here: "
        + (f"{WORKERS} workers time-slice {cores} cores, so wall time follows the total CPU work more than the "
           "slowest pipeline (a waiting device, or the straggler's emulated sleep, frees a core for the others); "
           if cores < WORKERS else "")
        + "at a 256-token context a micro-batch's fixed costs (c and the runtime's "
        "per-micro-batch work, which the cost model does not see: the head, p2p, collation) outweigh attention's "
        "Σl², so most of the gain comes from fewer, fuller micro-batches rather than from balance; the "
        "python corpus is mostly full 256-byte pieces, which leaves little to re-arrange; and every step carries "
        "Ray/gloo overheads (dispatch, gradient all-reduce, optimizer) that no assignment changes.", "",
        "Why the gap need not shrink: dispatch balances a per-pipeline bound that counts one micro-batch's c "
        "and the longest sequence's fill; packing then chooses each pipeline's micro-batch count on its own, "
        "adding (V − 1)·c and a whole micro-batch's fill, and the runtime's unmodelled per-micro-batch work on "
        "top. With these fixed costs as large as here, pipelines packed into 3 and 4 micro-batches differ by "
        "more than the sequences' own imbalance, so the length-aware busy gap can exceed the fixed split's, "
        "even while every pipeline's total is lower."
        + (" Wall and busy ratios disagree for " + "; ".join(off) + ": that part of the difference is "
           "outside the devices' compute (p2p waits, driver dispatch, time-slicing)." if off else ""),
    ])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench lengths-runtime", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per assignment, (data, straggler) block and round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per assignment at the start of each block")
    number_option(ap, "--factor", 1, 100, default=3.0, help="the straggler's slowdown")
    ap.add_argument("--datasets", default=",".join(DATASETS))
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--sweep-repeats", type=int, default=9, help="the cost-model sweep's rounds (the coordinator: 9)")
    number_option(ap, "--time-limit", 0.001, MAX_SECONDS, default=None,
                    help="assign()'s time limit per MILP, s (default: the coordinator's rule, from the last iteration)")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's section (e.g. BENCHMARKS.md)")
    ap.add_argument("--plot", metavar="PNG", help=f"write the plot here (e.g. {PLOT})")
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    args = ap.parse_args(argv)
    datasets = tuple(args.datasets.split(","))
    if any(d not in DATASETS for d in datasets):
        ap.error(f"--datasets: choose from {', '.join(DATASETS)}")
    import ray

    from malleus_svc.runtime.cluster import start_local_ray

    own = not ray.is_initialized()
    if own:
        start_local_ray(WORKERS, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    try:
        result = run(args.rounds, args.steps, args.warmup, args.factor, datasets, args.global_batch,
                     args.sweep_repeats, args.time_limit, log=lambda m: print(f"[bench lengths-runtime] {m}", file=sys.stderr, flush=True))
    finally:
        if own:
            ray.shutdown()
    rows = summarise(result)
    print(table(rows))
    if args.plot:
        plot(rows, Path(args.plot))
    if args.write:
        cmd = ("malleus bench lengths-runtime " + " ".join(argv)).strip()
        write_section(render(result, rows, cmd, args.date, time.perf_counter() - t0, args.plot), Path(args.write),
                      MARKER)
    return 0
