"""The Gated DeltaNet tree solve alone on a GPU: the PyTorch solve (``gdn.gdn_gates`` +
``gdn.parallel_gated_delta``, about forty kernels) against the Triton solves
(``triton_gdn.tree_solve``: the path solve's plans (heads a program, value columns a step of its
sums, warps, prep tile) and the blocked solve), per row count, each captured in a CUDA graph and
replayed (device time per layer call). Shape: one Qwen3.6-27B Gated DeltaNet layer (16 key heads,
48 value heads, head dims 128) in bf16, on a random tree of depth at most 15 (a block-16 draft's),
the path bound given as the decoder gives it. Also prints the kernels' worst difference from the
PyTorch solve.

    python -m bench.gdn_solve_speed [--rows 1,17,65,257]

Rows 1 runs the one-row kernel whatever the plan (the plans apply from 2 rows up).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.graph_timing import needs_cuda
from bench.tree_kernel_speed import graph_ms
from ddtree_diag.engine import gdn
from ddtree_diag.engine.fast import triton_gdn
from ddtree_diag.engine.tree import ancestor_mask

KEY_HEADS, VALUE_HEADS, DK, DV = 16, 48, 128, 128
BLOCK, MAX_DEPTH = 16, 15
SOLVE_COLUMNS = triton_gdn.SOLVE_COLUMNS  # the default, for the plans that do not name their own
PLANS = {  # name: tree_solve's keywords
    "path 1hd": dict(method="path", share_heads=False, paths="table"),  # a program per value head
    "path": dict(method="path", paths="table", share_heads=True),  # a program per key head's value heads (3 here)
    "auto": dict(method="path", paths="table"),  # shared past SHARE_HEADS_FROM rows (the default)
    # the sums over the path's right-hand sides in steps of 64 / 32 value columns (fewer registers)
    "sv64": dict(method="path", paths="table", share_heads=True, solve_columns=64),
    "sv32": dict(method="path", paths="table", share_heads=True, solve_columns=32),
    "sv64 2w": dict(method="path", paths="table", share_heads=True, solve_columns=64, path_warps=2),
    "1hd sv64": dict(method="path", paths="table", share_heads=False, solve_columns=64),
    "prep 64r8w": dict(method="path", paths="table", share_heads=True, prep_rows=64, prep_warps=8),
    "blk c64": dict(method="blocked"),  # block_n 16, block_v 64, 8 warps, tf32
}


def inputs(rows: int, generator: torch.Generator) -> dict:
    # a random recursive tree (each row's parent drawn from the earlier rows) cut at the draft's depth
    parents, depths = [-1], [0]
    for i in range(1, rows):
        open_rows = [j for j in range(i) if depths[j] < MAX_DEPTH]
        parent = open_rows[int(torch.randint(0, len(open_rows), (1,), generator=generator))]
        parents.append(parent)
        depths.append(depths[parent] + 1)
    width = 2 * KEY_HEADS * DK + VALUE_HEADS * DV
    dev = "cuda"
    return dict(
        conv_out=torch.randn(rows, width, generator=generator).to(dev, torch.bfloat16),
        gates=torch.randn(rows, 2 * VALUE_HEADS, generator=generator).to(dev, torch.bfloat16),
        a_log=(torch.randn(VALUE_HEADS, generator=generator) * 0.5).to(dev),
        dt_bias=torch.randn(VALUE_HEADS, generator=generator).to(dev, torch.bfloat16),
        anc=ancestor_mask(parents).to(dev),
        state=(torch.randn(VALUE_HEADS, DK, DV, generator=generator) * 0.2).to(dev),
    )


def time_rows(rows: int, generator: torch.Generator) -> tuple[list[float], float]:
    """(us per call: the PyTorch solve, then each plan), worst |kernel - PyTorch| over the plans."""
    x = inputs(rows, generator)
    a, b = x["gates"][:, :VALUE_HEADS], x["gates"][:, VALUE_HEADS:]
    q, k, v = x["conv_out"].split([KEY_HEADS * DK, KEY_HEADS * DK, VALUE_HEADS * DV], dim=-1)

    def pytorch():
        g = -x["a_log"].exp() * F.softplus(a.float() + x["dt_bias"])
        return gdn.parallel_gated_delta(
            q.reshape(rows, KEY_HEADS, DK), k.reshape(rows, KEY_HEADS, DK), v.reshape(rows, VALUE_HEADS, DV),
            g, b.sigmoid(), x["anc"], x["state"],
        )[0]

    parts = [torch.empty(VALUE_HEADS, rows, size, device="cuda") for size in (DK, DV)]
    decay = torch.empty(VALUE_HEADS, rows, device="cuda")

    table = triton_gdn.path_table(x["anc"], BLOCK)

    def kernel(plan):
        plan = dict(plan)
        if plan.get("paths") == "table":
            plan["paths"] = table
        triton_gdn.SOLVE_COLUMNS = plan.pop("solve_columns", SOLVE_COLUMNS)
        return triton_gdn.tree_solve(x["conv_out"], a, b, x["a_log"], x["dt_bias"], x["anc"], x["state"], *parts,
                                     decay, KEY_HEADS, DK, max_path=BLOCK, **plan)

    times, worst = [graph_ms(pytorch) * 1000], 0.0
    for name, plan in PLANS.items():
        try:
            times.append(graph_ms(lambda plan=plan: kernel(plan)) * 1000)
            diff = (kernel(plan).float().reshape(rows, VALUE_HEADS, DV) - pytorch().float()).abs().max()
            worst = max(worst, float(diff))
        except Exception as exc:  # a plan that does not compile here: report and go on
            print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            times.append(float("nan"))
    return times, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,17,65,257")
    args = parser.parse_args()
    needs_cuda("gdn_solve_speed")
    generator = torch.Generator().manual_seed(0)
    print(f"gdn_solve_speed: {torch.cuda.get_device_name()}, us per layer call (CUDA graph replays)")
    names = " ".join(f"{name:>10}" for name in PLANS)
    print(f"{'rows':>5} {'pytorch':>8} {names}  max |diff|")
    for rows in [int(r) for r in args.rows.split(",")]:
        times, worst = time_rows(rows, generator)
        print(f"{rows:>5} {times[0]:>8.1f} " + " ".join(f"{t:>10.1f}" for t in times[1:]) + f"  {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
