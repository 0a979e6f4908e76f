"""One cell renderer for every format: the console table, Markdown, JUnit and HTML all show a
case through these functions, so a verdict reads the same everywhere.

A ``Cell`` is plain text plus a style name (rich style syntax; other formats map or ignore it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ddtree_diag.records import MISMATCH, NEAR_TIE, ProbeResult, RunReport

DASH = "—"  # unknown, never 0


@dataclass(frozen=True)
class Cell:
    text: str
    style: str = ""


def fmt(value: float | int | None, spec: str = ".2f") -> str:
    return DASH if value is None else format(value, spec)


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
        elif 0xD800 <= ord(char) <= 0xDFFF:  # a lone surrogate: no terminal or file can carry it
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def acceptance_style(value: float | None) -> str:
    if value is None:
        return "dim"
    if value >= 2.5:
        return "green"
    if value >= 1.5:
        return "yellow"
    return "red"


def _marks(result: ProbeResult) -> str:
    """``~`` derived from other numbers, ``*`` from server-wide counters."""
    return ("~" if result.spec.derived else "") + ("*" if result.spec.server_wide else "")


def acceptance_cell(result: ProbeResult) -> Cell:
    value = result.spec.mean_acceptance_length
    text = DASH if value is None else _marks(result) + fmt(value)
    return Cell(text, acceptance_style(value))


def rounds_cell(result: ProbeResult) -> Cell:
    rounds = result.spec.decode_rounds
    return Cell(DASH if rounds is None else _marks(result) + fmt(rounds, "d"))


def ttft_cell(result: ProbeResult) -> Cell:
    ttft = result.timings.ttft_s
    return Cell(DASH if ttft is None else f"{ttft * 1000:.0f}ms")


def quality_cell(result: ProbeResult) -> Cell:
    if not result.ok:
        return Cell(f"✗ {result.status}", "bold red")
    verdict = result.quality
    if verdict is None:
        return Cell(DASH, "dim")
    if verdict.garbage:
        top = verdict.top_reason
        return Cell(f"✗ {top.code}" if top else "✗ garbage", "bold red")
    if verdict.truncated:
        return Cell("✓ truncated", "yellow")
    return Cell("✓", "green")


def lossless_cell(result: ProbeResult) -> Cell:
    baseline = result.baseline
    if baseline is None:
        return Cell(DASH, "dim")
    at = f" @{baseline.char_index}" if baseline.char_index is not None else ""
    if baseline.verdict == "identical":
        return Cell("✓", "green")
    if baseline.verdict == NEAR_TIE:
        return Cell("≈ near-tie" + at, "yellow")
    if baseline.verdict == MISMATCH:
        return Cell("✗ mismatch" + at, "bold red")
    if baseline.verdict == "error":
        return Cell("? baseline failed", "yellow")
    return Cell(DASH, "dim")


def output_text(result: ProbeResult) -> str:
    """What a case said (its error when it failed); the reasoning when the answer is empty."""
    if not result.ok:
        return result.error or ""
    if not result.output and result.tool_calls:
        return " ".join(f"[call] {c.get('name')}({c.get('arguments')})" for c in result.tool_calls)
    if not result.output and result.reasoning:
        return f"[reasoning] {result.reasoning}"
    return result.output or ""


def workload_cell(result: ProbeResult) -> Cell:
    """What the case asks beyond a chat answer, and how the structured check went:
    ``schema ✓``, ``tool ✗``, ``8k``, ``cache 2nd``; empty for a plain case."""
    from ddtree_diag.checks.workloads import workload_label

    label = workload_label(result)
    failed = result.structured is not None and not result.structured.passed
    return Cell(label, "bold red" if failed else "")


def context_rows(report: RunReport) -> list[dict]:
    """Acceptance and TTFT per context length (``checks.workloads.context_table``); [] when the run
    filled no prompt."""
    from ddtree_diag.checks.workloads import context_table

    return context_table(report.results)


@dataclass
class Grid:
    """Values of a run by tree budget (rows) × thinking mode (columns), in the run's order."""

    budgets: list[int | None]
    modes: list[bool | None]
    values: dict[tuple[int | None, bool | None], list[float]]

    def mean(self, budget: int | None, mode: bool | None) -> float | None:
        found = self.values.get((budget, mode))
        return sum(found) / len(found) if found else None

    @property
    def largest(self) -> float:
        return max((max(v) for v in self.values.values() if v), default=0.0)


def by_budget_and_thinking(
    report: RunReport, value: Callable[[ProbeResult], float | None], *, single_cell: bool = False
) -> Grid | None:
    """``value`` of every successful case grouped by budget × thinking; None when nothing is known,
    or when the run has a single cell (one budget, one mode) unless ``single_cell``."""
    budgets: list[int | None] = []
    modes: list[bool | None] = []
    values: dict[tuple[int | None, bool | None], list[float]] = {}
    for result in report.results:
        case = result.case
        if case.tree_budget not in budgets:
            budgets.append(case.tree_budget)
        if case.enable_thinking not in modes:
            modes.append(case.enable_thinking)
        number = value(result) if result.ok else None
        if number is not None:
            values.setdefault((case.tree_budget, case.enable_thinking), []).append(number)
    if not values or (not single_cell and len(budgets) < 2 and len(modes) < 2):
        return None
    return Grid(budgets, modes, values)
