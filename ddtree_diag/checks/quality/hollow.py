"""Structure with nothing in it: list markers that never advance (``1. 1. 1.``), lines that hold
only punctuation or a bare list marker (in any script), list markers that count on with no
content (``1. 2. 3. 4.``), and runs of one punctuation character. A model that lost track of its
state keeps the shape of an answer (bullets, numbering, a closing mark) and drops the words.

Legitimate shapes stay quiet: Markdown rules and underlines (a whole line of ``-``, ``=``, ``*``),
table rows and borders, code (fenced or inline) and lines of closing brackets, dot leaders in a
table of contents (``Chapter 1 ........ 5``), fill-in blanks (``Name: ______``), an ellipsis or
an emphatic ``!!!``.
"""

from __future__ import annotations

import re
import unicodedata
from itertools import pairwise

from ddtree_diag.checks.quality.context import WINDOW, WINDOWED_ABOVE, Context, excerpt, inside_spans, reads
from ddtree_diag.checks.quality.patterns import MARKER_RE, STUCK_GATE_RE, WORDISH_RE
from ddtree_diag.records import Reason


def find_degenerate_enumeration(text: str, ctx: Context) -> list[Reason]:
    """List markers that never advance and hold nothing (``1. 1. 1.``), in a row or scattered."""
    if "." not in text and ")" not in text:
        return []
    gates = [m.start() for m in STUCK_GATE_RE.finditer(text)]
    if not gates:
        return []  # no marker followed closely by another: nothing stuck
    if len(text) <= WINDOWED_ABOVE:
        markers = list(MARKER_RE.finditer(text))
    else:  # a long text: walk the markers only around the gate hits
        markers, reach = [], 0
        for at in gates:
            lo, hi = max(reach, at - 200), min(len(text), at + 200)
            if lo < hi:
                markers += MARKER_RE.finditer(text, lo, hi)
            reach = max(reach, hi)
    if len(markers) < 3:
        return []
    stuck = 0
    first_span = None
    for prev, cur in pairwise(markers):
        between = text[prev.end() : cur.start()]
        empty = not WORDISH_RE.search(between) or len(between.strip()) <= 3
        if empty and int(cur.group(1)) <= int(prev.group(1)):
            stuck += 1
            if first_span is None:
                first_span = (prev.start(), cur.end())
    if stuck < 2:
        return []
    end = first_span[1]
    for m in markers:
        if m.start() >= first_span[0]:
            end = m.end()
    span = (first_span[0], end)
    return [Reason(
        "degenerate_enumeration",
        f"list markers that never advance and hold nothing ({stuck + 1} in a row or scattered)",
        excerpt(text, *span),
        min(0.9, 0.6 + 0.05 * (stuck - 2)),
        span,
    )]


# A list marker at the start of a line, in several scripts: bullets, "1." "1)" "(1)" "1、" "a)"
# "iv." "#3", and "<word> <number>:" ("Step 3:", "Шаг 3:", "Paso 3:").
_LINE_MARKER_RE = re.compile(
    r"^(?:[-*+•·‣◦▪●○■□–—>]|\(?\d{1,3}[.):、）]|\(\d{1,3}\)|\(?[a-zA-Z][.)]|[ivxlcIVXLC]{1,5}[.)]|#\d{1,3}"
    r"|[^\W\d_]{1,12}[ \t]?\d{1,3}[ \t]*[:.)：])"
)
_CODE_LINE_CHARS = set("{}[]();/\\|`\"'")  # a line of these is code (closing brackets, quotes)
_RULE_CHARS = set("-=_*~#+·•─━═")  # a line of one of these repeated is a rule or an underline
_SAME_CODE_LINES = 4


def _punct_only(text: str) -> bool:
    """Only punctuation and spaces (Unicode categories P*, plus the maths/modifier symbols that
    ASCII uses as punctuation: ``~ ^ + = < > |``); emoji and other symbols are content."""
    return all(ch.isspace() or unicodedata.category(ch)[0] == "P" or unicodedata.category(ch) in ("Sm", "Sk")
               for ch in text)


def _hollow(line: str) -> bool:
    """A line that holds a list marker or punctuation and nothing else, and is not a rule,
    a table row or a line of code punctuation."""
    stripped = line.strip()
    if not stripped or stripped.startswith(("|", "```", "~~~")):
        return False
    squeezed = stripped.replace(" ", "")
    if len(set(squeezed)) == 1 and squeezed[0] in _RULE_CHARS and len(squeezed) >= 3:
        return False  # "---", "===", "* * *": a rule or an underline
    if set(squeezed) <= _CODE_LINE_CHARS:
        return False  # "}", "});", "]": code
    marker = _LINE_MARKER_RE.match(stripped)
    rest = stripped[marker.end() :] if marker else stripped
    return _punct_only(rest)


@reads(WINDOW)
def find_hollow_lines(text: str, ctx: Context) -> list[Reason]:
    """Three or more hollow lines in a row (blank lines between them allowed), two or more ending
    the answer, or an answer whose lines are nearly all hollow."""
    code_spans, lo, hi = ctx.code_spans, ctx.lo, ctx.hi
    if "\n" not in text:
        return []
    at = lo
    run: list[tuple[int, int]] = []  # (start, end) of the hollow lines in the current run
    best: list[tuple[int, int]] = []
    # The same line of code punctuation, indentation and all, again and again (";", ")", '"'):
    # code nests its closing brackets at different depths, so a fifth identical one is not code.
    same: list[tuple[int, int]] = []
    hollow_total = content_total = 0
    for line in text[lo:hi].split("\n"):
        start, end = at, at + len(line)
        at = end + 1
        if not line or line.isspace():
            continue
        if len(line) <= 3 and set(line.strip()) <= _CODE_LINE_CHARS and not inside_spans(start, code_spans):
            same = [*same, (start, end)] if same and text[same[-1][0] : same[-1][1]] == line else [(start, end)]
            if len(same) >= _SAME_CODE_LINES and len(same) > len(best):
                best = list(same)
        else:
            same = []
        if len(line) > 24 or inside_spans(start, code_spans) or not _hollow(line):
            if line.strip():
                content_total += 1
            run = []
            continue
        hollow_total += 1
        run.append((start, end))
        if len(run) > len(best):
            best = list(run)
    needed = 3 if not ctx.repeat else 8
    mostly = hollow_total >= 2 and content_total <= 1 and hollow_total > content_total and not ctx.repeat
    # Empty items where the answer ends ("a) first\nb)\nc)"): the list was never filled.
    at_end = len(run) >= 2 and hi == len(text) and not text[run[-1][1] :].strip() and not ctx.repeat
    if at_end and len(best) < 3:
        best = list(run)
    if len(best) < needed and not mostly and not at_end:
        return []
    if len(best) < 2:
        return []
    span = (best[0][0], best[-1][1])
    lines = [text[a:b].strip() for a, b in best]
    shown = ", ".join(repr(x) for x in dict.fromkeys(lines[:6]))
    weight = 0.7 if len(best) >= 3 else 0.6
    if len(best) >= 6:
        weight = 0.8
    return [Reason(
        "empty_list",
        f"{len(best)} line(s) in a row hold only a list marker or punctuation ({shown}); "
        f"{hollow_total} such line(s), {content_total} with content",
        excerpt(text, *span),
        weight,
        span,
    )]


# A list marker: "1." "1)" "(1)" "#1" "1:" "1、" "一、"; before it may stand a label word that is the
# same at every marker ("Step 1: Step 2:", "Шаг 1: Шаг 2:").
_COUNT_MARKER_RE = re.compile(
    r"(?<![\w.,])(?:\((\d{1,3})\)|#(\d{1,3})|(\d{1,3})[.):、）:：]|([一二三四五六七八九十]{1,3})、)(?=\s|$)"
)
_LABEL_RE = re.compile(r"[^\W\d_]{1,12}")
_CJK_DIGITS = {c: i for i, c in enumerate("一二三四五六七八九十", 1)}


def _marker_number(match: re.Match) -> int:
    for group in match.groups():
        if group is None:
            continue
        if group.isdigit():
            return int(group)
        return sum(_CJK_DIGITS.get(c, 0) for c in group)
    return -1


@reads(WINDOW)
def find_empty_counting(text: str, ctx: Context) -> list[Reason]:
    """Four or more list markers in a row that count on (``1. 2. 3. 4.``, ``(1) (2) (3)``,
    ``Step 1: Step 2:``) with nothing but spaces or punctuation between them."""
    if ctx.repeat:
        return []
    code_spans, lo, hi = ctx.code_spans, ctx.lo, ctx.hi
    best: list[re.Match] = []
    run: list[re.Match] = []
    label = None
    for match in _COUNT_MARKER_RE.finditer(text, lo, hi):
        if inside_spans(match.start(), code_spans):
            run = []
            continue
        if run:
            between = text[run[-1].end() : match.start()]
            line_start = text.rfind("\n", 0, match.start()) + 1
            in_table = text[line_start : match.start()].lstrip().startswith("|")
            word = _LABEL_RE.search(between)
            # Nothing between but punctuation, or only the run's label word right before the number,
            # on its line ("Step 2:"; "1. TBD\n2. TBD" is a list of placeholders)
            empty = _punct_only(between) or (
                word is not None
                and _punct_only(between[: word.start()])
                and not between[word.end() :].strip()
                and "\n" not in between[word.end() :]
                and (label is None or word.group().lower() == label)
            )
            if empty and not in_table and _marker_number(match) == _marker_number(run[-1]) + 1:
                if word is not None and not _punct_only(between):
                    label = word.group().lower()
                run.append(match)
            else:
                run, label = [match], None
        else:
            run = [match]
        if len(run) > len(best):
            best = list(run)
    if len(best) < 4:
        return []
    span = (best[0].start(), best[-1].end())
    weight = 0.7 if len(best) < 8 else 0.8
    return [Reason(
        "empty_list",
        f"{len(best)} list markers count on with nothing in them "
        f"({best[0].group().strip()} … {best[-1].group().strip()})",
        excerpt(text, *span),
        weight,
        span,
    )]


# A run of one punctuation mark, contiguous ("!!!!!!!!", "。。。。。。") or spaced (". . . . . . . .").
_RUN_RE = re.compile(r"([^\w\s]|_)(?:[ \t]?\1){3,}")
_MARKUP = set("-=_*#~`|+<>/\\^")  # rules, underlines, borders, comments, arrows
_DOTS = set(".·•‧∙⋅")
_SEPARATORS = set(",，、;；:：")


_GRID_RULE_RE = re.compile(r"\s*\+[-=+:]*[-=]{3}[-=+:]*\+\s*")  # a grid table's rule: +----+=====+


@reads(WINDOW)
def find_punct_run(text: str, ctx: Context) -> list[Reason]:
    if ctx.repeat:
        return []
    code_spans, lo, hi = ctx.code_spans, ctx.lo, ctx.hi
    found: Reason | None = None
    for match in _RUN_RE.finditer(text, lo, hi):
        char = match.group(1)
        spaced = " " in match.group() or "\t" in match.group()
        count = match.group().count(char)
        start, end = match.span()
        if inside_spans(start, code_spans) or unicodedata.category(char)[0] not in "PS":
            continue
        if unicodedata.category(char)[0] == "S" and char not in _MARKUP:
            continue  # emoji and other symbols: the flood check's business
        line_start = text.rfind("\n", 0, start) + 1
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        line = text[line_start:line_end]
        before, after = text[line_start:start], text[end:line_end]
        if line.lstrip().startswith("|") or line.rstrip().endswith("|") or _GRID_RULE_RE.fullmatch(line):
            continue  # a table, or a grid table's rule ("+----+-----+", "+====+")
        reaches_end = not text[end:].strip()
        if char in _MARKUP or (spaced and char in "*-"):
            # A whole line of it is a rule; mid-line it is a blank to fill, an arrow or a masked
            # secret ("______", "---->", "********"), but nobody spaces those out ("* * * * * *").
            if not before.strip() and not after.strip():
                continue
            needed = 10 if spaced else 40
        elif char in _DOTS:
            if re.fullmatch(r"\s*\d[\d\s,.-]*", after) and before.strip():
                continue  # dot leaders: "Chapter 1 ....... 5"
            needed = 10
        elif char in _SEPARATORS:
            needed = 5
        elif char in "…":
            needed = 4
        elif char in "!?！？":
            needed = 10
        else:
            needed = 8
        if spaced:
            needed = max(needed, 8)
        if reaches_end and ctx.truncated:
            needed = max(5, needed // 2)
        if count < needed:
            continue
        weight = 0.75 if count >= 3 * needed or reaches_end else 0.6
        reason = Reason(
            "punct_run",
            f"{char!r} repeated {count}× in a row{' (spaced)' if spaced else ''}"
            + (" to the end" if reaches_end else ""),
            excerpt(text, start, end),
            weight,
            (start, end),
        )
        if found is None or reason.weight > found.weight:
            found = reason
    return [found] if found is not None else []


DETECTORS = (find_degenerate_enumeration, find_hollow_lines, find_empty_counting, find_punct_run)
