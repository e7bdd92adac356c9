"""What a device computes in: master weights in the parameters' dtype, working weights in the compute dtype.

Mixed precision the way large-model runtimes keep it (Megatron's bf16 with fp32 main parameters):
the optimizer owns fp32 master weights, fp32 gradients and fp32 Adam moments; the forward and
backward run on ONE low-precision working copy of the weights, made once and refreshed from the
masters after every optimizer step or load. The working copies take the masters' places in the
module (same names), so that a forward is the module's own call, with nothing swapped in per call. Activations and the pipeline's boundary tensors are in
the compute dtype too. Autocast would instead cast every weight afresh in every micro-batch's
forward and keep that cast for backward: one copy per micro-batch in flight.

A working copy's gradient is added into its master's gradient as soon as a micro-batch's backward
has accumulated it, then dropped: no low-precision gradient outlives its backward, and the sum over
micro-batches is taken in the masters' precision.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn as nn


GPU_COMPUTE_DTYPE = torch.bfloat16


def compute_dtype_for(device: torch.device, params_dtype: torch.dtype) -> torch.dtype:
    """The default: bf16 working weights for fp32 masters on a GPU; on the CPU stand-in the
    parameters' own dtype (the exact path the tests compare with one process), unless asked."""
    if device.type == "cuda" and params_dtype == torch.float32:
        return GPU_COMPUTE_DTYPE
    return params_dtype


class WorkingWeights:
    """The weights `model`'s forward and backward run on; its parameters as given are the masters.

    With `dtype` equal to the masters' there is nothing to copy: the model runs on the masters.
    Otherwise each master gets one working parameter of `dtype` that takes its place in the model;
    the masters live on here (`masters`), outside the module, for the optimizer and the state."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.masters = dict(model.named_parameters())
        self.dtype = dtype
        self.mixed = any(p.dtype != dtype for p in self.masters.values())
        self.tensors: dict[str, nn.Parameter] = {}
        if not self.mixed:
            return
        with torch.no_grad():
            for name, p in self.masters.items():
                w = nn.Parameter(p.detach().to(dtype))
                w.register_post_accumulate_grad_hook(partial(_into_master, p))
                self.tensors[name] = w
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, w)

    def __call__(self, model: nn.Module, *args: Any) -> Any:
        return model(*args)

    def refresh(self) -> None:
        """Copy the masters into the working weights: after each optimizer step and each load."""
        with torch.no_grad():
            for name, w in self.tensors.items():
                w.copy_(self.masters[name])

    @property
    def nbytes(self) -> int:
        return sum(w.untyped_storage().nbytes() for w in self.tensors.values())


def _into_master(master: nn.Parameter, working: torch.Tensor) -> None:
    """Runs once a backward has accumulated `working.grad`: add it to the master's, in the master's dtype."""
    if master.grad is None:
        master.grad = working.grad.to(master.dtype)
    else:
        master.grad.add_(working.grad)
    working.grad = None
