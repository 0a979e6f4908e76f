"""The load sweep (``RunReport.load``) as the console, Markdown and HTML show it: one row per
concurrency level with aggregate tok/s on both sides, the speed-up, and the speculative side's
TTFT and ITL (p50/p99); in HTML also a chart of the speed-up by level with 1.0 marked."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ddtree_diag.output.cells import DASH, fmt
from ddtree_diag.output.svg import esc, grouped_bars
from ddtree_diag.records import LoadLevel, LoadSide, RunReport

# Two-line headers keep the table within 80 columns (numbers and headers are never cut).
HEADERS = ("conc", "tok/s\nspec", "tok/s\nbase", "speed-up", "accept", "TTFT ms\np50/p99", "ITL ms\np50/p99",
           "requests\nspec/base")
CAPTION = ("tok/s: aggregate, completion tokens / the level's wall time; TTFT (ms) and ITL (ms per token) of the "
           "speculative side; requests sent with / without speculation, (failed)")


def _ms_pair(table: dict[str, float | None], scale: float = 1.0) -> str:
    low, high = table.get("p50"), table.get("p99")
    if low is None and high is None:
        return DASH
    return f"{fmt(None if low is None else low * scale, '.0f')}/{fmt(None if high is None else high * scale, '.0f')}"


def _ttft(side: LoadSide) -> str:
    return _ms_pair(side.ttft_s, 1000.0)


def _itl(side: LoadSide) -> str:
    low, high = side.itl_ms.get("p50"), side.itl_ms.get("p99")
    if low is None and high is None:
        return DASH
    return f"{fmt(low, '.1f')}/{fmt(high, '.1f')}"


def _requests(level: LoadLevel) -> str:
    def one(side: LoadSide | None) -> str:
        if side is None:
            return DASH
        return f"{side.requests}" + (f"({side.failures})" if side.failures else "")

    return f"{one(level.speculative)}/{one(level.baseline)}"


def speedup_text(level: LoadLevel) -> str:
    return DASH if level.speedup is None else f"{level.speedup:.2f}×"


def rows(report: RunReport) -> list[list[str]]:
    """The table's rows, as text (the console, Markdown and HTML share them)."""
    out = []
    for level in report.load:
        spec, base = level.speculative, level.baseline
        out.append([str(level.concurrency), fmt(spec.tokens_per_second, ".1f"),
                    fmt(None if base is None else base.tokens_per_second, ".1f"), speedup_text(level),
                    fmt(spec.mean_acceptance), _ttft(spec), _itl(spec), _requests(level)])
    return out


def load_table(report: RunReport) -> Table | None:
    """The console table, or None without a sweep."""
    if not report.load:
        return None
    table = Table(title="speed-up under load (with / without speculation)", title_justify="left", caption=CAPTION,
                  caption_justify="left")
    for header in HEADERS:
        table.add_column(header, justify="right", no_wrap=True)
    for level, row in zip(report.load, rows(report), strict=True):
        style = None if level.speedup is None else ("green" if level.speedup >= 1.0 else "bold red")
        table.add_row(*row[:3], Text(row[3], style=style or ""), *row[4:])
    return table


def markdown_lines(report: RunReport) -> list[str]:
    """The Markdown summary's section, or [] without a sweep."""
    if not report.load:
        return []
    lines = ["### Speed-up under load", "", "| " + " | ".join(h.replace("\n", " ") for h in HEADERS) + " |",
             "|" + "---:|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(report)]
    unknown = [lv for lv in report.load if lv.note]
    if unknown:
        lines += ["", f"{unknown[0].note}"]
    lines += ["", CAPTION, ""]
    return lines


def html_chart(report: RunReport) -> str | None:
    """Speed-up by concurrency level (a dashed line at 1.0: no gain), or None."""
    levels = [lv for lv in report.load if lv.speedup is not None]
    if not levels:
        return None
    title = "Speed-up by concurrency (tok/s with / without speculation; 1.0 = no gain)"
    values = {(g, 0): lv.speedup for g, lv in enumerate(levels)}
    svg = grouped_bars([f"concurrency {lv.concurrency}" for lv in levels], ["speed-up"], values, title=title,
                       y_label="× baseline tok/s", digits=2, reference=1.0)
    return f"<figure><figcaption>{esc(title)}</figcaption>{svg}</figure>"


def html_table(report: RunReport) -> list[str]:
    """The sweep's table for the HTML report, or [] without a sweep."""
    if not report.load:
        return []
    out = ['<h2 id="load">Speed-up under load</h2>', "<table>",
           "<tr>" + "".join(f"<th>{esc(h.replace(chr(10), ' '))}</th>" for h in HEADERS) + "</tr>"]
    for row in rows(report):
        out.append("<tr>" + "".join(f'<td class="num">{esc(cell)}</td>' for cell in row) + "</tr>")
    out.append("</table>")
    out.append(f'<p class="dim">{esc(CAPTION)}</p>')
    return out
