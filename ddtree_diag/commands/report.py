"""The ``report`` and ``diff`` commands: work on saved JSON runs, never on a server."""

from __future__ import annotations

import io
import sys

import typer

from ddtree_diag.commands.options import DEBUG, NO_COLOR
from ddtree_diag.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError
from ddtree_diag.output.reportfile import check_writable, dump_json, is_stdout, load_report, write_output

FORMATS = ("table", "markdown", "junit", "html")


def register(app: typer.Typer) -> None:
    @app.command()
    def report(
        run: str = typer.Argument(..., help="A JSON report written by probe/gate --json."),
        format: str = typer.Option("table", "--format", "-f", help=" | ".join(FORMATS) + "."),
        output: str | None = typer.Option(None, "--output", "-o", help="Write to PATH instead of stdout."),
        no_color: bool = NO_COLOR,
        debug: bool = DEBUG,
    ) -> None:
        """Re-render a saved run (exit code as the run's: 0 pass, 1 a check failed)."""
        raise typer.Exit(rerender(run, format, output=output, no_color=no_color))

    @app.command()
    def diff(
        a: str = typer.Argument(..., help="The reference run (JSON report)."),
        b: str = typer.Argument(..., help="The run to judge against it."),
        acceptance_tolerance: float = typer.Option(
            0.25, "--acceptance-tolerance", help="Per-case acceptance drop (tokens/round) allowed."
        ),
        tps_tolerance: float = typer.Option(
            0.30, "--tps-tolerance", help="Drop of the mean client tok/s allowed, as a fraction (0.3 = 30%)."
        ),
        fail_on_text_change: bool = typer.Option(
            False, "--fail-on-text-change", help="A changed T=0 text is a regression too."
        ),
        json_path: str | None = typer.Option(None, "--json", help="Write the comparison as JSON to PATH."),
        html: str | None = typer.Option(None, "--html", help="Write the comparison as a self-contained HTML page."),
        no_color: bool = NO_COLOR,
        debug: bool = DEBUG,
    ) -> None:
        """Compare two runs case by case; exit 1 on a regression beyond the tolerances."""
        raise typer.Exit(run_diff(a, b, acceptance_tolerance=acceptance_tolerance, tps_tolerance=tps_tolerance,
                                  fail_on_text_change=fail_on_text_change, json_path=json_path,
                                  html_path=html, no_color=no_color))


def rerender(path: str, fmt: str, *, output: str | None = None, no_color: bool = False) -> int:
    """Render a saved run as it was judged (its gate, findings and baseline are kept, not
    recomputed). Returns the run's exit code."""
    from ddtree_diag.orchestrator import exit_code_for
    from ddtree_diag.output import junit, markdown

    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    check_writable(output, "--output")
    report = load_report(path)
    code = exit_code_for(report)
    if fmt == "table":
        from ddtree_diag.output.console import make_console, render_report

        if output:
            buffer = io.StringIO()
            render_report(make_console(buffer, no_color=True), report, code)
            write_output(output, buffer.getvalue())
        else:
            render_report(make_console(sys.stdout, no_color=no_color), report, code)
        return code
    if fmt == "html":
        from ddtree_diag.output.html import html_report

        text = html_report(report, code)
    else:
        text = markdown.markdown_summary(report, code) if fmt == "markdown" else junit.junit_xml(report)
    if output:
        write_output(output, text)
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
    html_path: str | None = None,
    no_color: bool = False,
) -> int:
    from ddtree_diag.output.console import make_console
    from ddtree_diag.output.diff import Tolerances, diff_runs, render_diff

    if not (acceptance_tolerance >= 0 and tps_tolerance >= 0):  # NaN fails too
        raise UsageError("tolerances must be >= 0")
    check_writable(json_path, "--json")
    check_writable(html_path, "--html")
    a, b = load_report(a_path), load_report(b_path)
    result = diff_runs(a, b, Tolerances(acceptance_tolerance, tps_tolerance, fail_on_text_change))
    # With --json -, stdout carries the JSON alone and the comparison table goes to stderr.
    to_stdout = is_stdout(json_path)
    render_diff(make_console(sys.stderr if to_stdout else sys.stdout, no_color=no_color), result, a_path, b_path)
    text = dump_json(result.to_dict())
    if to_stdout:
        sys.stdout.write(text)
    elif json_path:
        write_output(json_path, text)
    if html_path:
        from ddtree_diag.output.html import html_diff

        write_output(html_path, html_diff(result, a_path, b_path))
    return EXIT_CHECK_FAILED if result.regressed else EXIT_OK
