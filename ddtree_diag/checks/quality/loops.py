"""Repetition: token/phrase/line loops, repeated n-grams, floods, compression."""

from __future__ import annotations

import re
import zlib
from collections import Counter
from itertools import pairwise

from ddtree_diag.checks.quality.context import Context, excerpt, inside_spans, line_at
from ddtree_diag.checks.quality.patterns import EVIDENCE_CHARS, INTERJECTIONS, TOKEN_RE
from ddtree_diag.records import Reason

# --------------------------------------------------------------------------------------------
# Loops


def _tokens(text: str) -> tuple[list[int], list[str]]:
    """Token ids (case-folded) and the distinct token strings by id."""
    lowered = text.lower()
    if len(lowered) != len(text):  # a few characters change length when lowered (İ)
        lowered = text
    toks = TOKEN_RE.findall(lowered)
    vocab: dict[str, int] = {}
    ids = [vocab.setdefault(t, len(vocab)) for t in toks]
    return ids, list(vocab)


def _token_offsets(text: str) -> list[int]:
    """Character offset of every token; only computed when a loop must be located."""
    lowered = text.lower()
    if len(lowered) != len(text):
        lowered = text
    return [m.start() for m in TOKEN_RE.finditer(lowered)]


def _is_word(token: str) -> bool:
    return (
        token[:1].isalpha()
        or (token[:1].isalnum() and not token.isdigit())
        or (token[:1] == "_" and len(token) > 1)
    )


def _asked_for(ctx: Context, unit: list[str]) -> float:
    """How many repeats of ``unit`` (tokens) a repetition prompt asks for ("say hello 50 times":
    the prompt's own words, its count), a little over (a count splits into tokens otherwise); 0
    where it asks for none."""
    said = [token.strip() for token in unit if _is_word(token) or token.strip().isdigit()]
    if not ctx.repeat_count or not said or not all(word in ctx.prompt_lower for word in said):
        return 0.0
    return ctx.repeat_count * 1.1 + 1


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


def find_loops(text: str, ctx: Context) -> list[Reason]:
    """Back-to-back repetition (token, phrase, line loops) and recurring n-grams, in every search
    window; the heaviest reason per code."""
    best: dict[str, Reason] = {}
    for lo, hi in ctx.windows:
        best = _loops_in(text, lo, hi, ctx, ctx.code_spans, best)
    counted = _numbered_item_loop(text, ctx, ctx.code_spans)
    if counted is not None and ("line_loop" not in best or counted.weight > best["line_loop"].weight):
        best["line_loop"] = counted
    return list(best.values())


_LIST_ITEM_RE = re.compile(r"^[ \t]*(\d{1,4})[.)][ \t]+([^\n]*)$", re.MULTILINE)
# The same item under this many numbers in a row where the list runs into the token limit (a loop
# that never ended), or this many anywhere: knitting rows, meal plans, tabata rounds and answer keys
# repeat an item a few times on purpose.
NUMBERED_REPEATS_TO_LIMIT = 5
NUMBERED_REPEATS = 12
_PLACEHOLDERS = frozenset({"tbd", "todo", "n/a", "na", "none", "-", "—", "...", "…", "[ ]", "[x]", "?"})


def _numbered_item_loop(text: str, ctx: Context, code_spans: list[tuple[int, int]]) -> Reason | None:
    """A numbered list whose items stop changing ("3. Take breaks.\n4. Take breaks.\n…") up to
    the token limit, or for a long stretch: a loop with a counter, which the back-to-back search
    cannot see (the number changes) and the n-gram search misses where the item is short.
    Placeholders ("TBD", "N/A") and asked-for repetition are lists, not loops."""
    if ctx.repeat:
        return None
    streak: list[tuple[int, str, int, int]] = []  # (number, item, start, end)
    found: list[tuple[int, str, int, int]] = []
    for match in _LIST_ITEM_RE.finditer(text):
        if inside_spans(match.start(), code_spans):
            continue
        item = match.group(2).strip().casefold()
        entry = (int(match.group(1)), item, match.start(), match.end())
        follows = bool(streak) and not text[streak[-1][3] : match.start()].strip() and (
            entry[0] == streak[-1][0] + 1 and item == streak[-1][1]
        )
        if not follows:
            streak = []
        if any(ch.isalpha() for ch in item) and item.strip(".!") not in _PLACEHOLDERS:
            streak.append(entry)
        if len(streak) > len(found):
            found = list(streak)
    if not found:
        return None
    rest = text[found[-1][3] :].strip()
    # what follows the streak is nothing, or one more item cut by the token limit ("10. Take bre")
    to_the_limit = ctx.truncated and (not rest or (_LIST_ITEM_RE.fullmatch(rest) is not None and "\n" not in rest))
    repeats = len(found) + (1 if to_the_limit and rest else 0)
    wordy = len(found[0][1].split()) >= 2
    if not ((to_the_limit and repeats >= NUMBERED_REPEATS_TO_LIMIT) or (wordy and repeats >= NUMBERED_REPEATS)):
        return None
    start, end = found[0][2], found[-1][3]
    return Reason(
        "line_loop",
        f"{text[start:end].splitlines()[0].strip()[:48]!r}: the item under {repeats} list numbers in a row"
        + (" up to the token limit" if to_the_limit else ""),
        excerpt(text, start, end),
        0.75 if repeats >= 2 * NUMBERED_REPEATS_TO_LIMIT else 0.65,
        (start, end),
    )


def find_compression(text: str, ctx: Context) -> list[Reason]:
    """The whole text compresses far better (or worse) than language does."""
    found = _compression(text, ctx, ctx.code_spans)
    return [found] if found else []


# One symbol (emoji, "!", "?", U+FFFD aside) 16+ times in a row, or 20+ newlines: the tokenizer
# sees one token, so the loop search does not; markdown rules ("-----", "=====") and dots are fine.
# Box drawing, block elements and the caret: a line of them is a drawing, not a loop.
_DRAWING = frozenset(chr(c) for c in range(0x2500, 0x25A0)) | {"^"}
_FLOOD_RE = re.compile(r"([^\w\s\-=_*#~.`|+<>/\\\ufffd]{1,2}?)\1{15,}|\n[ \t]*(?:\n[ \t]*){19,}")


# One letter or digit 64+ times in a row ("IIII…", "4444…"), or 64+ spaces / tabs, running into
# the token limit: one token to the loop search too. Elsewhere a run that long can be meant (a
# googol written out, a 128-bit mask, a poly(A) tail, an aligned table), so only past 200.
_CHAR_RUN_RE = re.compile(r"([^\W_])\1{63,}|[ \t]{64,}")
RUN_ANYWHERE = 200
# A markup character ("-", "=", "*", "#", "_", "~", ".") or unit ("|---") repeated over this many
# characters into the token limit is a loop: no rule or border is that long.
MARKUP_TO_LIMIT = 120
_MARKUP_RUN_RE = re.compile(r"([-=_*#~.])\1{119,}")
DIGITS_TO_LIMIT = 120


def _char_run(text: str, lo: int, hi: int, ctx: Context, code_spans: list[tuple[int, int]]) -> Reason | None:
    if ctx.repeat:
        return None
    content_end = len(text.rstrip()) if ctx.truncated else -1
    for match in _CHAR_RUN_RE.finditer(text, lo, hi):
        if inside_spans(match.start(), code_spans):
            continue
        count = match.end() - match.start()
        blank = match.group(1) is None
        # a blank run is what is left at the end; a letter's or digit's reaches it (a digit's from
        # DIGITS_TO_LIMIT: a number written out in full may be cut there, "10^100 = 1000…")
        to_the_limit = ctx.truncated and (match.start() >= content_end if blank else match.end() >= content_end)
        if to_the_limit and not blank and match.group(1).isdigit() and count < DIGITS_TO_LIMIT:
            to_the_limit = False
        if not (to_the_limit or count >= RUN_ANYWHERE):
            continue
        unit = "whitespace" if blank else repr(match.group(1))
        return Reason(
            "token_loop",
            f"{unit} repeated {count}× in a row" + (" up to the token limit" if to_the_limit else ""),
            excerpt(text, max(0, match.start() - 40), match.end()),
            0.6 if count < 120 else 0.75,
            match.span(),
        )
    return None


def _flood(text: str, lo: int, hi: int, ctx: Context, code_spans: list[tuple[int, int]]) -> Reason | None:
    run = _char_run(text, lo, hi, ctx, code_spans)
    if run is not None:
        return run
    if ctx.truncated and not ctx.repeat and hi == len(text):
        content_end = len(text.rstrip())
        for match in _MARKUP_RUN_RE.finditer(text, lo, hi):
            if match.end() >= content_end and not inside_spans(match.start(), code_spans):
                count = match.end() - match.start()
                return Reason("token_loop", f"{match.group(1)!r} repeated {count}× in a row up to the token limit",
                              excerpt(text, max(0, match.start() - 40), match.end()), 0.75, match.span())
    for match in _FLOOD_RE.finditer(text, lo, hi):
        if inside_spans(match.start(), code_spans) or ctx.repeat:
            continue
        unit = match.group(1) or "\n"
        count = match.group().count(unit)
        if all(ch in _DRAWING for ch in unit) and count < 120:
            continue  # a rule, a border or a bar ("────", "████", "^^^^" under an error)
        return Reason(
            "token_loop",
            f"{unit!r} repeated {count}× in a row",
            excerpt(text, *match.span()),
            0.6 if count < 40 else 0.75,
            match.span(),
        )
    return None


_OPENER_OF = {"]": "[", ")": "(", "}": "{"}
_LITERAL_END_RE = re.compile(r"[\s,;'\"]*(?:[-+]?[\d.]+[\s'\"]*)?([\])}])")  # the number needs a digit: no overlap


def _in_literal(text: str, start: int, end: int) -> bool:
    """Whether text[start:end] lies inside a bracket opened before it on its line and closed right
    after it ("[0, 0, 0, 0, 0]", "(1, 1, 1, 1)"): data written out, not a loop."""
    line_start = text.rfind("\n", 0, start) + 1
    before = text[line_start:start]
    tail = _LITERAL_END_RE.match(text, end)
    if tail is None:
        return False
    closer = tail.group(1)
    return before.count(_OPENER_OF[closer]) > before.count(closer)


def _loops_in(
    text: str, lo: int, hi: int, ctx: Context, code_spans: list[tuple[int, int]], found: dict[str, Reason]
) -> dict[str, Reason]:
    """Find back-to-back repetition in text[lo:hi]: ``found`` (the heaviest reason per code so
    far) with this window's reasons merged in, as a new dict."""
    best = dict(found)
    flood = _flood(text, lo, hi, ctx, code_spans)
    if flood and ("token_loop" not in best or flood.weight > best["token_loop"].weight):
        best["token_loop"] = flood
    segment = text[lo:hi] if (lo, hi) != (0, len(text)) else text
    ids, names = _tokens(segment)
    n = len(ids)
    if n < 4:
        return best
    at_text_end = hi == len(text)
    starts: list[int] | None = None
    # No bigram occurs twice: nothing can repeat back to back (most short answers stop here).
    runs = _periodic_runs(ids) if len(set(pairwise(ids))) < n - 1 else []
    for start, end, period in runs:
        covered = end - start
        repeats = covered / period
        unit = ids[start : start + period]
        # the last repeat may lack only the unit's closing separator ("A.\n\nA." is A said twice)
        unfinished = unit[covered % period :] if covered % period else []
        closed = len(unfinished) <= 2 and not any(ch.isalnum() for t in unfinished for ch in names[t])
        complete = -(-covered // period) if closed else repeats  # the last repeat counted whole
        if complete < 2.0:
            continue
        if period >= 6:
            repeats = complete  # a sentence: "A.\n\nA.\n\nA." is A said three times, not 2.9
        unit_words = sum(1 for t in unit if _is_word(names[t]))
        # A whole passage (20+ tokens, mostly words) said twice in a row is already a fault; so
        # is a sentence said twice right where the reply hits the token limit (a loop starting).
        wordy = unit_words >= period / 2
        passage = wordy and (period >= 20 or (period >= 8 and ctx.truncated and at_text_end and n - end <= 2))
        if repeats < 3.0 and not passage:
            continue
        # A refrain that runs until the token limit is a loop, song or not.
        runs_out = ctx.truncated and at_text_end and n - end <= 2
        if passage:
            needed = 2.0
        elif not unit_words:
            if not any(names[t].isdigit() for t in unit):
                if not (runs_out and sum(len(names[t]) for t in ids[start:end]) >= MARKUP_TO_LIMIT):
                    continue  # punctuation and markup: rules, table borders, closing braces
                needed = 3.0  # ... unless it runs on into the token limit: "|---|---|---|…"
            else:
                # Numbers repeat legitimately (matrices, tallies), but not forever; a longer numeric
                # phrase ("2 + 2 = 4.") repeated verbatim is already odd.
                needed = 4.0 if period >= 4 else 10.0
        elif all(names[t] in INTERJECTIONS for t in unit if _is_word(names[t])):
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
        listed = not unit_words or (unit_words == 1 and any("," in names[t] and not _is_word(names[t]) for t in unit))
        if listed and _in_literal(text, pos, starts[end - 1] + len(names[ids[end - 1]])):
            continue  # items of a bracketed literal closed on its line: [0, 0, 0, 0], [None, None, None]
        relaxed = inside_spans(pos, code_spans) or line_at(text, pos).lstrip().startswith("|")
        if (relaxed or ctx.lyric) and not runs_out:
            needed = max(needed * 2, 6.0)
        if ctx.repeat:
            needed = max(needed * 3, 12.0, _asked_for(ctx, [names[t] for t in unit]))
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
            excerpt(text, char_start, char_end),
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
    return best


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
    if count < _asked_for(ctx, [names[t] for t in gram]):
        return None
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
    if inside_spans(starts[first], code_spans) or line_at(text, starts[first]).lstrip().startswith("|"):
        needed = 0.8
    if coverage < needed:
        return None
    weight = 0.35
    reaches_end = ctx.truncated and hits[-1] + 2 * size >= n
    # a list that ends after a few equal items can be meant (workout rounds, knitting rows); one
    # that runs into the token limit, or on and on, is a loop
    meant = not reaches_end and count < 12
    if counter_loop and count >= 5 and (coverage >= 0.7 or (coverage >= 0.6 and reaches_end)) and not meant:
        weight = 0.6
    if counter_loop and coverage >= 0.85 and count >= 8 and not meant:
        weight = 0.7
    if not counter_loop:
        weight = 0.2
    phrase = " ".join(names[t] for t in gram).replace("\n", "\\n")
    span = (starts[first], min(len(text), starts[first] + EVIDENCE_CHARS))
    return Reason(
        "repeated_ngram",
        f"{phrase!r} recurs {count}×; recurring phrases cover {coverage:.0%} of the text",
        excerpt(text, *span),
        weight,
        span,
    )


def _compression(text: str, ctx: Context, code_spans: list[tuple[int, int]]) -> Reason | None:
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
            excerpt(text, 0, len(text)),
            weight,
            (0, len(text)),
        )
    if ratio > 0.9 and text.isascii() and len(data) >= 600:
        return Reason(
            "compression_ratio",
            f"compresses to {ratio:.0%} of its size: closer to noise than to language",
            excerpt(text, 0, len(text)),
            0.3,
            (0, len(text)),
        )
    return None


DETECTORS = (find_loops, find_compression)
