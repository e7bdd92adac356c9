"""What-if planning: the paper's 110B model on 64 GPUs, with a few stragglers. No cluster needed.

    python examples/what_if_110b.py                       # two stragglers on node 0, one on node 2
    python examples/what_if_110b.py --rate 5=4 --rate 40=1.5

Plans the job with malleus-svc's planner, then compares, under the simulator, the iteration time
of that plan with the static Megatron/DeepSpeed layout a user would otherwise keep running.
"""
import argparse

from malleus_svc.config import load_scenario
from malleus_svc.planner import baseline_plan, plan
from malleus_svc.planner.describe import plan_table, summary_line
from malleus_svc.config.scenario import BUNDLED
from malleus_svc.simulate import simulate
from malleus_svc.planner.build import build_problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", action="append", default=[], metavar="DEVICE=RATE",
                    help="a straggler: device id and how many times slower it runs")
    args = ap.parse_args()
    rates = dict(item.split("=") for item in args.rate) or {"3": "2.5", "4": "2.5", "17": "5"}
    rates = {int(d): float(r) for d, r in rates.items()}

    scenario = load_scenario(BUNDLED / "llama110b-64gpu.yaml")   # 80 layers, hidden 8192, FFN 49152
    problem = build_problem(scenario, rates=rates, objective="full")     # full: bubbles, p2p, gradient reduction

    result = plan(problem)                                        # the bi-level planner (ILPs on HiGHS)
    print(plan_table(result.plan, problem))
    print(summary_line(result.plan, result.ideal_objective, result.solve_seconds, result.candidates))

    static = baseline_plan(problem)                               # the healthy DP x TP x PP layout, unchanged
    ours = simulate(result.plan, problem, rates=rates).iteration_seconds
    theirs = simulate(static, problem, rates=rates).iteration_seconds
    print(f"stragglers {rates}: static layout {theirs:.1f} s/iteration, malleus plan {ours:.1f} s/iteration "
          f"-> {theirs / ours:.2f}x faster")


if __name__ == "__main__":
    main()
