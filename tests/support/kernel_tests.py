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
