"""Report files: JSON written atomically, read back for re-rendering and comparison."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddtree_diag.errors import UsageError
from ddtree_diag.records import RunReport


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` so that readers see the old file or the new one, never half of it."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    try:
        # backslashreplace: a lone surrogate (a server can send "\ud800" in JSON) is written as
        # the six characters \ud800, which is the same string again when the JSON is read back.
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def report_json(report: RunReport) -> str:
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n"


def write_report(report: RunReport, destination: str) -> None:
    """``-`` writes to stdout (and only JSON goes there); anything else is a file path."""
    text = report_json(report)
    if destination == "-":
        if hasattr(sys.stdout, "buffer"):
            sys.stdout.flush()
            sys.stdout.buffer.write(text.encode("utf-8", "backslashreplace"))
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
    else:
        write_atomic(destination, text)


def load_report(path: str | Path) -> RunReport:
    try:
        data: Any = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"report not found: {path}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: not a ddtree-diag JSON report ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not a ddtree-diag JSON report")
    try:
        return RunReport.from_dict(data)
    except (ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"{path}: {exc}") from None
