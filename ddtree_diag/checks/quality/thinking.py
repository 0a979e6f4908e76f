"""Think blocks: split the answer from its thinking, and flag thinking leaks."""

from __future__ import annotations

import re

from ddtree_diag.checks.quality.context import WHOLE, Context, excerpt, named_in_prose, reads
from ddtree_diag.checks.quality.patterns import THINK_CLOSE, THINK_OPEN
from ddtree_diag.records import Reason


def split_thinking(text: str) -> tuple[str, str, int]:
    """(answer, think_text, think_offset): the answer after a think block, the block's text and
    where it starts in ``text``; an unclosed block runs to the end (the answer is what precedes it)."""
    opens = text.count(THINK_OPEN)
    closes = text.count(THINK_CLOSE)
    if (not opens and not closes) or _all_named(text):
        return text, "", 0  # no tags, or only tags an answer talks about
    last_close = text.rfind(THINK_CLOSE)
    if unclosed_think(text):
        start = text.rfind(THINK_OPEN)
        think_start = start + len(THINK_OPEN)
        return text[:start], text[think_start:], think_start
    if last_close >= 0:
        open_at = text.find(THINK_OPEN)
        think_start = open_at + len(THINK_OPEN) if 0 <= open_at < last_close else 0
        return text[last_close + len(THINK_CLOSE) :], text[think_start:last_close], think_start
    return text, "", 0


def unclosed_think(text: str) -> bool:
    """A ``<think>`` after the last ``</think>``: a block that never closes (not a tag the
    answer only talks about)."""
    return THINK_OPEN in text and text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE) and not _all_named(text)


def _all_named(text: str) -> bool:
    """Every think tag is talked about in prose (see ``named_in_prose``)."""
    tags = [(m.start(), m.end()) for m in _THINK_TAG_RE.finditer(text)]
    return bool(tags) and all(named_in_prose(text, a, b) for a, b in tags)


_THINK_TAG_RE = re.compile(re.escape(THINK_OPEN) + "|" + re.escape(THINK_CLOSE))


@reads(WHOLE)
def find_thinking_leaks(text: str, ctx: Context) -> list[Reason]:
    """Think tags where they do not belong (thinking off, reasoning separated, repeated), and a
    think block that never closes."""
    opens = text.count(THINK_OPEN)
    closes = text.count(THINK_CLOSE)
    if not opens and not closes:
        return []
    out: list[Reason] = []
    first = min(i for i in (text.find(THINK_OPEN), text.find(THINK_CLOSE)) if i >= 0)
    tag_span = (first, first + len(THINK_CLOSE))
    if _all_named(text):
        return []  # "between <think> and </think> tags": an answer about think tags, not a leak
    leak = None
    if ctx.thinking is False:
        leak = (f"think tags in the answer although thinking is off ({opens} open, {closes} close)", 0.8)
    elif ctx.reasoning and ctx.reasoning.strip():
        leak = ("think tags in the answer although the server returned the reasoning separately", 0.7)
    elif opens > 1 or closes > 1:
        leak = (f"repeated think tags ({opens} open, {closes} close)", 0.7)
    if leak is not None:
        out.append(Reason("thinking_leak", leak[0], excerpt(text, *tag_span), leak[1], tag_span))
    if unclosed_think(text):
        start = text.rfind(THINK_OPEN)
        if ctx.truncated:
            detail = "cut by length inside the think block"
            out.append(Reason("unterminated_think", detail, "", 0.0, (start, len(text))))
        else:
            stopped = ctx.finish is not None  # with no finish_reason, it may have been cut
            out.append(Reason(
                "unterminated_think",
                "the think block never closes although generation stopped"
                if stopped
                else "the think block never closes (finish_reason unknown)",
                excerpt(text, start, len(text)),
                0.6 if stopped else 0.3,
                (start, len(text)),
            ))
    return out


DETECTORS = (find_thinking_leaks,)
