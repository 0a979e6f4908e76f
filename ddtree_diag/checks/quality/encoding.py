"""Encoding damage: mojibake (found with ftfy), with a stdlib fallback."""

from __future__ import annotations

import re

from ddtree_diag.checks.quality.context import Context, excerpt
from ddtree_diag.checks.quality.patterns import MOJIBAKE_GATE_RE, MOJIBAKE_PROMPT_RE, NONSPACE_RE
from ddtree_diag.records import Reason


def find_mojibake(text: str, ctx: Context) -> list[Reason]:
    """UTF-8 decoded with the wrong codec (``Ã©tÃ©`` for ``été``)."""
    if text.isascii() or not MOJIBAKE_GATE_RE.search(text):
        return []
    if MOJIBAKE_PROMPT_RE.search(ctx.prompt):
        return []  # the prompt is about encodings: mis-decoded samples are the topic
    try:
        import ftfy  # ~70 ms to import; only reached when the text has mojibake-typical characters
        from ftfy.badness import BADNESS_RE
    except ImportError:  # a core dependency, but a broken install should not crash a probe run
        return _mojibake_without_ftfy(text)
    match = BADNESS_RE.search(text)
    if not match:
        return []
    if ctx.prompt and ftfy.fix_encoding(ctx.prompt) != ctx.prompt:
        return []  # the prompt quotes mis-decoded text: the answer explains or repeats it
    fixed = ftfy.fix_encoding(text)
    start = max(0, match.start() - 10)
    span = (start, min(len(text), match.end() + 20))
    if fixed != text:
        pairs = [(a, b) for a, b in zip(NONSPACE_RE.findall(text), NONSPACE_RE.findall(fixed), strict=False) if a != b]
        # Every broken word shown next to its repaired form: an explanation of mojibake, not damage.
        if pairs and all(_core(b) in text for _, b in pairs):
            return []
        sample = f" ({pairs[0][0]!r} should read {pairs[0][1]!r})" if pairs else ""
        weight = 0.75
        detail = f"mis-decoded UTF-8{sample}"
    else:
        weight = 0.35
        detail = "character sequences typical of mis-decoded text"
    return [Reason("mojibake", detail, excerpt(text, *span), weight, span)]


def _core(word: str) -> str:
    """A word without the quotes and punctuation around it."""
    return word.strip("\"'“”‘’«»()[]{}.,;:!?`*")


_LATIN1_RUN_RE = re.compile(
    r"[\u0080-\u00ff\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc\u2013-\u2122]{2,}"
)


def _mojibake_without_ftfy(text: str) -> list[Reason]:
    """Fallback: a run of Latin-1/cp1252 characters that re-encodes to valid multi-byte UTF-8."""
    for match in _LATIN1_RUN_RE.finditer(text):
        run = match.group()
        for codec in ("cp1252", "latin-1"):
            try:
                fixed = run.encode(codec).decode("utf-8")
            except (UnicodeEncodeError, UnicodeDecodeError):
                continue
            if fixed != run:
                detail = f"mis-decoded UTF-8 ({run!r} should read {fixed!r})"
                return [Reason("mojibake", detail, run, 0.75, (match.start(), match.end()))]
    return []


DETECTORS = (find_mojibake,)
