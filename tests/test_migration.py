"""Live migration between plans (runtime/migrate.py): the pure transfer planner, then the real
thing on a local Ray cluster (8 workers, 2 logical nodes of 4), checked bitwise."""
from __future__ import annotations

import copy
import dataclasses
import random
from collections import Counter
from fractions import Fraction

import pytest
import torch

from malleus_svc.config.presets import ModelShape
from _plans import BASELINE, PLAN_1, PLAN_A, PLAN_B, SHAPE_32, random_plan
from malleus_svc.plan import EMBEDDING, HEAD, Plan, StateSizes
from malleus_svc.runtime.migrate import MigrationError, plan_migration, sharded_moves_by_fraction
from malleus_svc.geometry import part_of, part_tensors, split_dim, tensor_spec


def _sizes(shape) -> StateSizes:
    """What plan_migration gives the diff: the model's state in bytes (fp32 param and Adam moments)."""
    return StateSizes.of(shape, 12)


def _in_blocks(name: str) -> bool:
    return isinstance(part_of(name), int)


def _tiny():
    from malleus_svc.config.presets import PRESETS

    return PRESETS["tiny"]


def _holds_rows(plan: Plan, shape, device: int, name: str) -> tuple[int, int] | None:
    for _, st in plan.holders(part_of(name)):
        if device in st.devices:
            return tensor_spec(shape, name).held_rows(st.devices.index(device), st.tp)
    return None


def _check_complete(old: Plan, new: Plan, shape, sched) -> None:
    """Every row a new holder needs is kept or received exactly once, from a device that held it."""
    for dev, names in sched.holdings.items():
        for name, h in names.items():
            assert _holds_rows(new, shape, dev, name) == (h.start, h.end)
    count: dict[tuple[int, str], torch.Tensor] = {
        (dev, name): torch.zeros(h.end - h.start, dtype=torch.int32)
        for dev, names in sched.holdings.items() for name, h in names.items()}
    for k in sched.kept:
        held = _holds_rows(old, shape, k.device, k.name)
        assert held and held[0] <= k.start and k.end <= held[1], k
        count[(k.device, k.name)][k.start - sched.holdings[k.device][k.name].start:
                                  k.end - sched.holdings[k.device][k.name].start] += 1
    for s in sched.slices:
        assert s.src != s.dst, s
        held = _holds_rows(old, shape, s.src, s.name)
        assert held and held[0] <= s.start and s.end <= held[1], s
        assert _holds_rows(old, shape, s.dst, s.name) is None or s.dim is not None, \
            f"{s}: a replicated tensor sent to a device that already held it"
        h = sched.holdings[s.dst][s.name]
        count[(s.dst, s.name)][s.start - h.start:s.end - h.start] += 1
    for key, c in count.items():
        assert bool((c == 1).all()), (key, c.tolist())


# --------------------------------------------------------------------------- planning, no Ray
def test_test_vector_sharded_flows_equal_plan_diff():
    """The worked example's migration vector: for sharded tensors the tensor-level schedule is Plan.diff's, piece for piece."""
    sched = plan_migration(BASELINE, PLAN_1, SHAPE_32)
    assert sharded_moves_by_fraction(sched, SHAPE_32) == {(m.part, m.start, m.end, m.src, m.dst)
                                                          for m in Plan.diff(BASELINE, PLAN_1, _sizes(SHAPE_32)).moves
                                                          if m.sharded}
    # Totals in units of one block's sharded state: 40 blocks moved (160 quarters), 24 kept (96).
    diff = Plan.diff(BASELINE, PLAN_1)
    block_sharded = sum(3 * 4 * torch.Size(t.shape).numel()
                        for t in part_tensors(SHAPE_32, 0) if t.split_dim is not None)
    moved = sum(s.nbytes for s in sched.slices if s.dim is not None and _in_blocks(s.name))
    kept = sum(k.nbytes for k in sched.kept if split_dim(k.name) is not None and _in_blocks(k.name))
    assert Fraction(moved, block_sharded) == Fraction(diff.moved_bytes) == 40
    assert Fraction(kept, block_sharded) == Fraction(diff.reused_bytes) == 24
    assert sched.inter_node_bytes == 0
    # Per-device flows of the vector, in quarters of a block (the blocks' sharded tensors only).
    flows = Counter()
    for s in sched.slices:
        if s.dim is not None and _in_blocks(s.name):
            flows[(s.src, s.dst)] += Fraction(4 * s.nbytes, block_sharded)
    assert dict(flows) == {(0, 4): 8, (1, 4): 8, (2, 6): 8, (3, 6): 8, (0, 7): 4, (1, 7): 4, (2, 7): 4,
                           (3, 7): 4, (4, 0): 16, (5, 1): 16, (6, 2): 16, (7, 3): 16, (8, 15): 4,
                           (9, 15): 4, (10, 15): 4, (11, 15): 4, (13, 12): 16, (15, 14): 16}
    _check_complete(BASELINE, PLAN_1, SHAPE_32, sched)


def test_replicated_tensors_move_whole_and_only_to_devices_without_a_copy():
    sched = plan_migration(BASELINE, PLAN_1, SHAPE_32)
    rep = [s for s in sched.slices if s.dim is None]
    # Device 7 takes blocks 0-3 (it held 16-31); 15 takes blocks 4-7 (it held 16-31); 4 and 6 take
    # blocks 8-15; 0-3 take 16-31 and the head's final norm; 12, 14 keep theirs. The embedding has
    # no replicated tensor (its rows are split like the head's matrix).
    got = {(s.part, s.dst) for s in rep}
    expected = ({(b, 7) for b in range(4)} | {(b, 15) for b in range(4, 8)} |
                {(b, d) for b in range(8, 16) for d in (4, 6)} |
                {(p, d) for p in [*range(16, 32), HEAD] for d in (0, 1, 2, 3)})
    assert got == expected
    for s in rep:
        assert (s.start, s.end) == (0, tensor_spec(SHAPE_32, s.name).shape[0])
        assert s.src // 8 == s.dst // 8  # every part has an old holder on each node here


def test_same_node_sources_first_and_least_loaded():
    shape = _tiny()
    sched = plan_migration(PLAN_A, PLAN_B, shape)
    _check_complete(PLAN_A, PLAN_B, shape, sched)
    for s in sched.slices:
        holders = [d for d in range(8) if d != s.dst and (r := _holds_rows(PLAN_A, shape, d, s.name))
                   and r[0] <= s.start and s.end <= r[1]]
        if any(d // 4 == s.dst // 4 for d in holders):
            assert s.src // 4 == s.dst // 4, s
    # Some state must cross nodes: block 3 and the head lived only on node 1; the embedding and
    # blocks 0, 1 only on node 0. Nothing else crosses.
    assert sched.inter_node_bytes > 0
    cross = {(s.part, s.dst) for s in sched.slices if s.src // 4 != s.dst // 4}
    assert cross == {(3, 0), (HEAD, 0), (EMBEDDING, 6), (EMBEDDING, 7), (0, 6), (0, 7), (1, 6), (1, 7)}
    # Least loaded, then lowest id: the upper halves of blocks 0 and 1 are held by 1 and 3. Device
    # 0 (TP 1, needers in id order) takes them first, from 1 (a tie, lower id); 7 then takes them
    # from 3, which has sent less. The lower halves (held by 0 and 2): 1 takes them from 0, 6 from 2.
    src = {(s.part, s.dst): s.src for s in sched.slices if s.dim is not None and s.part in (0, 1)}
    assert src == {(b, d): s for b in (0, 1) for d, s in ((0, 1), (7, 3), (1, 0), (6, 2))}, src


def test_no_self_sends_and_every_row_covered_once_random_plans():
    rng = random.Random(7)
    shape = ModelShape(layers=6, hidden=32, heads=4, ffn=64, vocab=64, seq_len=16)

    for _ in range(40):
        old, new = random_plan(rng), random_plan(rng)
        sched = plan_migration(old, new, shape, bucket_bytes=rng.choice([1000, 5000, 1 << 20]))
        _check_complete(old, new, shape, sched)
        diff = Plan.diff(old, new, _sizes(shape))
        assert sharded_moves_by_fraction(sched, shape) == {(m.part, m.start, m.end, m.src, m.dst)
                                                           for m in diff.moves if m.sharded}
        assert (sched.inter_node_bytes == 0) == (diff.inter_node_bytes == 0)
        assert plan_migration(old, new, shape, bucket_bytes=sched.bucket_bytes).digest() == sched.digest()
    same = plan_migration(PLAN_B, PLAN_B, _tiny())
    assert not same.slices and not same.buckets and same.reused_bytes > 0


def _merged(pieces) -> list[list]:
    """(name, start, end) of consecutive row ranges, each run of adjacent ones of a tensor joined."""
    out = []
    for c in pieces:
        if out and out[-1][0] == c.name and out[-1][2] == c.start:
            out[-1][2] = c.end
        else:
            out.append([c.name, c.start, c.end])
    return out


@pytest.mark.parametrize("bucket_bytes", [1, 700, 4096, 50_000, 64 << 20])
def test_buckets_are_bounded_and_reassemble_the_slices(bucket_bytes):
    shape = _tiny()
    sched = plan_migration(PLAN_A, PLAN_B, shape, bucket_bytes=bucket_bytes)
    biggest_row = max(s.nbytes // (s.end - s.start) for s in sched.slices)
    for b in sched.buckets:
        assert b.nbytes == sum(c.nbytes for c in b.chunks)
        assert b.nbytes <= bucket_bytes or (len(b.chunks) == 1 and b.chunks[0].end - b.chunks[0].start == 1
                                            and bucket_bytes < biggest_row), b
        assert all((c.src, c.dst) == (b.src, b.dst) for c in b.chunks)
    # The chunks of each pair, in bucket order, are exactly its slices cut into row ranges.
    pair_buckets: dict[tuple[int, int], list] = {}
    for b in sched.buckets:
        pair_buckets.setdefault((b.src, b.dst), []).append(b)
    for pair in {(s.src, s.dst) for s in sched.slices}:
        chunks = [c for b in sorted(pair_buckets[pair], key=lambda b: b.index) for c in b.chunks]
        assert _merged(chunks) == _merged([s for s in sched.slices if (s.src, s.dst) == pair])
    # Per round: one bucket per pair, and per device <= bucket_bytes sent and received (one lone
    # oversize bucket excepted).
    by_round: dict[int, list] = {}
    for b in sched.buckets:
        by_round.setdefault(b.round, []).append(b)
    assert sorted(by_round) == list(range(sched.rounds))
    for bs in by_round.values():
        assert len({(b.src, b.dst) for b in bs}) == len(bs)
        for side in ("src", "dst"):
            per = Counter()
            n = Counter()
            for b in bs:
                per[getattr(b, side)] += b.nbytes
                n[getattr(b, side)] += 1
            assert all(v <= bucket_bytes or n[d] == 1 for d, v in per.items())
    assert sum(b.nbytes for b in sched.buckets) == sched.moved_bytes
    if bucket_bytes == 64 << 20:
        assert len(sched.buckets) == len(sched.flows())  # one bucket per pair when all fits


def test_unavailable_sources_are_refused_with_what_is_lost():
    with pytest.raises(MigrationError) as e:
        plan_migration(BASELINE, PLAN_1, SHAPE_32, unavailable=[5, 13])
    msg = str(e.value)
    assert "[5, 13]" in msg and "block 16 fraction [1/4, 1/2) for device 1" in msg and "checkpoint" in msg
    # One dead device with a surviving replica elsewhere: fine, and it never sends.
    sched = plan_migration(BASELINE, PLAN_1, SHAPE_32, unavailable=[5])
    assert all(s.src != 5 for s in sched.slices)
    assert sched.moved_bytes > plan_migration(BASELINE, PLAN_1, SHAPE_32).moved_bytes - 1


def _owned_cover(plan: Plan, shape, owned) -> None:
    """Each tensor's elements (a tied head's are the embedding's) tile [0, numel) once."""
    from malleus_svc.geometry import TIED, model_parts

    for part in model_parts(shape.layers):
        for spec in part_tensors(shape, part):
            if shape.tie_embeddings and spec.name == TIED[1]:
                assert spec.name not in owned
                continue
            ends = [0] + [e for _, e, _ in owned[spec.name]]
            assert [s for s, _, _ in owned[spec.name]] == ends[:-1] and ends[-1] == spec.numel, spec.name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_sharded_optimizer_moves_each_element_once_from_its_old_owner_to_its_new(tied):
    """With the optimizer sharded every element of the state has one owner under a plan (its chunk
    of a gradient bucket, or the one device holding it), and the schedule sends an element only
    from its old owner to its new one: never twice, never where the owner stays. A lost owner
    leaves its elements without a source: the schedule refuses, naming them."""
    from malleus_svc.runtime.state_owners import owners

    rng = random.Random(11)
    shape = ModelShape(layers=6, hidden=32, heads=4, ffn=64, vocab=64, seq_len=16, tie_embeddings=tied)
    for _ in range(25):
        old, new = random_plan(rng), random_plan(rng)
        grad_bytes = rng.choice([256, 4096, 1 << 20])
        before, after = (owners(p, shape, bucket_bytes=grad_bytes) for p in (old, new))
        _owned_cover(old, shape, before)
        _owned_cover(new, shape, after)
        sched = plan_migration(old, new, shape, sharded=True, grad_bucket_bytes=grad_bytes,
                               bucket_bytes=rng.choice([1000, 1 << 20]))

        def owner(runs, name, i):
            return next(d for s, e, d in runs[name] if s <= i < e)

        got = Counter()
        for k in sched.kept:
            assert owner(before, k.name, k.start) == owner(after, k.name, k.start) == k.device
            got.update((k.name, i) for i in range(k.start, k.end))
        for sl in sched.slices:
            assert sl.src != sl.dst and owner(before, sl.name, sl.start) == sl.src, sl
            assert owner(before, sl.name, sl.end - 1) == sl.src and owner(after, sl.name, sl.start) == sl.dst, sl
            assert sl.nbytes == 12 * (sl.end - sl.start)
            got.update((sl.name, i) for i in range(sl.start, sl.end))
        assert set(got.values()) == {1} and len(got) == sum(e - s for runs in after.values() for s, e, _ in runs)
        assert sched.moved_bytes == 12 * sum(1 for name, runs in after.items() for s, e, d in runs
                                             for i in range(s, e) if owner(before, name, i) != d)
    same = plan_migration(PLAN_B, PLAN_B, _tiny(), sharded=True)
    assert not same.slices and same.reused_bytes > 0
    lost = plan_migration(PLAN_A, PLAN_B, _tiny(), sharded=True).slices[0].src
    with pytest.raises(MigrationError, match=rf"owned by device {lost}.*sharded.*checkpoint"):
        plan_migration(PLAN_A, PLAN_B, _tiny(), sharded=True, unavailable=[lost])
    with pytest.raises(MigrationError, match=rf"owned by device {lost}"):   # the same plan: its own state is lost
        plan_migration(PLAN_A, PLAN_A, _tiny(), sharded=True, unavailable=[lost])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_planners_sharded_migration_bytes_are_the_runtimes(tied):
    """The planner prices a sharded optimizer's migration by owner (`Plan.moved_bytes` with
    `StateSizes.sharded`): each piece owned in equal shares by its holders (a tied head's among the
    holders of either copy). Where each gradient bucket holds one piece (a large model's buckets),
    that is the runtime's schedule up to the rounding of rows and chunks (< 0.1%); and it is not
    the replicated optimizer's diff."""
    rng = random.Random(3)
    shape = ModelShape(layers=6, hidden=64, heads=4, ffn=128, vocab=128, seq_len=16, tie_embeddings=tied)
    sizes = dataclasses.replace(_sizes(shape), sharded=True)
    differs = 0
    for _ in range(20):
        old, new = random_plan(rng), random_plan(rng)
        exact = plan_migration(old, new, shape, sharded=True, grad_bucket_bytes=1).moved_bytes
        assert Plan.moved_bytes(old, new, sizes) == pytest.approx(exact, rel=1e-3, abs=1)
        differs += abs(exact - Plan.moved_bytes(old, new, _sizes(shape))) > 0.01 * exact
    assert differs >= 10


def test_an_owned_run_must_be_filled_exactly_once():
    """A receiving owner's runs are tracked as the ranges filled (a run is up to billions of
    elements: no per-element count): a gap or an overlap is refused, naming the elements."""
    import torch

    from malleus_svc.runtime.migrate import _Runs
    from malleus_svc.runtime.state_owners import Run

    schedule = plan_migration(PLAN_A, PLAN_B, _tiny(), sharded=True)
    run = Run("blocks.0.attn.wq", 100, 110)
    schedule = dataclasses.replace(schedule, owned={0: (run,)})

    def fill(*ranges):
        state = _Runs(schedule, 0, None, torch.float32, torch.device("cpu"))
        for a, e in ranges:
            state.write(run.name, a, e, [torch.full((e - a,), float(a))] * 3, 4)
        return state.result()

    out = fill((105, 110), (100, 105))[run.name][0]
    assert out.run == run and out.step == 4 and out.tensors[0].tolist() == [100.0] * 5 + [105.0] * 5
    with pytest.raises(MigrationError, match=r"elements \[105, 110\) were never filled"):
        fill((100, 105))
    with pytest.raises(MigrationError, match=r"elements \[103, 105\) were filled twice"):
        fill((100, 105), (103, 110))
    with pytest.raises(MigrationError, match="does not own"):
        fill((95, 105))


# --------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def group(ray_cluster):
    from malleus_svc.runtime.cluster import WorkerGroup

    g = WorkerGroup(8, 4, name="test-migration").start()
    try:
        yield g
    finally:
        g.shutdown()


def _optim():
    from malleus_svc.runtime.engine import OptimConfig

    return OptimConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.5)


@pytest.fixture(scope="module")
def migrated(group):
    """Train 3 steps under A, migrate to B (small buckets: many buckets and rounds). Everything the
    tests check about the migration is taken here, right after it: the group itself goes on to be
    stepped and re-planned by test_training_continues_as_if_started_under_the_new_plan."""
    import ray

    from malleus_svc.runtime.data import GlobalSampler

    spec = {"source": "synthetic", "seq_len": 32, "num_samples": 96, "vocab": 256, "seed": 5}
    n = group.set_data(spec, "pack", 32)
    group.apply_plan(PLAN_A, _tiny(), seed=4, optim=_optim())
    sampler = GlobalSampler(n, PLAN_A.global_batch, seed=3)
    for _ in range(3):
        group.step(sampler.next_global_batch())
    before = group.full_state()
    pids = [i["pid"] for i in group.infos]
    bucket_bytes = 16 << 10
    report = group.migrate(PLAN_B, bucket_bytes=bucket_bytes)
    after = group.full_state()
    return {"before": before, "after": after, "report": report, "sampler": sampler, "pids": pids,
            "bucket_bytes": bucket_bytes, "infos_after": ray.get([w.info.remote() for w in group.workers]),
            "plan_after": group.plan}


def _assert_bitwise(a, b):
    assert set(a) == set(b)
    for k in sorted(a):
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.ray
def test_migration_is_bitwise_and_restarts_nothing(migrated):
    before, after, report = migrated["before"], migrated["after"], migrated["report"]
    assert int(before["blocks.0.attn.wq:step"]) == 3
    _assert_bitwise(before, after)   # every parameter, both Adam moments and every step count
    infos = migrated["infos_after"]
    assert [i["pid"] for i in infos] == migrated["pids"]                   # no worker restarted
    assert [i["has_engine"] for i in infos] == [d != 2 for d in range(8)]  # 2 suspended, 7 back
    assert {i["plan_id"] for i in infos} == {PLAN_B.plan_id} and migrated["plan_after"] == PLAN_B
    assert report.old_plan_id == PLAN_A.plan_id and report.new_plan_id == PLAN_B.plan_id
    assert report.per_device[2]["sent_bytes"] > 0 and report.per_device[2]["received_bytes"] == 0
    assert report.per_device[7]["sent_bytes"] == 0 and report.per_device[7]["received_bytes"] > 0
    print(f"\nmigration A->B: {report.moved_bytes} B moved ({report.inter_node_bytes} inter-node), "
          f"{report.reused_bytes} B kept, {report.moves} slices, {report.buckets} buckets, {report.rounds} rounds, "
          f"{report.seconds:.3f} s (per device max {max(report.per_device_seconds.values()):.3f} s, "
          f"comm max {max(r['comm_seconds'] for r in report.per_device.values()):.3f} s, "
          f"export max {max(r['export_seconds'] for r in report.per_device.values()):.3f} s, "
          f"engine build+load max {max(r['build_seconds'] for r in report.per_device.values()):.3f} s)")


@pytest.mark.ray
def test_reported_bytes_equal_the_planned_totals(migrated):
    report = migrated["report"]
    sched = plan_migration(PLAN_A, PLAN_B, _tiny(), bucket_bytes=migrated["bucket_bytes"])
    assert report.moved_bytes == sched.moved_bytes > 0
    assert report.inter_node_bytes == sched.inter_node_bytes > 0
    assert (report.moves, report.buckets, report.rounds) == (len(sched.slices), len(sched.buckets), sched.rounds)
    assert report.buckets > len(sched.flows())  # small buckets: pairs used several
    for d in range(8):
        r = report.per_device[d]
        assert r["sent_bytes"] == sched.sent_bytes(d) and r["received_bytes"] == sched.received_bytes(d), d
    assert set(report.per_device_seconds) == set(range(8))
    # Full state sizes: moved + kept is what the new plan holds in all.
    held = sum(3 * 4 * (h.end - h.start) * torch.Size(h.full_shape).numel() // (
        h.full_shape[0 if h.dim is None else h.dim]) for names in sched.holdings.values() for h in names.values())
    assert report.moved_bytes + report.reused_bytes == held


@pytest.mark.ray
def test_training_continues_as_if_started_under_the_new_plan(group, migrated):
    """k steps after the migration == k steps of fresh B engines loaded with the pre-migration state."""
    assert group.plan == migrated["plan_after"], "the group is no longer where the migration left it"
    sampler, k = copy.deepcopy(migrated["sampler"]), 3   # the fixture's stays where the migration left it
    batches = [sampler.next_global_batch() for _ in range(k)]
    migrated_losses = [group.step(ids).loss for ids in batches]
    migrated_full = group.full_state()

    group.apply_plan(PLAN_B, _tiny(), seed=99, optim=_optim())   # fresh engines, other init
    group.load_full_state(migrated["before"])
    _assert_bitwise(group.full_state(), migrated["before"])
    fresh_losses = [group.step(ids).loss for ids in batches]
    assert migrated_losses == fresh_losses
    _assert_bitwise(group.full_state(), migrated_full)

    # And back to A with the default bucket size: still bitwise.
    report = group.migrate(PLAN_A)
    assert report.buckets == len(plan_migration(PLAN_B, PLAN_A, _tiny()).flows())
    _assert_bitwise(group.full_state(), migrated_full)

    # To A with the TP-2 stages recomputing their blocks and the others their elementwise outputs:
    # nothing moves, and the next step is the one A's engines take (a recomputed block trains
    # bitwise like a stored one).
    recomputing = dataclasses.replace(PLAN_A, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(st, recompute="full" if st.tp == 2 else "selective")
                                            for st in p.stages)) for p in PLAN_A.pipelines))
    report = group.migrate(recomputing)
    assert report.moved_bytes == 0 and report.reused_bytes > 0
    _assert_bitwise(group.full_state(), migrated_full)
    extra = sampler.next_global_batch()
    recomputed_loss, recomputed_full = group.step(extra).loss, group.full_state()
    group.apply_plan(PLAN_A, _tiny(), seed=99, optim=_optim())
    group.load_full_state(migrated_full)
    assert group.step(extra).loss == recomputed_loss
    _assert_bitwise(group.full_state(), recomputed_full)

    # The optimizer sharded (each piece's masters and Adam moments split among its holders): the same
    # state migrates live to B, where the chunks fall elsewhere, each element from its old owner to
    # its new one (less than the replicated optimizer moves), and trains on as the replicated
    # optimizer does, up to the order of the gradient sums.
    group.apply_plan(PLAN_A, _tiny(), seed=99, optim=dataclasses.replace(_optim(), shard_optimizer=True))
    group.load_full_state(migrated["before"])
    _assert_bitwise(group.full_state(), migrated["before"])
    report = group.migrate(PLAN_B)
    assert report.moved_bytes == plan_migration(PLAN_A, PLAN_B, _tiny(), sharded=True).moved_bytes
    assert 0 < report.moved_bytes < plan_migration(PLAN_A, PLAN_B, _tiny()).moved_bytes
    assert [group.step(ids).loss for ids in batches] == pytest.approx(fresh_losses, rel=1e-6)
    for name, t in group.full_state().items():
        torch.testing.assert_close(t, migrated_full[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
