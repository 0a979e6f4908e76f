"""The Gated DeltaNet kernels in whole fast decodes of hybrid targets (the solve, the tree rows'
conv and the state commit: == the PyTorch layers, token for token), and the solve handing back its
output through the layer's gated output norm.

Without a GPU the kernels run through Triton's interpreter; on a GPU the compiled kernels.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import PROMPTS  # noqa: E402
from tests.support.gdn_solve import TOKENS, solve_both  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls  # noqa: E402

pytestmark = MARKS


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
