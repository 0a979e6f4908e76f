"""Acceptance by depth in the reports: a small table per run (console) and a curve per budget ×
thinking group (HTML). Nothing is shown when no case said anything per depth."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ddtree_diag.backends import depth
from ddtree_diag.output.svg import esc, line_chart
from ddtree_diag.records import RunReport

MOST_DEPTHS = 12  # the console shows this many depths, then "…"


def _curves(report: RunReport) -> list[tuple[str, depth.Depth]]:
    """(group label, pooled curve) per group, each with its known drop to 0 one depth past the
    deepest ever accepted (see ``Depth.extended``)."""
    from ddtree_diag.checks.depth import group_limit

    return [(label, pooled.extended(group_limit(report, results))) for label, results, pooled in depth.groups(report)]


def depth_table(report: RunReport) -> Table | None:
    """``group · rounds · P(depth 1) P(depth 2) …`` per budget × thinking group; None when unknown."""
    curves = _curves(report)
    if not curves:
        return None
    table = Table(title="acceptance by depth", title_justify="left")
    table.add_column("group", no_wrap=True)
    table.add_column("rounds", justify="right", no_wrap=True)
    # wide enough that the source caption under it wraps little
    table.add_column("P(draft token at depth 1 2 3 … accepted)", overflow="fold", min_width=24)
    sources = []
    for label, curve in curves:
        table.add_row(label, f"{curve.rounds:.0f}", Text(depth.curve_text(curve, MOST_DEPTHS)))
        sources += [s for s in curve.source.split("; ") if s not in sources]
    table.caption = "from " + "; ".join(sources)
    table.caption_justify = "left"
    return table


def depth_figure(report: RunReport) -> str | None:
    """The HTML plot: one line per group, P(accepted) against depth; None when unknown."""
    curves = _curves(report)
    if not curves:
        return None
    deepest = max(len(curve.accepted) for _, curve in curves)
    title = "Acceptance by draft depth"
    svg = line_chart([str(k) for k in range(1, deepest + 1)],
                     [(label.replace("budget=", "budget ").replace("think=", "thinking "), curve.probabilities)
                      for label, curve in curves],
                     title=title, y_label="P(accepted)", x_label="draft depth", y_max=1.0)
    return f"<figure><figcaption>{esc(title)}</figcaption>{svg}</figure>"
