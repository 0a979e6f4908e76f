"""Command-line entry point (typer): the app, its commands (``ddtree_diag/commands``), and the
mapping of every failure to one line on stderr and a documented exit code.

Heavy modules (httpx, torch, transformers) are imported inside commands, so ``--help`` and the
remote path start fast.
"""

from __future__ import annotations

import contextlib
import os
import sys

import typer

from ddtree_diag import __version__
from ddtree_diag.commands import demo, engine_info, report, run, serve, textcheck, train
from ddtree_diag.commands.options import DEBUG
from ddtree_diag.errors import EXIT_INTERRUPTED, EXIT_USAGE, DiagError, one_line

app = typer.Typer(
    name="ddtree-diag",
    help="Is this speculative-decoding deployment healthy? Probe it, check its text, gate on it.\n\n"
    "Exit codes: 0 ok · 1 a check failed · 2 usage/config error · 3 target unreachable · "
    "130 interrupted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

def _version(value: bool) -> None:
    if value:
        typer.echo(f"ddtree-diag {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = DEBUG,
) -> None:
    """ddtree-diag"""


# Commands, in help order. Each module registers its own; none imports httpx or torch at load.
for _module in (run, textcheck, report, serve, engine_info, demo, train):
    _module.register(app)


def _click_exit_code(exc: Exception) -> int | None:
    """Exit code for click's own exceptions, or None for anything else. typer >= 0.26 bundles its
    own copy of click, so these are matched by shape rather than by class."""
    name = type(exc).__name__
    if name == "Abort":
        sys.stderr.write("ddtree-diag: interrupted\n")
        return EXIT_INTERRUPTED
    if name == "Exit" and isinstance(getattr(exc, "exit_code", None), int):
        return exc.exit_code
    if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
        exc.show()  # click's usage errors: "Usage: ... Error: ..." on stderr
        return EXIT_USAGE
    return None


def _stdout_identity() -> tuple[int, int] | None:
    try:
        stat = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return stat.st_dev, stat.st_ino


def _stdout_went_away(before: tuple[int, int] | None) -> bool:
    """Whether stdout was redirected to /dev/null during the run (what rich does on EPIPE)."""
    now = _stdout_identity()
    null = os.stat(os.devnull)
    return now is not None and now != before and now == (null.st_dev, null.st_ino)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app and map every failure to one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    for stream in (sys.stdout, sys.stderr):
        # Whatever a server sent (a lone surrogate) can always be printed, escaped if need be.
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    command = typer.main.get_command(app)
    stdout_was = _stdout_identity()
    try:
        # Without standalone mode click returns the code of a typer.Exit instead of raising it.
        returned = command.main(args=args, prog_name="ddtree-diag", standalone_mode=False)
        code = returned if isinstance(returned, int) else 0
    except KeyboardInterrupt:
        sys.stderr.write("ddtree-diag: interrupted\n")
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout left (``--help | head``): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        from ddtree_diag.output.console import silence_stdout

        silence_stdout()
        code = 0
    except SystemExit as exc:
        # click and rich answer a closed stdout (EPIPE) themselves with exit 1 (rich after pointing
        # stdout at /dev/null, click after wrapping it). A reader that stopped reading (``--help |
        # head``) is not a failure of ours.
        if exc.code != 1 or not (type(sys.stdout).__name__ == "PacifyFlushWrapper" or _stdout_went_away(stdout_was)):
            raise
        code = 0
    except DiagError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        sys.stderr.write(f"ddtree-diag: error: {one_line(str(exc))}\n")
        code = exc.exit_code
    except Exception as exc:
        code = _click_exit_code(exc)
        if code is None:  # a bug of ours: one line, the traceback only on request
            if debug:
                import traceback

                traceback.print_exc()
            first = one_line(str(exc).splitlines()[0]) if str(exc).strip() else ""
            sys.stderr.write(f"ddtree-diag: internal error: {type(exc).__name__}: {first} (rerun with --debug)\n")
            code = EXIT_USAGE
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        from ddtree_diag.output.console import silence_stdout

        silence_stdout()
    sys.exit(code)


if __name__ == "__main__":
    main()
