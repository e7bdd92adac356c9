"""The link probe (runtime/link_probe.py): what a job times before it prices communication."""
from __future__ import annotations

import functools
import threading

import pytest
import torch

from _mp import run_on_gloo
from malleus_svc.costmodel.profile import CommCosts, LinkTimes
from malleus_svc.runtime.link_probe import time_links
from malleus_svc.runtime.nccl_rules import RulesHub, rules_exchange, run_threads


def test_the_probe_keeps_nccl_rules_in_order_unbuffered_one_batch_per_message():
    # three ranks, two pairs timed one after the other: rank 0 leads both, rank 2 waits its turn
    hub = RulesHub(3, timeout=10.0)
    rounds = [[(0, 1)], [(0, 2)]]
    world = threading.Barrier(3)
    fns = {r: functools.partial(time_links, r, rounds, [], 256, 0, torch.float32, torch.device("cpu"), repeats=3,
                                exchange=rules_exchange(hub, r), barrier=world.wait) for r in range(3)}
    out = run_threads(fns, hub)
    assert set(out[0]["pairs"]) == {0, 1} and out[1]["pairs"] == {} and out[2]["pairs"] == {}
    assert all(t > 0 for t in out[0]["pairs"].values())
    assert all(o["all_reduce"] is None for o in out.values())   # fewer than two reducers: nothing reduced


def test_pairs_of_a_round_run_at_once_each_with_its_share_of_the_tensor():
    """A boundary between TP groups of two: both pairs of the round run at once, each moving half
    the tensor, and no round starts before the one before it has ended everywhere."""
    hub = RulesHub(4, timeout=10.0)
    sizes = []
    exchanges = {r: rules_exchange(hub, r) for r in range(4)}

    def sized(r):
        def exchange(messages, tag):
            sizes.extend(m.tensor.numel() for m in messages)
            return exchanges[r](messages, tag)
        return exchange
    starts = []
    world = threading.Barrier(4, action=lambda: starts.append(len(sizes)))
    rounds = [[(0, 1)], [(0, 1), (2, 3)]]
    fns = {r: functools.partial(time_links, r, rounds, [], 256, 0, torch.float32, torch.device("cpu"),
                                repeats=2, exchange=sized(r), barrier=world.wait) for r in range(4)}
    out = run_threads(fns, hub)
    assert set(out[0]["pairs"]) == {0, 1} and set(out[2]["pairs"]) == {1} and not out[1]["pairs"] and not out[3]["pairs"]
    # round 1 began after every message of round 0 (one pair, 3 round trips of the whole tensor)
    assert starts == [0, 12] and sizes[:12] == [256] * 12 and set(sizes[12:]) == {128}


def _probe(rank: int, world: int, elements: int) -> dict:
    return time_links(rank, [[(0, 1)], [(1, 2)]], [0, 2], 4096, elements, torch.float32, torch.device("cpu"), repeats=9)


def test_links_are_timed_on_a_gloo_world_and_a_bigger_all_reduce_takes_longer():
    # the reducers form a member-only group: rank 1 is not in it and creates nothing
    small = run_on_gloo(_probe, 3, 1 << 10)
    big = run_on_gloo(_probe, 3, 1 << 21)        # 8 MiB of fp32 against 4 KiB
    for out in (small, big):
        assert set(out[0]["pairs"]) == {0} and set(out[1]["pairs"]) == {1} and out[2]["pairs"] == {}
        assert out[1]["all_reduce"] is None and out[0]["all_reduce"] > 0 and out[2]["all_reduce"] > 0
    # the faster reducer of each: load on the host only ever adds time
    assert min(big[0]["all_reduce"], big[2]["all_reduce"]) > min(small[0]["all_reduce"], small[2]["all_reduce"])


def test_link_seconds_become_t0_units():
    links = LinkTimes(p2p_intra_node_s=0.002, p2p_inter_node_s=0.01, grad_sync_per_block_s=0.004, reducers=4,
                      p2p_shares=(("inter", 2, 0.7), ("inter", 4, 0.6), ("intra", 2, 1.6)))
    comm = links.comm_costs(t0_seconds=0.02)
    assert comm.p2p_intra_node == pytest.approx(0.1) and comm.p2p_inter_node == pytest.approx(0.5)
    assert comm.grad_sync_per_block == pytest.approx(0.2)
    assert "among 4 devices" in links.describe() and "4 pairs at once with 1/4 each 0.60x across" in links.describe()
    # measured: on the boundary's kind of link, the share at the largest k measured up to k
    assert [comm.p2p_share(k, False) for k in (1, 2, 3, 4, 8)] == [1.0, 0.7, 0.7, 0.6, 0.6]
    assert [comm.p2p_share(k, True) for k in (1, 2, 8)] == [1.0, 1.6, 1.6]
    only_inter = LinkTimes(0.002, 0.01, 0.004, 2, (("inter", 2, 0.7),)).comm_costs(0.02)
    assert only_inter.p2p_share(2, True) == 0.7     # the other kind's, where this one was not measured
    # a datasheet's links are each device's own; nothing measured: the whole
    assert [CommCosts(p2p_intra_node=1.0).p2p_share(k, True) for k in (1, 2, 8)] == [1.0, 0.5, 0.125]
    assert LinkTimes(0.002, None, 0.004, 2).comm_costs(0.02).p2p_share(4, True) == 1.0


def test_on_one_node_the_round_trip_within_it_prices_every_boundary():
    links = LinkTimes(p2p_intra_node_s=0.002, p2p_inter_node_s=None, grad_sync_per_block_s=0.004, reducers=8)
    comm = links.comm_costs(t0_seconds=0.02)
    assert comm.p2p_inter_node == comm.p2p_intra_node == pytest.approx(0.1)
    assert "across nodes" not in links.describe() and "within a node" in links.describe()
