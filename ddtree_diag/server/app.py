"""Reference server: OpenAI-compatible chat completions over the in-process DDTree engine.

A known-good server with the standalone DDTree wire format (top-level ``enable_thinking`` and
``tree_budget``, a ``ddtree`` object with per-request spec numbers) so a deployment can be
compared with it, and so our own end-to-end tests probe a real server.

One engine, one worker thread: requests queue and run one at a time (FIFO), so concurrent clients
are safe and each request's numbers are its own. A streaming client that disconnects cancels its
generation at the next round; a queued request whose client has gone is skipped.

Client input never causes a 5xx: a body that is not JSON (or not ``application/json``: 415), too
deep, too large, with lone surrogates, wrong types, non-finite or out-of-range numbers, a template
that cannot render the messages, or a prompt over the context gets a 4xx with an OpenAI error
object. ``ServerLimits`` keeps one client from holding the single worker for minutes: a maximum
tree budget and context, and a per-request generation deadline (408). Errors after a stream has
started are sent as an SSE ``data: {"error": {...}}`` event, and the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree_diag import __version__
from ddtree_diag.engine.decode import MIN_SAMPLING_TEMPERATURE, SEED_RANGE
from ddtree_diag.errors import DiagError
from ddtree_diag.jsonsafe import MAX_DEPTH, depth

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any probe, small enough to refuse abuse early
MAX_TREE_BUDGET = 4096  # the schema's ceiling; ServerLimits.max_tree_budget is the server's own
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
                   request_timeout_s: float | None = None) -> ServerLimits:  # fmt: skip
        """Defaults that keep a CPU server responsive (budget 256, context 4096, 120 s); on CUDA the
        schema's ceiling, the model's context and 600 s."""
        device = getattr(getattr(engine, "device", None), "type", "cpu")
        cpu = device != "cuda"
        context = int(getattr(engine, "context_length", 0) or 1 << 20)
        return cls(
            max_tree_budget=max_tree_budget if max_tree_budget is not None else (256 if cpu else MAX_TREE_BUDGET),
            max_context=max_context if max_context is not None else (min(context, 4096) if cpu else context),
            request_timeout_s=request_timeout_s if request_timeout_s is not None else (120.0 if cpu else 600.0),
        )


class ApiError(Exception):
    """A client mistake, answered with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


# ---------------------------------------------------------------------------------------------
# Request schema: unknown fields are ignored (as vLLM and SGLang do), known ones are type-checked.


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
    tree_budget: int | None = Field(default=None, ge=0, le=MAX_TREE_BUDGET, strict=True)
    chat_template_kwargs: TemplateKwargs | None = None

    @field_validator("temperature")
    @classmethod
    def _samplable(cls, value: float) -> float:
        if 0 < value < MIN_SAMPLING_TEMPERATURE:
            raise ValueError(f"{value:g} is too small to sample with (minimum {MIN_SAMPLING_TEMPERATURE:g}; "
                             "0 means greedy)")  # fmt: skip
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


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors(include_url=False, include_input=False)[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    message = str(first.get("msg")).removeprefix("Value error, ")
    if first.get("type") == "bool_type":  # strict: "yes", 1, "no" are not coerced
        message = "must be a JSON boolean (true or false)"
    return f"{param}: {message}" if param else message, param


def _surrogate_at(value: Any) -> str | None:
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


def _is_json_media_type(content_type: str | None) -> bool:
    """application/json or application/*+json (a missing Content-Type is read as JSON too)."""
    if not content_type:
        return True
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# ---------------------------------------------------------------------------------------------
# Metrics


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ddtree_requests", "Chat completion requests", ["status"], registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("ddtree_generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram(
            "ddtree_request_latency_seconds", "End-to-end request latency", registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )  # fmt: skip
        # The same names vLLM and llama.cpp use, so server-wide probing works here too.
        self.drafts = Counter("ddtree_spec_decode_num_drafts", "Verify rounds with a draft", registry=r)
        self.draft_tokens = Counter("ddtree_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter(
            "ddtree_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )

    def record(self, generation: Any) -> None:
        self.prompt_tokens.inc(generation.prompt_tokens)
        self.generation_tokens.inc(generation.completion_tokens)
        if generation.mode != "ar":
            self.drafts.inc(generation.decode_rounds)
            self.draft_tokens.inc(sum(generation.tree_sizes))
            self.accepted_tokens.inc(sum(length - 1 for length in generation.acceptance_lengths))


# ---------------------------------------------------------------------------------------------
# Response shapes


def ddtree_stats(generation: Any) -> dict[str, Any]:
    """The per-request ``ddtree`` object (the standalone DDTree server's format, extended)."""
    decode_time = generation.e2e_s - generation.ttft_s
    rounds = generation.decode_rounds
    return {
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


def logprobs_content(tokenizer: Any, generation: Any, count: int) -> list[dict[str, Any]] | None:
    """OpenAI ``choices[0].logprobs.content`` from the engine's per-token top-k log-probs."""
    if not generation.top_logprobs:
        return None
    content = []
    for token_id, top in zip(generation.token_ids, generation.top_logprobs, strict=False):
        chosen = dict(top).get(token_id)
        entry_token = tokenizer.decode([token_id])
        content.append({
            "token": entry_token,
            "logprob": chosen if chosen is not None else min(v for _, v in top),
            "bytes": list(entry_token.encode("utf-8")),
            "top_logprobs": [
                {"token": tokenizer.decode([tid]), "logprob": value,
                 "bytes": list(tokenizer.decode([tid]).encode("utf-8"))}
                for tid, value in top[:count]
            ],
        })  # fmt: skip
    return content


# ---------------------------------------------------------------------------------------------
# The app


class _Job:
    """One queued generation: its cancel flag, and whether the deadline is what stopped it."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.timed_out = False
        self.tokens = 0  # committed so far (for the deadline's message)


def create_app(
    engine: Any,
    *,
    model_name: str,
    api_key: str | None = None,
    default_tree_budget: int | None = None,
    description: dict[str, Any] | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """Build the FastAPI app around a loaded engine (``ddtree_diag.engine.load_engine``)."""
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddtree-engine")
    limits = limits or ServerLimits.for_engine(engine)
    if default_tree_budget is None:  # the engine's own default, within this server's limit
        default_tree_budget = min(int(getattr(engine, "default_tree_budget", 0)), limits.max_tree_budget)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ddtree-diag reference server", version=__version__, docs_url=None,
                  redoc_url=None, openapi_url=None, lifespan=lifespan)  # fmt: skip
    metrics = Metrics()
    created = int(time.time())
    context_length = getattr(engine, "context_length", None)
    max_context = min(limits.max_context, context_length) if context_length else limits.max_context
    info = dict(description or {})
    app.state.worker = worker
    app.state.limits = limits

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key", kind="authentication_error",
                           code="invalid_api_key")  # fmt: skip

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(status=str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths (404), wrong methods (405): the same OpenAI error shape as everything else.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(Exception)
    async def _server_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, never a client's mistake: still an OpenAI error object, and the server lives on.
        metrics.requests.labels(status="500").inc()
        return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "ready": True,
            "model": model_name,
            "tree_budget_default": default_tree_budget,
            "limits": {**asdict(limits), "max_context": max_context},
            "version": __version__,
            **info,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "ddtree-diag"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
            raise ApiError(413, f"request body over {limits.max_body_bytes} bytes")
        raw = bytearray()
        async for chunk in request.stream():  # stop reading as soon as it is too large
            raw += chunk
            if len(raw) > limits.max_body_bytes:
                raise ApiError(413, f"request body over {limits.max_body_bytes} bytes")
        return bytes(raw)

    async def parse(request: Request) -> ChatRequest:
        content_type = request.headers.get("content-type")
        if not _is_json_media_type(content_type):
            raise ApiError(415, f"Content-Type must be application/json, got {content_type[:80]!r}",
                           code="unsupported_media_type")  # fmt: skip
        raw = await read_body(request)
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
        where = _surrogate_at(data)
        if where is not None:
            raise ApiError(400, f"{where}: contains a lone UTF-16 surrogate (not valid Unicode text)",
                           param=where)  # fmt: skip
        try:
            body = ChatRequest.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise ApiError(400, message, param=param) from None
        except RecursionError:
            raise ApiError(400, f"invalid JSON body: nested deeper than {MAX_DEPTH} levels") from None
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"the model {body.model[:200]!r} does not exist (this server has {model_name!r})",
                           param="model", code="model_not_found")  # fmt: skip
        if body.tree_budget is not None and body.tree_budget > limits.max_tree_budget:
            raise ApiError(400, f"tree_budget {body.tree_budget} exceeds this server's limit "
                           f"{limits.max_tree_budget} (serve --max-tree-budget)", param="tree_budget")  # fmt: skip
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens and max_tokens >= max_context:
            raise ApiError(400, f"max_tokens {max_tokens} exceeds the context length {max_context}"
                           + ("" if max_context == context_length else " (serve --max-context)"),
                           param="max_tokens")  # fmt: skip
        return body

    def run_generation(body: ChatRequest, job: _Job, on_delta=None) -> Any:
        """Runs on the engine thread."""
        if job.cancelled.is_set():
            return None  # the client left while queued
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt_ids = engine.render_prompt(messages, body.thinking())
        max_tokens = body.max_completion_tokens or body.max_tokens or min(256, max(1, max_context - len(prompt_ids)))
        if len(prompt_ids) + max_tokens > max_context:
            raise DiagError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                            f"context length {max_context}")  # fmt: skip
        ends = time.monotonic() + limits.request_timeout_s

        def on_token(token_ids: list[int], text: str) -> bool:
            job.tokens += len(token_ids)
            if time.monotonic() > ends:
                job.timed_out = True
                return False
            if on_delta is not None and text:
                on_delta(text)
            return not job.cancelled.is_set()

        top = body.top_logprobs if body.logprobs else 0
        generation = engine.generate(
            prompt_ids=prompt_ids,
            tree_budget=body.tree_budget if body.tree_budget is not None else default_tree_budget,
            temperature=body.temperature,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=body.stop,
            top_logprobs=max(top or 0, 1 if body.logprobs else 0),
            on_token=on_token,
        )
        if generation.finish_reason == "cancelled" and not job.timed_out:
            metrics.requests.labels(status="cancelled").inc()  # nobody is left to answer
        return generation

    def deadline_error(job: _Job) -> ApiError:
        return ApiError(408, f"generation stopped at this server's per-request limit of "
                        f"{limits.request_timeout_s:g} s (serve --request-timeout) after {job.tokens} tokens",
                        kind="timeout_error", code="request_timeout")  # fmt: skip

    def finish_generation(generation: Any, started: float) -> None:
        metrics.record(generation)
        metrics.requests.labels(status="200").inc()
        metrics.latency.observe(time.perf_counter() - started)

    def engine_error(exc: Exception) -> ApiError:
        if isinstance(exc, DiagError):  # e.g. prompt longer than the context: the client's doing
            return ApiError(400, str(exc))
        return ApiError(500, f"engine error: {type(exc).__name__}: {exc}", kind="server_error")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_auth(request)
        body = await parse(request)
        started = time.perf_counter()
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        loop = asyncio.get_running_loop()
        job = _Job()
        if body.stream:
            return StreamingResponse(
                stream_chunks(body, job, completion_id, started, loop),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        future = loop.run_in_executor(worker, run_generation, body, job)
        try:
            while True:  # wait for the engine, watching for a client that gives up
                done, _ = await asyncio.wait({future}, timeout=0.25)
                if done:
                    break
                if await request.is_disconnected():
                    job.cancelled.set()  # frees the worker at the next round
            generation = future.result()
        except Exception as exc:
            raise engine_error(exc) from None
        if job.timed_out:
            raise deadline_error(job)
        if generation is None:
            raise ApiError(499, "client closed the request")
        finish_generation(generation, started)
        message: dict[str, Any] = {"role": "assistant", "content": generation.text}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": generation.finish_reason}  # fmt: skip
        if body.logprobs:
            choice["logprobs"] = {"content": logprobs_content(engine.tokenizer, generation, body.top_logprobs or 0)}
        return JSONResponse({
            "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "choices": [choice], "usage": _usage(generation), "ddtree": ddtree_stats(generation),
        })  # fmt: skip

    async def stream_chunks(body: ChatRequest, job: _Job, completion_id: str, started: float, loop):
        queue: asyncio.Queue = asyncio.Queue()

        def on_delta(text: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("delta", text))

        def work() -> Any:
            try:
                result = run_generation(body, job, on_delta)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", result))
            except Exception as exc:  # reported in the stream; the worker stays healthy
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))

        base = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model_name}  # fmt: skip

        def sse(payload: Any) -> str:
            return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

        def sse_error(error: ApiError) -> str:
            # The status line (200) is already sent: the error travels as an event, then the stream ends.
            metrics.requests.labels(status=str(error.status)).inc()
            return sse({"error": {"message": error.message, "type": error.kind, "param": error.param,
                                  "code": error.code or error.status}})  # fmt: skip

        future = loop.run_in_executor(worker, work)
        try:
            yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]})  # fmt: skip
            while True:
                kind, value = await queue.get()
                if kind == "delta":
                    yield sse({**base, "choices": [{"index": 0, "delta": {"content": value},
                                                    "finish_reason": None}]})  # fmt: skip
                    continue
                if kind == "error":
                    yield sse_error(engine_error(value))
                    yield sse("[DONE]")
                    return
                generation = value
                break
            if job.timed_out:
                yield sse_error(deadline_error(job))
                yield sse("[DONE]")
                return
            if generation is None:
                return
            finish_generation(generation, started)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            final: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": {},
                                                          "finish_reason": generation.finish_reason}]}  # fmt: skip
            if body.logprobs:
                final["choices"][0]["logprobs"] = {
                    "content": logprobs_content(engine.tokenizer, generation, body.top_logprobs or 0)}
            if not include_usage:
                final["ddtree"] = ddtree_stats(generation)  # no usage chunk: ride the finish chunk
            yield sse(final)
            if include_usage:
                yield sse({**base, "choices": [], "usage": _usage(generation), "ddtree": ddtree_stats(generation)})
            yield sse("[DONE]")
        finally:
            # Client gone (generator closed) or done: stop the engine at its next round.
            job.cancelled.set()
            del future  # the worker drains it; nothing waits on the result

    return app


def _usage(generation: Any) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def serve(
    engine: Any,
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    default_tree_budget: int | None = None,
    description: dict[str, Any] | None = None,
    limits: ServerLimits | None = None,
    log_level: str = "warning",
) -> None:
    """Run the server until SIGINT/SIGTERM (uvicorn shuts down gracefully on both)."""
    import uvicorn

    app = create_app(engine, model_name=model_name, api_key=api_key, default_tree_budget=default_tree_budget,
                     description=description, limits=limits)  # fmt: skip
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    # that was installed before it started; a no-op there makes a requested stop exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
