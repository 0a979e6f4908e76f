"""Chat-completion bodies and SSE chunks from a finished (or streaming) generation.

The wire format is the standalone DDTree server's: OpenAI chat completions plus a top-level
``ddtree`` object with the request's own spec numbers. Streamed, the ``ddtree`` object rides the
finish chunk, or the usage chunk when ``stream_options.include_usage`` asks for one. The message
is ``parsing``'s reading of the text: ``reasoning_content`` split off when thinking is on,
``tool_calls`` (and finish_reason "tool_calls") when the request has tools.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from ddtree_diag.server import prompting
from ddtree_diag.server.parsing import AnswerParser

MASKED_LOGPROB = -9999.0  # OpenAI's value for a token with no probability


def ddtree_stats(generation: Any) -> dict[str, Any]:
    """The per-request ``ddtree`` object (the standalone DDTree server's format, extended)."""
    decode_time = generation.e2e_s - generation.ttft_s
    rounds = generation.decode_rounds
    extras = getattr(generation, "extras", None) or {}
    grammar = None
    if extras.get("grammar"):  # a constrained request: what the grammar cost and what it pruned
        grammar = {"kind": extras["grammar"], "pruned_nodes": extras.get("grammar_pruned_nodes"),
                   "mask_s": extras.get("grammar_mask_s")}
    stats = {
        "tree_budget": generation.tree_budget,
        "mode": generation.mode,
        "decode_rounds": rounds,
        "mean_acceptance_length": generation.mean_acceptance_length,
        "acceptance_lengths": generation.acceptance_lengths,
        "tree_sizes": generation.tree_sizes,
        "draft_tokens": sum(generation.tree_sizes) if generation.mode != "ar" else None,
        "accepted_tokens": sum(n - 1 for n in generation.acceptance_lengths) if generation.mode != "ar" else None,
        "tokens_per_second": generation.decode_tokens_per_second,
        "ttft_s": generation.ttft_s,
        "decode_s": decode_time,
        "stage_times": generation.stage_times,
    }
    if grammar is not None:
        stats["grammar"] = grammar
    return stats


def logprobs_content(tokenizer: Any, generation: Any, count: int) -> list[dict[str, Any]] | None:
    """OpenAI ``choices[0].logprobs.content`` from the engine's per-token log-probs: each token's
    own and its top-k.
    Under a grammar the masked tokens' log-probs are -inf: they are no candidates, so they are
    left out of ``top_logprobs`` (and a value JSON cannot carry becomes OpenAI's -9999.0)."""
    if not generation.top_logprobs:
        return None
    content = []
    own = generation.token_logprobs or [None] * len(generation.token_ids)
    for token_id, all_top, own_value in zip(generation.token_ids, generation.top_logprobs, own, strict=False):
        top = [(tid, value) for tid, value in all_top if math.isfinite(value)]
        # the token's own log-prob (a sampled token may be outside the top ones); a record
        # without it: its value among the top ones, else the lowest of them
        chosen = own_value if own_value is not None and math.isfinite(own_value) else dict(top).get(token_id)
        entry_token = tokenizer.decode([token_id])
        content.append({
            "token": entry_token,
            "logprob": chosen if chosen is not None else min((v for _, v in top), default=MASKED_LOGPROB),
            "bytes": list(entry_token.encode("utf-8")),
            "top_logprobs": [
                {"token": tokenizer.decode([tid]), "logprob": value,
                 "bytes": list(tokenizer.decode([tid]).encode("utf-8"))}
                for tid, value in top[:count]
            ],
        })
    return content


def usage(generation: Any) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def _logprobs(body: Any, generation: Any, tokenizer: Any) -> dict[str, Any]:
    return {"content": logprobs_content(tokenizer, generation, body.top_logprobs or 0)}


def answer_parser(body: Any, tokenizer: Any) -> AnswerParser:
    """How this request's text is read: reasoning split off when thinking is on (from the start when
    the template opened the think block, else only after an opening tag), tool calls when it has
    tools (see ``parsing``)."""
    thinking = body.thinking()
    splits = thinking is not False or prompting.speaks_harmony(tokenizer)  # gpt-oss always reasons
    return AnswerParser(thinking=splits, prefilled=prompting.think_prefilled(tokenizer, thinking),
                        tool_mode=body.tool_mode(),
                        tool_names=[tool.function.name for tool in body.tools or ()], named=body.named_tool())


def completion(completion_id: str, model_name: str, body: Any, generation: Any, tokenizer: Any) -> dict[str, Any]:
    """The whole ``chat.completion`` body for a request that did not stream."""
    parser = answer_parser(body, tokenizer)
    message: dict[str, Any] = {"role": "assistant", **parser.message(generation.text)}
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                              "finish_reason": parser.finish_reason(generation.finish_reason)}
    if body.logprobs:
        choice["logprobs"] = _logprobs(body, generation, tokenizer)
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
        "choices": [choice], "usage": usage(generation), "ddtree": ddtree_stats(generation),
    }


def sse(payload: Any) -> str:
    """One server-sent event: a JSON payload, or a bare word (``[DONE]``)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


DONE = sse("[DONE]")


class Chunks:
    """The ``chat.completion.chunk`` events of one streamed completion."""

    def __init__(self, completion_id: str, model_name: str) -> None:
        self.base = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model_name}

    def role(self) -> str:
        return sse({**self.base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]})

    def delta(self, delta: dict[str, Any]) -> str:
        """One piece of the answer: ``{"content": ...}``, ``{"reasoning_content": ...}`` or
        ``{"tool_calls": [...]}`` (``parsing``'s deltas)."""
        return sse({**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})

    def finish(self, body: Any, generation: Any, tokenizer: Any, finish_reason: str | None = None) -> list[str]:
        """The finish chunk, then the usage chunk when asked for; not ``[DONE]``."""
        include_usage = body.include_usage()
        final: dict[str, Any] = {**self.base, "choices": [{"index": 0, "delta": {},
                                                           "finish_reason": finish_reason or generation.finish_reason}]}
        if body.logprobs:
            final["choices"][0]["logprobs"] = _logprobs(body, generation, tokenizer)
        if not include_usage:
            final["ddtree"] = ddtree_stats(generation)  # no usage chunk: ride the finish chunk
        events = [sse(final)]
        if include_usage:
            events.append(sse({**self.base, "choices": [], "usage": usage(generation),
                               "ddtree": ddtree_stats(generation)}))
        return events
