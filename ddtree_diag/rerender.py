"""The ``report`` and ``diff`` commands: work on saved JSON runs, never on a server."""

from __future__ import annotations

import json
import sys

from ddtree_diag.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError
from ddtree_diag.report import load_report, write_atomic

FORMATS = ("table", "markdown", "junit")


def rerender(path: str, fmt: str, *, output: str | None = None, no_color: bool = False) -> int:
    """Render a saved run as it was judged (its gate, findings and baseline are kept, not
    recomputed). Returns the run's exit code."""
    from ddtree_diag import formats
    from ddtree_diag.probe import exit_code_for

    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    report = load_report(path)
    code = exit_code_for(report)
    if fmt == "table":
        from ddtree_diag.render import make_console, render_report

        if output:
            with open(output, "w", encoding="utf-8") as handle:
                render_report(make_console(handle, no_color=True), report, code)
        else:
            render_report(make_console(sys.stdout, no_color=no_color), report, code)
        return code
    text = formats.markdown_summary(report, code) if fmt == "markdown" else formats.junit_xml(report)
    if output:
        write_atomic(output, text)
    else:
        sys.stdout.write(text)
    return code


def run_diff(
    a_path: str,
    b_path: str,
    *,
    acceptance_tolerance: float = 0.25,
    tps_tolerance: float = 0.30,
    fail_on_text_change: bool = False,
    json_path: str | None = None,
    no_color: bool = False,
) -> int:
    from ddtree_diag.compare import Tolerances, diff_runs, render_diff
    from ddtree_diag.render import make_console

    if acceptance_tolerance < 0 or tps_tolerance < 0:
        raise UsageError("tolerances must be >= 0")
    a, b = load_report(a_path), load_report(b_path)
    result = diff_runs(a, b, Tolerances(acceptance_tolerance, tps_tolerance, fail_on_text_change))
    # With --json -, stdout carries the JSON alone and the comparison table goes to stderr.
    to_stdout = json_path == "-"
    render_diff(make_console(sys.stderr if to_stdout else sys.stdout, no_color=no_color), result, a_path, b_path)
    text = json.dumps(result.to_dict(), indent=2, ensure_ascii=False) + "\n"
    if to_stdout:
        sys.stdout.write(text)
    elif json_path:
        write_atomic(json_path, text)
    return EXIT_CHECK_FAILED if result.regressed else EXIT_OK
