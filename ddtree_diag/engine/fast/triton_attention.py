"""Verify and draft attention as a split-key (flash-decoding) Triton kernel (imported only where Triton is).

A verify round attends ~17-257 tree rows (times the query heads of a KV head) to the committed
cache plus their tree ancestors. PyTorch's memory-efficient SDPA kernel tiles the queries only:
at the 8B shape, budget 16, that is 8 KV heads x 2 query tiles = 16 thread blocks on a 132-SM
card, ~14 us per layer for a few hundred keys. Here the keys are split too:

- ``_split_kernel``: grid (KV head x query block, key split). A program takes BLOCK_M query rows
  of one KV head's group (GQA: the query heads of a KV head are extra rows, row m = r * rows + i
  for query head kv * rep + r and tree row i, as the SDPA path's ``reshape`` lays them out) and
  one slice of the keys, and writes the slice's unnormalised output with its running max and sum
  (fp32 partials).
- ``_combine_kernel``: one program per (KV head, ``COMBINE_ROWS`` group rows) merges the splits'
  partials and writes the output in the model dtype straight into the [rows, heads * head_dim]
  layout o_proj reads (no transpose copy). Where the plan makes one split (``plan``), the split
  kernel normalises and writes that output itself: no partials, no second launch.

A program takes its keys in two loops: the committed slots, which every row sees (no ancestor
bytes read, no per-row mask), then the tree slots with the ancestor mask. At budget 256 the
committed slots are most of a block's keys; on the H100 the 8B's 257-row verify attention went
from 26.5 to 18.1 us a layer with the loop split (``bench/attention_kernel_speed.py``).

The visibility rule is the SDPA path's mask (``FastDecoder._target_forward``): key slot j is
visible to tree row i when j < start (committed) or start <= j < start + rows and anc[i, j - start]
(the row's ancestors and itself; padding rows see themselves). Nothing past the last tree row
of a program's block is read. ``start`` is read from the device tensor, so one captured CUDA
graph serves every round of a window; the grid depends only on (rows, window), which are static
per graph.

The draft's noise block (``FastDecoder._draft``) runs the same kernels in their masked mode
(``masked_attention``): visibility is read from a boolean mask [rows, window] (or [1, window]
shared by every row: the context plus the block, or a sliding layer's band), with no cut of the
keys. On an H200 the draft's SDPA attention took ~38 us a layer (16 block rows x 4 query heads
per KV head over ~512 slots: 26.5 us in the memory-efficient kernel, the rest in turning the
boolean mask into a bias on every call and in the output's transpose copies), where this kernel
takes ~10 us at the verify's similar sizes and writes o_proj's layout directly.

Math as SDPA: scores q.k in fp32 times ``scale``, softmax in fp32, probabilities rounded to the
value dtype for the p.v product (the memory-efficient kernel does the same), fp32 accumulation,
output cast to the model dtype. fp32 inputs use IEEE fp32 products (no TF32), so the fp32 engine
tests stay equal to eager.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys, stride
from ddtree_diag.engine.fast.triton_kernels import _rounded

# Triton's interpreter (the CPU tests) multiplies bf16 tl.dot operands wrongly (3.9: garbage of
# order 1e10); there the kernel feeds the dots the same bf16 values as fp32 (exact products, fp32
# sums: what a tensor core's bf16 MMA computes too), rounding p to bf16 with integer ops first.
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"
# Key tile per loop step, and the number of programs the split count aims for: about two per SM of
# an H200 (132), so that budget 256's 136 query blocks split in two (8B: 37.3 -> 26.6 us a layer),
# without writing more fp32 partials than the keys themselves weigh. The
# interpreter runs programs one after another, so there it aims for one split (a whole decode
# under it would otherwise take minutes); the tests set it to exercise the splits.
BLOCK_N = 32
TARGET_PROGRAMS = 1 if UPCAST else 256
# Key tiles a split takes at the least: with one, a 32-row verify's splits are one tile each and
# the combine merges twice as many partials (8B, us per layer: 12.2 -> 11.4 at 32 rows, 7.0 -> 6.5
# for AR; ``bench/attention_kernel_speed.py``).
MIN_SPLIT_BLOCKS = 2
# The combine's plan: group rows a program, its warps, and how many splits' partials it loads before
# merging them (1, 2 or 4; the same bits either way: the merge order and each element's arithmetic
# do not change). Few rows a program and four splits' loads in flight suit the decode steps' short
# merges. On the H100, 8B shape, 300 committed slots, us per layer at 1 / 17 / 65 rows
# (``bench.attention_kernel_speed``): 16 rows, 4 warps, one split at a time 7.56 / 12.08 / 14.04;
# 4 rows, 2 warps, four splits 6.98 / 9.22 / 12.12 (8B rounds at budgets 16 / 64: 8.17 -> 8.06, 8.51
# -> 8.40 ms). Heads wider than 128, 27B shape, same card and bench: the old plan 11.03 / 19.77 /
# 21.35; 4 rows, 2 warps, four splits 8.50 / 12.94 / 18.84; 2 rows, 1 warp, four splits 8.07 / 13.14
# / 18.85, the least summed over the three.
COMBINE_ROWS, COMBINE_WARPS, COMBINE_UNROLL = 4, 2, 4
WIDE_COMBINE_ROWS, WIDE_COMBINE_WARPS, WIDE_COMBINE_UNROLL = 2, 1, 4
# The split kernel's software pipeline depth (Triton's default) and warps for heads wider than 128.
# 27B shape (head dim 256) on the H100, us per layer at 1 / 32 / 80 / 272 rows: 8 warps 9.6 / 14.1 /
# 20.4 / 53.8, 4 warps 9.1 / 14.8 / 17.5 / 47.0 (``bench.attention_kernel_speed --shape 27b``)
STAGES, WIDE_WARPS = 3, 4
# Heads wider than 128 (Qwen3.6-27B's 256) on their own plan: 2 pipeline stages, programs aimed at
# 128, and where that leaves one key split (budget 256: 196 query blocks of 32 rows) key tiles of
# 64. On the H100, 27B shape, 300 committed slots, us per layer at 1 / 17 / 65 / 257 rows: the
# narrow heads' plan 13.27 / 20.23 / 24.10 / 50.17; 2 stages and 128 programs 12.92 / 19.93 / 21.89
# / 46.41; with the wider tile where one split 41.08 at 257. The 8B's heads lost with either
# change (at 257 rows 18.05 us against 23.92 for one split, 32.33 for one split of 64-key tiles).
WIDE_STAGES, WIDE_TARGET_PROGRAMS, WIDE_ONE_SPLIT_BLOCK_N = 2, (1 if UPCAST else 128), 64
# Tree mode: the key splits share the keys a query block can see (the committed slots and the tree
# rows up to its last), read from the device's committed count, instead of the window's slots. Off:
# on the H100 it lost at 257 rows (us per layer, 8B 26.6 -> 31.6, 27B 87.0 -> 90.0) and cost the
# 8B's budget-256 verify ~0.15 ms (``bench.attention_kernel_speed``).
BALANCED_SPLITS = False
# Query rows a program takes at most, for heads of up to 128 dims and for wider ones.
NARROW_BLOCK_M, WIDE_BLOCK_M = 64, 32


@triton.jit
def _key_tile(
    q, k_base, v_base, n, n_ok, visible, m_i, l_i, acc, d, d_ok, scale, k_slot_stride, v_slot_stride,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One tile of keys ``n`` folded into the rows' online softmax (max m_i, sum l_i, acc); scores
    not ``visible`` count as -inf."""
    k = tl.load(k_base + n[:, None] * k_slot_stride + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter: the same products of the same values, in fp32 (see UPCAST)
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row with nothing visible yet keeps max -inf: subtract 0 there (exp(-inf) = 0, no NaN)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + n[:, None] * v_slot_stride + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        pv = tl.dot(_rounded(p, v.dtype), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _store_rows(out_ptr, acc, total, m, m_ok, d, d_ok, rows, heads, rep, kv, head_dim):
    """Group rows ``m`` of KV head ``kv``, normalised by their sums, into out [rows, heads *
    head_dim] (the layout o_proj reads): group row m is query head kv * rep + m // rows of tree row
    m % rows. A row that saw no key gives 0 (the grid's spare rows; a tree row sees itself, a
    masked-mode row may see nothing)."""
    o = acc / tl.where(total > 0, total, 1.0)[:, None]
    head = kv * rep + m // rows
    row = m % rows
    tl.store(out_ptr + (row * heads + head)[:, None] * head_dim + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, start_ptr, part_o_ptr, part_ml_ptr, out_ptr,
    rows, heads, rep, group_rows, q_blocks, window, split_len, splits, head_dim, scale,
    q_head_stride, q_row_stride, k_head_stride, k_slot_stride, v_head_stride, v_slot_stride,
    mask_row_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, MASKED: tl.constexpr, BALANCED: tl.constexpr, DIRECT: tl.constexpr,
):
    """MASKED False: the tree rule, mask_ptr = anc [rows, rows] bytes, start_ptr the committed
    count. MASKED True: slot n visible to row i iff mask[i, n] (bytes, row stride 0 for one row
    shared by all), keys [0, window) uncut; start_ptr is not read. DIRECT (one split): the
    program writes its rows' output itself; otherwise fp32 partials for the combine."""
    kv = tl.program_id(0) // q_blocks
    block = tl.program_id(0) % q_blocks
    split = tl.program_id(1)
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # row in the KV head's group
    m_ok = m < group_rows
    head = kv * rep + m // rows  # query head
    row = m % rows  # tree row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + head[:, None] * q_head_stride + row[:, None] * q_row_stride + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    k_base = k_ptr + kv * k_head_stride
    v_base = v_ptr + kv * v_head_stride
    lo = split * split_len
    if MASKED:  # a mask can let any row see any slot: no cut, and no slot every row sees
        hi = tl.minimum(lo + split_len, window)
        shared_hi = lo
        mask_first = 0  # the mask's column of slot 0
    else:
        start = tl.load(start_ptr).to(tl.int32)
        # The keys the block can see, cut at its last tree row: a row's ancestors come before it, so
        # a tree slot past every row of the block is visible to none of them (budget 256: a block of
        # 64 rows of one query head reads on average half the tree's slots).
        first = block * BLOCK_M
        last = tl.minimum(first + BLOCK_M, group_rows) - 1
        last_row = tl.where(first // rows == last // rows, last % rows, rows - 1)  # rows of two heads: all
        end = tl.minimum(window, start + last_row + 1)
        if BALANCED:
            # the splits share those keys, not the window's slots: the window's tail past the last
            # row is empty, so window-wide splits would leave the last ones idle and the first long
            share = tl.cdiv(tl.cdiv(end, BLOCK_N), splits) * BLOCK_N
            lo = split * share
            hi = tl.minimum(lo + share, end)
        else:
            hi = tl.minimum(lo + split_len, end)
        # Committed slots are visible to every row: their tiles read no ancestor bytes and mask
        # only the keys past the committed ones (at 257 rows most of a block's keys are these). So
        # is a one-row tree's slot (a row sees itself): AR rounds take no tree tile.
        shared_hi = tl.minimum(hi, tl.where(rows == 1, start + 1, start))
        mask_first = start  # anc's column of slot start (the first tree row)
    for n0 in range(lo, shared_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < shared_hi
        m_i, l_i, acc = _key_tile(q, k_base, v_base, n, n_ok, n_ok[None, :], m_i, l_i, acc, d, d_ok, scale,
                                  k_slot_stride, v_slot_stride, PRECISION, UPCAST)
    # the rest: visible to the rows the mask says (anc: their ancestors and themselves)
    for n0 in range(tl.maximum(lo, shared_hi), hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        seen = tl.load(
            mask_ptr + row[:, None] * mask_row_stride + (n - mask_first)[None, :],
            mask=m_ok[:, None] & n_ok[None, :], other=0,
        )
        visible = (seen != 0) & n_ok[None, :] & m_ok[:, None]
        m_i, l_i, acc = _key_tile(q, k_base, v_base, n, n_ok, visible, m_i, l_i, acc, d, d_ok, scale,
                                  k_slot_stride, v_slot_stride, PRECISION, UPCAST)
    if DIRECT:
        _store_rows(out_ptr, acc, l_i, m, m_ok, d, d_ok, rows, heads, rep, kv, head_dim)
    else:
        # partials: [kv, group_rows, splits, head_dim] and [kv, group_rows, splits, 2] (max, sum)
        at = (kv * group_rows + m) * splits + split
        tl.store(part_o_ptr + at[:, None] * head_dim + d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + at * 2, m_i, mask=m_ok)
        tl.store(part_ml_ptr + at * 2 + 1, l_i, mask=m_ok)


@triton.jit
def _load_split(part_o_ptr, part_ml_ptr, at, split, splits, m_ok, d, d_ok, head_dim):
    """One split's partials for the combine's rows; a split past the last reads as empty."""
    ok = m_ok & (tl.zeros_like(at) + split < splits)  # (a tensor: the interpreter's split is an int)
    m_s = tl.load(part_ml_ptr + (at + split) * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + (at + split) * 2 + 1, mask=ok, other=0.0)
    o_s = tl.load(part_o_ptr + (at + split)[:, None] * head_dim + d[None, :], mask=ok[:, None] & d_ok[None, :],
                  other=0.0)
    return m_s, l_s, o_s


@triton.jit
def _merge_split(top, total, acc, m_s, l_s, o_s):
    """One more step of the online softmax over the splits. An empty split (max -inf, sum 0) leaves
    (top, total, acc) bit for bit as they were: its weight is exp(-inf) = 0, theirs exp(0) = 1."""
    new = tl.maximum(top, m_s)
    shift = tl.where(new == float("-inf"), 0.0, new)
    old_w = tl.exp(top - shift)
    w = tl.exp(m_s - shift)
    return new, total * old_w + l_s * w, acc * old_w[:, None] + o_s * w[:, None]


@triton.jit
def _combine_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, rows, heads, rep, group_rows, splits, head_dim,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
):
    kv = tl.program_id(0)
    m = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of the KV head's group
    m_ok = m < group_rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    at = (kv * group_rows + m) * splits
    # the splits merged in order as one more online softmax (an empty split has max -inf and weighs
    # 0); UNROLL splits' loads are issued before the first of them is merged, so that a decode
    # step's many small splits wait on memory together rather than one after another
    for base in range(0, splits, UNROLL):
        m_0, l_0, o_0 = _load_split(part_o_ptr, part_ml_ptr, at, base, splits, m_ok, d, d_ok, head_dim)
        if UNROLL >= 2:
            m_1, l_1, o_1 = _load_split(part_o_ptr, part_ml_ptr, at, base + 1, splits, m_ok, d, d_ok, head_dim)
        if UNROLL >= 4:
            m_2, l_2, o_2 = _load_split(part_o_ptr, part_ml_ptr, at, base + 2, splits, m_ok, d, d_ok, head_dim)
            m_3, l_3, o_3 = _load_split(part_o_ptr, part_ml_ptr, at, base + 3, splits, m_ok, d, d_ok, head_dim)
        top, total, acc = _merge_split(top, total, acc, m_0, l_0, o_0)
        if UNROLL >= 2:
            top, total, acc = _merge_split(top, total, acc, m_1, l_1, o_1)
        if UNROLL >= 4:
            top, total, acc = _merge_split(top, total, acc, m_2, l_2, o_2)
            top, total, acc = _merge_split(top, total, acc, m_3, l_3, o_3)
    _store_rows(out_ptr, acc, total, m, m_ok, d, d_ok, rows, heads, rep, kv, head_dim)


def plan(rows: int, rep: int, kv_heads: int, window: int, head_dim: int = 128) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, splits, split_len) for a shape: query blocks of up to NARROW_BLOCK_M
    group rows (WIDE_BLOCK_M for heads wider than 128: a program's fp32 accumulator is BLOCK_M x
    head_dim; at least 16, tl.dot's minimum), and as many key splits of at least MIN_SPLIT_BLOCKS
    BLOCK_N-key tiles as bring the grid to about TARGET_PROGRAMS (WIDE_TARGET_PROGRAMS; few when
    the query blocks alone nearly fill it, budget 256). One split: the program writes the output
    itself, and wide heads take WIDE_ONE_SPLIT_BLOCK_N keys a tile."""
    wide = head_dim > 128
    group_rows = rep * rows
    block_m = min(WIDE_BLOCK_M if wide else NARROW_BLOCK_M, max(16, triton.next_power_of_2(group_rows)))
    programs = kv_heads * triton.cdiv(group_rows, block_m)
    key_blocks = triton.cdiv(window, BLOCK_N)
    target = WIDE_TARGET_PROGRAMS if wide else TARGET_PROGRAMS
    splits = max(1, min(key_blocks // MIN_SPLIT_BLOCKS, triton.cdiv(target, programs)))
    if splits == 1:
        block_n = WIDE_ONE_SPLIT_BLOCK_N if wide else BLOCK_N
        return block_m, block_n, 1, triton.cdiv(window, block_n) * block_n
    split_len = triton.cdiv(key_blocks, splits) * BLOCK_N
    return block_m, BLOCK_N, triton.cdiv(window, split_len), split_len


def tree_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    anc: torch.Tensor,
    start: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Attention of tree rows over the cache slots [0, window). q [1, heads, rows, head_dim] (any
    row/head strides); cache_k/v [1, kv_heads, capacity, head_dim]; anc [rows, rows] bool; start: a
    0-d int64 device tensor (committed slots; the rows' K/V sit at slots start..start+rows).
    Returns [1, rows, heads * head_dim] in q's dtype: what the SDPA path feeds o_proj."""
    anc = anc.contiguous()  # the kernel steps along a row of anc by 1 (the tree buffers are)
    anc_bytes = anc.view(torch.uint8) if anc.dtype == torch.bool else anc
    return _attention(q, cache_k, cache_v, anc_bytes, anc_bytes.stride(0), start, window, scale, masked=False)


def masked_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    mask: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Attention of rows over the cache slots [0, window) where ``mask`` lets them: slot n is
    visible to row i iff mask[i, n]. q, cache_k/v and the result as ``tree_attention``'s; mask
    [rows, >= window] bool, or [1, >= window] for a mask every row shares. A row that sees no slot
    gives 0, not NaN."""
    rows = q.shape[2]
    if mask.dim() != 2 or mask.shape[0] not in (1, rows) or mask.shape[1] < window:
        raise ValueError(f"mask {tuple(mask.shape)} for {rows} rows over {window} slots")
    if mask.dtype != torch.bool:  # an additive float mask's -inf would read as "visible"
        raise ValueError(f"a boolean mask, not {mask.dtype}")
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    mask_bytes = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    row_stride = 0 if mask.shape[0] == 1 else mask_bytes.stride(0)
    # start is not read in the masked mode: the mask stands in for its pointer
    return _attention(q, cache_k, cache_v, mask_bytes, row_stride, mask_bytes, window, scale, masked=True)


def _attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    mask: torch.Tensor,
    mask_row_stride: int,
    start: torch.Tensor,
    window: int,
    scale: float,
    masked: bool,
) -> torch.Tensor:
    """The split and combine launches for either mode (``_split_kernel``'s MASKED)."""
    _, heads, rows, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    rep = heads // kv_heads
    group_rows = rep * rows
    block_m, block_n, splits, split_len = plan(rows, rep, kv_heads, window, head_dim)
    q_blocks = triton.cdiv(group_rows, block_m)
    out = torch.empty(1, rows, heads * head_dim, device=q.device, dtype=q.dtype)
    direct = splits == 1  # the split kernel normalises and writes out itself: no partials, no combine
    parts = 1 if direct else kv_heads * group_rows * splits  # (one element: never a null pointer)
    part_o = torch.empty(parts * head_dim, device=q.device, dtype=torch.float32)
    part_ml = torch.empty(parts * 2, device=q.device, dtype=torch.float32)
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = head_dim > 128
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is unused for bf16 operands
    launch(
        _split_kernel, (kv_heads * q_blocks, splits),
        q, cache_k, cache_v, mask, start, part_o, part_ml, out,
        rows, heads, rep, group_rows, q_blocks, window, split_len, splits, head_dim, scale,
        stride(q, 1), stride(q, 2), stride(cache_k, 1), cache_k.stride(2), stride(cache_v, 1), cache_v.stride(2),
        mask_row_stride,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision, UPCAST=UPCAST, MASKED=masked,
        BALANCED=BALANCED_SPLITS, DIRECT=direct, num_warps=WIDE_WARPS if wide else 4,
        num_stages=WIDE_STAGES if wide else STAGES,
    )
    if not direct:
        combine_rows, combine_warps, unroll = (
            (WIDE_COMBINE_ROWS, WIDE_COMBINE_WARPS, WIDE_COMBINE_UNROLL) if wide
            else (COMBINE_ROWS, COMBINE_WARPS, COMBINE_UNROLL)
        )
        if unroll not in (1, 2, 4):  # the kernel steps by UNROLL and loads at most 4: 3 would skip splits
            raise ValueError(f"combine unroll {unroll}: 1, 2 or 4")
        launch(
            _combine_kernel, (kv_heads, triton.cdiv(group_rows, combine_rows)),
            part_o, part_ml, out, rows, heads, rep, group_rows, splits, head_dim,
            BLOCK_R=combine_rows, BLOCK_D=block_d, UNROLL=unroll, num_warps=combine_warps,
        )
    return out


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
