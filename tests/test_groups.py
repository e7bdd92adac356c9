"""Process groups across plan changes, on real gloo worlds: a plan change keeps the groups the new
plan shares, shuts the rest down, and a group released earlier can be made again and works (its
name is not reused)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from _mp import run_on_gloo
from _plans import PLAN_A, PLAN_B
from malleus_svc.runtime.groups import Groups, cached_groups, ordered_group_ranks, release_unused


def _all_reduce_each(groups: Groups | None) -> dict[tuple[int, ...], int]:
    """Every group this rank is in under its plan answers a sum of ones with its size."""
    if groups is None:
        return {}
    out = {}
    for ranks, group in sorted(groups._groups.items()):
        one = torch.ones(1)
        dist.all_reduce(one, group=group)
        out[ranks] = int(one.item())
    return out


def _change_plans(rank: int, world: int):
    def build(plan):
        return Groups(plan, rank) if rank in plan.roles() else None

    build(PLAN_A)
    first = release_unused(PLAN_A)
    b = build(PLAN_B)
    released = release_unused(PLAN_B)
    kept = cached_groups()
    sums_b = _all_reduce_each(b)
    a = build(PLAN_A)                        # back: the groups released a moment ago are made anew
    released_again = release_unused(PLAN_A)
    return {"first": first, "released": released, "kept": kept, "sums_b": sums_b,
            "sums_a": _all_reduce_each(a), "kept_a": cached_groups(), "released_again": released_again}


def test_a_plan_change_destroys_the_groups_the_new_plan_does_not_use():
    results = run_on_gloo(_change_plans, PLAN_A.num_devices)
    for rank, r in enumerate(results):
        mine_a = sorted(k for k in ordered_group_ranks(PLAN_A) if rank in k)
        mine_b = sorted(k for k in ordered_group_ranks(PLAN_B) if rank in k)
        assert r["first"] == []                                  # nothing to release under the plan just built
        assert r["kept"] == mine_b, rank                         # exactly the new plan's groups stay
        assert r["released"] == sorted(set(mine_a) - set(mine_b)), rank
        assert r["released_again"] == sorted(set(mine_b) - set(mine_a)), rank
        assert r["kept_a"] == mine_a, rank
        assert r["sums_b"] == {k: len(k) for k in mine_b}, rank  # the kept and new groups work
        assert r["sums_a"] == {k: len(k) for k in mine_a}, rank  # and so do re-made ones
    assert any(r["released"] for r in results)                   # the plans differ: something was released
