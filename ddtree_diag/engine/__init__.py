"""In-process DDTree engine (torch + transformers). See ``load.py`` for the public API.

Importing this package is light: torch/transformers load only when ``load_engine`` is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddtree_diag.engine.generate import Engine


def load_engine(
    target: str | Path,
    draft: str | Path | None = None,
    gguf_file: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> Engine:
    """Load a target (HF directory or GGUF) and an optional DFlash draft; see ``load.load_engine``."""
    from ddtree_diag.engine.load import load_engine as _load

    return _load(target, draft=draft, gguf_file=gguf_file, device=device, dtype=dtype)


__all__ = ["load_engine"]
