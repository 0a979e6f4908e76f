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
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ddtree_diag import budget
from ddtree_diag.engine.decode import MIN_SAMPLING_TEMPERATURE, SEED_RANGE
from ddtree_diag.errors import one_line
from ddtree_diag.jsonsafe import MAX_DEPTH, depth

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any probe, small enough to refuse abuse early
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOOLS = 128  # OpenAI's limit


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
    # a tool round trip: the assistant's calls, and the tool's answer to one of them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type == "text")
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (content as text; tool fields when sent)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = Field(default=False, strict=True)


class TemplateKwargs(BaseModel):
    """``chat_template_kwargs``: any keys; the one the server reads is type-checked."""

    model_config = ConfigDict(extra="allow")
    enable_thinking: bool | None = Field(default=None, strict=True)


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a JSON Schema (one line), None when it is one."""
    import jsonschema

    if not isinstance(schema, dict | bool):
        return "must be a JSON Schema (an object)"
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"invalid JSON Schema: {one_line(exc.message, 160)}" + (f" (at {where})" if where else "")
    return None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, strict=True)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")  # "schema" would shadow BaseModel.schema
    strict: bool | None = Field(default=None, strict=True)

    @field_validator("json_schema")
    @classmethod
    def _is_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = schema_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('"json_schema" is required when type is "json_schema"')
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64, strict=True)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(default=None, strict=True)

    @field_validator("parameters")
    @classmethod
    def _is_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = None if value is None else schema_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @property
    def name(self) -> str:
        return self.function["name"]


TOOL_CHOICES = ("none", "auto", "required")


def read_tool_choice(value: Any, tools: list[Tool] | None) -> str | NamedToolChoice | None:
    """``tool_choice`` checked against the request's ``tools`` (ValueError: why not)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ValueError(f"must be one of {', '.join(TOOL_CHOICES)} or "
                             '{"type": "function", "function": {"name": ...}}')
        choice: str | NamedToolChoice = value
    elif isinstance(value, dict):
        function = value.get("function")
        if value.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError('a named choice is {"type": "function", "function": {"name": ...}}')
        choice = NamedToolChoice.model_validate(value)
    else:
        raise ValueError("must be a string or an object")
    if choice in ("none", "auto"):
        return choice
    if not tools:
        raise ValueError(f"{choice if isinstance(choice, str) else 'a named function'} needs tools")
    if isinstance(choice, NamedToolChoice) and choice.name not in {t.function.name for t in tools}:
        raise ValueError(f"no function named {choice.name[:64]!r} in tools")
    return choice


class ThinkingToggle(BaseModel):
    """The thinking toggle a chat request and /tokenize share."""

    enable_thinking: bool | None = Field(default=None, strict=True)
    chat_template_kwargs: TemplateKwargs | None = None

    def thinking(self) -> bool | None:
        """Top-level enable_thinking (the standalone server's knob) wins over the template kwargs."""
        if self.enable_thinking is not None:
            return self.enable_thinking
        return self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs is not None else None


class ChatRequest(ThinkingToggle):
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
    tree_budget: int | None = Field(default=None, ge=0, le=budget.MAX_TREE_BUDGET, strict=True)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = Field(default=None, strict=True)  # one call at most is made anyway

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

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or ()]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"function {twice[0][:64]!r} is listed twice")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> str | NamedToolChoice | None:
        return read_tool_choice(value, info.data.get("tools"))

    def tool_mode(self) -> str:
        """How the answer is read: "none" (no tools or tool_choice none), "auto" (tagged calls in
        the text) or "forced" (a constraint makes the answer a call)."""
        from ddtree_diag.server.parsing import tool_mode

        return tool_mode(bool(self.tools), self.tool_choice)

    def wants_constraint(self) -> bool:
        """Whether the answer is decoded under a grammar (or its tools checked by one)."""
        formatted = self.response_format is not None and self.response_format.type != "text"
        return formatted or self.tool_mode() != "none"

    def named_tool(self) -> str | None:
        return self.tool_choice.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (none when tool_choice is "none": the model is
        not to call one, and a template that lists them invites it to)."""
        if self.tool_mode() == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TokenizeRequest(ThinkingToggle):
    """vLLM's /tokenize: ``prompt`` (text) or ``messages`` (rendered as a chat request would be)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = Field(default=None, strict=True)
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = Field(default=True, strict=True)
    add_special_tokens: bool | None = Field(default=None, strict=True)  # vLLM: prompt True, messages False
    return_token_strs: bool = Field(default=False, strict=True)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('send either "prompt" (text) or "messages"')
        return self


Body = TypeVar("Body", bound=BaseModel)


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
        return self.validate(await self.read(request))

    async def parse_tokenize(self, request: Request) -> TokenizeRequest:
        """The validated body of a /tokenize request; ApiError (4xx) for anything else."""
        body = self.model_body(await self.read(request), TokenizeRequest)
        self.check_model(body.model)
        return body

    async def read(self, request: Request) -> bytes:
        content_type = request.headers.get("content-type")
        if not is_json_media_type(content_type):
            raise ApiError(415, f"Content-Type must be application/json, got {content_type[:80]!r}",
                           code="unsupported_media_type")
        return await read_body(request, self.limits.max_body_bytes)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model[:200]!r} does not exist (this server has "
                           f"{self.model_name!r})", param="model", code="model_not_found")

    def validate(self, raw: bytes) -> ChatRequest:
        body = self.model_body(raw, ChatRequest)
        self.check_model(body.model)
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

    @staticmethod
    def model_body(raw: bytes, model: type[Body]) -> Body:
        """``raw`` as a ``model``: JSON, not too deep, valid Unicode, the schema's types."""
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
            return model.model_validate(data)
        except ValidationError as exc:
            message, param = validation_message(exc)
            raise ApiError(400, message, param=param) from None
        except RecursionError:
            raise ApiError(400, f"invalid JSON body: nested deeper than {MAX_DEPTH} levels") from None
