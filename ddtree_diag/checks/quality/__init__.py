r"""Garbage-text detection: does this answer look like something no model would write?

A speculative-decoding bug (wrong positions, a stale cache, a bad template) usually shows first as
text, not as a number: acceptance can even *rise* on a degenerate loop. ``assess`` looks at one
answer (plus what is known about its request) and returns a :class:`Verdict` with named reasons,
each carrying the text that triggered it. It is fast, deterministic and needs no model.

    >>> v = assess("Hello,", prompt="Say hello in one short sentence.", finish_reason="stop")
    >>> v.garbage, v.top_reason.code
    (True, 'premature_stop')

Scoring: each reason has a weight in [0, 1]; the score is the noisy-OR of the weights,
``1 - prod(1 - w)``, and the text is garbage when ``score >= GARBAGE_THRESHOLD`` (0.5). "Hard"
reasons weigh >= 0.5 and condemn the text alone; "soft" ones (< 0.5) need a second signal; "info"
reasons (weight 0) are reported but never count (``truncated``).

Reason codes (stable; other tools may match on them):

| code | severity | what it means |
|---|---|---|
| `empty_output` | hard | no answer, or only whitespace, punctuation or a bare list marker |
| `premature_stop` | hard/soft | `stop` on an unfinished sentence (`Hello,`, `Here is the code:`) |
| `token_loop` | hard | one word or character repeated back to back (`the the the the`) |
| `phrase_loop` | hard | a multi-word phrase repeated back to back |
| `line_loop` | hard | the same line (or group of lines) repeated back to back |
| `repeated_ngram` | hard/soft | a phrase recurring with only a counter changing (`1. X. 2. X. 3. X.`) |
| `compression_ratio` | soft | zlib finds the text far more repetitive (or noisier) than language |
| `script_mix` | hard/soft | a script the prompt does not use (CJK inside English), or homoglyphs |
| `template_leak` | hard | chat-template tokens (`<\|im_start\|>`, `<\|endoftext\|>`, `</s>`, `[INST]`) |
| `role_leak` | hard/soft | turn markers (`user:`, `# user:`, `Human:`, `### Instruction:`, `assistant`) |
| `thinking_leak` | hard | `<think>`/`</think>` in the answer when thinking is off, separated, or repeated |
| `unterminated_think` | hard/info | a `<think>` block that never closes (info when cut by length) |
| `degenerate_enumeration` | hard | list markers that never advance and hold nothing (`1. 1. 1.`) |
| `replacement_char` | hard | U+FFFD replacement characters (broken byte-level decoding) |
| `control_chars` | hard | C0/C1 control characters, lone surrogates or non-characters |
| `mojibake` | hard/soft | UTF-8 decoded with the wrong codec (`Ã©tÃ©` for `été`), found with ftfy |
| `truncated` | info | cut at max_tokens (`finish_reason=length`); never garbage by itself |

Hard/soft depends on the evidence (how many repeats, how much of the text, what the prompt asked
for); ``Reason.severity`` says which one a given reason is.

The verdict's dict form (``Verdict.to_dict``) is what probe results and the JSON report carry:
``{"garbage", "score", "truncated", "reasons": [{"code", "detail", "evidence", "severity",
"weight", "span", "source"}]}`` where ``span`` is ``[start, end]`` in the assessed text and
``source`` is ``"text"`` or ``"reasoning"``. ``assess_result(probe_result)`` fills
``ProbeResult.quality`` with it; ``summarize(result.quality)`` gives the table cell.

What the prompt changes: scripts used in the prompt, or languages it names ("in Chinese",
"translate", "日本語で"), are allowed in the answer; prompts for songs/poems or for repetition relax
the loop thresholds; prompts for a dialogue relax turn markers; prompts about chat templates or
special tokens allow them in code blocks. Code blocks and table rows get looser loop thresholds.

Known limits: an unfinished clause without a tell-tale last word (``... a coder named``) or one
in a language whose function words are not listed (Arabic, Hindi) is not caught; a short stutter
(``the the the the``) deep inside a text longer than 16 KiB is only found when its 1 KiB block
compresses much better than the rest (long texts are searched in such blocks and at the tail);
famous intentional repetition (``Buffalo buffalo Buffalo buffalo ...``) is flagged.
"""

from __future__ import annotations

import re
import zlib
from bisect import bisect_right
from collections import Counter
from dataclasses import replace
from functools import cache, cached_property
from itertools import pairwise
from typing import Any

from ddtree_diag.records import GARBAGE_THRESHOLD, Reason, Verdict

__all__ = [
    "GARBAGE_THRESHOLD",
    "REASON_CODES",
    "Reason",
    "Verdict",
    "assess",
    "assess_result",
    "summarize",
]

REASON_CODES = (
    "empty_output",
    "premature_stop",
    "token_loop",
    "phrase_loop",
    "line_loop",
    "repeated_ngram",
    "compression_ratio",
    "script_mix",
    "template_leak",
    "role_leak",
    "thinking_leak",
    "unterminated_think",
    "degenerate_enumeration",
    "replacement_char",
    "control_chars",
    "mojibake",
    "truncated",
)

_EVIDENCE_CHARS = 80


# --------------------------------------------------------------------------------------------
# Patterns. Compiled once at import (stdlib `re`); the `regex` module, for Unicode script
# properties, is loaded on the first non-ASCII text.

# Words (letters/marks/digits, with inner apostrophes), one CJK/kana character each, newline runs,
# and punctuation runs. Spaces are dropped: a loop is about what repeats, not how it is spaced.
# (stdlib `re` here: about twice as fast as `regex` on this simple pattern; CJK ranges by hand.)
_CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKEN_RE = re.compile(rf"[{_CJK_RANGES}]|[^\W{_CJK_RANGES}]+(?:['’][^\W{_CJK_RANGES}]+)*|\n+|[^\w\s]+")
_WORDISH_RE = re.compile(r"[^\W\d_]")
_HAS_CONTENT_RE = re.compile(r"[^\W_]|[^\x00-\x7f]")
_ONLY_MARKER_RE = re.compile(r"(?:\d{1,3}[.)]|[-*•]|step \d+:?)", re.IGNORECASE)
_MOJIBAKE_PROMPT_RE = re.compile(r"mojibake|encod|utf|latin-?1|cp1252|乱码|文字化け", re.IGNORECASE)
_NONSPACE_RE = re.compile(r"\S+")
_FIRST_WORD_RE = re.compile(r"[^\w]*(\w+)")
_WORDS_RE = re.compile(r"[^\W_]+")
_CJK_CHAR_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")
_SENTENCE_END_RE = re.compile(r"[.!?。！？]\s")

_SCRIPT_GROUPS = (
    ("Latin", r"\p{Latin}"),
    ("Han", r"\p{Han}"),
    ("Kana", r"[\p{Hiragana}\p{Katakana}ー]"),
    ("Hangul", r"\p{Hangul}"),
    ("Cyrillic", r"\p{Cyrillic}"),
    ("Greek", r"\p{Greek}"),
    ("Arabic", r"\p{Arabic}"),
    ("Hebrew", r"\p{Hebrew}"),
    ("Devanagari", r"\p{Devanagari}"),
    ("Thai", r"\p{Thai}"),
    ("Armenian", r"\p{Armenian}"),
    ("Georgian", r"\p{Georgian}"),
    ("Bengali", r"\p{Bengali}"),
    ("Tamil", r"\p{Tamil}"),
    ("Ethiopic", r"\p{Ethiopic}"),
)


# Where the `regex` module is missing (the single-file build vendors nothing compiled), the same
# classes from Unicode block ranges: blocks are a close approximation of scripts for letters.
_SCRIPT_RANGES = {
    "Latin": "A-Za-z\u00aa\u00ba\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u1e00-\u1eff\u2c60-\u2c7f"
    "\ua720-\ua7ff\uab30-\uab6f\uff21-\uff3a\uff41-\uff5a",
    "Han": "\u2e80-\u2fdf\u3005\u3007\u3021-\u3029\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
    "\U00020000-\U0003134f",
    "Kana": "\u3041-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9d",
    "Hangul": "\u1100-\u11ff\u3131-\u318e\ua960-\ua97f\uac00-\ud7af\ud7b0-\ud7ff\uffa0-\uffdc",
    "Cyrillic": "\u0400-\u0482\u048a-\u052f\u1c80-\u1c8f\u2de0-\u2dff\ua640-\ua69f",
    "Greek": "\u0370-\u0373\u0376-\u037d\u037f-\u03ff\u1f00-\u1fff",
    "Arabic": "\u0620-\u064a\u066e-\u06d3\u06d5\u06fa-\u06ff\u0750-\u077f\u08a0-\u08ff"
    "\ufb50-\ufdff\ufe70-\ufefc",
    "Hebrew": "\u05d0-\u05f2\ufb1d-\ufb4f",
    "Devanagari": "\u0900-\u0963\u0966-\u097f\ua8e0-\ua8ff",
    "Thai": "\u0e01-\u0e3a\u0e40-\u0e5b",
    "Armenian": "\u0531-\u0556\u0559-\u058a\ufb13-\ufb17",
    "Georgian": "\u10a0-\u10ff\u1c90-\u1cbf\u2d00-\u2d2f",
    "Bengali": "\u0980-\u09ff",
    "Tamil": "\u0b80-\u0bff",
    "Ethiopic": "\u1200-\u139f\u2d80-\u2ddf",
}
_COMBINING_MARKS = (
    "\u0300-\u036f\u0483-\u0489\u0591-\u05bd\u064b-\u065f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"
)


@cache
def _script_run_re() -> Any:
    """Runs of letters of one script (anything else lettered is "Other"). The `regex` module
    knows Unicode script properties; it is imported on the first non-ASCII text only."""
    try:
        import regex
    except ImportError:
        return re.compile(
            "|".join(f"(?P<{name}>(?:[{_SCRIPT_RANGES[name]}][{_COMBINING_MARKS}]*)+)" for name, _ in _SCRIPT_GROUPS)
            + r"|(?P<Other>[^\W\d_]+)"
        )
    return regex.compile(
        "|".join(f"(?P<{name}>(?:{cls}[\\p{{M}}]*)+)" for name, cls in _SCRIPT_GROUPS)
        + r"|(?P<Other>(?:(?![\p{Common}\p{Inherited}])\p{L})+)"
    )


# Stretches that may hold non-Latin letters: everything outside ASCII, Latin blocks, combining
# marks, general punctuation/symbols/maths and emoji. Only these go through the (slower) script
# classifier (_script_run_re).
_NON_LATIN_CANDIDATE_RE = re.compile(
    "[^\x00-\u036f\u1e00-\u1eff\u2000-\u2bff\ufe00-\ufe0f\U0001f000-\U0001faff\\s]+"
)
_NOT_ASCII_LETTERS = bytes(b for b in range(128) if not chr(b).isalpha())
_ASCII_PAIR_RE = re.compile(r"[A-Za-z]{2}")

# Prompt words that allow (or ask for) other writing systems in the answer.
_ANY_SCRIPT_RE = re.compile(
    r"translat|traduc|traduz|übersetz|uebersetz|перев[оеё]д|翻译|翻譯|翻訳|번역|"
    r"multilingual|\b(?:in|into|across)\b[^.?!\n]{0,30}\blanguages\b|idiomas|langues|"
    r"sprachen|языках|多语|多種言語|unicode|writing system|character set|charset|encoding|alphabet|"
    r"(?:native|local|original) (?:script|language|writing|spelling|name)",
    re.IGNORECASE,
)
_LANGUAGE_SCRIPTS = (
    (
        r"chin(?:a|ese)|taiwan|hong kong|mandarin|cantonese|hanzi|kanji|pinyin|"
        r"中文|汉语|漢語|华语|普通话|汉字|漢字|chino|chinois|chinesisch|chinês|cines[ei]|китайск|중국",
        {"Han"},
    ),
    (
        r"japan|japon|giappon|hiragana|katakana|kana\b|日本語|日语|日文|японск|일본",
        {"Han", "Kana"},
    ),
    (r"korea|corea|coré|hangul|한국어|韩语|韓国語|корейск", {"Hangul", "Han"}),
    (
        r"russia|cyrillic|ukrain|bulgarian|serbian|belarusian|kazakh|mongolian|"
        r"русск|украин|rus[os]|russ[eo]|russisch|俄语|ロシア語|러시아",
        {"Cyrillic"},
    ),
    (r"greek|greece|ελληνικ|grieg|grec|greg|griech|希腊", {"Greek"}),
    (r"\barab|egypt|persian|\biran|farsi|urdu|pakistan|عرب|árabe|arabe|arabisch|阿拉伯", {"Arabic"}),
    (r"hebrew|israel|yiddish|עברית|hebr|ebraic", {"Hebrew"}),
    (r"india|hindi|sanskrit|marathi|nepali|devanagari|हिन्दी|हिंदी", {"Devanagari"}),
    (r"\bthai|ภาษาไทย|泰语", {"Thai"}),
    (r"armenian", {"Armenian"}),
    (r"georgian", {"Georgian"}),
    (r"bengali|bangla", {"Bengali"}),
    (r"tamil", {"Tamil"}),
    (r"amharic|ethiopic|tigrinya", {"Ethiopic"}),
)
_LANGUAGE_SCRIPTS_RE = [(re.compile(p, re.IGNORECASE), s) for p, s in _LANGUAGE_SCRIPTS]

# Chat-template special tokens of the common families (ChatML, Llama 2/3, Gemma, Phi, GPT-OSS,
# DeepSeek's full-width bars, SentencePiece markers).
_TEMPLATE_RE = re.compile(
    r"<\|[A-Za-z_][\w.\-]{0,40}\|>"
    r"|<｜[^｜<>\n]{1,40}｜>"
    r"|</s>|<s>(?=\s*\[INST\])|\[/?INST\]|<</?SYS>>"
    r"|<(?:start|end)_of_turn>|<(?:bos|eos|unk|pad|eot)>"
    r"|<\|(?:im_start|im_end|im_sep)\b"
)
# Conversation turn markers at a line start. Group "bare": the marker alone on its line (what a
# ChatML leak looks like once the special tokens are stripped); "head": a markdown heading;
# "instr": Alpaca-style headers; "content": a dialogue line with text after the colon.
_ROLE_RE = re.compile(
    r"(?m)^[ \t>*_]*(?:"
    r"(?P<head>\#{1,6}[ \t]*(?:user|assistant|human|system)[ \t\r]*(?::[^\n]*|(?=\n|$)))"
    r"|(?P<instr>\#{2,3}[ \t]*(?:instruction|response|human|assistant|user)[ \t]*:)"
    r"|(?P<bare>(?:(?:user|assistant|human)[ \t]*:?|(?-i:system|model))[ \t\r]*(?=\n|$))"
    r"|(?P<human>human[ \t]*:[ \t]*\S)"
    r"|(?P<content>(?:user|assistant|ai|bot|gpt|chatbot)[*_]*[ \t]*:[*_]*[ \t]*\S)"
    r")",
    re.IGNORECASE,
)
_DIALOGUE_PROMPT_RE = re.compile(
    r"dialog|conversation|\bchat\b|chat log|transcript|role[- ]?play|screenplay|skit|interview|"
    r"chat template|chatml|prompt format|few-shot|system prompt|prompt engineering|example prompt|"
    r"对话|對話|會話|会話|диалог|Gespräch|diálogo",
    re.IGNORECASE,
)

_TEMPLATE_PROMPT_RE = re.compile(
    r"special tokens?|tokeni[sz]|stop tokens?|chat.?template|chatml|\beos\b|\bbos\b|"
    r"end.of.(?:text|turn|sequence)|prompt.{0,20}format|format.{0,20}prompt|im_start|im_end|\[inst\]|"
    r"jinja|\b(?:qwen|llama|mistral|gemma|phi-?\d|deepseek|vicuna|alpaca)",
    re.IGNORECASE,
)

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"

# C0 (but tab/newline/CR), DEL, C1, lone surrogates, non-characters.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
# Characters that UTF-8-as-Latin-1/cp1252 mojibake always produces; gates the (slower) ftfy check.
_MOJIBAKE_GATE_RE = re.compile(
    r"[\u00c2-\u00c5\u00ce-\u00d1\u00e2\u00e3\u00ef\u0152\u0153\u0161\u201a-\u201e"
    r"\u2020\u2021\u2030\u2039\u203a\u02c6\u02dc\u0080-\u009f]"
)

# Two list markers with nothing between ("1. 1.", "2.\n2."): a cheap gate (it starts with a
# digit, which the regex engine scans for fast) before the full marker walk.
_STUCK_GATE_RE = re.compile(r"\d[.)][^\w\n]{0,4}\n?[^\w\n]{0,4}\d[.)]")
# A list marker ("1." / "1)") at a word boundary followed by space or end.
_MARKER_RE = re.compile(r"(?<![\w.,])(\d{1,3})[.)](?=\s|$)")

_INLINE_CODE_RE = re.compile(r"`[^`\n]+`")

_LYRIC_PROMPT_RE = re.compile(
    r"\b(?:songs?|lyrics?|poems?|poetry|verses?|chants?|rhym\w*|haikus?|sonnets?|limericks?|refrains?|"
    r"chorus(?:es)?|nursery|ballads?|raps?|anthems?|hymns?|canci[oó]n\w*|poemas?|gedichte?|chansons?)\b"
    r"|歌|诗|詩|песн|стих",
    re.IGNORECASE,
)
_REPEAT_PROMPT_RE = re.compile(
    r"\brepeat|\btimes\b|over and over|again and again|重复|重複|繰り返|повтор|wiederhol|repite|répète|"
    r"\bspell|\bcount\b|list all",
    re.IGNORECASE,
)

# Interjections and sounds that people do write several times in a row.
_INTERJECTIONS_TEXT = (
    "ha he hi ho hah heh hee la na da di do doo oh ooh ah aah uh um hmm mm no yes yeah yay "
    "hey wow bye go very so really much more tick tock knock ding dong bang boom beep buzz choo "
    "woof meow quack moo baa oink tweet chirp zzz bla blah yada rah hip hurray hooray pew "
    "哈 呵 嘿 啊 嗯 哦 呜 啦 嘻 は ふ へ ほ ひ"
)
_INTERJECTIONS = frozenset(_INTERJECTIONS_TEXT.split())

# (";" is left out: code and SQL end on it.)
_UNFINISHED_END = tuple(",，、:：；(（[{—–-“«‘")
# Words an English/Spanish/German/French sentence cannot end on (prepositions and pronouns can).
_FUNCTION_WORDS_TEXT = (
    "a an the and or but nor because although whereas unless my your our their whose y und oder et ou"
)
_FUNCTION_WORDS = frozenset(_FUNCTION_WORDS_TEXT.split())
_STOP_REASONS = frozenset({"stop", "eos", "end_turn", "stop_sequence", "eos_token"})
_LENGTH_REASONS = frozenset({"length", "max_tokens", "max_length", "max_new_tokens"})


# --------------------------------------------------------------------------------------------
# Public API


def assess(
    text: str | None,
    *,
    prompt: str | None = None,
    finish_reason: str | None = None,
    completion_tokens: int | None = None,
    max_tokens: int | None = None,
    thinking: bool | None = None,
    reasoning: str | None = None,
) -> Verdict:
    """Judge one answer. ``thinking`` is the request's enable_thinking (None = unknown);
    ``reasoning`` the server-separated thinking text, if any (checked for loops and leaks too)."""
    text = text or ""
    prompt = prompt or ""
    finish = (finish_reason or "").strip().lower() or None
    truncated = finish in _LENGTH_REASONS or (
        completion_tokens is not None and max_tokens is not None and 0 < max_tokens <= completion_tokens
    )
    ctx = _Context(prompt, truncated)
    reasons: list[Reason] = []

    if truncated:
        why = (
            f"finish_reason={finish}"
            if finish in _LENGTH_REASONS
            else f"{completion_tokens} of {max_tokens} tokens"
        )
        reasons.append(Reason("truncated", f"cut at the token limit ({why}); not garbage by itself"))

    answer, think_text, think_offset = _split_thinking(text, thinking, reasoning, truncated, finish, reasons)

    # Where the answer sits in the text (after a think block), so every span points into `text`.
    answer_at = len(text) - len(answer) if answer and text.endswith(answer) else 0
    stripped = answer.strip()
    has_thought = bool((reasoning or "").strip() or (think_text or "").strip())
    if not stripped:
        if truncated and has_thought:
            pass  # cut while thinking: the answer never started; `truncated` says so
        elif truncated or (has_thought and finish is None):
            # Maybe cut before the answer began; an unterminated think block already says so.
            if not any(r.code == "unterminated_think" for r in reasons):
                reasons.append(Reason("empty_output", "the answer is empty (cut before it began?)", "", 0.3))
        else:
            reasons.append(Reason("empty_output", "the answer is empty", "", 1.0 if not has_thought else 0.7))
    elif not _HAS_CONTENT_RE.search(stripped) or _ONLY_MARKER_RE.fullmatch(stripped):
        reasons.append(
            Reason(
                "empty_output",
                "the answer holds only punctuation or a bare list marker",
                stripped[:_EVIDENCE_CHARS],
                0.7,
                (answer_at + answer.index(stripped), answer_at + answer.index(stripped) + len(stripped)),
            )
        )
    else:
        reasons.extend(_content_signals(answer, ctx, answer_at, "text"))
        found = _script_signals(answer, ctx)
        if not truncated and (finish in _STOP_REASONS):
            found += _premature_stop(answer, completion_tokens, ctx)
        elif finish is None and not truncated:
            found += _premature_stop(answer, completion_tokens, ctx, unknown_finish=True)
        reasons.extend(_shifted(r, answer_at) for r in found)

    if think_text and think_text.strip():
        reasons.extend(_content_signals(think_text, ctx, think_offset, "text", label="think block: "))
    if reasoning and reasoning.strip():
        reasons.extend(_content_signals(reasoning, ctx, 0, "reasoning", label="reasoning: "))

    score = 1.0
    for reason in reasons:
        score *= 1.0 - max(0.0, min(1.0, reason.weight))
    score = round(1.0 - score, 4)
    reasons.sort(key=lambda r: -r.weight)
    return Verdict(garbage=score >= GARBAGE_THRESHOLD, score=score, reasons=reasons, truncated=truncated)


def _shifted(reason: Reason, offset: int) -> Reason:
    if not offset or reason.span is None:
        return reason
    return replace(reason, span=(reason.span[0] + offset, reason.span[1] + offset))


def assess_result(result: Any) -> Verdict:
    """Assess a records.ProbeResult and store the verdict in ``result.quality``.

    Results that carry no answer because the request failed get no verdict (quality stays None).
    """
    if not getattr(result, "ok", True):
        return None  # type: ignore[return-value]
    case = result.case
    verdict = assess(
        result.output,
        prompt=case.prompt_text,
        finish_reason=result.finish_reason,
        completion_tokens=result.completion_tokens,
        max_tokens=case.max_tokens,
        thinking=case.enable_thinking,
        reasoning=result.reasoning,
    )
    result.quality = verdict
    return verdict


def summarize(quality: Verdict | dict[str, Any] | None, width: int | None = 60) -> str:
    """Table cell for a stored verdict (``ProbeResult.quality``): ``✓``, ``✓ truncated``,
    ``✗ token_loop: …``, or ``—`` when there is none (the request failed)."""
    if not quality:
        return "—"
    verdict = Verdict.from_dict(quality) if isinstance(quality, dict) else quality
    return verdict.summary(width)


# --------------------------------------------------------------------------------------------
# Context shared by the signals


class _Context:
    """What the prompt allows; each fact is computed only when a signal asks for it."""

    def __init__(self, prompt: str, truncated: bool) -> None:
        self.prompt = prompt
        self.truncated = truncated

    @cached_property
    def prompt_lower(self) -> str:
        return self.prompt.lower()

    @cached_property
    def any_script(self) -> bool:  # translation and language prompts allow every script
        return bool(self.prompt) and bool(_ANY_SCRIPT_RE.search(self.prompt))

    @cached_property
    def dialogue(self) -> bool:  # the prompt asked for a conversation, so turn markers are fine
        return bool(self.prompt) and bool(_DIALOGUE_PROMPT_RE.search(self.prompt))

    @cached_property
    def about_templates(self) -> bool:  # the prompt asks about special tokens or chat templates
        return bool(self.prompt) and bool(_TEMPLATE_PROMPT_RE.search(self.prompt))

    @cached_property
    def lyric(self) -> bool:  # songs and poems repeat on purpose
        return bool(self.prompt) and bool(_LYRIC_PROMPT_RE.search(self.prompt))

    @cached_property
    def repeat(self) -> bool:  # the prompt asked for repetition
        return bool(self.prompt) and bool(_REPEAT_PROMPT_RE.search(self.prompt))


def _excerpt(text: str, start: int, end: int) -> str:
    end = min(end, start + _EVIDENCE_CHARS)
    return text[start:end]


def _code_spans(text: str) -> list[tuple[int, int]]:
    """Fenced blocks (an unclosed fence runs to the end) and inline `code`, sorted, disjoint."""
    if "`" not in text and "~~~" not in text:
        return []
    fences = _fence_spans(text)
    spans = list(fences)
    if "`" in text:
        spans += [m.span() for m in _INLINE_CODE_RE.finditer(text) if not _inside(m.start(), fences)]
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


def _inside(pos: int, spans: list[tuple[int, int]]) -> bool:
    """Is pos inside one of the sorted, disjoint spans?"""
    index = bisect_right(spans, (pos, _FAR)) - 1
    return index >= 0 and spans[index][0] <= pos < spans[index][1]


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start : end if end >= 0 else len(text)]


# --------------------------------------------------------------------------------------------
# Thinking


def _split_thinking(
    text: str,
    thinking: bool | None,
    reasoning: str | None,
    truncated: bool,
    finish: str | None,
    reasons: list[Reason],
) -> tuple[str, str, int]:
    """Return (answer, think_text, think_offset) and add thinking_leak/unterminated_think reasons."""
    opens = text.count(_THINK_OPEN)
    closes = text.count(_THINK_CLOSE)
    if not opens and not closes:
        return text, "", 0
    first = min(i for i in (text.find(_THINK_OPEN), text.find(_THINK_CLOSE)) if i >= 0)
    tag_span = (first, first + len(_THINK_CLOSE))
    if thinking is False:
        reasons.append(
            Reason(
                "thinking_leak",
                f"think tags in the answer although thinking is off ({opens} open, {closes} close)",
                _excerpt(text, *tag_span),
                0.8,
                tag_span,
            )
        )
    elif reasoning and reasoning.strip():
        reasons.append(
            Reason(
                "thinking_leak",
                "think tags in the answer although the server returned the reasoning separately",
                _excerpt(text, *tag_span),
                0.7,
                tag_span,
            )
        )
    elif opens > 1 or closes > 1:
        reasons.append(
            Reason(
                "thinking_leak",
                f"repeated think tags ({opens} open, {closes} close)",
                _excerpt(text, *tag_span),
                0.7,
                tag_span,
            )
        )
    last_close = text.rfind(_THINK_CLOSE)
    if opens and text.rfind(_THINK_OPEN) > last_close:
        start = text.rfind(_THINK_OPEN)
        think_start = start + len(_THINK_OPEN)
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
                    _excerpt(text, start, len(text)),
                    0.6 if stopped else 0.3,
                    (start, len(text)),
                )
            )
        return text[:start], text[think_start:], think_start
    if last_close >= 0:
        open_at = text.find(_THINK_OPEN)
        think_start = open_at + len(_THINK_OPEN) if 0 <= open_at < last_close else 0
        return text[last_close + len(_THINK_CLOSE) :], text[think_start:last_close], think_start
    return text, "", 0


# --------------------------------------------------------------------------------------------
# Signals that hold for any text (answer, think block, separated reasoning)


def _content_signals(text: str, ctx: _Context, offset: int, source: str, label: str = "") -> list[Reason]:
    out: list[Reason] = []

    def add(code: str, detail: str, span: tuple[int, int] | None, weight: float) -> None:
        evidence = _excerpt(text, *span) if span else ""
        full_span = (span[0] + offset, span[1] + offset) if span else None
        out.append(Reason(code, label + detail, evidence, weight, full_span, source))

    code_spans = _code_spans(text)

    if "\ufffd" in text and "\ufffd" not in ctx.prompt:
        count = text.count("\ufffd")
        first = text.index("\ufffd")
        add(
            "replacement_char",
            f"{count} U+FFFD replacement character(s)",
            (first, first + 1),
            min(0.95, 0.7 + 0.05 * count),
        )

    control = _CONTROL_RE.search(text)
    if control:
        count = len(_CONTROL_RE.findall(text))
        name = f"U+{ord(control.group()):04X}"
        span = (max(0, control.start() - 20), min(len(text), control.end() + 20))
        add(
            "control_chars",
            f"{count} control/invalid character(s), first {name}",
            span,
            min(0.9, 0.6 + 0.05 * count),
        )

    if not text.isascii() and _MOJIBAKE_GATE_RE.search(text):
        out.extend(_mojibake(text, ctx, offset, source, label))

    for match in _TEMPLATE_RE.finditer(text):
        token = match.group()
        if token in ctx.prompt:
            continue
        in_code = _inside(match.start(), code_spans)
        if in_code and _in_inline_code(text, match.start()):
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
        count = len(_TEMPLATE_RE.findall(text))
        where = "at a code block" if in_code else "in the text"
        add(
            "template_leak",
            f"chat-template token {token!r} {where} ({count} in all)",
            match.span(),
            0.7 if in_code else min(0.95, 0.8 + 0.03 * count),
        )
        break

    role = _role_leak(text, ctx, code_spans)
    if role:
        add(*role)

    enum = _degenerate_enumeration(text)
    if enum:
        add(*enum)

    out.extend(
        Reason(
            r.code,
            label + r.detail,
            r.evidence,
            r.weight,
            (r.span[0] + offset, r.span[1] + offset) if r.span else None,
            source,
        )
        for r in _loops(text, ctx, code_spans)
    )
    return out


def _in_inline_code(text: str, pos: int) -> bool:
    """Inside `single backticks` on its line (an odd number of backticks before it)."""
    line_start = text.rfind("\n", 0, pos) + 1
    before = text[line_start:pos]
    return before.count("`") % 2 == 1 and not before.lstrip().startswith("```")


def _mojibake(text: str, ctx: _Context, offset: int, source: str, label: str) -> list[Reason]:
    if _MOJIBAKE_PROMPT_RE.search(ctx.prompt):
        return []  # the prompt is about encodings: mis-decoded samples are the topic
    try:
        import ftfy  # ~70 ms to import; only reached when the text has mojibake-typical characters
        from ftfy.badness import BADNESS_RE
    except ImportError:  # a core dependency, but a broken install should not crash a probe run
        return _mojibake_without_ftfy(text, offset, source, label)
    match = BADNESS_RE.search(text)
    if not match:
        return []
    fixed = ftfy.fix_encoding(text)
    start = max(0, match.start() - 10)
    span = (start, min(len(text), match.end() + 20))
    if fixed != text:
        sample = ""
        for a, b in zip(_NONSPACE_RE.findall(text), _NONSPACE_RE.findall(fixed), strict=False):
            if a != b:
                sample = f" ({a!r} should read {b!r})"
                break
        weight = 0.75
        detail = f"mis-decoded UTF-8{sample}"
    else:
        weight = 0.35
        detail = "character sequences typical of mis-decoded text"
    return [
        Reason(
            "mojibake",
            label + detail,
            _excerpt(text, *span),
            weight,
            (span[0] + offset, span[1] + offset),
            source,
        )
    ]


_LATIN1_RUN_RE = re.compile(
    r"[\u0080-\u00ff\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc\u2013-\u2122]{2,}"
)


def _mojibake_without_ftfy(text: str, offset: int, source: str, label: str) -> list[Reason]:
    """Fallback: a run of Latin-1/cp1252 characters that re-encodes to valid multi-byte UTF-8."""
    for match in _LATIN1_RUN_RE.finditer(text):
        run = match.group()
        for codec in ("cp1252", "latin-1"):
            try:
                fixed = run.encode(codec).decode("utf-8")
            except (UnicodeEncodeError, UnicodeDecodeError):
                continue
            if fixed != run:
                span = (match.start(), match.end())
                return [
                    Reason(
                        "mojibake",
                        f"{label}mis-decoded UTF-8 ({run!r} should read {fixed!r})",
                        run,
                        0.75,
                        (span[0] + offset, span[1] + offset),
                        source,
                    )
                ]
    return []


def _role_leak(text: str, ctx: _Context, code_spans: list[tuple[int, int]]):
    if ":" not in text and "\n" not in text and not text.lstrip().lower().startswith(("user", "assistant")):
        return None
    hits = []
    for match in _role_matches(text):
        if _inside(match.start(), code_spans):
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
        return None
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
        return None
    what = "turn marker" if strong else "dialogue line"
    return (
        "role_leak",
        f"conversation {what} {marker[:30]!r} in the text ({len(hits)} in all)",
        span,
        weight,
    )


def _opens_a_turn(text: str, start: int, end: int) -> bool:
    """A bare role line opens a turn when a sentence follows it (the turn's message) or prose
    precedes it (the answer ended, a new turn begins); between one-word lines it is a list item."""
    after = next((line for line in text[end:].split("\n") if line.strip()), "")
    before = next((line for line in reversed(text[:start].split("\n")) if line.strip()), None)
    return len(after.split()) >= 2 or before is None or len(before.split()) >= 3


def _speaker(marker: str) -> str:
    return _FIRST_WORD_RE.match(marker).group(1).lower()


def _role_matches(text: str):
    """_ROLE_RE matches, tried only on lines that begin with a role word (found with str.find,
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
        match = _ROLE_RE.match(line)
        if match:
            yield _ShiftedMatch(match, line_start)


# Role words as they start a turn-marker line (the short ones only with their colon).
_ROLE_FINDS = (
    "user", "assistant", "human", "system", "model", "instruction", "response",
    "ai:", "ai*", "bot:", "bot*", "gpt:", "gpt*", "chatbot",
)  # fmt: skip


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


def _degenerate_enumeration(text: str):
    if "." not in text and ")" not in text:
        return None
    gates = [m.start() for m in _STUCK_GATE_RE.finditer(text)]
    if not gates:
        return None  # no marker followed closely by another: nothing stuck
    if len(text) <= _WINDOWED_ABOVE:
        markers = list(_MARKER_RE.finditer(text))
    else:  # a long text: walk the markers only around the gate hits
        markers, reach = [], 0
        for at in gates:
            lo, hi = max(reach, at - 200), min(len(text), at + 200)
            if lo < hi:
                markers += _MARKER_RE.finditer(text, lo, hi)
            reach = max(reach, hi)
    if len(markers) < 3:
        return None
    stuck = 0
    first_span = None
    for prev, cur in pairwise(markers):
        between = text[prev.end() : cur.start()]
        empty = not _WORDISH_RE.search(between) or len(between.strip()) <= 3
        if empty and int(cur.group(1)) <= int(prev.group(1)):
            stuck += 1
            if first_span is None:
                first_span = (prev.start(), cur.end())
    if stuck < 2:
        return None
    end = first_span[1]
    for m in markers:
        if m.start() >= first_span[0]:
            end = m.end()
    return (
        "degenerate_enumeration",
        f"list markers that never advance and hold nothing ({stuck + 1} in a row or scattered)",
        (first_span[0], end),
        min(0.9, 0.6 + 0.05 * (stuck - 2)),
    )


# --------------------------------------------------------------------------------------------
# Loops


def _tokens(text: str) -> tuple[list[int], list[str]]:
    """Token ids (case-folded) and the distinct token strings by id."""
    lowered = text.lower()
    if len(lowered) != len(text):  # a few characters change length when lowered (İ)
        lowered = text
    toks = _TOKEN_RE.findall(lowered)
    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(t, len(vocab)) for t in toks]
    return ids, list(vocab)


def _token_offsets(text: str) -> list[int]:
    """Character offset of every token; only computed when a loop must be located."""
    lowered = text.lower()
    if len(lowered) != len(text):
        lowered = text
    return [m.start() for m in _TOKEN_RE.finditer(lowered)]


def _is_word(token: str) -> bool:
    return (
        token[:1].isalpha()
        or (token[:1].isalnum() and not token.isdigit())
        or (token[:1] == "_" and len(token) > 1)
    )


def _periodic_runs(ids: list[int], max_period: int = 200) -> list[tuple[int, int, int]]:
    """Maximal stretches where the token sequence repeats with some period.

    Returns (start, end, period) over token indices (end exclusive). Linear: the candidate period
    at each step is the distance to the previous occurrence of the current bigram; a run extends
    while ids[i] == ids[i - period].
    """
    runs: list[tuple[int, int, int]] = []
    n = len(ids)
    if n < 4:
        return runs
    last: dict[int, int] = {}
    width = len(ids) + 1
    period = 0
    run_start = 0
    for i in range(1, n):
        key = ids[i - 1] * width + ids[i]
        prev = last.get(key)
        last[key] = i
        if period and ids[i] == ids[i - period]:
            continue
        if period:
            if i - run_start >= 2 * period + 1 or i - run_start >= period + 2:
                runs.append((run_start, i, period))
            period = 0
        if prev is not None and i - prev <= max_period:
            period = i - prev
            # Extend backwards: the repetition may have started before this bigram recurred.
            j = i - 1
            limit = max(period, i - 4 * max_period)
            while j - period >= 0 and j >= limit and ids[j] == ids[j - period]:
                j -= 1
            run_start = j - period + 1
    if period and n - run_start >= period + 2:
        runs.append((run_start, n, period))
    return runs


# Texts longer than this are searched for loops only where zlib says they repeat (a loop always
# compresses well), which keeps long healthy answers fast: zlib runs at C speed.
_WINDOWED_ABOVE = 16_384
_BLOCK = 1_024
_TAIL = 8_192


def _loops(text: str, ctx: _Context, code_spans: list[tuple[int, int]]) -> list[Reason]:
    best: dict[str, Reason] = {}
    if len(text) <= _WINDOWED_ABOVE:
        _loops_in(text, 0, len(text), ctx, code_spans, best)
    else:
        for lo, hi in _suspect_windows(text):
            _loops_in(text, lo, hi, ctx, code_spans, best)
    found = list(best.values())
    comp = _compression(text, ctx, code_spans)
    if comp:
        found.append(comp)
    return found


# One symbol (emoji, "!", "?", U+FFFD aside) 16+ times in a row, or 20+ newlines: the tokenizer
# sees one token, so the loop search does not; markdown rules ("-----", "=====") and dots are fine.
_FLOOD_RE = re.compile(r"([^\w\s\-=_*#~.`|+<>/\\\ufffd]{1,2}?)\1{15,}|\n[ \t]*(?:\n[ \t]*){19,}")


def _flood(text: str, lo: int, hi: int, ctx: _Context, code_spans: list[tuple[int, int]]) -> Reason | None:
    for match in _FLOOD_RE.finditer(text, lo, hi):
        if _inside(match.start(), code_spans) or ctx.repeat:
            continue
        unit = match.group(1) or "\n"
        count = match.group().count(unit)
        return Reason(
            "token_loop",
            f"{unit!r} repeated {count}× in a row",
            _excerpt(text, *match.span()),
            0.6 if count < 40 else 0.75,
            match.span(),
        )
    return None


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
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(picks):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _loops_in(
    text: str, lo: int, hi: int, ctx: _Context, code_spans: list[tuple[int, int]], best: dict[str, Reason]
) -> None:
    """Find back-to-back repetition in text[lo:hi]; keep the heaviest reason per code in `best`."""
    flood = _flood(text, lo, hi, ctx, code_spans)
    if flood and ("token_loop" not in best or flood.weight > best["token_loop"].weight):
        best["token_loop"] = flood
    segment = text[lo:hi] if (lo, hi) != (0, len(text)) else text
    ids, names = _tokens(segment)
    n = len(ids)
    if n < 4:
        return
    at_text_end = hi == len(text)
    starts: list[int] | None = None
    # No bigram occurs twice: nothing can repeat back to back (most short answers stop here).
    runs = _periodic_runs(ids) if len(set(pairwise(ids))) < n - 1 else []
    for start, end, period in runs:
        covered = end - start
        repeats = covered / period
        if repeats < 2.0:
            continue
        unit = ids[start : start + period]
        unit_words = sum(1 for t in unit if _is_word(names[t]))
        # A whole passage (20+ tokens, mostly words) said twice in a row is already a fault; so
        # is a sentence said twice right where the reply hits the token limit (a loop starting).
        wordy = unit_words >= period / 2
        passage = wordy and (period >= 20 or (period >= 8 and ctx.truncated and at_text_end and n - end <= 2))
        if repeats < 3.0 and not passage:
            continue
        if passage:
            needed = 2.0
        elif not unit_words:
            if not any(names[t].isdigit() for t in unit):
                continue  # punctuation and markup: rules, table borders, closing braces
            # Numbers repeat legitimately (matrices, tallies), but not forever; a longer numeric
            # phrase ("2 + 2 = 4.") repeated verbatim is already odd.
            needed = 4.0 if period >= 4 else 10.0
        elif all(names[t] in _INTERJECTIONS for t in unit if _is_word(names[t])):
            needed = 6.0  # "ha ha ha", "no, no, no, no", "tick-tock, tick-tock"
        elif period <= 2:
            needed = 4.0
        elif covered >= 12 or period >= 6:
            needed = 3.0
        else:
            needed = 4.0
        if repeats < needed:
            continue
        if starts is None:
            starts = [lo + x for x in _token_offsets(segment)]
        pos = starts[start]
        relaxed = _inside(pos, code_spans) or _line_at(text, pos).lstrip().startswith("|")
        # A refrain that runs until the token limit is a loop, song or not.
        runs_out = ctx.truncated and at_text_end and n - end <= 2
        if (relaxed or ctx.lyric) and not runs_out:
            needed = max(needed * 2, 6.0)
        if ctx.repeat:
            needed = max(needed * 3, 12.0)
        if repeats < needed:
            continue
        reaches_end = at_text_end and n - end <= max(2, period)
        weight = 0.65 if repeats >= 3.0 else 0.5
        if repeats >= 2 * needed:
            weight += 0.1
        if reaches_end and (ctx.truncated or repeats >= needed + 1):
            weight += 0.1
        has_newline = any(names[t].startswith("\n") for t in unit)
        code = "token_loop" if period == 1 else ("line_loop" if has_newline else "phrase_loop")
        unit_text = " ".join(names[t] for t in unit).replace("\n", "\\n")
        if len(unit_text) > 40:
            unit_text = unit_text[:37] + "..."
        char_start = starts[start]
        char_end = starts[end - 1] + len(names[ids[end - 1]])
        where = "to the end" if reaches_end else "mid-text"
        reason = Reason(
            code,
            f"{unit_text!r} repeated {repeats:.0f}× back to back ({covered} tokens, {where})",
            _excerpt(text, char_start, char_end),
            min(weight, 0.95),
            (char_start, char_end),
        )
        if code not in best or reason.weight > best[code].weight:
            best[code] = reason
    # In a long text, near-duplicate paragraphs mid-way are normal (reference docs); a counter loop
    # that matters runs to the end, so only the tail window is held to this signal.
    if "phrase_loop" not in best and "line_loop" not in best and (lo == 0 or at_text_end):
        ngram = _repeated_ngram(text, lo, segment, ids, names, ctx, code_spans)
        if ngram and ("repeated_ngram" not in best or ngram.weight > best["repeated_ngram"].weight):
            best["repeated_ngram"] = ngram


def _repeated_ngram(text, lo, segment, ids, names, ctx, code_spans) -> Reason | None:
    """A long word sequence that keeps coming back with something changing in between.

    Catches loops with a counter ("1. The cat sat. 2. The cat sat. 3. ...") that the back-to-back
    detector misses. Refrains recur too, so it needs many recurrences over most of the text.
    """
    size = 6
    n = len(ids)
    if n < size * 4:
        return None
    counts = Counter(zip(*(ids[k:] for k in range(size)), strict=False))
    word_ids = {i for i, t in enumerate(names) if _is_word(t)}
    common = [
        (gram, count)
        for gram, count in counts.most_common(50)
        if count >= 4 and sum(1 for t in gram if t in word_ids) >= 3
    ]
    if not common:
        return None
    gram, count = common[0]
    frequent = {g for g, c in counts.items() if c >= 3 and sum(1 for t in g if t in word_ids) >= 3}
    hits = [i for i, g in enumerate(zip(*(ids[k:] for k in range(size)), strict=False)) if g in frequent]
    first = hits[0]
    covered_tokens = 0
    reach = -1  # union of the windows [i, i + size)
    for i in hits:
        covered_tokens += min(size, i + size - max(i, reach))
        reach = i + size
    coverage = covered_tokens / n
    if coverage < 0.5:
        return None
    # What changes between the recurrences? Only numbers and markers: a loop with a counter.
    # Words: a list with a fixed shape ("Add 1 cup of X to the bowl."), which is fine.
    # Look at the gaps between covered stretches (not the text before the first or after the last).
    gaps = with_words = 0
    reach = hits[0] + size
    for i in hits[1:]:
        if i > reach:
            gaps += 1
            with_words += any(ids[k] in word_ids for k in range(reach, i))
        reach = i + size
    counter_loop = with_words <= 0.25 * gaps
    starts = [lo + x for x in _token_offsets(segment)]
    needed = 0.5
    if ctx.lyric or ctx.repeat:
        needed = 0.8
    if _inside(starts[first], code_spans) or _line_at(text, starts[first]).lstrip().startswith("|"):
        needed = 0.8
    if coverage < needed:
        return None
    weight = 0.35
    reaches_end = ctx.truncated and hits[-1] + 2 * size >= n
    if counter_loop and count >= 5 and (coverage >= 0.7 or (coverage >= 0.6 and reaches_end)):
        weight = 0.6
    if counter_loop and coverage >= 0.85 and count >= 8:
        weight = 0.7
    if not counter_loop:
        weight = 0.2
    phrase = " ".join(names[t] for t in gram).replace("\n", "\\n")
    span = (starts[first], min(len(text), starts[first] + _EVIDENCE_CHARS))
    return Reason(
        "repeated_ngram",
        f"{phrase!r} recurs {count}×; recurring phrases cover {coverage:.0%} of the text",
        _excerpt(text, *span),
        weight,
        span,
    )


def _compression(text: str, ctx: _Context, code_spans: list[tuple[int, int]]) -> Reason | None:
    data = text.encode("utf-8", "surrogatepass")
    if len(data) < 400:
        return None
    ratio = len(zlib.compress(data, 6)) / len(data)
    if ratio < 0.12 and not ctx.repeat:
        in_code = sum(b - a for a, b in code_spans) > len(text) / 2
        weight = 0.3 if in_code or ctx.lyric else (0.45 if ratio < 0.07 else 0.35)
        return Reason(
            "compression_ratio",
            f"compresses to {ratio:.0%} of its size (natural text: 30-60%): highly repetitive",
            _excerpt(text, 0, len(text)),
            weight,
            (0, len(text)),
        )
    if ratio > 0.9 and text.isascii() and len(data) >= 600:
        return Reason(
            "compression_ratio",
            f"compresses to {ratio:.0%} of its size: closer to noise than to language",
            _excerpt(text, 0, len(text)),
            0.3,
            (0, len(text)),
        )
    return None


# --------------------------------------------------------------------------------------------
# Script mixing


def _script_runs(text: str) -> tuple[list[tuple[str, int, int]], int]:
    """Runs of non-Latin letters as (script, start, end), and the number of ASCII letters."""
    runs: list[tuple[str, int, int]] = []
    for candidate in _NON_LATIN_CANDIDATE_RE.finditer(text):
        base = candidate.start()
        for match in _script_run_re().finditer(candidate.group()):
            runs.append((match.lastgroup, base + match.start(), base + match.end()))
    latin = len(text.encode("ascii", "ignore").translate(None, _NOT_ASCII_LETTERS))
    return runs, latin


def _scripts(text: str) -> Counter:
    runs, latin = _script_runs(text)
    counts: Counter = Counter()
    if latin:
        counts["Latin"] = latin
    for script, a, b in runs:
        counts[script] += b - a
    return counts


def _mixed_word(text: str, runs: list[tuple[str, int, int]]) -> str | None:
    """A word mixing Latin and Cyrillic letters (homoglyph soup: "Hеllo" with a Cyrillic e)."""
    for script, a, b in runs:
        if script != "Cyrillic":
            continue
        before = text[a - 1] if a else ""
        after = text[b] if b < len(text) else ""
        if (before.isascii() and before.isalpha()) or (after.isascii() and after.isalpha()):
            start, end = a, b
            while start and text[start - 1].isalpha():
                start -= 1
            while end < len(text) and text[end].isalpha():
                end += 1
            return text[start:end]
    return None


def _script_signals(text: str, ctx: _Context) -> list[Reason]:
    out: list[Reason] = []
    if text.isascii():
        return out
    runs, latin = _script_runs(text)
    mixed = _mixed_word(text, runs)
    if mixed and mixed not in ctx.prompt:
        # Homoglyph soup says more than the run count; report it alone.
        at = text.find(mixed)
        return [
            Reason(
                "script_mix",
                f"word mixes Latin and Cyrillic letters: {mixed!r}",
                mixed,
                0.65,
                (at, at + len(mixed)),
            )
        ]
    if not runs or ctx.any_script:
        return out
    answer_counts: Counter = Counter()
    if latin:
        answer_counts["Latin"] = latin
    for script, a, b in runs:
        answer_counts[script] += b - a
    total = sum(answer_counts.values())
    if not total:
        return out
    if ctx.prompt.strip():
        allowed = set(_scripts(ctx.prompt)) | {"Latin"}
        if "Kana" in allowed:
            allowed.add("Han")
        if "Hangul" in allowed:
            allowed.add("Han")
        for pattern, scripts in _LANGUAGE_SCRIPTS_RE:
            if pattern.search(ctx.prompt):
                allowed |= scripts
        expected = "the prompt's"
    else:
        dominant = answer_counts.most_common(1)[0][0]
        allowed = {dominant, "Latin"}
        if dominant in ("Kana", "Han"):
            allowed |= {"Kana", "Han"}
        if dominant == "Hangul":
            allowed.add("Han")
        expected = f"the text's main ({dominant})"
    foreign_total = sum(c for s, c in answer_counts.items() if s not in allowed)
    if not foreign_total:
        return out
    code_spans = _code_spans(text)
    foreign = [(s, a, b) for s, a, b in runs if s not in allowed and not _inside(a, code_spans)]
    if not foreign:
        return out
    foreign_total = sum(b - a for _, a, b in foreign)
    names = sorted({s for s, _, _ in foreign})
    if foreign_total / total >= 0.8:
        # The whole answer is in another writing system: a language switch, odd but consistent.
        first = foreign[0]
        out.append(
            Reason(
                "script_mix",
                f"the answer is written in {'/'.join(names)}, not in {expected} script",
                _excerpt(text, first[1], len(text)),
                0.45,
                (first[1], min(len(text), first[2] + 40)),
            )
        )
        return out
    weights = []
    flagged = []
    for script, a, b in _merge_runs(text, foreign):
        if script == "Greek" and b - a <= 3:
            continue  # maths symbols: α, β, π, Σ
        if _quoted(text, a, b) or _in_url(text, a):
            continue
        line_start = text.rfind("\n", 0, a) + 1
        line_end = text.find("\n", b)
        line_end = len(text) if line_end < 0 else line_end
        before = text[max(line_start, a - 40) : a]
        after = text[b : min(line_end, b + 40)]
        host_before = _host_letters(before, allowed)
        host_after = _host_letters(after, allowed)
        if host_before and host_after:
            w = 0.55  # switched script mid-sentence and back
        elif b - a >= 6:
            w = 0.55  # a whole foreign phrase
        elif _host_letters(_SENTENCE_END_RE.split(before)[-1], allowed):
            w = 0.5  # a sentence begun in the host script ends in another one
        else:
            w = 0.4
        if b - a == 1 and script in ("Han", "Kana") and allowed & {"Han", "Kana"}:
            w = min(w, 0.4)  # one kana in Chinese ("我の最爱") is net slang, not a switch
        weights.append(w)
        flagged.append((script, a, b))
    if not flagged:
        return out
    score = 1.0
    for w in weights:
        score *= 1 - w
    weight = min(0.9, 1 - score)
    script, a, b = flagged[0]
    span = (max(0, a - 20), min(len(text), b + 20))
    spans = ", ".join(repr(text[x:y][:12]) for _, x, y in flagged[:4])
    out.append(
        Reason(
            "script_mix",
            f"{len(flagged)} {'/'.join(sorted({s for s, _, _ in flagged}))} span(s) outside "
            f"{expected} script: {spans}",
            _excerpt(text, *span),
            weight,
            span,
        )
    )
    return out


def _merge_runs(text: str, runs: list[tuple[str, int, int]]):
    """Join touching runs (Japanese mixes Han and kana) and runs of one script separated only by
    spaces: a foreign phrase is one span."""
    merged: list[tuple[str, int, int]] = []
    for script, a, b in runs:
        if merged:
            last_script, last_a, last_b = merged[-1]
            gap = text[last_b:a]
            if gap == "" or (gap.strip(" \u3000") == "" and last_script == script):
                merged[-1] = (last_script, last_a, b)
                continue
        merged.append((script, a, b))
    return merged


def _host_letters(snippet: str, allowed: set[str]) -> bool:
    """Does the snippet hold two letters in a row of an allowed (host) script?"""
    if "Latin" in allowed and _ASCII_PAIR_RE.search(snippet):
        return True
    return any(match.lastgroup in allowed and len(match.group()) >= 2 for match in _script_run_re().finditer(snippet))


_OPEN_QUOTES = "\"'`“‘«「『(（[*_<‹【《"
_CLOSE_QUOTES = "\"'`”’»」』)）]*_>›】》"


def _in_url(text: str, a: int) -> bool:
    """Part of a URL or e-mail address (``https://ja.wikipedia.org/wiki/東京``)."""
    chunk_start = max(text.rfind(" ", 0, a), text.rfind("\n", 0, a), text.rfind("(", 0, a)) + 1
    chunk = text[chunk_start:a]
    return "://" in chunk or chunk.startswith("www.") or "@" in chunk


def _quoted(text: str, a: int, b: int) -> bool:
    """A foreign term written as a term: in quotes, brackets or emphasis, or glossed in
    parentheses: ``"你好"``, ``(こんにちは)``, ``早上好 (zǎoshang hǎo)``."""
    before = text[max(0, a - 2) : a].rstrip(" ")
    after = text[b : b + 3].lstrip(" ")
    if before and before[-1] in _OPEN_QUOTES:
        return True
    if after and after[0] in _CLOSE_QUOTES:
        return True
    return after.startswith(("(", "（", "["))


# --------------------------------------------------------------------------------------------
# Premature stop


# Aux verbs and prepositions a very short reply cannot stop on ("The capital of France is").
_SHORT_DANGLING = _FUNCTION_WORDS | frozenset(
    "is are was were i'm i’m it's it’s to of at for with from by as into than very".split()  # noqa: SIM905
)
# "Yes it is", "There it is": a pronoun before the verb makes a complete short sentence.
_PRONOUNS = frozenset(
    "it he she they we you i this that what who which one so".split()  # noqa: SIM905
)


def _premature_stop(
    answer: str, completion_tokens: int | None, ctx: _Context, unknown_finish: bool = False
) -> list[Reason]:
    """The reply stopped (not cut by length) in the middle of a sentence. Hard at any length: a
    healthy model does not emit end-of-turn after "the" or ","; soft only for an unclosed code
    fence (some models forget the closing fence), for poems, and when finish_reason is unknown."""
    stripped = answer.rstrip()
    if not stripped:
        return []
    end_char = stripped[-1]
    tail = stripped[-400:]
    words = _WORDS_RE.findall(tail)
    # A long text is never "short"; CJK text has no spaces, so count two characters as a word.
    n_words = 100 if len(stripped) > 400 else max(len(words), len(_CJK_CHAR_RE.findall(tail)) // 2)
    short = n_words <= 8 or (completion_tokens is not None and completion_tokens <= 8)
    cut = len(tail)
    while cut and (tail[cut - 1].isalnum() or tail[cut - 1] in "'’"):
        cut -= 1
    last_word = tail[cut:].lower().lstrip("'’")
    why = None
    if end_char in _UNFINISHED_END:
        why = f"ends on {end_char!r}"
    elif stripped.count("```") % 2 == 1:
        why = "a code block is never closed"
    elif last_word:
        if last_word in _FUNCTION_WORDS and (len(words) >= 2 or len(last_word) > 1):
            why = f"ends on the word {last_word!r}"
        elif len(words) >= 2 and short and last_word in _SHORT_DANGLING:
            before = words[-2].lower()
            if not (last_word in ("is", "are", "was", "were") and before in _PRONOUNS):
                why = f"ends on the word {last_word!r}"
    if why is None:
        return []
    if unknown_finish:
        weight = 0.4 if short else 0.2
    elif short:
        weight = 0.65
    elif why.startswith("a code block") or ctx.lyric:
        weight = 0.4
    else:
        weight = 0.55
    size = f"{completion_tokens} tokens" if completion_tokens is not None else f"{n_words} word(s)"
    finish = "finish_reason unknown" if unknown_finish else "finish_reason=stop"
    span = (max(0, len(stripped) - 40), len(stripped))
    return [
        Reason(
            "premature_stop",
            f"{finish} after {size}, but the text {why}",
            _excerpt(answer, *span),
            weight,
            span,
        )
    ]
