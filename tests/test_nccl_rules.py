"""NCCL's point-to-point rules on CPU (runtime/nccl_rules.py): the fake catches the classic 1F1B
deadlock of single isend/irecv calls, the batched post program passes it for many pipeline
shapes, the real engine trains exactly over it, and every migration's exchanges pass it."""
from __future__ import annotations

import functools
import random
from dataclasses import asdict

import pytest
import torch

from _mp import run_on_gloo
from _plans import BASELINE, PLAN_1, PLAN_A, PLAN_B, SHAPE_32, random_plan
from malleus_svc.config.presets import ModelShape, preset
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime.groups import pipeline_peers
from malleus_svc.runtime.nccl_rules import (NcclRuleError, Op, RulesHub, RulesMatcher, pipeline_programs,
                                            rules_exchange, run_programs, run_threads)
from malleus_svc.runtime.schedule import Compute, Post, Transfer, stage_program, stage_steps

TINY = preset("tiny")


# ---------------------------------------------------------------------------- the rules themselves
def _op(kind, peer, label="", shape=(4,)):
    return Op(kind, peer, shape, "float32", label)


def old_single_isend_programs(num_stages: int, num_micro: int) -> dict[int, list]:
    """The order the engine used before posts: per 1F1B step, one irecv (waited for) before the
    compute and one isend (left in flight) after it, each its own call."""
    programs = {}
    for j in range(num_stages):
        batches = []
        for s in stage_steps(num_stages, j, num_micro):
            label = f"{'activation' if s.kind == 'F' else 'gradient'} {s.micro}"
            if s.receive:
                batches.append(([_op("recv", j - 1 if s.kind == "F" else j + 1, label)], True))
            if s.send:
                batches.append(([_op("send", j + 1 if s.kind == "F" else j - 1, label)], False))
        programs[j] = batches
    return programs


def test_old_single_isend_order_deadlocks_under_the_rules():
    run_programs(old_single_isend_programs(2, 1))   # one micro-batch: nothing crosses, fine
    with pytest.raises(NcclRuleError) as e:
        run_programs(old_single_isend_programs(2, 2))
    msg = str(e.value)
    # stage 0 sends A1 while stage 1 sends G0; each one's receive is queued behind its send
    assert "deadlock" in msg
    assert "rank 0" in msg and "send->1 activation 1" in msg and "recv<-1 gradient 0" in msg
    assert "rank 1" in msg and "send->0 gradient 0" in msg and "recv<-0 activation 1" in msg
    assert "ranks 0 and 1 each wait to send to the other" in msg


def test_old_order_deadlocks_with_live_ranks_too():
    # The same order posted by two threads through the hub: found at once (every rank waits).
    hub = RulesHub(world=2, timeout=20)
    programs = old_single_isend_programs(2, 2)

    def rank_fn(rank):
        def run():
            for ops, wait in programs[rank]:
                seq = hub.post(rank, ops, [torch.ones(4) if o.kind == "send" else None for o in ops])
                if wait:
                    hub.wait(rank, seq)
        return run

    with pytest.raises(NcclRuleError, match="every rank waits") as e:
        run_threads({r: rank_fn(r) for r in programs}, hub)
    assert "send->1 activation 1" in str(e.value) and "send->0 gradient 0" in str(e.value)


def test_a_batch_is_a_group_and_pairs_match_in_order_whatever_the_tags():
    m = RulesMatcher()
    # both send first inside one batch each: a group, so no deadlock
    a = m.post(0, [_op("send", 1), _op("recv", 1)], ["from 0", None])
    b = m.post(1, [_op("send", 0), _op("recv", 0)], ["from 1", None])
    m.progress()
    assert m.completed(0, a) and m.completed(1, b)
    assert m.received(0, a) == ["from 1"] and m.received(1, b) == ["from 0"]
    # FIFO per ordered pair: the first send meets the first receive (ops have no tags to go by)
    s = m.post(0, [_op("send", 1), _op("send", 1)], ["x", "y"])
    r = m.post(1, [_op("recv", 0), _op("recv", 0)])
    m.progress()
    assert m.completed(0, s) and m.received(1, r) == ["x", "y"]


def test_sends_are_not_buffered_and_shapes_must_agree():
    with pytest.raises(NcclRuleError, match="deadlock"):   # both send, then both receive
        run_programs({0: [([_op("send", 1)], False), ([_op("recv", 1)], True)],
                      1: [([_op("send", 0)], False), ([_op("recv", 0)], True)]})
    with pytest.raises(NcclRuleError, match="mismatch: rank 0 sends .*rank 1 receives"):
        run_programs({0: [([_op("send", 1, shape=(4, 2))], True)], 1: [([_op("recv", 0, shape=(2, 4))], True)]})
    with pytest.raises(NcclRuleError, match="mismatch: .*activation 0.*activation 1"):   # crossed micro-batches
        run_programs({0: [([_op("send", 1, "activation 0"), _op("send", 1, "activation 1")], True)],
                      1: [([_op("recv", 0, "activation 1"), _op("recv", 0, "activation 0")], True)]})


# ---------------------------------------------------------------------------- the post program
def _pipeline(tps: list[int], micro: int) -> Plan:
    stages, d = [], 0
    for j, t in enumerate(tps):
        stages.append(Stage(tuple(range(d, d + t)), (j, j + 1)))
        d += t
    return Plan(num_devices=d, num_layers=len(tps), micro_batch_size=1, pipelines=(Pipeline(tuple(stages), micro),))


def _stage_peers(plan: Plan, pipeline: int = 0):
    return [{r: pipeline_peers(plan, r) for r in st.devices} for st in plan.pipelines[pipeline].stages]


@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 1), (2, 2), (3, 7), (4, 4), (5, 2), (8, 3)])
def test_program_posts_every_transfer_once_around_its_compute(stages, micro):
    for j in range(stages):
        program = stage_program(stages, j, micro)
        computes = [i for i in program if isinstance(i, Compute)]
        assert [(c.kind, c.micro) for c in computes] == [(s.kind, s.micro) for s in stage_steps(stages, j, micro)]
        assert not any(isinstance(a, Post) and isinstance(b, Post) for a, b in zip(program, program[1:]))
        seen: list[Transfer] = []
        done: set[tuple[str, int]] = set()
        for ins in program:
            if isinstance(ins, Post):
                assert 1 <= len(ins.transfers) <= 2
                for t in ins.sends:   # a send follows the compute that made it
                    assert ("F" if t.tensor == "activation" else "B", t.micro) in done
                seen += ins.transfers
            else:
                want = Transfer("recv", "activation" if ins.kind == "F" else "gradient", ins.micro)
                if (ins.kind == "F" and j > 0) or (ins.kind == "B" and j < stages - 1):
                    assert want in seen   # received before the compute that needs it
                done.add((ins.kind, ins.micro))
        assert len(seen) == len(set(seen)) == micro * ((j > 0) + (j < stages - 1)) * 2


def test_post_program_never_deadlocks_across_pipeline_shapes():
    rng = random.Random(11)
    for stages in range(1, 17):
        for micro in (1, 2, 3, 4, 7, stages - 1, stages, stages + 1, 31, 64):
            if micro < 1:
                continue
            tps = [rng.choice([1, 2, 3, 4]) for _ in range(stages)]
            run_programs(pipeline_programs(_stage_peers(_pipeline(tps, micro)), micro))


def test_post_program_with_real_tensors_on_live_ranks():
    # threads posting real tensors through the hub, TP groups 2 -> 1 -> 3 -> 2, micro-batches of 7
    # tokens: every boundary re-cuts each rank's rows (sequence parallelism)
    plan = _pipeline([2, 1, 3, 2], 5)
    programs = pipeline_programs(_stage_peers(plan), 5, tokens=7, width=3)
    hub = RulesHub(world=plan.num_devices, timeout=20)

    def rank_fn(rank):
        def run():
            got = []
            for ops, wait in programs[rank]:
                seq = hub.post(rank, ops, [torch.full(o.shape, float(rank)) if o.kind == "send" else None for o in ops])
                if wait:
                    got += zip([o for o in ops if o.kind == "recv"], hub.wait(rank, seq))
            return got
        return run

    results = run_threads({r: rank_fn(r) for r in programs}, hub)
    peers = {r: p for st in _stage_peers(plan) for r, p in st.items()}
    for r, got in results.items():
        rows: dict[str, list[tuple[int, int]]] = {}
        for op, t in got:        # each piece came from the peer its op names, with the rows it names
            assert tuple(t.shape) == op.shape and bool((t == op.peer).all()), (r, str(op))
            what, span = op.label.split(" rows ")
            rows.setdefault(what, []).append(tuple(map(int, span.split(":"))))
        lo, hi = peers[r].rows(7)  # and together they are this rank's rows of every tensor it receives
        expected = 5 * ((peers[r].prev != ()) + (peers[r].next != ()))
        assert len(rows) == expected and all(sorted(v)[0][0] == lo and sorted(v)[-1][1] == hi and
                                             sum(b - a for a, b in v) == hi - lo for v in rows.values())


# ---------------------------------------------------------------------------- the real engine
RULES_PLAN = Plan(
    num_devices=6, num_layers=4, micro_batch_size=2,
    pipelines=(
        Pipeline((Stage((0, 1), (0, 1)), Stage((2,), (1, 3)), Stage((3,), (3, 4))), micro_batches=4),
        Pipeline((Stage((4,), (0, 2)), Stage((5,), (2, 4))), micro_batches=2),
    ),
)
# One pipeline deeper than its stages' TP mix is wide: 4 stages (TP 1, 2, 1, 1), 8 micro-batches,
# so 1F1B's steady state posts a send and a receive to both neighbours at once.
DEEP_PLAN = Plan(
    num_devices=5, num_layers=4, micro_batch_size=1,
    pipelines=(Pipeline((Stage((0,), (0, 1)), Stage((1, 2), (1, 2)), Stage((3,), (2, 3)), Stage((4,), (3, 4))),
                        micro_batches=8),),
)


def _train_under_rules(rank: int, world: int, plan: Plan, batches, hub, shape: ModelShape):
    from malleus_svc.runtime.engine import Engine
    from malleus_svc.runtime.nccl_rules import RulesTransport
    from test_engine import OPTIM, SEED, _pipeline_share

    if rank not in plan.roles():
        return None      # suspended: builds nothing, posts nothing
    engine = Engine(shape, plan, rank, seed=SEED, optim=OPTIM, dtype=torch.float64,
                    transport=functools.partial(RulesTransport, hub=hub, rank=rank))
    stats = []
    for batch in batches[:-1]:
        loss_tokens = sum(mb.num_loss_tokens for mb in batch)
        stats.append(asdict(engine.train_step(_pipeline_share(plan, engine.role.pipeline, batch), loss_tokens)))
    # the last batch evaluated: the forward-only program's posts under the same rules
    held_out = batches[-1]
    evaluated = engine.eval_step(_pipeline_share(plan, engine.role.pipeline, held_out),
                                 sum(mb.num_loss_tokens for mb in held_out))
    return {"role": engine.role, "stats": stats, "state": engine.export_state(), "eval": evaluated}


# a vocabulary no TP size divides, split by rows unevenly at both ends, against one pipeline that
# holds it whole: the gradient reduction meets shards of 28, 28, 29 rows and one of 85
ODD_VOCAB_PLAN = Plan(
    num_devices=8, num_layers=3, micro_batch_size=2,
    pipelines=(Pipeline((Stage((0, 1, 2), (0, 1)), Stage((3,), (1, 2)), Stage((4, 5, 6), (2, 3))), micro_batches=3),
               Pipeline((Stage((7,), (0, 3)),), micro_batches=1)),
)


@pytest.mark.parametrize("plan", [RULES_PLAN, DEEP_PLAN, PLAN_A, ODD_VOCAB_PLAN],
                         ids=["uneven-tp", "deep", "suspended-cross-node", "odd-vocab"])
def test_engine_over_the_rules_transport_matches_the_reference(plan):
    from malleus_svc.runtime.engine import assemble_full
    from malleus_svc.runtime.nccl_rules import serve_hub
    from malleus_svc.runtime.reference import reference_loss, reference_train
    from test_engine import ODD_VOCAB, OPTIM, SEED, global_batches

    shape = ODD_VOCAB if plan is ODD_VOCAB_PLAN else TINY
    batches = global_batches(steps=3, micro_batches=plan.num_micro_batches, micro_batch_size=plan.micro_batch_size,
                             vocab=shape.vocab)
    manager, hub = serve_hub(plan.num_devices, timeout=60)
    try:
        results = [r for r in run_on_gloo(_train_under_rules, plan.num_devices, plan, batches, hub, shape)
                   if r is not None]
    finally:
        manager.shutdown()
    ref_losses, ref_params, _ = reference_train(shape, SEED, OPTIM, batches[:-1], torch.float64)
    ref_eval = reference_loss(shape, ref_params, batches[-1])
    for r in results:
        assert [s["global_loss"] for s in r["stats"]] == pytest.approx(ref_losses, rel=1e-9)
        assert r["eval"] == pytest.approx(ref_eval, rel=1e-9)
        assert all(s["comm_seconds"] >= 0 and s["compute_seconds"] > 0 for s in r["stats"])
    full = assemble_full(r["state"] for r in results)
    for name, ref in ref_params.items():
        torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------- migrations
SHAPE_6 = ModelShape(layers=6, hidden=32, heads=4, ffn=64, vocab=64, seq_len=16)


def _full_states(shape: ModelShape):
    """Whole tensors with distinct moments, as ShardStates every rank can send any rows of."""
    from malleus_svc.runtime.engine import full_shard_states
    from malleus_svc.runtime.model import full_model

    g = torch.Generator().manual_seed(0)
    full = {}
    for name, p in full_model(shape, 3).named_parameters():
        full[name] = p.detach().clone()
        full[name + ":exp_avg"] = torch.randn(p.shape, generator=g)
        full[name + ":exp_avg_sq"] = torch.rand(p.shape, generator=g)
        full[name + ":step"] = torch.tensor(5)
    return full, full_shard_states(full)


def _migrate_under_rules(old: Plan, new: Plan, shape: ModelShape, **kw) -> None:
    from malleus_svc.runtime.migrate import execute_migration, plan_migration

    sched = plan_migration(old, new, shape, **kw)
    full, states = _full_states(shape)
    hub = RulesHub(world=old.num_devices, timeout=20)
    results = run_threads({r: functools.partial(execute_migration, sched, r, states, check_digest=False,
                                                exchange=rules_exchange(hub, r))
                           for r in range(old.num_devices)}, hub)
    for rank, (out, _) in results.items():   # and what arrived is the right rows
        for name, st in out.items():
            axis = 0 if st.dim is None else st.dim
            assert torch.equal(st.param, full[name].narrow(axis, st.start, st.end - st.start)), (rank, name)
            assert torch.equal(st.exp_avg, full[name + ":exp_avg"].narrow(axis, st.start, st.end - st.start))


@pytest.mark.parametrize("bucket_bytes", [1, 700, 4096, 16 << 10, 50_000, 64 << 20])
def test_migration_exchanges_pass_the_rules_tiny(bucket_bytes):
    _migrate_under_rules(PLAN_A, PLAN_B, TINY, bucket_bytes=bucket_bytes)


def test_migration_exchanges_pass_the_rules_worked_example():
    _migrate_under_rules(BASELINE, PLAN_1, SHAPE_32)
    _migrate_under_rules(BASELINE, PLAN_1, SHAPE_32, unavailable=[5])


def test_migration_of_an_odd_vocabulary_between_tp_degrees_passes_the_rules():
    """Uneven row shards of the vocabulary (85 rows) move between TP 3, TP 1 and back: every row
    arrives once, where the new plan holds it."""
    from test_engine import ODD_VOCAB

    whole = Plan(8, 3, 2, (Pipeline((Stage((7,), (0, 3)),), micro_batches=1),
                           Pipeline((Stage((3,), (0, 1)), Stage((0, 1, 2), (1, 2)), Stage((4,), (2, 3))),
                                    micro_batches=3)), suspended=(5, 6))
    _migrate_under_rules(ODD_VOCAB_PLAN, whole, ODD_VOCAB)
    _migrate_under_rules(whole, ODD_VOCAB_PLAN, ODD_VOCAB)


def test_migration_exchanges_pass_the_rules_random_plans():
    rng = random.Random(7)
    for _ in range(12):
        old, new = random_plan(rng), random_plan(rng)
        _migrate_under_rules(old, new, SHAPE_6, bucket_bytes=rng.choice([1000, 5000, 1 << 20]))


def test_a_crossed_migration_exchange_fails_the_rules():
    # one rank posting its round's messages in the other order than its peer deadlocks
    hub = RulesHub(world=2, timeout=20)
    ex0, ex1 = rules_exchange(hub, 0), rules_exchange(hub, 1)
    from malleus_svc.runtime.transport import Message

    def rank0():
        ex0([Message("send", torch.ones(2), 1)], 0)
        ex0([Message("recv", torch.empty(2), 1)], 0)

    def rank1():
        ex1([Message("send", torch.ones(2), 0)], 0)
        ex1([Message("recv", torch.empty(2), 0)], 0)

    with pytest.raises(NcclRuleError, match="each wait to send to the other"):
        run_threads({0: rank0, 1: rank1}, hub)
