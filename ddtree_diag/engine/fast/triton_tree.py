"""The DDTree draft tree as one Triton kernel: ``tree.build_tree``'s heap, run as written.

The tensor build (``tree.build_tree_tensors``) reproduces the heap's order with sorts, pointer
doubling and a proof pass: ~300 tiny kernels per round (1.2-2.5 ms on the H200). Here a single
program runs the heap loop itself. The frontier is an array of ``budget`` slots whose entries keep
their push order, so the heap's key (path score desc, push order asc) is one block reduction over
(live, score, order) that carries the winner's fields along (on CUDA; under the interpreter, four
plain ones). A pop's next sibling takes the popped slot and its first child the next free one, so
``budget`` slots hold every push the pops can still reach (a frontier indexed by push order needed
``2 * budget + 1``: four times the slots at budget 256, and four warps to reduce them). That is
exact by construction: no proof pass and no host fallback. One program, a fixed grid and no host
reads, so it is captured in the tree stage's CUDA graph like the rest.

A second kernel (``write_tree_rows``) turns the built nodes into the verify's rows: the root, the
nodes, empty padding rows and the ancestor mask, one program a row.

Imported only where Triton is (``kernels.tree_kernel``); on CPU tensors it runs under Triton's
interpreter (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_diag.engine.fast.ahead import launch, settle_cache_keys

# An entry's parent node, depth and rank packed in one int64 (parent, depth and rank < 2**21):
# one reduction reads all three back for the popped entry instead of three.
FIELD = 1 << 21


@triton.jit
def _first_best(score_a, order_a, base_a, meta_a, live_a, score_b, order_b, base_b, meta_b, live_b):
    """The heap's pick of two entries: a live one over a dead one, then the larger score, then the
    earlier push (a total order on live entries, so the reduction's tree shape does not matter;
    scores are sums of log-softmax values, never NaN)."""
    take_a = (live_a != 0) & ((live_b == 0) | (score_a > score_b) | ((score_a == score_b) & (order_a < order_b)))
    return (tl.where(take_a, score_a, score_b), tl.where(take_a, order_a, order_b), tl.where(take_a, base_a, base_b),
            tl.where(take_a, meta_a, meta_b), tl.where(take_a, live_a, live_b))


@triton.jit
def _build_tree_kernel(
    values_ptr, ids_ptr, limit_ptr,
    tokens_ptr, parents_ptr, depths_ptr, valid_ptr, count_ptr,
    budget, top_k, max_depth,
    FRONTIER: tl.constexpr, FIELD: tl.constexpr, ONE_REDUCTION: tl.constexpr,
):
    """values/ids: [max_depth, top_k] per-depth ranked top-k (fp32 log-probs, int64 token ids).
    Writes ``budget`` nodes (popped order; past the last node: zeros, valid 0) and the count."""
    slot = tl.arange(0, FRONTIER)
    # depths 1..limit may hold nodes (the decoder's depth limit, a device scalar)
    limit = tl.minimum(tl.load(limit_ptr).to(tl.int32), max_depth)
    neg_inf = float("-inf")
    # The frontier, one entry a slot. ``score``: the entry's path score (float64 sums in the
    # heap's order, so bit-identical to it); ``base``: its parent's path score (a sibling's score
    # is base + the next rank's value, as the heap forms it); ``meta``: parent, depth, rank;
    # ``order``: its push index (the heap's tie rule); ``live``: pushed and not yet popped (a
    # score of -inf can be live, so it is not the marker).
    first = tl.load(values_ptr).to(tl.float64)  # depth 1, rank 0: 0.0 + value, as the heap pushes it
    score = tl.where(slot == 0, first + 0.0, neg_inf)
    base = tl.zeros([FRONTIER], dtype=tl.float64)
    meta = tl.where(slot == 0, 1 * FIELD, 0).to(tl.int64)  # parent 0 (the root), depth 1, rank 0
    live = ((slot == 0) & (limit >= 1)).to(tl.int32)
    order = slot * 0  # the first entry is push 0; a dead slot's order is never looked at
    pushes = limit * 0 + 1  # entries pushed so far (an int32 tensor, as the loop carries it)
    tail = limit * 0 + 1  # the next free slot
    count = limit * 0
    for i in range(0, budget):
        # pop: the largest score among live entries, ties to the entry pushed first
        if ONE_REDUCTION:  # one reduction carries the winner's fields along: one cross-warp round trip
            best, pick, parent_score, packed, found = tl.reduce((score, order, base, meta, live), 0, _first_best)
            found = found != 0  # False once the frontier is empty (a tree smaller than budget)
            hit = (live != 0) & (order == pick)  # push indices are unique: one live slot, or none
        else:  # four plain ones (Triton's interpreter runs a custom reduction ~10x slower)
            best = tl.max(tl.where(live != 0, score, neg_inf), axis=0)
            pick = tl.min(tl.where((live != 0) & (score == best), order, 2**30), axis=0)
            found = pick < 2**30
            hit = (live != 0) & (order == pick)
            parent_score = tl.sum(tl.where(hit, base, 0.0), axis=0)
            packed = tl.sum(tl.where(hit, meta, 0), axis=0)
        rank = (packed % FIELD).to(tl.int32)
        depth = ((packed // FIELD) % FIELD).to(tl.int32)
        parent = (packed // FIELD) // FIELD  # (FIELD * FIELD would be a constant past int32)
        live = tl.where(hit, 0, live)
        node = count.to(tl.int64) + 1  # pops so far + 1 (the root is node 0); = i + 1 while found
        token = tl.load(ids_ptr + (depth - 1) * top_k + rank, mask=found, other=0)
        tl.store(tokens_ptr + i, tl.where(found, token, 0))
        tl.store(parents_ptr + i, tl.where(found, parent, 0))
        tl.store(depths_ptr + i, tl.where(found, depth, 0).to(tl.int64))
        tl.store(valid_ptr + i, found.to(tl.int8))
        count += found.to(tl.int32)
        # push the next sibling (same parent, rank + 1) into the popped slot, then the first child
        # (rank 0, one deeper) into the next free one: the heap's push order. The last pop pushes
        # nothing (no pop would read it), which keeps ``budget`` slots enough.
        more = found & (i + 1 < budget)
        sibling = more & (rank + 1 < top_k)
        value = tl.load(values_ptr + (depth - 1) * top_k + rank + 1, mask=sibling, other=0.0).to(tl.float64)
        at = sibling & hit
        score = tl.where(at, parent_score + value, score)
        base = tl.where(at, parent_score, base)
        meta = tl.where(at, packed + 1, meta)  # same parent and depth, rank + 1
        order = tl.where(at, pushes, order)
        live = tl.where(at, 1, live)
        pushes += sibling.to(tl.int32)
        child = more & (depth < limit)
        value = tl.load(values_ptr + depth * top_k, mask=child, other=0.0).to(tl.float64)
        at = child & (slot == tail)
        score = tl.where(at, best + value, score)
        base = tl.where(at, best, base)
        meta = tl.where(at, (node * FIELD + depth + 1) * FIELD, meta)
        order = tl.where(at, pushes, order)
        live = tl.where(at, 1, live)
        pushes += child.to(tl.int32)
        tail += child.to(tl.int32)
    tl.store(count_ptr, count.to(tl.int64))


def default_warps(frontier: int) -> int:
    """Warps for a frontier of ``frontier`` entries: each pop is a block reduction, and with one
    warp it is register shuffles only (no shared memory or barriers), which wins while each lane
    holds few entries. On the H100 (``bench.tree_kernel_speed``, ms per build): budget 64 (64
    slots) 1 / 2 / 4 / 8 warps 0.030 / 0.037 / 0.038 / 0.044; budget 256 (256 slots) 0.186 / 0.166 /
    0.164 / 0.187, where the frontier indexed by push order (1024 slots) took 0.212 on 4."""
    return 4 if frontier >= 256 else 1


def build_tree(
    values: torch.Tensor, ids: torch.Tensor, budget: int, depth_limit: torch.Tensor, num_warps: int | None = None,
    one_reduction: bool | None = None,
) -> dict:
    """``tree.build_tree`` from the per-depth ranked top-k (``values`` [D, top_k] float32,
    ``ids`` [D, top_k] int64; top_k = min(budget, vocab)) and a device-scalar depth limit.
    Returns what ``build_tree_tensors`` returns: ``tokens``, ``parents``, ``depths``, ``valid``
    ([budget] each), ``count`` and ``exact`` (always True). ``one_reduction``: each pop as one
    reduction carrying the winner's fields (default on CUDA) or four plain ones (default under the
    interpreter, where a custom reduction is slow); the same tree either way."""
    device = values.device
    max_depth, top_k = values.shape
    assert budget < FIELD and max_depth < FIELD
    tokens = torch.empty(budget, dtype=torch.long, device=device)
    parents = torch.empty(budget, dtype=torch.long, device=device)
    depths = torch.empty(budget, dtype=torch.long, device=device)
    valid = torch.empty(budget, dtype=torch.bool, device=device)
    count = torch.empty((), dtype=torch.long, device=device)
    if budget > 0 and max_depth > 0:
        # slots: the first entry's, then one a child pushed by the first budget - 1 pops
        frontier = max(16, triton.next_power_of_2(budget))
        launch(
            _build_tree_kernel, (1,),
            values.float().contiguous(), ids.contiguous(), depth_limit.reshape(1),
            tokens, parents, depths, valid.view(torch.int8), count,
            budget, top_k, max_depth,
            FRONTIER=frontier, FIELD=FIELD, ONE_REDUCTION=values.is_cuda if one_reduction is None else one_reduction,
            num_warps=num_warps or default_warps(frontier),
        )
    else:
        tokens.zero_(), parents.zero_(), depths.zero_(), valid.zero_(), count.zero_()
    return {
        "tokens": tokens,
        "parents": parents,
        "depths": depths,
        "valid": valid,
        "count": count,
        "exact": torch.ones((), dtype=torch.bool, device=device),
    }


@triton.jit
def _tree_rows_kernel(
    root_ptr, tokens_ptr, parents_ptr, depths_ptr, valid_ptr,
    out_tokens_ptr, out_parents_ptr, out_depths_ptr, out_valid_ptr, anc_ptr,
    nodes, rows,
    BLOCK: tl.constexpr, DEPTH: tl.constexpr,
):
    """Row ``r`` of a verify's tree buffers: r = 0 the root, r = 1..nodes draft node r - 1 where
    it is valid (else, and past the nodes, an empty row: token 0, no parent, depth 0, not valid),
    and its ancestor-or-self row of ``anc``, walked up the nodes' parents (at most DEPTH steps)."""
    r = tl.program_id(0)
    node = r - 1
    inside = (node >= 0) & (node < nodes)
    valid = tl.load(valid_ptr + node, mask=inside, other=0) != 0
    token = tl.where(valid, tl.load(tokens_ptr + node, mask=inside, other=0), 0)
    parent = tl.where(valid, tl.load(parents_ptr + node, mask=inside, other=-1), -1)
    depth = tl.where(valid, tl.load(depths_ptr + node, mask=inside, other=0), 0)
    is_root = r == 0
    tl.store(out_tokens_ptr + r, tl.where(is_root, tl.load(root_ptr), token))
    tl.store(out_parents_ptr + r, tl.where(is_root, -1, parent))
    tl.store(out_depths_ptr + r, tl.where(is_root, 0, depth))
    tl.store(out_valid_ptr + r, (is_root | valid).to(tl.int8))
    lanes = tl.arange(0, BLOCK)
    seen = lanes == r
    up = tl.where(is_root, -1, parent).to(tl.int64)
    for _ in range(DEPTH):  # a row's parent is an earlier row; -1 (none) matches no lane
        seen = seen | (lanes == up)
        above = up - 1  # the node of row ``up``; the root's (row 0) is -1: no parent
        known = (above >= 0) & (above < nodes)
        above_valid = tl.load(valid_ptr + above, mask=known, other=0) != 0
        up = tl.where(known & above_valid, tl.load(parents_ptr + above, mask=known, other=-1), -1)
    tl.store(anc_ptr + r.to(tl.int64) * rows + lanes, seen.to(tl.int8), mask=lanes < rows)


def write_tree_rows(
    tree: dict[str, torch.Tensor], root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
    depths: torch.Tensor, valid: torch.Tensor, depth: int,
) -> None:
    """Fill a verify's tree buffers (``tree``: ``tokens``, ``parents``, ``depths`` [rows] int64,
    ``valid`` [rows] bool, ``anc`` [rows, rows] bool) from the root token (a 1-element tensor) and
    the draft nodes (``tokens``, ``parents``, ``depths`` int64 and ``valid`` bool, [nodes], nodes <
    rows; a node's parent is a row: 0 the root, i + 1 node i) in one launch: what
    ``fast_tree.write_tree_rows`` writes in some 35 small torch kernels (``anc`` over at most
    ``depth`` levels)."""
    rows, nodes = tree["tokens"].shape[0], tokens.shape[0]
    if nodes >= rows:
        raise ValueError(f"{nodes} draft nodes do not fit {rows} rows with the root")
    anc = tree["anc"]
    if not anc.is_contiguous() or anc.shape != (rows, rows):
        raise ValueError(f"anc {tuple(anc.shape)} is not a contiguous [{rows}, {rows}] buffer")
    launch(
        _tree_rows_kernel, (rows,),
        root, tokens.contiguous(), parents.contiguous(), depths.contiguous(), valid.contiguous().view(torch.int8),
        tree["tokens"], tree["parents"], tree["depths"], tree["valid"].view(torch.int8), anc.view(torch.int8),
        nodes, rows,
        BLOCK=max(16, triton.next_power_of_2(rows)), DEPTH=max(depth, 0), num_warps=1,
    )


settle_cache_keys(globals())  # each kernel's key as every process computes it (see there)
