"""Target-likelihood check: teacher-force an answer through a reference model in ONE forward.

The prompt is rendered with the model's chat template, the answer's tokens appended (and the
end-of-turn token when the server said ``stop``); one forward gives every position's
log-probabilities. From them:

- mean surprisal (nats/token) and the worst span (the 16-token window with the highest mean):
  salad, wrong-language garbage and garbled stretches after a fluent opening read as far less
  likely than language, in any language the model knows (``low_likelihood``);
- with the deployment's OWN weights at T=0, every token must be the target's argmax (greedy
  decoding is lossless under speculation): the first position where it is not, with the top-2
  gap there, is a lossless failure found without a second server (``not_greedy``). A position
  where the argmax is another tokenization of the same text is not a failure; a gap below the
  near-tie gap is a numerics near-tie (bf16), reported softly.

The model is the embedded SmolLM2 by default (``choose_models``), or a path (HF directory or
GGUF file). Loading needs the engine extra; torch is imported inside functions only, so the
remote path never pays for it. The model-free detector (checks.quality) stays the default.

Thresholds (nats/token, SmolLM2-135M, calibrated with ``python -m bench.bench_likelihood`` on the
clean corpus vs garbage): see ``MEAN_SOFT``/``MEAN_HARD``/``SPAN_HARD``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ddtree_diag.records import Reason

# Calibrated on SmolLM2-135M (bench/bench_likelihood.py): the clean corpus averages 2.0 nats per
# token (95th percentile 3.9, highest 4.8 over 4+ tokens, worst 16-token span 6.8); salad in Latin
# scripts 5.5-8.6 (worst span 6.6-10.6). Salad in other scripts scores 3-5: SmolLM2 predicts the
# byte pieces of scripts it hardly knows; the lexicon signal (word_salad) covers those.
MEAN_SOFT = 4.5
MEAN_HARD = 5.5
SPAN_TOKENS = 16
SPAN_HARD = 7.5
NEAR_TIE_GAP = 0.05  # nats, as the lossless check's default
MIN_TOKENS = 4  # shorter answers are not judged by likelihood (too few tokens to mean anything)
THRESHOLDS = {"mean_soft": MEAN_SOFT, "mean_hard": MEAN_HARD, "span_hard": SPAN_HARD, "span_tokens": SPAN_TOKENS,
              "min_tokens": MIN_TOKENS, "near_tie_gap": NEAR_TIE_GAP}
EMBEDDED = "embedded"


@dataclass
class NotGreedy:
    token_index: int  # index among the answer's tokens
    char_index: int
    chosen: str
    argmax: str
    chosen_logprob: float
    argmax_logprob: float
    top2_gap: float  # log p(top1) - log p(top2) at that position
    at_stop: bool = False  # the position is the end of turn (the server stopped; the model would not)

    @property
    def near_tie(self) -> bool:
        return self.argmax_logprob - self.chosen_logprob <= NEAR_TIE_GAP


@dataclass
class LikelihoodScore:
    model: str
    tokens: int
    mean_surprisal: float
    worst_span: tuple[int, int] = (0, 0)  # chars of the answer
    worst_span_surprisal: float = 0.0
    not_greedy: NotGreedy | None = None
    surprisals: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k not in ("surprisals", "not_greedy")}
        data["not_greedy"] = self.not_greedy.__dict__ if self.not_greedy else None
        return data

    def summary(self, *, greedy: bool) -> dict[str, Any]:
        """The figures a reader needs to see how close the text came to a reason, with the
        thresholds: kept in the verdict of every scored text, clean or not."""
        miss = self.not_greedy
        return {
            "model": self.model,
            "tokens": self.tokens,
            "mean_surprisal": round(self.mean_surprisal, 3),
            "worst_span_surprisal": round(self.worst_span_surprisal, 3),
            "greedy_checked": greedy,
            "not_greedy_at_token": miss.token_index if (greedy and miss) else None,
            "thresholds": THRESHOLDS,
        }


def describe_scores(summary: dict[str, Any]) -> str:
    """One line of a verdict's ``likelihood`` summary: the figures against their thresholds."""
    limits = summary.get("thresholds") or {}
    parts = [f"{summary.get('model')}: {summary.get('mean_surprisal', 0):.2f} nats/token over "
             f"{summary.get('tokens')} tokens (low_likelihood at >= {limits.get('mean_soft')} soft, "
             f">= {limits.get('mean_hard')} hard)"]
    if summary.get("tokens", 0) >= (limits.get("span_tokens") or SPAN_TOKENS):
        parts.append(f"worst {limits.get('span_tokens')}-token stretch {summary.get('worst_span_surprisal', 0):.2f} "
                     f"(>= {limits.get('span_hard')})")
    if summary.get("greedy_checked"):
        at = summary.get("not_greedy_at_token")
        parts.append("every token the greedy choice" if at is None else f"not greedy at token {at}")
    return "; ".join(parts)


class Scorer:
    """A loaded reference model that scores answers. ``own_weights``: it IS the deployment's
    target, so at T=0 the greedy check applies."""

    def __init__(self, engine: Any, name: str, own_weights: bool) -> None:
        self.engine = engine
        self.name = name
        self.own_weights = own_weights

    @classmethod
    def load(cls, spec: str = EMBEDDED, *, own_weights: bool = False, device: str | None = None,
             dtype: str | None = None) -> Scorer:
        """``spec``: "embedded" or a path (an HF model directory, or a .gguf file)."""
        from ddtree_diag.output.waiting import waiting

        with waiting(f"loading the scoring model ({spec}) for --score-with"):  # the engine's own line nests inside
            return cls._load(spec, own_weights=own_weights, device=device, dtype=dtype)

    @classmethod
    def _load(cls, spec: str, *, own_weights: bool, device: str | None, dtype: str | None) -> Scorer:
        from ddtree_diag.engine.models import choose_models, load_chosen

        if spec == EMBEDDED:
            choice = choose_models(use_draft=False)
        elif spec.endswith(".gguf"):
            choice = choose_models(gguf=spec, use_draft=False)
        else:
            choice = choose_models(target=spec, use_draft=False)
        choice.draft = None
        engine = load_chosen(choice, device=device, dtype=dtype or "fp32")
        return cls(engine, choice.name, own_weights)

    def score(
        self,
        text: str,
        messages: list[dict[str, Any]],
        *,
        enable_thinking: bool | None = None,
        stopped: bool = False,
        greedy: bool = False,
        answer_ids: list[int] | None = None,
    ) -> LikelihoodScore:
        """Teacher-force ``text`` after ``messages`` in one forward. ``stopped``: the server ended
        the turn here (the end-of-turn token is scored too); ``greedy``: look for the first token
        that is not the model's argmax. ``answer_ids``: the answer's token ids when the server
        gave them (exact); else the text is tokenized again."""
        import torch

        engine = self.engine
        tok = engine.tokenizer
        prompt_ids = engine.render_prompt(messages, enable_thinking)
        exact = answer_ids is not None
        if answer_ids is not None:
            answer_ids = list(answer_ids)
            if stopped and answer_ids and answer_ids[-1] in engine.stop_token_ids:
                answer_ids.pop()  # scored below as the end of turn
            offsets = []
            for i in range(len(answer_ids)):
                start = len(tok.decode(answer_ids[:i]))
                offsets.append((start, len(tok.decode(answer_ids[: i + 1]))))
            text = tok.decode(answer_ids)
        else:
            encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            answer_ids = list(encoded["input_ids"])
            offsets = [tuple(o) for o in encoded["offset_mapping"]]
        stop_ids = engine.stop_token_ids
        end_id = _end_of_turn_id(tok, stop_ids)
        scored_stop = stopped and end_id is not None
        if scored_stop:
            answer_ids.append(end_id)
            offsets.append((len(text), len(text)))
        if not answer_ids:
            return LikelihoodScore(self.name, 0, 0.0)
        ids = torch.tensor([prompt_ids + answer_ids], device=engine.device)
        with torch.no_grad():
            logits = engine.target.hf(input_ids=ids).logits[0].float()
        start = len(prompt_ids) - 1
        logprobs = torch.log_softmax(logits[start : start + len(answer_ids)], dim=-1)
        target = torch.tensor(answer_ids, device=logprobs.device)
        chosen = logprobs.gather(1, target[:, None])[:, 0]
        surprisals = [-float(x) for x in chosen]
        n_text = len(answer_ids) - (1 if scored_stop else 0)
        text_surprisals = surprisals[:n_text] or surprisals
        score = LikelihoodScore(self.name, n_text, sum(text_surprisals) / len(text_surprisals),
                                surprisals=surprisals)
        _worst_span(score, text_surprisals, offsets)
        if greedy:
            score.not_greedy = _first_not_greedy(tok, text, answer_ids, offsets, logprobs, stop_ids, scored_stop,
                                                 exact=exact)
        return score

    def reasons(self, score: LikelihoodScore, *, greedy: bool) -> list[Reason]:
        return likelihood_reasons(score, greedy=greedy)


def _end_of_turn_id(tok: Any, stop_ids: list[int]) -> int | None:
    from ddtree_diag.engine.generate import END_OF_TURN_TOKENS

    for name in END_OF_TURN_TOKENS:
        token_id = tok.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id in stop_ids:
            return token_id
    return stop_ids[0] if stop_ids else None


def _worst_span(score: LikelihoodScore, surprisals: list[float], offsets: list[tuple[int, int]]) -> None:
    width = min(SPAN_TOKENS, len(surprisals))
    if not width:
        return
    total = sum(surprisals[:width])
    best, at = total, 0
    for i in range(1, len(surprisals) - width + 1):
        total += surprisals[i + width - 1] - surprisals[i - 1]
        if total > best:
            best, at = total, i
    score.worst_span = (offsets[at][0], offsets[at + width - 1][1])
    score.worst_span_surprisal = best / width


def _first_not_greedy(tok, text, answer_ids, offsets, logprobs, stop_ids, scored_stop, exact) -> NotGreedy | None:
    import torch

    top2 = torch.topk(logprobs, 2, dim=-1)
    for i, token_id in enumerate(answer_ids):
        best = int(top2.indices[i, 0])
        if best == token_id or (best in stop_ids and token_id in stop_ids):
            continue
        at = offsets[i][0]
        best_text = tok.decode([best])
        at_stop = scored_stop and i == len(answer_ids) - 1
        if not exact and not at_stop and best not in stop_ids and best_text and text.startswith(best_text, at):
            continue  # the same text, tokenized another way: not a different choice
        return NotGreedy(
            token_index=i,
            char_index=at,
            chosen=tok.decode([token_id]),
            argmax=best_text,
            chosen_logprob=float(logprobs[i, token_id]),
            argmax_logprob=float(top2.values[i, 0]),
            top2_gap=float(top2.values[i, 0] - top2.values[i, 1]),
            at_stop=at_stop,
        )
    return None


def likelihood_reasons(score: LikelihoodScore, *, greedy: bool) -> list[Reason]:
    out: list[Reason] = []
    if score.tokens >= MIN_TOKENS:
        mean = score.mean_surprisal
        span = score.worst_span
        if mean >= MEAN_SOFT:
            weight = 0.7 if mean >= MEAN_HARD else 0.35
            out.append(Reason(
                "low_likelihood",
                f"{score.model} finds the answer unlikely: {mean:.2f} nats/token over {score.tokens} tokens "
                f"(language: ~1-3); worst stretch {score.worst_span_surprisal:.2f}",
                "", weight, span, "likelihood",
            ))
        elif score.tokens >= SPAN_TOKENS * 2 and score.worst_span_surprisal >= SPAN_HARD:
            out.append(Reason(
                "low_likelihood",
                f"{score.model}: a stretch of {SPAN_TOKENS} tokens at {score.worst_span_surprisal:.2f} nats/token "
                f"(the answer averages {mean:.2f})",
                "", 0.6, span, "likelihood",
            ))
    miss = score.not_greedy
    if greedy and miss is not None:
        where = "the end of turn" if miss.at_stop else f"token {miss.token_index} (char {miss.char_index})"
        chosen = "the end of turn" if miss.at_stop else repr(miss.chosen)
        detail = (
            f"not the target's greedy choice at {where}: {chosen} (log p {miss.chosen_logprob:.2f}) where "
            f"{score.model}'s argmax is {miss.argmax!r} (log p {miss.argmax_logprob:.2f}); top-2 gap "
            f"{miss.top2_gap:.3f} nats"
        )
        weight = 0.3 if miss.near_tie else 0.8
        if miss.near_tie:
            detail += " — a numerics near-tie"
        out.append(Reason("not_greedy", detail, "", weight, (miss.char_index, miss.char_index), "likelihood"))
    return out


_LOADED: dict[tuple[str, bool], Scorer] = {}
_LOADING = threading.Lock()  # a fleet's targets ask from their own threads: load once


def scorer_for(spec: str, *, own_weights: bool = False, device: str | None = None) -> Scorer:
    """One loaded scorer per (model, own_weights) in this process."""
    key = (spec, own_weights)
    with _LOADING:
        if key not in _LOADED:
            _LOADED[key] = Scorer.load(spec, own_weights=own_weights, device=device)
        return _LOADED[key]
