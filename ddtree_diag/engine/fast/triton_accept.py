"""A verify round's accept walk as one Triton kernel (imported only where Triton is).

After the target's choice per tree row (``FastDecoder._choose``), the commit finds the accepted
path: a row is accepted when every row on its root path (itself included) holds its parent's
choice; the root always is. In PyTorch (``FastDecoder._commit``) that is ~35 tiny kernels: masks
over the [rows, rows] ancestor matrix, a scatter by depth, a sum, gathers, the guarded updates of
the round's counters and the host's result row, each ~1.5 us plus its gap in the graph. Here one
program walks each row's parent chain (at most ``block`` rows deep), gathers the path by depth
and writes what the rest of the commit and the next round read:

- ``keep`` [block]: the accepted row at each depth (0 past the path), ``count`` [1]: its length;
- ``slots`` [2, block]: the target cache slots to move (from, to), so the accepted rows follow the
  committed tokens (``KVCache.move``); where the tree is not ``exact`` every row stays;
- and, only where ``exact``: the committed count ``start`` advanced by ``count``, ``root`` set to
  the bonus token (the choice at the path's last row), the draft's ``ctx_len`` advanced by the
  rows its last round queued and ``pending_count`` set to ``count``;
- ``result`` [3 + 2 * block]: exact, count, bonus, keep, the kept rows' tokens (the one host read).

The same integers as the PyTorch form, so either may run (``kernels.accept_kernel`` decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys


@triton.jit
def _accept_kernel(
    tokens_ptr, choice_ptr, parents_ptr, valid_ptr, depths_ptr, exact_ptr,
    start_ptr, root_ptr, ctx_len_ptr, pending_count_ptr,
    keep_ptr, count_ptr, slots_ptr, result_ptr,
    rows, block,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DRAFT: tl.constexpr,
):
    row = tl.arange(0, BLOCK_R)
    inside = row < rows
    # Walk each row's chain to the root: a row on it whose token is not its parent's choice (or
    # that is padding: not valid) rejects the row. Row 0, the root, is always compatible.
    accepted = inside
    at = row.to(tl.int64)
    for _ in range(0, block):
        live = inside & (at >= 0)
        parent = tl.load(parents_ptr + at, mask=live, other=-1)
        token = tl.load(tokens_ptr + at, mask=live, other=0)
        valid = tl.load(valid_ptr + at, mask=live, other=0) != 0
        chosen = tl.load(choice_ptr + tl.maximum(parent, 0), mask=live, other=0)
        compatible = (at == 0) | (valid & (token == chosen))
        accepted = accepted & (~live | compatible)
        at = tl.where(live, parent, -1)
    count = tl.sum(accepted.to(tl.int64), axis=0)
    depth = tl.load(depths_ptr + row, mask=inside, other=-1)
    # the path by depth: one accepted row a depth (the tree's siblings hold distinct tokens); a max,
    # not a sum, so that a malformed tree could never point past the rows
    level = tl.arange(0, BLOCK_D)
    on_level = accepted[None, :] & (depth[None, :] == level[:, None])
    keep = tl.max(tl.where(on_level, row[None, :], 0), axis=1).to(tl.int64)
    last = tl.sum(tl.where(level == count - 1, keep, 0), axis=0)
    bonus = tl.load(choice_ptr + last)
    kept_tokens = tl.load(tokens_ptr + keep)
    exact = tl.load(exact_ptr) != 0
    # The counters this program moves are read, then (after the barrier) written: every warp must
    # read the old values before any warp writes a new one (the interpreter runs one thread and
    # cannot show the race; a GPU's warps run apart between barriers).
    start = tl.load(start_ptr)
    old_root = tl.load(root_ptr)
    if HAS_DRAFT:
        pending = tl.load(pending_count_ptr)
        ctx_len = tl.load(ctx_len_ptr)
    tl.debug_barrier()
    in_block = level < block
    tl.store(keep_ptr + level, keep, mask=in_block)
    tl.store(count_ptr, count)
    tl.store(slots_ptr + level, start + tl.where(exact, keep, level.to(tl.int64)), mask=in_block)
    tl.store(slots_ptr + block + level, start + level, mask=in_block)
    tl.store(result_ptr, exact.to(tl.int64))
    tl.store(result_ptr + 1, count)
    tl.store(result_ptr + 2, bonus)
    tl.store(result_ptr + 3 + level, keep, mask=in_block)
    tl.store(result_ptr + 3 + block + level, kept_tokens, mask=in_block)
    tl.store(start_ptr, start + tl.where(exact, count, 0))
    tl.store(root_ptr, tl.where(exact, bonus, old_root))
    if HAS_DRAFT:
        tl.store(ctx_len_ptr, ctx_len + tl.where(exact, pending, 0))
        tl.store(pending_count_ptr, tl.where(exact, count, pending))


def accept(
    tokens: torch.Tensor,
    choice: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    depths: torch.Tensor,
    exact: torch.Tensor,
    start: torch.Tensor,
    root: torch.Tensor,
    ctx_len: torch.Tensor | None,
    pending_count: torch.Tensor | None,
    keep: torch.Tensor,
    count: torch.Tensor,
    slots: torch.Tensor,
    result: torch.Tensor,
) -> None:
    """The accept walk (see the module docstring). tokens, choice, parents, depths [rows] int64,
    valid [rows] bool, exact a bool scalar; start (0-d), root [1], ctx_len / pending_count (0-d;
    None without a draft) int64, updated in place; keep [block], count [1], slots [2 * block],
    result [3 + 2 * block] int64, written. Tree rows are at most ``block`` deep (depth < block).
    No host sync: captured in the commit stage's CUDA graph."""
    rows, block = tokens.shape[0], keep.shape[0]
    assert slots.shape == (2 * block,) and result.shape == (3 + 2 * block,) and count.shape == (1,)
    has_draft = ctx_len is not None and pending_count is not None
    block_rows = max(16, triton.next_power_of_2(rows))
    launch(
        _accept_kernel, (1,),
        tokens, choice, parents, valid.view(torch.int8), depths, exact.reshape(1).view(torch.int8),
        start, root, ctx_len if has_draft else start, pending_count if has_draft else start,
        keep, count, slots, result,
        rows, block,
        BLOCK_R=block_rows, BLOCK_D=max(16, triton.next_power_of_2(block)),
        # the [depth, row] tile that gathers the path: ~64 values a thread (a budget of 1024 on 16 warps)
        HAS_DRAFT=has_draft, num_warps=min(16, max(4, block_rows // 128)),
    )


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
