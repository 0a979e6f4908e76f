"""Premature stops: ``stop`` on an unfinished sentence."""

from __future__ import annotations

from ddtree_diag.checks.quality.context import Context, excerpt
from ddtree_diag.checks.quality.patterns import CJK_CHAR_RE, FUNCTION_WORDS, UNFINISHED_END, WORDS_RE
from ddtree_diag.records import Reason

# --------------------------------------------------------------------------------------------
# Premature stop


# Aux verbs and prepositions a very short reply cannot stop on ("The capital of France is").
_SHORT_DANGLING = FUNCTION_WORDS | frozenset(
    "is are was were i'm i’m it's it’s to of at for with from by as into than very".split()  # noqa: SIM905
)
# "Yes it is", "There it is": a pronoun before the verb makes a complete short sentence.
_PRONOUNS = frozenset(
    "it he she they we you i this that what who which one so".split()  # noqa: SIM905
)


def find_premature_stop(
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
    words = WORDS_RE.findall(tail)
    # A long text is never "short"; CJK text has no spaces, so count two characters as a word.
    n_words = 100 if len(stripped) > 400 else max(len(words), len(CJK_CHAR_RE.findall(tail)) // 2)
    short = n_words <= 8 or (completion_tokens is not None and completion_tokens <= 8)
    cut = len(tail)
    while cut and (tail[cut - 1].isalnum() or tail[cut - 1] in "'’"):
        cut -= 1
    last_word = tail[cut:].lower().lstrip("'’")
    why = None
    if end_char in UNFINISHED_END:
        why = f"ends on {end_char!r}"
    elif stripped.count("```") % 2 == 1:
        why = "a code block is never closed"
    elif last_word:
        if last_word in FUNCTION_WORDS and (len(words) >= 2 or len(last_word) > 1):
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
            excerpt(answer, *span),
            weight,
            span,
        )
    ]
