"""The Triton top-k (engine/fast/triton_topk.py) == ``tree.ranked_top_k``'s torch path, bit for bit.

Without a GPU the kernel runs through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``)
on CPU tensors; on a GPU the same checks run the compiled kernel on CUDA tensors. The interpreter
takes about a second per program for the larger sorts, so the rows are few and small chunk sizes
stand in for the 2048-entry ones (they make the same passes: chunks, merges, a partial last chunk).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ddtree_diag.engine.fast import kernels  # noqa: E402
from ddtree_diag.engine.fast import tree as fast_tree  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls, turn_kernels_on  # noqa: E402

pytestmark = MARKS


@pytest.fixture
def topk(monkeypatch):
    """The top-k kernel's module (CPU tensors too); the torch path is what ``fast_tree.ranked_top_k``
    runs with it switched off."""
    turn_kernels_on(monkeypatch, on=("DDTREE_DIAG_TOPK_KERNEL",))
    module = kernels.topk_kernel(torch.zeros(1, 4, device=DEVICE), 1)
    assert module is not None, "triton is installed but the top-k kernel module did not import"
    return module


def torch_top_k(values: torch.Tensor, k: int, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    with monkeypatch.context() as patch:
        patch.setenv("DDTREE_DIAG_TOPK_KERNEL", "off")
        return fast_tree.ranked_top_k(values, k)


def hard_rows(vocab: int, seed: int) -> torch.Tensor:
    """Four rows: random; a few exact levels with -0.0 and 0.0 among them; half -inf; only -0.0 / 0.0."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(4, vocab, generator=gen)
    rows[1] = (rows[1] * 2).round() / 2
    rows[1, ::7] = -0.0
    rows[1, ::5] = 0.0
    rows[2, : vocab // 2] = float("-inf")
    rows[2, vocab - 3 :] = float("-inf")
    rows[3] = torch.where(rows[3] > 0, -0.0, 0.0)
    return rows.to(DEVICE)


def assert_equal_top_k(module, values, k, monkeypatch, **plan) -> None:
    got_values, got_ids = module.ranked_top_k(values, k, **plan)
    want_values, want_ids = torch_top_k(values, k, monkeypatch)
    what = (tuple(values.shape), k, plan)
    assert torch.equal(got_ids, want_ids), what
    # the bits too: -0.0 comes back where the row holds -0.0
    assert torch.equal(got_values.view(torch.int32), want_values.view(torch.int32)), what


def test_torch_path_is_a_stable_descending_sort(monkeypatch):
    rows = hard_rows(300, 0)
    values, ids = torch.sort(rows, dim=-1, descending=True, stable=True)
    top_values, top_ids = torch_top_k(rows, 40, monkeypatch)
    assert torch.equal(top_ids, ids[:, :40]) and torch.equal(top_values, values[:, :40])


# both ways of taking a chunk's k largest: the bitonic network and k rounds of a max reduction
METHODS = pytest.mark.parametrize("method", ["sort", "select"])


@METHODS
@pytest.mark.parametrize("k", [1, 3, 17])
def test_chunks_then_one_merge(topk, monkeypatch, k, method):
    # 3000 = 5 chunks of 512 and a partial one: one chunk pass, then the final pass
    assert_equal_top_k(topk, hard_rows(3000, k), k, monkeypatch, chunk=512, merge=512, method=method)


@METHODS
def test_several_merge_passes(topk, monkeypatch, method):
    # chunks of 64: 1500 -> 24 x 5 = 120 candidates -> 2 x 5 = 10 -> the final pass
    assert_equal_top_k(topk, hard_rows(1500, 1), 5, monkeypatch, chunk=64, merge=64, method=method)


@METHODS
def test_k_above_the_chunk_and_a_last_chunk_shorter_than_k(topk, monkeypatch, method):
    # k = 100 > chunk 64: blocks of 256; 777 = 3 x 256 + 9, so the last chunk passes on padding
    assert_equal_top_k(topk, hard_rows(777, 2)[:2], 100, monkeypatch, chunk=64, merge=128, method=method)


@METHODS
@pytest.mark.parametrize("vocab", [1, 7, 300])
def test_k_equals_vocab(topk, monkeypatch, vocab, method):
    # all in one program per row (FIRST and LAST): the whole stable sort
    assert_equal_top_k(topk, hard_rows(vocab, 3)[:, :vocab], vocab, monkeypatch, method=method)


def test_an_unknown_method_is_refused(topk):
    with pytest.raises(ValueError, match="unknown top-k method"):
        topk.ranked_top_k(hard_rows(40, 0), 4, method="heap")


def test_default_plan_on_bf16_log_probs(topk, monkeypatch):
    # the engine's case: log-probs of bf16 logits (many exact ties), a row stride past the vocab
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 5000, generator=gen) * 3).bfloat16().double()
    wide = torch.full((2, 5008), 7.0)
    wide[:, :5000] = torch.log_softmax(logits, -1).float()
    values = wide.to(DEVICE)[:, :5000]
    assert values.stride(0) == 5008
    assert_equal_top_k(topk, values, 16, monkeypatch)


def test_ranked_top_k_dispatches_to_the_kernel(topk, monkeypatch):
    calls = []
    record_calls(monkeypatch, topk, "ranked_top_k", lambda values, k, **_: calls.append(k))
    rows = hard_rows(200, 5)
    values, ids = fast_tree.ranked_top_k(rows, 9)
    assert calls == [9]
    want_values, want_ids = torch_top_k(rows, 9, monkeypatch)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
    assert calls == [9]  # the switched-off call went to torch


def test_what_the_dispatch_leaves_to_torch(topk, monkeypatch):
    rows = hard_rows(2000, 6)
    assert kernels.topk_kernel(rows, 16) is topk
    assert kernels.topk_kernel(rows, kernels.TOPK_KERNEL_MAX_K) is topk
    assert kernels.topk_kernel(rows, kernels.TOPK_KERNEL_MAX_K + 1) is None  # large k: torch
    assert kernels.topk_kernel(rows, 0) is None
    assert kernels.topk_kernel(rows[:, :10], 11) is None  # k past the vocab
    assert kernels.topk_kernel(rows.double(), 16) is None
    assert kernels.topk_kernel(rows.t(), 2) is None  # last dim not contiguous
    assert kernels.topk_kernel(rows[0], 2) is None  # not [rows, vocab]
    monkeypatch.setenv("DDTREE_DIAG_TOPK_KERNEL", "off")
    assert kernels.topk_kernel(rows, 16) is None
    monkeypatch.setenv("DDTREE_DIAG_TOPK_KERNEL", "on")
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "off")
    assert kernels.topk_kernel(rows, 16) is None
    if DEVICE == "cpu":
        # on CPU tensors only when asked for by name (the interpreter is slow)
        monkeypatch.setenv("DDTREE_DIAG_KERNELS", "on")
        monkeypatch.delenv("DDTREE_DIAG_TOPK_KERNEL")
        assert kernels.topk_kernel(rows, 16) is None


def test_past_the_kernels_k_the_keys_come_from_one_launch(topk, monkeypatch):
    """Where the ranking is left to ``torch.topk`` (k past TOPK_KERNEL_MAX_K: budget 256), the
    keys kernel forms its keys: the torch path's keys exactly (blocks of the kernel, a last one
    partly past the row, -0.0 and 0.0, exact levels, -inf), hence the same top k, bits and all."""
    rows = hard_rows(2 * topk.KEYS_BLOCK + 37, 9)
    assert torch.equal(topk.ranked_keys(rows), fast_tree.ranked_keys(rows))
    strided = torch.cat([rows, rows], dim=1)[:, 5 : 5 + 300]  # rows a row stride apart, not vocab
    assert torch.equal(topk.ranked_keys(strided), fast_tree.ranked_keys(strided))
    calls = []
    record_calls(monkeypatch, topk, "ranked_keys", lambda values: calls.append(tuple(values.shape)))
    k = kernels.TOPK_KERNEL_MAX_K + 36
    values, ids = fast_tree.ranked_top_k(rows[:, :300], k)
    assert calls == [(4, 300)]
    want_values, want_ids = torch_top_k(rows[:, :300], k, monkeypatch)
    assert calls == [(4, 300)]  # the switched-off call formed its keys in torch
    assert torch.equal(ids, want_ids) and torch.equal(values.view(torch.int32), want_values.view(torch.int32))
    assert kernels.topk_keys_kernel(rows) is topk and kernels.topk_keys_kernel(rows.double()) is None
    monkeypatch.setenv("DDTREE_DIAG_TOPK_KERNEL", "off")
    assert kernels.topk_keys_kernel(rows) is None


def test_off_switch_runs_torch(topk, monkeypatch):
    calls = []
    record_calls(monkeypatch, topk, "ranked_top_k", lambda *args, **_: calls.append(args))
    monkeypatch.setenv("DDTREE_DIAG_TOPK_KERNEL", "off")
    rows = hard_rows(50, 7)
    values, ids = fast_tree.ranked_top_k(rows, 4)
    assert calls == []
    reference = torch.sort(rows, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, reference.indices[:, :4]) and torch.equal(values, reference.values[:, :4])


def test_tree_build_through_the_kernel_equals_the_heap(topk, monkeypatch):
    from ddtree_diag.engine.tree import build_tree

    calls = []
    record_calls(monkeypatch, topk, "ranked_top_k", lambda values, k, **_: calls.append(k))
    logprobs = torch.log_softmax(hard_rows(40, 8)[:3].clamp(min=-30) * 2, -1)
    built = fast_tree.build_tree_kernel(logprobs, 16, 3)
    reference = build_tree(7, logprobs.cpu(), 16)
    assert calls == [16]
    assert built["tokens"].tolist() == reference.tokens[1:]
    assert built["parents"].tolist() == reference.parents[1:]
