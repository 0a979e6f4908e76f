"""How the answer ended: cut at the token limit, empty, or ``stop`` on an unfinished sentence."""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_left

from ddtree_diag.checks.quality import lexicon
from ddtree_diag.checks.quality.context import ANSWER, EMPTY, WHOLE, Context, excerpt, inside_spans, reads
from ddtree_diag.checks.quality.patterns import (
    CJK_CHAR_RE,
    DANGLING_BY_LANGUAGE,
    DANGLING_CJK,
    EVIDENCE_CHARS,
    FUNCTION_WORDS,
    LENGTH_REASONS,
    MARKED_WORDS_RE,
    PREPOSITION_ARTICLE,
    STOP_REASONS,
    UNFINISHED_END,
    WORDS_RE,
)
from ddtree_diag.records import Reason

# Aux verbs and prepositions a very short reply cannot stop on ("The capital of France is").
_SHORT_DANGLING = FUNCTION_WORDS | frozenset(
    "is are was were i'm i’m it's it’s to of at for with from by as into than very".split()  # noqa: SIM905
)
# "Yes it is", "There it is": a pronoun before the verb makes a complete short sentence.
_PRONOUNS = frozenset(
    "it he she they we you i this that what who which one so".split()  # noqa: SIM905
)


@reads(WHOLE)
def find_truncated(text: str, ctx: Context) -> list[Reason]:
    """Cut at the token limit: reported (info), never garbage by itself."""
    if not ctx.truncated:
        return []
    why = (
        f"finish_reason={ctx.finish}"
        if ctx.finish in LENGTH_REASONS
        else f"{ctx.completion_tokens} of {ctx.max_tokens} tokens"
    )
    return [Reason("truncated", f"cut at the token limit ({why}); not garbage by itself")]


@reads(EMPTY)
def find_empty_output(text: str, ctx: Context) -> list[Reason]:
    """No answer, or one of only whitespace, punctuation or a bare list marker (``has_content``
    is false: nothing else reads it)."""
    stripped = text.strip()
    if stripped:
        at = text.index(stripped)
        detail = "the answer holds only punctuation or a bare list marker"
        return [Reason("empty_output", detail, stripped[:EVIDENCE_CHARS], 0.7, (at, at + len(stripped)))]
    if ctx.truncated and ctx.has_thought:
        return []  # cut while thinking: the answer never started; `truncated` says so
    if ctx.truncated or (ctx.has_thought and ctx.finish is None):
        # Maybe cut before the answer began; an unterminated think block already says so.
        if ctx.unclosed_think:
            return []
        return [Reason("empty_output", "the answer is empty (cut before it began?)", "", 0.3)]
    return [Reason("empty_output", "the answer is empty", "", 1.0 if not ctx.has_thought else 0.7)]


@reads(ANSWER)
def find_premature_stop(text: str, ctx: Context) -> list[Reason]:
    """``stop`` (or an unknown finish) on an unfinished sentence; not when cut by length."""
    if ctx.truncated:
        return []
    if ctx.finish in STOP_REASONS:
        return _premature_stop(text, ctx.completion_tokens, ctx)
    if ctx.finish is None:
        return _premature_stop(text, ctx.completion_tokens, ctx, unknown_finish=True)
    return []


def _premature_stop(
    answer: str, completion_tokens: int | None, ctx: Context, unknown_finish: bool = False
) -> list[Reason]:
    """The reply stopped (not cut by length) in the middle of a sentence. Hard at any length: a
    healthy model does not emit end-of-turn after "the" or ","; soft only for an unclosed code
    fence (some models forget the closing fence), for poems, and when finish_reason is unknown."""
    stripped = answer.rstrip()
    if not stripped:
        return []
    end_char = stripped[-1]
    tail = stripped[-400:]
    words = MARKED_WORDS_RE.findall(tail)
    # A long text is never "short"; CJK text has no spaces, so count two characters as a word.
    n_words = 100 if len(stripped) > 400 else max(len(words), len(CJK_CHAR_RE.findall(tail)) // 2)
    short = n_words <= 8 or (completion_tokens is not None and completion_tokens <= 8)
    cut = len(tail)
    while cut and (tail[cut - 1].isalnum() or tail[cut - 1] in "'’" or unicodedata.category(tail[cut - 1])[0] == "M"):
        cut -= 1
    last_word = tail[cut:].lower().lstrip("'’")
    after_hyphen = cut > 0 and tail[cut - 1] in "-‐"  # "Fais-le", "allons-y": a pronoun, not an article
    # a word only where it stands apart: "C(=O)O" or "H2O" ends on no word "o"
    glued = cut > 0 and not tail[cut - 1].isspace() and tail[cut - 1] not in "(\"“‘«¿¡"
    before_last = words[-2].lower() if len(words) >= 2 else ""
    why = None
    cut_soft = False
    if end_char in UNFINISHED_END and not _MORSE_LINE_RE.fullmatch(stripped[stripped.rfind("\n") + 1 :]):
        why = f"ends on {end_char!r}"
    elif stripped.count("```") % 2 == 1:
        why = "a code block is never closed"
    elif CJK_CHAR_RE.match(end_char) and len(CJK_CHAR_RE.findall(tail)) >= 6 and stripped.endswith(DANGLING_CJK):
        why = f"ends on {next(p for p in DANGLING_CJK if stripped.endswith(p))!r}, which needs what follows"
    elif last_word and not after_hyphen and not glued and len(words) >= 2:
        # (a one-word answer is an answer: "Au", "De", "Or" are gold, a preposition's name, a word)
        dangling, pairs = _dangling_words(words, ctx.prompt)
        if last_word in dangling:
            why = f"ends on the word {last_word!r}"
        elif last_word in pairs[1] and before_last in pairs[0]:
            why = f"ends on {before_last!r} {last_word!r}, a preposition and its article"
        elif len(words) >= 2 and short and last_word in _SHORT_DANGLING:
            before = words[-2].lower()
            if not (last_word in ("is", "are", "was", "were") and before in _PRONOUNS):
                why = f"ends on the word {last_word!r}"
        elif not any(ch.isupper() for ch in tail[cut:]) and (whole := _cut_word(words, last_word, stripped)):
            why = f"ends inside a word: {last_word!r} is no word, {whole!r} is"
            # Hard only where the rest of the text ends its sentences: a word the lexicon lacks
            # ("struct", "redis") at the end of an unpunctuated short answer or a list item is a
            # plain ending too often. A 4-letter cut or a short last line is soft as well.
            last_line = stripped[stripped.rfind("\n") + 1 :]
            punctuates = _ENDED_SENTENCE_RE.search(stripped[: len(stripped) - len(last_word)]) is not None
            cut_soft = (not punctuates or len(last_word) < 5 or len(MARKED_WORDS_RE.findall(last_line)) < 6
                        or _LIST_ITEM_RE.match(last_line) is not None)
    if why is None:
        return _unpunctuated_prose_end(answer, stripped, ctx, unknown_finish)
    if unknown_finish:
        weight = 0.4 if short else 0.2
    elif cut_soft:
        weight = 0.4
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
            excerpt(answer, *span),
            weight,
            span,
        )
    ]


_TERMINATORS = ".!?。！？।؟"  # sentence ends in the scripts the lexicons cover, CJK and Indic included
_ENDED_SENTENCE_RE = re.compile(rf"[{_TERMINATORS}]\s")  # a sentence the text ended, another following
_SENTENCE_END_RE = re.compile(rf"[{_TERMINATORS}\n]")  # where a sentence (or a line) ends
_RESTART_HEAD = 12  # characters a broken-off sentence must have before it starts again
_RESTART_LOOKBACK = 400  # characters: a restart is looked for this far into its sentence


@reads(ANSWER)
def find_restart(text: str, ctx: Context) -> list[Reason]:
    """The answer breaks off inside a word and starts its sentence again ("…into IP addr DNS, the
    Domain Name System, translates … into IP addresses"): the second copy runs on through the word
    the first broke off in. A refrain or a repeated line ends where its copy does, so it is never
    this; a decoder that drops a round and resumes from an old state is."""
    if len(text) < 30:
        return []
    code_spans = ctx.code_spans
    starts = [0] + [m.end() for m in _SENTENCE_END_RE.finditer(text)]
    for start in starts:
        while start < len(text) and text[start].isspace():
            start += 1
        head = text[start : start + _RESTART_HEAD]
        if len(head) < _RESTART_HEAD or _SENTENCE_END_RE.search(head) or inside_spans(start, code_spans):
            continue  # a broken-off copy holds no sentence end; code is not prose
        # where the sentence's head comes again, close behind (C-speed find: most sentences stop here)
        resume = text.find(head, start + 1, start + _RESTART_LOOKBACK + _RESTART_HEAD)
        while resume > 0:
            cut = resume
            while cut > start and text[cut - 1].isspace():
                cut -= 1
            first = text[start:cut]
            after = resume + len(first)
            if (cut < resume and first.count(" ") >= 2 and after < len(text) and _letter(text[after])
                    and _letter(text[cut - 1]) and not _SENTENCE_END_RE.search(first)
                    and text.startswith(first, resume)):
                word = first.rsplit(None, 1)[-1]
                end = after
                while end < len(text) and _letter(text[end]):
                    end += 1
                return [Reason(
                    "restart",
                    f"breaks off inside {word + text[after:end]!r} (at {word!r}) and starts its sentence again",
                    excerpt(text, start, min(len(text), after + 20)),
                    0.7,
                    (start, after),
                )]
            resume = text.find(head, resume + 1, start + _RESTART_LOOKBACK + _RESTART_HEAD)
    return []


def _letter(ch: str) -> bool:
    """A letter or a combining mark (a Devanagari vowel sign or virama ends many a cut)."""
    return ch.isalpha() or unicodedata.category(ch)[0] == "M"


# a line of Morse code (".... . .-.. .-.. ---"), maybe after a label: its dashes end letters
_MORSE_LINE_RE = re.compile(r"(?:[^:\n]{1,30}:)?[ \t]*[.\-]+(?:[ \t/]+[.\-]+)+")

_LIST_ITEM_RE = re.compile(r"\s*(?:[-*+•]|\d+[.)]|[a-z][.)])\s|\s*#|\s*\|")


def _cut_word(words: list[str], last_word: str, text: str) -> str | None:
    """A word of the text's language that its last word is the start of, when that last word is
    none ("Rayleigh scatt", "the authorit"): the stop came inside a word. Only for prose in a
    language we hold (its frequent words make up 12 %+ of it), a last word of 4+ letters the
    text has not used before (a repeated unknown word is a term: "kubectl")."""
    if len(last_word) < 4 or len(words) < 5:
        return None
    if not all(ch.isalpha() or unicodedata.category(ch)[0] == "M" for ch in last_word):
        return None  # digits, "_": an identifier or a number, not a word
    ranked = lexicon.identify([w.casefold() for w in words])
    if not ranked or ranked[0][1] < 0.12:
        return None
    langs = [lang for lang, share in ranked[:2] if share >= 0.5 * ranked[0][1]]
    last_word = last_word.casefold()  # the lexicon is case-folded (ß, final ς)
    if any(last_word in lexicon.words(lang) for lang in langs):
        return None
    if len(re.findall(rf"(?<!\w){re.escape(last_word)}(?!\w)", text.casefold())) > 1:
        return None  # said before as a word of its own: a term
    listed = lexicon.sorted_words(langs[0])
    at = bisect_left(listed, last_word)
    while at < len(listed) and listed[at].startswith(last_word):
        if len(listed[at]) >= len(last_word) + 2:
            return listed[at]
        at += 1
    return None


def _dangling_words(words: list[str], prompt: str) -> tuple[frozenset[str], tuple[frozenset[str], frozenset[str]]]:
    """The words a sentence cannot end on, for the text's language (identified from its frequent
    words, then the prompt's); English's and its neighbours' when it cannot be told."""
    lowered = [w.casefold() for w in words[-60:]]  # words with their combining marks
    ranked = lexicon.identify(lowered) if lowered else []
    if not ranked or ranked[0][1] < 0.1:
        prompt_words = [w.casefold() for w in MARKED_WORDS_RE.findall(prompt)]
        ranked = lexicon.identify(prompt_words) if len(prompt_words) >= 3 else []
    none: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
    if ranked and ranked[0][1] >= 0.1 and ranked[0][0] in DANGLING_BY_LANGUAGE:
        lang = ranked[0][0]
        return DANGLING_BY_LANGUAGE[lang], PREPOSITION_ARTICLE.get(lang, none)
    return FUNCTION_WORDS, PREPOSITION_ARTICLE["en"]


_PROSE_LINE_END = tuple(".!?。！？…」』”’\"')]}*`>:;|")


def _unpunctuated_prose_end(answer: str, stripped: str, ctx: Context, unknown_finish: bool) -> list[Reason]:
    """A structural tell in any language: the answer punctuates its sentences, yet its last
    line, a sentence of prose, stops with no mark at all. Soft: a second signal is needed."""
    if unknown_finish or ctx.lyric:
        return []
    last_line = stripped.rsplit("\n", 1)[-1].strip()
    if not last_line or last_line.endswith(_PROSE_LINE_END) or not last_line[-1].isalpha():
        return []
    if last_line[:1] in "-*•#|>" or last_line[:2].rstrip(".)").isdigit() or "```" in stripped[-400:]:
        return []  # a list item, a heading, a table row, code
    words = WORDS_RE.findall(last_line)
    if len(words) < 6 or len(WORDS_RE.findall(stripped)) < 12:
        return []
    earlier = stripped[: len(stripped) - len(last_line)]
    sentence_ends = sum(earlier.count(mark) for mark in (". ", "! ", "? ", "。", "！", "？", ".\n"))
    if sentence_ends < 1:
        return []
    span = (max(0, len(stripped) - 40), len(stripped))
    return [
        Reason(
            "premature_stop",
            "finish_reason=stop, but the last sentence stops with no punctuation although the earlier ones have it",
            excerpt(answer, *span),
            0.3,
            span,
        )
    ]


DETECTORS = (find_truncated, find_empty_output, find_premature_stop, find_restart)
