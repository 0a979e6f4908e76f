"""Hand-fused Triton kernels for the fast path's elementwise work (imported only where Triton is).

Each kernel replaces a chain of small PyTorch kernels that a decode round otherwise launches per
layer: RMSNorm (with the residual add before it, or the SiLU gate after it in a Gated DeltaNet
layer), per-head q/k RMSNorm + rotary (or rotary alone), and SiLU(gate) * up. They round where
the HF modules round (to the tensor's dtype after each op the module does in that dtype, see
``_rounded``), so in bf16 they differ from the modules only where the variance sum's order or a
fast exp moves a value across a rounding boundary, and in fp32 by float rounding. ``kernels.py``
decides when they run; the modules themselves are the reference the tests compare these to (on
CPU through Triton's interpreter, on CUDA compiled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys, stride


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (kept in fp32), as torch rounds after each op in that dtype.
    Triton's compiler folds a ``.to(bf16).to(fp32)`` pair away (measured on the H200: 23 % of bf16
    products then differed from torch's), so bf16 rounds with integer ops: to nearest, ties to
    even (a NaN stays NaN: the GPU's 0x7FFFFFFF would carry into the sign bit). Triton's
    interpreter truncates in casts; this rounds there as well. Only fp32 and bf16 come here
    (``kernels`` leaves fp16 to the modules: its casts would fold the same way)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x


# Each program takes a tile of about TILE elements: one row of a wide hidden state, or several
# narrow rows (a small model), so tiny shapes are not thousands of programs (the q/k heads have
# their own plan: ``rope_plan``).
TILE = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, gate_ptr,
    rows, x_row_stride, delta_row_stride, sum_row_stride, gate_row_stride, gate_heads, gate_head_stride, cols, eps,
    OFFSET: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    # int64: row * stride passes 2**31 on long prompts (the prefill runs through here too)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    inside = (row < rows) & (offs < cols)
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_DELTA:
        # the residual add happens in the input dtype, as `hidden + delta` would
        delta = tl.load(delta_ptr + row * delta_row_stride + offs, mask=inside, other=0.0).to(tl.float32)
        x = _rounded(x + delta, sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_row_stride + offs, x.to(sum_ptr.dtype.element_ty), mask=inside)
    w = tl.load(w_ptr + offs, mask=offs < cols, other=0.0).to(tl.float32)
    gate = x
    if HAS_GATE:
        # the gate's rows may be heads of wider rows (row = token * gate_heads + head): a Gated
        # DeltaNet's z is a column slice of its input projection's output, read in place
        at = (row // gate_heads) * gate_row_stride + (row % gate_heads) * gate_head_stride
        gate = tl.load(gate_ptr + at + offs, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = _normed_rows(x, w, gate, cols, eps, dtype, OFFSET, HAS_GATE)
    tl.store(out_ptr + row * cols + offs, y.to(dtype), mask=inside)


@triton.jit
def _normed_rows(x, w, gate, cols, eps, dtype: tl.constexpr, OFFSET: tl.constexpr, HAS_GATE: tl.constexpr):
    """RMSNorm of each row of the fp32 tile ``x`` [rows, BLOCK] (columns past ``cols`` hold 0),
    scaled by the weight ``w`` [1, BLOCK] and, with HAS_GATE, times silu(``gate``) (x's shape); the
    result in fp32, rounded to ``dtype``. Shared with the Gated DeltaNet path solve, which norms its
    output rows in its own kernel."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / cols + eps)[:, None]
    if OFFSET:  # noqa: SIM108 -- Qwen3.5 / Qwen3-Next: (x * (1 + w)) in fp32, then cast
        y = normed * (1.0 + w)
    else:  # Llama / Qwen3: cast first, then scale by the weight
        y = _rounded(normed, dtype) * w
    if HAS_GATE:  # Gated DeltaNet output norm: (weight * norm(x)) in the dtype, times silu(gate) in fp32
        y = _rounded(y, dtype) * (gate / (1.0 + tl.exp(-gate)))
    return _rounded(y, dtype)


@triton.jit
def _norm_rope_heads(
    base, w_ptr, cos_ptr, sin_ptr, row, offs, inside, cos_row_stride, head_dim, rotary, eps,
    dtype: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr,
):
    """Per-head RMSNorm (NORM) then rotary for a tile of heads, each at ``base`` (a column of
    pointers, one per (row, head) pair) + ``offs``; returns the result in fp32, rounded to
    ``dtype``. Shared by both kernels below, so their outputs are bit-identical."""
    x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)[:, None]
    # rotate_half pairs dim i with i ± rotary/2 (dims past `rotary` do not turn): read the partner
    # dims again instead of shuffling registers
    half = rotary // 2
    partner = tl.where(offs < half, offs + half, tl.where(offs < rotary, offs - half, offs))
    xp = tl.load(base + partner, mask=inside, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + offs, mask=offs < head_dim, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=offs < head_dim, other=0.0).to(tl.float32)
        if OFFSET:
            y = _rounded(x * inv_rms * (1.0 + w), dtype)
            yp = _rounded(xp * inv_rms * (1.0 + wp), dtype)
        else:
            y = _rounded(_rounded(x * inv_rms, dtype) * w, dtype)
            yp = _rounded(_rounded(xp * inv_rms, dtype) * wp, dtype)
    else:  # x and xp hold values of the dtype already
        y, yp = x, xp
    turns = inside & (offs < rotary)
    cos = tl.load(cos_ptr + row * cos_row_stride + offs, mask=turns, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * cos_row_stride + offs, mask=turns, other=0.0).to(tl.float32)
    rotated = tl.where(offs < half, -yp, yp)
    # x*cos + rotate_half(x)*sin, each product rounded to the dtype first as in apply_rope
    out = _rounded(_rounded(y * cos, dtype) + _rounded(rotated * sin, dtype), dtype)
    return tl.where(offs < rotary, out, y)


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    pairs, heads, x_row_stride, x_head_stride, cos_row_stride, head_dim, rotary, eps,
    NORM: tl.constexpr, OFFSET: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr,
):
    # a tile of PAIRS (row, head) pairs, each head normed on its own (NORM; else rotary alone)
    pair = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)[:, None]
    row, head = pair // heads, pair % heads
    offs = tl.arange(0, BLOCK)[None, :]
    inside = (pair < pairs) & (offs < head_dim)
    dtype = out_ptr.dtype.element_ty
    out = _norm_rope_heads(
        x_ptr + row * x_row_stride + head * x_head_stride, w_ptr, cos_ptr, sin_ptr, row, offs, inside,
        cos_row_stride, head_dim, rotary, eps, dtype, NORM, OFFSET,
    )
    tl.store(out_ptr + pair * head_dim + offs, out.to(dtype), mask=inside)


@triton.jit
def _norm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, start_ptr,
    rows, heads, kv_heads, q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride,
    cache_head_stride, cache_slot_stride, cos_row_stride, head_dim, rotary, q_eps, k_eps,
    NORM: tl.constexpr, OFFSET: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr,
):
    # axis 1 picks the work: 0 = q's (row, head) pairs into q_out; 1 = k's pairs normed and turned
    # into the key cache, with v's same pairs copied raw into the value cache. Both at slot
    # start + row, start read here so a captured graph serves every round.
    pair = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    dtype = q_out_ptr.dtype.element_ty
    if tl.program_id(1) == 0:
        row, head = pair // heads, pair % heads
        inside = (pair < rows * heads) & (offs < head_dim)
        out = _norm_rope_heads(
            q_ptr + row * q_row_stride + head * q_head_stride, qw_ptr, cos_ptr, sin_ptr, row, offs, inside,
            cos_row_stride, head_dim, rotary, q_eps, dtype, NORM, OFFSET,
        )
        tl.store(q_out_ptr + pair * head_dim + offs, out.to(dtype), mask=inside)
    else:
        row, head = pair // kv_heads, pair % kv_heads
        inside = (pair < rows * kv_heads) & (offs < head_dim)
        out = _norm_rope_heads(
            k_ptr + row * k_row_stride + head * k_head_stride, kw_ptr, cos_ptr, sin_ptr, row, offs, inside,
            cos_row_stride, head_dim, rotary, k_eps, dtype, NORM, OFFSET,
        )
        slot = tl.load(start_ptr).to(tl.int64) + row
        at = head * cache_head_stride + slot * cache_slot_stride + offs
        tl.store(k_cache_ptr + at, out.to(dtype), mask=inside)
        v = tl.load(v_ptr + row * v_row_stride + head * v_head_stride + offs, mask=inside, other=0.0)
        tl.store(v_cache_ptr + at, v, mask=inside)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, total, width, in_row_stride, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # over [rows, width]; int64
    inside = index < total
    source = gate_up_ptr + (index // width) * in_row_stride + index % width
    gate = tl.load(source, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(source + width, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    activated = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)  # silu rounds, then the product
    tl.store(out_ptr + index, _rounded(activated * up, dtype).to(dtype), mask=inside)


def _warps(elements: int) -> int:
    return 1 if elements <= 256 else 4 if elements <= 2048 else 8


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool, delta: torch.Tensor | None = None,
    gate: torch.Tensor | None = None, rows_per_program: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x`` (+ ``delta`` first, when given; times silu(``gate``) after,
    when given). Returns (normed, the sum that was normed: ``x`` itself without a delta). ``gate``:
    x's shape, or [tokens, heads, cols] with any token and head strides (x's rows are then the
    tokens' heads in order; read in place, where a reshape to x's shape would copy).

    ``rows_per_program`` (a power of two) / ``num_warps`` override the launch plan (default:
    ``norm_plan``)."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    x2 = x.reshape(rows, cols)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if delta is None:
        total, d2, s2 = x, x2, x2
    else:
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        d2, s2 = delta.reshape(rows, cols), total.view(rows, cols)
    if gate is not None and gate.dim() == 3:
        if gate.shape[0] * gate.shape[1] != rows or gate.shape[2] != cols:
            raise ValueError(f"a gate of shape {tuple(gate.shape)} does not match {rows} rows of {cols}")
        g2, gate_heads = gate, gate.shape[1]
        gate_row_stride, gate_head_stride = stride(gate, 0), stride(gate, 1)
    else:
        g2 = x2 if gate is None else gate.reshape(rows, cols)
        gate_row_stride, gate_heads, gate_head_stride = stride(g2, 0), 1, 0
    block = triton.next_power_of_2(cols)
    tile_rows = rows_per_program or norm_plan(cols)[0]
    launch(
        _rms_norm_kernel, (triton.cdiv(rows, tile_rows),),
        x2, d2, weight, out, s2, g2, rows, stride(x2, 0), stride(d2, 0), stride(s2, 0), gate_row_stride, gate_heads,
        gate_head_stride, cols, eps,
        OFFSET=offset, HAS_DELTA=delta is not None, HAS_GATE=gate is not None, ROWS=tile_rows, BLOCK=block,
        num_warps=num_warps or _warps(block * tile_rows),
    )
    return out, total


def norm_plan(cols: int) -> tuple[int, int]:
    """``rms_norm``'s launch plan for rows of ``cols``: (rows per program, warps). Rows filling a
    ``TILE``, or a tile of 1024 for rows up to 256 wide (a Gated DeltaNet output norm's 128-wide
    heads: 8 rows on 4 warps took 4.9 us at 13056 x 128 on the H200 against 6.4 for 32 rows on 8);
    wide rows are one a program on 8 warps, within 0.2 us of the best plan swept at 32-272 rows of
    4096-5120 (``bench/norm_kernel_speed.py``)."""
    block = triton.next_power_of_2(cols)
    rows = max(1, (1024 if block <= 256 else TILE) // block)
    return rows, _warps(block * rows)


def rope_plan(head_dim: int, rows: int) -> tuple[int, int]:
    """The q/k norm + rotary kernels' launch plan for ``rows`` tokens' heads of ``head_dim``:
    ((row, head) pairs per program, warps). One head a program on one warp for a single row (a
    decode step's 32-64 heads), else tiles of 512 elements on 2 warps. On the H100, us per call
    (``bench/rope_kernel_speed.py``; the old plan, a 4096-element tile on 8 warps -> this): 8B (32 /
    8 heads of 128) at 1 / 17 / 257 rows 3.27 -> 1.57, 4.18 -> 2.77, 9.24 -> 8.77; Qwen3.6-27B (24 /
    4 heads of 256) at 17 / 257 rows 4.01 -> 3.14, 10.78 -> 10.38."""
    block = triton.next_power_of_2(head_dim)
    if rows <= 1:
        return 1, _warps(block)
    pairs = max(1, 512 // block)
    return pairs, max(1, pairs * block // 256)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: bool, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Per-head RMSNorm (none when ``weight`` is None) then rotary for ``x`` [1, rows, heads,
    head_dim] (any row/head strides, unit stride within a head); cos/sin hold [rows, rotary]
    values. Returns a contiguous tensor."""
    _, rows, heads, head_dim = x.shape
    rotary = cos.shape[-1]
    cos2, sin2 = cos.reshape(rows, rotary), sin.reshape(rows, rotary)
    out = torch.empty((1, rows, heads, head_dim), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(head_dim)
    tile_pairs, warps = rope_plan(head_dim, rows)
    launch(
        _norm_rope_kernel, (triton.cdiv(rows * heads, tile_pairs),),
        x, x if weight is None else weight, cos2, sin2, out, rows * heads, heads, stride(x, 1), stride(x, 2),
        stride(cos2, 0), head_dim, rotary, eps, NORM=weight is not None, OFFSET=offset, PAIRS=tile_pairs, BLOCK=block,
        num_warps=warps,
    )
    return out


def norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: bool,
    q_norm: tuple[torch.Tensor, float] | None,
    k_norm: tuple[torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    start: torch.Tensor,
    plan: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``norm_rope`` of q and of k, in one launch that also stores k (normed, turned) and v (as
    is) into ``cache_k`` / ``cache_v`` [1, kv_heads, capacity, head_dim] at slots start + row
    (``start`` a 0-d int64 device tensor). q [1, rows, heads, head_dim], k and v [1, rows, kv_heads,
    head_dim]: any row/head strides, unit stride within a head. ``q_norm`` / ``k_norm``: (weight,
    eps) of the per-head norms, both None for rotary alone. ``plan``: (pairs per program, warps)
    instead of ``rope_plan``'s (the bench's sweep). Returns q's result, contiguous
    [1, rows, heads, head_dim]."""
    _, rows, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    rotary = cos.shape[-1]
    cos2, sin2 = cos.reshape(rows, rotary), sin.reshape(rows, rotary)
    q_out = torch.empty((1, rows, heads, head_dim), dtype=q.dtype, device=q.device)
    (q_weight, q_eps), (k_weight, k_eps) = q_norm or (q, 0.0), k_norm or (k, 0.0)
    block = triton.next_power_of_2(head_dim)
    tile_pairs, warps = plan or rope_plan(head_dim, rows)
    launch(
        _norm_rope_cache_kernel, (triton.cdiv(rows * max(heads, kv_heads), tile_pairs), 2),
        q, k, v, q_weight, k_weight, cos2, sin2, q_out, cache_k, cache_v, start,
        rows, heads, kv_heads, stride(q, 1), stride(q, 2), stride(k, 1), stride(k, 2), stride(v, 1), stride(v, 2),
        stride(cache_k, 1), cache_k.stride(2), stride(cos2, 0), head_dim, rotary, q_eps, k_eps,
        NORM=q_norm is not None, OFFSET=offset, PAIRS=tile_pairs, BLOCK=block, num_warps=warps,
    )
    return q_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for ``gate_up`` [..., 2 * width] holding gate | up."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * width)
    flat = gate_up.reshape(rows, 2 * width)
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    launch(
        _silu_mul_kernel, (triton.cdiv(rows * width, block),),
        flat, out, rows * width, width, stride(flat, 0), BLOCK=block, num_warps=4
    )
    return out


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
