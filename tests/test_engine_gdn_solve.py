"""The Gated DeltaNet tree solve kernels (engine/fast/triton_gdn.py: the path solve, every row's
path solved whole, and the blocked solve, the rows in order) against the PyTorch solve they
replace (``gdn.parallel_gated_delta`` with ``gdn.gdn_gates``), then, with the conv and commit
kernels (triton_gdn_state), inside whole fast decodes of hybrid targets (== the PyTorch layers,
token for token).

Without a GPU the kernels run through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``);
on a GPU the same checks run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from ddtree_diag.engine import gdn, load_engine  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from ddtree_diag.engine.tree import ancestor_mask  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import PROMPTS  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls, turn_kernels_on  # noqa: E402

pytestmark = MARKS
TOKENS = 10  # per decode: every norm runs under the interpreter too, ~1 s a token on CPU


@pytest.fixture
def solver(monkeypatch):
    """The solve kernel on (CPU tensors too); returns a list of the (row count, max_path) it was
    called with."""
    turn_kernels_on(monkeypatch, "DDTREE_DIAG_GDN_KERNEL")
    module = kernels._triton_gdn()
    assert module is not None, "triton is installed but the solve kernel did not import"
    solved = []
    record_calls(monkeypatch, module, "tree_solve",
                 lambda conv_out, *_, **kw: solved.append((conv_out.shape[0], kw.get("max_path"))))
    return solved


def random_parents(n: int, shape: str, generator: torch.Generator) -> list[int]:
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "padded":  # a small tree, then padding rows that only see themselves (parent -1)
        used = max(1, n // 2)
        return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, used)] + [-1] * (n - used)
    return [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, n)]


def solve_both(n, shape, dtype, key_heads=2, value_heads=4, dk=32, dv=32, seed=0, with_paths=False, **tile):
    """(kernel's out, keys, updates, path decay), (the same from the PyTorch solve). ``with_paths``:
    the kernel gets the rows' path table (``path_table``) as a verify passes it."""
    generator = torch.Generator().manual_seed(seed)
    parents = random_parents(n, shape, generator)
    anc = ancestor_mask(parents).to(DEVICE)
    width = 2 * key_heads * dk + value_heads * dv

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(DEVICE)

    conv_out = rand(n, width).to(dtype)
    gates = rand(n, 2 * value_heads + 5, scale=2.0).to(dtype)  # a and b as strided column slices
    a, b = gates[:, :value_heads], gates[:, value_heads + 3 : 2 * value_heads + 3]
    a_log, dt_bias = rand(value_heads, scale=0.5), rand(value_heads).to(dtype)
    state = rand(value_heads, dk, dv, scale=0.2)
    q, k, v = conv_out.split([key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    reference, parts = gdn.parallel_gated_delta(
        q.reshape(n, key_heads, dk), k.reshape(n, key_heads, dk), v.reshape(n, value_heads, dv), g, b.sigmoid(),
        anc, state,
    )
    fp32 = dict(device=DEVICE, dtype=torch.float32)
    keys, updates = torch.full((value_heads, n, dk), 7.0, **fp32), torch.full((value_heads, n, dv), 7.0, **fp32)
    decay = torch.full((value_heads, n), 7.0, **fp32)
    module = kernels._triton_gdn()
    if with_paths:
        tile["paths"] = module.path_table(anc, tile["max_path"])
    out = module.tree_solve(conv_out, a, b, a_log, dt_bias, anc, state, keys, updates, decay, key_heads, dk, **tile)
    return (out.reshape(n, value_heads, dv), keys, updates, decay), (
        reference, parts.keys, parts.updates, parts.path_decay,
    )


CASES = [(5, "chain"), (17, "tree"), (40, "bushy"), (33, "padded"), (16, "chain"), (150, "tree")]


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


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_fast_decode_with_the_gdn_kernels_equals_the_pytorch_layers(solver, monkeypatch, tmp_path, kind):
    """The solve, the tree rows' conv and the commit kernels together in whole decodes."""
    state_module = kernels._triton_gdn_state()
    assert state_module is not None
    state_calls = []
    for name in ("conv_rows", "commit_states"):
        record_calls(monkeypatch, state_module, name, lambda *a, _n=name, **_: state_calls.append((_n, a[0].dim())))
    # only the Gated DeltaNet kernels under the interpreter: the others have their own decode tests
    monkeypatch.setenv("DDTREE_DIAG_TREE_KERNEL", "off")
    monkeypatch.setenv("DDTREE_DIAG_ATTENTION_KERNEL", "off")
    target = fx.make_hybrid_target(tmp_path / "target", kind=kind, pattern="LLAL")
    draft = fx.make_draft(tmp_path / "draft", block_size=4, layer_ids=(0, 2), layers=1)
    engine = load_engine(target, draft, device=DEVICE, dtype="fp32")
    engine.use_path("fast")
    prompt = PROMPTS[0]
    stages = engine.decoder("fast").stages  # captured graphs keep the solve they were captured with
    monkeypatch.setenv("DDTREE_DIAG_GDN_KERNEL", "off")
    plain = {b: engine.generate_ids(prompt, tree_budget=b, max_tokens=TOKENS, stop_token_ids=[]) for b in (0, 8)}
    assert solver == [] and state_calls == []  # the off switch keeps the PyTorch layers
    assert plain[0].token_ids == plain[8].token_ids  # lossless without the kernel (a sanity check)
    monkeypatch.delenv("DDTREE_DIAG_GDN_KERNEL")
    stages.clear()
    for budget in (0, 8):
        quick = engine.generate_ids(prompt, tree_budget=budget, max_tokens=TOKENS, stop_token_ids=[])
        assert quick.token_ids == plain[budget].token_ids, budget
        assert quick.acceptance_lengths == plain[budget].acceptance_lengths, budget
    rows = [n for n, _ in solver]
    assert 1 in rows and max(rows) > 1, solver  # AR rows and tree rows both went through it
    # the decoder bounds the paths (no host sync to count them inside a CUDA graph)
    assert all(max_path == 4 for n, max_path in solver if n > 1), solver
    # the commit moves every Gated DeltaNet layer's state at once: a stack [layers, heads, dk, dv]
    assert {("conv_rows", 2), ("commit_states", 4)} == set(state_calls)


def test_hybrid_layers_unlike_each_other_commit_one_at_a_time(solver, monkeypatch, tmp_path):
    """Where the Gated DeltaNet layers' buffers differ in shape (none of today's checkpoints), no
    stack holds them: each layer's commit is its own launch, with the same tokens."""
    from ddtree_diag.engine.fast.decoder import FastDecoder

    state_module = kernels._triton_gdn_state()
    commits = []
    record_calls(monkeypatch, state_module, "commit_states", lambda *a, **_: commits.append(a[0].dim()))
    monkeypatch.setenv("DDTREE_DIAG_TREE_KERNEL", "off")
    monkeypatch.setenv("DDTREE_DIAG_ATTENTION_KERNEL", "off")
    target = fx.make_hybrid_target(tmp_path / "target", kind="qwen3_5", pattern="LLAL")
    draft = fx.make_draft(tmp_path / "draft", block_size=4, layer_ids=(0, 2), layers=1)
    engine = load_engine(target, draft, device=DEVICE, dtype="fp32")
    engine.use_path("fast")
    stacked = engine.generate_ids(PROMPTS[0], tree_budget=8, max_tokens=TOKENS, stop_token_ids=[])
    assert commits and set(commits) == {4}
    shapes = FastDecoder._linear_shapes

    def unlike(self, index, rows=0):  # a stand-in difference: the shapes stay, the comparison sees them differ
        return {**shapes(self, index, rows), "layer": (index,)}

    monkeypatch.setattr(FastDecoder, "_linear_shapes", unlike)
    engine.decoder("fast").max_len = 0  # the buffers are allocated again
    commits.clear()
    alone = engine.generate_ids(PROMPTS[0], tree_budget=8, max_tokens=TOKENS, stop_token_ids=[])
    assert commits and set(commits) == {3}
    layers, rounds = len(engine.target.linear_layers), len(alone.acceptance_lengths)
    # one launch per layer: each round on the CPU; on a GPU each CUDA graph's capture, replayed after
    assert len(commits) % layers == 0 and (DEVICE != "cpu" or len(commits) == layers * rounds)
    assert alone.token_ids == stacked.token_ids and alone.acceptance_lengths == stacked.acceptance_lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, tile", [
    (19, dict(method="path")), (19, dict(method="path", share_heads=True)), (19, dict(method="blocked")),
    (1, dict()), (19, dict(method="path", columns=16)), (19, dict(method="path", in_solve=False)),
])
def test_the_solve_hands_back_its_output_through_the_gated_output_norm(solver, monkeypatch, dtype, n, tile):
    """``out_norm``: the layer's gated output norm (norm, weight, times silu(z), z a strided view of
    a wider projection output) applied to the solve's output rows: by the path solve itself where a
    program solves one head and one step of its value columns covers it (``NORM_IN_SOLVE``), else
    (heads shared, more steps, switched off, the blocked and one-row solves) by the norm kernel
    after it. Either way the module's answer on the plain solve's output."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    module, tile = kernels._triton_gdn(), dict(tile)  # (the parameter's dict is shared by both dtypes)
    if "columns" in tile:
        monkeypatch.setattr(module, "SOLVE_COLUMNS", tile.pop("columns"))
    monkeypatch.setattr(module, "NORM_IN_SOLVE", tile.pop("in_solve", True))
    after = []  # the solves whose output the norm kernel normed afterwards
    record_calls(monkeypatch, module, "_out_normed", lambda out, dv, out_norm: after.append(out_norm is not None))
    key_heads, value_heads, dk, dv = 1, 3, 16, 40  # dv not a power of two: masked norm columns
    generator = torch.Generator().manual_seed(8)
    wide = (torch.randn(n, 8 + value_heads * dv, generator=generator) * 2).to(DEVICE, dtype)
    gate = wide[:, 8:].view(n, value_heads, dv)
    norm = Qwen3_5RMSNormGated(dv, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dv, generator=generator) * 0.3 + 1)
    norm = norm.to(DEVICE, dtype)
    out_norm = kernels.gated_norm_for_solve(norm, gate)
    assert out_norm is not None
    common = dict(dtype=dtype, key_heads=key_heads, value_heads=value_heads, dk=dk, dv=dv, seed=6)
    (plain, *_), _ = solve_both(n, "tree", **common, **tile)
    after.clear()
    (normed, *_), _ = solve_both(n, "tree", **common, **tile, out_norm=out_norm)
    in_solve = (n > 1 and tile.get("method") == "path" and not tile.get("share_heads") and module.NORM_IN_SOLVE
                and dv <= module.SOLVE_COLUMNS)
    assert any(after) != in_solve  # the norm kernel ran after the solve where the solve could not norm
    want = norm(plain.reshape(-1, dv), gate.reshape(-1, dv)).reshape(normed.shape)
    assert normed.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)
    else:  # the solve rounds its output to bf16 itself before norming: a bf16 step or two apart
        step = want.float().abs().clamp(min=2**-8) * 2**-7
        assert ((normed.float() - want.float()).abs() <= 2 * step).all()
