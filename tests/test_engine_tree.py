"""Best-first DDTree build, ancestor mask, positions and the accept walk on hand-made inputs."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from ddtree_diag.engine.tree import (  # noqa: E402
    accept_walk,
    ancestor_mask,
    build_tree,
    chain_tree,
    ranked_top_k,
    tree_positions,
)

pytestmark = pytest.mark.engine

ROOT = 7


def hand_logprobs() -> torch.Tensor:
    # depth 1: tok2 -0.5, tok0 -1.0, tok1 -2.0, tok3 -3.0; depth 2: tok1 -0.2, tok3 -0.7, tok0 -3, tok2 -4
    return torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-3.0, -0.2, -4.0, -0.7]])


def test_best_first_order_parents_depths_with_score_tie():
    tree = build_tree(ROOT, hand_logprobs(), budget=4)
    # pops: tok2@d1 (-0.5), tok1 under it (-0.7), tok0@d1 (-1.0), then a tie at -1.2 between
    # tok3 under node 1 (pushed first) and tok1 under node 3: the earlier push wins.
    assert tree.tokens == [ROOT, 2, 1, 0, 3]
    assert tree.parents == [-1, 0, 1, 0, 1]
    assert tree.depths == [0, 1, 2, 1, 2]
    assert tree.children == [{2: 1, 0: 3}, {1: 2, 3: 4}, {}, {}, {}]
    bigger = build_tree(ROOT, hand_logprobs(), budget=5)
    assert bigger.tokens == [ROOT, 2, 1, 0, 3, 1] and bigger.parents[-1] == 3 and bigger.depths[-1] == 2


def test_equal_logprobs_rank_lower_token_first():
    logprobs = torch.tensor([[-1.0, -0.3, -2.0, -0.3]])
    tree = build_tree(ROOT, logprobs, budget=3)
    assert tree.tokens == [ROOT, 1, 3, 0]
    assert tree.parents == [-1, 0, 0, 0]


def _sorted_head(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ordered, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[:, :k], order[:, :k]


@pytest.mark.parametrize("case", ["random", "ties", "boundary_ties", "infinities", "nan", "constant"])
def test_ranked_top_k_is_the_head_of_a_stable_descending_sort(case):
    gen = torch.Generator().manual_seed(11)
    values = torch.log_softmax(torch.randn(6, 300, generator=gen) * 3, dim=-1)
    if case == "ties":  # a few distinct values: every boundary falls inside a run of ties
        values = torch.round(values)
    elif case == "boundary_ties":  # rows whose k-th value is tied with many past the k
        values = torch.full((6, 300), -9.0)
        values[:, ::7] = -1.0
        values[:, 5] = -0.5
    elif case == "infinities":
        values[0] = float("-inf")
        values[1, 10:200] = float("-inf")
        values[2, [3, 90, 250]] = float("inf")
        values[3, 40] = -0.0  # ties 0.0, as in sort
        values[3, 41] = 0.0
    elif case == "nan":
        values[1, 17] = float("nan")
        values[4, [0, 299]] = float("nan")
    elif case == "constant":
        values = torch.zeros(6, 300)
    for k in (1, 2, 5, 16, 43, 299, 300):
        got_values, got_ids = ranked_top_k(values, k)
        want_values, want_ids = _sorted_head(values, k)
        assert torch.equal(got_ids, want_ids), (case, k)
        assert torch.equal(got_values.isnan(), want_values.isnan())
        assert torch.equal(got_values.nan_to_num(), want_values.nan_to_num())


def test_budget_zero_and_budget_larger_than_tree():
    assert build_tree(ROOT, hand_logprobs(), budget=0).tokens == [ROOT]
    full = build_tree(ROOT, hand_logprobs(), budget=100)
    assert full.size == 4 + 16  # every depth-1 token and every depth-2 pair
    assert max(full.depths) == 2


def test_tree_is_the_top_budget_paths_by_score():
    gen = torch.Generator().manual_seed(3)
    logprobs = torch.log_softmax(torch.randn(3, 5, generator=gen) * 2, dim=-1)
    budget = 17
    tree = build_tree(ROOT, logprobs, budget=budget)
    paths = []
    for depth in range(1, 4):
        for seq in itertools.product(range(5), repeat=depth):
            paths.append((sum(logprobs[d, t].item() for d, t in enumerate(seq)), seq))
    best = {seq for _, seq in sorted(paths, reverse=True)[:budget]}

    def path_of(node: int) -> tuple[int, ...]:
        out = []
        while node > 0:
            out.append(tree.tokens[node])
            node = tree.parents[node]
        return tuple(reversed(out))

    assert {path_of(n) for n in range(1, tree.size + 1)} == best
    assert all(tree.parents[n] < n for n in range(1, tree.size + 1))  # parent before child


def test_ancestor_mask_and_positions():
    tree = build_tree(ROOT, hand_logprobs(), budget=5)  # parents [-1, 0, 1, 0, 1, 3]
    mask = ancestor_mask(tree.parents)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert tree_positions(tree.depths, start=10).tolist() == [10, 11, 12, 11, 12, 12]


def test_accept_walk_follows_target_choice():
    tree = build_tree(ROOT, hand_logprobs(), budget=5)  # tokens [R, 2, 1, 0, 3, 1]
    # target picks 0 after root (node 3), then 1 (node 5), then 9 (no child): bonus 9
    choice = [0, 5, 5, 1, 5, 9]
    assert accept_walk(tree, choice) == ([3, 5], 9)
    assert accept_walk(tree, [3, 0, 0, 0, 0, 0]) == ([], 3)  # nothing accepted, bonus only
    chain = chain_tree(ROOT, [4, 5, 6])
    assert chain.parents == [-1, 0, 1, 2] and chain.depths == [0, 1, 2, 3]
    assert accept_walk(chain, [4, 5, 6, 8]) == ([1, 2, 3], 8)
    assert accept_walk(chain, [4, 1, 6, 8]) == ([1], 1)
