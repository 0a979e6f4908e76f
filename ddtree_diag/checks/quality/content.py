"""Characters no decoder should leave in any text (answer, think block, separated reasoning):
U+FFFD replacement characters and control characters."""

from __future__ import annotations

from ddtree_diag.checks.quality.context import Context, excerpt
from ddtree_diag.checks.quality.patterns import CONTROL_RE
from ddtree_diag.records import Reason


def find_replacement_chars(text: str, ctx: Context) -> list[Reason]:
    """U+FFFD in the text (broken byte-level decoding), unless the prompt holds one."""
    if "\ufffd" not in text or "\ufffd" in ctx.prompt:
        return []
    count = text.count("\ufffd")
    first = text.index("\ufffd")
    span = (first, first + 1)
    weight = min(0.95, 0.7 + 0.05 * count)
    return [Reason("replacement_char", f"{count} U+FFFD replacement character(s)", excerpt(text, *span), weight, span)]


def find_control_chars(text: str, ctx: Context) -> list[Reason]:
    """C0/C1 control characters, lone surrogates, non-characters."""
    control = CONTROL_RE.search(text)
    if not control:
        return []
    count = len(CONTROL_RE.findall(text))
    name = f"U+{ord(control.group()):04X}"
    span = (max(0, control.start() - 20), min(len(text), control.end() + 20))
    detail = f"{count} control/invalid character(s), first {name}"
    return [Reason("control_chars", detail, excerpt(text, *span), min(0.9, 0.6 + 0.05 * count), span)]


DETECTORS = (find_replacement_chars, find_control_chars)
