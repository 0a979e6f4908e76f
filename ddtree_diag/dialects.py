"""Server dialects: how to shape a request and how to read spec-decoding numbers back.

Each OpenAI-compatible server speaks the same chat-completions core but differs in three places:
how the thinking toggle and tree budget are sent, which extra object carries per-request
speculative-decoding numbers, and small quirks (ddtree-mlx ignores ``stream`` and always says
``finish_reason: stop``). Everything here is pure data handling — no I/O — so it is unit-testable
on recorded bodies. Facts per server are in shared/DESIGN.md ("Server dialects").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddtree_diag.records import ProbeCase, SpecMetrics

DIALECTS = ("ddtree", "ddtree-mlx", "vllm", "sglang", "llamacpp", "openai")

# Top-level keys of a standard chat-completion body; anything else is a server extra.
_STANDARD_KEYS = {
    "id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier",
    "prompt_logprobs", "kv_transfer_params", "prompt_token_ids",
}  # fmt: skip


@dataclass
class ParsedResponse:
    """What a dialect reads out of one response (whole body or accumulated stream)."""

    output: str = ""
    reasoning: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    model: str | None = None
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    extras: dict[str, Any] = field(default_factory=dict)  # non-standard top-level objects
    notes: list[str] = field(default_factory=list)  # per-case remarks (e.g. corrected finish_reason)


# ---------------------------------------------------------------------------------------------
# Number helpers: servers send ints as floats, strings, or null; unknown stays None, never 0.


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _int(value: Any) -> int | None:
    number = _num(value)
    return None if number is None else round(number)


def _first(mapping: dict[str, Any], *keys: str) -> Any:
    """The first key present with a non-null value (servers renamed fields across versions)."""
    for key in keys:
        if mapping.get(key) is not None:
            return mapping[key]
    return None


def _int_list(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not value:
        return None
    numbers = [_int(v) for v in value]
    return None if any(n is None for n in numbers) else numbers  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Request shaping


def build_request(
    dialect: str, case: ProbeCase, model: str, *, stream: bool, minimal: bool = False
) -> dict[str, Any]:
    """The JSON body for one case. ``minimal`` drops every non-standard field (used to retry
    against a strict server that rejected one)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": case.messages,
        "max_tokens": case.max_tokens,
        "temperature": case.temperature,
        "stream": stream,
    }
    if minimal:
        body.update(case.extra)
        return body
    thinking = case.enable_thinking
    if stream and dialect != "ddtree-mlx":  # ddtree-mlx ignores stream and always answers JSON
        body["stream_options"] = {"include_usage": True}
    if dialect == "ddtree":
        if thinking is not None:
            body["enable_thinking"] = thinking
        if case.tree_budget is not None:
            body["tree_budget"] = case.tree_budget
    elif dialect == "ddtree-mlx":
        if thinking is not None:  # the only toggle it reads; thinking defaults off there
            body["chat_template_args"] = {"enable_thinking": thinking}
        if case.tree_budget is not None:
            body["tree_budget"] = case.tree_budget
    elif dialect in ("vllm", "sglang", "llamacpp", "openai"):
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        if dialect == "sglang":
            body["return_spec_tokens_details"] = True
        if dialect == "llamacpp" and case.tree_budget is not None:
            # For a chain draft the tree budget is the draft length: verify at most N draft tokens.
            body["speculative.n_max"] = case.tree_budget
    else:
        raise ValueError(f"unknown dialect {dialect!r}")
    body.update(case.extra)  # user-supplied fields win
    return body


def budget_is_sent(dialect: str) -> bool:
    """Whether a per-request tree budget means anything to this server."""
    return dialect in ("ddtree", "ddtree-mlx", "llamacpp")


# ---------------------------------------------------------------------------------------------
# Response parsing


def parse_body(dialect: str, body: dict[str, Any], case: ProbeCase) -> ParsedResponse:
    """Parse a non-streamed chat-completion body. Raises ValueError with a one-line reason when
    the body is not a usable chat completion."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        error = body.get("error")
        if error:  # some servers answer 200 with an error object
            message = error.get("message", error) if isinstance(error, dict) else error
            raise ValueError(f"server error in a 200 answer: {str(message).splitlines()[0][:200]}")
        raise ValueError("response has no choices[0]")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ValueError("response has no choices[0].message")
    parsed = ParsedResponse(
        output=_text(message.get("content")),
        reasoning=_reasoning(message),
        finish_reason=choice.get("finish_reason"),
        model=body.get("model"),
    )
    _read_usage(parsed, body.get("usage"))
    parsed.extras = extras_of(body, choice)
    if isinstance(choice.get("logprobs"), dict):
        # Kept for the lossless check's near-tie analysis (OpenAI shape: {"content": [...]}).
        parsed.extras["logprobs"] = choice["logprobs"]
    finish(dialect, parsed, case)
    return parsed


class StreamAccumulator:
    """Collects SSE chunks of one streamed completion into a ParsedResponse."""

    def __init__(self) -> None:
        self.parsed = ParsedResponse()
        self._output: list[str] = []
        self._reasoning: list[str] = []
        self.chunks = 0
        self.saw_done = False

    def feed(self, chunk: dict[str, Any]) -> str:
        """Add one decoded chunk; return the text it added (content or reasoning), for TTFT."""
        self.chunks += 1
        parsed = self.parsed
        if chunk.get("model"):
            parsed.model = chunk["model"]
        added = ""
        choices = chunk.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        delta = choice.get("delta") or choice.get("message") or {}
        if isinstance(delta, dict):
            content = _text(delta.get("content"))
            reasoning = _reasoning(delta) or ""
            self._output.append(content)
            self._reasoning.append(reasoning)
            added = content + reasoning
        if choice.get("finish_reason"):
            parsed.finish_reason = choice["finish_reason"]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            # Streams carry per-token logprobs chunk by chunk; keep them in one list.
            parsed.extras.setdefault("logprobs", {"content": []})["content"].extend(logprobs["content"])
        if chunk.get("usage"):
            _read_usage(parsed, chunk["usage"])
        for key, value in extras_of(chunk, choice).items():
            if value is not None:  # the last non-null copy of an extra wins
                parsed.extras[key] = value
        return added

    def result(self, dialect: str, case: ProbeCase) -> ParsedResponse:
        parsed = self.parsed
        parsed.output = "".join(self._output)
        reasoning = "".join(self._reasoning)
        parsed.reasoning = reasoning or None
        finish(dialect, parsed, case)
        return parsed


def extras_of(body: dict[str, Any], choice: dict[str, Any] | None = None) -> dict[str, Any]:
    """Non-standard objects a server attaches to the body (or, for some versions, to the choice)."""
    extras = {k: v for k, v in body.items() if k not in _STANDARD_KEYS}
    if choice:
        for key in ("sglext", "timings", "meta_info"):
            if key in choice and key not in extras:
                extras[key] = choice[key]
    return extras


def finish(dialect: str, parsed: ParsedResponse, case: ProbeCase) -> None:
    """Fill spec metrics from the extras and apply the dialect's quirks."""
    reader = _SPEC_READERS.get(dialect)
    if reader is not None:
        parsed.spec = reader(parsed.extras, parsed)
    if (
        dialect == "ddtree-mlx"
        and parsed.finish_reason == "stop"
        and parsed.completion_tokens is not None
        and parsed.completion_tokens >= case.max_tokens
    ):
        # ddtree-mlx says "stop" even when it cut at max_tokens; report what happened.
        parsed.finish_reason = "length"
        parsed.notes.append("server said finish_reason=stop at max_tokens; reported as length")
    spec = parsed.spec
    if (
        spec.mean_acceptance_length is None
        and spec.decode_rounds
        and parsed.completion_tokens is not None
    ):
        spec.mean_acceptance_length = parsed.completion_tokens / spec.decode_rounds
        spec.derived = True


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _reasoning(message: dict[str, Any]) -> str | None:
    value = _first(message, "reasoning_content", "reasoning")
    return value if isinstance(value, str) and value else None


def _read_usage(parsed: ParsedResponse, usage: Any) -> None:
    if isinstance(usage, dict):
        parsed.prompt_tokens = _int(usage.get("prompt_tokens"))
        parsed.completion_tokens = _int(usage.get("completion_tokens"))


# ---------------------------------------------------------------------------------------------
# Per-dialect spec readers: extras -> SpecMetrics


def _read_ddtree(extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
    stats = extras.get("ddtree")
    if not isinstance(stats, dict):
        return SpecMetrics()
    lengths = _int_list(stats.get("acceptance_lengths"))
    rounds = _int(_first(stats, "decode_rounds", "rounds", "num_rounds"))
    if rounds is None and lengths is not None:
        rounds = len(lengths)
    mean = _num(_first(stats, "mean_acceptance_length", "mean_acceptance", "avg_acceptance"))
    return SpecMetrics(
        decode_rounds=rounds,
        mean_acceptance_length=mean,
        acceptance_lengths=lengths,
        draft_tokens=_int(_first(stats, "draft_tokens", "num_draft_tokens")),
        accepted_tokens=_int(_first(stats, "accepted_tokens", "num_accepted_tokens")),
        server_tokens_per_second=_num(_first(stats, "tokens_per_second", "tok_per_sec")),
        tree_budget=_int(stats.get("tree_budget")),
        source="response.ddtree",
    )


def _read_ddtree_mlx(extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
    stats = extras.get("ddtree_stats")
    if not isinstance(stats, dict):
        return SpecMetrics()
    return SpecMetrics(
        decode_rounds=_int(_first(stats, "cycles", "decode_rounds")),
        mean_acceptance_length=_num(_first(stats, "avg_acceptance", "mean_acceptance_length")),
        # tok_per_sec includes prefill on these servers; kept as the server's own figure.
        server_tokens_per_second=_num(_first(stats, "tok_per_sec", "tokens_per_second")),
        tree_budget=_int(stats.get("tree_budget")),
        source="response.ddtree_stats",
    )


def _read_vllm(extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
    metrics = extras.get("metrics")
    stats = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(stats, dict):
        return SpecMetrics()
    rounds = _int(_first(stats, "num_spec_steps", "num_drafts"))
    drafts = _int(stats.get("num_draft_tokens"))
    accepted = _int(_first(stats, "num_accepted_draft_tokens", "num_accepted_tokens"))
    mean = _num(stats.get("mean_acceptance_length"))
    if mean is None and rounds and accepted is not None:
        mean = 1 + accepted / rounds
    return SpecMetrics(
        decode_rounds=rounds,
        mean_acceptance_length=mean,
        draft_tokens=drafts,
        accepted_tokens=accepted,
        source="response.metrics.speculative_decoding",
    )


def _read_sglang(extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
    sglext = extras.get("sglext")
    stats = None
    if isinstance(sglext, dict):
        stats = sglext.get("spec_tokens_details", sglext)
    if not isinstance(stats, dict):
        meta = extras.get("meta_info")  # the native /generate shape, if a proxy passes it on
        stats = meta if isinstance(meta, dict) else None
    if not isinstance(stats, dict) or stats.get("spec_verify_ct") is None:
        return SpecMetrics()
    rounds = _int(stats.get("spec_verify_ct"))
    accepted = _int(
        _first(stats, "spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
    )
    proposed = _int(_first(stats, "spec_num_proposed_drafts", "spec_draft_token_num"))
    mean = _num(stats.get("spec_accept_length"))
    if mean is None and rounds and parsed.completion_tokens is not None:
        mean = parsed.completion_tokens / rounds
    return SpecMetrics(
        decode_rounds=rounds,
        mean_acceptance_length=mean,
        draft_tokens=proposed,
        accepted_tokens=accepted,
        source="response.sglext.spec_tokens_details",
    )


def _read_llamacpp(extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
    timings = extras.get("timings")
    if not isinstance(timings, dict):
        return SpecMetrics()
    spec = SpecMetrics(
        server_tokens_per_second=_num(timings.get("predicted_per_second")),
        source="response.timings",
    )
    predicted = _int(timings.get("predicted_n"))
    drafted = _int(timings.get("draft_n"))
    accepted = _int(timings.get("draft_n_accepted"))
    if drafted is not None and accepted is not None and predicted:
        # llama.cpp reports no round count: each round commits its accepted drafts plus one
        # token of its own, so rounds ~= predicted - accepted (+-1 for the prefill token).
        spec.draft_tokens = drafted
        spec.accepted_tokens = accepted
        spec.decode_rounds = max(predicted - accepted, 1)
        spec.mean_acceptance_length = predicted / spec.decode_rounds
        spec.derived = True
        spec.source = "response.timings (rounds derived: predicted_n - draft_n_accepted)"
    return spec


_SPEC_READERS = {
    "ddtree": _read_ddtree,
    "ddtree-mlx": _read_ddtree_mlx,
    "vllm": _read_vllm,
    "sglang": _read_sglang,
    "llamacpp": _read_llamacpp,
}


# ---------------------------------------------------------------------------------------------
# Auto-detection


def detect_from_extras(extras: dict[str, Any]) -> str | None:
    """The dialect a response's extra objects identify, or None when they say nothing."""
    if isinstance(extras.get("ddtree"), dict):
        return "ddtree"
    if isinstance(extras.get("ddtree_stats"), dict):
        return "ddtree-mlx"
    if "sglext" in extras or "meta_info" in extras:
        return "sglang"
    if isinstance(extras.get("timings"), dict):
        return "llamacpp"
    if "metrics" in extras:  # vLLM sends "metrics": null when per-request metrics are off
        return "vllm"
    return None


def detect_from_owner(owned_by: str | None) -> str | None:
    """The dialect that /v1/models' ``owned_by`` names, when it names one we know."""
    owner = (owned_by or "").lower()
    for needle, dialect in (
        ("ddtree-mlx", "ddtree-mlx"),
        ("ddtree", "ddtree"),
        ("vllm", "vllm"),
        ("sglang", "sglang"),
        ("llamacpp", "llamacpp"),
        ("llama.cpp", "llamacpp"),
    ):
        if needle in owner:
            return dialect
    return None
