"""The split Triton argmax (engine/fast/triton_argmax.py) == ``torch.argmax(dim=-1)``, index for index.

Without a GPU the kernel runs through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``)
on CPU tensors; on a GPU the same checks run the compiled kernel on CUDA tensors. The interpreter
runs the programs one by one, so vocabularies are a few thousand and small chunks stand in for the
4096-entry ones (they make the same passes: several chunks, a partial last one, the merge).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import kernels  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import MAX_TOKENS, PROMPTS  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, record_calls, turn_kernels_on  # noqa: E402

pytestmark = MARKS

DTYPES = (torch.float32, torch.bfloat16)
NAN, INF = float("nan"), float("inf")


@pytest.fixture
def kernel(monkeypatch):
    """The argmax kernel's module (CPU tensors too, through the interpreter)."""
    turn_kernels_on(monkeypatch, "DDTREE_DIAG_ARGMAX_KERNEL")
    module = kernels.argmax_kernel(torch.zeros(1, 4, device=DEVICE))
    assert module is not None, "triton is installed but the argmax kernel module did not import"
    return module


def assert_argmax(module, x: torch.Tensor, **plan) -> None:
    """The kernel's answer (returned, and written into a given ``out``) equals torch's."""
    want = x.argmax(dim=-1)
    got = module.argmax(x, **plan)
    what = (tuple(x.shape), x.dtype, x.stride(), plan)
    assert got.dtype == torch.int64 and torch.equal(got, want), (what, got.tolist(), want.tolist())
    out = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
    assert module.argmax(x, out, **plan) is out and torch.equal(out, want), what


def random_rows(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 4).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 17, 40))
def test_random_rows(kernel, dtype, rows):
    # 3001 = 11 chunks of 256 and a partial one; bf16 randn repeats values, so ties come up too
    assert_argmax(kernel, random_rows(rows, 3001, dtype, rows), block=256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_plan_and_a_vocab_past_one_chunk(kernel, dtype):
    # 5000 entries: the default 1024-entry chunks, four full and a partial one
    assert_argmax(kernel, random_rows(3, 5000, dtype, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_planted_ties_take_the_first_index(kernel, dtype):
    x = random_rows(6, 1000, dtype, 2).clamp(max=50)
    x[0, [700, 130, 131]] = 60.0  # in two chunks, and twice in one
    x[1, [999, 998]] = 60.0  # in the partial last chunk only
    x[2, [5, 260, 520, 777]] = 60.0  # the first of each of four chunks
    x[3, [3, 1]] = 60.0  # twice in the first chunk
    x[4, [600]] = 0.0  # -0.0 and 0.0 tie, as ``>`` compares them
    x[4] = torch.where(x[4] > 0, -0.0, x[4])
    x[4, 400] = -0.0
    x[5] = torch.where(x[5] > 0, 0.0, -0.0)
    assert_argmax(kernel, x, block=128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities_and_equal_rows(kernel, dtype):
    x = random_rows(6, 700, dtype, 3)
    x[0] = -INF  # all -inf: index 0
    x[1] = -INF
    x[1, 650] = -1e30 if dtype == torch.float32 else -1e38
    x[2] = 3.0  # all equal: index 0
    x[3, [10, 500]] = INF  # +inf twice
    x[4, : 650] = -INF  # only the partial last chunk is finite
    x[5] = 0.0
    assert_argmax(kernel, x, block=128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_beats_everything_and_the_first_nan_wins(kernel, dtype):
    x = random_rows(6, 700, dtype, 4)
    x[0, [600, 300]] = NAN  # two chunks: the first NaN (300)
    x[0, 10] = INF
    x[1, [650, 640]] = NAN  # within the partial last chunk
    x[2] = NAN  # all NaN: index 0
    x[3] = -INF
    x[3, 699] = NAN  # the last entry
    x[4, 5] = -NAN  # a NaN with its sign bit set is still NaN
    x[5, [131, 129]] = NAN  # twice in one chunk
    x[5, 128] = INF
    assert_argmax(kernel, x, block=128)


def test_fp16_too(kernel):
    x = random_rows(5, 2000, torch.float16, 5)
    x[1, [100, 1500]] = x[1].max()
    x[2, 900] = NAN
    assert_argmax(kernel, x, block=256)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_stride_past_the_vocab_and_a_strided_out(kernel, dtype):
    # the engine's logits buffer is contiguous; a sliced view [:, :vocab] of a wider one works too
    wide = random_rows(17, 3000, dtype, 6)
    x = wide[:, 8 : 8 + 2900]
    assert x.stride(0) == 3000 and x.stride(1) == 1
    x[3, [2000, 50]] = 99.0
    assert_argmax(kernel, x, block=512)
    assert_argmax(kernel, wide[::3, 5:2505], block=1024)  # every third row: stride 9000
    out = torch.zeros(17, 2, dtype=torch.long, device=DEVICE)
    kernel.argmax(x, out[:, 1], block=512)
    assert torch.equal(out[:, 1], x.argmax(dim=-1)) and not out[:, 0].any()


@pytest.mark.parametrize("vocab", (1, 5, 100, 256))
def test_one_chunk_per_row(kernel, vocab):
    # the chunk pass writes the answer itself (no merge pass): also into a strided out
    x = random_rows(9, vocab, torch.bfloat16, vocab)
    x[2, vocab // 2 :] = x[2].max()
    assert_argmax(kernel, x, block=256)
    out = torch.zeros(9, 3, dtype=torch.long, device=DEVICE)
    kernel.argmax(x, out[:, 2], block=256)
    assert torch.equal(out[:, 2], x.argmax(dim=-1)) and not out[:, :2].any()


def test_dispatch_and_switches(kernel, monkeypatch):
    calls = []
    record_calls(monkeypatch, kernel, "argmax", lambda x, out=None, **_: calls.append(tuple(x.shape)))
    x = random_rows(4, 900, torch.bfloat16, 7)
    choice = torch.zeros(4, dtype=torch.long, device=DEVICE)
    assert kernels.argmax(x, out=choice) is choice and torch.equal(choice, x.argmax(-1))
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    assert calls == [(4, 900), (4, 900)]
    assert kernels.argmax_kernel(x) is kernel
    assert kernels.argmax_kernel(x.double()) is None
    assert kernels.argmax_kernel(x.t()) is None  # last dim not contiguous
    assert kernels.argmax_kernel(x[0]) is None  # not [rows, vocab]
    assert kernels.argmax_kernel(x[:0]) is None
    # an out the kernel does not write (int32): torch's answer copied in
    narrow = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    assert torch.equal(kernels.argmax(x, out=narrow), x.argmax(-1).int())
    assert len(calls) == 2
    monkeypatch.setenv("DDTREE_DIAG_ARGMAX_KERNEL", "off")
    assert kernels.argmax_kernel(x) is None
    choice.zero_()
    assert torch.equal(kernels.argmax(x, out=choice), x.argmax(-1)) and len(calls) == 2
    monkeypatch.delenv("DDTREE_DIAG_ARGMAX_KERNEL")
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "off")
    assert kernels.argmax_kernel(x) is None
    if DEVICE == "cpu":
        monkeypatch.setenv("DDTREE_DIAG_KERNELS", "auto")  # auto: CUDA tensors only
        assert kernels.argmax_kernel(x) is None


def test_fast_decodes_choose_through_the_kernel_and_equal_eager(kernel, tmp_path, monkeypatch):
    """Whole greedy fp32 decodes: a tree round's verify choice and a chain round's drafted tokens
    go through the argmax kernel, and the tokens are the eager path's. Only this kernel runs."""
    calls = []
    record_calls(monkeypatch, kernel, "argmax", lambda x, out=None, **_: calls.append(tuple(x.shape)))
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "auto")  # the others stay off on CPU tensors
    monkeypatch.setattr(kernels, "argmax_kernel", lambda logits: kernel if logits.dim() == 2 else None)
    engine = load_engine(fx.make_target(tmp_path / "target"), fx.make_draft(tmp_path / "d4", block_size=4),
                         device=DEVICE, dtype="fp32")
    vocab = engine.target.config.vocab_size
    for mode in ("chain", "tree"):
        calls.clear()
        runs = {}
        for path in ("eager", "fast-nograph"):
            engine.use_path(path)
            runs[path] = engine.generate_ids(prompt_ids=PROMPTS[0], mode=mode, tree_budget=4,
                                             max_tokens=MAX_TOKENS, stop_token_ids=[])
        assert runs["fast-nograph"].token_ids == runs["eager"].token_ids, mode
        assert runs["fast-nograph"].acceptance_lengths == runs["eager"].acceptance_lengths, mode
        if mode == "chain":  # the draft's block - 1 rows of log-probs
            assert (3, vocab) in calls, calls
        assert any(shape[0] > 1 and shape[1] == vocab for shape in calls), calls
