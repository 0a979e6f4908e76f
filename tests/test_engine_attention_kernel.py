"""The verify rounds' split-key attention kernel (engine/fast/triton_attention.py) against the SDPA
path it replaces (``FastDecoder._target_forward``'s mask, GQA reshape and additive bias), and its
one launch against the two kernels it replaced (split, then a combine kernel: bit for bit).

Without a GPU the kernel runs through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``);
on a GPU the same checks run the compiled kernel on CUDA tensors.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
triton = pytest.importorskip("triton")
tl = triton.language

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from ddtree_diag.engine.fast.layers import additive_mask, attend  # noqa: E402
from ddtree_diag.engine.tree import ancestor_mask  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls  # noqa: E402

pytestmark = MARKS


@pytest.fixture
def attention(monkeypatch):
    """The kernel module with the kernels on (CPU tensors too); counts its calls in ``calls``."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("compiled Triton kernels need CUDA")
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "on")
    monkeypatch.delenv("DDTREE_DIAG_ATTENTION_KERNEL", raising=False)
    module = kernels._triton_attention()
    assert module is not None, "triton is installed but the attention kernel did not import"
    monkeypatch.setattr(module, "calls", 0, raising=False)
    record_calls(monkeypatch, module, "tree_attention", lambda *_, **__: setattr(module, "calls", module.calls + 1))
    monkeypatch.setattr(module, "TARGET_PROGRAMS", 128)  # the GPU's split counts (the interpreter aims for 1)
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


def test_several_key_tiles_per_split_and_a_head_dim_not_a_power_of_two(attention, monkeypatch):
    """Fewer programs wanted: each split loops over several key tiles, the last one partial."""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 2)
    assert attention.plan(rows=9, rep=2, kv_heads=1, window=192)[1:] == (2, 96)
    q, cache_k, cache_v, anc, window = case(2, 1, 9, 6, 150, 24, torch.float32, seed=3)
    got = run_kernel(attention, q, cache_k, cache_v, anc, 150, window, 0.2)
    torch.testing.assert_close(got, reference(q, cache_k, cache_v, anc, 150, window, 0.2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_of_256_dims_in_32_row_query_blocks(attention, dtype):
    """Qwen3.6-27B's attention heads are 256 wide: the kernel takes them in 32-row query blocks."""
    assert attention.plan(rows=32, rep=6, kv_heads=4, window=256, head_dim=256)[0] == 32
    q, cache_k, cache_v, anc, window = case(6, 1, 9, 7, 40, 256, dtype, seed=11)
    got = run_kernel(attention, q, cache_k, cache_v, anc, 40, window, 256**-0.5)
    want = reference(q.float(), cache_k.float(), cache_v.float(), anc, 40, window, 256**-0.5)
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
    assert attention.calls > 0


@triton.jit
def _previous_combine(
    part_o_ptr, part_ml_ptr, out_ptr, rows, heads, rep, group_rows, splits, head_dim,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The combine kernel the one launch replaced, verbatim: one program per (KV head, 16 group
    rows) merges the splits' partials in split order and writes the output."""
    kv = tl.program_id(0)
    m = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_ok = m < group_rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    at = (kv * group_rows + m) * splits
    for split in range(0, splits):
        m_s = tl.load(part_ml_ptr + (at + split) * 2, mask=m_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + (at + split) * 2 + 1, mask=m_ok, other=0.0)
        o_s = tl.load(part_o_ptr + (at + split)[:, None] * head_dim + d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                      other=0.0)
        new = tl.maximum(top, m_s)
        shift = tl.where(new == float("-inf"), 0.0, new)
        old_w = tl.exp(top - shift)
        w = tl.exp(m_s - shift)
        total = total * old_w + l_s * w
        acc = acc * old_w[:, None] + o_s * w[:, None]
        top = new
    o = acc / tl.where(total > 0, total, 1.0)[:, None]
    head = kv * rep + m // rows
    row = m % rows
    tl.store(out_ptr + (row * heads + head)[:, None] * head_dim + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def two_kernels(module, q, cache_k, cache_v, anc, start: int, window: int, scale: float) -> torch.Tensor:
    """The previous path: the kernel writes its fp32 partials only (even for one split; counters far
    past any split count, so no program is the last to arrive), then the old combine kernel."""
    on = lambda x: x.to(DEVICE)  # noqa: E731
    q, cache_k, cache_v = on(q), on(cache_k), on(cache_v)
    start_t = torch.tensor(start, dtype=torch.long, device=DEVICE)
    never = torch.full((4096,), 1 << 20, dtype=torch.int32, device=DEVICE)
    _, part_o, part_ml = module._launch(q, cache_k, cache_v, on(anc), start_t, window, scale, never, partials=True)
    assert (never == 1 << 20).sum() < never.numel()  # the kernel did count its arrivals
    _, heads, rows, head_dim = q.shape
    rep = heads // cache_k.shape[1]
    splits = module.plan(rows, rep, cache_k.shape[1], window, head_dim)[1]
    out = torch.empty(1, rows, heads * head_dim, device=DEVICE, dtype=q.dtype)
    _previous_combine[(cache_k.shape[1], triton.cdiv(rep * rows, 16))](
        part_o, part_ml, out, rows, heads, rep, rep * rows, splits, head_dim,
        BLOCK_R=16, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4,
    )
    return out.cpu()


def counters_at_zero(module) -> bool:
    return all(not c.any() for held in module._COUNTERS.values() for c in held)


ONE_LAUNCH = [  # heads, kv_heads, rows, tree nodes, committed prefix, head_dim
    (2, 2, 5, 5, 0, 64),  # GQA 1
    (8, 2, 17, 12, 37, 128),  # GQA 4, padding rows
    (4, 1, 1, 1, 70, 128),  # one row (the AR round)
    (6, 1, 9, 7, 40, 256),  # GQA 6, the 27B's heads (32-row query blocks)
    (3, 1, 40, 30, 20, 64),  # GQA 3: 120 group rows in two query blocks, one of them partial
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("target", [1, 128], ids=["one-split", "splits"])
@pytest.mark.parametrize("shape", ONE_LAUNCH, ids=lambda s: "h{}-kv{}-r{}-d{}".format(*s[:3], s[5]))
def test_one_launch_equals_the_two_kernels(attention, monkeypatch, shape, target, dtype):
    """Bit for bit what the split kernel + combine kernel wrote (same partials, merged in split
    order), twice in a row on the same counters (the last program sets them back to 0)."""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", target)
    heads, kv_heads, rows, nodes, start, head_dim = shape
    q, cache_k, cache_v, anc, window = case(heads, kv_heads, rows, nodes, start, head_dim, dtype, seed=rows + head_dim)
    splits = attention.plan(rows, heads // kv_heads, kv_heads, window, head_dim)[1]
    assert (splits == 1) == (target == 1), splits
    scale = head_dim**-0.5
    first = run_kernel(attention, q, cache_k, cache_v, anc, start, window, scale)
    assert counters_at_zero(attention)
    second = run_kernel(attention, q, cache_k, cache_v, anc, start, window, scale)
    assert counters_at_zero(attention)
    previous = two_kernels(attention, q, cache_k, cache_v, anc, start, window, scale)
    assert first.dtype == dtype and first.shape == previous.shape
    assert torch.equal(first, previous) and torch.equal(second, previous)
    want = reference(q.float(), cache_k.float(), cache_v.float(), anc, start, window, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
    else:
        assert ((first.float() - want).abs() <= want.abs().clamp(min=1.0) * 2**-7).all()


def test_one_split_writes_no_partials(attention, monkeypatch):
    """One split: the kernel normalises in place; no fp32 partials are allocated or written."""
    monkeypatch.setattr(attention, "TARGET_PROGRAMS", 1)
    q, cache_k, cache_v, anc, window = case(8, 2, 17, 12, 37, 64, torch.float32, seed=5)
    on = lambda x: x.to(DEVICE)  # noqa: E731
    start_t = torch.tensor(37, dtype=torch.long, device=DEVICE)
    out, part_o, part_ml = attention._launch(on(q), on(cache_k), on(cache_v), on(anc), start_t, window, 0.125)
    assert part_o is None and part_ml is None
    torch.testing.assert_close(out.cpu(), reference(q, cache_k, cache_v, anc, 37, window, 0.125), rtol=1e-5, atol=1e-5)


def test_the_counters_are_one_buffer_kept_across_calls_and_shapes(attention):
    """Captured graphs point at the counters: later calls, other shapes included, reuse the buffer."""
    buffers = []
    for shape in ONE_LAUNCH[:2]:
        heads, kv_heads, rows, nodes, start, head_dim = shape
        q, cache_k, cache_v, anc, window = case(heads, kv_heads, rows, nodes, start, head_dim, torch.float32, seed=1)
        run_kernel(attention, q, cache_k, cache_v, anc, start, window, 0.25)
        buffers.append(attention._counters(q.to(DEVICE).device, 1))
    assert buffers[0] is buffers[1] and buffers[0].numel() >= attention.MIN_COUNTERS
    assert counters_at_zero(attention)
