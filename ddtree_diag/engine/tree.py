"""DDTree draft tree: best-first build, ancestor mask, positions, accept walk.

Pure functions on small tensors/lists so they can be tested on hand-made log-probabilities.

Tree layout: node 0 is the root (the last committed token, depth 0); nodes 1..n are draft tokens,
numbered in the order they were popped from the heap, so every parent comes before its children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: list[int]  # tokens[0] = root token
    parents: list[int]  # parents[0] = -1
    depths: list[int]  # depths[0] = 0
    children: list[dict[int, int]]  # per node: token -> child node index

    @property
    def size(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.tokens) - 1


def build_tree(root_token: int, depth_logprobs: torch.Tensor, budget: int) -> DraftTree:
    """Grow the tree best-first by path log-probability until ``budget`` draft nodes.

    ``depth_logprobs``: [D, V] log-probabilities of the draft at depths 1..D (DFlash predicts each
    depth independently of the path, so the r-th best token at depth d is the same under every
    parent). A heap entry is (path score, parent, depth, rank); popping a node pushes its next
    sibling (rank+1 under the same parent) and its first child (rank 0 one depth deeper).
    Ties in path score go to the entry pushed first; equal log-probs within a depth rank the lower
    token id first (stable sort).
    """
    tokens, parents, depths = [root_token], [-1], [0]
    children: list[dict[int, int]] = [{}]
    max_depth = depth_logprobs.shape[0]
    if budget <= 0 or max_depth == 0:
        return DraftTree(tokens, parents, depths, children)
    top_k = min(budget, depth_logprobs.shape[1])
    values, ids = ranked_top_k(depth_logprobs.float(), top_k)
    values = values.double().tolist()
    ids = ids.tolist()
    scores = [0.0]
    push_order = 0
    # (-score, push order, parent node, depth, rank)
    heap: list[tuple[float, int, int, int, int]] = [(-values[0][0], 0, 0, 1, 0)]
    while heap and len(tokens) - 1 < budget:
        neg_score, _, parent, depth, rank = heapq.heappop(heap)
        node = len(tokens)
        token = ids[depth - 1][rank]
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        children.append({})
        children[parent][token] = node
        scores.append(-neg_score)
        if rank + 1 < top_k:
            push_order += 1
            sibling = scores[parent] + values[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling, push_order, parent, depth, rank + 1))
        if depth < max_depth:
            push_order += 1
            child = -neg_score + values[depth][0]
            heapq.heappush(heap, (-child, push_order, node, depth + 1, 0))
    return DraftTree(tokens, parents, depths, children)


def ranked_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` (values, indices) of ``torch.sort(values, dim=-1, descending=True,
    stable=True)`` for [D, V] ``values``, without sorting whole rows (a draft's vocabulary: 14 ms
    for 7 x 49152 on a CPU core, against ~0.5 ms here). ``topk`` finds the k largest; where a row's
    k-th value is tied past the k (``topk`` may then keep any of the ties), the ties are taken in
    index order instead; the k are then ordered as the stable sort would. Syncs with the host (the
    eager loop does anyway); ``fast.tree.ranked_top_k`` is the capturable form."""
    rows, vocab = values.shape
    if k >= vocab:
        return _sorted_head(values, k)
    top, ids = torch.topk(values, k, dim=-1, sorted=False)
    if bool(torch.isnan(top).any()):  # topk and sort both put NaN first; the compares below cannot
        return _sorted_head(values, k)
    kth = top.amin(dim=-1, keepdim=True)
    if bool(((values >= kth).sum(dim=-1) != k).any()):
        above, tied = values > kth, values == kth
        needed = k - above.sum(dim=-1, keepdim=True)
        chosen = above | (tied & (tied.cumsum(dim=-1) <= needed))  # the lowest-index ties
        ids = chosen.nonzero()[:, 1].view(rows, k)  # exactly k a row, in index order
    else:
        ids = ids.sort(dim=-1).values  # index order: the stable sort below then breaks ties by index
    top = values.gather(-1, ids)
    top, order = torch.sort(top, dim=-1, descending=True, stable=True)
    return top, ids.gather(-1, order)


def _sorted_head(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ordered, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[:, :k], order[:, :k]


def chain_tree(root_token: int, draft_tokens: list[int]) -> DraftTree:
    """A single path (DFlash chain mode): root -> draft_tokens[0] -> draft_tokens[1] -> ..."""
    n = len(draft_tokens)
    children: list[dict[int, int]] = [{tok: i + 1} for i, tok in enumerate(draft_tokens)] + [{}]
    return DraftTree([root_token, *draft_tokens], list(range(-1, n)), list(range(n + 1)), children)


def ancestor_mask(parents: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """[n, n] bool: node i may attend to node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        p = parents[i]
        if p >= 0:
            mask[i] |= mask[p]  # parents come first, so mask[p] is complete
    return mask.to(device) if device is not None else mask


def tree_positions(depths: list[int], start: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Absolute positions: the root sits at ``start``; a node at depth d at ``start + d``."""
    return torch.tensor(depths, dtype=torch.long, device=device) + start


def accept_walk(tree: DraftTree, target_choice: list[int]) -> tuple[list[int], int]:
    """Follow the target's own choice from the root while it matches a child.

    ``target_choice[i]``: the target's token after node i (argmax at T=0, a sample otherwise).
    Returns (accepted node indices, root excluded, in path order; bonus token).
    """
    node, path = 0, []
    while True:
        token = target_choice[node]
        child = tree.children[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def prune_tree(tree: DraftTree, keep: list[bool]) -> tuple[DraftTree, list[int]]:
    """The tree without the nodes ``keep`` marks False (a dropped node's subtree must be dropped
    too), renumbered in order so parents still come first; also returns the kept old indices."""
    kept = [i for i, k in enumerate(keep) if k]
    new_index = {old: new for new, old in enumerate(kept)}
    tokens = [tree.tokens[i] for i in kept]
    parents = [-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in kept]
    depths = [tree.depths[i] for i in kept]
    children: list[dict[int, int]] = [{} for _ in kept]
    for node in range(1, len(kept)):
        children[parents[node]][tokens[node]] = node
    return DraftTree(tokens, parents, depths, children), kept
