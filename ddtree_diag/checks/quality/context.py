"""What every detector sees: the one detector shape, the request and the text being read (its code
spans and search windows), evidence excerpts.

A detector is ``(text, ctx) -> list[Reason]``: it reads ``text`` (the answer, the think block,
the separated reasoning or the whole reply, as its ``reads`` says) and returns new reasons with
spans into that text; the caller places them in the reply. A detector never changes what it was
handed. ``reads`` (set with the ``@reads(...)`` decorator, default ``ANY``) says which text it
is given:

- ``WHOLE``: the whole reply, once, before the think block is split off (truncation, think tags);
- ``EMPTY``: an answer with no content (``has_content`` is false): nothing else reads it;
- ``ANY``: every text with content: the answer, the think block, the separated reasoning;
- ``WINDOW``: as ``ANY``, one search window at a time (``ctx.lo``/``ctx.hi``: the stretches the
  loop search reads, minus long code blocks); the heaviest reason per code over every window and
  every ``WINDOW`` detector is kept;
- ``ANSWER``: the answer only, after the ``ANY`` detectors.
"""

from __future__ import annotations

import json
import re
import zlib
from bisect import bisect_right
from collections.abc import Callable
from typing import Any, Protocol

from ddtree_diag.checks.quality.patterns import (
    ANY_SCRIPT_RE,
    COUNT_RE,
    DIALOGUE_PROMPT_RE,
    EVIDENCE_CHARS,
    HAS_CONTENT_RE,
    INLINE_CODE_RE,
    LYRIC_PROMPT_RE,
    ONLY_MARKER_RE,
    REPEAT_PROMPT_RE,
    TEMPLATE_PROMPT_RE,
    count_value,
)
from ddtree_diag.records import Reason

# --------------------------------------------------------------------------------------------
# The detector shape

WHOLE, EMPTY, ANY, WINDOW, ANSWER = "whole", "empty", "any", "window", "answer"
SCOPES = (WHOLE, EMPTY, ANY, WINDOW, ANSWER)


class Detector(Protocol):
    """``(text, ctx) -> list[Reason]``; ``reads`` is one of ``SCOPES``."""

    __name__: str

    def __call__(self, text: str, ctx: Context, /) -> list[Reason]: ...


def reads(scope: str) -> Callable[[Callable[..., list[Reason]]], Detector]:
    """Mark which text a detector reads (see the module docstring); undecorated ones read ``ANY``."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")

    def mark(detector: Any) -> Detector:
        detector.reads = scope
        return detector

    return mark


def scope_of(detector: Detector) -> str:
    return getattr(detector, "reads", ANY)


def has_content(answer: str) -> bool:
    """Does the answer hold anything but whitespace, punctuation or a bare list marker?"""
    stripped = answer.strip()
    if stripped.startswith(("```", "~~~")) and _drawing(stripped):
        return True
    return bool(stripped) and bool(HAS_CONTENT_RE.search(stripped)) and not ONLY_MARKER_RE.fullmatch(stripped)


def _drawing(fenced: str) -> bool:
    """A fenced block drawn in punctuation (a tic-tac-toe board, an empty grid): 3+ lines, 3+
    kinds of mark, 12+ marks. Hollow garbage repeats one mark a line and is not fenced."""
    lines = [line for line in fenced.splitlines()[1:] if line.strip() and not line.lstrip().startswith(("```", "~~~"))]
    marks = "".join(lines).replace(" ", "").replace("\t", "")
    return len(lines) >= 3 and len(set(marks)) >= 3 and len(marks) >= 12


# --------------------------------------------------------------------------------------------
# Context shared by the detectors


def _cached_in(store: str) -> Callable[[Callable[[Context], Any]], property]:
    """A fact computed on first use and kept in the context's ``store`` dict: ``_facts`` (the
    request's, shared by every text read) or ``_text_facts`` (the text's, shared by its windows)."""

    def wrap(compute: Callable[[Context], Any]) -> property:
        name = compute.__name__

        def get(self: Context) -> Any:
            facts = getattr(self, store)
            if name not in facts:
                facts[name] = compute(self)
            return facts[name]

        return property(get, doc=compute.__doc__)

    return wrap


_fact = _cached_in("_facts")
_text_fact = _cached_in("_text_facts")


class Context:
    """The request (what the prompt allows, how generation ended) and the text being read; each
    fact is computed only when a detector asks for it."""

    def __init__(
        self,
        prompt: str,
        truncated: bool,
        *,
        finish: str | None = None,
        completion_tokens: int | None = None,
        max_tokens: int | None = None,
        thinking: bool | None = None,
        reasoning: str | None = None,
        has_thought: bool = False,
        unclosed_think: bool = False,
    ) -> None:
        self.prompt = prompt
        self.truncated = truncated
        self.finish = finish  # finish_reason, lower case; None when unknown
        self.completion_tokens = completion_tokens
        self.max_tokens = max_tokens
        self.thinking = thinking  # the request's enable_thinking (None = unknown)
        self.reasoning = reasoning  # the server-separated thinking text, if any
        self.has_thought = has_thought  # the reply holds thinking (separated or a think block)
        self.unclosed_think = unclosed_think  # the reply has a think block that never closes
        self.text = ""  # the text being read (see reading)
        self.lo, self.hi = 0, 0  # the stretch of it a WINDOW detector reads
        self._facts: dict[str, Any] = {}
        self._text_facts: dict[str, Any] = {}

    def reading(self, text: str) -> Context:
        """The same request, reading ``text``."""
        view = self._view()
        view.text, view.lo, view.hi = text, 0, len(text)
        view._text_facts = {}
        return view

    def window(self, lo: int, hi: int) -> Context:
        """The same text, one search window of it (for WINDOW detectors)."""
        view = self._view()
        view.lo, view.hi = lo, hi
        return view

    def _view(self) -> Context:
        view = object.__new__(Context)  # a shallow copy (copy.copy costs more per answer)
        view.__dict__.update(self.__dict__)
        return view

    # What the prompt allows
    @_fact
    def prompt_lower(self) -> str:
        return self.prompt.lower()

    @_fact
    def any_script(self) -> bool:  # translation and language prompts allow every script
        return bool(self.prompt) and bool(ANY_SCRIPT_RE.search(self.prompt))

    @_fact
    def dialogue(self) -> bool:  # the prompt asked for a conversation, so turn markers are fine
        return bool(self.prompt) and bool(DIALOGUE_PROMPT_RE.search(self.prompt))

    @_fact
    def about_templates(self) -> bool:  # the prompt asks about special tokens or chat templates
        return bool(self.prompt) and bool(TEMPLATE_PROMPT_RE.search(self.prompt))

    @_fact
    def lyric(self) -> bool:  # songs and poems repeat on purpose
        return bool(self.prompt) and bool(LYRIC_PROMPT_RE.search(self.prompt))

    @_fact
    def repeat(self) -> bool:  # the prompt asked for repetition
        return bool(self.prompt) and bool(REPEAT_PROMPT_RE.search(self.prompt))

    @_fact
    def repeat_count(self) -> int:  # the largest count a repetition prompt names (0: none, or no such prompt)
        if not self.repeat:
            return 0
        return max((count_value(match) for match in COUNT_RE.finditer(self.prompt)), default=0)

    # The text being read
    @_text_fact
    def code_spans(self) -> list[tuple[int, int]]:
        """The text's code: fenced blocks and inline code (see code_spans_of)."""
        return code_spans_of(self.text)

    @_text_fact
    def windows(self) -> list[tuple[int, int]]:
        """Where the repetition signals look (see search_windows)."""
        return search_windows(self.text)

    @_text_fact
    def shape_windows(self) -> list[tuple[int, int]]:
        """The windows minus long code blocks: what WINDOW detectors read."""
        return outside_code(self.windows, self.code_spans)


def excerpt(text: str, start: int, end: int) -> str:
    end = min(end, start + EVIDENCE_CHARS)
    return text[start:end]


def code_spans_of(text: str) -> list[tuple[int, int]]:
    """Fenced blocks (an unclosed fence runs to the end) and inline `code`, sorted, disjoint; a
    whole answer that is bare JSON ("return only JSON") is one span."""
    if bare_json(text):
        return [(0, len(text))]
    if "`" not in text and "~~~" not in text:
        return []
    fences = _fence_spans(text)
    spans = list(fences)
    if "`" in text:
        spans += [m.span() for m in INLINE_CODE_RE.finditer(text) if not inside_spans(m.start(), fences)]
    spans.sort()
    return spans


# A line of JSON: a key, a string or number item, a literal, or brackets alone.
_JSON_LINE_RE = re.compile(
    r'\s*(?:"(?:[^"\\]|\\.)*"\s*:.*|"(?:[^"\\]|\\.)*",?|-?\d[\d.eE+-]*,?|true,?|false,?|null,?|[\[\]{}]+,?)\s*'
)


def bare_json(text: str) -> bool:
    """Whether the whole text is JSON without a fence: it parses, or (cut by the token limit) it
    opens with a bracket and 3+ lines, nearly all of them JSON lines."""
    stripped = text.strip()
    if not stripped or stripped[0] not in "{[":
        return False
    try:
        json.loads(stripped)
        return True
    except ValueError:
        pass
    lines = [line for line in stripped.splitlines() if line.strip()]
    if len(lines) < 3:
        return False
    json_lines = sum(1 for line in lines[:-1] if _JSON_LINE_RE.fullmatch(line))  # the last may be cut
    return json_lines >= 0.8 * (len(lines) - 1)


def _fence_spans(text: str) -> list[tuple[int, int]]:
    # str.find over the fence markers: much faster than a multi-line regex on long texts.
    marks: list[tuple[int, str]] = []
    for fence in ("```", "~~~"):
        at = text.find(fence)
        while at >= 0:
            line_start = text.rfind("\n", 0, at) + 1
            if not text[line_start:at].strip(" \t"):
                marks.append((line_start, fence))
            nl = text.find("\n", at)
            at = text.find(fence, nl) if nl >= 0 else -1
    marks.sort()
    spans: list[tuple[int, int]] = []
    opened: tuple[int, str] | None = None
    for start, fence in marks:
        if opened is None:
            opened = (start, fence)
        elif fence == opened[1]:
            end = text.find("\n", start)
            spans.append((opened[0], end if end >= 0 else len(text)))
            opened = None
    if opened is not None:
        spans.append((opened[0], len(text)))
    return spans


_NAMING_BEFORE_RE = re.compile(
    r"\b(?:special\s+|control\s+|stop\s+|end\s+)?(?:tokens?|tags?|markers?|delimiters?|separators?|strings?)"
    r"\s+(?:like\s+|such\s+as\s+|called\s+|named\s+)?[\"'“‘]?\Z",
    re.IGNORECASE,
)
_NAMING_AFTER_RE = re.compile(
    r"[\"'”’]?(?:\s*(?:,|and|or|/)?\s*(?:<[^<>\s]{1,24}>|\[/?[A-Z_]{2,20}\]))*"
    r"\s+(?:special\s+)?(?:tokens?|tags?|markers?|delimiters?|blocks?|pairs?)\b",
    re.IGNORECASE,
)


def named_in_prose(text: str, start: int, end: int) -> bool:
    """Whether the special token at text[start:end] is talked about, not emitted: "the special
    token <|endoftext|>", "between <think> and </think> tags"."""
    return bool(_NAMING_BEFORE_RE.search(text, max(0, start - 40), start)
                or _NAMING_AFTER_RE.match(text, end, min(len(text), end + 60)))


def in_inline_code(text: str, pos: int) -> bool:
    """Inside `single backticks` on its line (an odd number of backticks before it)."""
    line_start = text.rfind("\n", 0, pos) + 1
    before = text[line_start:pos]
    return before.count("`") % 2 == 1 and not before.lstrip().startswith("```")


_FAR = float("inf")


def inside_spans(pos: int, spans: list[tuple[int, int]]) -> bool:
    """Is pos inside one of the sorted, disjoint spans?"""
    index = bisect_right(spans, (pos, _FAR)) - 1
    return index >= 0 and spans[index][0] <= pos < spans[index][1]


def line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start : end if end >= 0 else len(text)]


# --------------------------------------------------------------------------------------------
# Search windows

# Texts longer than this are searched for loops only where zlib says they repeat (a loop always
# compresses well), which keeps long healthy answers fast: zlib runs at C speed.
WINDOWED_ABOVE = 16_384
_BLOCK = 1_024
_TAIL = 8_192


def search_windows(text: str) -> list[tuple[int, int]]:
    """Where the repetition signals look: the whole text, or in a long one the stretches zlib
    finds repetitive plus the head and the tail (see _suspect_windows)."""
    if len(text) <= WINDOWED_ABOVE:
        return [(0, len(text))]
    windows = _suspect_windows(text)
    if windows[0][0] > _BLOCK * 4:
        windows = [(0, _BLOCK * 4), *windows]
    elif windows[0][1] < _BLOCK * 4:
        windows = [(0, _BLOCK * 4), *windows[1:]]
    return windows


def _suspect_windows(text: str) -> list[tuple[int, int]]:
    """Stretches of a long text worth a token-level loop search: 1 KiB blocks that compress much
    better than the text's median block, or two neighbours that do together (a loop across a
    block edge), with a block of margin each side; and the tail, since a loop that runs to the
    end is the common failure. Overlapping picks are merged."""
    starts = range(0, len(text), _BLOCK)
    ratios = []
    for lo in starts:
        chunk = text[lo : lo + _BLOCK].encode("utf-8", "surrogatepass")
        ratios.append(len(zlib.compress(chunk, 1)) / max(1, len(chunk)))
    median = sorted(ratios)[len(ratios) // 2]
    picks = []
    for i, ratio in enumerate(ratios):
        pair = (ratio + ratios[i + 1]) / 2 if i + 1 < len(ratios) else ratio
        if ratio < 0.8 * median or pair < 0.85 * median:
            picks.append(
                (max(0, starts[i] - _BLOCK // 2), min(len(text), starts[i] + 2 * _BLOCK + _BLOCK // 2))
            )
    picks.append((max(0, len(text) - _TAIL), len(text)))
    return merge_spans(picks)


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans sorted, overlapping or touching ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


def outside_code(windows: list[tuple[int, int]], code_spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The windows minus long code blocks (the shape and stutter finders skip code anyway, and a
    long answer is often mostly code)."""
    blocks = [(a, b) for a, b in code_spans if b - a > 200]
    if not blocks:
        return windows
    out = []
    for lo, hi in windows:
        at = lo
        for a, b in blocks:
            if b <= at or a >= hi:
                continue
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < hi:
            out.append((at, hi))
    return out
