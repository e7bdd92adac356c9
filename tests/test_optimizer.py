"""The engine's AdamW (runtime/optimizer.py): torch's update bit for bit, without torch's start-up cost."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from malleus_svc.runtime.engine import OptimConfig

REPO = Path(__file__).resolve().parent.parent


def test_updates_and_state_equal_torch_adamw_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 7, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    config = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = config.make(ours)
    ref = torch.optim.AdamW(theirs, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for params in (ours, theirs):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        if step == 2:            # a parameter without a gradient is left alone, as torch does
            ours[1].grad = theirs[1].grad = None
        opt.step()
        ref.step()
        opt.zero_grad()
        assert all(p.grad is None or not p.grad.any() for p in ours)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert set(opt.state[a]) == set(ref.state[b])
        assert all(torch.equal(opt.state[a][k], ref.state[b][k]) for k in ref.state[b])
        assert opt.state[a]["step"].dtype == ref.state[b]["step"].dtype


def test_a_workers_engine_starts_and_trains_without_importing_the_compiler():
    """torch._dynamo (imported by torch.optim's step) and sympy (by Module.to_empty) cost a CPU worker
    a third of its start-up; an engine that builds, trains and updates imports neither."""
    probe = textwrap.dedent("""
        import sys, torch
        from malleus_svc.config.presets import preset
        from malleus_svc.plan import Pipeline, Plan, Stage
        from malleus_svc.runtime.batch import MicroBatch
        from malleus_svc.runtime.engine import Engine
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        shape = preset("tiny")
        plan = Plan(num_devices=1, num_layers=shape.layers, micro_batch_size=1,
                    pipelines=(Pipeline((Stage((0,), (0, shape.layers)),), micro_batches=1),))
        engine = Engine(shape, plan, 0)
        ids = torch.randint(shape.vocab, (16,))
        mb = MicroBatch(ids, torch.roll(ids, -1), torch.tensor([0, 16], dtype=torch.int32), (0,))
        engine.train_step([mb], mb.num_loss_tokens)
        engine.train_step([mb], mb.num_loss_tokens)
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
