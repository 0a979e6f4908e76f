"""The verify round's greedy choice alone on a GPU: ``torch.argmax(dim=-1)`` against the split
Triton argmax (``triton_argmax``) over [rows, vocab] logits, us per call, each captured in a CUDA
graph and replayed. Torch runs as ``_choose`` ran it (argmax, then a copy into the choice buffer;
the kernel writes that buffer itself); the kernel at its default plan and at each (chunk, warps)
of a sweep, every one checked equal to torch's indices.

Why: on the H200 PyTorch's reduce (one thread block per row) took 97 us at 272 x 248320 bf16,
64 us at 272 x 151936 and 15 us at 32 x 151936, several times the time to read the logits; the
HBM floor (bytes / ``--bandwidth``) is printed beside each shape.

Each call in a graph reads its own copy of the logits, enough that they do not fit the L2 (a
verify's logits come straight from the LM head's GEMM, but 272 rows of them never fit);
``--warm`` reuses one.

    python -m bench.argmax_speed [--shapes 1x151936,257x248320] [--dtype bf16] [--warm]

Without CUDA (a smoke run): tiny shapes through Triton's interpreter, checked against torch,
nothing timed.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():  # the smoke run: Triton's interpreter, read when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.graph_timing import graph_us, kernel_bench_args
from bench.norm_kernel_speed import REPLAYS, copies_for
from ddtree_diag.engine.fast import triton_argmax

# (rows, vocab): one row (AR, a last round), a budget-16 verify, budget-256 trees (257 rows) on the
# 8B / Qwen3's 151936 vocabulary and Qwen3.6-27B's 248320
SHAPES = [(1, 151936), (17, 151936), (257, 151936), (257, 248320)]
SMOKE_SHAPES = [(1, 3000), (5, 2100)]
# (entries per chunk program, warps) of the sweep
PLANS = [(1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def logits(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random logits as a bf16 LM head gives them: many exact ties, so the first-index rule shows."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 3).to(device, dtype)


def run_shape(args, rows: int, vocab: int) -> None:
    size = rows * vocab * args.dtype.itemsize
    sets = [logits(rows, vocab, args.dtype, "cuda", seed) for seed in range(copies_for(size, args.warm))]
    outs = [torch.empty(rows, dtype=torch.long, device="cuda") for _ in sets]
    want = sets[0].argmax(dim=-1)
    pairs = list(zip(sets, outs, strict=True))
    torch_us = graph_us([lambda x=x, out=out: out.copy_(x.argmax(dim=-1)) for x, out in pairs], REPLAYS)

    def kernel_us(block: int | None, warps: int | None) -> tuple[float, bool]:
        equal = torch.equal(triton_argmax.argmax(sets[0], block=block, num_warps=warps), want)
        calls = [
            lambda x=x, out=out: triton_argmax.argmax(x, out, block=block, num_warps=warps)
            for x, out in pairs
        ]
        return graph_us(calls, REPLAYS), equal

    default = triton_argmax.plan(rows, vocab)
    default_us, default_equal = kernel_us(None, None)
    swept = {plan: kernel_us(*plan) for plan in PLANS}  # chunks past the row are cut to it
    equal = default_equal and all(same for _, same in swept.values())
    floor = size / (args.bandwidth * 1e12) * 1e6
    cells = ", ".join(f"c{c}/w{w} {us:.1f}" for (c, w), (us, _) in sorted(swept.items(), key=lambda item: item[1][0]))
    best, (best_us, _) = min(swept.items(), key=lambda item: item[1][0])
    print(
        f"{rows:>4} x {vocab:<6} | floor {floor:5.1f} | torch {torch_us:6.1f} | kernel c{default[0]}/w{default[1]} "
        f"{default_us:6.1f} | best c{best[0]}/w{best[1]} {best_us:6.1f} | equal: {equal}"
    )
    print(f"{'':>13} | {cells}")


def smoke() -> int:
    print("argmax_speed: no CUDA, smoke run through Triton's interpreter (nothing timed)")
    for rows, vocab in SMOKE_SHAPES:
        x = logits(rows, vocab, torch.bfloat16, "cpu", rows)
        want = x.argmax(dim=-1)
        results = [triton_argmax.argmax(x)] + [triton_argmax.argmax(x, block=c, num_warps=w) for c, w in PLANS[:3]]
        same = all(torch.equal(got, want) for got in results)
        print(f"{rows} x {vocab}: default plan {triton_argmax.plan(rows, vocab)} and {len(results) - 1} others "
              f"equal to torch.argmax: {same}")
        if not same:
            return 1
    return 0


def main() -> int:
    args = kernel_bench_args(
        __doc__.splitlines()[0],
        shapes_help="rowsxvocab,... (default SHAPES)",
        warm_help="one logits copy per graph (in L2 if it fits)",
    )
    if not torch.cuda.is_available():
        return smoke()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    print(
        f"argmax_speed: {torch.cuda.get_device_name()}, {args.dtype}, us per call (CUDA graph replays, "
        f"{'warm' if args.warm else 'logits past the L2'}); kernel plans as c<chunk>/w<warps>"
    )
    for rows, vocab in shapes:
        run_shape(args, rows, vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
