"""The engine's AdamW (runtime/optimizer.py): torch's update bit for bit, without torch's start-up cost."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from malleus_svc.config.lr_schedule import LrSchedule
from malleus_svc.runtime.engine import OptimConfig

REPO = Path(__file__).resolve().parent.parent


def test_updates_and_state_equal_torch_adamw_bit_for_bit():
    """Against torch's AdamW with the parameter groups the field uses (no decay on norm gains, on the
    embedding by the switch) and a learning rate set per step from a schedule."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"embedding.weight": (6, 3), "blocks.0.attn_norm.weight": (3,), "blocks.0.attn.wq": (5, 3),
              "final_norm.weight": (3,), "head.weight": (6, 3)}
    ours = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}
    theirs = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    config = OptimConfig(lr=1e-2, weight_decay=0.1, decay_embeddings=False,
                         schedule=LrSchedule(warmup_steps=2, decay="cosine", decay_steps=5, min_lr=1e-3))
    opt = config.make(ours)
    no_decay = ("embedding.weight", "blocks.0.attn_norm.weight", "final_norm.weight")
    ref = torch.optim.AdamW([{"params": [p for n, p in theirs.items() if n not in no_decay]},
                             {"params": [theirs[n] for n in no_decay], "weight_decay": 0.0}],
                            lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
    lrs = [config.lr_at(step) for step in range(6)]
    assert lrs[0] == 5e-3 and lrs[1] == 1e-2 and lrs[4] == lrs[5] == 1e-3 and 1e-3 < lrs[3] < lrs[2] < 1e-2
    for step, lr in enumerate(lrs):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ours.items()}
        for params in (ours, theirs):
            for n, p in params.items():
                p.grad = grads[n].clone()
        if step == 2:            # a parameter without a gradient is left alone, as torch does
            ours["head.weight"].grad = theirs["head.weight"].grad = None
        for group in ref.param_groups:
            group["lr"] = lr
        opt.step(lr)
        ref.step()
        opt.zero_grad()
        assert all(p.grad is None or not p.grad.any() for p in ours.values())
    for n in shapes:
        a, b = ours[n], theirs[n]
        assert torch.equal(a, b), n
        assert set(opt.state[a]) == set(ref.state[b])
        assert all(torch.equal(opt.state[a][k], ref.state[b][k]) for k in ref.state[b])
        assert opt.state[a]["step"].dtype == ref.state[b]["step"].dtype


def test_weight_decay_skips_norm_gains_and_the_embedding_only_by_the_switch():
    """With zero gradients AdamW's update is the decay alone: what moved shows what was decayed."""
    names = ("embedding.weight", "blocks.1.mlp_norm.weight", "blocks.1.mlp.w_up", "final_norm.weight", "head.weight")
    for embeddings in (True, False):
        params = {n: torch.nn.Parameter(torch.ones(2, 2)) for n in names}
        opt = OptimConfig(lr=0.1, weight_decay=0.5, decay_embeddings=embeddings).make(params)
        for p in params.values():
            p.grad = torch.zeros_like(p)
        opt.step()
        moved = {n for n, p in params.items() if not torch.equal(p, torch.ones(2, 2))}
        assert moved == {"blocks.1.mlp.w_up", "head.weight"} | ({"embedding.weight"} if embeddings else set())


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
