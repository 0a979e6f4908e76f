"""``tree.ranked_top_k`` in a few Triton launches (imported only where Triton is).

The PyTorch path builds int64 keys over the whole [rows, vocab] block and runs ``torch.topk``:
about eight small kernels, ~0.19 ms per round at the 8B shape (15 rows x 151936, k = 16) on the
H200. Here the same keys are formed in registers and reduced, for k up to ``SELECT_MAX_K`` by k
rounds of a max reduction (take the largest, drop it), past it by Triton's bitonic ``tl.topk``:

- a chunk pass, grid (row, chunk of ``BLOCK`` entries): each program keeps its chunk's k largest
  keys (the first pass forms the keys from the fp32 values; later passes read keys);
- a final pass, grid (row,): the k largest of the row's remaining candidates, decoded to ids, and
  the values gathered from the input (so -0.0 comes back as -0.0, as ``gather`` returns it).

The key is the one ``tree.ranked_top_k`` sorts: the float's bits as an order-preserving signed int
(-0.0 first made 0.0, so the two tie) in the high 32 bits, ``vocab - 1 - index`` in the low ones.
Keys are unique, so the k largest in descending order are exactly the first k of a stable
descending sort, whatever the sorting network does with equal keys. A chunk keeps min(k, its
entries) real keys, so at least k real keys reach the final pass; the padding keys (int64 min) sort
below every real one (no NaN among the values).

The grid and the scratch sizes depend only on (rows, vocab, k), and nothing is read back on the
host, so it is captured in a CUDA graph like the rest of the tree stage.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys

# Entries per program in the first pass, and the most candidates one program takes in the later
# ones (both rounded up to 2 * next_pow2(k), so every chunk pass at least halves the candidates).
# On the H200 (``bench/tree_kernel_speed.py``, 15 x 151936) chunks of 2048 were the fastest of
# 2048 / 4096 / 8192 at k = 16 and 64 (0.044 / 0.090 ms against torch's 0.187 / 0.196): k = 16 is 75
# chunks, then one final pass over 1200 candidates (two launches). Merging at most 2048 (not 4096)
# gives k = 64 one more small pass (4800 candidates: 3 programs a row, then 192) and was faster
# there (0.079 against 0.091 ms); it also spares the 4096-entry sorting network, whose compile
# took 5.6 s of a cold first request (2048 entries: 2.4-3.6 s). Those were sorting-network
# figures; selecting at k = 16, chunks of 2048 were again the fastest (0.036 ms against 0.039-0.043
# for 1024 / 4096 / 8192).
CHUNK = 2048
MERGE = 2048
# Up to this k the passes select by k max reductions instead of sorting. On the H200 at 15 x 151936
# (``bench/tree_kernel_speed.py``): k = 16 selects in 0.036 ms against the network's 0.044, and
# compiles in 0.0-0.3 s against 4.4 s, which was what a cold budget-16 first request waited on
# (27B: 5.1 -> 2.9 s); at k = 64 selecting is slower to run (0.141 against 0.079 ms a round), so
# that budget keeps the network (6.1 s to compile, once per cold cache).
SELECT_MAX_K = 16


@triton.jit
def _ranked_keys(x, offs, vocab):
    """The sort keys of fp32 values ``x`` at entries ``offs`` of a row of ``vocab`` (the module
    docstring's key)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 ties 0.0 (an fadd of 0.0 may be folded)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # float order as ints
    return (ordered << 32) | (vocab - 1 - offs).to(tl.int64)


@triton.jit
def _keys_kernel(values_ptr, keys_ptr, vocab, row_stride, BLOCK: tl.constexpr):
    """Program (row, block): the keys of BLOCK entries of a row of fp32 values, into keys [rows, vocab]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = tl.load(values_ptr + row * row_stride + offs, mask=inside, other=0.0)
    tl.store(keys_ptr + row * vocab + offs, _ranked_keys(x, offs, vocab), mask=inside)


@triton.jit
def _top_k_pass(
    src_ptr, dst_ptr, values_ptr, ids_ptr,
    n, row_stride, vocab, k,
    BLOCK: tl.constexpr, K_POW: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, SELECT: tl.constexpr,
):
    """One program: the k largest keys of entries [chunk * BLOCK, (chunk + 1) * BLOCK) of a row of
    ``n``. FIRST: the row is fp32 values (``row_stride`` apart), else int64 keys (``n`` apart).
    LAST (one chunk per row): writes ids and values [rows, k]; else keys to ``dst`` [rows, chunks * k]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    lowest = tl.full([BLOCK], 1, tl.int64) << 63  # int64 min: below every real key
    if FIRST:
        key = _ranked_keys(tl.load(src_ptr + row * row_stride + offs, mask=inside, other=0.0), offs, vocab)
    else:
        key = tl.load(src_ptr + row * n + offs, mask=inside, other=0)
    key = tl.where(inside, key, lowest)
    lane = tl.arange(0, K_POW)
    if SELECT:
        # k rounds of "take the largest key, then drop it": keys are unique, so this is the sorting
        # network's result exactly, in a loop that compiles in a fraction of its time
        top = tl.full([K_POW], 1, tl.int64) << 63
        for place in range(0, k):
            largest = tl.max(key, axis=0)
            top = tl.where(lane == place, largest, top)
            key = tl.where(key == largest, lowest, key)
    else:
        top = tl.topk(key, K_POW)  # descending
    keep = lane < k
    if LAST:
        # the low 32 bits without a 2**32 - 1 constant (typed uint32 by Triton)
        ids = vocab - 1 - (top - ((top >> 32) << 32))
        tl.store(ids_ptr + row * k + lane, ids, mask=keep)
        value = tl.load(values_ptr + row * row_stride + ids, mask=keep, other=0.0)
        tl.store(dst_ptr + row * k + lane, value, mask=keep)
    else:
        tl.store(dst_ptr + (row * tl.num_programs(1) + chunk) * k + lane, top, mask=keep)


def ranked_top_k(
    values: torch.Tensor, k: int, chunk: int = CHUNK, merge: int = MERGE, num_warps: int = 4, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree.ranked_top_k`` for fp32 ``values`` [rows, vocab] (last dim contiguous), 1 <= k <= vocab:
    (values [rows, k] fp32, ids [rows, k] int64), equal to the PyTorch path's. ``chunk`` / ``merge``:
    entries per program in the first pass / the most candidates one program takes later (powers
    of two). ``method``: "sort" (Triton's bitonic ``tl.topk``), "select" (k rounds of a max
    reduction) or "auto" (select up to ``SELECT_MAX_K``)."""
    if method not in ("auto", "sort", "select"):
        raise ValueError(f"unknown top-k method {method!r}")
    select = k <= SELECT_MAX_K if method == "auto" else method == "select"
    rows, vocab = values.shape
    k_pow = max(2, triton.next_power_of_2(k))  # Triton 3.6's tl.topk fails to compile for k = 1
    src, n, first = values, vocab, True
    # Chunk passes until one program per row can take the rest. Each keeps k of >= 2 * k_pow
    # entries per chunk, so n falls to at most n / 2 + k < n while n > 2 * k_pow.
    while n > max(merge, 2 * k_pow):
        block = max(chunk if first else merge, 2 * k_pow)
        chunks = triton.cdiv(n, block)
        keys = torch.empty(rows, chunks * k, dtype=torch.int64, device=values.device)
        launch(
            _top_k_pass, (rows, chunks),
            src, keys, values, keys, n, values.stride(0), vocab, k,
            BLOCK=block, K_POW=k_pow, FIRST=first, LAST=False, SELECT=select, num_warps=num_warps,
        )
        src, n, first = keys, chunks * k, False
    out_values = torch.empty(rows, k, dtype=values.dtype, device=values.device)
    out_ids = torch.empty(rows, k, dtype=torch.int64, device=values.device)
    block = max(triton.next_power_of_2(n), k_pow)
    launch(
        _top_k_pass, (rows, 1),
        src, out_values, values, out_ids, n, values.stride(0), vocab, k,
        BLOCK=block, K_POW=k_pow, FIRST=first, LAST=True, SELECT=select, num_warps=num_warps,
    )
    return out_values, out_ids


# Entries a program of the keys kernel takes.
KEYS_BLOCK = 1024


def ranked_keys(values: torch.Tensor) -> torch.Tensor:
    """``tree.ranked_keys`` for fp32 ``values`` [rows, vocab] (last dim contiguous) in one launch:
    where k is past the sorting kernels (budget 256), ``torch.topk`` ranks these keys. The torch
    path forms them in ~10 elementwise kernels over [rows, vocab] int64 (~0.15 ms of the 27B's
    budget-256 tree stage on an H100)."""
    rows, vocab = values.shape
    keys = torch.empty(rows, vocab, dtype=torch.int64, device=values.device)
    launch(
        _keys_kernel, (rows, triton.cdiv(vocab, KEYS_BLOCK)),
        values, keys, vocab, values.stride(0), BLOCK=KEYS_BLOCK, num_warps=4,
    )
    return keys


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
