"""The verify round's accept walk as one Triton kernel (engine/fast/triton_accept.py) against a
plain walk on lists, and in whole decodes against the PyTorch form (``FastDecoder._accept_walk``).

Without a GPU the kernel runs through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``)
on CPU tensors; on a GPU the same checks run the compiled kernel on CUDA tensors.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import PROMPTS  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls, turn_kernels_on  # noqa: E402

pytestmark = MARKS


@pytest.fixture
def walk(monkeypatch):
    turn_kernels_on(monkeypatch, "DDTREE_DIAG_ACCEPT_KERNEL")
    module = kernels.accept_kernel(torch.zeros(1, dtype=torch.long, device=DEVICE))
    assert module is not None, "triton is installed but the accept kernel module did not import"
    return module


def random_round(rows: int, nodes: int, block: int, rng: random.Random) -> dict:
    """A draft tree as the tree stage leaves it (``nodes`` real rows, each parent earlier, depth <
    ``block``, siblings with distinct tokens; padding rows after them: parent -1, not valid) and a
    target choice per row that follows some of its branches, so paths of any length get accepted."""
    parents, depths, tokens = [-1], [0], [rng.randrange(50)]
    children: dict[int, set[int]] = {0: set()}
    for i in range(1, nodes):
        parent = rng.choice([j for j in range(i) if depths[j] < block - 1])
        token = rng.choice([t for t in range(50) if t not in children[parent]])
        children[parent].add(token)
        children[i] = set()
        parents.append(parent)
        depths.append(depths[parent] + 1)
        tokens.append(token)
    choice = []
    for i in range(nodes):  # the target picks one of the row's children's tokens, or another token
        kids = sorted(children[i])
        choice.append(rng.choice(kids) if kids and rng.random() < 0.8 else 50 + rng.randrange(50))
    padding = rows - nodes
    return {
        "tokens": tokens + [0] * padding,
        "parents": parents + [-1] * padding,
        "depths": depths + [0] * padding,
        "valid": [True] * nodes + [False] * padding,
        # padding rows' choices are junk too: a padding row is never accepted whatever it holds
        "choice": choice + [rng.randrange(100) for _ in range(padding)],
    }


def reference(tree: dict, block: int, exact: bool, start: int, root: int, ctx_len: int, pending: int) -> dict:
    """The walk on lists: from the root, follow the child whose token is its parent's choice."""
    path, at = [0], 0
    while True:
        nxt = [i for i in range(len(tree["tokens"])) if tree["parents"][i] == at and tree["valid"][i]
               and tree["tokens"][i] == tree["choice"][at]]
        if not nxt:
            break
        (at,) = nxt
        path.append(at)
    count = len(path)
    keep = path + [0] * (block - count)
    bonus = tree["choice"][path[-1]]
    moved = keep if exact else list(range(block))
    return {
        "keep": keep, "count": [count],
        "slots": [start + k for k in moved] + [start + d for d in range(block)],
        "result": [int(exact), count, bonus, *keep, *(tree["tokens"][k] for k in keep)],
        "start": start + count if exact else start, "root": [bonus if exact else root],
        "ctx_len": ctx_len + pending if exact else ctx_len, "pending_count": count if exact else pending,
    }


def run_walk(walk, tree: dict, block: int, exact: bool, with_context: bool) -> dict:
    long = dict(dtype=torch.long, device=DEVICE)
    state = {
        "start": torch.tensor(37, **long), "root": torch.tensor([5], **long),
        "ctx_len": torch.tensor(30, **long), "pending_count": torch.tensor(3, **long),
        "keep": torch.full((block,), -7, **long), "count": torch.zeros(1, **long),
        "slots": torch.zeros(2 * block, **long), "result": torch.zeros(3 + 2 * block, **long),
    }
    walk.accept(
        *(torch.tensor(tree[name], **long) for name in ("tokens", "choice", "parents")),
        torch.tensor(tree["valid"], device=DEVICE), torch.tensor(tree["depths"], **long),
        torch.tensor(exact, device=DEVICE), state["start"], state["root"],
        state["ctx_len"] if with_context else None, state["pending_count"] if with_context else None,
        state["keep"], state["count"], state["slots"], state["result"],
    )
    return {name: value.tolist() for name, value in state.items()}


# rows, tree nodes, block: AR, chain-like, a shallow block, budgets 64, 256 and 1024
SHAPES = [(1, 1, 16), (17, 17, 16), (24, 17, 4), (65, 60, 16), (257, 230, 16), (1025, 1000, 16)]


@pytest.mark.parametrize(("rows", "nodes", "block"), SHAPES)
def test_the_walk_finds_the_accepted_path_and_moves_the_counters(walk, rows, nodes, block):
    rng = random.Random(rows * 31 + block)
    for trial in range(6):
        tree = random_round(rows, nodes, block, rng)
        exact, with_context = trial % 3 != 2, trial % 2 == 0
        got = run_walk(walk, tree, block, exact, with_context)
        want = reference(tree, block, exact, 37, 5, 30, 3)
        for name in ("keep", "count", "slots", "result", "start", "root"):
            assert got[name] == want[name], (name, trial)
        if with_context:
            assert (got["ctx_len"], got["pending_count"]) == (want["ctx_len"], want["pending_count"]), trial
        else:  # untouched where no draft queues context
            assert (got["ctx_len"], got["pending_count"]) == (30, 3), trial


def test_long_paths_are_found(walk):
    """A chain as deep as the block allows, every row accepted: count = block."""
    block = 8
    tree = {"tokens": list(range(10, 10 + block)), "parents": list(range(-1, block - 1)), "depths": list(range(block)),
            "valid": [True] * block, "choice": [*range(11, 10 + block), 99]}
    got = run_walk(walk, tree, block, True, True)
    assert got["count"] == [block] and got["keep"] == list(range(block)) and got["root"] == [99]


def test_decodes_walk_through_the_kernel_with_the_pytorch_walk_s_tokens(walk, tmp_path, monkeypatch):
    """Whole greedy fp32 decodes (tree, chain and AR rounds; a draft queuing context): the
    kernel's walk leaves the same tokens and acceptance as the PyTorch walk. Only this kernel runs."""
    calls = []
    record_calls(monkeypatch, walk, "accept", lambda tokens, *_: calls.append(tokens.shape[0]))
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "auto")  # the others stay off on CPU tensors
    engine = load_engine(fx.make_target(tmp_path / "target"), fx.make_draft(tmp_path / "d4", block_size=4),
                         device=DEVICE, dtype="fp32")
    engine.use_path("fast-nograph")
    runs = {}
    for use_kernel in (False, True):
        monkeypatch.setattr(kernels, "accept_kernel", lambda tokens, on=use_kernel: walk if on else None)
        runs[use_kernel] = [
            engine.generate_ids(prompt_ids=PROMPTS[0], mode=mode, tree_budget=6, max_tokens=12, stop_token_ids=[])
            for mode in ("tree", "chain", "ar")
        ]
    for plain, fused in zip(runs[False], runs[True], strict=True):
        assert fused.token_ids == plain.token_ids and fused.acceptance_lengths == plain.acceptance_lengths
    assert {7, 4, 1} <= set(calls), calls  # tree rows (budget + 1), a chain's block, the AR / last rounds' row
