"""The ``report`` and ``diff`` commands: work on saved JSON runs, never on a server."""

from __future__ import annotations

import io
import sys
from typing import TYPE_CHECKING

import typer

from ddtree_diag.commands.options import DEBUG, NO_COLOR
from ddtree_diag.errors import EXIT_CHECK_FAILED, EXIT_OK, UsageError

if TYPE_CHECKING:
    from ddtree_diag.records import FleetReport, RunReport

FORMATS = ("table", "markdown", "junit", "html", "json")


def register(app: typer.Typer) -> None:
    @app.command()
    def report(
        runs: list[str] = typer.Argument(..., metavar="RUN.json...", help="A JSON report written by probe/gate "
                                         "--json (a run's or a fleet's); several with --merge."),
        format: str = typer.Option("table", "--format", "-f", help=" | ".join(FORMATS) + "."),
        output: str | None = typer.Option(None, "--output", "-o", help="Write to PATH instead of stdout."),
        merge: bool = typer.Option(False, "--merge", help="Join the reports (runs and fleets, e.g. made from "
                                   "several machines) into one fleet report, judged as one fleet."),
        target: str | None = typer.Option(None, "--target", metavar="NAME",
                                          help="A fleet report: render only this target's run."),
        detail: bool = typer.Option(False, "--detail", help="A fleet report: every target's own tables too."),
        no_color: bool = NO_COLOR,
        debug: bool = DEBUG,
    ) -> None:
        """Re-render a saved run or fleet (exit code as the run's: 0 pass, 1 a check failed)."""
        raise typer.Exit(rerender(runs, format, output=output, no_color=no_color, merge=merge, target=target,
                                  detail=detail))

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


def rerender(paths: str | list[str], fmt: str, *, output: str | None = None, no_color: bool = False,
             merge: bool = False, target: str | None = None, detail: bool = False) -> int:
    """Render a saved run or fleet as it was judged (its gate, findings and baseline are kept, not
    recomputed; ``merge`` joins several into one fleet, whose cross-target verdict is computed).
    Returns the run's exit code."""
    from ddtree_diag.output.reportfile import check_writable, load_any
    from ddtree_diag.records import FleetReport

    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    paths = [paths] if isinstance(paths, str) else list(paths)
    if len(paths) > 1 and not merge:
        raise UsageError(f"{len(paths)} reports given: add --merge to join them into one fleet report")
    check_writable(output, "--output")
    loaded = [(path, load_any(path)) for path in paths]
    if merge:
        report: RunReport | FleetReport = _merged(loaded)
    else:
        report = loaded[0][1]
    if target is not None:
        if not isinstance(report, FleetReport):
            raise UsageError(f"--target {target}: {paths[0]} is one run's report, not a fleet's")
        member = report.member(target)
        if member is None:
            names = ", ".join(m.name for m in report.targets[:8])
            raise UsageError(f"--target {target}: no such target in the fleet (targets: {names}"
                             + (", …" if len(report.targets) > 8 else "") + ")")
        report = member.report
    if isinstance(report, FleetReport):
        return _render_fleet(report, fmt, output=output, no_color=no_color, detail=detail)
    return _render_run(report, fmt, output=output, no_color=no_color)


def _merged(loaded: list[tuple[str, RunReport | FleetReport]]) -> FleetReport:
    """One fleet from several reports, judged as one: every target's own gate decides whether
    the fleet is gated (any target gated: the fleet is)."""
    from ddtree_diag import fleet

    merged = fleet.merge(loaded)
    gated = any(m.report.gate is not None for m in merged.targets)
    fleet.judge(merged, gate=gated)
    return merged


def _emit(text: str, output: str | None) -> None:
    from ddtree_diag.output.reportfile import write_output

    if output:
        write_output(output, text)
    else:
        sys.stdout.write(text)


def _render_run(report: RunReport, fmt: str, *, output: str | None, no_color: bool) -> int:
    from ddtree_diag.orchestrator import exit_code_for
    from ddtree_diag.output import junit, markdown

    code = exit_code_for(report)
    if fmt == "table":
        from ddtree_diag.output.console import make_console, render_report

        if output:
            buffer = io.StringIO()
            render_report(make_console(buffer, no_color=True), report, code)
            _emit(buffer.getvalue(), output)
        else:
            render_report(make_console(sys.stdout, no_color=no_color), report, code)
        return code
    if fmt == "json":
        from ddtree_diag.output.reportfile import report_json

        text = report_json(report)
    elif fmt == "html":
        from ddtree_diag.output.html import html_report

        text = html_report(report, code)
    else:
        text = markdown.markdown_summary(report, code) if fmt == "markdown" else junit.junit_xml(report)
    _emit(text, output)
    return code


def _render_fleet(report: FleetReport, fmt: str, *, output: str | None, no_color: bool, detail: bool) -> int:
    from ddtree_diag import fleet
    from ddtree_diag.output import fleetview

    code = fleet.exit_code_for(report)
    if fmt == "table":
        from ddtree_diag.output.console import make_console

        if output:
            buffer = io.StringIO()
            fleetview.render_fleet(make_console(buffer, no_color=True), report, code, detail=detail)
            _emit(buffer.getvalue(), output)
        else:
            fleetview.render_fleet(make_console(sys.stdout, no_color=no_color), report, code, detail=detail)
        return code
    if fmt == "json":
        from ddtree_diag.output.reportfile import report_json

        text = report_json(report)
    elif fmt == "html":
        text = fleetview.html_fleet(report, code)
    elif fmt == "markdown":
        text = fleetview.fleet_markdown(report, code)
    else:
        text = fleetview.fleet_junit_xml(report)
    _emit(text, output)
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
    """Compare two saved reports; either may be a fleet's (then target by target, see
    ``output.fleetdiff``). Returns 1 on a regression, else 0."""
    from ddtree_diag.output.console import make_console
    from ddtree_diag.output.diff import RunDiff, Tolerances, diff_runs, render_diff
    from ddtree_diag.output.fleetdiff import FleetDiff, diff_fleets, render_fleet_diff
    from ddtree_diag.output.reportfile import check_writable, dump_json, is_stdout, load_any, write_output
    from ddtree_diag.records import RunReport

    if not (acceptance_tolerance >= 0 and tps_tolerance >= 0):  # NaN fails too
        raise UsageError("tolerances must be >= 0")
    check_writable(json_path, "--json")
    check_writable(html_path, "--html")
    a, b = load_any(a_path), load_any(b_path)
    tolerances = Tolerances(acceptance_tolerance, tps_tolerance, fail_on_text_change)
    # With --json -, stdout carries the JSON alone and the comparison table goes to stderr.
    to_stdout = is_stdout(json_path)
    console = make_console(sys.stderr if to_stdout else sys.stdout, no_color=no_color)
    result: RunDiff | FleetDiff
    if isinstance(a, RunReport) and isinstance(b, RunReport):  # two single runs: as always
        result = diff_runs(a, b, tolerances)
        render_diff(console, result, a_path, b_path)
    else:
        result = diff_fleets(a, b, tolerances)
        render_fleet_diff(console, result, a_path, b_path)
    text = dump_json(result.to_dict())
    if to_stdout:
        sys.stdout.write(text)
    elif json_path:
        write_output(json_path, text)
    if html_path:
        from ddtree_diag.output.fleetdiff import html_fleet_diff
        from ddtree_diag.output.html import html_diff

        page = (html_fleet_diff(result, a_path, b_path) if isinstance(result, FleetDiff)
                else html_diff(result, a_path, b_path))
        write_output(html_path, page)
    return EXIT_CHECK_FAILED if result.regressed else EXIT_OK
