"""What the Triton kernel test modules share.

Without a GPU the kernels run through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``)
on CPU tensors; on a GPU the same tests compile real kernels (Triton runs ptxas) on CUDA tensors,
which makes them gpu tests, not unit tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
MARKS = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")] + ([pytest.mark.gpu] if DEVICE == "cuda" else [])


def record_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str, note: Callable[..., None]) -> None:
    """Replace ``module.name`` for the test by a wrapper that calls ``note`` with the call's
    arguments, then the original."""
    original = getattr(module, name)

    def recorded(*args, **kwargs):
        note(*args, **kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)


def skip_without_gpu() -> None:
    """Skip where the kernels would compile (no interpreter) but there is no CUDA device."""
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("compiled Triton kernels need CUDA")


def needs_async_compile() -> None:
    """Skip where this Triton cannot compile in a thread pool (the compile-ahead pass's threads)."""
    import triton

    if not hasattr(triton, "AsyncCompileMode"):
        pytest.skip(f"triton {triton.__version__} has no AsyncCompileMode")


def turn_kernels_on(monkeypatch: pytest.MonkeyPatch, *cleared: str, on: tuple[str, ...] = ()) -> None:
    """The fused kernels on for the test (CPU tensors too, under the interpreter): the per-kernel
    switches in ``cleared`` unset, those in ``on`` set to ``on``; skipped without a device."""
    skip_without_gpu()
    monkeypatch.setenv("DDTREE_DIAG_KERNELS", "on")
    for switch in cleared:
        monkeypatch.delenv(switch, raising=False)
    for switch in on:
        monkeypatch.setenv(switch, "on")
