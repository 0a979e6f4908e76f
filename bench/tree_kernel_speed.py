"""Tree build alone on a GPU: the tensor build (``build_tree_tensors``) against the one-program
Triton kernel (``triton_tree``), per budget, each captured in a CUDA graph and replayed (device
time per build, launches included as a graph replays them), at several warp counts for the kernel.
Also checks the kernel's tree against the host heap on the same (bf16-logit) rows, and times the
per-depth top-k both ways: ``torch.topk`` on int64 keys and the Triton top-k (``triton_topk``) at
several (first-pass chunk, merge size, warps, method: sorting network or k max reductions), with
each plan's first call (its compile, on a cold Triton cache), checking that they are equal.

    python -m bench.tree_kernel_speed [--budgets 16,64,256] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from unittest import mock

import torch

from bench.graph_timing import graph_us
from ddtree_diag.engine.fast import tree as fast_tree
from ddtree_diag.engine.fast import triton_topk, triton_tree
from ddtree_diag.engine.tree import build_tree

REPLAYS = 50
# (chunk, merge, warps, method) plans of the Triton top-k to time; a sweep of twelve sorting plans
# took over two minutes of compiles on the H200. Each plan's first call (its compiles, on a cold
# Triton cache) is timed too.
TOPK_PLANS = [(2048, 2048, 4, "sort"), (2048, 2048, 4, "select"), (1024, 1024, 4, "select"),
              (4096, 4096, 8, "select"), (8192, 8192, 8, "select")]


def torch_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ranked_top_k``'s torch path (the kernel switched off while it is captured)."""
    with mock.patch.dict(os.environ, {"DDTREE_DIAG_TOPK_KERNEL": "off"}):
        return fast_tree.ranked_top_k(values, k)


def graph_ms(fn) -> float:
    """ms per call of ``fn`` captured in a CUDA graph (after a warm-up)."""
    return graph_us([fn], REPLAYS) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument(
        "--topk-plans", default=None,
        help="chunk:merge:warps:method,... of the Triton top-k to time (method sort or select; default: TOPK_PLANS)",
    )
    args = parser.parse_args()
    plans_to_time = TOPK_PLANS
    if args.topk_plans:
        plans_to_time = [
            (*(int(x) for x in plan.split(":")[:3]), plan.split(":")[3]) for plan in args.topk_plans.split(",")
        ]
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.depth, args.vocab, generator=gen) * 3).bfloat16()
    logprobs = torch.log_softmax(logits.cuda().float(), -1)
    limit = torch.tensor(args.depth, device="cuda")
    print(f"tree_kernel_speed: {torch.cuda.get_device_name()}, depth {args.depth}, vocab {args.vocab}, ms per build")
    for budget in (int(b) for b in args.budgets.split(",")):
        top_k = min(budget, args.vocab)
        values, ids = fast_tree.ranked_top_k(logprobs, top_k)
        out = triton_tree.build_tree(values, ids, budget, limit)
        reference = build_tree(0, logprobs.cpu(), budget)
        n = reference.size
        same = (
            out["tokens"][:n].tolist() == reference.tokens[1:]
            and out["parents"][:n].tolist() == reference.parents[1:]
            and out["depths"][:n].tolist() == reference.depths[1:]
            and int(out["count"]) == n
        )
        tensors = graph_ms(lambda b=budget: fast_tree.build_tree_tensors(logprobs, b, limit))
        topk = graph_ms(lambda k=top_k: fast_tree.ranked_top_k(logprobs, k))
        whole = graph_ms(lambda b=budget: fast_tree.build_tree_kernel(logprobs, b, limit))
        warps = {}
        for num_warps in (1, 2, 4, 8):
            build = functools.partial(triton_tree.build_tree, values, ids, budget, limit, num_warps)
            warps[num_warps] = graph_ms(build)
        kernel = " ".join(f"w{w} {ms:.3f}" for w, ms in warps.items())
        print(
            f"budget {budget:4d}: tensor build {tensors:.3f} | kernel path {whole:.3f} "
            f"(ranked_top_k {topk:.3f}; kernel alone {kernel}) | equals heap: {same}"
        )
        want = torch_top_k(logprobs, top_k)
        equal, cells = True, []
        for chunk, merge, warps, method in plans_to_time:
            run = functools.partial(triton_topk.ranked_top_k, logprobs, top_k, chunk, merge, warps, method)
            started = time.perf_counter()
            got = run()
            torch.cuda.synchronize()
            first = time.perf_counter() - started
            equal = equal and all(map(torch.equal, got, want))
            cells.append(f"{method} c{chunk}/m{merge}/w{warps} {graph_ms(run):.3f} (1st call {first:.1f} s)")
        plans = ", ".join(cells)
        reference = graph_ms(lambda k=top_k: torch_top_k(logprobs, k))
        print(f"  top-k {top_k}: torch {reference:.3f} | triton {plans} | equal: {equal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
