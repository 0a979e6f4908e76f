"""``logits.argmax(dim=-1)`` over a vocabulary as a split reduction (imported only where Triton is).

The greedy choice of a verify round (``FastDecoder._choose``) is one argmax over [rows, vocab]
logits. PyTorch's reduce kernel runs one thread block per row and took several times the read
time on the H200: 97 us at 272 x 248320 bf16, 64 us at 272 x 151936, 15 us at 32 x 151936. Here:

- a chunk pass, grid (row, chunk of ``BLOCK`` entries): each program writes its chunk's largest
  value (fp32) and the first index holding it to scratch [rows, chunks];
- a merge pass, grid (row,): the same reduction over the row's chunks, in chunk order, written as
  int64 (one vocabulary-sized chunk: the chunk pass writes the result itself, one launch).

It equals ``torch.argmax`` exactly: ties go to the first index (-0.0 ties 0.0, as ``>`` compares
them), and NaN is larger than everything (the first NaN's index wins), for fp32, bf16 and fp16
(both widen to fp32 exactly). The grid and scratch depend only on (rows, vocab) and nothing is
read back on the host, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys

# above every index (vocab < 2**31: kernels.argmax_kernel checks); a constexpr, as Triton wants
# module-level constants in kernels
_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _first_max(x, index):
    """(the largest of ``x``, the smallest ``index`` holding it) over a 1-D block, NaN counting as
    the largest. ``x`` is fp32; lanes past the data hold -inf with indices past every real one, so
    they lose every tie."""
    nan = x != x
    first_nan = tl.min(tl.where(nan, index, _NO_INDEX), axis=0)
    clean = tl.where(nan, float("-inf"), x)
    best = tl.max(clean, axis=0)
    first_best = tl.min(tl.where(clean == best, index, _NO_INDEX), axis=0)
    found_nan = first_nan != _NO_INDEX
    # a NaN made from bits: the merge pass must see it as NaN again
    nan_value = tl.full((), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(found_nan, nan_value, best), tl.where(found_nan, first_nan, first_best)


@triton.jit
def _argmax_chunk_kernel(x_ptr, value_ptr, index_ptr, vocab, row_stride, index_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * row_stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    value, index = _first_max(x, offs)
    tl.store(value_ptr + row * tl.num_programs(1) + chunk, value)
    tl.store(index_ptr + row * index_row_stride + chunk, index.to(index_ptr.dtype.element_ty))


@triton.jit
def _argmax_merge_kernel(value_ptr, index_ptr, out_ptr, chunks, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    inside = lane < chunks
    value = tl.load(value_ptr + row * chunks + lane, mask=inside, other=float("-inf"))
    # chunks come in index order, so the smallest index among the chunks that tie is the first
    index = tl.load(index_ptr + row * chunks + lane, mask=inside, other=_NO_INDEX)
    _, best = _first_max(value, index)
    tl.store(out_ptr + row * out_stride, best.to(out_ptr.dtype.element_ty))


def plan(rows: int, vocab: int) -> tuple[int, int]:
    """(entries per chunk program, its warps) for [rows, vocab]. Chunks of 1024 with 2 warps were
    the fastest of nine plans at every verify shape on the H200 (``bench/argmax_speed.py``, bf16,
    us: 1 x 151936 3.5 against torch's 10.7; 32 x 151936 7.1 / 19.4; 272 x 151936 31.8 / 66.6;
    272 x 248320 48.7 / 99.4)."""
    return 1024, 2


def argmax(
    x: torch.Tensor, out: torch.Tensor | None = None, block: int | None = None, num_warps: int | None = None
) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x`` [rows, vocab] (fp32 / bf16 / fp16, last dim contiguous, any
    row stride), into ``out`` [rows] (int64, any stride) when given. ``block`` / ``num_warps``: the
    chunk pass's entries per program (a power of two) and warps; ``plan`` picks them otherwise."""
    rows, vocab = x.shape
    default_block, default_warps = plan(rows, vocab)
    block = min(block or default_block, max(16, triton.next_power_of_2(vocab)))  # no wider than the row
    num_warps = num_warps or default_warps
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    chunks = triton.cdiv(vocab, block)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    if chunks == 1:  # the chunk's first maximum is the row's: written straight to out
        launch(
            _argmax_chunk_kernel, (rows, 1), x, values, out, vocab, x.stride(0), out.stride(0),
            BLOCK=block, num_warps=num_warps,
        )
        return out
    indices = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    launch(
        _argmax_chunk_kernel, (rows, chunks), x, values, indices, vocab, x.stride(0), chunks,
        BLOCK=block, num_warps=num_warps,
    )
    merge = max(2, triton.next_power_of_2(chunks))
    launch(
        _argmax_merge_kernel, (rows,), values, indices, out, chunks, out.stride(0),
        BLOCK=merge, num_warps=1 if merge <= 256 else 4,
    )
    return out


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
