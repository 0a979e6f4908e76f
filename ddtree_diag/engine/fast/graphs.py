"""CUDA-graph capture of a stage function over static buffers, and per-stage timing."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Stage:
    """A stage function over static buffers; on CUDA captured once as a graph and replayed.

    The second warm-up run (outside the capture) uses ``torch.cuda.set_sync_debug_mode("error")``: an op
    that would synchronise with the host, which a capture refuses, raises there with its stack
    instead of breaking the capture. A failed capture can leave the graph memory pool in a
    "recording" state that breaks every later capture, so after one the decoder stops capturing
    (``FastDecoder.capture_broken``) and the remaining stages run eagerly: slower, never wrong.
    """

    def __init__(self, fn: Callable[[], None], graphs: bool, pool: Any = None) -> None:
        self.fn, self.graph = fn, None
        self.error: str | None = None
        self.capture_failed = False
        if graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            previous = torch.cuda.get_sync_debug_mode()
            try:
                with torch.cuda.stream(stream):
                    fn()  # warm-up outside the capture: allocator, cuBLAS handles, compilation + autotuning
                    torch.cuda.set_sync_debug_mode("error")
                    fn()  # the same again, now any host sync raises
            except RuntimeError as exc:
                self.error = "host sync in the warm-up: " + _where(exc)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
            if self.error is None:
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        fn()
                    self.graph = graph
                except RuntimeError as exc:  # an op that cannot be captured: stay correct, run eagerly
                    self.capture_failed = True
                    self.error = "capture: " + _where(exc)
                    torch.cuda.synchronize()

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


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
