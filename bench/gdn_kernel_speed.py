"""The two ends of a Gated DeltaNet verify round alone on a GPU: the tree-row conv and the commit,
PyTorch (as ``layers.linear_attention_rows`` and ``FastDecoder._commit`` run them today) against
the Triton kernels in ``triton_gdn_state``, per row count, each captured in a CUDA graph and
replayed (device time per layer call; a Qwen3.6-27B round runs 48 such layers), and the commit of
all 48 layers in one launch, as the decoder runs it. Shape: one
Qwen3.6-27B Gated DeltaNet layer (16 key heads, 48 value heads, head dims 128, conv width 4) in
bf16. Also prints each kernel's worst difference from PyTorch.

    python -m bench.gdn_kernel_speed [--rows 1,17,257] [--sweep]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.graph_timing import needs_cuda
from bench.tree_kernel_speed import graph_ms
from ddtree_diag.engine import gdn
from ddtree_diag.engine.fast import triton_gdn_state
from ddtree_diag.engine.tree import ancestor_mask

KEY_HEADS, VALUE_HEADS, DK, DV, WIDTH = 16, 48, 128, 128, 4
CHANNELS = 2 * KEY_HEADS * DK + VALUE_HEADS * DV  # 10240
LAYERS = 48


def inputs(rows: int, generator: torch.Generator) -> dict:
    # each row's parent among the 4 before it, cut at a block-16 draft's depth of 15
    parents, depths = [-1], [0]
    for i in range(1, rows):
        near = [j for j in range(max(0, i - 4), i) if depths[j] < 15] or [0]
        parents.append(near[int(torch.randint(0, len(near), (1,), generator=generator))])
        depths.append(depths[parents[-1]] + 1)
    dev, bf16 = "cuda", torch.bfloat16
    anc = ancestor_mask(parents)
    g = -torch.rand(rows, VALUE_HEADS, generator=generator)
    # the accepted path the commit takes: the last row's root path, cut at a block-16 draft's depth
    path = [rows - 1]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    path = path[::-1][:16]
    # the fused GEMM's output: mixed | z | b | a; the conv reads the first CHANNELS columns
    wide = torch.randn(rows, CHANNELS + VALUE_HEADS * DV + 2 * VALUE_HEADS, generator=generator).to(dev, bf16)
    return dict(
        mixed=wide[:, :CHANNELS],
        parents=torch.tensor(parents).to(dev),
        conv_state=torch.randn(CHANNELS, WIDTH - 1, generator=generator).to(dev, bf16),
        weight=(0.5 * torch.randn(CHANNELS, WIDTH, generator=generator)).to(dev, bf16),
        anc=anc.to(dev),
        state=(0.2 * torch.randn(VALUE_HEADS, DK, DV, generator=generator)).to(dev),
        keys=(0.1 * torch.randn(VALUE_HEADS, rows, DK, generator=generator)).to(dev),
        updates=(0.1 * torch.randn(VALUE_HEADS, rows, DV, generator=generator)).to(dev),
        path_decay=(anc.float() @ g).transpose(0, 1).contiguous().to(dev),
        last=torch.tensor([path[-1]], device=dev),
        path=torch.tensor(path + [0] * (16 - len(path)), device=dev),
        count=torch.tensor([len(path)], device=dev),
        ok=torch.tensor(True, device=dev),
    )


def time_rows(rows: int, generator: torch.Generator) -> list[float]:
    """[conv PyTorch us, conv kernel us, conv max diff, commit PyTorch us, commit kernel us, commit
    max diff, the LAYERS layers' commit in one launch us]."""
    x = inputs(rows, generator)
    kept = torch.empty(rows, CHANNELS, dtype=torch.bfloat16, device="cuda")

    def conv_pytorch():
        windows = gdn.conv_windows(x["mixed"], x["parents"], x["conv_state"], WIDTH)
        out = gdn.conv_from_windows(windows, x["weight"], None, "silu").to(torch.bfloat16)
        kept.copy_(x["mixed"])
        return out

    def conv_kernel():
        return triton_gdn_state.conv_rows(x["mixed"], x["parents"], x["conv_state"], x["weight"], None, "silu", kept)[0]

    conv_diff = float((conv_pytorch().float() - conv_kernel().float()).abs().max())
    conv_times = [graph_ms(conv_pytorch) * 1000, graph_ms(conv_kernel) * 1000]

    # the commit writes in place: each side gets its own state copies (replays keep adding to them)
    def commit_pytorch(state, conv_state):
        parts = gdn.ParallelParts(x["keys"], x["updates"], x["path_decay"], x["anc"], state)
        new_state = gdn.state_after(parts, x["last"])
        new_conv = gdn.conv_tail(kept, x["parents"], conv_state, x["last"])
        state.copy_(torch.where(x["ok"], new_state, state))
        conv_state.copy_(torch.where(x["ok"], new_conv, conv_state))

    def commit_kernel(state, conv_state):
        triton_gdn_state.commit_states(
            state, conv_state, x["keys"], x["updates"], x["path_decay"], kept, x["parents"], x["path"], x["count"],
            x["ok"],
        )

    ours = [x["state"].clone(), x["conv_state"].clone()]
    theirs = [x["state"].clone(), x["conv_state"].clone()]
    commit_pytorch(*theirs)
    commit_kernel(*ours)
    commit_diff = float((ours[0] - theirs[0]).abs().max())
    commit_diff = max(commit_diff, float((ours[1].float() - theirs[1].float()).abs().max()))
    commit_times = [graph_ms(lambda: commit_pytorch(*theirs)) * 1000, graph_ms(lambda: commit_kernel(*ours)) * 1000]

    # the decoder's form: every layer's buffers are slices of one stack, one launch commits them all
    def stack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[None].repeat(LAYERS, *([1] * tensor.dim()))

    stacked = [stack(x[name]) for name in ("state", "conv_state", "keys", "updates", "path_decay")] + [stack(kept)]

    def commit_stacked():
        triton_gdn_state.commit_states(*stacked, x["parents"], x["path"], x["count"], x["ok"])

    return [*conv_times, conv_diff, *commit_times, commit_diff, graph_ms(commit_stacked) * 1000]


# tiles the sweep tries: conv (block_n, block_c, warps), commit (block_k, block_v, warps)
CONV_TILES = [(2, 256, 4), (4, 256, 4), (2, 128, 4), (2, 512, 4), (4, 128, 4), (8, 128, 4)]
COMMIT_TILES = [(32, 64, 4), (64, 64, 4), (16, 64, 2), (32, 64, 2), (32, 32, 2), (16, 128, 4)]


def sweep(rows: int, generator: torch.Generator) -> None:
    """us per layer call for each tile in CONV_TILES and COMMIT_TILES."""
    x = inputs(rows, generator)
    kept = torch.empty(rows, CHANNELS, dtype=torch.bfloat16, device="cuda")
    cells = []
    conv_args = (x["mixed"], x["parents"], x["conv_state"], x["weight"], None, "silu", kept)
    for tile in CONV_TILES:
        us = graph_ms(lambda tile=tile: triton_gdn_state.conv_rows(*conv_args, *tile)) * 1000
        cells.append(f"conv {tile[0]}x{tile[1]}/{tile[2]}: {us:.1f}")
    commit_args = (
        x["state"].clone(), x["conv_state"].clone(), x["keys"], x["updates"], x["path_decay"], kept, x["parents"],
        x["path"], x["count"], x["ok"],
    )
    for tile in COMMIT_TILES:
        us = graph_ms(lambda tile=tile: triton_gdn_state.commit_states(*commit_args, *tile)) * 1000
        cells.append(f"commit {tile[0]}x{tile[1]}/{tile[2]}: {us:.1f}")
    print(f"{rows:>5} | " + ", ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,17,257")
    parser.add_argument("--sweep", action="store_true", help="also time other tiles of each kernel")
    args = parser.parse_args()
    needs_cuda("gdn_kernel_speed")
    generator = torch.Generator().manual_seed(0)
    print(f"gdn_kernel_speed: {torch.cuda.get_device_name()}, us per layer call (CUDA graph replays);")
    print(f"x{LAYERS}: a 27B round's {LAYERS} Gated DeltaNet layers, in ms")
    head = f"{'rows':>5} | {'conv torch':>10} {'kernel':>8} {'x48 saved':>9} {'max diff':>9}"
    print(head + f" | {'commit torch':>12} {'kernel':>8} {'x48 saved':>9} {'max diff':>9} | {'x48 one launch':>14}")
    for rows in [int(r) for r in args.rows.split(",")]:
        conv_t, conv_k, conv_d, commit_t, commit_k, commit_d, commit_all = time_rows(rows, generator)
        conv_saved, commit_saved = (conv_t - conv_k) * LAYERS / 1000, (commit_t - commit_k) * LAYERS / 1000
        print(
            f"{rows:>5} | {conv_t:>10.1f} {conv_k:>8.1f} {conv_saved:>9.2f} {conv_d:>9.2e}"
            f" | {commit_t:>12.1f} {commit_k:>8.1f} {commit_saved:>9.2f} {commit_d:>9.2e}"
            f" | {commit_all:>11.1f} us (x48 launches {commit_k * LAYERS:.1f})"
        )
    if args.sweep:
        print("tiles, us per layer call:")
        for rows in [int(r) for r in args.rows.split(",")]:
            sweep(rows, generator)
    return 0


if __name__ == "__main__":
    sys.exit(main())
