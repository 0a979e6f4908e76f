"""Stutters the token-level loop search cannot see: a word repeated with no separator
(``partirpartirpartir``, one token to a word splitter, any script), every word said twice
(``the the cat cat sat sat``: runs of period 1 that never reach the loop thresholds), and short
spans said twice here and there (a round's tokens written twice)."""

from __future__ import annotations

import re

from ddtree_diag.checks.quality import lexicon
from ddtree_diag.checks.quality.context import WINDOW, Context, excerpt, inside_spans, line_at, reads
from ddtree_diag.checks.quality.patterns import CJK_CHAR_RE, INTERJECTIONS, TOKEN_RE
from ddtree_diag.records import Reason

# Candidate words: 8+ letters/marks in a row (a unit of 2 said 4 times, of 3 said 3 times). CJK is left to the loop
# search, which sees one token per character.
# Word characters with the combining marks of Indic, Arabic and Hebrew writing (not \\w in `re`):
# one character class, so the patterns below stay linear.
_MARKS = "\u0300-\u036f\u0591-\u05c7\u0610-\u061a\u064b-\u065f\u0670\u06d6-\u06ed\u0900-\u0dff"
_LONG_WORD_RE = re.compile(rf"[\w{_MARKS}]{{8,}}")
_GLUED_RE = re.compile(r"(.{2,30}?)\1{2,}")
_DNA = set("acgtu")


@reads(WINDOW)
def find_glued_repeat(text: str, ctx: Context) -> list[Reason]:
    """A word repeated with no separator (``WordWordWord``), in any script but CJK."""
    code_spans = ctx.code_spans
    best: Reason | None = None
    for word_match in _LONG_WORD_RE.finditer(text, ctx.lo, ctx.hi):
        word = word_match.group()
        if len(set(word)) * 2 > len(word) or any(ch.isdigit() or ch == "_" for ch in word):
            continue  # a unit said 3+ times leaves few distinct letters: most words stop here
        lowered = word.lower() if len(word.lower()) == len(word) else word
        glued = _GLUED_RE.search(lowered)
        if not glued:
            continue
        unit = glued.group(1)
        repeats = len(glued.group()) // len(unit)
        if CJK_CHAR_RE.search(unit):
            continue
        dna = word.isupper() and set(unit) <= _DNA
        if unit in INTERJECTIONS or unit.rstrip("h") in INTERJECTIONS or dna:
            continue  # "hahaha", "lalala", "blahblahblah", codons
        if len(set(unit)) == 1:
            continue  # "aaaaaah", "zzzz", "mmmm": a drawn-out sound, or a flood the loop search counts
        if repeats < (4 if len(unit) == 2 else 3):
            continue
        start = word_match.start() + glued.start()
        end = word_match.start() + glued.end()
        if inside_spans(start, code_spans) or word in ctx.prompt or _in_url(text, start):
            continue
        weight = 0.8 if repeats >= 5 else 0.7
        reason = Reason(
            "glued_repeat",
            f"{unit!r} repeated {repeats}× with no separator",
            excerpt(text, start, end),
            weight,
            (start, end),
        )
        if best is None or reason.weight > best.weight:
            best = reason
            if weight >= 0.8:
                break
    return [best] if best is not None else []


def _in_url(text: str, pos: int) -> bool:
    chunk_start = max(text.rfind(" ", 0, pos), text.rfind("\n", 0, pos)) + 1
    chunk = text[chunk_start:pos]
    return "/" in chunk or "@" in chunk or "." in chunk


# Two equal words in a row (case-folded), only whitespace between them.
# Values printed as data ("[True True False]", "None None"): a row of them is output, not speech.
_DATA_WORDS = frozenset({"true", "false", "none", "null", "nan", "inf"})
# (Spaces only: a tab between them is a table's column break, "po\tpo".)
_DOUBLE_RE = re.compile(rf"(?<![\w'’{_MARKS}-])([\w'’{_MARKS}]+) +(\1)(?![\w'’{_MARKS}-])", re.IGNORECASE)
_WORD_RE = re.compile(rf"[\w'’{_MARKS}]+")


@reads(WINDOW)
def find_doubled_words(text: str, ctx: Context) -> list[Reason]:
    """Three or more doubled words in a row (``w w x x y y``), or doubles making up 40 % of the
    words of a stretch of prose (20 % with six or more: a double at every decode round)."""
    if ctx.lyric or ctx.repeat:
        return []
    code_spans = ctx.code_spans
    doubles = []
    for match in _DOUBLE_RE.finditer(text, ctx.lo, ctx.hi):
        word = match.group(1).lower()
        if (not word[0].isalpha() and word[0] not in "'’") or CJK_CHAR_RE.match(word) or word in _DATA_WORDS:
            continue  # numbers ("1 1"), identifiers, Chinese reduplication (看看), printed values
        if len(word) == 1:
            continue  # a letter: a table's cells ("Y  Y  n"), variables ("x x")
        if inside_spans(match.start(), code_spans):
            continue
        doubles.append(match)
    # "very very", "no no" are said twice on purpose: they continue a chain but do not make one.
    meant = sum(1 for m in doubles if m.group(1).lower() not in INTERJECTIONS)
    if len(doubles) < 3 or meant < 2:
        return []
    # Chains: doubled pairs separated only by spaces/punctuation ("the the cat cat, sat sat").
    best_chain: list[re.Match] = []
    chain: list[re.Match] = []
    for match in doubles:
        if chain and not _WORD_RE.search(text, chain[-1].end(), match.start()):
            chain.append(match)
        else:
            chain = [match]
        if len(chain) > len(best_chain):
            best_chain = list(chain)
    # Density: doubles among the words of the stretch from the first to the last double.
    first, last = doubles[0].start(), doubles[-1].end()
    words_between = len(_WORD_RE.findall(text, first, last))
    density = 2 * len(doubles) / max(1, words_between)
    chain_meant = sum(1 for m in best_chain if m.group(1).lower() not in INTERJECTIONS)
    if len(best_chain) >= 3 and chain_meant >= 2:
        span = (best_chain[0].start(), best_chain[-1].end())
        weight = 0.7 if len(best_chain) < 5 else 0.8
        detail = f"{len(best_chain)} words in a row each said twice"
    # a draft's token said twice at round boundaries: a double every few words (4-7 a round), in
    # a language that does not double words on purpose
    elif (meant >= 4 and density >= 0.4) or (meant >= 6 and density >= 0.2 and _seldom_doubles(text, first, last)):
        span = (doubles[0].start(), doubles[-1].end())
        weight = 0.6
        detail = f"{len(doubles)} doubled words, {density:.0%} of the words in that stretch"
    else:
        return []
    shown = ", ".join(repr(m.group()) for m in (best_chain or doubles)[:3])
    return [Reason("doubled_words", f"{detail} ({shown})", excerpt(text, *span), weight, span)]


# Languages that double words as grammar or style (Hindi "धीरे धीरे", Turkish "yavaş yavaş",
# Malay/Indonesian "pelan pelan", Vietnamese, Tamil, Persian...): only dense doubling is a stutter
# there. Scripts the word lists do not cover (Korean, Thai...) count as such too.
_REDUPLICATING = frozenset({"bn", "fa", "fil", "hi", "id", "ms", "ta", "tr", "ur", "vi"})


def _seldom_doubles(text: str, start: int, end: int) -> bool:
    """Whether the stretch's language (from its frequent words) is one that seldom doubles a word."""
    words = [w.casefold() for w in _WORD_RE.findall(text, start, end)]
    ranked = lexicon.identify(words)
    return bool(ranked) and ranked[0][1] >= 0.1 and ranked[0][0] not in _REDUPLICATING


_LONGEST_DOUBLED_SPAN = 10  # tokens; longer spans said twice are the loop search's (a passage said twice)


@reads(WINDOW)
def find_doubled_phrases(text: str, ctx: Context) -> list[Reason]:
    """Short spans said twice back to back, again and again (``is scattered is scattered by the
    air. Blue light the air. Blue light``): a decode round's accepted tokens written twice. One
    such span is emphasis ("Go team! Go team!"); three or more covering a fifth of the stretch are
    not speech."""
    if ctx.lyric or ctx.repeat:
        return []
    found = [(m.group().lower(), m.start(), m.end()) for m in TOKEN_RE.finditer(text, ctx.lo, ctx.hi)]
    tokens = [token for token, _, _ in found]
    code_spans = ctx.code_spans
    spans: list[tuple[int, int]] = []  # (first token, span length in tokens)
    at = 0
    while at < len(tokens):
        for size in range(2, _LONGEST_DOUBLED_SPAN + 1):
            end = at + 2 * size
            if end > len(tokens) or tokens[at : at + size] != tokens[at + size : end]:
                continue
            first, last = found[at][1], found[end - 1][2]
            # words (not a path or URL said twice, "pydantic/pydantic"), outside code and tables
            if _speech(tokens[at : at + size]) and any(ch.isspace() for ch in text[first:last]) and not (
                inside_spans(first, code_spans) or line_at(text, first).lstrip().startswith("|")
            ):
                spans.append((at, size))
                at = end - 1
            break
        at += 1
    if len(spans) < 3:
        return []
    covered = sum(2 * size for _, size in spans)
    stretch = spans[-1][0] + 2 * spans[-1][1] - spans[0][0]
    if covered < 0.2 * stretch and len(spans) < 6:
        return []
    start, end = found[spans[0][0]][1], found[spans[-1][0] + 2 * spans[-1][1] - 1][2]
    shown = ", ".join(repr(text[found[first][1] : found[first + size - 1][2]]) for first, size in spans[:3])
    weight = 0.7 if len(spans) >= 6 else 0.6
    detail = f"{len(spans)} short spans each said twice back to back ({shown})"
    return [Reason("doubled_words", detail, excerpt(text, start, end), weight, (start, end))]


_LIST_BREAKS = frozenset({",", ";", "、", "，", "；", "/", "|"})


def _speech(unit: list[str]) -> bool:
    """Whether a doubled span is words (not numbers, markup or data): more than half its tokens
    words of two or more letters, not interjections or printed values; within one line."""
    if unit[0] in _LIST_BREAKS or unit[-1] in _LIST_BREAKS:
        return False  # items of a list that share their first words ("Sans Bold, Sans Bold Oblique")
    words = [t for t in unit if len(t) > 1 and t[0].isalpha() and t not in INTERJECTIONS and t not in _DATA_WORDS]
    return 2 * len(words) > len([t for t in unit if t.strip()]) and "\n" not in "".join(unit)


# Chinese writes no spaces, so its stutter is characters said twice: "所所以", "阳光阳光". Kana
# and Hangul are left out (Japanese and Korean mimetic words double by design: キラキラ, 반짝반짝);
# so are the characters Chinese itself doubles most (kinship words, 常常, 看看, 慢慢...).
_HAN_RUN_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3000-\u303f\uff0c\uff1a\uff1b\uff01\uff1f]+")
_HAN_DOUBLED = frozenset(
    "妈爸哥姐弟妹爷奶婆公叔伯姑舅姨宝娃星谢"  # kinship and nursery words
    "常看慢刚渐好轻静悄偷天人个年家处样试想走谈聊说笑高兴干净清楚明白"  # adverbs, "every", AABB words
)


def _doubled_at(chars: str, at: int) -> bool:
    return at >= 0 and at + 1 < len(chars) and chars[at] == chars[at + 1]


def _aabb(chars: str, at: int) -> bool:
    """An AABB word at ``at`` standing alone (开开心心): a stutter writes every token twice, so its
    doubles run on (所所以以是是蓝蓝色色) where a reduplicated word has undoubled neighbours."""
    return (_doubled_at(chars, at) and _doubled_at(chars, at + 2) and chars[at] != chars[at + 2]
            and not _doubled_at(chars, at - 2) and not _doubled_at(chars, at + 4))


@reads(WINDOW)
def find_doubled_han(text: str, ctx: Context) -> list[Reason]:
    """Chinese characters or short spans said twice back to back, again and again (``所所以是蓝色
    蓝色的``): the stutter of a round's tokens written twice, in a script without spaces."""
    if ctx.lyric or ctx.repeat:
        return []
    code_spans = ctx.code_spans
    doubles: list[tuple[int, int]] = []  # (start, length of the unit)
    han = 0
    for run in _HAN_RUN_RE.finditer(text, ctx.lo, ctx.hi):
        chars = run.group()
        han += len(chars)
        at = 0
        while at < len(chars) - 1:
            if _aabb(chars, at):
                at += 4  # 开开心心, 高高兴兴: a two-character word reduplicated, grammar not a stutter
                continue
            for size in (1, 2, 3, 4):
                unit = chars[at : at + size]
                if at + 2 * size > len(chars) or unit != chars[at + size : at + 2 * size]:
                    continue
                if not (size == 1 and unit in _HAN_DOUBLED) and not inside_spans(run.start() + at, code_spans):
                    doubles.append((run.start() + at, size))
                at += 2 * size - 1
                break
            at += 1
    if len(doubles) < 4 or len(doubles) * 15 < han:
        return []
    start, end = doubles[0][0], doubles[-1][0] + 2 * doubles[-1][1]
    weight = 0.7 if len(doubles) >= 8 and len(doubles) * 10 >= han else 0.6
    shown = ", ".join(repr(text[at : at + 2 * size]) for at, size in doubles[:3])
    detail = f"{len(doubles)} characters or spans said twice back to back in {han} Chinese characters ({shown})"
    return [Reason("doubled_words", detail, excerpt(text, start, end), weight, (start, end))]


DETECTORS = (find_glued_repeat, find_doubled_words, find_doubled_phrases, find_doubled_han)
