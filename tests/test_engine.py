"""The engine against the single-process oracle, on real gloo process groups.

The multi-process tests spawn one process per device (torch.multiprocessing + gloo, one thread
each); `_mp.run_on_gloo` hands each process's return value back to the test.
"""
from __future__ import annotations

import dataclasses
import itertools
import traceback
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters as dynamo_counters
from torch.utils._python_dispatch import TorchDispatchMode

from _mp import run_on_gloo
from malleus_svc.config.presets import ModelShape, preset
from malleus_svc.costmodel.profile import RECOMPUTED_FORWARD
from malleus_svc.geometry import one_f_one_b, split_dim
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime.batch import IGNORE_INDEX, MicroBatch
from malleus_svc.runtime.engine import STEP, Engine, OptimConfig, assemble_full, full_shard_states
from malleus_svc.runtime.gradient_sync import GRAD_BUCKET_BYTES, item_runs
from malleus_svc.runtime.memory import saved_for_backward
from malleus_svc.runtime.model import (Block, StageModel, build_stage_model, compile_blocks, full_model, init_part,
                                     take_shard)
from malleus_svc.runtime.reference import reference_loss, reference_train
from malleus_svc.runtime.tensor_parallel import TensorParallel

TINY = preset("tiny")
SEED = 1234
# Clip at a norm the tiny model exceeds, so clipping is exercised too.
OPTIM = OptimConfig(lr=1e-3, grad_clip=0.5)
SHARDED = dataclasses.replace(OPTIM, shard_optimizer=True)   # Adam's state split among a piece's holders


# ---------------------------------------------------------------------------- data
def packed_micro_batch(gen: torch.Generator, lengths: list[int], vocab: int, first_id: int) -> MicroBatch:
    """Random sequences packed into one row; each sequence's first target is ignored (a 'prompt')."""
    tokens, targets = [], []
    for n in lengths:
        seq = torch.randint(vocab, (n + 1,), generator=gen)
        tgt = seq[1:].clone()
        tgt[0] = IGNORE_INDEX
        tokens.append(seq[:-1])
        targets.append(tgt)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return MicroBatch(torch.cat(tokens), torch.cat(targets), cu, tuple(range(first_id, first_id + len(lengths))))


def global_batches(steps: int, micro_batches: int, micro_batch_size: int, seed: int = 13,
                   vocab: int = TINY.vocab) -> list[list[MicroBatch]]:
    gen = torch.Generator().manual_seed(seed)
    out, sample = [], 0
    for _ in range(steps):
        batch = []
        for _ in range(micro_batches):
            lengths = torch.randint(3, 30, (micro_batch_size,), generator=gen).tolist()
            batch.append(packed_micro_batch(gen, lengths, vocab, sample))
            sample += micro_batch_size
        out.append(batch)
    return out


# ---------------------------------------------------------------------------- exactness
HETERO = Plan(
    num_devices=7, num_layers=4, micro_batch_size=2,
    pipelines=(
        Pipeline((Stage((0, 1), (0, 1)), Stage((2,), (1, 3)), Stage((3,), (3, 4))), micro_batches=3),
        Pipeline((Stage((4,), (0, 2)), Stage((5,), (2, 4))), micro_batches=2),
    ),
    suspended=(6,),
)


def _pipeline_share(plan: Plan, pipeline: int, batch: list[MicroBatch]) -> list[MicroBatch]:
    start = sum(p.micro_batches for p in plan.pipelines[:pipeline])
    return batch[start:start + plan.pipelines[pipeline].micro_batches]


def _train_on_plan(rank: int, world: int, plan: Plan, batches: list[list[MicroBatch]], dtype: torch.dtype,
                   bucket_bytes: int = GRAD_BUCKET_BYTES, held_out: list[MicroBatch] | None = None, shape=TINY,
                   optim: OptimConfig = OPTIM, states=None):
    if rank not in plan.roles():
        return None  # suspended: builds nothing, joins no group
    engine = Engine(shape, plan, rank, seed=SEED, optim=optim, dtype=dtype)
    if states is not None:
        engine.load_state(states)
    sync, role = engine.grad_sync, engine.role
    sync.bucket_bytes = bucket_bytes
    stats = []
    for batch in batches:
        loss_tokens = sum(mb.num_loss_tokens for mb in batch)
        stats.append(asdict(engine.train_step(_pipeline_share(plan, role.pipeline, batch), loss_tokens)))
    buckets = sum(len(list(item_runs([sync._view(it).numel() * sync._view(it).element_size() for it in items],
                                     bucket_bytes))) for items in sync.buckets.values())
    state = engine.export_state()
    evaluated = None if held_out is None else engine.eval_step(_pipeline_share(plan, role.pipeline, held_out),
                                                               sum(mb.num_loss_tokens for mb in held_out))
    after = engine.export_state()        # collective when sharded: every device calls it once
    assert all(torch.equal(st.param, after[n].param) for n, st in state.items())   # eval changes nothing
    adam_elements = sum(s["exp_avg"].numel() for s in engine.optimizer.state.values()) + sum(
        sum(m.numel() for m in b.moments[:1]) for b in getattr(sync, "chunked", []))
    return {"role": role, "stats": stats, "state": state, "buckets": (buckets, len(sync.buckets)), "eval": evaluated,
            "adam_elements": adam_elements, "param_elements": sum(p.numel() for p in engine.params.values())}


# HETERO with its stages recomputing in backward: its TP2 stage and one of the other pipeline their
# blocks, one of each pipeline their elementwise outputs.
RECOMPUTED = dataclasses.replace(HETERO, pipelines=(
    Pipeline((Stage((0, 1), (0, 1), "full"), Stage((2,), (1, 3), "selective"), Stage((3,), (3, 4))), micro_batches=3),
    Pipeline((Stage((4,), (0, 2), "selective"), Stage((5,), (2, 4), "full")), micro_batches=2),
))
# ... and the other way round: the TP2 stage selective.
SELECTIVE = dataclasses.replace(HETERO, pipelines=(
    Pipeline((Stage((0, 1), (0, 1), "selective"), Stage((2,), (1, 3), "full"), Stage((3,), (3, 4))), micro_batches=3),
    Pipeline((Stage((4,), (0, 2), "full"), Stage((5,), (2, 4), "selective")), micro_batches=2),
))


# The embedding and the head at TP 1 in one pipeline and TP 2 in the other: their vocabulary rows
# split two ways, reduced over the finest common partition.
VOCAB_SPLIT = Plan(
    num_devices=7, num_layers=4, micro_batch_size=2,
    pipelines=(
        Pipeline((Stage((0,), (0, 1)), Stage((1, 2), (1, 4))), micro_batches=3),
        Pipeline((Stage((3, 4), (0, 2)), Stage((5,), (2, 4))), micro_batches=2),
    ),
    suspended=(6,),
)


@pytest.mark.parametrize("plan, optim", [(HETERO, OPTIM), (HETERO, SHARDED), (RECOMPUTED, OPTIM),
                                         (SELECTIVE, SHARDED), (VOCAB_SPLIT, SHARDED)],
                         ids=["replicated", "sharded", "recomputed", "selective-sharded", "vocab-split-sharded"])
def test_heterogeneous_plan_matches_single_process_training(plan, optim):
    # fp64 on both sides: in fp32 a handful of elements whose gradient nearly cancels (|g| ~ 1e-8)
    # have a rounding-level gradient difference that Adam's g / sqrt(v) normalisation blows up to
    # ~1e-6 in the parameter; in fp64 every element must agree, so any weighting error shows.
    dtype = torch.float64
    batches = global_batches(steps=4, micro_batches=plan.num_micro_batches, micro_batch_size=2)
    batches, held_out = batches[:3], batches[3]
    # Gradients reduced in buckets of 512 bytes: several per group, and views alone in theirs in place.
    results = run_on_gloo(_train_on_plan, plan.num_devices, plan, batches, dtype, 512, held_out, TINY, optim)
    ref_losses, ref_params, ref_optim = reference_train(TINY, SEED, OPTIM, batches, dtype)
    # Sharded: both pipelines hold every piece, so the devices hold Adam's state for half the
    # elements they hold (a little less: the TP pair's rank 1 gets its norm weights ready-made).
    held = sum(r["adam_elements"] for r in results if r) / sum(r["param_elements"] for r in results if r)
    assert (held == 1.0) if not optim.shard_optimizer else (0.45 <= held <= 0.5 + 1e-3), held
    assert any(r["buckets"][0] > r["buckets"][1] for r in results if r)
    # An evaluation forward only through the pipelines == one process's loss on the trained weights.
    evaluated = {r["eval"] for r in results if r}
    assert len(evaluated) == 1 and evaluated.pop() == pytest.approx(reference_loss(TINY, ref_params, held_out),
                                                                   rel=1e-9)

    # Losses: the sum of the pipelines' shares (reported by each last stage's TP rank 0).
    last = [r for r in results if r and r["role"].is_last and r["role"].tp_rank == 0]
    assert len(last) == 2
    losses = [sum(r["stats"][s]["loss"] for r in last) for s in range(3)]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for r in results:
        if r:
            assert [s["global_loss"] for s in r["stats"]] == pytest.approx(ref_losses, rel=1e-5)
            assert all(s["compute_seconds"] > 0 and s["comm_seconds"] >= 0 for s in r["stats"])
    # The data make a per-pipeline average differ from the true mean by far more than the tolerance:
    # pipeline 0 runs 3 of 5 micro-batches but holds neither 3/5 nor 1/2 of any step's loss tokens.
    for batch in batches:
        share0 = sum(mb.num_loss_tokens for mb in batch[:3]) / sum(mb.num_loss_tokens for mb in batch)
        assert abs(share0 - 0.6) > 0.05 and abs(share0 - 0.5) > 0.05
    # Clipping is active (the norm exceeds the clip) at least in the first step.
    assert results[0]["stats"][0]["grad_norm"] > OPTIM.grad_clip

    full = assemble_full(r["state"] for r in results if r)
    assert set(full) == set(ref_params) | set(ref_optim)
    for name, ref in ref_params.items():
        torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    for name, ref in ref_optim.items():
        if name.endswith(STEP):
            assert int(full[name]) == int(ref) == 3, name
        else:
            torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


TP2 = Plan(num_devices=2, num_layers=4, micro_batch_size=2,
           pipelines=(Pipeline((Stage((1, 0), (0, 4)),), micro_batches=5),))
ONE = Plan(num_devices=1, num_layers=4, micro_batch_size=2, pipelines=(Pipeline((Stage((0,), (0, 4)),), micro_batches=5),))
TIED = dataclasses.replace(TINY, tie_embeddings=True)


@pytest.mark.parametrize("plan, optim", [(HETERO, OPTIM), (HETERO, SHARDED), (VOCAB_SPLIT, OPTIM), (TP2, OPTIM),
                                         (ONE, OPTIM)],
                         ids=["heterogeneous", "heterogeneous-sharded", "vocab-split", "tp2", "one-device"])
def test_a_tied_head_trains_as_one_weight_under_any_plan(plan, optim):
    """The head tied to the embedding: its copies (on other devices, in TP groups, or both on one
    device) sum their gradients before the update, count once in the norm and decay as the
    embedding does, so they stay equal bit for bit and train as the one shared parameter of a
    single process does."""
    dtype = torch.float64
    batches = global_batches(steps=3, micro_batches=plan.num_micro_batches, micro_batch_size=2)
    results = run_on_gloo(_train_on_plan, plan.num_devices, plan, batches, dtype, GRAD_BUCKET_BYTES, None, TIED, optim)
    ref_losses, ref_params, ref_optim = reference_train(TIED, SEED, OPTIM, batches, dtype)
    last = [r for r in results if r and r["role"].is_last and r["role"].tp_rank == 0]
    losses = [sum(r["stats"][s]["loss"] for r in last) for s in range(3)]
    assert losses == pytest.approx(ref_losses, rel=1e-9)
    full = assemble_full(r["state"] for r in results if r)
    # every copy's vocabulary rows (the whole, or a TP rank's slice) equal the embedding's, bit for bit
    copies = [r["state"][n] for r in results if r for n in ("embedding.weight", "head.weight") if n in r["state"]]
    assert len(copies) >= 2 and all(
        torch.equal(c.param, full["embedding.weight"][c.start:c.end])
        and torch.equal(c.exp_avg, full["embedding.weight:exp_avg"][c.start:c.end]) for c in copies)
    for name, ref in {**ref_params, **ref_optim}.items():
        if not name.endswith(STEP):
            torch.testing.assert_close(full[name], ref, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")
    # Tied is another model: trained untied from the same start, the head leaves the embedding.
    _, untied, _ = reference_train(TINY, SEED, OPTIM, batches[:1], dtype)
    assert torch.equal(init_part(TIED, "head", SEED)["head.weight"], init_part(TIED, "embedding", SEED)["embedding.weight"])
    assert (untied["head.weight"] - ref_params["head.weight"]).abs().max() > 1e-4


def _resume_and_train(rank: int, world: int, states, batch: list[MicroBatch], init: bool, shape=TINY):
    import malleus_svc.runtime.model as model_mod

    drawn, draw = [], model_mod._tile      # this worker process's own count of initialisation tiles
    model_mod._tile = lambda *a: drawn.append(a) or draw(*a)
    engine = Engine(shape, TP2, rank, seed=SEED + 1, optim=OPTIM, dtype=torch.float64, init=init)  # load must win
    engine.load_state(states)
    engine.train_step(batch, sum(mb.num_loss_tokens for mb in batch))
    return engine.export_state(), len(drawn)


@pytest.mark.parametrize("init, shape", [(True, TINY), (False, TINY), (False, TIED)], ids=["init", "no-init", "tied"])
def test_state_moves_to_another_plan_and_training_continues_exactly(init, shape):
    # One step on the reference, its full state cut into shards for a TP=2 plan (devices listed
    # out of order), one more step there: equal to two steps on the reference (a tied head too).
    dtype = torch.float64
    batches = global_batches(steps=2, micro_batches=5, micro_batch_size=2, seed=3)
    _, params1, optim1 = reference_train(shape, SEED, OPTIM, batches[:1], dtype)
    states = full_shard_states({**params1, **optim1})
    results = run_on_gloo(_resume_and_train, 2, states, batches[1], init, shape)
    exports = [r[0] for r in results]
    assert all((drawn > 0) == init for _, drawn in results)   # state about to be loaded: no init at all
    _, params2, optim2 = reference_train(shape, SEED, OPTIM, batches, dtype)
    full = assemble_full(exports)
    for name, ref in {**params2, **optim2}.items():
        torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


# Another held-out plan: three pipelines, TP 2 feeding TP 1 in one, a device holding a whole pipeline.
THREE_WAY = Plan(
    num_devices=5, num_layers=4, micro_batch_size=2,
    pipelines=(
        Pipeline((Stage((0,), (0, 4)),), micro_batches=2),
        Pipeline((Stage((1, 2), (0, 3)), Stage((3,), (3, 4))), micro_batches=2),
        Pipeline((Stage((4,), (0, 4)),), micro_batches=1),
    ),
)


SEVEN_WAY = dataclasses.replace(THREE_WAY, num_devices=7, suspended=(5, 6))   # in HETERO's world


def _sharded_engine(rank: int, plan: Plan, shape: ModelShape, compute: torch.dtype | None) -> Engine | None:
    """A sharded engine with small gradient buckets (many chunks): fp64, or fp32 masters under bf16
    working weights (the GPU's precision, whose masters are shed after the first update)."""
    if rank not in plan.roles():
        return None
    engine = Engine(shape, plan, rank, seed=SEED, optim=SHARDED, dtype=torch.float64 if compute is None else torch.float32,
                    compute_dtype=compute)
    engine.grad_sync.bucket_bytes = 512
    return engine


def _step_on(engine: Engine, plan: Plan, batch: list[MicroBatch]) -> float:
    return engine.train_step(_pipeline_share(plan, engine.role.pipeline, batch),
                             sum(mb.num_loss_tokens for mb in batch)).global_loss


def _owned_migration(rank: int, world: int, batches, shape: ModelShape, compute: torch.dtype | None):
    from malleus_svc.runtime.migrate import execute_migration, plan_migration
    from malleus_svc.runtime.state_owners import owned_runs

    old = _sharded_engine(rank, HETERO, shape, compute)
    if old is not None:
        _step_on(old, HETERO, batches[0])
    before = old.export_state() if old is not None else None    # gathered: for the other path only
    itemsize = 8 if compute is None else 4
    schedule = plan_migration(HETERO, SEVEN_WAY, shape, itemsize=itemsize, sharded=True, grad_bucket_bytes=512)
    owned = old.export_owned() if old is not None else None
    if owned is not None:      # the engine's chunks are the ones the plan alone says it owns
        assert sorted(st.run for st in owned) == sorted(owned_runs(HETERO, rank, shape, itemsize=itemsize,
                                                                   bucket_bytes=512))
    held = sum(st.tensors[1].numel() for st in owned or ())     # moments: this device's share only
    states, stats = execute_migration(schedule, rank, owned)
    del old, owned
    new = _sharded_engine(rank, SEVEN_WAY, shape, compute)
    if new is None:
        return before, None, None, stats.sent_bytes, held
    new.load_owned(states)
    loss = _step_on(new, SEVEN_WAY, batches[1])
    return before, new.export_state(), loss, stats.sent_bytes, held


def _gathered_migration(rank: int, world: int, states, batch, shape: ModelShape, compute: torch.dtype | None):
    engine = _sharded_engine(rank, SEVEN_WAY, shape, compute)
    if engine is None:
        return None, None
    engine.load_state(states)
    loss = _step_on(engine, SEVEN_WAY, batch)
    return engine.export_state(), loss


@pytest.mark.parametrize("shape, compute", [(TINY, None), (TIED, None), (TINY, torch.bfloat16)],
                         ids=["fp64", "tied", "bf16-working-weights"])
def test_a_sharded_optimizer_state_moves_between_plans_exactly(shape, compute):
    """Sharded on one plan, migrated live to another whose chunks fall elsewhere: each element's
    master and moments go from its old owner to its new one (nothing gathered), and the next step
    is, bit for bit, the one taken after loading the gathered state; in fp64 two steps equal one
    process's two. The migration moves less than the replicated optimizer's would."""
    from malleus_svc.runtime.migrate import plan_migration

    batches = global_batches(steps=2, micro_batches=5, micro_batch_size=2, seed=7)
    owned = run_on_gloo(_owned_migration, HETERO.num_devices, batches, shape, compute)
    before = assemble_full(r[0] for r in owned if r[0] is not None)
    gathered = run_on_gloo(_gathered_migration, SEVEN_WAY.num_devices, full_shard_states(before), batches[1],
                           shape, compute)
    assert [r[2] for r in owned] == [loss for _, loss in gathered] and len({r[2] for r in owned}) == 2   # and None
    full = assemble_full(r[1] for r in owned if r[1] is not None)
    ref = assemble_full(st for st, _ in gathered if st is not None)
    assert full.keys() == ref.keys() and all(torch.equal(full[n], ref[n]) for n in ref)
    if compute is None:
        _, params, optim = reference_train(shape, SEED, OPTIM, batches, torch.float64)
        for name, t in {**params, **optim}.items():
            torch.testing.assert_close(full[name], t, rtol=1e-7, atol=1e-9, msg=lambda m: f"{name}: {m}")
    # every element's moments were on one device; each moved at most once, to its new owner only
    itemsize = 8 if compute is None else 4
    assert sum(r[4] for r in owned) == sum(t.numel() for n, t in before.items() if n.endswith(":exp_avg")
                                           and not (shape.tie_embeddings and n.startswith("head.")))
    sent = sum(r[3] for r in owned)
    sharded = plan_migration(HETERO, SEVEN_WAY, shape, itemsize=itemsize, sharded=True, grad_bucket_bytes=512)
    assert 0 < sent == sharded.moved_bytes < plan_migration(HETERO, SEVEN_WAY, shape, itemsize=itemsize).moved_bytes


def _owned_without_a_world(rank: int, world: int):
    from malleus_svc.runtime.state_owners import owned_runs

    engine = _sharded_engine(rank, HETERO, TINY, None)
    if engine is None:
        return None
    def gone(*args, **kwargs):
        raise RuntimeError("the world is gone")

    # as after a lost peer whose NCCL world was aborted: torch.distributed knows no group any more
    for name in ("get_group_rank", "get_world_size", "get_rank", "all_gather_single", "all_reduce", "barrier"):
        setattr(dist, name, gone)
    owned = engine.export_owned()      # its buckets were never cut: no step ran
    return sorted(st.run for st in owned) == sorted(owned_runs(HETERO, rank, TINY, itemsize=8, bucket_bytes=512))


def test_a_survivor_names_its_owned_state_without_a_world():
    """A sharded engine gives what it owns for a migration with its world gone (a survivor of a lost
    peer closes keeping it), also before its first step has cut its buckets."""
    assert [r for r in run_on_gloo(_owned_without_a_world, HETERO.num_devices) if r is not None] == [True] * 6


def _two_phase(rank: int, world: int, batches: list[list[MicroBatch]]):
    engine = Engine(TINY, ONE, rank, seed=SEED, optim=OPTIM, dtype=torch.float64)
    before = engine.export_state()
    engine.train_step(batches[0], sum(mb.num_loss_tokens for mb in batches[0]), apply=False)
    pending = engine.export_state()                    # what a recovery would export: the state before
    engine.train_step(batches[1], sum(mb.num_loss_tokens for mb in batches[1]), apply=False)  # drops it
    engine.apply_update()
    try:
        engine.apply_update()
        twice = None
    except RuntimeError as e:
        twice = str(e)
    return before, pending, engine.export_state(), twice


def _update_reports(rank: int, world: int, batches: list[list[MicroBatch]]):
    engine = Engine(TINY, ONE, rank, seed=SEED, optim=OPTIM, dtype=torch.float64)
    nbytes = 7 * sum(p.numel() * p.element_size() for p in engine.params.values())
    stats = []
    for apply in (False, False, True):   # the worker group's two phases, then an update inside the step
        stats.append(engine.train_step(batches[0], sum(mb.num_loss_tokens for mb in batches[0]), apply=apply))
        if not apply:
            engine.apply_update()
    return nbytes, [(s.update_seconds, s.update_bytes) for s in stats]


def test_a_step_reports_the_update_before_it_with_the_bytes_it_moved():
    """Each step reports the device time of the update(s) its clock timed since its last read (the
    one applied after the previous step, or its own) with that update's bytes: the coordinator's
    seconds per update byte."""
    batches = global_batches(steps=1, micro_batches=2, micro_batch_size=2, seed=5)
    nbytes, reports = run_on_gloo(_update_reports, 1, batches)[0]
    assert reports[0] == (0.0, 0.0)                      # nothing applied before the first step
    (one, moved_one), (two, moved_two) = reports[1:]
    assert one > 0 and moved_one == nbytes               # the update applied after the step before
    assert two > 0 and moved_two == 2 * nbytes           # that one, and the step's own


def test_an_update_waits_for_apply_and_a_new_step_drops_an_unapplied_one():
    # The worker group's two-phase step: train_step(apply=False) runs every collective but changes
    # no state; a step that is not applied (the group saw a device fail) is dropped by the next.
    batches = global_batches(steps=2, micro_batches=5, micro_batch_size=2, seed=5)
    before, pending, after, twice = run_on_gloo(_two_phase, 1, batches)[0]
    for name, st in before.items():
        assert torch.equal(pending[name].param, st.param) and pending[name].step == st.step == 0, name
    _, params, optim = reference_train(TINY, SEED, OPTIM, batches[1:], torch.float64)   # batch 1 only
    full = assemble_full([after])
    for name, ref in {**params, **optim}.items():
        torch.testing.assert_close(full[name], ref, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")
    assert twice and "no finished train_step" in twice


def _overlapped(rank: int, world: int, optim: OptimConfig, compute: torch.dtype):
    if rank not in HETERO.roles():
        return None
    engine = Engine(TINY, HETERO, rank, seed=SEED, optim=optim, compute_dtype=compute)
    engine.grad_sync.bucket_bytes = 512
    batch = global_batches(steps=1, micro_batches=HETERO.num_micro_batches, micro_batch_size=2)[0]
    stats = engine.train_step(_pipeline_share(HETERO, engine.role.pipeline, batch),
                              sum(mb.num_loss_tokens for mb in batch))
    sync = engine.grad_sync
    return sync.launched_early, sync.pending_at_first_launch, len(engine.model.blocks), stats.global_loss


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-working-weights"])
def test_gradient_buckets_are_reduced_behind_the_last_backward(sharded, compute):
    """With overlap, the gradient hooks launch buckets while the step's last backward still runs
    (the master weights' hooks also fire when a bf16 working copy computed the gradient); without,
    every bucket waits for backward's end. The losses agree either way."""
    optim = dataclasses.replace(OPTIM, shard_optimizer=sharded)
    on = [r for r in run_on_gloo(_overlapped, HETERO.num_devices, optim, compute) if r]
    off = [r for r in run_on_gloo(_overlapped, HETERO.num_devices,
                                  dataclasses.replace(optim, overlap_grad_reduce=False), compute) if r]
    assert all(early == 0 and pending == 0 for early, pending, *_ in off)
    # a device of several blocks launches its first bucket while the others' gradients are to come
    assert all(early > 0 for early, *_ in on) and all(pending > 0 for _, pending, blocks, _ in on if blocks > 1)
    assert {loss for *_, loss in on} == {loss for *_, loss in off} and len({loss for *_, loss in on}) == 1


def _mixed_steps(rank: int, world: int, optim: OptimConfig, batches):
    if rank not in HETERO.roles():
        return None
    engine = Engine(TINY, HETERO, rank, seed=SEED, optim=optim, compute_dtype=torch.bfloat16)
    held = sum(p.untyped_storage().nbytes() for p in engine.params.values())
    losses = [engine.train_step(_pipeline_share(HETERO, engine.role.pipeline, b),
                                sum(mb.num_loss_tokens for mb in b)).global_loss for b in batches]
    after = sum(p.untyped_storage().nbytes() for p in engine.params.values())
    state = engine.export_state()
    engine.load_state(state)             # whole masters again, shed again at the next step
    losses.append(engine.train_step(_pipeline_share(HETERO, engine.role.pipeline, batches[0]),
                                    sum(mb.num_loss_tokens for mb in batches[0])).global_loss)
    return losses, state, held, after


def test_a_sharded_optimizer_on_working_weights_keeps_one_chunk_of_the_masters():
    """bf16 working weights with fp32 masters, the GPU's precision: sharded, a device keeps the fp32
    masters of its own chunks only (the rest of the masters' storage is freed after the first
    update), and trains exactly as the replicated optimizer does, through an export and a load."""
    batches = global_batches(steps=2, micro_batches=HETERO.num_micro_batches, micro_batch_size=2, seed=9)
    sharded = [r for r in run_on_gloo(_mixed_steps, HETERO.num_devices, SHARDED, batches) if r]
    replicated = [r for r in run_on_gloo(_mixed_steps, HETERO.num_devices, OPTIM, batches) if r]
    assert [r[0] for r in sharded] == [r[0] for r in replicated]
    full_s, full_r = assemble_full(r[1] for r in sharded), assemble_full(r[1] for r in replicated)
    for name, t in full_r.items():
        assert torch.equal(full_s[name], t), name
    assert all(r[3] == r[2] for r in replicated)
    # every piece is held by both pipelines: the masters left are about none (the TP pair's rank 1
    # keeps nothing either: its norms come from rank 0)
    assert sum(r[3] for r in sharded) < 0.01 * sum(r[2] for r in sharded)


# ---------------------------------------------------------------------------- compiled blocks
@pytest.mark.parametrize("compute, recompute, stance", [
    (torch.float32, "none", "default"), (torch.bfloat16, "none", "default"), (torch.bfloat16, "full", "default"),
    (torch.bfloat16, "selective", "default"), (torch.bfloat16, "selective", "force_eager")])
def test_compiled_blocks_train_like_eager_ones(compute, recompute, stance):
    """Regional compile (the default on CUDA) changes kernels, not the computation: losses and every
    gradient as the eager engine's within the rounding of the compute dtype (fused kernels sum in
    another order: fp32 rtol 1e-5; bf16 activations rtol 2e-2 on the loss, gradients to 2e-2 of
    their largest entry), and the parameters keep their checkpoint names. Compiled blocks that are
    recomputed in backward, whole or selectively, too (against eager ones that are not); and a
    compiled selective block the compiler runs eagerly after all (a graph break, its recompile
    limit: `force_eager` here), whose recomputation must run on the bf16 working weights, not on
    the fp32 masters its module holds again by backward."""
    batches = global_batches(steps=2, micro_batches=2, micro_batch_size=2, seed=7)
    runs = {}
    for compiled in (False, True):
        plan = Plan(1, 4, 2, (Pipeline((Stage((0,), (0, 4), recompute if compiled else "none"),), micro_batches=5),))
        engine = Engine(TINY, plan, 0, seed=SEED, optim=dataclasses.replace(OPTIM, compile=compiled),
                        compute_dtype=compute)
        losses, grads = [], None
        for batch in batches:
            with torch.compiler.set_stance(stance if compiled else "default"):
                losses.append(engine.train_step(batch, sum(mb.num_loss_tokens for mb in batch), apply=False).loss)
            # the first step's: Adam turns round-off in near-zero gradients into full-size updates
            grads = grads or {n: p.grad.clone() for n, p in engine.params.items()}
            engine.apply_update()
        runs[compiled] = losses, grads, list(engine.params)
    (eager_losses, eager_grads, names), (losses, grads, compiled_names) = runs[False], runs[True]
    assert compiled_names == names and not any("_orig_mod" in n for n in names)
    rtol = 1e-5 if compute == torch.float32 else 2e-2
    assert losses == pytest.approx(eager_losses, rel=rtol)
    for n, g in eager_grads.items():
        assert float((grads[n] - g).abs().max()) <= rtol * float(g.abs().max()) + 1e-12, n
    assert OptimConfig().compiles_on(torch.device("cuda", 0)) and not OptimConfig().compiles_on(torch.device("cpu"))


def _kept_for_backward(rank: int = 0, world: int = 1) -> tuple[dict, int]:
    """Bytes a stage of two blocks saves for backward in one forward on bf16 working weights, as
    `malleus memory` counts them (here on CPU for real), eager and compiled, storing and selective;
    under TP this rank's, with its rows of the input. And the graph breaks the compiler made."""
    torch._dynamo.reset()
    dynamo_counters.clear()
    tp = TensorParallel(world, rank, dist.group.WORLD) if world > 1 else TensorParallel()
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 40, 64])
    positions = MicroBatch(torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long), cu, (0,)).positions()
    rows = slice(*tp.rows(64))
    x = torch.randn(64, TINY.hidden, generator=gen, dtype=torch.bfloat16)[rows].clone().requires_grad_()
    kept = {}
    for recompute, compiled in itertools.product(("none", "selective"), (False, True)):
        model = build_stage_model(TINY, (0, 2), has_embedding=False, has_head=False, seed=SEED, recompute=recompute,
                                  tp=tp)
        if compiled:
            compile_blocks(model)
        kept[recompute, compiled], _ = saved_for_backward(model, x, positions, cu, compute_dtype=torch.bfloat16)
    return kept, sum(dynamo_counters["graph_break"].values())


def test_a_compiled_selective_block_keeps_no_more_than_an_eager_one():
    """The compiler's partitioner picks what a compiled block keeps for backward, and would keep the
    outputs selective recomputation frees; a compiled selective block follows a checkpoint policy
    it obeys (GEMM and attention outputs kept, the rest recomputed). Alone, the whole block is one
    graph under the policy: it keeps less than the eager selective block the memory model measures
    (strictly: its fused norms keep no 1/rms either) and than a compiled storing block. Under TP,
    where the collectives break the graph, as much as the eager one, and less than storing.
    (A checkpoint run eagerly hides what it saves: alone, the block must be one graph for the
    bytes to mean anything.)"""
    kept, breaks = _kept_for_backward()
    assert breaks == 0
    assert kept["selective", True] < kept["selective", False] < kept["none", False], kept
    assert kept["selective", True] < kept["none", True], kept
    for kept, _ in run_on_gloo(_kept_for_backward, 2):
        assert kept["selective", True] <= kept["selective", False] < kept["none", False], kept
        assert kept["selective", True] < kept["none", True], kept


def _tp2_losses(rank: int, world: int, compiled: bool, recompute: str, compute: torch.dtype):
    batches = global_batches(steps=2, micro_batches=2, micro_batch_size=2, seed=7)
    plan = dataclasses.replace(TP2, pipelines=(Pipeline((Stage((1, 0), (0, 4), recompute),), micro_batches=5),))
    engine = Engine(TINY, plan, rank, seed=SEED, optim=dataclasses.replace(OPTIM, compile=compiled),
                    compute_dtype=compute)
    losses = [engine.train_step(b, sum(mb.num_loss_tokens for mb in b)).global_loss for b in batches]
    return losses, engine.groups.tp.comm_seconds


@pytest.mark.parametrize("recompute, compute", [("none", torch.float32), ("selective", torch.float32),
                                                ("selective", torch.bfloat16)])
def test_compiled_blocks_under_tensor_parallelism_train_like_eager_ones_and_keep_collectives_timed(recompute, compute):
    """A TP group's all-reduces inside compiled blocks run as they do eagerly (the graph breaks there),
    so their time is still measured and left out of the device's compute. Selective blocks too
    (against eager storing ones), on bf16 working weights too (rtol as for compiled blocks alone)."""
    (eager, _), _ = run_on_gloo(_tp2_losses, 2, False, "none", compute)
    (compiled, comm), _ = run_on_gloo(_tp2_losses, 2, True, recompute, compute)
    assert compiled == pytest.approx(eager, rel=1e-5 if compute == torch.float32 else 2e-2) and comm > 0


# ---------------------------------------------------------------------------- host reads
class DeviceReads(TorchDispatchMode):
    """Counts the host's reads of device tensors: a scalar read (`item`, `float`, `bool`, which on a
    GPU wait for it) or a copy to the host. The meta device stands in for the GPU: it holds no data,
    so no read can hide, and each read seen here returns a dummy (zeros) so that the step goes on."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_host = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and (
            kwargs.get("device", torch.device("meta")).type == "cpu" if func is torch.ops.aten._to_copy.default
            else args[0].device.type == "cpu" and args[1].device.type == "meta")
        if src is not None and (func is torch.ops.aten._local_scalar_dense.default and src.is_meta or to_host):
            self.reads.append("".join(f for f in traceback.format_stack() if "/malleus_svc/" in f.splitlines()[0]))
            if func is torch.ops.aten._local_scalar_dense.default:
                return False if src.dtype == torch.bool else 0
            shape_of = args[1] if func is torch.ops.aten.copy_.default else src
            return args[0] if func is torch.ops.aten.copy_.default else torch.zeros(shape_of.shape, dtype=kwargs.get("dtype") or src.dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize("apply", [True, False])
def test_a_step_reads_the_device_once_at_its_end(apply):
    """Forward, backward, the gradient norm, clipping and (with `apply`) the update are enqueued
    without the host waiting on the device; the step's figures come back in one read at its end."""
    engine = Engine(TINY, ONE, 0, seed=SEED, optim=OPTIM, device=torch.device("meta"))
    batch = global_batches(steps=1, micro_batches=3, micro_batch_size=2)[0]
    loss_tokens = sum(mb.num_loss_tokens for mb in batch)
    with DeviceReads() as seen:
        engine.train_step(batch, loss_tokens, apply=apply)
        if not apply:
            engine.apply_update()
    assert len(seen.reads) == 1, "\n".join(seen.reads)
    assert "train_step" in seen.reads[0]


# ---------------------------------------------------------------------------- packed sequences
def _recompute_or_not(rank: int, world: int, batches, mixed: bool):
    out = {}
    for recompute in ("none", "selective", "full"):
        plan = Plan(1, 4, 2, (Pipeline((Stage((0,), (0, 4), recompute),), micro_batches=3),))
        engine = Engine(TINY, plan, 0, seed=SEED, optim=OPTIM, dtype=torch.float32 if mixed else torch.float64,
                        compute_dtype=torch.bfloat16 if mixed else None)
        stats = [engine.train_step(b, sum(mb.num_loss_tokens for mb in b)) for b in batches]
        out[recompute] = {"losses": [s.global_loss for s in stats], "flops": [s.flops for s in stats],
                          "model_flops": [s.model_flops for s in stats], "state": engine.export_state(),
                          "blocks_forward": [sum(engine.model.recompute_flops(mb.cu_seqlens) for mb in b)
                                             for b in batches]}
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["fp64", "bf16-working-weights"])
def test_recomputed_blocks_train_bitwise_like_stored_ones_and_count_their_extra_forward(mixed):
    """A stage that recomputes its blocks in backward: the same losses and state bit for bit (the
    forward runs again on the same inputs and, in mixed precision, the same working weights), one
    more forward of its blocks in the FLOPs it ran (the device clock paces them), none in the
    model's FLOPs (MFU). A selective stage: the same, with selective's share of a forward."""
    batches = global_batches(steps=2, micro_batches=3, micro_batch_size=2)
    out = run_on_gloo(_recompute_or_not, 1, batches, mixed)[0]
    plain, rc = out["none"], out["full"]
    for mode in ("selective", "full"):
        assert out[mode]["losses"] == plain["losses"] and out[mode]["model_flops"] == plain["model_flops"]
        for name, st in plain["state"].items():
            got = out[mode]["state"][name]
            assert torch.equal(st.param, got.param) and torch.equal(st.exp_avg, got.exp_avg), (mode, name)
    assert all(b > 0 for b in rc["blocks_forward"])
    # the work the device reports (and the clock paces) is the planner's price of the mode: all of
    # the blocks' forward again, or selective's share of it
    for mode in ("selective", "full"):
        extra = [RECOMPUTED_FORWARD[mode] * b for b in rc["blocks_forward"]]
        assert [r - p for r, p in zip(out[mode]["flops"], plain["flops"])] == pytest.approx(extra, rel=1e-12)


def test_packed_model_equals_each_sequence_alone():
    # fp64, so that summation-order rounding cannot hide (or fake) a leak between sequences
    model = full_model(TINY, seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    packed = packed_micro_batch(gen, [7, 12, 4], TINY.vocab, 0)
    bounds = packed.cu_seqlens.tolist()
    w = torch.randn(packed.num_tokens, TINY.vocab, generator=gen, dtype=torch.float64)

    logits = model(packed.tokens, packed.positions(), packed.cu_seqlens)
    packed_grads = torch.autograd.grad((logits * w).sum(), list(model.parameters()))
    alone_grads = [torch.zeros_like(g) for g in packed_grads]
    for a, b in zip(bounds[:-1], bounds[1:]):
        alone = MicroBatch(packed.tokens[a:b], packed.targets[a:b], torch.tensor([0, b - a], dtype=torch.int32), (0,))
        out = model(alone.tokens, alone.positions(), alone.cu_seqlens)
        torch.testing.assert_close(logits[a:b], out, rtol=1e-10, atol=1e-12)
        for acc, g in zip(alone_grads, torch.autograd.grad((out * w[a:b]).sum(), list(model.parameters()))):
            acc += g
    for g, n in zip(packed_grads, alone_grads):
        torch.testing.assert_close(g, n, rtol=1e-10, atol=1e-12)

    # Changing sequence 2's tokens leaves sequence 1's outputs untouched.
    changed = packed.tokens.clone()
    changed[bounds[1]:bounds[2]] = (changed[bounds[1]:bounds[2]] + 1) % TINY.vocab
    other = model(changed, packed.positions(), packed.cu_seqlens)
    assert torch.equal(other[:bounds[1]], logits[:bounds[1]])
    assert not torch.allclose(other[bounds[1]:bounds[2]], logits[bounds[1]:bounds[2]])


@pytest.mark.parametrize("tied", [False, True])
def test_the_loss_over_token_chunks_equals_the_whole_micro_batchs_and_keeps_no_logits(tied):
    shape = dataclasses.replace(TINY, tie_embeddings=tied)
    model = full_model(shape, seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    mb = packed_micro_batch(gen, [7, 12, 4], shape.vocab, 0)
    targets = mb.targets.clone()
    targets[[0, 9, 22]] = IGNORE_INDEX
    logits = model(mb.tokens, mb.positions(), mb.cu_seqlens)
    whole = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    expected = torch.autograd.grad(whole, list(model.parameters()))
    assert model.head.chunk >= mb.num_tokens        # the default chunk holds this micro-batch whole
    model.head.chunk = 5                            # 23 tokens: chunks of 5, 5, 5, 5 and 3
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        chunked = model(mb.tokens, mb.positions(), mb.cu_seqlens, targets)
    assert not any(tuple(shape_) == (mb.num_tokens, shape.vocab) for shape_ in saved)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)
    for g, e, (name, _) in zip(torch.autograd.grad(chunked, list(model.parameters())), expected,
                               model.named_parameters()):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-14, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------- tensor parallelism
GQA = ModelShape(layers=1, hidden=64, heads=8, ffn=96, vocab=32, seq_len=32, kv_heads=4)


def _stage_inputs():
    gen = torch.Generator().manual_seed(9)
    cu = torch.tensor([0, 6, 19, 25], dtype=torch.int32)
    tokens = torch.randint(GQA.vocab, (25,), generator=gen)
    targets = torch.randint(GQA.vocab, (25,), generator=gen)
    targets[[0, 6, 13]] = IGNORE_INDEX
    return tokens, targets, cu, MicroBatch(tokens, targets, cu, (0,)).positions()


def _gqa_full() -> dict[str, torch.Tensor]:
    return {k: v.double() for part in ("embedding", 0, "head") for k, v in init_part(GQA, part, seed=5).items()}


def _stage_under_tp(rank: int, world: int):
    """A stage of the embedding, one block and the head at TP=4 (all ranks) and TP=2 (ranks {0,1}
    and {2,3}), in fp64, its loss over chunks of 4 tokens: loss, logits and grads per rank."""
    tokens, targets, cu, positions = _stage_inputs()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for size, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        tp = TensorParallel(size, rank % size, group)
        model = StageModel(GQA, (0, 1), has_embedding=True, has_head=True, tp=tp).double()
        model.load_full(_gqa_full())
        model.head.chunk = 4     # 25 tokens: seven chunks, each with its own collectives
        loss = model(tokens, positions, cu, targets)
        loss.backward()
        with torch.no_grad():
            logits = model(tokens, positions, cu)
        out[size] = {"loss": loss.detach(), "logits": logits, "shapes": {n: p.shape for n, p in model.named_parameters()},
                     "grads": {n: p.grad for n, p in model.named_parameters()}}
    return out


def test_tensor_parallel_stage_equals_unsharded():
    """Megatron's column- and row-parallel block with sequence parallelism (25 tokens: rows 6 or 7
    per rank at TP 4, 12 or 13 at TP 2) and its vocab-parallel embedding, head and cross-entropy
    (each rank holding 1/t of the vocabulary rows) equal one device's stage."""
    results = run_on_gloo(_stage_under_tp, 4)
    tokens, targets, cu, positions = _stage_inputs()
    model = StageModel(GQA, (0, 1), has_embedding=True, has_head=True).double()
    model.load_full(_gqa_full())
    logits = model(tokens, positions, cu)
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    for rank, res in enumerate(results):
        for size in (4, 2):
            got = res[size]
            assert got["shapes"]["embedding.weight"][0] == got["shapes"]["head.weight"][0] == GQA.vocab // size
            torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-12, atol=0)
            torch.testing.assert_close(got["logits"], logits.detach(), rtol=1e-12, atol=1e-14)
            group = range(rank - rank % size, rank - rank % size + size)
            for name, p in model.named_parameters():
                if split_dim(name) is None:    # a norm's gain: each rank's share is its rows' (sequence parallelism)
                    mine = sum(results[r][size]["grads"][name] for r in group)
                    assert not torch.allclose(got["grads"][name], p.grad)
                else:
                    mine = got["grads"][name]
                torch.testing.assert_close(mine, take_shard(name, p.grad, rank % size, size), rtol=1e-10, atol=1e-14,
                                           msg=lambda m: f"TP={size} rank {rank} {name}: {m}")


# ---------------------------------------------------------------------------- schedule and errors
@pytest.mark.parametrize("stages,micro", [(1, 3), (3, 3), (3, 2), (4, 7), (2, 1)])
def test_one_f_one_b_runs_every_micro_batch_once_in_order(stages, micro):
    for j in range(stages):
        acts = one_f_one_b(stages, j, micro)
        fwd = [i for k, i in acts if k == "F"]
        bwd = [i for k, i in acts if k == "B"]
        assert fwd == bwd == list(range(micro))
        # a micro-batch's backward comes after its forward; in flight never exceeds S - j
        for i in range(micro):
            assert acts.index(("F", i)) < acts.index(("B", i))
        inflight = peak = 0
        for k, _ in acts:
            inflight += 1 if k == "F" else -1
            peak = max(peak, inflight)
        assert peak <= stages - j


def test_tp_size_that_does_not_divide_heads_is_a_clear_error():
    plan = Plan(num_devices=4, num_layers=4, micro_batch_size=1,
                pipelines=(Pipeline((Stage((0,), (0, 2)), Stage((1, 2, 3), (2, 4))), micro_batches=2),))
    with pytest.raises(ValueError, match=r"pipeline 0 stage 1 \(devices \[1, 2, 3\]\): TP size 3 does not "
                                         r"divide heads=4.*sizes that divide .*: 1, 2, 4"):
        Engine(TINY, plan, 0)


def test_rank_without_work_is_a_clear_error():
    with pytest.raises(ValueError, match="rank 6 is suspended"):
        Engine(TINY, HETERO, 6)
    with pytest.raises(ValueError, match="rank 9 is not a device"):
        Engine(TINY, HETERO, 9)


def test_block_module_is_the_same_at_tp_one():
    # Sanity of the shared definition: a Block holds full tensors at TP size 1.
    block = Block(TINY, TensorParallel())
    assert block.attn.wq.shape == (TINY.heads * TINY.head_dim, TINY.hidden)


# ---------------------------------------------------------------------------- initialisation
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_shard_draws_only_its_own_tiles_and_equals_the_full_init(tp, monkeypatch):
    """Built on meta, a TP rank allocates and draws its shards alone, never the full tensors, and
    gets exactly its slice of what the single-process model holds."""
    import malleus_svc.runtime.model as model_mod
    from malleus_svc.runtime.tensor_parallel import LocalShard
    from malleus_svc.runtime.model import build_stage_model

    shape = ModelShape(layers=2, hidden=64, heads=8, ffn=96, vocab=40, seq_len=16, kv_heads=4)
    monkeypatch.setattr(model_mod, "TILE", 16)   # many tiles even at this size
    full = full_model(shape, seed=3)
    reference = dict(full.named_parameters())
    drawn = []
    real_tile = model_mod._tile
    monkeypatch.setattr(model_mod, "_tile", lambda *a: drawn.append(a[4] * a[5]) or real_tile(*a))
    for rank in range(tp):
        drawn.clear()
        model = build_stage_model(shape, (0, 2), has_embedding=True, has_head=True,
                                  tp=LocalShard(tp, rank), seed=3)
        own = 0
        for name, p in model.named_parameters():
            assert torch.equal(p, take_shard(name, reference[name].detach(), rank, tp)), name
            own += p.numel() if p.dim() == 2 else 0
        # what was drawn: this rank's shards, rounded out to whole tiles (16-row shards here)
        assert own <= sum(drawn) <= own * (1 if tp == 1 else 2), (sum(drawn), own)
    uninit = build_stage_model(shape, (0, 1), has_embedding=False, has_head=False, seed=None)
    assert all(p.device.type == "cpu" for p in uninit.parameters())


ODD_VOCAB = ModelShape(layers=3, hidden=96, heads=6, ffn=192, vocab=85, seq_len=32, kv_heads=3)


def _odd_vocab_ends(rank: int, world: int):
    """This TP rank's logits and head gradient from a stage holding the embedding and the head."""
    tp = TensorParallel(world, rank, dist.group.WORLD)
    model = build_stage_model(ODD_VOCAB, (0, 1), has_embedding=True, has_head=True, tp=tp, seed=3)
    mb = global_batches(1, 1, 2, vocab=ODD_VOCAB.vocab)[0][0]
    logits = model(mb.tokens, mb.positions(), mb.cu_seqlens)
    logits.square().sum().backward()
    return model.embedding.weight.shape[0], logits.detach(), model.head.weight.grad


def test_an_odd_vocabulary_splits_by_rows_at_the_ends():
    """A vocabulary no TP size divides (GPT-2's 50257 is odd): the stages holding the embedding or
    the head split it into row shards one row apart at most (85 rows in three: 28, 28, 29), a plan
    that puts them in TP groups is valid and migrates, and the whole logits and each shard's
    gradient are the single-process model's."""
    from malleus_svc.runtime.engine import validate_plan_for_model
    from malleus_svc.runtime.migrate import plan_migration

    def plan(*stages):
        return Plan(5, 3, 1, (Pipeline(tuple(Stage(d, l) for d, l in stages), micro_batches=2),))
    middle = plan(((0,), (0, 1)), ((1, 2, 3), (1, 2)), ((4,), (2, 3)))
    ends = plan(((0, 1, 2), (0, 1)), ((3,), (1, 2)), ((4,), (2, 3)))
    validate_plan_for_model(ODD_VOCAB, ends)
    assert plan_migration(middle, ends, ODD_VOCAB).flows()
    full = build_stage_model(ODD_VOCAB, (0, 1), has_embedding=True, has_head=True, seed=3)
    mb = global_batches(1, 1, 2, vocab=ODD_VOCAB.vocab)[0][0]
    logits = full(mb.tokens, mb.positions(), mb.cu_seqlens)
    logits.square().sum().backward()
    ranks = run_on_gloo(_odd_vocab_ends, 3)
    assert [rows for rows, *_ in ranks] == [28, 28, 29]
    start = 0
    for rows, tp_logits, grad in ranks:
        torch.testing.assert_close(tp_logits, logits.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, full.head.weight.grad[start:start + rows], rtol=1e-4, atol=1e-5)
        start += rows


def _column_parallel_backward(rank: int, world: int) -> list[str]:
    """What a column-parallel layer's backward does, in order: GEMMs and the collectives' starts and
    waits (each collective's Work wrapped to say when it is waited for)."""
    from malleus_svc.runtime.model import column_parallel

    events: list[str] = []

    def spied(real, name):
        def call(*args, **kwargs):
            events.append(f"{name} started")
            work = real(*args, **kwargs)

            class Waited:
                def wait(self):
                    work.wait()
                    events.append(f"{name} waited")
            return Waited()
        return call

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.malleus.weight_grad.default):
                events.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    dist.all_gather_single = spied(dist.all_gather_single, "gather")
    dist.reduce_scatter_single = spied(dist.reduce_scatter_single, "reduce-scatter")
    tp = TensorParallel(world, rank, dist.group.WORLD)
    x = torch.randn(5, 8, requires_grad=True)
    (out,) = column_parallel(x, tp, 10, torch.randn(6, 8, requires_grad=True))
    events.clear()
    with Gemms():
        out.square().sum().backward()
    return events


def test_a_column_parallel_backward_overlaps_its_collectives_with_its_gemms():
    """Sequence parallelism's backward (Megatron's overlap): the input's rows are gathered again
    while the input's gradient is computed, and that gradient is reduce-scattered while the
    weight's is; one collective in flight at a time, in the same order on every rank."""
    for events in run_on_gloo(_column_parallel_backward, 2):
        assert events == ["gather started", "mm", "gather waited", "reduce-scatter started", "weight_grad",
                          "reduce-scatter waited"], events
