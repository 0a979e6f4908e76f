"""Signals that hold for any text (answer, think block, separated reasoning): encoding damage,
template and role leaks, loops, enumerations."""

from __future__ import annotations

from ddtree_diag.checks.quality.context import Context, code_spans_of, excerpt, inside_spans
from ddtree_diag.checks.quality.encoding import find_mojibake, in_inline_code
from ddtree_diag.checks.quality.hollow import find_empty_counting, find_hollow_lines, find_punct_run
from ddtree_diag.checks.quality.leaks import find_role_leaks
from ddtree_diag.checks.quality.loops import find_degenerate_enumeration, find_loops, search_windows
from ddtree_diag.checks.quality.patterns import CONTROL_RE, MOJIBAKE_GATE_RE, TEMPLATE_RE
from ddtree_diag.checks.quality.salad import find_word_salad
from ddtree_diag.checks.quality.stutter import find_doubled_words, find_glued_repeat
from ddtree_diag.records import Reason

# --------------------------------------------------------------------------------------------
# Signals that hold for any text (answer, think block, separated reasoning)


def content_signals(text: str, ctx: Context, offset: int, source: str, label: str = "") -> list[Reason]:
    out: list[Reason] = []

    def add(code: str, detail: str, span: tuple[int, int] | None, weight: float) -> None:
        evidence = excerpt(text, *span) if span else ""
        full_span = (span[0] + offset, span[1] + offset) if span else None
        out.append(Reason(code, label + detail, evidence, weight, full_span, source))

    code_spans = code_spans_of(text)

    if "\ufffd" in text and "\ufffd" not in ctx.prompt:
        count = text.count("\ufffd")
        first = text.index("\ufffd")
        add(
            "replacement_char",
            f"{count} U+FFFD replacement character(s)",
            (first, first + 1),
            min(0.95, 0.7 + 0.05 * count),
        )

    control = CONTROL_RE.search(text)
    if control:
        count = len(CONTROL_RE.findall(text))
        name = f"U+{ord(control.group()):04X}"
        span = (max(0, control.start() - 20), min(len(text), control.end() + 20))
        add(
            "control_chars",
            f"{count} control/invalid character(s), first {name}",
            span,
            min(0.9, 0.6 + 0.05 * count),
        )

    if not text.isascii() and MOJIBAKE_GATE_RE.search(text):
        out.extend(find_mojibake(text, ctx, offset, source, label))

    for match in TEMPLATE_RE.finditer(text):
        token = match.group()
        if token in ctx.prompt:
            continue
        in_code = inside_spans(match.start(), code_spans)
        if in_code and in_inline_code(text, match.start()):
            continue  # `<|im_end|>` in backticks is written on purpose, never a leak
        if ctx.about_templates:
            if in_code:
                continue  # asked about templates, shown in a code block: exactly right
            add(
                "template_leak",
                f"chat-template token {token!r} in prose (the prompt asks about them)",
                match.span(),
                0.2,
            )
            break
        if token == "</s>" and "<s>" in text[: match.start()]:
            continue  # HTML strikethrough, not a SentencePiece end-of-sequence
        count = len(TEMPLATE_RE.findall(text))
        where = "at a code block" if in_code else "in the text"
        add(
            "template_leak",
            f"chat-template token {token!r} {where} ({count} in all)",
            match.span(),
            0.7 if in_code else min(0.95, 0.8 + 0.03 * count),
        )
        break

    role = find_role_leaks(text, ctx, code_spans)
    if role:
        add(*role)

    enum = find_degenerate_enumeration(text)
    if enum:
        add(*enum)

    # Shape without content and stutters: in a long text only where the loop search looks (they
    # all compress well); the heaviest reason per code is kept.
    windows = search_windows(text)
    best: dict[str, Reason] = {}
    for lo, hi in _outside_code(windows, code_spans):
        for finder in (find_hollow_lines, find_empty_counting, find_punct_run, find_glued_repeat, find_doubled_words):
            found = finder(text, ctx, code_spans, lo, hi)
            if found is not None and (found.code not in best or found.weight > best[found.code].weight):
                best[found.code] = found
    salad = find_word_salad(text, ctx, code_spans)
    if salad is not None:
        best[salad.code] = salad
    for found in best.values():
        add(found.code, found.detail, found.span, found.weight)

    out.extend(
        Reason(
            r.code,
            label + r.detail,
            r.evidence,
            r.weight,
            (r.span[0] + offset, r.span[1] + offset) if r.span else None,
            source,
        )
        for r in find_loops(text, ctx, code_spans, windows)
    )
    return out


def _outside_code(windows: list[tuple[int, int]], code_spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
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
