"""Output files (JSON report, JUnit, Markdown, re-rendered reports) and reading reports back.

What a CI user expects of ``--json/--junit/--summary/-o PATH``:

- ``check_writable`` runs before the run: a path that cannot be written is one line naming the flag
  and exit 2 at once, not after ten minutes of probing. It tries for real (a temporary file in the
  folder, or an append-open of the existing file): ``os.access`` says yes to root even in /proc.
- A regular file (new or existing) is written atomically: a temporary file in the same directory,
  fsync'd, then renamed over it, so a reader sees the old file or the new one. A symlink is
  followed: its target is replaced, the link stays. The mode of a new file follows the umask
  (0666 & ~umask, as a shell redirect gives); an existing file keeps its mode.
- Anything else (``/dev/null``, ``/dev/stdout``, a FIFO, a terminal) is written in place: renaming
  over a device would replace it with a file.
- A directory as target, a full disk, a read-only file system: one line naming the path.

Reports are strict JSON: non-finite numbers become null with a note, lone surrogates are escaped.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from ddtree_diag import jsonsafe
from ddtree_diag.errors import UsageError
from ddtree_diag.records import FleetReport, RunReport, is_fleet_dict
from ddtree_diag.redaction import redact, redact_data


def _umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def check_writable(path: str | None, flag: str = "output") -> None:
    """UsageError (exit 2, one line naming ``flag``) when ``path`` cannot be written. The check is
    real, not ``os.access`` (which says yes to root anywhere, /proc included): an existing regular
    file is opened for append (nothing truncated), a new one's folder gets a temporary file that is
    removed at once. Nothing is left behind; special files (FIFOs, devices) are never opened."""
    if not path or path == "-":
        return
    where = f"{flag} {path}"
    if os.path.basename(path) in ("", ".", ".."):
        raise UsageError(f"cannot write {where}: it names a directory")
    try:
        info = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        info = None
    except OSError as exc:  # a parent that is a file (ENOTDIR), a symlink loop, no permission
        raise UsageError(f"cannot write {where}: {_reason(exc)}") from None
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            raise UsageError(f"cannot write {where}: it is a directory")
        if not stat.S_ISREG(info.st_mode):
            # a FIFO would block until a reader came: only asked, never opened
            if not os.access(path, os.W_OK):
                raise UsageError(f"cannot write {where}: permission denied")
            return
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise UsageError(f"cannot write {where}: {_reason(exc)}") from None
        return
    # A new file (or a dangling symlink's target): the nearest existing folder must take it.
    folder = Path(os.path.realpath(path)).parent
    while not folder.exists():
        if folder.is_symlink() or folder == folder.parent:
            break
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"cannot write {where}: {folder} is not a directory")
    try:
        fd, temp = tempfile.mkstemp(prefix=".ddtree-diag-check.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise UsageError(f"cannot write {where}: cannot create a file in {folder} ({_reason(exc)})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(temp)


def write_output(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` as described in the module docstring. UsageError with
    one line when it cannot be done; a failed atomic write leaves the old file untouched."""
    path = str(path)
    if os.path.basename(path) in ("", ".", ".."):
        raise UsageError(f"cannot write {path}: it names a directory")
    data = text.encode("utf-8", "backslashreplace")  # lone surrogates cannot be UTF-8: shown escaped
    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {_reason(exc)}") from None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise UsageError(f"cannot write {path}: it is a directory")
    try:
        if info is not None and not stat.S_ISREG(info.st_mode):
            _write_in_place(path, data)  # a device, a FIFO, a socket: never replaced by a file
            return
        target = Path(os.path.realpath(path))  # a symlink's target is what gets replaced
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except PermissionError:
            if info is None:
                raise
            _write_in_place(path, data)  # a writable file in a folder we cannot create files in
            return
        _write_atomically(fd, temp, target, data, None if info is None else stat.S_IMODE(info.st_mode))
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {_reason(exc)}") from None


def _write_in_place(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()


def _write_atomically(fd: int, temp: str, target: Path, data: bytes, mode: int | None) -> None:
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp makes 0600 files; a report should get what `> file` would give it.
        os.chmod(temp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


# The old name, kept for callers and readers who know it.


def append_output(path: str, text: str) -> None:
    """Append (e.g. ``$GITHUB_STEP_SUMMARY``); UsageError with one line on failure."""
    try:
        with open(path, "ab") as handle:
            handle.write(text.encode("utf-8", "backslashreplace"))
    except OSError as exc:
        raise UsageError(f"cannot append to {path}: {_reason(exc)}") from None


def report_dict(report: RunReport | FleetReport) -> dict[str, Any]:
    """The report as strict-JSON-ready data: secrets redacted, non-finite numbers null (noted)."""
    replaced: list[str] = []
    data = jsonsafe.finite(redact_data(report.to_dict()), "", replaced)
    if replaced:
        shown = ", ".join(replaced[:5]) + (f" and {len(replaced) - 5} more" if len(replaced) > 5 else "")
        data.setdefault("notes", []).append(f"non-finite numbers written as null: {shown}")
    return data


def report_json(report: RunReport | FleetReport) -> str:
    if isinstance(report, FleetReport) and report.targets:
        return _fleet_json(report)
    return jsonsafe.dumps(report_dict(report)) + "\n"


def _fleet_json(report: FleetReport) -> str:
    """A fleet report's JSON, built one target at a time: the text of the whole dict dumped at
    once (a non-finite number is noted in its target's notes), without ever holding every
    target's dict (a 1,000-target fleet's is ~70 MB)."""
    import dataclasses

    head = jsonsafe.dumps(report_dict(dataclasses.replace(report, targets=[])))
    empty = '  "targets": []\n}'
    assert head.endswith(empty), "targets must be the fleet report's last key"
    pieces = []
    for index, member in enumerate(report.targets):
        replaced: list[str] = []
        # _level 2: the depth this dict has inside the fleet's, so deep nesting is cut where it was
        data = jsonsafe.finite(redact_data(member.to_dict()), f"targets[{index}]", replaced, 2)
        if replaced:  # said in the target's own notes
            shown = ", ".join(replaced[:5]) + (f" and {len(replaced) - 5} more" if len(replaced) > 5 else "")
            data["report"].setdefault("notes", []).append(f"non-finite numbers written as null: {shown}")
        pieces.append(textwrap.indent(jsonsafe.dumps(data), "    "))
    return head[: -len(empty)] + '  "targets": [\n' + ",\n".join(pieces) + "\n  ]\n}\n"


def is_stdout(path: str | None) -> bool:
    """``-``, or a path that names this process's stdout (``/dev/stdout``, ``/dev/fd/1``): the JSON
    then owns stdout and tables move to stderr, or the two would interleave."""
    if path == "-":
        return True
    if not path:
        return False
    try:
        here, there = os.fstat(sys.stdout.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured), or no such path yet
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def write_report(report: RunReport | FleetReport, destination: str) -> None:
    """``-`` (or a path naming stdout) writes to stdout, where only JSON goes; anything else is a
    file path."""
    text = report_json(report)
    if is_stdout(destination):
        if hasattr(sys.stdout, "buffer"):
            sys.stdout.flush()
            sys.stdout.buffer.write(text.encode("utf-8", "backslashreplace"))
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(text)
            sys.stdout.flush()
    else:
        write_output(destination, text)


def load_any(path: str | Path) -> RunReport | FleetReport:
    """A saved JSON report: a single run's or a fleet's. UsageError (one line) for anything else."""
    try:
        data: Any = jsonsafe.loads(Path(path).read_bytes(), what=str(path), max_depth=4 * jsonsafe.MAX_DEPTH)
    except FileNotFoundError:
        raise UsageError(f"report not found: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory, not a JSON report") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a ddtree-diag JSON report ({redact(str(exc))})") from None
    if not isinstance(data, dict) or not ("schema_version" in data or "results" in data):
        # other JSON (a diff's --json, a config): say what it is not, not which version it lacks
        raise UsageError(f"{path}: not a ddtree-diag JSON report")
    try:
        return FleetReport.from_dict(data) if is_fleet_dict(data) else RunReport.from_dict(data)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UsageError(f"{path}: {exc}") from None


def load_report(path: str | Path) -> RunReport:
    """A single run's saved report; a fleet report is one line saying so (exit 2)."""
    report = load_any(path)
    if isinstance(report, FleetReport):
        raise UsageError(f"{path} is a fleet report ({len(report.targets)} targets): this takes one run's report")
    return report


def dump_json(value: Any) -> str:
    """Strict JSON for other outputs (the diff's comparison)."""
    return jsonsafe.dumps(jsonsafe.finite(redact_data(value))) + "\n"

