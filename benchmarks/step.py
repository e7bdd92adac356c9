"""One device's training step at a block shape, beside torchtitan's Llama 3 at the same shape in the
same run: tokens/s, achieved TFLOP/s, MFU, peak memory and kernels per block forward+backward.

What is timed: forward and backward of one stage of N transformer blocks (a middle pipeline stage:
hidden states in, the output's gradient given) over one packed micro-batch, the per-step
preparation of positions and sequence boundaries included, as a training step makes them.
- ours: `StageModel` blocks on fp32 master weights with bf16 working weights (CUDA), each weight
  gradient added into its fp32 main gradient, as the runtime trains;
- torchtitan: its `Transformer` with the embedding, final norm and head removed, parameters in bf16
  (what FSDP's bf16 `param_dtype` computes in), its document masks (`get_attention_masks`) rebuilt
  every step as its trainer does.
Both attend over the same documents with the same kernel family (varlen on CUDA) and are compiled
per block (regional `torch.compile`) or not, alike.

"host ms" is the host's time to issue one step with nothing queued on the device: near "step ms",
the step is bound by the host (Python, launches), not by the device.

`--recompute selective,full` adds our row for each of those recompute modes (`plan.RECOMPUTE`), with
its step time over the storing row's beside what the planner prices the mode at
(`costmodel.profile.recompute_time_factor`): what a GPU measures of the price of recomputation.

Model FLOPs per micro-batch (forward; backward counts twice): 2 per block weight per token for the
matrix multiplies, plus 4 x (query heads x head dim) per attended (query, key) pair, causal within
each document: `StageModel.forward_flops`. MFU = model FLOP/s over the device's dense bf16 peak.
"""
from __future__ import annotations

import argparse
import functools
import gc
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from malleus_svc.config.presets import ModelShape
from malleus_svc.costmodel.profile import recompute_time_factor
from malleus_svc.plan import RECOMPUTE
from malleus_svc.runtime import attention
from malleus_svc.runtime.batch import MicroBatch
from malleus_svc.runtime.engine import to_device
from malleus_svc.runtime.model import build_stage_model, compile_blocks
from malleus_svc.runtime.precision import GPU_COMPUTE_DTYPE, WorkingWeights

from .planner import write_section

# dense bf16 peak TFLOP/s by device name (the vendors' data sheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0}
EOS = 0


@dataclass
class Row:
    name: str
    tokens_per_s: float
    tflops: float
    peak_gib: float | None
    kernels: Counter      # by kernel (CUDA) or top-level op (CPU) name, per block
    step_ms: float        # wall time per step, the device's work included
    host_ms: float        # the host's time to issue one step when the device has nothing queued

    @property
    def kernels_per_block(self) -> float:
        return sum(self.kernels.values())


def document_lengths(seq_len: int, packed: bool, seed: int = 0) -> list[int]:
    """The micro-batch's documents: one of seq_len, or documents of exponentially distributed
    lengths (mean seq_len / 8, at least 16 tokens) packed until the row is full."""
    if not packed:
        return [seq_len]
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], seq_len
    while left:
        n = max(16, int(torch.empty(1).exponential_(8.0 / seq_len, generator=gen)))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def boundaries(lengths: list[int]) -> torch.Tensor:
    """cu_seqlens (int32 [n+1]) of documents of these lengths packed into one row."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def model_flops(shape: ModelShape, blocks: int, lengths: list[int]) -> float:
    """Forward + backward model FLOPs of `blocks` blocks over one micro-batch (the formula above)."""
    stage = build_stage_model(shape, (0, blocks), has_embedding=False, has_head=False, device="meta")
    return 3.0 * stage.forward_flops(boundaries(lengths))


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernels_per_block(step: Callable[[], None], device: torch.device, blocks: int) -> Counter:
    """Kernels one step launches on the GPU (kernels, copies and fills), or on CPU the top-level aten
    ops it dispatches, per block, by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
        _sync(device)
    if device.type == "cuda":
        names = Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)
    else:
        names = Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return Counter({name: n / blocks for name, n in names.items()})


def measure(name: str, step: Callable[[], None], device: torch.device, blocks: int, tokens: int, flops: float,
            warmup: int, steps: int) -> Row:
    for _ in range(warmup):           # compiles, autotunes, fills the caching allocator
        step()
    _sync(device)
    kernels = kernels_per_block(step, device, blocks)
    host = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    seconds = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return Row(name, tokens / seconds, flops / seconds / 1e12, peak, kernels, 1e3 * seconds, 1e3 * sorted(host)[1])


def ours(shape: ModelShape, blocks: int, lengths: list[int], device: torch.device, compile: bool,
         recompute: str = "none") -> Callable[[], None]:
    model = build_stage_model(shape, (0, blocks), has_embedding=False, has_head=False, device=device, seed=0,
                              recompute=recompute)
    if compile:
        compile_blocks(model)
    compute = GPU_COMPUTE_DTYPE if device.type == "cuda" else torch.float32
    working = WorkingWeights(dict(model.named_parameters()), compute)
    tokens = sum(lengths)
    mb = MicroBatch(torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.long), boundaries(lengths), ())
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=compute, generator=gen).requires_grad_(True)
    grad = torch.randn(tokens, shape.hidden, device=device, dtype=compute, generator=gen)

    def step() -> None:
        out = working(model, x, to_device(mb.positions(), device), mb.cu_seqlens)   # as the engine copies them
        out.backward(grad)
        x.grad = None
        for p in model.parameters():
            p.grad = None
    return step


def torchtitan_step(shape: ModelShape, blocks: int, lengths: list[int], device: torch.device, compile: bool
                    ) -> Callable[[], None]:
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer
    tokens = sum(lengths)
    # its FFN width: int(multiplier * int(8 * dim / 3)) rounded up to `multiple_of`; set so both give ours
    args = TransformerModelArgs(dim=shape.hidden, n_layers=blocks, n_heads=shape.heads, n_kv_heads=shape.n_kv_heads,
                                vocab_size=256, multiple_of=shape.ffn,
                                ffn_dim_multiplier=shape.ffn / int(8 * shape.hidden / 3),
                                norm_eps=shape.norm_eps, rope_theta=shape.rope_theta, max_seq_len=tokens,
                                # packed documents: its varlen kernel; one document: causal SDPA
                                attn_type="varlen" if len(lengths) > 1 else "sdpa",
                                attn_mask_type="block_causal" if len(lengths) > 1 else "causal", eos_id=EOS)
    with torch.device(device):
        model = Transformer(args)      # initialises itself
    model.tok_embeddings = model.norm = model.output = None    # a middle stage: blocks only
    width = model.layers["0"].feed_forward.w1.weight.shape[0]
    if width != shape.ffn:
        raise SystemExit(f"torchtitan built an FFN of {width}, not {shape.ffn}")
    compute = GPU_COMPUTE_DTYPE if device.type == "cuda" else torch.float32
    with torch.no_grad():          # parameters only: Module.to would make its complex rotary table real
        for p in model.parameters():
            p.data = p.data.to(compute)
    if compile:
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block, fullgraph=True))
    ids = torch.ones(1, tokens, dtype=torch.long)
    ids[0, torch.tensor(lengths).cumsum(0) - 1] = EOS      # each document ends with its EOS
    ids = ids.to(device)
    tokenizer = SimpleNamespace(eos_id=EOS)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, tokens, shape.hidden, device=device, dtype=compute, generator=gen).requires_grad_(True)
    grad = torch.randn(1, tokens, shape.hidden, device=device, dtype=compute, generator=gen)

    def step() -> None:
        masks = model.get_attention_masks(ids, tokenizer) if len(lengths) > 1 else None
        model(x, attention_masks=masks).backward(grad)
        x.grad = None
        model.zero_grad(set_to_none=True)
    return step


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_table(rows: list[Row], peak: float | None) -> str:
    lines = ["| implementation | tokens/s | TFLOP/s | MFU | peak GiB | kernels per block fwd+bwd | step ms | host ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{r.tflops / peak:.1%}" if peak else "-"
        mem = f"{r.peak_gib:.1f}" if r.peak_gib is not None else "-"
        lines.append(f"| {r.name} | {r.tokens_per_s:,.0f} | {r.tflops:.1f} | {mfu} | {mem} | {r.kernels_per_block:.0f} | "
                     f"{r.step_ms:.1f} | {r.host_ms:.1f} |")
    by_name = {r.name: r for r in rows}
    if "torchtitan" in by_name:
        lines.append(f"\nours / torchtitan tokens/s: {rows[0].tokens_per_s / by_name['torchtitan'].tokens_per_s:.3f}")
    for mode in RECOMPUTE[1:]:
        if f"malleus ({mode})" in by_name:
            lines.append(f"\n{mode} / storing step time: {by_name[f'malleus ({mode})'].step_ms / rows[0].step_ms:.3f} "
                         f"(the planner prices it at {recompute_time_factor(mode):.3f})")
    return "\n".join(lines)


def format_kernel_difference(ours: Row, theirs: Row) -> str:
    """Per block, the kernels (ops) whose counts differ, ours against torchtitan's."""
    names = sorted(set(ours.kernels) | set(theirs.kernels), key=lambda n: ours.kernels[n] - theirs.kernels[n])
    lines = ["| kernel or op | ours | torchtitan | difference |", "|---|---|---|---|"]
    for name in names:
        a, b = ours.kernels[name], theirs.kernels[name]
        if a != b:
            lines.append(f"| `{name[:90]}` | {a:g} | {b:g} | {a - b:+g} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="malleus bench step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per micro-batch")
    ap.add_argument("--blocks", type=int, default=4, help="blocks in the stage")
    ap.add_argument("--packed", action=argparse.BooleanOptionalAction, default=None,
                    help="packed documents (the default on CUDA) or one document per micro-batch (on CPU, where "
                         "torchtitan's document masks have no kernel with a backward)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="regional torch.compile of each block, for both (default: on CUDA, off on CPU)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--torchtitan", action=argparse.BooleanOptionalAction, default=True,
                    help="the torchtitan row (needs the `bench` extra)")
    ap.add_argument("--ops", action="store_true", help="also list, per block, the kernels (ops) whose counts differ")
    ap.add_argument("--recompute", default="", metavar="MODES",
                    help=f"also our row recomputing, in each of these modes (comma-separated: {', '.join(RECOMPUTE[1:])})")
    ap.add_argument("--write", metavar="MD", help="update this markdown file's bench:step section")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("malleus bench step: no CUDA device here; --device cpu runs the comparison on CPU")
        return 2
    modes = [m for m in args.recompute.split(",") if m]
    if any(m not in RECOMPUTE[1:] for m in modes):
        print(f"malleus bench step: --recompute takes {', '.join(RECOMPUTE[1:])} (comma-separated), got {args.recompute!r}")
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    compile = args.compile if args.compile is not None else device.type == "cuda"
    packed = args.packed if args.packed is not None else device.type == "cuda"
    if packed and device.type == "cpu" and args.torchtitan:
        print("malleus bench step: torchtitan's packed-document attention (varlen, FlexAttention) has no CPU "
              "backward; use --no-packed, or --no-torchtitan for our row alone")
        return 2
    shape = ModelShape(layers=args.blocks, hidden=args.hidden, heads=args.heads, ffn=args.ffn, vocab=256,
                       seq_len=args.seq_len, kv_heads=args.kv_heads)
    lengths = document_lengths(args.seq_len, packed)
    flops = model_flops(shape, args.blocks, lengths)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_tflops(device)
    print(f"bench step on {label} (torch {torch.__version__}): hidden {args.hidden}, ffn {args.ffn}, heads "
          f"{args.heads}/{args.kv_heads}, {args.seq_len} tokens in {len(lengths)} document(s), {args.blocks} blocks, "
          f"compile {'on' if compile else 'off'}, attention {attention.attention_backend(device)}, "
          f"{flops / 1e12:.2f} model TFLOP per step, peak {peak or '-'} TFLOP/s", flush=True)
    makers = ([("malleus", ours)] + [(f"malleus ({m})", functools.partial(ours, recompute=m)) for m in modes]
              + ([("torchtitan", torchtitan_step)] if args.torchtitan else []))
    rows = []
    for name, make in makers:
        print(f"{name} ...", flush=True)
        try:
            step = make(shape, args.blocks, lengths, device, compile)
        except ImportError as e:
            print(f"  no {name} row: {e} (pip install 'malleus-svc[bench]')")
            continue
        rows.append(measure(name, step, device, args.blocks, args.seq_len, flops, args.warmup, args.steps))
        del step
        _release(device)
        print(f"  {rows[-1].tokens_per_s:,.0f} tokens/s", flush=True)
    md = format_table(rows, peak)
    if args.ops and rows[-1].name == "torchtitan":
        md += "\n\nKernels (ops) per block whose counts differ:\n\n" + format_kernel_difference(rows[0], rows[-1])
    print(md)
    if args.write:
        cmd = "malleus bench step " + " ".join(argv)
        write_section(f"Command: `{cmd}` — {time.strftime('%Y-%m-%d')}, {label}, torch {torch.__version__}, "
                      f"{len(lengths)} documents, compile {'on' if compile else 'off'}, attention "
                      f"{attention.attention_backend(device)}.\n\n{md}", Path(args.write), "bench:step")
    return 0
