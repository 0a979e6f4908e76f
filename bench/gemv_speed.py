"""One-row products (an AR verify's GEMMs): cuBLAS against a split-K Triton GEMV.

The GEMV (here only; the engine keeps cuBLAS: on an H100 it matched cuBLAS and no more, see
RESULTS-engine) cuts a weight stored [in, out] (the engine's CUDA layout, whose output columns are
its only contiguous axis) into column blocks and in-feature splits, so a 4096 x 4096 weight spreads
over hundreds of programs: each writes its split's fp32 partial sums to scratch, counts itself in
on its column block's counter, and the last to arrive adds the partials in split order (one
summation order every run), writes the row and zeroes the counter for the next launch.

Weights stored as the engine stores them on CUDA ([in, out]), each shape timed over enough
distinct copies that they do not fit in L2 (a 33 MB weight read twice in a row would partly come
from the cache), in a CUDA graph. Then a whole target's worth of one-row products in order (every
layer's q|k|v, o, gate|up, down on its own weights, then the LM head): what an AR round's GEMMs
take each way. Usage: ``python -m bench.gemv_speed [--shapes 8b,27b] [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.gemm_shapes import SHAPES_8B, SHAPES_27B
from bench.graph_timing import device_bandwidth, graph_us, needs_cuda

COUNTER_SLOTS = 1 << 16  # column blocks one launch may have (out features / block_n)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, partial_ptr, count_ptr, N, K, stride_wk, stride_wn, K_PER_SPLIT, SPLITS,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # K_PER_SPLIT and SPLITS are runtime values: one compile per (block_n, block_k, warps) serves
    # every shape
    block = tl.program_id(0)
    split = tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = split * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        k_ok = ks < K
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn, mask=k_ok[:, None] & col_ok[None, :],
            other=0.0, eviction_policy="evict_first",
        )
        acc += w.to(tl.float32) * x[:, None]
        ks += BLOCK_K
    part = tl.sum(acc, axis=0)
    if SPLITS == 1:
        tl.store(out_ptr + cols, part.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(partial_ptr + split * N + cols, part, mask=col_ok)
        # acq_rel: this program's partials are visible before its arrival counts, and the last
        # arrival sees every earlier program's
        arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for other in range(SPLITS):  # split order: one summation order whatever ran first
                total += tl.load(partial_ptr + other * N + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)
            tl.atomic_xchg(count_ptr + block, 0)


def counters(device: torch.device) -> torch.Tensor:
    """The arrival counters of ``device`` (zeros; each launch leaves them zero again). Made on
    first use, which must come before a CUDA graph capture uses them."""
    device = torch.device(device)
    found = _COUNTERS.get(device)
    if found is None:
        found = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return found


def plan(in_features: int, out_features: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, splits, warps) for a weight [out_features, in_features]."""
    return 64, 64, max(1, min(16, in_features // 512)), 4


def gemv(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None, stages: int | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for one row: ``x`` [..., in] with one row in all, last dim
    contiguous; ``weight`` [out, in] in either layout (its strides are read). ``config``:
    (block_n, block_k, splits, warps), ``plan``'s otherwise."""
    in_features = x.shape[-1]
    out_features = weight.shape[0]
    block_n, block_k, splits, warps = config or plan(in_features, out_features)
    row = x.reshape(in_features)
    if out is None:
        out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
    splits = triton.cdiv(in_features, k_per_split)
    blocks = triton.cdiv(out_features, block_n)
    partial = torch.empty(splits if splits > 1 else 1, out_features, dtype=torch.float32, device=x.device)
    extra = {} if stages is None else {"num_stages": stages}
    _gemv_kernel[(blocks, splits)](
        row, weight, out, partial, counters(x.device), out_features, in_features, weight.stride(1),
        weight.stride(0), k_per_split, splits, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **extra,
    )
    return out


LAYERS = {"8b": 36, "27b": 64}  # the chain's layer count (27B: its 16 attention and 48 GDN layers)
L2_BYTES = 50 * 2**20  # an H100's / H200's L2: each shape's copies add up to several times this


def column_major(k: int, n: int) -> torch.Tensor:
    """A random bf16 weight [n, k] stored transposed, as ``layers.store_column_major`` leaves it."""
    return (torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02).t()


def configs(quick: bool) -> list[tuple[int, int, int, int]]:
    if quick:
        return [(64, 64, splits, 4) for splits in (1, 4, 8, 16)]
    return list(itertools.product((32, 64, 128), (32, 64, 128), (1, 2, 4, 8, 16), (4, 8)))


def per_shape(shapes: list[tuple[str, int, int]], quick: bool, hbm: float) -> dict[str, tuple]:
    """Each shape's cuBLAS time and the fastest GEMV config (printed); {name: config}."""
    best_configs = {}
    print(f"{'gemm':>8} {'in':>6} {'out':>7} {'cublas us':>10} {'bw%':>5} {'gemv us':>8} {'bw%':>5} "
          f"{'config (n, k, splits, warps)':>28} {'maxdiff':>8} {'plan us':>8}")
    for name, k, n in shapes:
        copies = max(1, -(-4 * L2_BYTES // (2 * k * n)))
        weights = [column_major(k, n) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
        ideal_us = 1e6 * 2 * k * n / hbm
        cublas = graph_us([lambda w=w, x=x: F.linear(x, w) for w in weights], replays=20)
        results = []
        for config in configs(quick):
            try:
                us = graph_us([lambda w=w, o=o, c=config, x=x: gemv(x, w, out=o, config=c)
                               for w, o in zip(weights, outs, strict=True)], replays=10)
            except Exception as error:  # out of registers / shared memory and the like
                print(f"  ({name} {config}: {type(error).__name__})", file=sys.stderr)
                continue
            results.append((us, config))
        us, config = min(results)
        planned = graph_us(
            [lambda w=w, o=o, x=x: gemv(x, w, out=o) for w, o in zip(weights, outs, strict=True)],
            replays=10,
        )
        diff = (gemv(x, weights[0], config=config).float() - F.linear(x, weights[0]).float()).abs().max()
        print(f"{name:>8} {k:>6} {n:>7} {cublas:>10.1f} {100 * ideal_us / cublas:>4.0f}% {us:>8.1f} "
              f"{100 * ideal_us / us:>4.0f}% {config!s:>28} {diff.item():>8.4f} {planned:>8.1f}", flush=True)
        best_configs[name] = config
        del weights
        torch.cuda.empty_cache()
    return best_configs


def chain(shape: str, shapes: list[tuple[str, int, int]], best: dict[str, tuple], hbm: float) -> None:
    """A target's one-row products in order, each on its own weights: cuBLAS, the GEMV at each
    shape's best config, and at ``plan``'s."""
    layer_shapes = [s for s in shapes if s[0] != "lm_head"]
    if shape == "27b":  # a quarter of the layers attention, the rest Gated DeltaNet
        attention = [s for s in layer_shapes if s[0] not in ("gdn_in", "gdn_out")]
        linear = [s for s in layer_shapes if s[0] not in ("qkv", "o")]
        per_layer = [attention if index % 4 == 3 else linear for index in range(LAYERS[shape])]
    else:
        per_layer = [layer_shapes] * LAYERS[shape]
    products = [s for layer in per_layer for s in layer] + [s for s in shapes if s[0] == "lm_head"]
    weights = [(name, column_major(k, n)) for name, k, n in products]
    inputs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k, _ in products}
    outs = [torch.empty(1, w.shape[0], device="cuda", dtype=torch.bfloat16) for _, w in weights]
    floor_ms = 1e3 * sum(w.numel() * 2 for _, w in weights) / hbm
    ways = {
        "cublas": [lambda w=w, o=o: torch.matmul(inputs[w.shape[1]], w.t(), out=o)
                   for (_, w), o in zip(weights, outs, strict=True)],
        "gemv best": [lambda w=w, o=o, c=best.get(name): gemv(inputs[w.shape[1]], w, out=o, config=c)
                      for (name, w), o in zip(weights, outs, strict=True)],
        "gemv plan": [lambda w=w, o=o: gemv(inputs[w.shape[1]], w, out=o)
                      for (_, w), o in zip(weights, outs, strict=True)],
    }
    for way, calls in ways.items():
        ms = graph_us(calls, replays=10) * len(calls) / 1e3
        print(f"{shape} chain of {len(calls)} one-row products, {way:>10}: {ms:.3f} ms "
              f"({100 * floor_ms / ms:.0f}% of the {floor_ms:.3f} ms read floor)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8b,27b")
    parser.add_argument("--quick", action="store_true", help="four configs per shape")
    parser.add_argument("--no-chain", action="store_true")
    args = parser.parse_args()
    needs_cuda("gemv_speed")
    torch.manual_seed(0)
    hbm, label = device_bandwidth()
    print(f"gemv_speed: {torch.cuda.get_device_name()} ({label}), torch {torch.__version__}")
    tables = {"8b": SHAPES_8B, "27b": SHAPES_27B}
    for shape in args.shapes.split(","):
        print(f"== {shape}")
        best = per_shape(tables[shape], args.quick, hbm)
        if not args.no_chain:
            chain(shape, tables[shape], best, hbm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
