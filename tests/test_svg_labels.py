"""Chart text in the HTML report never overlaps: every ``<text>`` of every chart is measured as a
box (an independent per-character width estimate, turned by its ``rotate()``), and no two boxes
may intersect, for few and many groups, short, long and CJK labels, and wide values."""

from __future__ import annotations

import math
import re
import unicodedata
from html import unescape
from itertools import combinations

import pytest

from ddtree_diag.output.diff import diff_runs
from ddtree_diag.output.html import html_diff, html_report
from ddtree_diag.output.svg import grouped_bars, histogram, paired_bars
from tests.support.reportkit import slower_copy, varied_report

TEXT = re.compile(r"<text([^>]*)>(.*?)</text>", re.S)
SVG = re.compile(r"<svg[^>]*viewBox=\"0 0 (\d+) (\d+)\"[^>]*>(.*?)</svg>", re.S)


def width_of(text: str, size: float) -> float:
    """A typical sans-serif: ~0.58 em a Latin letter or digit on average, 1 em a CJK character."""
    return size * sum(1.0 if unicodedata.east_asian_width(c) in "WF" else 0.58 for c in text)


def boxes(svg: str) -> list[tuple[str, list[tuple[float, float]]]]:
    """(text, corners) of every text element: glyph box from ascent 0.8 em to descent 0.2 em."""
    found = []
    for attributes, inner in TEXT.findall(svg):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', attributes))
        text = unescape(re.sub(r"<title>.*?</title>", "", inner, flags=re.S))
        size = 10.0 if re.search(r"\b(value|small)\b", attrs.get("class", "")) else 11.0
        x, y = float(attrs["x"]), float(attrs["y"])
        w = width_of(text, size)
        start = {"start": x, "middle": x - w / 2, "end": x - w}[attrs.get("text-anchor", "start")]
        corners = [(start, y - 0.8 * size), (start + w, y - 0.8 * size), (start + w, y + 0.2 * size),
                   (start, y + 0.2 * size)]
        turn = re.search(r"rotate\(([-\d.]+) ([-\d.]+) ([-\d.]+)\)", attrs.get("transform", ""))
        if turn:
            angle, cx, cy = (float(v) for v in turn.groups())
            a = math.radians(angle)
            corners = [(cx + (px - cx) * math.cos(a) - (py - cy) * math.sin(a),
                        cy + (px - cx) * math.sin(a) + (py - cy) * math.cos(a)) for px, py in corners]
        found.append((text, corners))
    return found


def overlap(p: list[tuple[float, float]], q: list[tuple[float, float]]) -> bool:
    """Separating-axis test for two convex quadrilaterals (touching is not overlapping)."""
    for shape in (p, q):
        for (x1, y1), (x2, y2) in zip(shape, shape[1:] + shape[:1], strict=True):
            nx, ny = y2 - y1, x1 - x2
            a = [nx * x + ny * y for x, y in p]
            b = [nx * x + ny * y for x, y in q]
            if max(a) <= min(b) + 1e-6 or max(b) <= min(a) + 1e-6:
                return False
    return True


def assert_no_overlap(page_or_svg: str) -> int:
    charts = SVG.findall(page_or_svg)
    assert charts
    for width, _height, body in charts:
        found = boxes(body)
        for (ta, a), (tb, b) in combinations(found, 2):
            assert not overlap(a, b), (ta, tb)
        for text, corners in found:  # nothing runs off the left or right edge
            assert min(x for x, _ in corners) >= -1 and max(x for x, _ in corners) <= int(width) + 1, text
    return len(charts)


@pytest.mark.unit
def test_the_budget_charts_of_a_report_have_no_overlapping_text():
    report = varied_report()
    for result in report.results:  # three budgets, one thinking mode: the slots are narrow
        result.case.enable_thinking = False
    for result, budget in zip(report.results, (16, 32, 64, 16, 32), strict=True):
        result.case.tree_budget = budget
    page = html_report(report, 1)
    assert assert_no_overlap(page) >= 3
    assert ">16</text>" in page and ">64</text>" in page  # the shared "budget" went to the axis title
    assert assert_no_overlap(html_diff(diff_runs(report, slower_copy(report)), "runs/a.json", "runs/b.json"))


LABELS = {
    "budgets": lambda n: [f"budget {2 ** i}" for i in range(n)],
    "long": lambda n: [f"a rather long label for group number {i} of the chart" for i in range(n)],
    "cjk": lambda n: [f"预算 {i} 思考模式开启的情况" for i in range(n)],
    "mixed": lambda n: [("x" if i % 2 else "WWWWWWWWWWWWWWWWWWWWWW") + str(i) for i in range(n)],
}


@pytest.mark.unit
@pytest.mark.parametrize("kind", sorted(LABELS))
@pytest.mark.parametrize("groups", [1, 2, 3, 7, 16, 40])
@pytest.mark.parametrize("series", [1, 2, 4])
def test_grouped_bars_never_overlap_labels(kind, groups, series):
    labels = LABELS[kind](groups)
    names = [f"thinking mode {s} with a long name" for s in range(series)]
    values = {(g, s): (None if (g + s) % 5 == 4 else 1234.5 * (1 + (g * 7 + s) % 3)) for g in range(groups)
              for s in range(series)}
    svg = grouped_bars(labels, names, values, title="t", y_label="tok/s", digits=1, reference=1.0)
    assert assert_no_overlap(svg) == 1
    shown = [re.sub(r"<title>.*?</title>", "", t) for a, t in TEXT.findall(svg) if "xlabel" in a]
    assert shown and len(shown) >= min(groups, 8) // 2  # thinned at most to every other label here


@pytest.mark.unit
@pytest.mark.parametrize("largest", [3, 9, 16, 40, 150])
def test_histogram_labels_never_overlap(largest):
    counts = {n: (n * 37) % 11 + 1 for n in range(1, largest + 1)}
    assert assert_no_overlap(histogram(counts, largest, title="h")) == 1


@pytest.mark.unit
def test_paired_bars_labels_never_overlap():
    labels = [f"#{i} prompt-with-a-very-long-name-{'长' * i} on 16 T0 r0" for i in range(12)]
    a = [None if i % 4 == 3 else 1000.0 + i for i in range(12)]
    b = [2.5 * i for i in range(12)]
    svg = paired_bars(labels, a, b, title="p", names=("a-very-long-run-file-name.json", "b.json"), digits=1)
    assert assert_no_overlap(svg) == 1
