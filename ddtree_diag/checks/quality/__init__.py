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

Reason codes are stable (other tools may match on them); ``registry.REGISTRY`` lists them with
their meaning, and the README's table is generated from it. Signal families, one module each,
each listing its detectors (``(text, ctx) -> list[Reason]``, see ``context``) in ``DETECTORS``:
``stops`` (truncated, empty answer, premature stop), ``loops`` (repetition of every kind),
``hollow`` (list markers and punctuation with nothing in them), ``stutter`` (a word glued to
itself, every word said twice), ``salad`` (pieces of words cut and glued, read against
``lexicon``'s word lists of 39 languages), ``scripts`` (writing systems the prompt does not
use), ``leaks`` (template and role markers), ``thinking`` (think blocks), ``encoding``
(mojibake), ``content`` (replacement and control characters); ``context`` and ``patterns`` are
what they share. ``registry.FAMILIES`` names the families ``assess`` runs, in order. The
optional model-based reasons (``low_likelihood``, ``not_greedy``) come from ``checks.likelihood``
through the ``scorer`` argument.

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

Known limits: an unfinished clause without a tell-tale last word (``... a coder named``) is only
a soft signal (an unpunctuated last sentence), and one in a language whose function words are not
listed (29 are) is not caught; salad in a language without a word list, or in a script written
without spaces (Chinese, Japanese, Thai), is not caught without ``--score-with``; a short stutter
(``the the the the``) deep inside a text longer than 16 KiB is only found when its 1 KiB block
compresses much better than the rest (long texts are searched in such blocks and at the tail);
famous intentional repetition (``Buffalo buffalo Buffalo buffalo ...``) is flagged.
"""


from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

from ddtree_diag.checks.quality.context import ANSWER, ANY, EMPTY, WHOLE, WINDOW, Context, has_content, scope_of
from ddtree_diag.checks.quality.patterns import EVIDENCE_CHARS, LENGTH_REASONS, STOP_REASONS
from ddtree_diag.checks.quality.registry import LOOP_CODES, REASON_CODES, REGISTRY, detectors
from ddtree_diag.checks.quality.thinking import split_thinking, unclosed_think
from ddtree_diag.records import GARBAGE_THRESHOLD, Reason, Verdict

__all__ = [
    "GARBAGE_THRESHOLD",
    "LOOP_CODES",
    "REASON_CODES",
    "REGISTRY",
    "Reason",
    "Verdict",
    "assess",
    "assess_result",
    "summarize",
]


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
    scorer: Any = None,
    messages: list[dict[str, Any]] | None = None,
    temperature: float | None = None,
    answer_ids: list[int] | None = None,
) -> Verdict:
    """Judge one answer. ``thinking`` is the request's enable_thinking (None = unknown);
    ``reasoning`` the server-separated thinking text, if any (checked for loops and leaks too).

    ``scorer`` (a ``checks.likelihood.Scorer``, optional and slow) adds the target-likelihood
    reasons: the answer teacher-forced after ``messages`` (default: the prompt as one user turn);
    with the deployment's own weights and ``temperature`` 0, the greedy check too (on
    ``answer_ids``, the answer's token ids, when the backend gave them: exact)."""
    text = text or ""
    prompt = prompt or ""
    finish = (finish_reason or "").strip().lower() or None
    truncated = finish in LENGTH_REASONS or (
        completion_tokens is not None and max_tokens is not None and 0 < max_tokens <= completion_tokens
    )
    answer, think_text, think_offset = split_thinking(text)
    ctx = Context(
        prompt, truncated, finish=finish, completion_tokens=completion_tokens, max_tokens=max_tokens,
        thinking=thinking, reasoning=reasoning, unclosed_think=unclosed_think(text),
        has_thought=bool((reasoning or "").strip() or think_text.strip()),
    )

    reasons = _run(detectors(WHOLE), text, ctx.reading(text))
    # Where the answer sits in the text (after a think block), so every span points into `text`.
    answer_at = len(text) - len(answer) if answer and text.endswith(answer) else 0
    reading = ctx.reading(answer)
    if has_content(answer):
        reasons += _placed(_run(detectors(ANY, WINDOW), answer, reading), answer_at)
        reasons += _placed(_run(detectors(ANSWER), answer, reading), answer_at)
    else:
        reasons += _placed(_run(detectors(EMPTY), answer, reading), answer_at)
    if think_text.strip():
        reasons += _read(think_text, ctx, think_offset, "text", label="think block: ")
    if reasoning and reasoning.strip():
        reasons += _read(reasoning, ctx, 0, "reasoning", label="reasoning: ")

    likelihood = None
    if scorer is not None and text.strip():
        greedy = bool(getattr(scorer, "own_weights", False)) and temperature == 0
        scored = scorer.score(
            text, messages or [{"role": "user", "content": prompt}], enable_thinking=thinking,
            stopped=finish in STOP_REASONS, greedy=greedy, answer_ids=answer_ids if greedy else None,
        )
        if hasattr(scored, "summary"):
            likelihood = scored.summary(greedy=greedy)
        reasons.extend(
            replace(r, evidence=text[r.span[0] : r.span[0] + EVIDENCE_CHARS] if r.span else "", source="text")
            for r in scorer.reasons(scored, greedy=greedy)
        )

    score = 1.0
    for reason in reasons:
        score *= 1.0 - max(0.0, min(1.0, reason.weight))
    score = round(1.0 - score, 4)
    reasons.sort(key=lambda r: -r.weight)
    return Verdict(garbage=score >= GARBAGE_THRESHOLD, score=score, reasons=reasons, truncated=truncated,
                   likelihood=likelihood)


def _run(found_by: tuple, text: str, ctx: Context) -> list[Reason]:
    """Every detector's reasons on ``text``, in order; WINDOW detectors run together, window by
    window, at the first one's place, keeping the heaviest reason per code."""
    out: list[Reason] = []
    windowed = _windowed(found_by)
    for detector in found_by:
        if detector not in windowed:
            out += detector(text, ctx)
        elif detector is windowed[0]:
            out += _run_windowed(windowed, text, ctx)
    return out


@cache
def _windowed(found_by: tuple) -> tuple:
    return tuple(d for d in found_by if scope_of(d) == WINDOW)


def _run_windowed(found_by: list, text: str, ctx: Context) -> list[Reason]:
    best: dict[str, Reason] = {}
    for lo, hi in ctx.shape_windows:
        window = ctx.window(lo, hi)
        for detector in found_by:
            for found in detector(text, window):
                if found.code not in best or found.weight > best[found.code].weight:
                    best[found.code] = found
    return list(best.values())


def _read(text: str, ctx: Context, offset: int, source: str, label: str = "") -> list[Reason]:
    """The ANY and WINDOW detectors on one text (answer, think block, reasoning), their reasons
    placed in the reply: spans shifted by ``offset``, details prefixed with ``label``."""
    return _placed(_run(detectors(ANY, WINDOW), text, ctx.reading(text)), offset, source, label)


def _placed(found: list[Reason], offset: int, source: str = "text", label: str = "") -> list[Reason]:
    return [
        Reason(r.code, label + r.detail, r.evidence, r.weight,
               (r.span[0] + offset, r.span[1] + offset) if r.span else None, source)
        for r in found
    ]


def assess_result(result: Any, scorer: Any = None) -> Verdict:
    """Assess a records.ProbeResult and store the verdict in ``result.quality``; ``scorer`` adds
    the target-likelihood reasons (see ``assess``).

    Results that carry no answer because the request failed get no verdict (quality stays None).
    """
    if not getattr(result, "ok", True):
        return None  # type: ignore[return-value]
    case = result.case
    text = result.output
    calls = getattr(result, "tool_calls", None)
    if calls and not text.strip():
        # a tool call's answer is its arguments: read them (an empty content is not an empty answer)
        text = "\n".join(str(c.get("arguments") or "") for c in calls)
    verdict = assess(
        text,
        prompt=case.prompt_text,
        finish_reason=result.finish_reason,
        completion_tokens=result.completion_tokens,
        max_tokens=case.max_tokens,
        thinking=case.enable_thinking,
        reasoning=result.reasoning,
        scorer=scorer,
        messages=case.messages,
        temperature=case.temperature,
        answer_ids=_token_ids(result) if result.reasoning is None else None,
    )
    result.quality = verdict
    return verdict


def _token_ids(result: Any) -> list[int] | None:
    """The answer's token ids when the backend recorded them (the in-process engine does)."""
    ids = getattr(result, "extras", {}).get("token_ids")
    return ids if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


def summarize(quality: Verdict | dict[str, Any] | None, width: int | None = 60) -> str:
    """Table cell for a stored verdict (``ProbeResult.quality``): ``✓``, ``✓ truncated``,
    ``✗ token_loop: …``, or ``—`` when there is none (the request failed)."""
    if not quality:
        return "—"
    verdict = Verdict.from_dict(quality) if isinstance(quality, dict) else quality
    return verdict.summary(width)
