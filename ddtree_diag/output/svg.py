"""Small inline SVG charts for the HTML report: grouped bars, a histogram, paired horizontal bars.

Plain SVG strings, no plotting library and no script: the report stays one self-contained file
that renders anywhere. Every piece of text goes through ``esc`` (labels can come from a server).
Unknown values are drawn as a "—" in place of a bar, never as 0.

No two pieces of text overlap: widths are estimated per character (``text_width``, on the wide
side for any sans-serif font), bars widen to hold their value, and x-axis labels that do not fit
their slot lose the prefix they share (shown once as the axis title), then turn 45° (cut with
"…" past ``LABEL_CHARS``, the whole label in a tooltip), and last are thinned to every n-th one.
"""

from __future__ import annotations

import html
import math
import re
import unicodedata
from collections.abc import Sequence

DASH = "—"
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2")
FONT = 11  # px: the chart's text (html.py's CSS); values and small labels are 10 px
SMALL = 10
LINE = 1.25  # a line of text is this many font sizes high
LABEL_CHARS = 24  # a rotated x label longer than this is cut (the whole label is its tooltip)
LABEL_PAD = 4  # px between two labels
_UNSAFE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff]")


def clean(text: object) -> str:
    """Text that is safe to put in an HTML/XML document once escaped: control characters, lone
    surrogates and non-characters become visible escapes (``\\x1b``, ``\\ud800``)."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                       str(text))


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


def _char_em(char: str) -> float:
    if unicodedata.east_asian_width(char) in ("W", "F"):
        return 1.0
    if unicodedata.combining(char) or char in "\u200b\u200c\u200d\ufe0f":
        return 0.0
    if char in " ijlI.,:;|!'`()[]{}/\\-":
        return 0.4
    if char.isupper() or char in "mwMW@%&—…":
        return 0.95
    return 0.62


def text_width(text: str, size: float = FONT) -> float:
    """Estimated width in px of ``text`` at ``size`` px in a sans-serif font, on the wide side
    (Latin letters average about 0.5 em; wide CJK characters are 1 em)."""
    return size * sum(_char_em(char) for char in text)


def _cut(text: str, chars: int = LABEL_CHARS) -> str:
    return text if len(text) <= chars else text[: chars - 1].rstrip() + "…"


def _shared_prefix(labels: Sequence[str]) -> str:
    """The words every label starts with (``budget`` of ``budget 16``, ``budget 64``), when each
    label has more after them; "" otherwise."""
    if len(labels) < 2:
        return ""
    words = [label.split(" ") for label in labels]
    shared: list[str] = []
    for column in zip(*words, strict=False):
        if len(set(column)) != 1:
            break
        shared.append(column[0])
    while shared and any(len(w) <= len(shared) or not " ".join(w[len(shared):]).strip() for w in words):
        shared.pop()
    return " ".join(shared)


class XLabels:
    """How to write labels centred on slots ``slot`` px apart without two overlapping: flat when
    the widest fits its slot; else without their shared prefix (which becomes the axis title);
    else turned 45° (and cut at ``LABEL_CHARS``), every ``step``-th one when even that is too
    dense. ``height`` is the room they take below the axis."""

    def __init__(self, labels: Sequence[str], slot: float, size: float = FONT, title: str | None = None) -> None:
        self.labels, self.title, self.size, self.rotated, self.step = list(labels), title, size, False, 1
        widest = max((text_width(label, size) for label in self.labels), default=0.0)
        if widest + LABEL_PAD > slot:
            prefix = _shared_prefix(self.labels)
            if prefix:
                short = [label[len(prefix):].strip() for label in self.labels]
                if max(text_width(label, size) for label in short) + LABEL_PAD <= slot:
                    self.labels, widest = short, max(text_width(label, size) for label in short)
                    self.title = f"{title} · {prefix}" if title else prefix
        if widest + LABEL_PAD > slot:
            self.rotated = True
            self.labels = [_cut(label) for label in self.labels]
            widest = max(text_width(label, size) for label in self.labels)
            # parallel lines 45° apart by slot·sin 45°: one line of text needs LINE·size + a pad
            self.step = max(1, math.ceil((LINE * size + LABEL_PAD) / (slot * math.sin(math.pi / 4))))
        line = LINE * size
        self.widest = widest
        self.height = (widest + line) * math.sin(math.pi / 4) + line if self.rotated else line
        self.full = list(labels)

    def svg(self, centres: Sequence[float], top: float) -> list[str]:
        """The labels' ``<text>`` elements under an axis at ``top``."""
        out = []
        for index, (centre, label) in enumerate(zip(centres, self.labels, strict=True)):
            if index % self.step:
                continue
            tip = f"<title>{esc(self.full[index])}</title>" if label != self.full[index] else ""
            if self.rotated:
                x, y = centre + 0.3 * self.size, top + self.size
                out.append(f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="end" class="xlabel" '
                           f'transform="rotate(-45 {x:.1f} {y:.1f})">{tip}{esc(label)}</text>')
            else:
                out.append(f'<text x="{centre:.1f}" y="{top + self.size + 4:.1f}" text-anchor="middle" '
                           f'class="xlabel">{tip}{esc(label)}</text>')
        return out


def _tick_label(value: float) -> str:
    return f"{value:g}"


def _svg(width: float, height: float, title: str, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" viewBox="0 0 {width:.0f} {height:.0f}" '
            f'width="{width:.0f}" height="{height:.0f}" class="chart"><title>{esc(title)}</title>'
            + "".join(body) + "</svg>")


def grouped_bars(
    groups: Sequence[str],
    series: Sequence[str],
    values: dict[tuple[int, int], float | None],
    *,
    title: str,
    y_label: str,
    digits: int = 2,
    reference: float | None = None,
    x_label: str | None = None,
) -> str:
    """Vertical bars: one group per x label, one bar per series inside it; ``values[(g, s)]``.
    ``reference``: a dashed horizontal line (e.g. acceptance 1.0 = nothing accepted).
    ``x_label``: the x axis's title, under the labels."""
    known = [v for v in values.values() if v is not None]
    top, ticks = axis(max([*known, reference or 0.0, 0.0]))
    widest_value = max((text_width(_number(v, digits), SMALL) for v in known), default=0.0)
    bar = max(28, math.ceil(widest_value + LABEL_PAD))  # values over neighbouring bars stay apart
    gap, right, upper, plot_h = 18, 12, 28, 180
    tick_w = max(text_width(_tick_label(t)) for t in ticks)
    left = max(52, math.ceil(tick_w + 6 + LINE * FONT + 12))
    group_w = bar * len(series) + gap
    labels = XLabels(groups, group_w, title=x_label)
    if labels.rotated:  # the first label runs down to the left of its bar: keep it inside the chart
        left = max(left, math.ceil(labels.widest * math.cos(math.pi / 4) + 30 - group_w / 2))
    legend_w = [14 + text_width(name) + 12 for name in series] if len(series) > 1 else []
    title_w = text_width(labels.title) if labels.title else 0.0
    plot_w = math.ceil(max(group_w * len(groups), 160, *legend_w, title_w))
    legend_rows: list[list[tuple[int, float]]] = [[]]  # (series index, x) per legend line
    x = left
    for s, item_w in enumerate(legend_w):
        if legend_rows[-1] and x + item_w > left + plot_w:
            legend_rows.append([])
            x = left
        legend_rows[-1].append((s, x))
        x += item_w
    width = left + right + plot_w
    axis_y = upper + plot_h
    title_y = axis_y + labels.height + (LINE * FONT if labels.title else 0)
    legend_top = title_y + 8
    height = legend_top + (LINE * FONT + 2) * (len(legend_rows) if len(series) > 1 else 0) + 6
    body: list[str] = []

    def y(v: float) -> float:
        return upper + plot_h - plot_h * v / top

    for tick in ticks:
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" class="grid"/>')
        body.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{esc(_tick_label(tick))}</text>')
    body.append(f'<text x="12" y="{upper + plot_h / 2:.0f}" transform="rotate(-90 12 {upper + plot_h / 2:.0f})" '
                f'text-anchor="middle">{esc(y_label)}</text>')
    centres = []
    for g, group in enumerate(groups):
        x0 = left + gap / 2 + g * group_w
        centres.append(x0 + (group_w - gap) / 2)
        for s, name in enumerate(series):
            value = values.get((g, s))
            x = x0 + s * bar
            if value is None:
                body.append(f'<text x="{x + bar / 2:.1f}" y="{y(0) - 4:.1f}" text-anchor="middle" class="unknown">'
                            f"{DASH}</text>")
                continue
            top_y = y(value)
            body.append(f'<rect x="{x + 2:.1f}" y="{top_y:.1f}" width="{bar - 4}" height="{y(0) - top_y:.1f}" '
                        f'fill="{PALETTE[s % len(PALETTE)]}"><title>{esc(group)} · {esc(name)}: '
                        f"{esc(_number(value, digits))}</title></rect>")
            body.append(f'<text x="{x + bar / 2:.1f}" y="{top_y - 4:.1f}" text-anchor="middle" class="value">'
                        f"{esc(_number(value, digits))}</text>")
    body += labels.svg(centres, axis_y)
    if labels.title:
        body.append(f'<text x="{left + plot_w / 2:.1f}" y="{title_y:.1f}" text-anchor="middle" class="xtitle">'
                    f"{esc(labels.title)}</text>")
    if reference is not None:
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(reference):.1f}" y2="{y(reference):.1f}" '
                    f'class="reference"/>')
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(0):.1f}" y2="{y(0):.1f}" class="axis"/>')
    if len(series) > 1:
        for row, items in enumerate(legend_rows):
            legend_y = legend_top + (LINE * FONT + 2) * (row + 1) - 4
            for s, x in items:
                body.append(f'<rect x="{x:.1f}" y="{legend_y - 10:.1f}" width="10" height="10" '
                            f'fill="{PALETTE[s % len(PALETTE)]}"/>'
                            f'<text x="{x + 14:.1f}" y="{legend_y:.1f}">{esc(series[s])}</text>')
    return _svg(width, height, title, body)


def histogram(counts: dict[int, int], largest: int, *, title: str) -> str:
    """Rounds per acceptance length 1..``largest`` (a small multiple: one per case)."""
    top = max(counts.values(), default=1)
    scale_top = max(1, top)
    bar, upper, plot_h, lower = 16, 8, 70, 30
    left = max(30, math.ceil(text_width(str(scale_top)) + 8))
    caption = "tokens per round"
    width = max(left + bar * largest + 10, math.ceil(text_width(caption, SMALL) + 8))
    body: list[str] = []

    def y(v: float) -> float:
        return upper + plot_h - plot_h * v / scale_top

    body.append(f'<text x="{left - 4}" y="{y(scale_top) + 4:.1f}" text-anchor="end">{scale_top}</text>')
    body.append(f'<text x="{left - 4}" y="{y(0) + 4:.1f}" text-anchor="end">0</text>')
    # every n-th length when the numbers are wider than a bar (1 always, then multiples of n)
    step = max(1, math.ceil((text_width(str(largest), SMALL) + LABEL_PAD) / bar))
    for length in range(1, largest + 1):
        x = left + (length - 1) * bar
        count = counts.get(length, 0)
        if count:
            tip = f"{count} round(s) committed {length} token(s)"
            body.append(f'<rect x="{x + 1}" y="{y(count):.1f}" width="{bar - 2}" height="{y(0) - y(count):.1f}" '
                        f'fill="{PALETTE[0]}"><title>{tip}</title></rect>')
        if length % step == 0 or (length == 1 and step < 3):
            body.append(f'<text x="{x + bar / 2:.1f}" y="{upper + plot_h + 14}" text-anchor="middle" class="small">'
                        f"{length}</text>")
    body.append(f'<line x1="{left}" x2="{left + bar * largest}" y1="{y(0):.1f}" y2="{y(0):.1f}" class="axis"/>')
    centre = min(max(left + bar * largest / 2, width / 2), width - text_width(caption, SMALL) / 2 - 4)
    body.append(f'<text x="{centre:.1f}" y="{upper + plot_h + lower - 2}" text-anchor="middle" '
                f'class="small">{caption}</text>')
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
    label_w = math.ceil(min(300, max((text_width(label) for label in labels), default=28) + 10))
    bar_h, row_gap, upper, plot_w, value_w = 11, 10, 24, 320, 48
    row_h = 2 * bar_h + row_gap
    width = label_w + plot_w + value_w
    height = upper + row_h * len(labels) + 10
    body: list[str] = []
    x = float(label_w)
    for s, name in enumerate(names):
        shown = _cut(name, 40)
        body.append(f'<rect x="{x:.1f}" y="6" width="10" height="10" fill="{_pair_colour(s)}"/>'
                    f'<text x="{x + 14:.1f}" y="15">{esc(shown)}</text>')
        x += 14 + text_width(shown) + 16
    width = max(width, math.ceil(x))
    for tick in ticks:
        x = label_w + plot_w * tick / top
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{upper - 2}" y2="{height - 8}" class="grid"/>')
    for row, label in enumerate(labels):
        y0 = upper + row * row_h
        shown = label
        while len(shown) > 1 and text_width(shown) + 10 > label_w:
            shown = shown[:-2].rstrip() + "…"
        body.append(f'<text x="{label_w - 6}" y="{y0 + bar_h + 4}" text-anchor="end"><title>{esc(label)}</title>'
                    f"{esc(shown)}</text>")
        for s, values in enumerate((a, b)):
            value = values[row]
            y = y0 + s * bar_h
            if value is None:
                body.append(f'<text x="{label_w + 4}" y="{y + bar_h - 1}" class="unknown small">{DASH}</text>')
                continue
            length = plot_w * value / top
            body.append(f'<rect x="{label_w}" y="{y}" width="{length:.1f}" height="{bar_h - 1}" '
                        f'fill="{_pair_colour(s)}"><title>{esc(label)} · {esc(names[s])}: '
                        f"{esc(_number(value, digits))}</title></rect>")
            body.append(f'<text x="{label_w + length + 4:.1f}" y="{y + bar_h - 1}" class="small">'
                        f"{esc(_number(value, digits))}</text>")
    body.append(f'<line x1="{label_w}" x2="{label_w}" y1="{upper - 2}" y2="{height - 8}" class="axis"/>')
    return _svg(width, height, title, body)


def _pair_colour(index: int) -> str:
    return ("#9aa5b1", PALETTE[0])[index]


def line_chart(
    x_labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    title: str,
    y_label: str,
    x_label: str,
    y_max: float | None = None,
    digits: int = 2,
) -> str:
    """One line per series over shared x positions (e.g. acceptance by draft depth, one line per
    budget × thinking group); a point's value is its tooltip, so no value text can collide. A
    series shorter than the axis stops where it ends; ``None`` breaks its line."""
    known = [v for _, values in series for v in values if v is not None]
    top, ticks = axis(max([*known, y_max or 0.0, 0.0]))
    slot, right, upper, plot_h = 28, 12, 16, 160
    tick_w = max(text_width(_tick_label(t)) for t in ticks)
    left = max(52, math.ceil(tick_w + 6 + LINE * FONT + 12))
    labels = XLabels(x_labels, slot, title=x_label)
    legend_w = [22 + text_width(name) + 12 for name, _ in series]
    plot_w = math.ceil(max(slot * len(x_labels), 160, text_width(labels.title or "")))
    legend_rows: list[list[tuple[int, float]]] = [[]]
    x = float(left)
    for s, item_w in enumerate(legend_w):
        if legend_rows[-1] and x + item_w > left + plot_w:
            legend_rows.append([])
            x = float(left)
        legend_rows[-1].append((s, x))
        x += item_w
    plot_w = max(plot_w, math.ceil(max((item_w for item_w in legend_w), default=0.0)))
    width = left + right + plot_w
    axis_y = upper + plot_h
    title_y = axis_y + labels.height + (LINE * FONT if labels.title else 0)
    legend_top = title_y + 8
    height = legend_top + (LINE * FONT + 2) * len(legend_rows) + 6
    body: list[str] = []

    def y(v: float) -> float:
        return upper + plot_h - plot_h * v / top

    def cx(index: int) -> float:
        return left + slot * index + slot / 2

    for tick in ticks:
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" class="grid"/>')
        body.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{esc(_tick_label(tick))}</text>')
    body.append(f'<text x="12" y="{upper + plot_h / 2:.0f}" transform="rotate(-90 12 {upper + plot_h / 2:.0f})" '
                f'text-anchor="middle">{esc(y_label)}</text>')
    for s, (name, values) in enumerate(series):
        colour = PALETTE[s % len(PALETTE)]
        runs: list[list[str]] = [[]]
        for index, value in enumerate(values[: len(x_labels)]):
            if value is None:
                runs.append([])
                continue
            runs[-1].append(f"{cx(index):.1f},{y(value):.1f}")
            body.append(f'<circle cx="{cx(index):.1f}" cy="{y(value):.1f}" r="3" fill="{colour}"><title>'
                        f"{esc(name)} · {esc(x_label)} {esc(x_labels[index])}: {esc(_number(value, digits))}"
                        "</title></circle>")
        for points in runs:
            if len(points) > 1:
                body.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{colour}" stroke-width="2"/>')
    body += labels.svg([cx(i) for i in range(len(x_labels))], axis_y)
    if labels.title:
        body.append(f'<text x="{left + plot_w / 2:.1f}" y="{title_y:.1f}" text-anchor="middle" class="xtitle">'
                    f"{esc(labels.title)}</text>")
    body.append(f'<line x1="{left}" x2="{width - right}" y1="{y(0):.1f}" y2="{y(0):.1f}" class="axis"/>')
    for row, items in enumerate(legend_rows):
        legend_y = legend_top + (LINE * FONT + 2) * (row + 1) - 4
        for s, x in items:
            colour = PALETTE[s % len(PALETTE)]
            body.append(f'<line x1="{x:.1f}" x2="{x + 16:.1f}" y1="{legend_y - 4:.1f}" y2="{legend_y - 4:.1f}" '
                        f'stroke="{colour}" stroke-width="2"/>'
                        f'<text x="{x + 22:.1f}" y="{legend_y:.1f}">{esc(series[s][0])}</text>')
    return _svg(width, height, title, body)
