"""Skinny bf16 GEMMs of a decode round: cuBLAS (F.linear) against a simple Triton skinny GEMM.

The verify batch is 1-257 rows (budget + 1) against weights of 4096-24576 columns: memory bound, so the
figure is the share of the weight-read bandwidth (the card's HBM bandwidth: 4.8 TB/s on an H200) each reaches. Timed in
CUDA graphs (launch cost excluded, as in the decode stages). Usage:
``python -m bench.gemm_shapes [--rows 1,17,65,257]``; other modes: ``--layouts`` (weight stored
[out, in] or [in, out]), ``--orientations`` (x @ w or its transposed product), ``--backends``
(cuBLAS, cuBLASLt, no reduced-precision split-K, column halves), ``--inductor DEFAULT`` (cuBLAS
against torch.compile's max-autotune GEMM), ``--tunable`` (cuBLAS against PyTorch's TunableOp, which
times cuBLAS and cuBLASLt's heuristic candidates per shape and keeps the fastest).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.graph_timing import device_bandwidth, needs_cuda
from ddtree_diag.engine.fast.graphs import blas_library

# (name, in, out) of the Qwen3-8B shape's projections (fused q|k|v and gate|up) and lm_head
SHAPES_8B = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096),
             ("lm_head", 4096, 151936)]
# the Qwen3.6-27B hybrid shape's: attention q (with its gate)|k|v, o; Gated DeltaNet q|k|v|z and
# out_proj; the MLP; lm_head
SHAPES_27B = [("qkv", 5120, 14336), ("o", 6144, 5120), ("gdn_in", 5120, 16384), ("gdn_out", 6144, 5120),
              ("gate_up", 5120, 34816), ("down", 17408, 5120), ("lm_head", 5120, 248320)]


# One program per column block, all rows in one tile, no split-K: the weight tile is streamed once
# and the bytes in flight come from the pipeline depth (the engine does not use it: see RESULTS).
@triton.jit
def _skinny_gemm(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks[None, :]) < K
        x = tl.load(x_ptrs, mask=row_ok & k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=col_ok & k_ok, other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int, int]) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for a contiguous 2-D or 3-D bf16 ``x``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    block_m, block_n, block_k, warps, stages = config
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _skinny_gemm[grid](
        x2, weight, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return out.reshape(*shape[:-1], n)


def timed_us(fn, reps: int = 50) -> float:
    import triton.testing

    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=reps)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,17,65,257")
    parser.add_argument(
        "--layouts", action="store_true",
        help="instead: cuBLAS on the weight stored [out, in] (F.linear, a TN GEMM) against the same values "
        "stored [in, out] (x @ w_t, an NN GEMM)",
    )
    parser.add_argument(
        "--orientations", action="store_true",
        help="instead: compute-bound rows (default 256,257,272,288): x @ w against the same product "
        "computed transposed (w^T @ x^T, the rows as cuBLAS's N), both shapes' projections",
    )
    parser.add_argument(
        "--backends", action="store_true",
        help="instead: compute-bound rows (default 256,257): cuBLAS as torch calls it against cuBLASLt "
        "(torch.backends.cuda.preferred_blas_library), against cuBLAS without reduced-precision split-K "
        "reductions, and against the GEMM run as two halves of its output columns",
    )
    parser.add_argument(
        "--inductor", choices=("DEFAULT", "EXHAUSTIVE"), default=None,
        help="instead: compute-bound rows (default 257): cuBLAS against what torch.compile's max-autotune picks "
        "(its Triton GEMM templates, persistent TMA ones included, and cuBLAS), at this search space",
    )
    parser.add_argument(
        "--tunable", action="store_true",
        help="instead: cuBLAS and cuBLASLt against PyTorch's TunableOp (torch.cuda.tunable: every candidate "
        "cuBLASLt's heuristic lists, timed per shape), its pick replayed in a CUDA graph",
    )
    parser.add_argument("--shapes", default="8b,27b", help="with --inductor / --tunable: which models' projections")
    args = parser.parse_args()
    needs_cuda("gemm_shapes")
    torch.manual_seed(0)
    if args.inductor:
        rows = "257" if args.rows == parser.get_default("rows") else args.rows
        return inductor([int(r) for r in rows.split(",")], args.inductor, args.shapes.split(","))
    if args.tunable:
        rows = "17,65,257" if args.rows == parser.get_default("rows") else args.rows
        return tunable([int(r) for r in rows.split(",")], args.shapes.split(","))
    if args.backends:
        rows = "256,257" if args.rows == parser.get_default("rows") else args.rows
        return backends([int(r) for r in rows.split(",")])
    if args.orientations:
        rows = "256,257,272,288" if args.rows == parser.get_default("rows") else args.rows
        return orientations([int(r) for r in rows.split(",")])
    if args.layouts:
        return layouts([int(r) for r in args.rows.split(",")])
    print(f"{'gemm':>8} {'rows':>5} {'cublas us':>10} {'bw%':>5} {'triton us':>10} {'bw%':>5} "
          f"{'config':>22} {'maxdiff':>8}")
    hbm = device_bandwidth()[0]
    for name, k, n in SHAPES_8B:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ideal_us = 1e6 * (w.numel() * 2) / hbm
            cublas = timed_us(lambda x=x, w=w: F.linear(x, w))
            best = None
            block_m = min(64, max(16, 1 << (m - 1).bit_length()))
            for bn in (16, 32, 64, 128):
                for bk in (64, 128, 256):
                    for stages in (3, 5):
                        for warps in (4,):
                            cfg = (block_m, bn, bk, warps, stages)
                            try:
                                us = timed_us(lambda cfg=cfg, x=x, w=w: linear(x, w, cfg), reps=20)
                            except Exception:  # out of shared memory and the like
                                continue
                            if best is None or us < best[0]:
                                best = (us, cfg)
            ours, config = best
            diff = (linear(x, w, config).float() - F.linear(x, w).float()).abs().max().item()
            print(f"{name:>8} {m:>5} {cublas:>10.1f} {100 * ideal_us / cublas:>4.0f}% {ours:>10.1f} "
                  f"{100 * ideal_us / ours:>4.0f}% {config!s:>22} {diff:>8.4f}", flush=True)
    return 0


def layouts(rows: list[int]) -> int:
    """cuBLAS's choice on each weight layout: weights as loaded, [out, in] (F.linear, a "TN" GEMM),
    against the same values stored [in, out] (an "NN" GEMM, other kernels to pick; the layout the
    engine gives them on CUDA, ``layers.store_column_major``)."""
    print(f"{'gemm':>8} {'rows':>5} {'[out,in] us':>12} {'bw%':>5} {'[in,out] us':>12} {'bw%':>5} {'same':>5}")
    hbm = device_bandwidth()[0]
    for name, k, n in SHAPES_8B:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w_t = w.t().contiguous()
        ideal_us = 1e6 * (w.numel() * 2) / hbm
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            stored = timed_us(lambda x=x, w=w: F.linear(x, w))
            transposed = timed_us(lambda x=x, w_t=w_t: x @ w_t)
            same = torch.equal(F.linear(x, w), x @ w_t)
            print(f"{name:>8} {m:>5} {stored:>12.1f} {100 * ideal_us / stored:>4.0f}% {transposed:>12.1f} "
                  f"{100 * ideal_us / transposed:>4.0f}% {same!s:>5}", flush=True)
    return 0


def column_major_weights(shapes: list[str]) -> Iterator[tuple[str, str, int, int, torch.Tensor]]:
    """(shape, GEMM name, in, out, weight) for each projection of the named shapes ("8b", "27b"),
    the weight [in, out] random bf16 stored as the engine stores it on CUDA; one at a time."""
    tables = {"8b": SHAPES_8B, "27b": SHAPES_27B}
    for shape in shapes:
        for name, k, n in tables[shape]:
            yield shape, name, k, n, (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).t().contiguous()


def orientations(rows: list[int]) -> int:
    """At a few hundred rows a verify GEMM is compute-bound, and the rows' count decides how full
    cuBLAS's tiles are (272 = 256 + 16 rows in 128-row tiles fill 71 %). The same product computed
    as (w^T x^T)^T puts the rows in the tile's N, which takes more sizes; ``+copy`` adds making
    the result row-major again, as the next kernel would need."""
    print(f"{'shape':>6} {'gemm':>8} {'rows':>5} {'x@w us':>8} {'TFLOP/s':>8} {'wT@xT us':>9} {'TFLOP/s':>8} "
          f"{'+copy us':>9} {'same':>5}")
    for shape, name, k, n, w_t in column_major_weights(["8b", "27b"]):
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            flop = 2 * m * k * n
            straight = timed_us(lambda x=x, w_t=w_t: x @ w_t)
            swapped = timed_us(lambda x=x, w_t=w_t: w_t.t() @ x.t())
            copied = timed_us(lambda x=x, w_t=w_t: (w_t.t() @ x.t()).t().contiguous())
            same = torch.equal(x @ w_t, (w_t.t() @ x.t()).t())
            print(f"{shape:>6} {name:>8} {m:>5} {straight:>8.1f} {flop / straight / 1e6:>8.0f} {swapped:>9.1f} "
                  f"{flop / swapped / 1e6:>8.0f} {copied:>9.1f} {same!s:>5}", flush=True)
    return 0


def backends(rows: list[int]) -> int:
    """Ways to run one verify GEMM (x @ w on the column-major weight, as the engine stores it) that
    pick other kernels: cuBLASLt's heuristic instead of cuBLAS's, cuBLAS told not to reduce split-K
    partial sums in bf16, and the output columns as two GEMMs (other tile counts per wave). ``same``:
    bit-equal to the default's result."""
    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    # way: (BLAS library, the engine's switch: None = as it is; reduced-precision reductions
    # allowed; output columns in halves)
    ways = {"cublas": (None, reduced, False), "lt": ("cublaslt", reduced, False),
            "no-red": (None, False, False), "halves": (None, reduced, True)}
    print(f"{'shape':>6} {'gemm':>8} {'rows':>5} {'cublas us':>10} {'TFLOP/s':>8}"
          + "".join(f" {way + ' us':>10} {'same':>5}" for way in list(ways)[1:]))
    for shape, name, k, n, w_t in column_major_weights(["8b", "27b"]):
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cells = []
            for library, allow_reduced, split in ways.values():
                def product(x=x, w_t=w_t, split=split):
                    if not split:
                        return x @ w_t
                    half = w_t.shape[1] // 2
                    return torch.cat([x @ w_t[:, :half], x @ w_t[:, half:]], dim=1)
                matmul.allow_bf16_reduced_precision_reduction = allow_reduced
                try:
                    with blas_library(library):
                        cells.append((timed_us(product), product()))
                finally:
                    matmul.allow_bf16_reduced_precision_reduction = reduced
            (base, reference), *others = cells
            print(f"{shape:>6} {name:>8} {m:>5} {base:>10.1f} {2 * m * k * n / base / 1e6:>8.0f}"
                  + "".join(f" {us:>10.1f} {torch.equal(out, reference)!s:>5}" for us, out in others), flush=True)
    return 0


def inductor(rows: list[int], search_space: str, shapes: list[str]) -> int:
    """cuBLAS against torch.compile's max-autotune GEMM (Inductor benchmarks its Triton templates
    and cuBLAS per shape and keeps the fastest; its table of choices goes to stderr), with the
    compile's seconds: what a per-shape GEMM autotune would cost a first request."""
    import time

    import torch._dynamo
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    inductor_config.max_autotune_gemm_search_space = search_space
    inductor_config.triton.enable_persistent_tma_matmul = True
    print(f"{'shape':>6} {'gemm':>8} {'rows':>5} {'cublas us':>10} {'TFLOP/s':>8} {'tuned us':>9} {'TFLOP/s':>8} "
          f"{'compile s':>10} {'max diff':>9}")
    for shape, name, k, n, w_t in column_major_weights(shapes):
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.reset()
            tuned = torch.compile(lambda x, w: x @ w, mode="max-autotune-no-cudagraphs", dynamic=False)
            started = time.perf_counter()
            out = tuned(x, w_t)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - started
            cublas = timed_us(lambda x=x, w_t=w_t: x @ w_t)
            ours = timed_us(lambda x=x, w_t=w_t, tuned=tuned: tuned(x, w_t))
            diff = (out.float() - (x @ w_t).float()).abs().max().item()
            flop = 2 * m * k * n
            print(f"{shape:>6} {name:>8} {m:>5} {cublas:>10.1f} {flop / cublas / 1e6:>8.0f} {ours:>9.1f} "
                  f"{flop / ours / 1e6:>8.0f} {compile_s:>10.1f} {diff:>9.4f}", flush=True)
    return 0


def tunable(rows: list[int], shapes: list[str]) -> int:
    """cuBLAS and cuBLASLt (each library's own heuristic pick) against TunableOp's pick for each
    verify GEMM: TunableOp times torch's default call and each of the candidates cuBLASLt's heuristic
    lists for the shape and keeps the fastest; the tuned GEMM is then timed like the others, in a
    CUDA graph (so this also shows whether a capture keeps the tuned kernel: ``graph=eager``, the
    graph's output bit-equal to the tuned eager one). ``same``: bit-equal to cuBLAS."""
    import tempfile
    import time

    from torch.cuda import tunable as tunable_op

    print(f"torch {torch.__version__}, cuBLASLt candidates in TunableOp on this build: see the kernel column",
          flush=True)
    scratch = tempfile.mkdtemp(prefix="tunableop-")
    tunable_op.set_filename(f"{scratch}/results.csv")
    if hasattr(tunable_op, "write_file_on_exit"):  # gone from newer torch
        tunable_op.write_file_on_exit(False)
    tunable_op.set_max_tuning_duration(200)
    print(f"{'shape':>6} {'gemm':>8} {'rows':>5} {'cublas us':>10} {'lt us':>7} {'tuned us':>9} {'TFLOP/s':>8} "
          f"{'tune s':>7} {'same':>5} {'graph=eager':>11}  kernel")
    for shape, name, k, n, w_t in column_major_weights(shapes):
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = x @ w_t
            cublas = timed_us(lambda x=x, w_t=w_t: x @ w_t)
            with blas_library("cublaslt"):
                lt = timed_us(lambda x=x, w_t=w_t: x @ w_t)
            seen = len(tunable_op.get_results())
            tunable_op.enable(True)
            tunable_op.tuning_enable(True)
            try:
                started = time.perf_counter()
                x @ w_t
                torch.cuda.synchronize()
                tune_s = time.perf_counter() - started
                tunable_op.tuning_enable(False)
                tuned_out = x @ w_t
                tuned = timed_us(lambda x=x, w_t=w_t: x @ w_t)
                graph = torch.cuda.CUDAGraph()
                static = torch.empty_like(reference)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    static.copy_(x @ w_t)
                graph.replay()
                torch.cuda.synchronize()
                graph_same = torch.equal(static, tuned_out)
            finally:
                tunable_op.tuning_enable(False)
                tunable_op.enable(False)
            results = tunable_op.get_results()
            kernel = " / ".join(str(r[2]) for r in results[seen:]) or "(none recorded)"
            print(f"{shape:>6} {name:>8} {m:>5} {cublas:>10.1f} {lt:>7.1f} {tuned:>9.1f} "
                  f"{2 * m * k * n / tuned / 1e6:>8.0f} {tune_s:>7.2f} {torch.equal(tuned_out, reference)!s:>5} "
                  f"{graph_same!s:>11}  {kernel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
