"""Subword salad: real words cut at the wrong places and glued (``ofthe``, ``conv ert ed``,
``photo synth esis``), the text a position or cache bug makes of a target's own tokens.

No model needed: the text's language is identified from its (and the prompt's) most frequent
words, and each lower-case word is looked up in that language's lexicon (lexicon.py: its 16,000
most frequent words, and those of 5+ letters to rank 32,000); a German-style compound counts as
known when it splits into two known words. Clean text leaves only rare words and names outside
it, and rare words are long; salad leaves many short pieces outside it. The signal is the
number of *short* unknown pieces (<= 4 letters) in the worst stretch of 30 words, judged against
what the language's own frequency list says a clean text leaves (``short_missed`` in the index),
plus the share of unknown words there.

Words run together with no spaces at all leave too few words for that test: long letter runs are
split into the language's words instead (``find_run_together``).

Limits: languages without a lexicon (and scripts written without spaces: Chinese, Japanese,
Thai) are not checked; in a text longer than 16 KiB only the head, the tail and 16 sampled
KiB between are read.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

from ddtree_diag.checks.quality import lexicon
from ddtree_diag.checks.quality.context import Context, excerpt, inside_spans, merge_spans
from ddtree_diag.checks.quality.patterns import LETTER
from ddtree_diag.records import Reason

_WORD_RE = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
# Not prose: URLs and addresses, LaTeX ($...$, \\command), markup tags, code-ish joins (name(, =).
# (anchored at a chunk's start: from every position of a long chunk it would scan the rest of it)
_URL_RE = re.compile(r"(?<!\S)\S*?(?:://|www\.|@)\S*")
_SKIP_RE = re.compile(
    _URL_RE.pattern + r"|\$\$.+?\$\$|\$[^$\n]+\$|\\[A-Za-z]+|</?[A-Za-z][^<>\n]{0,200}>|&[a-z]+;"
    r"|(?<![^\W\d_])[^\W\d_]+(?=[(=_./\\:]\S)|(?m:^[ \t]*\$ .*$)",
    re.DOTALL,
)
WINDOW = 30
SHORT_WINDOW = 12
_MIN_WORDS = 8
_LONG = 16_384
_BLOCK = 1_024
# Languages that write compounds as one word: a long unknown word made of two known ones is fine.
_COMPOUNDING = frozenset(["de", "nl", "sv", "da", "nb", "is", "fi", "hu", "et", "el"])


def _stretches(text: str) -> list[tuple[int, int]]:
    if len(text) <= _LONG:
        return [(0, len(text))]
    picks = [(0, 4 * _BLOCK)]
    stride = max(8 * _BLOCK, len(text) // 16)  # at most ~28 KiB read, however long the text
    picks += [(at, at + _BLOCK) for at in range(8 * _BLOCK, len(text) - 8 * _BLOCK, stride)]
    picks.append((len(text) - 8 * _BLOCK, len(text)))
    return picks


_VOWELS = frozenset("aeiouyàáâãäåæèéêëìíîïòóôõöøùúûüýÿœăâîșțąęėįųūłóőűаеёиоуыэюяіїєўαεηιουωάέήίόύώϊϋΐΰ")
_VOWELLED = re.compile(r"[a-zà-ɏ\u0400-\u04ff\u0370-\u03ff]")


def _no_vowel(word: str) -> bool:
    """A Latin, Cyrillic or Greek word without a vowel ("nth" aside, words have one)."""
    return _VOWELLED.match(word) is not None and not (_VOWELS & set(word))


class _Lookup:
    """Known / unknown / glued for the words of one text, against one or two languages
    (``guessed``: the language is a guess from the prompt's lexicon, not from frequent words)."""

    def __init__(self, langs: list[str], guessed: bool = False) -> None:
        self.guessed = guessed
        self.lexicons = [lexicon.words(lang) for lang in langs]
        self.function = frozenset(w for lang in langs for w in lexicon.index()[lang]["top"][:100])
        self.compounding = any(lang in _COMPOUNDING for lang in langs)

    def known(self, word: str) -> bool:
        return any(word in lex for lex in self.lexicons)

    def flag(self, word: str) -> int:
        """0 known, 1 unknown (long), 2 a short unknown piece, 3 a function word glued to a word
        (``ofthe``)."""
        if self.known(word):
            return 0
        if "'" in word or "’" in word:
            return 0 if all(self.known(p) for p in re.split(r"['’]", word) if p) else 1
        for cut in range(2, len(word) - 1):
            head, tail = word[:cut], word[cut:]
            if (head in self.function and (self.known(tail) or tail in self.function)) or (
                tail in self.function and self.known(head) and len(tail) >= 2
            ):
                return 3  # a function word glued to a word: "ofthe", "muttaolla"
        if self.compounding and len(word) >= 8:
            for cut in range(4, len(word) - 3):
                if self.known(word[:cut]) and (self.known(word[cut:]) or self.known(word[cut + 1 :])):
                    return 0  # "Donaudampfschiff": known parts (a linking s allowed)
        if len(word) <= 4 or unicodedata.category(word[0])[0] == "M" or _no_vowel(word):
            return 2  # short, or a piece no word has: a leading vowel sign, no vowel at all
        return 1


def _language(words: list[str], prompt: str, any_language: bool) -> tuple[list[str], bool] | None:
    """(The answer's language(s), guessed) from its own frequent words; when it has too few (salad
    keeps few function words whole), the prompt's, unless the prompt asks for another language;
    ``guessed`` where only the prompt's lexicon named it (``_only_lexicon_holding``).

    A language we hold no list for shares short words with some that we do ("na", "ya", "la"):
    the answer is only judged as language L when some of L's frequent words of 4+ letters occur
    in it (or a third of its words are L's frequent words)."""
    ranked = lexicon.identify(words)
    if ranked and ranked[0][1] >= 0.12:
        top = frozenset(lexicon.index()[ranked[0][0]]["top"])
        long_hits = len({w for w in words if len(w) >= 4 and w in top})
        if long_hits >= 2 or ranked[0][1] >= 0.33:
            return [ranked[0][0]] + [lang for lang, share in ranked[1:2] if share >= 0.7 * ranked[0][1]], False
    if any_language:
        return None
    prompt_lang = _prompt_language(prompt)
    if prompt_lang is not None and lexicon.index()[prompt_lang]["script"] == lexicon.script_of_char(words[0][0]):
        return [prompt_lang] + ([ranked[0][0]] if ranked and ranked[0][1] >= 0.05 else []), False
    guess = _only_lexicon_holding([chunk.strip(_EDGE) for chunk in prompt.split()]) if prompt_lang is None else None
    if guess is not None and _covers_about_best(guess, words):
        return [guess], True
    return None


# How much more of a text another candidate language's lexicon must hold to be read as that one.
_COVERAGE_MARGIN = 0.25


def _best_covered(langs: list[str], words: list[str]) -> list[str]:
    """The identified language(s), unless another language of the text's script among its likely
    ones holds far more of its words. Frequent-word identification can pick a language whose
    function words the text shares by chance ("ten" is Czech): "One, two, three, ..., ten" read
    as Czech is all unknown words, as English all known."""
    script = lexicon.index()[langs[0]]["script"]
    candidates = [lang for lang, share in lexicon.identify(words)[:4]
                  if share > 0 and lang not in langs and lexicon.index()[lang]["script"] == script]
    if not candidates:
        return langs

    held = _held((*langs, *candidates), words)
    best = max(candidates, key=held.__getitem__)
    return [best] if held[best] >= max(held[lang] for lang in langs) + _COVERAGE_MARGIN else langs


def _prompt_language(prompt: str) -> str | None:
    """The prompt's language, from its frequent words; short prompts share their few frequent
    words between languages ("Parlami della storia": "di", "la"), so a tie is broken by the
    language whose whole lexicon holds 2+ and two thirds of the prompt's words of 3+ letters
    (names left out), if exactly one does. Two-letter coincidences ("de", "am") alone say nothing."""
    chunks = [chunk.strip(_EDGE) for chunk in prompt.split()]
    prompt_words = [c.casefold() for c in chunks if _PLAIN_RE.fullmatch(c)]
    ranked = lexicon.identify(prompt_words) if len(prompt_words) >= 3 else []
    if not ranked or ranked[0][1] < 0.15:
        return None
    top = frozenset(lexicon.index()[ranked[0][0]]["top"])
    if any(len(w) >= 3 and w in top for w in prompt_words):
        return ranked[0][0]
    longer = _content_words(chunks, 3)
    counts = [(sum(1 for w in longer if w in lexicon.words(lang)), lang) for lang, share in ranked[:6] if share >= 0.15]
    fits = [(known, lang) for known, lang in counts if known >= 2 and 3 * known >= 2 * len(longer)]
    if not fits:
        return None
    best = max(known for known, _ in fits)
    winners = [lang for known, lang in fits if known == best]
    return winners[0] if len(winners) == 1 else None


def _held(langs: Iterable[str], words: list[str]) -> dict[str, float]:
    """Each language's share of the distinct ``words`` its lexicon holds."""
    distinct = set(words)
    return {lang: len(distinct & lexicon.words(lang)) / len(distinct) for lang in langs}


def _content_words(chunks: list[str], min_letters: int) -> list[str]:
    """A prompt's plain words of ``min_letters``+ letters, case-folded, without names (capitalised
    past the first word): a loanword list holds "Roma" and "Kano" in many languages."""
    return [c.casefold() for at, c in enumerate(chunks)
            if len(c) >= min_letters and _PLAIN_RE.fullmatch(c) and (at == 0 or c.lower() == c)]


def _covers_about_best(lang: str, words: list[str]) -> bool:
    """Whether ``lang``'s lexicon holds about as many of the answer's distinct words as the best of
    its script does: a guess from a few prompt words ("Describe paella valenciana." is held by
    Spanish alone) must not judge an English answer as Spanish."""
    script = lexicon.index()[lang]["script"]
    if lexicon.script_of_char(words[0][0]) != script:
        return False
    held = _held([other for other, info in lexicon.index().items() if info["script"] == script], words)
    return held[lang] >= max(held.values()) - 0.05


def _only_lexicon_holding(chunks: list[str]) -> str | None:
    """A short prompt of content words only ("Explain recursion.", "Explain gradient descent."):
    the one language of its script whose lexicon holds all its words of 4+ letters (2+ of them,
    names left out), if exactly one does. One word proves nothing ("Hello" is a loanword)."""
    longer = _content_words(chunks, 4)
    if len(longer) < 2:
        return None
    script = lexicon.script_of_char(longer[0][0])
    holding = [lang for lang, info in lexicon.index().items()
               if info["script"] == script and all(w in lexicon.words(lang) for w in longer)]
    return holding[0] if len(holding) == 1 else None


_CHUNK_RE = re.compile(r"\S+")
_EDGE = "\"'“”‘’«»„()[]{}<>.,;:!?¡¿…*_~`|—–-。、，！？：；·।॥؟،"
_PLAIN_RE = re.compile(rf"{LETTER}+(?:['’-]{LETTER}+)*")


def _prose_words(text: str, code_spans: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """Lower-case words of the prose: whitespace-separated chunks that are plain words once the
    punctuation around them is stripped (``file.py``, ``sin(x)``, ``k0``, ``cÃ³mo`` are not),
    outside code, URLs, LaTeX and markup; hyphenated words give their parts."""
    stretches = _stretches(text)
    skip = merge_spans(list(code_spans) + [m.span() for lo, hi in stretches for m in _SKIP_RE.finditer(text, lo, hi)])
    out: list[tuple[str, int, int]] = []
    for lo, hi in stretches:
        for match in _CHUNK_RE.finditer(text, lo, hi):
            chunk = match.group()
            core = chunk.strip(_EDGE)
            # Names, acronyms and identifiers (any capital letter) are not in a lexicon of words.
            if not core or core.lower() != core or not _PLAIN_RE.fullmatch(core):
                continue
            if inside_spans(match.start(), skip):
                continue
            at = match.start() + chunk.index(core)
            for part in core.split("-") if "-" in core else (core,):
                if part:
                    out.append((part.casefold(), at, at + len(part)))
                at += len(part) + 1
    return out


def salad_stats(text: str, prompt: str, code_spans: list[tuple[int, int]], any_language: bool = False):
    """(languages, per-word flags (see ``_Lookup.flag``), the words with their spans, lookup) or
    None when the text cannot be judged."""
    if text.count(" ") + text.count("\n") < _MIN_WORDS - 1 or not lexicon.index():
        return None  # too few words to judge (most short answers stop here)
    checked = _prose_words(text, code_spans)
    if len(checked) < _MIN_WORDS:
        return None
    words = [w for w, _, _ in checked]
    found = _language(words, prompt, any_language)
    if found is None:
        return None
    langs, guessed = found
    langs = _best_covered(langs, words)
    script = lexicon.index()[langs[0]]["script"]
    checked = [c for c in checked if lexicon.script_of_char(c[0][0]) == script]  # "α" in English: maths
    if len(checked) < _MIN_WORDS:
        return None
    lookup = _Lookup(langs, guessed)
    flags = [lookup.flag(w) for w, _, _ in checked]
    # A word split in two ("fa zer", "ten ha"): an unknown piece that, joined to its neighbour
    # across one space, makes a known word of 5+ letters. Counted like a glued word.
    for i in range(1, len(checked)):
        (left, _, left_end), (right, right_start, _) = checked[i - 1], checked[i]
        if right_start - left_end != 1 or not (flags[i - 1] or flags[i]) or len(left) + len(right) < 5:
            continue
        if lookup.known(left + right):
            for at in (i - 1, i):
                if flags[at]:
                    flags[at] = 3
    # Short unknown words that keep coming back are the function words of a language we hold no
    # list for (Swahili "kwa", Welsh "yn"); salad's pieces are cut at random and rarely recur
    # (the pieces of a split word, counted above, aside).
    short_counts: dict[str, int] = {}
    for (word, _, _), flag in zip(checked, flags, strict=True):
        if flag == 2 and len(word) <= 4:
            short_counts[word] = short_counts.get(word, 0) + 1
    if sum(1 for count in short_counts.values() if count >= 2) >= 2:
        return None
    # A rare word said again (a name, a refrain, a term the answer is about) is one rare word.
    seen: set[str] = set()
    for i, (word, _, _) in enumerate(checked):
        if flags[i] in (1, 3):
            if word in seen:
                flags[i] = 0
            seen.add(word)
    return langs, flags, checked, lookup


def _worst_window(flags: list[int], checked: list[tuple[str, int, int]], size: int) -> tuple[int, ...]:
    """(short-or-glued pieces, unknown words, window, start, end, glued) of the ``size``-word
    window with the most unknown, short and glued words."""
    window = min(size, len(flags))
    unknown = sum(1 for f in flags[:window] if f)
    short = sum(1 for f in flags[:window] if f >= 2)
    glued = sum(1 for f in flags[:window] if f == 3)
    best = (short, unknown, window, checked[0][1], checked[window - 1][2], glued)
    for i in range(1, len(flags) - window + 1):
        out, inn = flags[i - 1], flags[i + window - 1]
        unknown += (inn > 0) - (out > 0)
        short += (inn >= 2) - (out >= 2)
        glued += (inn == 3) - (out == 3)
        if (short + unknown + glued) > best[0] + best[1] + best[5]:
            best = (short, unknown, window, checked[i][1], checked[i + window - 1][2], glued)
    return best


def find_word_salad(text: str, ctx: Context) -> list[Reason]:
    """Pieces of words cut at the wrong places and glued: far more words outside the language's
    lexicon than its text has, in the worst stretch of 30 (or 12) words."""
    if "lorem ipsum" in text.casefold():
        return []  # the placeholder text is mangled Latin by design, and no decoder makes it by chance
    stats = salad_stats(text, ctx.prompt, ctx.code_spans, ctx.any_script)
    if stats is None:
        return []
    langs, flags, checked, lookup = stats
    info = lexicon.index()[langs[0]]
    # What a clean text of this language leaves outside the lexicon per word, from wordfreq's own
    # frequencies, with room for the names, jargon and inflection the list does not hold.
    rate_short = max(0.03, 3 * info["short_missed"])
    rate_unknown = max(0.12, 2 * (1 - info["coverage"]))
    short, unknown, window, start, end, glued = _worst_window(flags, checked, WINDOW)
    many_short = short >= max(3, 3 * rate_short * window) and unknown >= max(5, 0.2 * window, 2 * rate_unknown * window)
    # judged in a language guessed from a few prompt words, unknown whole words may be the answer's
    # jargon (a list of flamenco forms): only pieces and glued words count then
    mostly_unknown = unknown >= max(8, 0.5 * window, 3 * rate_unknown * window) and not lookup.guessed
    # Words glued to a function word ("ofthe", "muttaolla") are rare in any clean text.
    many_glued = glued >= 3 and unknown >= max(4, 0.15 * window)
    weight = 0.6
    if many_short or mostly_unknown or many_glued:
        if short >= max(5, 4 * rate_short * window) or unknown >= max(10, 0.6 * window) or glued >= 5:
            weight = 0.8
    else:
        # A salad tail after a fluent opening is diluted in 30 words: a short stretch where most
        # words are unknown and several are short pieces is as telling (clean text leaves ~1 short
        # piece in 100 words, and its unknown words are long).
        short, unknown, window, start, end, glued = _worst_window(flags, checked, SHORT_WINDOW)
        if not (window == SHORT_WINDOW and short >= 4 and unknown >= max(8, 2 * rate_unknown * window)):
            return []
    pieces = [w for w in _WORD_RE.findall(text, start, end) if w.lower() == w and lookup.flag(w.casefold())]
    shown = ", ".join(repr(w) for w in pieces[:6])
    return [Reason(
        "word_salad",
        f"{unknown} of {window} words are not {'/'.join(langs)} words, {short} of them short pieces or glued "
        f"words ({glued} glued to a function word: {shown}); clean {langs[0]} text leaves "
        f"~{rate_unknown * window / 2:.0f}",
        excerpt(text, start, end),
        weight,
        (start, end),
    )]


# Words run together with no spaces at all ("Theskylooksbluebecause"): a detokenizer that drops
# the space marks. Too few words are left for the lexicon test above, so each long letter run is
# split into the language's words instead; prose run together splits into many frequent function
# words ("the", "is", "of"), a compound or a long technical word into none or few.
_RUN_RE = re.compile(r"(?<![#@\w])[^\W\d_]{25,}(?!\w)")
_LONGEST_WORD = 20
_SPLIT_LETTERS = 400  # of a longer run only its head is split: it tells as well, in bounded time


def find_run_together(text: str, ctx: Context) -> list[Reason]:
    """Prose words run together with no spaces (``Theskylooksbluebecausesunlight``)."""
    # URLs and code only, not _SKIP_RE's "name.attr" joins: a sentence run into the next reads
    # "air.Blue" (and _RUN_RE skips hashtags and handles itself)
    skip = merge_spans(list(ctx.code_spans) + [m.span() for m in _URL_RE.finditer(text)])
    runs = [m for m in _RUN_RE.finditer(text) if not inside_spans(m.start(), skip) and m.group()[1:].islower()]
    if not runs:
        return []
    # the languages to split in: the text's own (from its other words), the prompt's, English
    ranked = lexicon.identify([w.casefold() for w in _WORD_RE.findall(text)])
    langs = [ranked[0][0]] if ranked and ranked[0][1] >= 0.1 else []
    langs = list(dict.fromkeys([*langs, *filter(None, [_prompt_language(ctx.prompt)]), "en"]))
    found: list[tuple[re.Match, list[str]]] = []
    for run in sorted(runs, key=lambda m: -len(m.group()))[:8]:
        words = _split_run(run.group()[:_SPLIT_LETTERS].casefold(), langs)
        if words:
            found.append((run, words))
    letters = sum(len(run.group()) for run, _ in found)
    if not found or (len(found) < 2 and letters < 40):
        return []
    run, words = max(found, key=lambda pair: len(pair[0].group()))
    shown = f"{run.group()[:30]!r} = {' '.join(words[:6])}"
    detail = f"{len(found)} stretch(es) of words run together with no spaces ({shown}…)"
    return [Reason("word_salad", detail, excerpt(text, *run.span()), 0.75, run.span())]


def _split_run(run: str, langs: list[str]) -> list[str] | None:
    """The run as words of one of ``langs`` (fewest unknown letters, then fewest words), when
    nearly all of it splits and a third of the words are that language's frequent words."""
    script = lexicon.script_of_char(run[0])
    for lang in langs:
        info = lexicon.index()[lang]
        if info["script"] != script:
            continue
        vocab, top = lexicon.words(lang), frozenset(info["top"])
        # best[i]: (unknown letters, words) for run[:i]; cut[i]: where its last piece starts
        best: list[tuple[int, int]] = [(0, 0)] + [(len(run) + 1, 0)] * len(run)
        cut = [0] * (len(run) + 1)
        for end in range(1, len(run) + 1):
            best[end], cut[end] = (best[end - 1][0] + 1, best[end - 1][1]), -(end - 1)  # a letter left over
            for start in range(max(0, end - _LONGEST_WORD), end - 1):
                if run[start:end] in vocab and (best[start][0], best[start][1] + 1) < best[end]:
                    best[end], cut[end] = (best[start][0], best[start][1] + 1), start
        unknown, count = best[len(run)]
        if unknown > len(run) // 10 or count < 4:
            continue
        words, end = [], len(run)
        while end > 0:
            start = abs(cut[end])
            if cut[end] >= 0 or end - start > 1:
                words.append(run[start:end])
            end = start
        words.reverse()
        if 3 * sum(1 for w in words if w in top) >= len(words):
            return words
    return None


DETECTORS = (find_word_salad, find_run_together)
