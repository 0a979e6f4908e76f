"""A request's Triton kernels compiled in parallel, ahead of its first run (cold Triton caches).

On a cold cache, the first run of a stage compiles each of its Triton kernels when it is first
launched, one after another: on an H200 a top-k pass takes 1.5-5.6 s, and each new kernel
signature also builds a C launcher with gcc (~0.35 s). A first request of a Qwen3.6-27B shape spent
9-11 s so. Much of that work runs in parallel in threads (six top-k compiles: 20.6 s one after
another, 8.5 s in a pool; the compiler passes, ptxas and gcc do not hold the GIL throughout), but a
compile needs the kernel's arguments, and those only exist once the stage runs up to it.

So ``compile_ahead`` runs the stage functions once without running anything: under
``FakeTensorMode`` the PyTorch ops only compute shapes, strides and dtypes, and every Triton launch
that goes through ``launch`` becomes a compile request handed to a thread pool
(``triton.AsyncCompileMode``), with a stand-in for each tensor that carries what Triton specializes
on (dtype, 16-byte alignment). A worker also builds the kernel's launcher. When the pass ends, the
pool has compiled every kernel the stages will launch; their first real launches find them in
Triton's in-memory cache. Layer loops run one layer of each kind in the pass (``Repeats``): a fake
op costs ~0.1 ms of Python, and 64 layers of them took seconds.

Nothing real is written. An in-place op with a fake operand writes only a fake copy of its target;
one whose operands are all real (``x.add_(1)``, ``x.copy_(y)``), which ``FakeTensorMode(
allow_non_fake_inputs=True)`` would run on real memory, the pass skips (``_RealWritesSkipped``):
its result's shape is its target's. Attributes the stages set (a lazily moved table) are put back
afterwards; a test checks every buffer of the decoder after a pass.

It is only ever a speed-up: a kernel the pass did not reach, or whose real arguments specialize
otherwise, compiles at its first launch as before, and a pass that fails is reported and ignored.
``launch`` costs one context-variable read per launch outside a pass (launches inside CUDA graphs
are not Python calls at all).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Launches are recorded (tests), compiled ahead (``compile_ahead``), or neither (None).
_ACTIVE: contextvars.ContextVar[_Pass | None] = contextvars.ContextVar("ddtree_diag_ahead", default=None)


@dataclass
class _Pass:
    dry: bool  # True: launch nothing (the stage functions run on fake tensors)
    warm: bool  # True: hand each launch's compile to Triton's async compile mode
    launches: list[tuple] = field(default_factory=list)


def launch(kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``; inside ``compile_ahead``, that launch's compile only."""
    active = _ACTIVE.get()
    if active is None:
        kernel[grid](*args, **meta)
        return
    active.launches.append(launch_signature(kernel, args, meta))
    if not active.dry:
        kernel[grid](*args, **meta)
    elif active.warm:
        kernel.warmup(*(_stand_in(a) for a in args), grid=grid, **meta)


def stride(tensor: torch.Tensor, dim: int) -> int:
    """``tensor.stride(dim)`` for a kernel argument, 0 where that dim has size 1. A size-1 dim's
    stride is arbitrary (only index 0 is ever read), and a fake tensor's may differ from the real
    one's (a one-token reshape: 136 against 32), which would put the real launch in another of
    Triton's integer classes than the pass compiled: a compile at the first real launch."""
    return 0 if tensor.shape[dim] == 1 else tensor.stride(dim)


def dry() -> bool:
    """Whether a dry pass is running: the stage functions may then run one layer of each kind
    only (``Repeats``); nothing they compute is used."""
    active = _ACTIVE.get()
    return active is not None and active.dry


class Repeats:
    """Tells a layer loop inside a dry pass which layers it can skip: a layer whose signature
    (what its kernels' specializations depend on: its kind, its parameters' shapes, the state it
    is entered with) a run layer already had. A 64-layer target then runs a handful of layers in
    the pass (27B shape, AR: 39 launches where every layer made 640): every op under
    ``FakeTensorMode`` costs ~0.1 ms of Python."""

    def __init__(self) -> None:
        self.active = dry()
        self.seen: set[tuple] = set()

    def skip(self, layer: torch.nn.Module, *state: object) -> bool:
        if not self.active:
            return False
        signature = (type(layer).__name__, *(tuple(p.shape) for p in layer.parameters()), *state)
        if signature in self.seen:
            return True
        self.seen.add(signature)
        return False


def launch_signature(kernel: Any, args: tuple, meta: dict[str, Any]) -> tuple:
    """What a Triton compile of this launch depends on, as a hashable tuple: the kernel, each
    tensor's dtype and whether its data is 16-byte aligned, each integer's class as Triton
    specializes it (1, a multiple of 16, 64-bit or not: a row stride of a one-row view may be 64 in
    one run and 128 in another, one compile serves both), other arguments' values, the
    meta-parameters (the grid is not part of it)."""
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
    described: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            described.append(("tensor", str(arg.dtype), _aligned(arg)))
        elif isinstance(arg, float):
            described.append(("float",))  # Triton does not specialize on a float's value
        elif isinstance(arg, int) and not isinstance(arg, bool) and arg != 1:
            described.append(("int", arg % 16 == 0, not -(2**31) <= arg < 2**31))
        else:
            described.append(arg)
    return (name, tuple(described), tuple(sorted(meta.items())))


def _aligned(tensor: torch.Tensor) -> bool:
    """Whether the tensor's data starts on a 16-byte boundary: from the pointer for a real tensor;
    for a fake one from its storage offset (storages come from the caching allocator, 512-byte
    aligned)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(tensor, FakeTensor) or tensor.device.type == "meta":
        return tensor.storage_offset() * tensor.element_size() % 16 == 0
    return tensor.data_ptr() % 16 == 0


def _stand_in(arg: Any) -> Any:
    """A fake tensor as Triton's warm-up takes it (a ``MockTensor``: a dtype and a data pointer),
    with a pointer of 0 or 8: aligned to 16 bytes or not, as the tensor is."""
    if not isinstance(arg, torch.Tensor):
        return arg
    stand_in = _stand_in_class()(arg.dtype)
    stand_in.pointer = 0 if _aligned(arg) else 8
    return stand_in


@functools.cache
def _stand_in_class() -> type:
    from triton.runtime.jit import MockTensor

    class StandIn(MockTensor):
        pointer = 0

        def data_ptr(self) -> int:  # the instance's pointer, over MockTensor's static 0
            return self.pointer

    return StandIn


@dataclass
class AheadReport:
    """What a ``compile_ahead`` pass did: Triton launches it saw, distinct kernels among them,
    its wall time (the fake pass and every compile), and why it stopped early, if it did;
    ``skipped``: no pass ran, one already had for these stages and this Triton cache."""

    launches: int = 0
    kernels: int = 0
    seconds: float = 0.0
    error: str | None = None
    skipped: bool = False

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"launches": self.launches, "kernels": self.kernels, "seconds": round(self.seconds, 3)}
        return out | ({"error": self.error} if self.error else {}) | ({"skipped": True} if self.skipped else {})


def dry_run(stage_fns: Iterable[Callable[[], None]], keep: Iterable[object] = ()) -> list[tuple]:
    """Run ``stage_fns`` under ``FakeTensorMode`` (no kernel runs, no buffer is written) and return
    the signatures of the Triton launches they would make. ``keep``: objects whose attributes the
    functions may set (a lazily moved table, say); each is put back as it was, so no fake tensor
    outlives the pass."""
    return _fake_pass(stage_fns, keep, _Pass(dry=True, warm=False)).launches


def record_launches(fn: Callable[[], None]) -> list[tuple]:
    """Run ``fn`` for real and return the signatures of its Triton launches (for tests: what the
    dry pass must have seen)."""
    recorder = _Pass(dry=False, warm=False)
    token = _ACTIVE.set(recorder)
    try:
        fn()
    finally:
        _ACTIVE.reset(token)
    return recorder.launches


def compile_ahead(
    stage_fns: Iterable[Callable[[], None]],
    keep: Iterable[object] = (),
    workers: int | None = None,
    identity: str | None = None,
) -> AheadReport:
    """Compile the Triton kernels that ``stage_fns`` launch, in parallel, without running them (see
    the module docstring). Returns what it did; it never raises (on any error the stages compile
    their kernels at their first launch, as without it).

    ``identity``: what makes these stages' kernels (the caller's stage keys, model and dtype). A
    pass that compiled them all leaves a marker for it (with the Triton version, the kernels'
    source and Triton's cache directory) in the tool's cache, and a later process skips the pass:
    Triton's on-disk cache already holds the kernels, and loading them at their first launches
    is cheaper than the pass (~0.3-1.5 s of Python on the H200 machines). Were that cache
    emptied since, the kernels compile at their first launches, one after another."""
    report, started = AheadReport(), time.perf_counter()
    marker = _marker(identity) if identity is not None else None
    try:
        if marker is not None and marker.exists():
            report.skipped = True
            return report
    except OSError:  # an unreadable cache: run the pass
        marker = None
    try:
        import triton

        mode_class = getattr(triton, "AsyncCompileMode", None)
        if mode_class is None:
            report.error = f"triton {triton.__version__} has no AsyncCompileMode"
            return report
        workers = workers or min(16, os.cpu_count() or 1)
        recorder = _Pass(dry=True, warm=True)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="triton-compile")
        with pool, _with_launchers(mode_class)(pool):  # the mode's exit waits for every compile
            _fake_pass(stage_fns, keep, recorder)
        report.launches, report.kernels = len(recorder.launches), len(set(recorder.launches))
    except Exception as exc:  # only ever a speed-up: the real run compiles what is missing
        report.error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    finally:
        report.seconds = time.perf_counter() - started
    if marker is not None and report.error is None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # a read-only cache: the next process runs the pass again
            pass
    return report


def _marker(identity: str) -> Path | None:
    """The marker file of a pass over ``identity``'s kernels, or None where the parts of its key
    cannot be read (no marker: the pass always runs)."""
    try:
        import triton

        from ddtree_diag.engine.embedded import cache_root

        key = repr((identity, triton.__version__, _triton_cache_dir(), _kernel_sources_digest()))
    except Exception:
        return None
    return cache_root() / "compile-ahead" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _triton_cache_dir() -> str:
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:  # an older Triton: its documented variable, else its default
        return os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")


@functools.cache
def _kernel_sources_digest() -> str:
    """A digest of the fast path's modules (the kernels and the code that picks their arguments):
    changed code may mean new compiles."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _fake_pass(stage_fns: Iterable[Callable[[], None]], keep: Iterable[object], recorder: _Pass) -> _Pass:
    from torch._subclasses.fake_tensor import FakeTensorMode

    kept = [(obj, dict(vars(obj))) for obj in keep]
    token = _ACTIVE.set(recorder)
    # An op with no fake kernel for its inputs (HF's MoE experts run ``torch._grouped_mm`` in fp32
    # on CUDA, whose shape function takes bf16 only) raises, and the pass is abandoned (only ever a
    # speed-up); FakeTensorMode would first log the traceback at ERROR, pages of it on stderr.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log_was_disabled, fake_log.disabled = fake_log.disabled, True
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), _real_writes_skipped():
            for fn in stage_fns:
                fn()
    finally:
        fake_log.disabled = fake_log_was_disabled
        _ACTIVE.reset(token)
        for obj, attributes in kept:
            for name in set(vars(obj)) - set(attributes):
                delattr(obj, name)
            vars(obj).update(attributes)
    return recorder


def _real_writes_skipped() -> Any:
    """A dispatch mode (above ``FakeTensorMode``) that skips an op writing into a real tensor when
    none of its operands is fake: ``FakeTensorMode`` would run it on real memory. The op's result is
    its written operand, unchanged: the same shape, all a dry pass needs."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class RealWritesSkipped(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if func._schema.is_mutable:
                tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
                if tensors and not any(isinstance(tensor, FakeTensor) for tensor in tensors):
                    written = [
                        kwargs.get(spec.name, args[i] if i < len(args) else None)
                        for i, spec in enumerate(func._schema.arguments)
                        if spec.alias_info is not None and spec.alias_info.is_write
                    ]
                    if len(written) == 1 and isinstance(written[0], torch.Tensor):
                        return written[0]
            return func(*args, **kwargs)

    return RealWritesSkipped()


def _with_launchers(mode_class: type) -> type:
    """Triton's ``AsyncCompileMode`` whose workers also build each compiled kernel's launcher (a C
    module Triton builds with gcc on a kernel's first launch, else in the main thread, one after
    another; the built module is cached on disk, so the first launch then only loads it)."""

    class WithLaunchers(mode_class):
        def submit(self, key: Any, compile_fn: Callable[[], Any], *rest: Any) -> Any:
            def compile_and_build() -> Any:
                kernel = compile_fn()
                try:
                    from triton.runtime.driver import driver

                    driver.active.launcher_cls(kernel.src, kernel.metadata)
                except Exception:  # Triton builds it at the first launch instead
                    pass
                return kernel

            return super().submit(key, compile_and_build, *rest)

    return WithLaunchers
