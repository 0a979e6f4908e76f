"""The Gated DeltaNet tree solve as Triton kernels (imported only where Triton is).

``gdn.parallel_gated_delta`` solves a Gated DeltaNet layer over the tree rows of a verify round
in about forty small PyTorch kernels (head repeat, l2 norms, gates, the path decays, three batched
matmuls, a triangular solve, the output), each a few microseconds on a handful of kilobytes: on
an H200 the 48 such layers of a 27B hybrid round spend more time launching and finishing those
kernels than reading their weights. The system is (I + L) u = rhs over the rows, with
L[i, j] = beta_i e^{G_i - G_j} k_i . k_j for j a strict ancestor of i (``anc``), G_i the sum of g
over the row's ancestors, rhs_i = beta_i (v_i - e^{G_i} k_i S0); the output is
o_i = e^{G_i} q_i S0 + sum over ancestors j (itself included) of e^{G_i - G_j} (q_i . k_j) u_j,
written straight to the [rows, heads * head_dim] layout the gated norm reads. Two ways to solve it:

- **The path solve** (default; a draft tree's paths are at most its block long): a row's
  ancestors are a chain closed under the system (an ancestor's ancestors are the row's too), so
  every row solves its own path whole, in parallel with every other. Both kernels read the
  round's path table (``path_table``: each row's root path, built once a verify).
  ``_path_prep_kernel`` (per value head, block of rows, 64 value columns) writes what is each
  row's own, whichever descendant's path it lies on: prepared key (l2-normed, fp32), beta, path
  decay G (its gates summed from the root), right-hand side beta (v - e^G k S0) and the output's
  state part e^G q S0. ``_path_solve_kernel`` (per row and value head, or per row and key head
  for its value heads past ``SHARE_HEADS_FROM`` rows) gathers its path's keys,
  builds the path's [PATH, PATH] system and back-substitutes for the two row vectors it needs
  (see there), then sums the path's right-hand sides with them. Ancestors' rows are solved again
  by each descendant's program: far cheaper than waiting for them.
- **The blocked solve** (any tree; paths past ``PATH_LIMIT`` rows): one program per (value head,
  slice of value columns) takes the rows in blocks of BLOCK_N, in order: a first pass writes the
  prepared keys and path decays; then each block's right-hand side minus what the earlier blocks'
  updates contribute, and the block's own triangular system through its inverse, built by
  doubling (log2(BLOCK_N) steps of small exact products, not BLOCK_N dependent row steps).

In the blocked solve the columns of the updates are independent of each other (the system's
matrix has no value dimension), so the value columns split across programs; each program
recomputes the same L, which costs far less than it saves in parallelism. Programs of one head
write the same keys and decays, bit for bit, so their overlapping stores are harmless.

A one-row tree (the AR rounds) is a single step of the recurrence: ``_one_row_kernel`` does it
with row-by-matrix sums instead of 16-row tiles (4 us a layer on an H200 against 78 us for the
PyTorch solve, 27B shape; ``bench/gdn_solve_speed.py``).

The same math as ``gdn.parallel_gated_delta``, in another summation order. fp32 models: IEEE
fp32 products, so results agree with the PyTorch solve to float rounding (not bit for bit). bf16
models: the key products (and the blocked solve's tiles) run on TF32 tensor cores (IEEE fp32
dots were 2-3x slower than the whole PyTorch solve); TF32 keeps 10 mantissa bits of the fp32
operands, more than the bf16 values they come from. Gates as ``gdn.gdn_gates``:
g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b) rounded to the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast import triton_kernels
from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys
from ddtree_diag.engine.fast.triton_kernels import _normed_rows, _rounded


@triton.jit
def _softplus(x):
    # torch's softplus (beta 1, threshold 20): x itself above 20, else log(1 + e^x), written as
    # max(x, 0) + log(1 + e^-|x|) so that a very negative x keeps its digits
    smooth = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
    return tl.where(x > 20.0, x, smooth)


@triton.jit
def _gates(a_ptr, b_ptr, rows, row_ok, a_row_stride, b_row_stride, head, neg_rate, dt_bias, dtype: tl.constexpr):
    """(g, beta) of ``rows`` for value head ``head`` (fp32; beta rounded to the model dtype)."""
    a = tl.load(a_ptr + rows * a_row_stride + head, mask=row_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * b_row_stride + head, mask=row_ok, other=0.0).to(tl.float32)
    g = neg_rate * _softplus(a + dt_bias)
    beta = _rounded(1.0 / (1.0 + tl.exp(-b)), dtype)
    return g, beta


@triton.jit
def _normed(x_ptr, rows, row_ok, row_stride, column, d, d_ok, divisor):
    """Rows of one key head from the conv output, l2-normed in fp32 (then divided: q's scale)."""
    x = tl.load(x_ptr + rows[:, None] * row_stride + column + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]  # gdn.L2NORM_EPS, inside the rsqrt
    return x / divisor


@triton.jit
def _tree_solve_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, anc_ptr, state_ptr,
    out_ptr, keys_ptr, updates_ptr, decay_ptr,
    n_rows, conv_row_stride, a_row_stride, b_row_stride, anc_row_stride,
    key_dim, heads_per_key, dk, dv, q_divisor,
    BLOCK_N: tl.constexpr, LOG2_BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(0)  # value head
    v0 = tl.program_id(1) * BLOCK_V  # first value column of this program
    key_head = head // heads_per_key  # a key head serves heads_per_key consecutive value heads
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_K)
    d_ok = d < dk
    e = v0 + tl.arange(0, BLOCK_V)
    e_ok = e < dv
    heads = tl.num_programs(0)
    neg_rate = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    local = tl.arange(0, BLOCK_N)
    keys_base = keys_ptr + head * n_rows * dk
    decay_base = decay_ptr + head * n_rows

    # pass 1: prepared keys and path decays of every row
    wide = tl.arange(0, BLOCK_C)
    for i0 in range(0, n_rows, BLOCK_N):
        rows = i0 + local
        row_ok = rows < n_rows
        k = _normed(conv_ptr, rows, row_ok, conv_row_stride, key_dim + key_head * dk, d, d_ok, 1.0)
        tl.store(keys_base + rows[:, None] * dk + d[None, :], k, mask=row_ok[:, None] & d_ok[None, :])
        total = tl.zeros((BLOCK_N,), tl.float32)
        # ancestors come first: nothing past this block; BLOCK_C columns a step (a 272-row tree: 45
        # steps of 64 columns instead of 153 of 16, each with the columns' gates recomputed)
        for j0 in range(0, i0 + BLOCK_N, BLOCK_C):
            cols = j0 + wide
            col_ok = (cols < n_rows) & (cols < i0 + BLOCK_N)
            g, _ = _gates(a_ptr, b_ptr, cols, col_ok, a_row_stride, b_row_stride, head, neg_rate, dt_bias, dtype)
            anc = tl.load(anc_ptr + rows[:, None] * anc_row_stride + cols[None, :],
                          mask=row_ok[:, None] & col_ok[None, :], other=0)
            total += tl.sum(tl.where(anc != 0, g[None, :], 0.0), axis=1)
        tl.store(decay_base + rows, total, mask=row_ok)
    tl.debug_barrier()  # this program reads back what all of its threads stored above

    # the committed state's columns this program needs: S0[:, v0:v0+BLOCK_V]
    state = tl.load(state_ptr + head * dk * dv + d[:, None] * dv + e[None, :], mask=d_ok[:, None] & e_ok[None, :],
                    other=0.0)
    updates_base = updates_ptr + head * n_rows * dv
    for i0 in range(0, n_rows, BLOCK_N):
        rows = i0 + local
        row_ok = rows < n_rows
        k_i = tl.load(keys_base + rows[:, None] * dk + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_i = _normed(conv_ptr, rows, row_ok, conv_row_stride, key_head * dk, d, d_ok, q_divisor)
        decay_i = tl.load(decay_base + rows, mask=row_ok, other=0.0)
        _, beta = _gates(a_ptr, b_ptr, rows, row_ok, a_row_stride, b_row_stride, head, neg_rate, dt_bias, dtype)
        v = tl.load(conv_ptr + rows[:, None] * conv_row_stride + 2 * key_dim + head * dv + e[None, :],
                    mask=row_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        grow = tl.exp(decay_i)[:, None]
        rhs = beta[:, None] * (v - grow * tl.dot(k_i, state, input_precision=PRECISION))
        out = grow * tl.dot(q_i, state, input_precision=PRECISION)
        # earlier blocks (their updates are final), BLOCK_C rows a step: a 272-row tree takes 40
        # steps with [16, 64]-wide products instead of 136 block pairs of [16, 16] ones; the loop is
        # latency bound, so fewer, wider steps are what counts. Rows at or past i0 are masked out
        # (their updates are not written yet: garbage, possibly NaN, that must not be multiplied).
        for j0 in range(0, i0, BLOCK_C):
            cols = j0 + wide
            col_ok = cols < i0
            k_j = tl.load(keys_base + cols[:, None] * dk + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            decay_j = tl.load(decay_base + cols, mask=col_ok, other=0.0)
            u_j = tl.load(updates_base + cols[:, None] * dv + e[None, :], mask=col_ok[:, None] & e_ok[None, :],
                          other=0.0)
            anc = tl.load(anc_ptr + rows[:, None] * anc_row_stride + cols[None, :],
                          mask=row_ok[:, None] & col_ok[None, :], other=0)
            path = tl.exp(tl.where(anc != 0, decay_i[:, None] - decay_j[None, :], float("-inf")))
            system = beta[:, None] * path * tl.dot(k_i, tl.trans(k_j), input_precision=PRECISION)
            rhs -= tl.dot(system, u_j, input_precision=PRECISION)
            out += tl.dot(path * tl.dot(q_i, tl.trans(k_j), input_precision=PRECISION), u_j, input_precision=PRECISION)
        # this block
        anc = tl.load(anc_ptr + rows[:, None] * anc_row_stride + rows[None, :],
                      mask=row_ok[:, None] & row_ok[None, :], other=0)
        path = tl.exp(tl.where(anc != 0, decay_i[:, None] - decay_i[None, :], float("-inf")))
        strict = path * (local[:, None] != local[None, :])
        system = beta[:, None] * strict * tl.dot(k_i, tl.trans(k_i), input_precision=PRECISION)
        # (I + L) x = rhs with L = system strictly lower (ancestors come first): x = T rhs, with the
        # inverse T built by doubling instead of BLOCK_N dependent row steps (each a cross-warp
        # reduction: ~12 % of the kernel at 272 rows on an H200). T starts as the inverse
        # of the 1x1 diagonal blocks (I); step s merges blocks of w = 2^s rows pairwise, using
        # [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]: T -= T C T with C the lower-left
        # w x w blocks of L. Stable as the substitution (no Neumann series, whose terms of
        # alternating sign lose ~1e-3 on a badly conditioned chain); IEEE fp32 whatever the model
        # dtype: on [BLOCK_N, BLOCK_N] tiles the exact products cost next to nothing.
        inverse = (local[:, None] == local[None, :]).to(tl.float32)
        for step in tl.static_range(LOG2_BLOCK_N):
            pair = (local[:, None] >> (step + 1)) == (local[None, :] >> (step + 1))
            lower_left = pair & ((local[:, None] >> step) != (local[None, :] >> step))
            merged = tl.dot(inverse, tl.where(lower_left, system, 0.0), input_precision="ieee")
            inverse -= tl.dot(merged, inverse, input_precision="ieee")
        solved = tl.dot(inverse, rhs, input_precision="ieee")
        tl.store(updates_base + rows[:, None] * dv + e[None, :], solved, mask=row_ok[:, None] & e_ok[None, :])
        out += tl.dot(path * tl.dot(q_i, tl.trans(k_i), input_precision=PRECISION), solved, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * (heads * dv) + head * dv + e[None, :], out.to(dtype),
                 mask=row_ok[:, None] & e_ok[None, :])
        tl.debug_barrier()  # the next blocks read these updates back


@triton.jit
def _path_prep_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, paths_ptr,
    keys_ptr, beta_ptr, decay_ptr, rhs_ptr, base_ptr,
    n_rows, conv_row_stride, a_row_stride, b_row_stride,
    key_dim, heads_per_key, dk, dv, q_divisor,
    PATH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # one program per (value head, block of rows, slice of value columns): everything of a row
    # that does not depend on which descendant's path it is on. Its path decay G (the gates summed
    # along its root path, from the path table), its right-hand side beta (v - e^G k S0) and its
    # output's state part e^G q S0: the solve then reads one fp32 row per path place and head
    # instead of v, k S0 and the gates.
    head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    # as a row vector: a scalar in a store mask does not broadcast in Triton's interpreter
    first_slice = (tl.zeros([BLOCK_N], tl.int32) + tl.program_id(2)) == 0
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    e_ok = e < dv
    key_head = head // heads_per_key
    d = tl.arange(0, BLOCK_K)
    d_ok = d < dk
    neg_rate = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    _, beta = _gates(a_ptr, b_ptr, rows, row_ok, a_row_stride, b_row_stride, head, neg_rate, dt_bias,
                     conv_ptr.dtype.element_ty)
    place = tl.arange(0, PATH)
    path = tl.load(paths_ptr + rows[:, None] * PATH + place[None, :], mask=row_ok[:, None], other=-1)
    on_path = path >= 0
    g, _ = _gates(a_ptr, b_ptr, path, on_path, a_row_stride, b_row_stride, head, neg_rate, dt_bias,
                  conv_ptr.dtype.element_ty)
    here = path == rows[:, None]
    decay = tl.sum(tl.where(here, tl.cumsum(tl.where(on_path, g, 0.0), axis=1), 0.0), axis=1)
    # a path longer than the table (a caller's bound too small): NaN, not a quiet wrong answer
    decay += tl.where(tl.sum(here.to(tl.int32), axis=1) > 0, 0.0, float("nan"))
    k = _normed(conv_ptr, rows, row_ok, conv_row_stride, key_dim + key_head * dk, d, d_ok, 1.0)
    q = _normed(conv_ptr, rows, row_ok, conv_row_stride, key_head * dk, d, d_ok, q_divisor)
    # the value-column slices of a head hold the same keys, beta and decays: the first one stores them
    tl.store(keys_ptr + head * n_rows * dk + rows[:, None] * dk + d[None, :], k,
             mask=(row_ok & first_slice)[:, None] & d_ok[None, :])
    tl.store(beta_ptr + head * n_rows + rows, beta, mask=row_ok & first_slice)
    tl.store(decay_ptr + head * n_rows + rows, decay, mask=row_ok & first_slice)
    state = tl.load(state_ptr + head * dk * dv + d[:, None] * dv + e[None, :], mask=d_ok[:, None] & e_ok[None, :],
                    other=0.0)
    ok = row_ok[:, None] & e_ok[None, :]
    v = tl.load(conv_ptr + rows[:, None] * conv_row_stride + 2 * key_dim + head * dv + e[None, :], mask=ok,
                other=0.0).to(tl.float32)
    grow = tl.exp(decay)[:, None]
    here = head * n_rows * dv + rows[:, None] * dv + e[None, :]
    tl.store(rhs_ptr + here, beta[:, None] * (v - grow * tl.dot(k, state, input_precision=PRECISION)), mask=ok)
    tl.store(base_ptr + here, grow * tl.dot(q, state, input_precision=PRECISION), mask=ok)


@triton.jit
def _path_solve_kernel(
    conv_ptr, paths_ptr, keys_ptr, beta_ptr, decay_ptr, rhs_ptr, base_ptr, out_ptr, updates_ptr,
    norm_w_ptr, gate_ptr,
    n_rows, conv_row_stride, key_dim, heads_per_key, dk, dv, q_divisor, gate_row_stride, gate_head_stride, norm_eps,
    PATH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
):
    # one program per (row, GROUP value heads of one key head): the row's path (root .. row) is a
    # closed chain system of at most PATH rows, solved here whole; other programs redo the same
    # ancestors' rows rather than wait for them. The value heads of a key head share the path, its
    # keys, their Gram matrix and q's products with them: found, loaded and multiplied once.
    # NORM (BLOCK_V covers dv): each head's output row is the layer's gated output norm's input, so
    # the norm runs here on it (``_normed_rows``, as the norm kernel computes it) and the normed
    # row is what is stored: no separate norm kernel, no round trip of the output through memory.
    row = tl.program_id(0)
    first_head = tl.program_id(1) * GROUP
    heads = tl.num_programs(1) * GROUP
    key_head = first_head // heads_per_key
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_K)
    d_ok = d < dk
    step = tl.arange(0, PATH)  # place along the path = depth
    path = tl.load(paths_ptr + row * PATH + step)  # the round's path table (``path_table``)
    found = tl.sum((path == row).to(tl.int32), axis=0)  # 0: the path runs past PATH rows
    depth = tl.sum(tl.where(path == row, step, 0), axis=0)
    # a path longer than PATH (a caller's bound too small) cannot be solved here: NaN, not a quiet
    # wrong answer
    lost = tl.where(found > 0, 0.0, float("nan"))
    on_path = (step <= depth) & (path >= 0)  # (a row missing from its own table row reads nothing)
    at_row = step == depth
    # the prepared keys are the key head's, repeated per value head: the first head's serve all
    k = tl.load(keys_ptr + first_head * n_rows * dk + path[:, None] * dk + d[None, :],
                mask=on_path[:, None] & d_ok[None, :], other=0.0)
    gram = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    q = tl.load(conv_ptr + row * conv_row_stride + key_head * dk + d, mask=d_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) / q_divisor
    q_keys = tl.sum(k * q[None, :], axis=1)
    # (I + L) x = rhs on the path, L[s, t] = beta_s e^{G_s - G_t} k_s . k_t for t < s (every
    # earlier row of a path is an ancestor), rhs_t = beta_t (v_t - e^{G_t} k_t S0). The row needs
    # two sums over the path's x: its own update (x at its depth) and its output's
    # sum_t e^{G - G_t} (q . k_t) x_t, i.e. r x for two row vectors r. So solve y (I + L) = r for
    # those two r instead of x: depth steps of back substitution on [2, PATH] vectors, no
    # [PATH, PATH] products (x = (I + L)^-1 rhs, so r x = y rhs). Back substitution is as stable
    # as the forward one it replaces. The GROUP heads' systems ride in one [GROUP, ...] tile, so
    # their substitutions share each of the depth dependent steps (the kernel's critical path).
    member = tl.arange(0, GROUP_TILE)
    heads_here = first_head + member
    head_path = (member < GROUP)[:, None] & on_path[None, :]
    at = heads_here[:, None] * n_rows + path[None, :]
    beta = tl.load(beta_ptr + at, mask=head_path, other=0.0)  # [GROUP_TILE, PATH]
    # path log-decays: G_t of each place's row (the prep's, from the root to that row)
    decay = tl.load(decay_ptr + at, mask=head_path, other=0.0)
    own_decay = tl.sum(tl.where(at_row[None, :], decay, 0.0), axis=1)
    weight = tl.where(on_path[None, :], tl.exp(own_decay[:, None] - decay) * q_keys[None, :], 0.0)
    which = tl.arange(0, 2)[:, None]  # 0: the update, 1: the output
    pick = which[None, :, :]
    solved = tl.where(pick == 0, at_row.to(tl.float32)[None, None, :], weight[:, None, :])  # [GROUP_TILE, 2, PATH]
    for back in range(0, depth):  # the row's depth steps, not PATH: nothing lies past it
        t = depth - 1 - back  # y_t -= sum over s > t of y_s L[s, t] (column t of L, rows below it)
        # column t of each head's L, built here from the shared Gram column and G_t: a [GROUP,
        # PATH, PATH] tile of L held across the loop took the registers that bound how many
        # programs share a multiprocessor (H100, 27B shape, 272 rows: 86.7 -> 65.7 us a layer)
        at_t = step == t
        gram_column = tl.sum(tl.where(at_t[None, :], gram, 0.0), axis=1)
        decay_t = tl.sum(tl.where(at_t[None, :], decay, 0.0), axis=1)
        column = tl.where(((step > t) & on_path)[None, :],
                          beta * tl.exp(decay - decay_t[:, None]) * gram_column[None, :], 0.0)
        solved -= tl.where(at_t[None, None, :], tl.sum(solved * column[:, None, :], axis=2)[:, :, None], 0.0)
    for index in tl.static_range(GROUP):
        head = first_head + index
        mine = tl.sum(tl.where(member[:, None, None] == index, solved, 0.0), axis=0)  # [2, PATH]
        own = tl.sum(tl.where(which == 0, mine, 0.0), axis=0) + lost
        through = tl.sum(tl.where(which == 1, mine, 0.0), axis=0) + lost
        for v0 in range(0, dv, BLOCK_V):
            e = v0 + tl.arange(0, BLOCK_V)
            e_ok = e < dv
            rhs = tl.load(rhs_ptr + head * n_rows * dv + path[:, None] * dv + e[None, :],
                          mask=on_path[:, None] & e_ok[None, :], other=0.0)
            tl.store(updates_ptr + head * n_rows * dv + row * dv + e, tl.sum(own[:, None] * rhs, axis=0), mask=e_ok)
            out = tl.load(base_ptr + head * n_rows * dv + row * dv + e, mask=e_ok, other=0.0)
            out += tl.sum(through[:, None] * rhs, axis=0)
            if NORM:  # the output as the solve would store it (in the dtype), then normed and gated
                # (names of their own: a name bound before the unrolled head loop keeps its shape)
                norm_weight = tl.load(norm_w_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
                gate = tl.load(gate_ptr + row * gate_row_stride + head * gate_head_stride + e, mask=e_ok,
                               other=0.0).to(tl.float32)
                normed = _normed_rows(_rounded(out, dtype)[None, :], norm_weight[None, :], gate[None, :], dv,
                                      norm_eps, dtype, NORM_OFFSET, True)
                tl.store(out_ptr + row * (heads * dv) + head * dv + e[None, :], normed.to(dtype),
                         mask=e_ok[None, :])
            else:
                tl.store(out_ptr + row * (heads * dv) + head * dv + e, out.to(dtype), mask=e_ok)


@triton.jit
def _one_row_kernel(
    conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr, keys_ptr, updates_ptr, decay_ptr,
    key_dim, heads_per_key, dk, dv, q_divisor, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # A one-row "tree" (the AR rounds): the solve is one step of the recurrence, and every product
    # a row-by-matrix sum; no tiles of 16 rows for one.
    head = tl.program_id(0)
    v0 = tl.program_id(1) * BLOCK_V
    key_head = head // heads_per_key
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_K)
    d_ok = d < dk
    e = v0 + tl.arange(0, BLOCK_V)
    e_ok = e < dv
    k = tl.load(conv_ptr + key_dim + key_head * dk + d, mask=d_ok, other=0.0).to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = tl.load(conv_ptr + key_head * dk + d, mask=d_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) / q_divisor
    neg_rate = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    a = tl.load(a_ptr + head).to(tl.float32)
    b = tl.load(b_ptr + head).to(tl.float32)
    g = neg_rate * _softplus(a + tl.load(dt_bias_ptr + head).to(tl.float32))
    beta = _rounded(1.0 / (1.0 + tl.exp(-b)), dtype)
    state = tl.load(state_ptr + head * dk * dv + d[:, None] * dv + e[None, :], mask=d_ok[:, None] & e_ok[None, :],
                    other=0.0)
    v = tl.load(conv_ptr + 2 * key_dim + head * dv + e, mask=e_ok, other=0.0).to(tl.float32)
    grow = tl.exp(g)
    update = beta * (v - grow * tl.sum(k[:, None] * state, axis=0))
    out = grow * tl.sum(q[:, None] * state, axis=0) + tl.sum(q * k, axis=0) * update
    tl.store(out_ptr + head * dv + e, out.to(dtype), mask=e_ok)
    tl.store(updates_ptr + head * dv + e, update, mask=e_ok)
    tl.store(keys_ptr + head * dk + d, k, mask=d_ok)  # every value-column program: the same bits
    tl.store(decay_ptr + head, g)


SHARE_HEADS_FROM = 64  # rows past which a path-solve program takes all value heads of a key head
SOLVE_COLUMNS = 128  # value columns a step of the path solve's sums over its path (bench.gdn_solve_speed sweeps)
# the path solve applies the layer's gated output norm itself where a program solves one head and
# one step of its value columns covers the head's values
NORM_IN_SOLVE = True
PATH_LIMIT = 64  # longest root-to-row path the path solve takes; longer ones go to the blocked solve


def tree_solve(
    conv_out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ancestors: torch.Tensor,
    state: torch.Tensor,
    keys: torch.Tensor,
    updates: torch.Tensor,
    path_decay: torch.Tensor,
    key_heads: int,
    dk: int,
    block_n: int = 16,
    block_v: int = 64,
    warps: int = 8,
    precision: str = "tf32",
    block_c: int = 64,
    max_path: int | None = None,
    method: str = "auto",
    path_warps: int = 1,
    paths: torch.Tensor | None = None,
    share_heads: bool | None = None,
    prep_rows: int = 32,
    prep_warps: int = 4,
    out_norm: tuple[torch.Tensor, float, bool, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet layer's core over N tree rows: conv_out [N, 2 * key_heads * dk + Hv * dv]
    (q | k | v after the conv, model dtype, unit column stride); a, b [N, Hv] (views with a row
    stride); a_log, dt_bias [Hv]; ancestors [N, N] bool (diagonal set); state [Hv, dk, dv] fp32.
    Writes the commit's parts into ``keys`` [Hv, N, dk], ``updates`` [Hv, N, dv] and ``path_decay``
    [Hv, N] (fp32, contiguous) and returns the output [N, Hv * dv] in conv_out's dtype.

    ``max_path``: a bound on the rows of any root-to-row path (a draft tree's: its block size);
    None counts it from ``ancestors`` (a host sync: not inside a CUDA graph). The path solve
    writes NaN for a row whose path is longer than the bound (rounded up to a power of two).

    ``paths``: ``path_table(ancestors, max_path)``, built once for many layers' solves (else the
    path solve builds it). ``share_heads``: one path-solve program takes all value heads of a key
    head (up to 4), which share its keys' products (None: past ``SHARE_HEADS_FROM`` rows, for
    paths of up to 32 places).
    ``prep_rows`` / ``prep_warps``: the path solve's prep tile (rows a program, a power of two
    >= 16) and its warps.
    ``out_norm``: (weight, eps, offset, gate [N, Hv, dv], unit stride within a head) of the layer's
    gated output norm (``kernels.gated_norm_for_solve``): the output comes back normed and gated,
    by the path solve itself where ``NORM_IN_SOLVE``, a program solves one value head and one step
    of its value columns covers dv, else by the norm kernel after the solve.

    ``method``: "path" (every row's path solved whole by its own program: paths up to
    ``PATH_LIMIT`` rows), "blocked" (the rows in order, blocks of ``block_n``: any tree) or "auto"
    (path where it applies).
    ``block_n`` (a power of two: the block's inverse is built by doubling), ``block_v`` value
    columns per program, ``warps`` per program, ``block_c`` earlier rows a step: the blocked
    solve's tile; ``path_warps``: the path solve's warps per program (``bench/gdn_solve_speed.py``
    compares them)."""
    if method not in ("auto", "path", "blocked"):
        raise ValueError(f"unknown solve method {method!r}")
    n_rows = conv_out.shape[0]
    value_heads, _, dv = state.shape
    out = torch.empty(n_rows, value_heads * dv, device=conv_out.device, dtype=conv_out.dtype)
    state = state.contiguous()
    block_k = max(16, triton.next_power_of_2(dk))
    if n_rows == 1:
        launch(
            _one_row_kernel, (value_heads, triton.cdiv(dv, 32)),
            conv_out, a, b, a_log, dt_bias, state, out, keys, updates, path_decay,
            key_heads * dk, value_heads // key_heads, dk, dv, float(dk**0.5), BLOCK_K=block_k, BLOCK_V=32,
            num_warps=4,
        )
        return _out_normed(out, dv, out_norm)
    # fp32 models: IEEE products (the fp32 tests compare with the PyTorch solve); else TF32 tensor
    # cores on the fp32 operands, closer to fp32 than the bf16 inputs themselves
    precision = "ieee" if conv_out.dtype == torch.float32 else precision
    anc = ancestors.contiguous()
    anc_bytes = anc.view(torch.uint8) if anc.dtype == torch.bool else anc
    if method != "blocked":
        if max_path is None:
            max_path = int(anc_bytes.sum(dim=1).max())
        if max_path <= PATH_LIMIT:
            normed = _path_solve(
                conv_out, a, b, a_log, dt_bias, anc_bytes, state, keys, updates, path_decay, out,
                key_heads, dk, max_path=max_path, precision=precision, warps=path_warps,
                paths=paths if paths is not None and paths.shape[1] == path_width(max_path) else None,
                share_heads=share_heads, prep_rows=prep_rows, prep_warps=prep_warps, out_norm=out_norm,
            )
            return out if normed else _out_normed(out, dv, out_norm)
        if method == "path":
            raise ValueError(f"a {max_path}-row path is past the path solve's {PATH_LIMIT}")
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    launch(
        _tree_solve_kernel, (value_heads, triton.cdiv(dv, block_v)),
        conv_out, a, b, a_log, dt_bias, anc_bytes, state,
        out, keys, updates, path_decay,
        n_rows, conv_out.stride(0), a.stride(0), b.stride(0), anc_bytes.stride(0),
        key_heads * dk, value_heads // key_heads, dk, dv, float(dk**0.5),
        BLOCK_N=block_n, LOG2_BLOCK_N=block_n.bit_length() - 1, BLOCK_C=max(block_n, block_c), BLOCK_K=block_k,
        BLOCK_V=block_v, PRECISION=precision, num_warps=warps,
    )
    return _out_normed(out, dv, out_norm)


def _out_normed(out: torch.Tensor, dv: int, out_norm: tuple | None) -> torch.Tensor:
    """The solve's output [N, Hv * dv] through the gated output norm (the norm kernel), if any."""
    if out_norm is None:
        return out
    weight, eps, offset, gate = out_norm
    return triton_kernels.rms_norm(out.view(-1, dv), weight, eps, offset, gate=gate)[0].view(out.shape)


def _path_solve(conv_out, a, b, a_log, dt_bias, anc_bytes, state, keys, updates, path_decay, out,
                key_heads, dk, max_path, precision, warps, paths=None, share_heads=None,
                prep_rows=32, prep_warps=4, out_norm=None) -> bool:
    """The path solve: a first kernel prepares what is each row's own (key, beta, path decay, its
    right-hand side and output state part), a second solves each row's path. Returns whether it
    applied ``out_norm`` (see ``tree_solve``) to ``out`` too."""
    n_rows = conv_out.shape[0]
    value_heads, _, dv = state.shape
    block_k = max(16, triton.next_power_of_2(dk))
    width = path_width(max_path)
    if paths is None:
        paths = path_table(anc_bytes, max_path)
    assert paths.shape == (n_rows, width) and paths.dtype == torch.int32 and paths.is_contiguous()
    fp32 = dict(device=conv_out.device, dtype=torch.float32)
    beta = torch.empty(value_heads, n_rows, **fp32)
    rhs, base = (torch.empty(value_heads, n_rows, dv, **fp32) for _ in range(2))
    prep_v = min(64, max(16, triton.next_power_of_2(dv)))
    launch(
        _path_prep_kernel, (value_heads, triton.cdiv(n_rows, prep_rows), triton.cdiv(dv, prep_v)),
        conv_out, a, b, a_log, dt_bias, state, paths, keys, beta, path_decay, rhs, base,
        n_rows, conv_out.stride(0), a.stride(0), b.stride(0),
        key_heads * dk, value_heads // key_heads, dk, dv, float(dk**0.5),
        PATH=width, BLOCK_N=prep_rows, BLOCK_K=block_k, BLOCK_V=prep_v, PRECISION=precision, num_warps=prep_warps,
    )
    heads_per_key = value_heads // key_heads
    if share_heads is None:
        # on the H200, 27B shape: shared at 272 rows 74.8 us against 83.7, but 17.6 against 15.9 at
        # 32 rows, where one program per head spreads the work over more of the card. Paths past
        # 32 places stay one head a program: set when a program held its heads' [GROUP, PATH,
        # PATH] systems (too many registers for one warp); not measured since it holds none.
        share_heads = n_rows > SHARE_HEADS_FROM and width <= 32
    group = heads_per_key if share_heads and heads_per_key <= 4 else 1
    block_v = min(SOLVE_COLUMNS, max(16, triton.next_power_of_2(dv)))
    # a program of one head norms its row in its own kernel; a program of GROUP heads does not: on
    # an H100 (27B shape, 257 rows, three heads a program on one warp) the verify took 0.3 ms
    # longer with the norms inside than with the norm kernel after, at 17 rows (one head a
    # program) 0.07 ms less
    norm_here = out_norm is not None and NORM_IN_SOLVE and block_v >= dv and group == 1
    weight, eps, offset, gate = out_norm if norm_here else (out, 0.0, False, out[:, None, :])
    launch(
        _path_solve_kernel, (n_rows, value_heads // group),
        conv_out, paths, keys, beta, path_decay, rhs, base, out, updates, weight, gate,
        n_rows, conv_out.stride(0), key_heads * dk, heads_per_key, dk, dv, float(dk**0.5), gate.stride(0),
        gate.stride(1), eps,
        PATH=width, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision, GROUP=group,
        GROUP_TILE=triton.next_power_of_2(group), NORM=norm_here, NORM_OFFSET=offset, num_warps=warps,
    )
    return norm_here


def path_width(max_path: int) -> int:
    """The path solve's places per path for paths of up to ``max_path`` rows (its tile: a power of two)."""
    return max(16, triton.next_power_of_2(max_path))


def path_table(ancestors: torch.Tensor, max_path: int) -> torch.Tensor:
    """[N, path_width(max_path)] int32: each row's root path (its ancestors in order, itself last),
    -1 past it; a longer path keeps its first rows only (the solve then finds no row itself and
    writes NaN). Both path-solve kernels read it; a verify builds it once for all its layers. No
    host sync."""
    n = ancestors.shape[0]
    width = path_width(max_path)
    anc = ancestors.bool()
    place = anc.long().cumsum(dim=1) - 1  # ancestors come first, in path order
    keep = anc & (place < width)
    columns = torch.arange(n, device=anc.device, dtype=torch.int32).expand(n, n)
    table = torch.full((n, width + 1), -1, dtype=torch.int32, device=anc.device)
    # entries not kept all go to the spare last column, then dropped
    table.scatter_(1, torch.where(keep, place, width), torch.where(keep, columns, -1))
    return table[:, :width].contiguous()


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
