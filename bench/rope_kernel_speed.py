"""The q/k norm + rotary + K/V cache write kernel (``triton_kernels.norm_rope_cache``) alone on a
GPU, at each launch plan ((row, head) pairs per program, warps) of a sweep, per shape: us per call,
each plan captured in a CUDA graph and replayed.

Why: in the 8B's 257-row verify on an H100 this kernel took 8.4 us a layer (0.30 ms a round), where
its bytes (q in and out, k and v in, both into the cache) move in ~2 us; at 17 rows 3.8 us. Its plan
(pairs filling a 4096-element tile: one row's 32 query heads a program, 8 warps) dates from the
17-row verify. This prints every plan's time, the default's, the best per shape, and the HBM floor.

    python -m bench.rope_kernel_speed [--shapes 257x32x8x128,257x24x4x256] [--warm]

Without CUDA (a smoke run): tiny shapes through Triton's interpreter, each plan checked bit for bit
against the default, nothing timed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

if not torch.cuda.is_available():  # the smoke run: Triton's interpreter, read when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

from bench.graph_timing import graph_us, kernel_bench_args, print_plans
from bench.norm_kernel_speed import REPLAYS, copies_for
from ddtree_diag.engine.fast import triton_kernels

# (rows, heads, kv_heads, head_dim): the 8B's attention (Qwen3: q/k norms, full rotary) at AR, a
# budget-16 and a budget-256 verify; Qwen3.6-27B's full-attention layers (24 / 4 heads of 256,
# offset norms, a quarter of each head turned) at the same
SHAPES = [(1, 32, 8, 128, False), (17, 32, 8, 128, False), (257, 32, 8, 128, False),
          (17, 24, 4, 256, True), (257, 24, 4, 256, True)]
SMOKE_SHAPES = [(5, 4, 2, 32, False), (3, 6, 2, 64, True)]
CAPACITY = 1024  # cache slots; the rows land at START..
START = 300


def plans(rows: int, heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(pairs per program, warps) to try: tiles of one head up to 16384 elements (no more pairs than
    the shape's query heads have), warps leaving 4-128 elements per thread."""
    block = triton.next_power_of_2(head_dim)
    found = []
    pairs = 1
    while pairs * block <= 16384 and pairs <= triton.next_power_of_2(rows * heads):
        for warps in (1, 2, 4, 8, 16):
            if 4 <= pairs * block // (32 * warps) <= 128:
                found.append((pairs, warps))
        pairs *= 2
    return found


def shape_inputs(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int):
    """q, k, v as views of one fused projection output [1, rows, (heads + 2 kv) * head_dim] (the
    engine's layout), a cache pair, and rotary tables for positions START.."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(1, rows, width, generator=gen) * 2).to(device, dtype)
    q = qkv[..., : heads * head_dim].view(1, rows, heads, head_dim)
    k = qkv[..., heads * head_dim : (heads + kv_heads) * head_dim].view(1, rows, kv_heads, head_dim)
    v = qkv[..., (heads + kv_heads) * head_dim :].view(1, rows, kv_heads, head_dim)
    cache_k = torch.zeros(1, kv_heads, CAPACITY, head_dim, device=device, dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    return q, k, v, cache_k, cache_v


def rotary_tables(rows: int, rotary: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(START, START + rows, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    angles = torch.cat([positions[:, None] * inv[None]] * 2, dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def moved_bytes(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """HBM bytes of one call: q read and written, k and v read and written into the cache."""
    return 2 * rows * (heads + 2 * kv_heads) * head_dim * dtype.itemsize


def call(inputs, norms, cos, sin, start, offset: bool, plan: tuple[int, int] | None) -> torch.Tensor:
    q, k, v, cache_k, cache_v = inputs
    return triton_kernels.norm_rope_cache(q, k, v, offset, *norms, cos, sin, cache_k, cache_v, start, plan=plan)


def norms_for(head_dim: int, offset: bool, device: str, dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(head_dim, generator=gen) * 0.2 + (0.0 if offset else 1.0)).to(device, dtype)
    return (weight, 1e-6), (weight.flip(0).contiguous(), 1e-6)


def run_shape(args, rows: int, heads: int, kv_heads: int, head_dim: int, offset: bool) -> tuple[str, tuple, float]:
    dtype, device = args.dtype, "cuda"
    size = moved_bytes(rows, heads, kv_heads, head_dim, dtype)
    copies = copies_for(size, args.warm)
    sets = [shape_inputs(rows, heads, kv_heads, head_dim, dtype, device, seed) for seed in range(copies)]
    rotary = head_dim // 4 if offset else head_dim  # Qwen3.6 turns a quarter of each head
    cos, sin = rotary_tables(rows, rotary, device, dtype)
    norms = norms_for(head_dim, offset, device, dtype)
    start = torch.tensor(START, device=device)

    def calls(plan: tuple[int, int] | None) -> list[Callable[[], object]]:
        return [lambda inputs=inputs: call(inputs, norms, cos, sin, start, offset, plan) for inputs in sets]

    reference = call(sets[0], norms, cos, sin, start, offset, None)
    ref_k = sets[0][3][:, :, START : START + rows].clone()
    default = triton_kernels.rope_plan(head_dim, rows)
    times: dict[tuple[int, int], float] = {}
    same = True
    for plan in plans(rows, heads, head_dim):
        sets[0][3].zero_()
        out = call(sets[0], norms, cos, sin, start, offset, plan)
        same &= torch.equal(out, reference) and torch.equal(sets[0][3][:, :, START : START + rows], ref_k)
        times[plan] = graph_us(calls(plan), REPLAYS)
    times.setdefault(default, graph_us(calls(None), REPLAYS))
    floor = size / (args.bandwidth * 1e12) * 1e6
    kind = f"{rows}x{heads}x{kv_heads}x{head_dim}"
    best, best_us = print_plans(kind, 16, floor, default, times, ("p", "w"),
                                f"every plan bit-equal to the default: {same}")
    return kind, best, best_us


def smoke() -> int:
    """Each plan of the tiny shapes against the default plan, through the interpreter."""
    print("rope_kernel_speed: no CUDA, smoke run through Triton's interpreter (nothing timed)")
    for rows, heads, kv_heads, head_dim, offset in SMOKE_SHAPES:
        rotary = head_dim // 4 if offset else head_dim
        cos, sin = rotary_tables(rows, rotary, "cpu", torch.float32)
        norms = norms_for(head_dim, offset, "cpu", torch.float32)
        start = torch.tensor(START)
        inputs = shape_inputs(rows, heads, kv_heads, head_dim, torch.float32, "cpu", 0)
        want = call(inputs, norms, cos, sin, start, offset, None)
        want_k = inputs[3].clone()
        tried = plans(rows, heads, head_dim)
        same = True
        for plan in tried:
            inputs[3].zero_()
            same &= torch.equal(call(inputs, norms, cos, sin, start, offset, plan), want)
            same &= torch.equal(inputs[3], want_k)
        print(f"{rows}x{heads}x{kv_heads}x{head_dim}: {len(tried)} plans, default "
              f"{triton_kernels.rope_plan(head_dim, rows)}, all equal to the default: {same}")
        if not same:
            return 1
    return 0


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    """"257x32x8x128" (rows x heads x kv heads x head dim); an "o" suffix: offset norms, a quarter
    of each head turned (Qwen3.6)."""
    offset = text.endswith("o")
    rows, heads, kv_heads, head_dim = (int(part) for part in text.rstrip("o").split("x"))
    return rows, heads, kv_heads, head_dim, offset


def main() -> int:
    args = kernel_bench_args(
        __doc__.splitlines()[0],
        shapes_help="rowsxheadsxkv_headsxhead_dim[o],... (o: offset norms, partial rotary); default SHAPES",
        warm_help="one input copy per graph (in L2 after the first call)",
    )
    if not torch.cuda.is_available():
        return smoke()
    shapes = SHAPES if args.shapes is None else [parse_shape(s) for s in args.shapes.split(",")]
    print(
        f"rope_kernel_speed: {torch.cuda.get_device_name()}, {args.dtype}, us per call (CUDA graph replays, "
        f"{'warm' if args.warm else 'inputs past the L2'}); plans as (row, head) pairs per program / warps"
    )
    best = [run_shape(args, *shape) for shape in shapes]
    print("best plan per shape:")
    for kind, (pairs, warps), us in best:
        print(f"  {kind:>16}: pairs={pairs} num_warps={warps} ({us:.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
