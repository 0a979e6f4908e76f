"""Exit codes and the exceptions that carry them to the CLI.

The CLI turns a DiagError into one line on stderr and its exit code; only ``--debug`` shows a
traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # a gate or check failed (garbage, lossless mismatch, threshold)
EXIT_USAGE = 2  # bad flags, bad TOML, bad URL, missing model files
EXIT_TRANSPORT = 3  # the target could not be reached
EXIT_INTERRUPTED = 130  # Ctrl-C; the partial report was still written
# SIGTERM (a CI cancel, `timeout`, a container stop) and SIGHUP (the SSH session went away) end a
# run like Ctrl-C, with the shell's 128 + signal number: 143 and 129.


def one_line(text: object, limit: int | None = None) -> str:
    """Any message as one line (whitespace runs collapsed), cut to ``limit`` characters with an
    ellipsis, with every secret of this run masked: how errors reach a user or a report."""
    from ddtree_diag.redaction import redact

    line = " ".join(str(text).split())
    if limit is not None and len(line) > limit:
        line = line[: max(1, limit - 1)] + "…"
    return redact(line)


class DiagError(Exception):
    """An error the user can act on; its message is one line."""

    exit_code = EXIT_USAGE


class UsageError(DiagError):
    exit_code = EXIT_USAGE


class TransportError(DiagError):
    exit_code = EXIT_TRANSPORT


class Terminated(KeyboardInterrupt):
    """A termination signal during a run, handled as Ctrl-C is (partial reports are written)."""

    def __init__(self, signum: int, name: str) -> None:
        super().__init__(name)
        self.signum = signum
        self.name = name
        self.exit_code = 128 + signum
