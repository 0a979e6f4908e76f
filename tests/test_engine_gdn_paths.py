"""The Gated DeltaNet path solve's options (engine/fast/triton_gdn.py): its row limit and the
blocked solve past it, a caller's path bound, the path table a verify passes, value heads sharing
a key head's products, against the PyTorch solve (``tests.support.gdn_solve``).

Without a GPU the kernels run through Triton's interpreter; on a GPU the compiled kernels.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from ddtree_diag.engine.fast import kernels  # noqa: E402
from ddtree_diag.engine.tree import ancestor_mask  # noqa: E402
from tests.support.gdn_solve import CASES, random_parents, solve_both  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls  # noqa: E402

pytestmark = MARKS


def test_the_path_solve_takes_paths_up_to_its_limit_and_the_blocked_solve_the_rest(solver, monkeypatch):
    module = kernels._triton_gdn()
    took_paths = []
    record_calls(monkeypatch, module, "_path_solve", lambda *_, max_path, **__: took_paths.append(max_path))
    limit = module.PATH_LIMIT
    chain = dict(dk=16, dv=16, value_heads=2, key_heads=1)
    for n, bound in ((limit, None), (limit + 1, None), (24, limit + 1), (24, 8)):
        got, want = solve_both(n, "tree" if n == 24 else "chain", torch.float32, **chain, max_path=bound)
        for mine, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    # counted from the mask when not given (limit rows: path; one more: blocked); a caller's bound
    # decides with no count (past the limit: blocked; 8: path, the tree's rows padded to 16 a path)
    assert took_paths == [limit, 8], took_paths
    with pytest.raises(ValueError, match="past the path solve"):
        solve_both(limit + 1, "chain", torch.float32, **chain, method="path")
    with pytest.raises(ValueError, match="unknown solve method"):
        solve_both(3, "chain", torch.float32, method="fast")


@pytest.mark.parametrize("share_heads", [False, True], ids=("one-head", "shared-heads"))
@pytest.mark.parametrize("with_paths", [False, True], ids=("table-built-inside", "table-given"))
def test_a_path_longer_than_the_callers_bound_comes_out_nan_not_wrong(solver, with_paths, share_heads):
    """A 20-row chain with a bound of 4 (a 16-row path kernel): rows 16-19 cannot be solved there
    and say so; the rows whose paths fit are still right."""
    (out, _, updates, decay), (ref_out, _, ref_updates, ref_decay) = solve_both(
        20, "chain", torch.float32, dk=16, dv=16, value_heads=3, key_heads=1, max_path=4, with_paths=with_paths,
        share_heads=share_heads)
    assert decay[:, 16:].isnan().all() and updates[:, 16:].isnan().all() and out[16:].isnan().all()
    torch.testing.assert_close(decay[:, :16], ref_decay[:, :16], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(updates[:, :16], ref_updates[:, :16], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[:16], ref_out[:16], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("n", "shape"), [case for case in CASES if case[0] <= 64])
def test_the_path_table_holds_each_rows_root_path(solver, n, shape):
    parents = random_parents(n, shape, torch.Generator().manual_seed(n))
    table = kernels._triton_gdn().path_table(ancestor_mask(parents).to(DEVICE), n).cpu()
    assert table.dtype == torch.int32 and table.shape == (n, max(16, 1 << (n - 1).bit_length()))
    for row in range(n):
        path = [row]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        assert table[row].tolist() == path[::-1] + [-1] * (table.shape[1] - len(path)), row


@pytest.mark.parametrize(("n", "shape"), [case for case in CASES if case[0] <= 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_path_solve_with_a_path_table_or_shared_heads_gives_the_same_results(solver, n, shape, dtype):
    """A table given (as a verify passes it) or built by the solve itself, a program taking a key
    head's value heads together (sharing their keys' products) or one, and the prep's row tile:
    the same arithmetic for every head. Under the interpreter the table and the shared heads are bit
    for bit (the same products of the same shapes); another prep tile changes the products' shapes,
    whose sums a CPU's BLAS may order by shape (AVX2 OpenBLAS does), and compiled, the code's layouts
    may differ too: there, float rounding apart (one step of the output's dtype)."""
    small = dict(method="path", max_path=n, value_heads=6, dk=16, dv=16)  # small heads: the interpreter's time
    plain, _ = solve_both(n, shape, dtype, share_heads=False, **small)
    for variant in (dict(with_paths=True), dict(share_heads=True), dict(with_paths=True, share_heads=True),
                    dict(prep_rows=16)):
        got, _ = solve_both(n, shape, dtype, **small, **variant)
        for part, want in zip(got, plain, strict=True):
            if DEVICE == "cpu" and "prep_rows" not in variant:
                assert torch.equal(part, want), variant
            else:
                step = 1e-5 if part.dtype == torch.float32 else 8e-3
                torch.testing.assert_close(part.float(), want.float(), rtol=step, atol=step)


