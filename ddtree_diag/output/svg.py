"""Small inline SVG charts for the HTML report: grouped bars, a histogram, paired horizontal bars.

Plain SVG strings, no plotting library and no script: the report stays one self-contained file
that renders anywhere. Every piece of text goes through ``esc`` (labels can come from a server).
Unknown values are drawn as a "—" in place of a bar, never as 0.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence

DASH = "—"
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2")
FONT = 12
_UNSAFE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff]")


def clean(text: object) -> str:
    """Text that is safe to put in an HTML/XML document once escaped: control characters, lone
    surrogates and non-characters become visible escapes (``\\x1b``, ``\\ud800``)."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                       str(text))  # fmt: skip


def esc(text: object) -> str:
    """Escape for HTML text and attribute values alike."""
    return html.escape(clean(text), quote=True)


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^k at or above ``value`` (an axis maximum)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        candidate = step * 10**exponent
        if candidate >= value * (1 - 1e-9):
            return float(candidate)
    return float(10 ** (exponent + 1))


def _number(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def axis(largest: float, steps: int = 5) -> tuple[float, list[float]]:
    """(axis maximum, tick values) for data up to ``largest``: round steps (1, 2, 2.5, 5 × 10^k),
    at most ``steps`` + 1 ticks from 0."""
    if largest <= 0:
        return 1.0, [0.0, 0.5, 1.0]
    step = nice_ceiling(largest / steps)
    count = max(1, math.ceil(largest / step - 1e-9))
    return step * count, [round(step * i, 10) for i in range(count + 1)]


def _tick_label(value: float) -> str:
    return f"{value:g}"


def _svg(width: float, height: float, title: str, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" viewBox="0 0 {width:.0f} {height:.0f}" '
            f'width="{width:.0f}" height="{height:.0f}" class="chart"><title>{esc(title)}</title>'
            + "".join(body) + "</svg>")  # fmt: skip


def grouped_bars(
    groups: Sequence[str],
    series: Sequence[str],
    values: dict[tuple[int, int], float | None],
    *,
    title: str,
    y_label: str,
    digits: int = 2,
    reference: float | None = None,
) -> str:
    """Vertical bars: one group per x label, one bar per series inside it; ``values[(g, s)]``.
    ``reference``: a dashed horizontal line (e.g. acceptance 1.0 = nothing accepted)."""
    known = [v for v in values.values() if v is not None]
    top, ticks = axis(max([*known, reference or 0.0, 0.0]))
    bar, gap, left, right, upper, lower, plot_h = 28, 18, 52, 12, 28, 44, 180
    group_w = bar * len(series) + gap
    width = left + right + max(group_w * len(groups), 160)
    height = upper + plot_h + lower + (18 if len(series) > 1 else 0)
    body: list[str] = []

    def y(v: float) -> float:
        return upper + plot_h - plot_h * v / top

    for tick in ticks:
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" class="grid"/>')
        body.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{esc(_tick_label(tick))}</text>')
    body.append(f'<text x="12" y="{upper + plot_h / 2:.0f}" transform="rotate(-90 12 {upper + plot_h / 2:.0f})" '
                f'text-anchor="middle">{esc(y_label)}</text>')  # fmt: skip
    for g, group in enumerate(groups):
        x0 = left + gap / 2 + g * group_w
        for s, name in enumerate(series):
            value = values.get((g, s))
            x = x0 + s * bar
            if value is None:
                body.append(f'<text x="{x + bar / 2:.1f}" y="{y(0) - 4:.1f}" text-anchor="middle" class="unknown">'
                            f"{DASH}</text>")  # fmt: skip
                continue
            top_y = y(value)
            body.append(f'<rect x="{x + 2:.1f}" y="{top_y:.1f}" width="{bar - 4}" height="{y(0) - top_y:.1f}" '
                        f'fill="{PALETTE[s % len(PALETTE)]}"><title>{esc(group)} · {esc(name)}: '
                        f"{esc(_number(value, digits))}</title></rect>")  # fmt: skip
            body.append(f'<text x="{x + bar / 2:.1f}" y="{top_y - 4:.1f}" text-anchor="middle" class="value">'
                        f"{esc(_number(value, digits))}</text>")  # fmt: skip
        body.append(f'<text x="{x0 + (group_w - gap) / 2:.1f}" y="{upper + plot_h + 18}" text-anchor="middle">'
                    f"{esc(group)}</text>")  # fmt: skip
    if reference is not None:
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(reference):.1f}" y2="{y(reference):.1f}" '
                    f'class="reference"/>')  # fmt: skip
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(0):.1f}" y2="{y(0):.1f}" class="axis"/>')
    if len(series) > 1:
        x = left
        legend_y = upper + plot_h + 38
        for s, name in enumerate(series):
            body.append(f'<rect x="{x}" y="{legend_y - 10}" width="10" height="10" fill="{PALETTE[s % len(PALETTE)]}"/>'
                        f'<text x="{x + 14}" y="{legend_y}">{esc(name)}</text>')  # fmt: skip
            x += 24 + 7 * len(name)
    return _svg(width, height, title, body)


def histogram(counts: dict[int, int], largest: int, *, title: str) -> str:
    """Rounds per acceptance length 1..``largest`` (a small multiple: one per case)."""
    bar, left, upper, plot_h, lower = 16, 30, 8, 70, 30
    width = left + bar * largest + 10
    top = max(counts.values(), default=1)
    scale_top = max(1, top)
    body: list[str] = []

    def y(v: float) -> float:
        return upper + plot_h - plot_h * v / scale_top

    body.append(f'<text x="{left - 4}" y="{y(scale_top) + 4:.1f}" text-anchor="end">{scale_top}</text>')
    body.append(f'<text x="{left - 4}" y="{y(0) + 4:.1f}" text-anchor="end">0</text>')
    for length in range(1, largest + 1):
        x = left + (length - 1) * bar
        count = counts.get(length, 0)
        if count:
            tip = f"{count} round(s) committed {length} token(s)"
            body.append(f'<rect x="{x + 1}" y="{y(count):.1f}" width="{bar - 2}" height="{y(0) - y(count):.1f}" '
                        f'fill="{PALETTE[0]}"><title>{tip}</title></rect>')  # fmt: skip
        body.append(f'<text x="{x + bar / 2:.1f}" y="{upper + plot_h + 14}" text-anchor="middle" class="small">'
                    f"{length}</text>")  # fmt: skip
    body.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(0):.1f}" y2="{y(0):.1f}" class="axis"/>')
    body.append(f'<text x="{left + bar * largest / 2:.1f}" y="{upper + plot_h + lower - 2}" text-anchor="middle" '
                f'class="small">tokens per round</text>')  # fmt: skip
    return _svg(width, upper + plot_h + lower, title, body)


def paired_bars(
    labels: Sequence[str],
    a: Sequence[float | None],
    b: Sequence[float | None],
    *,
    title: str,
    names: tuple[str, str] = ("A", "B"),
    digits: int = 2,
) -> str:
    """Horizontal bars, two per row (A above B), for comparing two runs case by case."""
    known = [v for v in (*a, *b) if v is not None]
    top, ticks = axis(max([*known, 0.0]))
    label_w = min(300, 7 * max((len(label) for label in labels), default=4) + 10)
    bar_h, row_gap, upper, plot_w, value_w = 11, 10, 24, 320, 48
    row_h = 2 * bar_h + row_gap
    width = label_w + plot_w + value_w
    height = upper + row_h * len(labels) + 10
    body: list[str] = []
    for s, name in enumerate(names):
        body.append(f'<rect x="{label_w + s * 90}" y="6" width="10" height="10" fill="{_pair_colour(s)}"/>'
                    f'<text x="{label_w + s * 90 + 14}" y="15">{esc(name)}</text>')  # fmt: skip
    for tick in ticks:
        x = label_w + plot_w * tick / top
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{upper - 2}" y2="{height - 8}" class="grid"/>')
    for row, label in enumerate(labels):
        y0 = upper + row * row_h
        shown = label if len(label) * 7 + 10 <= label_w else label[: max(1, (label_w - 10) // 7 - 1)] + "…"
        body.append(f'<text x="{label_w - 6}" y="{y0 + bar_h + 4}" text-anchor="end"><title>{esc(label)}</title>'
                    f"{esc(shown)}</text>")  # fmt: skip
        for s, values in enumerate((a, b)):
            value = values[row]
            y = y0 + s * bar_h
            if value is None:
                body.append(f'<text x="{label_w + 4}" y="{y + bar_h - 1}" class="unknown small">{DASH}</text>')
                continue
            length = plot_w * value / top
            body.append(f'<rect x="{label_w}" y="{y}" width="{length:.1f}" height="{bar_h - 1}" '
                        f'fill="{_pair_colour(s)}"><title>{esc(label)} · {esc(names[s])}: '
                        f"{esc(_number(value, digits))}</title></rect>")  # fmt: skip
            body.append(f'<text x="{label_w + length + 4:.1f}" y="{y + bar_h - 1}" class="small">'
                        f"{esc(_number(value, digits))}</text>")  # fmt: skip
    body.append(f'<line x1="{label_w}" x2="{label_w}" y1="{upper - 2}" y2="{height - 8}" class="axis"/>')
    return _svg(width, height, title, body)


def _pair_colour(index: int) -> str:
    return ("#9aa5b1", PALETTE[0])[index]
