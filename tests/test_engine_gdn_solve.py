"""The Gated DeltaNet tree solve kernels (engine/fast/triton_gdn.py: the path solve, every row's
path solved whole, and the blocked solve, the rows in order) against the PyTorch solve they
replace (``gdn.parallel_gated_delta`` with ``gdn.gdn_gates``): rows, tiles, head shapes, badly
conditioned chains, bf16. The path solve's own options are in ``test_engine_gdn_paths``, whole
decodes of hybrid targets in ``test_engine_gdn_decode``.

Without a GPU the kernels run through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``);
on a GPU the same checks run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from ddtree_diag.engine import gdn  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from ddtree_diag.engine.tree import ancestor_mask  # noqa: E402
from tests.support.gdn_solve import CASES, solve_both  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS  # noqa: E402

pytestmark = MARKS


# one row: the one-row kernel whatever the method; a 130-row chain is past the path solve's limit
@pytest.mark.parametrize("n, shape, method", [(*case, m) for case in CASES for m in ("path", "blocked")]
                         + [(1, "tree", "auto"), (130, "chain", "auto")])
def test_solve_equals_the_parallel_solve_in_fp32(solver, n, shape, method):
    (out, keys, updates, decay), (ref_out, ref_keys, ref_updates, ref_decay) = solve_both(n, shape, torch.float32,
                                                                                          method=method)
    # the same fp32 math in another summation order: float rounding apart, never more
    torch.testing.assert_close(keys, ref_keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(decay, ref_decay, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(updates, ref_updates, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_n, block_c, block_v", [(16, 32, 16), (16, 128, 32), (32, 64, 64), (16, 16, 16)])
def test_every_tile_solves_the_same_system(solver, block_n, block_c, block_v):
    got, want = solve_both(150, "tree", torch.float32, seed=4, block_n=block_n, block_c=block_c, block_v=block_v,
                           method="blocked")
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["path", "path-shared", "blocked"])
@pytest.mark.parametrize("key_heads, value_heads, dk, dv",
                         [(1, 3, 24, 40), (2, 2, 16, 64), (4, 8, 32, 16), (1, 4, 16, 16), (1, 5, 16, 16)])
def test_solve_handles_head_ratios_and_dims_that_are_not_tile_sized(solver, key_heads, value_heads, dk, dv, method):
    # path-shared: a key head's value heads in one program (3: a padded tile of 4; 4: a full one;
    # 5: past the limit of 4, one a program)
    tile = dict(method="path", share_heads=True) if method == "path-shared" else dict(method=method)
    got, want = solve_both(19, "tree", torch.float32, key_heads, value_heads, dk, dv, seed=3, **tile)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value_columns", [16, 32])
@pytest.mark.parametrize("share_heads", [False, True])
def test_the_path_solve_in_steps_of_value_columns_solves_the_same_system(solver, monkeypatch, value_columns,
                                                                          share_heads):
    """The path solve's sums over the right-hand sides taken a slice of value columns a step
    (``SOLVE_COLUMNS``, fewer registers) rather than whole: the same results, every slice counted
    once. A dim that is not a whole number of steps leaves a masked last slice."""
    monkeypatch.setattr(kernels._triton_gdn(), "SOLVE_COLUMNS", value_columns)
    got, want = solve_both(23, "tree", torch.float32, 1, 3, 40, 72, seed=5, method="path", share_heads=share_heads)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile", [dict(method="path"), dict(method="blocked", block_n=16),
                                  dict(method="blocked", block_n=32)])
def test_solve_of_a_badly_conditioned_chain_matches_the_solve_in_float64(solver, tile):
    """The worst case of a triangular solve: a chain (every earlier row an ancestor), nearly equal
    keys, beta near 1 and no decay, so the system is close to the all-ones lower triangle and its
    inverse's series sums terms of alternating sign up to C(BLOCK_N-1, BLOCK_N/2) times the result
    (the blocked solve's in-block inverse; the path solve back-substitutes 48 steps at a 64-row
    path). The kernel must stay as close to the float64 solve as the PyTorch fp32 solve does."""
    n, key_heads, value_heads, dk, dv = 48, 1, 2, 16, 16
    generator = torch.Generator().manual_seed(11)
    anc = ancestor_mask(list(range(-1, n - 1))).to(DEVICE)
    direction = torch.randn(dk, generator=generator)
    keys = direction + 0.05 * torch.randn(n, key_heads, dk, generator=generator)
    q = torch.randn(n, key_heads, dk, generator=generator)
    v = torch.randn(n, value_heads, dv, generator=generator)
    conv_out = torch.cat([q.reshape(n, -1), keys.reshape(n, -1), v.reshape(n, -1)], dim=-1).to(DEVICE)
    a = torch.zeros(n, value_heads, device=DEVICE)
    b = torch.full((n, value_heads), 6.0, device=DEVICE)  # beta = sigmoid(6) ~ 0.9975
    a_log = torch.full((value_heads,), -20.0, device=DEVICE)  # g ~ -1e-9: no decay
    dt_bias = torch.zeros(value_heads, device=DEVICE)
    state = (torch.randn(value_heads, dk, dv, generator=generator) * 0.2).to(DEVICE)
    fp32 = dict(device=DEVICE, dtype=torch.float32)
    parts = [torch.empty(value_heads, n, size, **fp32) for size in (dk, dv)]
    decay = torch.empty(value_heads, n, **fp32)
    out = kernels._triton_gdn().tree_solve(conv_out, a, b, a_log, dt_bias, anc, state, *parts, decay, key_heads, dk,
                                           **tile)

    def pytorch(dtype):
        g = -a_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
        x = conv_out.to(dtype)
        qs, ks, vs = x.split([key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
        return gdn.parallel_gated_delta(qs.reshape(n, key_heads, dk), ks.reshape(n, key_heads, dk),
                                        vs.reshape(n, value_heads, dv), g, b.to(dtype).sigmoid(), anc,
                                        state.to(dtype))[0]

    exact, fp32_solve = pytorch(torch.float64), pytorch(torch.float32)
    scale = exact.abs().max()
    kernel_error = float((out.reshape(exact.shape).double() - exact).abs().max() / scale)
    pytorch_error = float((fp32_solve.double() - exact).abs().max() / scale)
    assert kernel_error <= max(8 * pytorch_error, 1e-5), (kernel_error, pytorch_error)


@pytest.mark.parametrize("method", ["path", "blocked"])
def test_solve_in_bf16_is_within_a_rounding_step_of_the_parallel_solve(solver, method):
    (out, _, updates, _), (ref_out, _, ref_updates, _) = solve_both(24, "tree", torch.bfloat16, seed=5,
                                                                    method=method)
    assert out.dtype == torch.bfloat16
    # fp32 inside either way; on a GPU the kernel's products run on TF32 tensor cores (10-bit
    # mantissas, finer than the bf16 inputs)
    torch.testing.assert_close(updates, ref_updates, rtol=1e-2, atol=1e-3)
    step = ref_out.float().abs().clamp(min=2**-8) * 2**-7  # one bf16 step at each value's scale
    assert ((out.float() - ref_out.float()).abs() <= 2 * step).all()



def test_solve_is_used_only_where_the_kernels_run(monkeypatch):
    x = torch.zeros(3, 8, device=DEVICE)
    module = type("Linear", (), {"A_log": 0, "dt_bias": 0, "num_v_heads": 4, "num_k_heads": 2,
                                 "head_k_dim": 16, "head_v_dim": 16})()
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "on")
    monkeypatch.setenv("DDTREE_DIAG_GDN_KERNEL", "off")
    assert kernels.gdn_solver(x, module, x[:, :4], x[:, 4:]) is None
    monkeypatch.delenv("DDTREE_DIAG_GDN_KERNEL")
    assert kernels.gdn_solver(x, module, x[:, :4], x[:, 4:]) is not None
    assert kernels.gdn_solver(x.t(), module, x[:, :4], x[:, 4:]) is None  # columns not contiguous
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "off")
    assert kernels.gdn_solver(x, module, x[:, :4], x[:, 4:]) is None


