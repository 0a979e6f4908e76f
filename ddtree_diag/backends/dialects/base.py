"""What every dialect shares: the Dialect plug-in base, number helpers, and response parsing.

A dialect is one object per server family. It knows how to shape a request (the thinking toggle,
the tree budget, the fields that ask for spec numbers), how to read that server's spec numbers
back, how to recognise the server from a response, and its quirks (it ignores ``stream``, says
``stop`` at max_tokens, closes the connection after a stream). The HTTP backend and the checks
read these attributes; nothing outside this package branches on a dialect's name.
Everything here is pure data handling, no I/O: unit-testable on recorded bodies.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ddtree_diag.records import ProbeCase, SpecMetrics

# Top-level keys of a standard chat-completion body; anything else is a server extra.
STANDARD_KEYS = {
    "id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier",
    "prompt_logprobs", "kv_transfer_params", "prompt_token_ids",
}


@dataclass
class ParsedResponse:
    """What a dialect reads out of one response (whole body or accumulated stream)."""

    output: str = ""
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{"id", "name", "arguments"}]
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens served from the server's prefix cache
    model: str | None = None
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    extras: dict[str, Any] = field(default_factory=dict)  # non-standard top-level objects
    notes: list[str] = field(default_factory=list)  # per-case remarks (e.g. corrected finish_reason)


# ---------------------------------------------------------------------------------------------
# Number helpers: servers send ints as floats, strings, or null; unknown stays None, never 0.


# Larger than any real count, rate or acceptance; beyond it a value is junk (and products of two
# such values stay finite, so no check downstream can overflow).
MAX_SERVER_NUMBER = 1e15


def num(value: Any) -> float | None:
    """A usable number from a server field, or None: every spec figure (acceptance, tok/s, counts)
    is >= 0, so booleans, NaN, infinities, negatives, values over 1e15 and junk are unknown."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        number = float(value) if abs(value) <= MAX_SERVER_NUMBER else math.inf
    elif isinstance(value, float):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value.strip()) if len(value) <= 64 else math.nan
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) and 0 <= number <= MAX_SERVER_NUMBER else None


def integer(value: Any) -> int | None:
    """A count from a server field (see ``num``), rounded; None when unknown."""
    number = num(value)
    return None if number is None else round(number)


def first(mapping: dict[str, Any], *keys: str) -> Any:
    """The first key present with a non-null value (servers renamed fields across versions)."""
    for key in keys:
        if mapping.get(key) is not None:
            return mapping[key]
    return None


def int_list(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not value:
        return None
    numbers = [integer(v) for v in value]
    return None if any(n is None for n in numbers) else numbers  # type: ignore[return-value]


def text_of(content: Any) -> str:
    """Message content as text: a string, or the text of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The reasoning text: vLLM and SGLang name it ``reasoning_content``, newer vLLM and
    OpenRouter ``reasoning``; the first that holds text (one may be sent empty beside the other)."""
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def refusal_of(message: dict[str, Any]) -> str:
    """OpenAI's ``refusal`` text (the model declined; ``content`` is then null)."""
    value = message.get("refusal")
    return value if isinstance(value, str) else ""


def choice_zero(choices: Any) -> dict[str, Any] | None:
    """The first choice: the one whose ``index`` is 0 (with ``n`` > 1 a stream interleaves the
    choices' chunks, each tagged with its index), or the first one where none has an index.
    None when this body or chunk carries only other choices."""
    if not isinstance(choices, list):
        return None
    listed = [c for c in choices if isinstance(c, dict)]
    for choice in listed:
        if choice.get("index") == 0 and not isinstance(choice.get("index"), bool):
            return choice
    if listed and all(choice.get("index") is None for choice in listed):
        return listed[0]
    return None


def other_choices(choices: Any) -> bool:
    """Whether a body or chunk holds a choice other than the first (``n`` > 1)."""
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and isinstance(c.get("index"), int) and c["index"] > 0 for c in choices)


# what a note says when the server answered more than one choice
MANY_CHOICES_NOTE = ("the server answered more than one choice (n > 1): choice 0 is read; the "
                     "usage counts may cover every choice")
REFUSAL_NOTE = "the model refused (OpenAI's refusal field); its refusal is read as the output"


def finish_reason_of(choice: dict[str, Any]) -> str | None:
    value = choice.get("finish_reason")
    return value if isinstance(value, str) and value else None


def read_usage(parsed: ParsedResponse, usage: Any) -> None:
    if isinstance(usage, dict):
        parsed.prompt_tokens = integer(usage.get("prompt_tokens"))
        parsed.completion_tokens = integer(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and integer(details.get("cached_tokens")) is not None:
            parsed.cached_tokens = integer(details.get("cached_tokens"))


def tool_calls_of(message: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A message's tool calls as [{"id", "name", "arguments"}] (legacy ``function_call`` too);
    None when it has none. Arguments stay the string the server sent (a dict is re-encoded)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        legacy = message.get("function_call")
        calls = [{"function": legacy}] if isinstance(legacy, dict) else []
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments) if arguments is not None else ""
        name = function.get("name")
        out.append({"id": call.get("id") if isinstance(call.get("id"), str) else None,
                    "name": name if isinstance(name, str) else None, "arguments": arguments})
    return out or None


class ToolCallDeltas:
    """Streamed tool calls: OpenAI sends each call's id and name once, then its arguments in
    pieces, keyed by ``index``."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def feed(self, deltas: Any) -> str:
        """Add one chunk's tool-call deltas; return the text they added (names and arguments)."""
        added = ""
        if not isinstance(deltas, list):
            return added
        for position, delta in enumerate(deltas):
            if not isinstance(delta, dict):
                continue
            index = delta.get("index")
            index = index if isinstance(index, int) and not isinstance(index, bool) else position
            call = self.calls.setdefault(index, {"id": None, "name": None, "arguments": ""})
            if isinstance(delta.get("id"), str):
                call["id"] = delta["id"]
            function = delta.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str) and function["name"]:
                    call["name"] = function["name"]
                    added += function["name"]
                piece = function.get("arguments")
                if isinstance(piece, dict):  # a server that sends the whole object at once
                    piece = json.dumps(piece)
                if isinstance(piece, str):
                    call["arguments"] += piece
                    added += piece
        return added

    def result(self) -> list[dict[str, Any]] | None:
        return [self.calls[i] for i in sorted(self.calls)] or None


def extras_of(body: dict[str, Any], choice: dict[str, Any] | None = None) -> dict[str, Any]:
    """Non-standard objects a server attaches to the body (or, for some versions, to the choice)."""
    extras = {k: v for k, v in body.items() if k not in STANDARD_KEYS}
    if choice:
        for key in ("sglext", "timings", "meta_info"):
            if key in choice and key not in extras:
                extras[key] = choice[key]
    return extras


# ---------------------------------------------------------------------------------------------
# The plug-in base


class Dialect:
    """One server family. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # Substrings of /v1/models' owned_by that name this server (auto-detection's fallback).
    owner_names: ClassVar[tuple[str, ...]] = ()
    # A per-request tree budget means something to this server (and budget0 is a baseline).
    sends_budget: ClassVar[bool] = False
    # Where the budget is fixed when it is not per request, for advice in notes and findings.
    budget_knob: ClassVar[str] = "the draft length is fixed at server start"
    # The server ignores stream=true and always answers one JSON body.
    ignores_stream: ClassVar[bool] = False
    # The server closes the keep-alive connection after a streamed answer: do not reuse it.
    close_after_stream: ClassVar[bool] = False
    # Detection priority: lower is tried first (a specific extra object before a generic one).
    detect_order: ClassVar[int] = 100

    def __repr__(self) -> str:
        return f"<dialect {self.name}>"

    def __str__(self) -> str:
        return self.name

    # -- requests -----------------------------------------------------------------------------
    def shape(self, body: dict[str, Any], case: ProbeCase) -> None:
        """Add this server's thinking toggle, budget and spec-number request fields to ``body``."""
        if case.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": case.enable_thinking}

    def build_request(
        self, case: ProbeCase, model: str, *, stream: bool, minimal: bool = False
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
        # Structured output and tools are OpenAI core fields: sent in every dialect, even minimal.
        if case.response_format is not None:
            body["response_format"] = case.response_format
        if case.tools:
            body["tools"] = case.tools
            if case.tool_choice is not None:
                body["tool_choice"] = case.tool_choice
        if not minimal:
            if stream and not self.ignores_stream:
                body["stream_options"] = {"include_usage": True}
            self.shape(body, case)
        body.update(case.extra)  # user-supplied fields win
        return body

    # -- responses ----------------------------------------------------------------------------
    def detect(self, extras: dict[str, Any]) -> bool:
        """Whether a plain response's extra objects identify this server."""
        return False

    def read_spec(self, extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
        """Spec-decoding numbers from the response's extras (empty when it has none)."""
        return SpecMetrics()

    def finish(self, parsed: ParsedResponse, case: ProbeCase) -> None:
        """Fill spec metrics from the extras and apply the server's quirks."""
        parsed.spec = self.read_spec(parsed.extras, parsed)
        self.fix_quirks(parsed, case)
        spec = parsed.spec
        if spec.mean_acceptance_length is not None and spec.mean_acceptance_length < 1 and not spec.decode_rounds:
            # no verify round (or none counted): servers fill the mean with a 0 then, not an acceptance
            spec.mean_acceptance_length = None
        if spec.mean_acceptance_length is None and spec.decode_rounds and parsed.completion_tokens is not None:
            spec.mean_acceptance_length = parsed.completion_tokens / spec.decode_rounds
            spec.derived = True

    def fix_quirks(self, parsed: ParsedResponse, case: ProbeCase) -> None:
        """Correct what this server is known to misreport (nothing by default)."""

    # -- parsing (shared) ---------------------------------------------------------------------
    def parse_body(self, body: dict[str, Any], case: ProbeCase) -> ParsedResponse:
        """Parse a non-streamed chat-completion body. Raises ValueError with a one-line reason when
        the body is not a usable chat completion."""
        choices = body.get("choices")
        choice = choice_zero(choices)
        error = body.get("error")
        if choice is None or error:
            if error:  # some servers answer 200 with an error object
                message = error.get("message", error) if isinstance(error, dict) else error
                text = str(message).splitlines()[0][:200] if str(message) else "(empty)"
                raise ValueError(f"server error in a 200 answer: {text}")
            raise ValueError("response has no choices[0]")
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ValueError("response has no choices[0].message")
        model = body.get("model")
        parsed = ParsedResponse(
            output=text_of(message.get("content")),
            reasoning=reasoning_of(message),
            tool_calls=tool_calls_of(message),
            finish_reason=finish_reason_of(choice),
            model=model if isinstance(model, str) else None,
        )
        if not parsed.output and refusal_of(message):
            parsed.output = refusal_of(message)
            parsed.notes.append(REFUSAL_NOTE)
        if other_choices(choices):
            parsed.notes.append(MANY_CHOICES_NOTE)
        read_usage(parsed, body.get("usage"))
        parsed.extras = extras_of(body, choice)
        if isinstance(choice.get("logprobs"), dict):
            # Kept for the lossless check's near-tie analysis (OpenAI shape: {"content": [...]}).
            parsed.extras["logprobs"] = choice["logprobs"]
        self.finish(parsed, case)
        return parsed

    def accumulator(self) -> StreamAccumulator:
        return StreamAccumulator(self)


class StreamAccumulator:
    """Collects SSE chunks of one streamed completion into a ParsedResponse."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self.parsed = ParsedResponse()
        self.output_parts: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[Any] = []  # per-token logprobs, chunk by chunk
        self._refusal: list[str] = []
        self._tool_calls = ToolCallDeltas()
        self.chunks = 0
        self.saw_done = False
        self._many_choices = False

    def feed(self, chunk: dict[str, Any]) -> str:
        """Add one decoded chunk; return the text it added (content or reasoning), for TTFT."""
        self.chunks += 1
        parsed = self.parsed
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            parsed.model = chunk["model"]
        added = ""
        choices = chunk.get("choices")
        self._many_choices = self._many_choices or other_choices(choices)
        choice = choice_zero(choices) or {}
        delta = choice.get("delta") or choice.get("message") or {}
        if isinstance(delta, dict):
            content = text_of(delta.get("content"))
            reasoning = reasoning_of(delta) or ""
            refusal = refusal_of(delta)
            self.output_parts.append(content)
            self._reasoning.append(reasoning)
            self._refusal.append(refusal)
            added = content + reasoning + refusal
            if delta.get("tool_calls") is not None:
                added += self._tool_calls.feed(delta["tool_calls"])  # a call's first piece is TTFT
        reason = finish_reason_of(choice)
        if reason:
            parsed.finish_reason = reason
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            # Streams carry per-token logprobs chunk by chunk; keep them in one list.
            self._logprobs.extend(logprobs["content"])
        if chunk.get("usage"):
            read_usage(parsed, chunk["usage"])
        for key, value in extras_of(chunk, choice).items():
            if value is not None:  # the last non-null copy of an extra wins
                parsed.extras[key] = value
        return added

    def result(self, case: ProbeCase) -> ParsedResponse:
        parsed = self.parsed
        parsed.output = "".join(self.output_parts)
        if not parsed.output and "".join(self._refusal):
            parsed.output = "".join(self._refusal)
            parsed.notes.append(REFUSAL_NOTE)
        if self._many_choices:
            parsed.notes.append(MANY_CHOICES_NOTE)
        parsed.reasoning = "".join(self._reasoning) or None
        parsed.tool_calls = self._tool_calls.result()
        if self._logprobs:
            parsed.extras["logprobs"] = {"content": self._logprobs}
        self.dialect.finish(parsed, case)
        return parsed
