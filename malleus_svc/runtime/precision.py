"""What a device computes in: master weights in the parameters' dtype, working weights in the compute dtype.

Mixed precision the way large-model runtimes keep it (Megatron's bf16 with fp32 main parameters):
the optimizer owns fp32 master weights, fp32 gradients and fp32 Adam moments; the forward and
backward run on ONE low-precision working copy of the weights, made once and refreshed from the
masters after every optimizer step or load. Activations and the pipeline's boundary tensors are in
the compute dtype too. Autocast would instead cast every weight afresh in every micro-batch's
forward and keep that cast for backward: one copy per micro-batch in flight.

No working copy ever holds a gradient: each working weight carries its master (`master_of`), and
the ops that use a weight (`model.linear`, the norms, the embedding, the head's loss) return its
gradient to the master, computed in the master's dtype from operands in the compute dtype
(Megatron's `main_grad`): a weight-gradient GEMM writes fp32 (`weight_grad`), and autograd adds it
into the master's gradient. No micro-batch's gradient is rounded to the compute dtype, and nothing
runs in Python per weight during backward.
"""
from __future__ import annotations

from functools import cache
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.func import functional_call


GPU_COMPUTE_DTYPE = torch.bfloat16


def compute_dtype_for(device: torch.device, params_dtype: torch.dtype) -> torch.dtype:
    """The default: bf16 working weights for fp32 masters on a GPU; on the CPU stand-in the
    parameters' own dtype (the exact path the tests compare with one process), unless asked."""
    if device.type == "cuda" and params_dtype == torch.float32:
        return GPU_COMPUTE_DTYPE
    return params_dtype


@torch.library.custom_op("malleus::weight_grad", mutates_args=())
def weight_grad(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad^T @ x over all leading dims, [out, in], written in `dtype` from operands in the compute
    dtype: on CUDA one GEMM that accumulates and writes fp32 (cuBLAS's bf16 GEMM with an fp32
    output; a torch without it rounds the GEMM's output once, as autograd would, rather than run a
    slow fp32 GEMM); elsewhere the operands upcast (exact: a product of two bf16 values fits in
    fp32). An op of its own, so that a compiled block calls it as it is."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    if g2.is_cuda:
        if dtype == torch.float32 and _mm_writes_fp32(g2.device, g2.dtype):
            return torch.mm(g2.t(), x2, out_dtype=dtype)
        return (g2.t() @ x2).to(dtype)
    wide = torch.promote_types(dtype, g2.dtype)
    return (g2.t().to(wide) @ x2.to(wide)).to(dtype)


@weight_grad.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return grad.new_empty((grad.shape[-1], x.shape[-1]), dtype=dtype)


@cache
def _mm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's GEMM takes `out_dtype` (added for CUDA in recent releases), tried once."""
    try:
        a = torch.ones(2, 2, device=device, dtype=dtype)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def master_of(weight: torch.Tensor) -> torch.Tensor | None:
    """The master parameter whose gradient a working weight's use produces (None: the weight is its
    own master, as when the model runs on its parameters)."""
    return getattr(weight, "master", None)


class WorkingWeights:
    """The weights a stage's forward and backward run on, for master parameters `params`.

    With `dtype` equal to the masters' there is nothing to copy: the model runs on the masters.
    Otherwise each master has one working tensor of `dtype` that carries it (`master_of`), and
    calling this object runs the model on those instead of its own parameters."""

    def __init__(self, params: Mapping[str, nn.Parameter], dtype: torch.dtype):
        self.masters = dict(params)
        self.dtype = dtype
        self.mixed = any(p.dtype != dtype for p in self.masters.values())
        self.tensors: dict[str, torch.Tensor] = {}
        self.external: set[str] = set()   # written by their owner (a sharded optimizer), not by `refresh`
        if not self.mixed:
            return
        with torch.no_grad():
            for name, p in self.masters.items():
                w = p.detach().to(dtype)
                w.master = p
                self.tensors[name] = w

    def __call__(self, model: nn.Module, *args: Any) -> Any:
        if not self.mixed:
            return model(*args)
        return functional_call(model, self.tensors, args, strict=True)

    def refresh(self) -> None:
        """Copy the masters into the working weights: after each optimizer step and each load."""
        with torch.no_grad():
            for name, w in self.tensors.items():
                if name not in self.external:
                    w.copy_(self.masters[name])

    @property
    def nbytes(self) -> int:
        return sum(w.untyped_storage().nbytes() for w in self.tensors.values())

