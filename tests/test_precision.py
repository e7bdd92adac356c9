"""Mixed precision (runtime/precision.py): fp32 master weights, gradients and Adam moments, one bf16
working copy the forward and backward run on, bf16 activations and boundary tensors. The path a GPU
worker takes by default, run here on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from _mp import run_on_gloo
from test_engine import HETERO, OPTIM, SEED, TINY, _pipeline_share, global_batches
from malleus_svc.config.presets import NORM_EPS
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime.batch import IGNORE_INDEX
from malleus_svc.runtime.engine import Engine, OptimConfig, assemble_full
from malleus_svc.runtime.model import _RMSNormFunction
from malleus_svc.runtime.precision import compute_dtype_for
from malleus_svc.runtime.reference import reference_train

BF16 = torch.bfloat16
ONE = Plan(num_devices=1, num_layers=4, micro_batch_size=2,
           pipelines=(Pipeline((Stage((0,), (0, 4)),), micro_batches=3),))


def _loss_tokens(batch) -> int:
    return sum(mb.num_loss_tokens for mb in batch)


def test_the_default_is_bf16_working_weights_on_a_gpu_only():
    assert compute_dtype_for(torch.device("cuda", 0), torch.float32) == BF16
    assert compute_dtype_for(torch.device("cpu"), torch.float32) == torch.float32
    assert compute_dtype_for(torch.device("cuda", 0), torch.float64) == torch.float64
    assert not Engine(TINY, ONE, 0, seed=SEED).working.mixed


def test_working_weights_follow_the_masters_after_every_update_and_load():
    engine = Engine(TINY, ONE, 0, seed=SEED, optim=OPTIM, compute_dtype=BF16)
    assert engine.working.mixed and engine.transport.dtype == BF16
    masters, working = engine.params, engine.working.tensors

    def in_step() -> bool:
        return all(torch.equal(w, masters[n].detach().to(BF16)) for n, w in working.items())

    assert in_step()
    for batch in global_batches(steps=2, micro_batches=3, micro_batch_size=2):
        before = {n: p.detach().clone() for n, p in masters.items()}
        engine.train_step(batch, _loss_tokens(batch), apply=False)
        assert all(w.grad is None for w in working.values())           # no bf16 gradient outlives its backward
        assert all(p.grad.dtype == torch.float32 and bool(p.grad.abs().sum() > 0) for p in masters.values())
        engine.apply_update()
        assert any(not torch.equal(before[n], p) for n, p in masters.items())
        assert in_step()
    other = Engine(TINY, ONE, 0, seed=SEED + 1, compute_dtype=BF16)
    other.load_state(engine.export_state())
    assert all(torch.equal(w, engine.working.tensors[n]) for n, w in other.working.tensors.items())


def test_the_master_gradient_is_each_micro_batchs_gradient_summed_in_fp32_never_rounded_to_bf16():
    """The engine's gradients, bit for bit, against the same sum written out by hand over working
    weights that carry their masters; no working weight ever holds a gradient; and the sum differs
    from the old one (each micro-batch's gradient rounded to bf16 first) by no more than that rounding."""
    optim = OptimConfig(lr=1e-3, grad_clip=None)
    batch = global_batches(steps=1, micro_batches=3, micro_batch_size=2, seed=5)[0]
    engine = Engine(TINY, ONE, 0, seed=SEED, optim=optim, compute_dtype=BF16)
    engine.train_step(batch, _loss_tokens(batch), apply=False)
    assert all(w.grad is None and not w.requires_grad for w in engine.working.tensors.values())

    model = Engine(TINY, ONE, 0, seed=SEED, optim=optim).model
    masters = dict(model.named_parameters())
    rounded = {n: torch.zeros_like(p) for n, p in masters.items()}
    for mb in batch:
        working = {}
        for n, p in masters.items():
            working[n] = p.detach().to(BF16)
            working[n].master = p
        logits = functional_call(model, working, (mb.tokens, mb.positions(), mb.cu_seqlens))
        loss = F.cross_entropy(logits.float(), mb.targets, ignore_index=IGNORE_INDEX, reduction="sum") / _loss_tokens(batch)
        loss.backward()
        plain = {n: p.detach().to(BF16).requires_grad_(True) for n, p in masters.items()}   # the old way
        logits = functional_call(model, plain, (mb.tokens, mb.positions(), mb.cu_seqlens))
        (F.cross_entropy(logits.float(), mb.targets, ignore_index=IGNORE_INDEX, reduction="sum") / _loss_tokens(batch)).backward()
        for n, w in plain.items():
            rounded[n] += w.grad
    for n, p in engine.params.items():
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, masters[n].grad), n
        scale = float(p.grad.abs().max())
        assert float((p.grad - rounded[n]).abs().max()) <= 3 * 2**-8 * scale, n   # 3 roundings to bf16 at most
    assert any(not torch.equal(p.grad, rounded[n]) for n, p in engine.params.items())


def test_a_weight_gradient_is_the_fp32_sum_of_exact_products_of_its_bf16_operands():
    """Against fp64 on the same bf16 operands: the master's gradient within fp32 accumulation, where
    a gradient written in bf16 (the plain op) is off by bf16's rounding."""
    from malleus_svc.runtime.model import linear
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 64, generator=gen).to(BF16)
    g = torch.randn(512, 32, generator=gen).to(BF16)
    master = torch.nn.Parameter(torch.randn(32, 64, generator=gen))
    w = master.detach().to(BF16)
    w.master = master
    xs = x.clone().requires_grad_(True)
    linear(xs, w).backward(g)
    exact = g.double().t() @ x.double()
    err = float((master.grad.double() - exact).abs().max() / exact.abs().max())
    plain_w = w.clone().requires_grad_(True)
    plain_x = x.clone().requires_grad_(True)
    F.linear(plain_x, plain_w).backward(g)
    plain = float((plain_w.grad.double() - exact).abs().max() / exact.abs().max())
    assert err < 1e-6 < 1e-4 < plain
    assert torch.equal(xs.grad, plain_x.grad)         # the input's gradient as the plain op's


def test_the_head_over_token_chunks_gives_the_masters_the_logits_paths_gradients_bitwise():
    """bf16 working weights: the loss over chunks of 5 tokens and over one chunk, and the logits'
    own path (the head as a linear, then the cross-entropy), give every master the same gradient."""
    batch = global_batches(steps=1, micro_batches=1, micro_batch_size=2, seed=9)[0]
    mb = batch[0]
    model = Engine(TINY, ONE, 0, seed=SEED).model
    masters = dict(model.named_parameters())
    working = {}
    for n, p in masters.items():
        working[n] = p.detach().to(BF16)
        working[n].master = p
    grads = []
    for chunk in (None, mb.num_tokens, 5):
        for p in masters.values():
            p.grad = None
        if chunk is None:
            logits = functional_call(model, working, (mb.tokens, mb.positions(), mb.cu_seqlens))
            F.cross_entropy(logits.float(), mb.targets, ignore_index=IGNORE_INDEX, reduction="sum").backward()
        else:
            model.head.chunk = chunk
            functional_call(model, working, (mb.tokens, mb.positions(), mb.cu_seqlens, mb.targets)).backward()
        grads.append({n: p.grad.clone() for n, p in masters.items()})
    assert mb.num_tokens > 5
    for n in masters:
        assert grads[0][n].dtype == torch.float32
        assert torch.equal(grads[0][n], grads[1][n]) and torch.equal(grads[1][n], grads[2][n]), n


def _train_mixed(rank: int, world: int, plan: Plan, batches):
    if rank not in plan.roles():
        return None
    engine = Engine(TINY, plan, rank, seed=SEED, optim=OPTIM, compute_dtype=BF16)
    losses = [engine.train_step(_pipeline_share(plan, engine.role.pipeline, b), _loss_tokens(b)).global_loss
              for b in batches]
    return losses, engine.export_state()


def test_a_heterogeneous_plan_in_bf16_tracks_fp32_single_process_training():
    """bf16 boundary tensors between stages, bf16 TP all-reduces and bf16 gradients of every
    micro-batch, over gloo: the losses within bf16's rounding of the fp32 reference's, the fp32
    master weights within a few Adam steps' rounding."""
    steps = 3
    batches = global_batches(steps=steps, micro_batches=HETERO.num_micro_batches, micro_batch_size=2)
    results = [r for r in run_on_gloo(_train_mixed, HETERO.num_devices, HETERO, batches) if r]
    ref_losses, ref_params, _ = reference_train(TINY, SEED, OPTIM, batches, torch.float32)
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=2e-3)
        assert losses != ref_losses                                   # bf16 really ran
    full = assemble_full(state for _, state in results)
    for name, ref in ref_params.items():
        assert full[name].dtype == torch.float32
        torch.testing.assert_close(full[name], ref, rtol=0, atol=2 * steps * OPTIM.lr, msg=lambda m: f"{name}: {m}")


def _plain_rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w).to(x.dtype)


def test_rmsnorm_keeps_its_input_and_one_rms_per_token_and_differentiates_exactly():
    x = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_RMSNormFunction.apply, (x, w, NORM_EPS, None))
    for dtype in (torch.float32, BF16):
        x = torch.randn(64, 96).to(dtype).requires_grad_(True)
        w = (1 + torch.randn(96) / 10).to(dtype).requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = _RMSNormFunction.apply(x, w, NORM_EPS, None)
        assert torch.equal(y, _plain_rmsnorm(x, w))
        assert sorted(tuple(t.shape) for t in saved) == [(64, 1), (64, 96), (96,)]
        g = torch.randn(64, 96).to(dtype)
        ours = torch.autograd.grad(y, (x, w), g)
        plain = torch.autograd.grad(_plain_rmsnorm(x, w), (x, w), g)
        for a, b in zip(ours, plain):
            torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
