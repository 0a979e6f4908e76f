"""The fused RMSNorm kernel (``triton_kernels.rms_norm``) alone on a GPU, at each launch plan (rows
per program, warps) of a sweep, per shape, with and without the residual add: us per call, each
plan captured in a CUDA graph and replayed.

Why: on the H200 the default plan (rows filling a 4096-element tile, ``_warps`` of it) took 5.2-5.5
us at a Qwen3.6-27B verify (272 x 5120 bf16 with the residual add), where moving its bytes takes
~2.3 us; 5.2 us for the Gated DeltaNet output norm (13056 x 128, gated), 2.7 us at 32 x 4096 (8B).
This prints every plan's time, the default's, the best per shape, and the HBM floor (bytes moved /
``--bandwidth``), to pick better defaults (``rms_norm``'s ``rows_per_program`` / ``num_warps``).

Each call in a graph reads its own copy of the inputs, enough copies that they do not fit the L2
(a verify layer's norm reads activations the weight reads have pushed out); ``--warm`` reuses one.

    python -m bench.norm_kernel_speed [--shapes 257x5120,12336x128g] [--dtype bf16] [--warm]

Without CUDA (a smoke run): tiny shapes through Triton's interpreter, each plan checked against
the default, nothing timed.
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
from ddtree_diag.engine.fast import triton_kernels

# (rows, cols, gated, offset): the 8B's hidden norms (Qwen3: weight after the cast), Qwen3.6-27B's
# (Qwen3.5 style: 1 + weight) at a budget-16 verify (17 rows) and a budget-256 one (257 rows), and its
# Gated DeltaNet output norm (rows x 48 value heads, 128 wide; gated, never with a residual add)
SHAPES = [(17, 4096, False, False), (257, 4096, False, False), (17, 5120, False, True), (257, 5120, False, True),
          (12336, 128, True, False)]
SMOKE_SHAPES = [(5, 96, False, False), (37, 64, True, False)]
L2_BYTES = 128 * 2**20  # well past the H200's 50 MiB L2 (and the next GPU's)
MAX_COPIES = 256
REPLAYS = 20


def copies_for(bytes_per_call: int, warm: bool) -> int:
    """Input copies per graph: one (``warm``), else enough to spill the L2."""
    return 1 if warm else max(2, min(MAX_COPIES, -(-L2_BYTES // bytes_per_call)))


def plans(rows: int, cols: int) -> list[tuple[int, int]]:
    """(rows per program, warps) to try: tiles of one row up to 16384 elements (and no more rows
    than the shape has), warps leaving 4-128 elements per thread."""
    block = triton.next_power_of_2(cols)
    found = []
    rows_per_program = 1
    while rows_per_program * block <= 16384 and rows_per_program <= triton.next_power_of_2(rows):
        for warps in (1, 2, 4, 8, 16):
            if 4 <= rows_per_program * block // (32 * warps) <= 128:
                found.append((rows_per_program, warps))
        rows_per_program *= 2
    return found


def default_plan(cols: int) -> tuple[int, int]:
    """``rms_norm``'s own plan (what it runs with neither override)."""
    return triton_kernels.norm_plan(cols)


def shape_inputs(rows: int, cols: int, dtype: torch.dtype, gated: bool, with_delta: bool, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(device, dtype)
    extra = {}
    if with_delta:
        extra["delta"] = torch.randn(rows, cols, generator=gen).to(device, dtype)
    if gated:
        extra["gate"] = (torch.randn(rows, cols, generator=gen) * 3).to(device, dtype)
    return x, extra


def moved_bytes(rows: int, cols: int, dtype: torch.dtype, gated: bool, with_delta: bool) -> int:
    """HBM bytes of one call: x, (delta, gate) read; out, (the sum) written; the weight."""
    tensors = 2 + 2 * with_delta + gated
    return (tensors * rows + 1) * cols * dtype.itemsize


def run_shape(args, rows: int, cols: int, gated: bool, offset: bool, with_delta: bool) -> tuple[str, tuple, float]:
    dtype = args.dtype
    weight = (torch.randn(cols, generator=torch.Generator().manual_seed(1)) * 0.3 + 1).to("cuda", dtype)
    size = moved_bytes(rows, cols, dtype, gated, with_delta)
    copies = copies_for(size, args.warm)
    sets = [shape_inputs(rows, cols, dtype, gated, with_delta, "cuda", seed) for seed in range(copies)]

    def calls(plan: tuple[int, int] | None) -> list[Callable[[], object]]:
        override = {} if plan is None else {"rows_per_program": plan[0], "num_warps": plan[1]}
        return [
            lambda x=x, extra=extra: triton_kernels.rms_norm(x, weight, 1e-6, offset, **extra, **override)
            for x, extra in sets
        ]

    reference = triton_kernels.rms_norm(sets[0][0], weight, 1e-6, offset, **sets[0][1])[0].float()
    default = default_plan(cols)
    times: dict[tuple[int, int], float] = {}
    worst = 0.0
    for plan in plans(rows, cols):
        out = triton_kernels.rms_norm(
            sets[0][0], weight, 1e-6, offset, **sets[0][1], rows_per_program=plan[0], num_warps=plan[1]
        )[0].float()
        worst = max(worst, float((out - reference).abs().max()))
        times[plan] = graph_us(calls(plan), REPLAYS)
    times.setdefault(default, graph_us(calls(None), REPLAYS))
    floor = size / (args.bandwidth * 1e12) * 1e6
    kind = f"{rows}x{cols}{' gated' if gated else ''}{' +delta' if with_delta else ''}"
    best, best_us = print_plans(kind, 22, floor, default, times, ("r", "w"),
                                f"plans' max |diff| from the default {worst:.3g}")
    return kind, best, best_us


def smoke() -> int:
    """Each plan of the tiny shapes against the default plan, through the interpreter."""
    print("norm_kernel_speed: no CUDA, smoke run through Triton's interpreter (nothing timed)")
    for rows, cols, gated, offset in SMOKE_SHAPES:
        weight = torch.randn(cols) * 0.3 + 1
        for with_delta in (False, True):
            x, extra = shape_inputs(rows, cols, torch.float32, gated, with_delta, "cpu", 0)
            want = triton_kernels.rms_norm(x, weight, 1e-6, offset, **extra)[0]
            tried = plans(rows, cols)
            normed = [
                triton_kernels.rms_norm(x, weight, 1e-6, offset, **extra, rows_per_program=r, num_warps=w)[0]
                for r, w in tried
            ]
            same = all(torch.equal(out, want) for out in normed)
            print(f"{rows}x{cols}{' gated' if gated else ''}{' +delta' if with_delta else ''}: "
                  f"{len(tried)} plans, default {default_plan(cols)}, all equal to the default: {same}")
            if not same:
                return 1
    return 0


def parse_shape(text: str) -> tuple[int, int, bool, bool]:
    """"272x5120" / "13056x128g" (gated) / "272x5120o" (offset norm)."""
    rows, rest = text.split("x")
    cols = rest.rstrip("go")
    return int(rows), int(cols), "g" in rest, "o" in rest


def main() -> int:
    args = kernel_bench_args(
        __doc__.splitlines()[0],
        shapes_help="rowsxcols[g][o],... (g: gated, o: offset norm); default SHAPES",
        warm_help="one input copy per graph (in L2 after the first call)",
    )
    if not torch.cuda.is_available():
        return smoke()
    shapes = SHAPES if args.shapes is None else [parse_shape(s) for s in args.shapes.split(",")]
    print(
        f"norm_kernel_speed: {torch.cuda.get_device_name()}, {args.dtype}, us per call (CUDA graph replays, "
        f"{'warm' if args.warm else 'inputs past the L2'}); plans as rows per program / warps"
    )
    best = []
    for rows, cols, gated, offset in shapes:
        for with_delta in (False,) if gated else (False, True):
            best.append(run_shape(args, rows, cols, gated, offset, with_delta))
    print("best plan per shape:")
    for kind, (r, w), us in best:
        print(f"  {kind:>22}: rows_per_program={r} num_warps={w} ({us:.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
