"""Think blocks: split the answer from its thinking, and flag thinking leaks."""

from __future__ import annotations

from ddtree_diag.checks.quality.context import excerpt
from ddtree_diag.checks.quality.patterns import THINK_CLOSE, THINK_OPEN
from ddtree_diag.records import Reason

# --------------------------------------------------------------------------------------------
# Thinking


def split_thinking(
    text: str,
    thinking: bool | None,
    reasoning: str | None,
    truncated: bool,
    finish: str | None,
    reasons: list[Reason],
) -> tuple[str, str, int]:
    """Return (answer, think_text, think_offset) and add thinking_leak/unterminated_think reasons."""
    opens = text.count(THINK_OPEN)
    closes = text.count(THINK_CLOSE)
    if not opens and not closes:
        return text, "", 0
    first = min(i for i in (text.find(THINK_OPEN), text.find(THINK_CLOSE)) if i >= 0)
    tag_span = (first, first + len(THINK_CLOSE))
    if thinking is False:
        reasons.append(
            Reason(
                "thinking_leak",
                f"think tags in the answer although thinking is off ({opens} open, {closes} close)",
                excerpt(text, *tag_span),
                0.8,
                tag_span,
            )
        )
    elif reasoning and reasoning.strip():
        reasons.append(
            Reason(
                "thinking_leak",
                "think tags in the answer although the server returned the reasoning separately",
                excerpt(text, *tag_span),
                0.7,
                tag_span,
            )
        )
    elif opens > 1 or closes > 1:
        reasons.append(
            Reason(
                "thinking_leak",
                f"repeated think tags ({opens} open, {closes} close)",
                excerpt(text, *tag_span),
                0.7,
                tag_span,
            )
        )
    last_close = text.rfind(THINK_CLOSE)
    if opens and text.rfind(THINK_OPEN) > last_close:
        start = text.rfind(THINK_OPEN)
        think_start = start + len(THINK_OPEN)
        if truncated:
            reasons.append(
                Reason(
                    "unterminated_think", "cut by length inside the think block", "", 0.0, (start, len(text))
                )
            )
        else:
            stopped = finish is not None  # with no finish_reason, it may have been cut
            reasons.append(
                Reason(
                    "unterminated_think",
                    "the think block never closes although generation stopped"
                    if stopped
                    else "the think block never closes (finish_reason unknown)",
                    excerpt(text, start, len(text)),
                    0.6 if stopped else 0.3,
                    (start, len(text)),
                )
            )
        return text[:start], text[think_start:], think_start
    if last_close >= 0:
        open_at = text.find(THINK_OPEN)
        think_start = open_at + len(THINK_OPEN) if 0 <= open_at < last_close else 0
        return text[last_close + len(THINK_CLOSE) :], text[think_start:last_close], think_start
    return text, "", 0
