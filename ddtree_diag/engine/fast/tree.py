"""The DDTree draft tree as device tensors: ``tree.build_tree`` with tensor ops only (no host
sync, capturable in a CUDA graph), the ancestor mask from parent indices, and node counts."""

from __future__ import annotations

import torch

from ddtree_diag.engine.fast import kernels

DOUBLING_STEPS = 4  # pointer-doubling passes over tied pusher chains (settles chains of 2**4)
REFINE_STEPS = 1  # passes of the heap's tie rule after them (>= 1: the last one proves the order)


def tree_node_count(budget: int, depth: int, vocab: int) -> int:
    """Draft nodes ``build_tree`` creates: min(budget, all paths of length <= depth over top_k)."""
    if budget <= 0 or depth <= 0:
        return 0
    top_k = min(budget, vocab)
    total = 0
    for d in range(1, depth + 1):
        total += top_k**d
        if total >= budget:
            return budget
    return total


# ---- vectorised tree build --------------------------------------------------------------------


def ranked_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` of a stable descending sort of each row (equal values: lower index first),
    via ``topk`` on unique int64 keys (order-preserving float bits, then the inverted index) —
    a full sort of a 150k vocabulary per depth is what this avoids. Where the kernels run, the
    same keys go through a Triton top-k instead (``triton_topk``: a few launches)."""
    kernel = kernels.topk_kernel(values, k)
    if kernel is not None:
        return kernel.ranked_top_k(values, k)
    keys_kernel = kernels.topk_keys_kernel(values)  # k past the Triton top-k: its keys, in one launch
    keys = keys_kernel.ranked_keys(values) if keys_kernel is not None else ranked_keys(values)
    ids = torch.topk(keys, k, dim=-1, sorted=True).indices
    return values.gather(-1, ids), ids


def ranked_keys(values: torch.Tensor) -> torch.Tensor:
    """Unique int64 sort keys of ``values`` [..., vocab]: the float's order-preserving bits (-0.0
    made 0.0) in the high 32 bits, the inverted index in the low ones, so a descending order of the
    keys is a stable descending sort of the values."""
    bits = (values.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 ties 0.0, as in sort
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as signed ints
    # inverted index (vocab-1-index, not 2**32-1-index: a constant over int32 breaks Triton codegen)
    inverted = values.shape[-1] - 1 - torch.arange(values.shape[-1], device=values.device)
    return ordered * (1 << 32) + inverted


# Up to this many elements, a sort is done by counting comparisons (one [n, n] compare and a sum)
# instead of torch.sort: on CUDA a sort of a few hundred to a few thousand float64/int64 keys is a
# radix sort of 8 passes over 64-bit keys in one block (~28 us on the H200, a dozen of them per
# tree build), while the [n, n] compare is two or three wide kernels of a few us. Same order exactly:
# a position is the count of keys that come before it, ties by index (a stable sort). Measured on
# the H200: at 4096 keys (budget 64's candidates) the compare was far slower (tree 1.8 -> 4.3 ms).
SMALL_SORT = 1024


def _positions(keys: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """Each key's position in a stable sort of ``keys`` (1-D, n <= SMALL_SORT), by counting."""
    index = torch.arange(keys.shape[0], device=keys.device)
    before = (keys[None, :] > keys[:, None]) if descending else (keys[None, :] < keys[:, None])
    tied_before = (keys[None, :] == keys[:, None]) & (index[None, :] < index[:, None])
    return (before | tied_before).sum(dim=1)


def _sort_order(keys: torch.Tensor) -> torch.Tensor:
    """``torch.sort(keys, stable=True).indices`` (ascending), by counting when small."""
    if keys.shape[0] > SMALL_SORT:
        return torch.sort(keys, stable=True).indices
    order = torch.empty_like(keys, dtype=torch.long)
    order[_positions(keys)] = torch.arange(keys.shape[0], device=keys.device)
    return order


def _sort_descending(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted keys, order, each key's position): a stable descending sort and its inverse."""
    n = keys.shape[0]
    if n > SMALL_SORT:
        ordered, order = torch.sort(keys, descending=True, stable=True)
        positions = torch.empty_like(order)
        positions[order] = torch.arange(n, device=keys.device)
        return ordered, order, positions
    positions = _positions(keys, descending=True)
    order = torch.empty_like(positions)
    order[positions] = torch.arange(n, device=keys.device)
    return keys[order], order, positions


def _dense_rank(keys: torch.Tensor) -> torch.Tensor:
    """A rank of each key that orders the keys and ties equal ones, in [0, n): for n <=
    SMALL_SORT the count of smaller keys (by comparisons), else the 0-based rank among the
    distinct keys (by a sort). Callers need only the order, the ties and the bound."""
    if keys.shape[0] <= SMALL_SORT:
        return (keys[None, :] < keys[:, None]).sum(dim=1)
    ordered, order = torch.sort(keys)
    steps = torch.cat([torch.zeros(1, dtype=torch.long, device=keys.device), (ordered[1:] != ordered[:-1]).long()])
    ranks = torch.empty_like(order)
    ranks[order] = torch.cumsum(steps, 0)
    return ranks


def build_tree_tensors(
    depth_logprobs: torch.Tensor, budget: int, depth_limit: torch.Tensor | int,
    refine_steps: int = REFINE_STEPS,
    doubling_steps: int = DOUBLING_STEPS,
) -> dict[str, torch.Tensor]:
    """``tree.build_tree`` with tensor ops only (no host sync), padded to ``budget`` nodes.

    ``depth_logprobs`` [D, V]; only depths 1..``depth_limit`` may hold nodes. Returns (device
    tensors) ``tokens`` ([budget] token ids), ``parents`` ([budget] node index, 0 = root),
    ``depths``, ``valid`` (rows that are real nodes), ``count`` and ``exact`` (False when the
    order below could not be proven; the caller then uses ``build_tree``).

    Why it equals the heap: the heap pops nodes by (path score desc, push order asc). A node
    (ranks r1..rd) is pushed by exactly one node, its *pusher*: its previous sibling (rank-1) or,
    for rank 0, its parent; push order is (pop index of the pusher, sibling before child). So the
    pop order is the unique fixed point of "sort by (-score, 2·rank(pusher) + kind)". Iterating
    that rule settles one more tied pusher per sort, and bf16 logits make long tie chains (10 % of
    random bf16 rounds at budget 64-256 needed more than 4 sorts, and how many depended on the
    last bit of log_softmax, i.e. on the CPU's SIMD width); so the pushers' score chains are first
    ranked by pointer doubling (chains of 2**k in k sorts), then one pass of the rule decides
    chains that meet at one pusher and verifies (it moved none of the selected nodes). The candidates are per-depth
    beams of the ``budget`` best extensions of the previous beam; a node the heap pops cannot
    fall out of a beam unless a beam's first excluded candidate ties or beats the cut score,
    which is checked. Scores are float64 sums in the heap's order, so they are bit-identical.
    """
    device = depth_logprobs.device
    max_depth, vocab = depth_logprobs.shape
    top_k = min(budget, vocab)
    values, ids = ranked_top_k(depth_logprobs.float(), top_k)
    values = values.double()
    limit = torch.as_tensor(depth_limit, device=device)
    inf = torch.full((), float("inf"), dtype=torch.float64, device=device)

    # depth 1: every rank, in rank order; pool index = position in these concatenated arrays
    scores = [values[0]]
    ranks = [torch.arange(top_k, device=device)]
    parents = [torch.full((top_k,), -1, device=device)]
    pushers = [torch.arange(top_k, device=device) - 1]  # rank r pushed by rank r-1; rank 0: origin (-1)
    depths = [torch.ones(top_k, dtype=torch.long, device=device)]
    cut_scores = []  # first excluded candidate of each deeper beam (-inf: nothing excluded)
    offset, beam = 0, values[0]
    for depth in range(2, max_depth + 1):
        width = beam.shape[0]
        candidates = (beam[:, None] + values[depth - 1][None, :]).reshape(-1)  # parent-major
        sorted_scores, order, where_in_beam = _sort_descending(candidates)
        keep = min(budget, candidates.shape[0])
        cut_scores.append(sorted_scores[keep] if keep < candidates.shape[0] else -inf)
        order = order[:keep]
        parent_beam, rank = order // top_k, order % top_k
        new_offset = offset + width
        sibling_at = where_in_beam[(order - 1).clamp(min=0)]
        sibling = torch.where(sibling_at < keep, new_offset + sibling_at, torch.full_like(order, -2))
        scores.append(sorted_scores[:keep])
        ranks.append(rank)
        parents.append(offset + parent_beam)
        pushers.append(torch.where(rank > 0, sibling, offset + parent_beam))
        depths.append(torch.full((keep,), depth, device=device))
        offset, beam = new_offset, sorted_scores[:keep]

    score = torch.cat(scores)
    rank = torch.cat(ranks)
    parent = torch.cat(parents)
    pusher = torch.cat(pushers)  # -1 origin, -2 missing from the pool
    depth_of = torch.cat(depths)
    pool = score.shape[0]
    kind = (rank == 0).long()  # 0: pushed as a sibling, 1: pushed as a child
    invalid = (depth_of > limit).long()
    # Each refinement pass orders nodes by (invalid, -score, secondary, index). The score order
    # never changes, so rank the scores once (equal scores, equal rank) and sort each pass by one
    # int64 key: one sort per pass instead of three stable sorts and their gathers.
    score_rank = _dense_rank(-score)
    width = 2 * pool + 4  # secondary + 1 lies in [0, 2 * pool + 3]
    major = (invalid * pool + score_rank) * width
    node_index = torch.arange(pool, device=device)

    def sorted_by(secondary: torch.Tensor) -> torch.Tensor:
        return _sort_order((major + secondary + 1) * pool + node_index)

    # Ties chain along pushers: two tied nodes are ordered by their pushers, which may tie too
    # (equal bf16 logits at one depth make twin subtrees that tie node for node, as deep as a
    # path's sum of ranks). Pointer doubling settles a chain of 2**k tied pushers in k sorts:
    # after pass k, ``chain_rank`` orders nodes by the scores of X, pusher(X), ... 2**k links up
    # (the origin first, a pusher missing from the pool last).
    chain_rank = invalid * pool + score_rank
    jump = pusher
    for _ in range(doubling_steps):
        ahead = torch.where(jump >= 0, chain_rank[jump.clamp(min=0)], torch.where(jump == -1, -1, 2 * pool))
        chain_rank = _dense_rank(chain_rank * (2 * pool + 2) + ahead + 1)
        jump = torch.where(jump >= 0, jump[jump.clamp(min=0)], jump)
    order = _sort_order(chain_rank * pool + node_index)
    previous = order
    positions = torch.arange(pool, device=device)
    # Then the heap's own rule, (score, pusher's position, sibling before child): it decides
    # chains that meet at one pusher, and its last pass is the proof below.
    for _ in range(refine_steps):
        rank_of = torch.empty_like(order)
        rank_of[order] = positions
        pusher_rank = rank_of[pusher.clamp(min=0)]
        secondary = torch.where(pusher >= 0, 2 * pusher_rank + kind, torch.where(pusher == -1, -1, 2 * pool + 2))
        previous, order = order, sorted_by(secondary)

    n = min(budget, pool)
    count = torch.clamp((1 - invalid).sum(), max=budget)
    selected = order[:n]
    # index_select with a 1-element tensor: indexing with a 0-d tensor goes through __index__,
    # a host sync that CUDA-graph capture refuses (seen on the H200: cudaErrorStreamCaptureUnsupported).
    last = order.index_select(0, (count - 1).clamp(min=0).reshape(1))
    cut = score.index_select(0, last).squeeze(0)
    # One more pass moving none of the first `count` nodes proves them (induction on position:
    # a correct prefix fixes the next node's key, so an unchanged prefix is the heap's).
    exact = ((order[:n] == previous[:n]) | (positions[:n] >= count)).all()
    if cut_scores:
        cuts = torch.stack(cut_scores)  # beam of depth d+2 at index d
        deep_valid = torch.arange(2, max_depth + 1, device=device) <= limit
        exact = exact & ~((cuts >= cut) & deep_valid & (count >= budget)).any()
    node_of = torch.zeros(pool, dtype=torch.long, device=device)
    node_of[selected] = torch.arange(1, n + 1, device=device)
    parent_sel = parent[selected]
    parent_node = torch.where(parent_sel >= 0, node_of[parent_sel.clamp(min=0)], 0)
    valid = torch.arange(n, device=device) < count
    if n < budget:
        pad = budget - n
        zeros = torch.zeros(pad, dtype=torch.long, device=device)
        selected_tokens = torch.cat([ids[depth_of[selected] - 1, rank[selected]], zeros])
        parent_node = torch.cat([parent_node, zeros])
        depth_sel = torch.cat([depth_of[selected], zeros])
        valid = torch.cat([valid, torch.zeros(pad, dtype=torch.bool, device=device)])
    else:
        selected_tokens = ids[depth_of[selected] - 1, rank[selected]]
        depth_sel = depth_of[selected]
    return {
        "tokens": selected_tokens,
        "parents": parent_node,
        "depths": depth_sel,
        "valid": valid,
        "count": count,
        "exact": exact,
    }


def build_tree_kernel(depth_logprobs: torch.Tensor, budget: int, depth_limit: torch.Tensor | int) -> dict:
    """``build_tree_tensors``'s result from the one-program Triton kernel (``triton_tree``): the
    heap itself, so always exact. Callers check ``kernels.tree_kernel(device)`` first."""
    from ddtree_diag.engine.fast import kernels

    device = depth_logprobs.device
    values, ids = ranked_top_k(depth_logprobs.float(), min(budget, depth_logprobs.shape[1]))
    limit = torch.as_tensor(depth_limit, dtype=torch.long, device=device)
    return kernels.tree_kernel(device).build_tree(values, ids, budget, limit)


def write_tree_rows(
    tree: dict[str, torch.Tensor], root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
    depths: torch.Tensor, valid: torch.Tensor, depth: int,
) -> None:
    """A verify's tree buffers (``tree``: ``tokens``, ``parents``, ``depths`` [rows], ``valid``,
    ``anc`` [rows, rows]) from the root token and the draft nodes ([nodes] each, nodes < rows; a
    node's parent is a row: 0 the root, i + 1 node i): row 0 the root, row i + 1 node i where it is
    valid, the rest empty (token 0, no parent, depth 0, not valid; ``anc`` self only). The Triton
    kernel ``triton_tree.write_tree_rows`` writes the same in one launch."""
    pad = tree["tokens"].shape[0] - 1 - tokens.shape[0]
    long = dict(dtype=torch.long, device=tokens.device)
    zero, none = torch.zeros(pad, **long), torch.full((pad,), -1, **long)
    tree["tokens"].copy_(torch.cat([root, torch.where(valid, tokens, 0), zero]))
    tree["parents"].copy_(torch.cat([torch.full((1,), -1, **long), torch.where(valid, parents, -1), none]))
    tree["depths"].copy_(torch.cat([torch.zeros(1, **long), torch.where(valid, depths, 0), zero]))
    tree["valid"].copy_(torch.cat([torch.ones(1, dtype=torch.bool, device=tokens.device), valid, zero.bool()]))
    tree["anc"].copy_(ancestors_from_parents(tree["parents"], depth))


def ancestors_from_parents(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[T, T] bool ancestor-or-self mask from parent indices (-1: none) of a tree at most ``depth``
    deep, with no host sync. Pointer doubling: after step s a row holds its ancestors less than 2**s
    up and ``jump`` its 2**s-th one, so depth 15 takes 4 steps (12 small kernels, not 30)."""
    size = parents.shape[0]
    index = torch.arange(size, device=parents.device)
    jump = torch.where(parents >= 0, parents, index)  # a parentless row stays put: idempotent
    mask = index[:, None] == index[None, :]
    for _ in range(max(depth, 0).bit_length()):  # 2**steps > depth
        mask = mask | mask[jump]
        jump = jump[jump]
    return mask
