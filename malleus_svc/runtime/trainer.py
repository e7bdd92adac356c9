"""What a job needs before its workers train: the first plan, a check that a given plan fits the
job, and the optimizer settings. The training loop itself is the coordinator's (`control`)."""
from __future__ import annotations

from malleus_svc.config.job import JobConfig
from malleus_svc.costmodel.profile import CommCosts
from malleus_svc.plan import Plan, PlanError
from malleus_svc.planner.build import build_problem
from malleus_svc.planner.search import check_plan_fits


def optim_config(job: JobConfig):
    from .engine import OptimConfig

    return OptimConfig.of(job.train, shard_optimizer=bool(job.scenario.shard_optimizer))


def check_plan_for_job(plan: Plan, job: JobConfig, where: str = "plan") -> Plan:
    """A plan given by the user must fit the job: device count, node size, layers, global batch, and
    (as the planner would make it) its stages TP groups of the job's sizes on one node each."""
    sc = job.scenario
    problems = []
    if plan.num_devices != sc.num_devices:
        problems.append(f"it is for {plan.num_devices} devices, the job has {sc.num_devices} "
                        f"(cluster.nodes {sc.nodes} x cluster.gpus_per_node {sc.gpus_per_node})")
    if plan.gpus_per_node != sc.gpus_per_node:
        problems.append(f"it assumes gpus_per_node {plan.gpus_per_node}, the job has {sc.gpus_per_node}")
    if plan.num_layers != sc.num_layers:
        problems.append(f"its stages cover {plan.num_layers} layers, the model has {sc.num_layers}")
    if plan.global_batch != sc.global_batch:
        problems.append(f"its global batch is {plan.global_batch} (micro_batch_size {plan.micro_batch_size} x "
                        f"{plan.num_micro_batches} micro-batches), the job's batch.global is {sc.global_batch}")
    if problems:
        raise PlanError(f"{where} {plan.plan_id} does not match the job {job.name!r}: " + "; ".join(problems))
    return check_plan_fits(build_problem(job.scenario), plan, where)


def make_plan(job: JobConfig) -> Plan:
    """The planner's plan for the scenario (its rates and exclusions), made before the job's links
    and updates are measured: it prices neither communication nor the optimizer step (the
    coordinator prices them once measured)."""
    from malleus_svc.planner import plan as solve

    problem = build_problem(job.scenario, comm=CommCosts(), optimizer_per_block=0.0)
    return check_plan_for_job(solve(problem).plan, job, "the planner's plan")
