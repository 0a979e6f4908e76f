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

from ddtree_diag.records import ProbeResult, RunReport

DASH = "—"  # unknown, never 0


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


def visible(text: str, limit: int = 60) -> str:
    """Text with control characters made visible, cut to ``limit`` characters."""
    out = []
    for char in text:
        if char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif ord(char) < 32 or 0x7F <= ord(char) < 0xA0:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def _fmt(value: float | int | None, spec: str = ".2f") -> str:
    if value is None:
        return DASH
    return format(value, spec)


def _thinking(value: bool | None) -> str:
    return {True: "on", False: "off", None: "default"}[value]


def _budget(value: int | None) -> str:
    return "default" if value is None else str(value)


def acceptance_style(value: float | None) -> str:
    if value is None:
        return "dim"
    if value >= 2.5:
        return "green"
    if value >= 1.5:
        return "yellow"
    return "red"


def quality_cell(result: ProbeResult) -> Text:
    if result.quality is None:
        return Text(DASH, style="dim")
    reasons = result.quality.get("reasons") or []
    top = reasons[0]["code"] if reasons else ""
    if result.quality.get("garbage"):
        return Text(f"✗ {top}".strip(), style="bold red")
    if result.quality.get("truncated"):
        return Text("✓ truncated", style="yellow")
    return Text("✓", style="green")


def lossless_cell(result: ProbeResult) -> Text:
    baseline = result.baseline or {}
    verdict = baseline.get("verdict")
    at = f" @{baseline['char_index']}" if baseline.get("char_index") is not None else ""
    if verdict == "identical":
        return Text("✓", style="green")
    if verdict == "near_tie":
        return Text("≈ near-tie" + at, style="yellow")
    if verdict == "mismatch":
        return Text("✗ mismatch" + at, style="bold red")
    if verdict == "error":
        return Text("? baseline failed", style="yellow")
    return Text(DASH, style="dim")


def results_table(report: RunReport) -> Table:
    results = report.results
    target = report.target
    title_bits = [target.get("url") or target.get("engine") or "", target.get("model") or ""]
    if target.get("dialect"):
        title_bits.append(f"dialect {target['dialect']}")
    table = Table(title=" · ".join(b for b in title_bits if b), title_justify="left")

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
        row += [_thinking(case.enable_thinking), _budget(case.tree_budget)]
        if show_temperature:
            row.append(f"{case.temperature:g}")
        if show_max:
            row.append(str(case.max_tokens))
        if show_repeat:
            row.append(str(case.repeat))
        if not result.ok:
            row += [DASH] * 7  # tok .. TTFT; the status goes in the quality column
            row.append(Text("✗ " + result.status, style="bold red"))
            if show_lossless:
                row.append(DASH)
            row.append(Text(result.error or "", style="red"))
            table.add_row(*row)
            continue
        mark = "~" if spec.derived else ""
        mark += "*" if spec.server_wide else ""
        accept = spec.mean_acceptance_length
        ttft = result.timings.ttft_s
        row += [
            _fmt(result.completion_tokens, "d"),
            result.finish_reason or DASH,
            (mark + _fmt(spec.decode_rounds, "d")) if spec.decode_rounds is not None else DASH,
            Text(
                (mark + _fmt(accept)) if accept is not None else DASH,
                style=acceptance_style(accept),
            ),
            _fmt(spec.server_tokens_per_second, ".1f"),
            _fmt(result.timings.decode_tokens_per_second, ".1f"),
            DASH if ttft is None else f"{ttft * 1000:.0f}ms",
            quality_cell(result),
            *([lossless_cell(result)] if show_lossless else []),
            visible(result.output or (f"[reasoning] {result.reasoning}" if result.reasoning else "")),
        ]
        table.add_row(*row)
    return table


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
        table.add_column(_thinking(mode), justify="right")
    for budget in budgets:
        row: list[Any] = [_budget(budget)]
        for mode in modes:
            values = cells.get((budget, mode))
            value = mean(values) if values else None
            row.append(Text(_fmt(value), style=acceptance_style(value)))
        table.add_row(*row)
    return table


def summary_line(report: RunReport, exit_code: int | None = None) -> str:
    results = report.results
    failed = [r for r in results if not r.ok]
    garbage = [r for r in results if r.quality and r.quality.get("garbage")]
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
        console.print(Text(f"note: {note}", style="dim"))
    render_findings(console, report)
    render_gate(console, report)
    console.print(summary_line(report, exit_code))


def render_findings(console: Console, report: RunReport) -> None:
    for finding in report.findings:
        severity = finding.get("severity", "info")
        style = {"error": "bold red", "warning": "yellow"}.get(severity, "cyan")
        console.print(Text(f"[{severity}] {finding.get('title', '')}", style=style))
        if finding.get("evidence"):
            console.print(Text(f"    evidence: {finding['evidence']}", style="dim"))
        if finding.get("check"):
            console.print(Text(f"    check: {finding['check']}", style="dim"))


def render_gate(console: Console, report: RunReport) -> None:
    """One line per gate check (✓/✗, name, detail) and the verdict; nothing without a gate."""
    if report.gate is None:
        return
    for check in report.gate.get("checks", []):
        mark, style = ("✓", "green") if check.get("passed") else ("✗", "bold red")
        console.print(Text(f"{mark} {check.get('name')}: {check.get('detail', '')}", style=style))
    passed = report.gate.get("passed")
    console.print(Text(f"gate: {'PASSED' if passed else 'FAILED'}", style="bold green" if passed else "bold red"))
