"""Terminal output at 80, 120 and 200 columns (tables, pivot, findings, diff: nothing wider than
the terminal, no number or header cut), progress lines for CI logs, and a closed stdout."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest
from rich.cells import cell_len
from rich.console import Console

from ddtree_diag.output.console import progress, progress_line, render_report, results_columns
from ddtree_diag.output.diff import diff_runs, render_diff
from tests.support.processes import ROOT
from tests.support.reportkit import slower_copy, varied_report

WIDTHS = (80, 120, 200)


def rendered(width: int, draw, *, terminal: bool = False) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal, no_color=True,
                      color_system=None, highlight=False, emoji=False, legacy_windows=False)
    draw(console)
    return console.file.getvalue()


def numbers_of(report) -> list[str]:
    """Every number the per-case table shows, as the table formats it."""
    values = []
    for column in results_columns(report):
        if column.kind == "number":
            values += [c.plain if hasattr(c, "plain") else str(c) for c in column.cells]
    return [v for v in values if v != "—"]


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.unit
@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
@pytest.mark.parametrize("width", WIDTHS)
def test_run_fits_the_width_without_cutting_numbers_or_headers(width, terminal):
    report = varied_report()
    out = rendered(width, lambda c: render_report(c, report, 3), terminal=terminal)
    lines = out.splitlines()
    assert max(cell_len(line) for line in lines) <= width
    dropped = re.search(r"left out at \d+ columns: (.*) \(see", out)
    left_out = set(dropped.group(1).split(", ")) if dropped else set()
    assert left_out <= {"output"}, "only the free-text column may be left out"
    if width == 200:
        assert not left_out and "Hello! It is nice to meet you." in out
    for column in results_columns(report):
        if column.header not in left_out:  # every header on one line, whole
            assert any(re.search(rf"(^|\s|[|│┃]){re.escape(column.header)}($|\s|[|│┃])", line) for line in lines), \
                column.header
    for number in numbers_of(report):  # every number whole, on one line
        assert any(re.search(rf"(^|[\s|│┃~*]){re.escape(number)}($|[\s|│┃])", line) for line in lines), number
    # the pivot, the findings (wrapped, never cut) and the gate are all there
    assert "budget \\ thinking" in out and "3.40" in out
    flat = words(out)
    for finding in report.findings:
        assert words(finding.evidence) in flat and words(finding.check) in flat
    assert "gate: FAILED" in out and "exit 3" in out
    if not left_out:  # a failed case shows its error where the output would be
        assert "connection refused by" in out


@pytest.mark.unit
def test_a_typical_smoke_run_is_one_table_with_its_output_at_120_columns():
    report = varied_report()
    report.results = report.results[:2]  # one prompt, two budgets: the usual smoke shape
    out = rendered(120, lambda c: render_report(c, report, 1))
    header = next(line for line in out.splitlines() if " tok/s cli " in line)
    assert "output" in header and "quality" in header and "left out" not in out


@pytest.mark.unit
@pytest.mark.parametrize("width", WIDTHS)
def test_diff_fits_the_width_and_has_no_spacer_rows(width):
    a = varied_report()
    diff = diff_runs(a, slower_copy(a))
    out = rendered(width, lambda c: render_diff(c, diff, "runs/a.json", "runs/b.json"))
    lines = out.splitlines()
    assert max(cell_len(line) for line in lines) <= width
    for header in ("case", "accept A", "accept B", "tok/s A", "tok/s B"):
        assert any(header in line for line in lines), header
    for number in ("3.00", "2.50", "41.2", "20.6", "1.33", "0.83"):
        assert any(re.search(rf"(^|\s|\|){re.escape(number)}($|\s|\|)", line) for line in lines), number
    # no blank row inside the table: every table line between the rules holds text
    body = [line for line in lines if line.startswith("|") and not set(line) <= set("|+-= ")]
    assert all(line.strip("| ").strip() for line in body)
    assert not any(re.fullmatch(r"\|(\s*\|)+", line) for line in lines)


@pytest.mark.unit
def test_diff_of_runs_without_a_shared_case_says_so():
    a = varied_report()
    b = slower_copy(a)
    for result in b.results:
        result.case.max_tokens = 512
    diff = diff_runs(a, b)
    assert diff.shared == 0 and diff.to_dict()["shared_cases"] == 0
    out = rendered(120, lambda c: render_diff(c, diff, "a.json", "b.json"))
    assert out.splitlines()[0] == "no shared cases: a.json and b.json have no case id in common"
    assert "the runs share no cases (A has 5, B has 5)" in out


@pytest.mark.unit
def test_progress_lines_in_a_log_and_quiet():
    report = varied_report()
    log = Console(file=io.StringIO(), force_terminal=False, width=80)
    with progress(log, len(report.results)) as advance:
        for result in report.results:
            advance(result)
    lines = log.file.getvalue().splitlines()
    assert lines == [progress_line(r, i, 5) for i, r in enumerate(report.results, 1)]
    assert lines[0] == "[1/5] hello/think=off/budget=16/T=0/max=48/r0  accept 3.00  tok/s 41.2  ✓"
    assert lines[2].endswith("tok/s 12.8  ✗ degenerate_enumeration")
    assert lines[4].startswith("[5/5] story/think=off/budget=16/T=0.7/max=128/r0  accept —  tok/s —  "
                               "✗ transport_error: connection refused")
    quiet = Console(file=io.StringIO(), force_terminal=False)
    tracker = progress(quiet, 5, quiet=True)
    with tracker as advance:
        advance(report.results[0])
        tracker.note("baseline starting")
    assert quiet.file.getvalue() == ""


@pytest.mark.unit
def test_progress_on_a_terminal_is_a_bar_not_lines():
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
    report = varied_report()
    tracker = progress(terminal, 5)
    with tracker as advance:
        advance(report.results[0])
        tracker.note("baseline starting")
    assert "[1/5]" not in terminal.file.getvalue() and "baseline starting" not in terminal.file.getvalue()


def test_ci_log_shows_one_line_per_case_and_quiet_silences_it(standin, cli):
    server = standin("--dialect", "ddtree")
    shown = cli("probe", "--url", server.url, "--baseline", "budget0")
    assert shown.code == 0, shown.stderr
    lines = [line for line in shown.stderr.splitlines() if line.startswith("[")]
    assert [line.split()[0] for line in lines] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert all("accept 2.33" in line and line.endswith("✓") for line in lines)
    assert "baseline (same server, tree_budget=0): running the T=0 cases" in shown.stderr
    quiet = cli("probe", "--url", server.url, "--quiet")
    assert quiet.code == 0 and quiet.stderr == "" and "4 cases" in quiet.stdout


def _closed_early(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with its stdout read by nobody: the pipe is closed before it writes."""
    process = subprocess.Popen([sys.executable, "-m", "ddtree_diag", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    stderr = process.stderr.read()
    return subprocess.CompletedProcess(args, process.wait(timeout=120), "", stderr)


@pytest.mark.e2e
@pytest.mark.parametrize("args", [("--help",), ("probe", "--help"), ("gate", "--help")])
def test_help_into_a_closed_pipe_exits_0(args):
    done = _closed_early(*args)
    assert done.returncode == 0 and done.stderr == ""


def test_a_run_into_a_closed_pipe_keeps_its_exit_code_and_files(standin, tmp_path):
    server = standin("--dialect", "ddtree", "--lossy")
    done = _closed_early("probe", "--url", server.url, "--baseline", "budget0", "--quiet", "--json",
                         str(tmp_path / "run.json"), "--html", str(tmp_path / "run.html"))
    assert done.returncode == 1 and "Traceback" not in done.stderr  # the lossless mismatch, not the pipe
    assert (tmp_path / "run.json").is_file() and (tmp_path / "run.html").is_file()
