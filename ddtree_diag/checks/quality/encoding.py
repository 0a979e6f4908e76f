"""Encoding damage: mojibake (found with ftfy, with a stdlib fallback) and tokenizer pieces left
undecoded."""

from __future__ import annotations

import itertools
import re

from ddtree_diag.checks.quality.context import Context, excerpt, inside_spans, line_at
from ddtree_diag.checks.quality.patterns import EVIDENCE_CHARS, MOJIBAKE_GATE_RE, MOJIBAKE_PROMPT_RE, NONSPACE_RE
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


# Tokenizer pieces a server returned instead of text: byte-level BPE's space and newline marks
# (GPT-2 style vocabularies: "ĠThe", "Ċ"), SentencePiece's word mark ("▁The") and its byte
# fallback tokens ("<0x0A>"). Maltese writes Ġ and Ċ as letters, so a mark counts only where it
# opens a word of another shape, and a text needs many of them.
_BPE_MARK_RE = re.compile(r"[\u0120\u010a\u2581](?=[A-Za-z0-9\u0120\u010a\u2581(\[\"'])")
_OPEN = "-'’\"“«([{/"  # what may stand right before a word (Maltese "mill-Ġermanja", "(Ċensu)")
_BYTE_TOKEN_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_PIECES_PROMPT_RE = re.compile(
    r"[\u0120\u010a\u2581]|<0x[0-9A-Fa-f]{2}>|\btokeni[sz]|\bbyte.?(?:token|fallback|level)|\btoken ids?\b|"
    r"\bvocab|sentencepiece|\bbpe\b",
    re.IGNORECASE,
)


def find_token_pieces(text: str, ctx: Context) -> list[Reason]:
    """Tokenizer pieces in the text (``ĠThe Ġsky``, ``▁The▁sky``, ``<0x0A>``): the server decoded
    token strings, not text (a detokenizer or vocabulary mismatch)."""
    if text.isascii() and "<0x" not in text:
        return []
    if ctx.prompt and _PIECES_PROMPT_RE.search(ctx.prompt):
        return []  # the prompt is about tokenizers or quotes pieces itself
    code_spans = ctx.code_spans  # pieces quoted as code are examples
    marks = [m for m in _BPE_MARK_RE.finditer(text) if not inside_spans(m.start(), code_spans)]
    # glued: a mark right after a letter, digit or sentence mark, where a space or newline belongs
    # ("blueĠbecause", "sky.ĊIt"); Maltese's capital Ġ / Ċ open a word
    glued = sum(1 for m in marks if m.start() and not (text[m.start() - 1].isspace() or text[m.start() - 1] in _OPEN))
    spaced = len(marks) >= 4 and len(marks) >= 0.6 * len(NONSPACE_RE.findall(text))  # nearly every word
    found = None
    if glued >= 3 or spaced:
        found = marks
        detail = f"{len(marks)} words opened by a tokenizer mark ({marks[0].group()!r}: undecoded BPE/SentencePiece)"
    else:
        byte_tokens = [m for m in _BYTE_TOKEN_RE.finditer(text) if not inside_spans(m.start(), code_spans)]
        # one or two are enough where one stands glued to a word, as a decoded byte would
        # ("line.<0x0A>Next", "print(<0x22>hi"); spaced apart they may be named, not leaked
        glued_bytes = any(_glued_byte(text, m) for m in byte_tokens)
        if len(byte_tokens) >= 3 or glued_bytes:
            found = byte_tokens
            detail = f"{len(byte_tokens)} byte-fallback token(s) ({byte_tokens[0].group()!r}) left undecoded"
    if not found:
        return []
    span = (found[0].start(), min(len(text), found[0].start() + EVIDENCE_CHARS))
    weight = 0.75 if len(found) >= 3 else 0.6
    return [Reason("token_pieces", detail, excerpt(text, *span), weight, span)]


def _glued_byte(text: str, match: re.Match) -> bool:
    """A byte token with an ASCII letter or digit right before or after it (CJK prose has no
    spaces, so a byte token named there touches its words anyway)."""
    before = text[match.start() - 1] if match.start() else " "
    after = text[match.end()] if match.end() < len(text) else " "
    return any(ch.isascii() and ch.isalnum() for ch in (before, after))


# Text escaped once more than it should be (a proxy or server encoding a JSON string twice, or
# HTML-escaping it): a literal backslash-n where a line breaks (before a capital, a digit, a list
# mark or another break; "C:\new\node" is a path), \uXXXX where the characters belong, and the
# quote, apostrophe and ampersand entities in prose ("It&#39;s"; &lt; and &gt; are what answers
# about HTML explain).
_LITERAL_NEWLINE_RE = re.compile(r"(?<!\\)\\[rn](?![a-z])")
_UNICODE_ESCAPE_RE = re.compile(r"(?<!\\)\\u[0-9a-fA-F]{4}")
_HTML_ENTITY_RE = re.compile(r"&(?:#(?:39|34|38)|#x(?:27|22|26)|quot|amp|apos);")
_ESCAPES_PROMPT_RE = re.compile(
    r"escap|json|html|xml|entit|unicode|encod|decod|string literal|\\[nu]|&#|&\w+;|regex|printf|newline char|"
    r"ampersand|markup|web ?page",
    re.IGNORECASE,
)


def find_escaped_text(text: str, ctx: Context) -> list[Reason]:
    """Text escaped twice: literal ``\\n`` for line breaks, ``\\u5929`` for characters, or HTML
    entities (``It&#39;s``) in prose; not in code, nor when the prompt is about escaping."""
    if "\\" not in text and "&" not in text:
        return []
    if ctx.prompt and _ESCAPES_PROMPT_RE.search(ctx.prompt):
        return []
    code_spans = ctx.code_spans

    def outside(pattern: re.Pattern, needed: int) -> list[re.Match]:
        """Up to ``needed`` matches outside code and literals, from the first ``_CANDIDATES``
        (each look reads its line: on one long line, every match would make it quadratic)."""
        found = []
        for m in itertools.islice(pattern.finditer(text), _CANDIDATES):
            if not (inside_spans(m.start(), code_spans) or _quoted(text, m.start())):
                found.append(m)
                if len(found) >= needed:
                    break
        return found

    newlines = outside(_LITERAL_NEWLINE_RE, max(3, text.count("\n") + 1))
    characters, entities = outside(_UNICODE_ESCAPE_RE, 3), outside(_HTML_ENTITY_RE, 2)
    if len(newlines) >= 3 and len(newlines) > text.count("\n"):  # more escaped line breaks than real ones
        found, what = newlines, "line breaks written as a literal backslash-n"
    elif len(characters) >= 3:
        found, what = characters, "characters written as \\u escapes"
    elif len(entities) >= 2:
        found, what = entities, "HTML entities in plain text"
    else:
        return []
    span = (found[0].start(), min(len(text), found[0].start() + EVIDENCE_CHARS))
    detail = f"{len(found)} or more {what} ({found[0].group()!r}): the text was escaped twice on its way"
    return [Reason("escaped_text", detail, excerpt(text, *span), 0.7, span)]


_CANDIDATES = 200  # escapes looked at per kind: enough to tell, and a bound on the work
_QUOTE_RE = re.compile(r"(?<![\\\w])['\"]|['\"](?!\w)")  # quote marks, not escaped ones or apostrophes


def _quoted(text: str, pos: int) -> bool:
    """Whether ``pos`` is in code or a literal the fences do not mark: an indented or prompt line
    (``>>> 'cafe\u0301'``), inside quotes on its line, or in a URL (``?a=1&amp;b=2``)."""
    line = line_at(text, pos)
    if line.startswith(("    ", "\t")) or line.lstrip().startswith((">>>", "$ ", "...")):
        return True
    before = text[text.rfind("\n", 0, pos) + 1 : pos]
    quotes = _QUOTE_RE.findall(before)
    for mark in ("'", '"'):
        # a short literal ('cafe\u0301'): opened and closed within a few words, not a whole answer
        # in quotes (a JSON string encoded twice)
        opened_near = quotes.count(mark) % 2 and len(before) - before.rfind(mark) <= 30
        if opened_near and mark in _QUOTE_RE.findall(text, pos, pos + 30):
            return True
    word = before[max(before.rfind(" "), before.rfind("(")) + 1 :]
    return "://" in word or "?" in word or "=" in word


DETECTORS = (find_mojibake, find_token_pieces, find_escaped_text)
