"""Verify attention alone on a GPU: the SDPA path (``FastDecoder._target_forward``: GQA reshape,
memory-efficient SDPA with the additive bias, transpose back) against the split-key Triton kernel
(``triton_attention``), 8B shape (32 query heads, 8 KV heads, head_dim 128, bf16), per verify
bucket, each as 36 calls (one per layer) captured in a CUDA graph and replayed; at its default
plan and at plans that override some of the module's settings (``NARROW_PLANS``, ``WIDE_PLANS``).
Also checks the kernel against SDPA on the same inputs (bf16 steps).

    python -m bench.attention_kernel_speed [--start 176] [--rows 1,17,65,257] [--shape 27b]

``--shape 27b``: Qwen3.6-27B's attention layers instead (24 query heads, 4 KV heads, head_dim 256,
16 layers), with the wide heads' plans (its 32-row query blocks of 6 heads x 257 rows are 196
programs before any key split).
"""

from __future__ import annotations

import argparse
import random

import torch

from bench.graph_timing import graph_us, needs_cuda
from ddtree_diag.engine.fast import triton_attention
from ddtree_diag.engine.fast.decoder import attention_window
from ddtree_diag.engine.fast.layers import additive_mask, attend
from ddtree_diag.engine.tree import ancestor_mask

LAYERS, REPLAYS = 36, 20
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# Plans as overrides of the module's settings ({} = its defaults). BALANCED_SPLITS: key splits over
# the keys a query block sees, not the window's slots. A TARGET_PROGRAMS below the query blocks'
# count leaves one split (the program writes the output, no combine: budget 256 at both shapes).
# COMBINE_*: the combine's group rows a program, warps, and splits loaded before they are merged
# (WIDE_COMBINE_* for heads wider than 128); the first of these plans is the one before the default.
COMBINE_PLANS = [
    {"ROWS": 16, "WARPS": 4, "UNROLL": 1}, {"ROWS": 16, "WARPS": 4, "UNROLL": 4}, {"ROWS": 8, "WARPS": 4, "UNROLL": 2},
    {"ROWS": 4, "WARPS": 2, "UNROLL": 1}, {"ROWS": 4, "WARPS": 2, "UNROLL": 4}, {"ROWS": 2, "WARPS": 1, "UNROLL": 4},
]
NARROW_PLANS = [
    {}, {"TARGET_PROGRAMS": 128}, {"TARGET_PROGRAMS": 128, "BLOCK_N": 64, "MIN_SPLIT_BLOCKS": 1},
    {"BLOCK_N": 64, "MIN_SPLIT_BLOCKS": 1}, {"NARROW_BLOCK_M": 32}, {"STAGES": 2}, {"BALANCED_SPLITS": True},
    *({f"COMBINE_{name}": value for name, value in plan.items()} for plan in COMBINE_PLANS),
]
WIDE_PLANS = [
    {}, {"WIDE_TARGET_PROGRAMS": 256}, {"WIDE_STAGES": 3}, {"WIDE_ONE_SPLIT_BLOCK_N": 32}, {"WIDE_WARPS": 8},
    {"WIDE_BLOCK_M": 64, "WIDE_WARPS": 8}, {"BALANCED_SPLITS": True, "WIDE_TARGET_PROGRAMS": 256},
    *({f"WIDE_COMBINE_{name}": value for name, value in plan.items()} for plan in COMBINE_PLANS),
]
SHAPES = {  # layers, query heads, KV heads, head_dim; plans
    "8b": (36, 32, 8, 128, NARROW_PLANS),
    "27b": (16, 24, 4, 256, WIDE_PLANS),
}
PLANS = NARROW_PLANS


def plan_name(plan: dict) -> str:
    return ",".join(f"{name}={value}" for name, value in plan.items()) or "default"


def layers_us(fn) -> float:
    """us per call of ``fn`` (LAYERS calls captured in one CUDA graph, replayed)."""
    return graph_us([fn] * LAYERS, REPLAYS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=176, help="committed slots (prompt 128 + ~48 decoded)")
    parser.add_argument("--rows", default="1,17,65,257")
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    args = parser.parse_args()
    needs_cuda("attention_kernel_speed")
    global LAYERS, HEADS, KV_HEADS, HEAD_DIM, PLANS
    LAYERS, HEADS, KV_HEADS, HEAD_DIM, PLANS = SHAPES[args.shape]
    start = args.start
    print(f"{torch.cuda.get_device_name()}  start={start}  (us per layer call)")
    rows_list = [int(r) for r in args.rows.split(",")]
    table = {}  # plan name -> us per layer at each row count
    for rows in rows_list:
        window, times, steps = measure(rows, start, torch.device("cuda"), torch.bfloat16)
        print(f"{rows} rows, window {window}: max bf16 steps from exact {steps}")
        for name, us in times.items():
            table.setdefault(name, []).append(us)
    print(f"\n{'us per layer call at rows':<58}" + "".join(f"{rows:>9}" for rows in rows_list))
    for name, cells in table.items():
        print(f"{name:<58}" + "".join(f"{us:9.2f}" for us in cells))


def measure(rows: int, start: int, dev: torch.device, dtype: torch.dtype) -> tuple[int, dict[str, float], str]:
    """The verify bucket of ``rows`` rows after ``start`` committed slots: its window, us per layer
    call of SDPA and of the kernel at each plan, and the bf16 steps of each from exact attention."""
    window = attention_window(start + rows, 1 << 16)
    rep = HEADS // KV_HEADS
    gen = torch.Generator(device=dev).manual_seed(rows)
    q = torch.randn(1, rows, HEADS, HEAD_DIM, device=dev, generator=gen).to(dtype).transpose(1, 2)
    cache_k = torch.randn(1, KV_HEADS, window + 64, HEAD_DIM, device=dev, generator=gen).to(dtype)
    cache_v = torch.randn(1, KV_HEADS, window + 64, HEAD_DIM, device=dev, generator=gen).to(dtype)
    rng = random.Random(rows)
    nodes = max(1, rows - 15)
    anc = torch.eye(rows, dtype=torch.bool)
    anc[:nodes, :nodes] = ancestor_mask([-1] + [rng.randrange(i) for i in range(1, nodes)])
    anc = anc.to(dev)
    start_t = torch.tensor(start, device=dev)
    slot_index = torch.arange(window, device=dev)
    mask = (slot_index < start_t).unsqueeze(0).expand(rows, window).clone()
    mask.index_copy_(1, start_t + torch.arange(rows, device=dev), anc)
    bias = additive_mask(mask.repeat(rep, 1)[None, None], dtype)
    scale = HEAD_DIM**-0.5

    def sdpa():
        qq = q.reshape(1, KV_HEADS, rep * rows, HEAD_DIM)
        out = attend(qq, cache_k[:, :, :window], cache_v[:, :, :window], bias, scale)
        return out.reshape(1, HEADS, rows, HEAD_DIM).transpose(1, 2).reshape(1, rows, HEADS * HEAD_DIM)

    def kernel(q=q, cache_k=cache_k, cache_v=cache_v):
        return triton_attention.tree_attention(q, cache_k, cache_v, anc, start_t, window, scale)

    exact = kernel(q.float(), cache_k.float(), cache_v.float())  # fp32 (IEEE products)
    unit = exact.abs().clamp(min=1.0) * 2**-7
    steps = ((kernel().float() - exact).abs() / unit).max().item()
    sdpa_steps = ((sdpa().float() - exact).abs() / unit).max().item()
    times = {"sdpa": layers_us(sdpa)}
    for plan in PLANS:
        saved = {name: getattr(triton_attention, name) for name in plan}
        for name, value in plan.items():
            setattr(triton_attention, name, value)
        try:
            times["kernel " + plan_name(plan)] = layers_us(kernel)
        except Exception as exc:  # e.g. a plan past the card's shared memory: the sweep goes on
            print(f"plan {plan_name(plan)}: {type(exc).__name__}: {str(exc)[:120]}")
            times["kernel " + plan_name(plan)] = float("nan")
        finally:
            for name, value in saved.items():
                setattr(triton_attention, name, value)
    return window, times, f"kernel {steps:.2f} / sdpa {sdpa_steps:.2f}"

if __name__ == "__main__":
    main()
