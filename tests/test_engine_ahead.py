"""Compiling a request's Triton kernels ahead (engine/fast/ahead.py).

The pass runs the decoder's stage functions on fake tensors and turns every Triton launch into a
compile. What it must get right, checked here with the kernels under Triton's interpreter (CPU):
it reaches every kernel specialization the real rounds launch (same kernel, dtypes, alignment,
integer arguments and meta-parameters), it writes nothing real (the decode after it is still the
eager path's, token for token), and no fake tensor outlives it. Whether the parallel compiles pay
is a GPU measurement (``bench.engine_speed``'s first-request column on a cold Triton cache).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import ahead, kernels  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, needs_async_compile, turn_kernels_on  # noqa: E402

pytestmark = [*MARKS, pytest.mark.usefixtures("no_compile_workers")]


@pytest.fixture
def kernels_on(monkeypatch):
    turn_kernels_on(monkeypatch, on=("DDTREE_DIAG_TOPK_KERNEL",))  # the tree's top-k too (small vocabulary here)
    assert kernels._triton() is not None


def tensors_in(root: object, depth: int = 4) -> dict[str, torch.Tensor]:
    """Tensors under ``root`` (objects' attributes, dict values, list items; not inside modules)
    by attribute path."""
    found: dict[str, torch.Tensor] = {}

    def walk(value: object, path: str, left: int) -> None:
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif left == 0 or isinstance(value, (str, bytes, int, float)):
            return
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]", left - 1)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]", left - 1)
        elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for name, item in vars(value).items():
                walk(item, f"{path}.{name}", left - 1)

    walk(root, "root", depth)
    return found


def fake_tensors_in(root: object) -> list[str]:
    return [path for path, tensor in tensors_in(root).items() if isinstance(tensor, FakeTensor)]


@pytest.mark.parametrize(
    ("hybrid", "temperature"), ((False, 0.0), (True, 0.0), (True, 0.8)), ids=("dense", "hybrid", "hybrid-sampled")
)
def test_the_pass_reaches_every_launch_of_the_real_rounds_and_writes_nothing(
    kernels_on, tmp_path, monkeypatch, hybrid, temperature
):
    """At T>0 the commits run outside the stages (a full round's and the last round's, whose Gated
    DeltaNet commit kernels differ): the pass must run them too."""
    if hybrid:  # layers 1 and 4 are both linear, read for the draft and entered alike: the pass
        # runs one of them, and must still give the draft the other's features
        target = fx.make_hybrid_target(tmp_path / "t", pattern="LLALLA")
        draft = fx.make_draft(tmp_path / "d", block_size=4, layer_ids=(1, 4), layers=1)
    else:
        target, draft = fx.make_target(tmp_path / "t"), fx.make_draft(tmp_path / "d", block_size=4)
    engine = load_engine(target, draft, device=DEVICE, dtype="fp32")
    # On a GPU every weight is an allocation of its own (16-byte aligned, as the pass assumes of a
    # tensor it only knows by its storage offset); on CPU safetensors may map a weight at any offset.
    with torch.no_grad():
        for module in (engine.target.hf, engine.draft):
            for parameter in module.parameters():
                parameter.data = parameter.data.clone()
    prompt = fx.PROMPTS[0]
    engine.use_path("eager")
    sampling = {"temperature": temperature, "seed": 3}
    eager = engine.generate_ids(prompt, tree_budget=8, max_tokens=6, stop_token_ids=[], **sampling)
    engine.use_path("fast-nograph")
    decoder = engine.decoder("fast-nograph")
    decoder.compile_ahead = True  # what CUDA does; here the pass records instead of compiling
    passes: list[list[tuple]] = []
    identities: list[str] = []

    def dry(stage_fns, keep=(), workers=None, identity=None):
        identities.append(identity)
        def buffers() -> dict[str, torch.Tensor]:
            return {f"{i}{path}": t for i, obj in enumerate(keep) for path, t in tensors_in(obj).items()}

        before = {path: tensor.clone() for path, tensor in buffers().items()}
        launches = ahead.dry_run(stage_fns, keep)
        after = buffers()
        assert after.keys() == before.keys()
        changed = [path for path, tensor in before.items() if not torch.equal(after[path], tensor)]
        assert not changed, f"the pass wrote real buffers: {changed[:5]}"
        passes.append(launches)
        return ahead.AheadReport(launches=len(launches), kernels=len(set(launches)))

    monkeypatch.setattr(ahead, "compile_ahead", dry)
    result = None

    def decode() -> None:
        nonlocal result
        result = engine.generate_ids(prompt, tree_budget=8, max_tokens=6, stop_token_ids=[], **sampling)

    real = ahead.record_launches(decode)
    assert len(passes) == 1 and real, "one pass for the request's new stages; the rounds launch kernels"
    seen = set(passes[0])
    missed = set(real) - seen
    assert not missed, f"launches the pass never saw: {sorted(missed, key=repr)[:3]}"
    names = {signature[0] for signature in real}
    assert {"_rms_norm_kernel", "_top_k_pass", "_build_tree_kernel"} <= names
    if hybrid:
        assert {"_conv_rows_kernel", "_commit_kernel", "_path_solve_kernel"} <= names
    assert result.extras["compile_ahead"] == {"launches": len(passes[0]), "kernels": len(seen), "seconds": 0.0}
    # nothing real was written: the rounds after the pass are the eager path's (sampled on CUDA,
    # the fast path draws from a GPU generator, another stream than eager's: then those of the same
    # path in an engine that runs no pass)
    reference = eager
    if DEVICE == "cuda" and temperature > 0:
        plain = load_engine(target, draft, device=DEVICE, dtype="fp32")
        plain.use_path("fast-nograph")
        plain.decoder("fast-nograph").compile_ahead = False
        reference = plain.generate_ids(prompt, tree_budget=8, max_tokens=6, stop_token_ids=[], **sampling)
    assert (result.token_ids, result.acceptance_lengths) == (reference.token_ids, reference.acceptance_lengths)
    for owner in (decoder, engine.target, engine.target.kv, engine.draft):
        assert not fake_tensors_in(owner), fake_tensors_in(owner)
    # a second request of the same shapes creates no stage: no pass
    again = engine.generate_ids(prompt, tree_budget=8, max_tokens=3, stop_token_ids=[], **sampling)
    assert len(passes) == 1 and "compile_ahead" not in again.extras
    # a later request that reaches a wider attention window: the same kernels, no pass
    padded = next(key[1] for key in decoder.stages if key[0] == "verify" and key[1] > 1)
    window = max(key[-1] for key in decoder.stages if key[0] == "draft")
    wider = decoder._stage_plans(padded, 8, "tree", temperature, True, 2 * window)
    assert decoder._compile_ahead([wider], padded, temperature, len(prompt), True) is None
    if not hybrid:  # another process with the same model and request names the same kernels
        other = load_engine(target, draft, device=DEVICE, dtype="fp32")
        other.use_path("fast-nograph")
        other.decoder("fast-nograph").compile_ahead = True
        other.generate_ids(prompt, tree_budget=8, max_tokens=2, stop_token_ids=[])
        other.generate_ids(prompt, tree_budget=4, max_tokens=2, stop_token_ids=[])  # a new tree stage
        assert len(identities) == 3 and identities[1] == identities[0] != identities[2]


def test_the_fake_pass_puts_back_attributes_and_leaves_real_buffers_alone():
    class Holder:
        def __init__(self) -> None:
            self.table = torch.arange(4.0)
            self.buffer = torch.zeros(3)

    holder = Holder()
    table = holder.table

    other = torch.arange(3.0)

    def stage() -> None:
        holder.table = holder.table * 2  # a lazily replaced attribute: fake inside the pass
        holder.extra = torch.ones(2)  # a new one
        holder.buffer.add_(holder.table[:3])  # an in-place write to a real buffer: lands on a fake
        holder.buffer.index_copy_(0, torch.tensor([1]), torch.ones(1))
        # every operand real: FakeTensorMode itself would write real memory; the pass skips them
        assert holder.buffer.add_(5).shape == (3,)
        holder.buffer.copy_(other)
        torch.add(other, 1, out=holder.buffer)

    assert ahead.dry_run([stage], keep=[holder]) == []
    assert holder.table is table and not hasattr(holder, "extra")
    assert torch.equal(holder.buffer, torch.zeros(3))


def test_a_launch_signature_says_what_triton_specializes_on():
    class Kernel:
        __name__ = "_k"

    base = torch.zeros(64, dtype=torch.bfloat16)
    aligned, offset = base[8:], base[1:]  # 16 bytes in, and 2
    args = (aligned, offset, 7, 64, 1, 2**40, True, 1.5, None)
    signature = ahead.launch_signature(Kernel(), args, {"BLOCK": 16})
    assert signature == (
        "_k",
        (
            ("tensor", "torch.bfloat16", True), ("tensor", "torch.bfloat16", False),
            ("int", False, False), ("int", True, False), 1, ("int", True, True), True, ("float",), None,
        ),
        (("BLOCK", 16),),
    )
    assert ahead.launch_signature(Kernel(), (aligned, offset, 9, 128, *args[4:]), {"BLOCK": 16}) == signature
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # the same from a fake tensor's storage offset
        fake = torch.zeros(64, dtype=torch.bfloat16)
        assert ahead.launch_signature(Kernel(), (fake[8:], fake[1:], *args[2:]), {"BLOCK": 16}) == signature


def test_a_size_one_dims_stride_goes_to_kernels_as_zero():
    """Only index 0 of a size-1 dim is read, so its stride is free: 0 on a real and a fake tensor
    alike (their own strides may differ: a one-token reshape), other dims' strides as they are."""
    one_row = torch.zeros(4, 1, 8)[:, :, 2:]  # strides (8, 8, 1)
    assert [ahead.stride(one_row, d) for d in range(3)] == [8, 0, 1]
    with FakeTensorMode():
        fake = torch.empty_strided((1, 3), (136, 1))
        real_like = torch.empty_strided((1, 3), (32, 1))
        assert ahead.stride(fake, 0) == ahead.stride(real_like, 0) == 0
        assert ahead.stride(fake, 1) == 1


def test_a_failing_pass_is_reported_not_raised(monkeypatch):
    needs_async_compile()
    report = ahead.compile_ahead([lambda: 1 / 0])
    assert report.error is not None and report.error.startswith("ZeroDivisionError")
    import triton

    monkeypatch.delattr(triton, "AsyncCompileMode", raising=False)
    report = ahead.compile_ahead([lambda: None])
    assert report.error is not None and "AsyncCompileMode" in report.error
    assert set(report.as_dict()) == {"launches", "kernels", "seconds", "error"}


def test_a_pass_that_compiled_its_kernels_is_not_run_again(monkeypatch, tmp_path):
    needs_async_compile()
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path))
    ran: list[str] = []
    first = ahead.compile_ahead([lambda: ran.append("a")], identity="stages A")
    assert ran == ["a"] and not first.skipped and first.error is None
    again = ahead.compile_ahead([lambda: ran.append("a")], identity="stages A")
    assert ran == ["a"] and again.skipped and again.as_dict()["skipped"] is True
    assert not ahead.compile_ahead([lambda: ran.append("b")], identity="stages B").skipped  # other stages
    assert not ahead.compile_ahead([lambda: ran.append("c")]).skipped  # no identity: always runs
    assert ran == ["a", "b", "c"]
    # a pass that failed leaves no marker: the next one runs
    assert ahead.compile_ahead([lambda: 1 / 0], identity="stages C").error
    assert not ahead.compile_ahead([lambda: ran.append("d")], identity="stages C").skipped
    # another Triton cache directory is another marker
    monkeypatch.setattr(ahead, "_triton_cache_dir", lambda: str(tmp_path / "elsewhere"))
    assert not ahead.compile_ahead([lambda: ran.append("e")], identity="stages A").skipped
    assert ran == ["a", "b", "c", "d", "e"]
    # a cache the marker cannot be written to: the pass still reports success
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a directory")
    report = ahead.compile_ahead([lambda: ran.append("f")], identity="stages A")
    assert report.error is None and not report.skipped and ran[-1] == "f"


@pytest.mark.parametrize("where", ["threads", "processes"])
@pytest.mark.parametrize(("hybrid", "temperature"), ((False, 0.0), (True, 0.8)), ids=("dense", "hybrid-sampled"))
def test_after_a_real_pass_the_rounds_compile_nothing(kernels_on, tmp_path, monkeypatch, hybrid, temperature, where):
    """On a GPU, the real pass (a thread pool, ``AsyncCompileMode``; or the compile workers, whose
    kernels the pass then loads here): every kernel the request then launches was compiled in it.
    After the pass nothing is added to Triton's on-disk cache, and Triton does not call its JIT
    cache hook (which it calls before each compile or load from that cache) for any launch."""
    if DEVICE != "cuda":
        pytest.skip("under the interpreter nothing compiles")
    needs_async_compile()
    from triton import knobs

    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "cache"))  # no marker: the pass runs
    triton_cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))  # a cold cache: the pass compiles all
    if hybrid:
        target = fx.make_hybrid_target(tmp_path / "t", pattern="LLALLA")
        draft = fx.make_draft(tmp_path / "d", block_size=4, layer_ids=(1, 4), layers=1)
    else:
        target, draft = fx.make_target(tmp_path / "t"), fx.make_draft(tmp_path / "d", block_size=4)
    ahead.stop_workers()
    if where == "threads":
        monkeypatch.setenv("DDTREE_DIAG_COMPILE_AHEAD", "threads")
    engine = load_engine(target, draft, device=DEVICE, dtype="bf16")
    # on a cold cache, loading the engine started the workers (unless told to keep to threads)
    assert (ahead._WORKERS.pool is not None) == (where == "processes")
    for started in ahead._WORKERS.ready:  # a pass takes them once they have started
        started.result()
    engine.use_path("fast")
    engine.decoder("fast").compile_ahead = True
    compiles: list[tuple[str, bool]] = []  # (kernel, inside the pass)
    in_pass = [False]
    cached_after_pass: list[set[Path]] = []
    real_pass = ahead.compile_ahead

    def marked(*args, **kwargs):
        in_pass[0] = True
        try:
            return real_pass(*args, **kwargs)
        finally:
            in_pass[0] = False
            cached_after_pass.append(set(triton_cache.rglob("*")))

    def hook(*, fn, **_):
        compiles.append((fn.name, in_pass[0]))
        return False  # go on and compile

    monkeypatch.setattr(ahead, "compile_ahead", marked)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", hook)
    try:
        # a prompt of its own length class and a budget no other test uses: new stages, a pass
        result = engine.generate_ids(fx.PROMPTS[0] * 3, tree_budget=6, max_tokens=9, stop_token_ids=[],
                                     temperature=temperature, seed=5)
    finally:
        ahead.stop_workers()
    report = result.extras["compile_ahead"]
    assert "error" not in report and report["kernels"] > 0 and report["compiled_in"] == where, report
    added = set(triton_cache.rglob("*")) - cached_after_pass[-1]
    assert not added, f"built after the pass: {sorted(path.name for path in added)}"
    after = [name for name, inside in compiles if not inside]
    assert not after, f"compiled (or loaded from the disk cache) at their first launch, after the pass: {after}"


def test_an_op_without_a_fake_kernel_abandons_the_pass_without_logging_a_traceback():
    """HF's MoE experts call ``torch._grouped_mm`` in fp32 on CUDA, whose shape function takes bf16
    only: the pass raises (its caller runs the request without it), and FakeTensorMode's logged
    traceback does not reach the user's terminal."""

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    fake_log, records = logging.getLogger("torch._subclasses.fake_tensor"), Records()
    fake_log.addHandler(records)
    x, w, offs = torch.randn(8, 16), torch.randn(2, 16, 4), torch.tensor([4, 8], dtype=torch.int32)
    try:
        with pytest.raises(RuntimeError, match="BF16"):
            ahead.dry_run([lambda: torch._grouped_mm(x, w, offs)])
        with pytest.raises(RuntimeError, match="BF16"), FakeTensorMode(allow_non_fake_inputs=True):
            torch._grouped_mm(x, w, offs)  # outside the pass the log is as it was
    finally:
        fake_log.removeHandler(records)
    assert [message for message in records.messages if "failed while attempting" in message] == [
        "failed while attempting to run meta for aten._grouped_mm.default"
    ]
