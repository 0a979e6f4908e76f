"""What a chat-completion request may be, and how a bad one is answered.

Unknown fields are ignored (as vLLM and SGLang do), known ones are type-checked, strictly: a
boolean or a string where a number belongs, or a string or a number where a boolean belongs
(``"stream": "yes"``, ``"logprobs": 1``), is a 400 naming the field, never coerced. Every refusal
is an ``ApiError``, answered as an OpenAI error object. ``ServerLimits`` is what one request may
ask of the single worker (``serve`` flags; shown in /health); ``parse_request`` applies it.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ddtree_diag import budget
from ddtree_diag.engine.decode import MIN_SAMPLING_TEMPERATURE, SEED_RANGE
from ddtree_diag.jsonsafe import MAX_DEPTH, depth

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any probe, small enough to refuse abuse early
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class ServerLimits:
    """What one request may ask of the single worker (``serve`` flags; shown in /health)."""

    max_tree_budget: int
    max_context: int  # prompt + max_tokens, in tokens
    request_timeout_s: float  # generation time per request; past it: 408 (or an SSE error event)
    max_body_bytes: int = MAX_BODY_BYTES

    @classmethod
    def for_engine(cls, engine: Any, *, max_tree_budget: int | None = None, max_context: int | None = None,
                   request_timeout_s: float | None = None) -> ServerLimits:
        """Defaults that keep a CPU server responsive (budget 256, context 4096, 120 s); on CUDA the
        schema's ceiling, the model's context and 600 s."""
        device = getattr(getattr(engine, "device", None), "type", "cpu")
        cpu = device != "cuda"
        context = int(getattr(engine, "context_length", 0) or 1 << 20)
        default_budget = budget.CPU_MAX_TREE_BUDGET if cpu else budget.MAX_TREE_BUDGET
        return cls(
            max_tree_budget=max_tree_budget if max_tree_budget is not None else default_budget,
            max_context=max_context if max_context is not None else (min(context, 4096) if cpu else context),
            request_timeout_s=request_timeout_s if request_timeout_s is not None else (120.0 if cpu else 600.0),
        )


class ApiError(Exception):
    """A client mistake (or, 5xx, ours), answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def stream_body(self) -> dict[str, Any]:
        """The SSE error event's payload (after the 200 status line): the code is never null."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code or self.status}}


# ---------------------------------------------------------------------------------------------
# The request body


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str = ""


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(default=False, strict=True)


class TemplateKwargs(BaseModel):
    """``chat_template_kwargs``: any keys; the one the server reads is type-checked."""

    model_config = ConfigDict(extra="allow")
    enable_thinking: bool | None = Field(default=None, strict=True)


class ChatRequest(BaseModel):
    # Numbers and booleans are strict: a boolean or a string where a number belongs, or a string or
    # a number where a boolean belongs ("stream": "yes", "logprobs": 1), is a 400, never coerced.
    model_config = ConfigDict(extra="ignore", strict=False)
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, strict=True, allow_inf_nan=False)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1], strict=True)
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    n: int = Field(default=1, ge=1, le=1, strict=True)
    enable_thinking: bool | None = Field(default=None, strict=True)
    tree_budget: int | None = Field(default=None, ge=0, le=budget.MAX_TREE_BUDGET, strict=True)
    chat_template_kwargs: TemplateKwargs | None = None

    @field_validator("temperature")
    @classmethod
    def _samplable(cls, value: float) -> float:
        if 0 < value < MIN_SAMPLING_TEMPERATURE:
            raise ValueError(f"{value:g} is too small to sample with (minimum {MIN_SAMPLING_TEMPERATURE:g}; "
                             "0 means greedy)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 8:
            raise ValueError("at most 8 stop sequences")
        return [s for s in stops if s]

    def thinking(self) -> bool | None:
        """Top-level enable_thinking (the standalone server's knob) wins over the template kwargs."""
        if self.enable_thinking is not None:
            return self.enable_thinking
        return self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs is not None else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """(one-line message naming the field, the field's path) for the first schema error."""
    first = exc.errors(include_url=False, include_input=False)[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    message = str(first.get("msg")).removeprefix("Value error, ")
    if first.get("type") == "bool_type":  # strict: "yes", 1, "no" are not coerced
        message = "must be a JSON boolean (true or false)"
    return f"{param}: {message}" if param else message, param


def surrogate_at(value: Any) -> str | None:
    """The JSON path of the first string (or key) holding a lone surrogate, which no tokenizer
    can encode; None when there is none."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if any("\ud800" <= ch <= "\udfff" for ch in item):
                return path or "(body)"
        elif isinstance(item, dict):
            for key, child in item.items():
                if any("\ud800" <= ch <= "\udfff" for ch in key):
                    return f"{path}.(key)" if path else "(key)"
                stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def is_json_media_type(content_type: str | None) -> bool:
    """application/json or application/*+json (a missing Content-Type is read as JSON too)."""
    if not content_type:
        return True
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# ---------------------------------------------------------------------------------------------
# Reading a request


def check_auth(request: Request, api_key: str | None) -> None:
    """401 unless the request carries ``Authorization: Bearer API_KEY`` (no key: anyone)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "invalid or missing API key", kind="authentication_error",
                       code="invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is over ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body over {limit} bytes")
    raw = bytearray()
    async for chunk in request.stream():  # stop reading as soon as it is too large
        raw += chunk
        if len(raw) > limit:
            raise ApiError(413, f"request body over {limit} bytes")
    return bytes(raw)


@dataclass
class RequestRules:
    """What this server accepts beyond the schema: its model, its limits, its context."""

    model_name: str
    limits: ServerLimits
    context_length: int | None  # the model's

    @property
    def max_context(self) -> int:
        """prompt + max_tokens: the limit's, within the model's context."""
        if self.context_length:
            return min(self.limits.max_context, self.context_length)
        return self.limits.max_context

    async def parse(self, request: Request) -> ChatRequest:
        """The validated body of a chat-completion request; ApiError (4xx) for anything else."""
        content_type = request.headers.get("content-type")
        if not is_json_media_type(content_type):
            raise ApiError(415, f"Content-Type must be application/json, got {content_type[:80]!r}",
                           code="unsupported_media_type")
        return self.validate(await read_body(request, self.limits.max_body_bytes))

    def validate(self, raw: bytes) -> ChatRequest:
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ApiError(400, f"invalid JSON body: nested deeper than {MAX_DEPTH} levels") from None
        except ValueError as exc:  # includes invalid UTF-8 (UnicodeDecodeError)
            raise ApiError(400, f"invalid JSON body: {' '.join(str(exc).split())[:200]}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        if depth(data, MAX_DEPTH) > MAX_DEPTH:
            raise ApiError(400, f"invalid JSON body: nested deeper than {MAX_DEPTH} levels")
        where = surrogate_at(data)
        if where is not None:
            raise ApiError(400, f"{where}: contains a lone UTF-16 surrogate (not valid Unicode text)",
                           param=where)
        try:
            body = ChatRequest.model_validate(data)
        except ValidationError as exc:
            message, param = validation_message(exc)
            raise ApiError(400, message, param=param) from None
        except RecursionError:
            raise ApiError(400, f"invalid JSON body: nested deeper than {MAX_DEPTH} levels") from None
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model {body.model[:200]!r} does not exist (this server has "
                           f"{self.model_name!r})", param="model", code="model_not_found")
        refused = budget.over_limit(body.tree_budget, self.limits.max_tree_budget)
        if refused is not None:
            raise ApiError(400, refused, param="tree_budget")
        max_tokens = body.requested_max_tokens()
        max_context = self.max_context
        if max_tokens and max_tokens >= max_context:
            raise ApiError(400, f"max_tokens {max_tokens} exceeds the context length {max_context}"
                           + ("" if max_context == self.context_length else " (serve --max-context)"),
                           param="max_tokens")
        return body
