"""The one-program Triton tree build (engine/fast/triton_tree.py) == the heap (``tree.build_tree``).

Without a GPU the kernel runs through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``):
the same kernel code, on CPU tensors, node for node against the heap on random rows and on rows
full of exact ties, then inside whole fast decodes (== the eager path, token for token). On a GPU
the same checks run the compiled kernel on CUDA tensors, and the decode runs in CUDA graphs.
The interpreter takes ~1 s per budget-256 build, so those cases are few.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from ddtree_diag.engine.fast import tree as fast_tree  # noqa: E402
from ddtree_diag.engine.tree import build_tree  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import MAX_TOKENS, PROMPTS  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls, turn_kernels_on  # noqa: E402

pytestmark = MARKS


@pytest.fixture
def tree_kernel(monkeypatch):
    """The tree kernel on (CPU tensors too); returns a list that counts its builds."""
    turn_kernels_on(monkeypatch, "DDTREE_DIAG_TREE_KERNEL")
    module = kernels.tree_kernel(torch.device(DEVICE))
    assert module is not None, "triton is installed but the tree kernel module did not import"
    builds = []
    record_calls(monkeypatch, module, "build_tree", lambda *args, **_: builds.append(args[2]))  # the budget
    return builds


def assert_same_tree(logprobs: torch.Tensor, budget: int, depth: int) -> None:
    """The kernel's build of the first ``depth`` rows == build_tree's, node for node."""
    limit = torch.tensor(depth, device=DEVICE)
    built = fast_tree.build_tree_kernel(logprobs.to(DEVICE), budget, limit)
    reference = build_tree(7, logprobs[:depth], budget)
    n = reference.size
    what = (budget, depth)
    assert int(built["count"]) == n == fast_tree.tree_node_count(budget, depth, logprobs.shape[1]), what
    assert bool(built["exact"])
    assert built["valid"].tolist() == [True] * n + [False] * (budget - n), what
    assert built["tokens"][:n].tolist() == reference.tokens[1:], what
    assert built["parents"][:n].tolist() == reference.parents[1:], what
    assert built["depths"][:n].tolist() == reference.depths[1:], what
    # past the tree: zeros (the decoder masks them with ``valid``)
    for name in ("tokens", "parents", "depths"):
        assert built[name].shape == (budget,) and built[name].dtype == torch.long
        assert not built[name][n:].any(), (name, what)


def bf16_logprobs(seed: int, scale: float, vocab: int = 8192) -> torch.Tensor:
    """Log-probs of bf16 logits (the GPU case: many exact ties), the same bits on every CPU
    (the log_softmax in float64, then rounded once)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(15, vocab, generator=gen) * scale).bfloat16().double()
    return torch.log_softmax(logits, -1).float()


def test_kernel_equals_heap_on_random_rows(tree_kernel):
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        depth_rows, vocab = (3, 7, 15)[trial], (5, 40, 300)[trial]
        logprobs = torch.log_softmax(torch.randn(depth_rows, vocab, generator=gen) * (1 + trial), -1)
        for budget in (1, 2, 16, 64):
            for depth in sorted({1, depth_rows // 2 or 1, depth_rows}):
                assert_same_tree(logprobs, budget, depth)


def test_kernel_equals_heap_with_exact_ties(tree_kernel):
    """Quantised logits (equal log-probs within a depth, equal path sums across depths), uniform
    rows (every path of a depth ties), one-hot rows (log-prob 0.0: a child ties its parent),
    twin subtrees (tied node for node down a long chain) and bf16-rounded rows."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(3):
        depth_rows, vocab = (4, 6, 15)[trial], (6, 30, 300)[trial]
        logits = torch.randint(0, 3, (depth_rows, vocab), generator=gen).float()
        if trial == 1:
            logits[::2] = 0.0
            logits[::2, 3] = 200.0
        if trial == 2:
            logits[5:] = 0.0
        logprobs = torch.log_softmax(logits, -1)
        for budget in (1, 2, 16, 64):
            for depth in (1, depth_rows):
                assert_same_tree(logprobs, budget, depth)
    twins = -torch.arange(40.0).repeat(12, 1) * 0.75
    twins[0, 1] = twins[0, 0]
    assert_same_tree(torch.log_softmax(twins, -1), 64, 12)
    for seed, scale in ((0, 1.0), (1, 4.0)):
        logprobs = bf16_logprobs(seed, scale)
        assert logprobs.unique().numel() < logprobs.numel() // 4  # plenty of exact ties
        for budget, depth in ((16, 15), (64, 2)):
            assert_same_tree(logprobs, budget, depth)


def test_kernel_equals_heap_at_budget_256(tree_kernel):
    """The largest budget: a deep bf16 tree, and a tiny vocabulary whose whole tree (155 nodes)
    is smaller than the budget (top_k = 5 < budget)."""
    assert_same_tree(bf16_logprobs(2, 2.0), 256, 15)
    small = torch.log_softmax(torch.randint(0, 2, (15, 5), generator=torch.Generator().manual_seed(3)).float(), -1)
    assert_same_tree(small, 256, 3)


@pytest.mark.parametrize("one_reduction", [False, True], ids=("four-reductions", "one-reduction"))
def test_both_pop_reductions_build_the_heaps_tree(tree_kernel, one_reduction):
    """The pop as one reduction carrying the winner's fields (the CUDA default) or as four plain
    ones (the interpreter's): the heap's tree either way, on exact ties, -inf log-probs (live
    entries scoring -inf) and a frontier that runs dry before the budget."""
    module = kernels.tree_kernel(torch.device(DEVICE))
    ties = torch.log_softmax(torch.randint(0, 3, (6, 30), generator=torch.Generator().manual_seed(5)).float(), -1)
    dead = torch.log_softmax(torch.randn(4, 12, generator=torch.Generator().manual_seed(6)), -1)
    dead[:, 3:] = float("-inf")  # zero-probability tokens: paths through them score -inf
    small = torch.log_softmax(torch.randn(2, 3, generator=torch.Generator().manual_seed(8)), -1)  # 12 nodes in all
    cases = ((ties, 64, 6), (bf16_logprobs(7, 3.0, vocab=256), 16, 15), (dead, 64, 4), (small, 20, 2))
    for logprobs, budget, depth in cases:
        values, ids = fast_tree.ranked_top_k(logprobs.to(DEVICE), min(budget, logprobs.shape[1]))
        built = module.build_tree(values, ids, budget, torch.tensor(depth, device=DEVICE), one_reduction=one_reduction)
        reference = build_tree(7, logprobs[:depth], budget)
        n = reference.size
        assert int(built["count"]) == n, (budget, depth)
        if logprobs is small:
            assert n == 12 < budget  # the frontier ran dry before the budget
        assert built["tokens"][:n].tolist() == reference.tokens[1:]
        assert built["parents"][:n].tolist() == reference.parents[1:]
        assert built["valid"].tolist() == [True] * n + [False] * (budget - n)


def test_every_depth_limit_and_an_empty_tree(tree_kernel):
    logprobs = bf16_logprobs(4, 3.0, vocab=64)
    for depth in range(1, 16):
        assert_same_tree(logprobs, 16, depth)
    built = fast_tree.build_tree_kernel(logprobs.to(DEVICE), 4, torch.tensor(0, device=DEVICE))
    assert int(built["count"]) == 0 and not built["valid"].any() and not built["tokens"].any()


def _scribbled_rows(rows: int) -> dict[str, torch.Tensor]:
    """Tree buffers holding what neither writer leaves anywhere: each must write every element."""
    long = dict(dtype=torch.long, device=DEVICE)
    return {
        "tokens": torch.full((rows,), 77, **long), "parents": torch.full((rows,), 55, **long),
        "depths": torch.full((rows,), 33, **long), "valid": torch.ones(rows, dtype=torch.bool, device=DEVICE),
        "anc": torch.ones(rows, rows, dtype=torch.bool, device=DEVICE),
    }


def test_the_tree_rows_kernel_writes_what_the_torch_ops_write(tree_kernel):
    """The verify's tree buffers from the draft nodes in one launch == the torch ops': heap trees
    (whole, cut by the depth limit, into budget + 1 rows and into more), the decoder's chain cut
    by the depth limit or not, and invalid nodes among valid ones with parent fields that are no
    rows or that name one (a valid node hangs below an invalid one: its ancestors stop there)."""
    module = kernels.tree_kernel(torch.device(DEVICE))
    root = torch.tensor([9], device=DEVICE)
    cases = []
    logprobs = bf16_logprobs(9, 3.0, vocab=64)
    for budget, depth, extra_rows in ((16, 15, 0), (16, 3, 5), (64, 15, 0), (5, 1, 2)):
        built = fast_tree.build_tree_kernel(logprobs.to(DEVICE), budget, torch.tensor(depth, device=DEVICE))
        cases.append(([built[name] for name in ("tokens", "parents", "depths", "valid")], budget + 1 + extra_rows))
    chain_rows = torch.arange(1, 16, device=DEVICE)
    for cut in (6, 15):  # 15: the deepest row's walk takes every one of the 15 steps
        cases.append(([torch.arange(100, 115, device=DEVICE), chain_rows - 1, chain_rows, chain_rows <= cut], 16))
    parents = torch.tensor([0, 1, 1, 0, 4, 99, 5, 3, 3, 8, 5, 9], device=DEVICE)
    depths = torch.tensor([1, 2, 2, 1, 2, 40, 3, 3, 0, 4, 3, 5], device=DEVICE)
    valid = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool, device=DEVICE)
    cases.append(([torch.arange(500, 512, device=DEVICE), parents, depths, valid], 20))
    for nodes, rows in cases:
        want, got = _scribbled_rows(rows), _scribbled_rows(rows)
        fast_tree.write_tree_rows(want, root, *nodes, 15)
        module.write_tree_rows(got, root, *nodes, 15)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, rows)
        valid_rows = got["valid"].nonzero().flatten()
        if nodes[2] is not depths:  # consistent depths: a row sees its depth's count of ancestors, and itself
            assert got["anc"][valid_rows].sum(1).tolist() == (got["depths"][valid_rows] + 1).tolist()
    assert got["anc"][12].nonzero().flatten().tolist() == [9, 12]  # node 11 below invalid node 8
    with pytest.raises(ValueError, match="do not fit"):
        module.write_tree_rows(_scribbled_rows(12), root, *nodes, 15)


def test_tree_kernel_follows_the_kernel_setting(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("DDTREE_DIAG_TREE_KERNEL", raising=False)
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "auto")  # CUDA only
    assert kernels.tree_kernel(cpu) is None and kernels.tree_kernel(cuda) is not None
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "on")
    assert kernels.tree_kernel(cpu) is not None
    monkeypatch.setenv("DDTREE_DIAG_TREE_KERNEL", "off")  # this one alone off
    assert kernels.tree_kernel(cpu) is None and kernels.tree_kernel(cuda) is None
    assert kernels.available()
    monkeypatch.delenv("DDTREE_DIAG_TREE_KERNEL")
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "off")
    assert kernels.tree_kernel(cuda) is None


def test_fast_decode_with_the_tree_kernel_equals_eager(tree_kernel, tmp_path, monkeypatch):
    """Whole decodes, greedy fp32: the fast path building every tree with the kernel gives the
    eager path's tokens, acceptance and tree sizes, and never falls back to the host build. Only
    the tree kernel runs (the other fused kernels are tested in test_engine_kernels)."""
    module = kernels.tree_kernel(torch.device(DEVICE))
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "auto")
    monkeypatch.setattr(kernels, "tree_kernel", lambda device: module)
    target = fx.make_target(tmp_path / "target")
    engine = load_engine(target, fx.make_draft(tmp_path / "d8", block_size=8), device=DEVICE, dtype="fp32")
    budgets = (1, 4, 16) if DEVICE == "cpu" else (1, 2, 4, 16, 64)
    paths = ("fast-nograph",) if DEVICE == "cpu" else ("fast-nograph", "fast")
    for budget in budgets:
        for path in paths:
            previous = engine.decode_path
            try:
                engine.use_path("eager")
                eager = engine.generate_ids(prompt_ids=PROMPTS[1], tree_budget=budget, max_tokens=MAX_TOKENS,
                                            stop_token_ids=[])
                engine.use_path(path)
                quick = engine.generate_ids(prompt_ids=PROMPTS[1], tree_budget=budget, max_tokens=MAX_TOKENS,
                                            stop_token_ids=[])
            finally:
                engine.use_path(previous)
            what = (budget, path)
            assert quick.token_ids == eager.token_ids, what
            assert quick.acceptance_lengths == eager.acceptance_lengths, what
            assert quick.tree_sizes == eager.tree_sizes, what
            assert quick.extras["fast_tree_fallbacks"] == 0, what
            if path == "fast":
                assert quick.extras["cuda_graph_errors"] == [] and quick.extras["cuda_graphs"], what
    assert tree_kernel and set(tree_kernel) >= set(budgets) - {0}
