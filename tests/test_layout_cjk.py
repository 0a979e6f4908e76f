"""Answers written without spaces (Chinese, Japanese, glued garbage) in the per-case table: the
output column folds them at character boundaries by display width instead of being left out."""

from __future__ import annotations

import io
import itertools
import re

import pytest
from rich.cells import cell_len
from rich.console import Console

from ddtree_diag.output.cells import visible
from ddtree_diag.output.console import render_report
from ddtree_diag.output.fit import fold_offsets
from tests.support.reportkit import varied_report

CHINESE = "你好！很高兴认识你。今天天气很好，我们一起去公园散步吧。我想告诉你一个关于猫的故事，它住在山里。"
JAPANESE = "こんにちは。お元気ですか。今日はとても良い天気ですね。一緒に公園へ散歩に行きましょう。"


def rendered(width: int, report, *, terminal: bool = False) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal, no_color=True,
                      color_system=None, highlight=False, emoji=False, legacy_windows=False)
    render_report(console, report, 0)
    return console.file.getvalue()


def wide_chars(text: str) -> str:
    return "".join(ch for ch in text if cell_len(ch) == 2)


def cjk_report(answers: list[str]):
    report = varied_report()
    report.results = report.results[: len(answers)]
    for result, answer in zip(report.results, answers, strict=True):
        result.output = answer
    report.findings, report.gate, report.notes = [], None, []
    return report


def pieces(text: str, width: int) -> list[str]:
    offsets = [0, *fold_offsets(text, width), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(offsets)]


@pytest.mark.unit
@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
@pytest.mark.parametrize("width", (80, 120, 200))
def test_a_cjk_answer_keeps_the_output_column(width, terminal):
    # long enough that neither answer fits on one line next to the numbers, even at 200 columns
    report = cjk_report([CHINESE * 2, JAPANESE * 2])
    out = rendered(width, report, terminal=terminal)
    assert max(cell_len(line) for line in out.splitlines()) <= width
    left_out = re.search(r"left out at \d+ columns: (.*) \(see", out)
    if width >= 120:
        assert left_out is None, out
    if left_out is None:  # every character of what the table shows, in order, across the folded lines
        header = next(line for line in out.splitlines() if "output" in line)
        assert "quality" in header or width < 120
        shown = wide_chars(out)
        for result in report.results:
            expected = wide_chars(visible(result.output))
            assert expected in shown, (expected, out)


@pytest.mark.unit
def test_a_short_cjk_answer_stays_on_one_line_at_200_columns():
    report = cjk_report(["你好！很高兴认识你。", "こんにちは。"])
    out = rendered(200, report)
    assert any("你好！很高兴认识你。" in line for line in out.splitlines())


@pytest.mark.unit
@pytest.mark.parametrize("width", (2, 3, 7, 10, 21))
def test_fold_breaks_unspaced_text_by_display_width(width):
    for text in (CHINESE, JAPANESE, "WordWordWordWordWordWord and 题目:题目 more", "a " * 30, "漢字abc漢字 de"):
        lines = pieces(text, width)
        assert "".join(lines) == text
        assert all(cell_len(line.rstrip()) <= width for line in lines), lines
        if width >= 4:  # closing punctuation never starts a line (room for a character and its mark)
            assert not any(line[:1] in "。，！、" for line in lines[1:]), lines


@pytest.mark.unit
def test_fold_keeps_words_whole_when_they_fit_and_joins_combining_marks():
    assert pieces("Hello world, this is a test", 12) == ["Hello world, ", "this is a ", "test"]
    assert pieces("你好世界", 4) == ["你好", "世界"]
    # a base letter and its combining mark (and an emoji with its skin tone) are never split
    text = "e\u0301" * 6 + "👍🏽" * 3
    for width in (2, 3, 4):
        for line in pieces(text, width):
            assert not line.startswith("\u0301") and not line.startswith("\U0001f3fd")
