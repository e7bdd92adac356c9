"""Varlen causal attention (runtime/attention.py): the SDPA fallback against one masked attention
over the whole packed row (`reference.masked_attention`), and what a forward prepares once for
all its layers."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from malleus_svc.config.presets import RopeScaling, preset
from malleus_svc.runtime.attention import Packing, RotaryTables, rotary_tables, sdpa_by_length, varlen_causal_attention
from malleus_svc.runtime.model import full_model
from malleus_svc.runtime.reference import masked_attention


def _qkv(lengths: list[int], heads: int, kv_heads: int, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(t, h, dim, generator=gen, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("lengths", [
    [5, 1, 11, 3],            # uneven, one of length 1
    [7, 4, 7, 9, 4, 7],       # repeated lengths, interleaved: batched per length, put back in row order
    [12],                     # one sequence
    [6, 6, 6],                # all equal: one batch, already in row order
])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("batched", [True, False], ids=["per-length", "per-sequence"])
def test_the_sdpa_fallback_equals_one_masked_attention_over_the_packed_row(lengths, heads, kv_heads, batched):
    q, k, v = _qkv(lengths, heads, kv_heads)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_causal_attention(q, k, v, Packing(cu, "cpu", batch_equal_lengths=batched))
    ref = masked_attention(q, k, v, lengths)
    assert out.shape == (sum(lengths), heads, 16)
    torch.testing.assert_close(out, ref)          # fp32 tolerances: rtol 1.3e-6, atol 1e-5
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for g, r in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(g, r)


def test_empty_sequences_in_the_row_are_skipped():
    q, k, v = _qkv([4, 6], 4, 2)
    with_empties = Packing(torch.tensor([0, 0, 4, 4, 10, 10], dtype=torch.int32), "cpu")
    assert with_empties.lengths == [0, 4, 0, 6, 0] and with_empties.max_len == 6
    torch.testing.assert_close(varlen_causal_attention(q, k, v, with_empties), masked_attention(q, k, v, [4, 6]))


def test_the_fallback_gives_sdpa_four_dimensional_batches_that_a_fused_kernel_takes():
    # torch's fused kernels (flash, memory-efficient, CPU flash) refuse 3-D inputs; restricted to
    # the flash kernel, SDPA raises "No available kernel" unless it is given [B, H, L, d]
    q, k, v = _qkv([5, 9, 5], 8, 2)
    packing = Packing(torch.tensor([0, 5, 14, 19], dtype=torch.int32), "cpu", batch_equal_lengths=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = sdpa_by_length(q, k, v, packing)
    torch.testing.assert_close(out, masked_attention(q, k, v, [5, 9, 5]))
    groups, restore = packing.by_length
    assert [n for n, _ in groups] == [5, 9] and groups[0][1].tolist() == [*range(5), *range(14, 19)]
    assert restore is not None and restore.tolist()[:6] == [0, 1, 2, 3, 4, 10]


def test_equal_lengths_share_a_call_on_accelerators_and_not_on_the_cpu_stand_in():
    cu = torch.tensor([0, 5, 14, 19], dtype=torch.int32)
    accelerator = "meta"     # any device but the CPU stand-in (CUDA is not on the test machine)
    assert Packing(cu, accelerator).batch_equal_lengths and not Packing(cu, "cpu").batch_equal_lengths
    groups, restore = Packing(cu, "cpu").by_length          # per sequence, in row order
    assert [(n, idx.tolist()) for n, idx in groups] == [(5, [*range(5)]), (9, [*range(5, 14)]), (5, [*range(14, 19)])]
    assert restore is None


def test_a_forward_prepares_the_boundaries_once_for_all_its_layers():
    model = full_model(preset("tiny"), seed=0)
    seen = []
    for block in model.blocks.values():
        block.register_forward_pre_hook(lambda _, args: seen.append(args[2]))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    model(torch.zeros(10, dtype=torch.long), torch.tensor([0, 1, 2, *range(7)]), cu)
    assert len(seen) == len(model.blocks) > 1 and all(p is seen[0] for p in seen)
    packing = seen[0]
    assert packing.device_cu_seqlens is packing.device_cu_seqlens     # one host-to-device copy, kept
    assert packing.device_cu_seqlens.dtype == torch.int32 and packing.max_len == 7


def test_a_packing_must_cover_the_tokens():
    q, k, v = _qkv([4], 2, 2)
    with pytest.raises(ValueError, match="4 tokens, but the packing covers 5"):
        varlen_causal_attention(q, k, v, Packing(torch.tensor([0, 5], dtype=torch.int32), "cpu"))


def test_rotary_tables_are_made_once_and_indexed_with_the_values_of_each_position():
    tables = RotaryTables(16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64))
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5, 6])
    cos, sin = tables(positions, 7, torch.device("cpu"), torch.float32)
    want_cos, want_sin = rotary_tables(positions, 16, None, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64))
    assert torch.equal(cos, want_cos.float()) and torch.equal(sin, want_sin.float())
    first = tables._tables[(torch.device("cpu"), torch.float32)][0]
    assert first.shape[0] == 8
    tables(positions, 5, torch.device("cpu"), torch.float32)
    assert tables._tables[(torch.device("cpu"), torch.float32)][0] is first        # shorter: the same table
    cos, _ = tables(torch.arange(40), 40, torch.device("cpu"), torch.float64)
    assert torch.equal(cos, rotary_tables(torch.arange(40), 16, None, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64))[0])
    assert tables._tables[(torch.device("cpu"), torch.float64)][0].shape[0] == 64  # per dtype, grown to fit
