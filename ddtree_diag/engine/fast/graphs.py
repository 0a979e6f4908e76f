"""CUDA-graph capture of a stage function over static buffers, and per-stage timing."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ddtree_diag.errors import UsageError

# The BLAS libraries a stage's GEMMs can run through (``torch.backends.cuda.preferred_blas_library``).
# Their heuristics pick different kernels for a verify's skinny shapes: on an H100, cuBLASLt ran the
# 27B down projection in 60 us against cuBLAS's 64-68 at 17-65 rows, and slower at 256 rows
# (``python -m bench.gemm_shapes --backends``). Which is faster per stage depends on the card and
# the shapes, so a stage that may choose is captured under each and the faster replay is kept.
BLAS_LIBRARIES = ("cublas", "cublaslt")
# A replay must be this much faster to switch libraries. Below it the two are noise apart, and a
# choice that flips from process to process would make bf16 runs differ at near-ties (the libraries'
# kernels sum in other orders); the gains taken were 1.3-3 % (H100: 27B verify at 17 / 65 rows, 8B
# at 65).
BLAS_MARGIN = 0.01
_lt_warned = False


def blas_setting() -> str:
    """``DDTREE_DIAG_BLAS``: "auto" (default: each draft / verify stage shape measured under each
    BLAS library when it is captured, the faster kept), or one of ``BLAS_LIBRARIES`` for
    every stage."""
    value = os.environ.get("DDTREE_DIAG_BLAS", "").strip().lower() or "auto"
    if value not in ("auto", *BLAS_LIBRARIES):
        raise UsageError(f"DDTREE_DIAG_BLAS={value!r}: use auto, {' or '.join(BLAS_LIBRARIES)}")
    return value


def blas_plan(dtype: torch.dtype) -> str | None:
    """What the GEMMs of the stages captured in ``dtype`` run through: the library DDTREE_DIAG_BLAS
    fixes, "auto" (bf16 / fp16: chosen per stage shape by its replays), or None (fp32, the dtype
    the lossless checks compare in: torch's default, as the eager path runs)."""
    setting = blas_setting()
    if setting != "auto":
        return setting
    return "auto" if dtype in (torch.bfloat16, torch.float16) else None


def _library_name(backend: object) -> str:
    """"cublas" / "cublaslt" / ... for torch's backend enum (or a name)."""
    return str(getattr(backend, "name", backend)).lower()


def _set_library(backend: object) -> None:
    """Set torch's preferred BLAS library. torch warns once a process, on C++'s stderr, that
    choosing one other than cuBLAS is experimental: the README says so where the choice is
    documented, so that first switch goes to /dev/null instead of a probe's terminal."""
    global _lt_warned
    if _library_name(backend) != "cublas" and not _lt_warned:
        _lt_warned = True
        with _quiet_stderr():
            torch.backends.cuda.preferred_blas_library(backend)
    else:
        torch.backends.cuda.preferred_blas_library(backend)


@contextmanager
def blas_library(name: str | None) -> Iterator[None]:
    """GEMMs inside run through ``name`` ("cublas" / "cublaslt"; None: as they are). The choice
    is read when a GEMM is launched, so a graph captured inside keeps that library's kernels."""
    if name is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    _set_library(name)
    try:
        yield
    finally:
        _set_library(previous)


@functools.cache
def blas_switchable() -> bool:
    """Whether this torch build can switch its CUDA GEMMs to every one of ``BLAS_LIBRARIES`` (one
    built without cuBLASLt refuses): if not, no stage chooses."""
    try:
        for name in BLAS_LIBRARIES:
            with blas_library(name):
                pass
    except (RuntimeError, ValueError, AttributeError):
        return False
    return True


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 pointed at /dev/null inside (C++ writes there, not to ``sys.stderr``).
    Process-wide for the moment it lasts (one preference switch, once a process); where fd 2
    cannot be duplicated (closed), nothing is redirected."""
    if sys.stderr is not None:
        sys.stderr.flush()  # what Python holds for fd 2 goes out before, not into /dev/null
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Stage:
    """A stage function over static buffers; on CUDA captured once as a graph and replayed.

    The second warm-up run (outside the capture) uses ``torch.cuda.set_sync_debug_mode("error")``: an op
    that would synchronise with the host, which a capture refuses, raises there with its stack
    instead of breaking the capture. A failed capture can leave the graph memory pool in a
    "recording" state that breaks every later capture, so after one the decoder stops capturing
    (``FastDecoder.capture_broken``) and the remaining stages run eagerly: slower, never wrong.

    ``blas``: the BLAS library its GEMMs are captured with (None: torch's current one).
    ``choose_blas``: capture it under each of ``BLAS_LIBRARIES`` instead, time their replays
    (alternated, best of ``BLAS_TRIALS``) and keep the faster graph; ``blas`` and ``blas_ms``
    then say which and the times. Where an alternative will not capture, the stage keeps the
    first library's graph and ``blas_error`` says why (a failed capture still sets
    ``capture_failed``: the pool it used may be broken). The function must give the same result
    when run again on the same inputs (the draft and verify stages do: they write what they
    compute, nothing advances).
    """

    BLAS_TRIALS = 4

    def __init__(
        self, fn: Callable[[], None], graphs: bool, pool: Any = None, blas: str | None = None,
        choose_blas: bool = False,
    ) -> None:
        self.fn, self.graph = fn, None
        self.error: str | None = None
        self.capture_failed = False
        self.blas = blas
        self.blas_ms: dict[str, float] = {}
        self.blas_error: str | None = None
        if not graphs:
            return
        if not choose_blas or not blas_switchable():
            self.graph, self.error = self._capture(pool, blas)
            return
        self.blas = BLAS_LIBRARIES[0]
        self.graph, self.error = self._capture(pool, self.blas)
        if self.graph is None:
            self.blas = None
            return
        graphs_by_library = {self.blas: self.graph}
        for library in BLAS_LIBRARIES[1:]:
            graph, error = self._capture(pool, library)
            if graph is None:
                self.blas_error = f"under {library}: {error}"
                return
            graphs_by_library[library] = graph
        self.blas_ms = _fastest_replays(graphs_by_library, self.BLAS_TRIALS)
        self.blas = faster_library(self.blas_ms)
        self.graph = graphs_by_library[self.blas]

    def _capture(self, pool: Any, blas: str | None) -> tuple[Any, str | None]:
        """(the function captured as a graph with GEMMs through ``blas``, None), after a warm-up
        run and a second one that raises on a host sync; (None, why) where it cannot be."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        previous = torch.cuda.get_sync_debug_mode()
        with blas_library(blas):
            try:
                with torch.cuda.stream(stream):
                    self.fn()  # warm-up outside the capture: allocator, BLAS handles, compilation + autotuning
                    torch.cuda.set_sync_debug_mode("error")
                    self.fn()  # the same again, now any host sync raises
            except RuntimeError as exc:
                return None, "host sync in the warm-up: " + _where(exc)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.fn()
                return graph, None
            except RuntimeError as exc:  # an op that cannot be captured: stay correct, run eagerly
                self.capture_failed = True
                torch.cuda.synchronize()
                return None, "capture: " + _where(exc)

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:  # not captured (or it would not be): the same GEMM library the graph would have had
            with blas_library(self.blas):
                self.fn()


def faster_library(blas_ms: dict[str, float]) -> str:
    """The library of ``BLAS_LIBRARIES`` to keep, given each one's replay time: the first (torch's
    default) unless another is faster by more than ``BLAS_MARGIN``."""
    default = BLAS_LIBRARIES[0]
    best = min(BLAS_LIBRARIES, key=lambda name: blas_ms[name])
    return best if blas_ms[best] < blas_ms[default] * (1 - BLAS_MARGIN) else default


def _fastest_replays(graphs: dict[str, Any], trials: int) -> dict[str, float]:
    """Each graph's best replay time in ms over ``trials`` rounds that replay every graph once,
    in turn and in alternating order (a clock or power change mid-way then costs each alike).
    Each timed replay is queued behind a short GPU wait, so it runs as a decode round's do (the
    host's launch hidden behind work already queued) and its time is the GPU's alone."""
    best = dict.fromkeys(graphs, float("inf"))
    for graph in graphs.values():  # once each first: the replays' own first-launch work
        graph.replay()
    order = list(graphs.items())
    for trial in range(trials):
        for name, graph in order if trial % 2 == 0 else order[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_LAUNCH_COVER_CYCLES)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end))
    return best


# GPU clock cycles (~0.5 ms) the stream waits before a timed replay: longer than launching a
# stage's graph takes the host
_LAUNCH_COVER_CYCLES = 1_000_000


def _where(exc: BaseException) -> str:
    """First line of an error plus the innermost frame of this package that raised it."""
    import traceback

    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ddtree_diag" in f.filename]
    if frames:
        frame = frames[-1]
        message += f" (at {Path(frame.filename).name}:{frame.lineno} {frame.line})"
    return message


class StageTimer:
    """Stage times per round: CUDA events on the GPU (no sync until the round's own), else wall clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [("", self._now())]

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def elapsed(self) -> list[tuple[str, float]]:
        """(stage, seconds) between consecutive marks of the round."""
        out = []
        for (_, before), (name, after) in zip(self.marks, self.marks[1:], strict=False):
            if self.cuda:
                after.synchronize()
                out.append((name, before.elapsed_time(after) / 1000))
            else:
                out.append((name, after - before))
        return out
