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

In threads the compiles share the GIL (Triton's code generation is Python, and its compiler passes
hold the GIL while they run): 16 threads got 2.6x over one, and the pass was most of a cold first
request (2.5-2.9 s of 4-5 s on the 27B shape). So where compile workers run (``start_workers``,
called as the weights start to load, while there is time to hide their torch import), each launch
becomes a compile in a worker process instead: Triton's JIT hook hands over the launch's
specialization (``JITFunction.preload``'s serialized form) in place of compiling it here; the
worker builds it, and its launcher, into Triton's on-disk cache for the parent's GPU without
touching a GPU itself (no CUDA context: ``_TargetOnly``). As each compile ends, the pass loads
the kernel back from that cache, so the real launches find it in memory, as after threads.
Workers are started only where no pass has left a marker for this Triton cache and these kernels
(a cold cache: a fresh machine or container, a new release), and stop after a while idle;
elsewhere the pass runs in threads. ``DDTREE_DIAG_COMPILE_AHEAD=threads`` keeps it in threads.

It is only ever a speed-up: a kernel the pass did not reach, or whose real arguments specialize
otherwise, compiles at its first launch as before, and a pass that fails is reported and ignored.
``launch`` costs one context-variable read per launch outside a pass (launches inside CUDA graphs
are not Python calls at all).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import BrokenExecutor, Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
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
    where they compiled ("processes" or "threads"), its wall time (the fake pass and every
    compile), and why it stopped early, if it did; ``skipped``: no pass ran, one already had for
    these stages and this Triton cache."""

    launches: int = 0
    kernels: int = 0
    seconds: float = 0.0
    error: str | None = None
    skipped: bool = False
    compiled_in: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"launches": self.launches, "kernels": self.kernels, "seconds": round(self.seconds, 3)}
        out |= {"compiled_in": self.compiled_in} if self.compiled_in else {}
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
    the module docstring): in the compile workers where ``start_workers`` started them, else in
    ``workers`` threads. Returns what it did; it never raises (on any error the stages compile
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
        pool = _WORKERS.take()
        if pool is not None:
            try:
                _compile_in_processes(stage_fns, keep, pool, report)
            except BrokenExecutor:  # a worker died: later passes run in threads
                _WORKERS.stop()
                raise
            finally:
                _WORKERS.release()
        else:
            _compile_in_threads(stage_fns, keep, workers or min(16, os.cpu_count() or 1), report)
    except Exception as exc:  # only ever a speed-up: the real run compiles what is missing
        report.error = _described(exc)
    finally:
        report.seconds = time.perf_counter() - started
    if marker is not None and report.error is None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # a read-only cache: the next process runs the pass again
            pass
    return report


def _compile_in_threads(stage_fns: Iterable[Callable[[], None]], keep: Iterable[object], workers: int,
                        report: AheadReport) -> None:
    """The pass with each launch's compile in a thread pool (Triton's ``AsyncCompileMode``)."""
    import triton

    mode_class = getattr(triton, "AsyncCompileMode", None)
    if mode_class is None:
        report.error = f"triton {triton.__version__} has no AsyncCompileMode"
        return
    recorder = _Pass(dry=True, warm=True)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="triton-compile")
    with pool, _with_launchers(mode_class)(pool):  # the mode's exit waits for every compile
        _fake_pass(stage_fns, keep, recorder)
    report.launches, report.kernels = len(recorder.launches), len(set(recorder.launches))
    report.compiled_in = "threads"


def _compile_in_processes(stage_fns: Iterable[Callable[[], None]], keep: Iterable[object],
                          pool: ProcessPoolExecutor, report: AheadReport) -> None:
    """The pass with each launch's compile sent to a worker process: Triton's JIT cache hook, which
    it calls before each compile, gets the launch's serialized specialization, submits it and
    tells Triton not to compile here. Waits for every compile and loads each kernel; the first
    failure is the error."""
    from triton import knobs
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    job = _Job(
        target=(target.backend, target.arch, target.warp_size),
        # what Triton's cache keys and compiler read from the environment, as it is here now
        environment={name: value for name, value in os.environ.items() if name.startswith("TRITON_")}
        | {"TRITON_CACHE_DIR": _triton_cache_dir()},
    )
    compiles: dict[Future, tuple[Any, str]] = {}  # -> (the kernel, its specialization)
    submitted: set[str] = set()

    def hand_over(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        specialization = compile["specialization_data"]
        if specialization not in submitted:
            submitted.add(specialization)
            future = pool.submit(_compile_in_worker, job, fn.module, fn.name, specialization)
            compiles[future] = (fn.jit_function, specialization)
        return True  # compiled: not here

    recorder = _Pass(dry=True, warm=True)
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hand_over
    try:
        _fake_pass(stage_fns, keep, recorder)
    finally:
        knobs.runtime.jit_cache_hook = previous
        # As each compile ends, its kernel is loaded here from Triton's cache into the kernel's
        # own (as the threads' compiles are): the first real launch then finds it in memory.
        failures = []
        for future in as_completed(compiles):
            failures.append(_failure(future))
            if failures[-1] is None:
                kernel, specialization = compiles[future]
                with contextlib.suppress(Exception):  # else it loads (or compiles) at its first launch
                    kernel.preload(specialization)
    report.launches, report.kernels = len(recorder.launches), len(set(recorder.launches))
    report.compiled_in = "processes"
    report.error = next((failure for failure in failures if failure), None)


def settle_cache_keys(namespace: dict[str, Any]) -> list[Any]:
    """Compute the cache key of every Triton JIT function a kernel module defines (its
    ``globals()``, at the end of its import) now, each after those of the JIT functions it calls;
    returns them in that order. Triton before 3.9 merges a callee's global constants into its
    caller's key before it computes the callee's key, so a kernel whose helper's key was not yet
    computed gets another key than one whose was: which one depended on the order in which a
    process first touched them. The parent and a compile worker
    then looked for the same kernel under two keys (on the H100, the split argmax's chunk kernel
    was built twice), and a warm process could miss what a cold one cached. Callee first is the
    order Triton 3.9 itself keeps. Never raises: a key left out is computed at its first launch."""
    from triton.runtime.jit import JITFunction

    settled: list[Any] = []
    seen: set[int] = set()

    def settle(fn: Any) -> None:
        if id(fn) in seen:
            return
        seen.add(id(fn))
        for callee in _jit_callees(fn, JITFunction):
            settle(callee)
        fn.cache_key  # noqa: B018 - the property computes and keeps the key
        settled.append(fn)

    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.fn.__module__ == namespace["__name__"]:
            with contextlib.suppress(Exception):
                settle(value)
    return settled


def _jit_callees(fn: Any, jit_class: type) -> list[Any]:
    """The JIT functions ``fn``'s source names: a global (``helper``) or an attribute of one
    (``module.helper``, ``tl.max``), in source order."""
    import ast

    callees = []
    for node in ast.walk(fn.parse()):
        if isinstance(node, ast.Attribute):
            path, base = [], node
            while isinstance(base, ast.Attribute):
                path.append(base.attr)
                base = base.value
            if not isinstance(base, ast.Name):
                continue
            value = fn.__globals__.get(base.id)
            for name in reversed(path):
                value = getattr(value, name, None)
        elif isinstance(node, ast.Name):
            value = fn.__globals__.get(node.id)
        else:
            continue
        if isinstance(value, jit_class) and value is not fn:
            callees.append(value)
    return callees


def _described(exc: BaseException) -> str:
    """An error as a report says it: its type and its message's first line."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def _failure(future: Future) -> str | None:
    try:
        return future.result()
    except BrokenExecutor:
        raise
    except Exception as exc:  # a job that did not pickle, say
        return _described(exc)


# ---- compile workers --------------------------------------------------------------------------

WORKERS_IDLE_S = 120.0  # workers unused this long stop (a later pass runs in threads)


@dataclass(frozen=True)
class _Job:
    """What a worker needs besides the launch: the parent's GPU target and Triton environment."""

    target: tuple[str, int, int]
    environment: dict[str, str]


class _TargetOnly:
    """The Triton driver a compile worker makes active: device 0 of the parent's GPU target. It is
    all ``JITFunction.preload`` and ``triton.compile`` ask of a driver, and the worker builds
    kernels for that GPU without initialising CUDA (no context, no device memory)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def _worker_started() -> None:
    """A compile worker's initializer: the imports every job needs, done before the first job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import triton.compiler  # noqa: F401

    for path in sorted(Path(__file__).parent.glob("triton_*.py")):  # the modules that define kernels
        importlib.import_module(f"{__package__}.{path.stem}")


def _compile_in_worker(job: _Job, module: str, name: str, specialization: str) -> str | None:
    """In a worker: compile one launch (``JITFunction.preload`` of its serialized specialization)
    into Triton's on-disk cache, with its launcher. None, or what went wrong."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    for variable in [variable for variable in os.environ if variable.startswith("TRITON_")]:
        if variable not in job.environment:
            del os.environ[variable]
    os.environ.update(job.environment)
    target = GPUTarget(*job.target)
    driver.set_active(_TargetOnly(target))
    try:
        kernel: Any = importlib.import_module(module)
        for part in name.split("."):
            kernel = getattr(kernel, part)
        compiled = kernel.preload(specialization)
    except Exception as exc:
        return f"{name}: {_described(exc)}"
    # the launcher's C module (Triton builds it with gcc, cached on disk) where Triton has one;
    # else Triton builds it at the first launch, in the parent, one kernel after another
    with contextlib.suppress(Exception):
        _launcher_class(target)(compiled.src, compiled.metadata)
    return None


def _driver_class(target: Any) -> type:
    """The Triton driver class of the backend that compiles for ``target``. Backends are named
    ``nvidia`` / ``amd`` where targets say ``cuda`` / ``hip``: Triton matches them by asking each
    backend's compiler, as ``triton.compiler.make_backend`` does."""
    from triton.backends import backends

    matching = [backend.driver for backend in backends.values() if backend.compiler.supports_target(target)]
    if len(matching) != 1:
        raise RuntimeError(f"{len(matching)} Triton backends compile for {target}")
    return matching[0]


@functools.cache
def _launcher_class(target: Any) -> Any:
    # an instance, not the class, holds it; building one loads Triton's CUDA utilities, no context
    return _driver_class(target)().launcher_cls


class _Workers:
    """The compile worker processes of this process: started by ``start``, taken by one pass at a
    time, stopped after ``WORKERS_IDLE_S`` unused."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: ProcessPoolExecutor | None = None
        self.ready: list[Future] = []  # the workers' first jobs (see start)
        self.busy = False
        self.timer: threading.Timer | None = None

    def start(self, workers: int) -> bool:
        import multiprocessing

        with self.lock:
            if self.pool is not None:
                return True
            # spawned, not forked: the parent may have CUDA initialised, which a fork cannot keep
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_worker_started)
            ignore = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
            # One job per worker starts them all now (a spawned child keeps SIGINT ignored). Each
            # takes half a second, so that the first worker up cannot run them all before the rest
            # have started: once all are done, most workers are ready.
            try:
                with _main_module_hidden():
                    self.ready = [pool.submit(time.sleep, 0.5) for _ in range(workers)]
            finally:
                if ignore:
                    signal.signal(signal.SIGINT, previous)
            self.pool = pool
            self._arm()
            return True

    def take(self) -> ProcessPoolExecutor | None:
        """The workers for one pass, None where none run, another pass has them, or they are
        still starting (their imports: then threads compile sooner than they would)."""
        with self.lock:
            if self.pool is None or self.busy or not all(future.done() for future in self.ready):
                return None
            self.busy = True
            if self.timer is not None:
                self.timer.cancel()
            return self.pool

    def release(self) -> None:
        with self.lock:
            self.busy = False
            self._arm()

    def stop(self) -> None:
        with self.lock:
            pool, self.pool, self.ready = self.pool, None, []
            if self.timer is not None:
                self.timer.cancel()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _arm(self) -> None:
        if self.pool is None:
            return
        self.timer = threading.Timer(WORKERS_IDLE_S, self._stop_if_idle)
        self.timer.daemon = True
        self.timer.start()

    def _stop_if_idle(self) -> None:
        if not self.busy:
            self.stop()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While workers spawn: a spawned child imports the parent's main module first (a script's
    unguarded top level would run again in every worker: a script that loads a model would load
    it sixteen times). The workers need nothing of it, so the children are told of none."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


_WORKERS = _Workers()


def start_workers(device: Any, dtype: Any, workers: int | None = None) -> bool:
    """Start the compile workers (in the background; returns at once) where a pass will likely
    need them: a CUDA device, the fused kernels on for ``dtype``, compiling ahead in processes not
    switched off, and no pass marker yet for this Triton cache and these kernels (a cold cache).
    Call it as the weights start to load: a worker's imports (torch, Triton) take seconds, hidden
    there. Whether they started; never raises."""
    try:
        setting = os.environ.get("DDTREE_DIAG_COMPILE_AHEAD", "").strip().lower()
        if setting in ("off", "threads") or torch.device(device).type != "cuda":
            return False
        from ddtree_diag.engine.fast import kernels

        if not kernels.active(torch.device(device), dtype) or _markers_present():
            return False
        return _WORKERS.start(workers or min(16, os.cpu_count() or 1))
    except Exception:  # only ever a speed-up
        return False


def stop_workers() -> None:
    """Stop the compile workers now, if any run."""
    _WORKERS.stop()


def _marker(identity: str) -> Path | None:
    """The marker file of a pass over ``identity``'s kernels, or None where the parts of its key
    cannot be read (no marker: the pass always runs)."""
    directory = _markers_dir()
    if directory is None:
        return None
    return directory / hashlib.sha256(identity.encode()).hexdigest()[:32]


def _markers_dir() -> Path | None:
    """Where the markers of passes over this Triton (version, cache directory) and these kernels'
    sources go, None where that cannot be told."""
    try:
        import triton

        from ddtree_diag.engine.embedded import cache_root

        key = repr((triton.__version__, _triton_cache_dir(), _kernel_sources_digest()))
    except Exception:
        return None
    return cache_root() / "compile-ahead" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _markers_present() -> bool:
    """Whether any pass has compiled kernels of this source into this Triton cache (a warm cache:
    later passes there are mostly skipped, and compile few kernels where they run)."""
    directory = _markers_dir()
    try:
        return directory is None or any(directory.iterdir())
    except OSError:  # none yet (or unreadable)
        return False


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
