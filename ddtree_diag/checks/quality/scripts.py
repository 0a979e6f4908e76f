"""Script mixing: writing systems the prompt does not use, homoglyphs inside words."""

from __future__ import annotations

import re
from collections import Counter

from ddtree_diag.checks.quality.context import ANSWER, Context, excerpt, inside_spans, merge_spans, reads
from ddtree_diag.checks.quality.patterns import (
    ASCII_PAIR_RE,
    LANGUAGE_SCRIPTS_RE,
    NON_LATIN_CANDIDATE_RE,
    NOT_ASCII_LETTERS,
    SENTENCE_END_RE,
    script_run_re,
)
from ddtree_diag.records import Reason

# --------------------------------------------------------------------------------------------
# Script mixing


def _script_runs(text: str) -> tuple[list[tuple[str, int, int]], int]:
    """Runs of non-Latin letters as (script, start, end), and the number of ASCII letters."""
    runs: list[tuple[str, int, int]] = []
    for candidate in NON_LATIN_CANDIDATE_RE.finditer(text):
        base = candidate.start()
        for match in script_run_re().finditer(candidate.group()):
            runs.append((match.lastgroup, base + match.start(), base + match.end()))
    latin = len(text.encode("ascii", "ignore").translate(None, NOT_ASCII_LETTERS))
    return runs, latin


def _scripts(text: str) -> Counter:
    runs, latin = _script_runs(text)
    counts: Counter = Counter()
    if latin:
        counts["Latin"] = latin
    for script, a, b in runs:
        counts[script] += b - a
    return counts


# Greek letters drawn like Latin ones; maths writes its Greek in the other shapes (α, ρ, Δ, σ)
_GREEK_HOMOGLYPHS = frozenset("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧου")
_WORD_REACH = 40  # letters walked each way from a run to find its word (no word is longer)


def _mixed_word(text: str, runs: list[tuple[str, int, int]]) -> str | None:
    """A word mixing Latin and Cyrillic letters, or Latin and Greek ones drawn alike (homoglyph
    soup: "Hеllo" with a Cyrillic e, "Τhe" with a Greek T)."""
    checked_to = 0  # the end of the last word walked: runs inside it are not walked again
    for script, a, b in runs:
        if script == "Greek":
            if a < checked_to or not set(text[a:b]) <= _GREEK_HOMOGLYPHS:
                continue
            start, end = _word_around(text, a, b, _WORD_REACH)
            checked_to = end
            if sum(ch.isascii() for ch in text[start:end]) >= 2:
                return text[start:end]
            continue
        if script != "Cyrillic":
            continue
        before = text[a - 1] if a else ""
        after = text[b] if b < len(text) else ""
        if (before.isascii() and before.isalpha()) or (after.isascii() and after.isalpha()):
            start, end = _word_around(text, a, b, len(text))
            return text[start:end]
    return None


def _word_around(text: str, a: int, b: int, reach: int) -> tuple[int, int]:
    """The span of the word holding text[a:b], walking at most ``reach`` letters each way."""
    start, end = a, b
    while start > max(0, a - reach) and text[start - 1].isalpha():
        start -= 1
    while end < min(len(text), b + reach) and text[end].isalpha():
        end += 1
    return start, end


@reads(ANSWER)
def find_script_mix(text: str, ctx: Context) -> list[Reason]:
    """Writing systems the prompt does not use (CJK inside English), or homoglyph soup."""
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
                f"word mixes Latin and {'Greek' if any('Α' <= ch <= 'ω' for ch in mixed) else 'Cyrillic'} "
                f"letters: {mixed!r}",
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
        for pattern, scripts in LANGUAGE_SCRIPTS_RE:
            if pattern.search(ctx.prompt):
                allowed |= scripts
        expected = "the prompt's"
    else:
        dominant = _main_script(text, runs, ctx.code_spans)
        allowed = {dominant, "Latin"}
        if dominant in ("Kana", "Han"):
            allowed |= {"Kana", "Han"}
        if dominant == "Hangul":
            allowed.add("Han")
        expected = f"the text's main ({dominant})"
    foreign_total = sum(c for s, c in answer_counts.items() if s not in allowed)
    if not foreign_total:
        return out
    code_spans = ctx.code_spans
    foreign = [(s, a, b) for s, a, b in runs if s not in allowed and not inside_spans(a, code_spans)]
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
                excerpt(text, first[1], len(text)),
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
        elif _host_letters(SENTENCE_END_RE.split(before)[-1], allowed):
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
            excerpt(text, *span),
            weight,
            span,
        )
    )
    return out


# A Han, kana or Hangul character carries about what three Latin letters do (a translation's
# character counts): the main script is weighed by that, not by raw characters.
_SYLLABIC_WEIGHT = {"Han": 3, "Kana": 3, "Hangul": 3}
# TeX maths ($...$, $$...$$, \(...\), \[...\]): Latin letters that are notation, not language
_MATH_RE = re.compile(r"\$\$.{1,2000}?\$\$|\$[^$\n]{1,400}\$|\\\(.{1,2000}?\\\)|\\\[.{1,2000}?\\\]", re.DOTALL)


def _main_script(text: str, runs: list[tuple[str, int, int]], code_spans: list[tuple[int, int]]) -> str:
    """The script the prose is written in, with no prompt to say: code and TeX maths do not count
    (a Russian or Chinese answer's code is Latin), and a syllabic character weighs as three
    letters (a Chinese answer naming "Docker Compose" is still Chinese)."""
    notation = merge_spans(code_spans + [m.span() for m in _MATH_RE.finditer(text)])  # a fence may hold $…$
    counts: Counter = Counter()
    for script, a, b in runs:
        if not inside_spans(a, notation):
            counts[script] += (b - a) * _SYLLABIC_WEIGHT.get(script, 1)
    cursor = 0
    prose: list[str] = []
    for a, b in notation:
        if a >= cursor:
            prose.append(text[cursor:a])
            cursor = b
    prose.append(text[cursor:])
    latin = len("".join(prose).encode("ascii", "ignore").translate(None, NOT_ASCII_LETTERS))
    if latin:
        counts["Latin"] = latin
    if not counts:  # everything is code or maths: count it all
        return _scripts(text).most_common(1)[0][0]
    return counts.most_common(1)[0][0]


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
    if "Latin" in allowed and ASCII_PAIR_RE.search(snippet):
        return True
    return any(match.lastgroup in allowed and len(match.group()) >= 2 for match in script_run_re().finditer(snippet))


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


DETECTORS = (find_script_mix,)
