"""The verify rounds' split-key attention kernel (engine/fast/triton_attention.py) against the SDPA
path it replaces (``FastDecoder._target_forward``'s mask, GQA reshape and additive bias), and its
masked mode (``masked_attention``, the draft's noise block: ``FastDecoder._draft``) against SDPA
with the same boolean mask.

Without a GPU the kernel runs through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``);
on a GPU the same checks run the compiled kernel on CUDA tensors.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import ahead, kernels  # noqa: E402
from ddtree_diag.engine.fast.layers import additive_mask, attend  # noqa: E402
from ddtree_diag.engine.tree import ancestor_mask  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls, turn_kernels_on  # noqa: E402

pytestmark = MARKS


@pytest.fixture
def attention(monkeypatch):
    """The kernel module with the kernels on (CPU tensors too); counts its calls in ``calls``."""
    turn_kernels_on(monkeypatch, "DDTREE_DIAG_ATTENTION_KERNEL")
    module = kernels._triton_attention()
    assert module is not None, "triton is installed but the attention kernel did not import"
    monkeypatch.setattr(module, "calls", 0, raising=False)
    monkeypatch.setattr(module, "masked_calls", 0, raising=False)

    def count(name: str):
        return lambda *_, **__: setattr(module, name, getattr(module, name) + 1)

    record_calls(monkeypatch, module, "tree_attention", count("calls"))
    record_calls(monkeypatch, module, "masked_attention", count("masked_calls"))
    # the GPU's split counts (the interpreter aims for 1)
    monkeypatch.setattr(module, "TARGET_PROGRAMS", 256)
    monkeypatch.setattr(module, "WIDE_TARGET_PROGRAMS", 128)
    return module


def tree_anc(rows: int, nodes: int, rng: random.Random) -> torch.Tensor:
    """[rows, rows] as the fast path's tree buffers hold it: a random tree of ``nodes`` nodes (node
    0 the root, each parent earlier), then padding rows that see only themselves."""
    parents = [-1] + [rng.randrange(i) for i in range(1, nodes)]
    anc = torch.eye(rows, dtype=torch.bool)
    anc[:nodes, :nodes] = ancestor_mask(parents)
    return anc


def reference(q, cache_k, cache_v, anc, start: int, window: int, scale: float) -> torch.Tensor:
    """The SDPA path exactly as ``_target_forward`` runs it (mask, GQA rows, bias, reshapes)."""
    _, heads, rows, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    rep = heads // kv_heads
    slot_index = torch.arange(window)
    slots = start + torch.arange(rows)
    mask = (slot_index < start).unsqueeze(0).expand(rows, window).clone()
    mask.index_copy_(1, slots, anc)
    bias = additive_mask(mask.repeat(rep, 1)[None, None], q.dtype)
    q = q.reshape(1, kv_heads, rep * rows, head_dim)
    out = attend(q, cache_k[:, :, :window], cache_v[:, :, :window], bias, scale)
    return out.reshape(1, heads, rows, head_dim).transpose(1, 2).reshape(1, rows, heads * head_dim)


def case(heads: int, kv_heads: int, rows: int, nodes: int, start: int, head_dim: int, dtype, seed: int):
    """Random q (strided, as the layer halves leave it), a cache with the rows' K/V at slots
    start..start+rows and junk past them, the tree mask, and the window the decoder would use."""
    gen = torch.Generator().manual_seed(seed)
    capacity = start + rows + 40
    window = min(capacity, -(-(start + rows) // 64) * 64)
    q = torch.randn(1, rows, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    cache_k = torch.randn(1, kv_heads, capacity, head_dim, generator=gen).to(dtype)
    cache_v = torch.randn(1, kv_heads, capacity, head_dim, generator=gen).to(dtype)
    anc = tree_anc(rows, nodes, random.Random(seed))
    return q, cache_k, cache_v, anc, window


def run_kernel(module, q, cache_k, cache_v, anc, start: int, window: int, scale: float) -> torch.Tensor:
    on = lambda x: x.to(DEVICE)  # noqa: E731
    start_t = torch.tensor(start, dtype=torch.long, device=DEVICE)
    return module.tree_attention(on(q), on(cache_k), on(cache_v), on(anc), start_t, window, scale).cpu()


SHAPES = [  # heads, kv_heads, rows, tree nodes, committed prefix
    (2, 2, 5, 5, 0),  # GQA 1, no prefix
    (8, 2, 17, 12, 37),  # GQA 4, padding rows, a prefix not a multiple of the key tile
    (4, 1, 1, 1, 70),  # one row (the AR round)
    (8, 2, 32, 17, 100),  # budget 16's bucket: 17 nodes in 32 rows, 64-row query blocks
    # 64-row query blocks that end before the tree's last row (their keys cut there), one across
    # two query heads (not cut)
    (2, 1, 80, 70, 20),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_the_sdpa_path_fp32(attention, shape):
    heads, kv_heads, rows, nodes, start = shape
    q, cache_k, cache_v, anc, window = case(heads, kv_heads, rows, nodes, start, 16, torch.float32, seed=rows + start)
    got = run_kernel(attention, q, cache_k, cache_v, anc, start, window, 0.25)
    want = reference(q, cache_k, cache_v, anc, start, window, 0.25)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_kernel_bf16_within_one_step(attention, shape):
    """bf16: the kernel's output is within one bf16 step of the exact (fp32) attention of the same
    bf16 inputs (steps taken at the outputs' unit scale: the values are N(0, 1))."""
    heads, kv_heads, rows, nodes, start = shape
    q, cache_k, cache_v, anc, window = case(heads, kv_heads, rows, nodes, start, 32, torch.bfloat16, seed=start)
    got = run_kernel(attention, q, cache_k, cache_v, anc, start, window, 32**-0.5)
    want = reference(q.float(), cache_k.float(), cache_v.float(), anc, start, window, 32**-0.5)
    assert got.dtype == torch.bfloat16
    step = want.abs().clamp(min=1.0) * 2**-7
    assert ((got.float() - want).abs() <= step).all()


@pytest.mark.parametrize("balanced", [True, False])
def test_splits_over_a_window_far_wider_than_the_keys(attention, monkeypatch, balanced):
    """Early in an attention window the keys a query block sees (committed slots, tree rows up to
    its last) fill a small part of it: the splits share those keys (BALANCED_SPLITS), or the
    window's slots with the tail ones empty. Either way every visible key is counted once."""
    monkeypatch.setattr(attention, "BALANCED_SPLITS", balanced)
    heads, kv_heads, rows, nodes, start, head_dim = 4, 2, 40, 33, 45, 16
    window = 512  # 85 slots of keys; junk past them that no row may see
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, rows, heads, head_dim, generator=gen).transpose(1, 2)
    cache_k = torch.randn(1, kv_heads, window, head_dim, generator=gen)
    cache_v = torch.randn(1, kv_heads, window, head_dim, generator=gen)
    anc = tree_anc(rows, nodes, random.Random(5))
    splits = attention.plan(rows, heads // kv_heads, kv_heads, window, head_dim)[2]
    assert splits > 3  # so that, split by the window, most splits would be past the last key
    got = run_kernel(attention, q, cache_k, cache_v, anc, start, window, 0.3)
    torch.testing.assert_close(got, reference(q, cache_k, cache_v, anc, start, window, 0.3), rtol=1e-5, atol=1e-5)


def test_several_key_tiles_per_split_and_a_head_dim_not_a_power_of_two(attention, monkeypatch):
    """Fewer programs wanted: each split loops over several key tiles, the last one partial."""
    # the 8B's budget-16 verify (16 query blocks): 4 splits of 2 key tiles, not 8 of one
    assert attention.plan(rows=32, rep=4, kv_heads=8, window=256) == (64, 32, 4, 64)
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 2)
    assert attention.plan(rows=9, rep=2, kv_heads=1, window=192)[2:] == (2, 96)
    q, cache_k, cache_v, anc, window = case(2, 1, 9, 6, 150, 24, torch.float32, seed=3)
    got = run_kernel(attention, q, cache_k, cache_v, anc, 150, window, 0.2)
    torch.testing.assert_close(got, reference(q, cache_k, cache_v, anc, 150, window, 0.2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_one_split_writes_the_output_itself(attention, monkeypatch, masked):
    """Where the query blocks alone fill the grid (budget 256) there is one key split: its program
    normalises and writes the output (no fp32 partials, no combine launch), the same as splits
    merged by the combine. The prefix (75) ends inside a key tile, and the tree spans several."""
    heads, kv_heads, rows, nodes, start, head_dim = 4, 2, 70, 61, 75, 16
    q, cache_k, cache_v, anc, window = case(heads, kv_heads, rows, nodes, start, head_dim, torch.float32, seed=8)
    if masked:  # the draft's mode: a boolean mask per row, here the same visibility as the tree rule
        mask = (torch.arange(window) < start).unsqueeze(0).expand(rows, window).clone()
        mask.index_copy_(1, start + torch.arange(rows), anc)
        run = lambda: attention.masked_attention(  # noqa: E731
            q.to(DEVICE), cache_k.to(DEVICE), cache_v.to(DEVICE), mask.to(DEVICE), window, 0.3).cpu()
    else:
        run = lambda: run_kernel(attention, q, cache_k, cache_v, anc, start, window, 0.3)  # noqa: E731
    got = {}
    for target_programs in (1, 256):
        monkeypatch.setattr(attention, "TARGET_PROGRAMS", target_programs)
        splits = attention.plan(rows, heads // kv_heads, kv_heads, window, head_dim)[2]
        launches = ahead.record_launches(lambda t=target_programs: got.__setitem__(t, run()))
        kernels_launched = [signature[0] for signature in launches]
        if target_programs == 1:
            assert splits == 1 and kernels_launched == ["_split_kernel"]
        else:
            assert splits > 1 and kernels_launched == ["_split_kernel", "_combine_kernel"]
    want = reference(q, cache_k, cache_v, anc, start, window, 0.3)
    torch.testing.assert_close(got[1], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[256], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 256])
def test_the_combine_gives_the_same_bits_under_every_plan(attention, monkeypatch, dtype, head_dim):
    """The combine's plan (group rows a program, splits loaded before they are merged) changes
    neither the merge order nor any element's arithmetic: the splits past the last (7 splits here:
    not a multiple of 2 or 4) read as empty, and the output is bit for bit the one-row-block,
    one-split-at-a-time merge's. Heads wider than 128 take the WIDE_ settings."""
    heads, kv_heads, rows, nodes, start = 4, 2, 5, 5, 430
    q, cache_k, cache_v, anc, window = case(heads, kv_heads, rows, nodes, start, head_dim, dtype, seed=21)
    if head_dim > 128:
        monkeypatch.setattr(attention, "WIDE_TARGET_PROGRAMS", 256)  # the narrow heads' split count
    assert attention.plan(rows, heads // kv_heads, kv_heads, window, head_dim)[2] == 7
    prefix = "WIDE_" if head_dim > 128 else ""
    got = []
    for combine_rows, unroll in ((16, 1), (16, 2), (4, 4), (2, 4)):
        monkeypatch.setattr(attention, f"{prefix}COMBINE_ROWS", combine_rows)
        monkeypatch.setattr(attention, f"{prefix}COMBINE_UNROLL", unroll)
        got.append(run_kernel(attention, q, cache_k, cache_v, anc, start, window, 0.25))
    assert all(torch.equal(got[0], other) for other in got[1:])
    want = reference(q.float(), cache_k.float(), cache_v.float(), anc, start, window, 0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0].float(), want, rtol=tolerance, atol=tolerance)


def test_a_combine_unroll_that_would_skip_splits_is_refused(attention, monkeypatch):
    """The combine steps UNROLL splits at a time and loads at most four: 3 would skip splits."""
    monkeypatch.setattr(attention, "COMBINE_UNROLL", 3)
    q, cache_k, cache_v, anc, window = case(4, 2, 5, 5, 430, 32, torch.float32, seed=21)
    with pytest.raises(ValueError, match="unroll 3"):
        run_kernel(attention, q, cache_k, cache_v, anc, 430, window, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [40, 150])
def test_heads_of_256_dims_in_32_row_query_blocks(attention, dtype, start):
    """Qwen3.6-27B's attention heads are 256 wide: the kernel takes them in 32-row query blocks, on
    their own plan: one split of 64-key tiles where the query blocks fill the grid (budget 256, and
    here at 40 committed slots), splits of 32-key tiles where they do not (150)."""
    assert attention.plan(rows=32, rep=6, kv_heads=4, window=256, head_dim=256)[0] == 32
    assert attention.plan(rows=257, rep=6, kv_heads=4, window=768, head_dim=256) == (32, 64, 1, 768)
    q, cache_k, cache_v, anc, window = case(6, 1, 9, 7, start, 256, dtype, seed=11)
    tiles_and_splits = attention.plan(9, 6, 1, window, 256)[1:3]
    assert tiles_and_splits == ((64, 1) if start == 40 else (32, 3))
    got = run_kernel(attention, q, cache_k, cache_v, anc, start, window, 256**-0.5)
    want = reference(q.float(), cache_k.float(), cache_v.float(), anc, start, window, 256**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert ((got.float() - want).abs() <= want.abs().clamp(min=1.0) * 2**-7).all()


def test_the_switch_turns_it_off(attention, monkeypatch):
    q = torch.zeros(1, 4, 3, 16, device=DEVICE)
    cache = torch.zeros(1, 2, 8, 16, device=DEVICE)
    assert kernels.attention_kernel(q, cache) is attention
    monkeypatch.setenv("DDTREE_DIAG_ATTENTION_KERNEL", "off")
    assert kernels.attention_kernel(q, cache) is None
    monkeypatch.setenv("DDTREE_DIAG_ATTENTION_KERNEL", "")
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "off")
    assert kernels.attention_kernel(q, cache) is None


def test_fast_rounds_with_the_kernel_equal_eager(attention, tmp_path, monkeypatch):
    """A whole fast decode (fp32, T=0) with the verify attention in the kernel: the eager path's
    tokens and acceptance, at budget 16 (tests/test_engine_kernels.py's fused decodes run it at
    budgets 0-16 too, AR rounds included). One key split per query block: the interpreter runs
    programs one by one (the splits are checked above)."""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 1)
    target = fx.make_target(tmp_path / "t")
    engine = load_engine(target, fx.make_draft(tmp_path / "d", block_size=4), device=DEVICE, dtype="fp32")
    previous = engine.decode_path
    try:
        for budget in (16,):
            runs = {}
            for path in ("eager", "fast-nograph"):
                engine.use_path(path)
                runs[path] = engine.generate_ids(fx.PROMPTS[1], stop_token_ids=[], max_tokens=12, tree_budget=budget)
            eager, quick = runs["eager"], runs["fast-nograph"]
            assert (quick.token_ids, quick.acceptance_lengths) == (eager.token_ids, eager.acceptance_lengths), budget
    finally:
        engine.use_path(previous)
    assert attention.calls > 0 and attention.masked_calls > 0


def test_layers_that_slide_keep_sdpa_and_the_full_layers_take_the_kernel(attention, tmp_path, monkeypatch):
    """A Qwen2 whose upper layers slide (window 6, shorter than the prompt): the verify's tree rows
    of the two full-attention layers go through the kernel, the sliding layers' through SDPA with
    their window; the eager path's tokens and acceptance."""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 1)
    target = fx.make_target(
        tmp_path / "t", model_type="qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=2
    )
    engine = load_engine(target, fx.make_draft(tmp_path / "d", block_size=4), device=DEVICE, dtype="fp32")
    caches: set[int] = set()  # the KV cache slots the kernel read
    record_calls(monkeypatch, attention, "tree_attention", lambda q, cache_k, *_: caches.add(cache_k.data_ptr()))
    previous = engine.decode_path
    try:
        runs = {}
        for path in ("eager", "fast-nograph"):
            engine.use_path(path)
            runs[path] = engine.generate_ids(fx.PROMPTS[2], stop_token_ids=[], max_tokens=12, tree_budget=4)
    finally:
        engine.use_path(previous)
    eager, quick = runs["eager"], runs["fast-nograph"]
    assert (quick.token_ids, quick.acceptance_lengths) == (eager.token_ids, eager.acceptance_lengths)
    t = engine.target
    assert t.arch.windows == (None, None, 6, 6)
    assert caches == {t.kv.k[t.cache_slot[layer]].data_ptr() for layer in (0, 1)}


# ---- the masked mode (the draft's noise block) ---------------------------------------------------


def masked_reference(q, cache_k, cache_v, mask, window: int, scale: float) -> torch.Tensor:
    """SDPA in float64 with the boolean mask itself (every query head of a KV head gets its row's
    mask; K/V repeated per query head, as the eager draft does), laid out [1, rows, heads * head_dim];
    a row that sees no key is 0 (SDPA's softmax of nothing)."""
    _, heads, rows, head_dim = q.shape
    rep = heads // cache_k.shape[1]
    k = cache_k[:, :, :window].double().repeat_interleave(rep, dim=1)
    v = cache_v[:, :, :window].double().repeat_interleave(rep, dim=1)
    full = mask[:, :window].expand(rows, window)
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=full[None, None], scale=scale)
    out = torch.where(full.any(dim=-1)[None, None, :, None], out, 0.0)
    return out.transpose(1, 2).reshape(1, rows, heads * head_dim)


def draft_case(heads: int, kv_heads: int, rows: int, window: int, head_dim: int, dtype, seed: int):
    """Random strided q (as the draft layer leaves it) and a cache of ``window`` + 40 slots (junk
    past the window)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, rows, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    cache_k = torch.randn(1, kv_heads, window + 40, head_dim, generator=gen).to(dtype)
    cache_v = torch.randn(1, kv_heads, window + 40, head_dim, generator=gen).to(dtype)
    return q, cache_k, cache_v


def draft_masks(rows: int, window: int, context: int, band: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``FastDecoder._draft`` builds them: the visible slots (context 0..context, the noise block
    at context + rows..) as a [1, window] mask, and a sliding layer's [rows, window] band (keys less
    than ``band`` positions behind the row; the block sits at positions context..)."""
    slots = torch.arange(window)
    noise = context + rows
    visible = (slots < context) | ((slots >= noise) & (slots < noise + rows))
    key_positions = torch.where((slots >= noise) & (slots < noise + rows), slots - rows, slots)
    query_positions = context + torch.arange(rows)
    near = key_positions[None, :] > query_positions[:, None] - band
    return visible[None, :], visible[None, :] & near


def run_masked(module, q, cache_k, cache_v, mask, window: int, scale: float) -> torch.Tensor:
    on = lambda x: x.to(DEVICE)  # noqa: E731
    return module.masked_attention(on(q), on(cache_k), on(cache_v), on(mask), window, scale).cpu()


MASKED_SHAPES = [  # heads, kv_heads, block rows, window (not a multiple of the key tile), context
    (8, 2, 16, 200, 150),  # GQA 4: 64 group rows, several splits
    (4, 4, 4, 100, 40),  # GQA 1, a short block
    (6, 2, 5, 136, 90),  # GQA 3: a query block across query heads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MASKED_SHAPES)
def test_masked_kernel_equals_sdpa_with_the_same_mask(attention, shape, dtype):
    """The shared [1, window] mask (full-attention layers) and the per-row band (sliding layers):
    fp32 to 1e-5 of float64 SDPA, bf16 within one bf16 step of it."""
    heads, kv_heads, rows, window, context = shape
    head_dim = 16 if dtype == torch.float32 else 32
    q, cache_k, cache_v = draft_case(heads, kv_heads, rows, window, head_dim, dtype, seed=window + rows)
    shared, band = draft_masks(rows, window, context, band=24)
    assert not torch.equal(band, shared.expand(rows, window))  # the band cuts some context
    # several key splits (the interpreter's default is one; the fixture asks for the GPU's count)
    assert attention.plan(rows, heads // kv_heads, kv_heads, window, head_dim)[2] > 1
    scale = head_dim**-0.5
    for mask in (shared, band):
        got = run_masked(attention, q, cache_k, cache_v, mask, window, scale)
        want = masked_reference(q, cache_k, cache_v, mask, window, scale)
        assert got.shape == want.shape == (1, rows, heads * head_dim) and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        else:
            assert ((got.double() - want).abs() <= want.abs().clamp(min=1.0) * 2**-7).all()


def test_a_shared_mask_equals_it_repeated_per_row_and_a_row_that_sees_nothing_is_zero(attention, monkeypatch):
    """Row stride 0 (one mask row for all) is the same computation as the mask written out per row;
    a row whose mask is all False gives 0, not NaN, in every split; a mask over more slots than the
    window reads only the window's."""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 4)  # few programs: splits of several key tiles
    heads, kv_heads, rows, window = 4, 2, 6, 150
    q, cache_k, cache_v = draft_case(heads, kv_heads, rows, window, 16, torch.float32, seed=7)
    assert attention.plan(rows, 2, kv_heads, window, 16)[2:] == (2, 96)
    gen = torch.Generator().manual_seed(8)
    shared = torch.rand(1, window, generator=gen) < 0.6
    repeated = shared.expand(rows, window).contiguous()
    got = run_masked(attention, q, cache_k, cache_v, shared, window, 0.3)
    again = run_masked(attention, q, cache_k, cache_v, repeated, window, 0.3)
    if DEVICE == "cpu":
        assert torch.equal(got, again)
    else:  # compiled, a stride of 0 and one of 150 are two specializations: rounding apart at most
        torch.testing.assert_close(got, again, rtol=1e-6, atol=1e-6)
    per_row = torch.rand(rows, window + 20, generator=gen) < 0.3  # 20 slots past the window: unread
    per_row[2] = False
    per_row[4, 96:] = False  # sees keys in the first split only
    got = run_masked(attention, q, cache_k, cache_v, per_row, window, 0.3)
    want = masked_reference(q, cache_k, cache_v, per_row, window, 0.3)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert (got.view(rows, heads, 16)[2] == 0).all()


def test_a_mask_of_the_wrong_shape_is_refused(attention):
    q, cache_k, cache_v = draft_case(4, 2, 3, 64, 16, torch.float32, seed=1)
    for mask in (torch.ones(2, 64, dtype=torch.bool), torch.ones(3, 63, dtype=torch.bool), torch.zeros(3, 64)):
        with pytest.raises(ValueError):  # the last: an additive float mask, whose -inf is not "hidden" here
            run_masked(attention, q, cache_k, cache_v, mask, 64, 0.25)


def test_the_draft_runs_the_masked_kernel_and_equals_eager(attention, tmp_path, monkeypatch):
    """A whole fast decode (fp32, T=0) with a draft of one sliding layer (a short window, so its
    band cuts the context) and one full layer: the draft's attention goes through the masked mode
    (both masks), and the tokens and acceptance are the eager path's."""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 1)
    target = fx.make_target(tmp_path / "t")
    directory = fx.make_draft(tmp_path / "d", block_size=4)
    fx.edit_json(
        directory / "config.json", layer_types=["sliding_attention", "full_attention"], sliding_window=6,
        use_sliding_window=True,
    )
    engine = load_engine(target, directory, device=DEVICE, dtype="fp32")
    assert engine.draft.config.layer_window(0) == 6 and engine.draft.config.layer_window(1) is None
    masks: list[tuple[int, ...]] = []
    record_calls(monkeypatch, attention, "masked_attention", lambda q, k, v, mask, *_: masks.append(tuple(mask.shape)))
    prompt = fx.PROMPTS[1]
    engine.use_path("eager")
    eager = engine.generate_ids(prompt, stop_token_ids=[], max_tokens=12, tree_budget=8)
    engine.use_path("fast-nograph")
    launches = ahead.record_launches(
        lambda: masks.append(engine.generate_ids(prompt, stop_token_ids=[], max_tokens=12, tree_budget=8))
    )
    quick = masks.pop()
    assert (quick.token_ids, quick.acceptance_lengths) == (eager.token_ids, eager.acceptance_lengths)
    assert {shape[0] for shape in masks} == {1, 4}  # the full layer's shared row, the sliding band
    modes = {dict(meta)["MASKED"] for name, _args, meta in launches if name == "_split_kernel"}
    assert modes == {True, False}  # the draft's masked launches and the verify's tree launches
