"""Terminal rendering with rich: the per-case table, the acceptance pivot, notes and a summary.

On a TTY: colour and unicode boxes. Anywhere else (pipes, CI logs, files): no colour, simple
ASCII-friendly layout and a fixed width, so the output is stable and greppable.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from statistics import mean
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ddtree_diag.output.cells import (
    DASH,
    Cell,
    acceptance_cell,
    acceptance_style,
    by_budget_and_thinking,
    context_rows,
    fmt,
    lossless_cell,
    output_text,
    quality_cell,
    rounds_cell,
    ttft_cell,
    visible,
    workload_cell,
)
from ddtree_diag.output.depth import depth_table
from ddtree_diag.output.fit import FREE, NUMBER, TEXT, Column, fit_tables, print_tables
from ddtree_diag.output.loadview import load_table
from ddtree_diag.records import Finding, GateResult, ProbeResult, RunReport, budget_label, thinking_label
from ddtree_diag.redaction import redact, redacted_report


def silence_stdout() -> None:
    """The reader of stdout went away (``| head``): send what is left to /dev/null, so the
    interpreter's final flush does not fail too."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Stop writing and raise BrokenPipeError, which the commands handle, instead of rich's
        own exit 1: a run piped into ``head`` keeps its exit code."""
        self.quiet = True
        silence_stdout()
        raise BrokenPipeError


def make_console(file: IO[str] | None = None, *, no_color: bool = False) -> Console:
    """A console that is rich on a terminal and plain and stable everywhere else."""
    file = file or sys.stdout
    is_tty = hasattr(file, "isatty") and file.isatty()
    if no_color or os.environ.get("NO_COLOR"):
        no_color = True
    if is_tty:
        return _Console(file=file, no_color=no_color, highlight=False)
    width = int(os.environ.get("COLUMNS", "0") or 0) or 200
    return _Console(
        file=file, no_color=True, force_terminal=False, width=width, highlight=False,
        color_system=None, emoji=False,
    )


def _text(cell: Cell) -> Text:
    return Text(cell.text, style=cell.style)


def _title(report: RunReport) -> str:
    target = report.target
    bits = [target.get("url") or target.get("engine") or "", target.get("model") or ""]
    if target.get("dialect"):
        bits.append(f"dialect {target['dialect']}")
    return " · ".join(b for b in bits if b)


def results_columns(report: RunReport) -> list[Column]:
    """The per-case table as columns; axes that do not vary across the run are left out."""
    results = report.results

    def varies(getter) -> bool:
        return len({getter(r.case) for r in results}) > 1

    def column(header: str, kind: str, values: list[Any], justify: str = "right", key: bool = False) -> Column:
        return Column(header, kind, justify if kind == NUMBER else "left", values, key)

    def ok_only(getter) -> list[Any]:
        return [getter(r) if r.ok else DASH for r in results]

    columns = [column("#", NUMBER, [str(i) for i in range(1, len(results) + 1)], key=True)]
    if varies(lambda c: c.prompt_id):
        columns.append(column("prompt", TEXT, [r.case.prompt_id for r in results], key=True))
    workloads = [workload_cell(r) for r in results]
    if any(cell.text for cell in workloads):
        columns.append(column("workload", TEXT, [_text(cell) for cell in workloads], key=True))
    columns.append(column("think", TEXT, [thinking_label(r.case.enable_thinking) for r in results], key=True))
    columns.append(column("budget", NUMBER, [budget_label(r.case.tree_budget) for r in results], key=True))
    if varies(lambda c: c.temperature):
        columns.append(column("T", NUMBER, [f"{r.case.temperature:g}" for r in results], key=True))
    if varies(lambda c: c.max_tokens):
        columns.append(column("max", NUMBER, [str(r.case.max_tokens) for r in results], key=True))
    if varies(lambda c: c.repeat):
        columns.append(column("rep", NUMBER, [str(r.case.repeat) for r in results], key=True))
    columns += [
        column("tok", NUMBER, ok_only(lambda r: fmt(r.completion_tokens, "d"))),
        column("finish", TEXT, ok_only(lambda r: r.finish_reason or DASH)),
        column("rounds", NUMBER, ok_only(lambda r: rounds_cell(r).text)),
        column("accept", NUMBER, ok_only(lambda r: _text(acceptance_cell(r)))),
        column("tok/s srv", NUMBER, ok_only(lambda r: fmt(r.spec.server_tokens_per_second, ".1f"))),
        column("tok/s cli", NUMBER, ok_only(lambda r: fmt(r.timings.decode_tokens_per_second, ".1f"))),
        column("TTFT", NUMBER, ok_only(lambda r: ttft_cell(r).text)),
        column("quality", TEXT, [_text(quality_cell(r)) for r in results]),  # a failed case's status too
    ]
    if any(r.baseline for r in results):
        columns.append(column("lossless", TEXT, ok_only(lambda r: _text(lossless_cell(r)))))
    outputs = [visible(output_text(r)) if r.ok else Text(visible(output_text(r), 200), style="red") for r in results]
    columns.append(column("output", FREE, outputs))
    return columns


def results_tables(console: Console, report: RunReport, on_dropped: Any = None) -> list[Table | Text]:
    """The per-case table laid out for ``console.width`` (two tables when it must split)."""
    return fit_tables(console, results_columns(report), _title(report) or None, on_dropped=on_dropped)


def pivot_table(report: RunReport) -> Table | None:
    """Mean acceptance by tree budget (rows) × thinking (columns), when both are known."""
    grid = by_budget_and_thinking(report, lambda r: r.spec.mean_acceptance_length)
    if grid is None:
        return None
    table = Table(title="mean acceptance (tokens/round)", title_justify="left")
    table.add_column("budget \\ thinking", no_wrap=True)
    for mode in grid.modes:
        table.add_column(thinking_label(mode), justify="right", no_wrap=True)
    for budget in grid.budgets:
        row: list[Any] = [budget_label(budget)]
        for mode in grid.modes:
            value = grid.mean(budget, mode)
            row.append(Text(fmt(value), style=acceptance_style(value)))
        table.add_row(*row)
    return table


def context_table(report: RunReport) -> Table | None:
    """Acceptance and TTFT by context length, when the run filled a prompt to a length."""
    rows = context_rows(report)
    if not rows:
        return None
    table = Table(title="by context length", title_justify="left")
    for header in ("context", "cases", "accept", "TTFT", "garbage"):
        table.add_column(header, justify="left" if header == "context" else "right", no_wrap=True)
    for row in rows:
        ttft = DASH if row["ttft_s"] is None else f"{row['ttft_s'] * 1000:.0f}ms"
        accept = Text(fmt(row["acceptance"]), style=acceptance_style(row["acceptance"]))
        table.add_row(row["label"], str(row["cases"]), accept, ttft, str(row["garbage"]))
    return table


def summary_line(report: RunReport, exit_code: int | None = None) -> str:
    results = report.results
    failed = [r for r in results if not r.ok]
    garbage = [r for r in results if r.garbage]
    accepts = [r.spec.mean_acceptance_length for r in results
               if r.ok and r.spec.mean_acceptance_length is not None]
    parts = [f"{len(results)} case{'s' if len(results) != 1 else ''}"]
    parts.append(f"{len(results) - len(failed)} ok, {len(failed)} failed")
    parts.append(f"{len(garbage)} garbage")
    if accepts:
        parts.append(f"mean acceptance {mean(accepts):.2f}")
    if report.interrupted:
        parts.append(report.stop_label() or "INTERRUPTED (partial)")
    if exit_code is not None:
        parts.append(f"exit {exit_code}")
    return " · ".join(parts)


def render_report(console: Console, report: RunReport, exit_code: int | None = None) -> None:
    report = redacted_report(report)
    dropped: list[str] = []
    tables = results_tables(console, report, on_dropped=dropped.append) if report.results else []
    tables += [t for t in (pivot_table(report), context_table(report), depth_table(report)) if t is not None]
    tables += [t for t in (load_table(report),) if t is not None]  # the load sweep
    print_tables(console, tables)
    legend = []
    if dropped:
        legend.append(f"left out at {console.width} columns: {dropped[0]} (see --json or --html for everything)")
    if any(r.spec.derived for r in report.results):
        legend.append("~ derived from other numbers (not reported by the server)")
    if any(r.spec.server_wide for r in report.results):
        legend.append("* from server-wide /metrics counters: other traffic is counted too")
    for line in legend:
        console.print(Text(line, style="dim"))
    for note in report.notes:
        console.print(Text(f"note: {visible(note, 10_000)}", style="dim"))
    render_scores(console, report)
    render_findings(console, report)
    render_gate(console, report)
    console.print(Text(summary_line(report, exit_code)))


def render_scores(console: Console, report: RunReport) -> None:
    """``--score-with``: every scored case's figures, clean or not, and the thresholds once."""
    scored = [(r, r.quality.likelihood) for r in report.results if r.quality is not None and r.quality.likelihood]
    if not scored:
        return
    table = Table(box=box.ASCII if not console.is_terminal else box.SIMPLE, header_style="bold")
    table.add_column("case", overflow="fold")
    for header in ("tokens", "nats/token", "worst span", "greedy"):
        table.add_column(header, justify="right", no_wrap=True)
    for result, score in scored:
        at = score.get("not_greedy_at_token")
        greedy = "—" if not score.get("greedy_checked") else "✓" if at is None else f"✗ token {at}"
        table.add_row(visible(result.case_id, 200), str(score.get("tokens")), f"{score.get('mean_surprisal', 0):.2f}",
                      f"{score.get('worst_span_surprisal', 0):.2f}", greedy)
    limits = scored[0][1].get("thresholds") or {}
    table.title = f"target likelihood ({visible(str(scored[0][1].get('model')), 80)})"
    table.caption = (f"low_likelihood at >= {limits.get('mean_soft')} (soft) / >= {limits.get('mean_hard')} (hard) "
                     f"nats/token, or a {limits.get('span_tokens')}-token stretch >= {limits.get('span_hard')}; "
                     f"answers under {limits.get('min_tokens')} tokens are not judged")
    console.print(table)


def _indented(text: str, style: str, indent: int = 4) -> Padding:
    """Text wrapped at the console width, every line indented (evidence under a finding)."""
    return Padding(Text(text, style=style), (0, 0, 0, indent), expand=False)


def render_findings(console: Console, report: RunReport) -> None:
    print_findings(console, report.findings)


def print_findings(console: Console, findings: list[Finding]) -> None:
    """Each finding: ``[severity] title``, then its evidence and what to check, indented (a run's
    findings, or a fleet's cross-target ones)."""
    for finding in findings:
        style = {"error": "bold red", "warning": "yellow"}.get(finding.severity, "cyan")
        console.print(Text(f"[{finding.severity}] {finding.title}", style=style))
        if finding.evidence:
            console.print(_indented(f"evidence: {finding.evidence}", "dim"))
        if finding.check:
            console.print(_indented(f"check: {finding.check}", "dim"))


def render_gate(console: Console, report: RunReport) -> None:
    """One line per gate check (✓/✗, name, detail) and the verdict; nothing without a gate."""
    print_gate(console, report.gate)


def print_gate(console: Console, gate: GateResult | None, label: str = "gate") -> None:
    """A gate's checks and its verdict line (``label: PASSED``); nothing when no gate ran."""
    if gate is None:
        return
    for check in gate.checks:
        mark, style = ("✓", "green") if check.passed else ("✗", "bold red")
        console.print(Text(f"{mark} {check.name}: {check.detail}", style=style))
    passed = gate.passed
    console.print(Text(f"{label}: {'PASSED' if passed else 'FAILED'}", style="bold green" if passed else "bold red"))


def progress_line(result: ProbeResult, done: int, total: int, target: str | None = None) -> str:
    """One finished case for a log: position, (the fleet target,) id, acceptance, tok/s and verdict."""
    tps = result.timings.decode_tokens_per_second
    if tps is None:
        tps = result.spec.server_tokens_per_second
    verdict = quality_cell(result).text
    if not result.ok and result.error:
        verdict += f": {visible(result.error, 100)}"
    width = len(str(total))
    where = f"{target}  " if target else ""
    line = (f"[{done:>{width}}/{total}] {where}{result.case_id}  accept {acceptance_cell(result).text}  "
            f"tok/s {fmt(tps, '.1f')}  {verdict}")
    return redact(line)  # a server may echo the key in its reason phrase


class progress:
    """Progress while cases run, used as ``with progress(console, total) as advance: ...
    advance(result)``. On a terminal: a transient bar. Anywhere else (a CI log, a pipe): one line
    per finished case, flushed at once, so a long run shows it is alive. ``quiet``: nothing.
    A fleet's targets report from their own threads: ``advance(result, target=NAME)``."""

    def __init__(self, console: Console, total: int, *, quiet: bool = False) -> None:
        self.console = console
        self.total = total
        self.quiet = quiet
        self.bar: Any = None
        self.done = 0
        self._lock = threading.Lock()

    def __enter__(self) -> Any:
        if self.quiet:
            return lambda result, target=None: None
        if not self.console.is_terminal:
            return self._log_line
        if self.total <= 1:
            return lambda result, target=None: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.bar = Progress(
            TextColumn("probing"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.description}"), console=self.console, transient=True,
        )
        self.bar.start()
        task = self.bar.add_task("", total=self.total)

        def advance(result: Any, target: str | None = None) -> None:
            label = f"{target}: {result.case_id}" if target else result.case_id
            with self._lock:
                self.bar.update(task, advance=1, description=label)

        return advance

    def _log_line(self, result: ProbeResult, target: str | None = None) -> None:
        with self._lock:
            self.done += 1
            stream = self.console.file
            stream.write(progress_line(result, self.done, self.total, target) + "\n")
            stream.flush()

    def note(self, text: str) -> None:
        """A stage of the run (the baseline starting), as a line in a log; nothing on a terminal."""
        if not self.quiet and not self.console.is_terminal:
            with self._lock:
                self.console.file.write(redact(text) + "\n")
                self.console.file.flush()

    def __exit__(self, *exc_info: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
