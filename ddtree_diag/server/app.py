"""Reference server: OpenAI-compatible chat completions over the in-process DDTree engine.

A known-good server with the standalone DDTree wire format (top-level ``enable_thinking`` and
``tree_budget``, a ``ddtree`` object with per-request spec numbers) so a deployment can be
compared with it, and so our own end-to-end tests probe a real server.

This module wires the FastAPI routes; the parts live beside it:

- ``schema``: the request body, its strict validation, ``ServerLimits`` and ``ApiError`` (the
  OpenAI error object). Client input never causes a 5xx: a body that is not JSON (or not
  ``application/json``: 415), too deep, too large, with lone surrogates, wrong types, non-finite or
  out-of-range numbers, a template that cannot render the messages, or a prompt over the context
  gets a 4xx with an OpenAI error object.
- ``worker``: one engine, one worker thread; requests queue and run one at a time (FIFO) under a
  per-request generation deadline (408). A streaming client that disconnects cancels its
  generation at the next round; a queued request whose client has gone is skipped.
- ``responses``: the completion body and the SSE chunks. Errors after a stream has started are
  sent as an SSE ``data: {"error": {...}}`` event, and the stream ends.
- ``metrics``: the Prometheus counters.
- ``prompting``: the chat template with the request's tools (a system note lists them when the
  template does not); ``/tokenize`` renders through it too, so its count is the chat's.
- ``parsing``: reasoning (``</think>``) and tool calls read out of the generated text, streamed or
  whole. ``response_format`` and forced tool calls are decoded under a grammar
  (``engine.grammar``, llguidance), compiled before the request is queued: a schema it cannot
  follow is a 400 naming the feature.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree_diag import __version__, budget
from ddtree_diag.errors import DiagError
from ddtree_diag.server import prompting, responses
from ddtree_diag.server.metrics import CONTENT_TYPE_LATEST, Metrics
from ddtree_diag.server.schema import ApiError, ChatRequest, RequestRules, ServerLimits, check_auth
from ddtree_diag.server.worker import EngineWorker, Job

__all__ = ["ApiError", "ServerLimits", "create_app", "serve"]


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
    limits = limits or ServerLimits.for_engine(engine)
    if default_tree_budget is None:  # the engine's own default, within this server's limit
        default_tree_budget = budget.server_default(getattr(engine, "default_tree_budget", 0), limits.max_tree_budget)
    rules = RequestRules(model_name, limits, getattr(engine, "context_length", None))
    metrics = Metrics()
    worker = EngineWorker(engine, limits=limits, max_context=rules.max_context,
                          default_tree_budget=default_tree_budget, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        worker.shutdown()

    app = FastAPI(title="ddtree-diag reference server", version=__version__, docs_url=None,
                  redoc_url=None, openapi_url=None, lifespan=lifespan)
    created = int(time.time())
    capabilities = {
        # response_format json_object / json_schema and forced tool calls, decoded under a grammar
        "structured_output": "llguidance" if importlib.util.find_spec("llguidance") else None,
        "tool_calls": True,  # forced (required / named) under a grammar; "auto": <tool_call> blocks parsed
        "reasoning_content": True,  # split at </think> when thinking is on
        "tokenize": True,
    }
    info = dict(description or {})
    app.state.worker = worker
    app.state.limits = limits

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        metrics.count(exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths (404), wrong methods (405): the same OpenAI error shape as everything else.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind=kind).response()

    @app.exception_handler(Exception)
    async def _server_error(_: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, never a client's mistake: still an OpenAI error object, and the server lives on.
        metrics.count(500)
        return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "ready": True,
            "model": model_name,
            "tree_budget_default": default_tree_budget,
            "workers": 1,  # one engine worker: requests queue (a load test measures the queue)
            "limits": {**asdict(limits), "max_context": rules.max_context},
            "capabilities": capabilities,
            "version": __version__,
            **info,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request, api_key)
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "ddtree-diag",
             "max_model_len": rules.max_context}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a text, or messages rendered exactly as a chat request renders them."""
        check_auth(request, api_key)
        body = await rules.parse_tokenize(request)
        tokenizer = engine.tokenizer
        try:
            if body.messages is not None:
                text = prompting.render_text(
                    tokenizer, [m.for_template() for m in body.messages], thinking=body.thinking(),
                    tools=[tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None,
                    add_generation_prompt=body.add_generation_prompt)
            else:
                text = body.prompt or ""
            special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
            tokens = list(tokenizer(text, add_special_tokens=special)["input_ids"])
        except DiagError as exc:  # the template refused the messages
            raise ApiError(400, str(exc), param="messages") from None
        return {"count": len(tokens), "max_model_len": rules.max_context, "tokens": tokens,
                "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.page(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_auth(request, api_key)
        body = await rules.parse(request)
        started = time.perf_counter()
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        constraint = None
        if body.wants_constraint():  # off the event loop: a large schema, or the grammar's first look
            constraint = await asyncio.to_thread(worker.constraint_for, body)  # at the vocabulary, takes a while
        job = Job(constraint)
        if body.stream:
            return StreamingResponse(
                stream_events(body, job, completion_id, started),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        generation = await worker.complete(body, job, request)
        metrics.finished(generation, started)
        return JSONResponse(responses.completion(completion_id, model_name, body, generation, engine.tokenizer))

    def sse_error(error: ApiError) -> str:
        # The status line (200) is already sent: the error travels as an event, then the stream ends.
        metrics.count(error.status)
        return responses.sse(error.stream_body())

    async def stream_events(body: ChatRequest, job: Job, completion_id: str, started: float) -> AsyncIterator[str]:
        chunks = responses.Chunks(completion_id, model_name)
        parser = responses.answer_parser(body, engine.tokenizer)
        events = worker.start_streaming(body, job)
        try:
            yield chunks.role()
            while True:
                kind, value = await events.get()
                if kind == "delta":
                    for delta in parser.feed(value):
                        yield chunks.delta(delta)
                    continue
                if kind == "error":
                    yield sse_error(worker.engine_error(value))
                    yield responses.DONE
                    return
                generation = value
                break
            if job.timed_out:
                yield sse_error(worker.deadline_error(job))
                yield responses.DONE
                return
            if generation is None:
                return
            metrics.finished(generation, started)
            for delta in parser.finish():
                yield chunks.delta(delta)
            for event in chunks.finish(body, generation, engine.tokenizer,
                                       parser.finish_reason(generation.finish_reason)):
                yield event
            yield responses.DONE
        finally:
            # Client gone (generator closed) or done: stop the engine at its next round.
            job.cancelled.set()

    return app


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
                     description=description, limits=limits)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
    # that was installed before it started; a no-op there makes a requested stop exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
