"""The Plan contract: validation, JSON round trip, and plan diffs (the worked example's migration vector)."""
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from _plans import BASELINE, PLAN_1, make_plan
from malleus_svc.geometry import model_parts
from malleus_svc.plan import EMBEDDING, HEAD, Plan, PlanError, StateSizes


def test_json_round_trip_keeps_structure_and_id():
    p = Plan.from_json(PLAN_1.to_json())
    assert p == PLAN_1 and p.plan_id == PLAN_1.plan_id
    assert p.global_batch == 64 and p.sample_slices() == [(0, 43), (43, 64)]
    assert PLAN_1.plan_id != BASELINE.plan_id


def test_recomputation_is_part_of_a_stage_and_absent_where_off():
    """A stage's recomputation travels with the plan and is part of its identity; a plan without any
    writes none (its id stays what it was), and moving between the two moves no state."""
    d = PLAN_1.to_dict()
    assert all("recompute" not in st for p in d["pipelines"] for st in p["stages"])
    d["pipelines"][1]["stages"][0]["recompute"] = "full"
    d.pop("plan_id")
    rc = Plan.from_dict(d)
    assert rc.pipelines[1].stages[0].recompute == "full" and rc.pipelines[0].stages[0].recompute == "none"
    assert Plan.from_json(rc.to_json()) == rc and rc.plan_id != PLAN_1.plan_id
    diff = Plan.diff(PLAN_1, rc, StateSizes(block=1.0, embedding=3.0, head=5.0))
    assert diff.moved_bytes == 0 and not diff.moves


def test_roles_and_holders():
    roles = PLAN_1.roles()
    assert roles[6].pipeline == 0 and roles[6].stage == 2 and roles[6].tp_rank == 1 and roles[6].tp_size == 2
    assert roles[7].is_first and roles[3].is_last and 5 not in roles
    assert [s.devices for _, s in PLAN_1.holders(10)] == [(4, 6), (8, 9, 10, 11)]
    assert [s.devices for _, s in PLAN_1.holders(EMBEDDING)] == [(7,), (8, 9, 10, 11)]
    assert [s.devices for _, s in PLAN_1.holders(HEAD)] == [(0, 1, 2, 3), (12, 14)]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["pipelines"][0]["stages"][1].update(layers=[5, 8]), "do not continue"),
    (lambda d: d["pipelines"][0]["stages"][1].update(devices=[7]), "already used"),
    (lambda d: d.update(suspended=[5]), "neither in a stage"),
    (lambda d: d["pipelines"][1].update(micro_batches=0), "micro_batches must be >= 1"),
    (lambda d: d["pipelines"][0]["stages"][0].update(devices=[99]), "not in 0..15"),
    (lambda d: d.pop("num_layers"), "missing the field 'num_layers'"),
    (lambda d: d.update(global_batch=65), "disagrees"),
    (lambda d: d["pipelines"][0]["stages"][-1].update(layers=[16, 31]), "cover layers [0, 31)"),
    (lambda d: d["pipelines"][0]["stages"][0].update(recompute="some"), "recompute must be one of none, selective, full"),
])
def test_invalid_plans_are_refused_with_the_reason(mutate, message):
    d = PLAN_1.to_dict()
    mutate(d)
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Plan.from_dict(d)


def test_load_reports_missing_and_malformed_files(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)


def test_diff_reproduces_the_migration_test_vector():
    """The worked example's migration vector: in units of 1/4 block, 96 reused, 160 moved, nothing across nodes."""
    diff = Plan.diff(BASELINE, PLAN_1, StateSizes(block=4.0))
    assert diff.reused_bytes == 96 and diff.moved_bytes == 160 and diff.inter_node_bytes == 0
    flows = Counter()
    for m in diff.moves:
        flows[(m.src, m.dst)] += m.bytes
    expected = {(0, 4): 8, (1, 4): 8, (2, 6): 8, (3, 6): 8, (0, 7): 4, (1, 7): 4, (2, 7): 4, (3, 7): 4,
                (4, 0): 16, (5, 1): 16, (6, 2): 16, (7, 3): 16,
                (8, 15): 4, (9, 15): 4, (10, 15): 4, (11, 15): 4, (13, 12): 16, (15, 14): 16}
    assert dict(flows) == expected
    assert diff.max_bytes_per_device() == (16, 16)


def test_diff_of_a_plan_with_itself_moves_nothing():
    d = Plan.diff(PLAN_1, PLAN_1, StateSizes(block=1.0, embedding=3.0, head=5.0))
    assert d.moved_bytes == 0 and not d.moves and d.reused_bytes > 0


def test_diff_reports_state_only_dead_devices_held():
    # Only pipeline 0 held layers 16..31 quarter 1 on node 0 (device 5) and node 1 (device 13); kill both.
    d = Plan.diff(BASELINE, PLAN_1, StateSizes(block=4.0), unavailable=[5, 13])
    assert {(m.part, m.dst) for m in d.missing} == {(layer, 1) for layer in range(16, 32)} | \
        {(layer, 12) for layer in range(16, 32)}
    assert all(m.src is None for m in d.missing)


@st.composite
def random_plan(draw, n=8, layers=6, tp=(1, 2)):
    devices = draw(st.permutations(range(n)))
    k = draw(st.integers(1, 3))  # pipelines
    pipes, pos = [], 0
    for i in range(k):
        stages = draw(st.integers(1, min(3, layers)))
        cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1, unique=True)))
        bounds = [0, *cuts, layers]
        stage_list = []
        for j in range(stages):
            size = draw(st.sampled_from(tp))
            if pos + size > n:
                return None
            stage_list.append((devices[pos:pos + size], (bounds[j], bounds[j + 1])))
            pos += size
        pipes.append((stage_list, draw(st.integers(1, 4))))
    return make_plan(pipes, suspended=devices[pos:], num_devices=n, layers=layers, gpn=4)


@settings(max_examples=150, deadline=None)
@given(random_plan(), random_plan())
def test_diff_is_minimal_and_complete(old, new):
    """Every byte a new holder needs is either kept in place or moved exactly once, and nothing else moves."""
    if old is None or new is None:
        return
    sizes = StateSizes(block=12.0, embedding=7.0, head=5.0)
    d = Plan.diff(old, new, sizes)
    need = have = 0.0
    for part in [EMBEDDING, *range(new.num_layers), HEAD]:      # every part split by its TP group
        old_map = {dev: (Fraction(r, s.tp), Fraction(r + 1, s.tp))
                   for _, s in old.holders(part) for r, dev in enumerate(s.devices)}
        for _, s in new.holders(part):
            for r, dev in enumerate(s.devices):
                lo, hi = Fraction(r, s.tp), Fraction(r + 1, s.tp)
                need += float((hi - lo) * sizes.bytes_of(part))
                if dev in old_map:
                    a, b = old_map[dev]
                    have += float(max(0, min(hi, b) - max(lo, a)) * sizes.bytes_of(part))
    assert d.moved_bytes == pytest.approx(need - have)
    assert d.reused_bytes == pytest.approx(have)
    assert not d.missing
    assert all(m.src != m.dst for m in d.moves)


@settings(max_examples=150, deadline=None)
@given(random_plan(tp=(1, 2, 3)), random_plan(tp=(1, 2, 3)))
def test_moved_bytes_without_the_schedule_equal_the_diffs(old, new):
    """`Plan.moved_bytes`, device by device, is what `Plan.diff` moves, sharded and replicated state alike."""
    if old is None or new is None:
        return
    sizes = StateSizes(block=12.0, embedding=7.0, head=5.0, block_replicated=3.0, head_replicated=2.0)
    assert Plan.moved_bytes(old, new, sizes) == pytest.approx(Plan.diff(old, new, sizes).moved_bytes, rel=1e-12)
    assert Plan.moved_bytes(old, old, sizes) == 0.0


def _diff_by_scan(old, new, sizes, dead):
    """`Plan.diff`'s moves by its definition: every needer's span cut against every live old holder,
    each piece from a holder on the needer's node if any, the fewest bytes sent so far, lowest id."""
    from malleus_svc.geometry import finest_partition, shard_map
    moves, missing, kept, sent = [], [], [], {}
    for sharded in (True, False):
        for part in model_parts(new.num_layers):
            part_bytes = sizes.bytes_of(part, sharded)
            if part_bytes <= 0:
                continue
            owned = shard_map((s.devices for _, s in old.holders(part)), sharded=sharded, exclude=dead)
            needed = shard_map((s.devices for _, s in new.holders(part)), sharded=sharded)
            for dst, span in sorted(needed.items()):
                for a, b in finest_partition(owned.values(), within=span):
                    n = float((b - a) * part_bytes)
                    if dst in owned and owned[dst][0] <= a and b <= owned[dst][1]:
                        kept.append((part, a, b, dst, dst))
                        continue
                    srcs = [s for s, (x, y) in owned.items() if x <= a and b <= y]
                    if not srcs:
                        missing.append((part, a, b, None, dst))
                        continue
                    local = [s for s in srcs if new.node_of(s) == new.node_of(dst)]
                    src = min(local or srcs, key=lambda s: (sent.get(s, 0.0), s))
                    sent[src] = sent.get(src, 0.0) + n
                    moves.append((part, a, b, src, dst))
    return moves, missing, kept


@settings(max_examples=150, deadline=None)
@given(random_plan(), random_plan(), st.sets(st.integers(0, 7), max_size=3))
def test_diff_sends_what_a_scan_over_every_holder_sends(old, new, dead):
    """The indexed sources (a heap per shard, refreshed as bytes are sent) give the same moves, in
    the same order and from the same senders, as scanning every holder for every piece."""
    if old is None or new is None:
        return
    sizes = StateSizes(block=12.0, block_replicated=1.0, embedding=7.0, head=5.0)
    d = Plan.diff(old, new, sizes, unavailable=dead)
    got = tuple([(m.part, m.start, m.end, m.src, m.dst) for m in ms] for ms in (d.moves, d.missing, d.kept))
    assert got == _diff_by_scan(old, new, sizes, dead)
