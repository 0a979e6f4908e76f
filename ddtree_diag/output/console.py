"""Terminal rendering with rich: the per-case table, the acceptance pivot, notes and a summary.

On a TTY: colour and unicode boxes. Anywhere else (pipes, CI logs, files): no colour, simple
ASCII-friendly layout and a fixed width, so the output is stable and greppable.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from statistics import mean
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddtree_diag.output.cells import (
    DASH,
    Cell,
    acceptance_cell,
    acceptance_style,
    budget_label,
    fmt,
    lossless_cell,
    output_text,
    quality_cell,
    rounds_cell,
    thinking_label,
    ttft_cell,
    visible,
)
from ddtree_diag.records import RunReport
from ddtree_diag.redaction import redacted_report


def make_console(file: IO[str] | None = None, *, no_color: bool = False) -> Console:
    """A console that is rich on a terminal and plain and stable everywhere else."""
    file = file or sys.stdout
    is_tty = hasattr(file, "isatty") and file.isatty()
    if no_color or os.environ.get("NO_COLOR"):
        no_color = True
    if is_tty:
        return Console(file=file, no_color=no_color, highlight=False)
    width = int(os.environ.get("COLUMNS", "0") or 0) or 200
    return Console(
        file=file, no_color=True, force_terminal=False, width=width, highlight=False,
        color_system=None, emoji=False,
    )  # fmt: skip


def _text(cell: Cell) -> Text:
    return Text(cell.text, style=cell.style)


def results_table(report: RunReport) -> Table:
    results = report.results
    target = report.target
    title_bits = [target.get("url") or target.get("engine") or "", target.get("model") or ""]
    if target.get("dialect"):
        title_bits.append(f"dialect {target['dialect']}")
    table = Table(title=Text(visible(" · ".join(str(b) for b in title_bits if b), 400)), title_justify="left")

    def varies(getter) -> bool:
        return len({getter(r.case) for r in results}) > 1

    show_prompt = varies(lambda c: c.prompt_id)
    show_temperature = varies(lambda c: c.temperature)
    show_max = varies(lambda c: c.max_tokens)
    show_repeat = varies(lambda c: c.repeat)
    columns: list[tuple[str, dict[str, Any]]] = [("#", {"justify": "right"})]
    if show_prompt:
        columns.append(("prompt", {}))
    columns += [("think", {}), ("budget", {"justify": "right"})]
    if show_temperature:
        columns.append(("T", {"justify": "right"}))
    if show_max:
        columns.append(("max", {"justify": "right"}))
    if show_repeat:
        columns.append(("rep", {"justify": "right"}))
    columns += [
        ("tok", {"justify": "right"}),
        ("finish", {}),
        ("rounds", {"justify": "right"}),
        ("accept", {"justify": "right"}),
        ("tok/s srv", {"justify": "right"}),
        ("tok/s cli", {"justify": "right"}),
        ("TTFT", {"justify": "right"}),
        ("quality", {}),
    ]
    show_lossless = any(r.baseline for r in results)
    if show_lossless:
        columns.append(("lossless", {}))
    columns.append(("output", {"overflow": "fold", "min_width": 20}))
    for name, options in columns:
        table.add_column(name, **options)

    for index, result in enumerate(results, 1):
        case = result.case
        spec = result.spec
        row: list[Any] = [str(index)]
        if show_prompt:
            row.append(case.prompt_id)
        row += [thinking_label(case.enable_thinking), budget_label(case.tree_budget)]
        if show_temperature:
            row.append(f"{case.temperature:g}")
        if show_max:
            row.append(str(case.max_tokens))
        if show_repeat:
            row.append(str(case.repeat))
        if not result.ok:
            row += [DASH] * 7  # tok .. TTFT; the status goes in the quality column
            row.append(_text(quality_cell(result)))
            if show_lossless:
                row.append(DASH)
            row.append(Text(visible(output_text(result), 10_000), style="red"))
            table.add_row(*_plain_cells(row))
            continue
        row += [
            fmt(result.completion_tokens, "d"),
            result.finish_reason or DASH,
            rounds_cell(result).text,
            _text(acceptance_cell(result)),
            fmt(spec.server_tokens_per_second, ".1f"),
            fmt(result.timings.decode_tokens_per_second, ".1f"),
            ttft_cell(result).text,
            _text(quality_cell(result)),
            *([_text(lossless_cell(result))] if show_lossless else []),
            visible(output_text(result)),
        ]
        table.add_row(*_plain_cells(row))
    return table


def _plain_cells(row: list[Any]) -> list[Any]:
    """Strings as Text: a server's words (``[/]`` in an answer or a finish reason) are never
    read as rich markup."""
    return [Text(visible(cell, 10_000)) if isinstance(cell, str) else cell for cell in row]


def pivot_table(report: RunReport) -> Table | None:
    """Mean acceptance by tree budget (rows) × thinking (columns), when both are known."""
    cells: dict[tuple[int | None, bool | None], list[float]] = defaultdict(list)
    budgets: list[int | None] = []
    modes: list[bool | None] = []
    for result in report.results:
        case = result.case
        if case.tree_budget not in budgets:
            budgets.append(case.tree_budget)
        if case.enable_thinking not in modes:
            modes.append(case.enable_thinking)
        value = result.spec.mean_acceptance_length
        if result.ok and value is not None:
            cells[(case.tree_budget, case.enable_thinking)].append(value)
    if not cells or (len(budgets) < 2 and len(modes) < 2):
        return None
    table = Table(title="mean acceptance (tokens/round)", title_justify="left")
    table.add_column("budget \\ thinking")
    for mode in modes:
        table.add_column(thinking_label(mode), justify="right")
    for budget in budgets:
        row: list[Any] = [budget_label(budget)]
        for mode in modes:
            values = cells.get((budget, mode))
            value = mean(values) if values else None
            row.append(Text(fmt(value), style=acceptance_style(value)))
        table.add_row(*row)
    return table


def summary_line(report: RunReport, exit_code: int | None = None) -> str:
    results = report.results
    failed = [r for r in results if not r.ok]
    garbage = [r for r in results if r.garbage]
    accepts = [r.spec.mean_acceptance_length for r in results
               if r.ok and r.spec.mean_acceptance_length is not None]  # fmt: skip
    parts = [f"{len(results)} case{'s' if len(results) != 1 else ''}"]
    parts.append(f"{len(results) - len(failed)} ok, {len(failed)} failed")
    parts.append(f"{len(garbage)} garbage")
    if accepts:
        parts.append(f"mean acceptance {mean(accepts):.2f}")
    if report.interrupted:
        parts.append("INTERRUPTED (partial)")
    if exit_code is not None:
        parts.append(f"exit {exit_code}")
    return " · ".join(parts)


def render_report(console: Console, report: RunReport, exit_code: int | None = None) -> None:
    report = redacted_report(report)
    tables = [results_table(report)] if report.results else []
    pivot = pivot_table(report)
    if pivot is not None:
        tables.append(pivot)
    for table in tables:
        if not console.is_terminal:
            table.box = box.ASCII  # plain, stable layout for logs and pipes
        console.print(table)
    legend = []
    if any(r.spec.derived for r in report.results):
        legend.append("~ derived from other numbers (not reported by the server)")
    if any(r.spec.server_wide for r in report.results):
        legend.append("* from server-wide /metrics counters: other traffic is counted too")
    for line in legend:
        console.print(Text(line, style="dim"))
    for note in report.notes:
        console.print(Text(f"note: {visible(note, 10_000)}", style="dim"))
    render_findings(console, report)
    render_gate(console, report)
    console.print(Text(summary_line(report, exit_code)))


def render_findings(console: Console, report: RunReport) -> None:
    for finding in report.findings:
        style = {"error": "bold red", "warning": "yellow"}.get(finding.severity, "cyan")
        console.print(Text(f"[{finding.severity}] {finding.title}", style=style))
        if finding.evidence:
            console.print(Text(f"    evidence: {finding.evidence}", style="dim"))
        if finding.check:
            console.print(Text(f"    check: {finding.check}", style="dim"))


def render_gate(console: Console, report: RunReport) -> None:
    """One line per gate check (✓/✗, name, detail) and the verdict; nothing without a gate."""
    if report.gate is None:
        return
    for check in report.gate.checks:
        mark, style = ("✓", "green") if check.passed else ("✗", "bold red")
        console.print(Text(f"{mark} {check.name}: {check.detail}", style=style))
    passed = report.gate.passed
    console.print(Text(f"gate: {'PASSED' if passed else 'FAILED'}", style="bold green" if passed else "bold red"))


class progress:
    """A transient progress bar on a terminal for multi-case runs; a no-op elsewhere. Used as
    ``with progress(console, total) as advance: ... advance(result)``."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.bar: Any = None

    def __enter__(self) -> Any:
        if self.total <= 1 or not self.console.is_terminal:
            return lambda result: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.bar = Progress(
            TextColumn("probing"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.description}"), console=self.console, transient=True,
        )  # fmt: skip
        self.bar.start()
        task = self.bar.add_task("", total=self.total)

        def advance(result: Any) -> None:
            self.bar.update(task, advance=1, description=result.case_id)

        return advance

    def __exit__(self, *exc_info: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
