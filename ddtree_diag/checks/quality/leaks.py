"""Chat-template and conversation-turn leaks."""

from __future__ import annotations

import re

from ddtree_diag.checks.quality.context import Context, excerpt, in_inline_code, inside_spans, named_in_prose
from ddtree_diag.checks.quality.patterns import FIRST_WORD_RE, ROLE_RE, TEMPLATE_RE
from ddtree_diag.records import Reason


def find_template_leaks(text: str, ctx: Context) -> list[Reason]:
    """Chat-template tokens (``<|im_start|>``, ``</s>``, ``[INST]``) the prompt did not ask about."""
    code_spans = ctx.code_spans
    talked_about: Reason | None = None  # a token named in prose; a later one may still be a leak
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
            detail = f"chat-template token {token!r} in prose (the prompt asks about them)"
            return [Reason("template_leak", detail, excerpt(text, *match.span()), 0.2, match.span())]
        if not in_code and named_in_prose(text, *match.span()):
            if talked_about is None:
                detail = f"chat-template token {token!r} in prose (named as a token or tag)"
                talked_about = Reason("template_leak", detail, excerpt(text, *match.span()), 0.2, match.span())
            continue
        if token == "</s>" and "<s>" in text[: match.start()]:
            continue  # HTML strikethrough, not a SentencePiece end-of-sequence
        count = len(TEMPLATE_RE.findall(text))
        where = "at a code block" if in_code else "in the text"
        weight = 0.7 if in_code else min(0.95, 0.8 + 0.03 * count)
        detail = f"chat-template token {token!r} {where} ({count} in all)"
        return [Reason("template_leak", detail, excerpt(text, *match.span()), weight, match.span())]
    return [talked_about] if talked_about is not None else []


# gpt-oss's harmony format with its special tokens stripped (a server without a harmony parser,
# or decoding with skip_special_tokens): the channel names end up glued to the text around them,
# "analysisThe user asks ... assistantfinalHello!", "assistant to=functions.fcommentary json{...}".
# A channel name glued after "assistant" or after a recipient is never prose; a leading
# "analysis" glued to a reasoning opener is the same leak cut shorter.
_HARMONY_GLUED_RE = re.compile(
    r"(?<![A-Za-z0-9_])assistant(?:final|analysis|commentary)(?![_0-9])"
    r"|\bto=functions\.\w*?(?:commentary|analysis|final)\b"
)
_HARMONY_HEAD_RE = re.compile(
    r"\A\s*(?:analysis|commentary)(?=[A-Z][a-z]|(?:the|we|user|i|let|ok|okay|so|now|need|this)\b)"
    r"|\A\s*commentary\s+to=\S"
)


def find_harmony_residue(text: str, ctx: Context) -> list[Reason]:
    """gpt-oss harmony channel names left in the text once its special tokens are stripped."""
    match = _HARMONY_GLUED_RE.search(text)
    glued = match is not None and match.group() not in ctx.prompt  # a prompt may quote the glued form
    if not glued:
        match = _HARMONY_HEAD_RE.search(text)
    if match is None or inside_spans(match.start(), ctx.code_spans):
        return []
    detail = (f"gpt-oss harmony channel {match.group().strip()!r} glued to the text "
              "(the template's special tokens stripped: no harmony parser?)")
    return [Reason("template_leak", detail, excerpt(text, *match.span()), 0.9 if glued else 0.6, match.span())]


def find_role_leaks(text: str, ctx: Context) -> list[Reason]:
    """Conversation turn markers (``user:``, ``### Instruction:``) the model should not write."""
    if ":" not in text and "\n" not in text and not text.lstrip().lower().startswith(("user", "assistant")):
        return []
    code_spans = ctx.code_spans
    hits = []
    for match in _role_matches(text):
        if inside_spans(match.start(), code_spans):
            continue
        marker = match.group().strip()
        if marker.lower() in ctx.prompt_lower:
            continue
        if match.lastgroup in ("bare", "head") and ":" not in marker and not marker.lstrip("# ").islower():
            continue  # "User" / "## Assistant" as a list item or a section heading
        kind = match.lastgroup
        if kind == "bare" and not _opens_a_turn(text, *match.span()):
            kind = "content"  # "user" as one item of a one-word list (table names): weak
        hits.append((kind, match.span(), marker))
    if not hits:
        return []
    strong = [h for h in hits if h[0] in ("head", "instr", "bare", "human")]
    contents = [h for h in hits if h[0] == "content"]
    # Plain "User:" / "Assistant:" lines taking turns; bold labels are a formatted example.
    speakers = {_speaker(h[2]) for h in contents if "*" not in h[2] and "_" not in h[2]}
    turn_taking = "user" in speakers and bool(speakers & {"assistant", "ai", "bot", "gpt", "chatbot"})
    _kind, span, marker = (strong or hits)[0]
    line_end = text.find("\n", span[0])
    span = (span[0], line_end if line_end > span[0] else len(text))
    if ctx.dialogue:
        weight = 0.3 if strong else 0.0
    elif strong:
        weight = min(0.9, 0.7 + 0.05 * (len(strong) - 1))
    elif turn_taking:
        weight = 0.6
    elif any(
        _continues_conversation(text, h[1][1], h[2])
        for h in contents
        if _speaker(h[2]) in ("user", "assistant", "human")
    ):
        weight = 0.55
    else:
        weight = 0.3
    if weight <= 0:
        return []
    what = "turn marker" if strong else "dialogue line"
    detail = f"conversation {what} {marker[:30]!r} in the text ({len(hits)} in all)"
    return [Reason("role_leak", detail, excerpt(text, *span), weight, span)]


def _opens_a_turn(text: str, start: int, end: int) -> bool:
    """A bare role line opens a turn when a sentence follows it (the turn's message) or prose
    precedes it (the answer ended, a new turn begins); between one-word lines it is a list item."""
    after = next((line for line in text[end:].split("\n") if line.strip()), "")
    before = next((line for line in reversed(text[:start].split("\n")) if line.strip()), None)
    return len(after.split()) >= 2 or before is None or len(before.split()) >= 3


def _speaker(marker: str) -> str:
    return FIRST_WORD_RE.match(marker).group(1).lower()


def _role_matches(text: str):
    """ROLE_RE matches, tried only on lines that begin with a role word (found with str.find,
    which keeps long texts fast)."""
    lowered = text.lower()
    if len(lowered) != len(text):  # a few characters change length when lowered
        lowered = text
    line_starts: set[int] = set()
    for word in _ROLE_FINDS:
        at = lowered.find(word)
        while at >= 0:
            line_start = lowered.rfind("\n", 0, at) + 1
            if not lowered[line_start:at].strip(" \t>*_#"):
                line_starts.add(line_start)
            at = lowered.find(word, at + len(word))
    for line_start in sorted(line_starts):
        line_end = text.find("\n", line_start)
        line = text[line_start : line_end if line_end >= 0 else len(text)]
        match = ROLE_RE.match(line)
        if match:
            yield _ShiftedMatch(match, line_start)


# Role words as they start a turn-marker line (the short ones only with their colon).
_ROLE_FINDS = (
    "user", "assistant", "human", "system", "model", "instruction", "response",
    "ai:", "ai*", "bot:", "bot*", "gpt:", "gpt*", "chatbot",
)


class _ShiftedMatch:
    """A match on one line, with spans in whole-text coordinates."""

    __slots__ = ("_match", "_offset", "lastgroup")

    def __init__(self, match: re.Match, offset: int) -> None:
        self._match = match
        self._offset = offset
        self.lastgroup = match.lastgroup

    def group(self) -> str:
        return self._match.group()

    def start(self) -> int:
        return self._match.start() + self._offset

    def span(self) -> tuple[int, int]:
        a, b = self._match.span()
        return a + self._offset, b + self._offset


def _continues_conversation(text: str, end: int, marker: str) -> bool:
    """A plain "User: <a sentence or a question>" line: the model writing the next turn itself
    (unlike "User: admin" in credentials or a bold "**User:**" glossary label)."""
    if "*" in marker or "_" in marker:
        return False
    line_end = text.find("\n", end)
    rest = text[end - 1 : line_end if line_end >= 0 else len(text)]
    return "?" in rest or "!" in rest or len(rest.split()) >= 3


DETECTORS = (find_template_leaks, find_harmony_residue, find_role_leaks)
