"""What every signal sees: the prompt-derived context, code spans, evidence excerpts."""

from __future__ import annotations

from bisect import bisect_right
from functools import cached_property

from ddtree_diag.checks.quality.patterns import (
    ANY_SCRIPT_RE,
    DIALOGUE_PROMPT_RE,
    EVIDENCE_CHARS,
    INLINE_CODE_RE,
    LYRIC_PROMPT_RE,
    REPEAT_PROMPT_RE,
    TEMPLATE_PROMPT_RE,
)

# --------------------------------------------------------------------------------------------
# Context shared by the signals


class Context:
    """What the prompt allows; each fact is computed only when a signal asks for it."""

    def __init__(self, prompt: str, truncated: bool) -> None:
        self.prompt = prompt
        self.truncated = truncated

    @cached_property
    def prompt_lower(self) -> str:
        return self.prompt.lower()

    @cached_property
    def any_script(self) -> bool:  # translation and language prompts allow every script
        return bool(self.prompt) and bool(ANY_SCRIPT_RE.search(self.prompt))

    @cached_property
    def dialogue(self) -> bool:  # the prompt asked for a conversation, so turn markers are fine
        return bool(self.prompt) and bool(DIALOGUE_PROMPT_RE.search(self.prompt))

    @cached_property
    def about_templates(self) -> bool:  # the prompt asks about special tokens or chat templates
        return bool(self.prompt) and bool(TEMPLATE_PROMPT_RE.search(self.prompt))

    @cached_property
    def lyric(self) -> bool:  # songs and poems repeat on purpose
        return bool(self.prompt) and bool(LYRIC_PROMPT_RE.search(self.prompt))

    @cached_property
    def repeat(self) -> bool:  # the prompt asked for repetition
        return bool(self.prompt) and bool(REPEAT_PROMPT_RE.search(self.prompt))


def excerpt(text: str, start: int, end: int) -> str:
    end = min(end, start + EVIDENCE_CHARS)
    return text[start:end]


def code_spans_of(text: str) -> list[tuple[int, int]]:
    """Fenced blocks (an unclosed fence runs to the end) and inline `code`, sorted, disjoint."""
    if "`" not in text and "~~~" not in text:
        return []
    fences = _fence_spans(text)
    spans = list(fences)
    if "`" in text:
        spans += [m.span() for m in INLINE_CODE_RE.finditer(text) if not inside_spans(m.start(), fences)]
    spans.sort()
    return spans


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


_FAR = float("inf")


def inside_spans(pos: int, spans: list[tuple[int, int]]) -> bool:
    """Is pos inside one of the sorted, disjoint spans?"""
    index = bisect_right(spans, (pos, _FAR)) - 1
    return index >= 0 and spans[index][0] <= pos < spans[index][1]


def line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start : end if end >= 0 else len(text)]
