"""Say on stderr what a long wait is (a model loading, the embedded cache being built), so a
command never sits silent for a minute.

On a terminal: a rich spinner with the elapsed time, then one line with the time it took.
Anywhere else (a CI log, a pipe): a line when the wait starts and one when it ends, flushed at
once. With ``--quiet``: nothing. Commands set quiet with ``configure`` (``options.run_options``
does it for probe and gate); the engine's load functions call ``waiting`` and need not know.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

_state: dict[str, Any] = {"quiet": False, "no_color": False, "status": None, "depth": 0}


def configure(*, quiet: bool = False, no_color: bool = False) -> None:
    _state["quiet"] = quiet
    _state["no_color"] = no_color


@contextlib.contextmanager
def configured(*, quiet: bool = False, no_color: bool = False) -> Iterator[None]:
    """``configure`` for the length of a command, then back to what it was."""
    before = (_state["quiet"], _state["no_color"])
    configure(quiet=quiet, no_color=no_color)
    try:
        yield
    finally:
        configure(quiet=before[0], no_color=before[1])


def is_quiet() -> bool:
    return bool(_state["quiet"])


def _stderr_is_terminal() -> bool:
    stream = sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False


def _write(line: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


@contextlib.contextmanager
def waiting(message: str) -> Iterator[None]:
    """``with waiting("loading target model X"):`` around something slow. ``message`` names what
    is happening, without a trailing ellipsis. A wait inside another is shown in the outer one's
    spinner on a terminal and not at all in a log (the outer line already says it)."""
    if _state["quiet"]:
        yield
        return
    started = time.monotonic()
    outer = _state["status"]
    if not _stderr_is_terminal():
        if _state.get("depth"):  # inside another wait, which already said what this is
            yield
            return
        _write(f"ddtree-diag: {message}…")
        _state["depth"] = 1
        try:
            yield
        finally:
            _state["depth"] = 0
        _write(f"ddtree-diag: {message}: done in {time.monotonic() - started:.1f} s")
        return
    if outer is not None:  # inside another wait: the one spinner says the inner step for now
        before = outer.status
        outer.update(f"{message}…")
        try:
            yield
        finally:
            outer.update(before)
        return
    from rich.console import Console

    console = Console(stderr=True, no_color=_state["no_color"], highlight=False)
    status = console.status(f"{message}…")
    _state["status"] = status
    try:
        with status:
            yield
    finally:
        _state["status"] = None
    console.print(f"✓ {message}: done in {time.monotonic() - started:.1f} s", style="dim", markup=False)
