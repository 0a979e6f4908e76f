"""The two ends of a Gated DeltaNet verify round as Triton kernels (imported only where Triton is).

- ``conv_rows``: the short depthwise causal conv over tree rows. The PyTorch form
  (``gdn.conv_windows`` + ``gdn.conv_from_windows`` + a cast) gathers a [N, C, K] window table
  with a dozen index kernels, runs F.conv1d on it and activates; here one kernel walks each
  node's parent chain K-1 steps, reads its window straight from the projection output (any row
  stride: it may be a column slice of a wider GEMM) and the committed conv state, and writes the
  activated output and a contiguous copy of the rows' inputs for the commit. (It used to write
  every row's [C, K-1] window tail instead: 17 MB a layer at the 27B shape's 272 rows, in
  3-element runs: 33 us a layer on the H200, where its bytes would take ~6 us.)
- ``commit_states``: after the accept walk, a layer's recurrent state becomes the state after the
  deepest accepted node (``gdn.state_after``) and its conv state that node's window tail (rebuilt
  from the kept inputs along its K-1 newest ancestors); both only when the round is ``ok``, read
  from a device flag, so the commit stays capturable in a CUDA graph. One launch per layer
  instead of ~10 small kernels.

They round where the PyTorch reference rounds (``_rounded``): in fp32 they differ from it by
summation order only; in bf16 the conv output can differ where that order moves a value across
a rounding boundary. Only fp32 and bf16 (``_rounded``'s dtypes) are meant to come here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys
from ddtree_diag.engine.fast.triton_kernels import _rounded


@triton.jit
def _conv_rows_kernel(
    x_ptr, parents_ptr, state_ptr, w_ptr, b_ptr, out_ptr, inputs_ptr,
    rows, channels, history,
    x_row_stride, x_col_stride, state_row_stride, state_col_stride, w_row_stride, w_col_stride,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    MIXED_DTYPES: tl.constexpr,
):
    # MIXED_DTYPES: x's dtype is not the weight's. Else a window value already is one of the
    # weight's dtype and the conv's output one of x's, so rounding them again is the identity
    # (the kernel is instruction-bound: ~6 integer ops an element a step for bf16)
    node = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    chan = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    node_in = node < rows
    chan_in = chan < channels
    inside = node_in[:, None] & chan_in[None, :]
    conv_dtype = w_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + chan, mask=chan_in, other=0.0).to(tl.float32)[None, :]
    # Walk back from the node itself (window slot K-1) to slot 0. ``at`` >= 0 is a tree row;
    # < 0 is committed history: -1 the newest column of the conv state, -2 the one before, ...
    at = node
    for step in tl.static_range(K):
        slot = K - 1 - step
        on_tree = at >= 0
        from_tree = tl.load(
            x_ptr + at[:, None] * x_row_stride + chan[None, :] * x_col_stride,
            mask=inside & on_tree[:, None], other=0.0,
        )
        if step == 0:  # the node's own input, kept contiguous: the commit rebuilds a window from these
            tl.store(inputs_ptr + node[:, None] * channels + chan[None, :], from_tree, mask=inside)
        # past the tree (from_tree's 0 there), committed history: -1 its newest column. A state
        # narrower than K-1 columns reads zeros past its oldest, as the reference pads. The node
        # itself is always a tree row, and most tiles of a deep tree read no history at all: those
        # skip the load and its addressing (the kernel is instruction-bound)
        value = from_tree
        if step > 0:
            column = history + at
            from_history = ~on_tree & (column >= 0) & node_in
            if tl.sum(from_history.to(tl.int32), axis=0) > 0:
                from_state = tl.load(
                    state_ptr + chan[None, :] * state_row_stride + column[:, None] * state_col_stride,
                    mask=chan_in[None, :] & from_history[:, None], other=0.0,
                )
                # the window holds x's dtype (the reference casts the conv state to it first)
                value = tl.where(on_tree[:, None], from_tree, from_state.to(x_ptr.dtype.element_ty))
        # F.conv1d runs in the weight's dtype: the window is rounded to it before the products
        window = value.to(tl.float32)
        if MIXED_DTYPES:
            window = _rounded(window, conv_dtype)
        weight = tl.load(w_ptr + chan * w_row_stride + slot * w_col_stride, mask=chan_in, other=0.0).to(tl.float32)
        acc += window * weight[None, :]
        if step < K - 1:
            parent = tl.load(parents_ptr + at, mask=node_in & on_tree, other=-1)
            at = tl.where(on_tree, parent, at - 1)
    # the conv's output rounds to its dtype; silu runs in fp32 and rounds again
    y = _rounded(acc, conv_dtype)
    if SILU:
        y = _rounded(y / (1.0 + tl.exp(-y)), conv_dtype)
    out_dtype = out_ptr.dtype.element_ty
    if MIXED_DTYPES:
        y = _rounded(y, out_dtype)
    tl.store(out_ptr + node[:, None] * channels + chan[None, :], y.to(out_dtype), mask=inside)


def conv_rows(
    mixed: torch.Tensor,
    parents: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    inputs_out: torch.Tensor | None = None,
    block_n: int = 4,
    block_c: int = 256,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-row causal conv: ``gdn.conv_from_windows(gdn.conv_windows(mixed, parents, conv_state,
    K), weight, bias, activation).to(mixed.dtype)``, and a contiguous copy of ``mixed`` (what the
    commit rebuilds the accepted row's window from: ``commit_states``).

    mixed [N, C] pre-conv inputs (any strides); parents [N] long (-1: the committed state;
    topological; padding rows -1); conv_state [C, L >= K-1 ideally] committed inputs, oldest
    first; weight [C, K]; bias [C] or None; activation "silu" / "swish" / None. Returns
    (conv_out [N, C] in mixed's dtype, inputs [N, C] in mixed's dtype). ``inputs_out``: a
    contiguous [N, C] buffer to write the inputs into (returned).
    block_n / block_c / num_warps: the tile (rows x channels, powers of two) and its warps; the
    defaults were the fastest of six tried on the H200 at the 27B shape, 272 rows
    (``bench.gdn_kernel_speed --sweep``: 4 x 256 on 4 warps 19.1 us, 2 x 256 22.2). Reading each
    window's rows from the verify's path table at once, instead of walking ``parents`` one
    dependent load a step, was no faster in the 27B budget-256 round (31.99 against 31.88 ms)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    rows, channels = mixed.shape
    width = weight.shape[-1]
    out = torch.empty((rows, channels), dtype=mixed.dtype, device=mixed.device)
    if inputs_out is None:
        inputs_out = torch.empty((rows, channels), dtype=mixed.dtype, device=mixed.device)
    assert inputs_out.is_contiguous() and inputs_out.shape == (rows, channels)
    assert inputs_out.dtype == mixed.dtype
    if rows == 0:
        return out, inputs_out
    block_n = min(block_n, max(2, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(rows, block_n), triton.cdiv(channels, block_c))
    launch(
        _conv_rows_kernel, grid,
        mixed, parents, conv_state, weight, weight if bias is None else bias, out, inputs_out,
        rows, channels, conv_state.shape[-1],
        mixed.stride(0), mixed.stride(1), conv_state.stride(0), conv_state.stride(1), weight.stride(0),
        weight.stride(1),
        K=width, HAS_BIAS=bias is not None, SILU=activation is not None,
        BLOCK_N=block_n, BLOCK_C=block_c, MIXED_DTYPES=mixed.dtype != weight.dtype,
        num_warps=num_warps,
    )
    return out, inputs_out


@triton.jit
def _commit_kernel(
    state_ptr, keys_ptr, updates_ptr, decay_ptr, path_ptr, count_ptr, ok_ptr, conv_ptr, inputs_ptr, parents_ptr,
    rows, dk, dv, channels, path_len,
    state_layer, keys_layer, updates_layer, decay_layer, conv_layer, inputs_layer,
    BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CONV_SPAN: tl.constexpr,
    HISTORY: tl.constexpr, SLOTS: tl.constexpr,
):
    # one program per (head, dk block, dv block) tile of the state: it reads only the old values
    # of the tile it writes, so no program can see another's new values. The second grid axis is
    # the layer (its tensors a whole ``*_layer`` elements further on): one launch for every layer
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    state_ptr += layer * state_layer
    keys_ptr += layer * keys_layer
    updates_ptr += layer * updates_layer
    decay_ptr += layer * decay_layer
    conv_ptr += layer * conv_layer
    inputs_ptr += layer * inputs_layer
    k_blocks = tl.cdiv(dk, BLOCK_K)
    v_blocks = tl.cdiv(dv, BLOCK_V)
    head = pid // (k_blocks * v_blocks)
    kb = (pid // v_blocks) % k_blocks
    vb = pid % v_blocks
    ok = tl.load(ok_ptr) != 0
    # the accepted path's rows, root first: only they add anything (depth + 1 of the N rows)
    count = tl.load(count_ptr)
    place = tl.arange(0, BLOCK_J)
    on_path = (place < count) & (place < path_len)
    j = tl.load(path_ptr + place, mask=on_path, other=0)
    last = tl.load(path_ptr + tl.maximum(tl.minimum(count, path_len) - 1, 0))
    decay_base = decay_ptr + head.to(tl.int64) * rows
    decay_last = tl.load(decay_base + last)
    kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    tile_in = (kk < dk)[:, None] & (vv < dv)[None, :]
    tile = state_ptr + head.to(tl.int64) * dk * dv + kk[:, None] * dv + vv[None, :]
    decay_j = tl.load(decay_base + j, mask=on_path, other=0.0)
    # off the path: weight 0 (the reference's exp(-inf)); on it: e^{G_last - G_j}
    weight = tl.where(on_path, tl.exp(decay_last - decay_j), 0.0)
    row = head.to(tl.int64) * rows + j
    keys = tl.load(keys_ptr + row[None, :] * dk + kk[:, None], mask=on_path[None, :] & (kk < dk)[:, None], other=0.0)
    updates = tl.load(updates_ptr + row[:, None] * dv + vv[None, :], mask=on_path[:, None] & (vv < dv)[None, :],
                      other=0.0)
    # as the reference: weights scale the updates, then keys^T @ (that); exact fp32 products
    # (the state carries over every round, so tf32's error would pile up)
    written = tl.dot(keys, updates * weight[:, None], input_precision="ieee")
    # not ok: write the old values back (a scalar flag as a store mask does not broadcast in
    # Triton's interpreter; the extra write is the tile's own values)
    old = tl.load(tile, mask=tile_in, other=0.0)
    tl.store(tile, tl.where(ok, tl.exp(decay_last) * old + written, old), mask=tile_in)
    # The conv state [C, K-1] becomes ``last``'s window tail: the inputs of the K-1 newest rows on
    # its root path, topped up from the old state where the path is shorter (as conv_rows walks).
    # Each program takes whole channels: a channel's new columns come from its own old ones.
    chan = pid * CONV_SPAN + tl.arange(0, CONV_SPAN)
    chan_in = chan < channels
    slot_ids = tl.arange(0, SLOTS)[None, :]
    cells = conv_ptr + chan[:, None] * HISTORY + slot_ids
    cells_in = chan_in[:, None] & (slot_ids < HISTORY)
    window = tl.zeros([CONV_SPAN, SLOTS], dtype=conv_ptr.dtype.element_ty)
    at = tl.zeros([CONV_SPAN], dtype=tl.int64) + last  # one per channel: masks then broadcast everywhere
    for step in tl.static_range(HISTORY):
        on_tree = at >= 0
        from_tree = tl.load(inputs_ptr + at * channels + chan, mask=chan_in & on_tree, other=0.0)
        from_state = tl.load(conv_ptr + chan * HISTORY + (HISTORY + at), mask=chan_in & (at < 0), other=0.0)
        # the window holds the inputs' dtype (conv_rows casts the state to it too)
        value = tl.where(on_tree, from_tree, from_state.to(inputs_ptr.dtype.element_ty))
        window = tl.where(slot_ids == HISTORY - 1 - step, value.to(conv_ptr.dtype.element_ty)[:, None], window)
        if step < HISTORY - 1:
            parent = tl.load(parents_ptr + tl.maximum(at, 0), mask=chan_in, other=-1)
            at = tl.where(on_tree, parent, at - 1)
    tl.debug_barrier()  # every old column is read before any is overwritten
    committed = tl.load(cells, mask=cells_in, other=0.0)
    tl.store(cells, tl.where(ok, window, committed), mask=cells_in)


def commit_states(
    state: torch.Tensor,
    conv_state: torch.Tensor,
    keys: torch.Tensor,
    updates: torch.Tensor,
    path_decay: torch.Tensor,
    inputs: torch.Tensor,
    parents: torch.Tensor,
    path: torch.Tensor,
    count: torch.Tensor,
    ok: torch.Tensor,
    block_k: int = 32,
    block_v: int = 64,
    num_warps: int = 4,
) -> None:
    """One Gated DeltaNet layer's commit, in place and only where ``ok``: ``state`` [Hv, dk, dv]
    fp32 = ``gdn.state_after(ParallelParts(keys, updates, path_decay, anc, state), last)`` (anc:
    the tree's ancestor mask, of which ``path[:count]`` is ``last``'s row);
    ``conv_state`` [C, K-1] = ``gdn.conv_tail(inputs, parents, conv_state, last)`` (the window
    tail ``conv_rows`` read for row ``last``). keys [Hv, N, dk], updates [Hv, N, dv], path_decay
    [Hv, N] fp32; inputs [N, C] (``conv_rows``'s copy of the pre-conv rows); parents [N] long;
    path [P] long: the accepted rows root first (the accept walk's ``keep``), of which the first
    ``count`` (a 1-element long tensor, 1..P) count, so last = path[count - 1]; ok: bool scalar
    tensor. All contiguous, all on one device. No host sync (capturable in a CUDA graph); one
    launch. block_k / block_v / num_warps: the state tile (powers of two, >= 16) and its warps.

    Several layers at once: ``state`` [L, Hv, dk, dv] and each per-layer tensor stacked the same
    way (conv_state [L, C, K-1], keys [L, Hv, N, dk], updates [L, Hv, N, dv], path_decay [L, Hv,
    N], inputs [L, N, C]); parents, path, count and ok are the round's, shared. Still one launch:
    a layer's commit moves ~2 x 3 MB of state at the 27B shape, a few microseconds of bandwidth,
    which a launch of its own (48 a round) spends mostly starting and draining."""
    if state.dim() == 3:
        state, conv_state, keys, updates, path_decay, inputs = (
            t[None] for t in (state, conv_state, keys, updates, path_decay, inputs)
        )
    layers, heads, dk, dv = state.shape
    rows = keys.shape[2]
    for tensor in (state, conv_state, keys, updates, path_decay, inputs, parents, path):
        assert tensor.is_contiguous()
    _, channels, history = conv_state.shape
    assert inputs.shape == (layers, rows, channels) and history >= 1 and path.dim() == 1
    assert keys.shape[:2] == updates.shape[:2] == path_decay.shape[:2] == (layers, heads)
    assert conv_state.shape[0] == layers
    block_k = min(block_k, max(16, triton.next_power_of_2(dk)))
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    programs = heads * triton.cdiv(dk, block_k) * triton.cdiv(dv, block_v)
    span = max(16, triton.next_power_of_2(triton.cdiv(channels, programs)))
    launch(
        _commit_kernel, (programs, layers),
        state, keys, updates, path_decay, path, count.reshape(1), ok.reshape(1).view(torch.int8),
        conv_state, inputs, parents,
        rows, dk, dv, channels, path.shape[0],
        *(t[0].numel() for t in (state, keys, updates, path_decay, conv_state, inputs)),
        BLOCK_J=max(16, triton.next_power_of_2(path.shape[0])), BLOCK_K=block_k, BLOCK_V=block_v, CONV_SPAN=span,
        HISTORY=history, SLOTS=triton.next_power_of_2(history), num_warps=num_warps,
    )


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
