"""The single engine worker: one engine, one thread, requests run one at a time (FIFO).

Concurrent clients are safe and each request's numbers are its own. Every generation runs under
the server's per-request deadline (``ServerLimits.request_timeout_s``: past it the request gets a
408, or an SSE error event once streaming). A client that goes away cancels its generation at the
next round; a queued request whose client has gone is skipped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from ddtree_diag import budget
from ddtree_diag.errors import DiagError
from ddtree_diag.server import prompting
from ddtree_diag.server.metrics import Metrics
from ddtree_diag.server.schema import ApiError, ChatRequest, ServerLimits

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class Job:
    """One queued generation: its cancel flag, whether the deadline is what stopped it, and the
    constraint its answer is decoded under (compiled before it was queued)."""

    def __init__(self, constraint: Any = None) -> None:
        self.cancelled = threading.Event()
        self.timed_out = False
        self.tokens = 0  # committed so far (for the deadline's message)
        self.constraint = constraint


class EngineWorker:
    """Runs generations on the engine's one thread."""

    def __init__(self, engine: Any, *, limits: ServerLimits, max_context: int, default_tree_budget: int,
                 metrics: Metrics) -> None:
        self.engine = engine
        self.limits = limits
        self.max_context = max_context
        self.default_tree_budget = default_tree_budget
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddtree-engine")

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- on the engine thread ------------------------------------------------------------------

    def generate(self, body: ChatRequest, job: Job, on_delta: Callable[[str], None] | None = None) -> Any:
        """One generation (None when the client left while it was queued)."""
        if job.cancelled.is_set():
            return None  # the client left while queued
        engine, max_context = self.engine, self.max_context
        prompt_ids = prompting.render(engine.tokenizer, body.template_messages(), thinking=body.thinking(),
                                      tools=body.template_tools())
        max_tokens = body.requested_max_tokens() or min(256, max(1, max_context - len(prompt_ids)))
        if len(prompt_ids) + max_tokens > max_context:
            raise DiagError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                            f"context length {max_context}")
        ends = time.monotonic() + self.limits.request_timeout_s

        def on_token(token_ids: list[int], text: str) -> bool:
            job.tokens += len(token_ids)
            if time.monotonic() > ends:
                job.timed_out = True
                return False
            if on_delta is not None and text:
                on_delta(text)
            return not job.cancelled.is_set()

        top = body.top_logprobs if body.logprobs else 0
        # only when there is one: an unconstrained request calls the engine exactly as before
        constrained = {"constraint": job.constraint} if job.constraint is not None else {}
        generation = engine.generate(
            prompt_ids=prompt_ids,
            tree_budget=budget.resolve(body.tree_budget, self.default_tree_budget),
            temperature=body.temperature,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=body.stop,
            top_logprobs=max(top or 0, 1 if body.logprobs else 0),
            on_token=on_token,
            **constrained,
        )
        if generation.finish_reason == "cancelled" and not job.timed_out:
            self.metrics.count("cancelled")  # nobody is left to answer
        return generation

    # -- from the event loop -------------------------------------------------------------------

    def constraint_for(self, body: ChatRequest) -> Any:
        """The request's compiled constraint (None: free text); ApiError (400) naming what the
        grammar cannot do. Compiled before queueing, so a streamed request is refused with a 400
        rather than an error event."""
        if not body.wants_constraint():
            return None
        tool_mode = body.tool_mode()
        response_format = body.response_format.model_dump(by_alias=True, exclude_none=True) \
            if body.response_format is not None and body.response_format.type != "text" else None
        try:
            from ddtree_diag.engine.grammar import GrammarError, compile_constraint
        except ImportError as exc:  # llguidance (the engine extra) missing
            raise ApiError(400, f"structured output is not available on this server: {exc}",
                           param="response_format" if response_format else "tools") from None
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()] if tool_mode != "none" else None
        choice = body.tool_choice
        tool_choice = choice.model_dump() if hasattr(choice, "model_dump") else choice
        try:
            return compile_constraint(self.engine.tokenizer, response_format=response_format, tools=tools,
                                      tool_choice=tool_choice if tools else None, thinking=body.thinking() is True)
        except GrammarError as exc:
            raise ApiError(400, str(exc), param=grammar_param(str(exc), response_format is not None,
                                                              tool_mode)) from None

    async def complete(self, body: ChatRequest, job: Job, request: Request) -> Any:
        """The finished generation of a request that does not stream; ApiError when it failed,
        ran past the deadline or its client left."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, self.generate, body, job)
        try:
            while True:  # wait for the engine, watching for a client that gives up
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await request.is_disconnected():
                    job.cancelled.set()  # frees the worker at the next round
            generation = future.result()
        except Exception as exc:
            raise self.engine_error(exc) from None
        if job.timed_out:
            raise self.deadline_error(job)
        if generation is None:
            raise ApiError(499, "client closed the request")
        return generation

    def start_streaming(self, body: ChatRequest, job: Job) -> asyncio.Queue:
        """Queue the generation; its events arrive on the returned queue: ``("delta", text)``
        while it runs, then ``("done", generation or None)`` or ``("error", exception)``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(event: tuple[str, Any]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        def work() -> None:
            try:
                put(("done", self.generate(body, job, lambda text: put(("delta", text)))))
            except Exception as exc:  # reported in the stream; the worker stays healthy
                put(("error", exc))

        loop.run_in_executor(self.executor, work)  # the worker drains it; nothing waits on the result
        return queue

    # -- errors --------------------------------------------------------------------------------

    def deadline_error(self, job: Job) -> ApiError:
        return ApiError(408, f"generation stopped at this server's per-request limit of "
                        f"{self.limits.request_timeout_s:g} s (serve --request-timeout) after {job.tokens} tokens",
                        kind="timeout_error", code="request_timeout")

    @staticmethod
    def engine_error(exc: Exception) -> ApiError:
        if isinstance(exc, DiagError):  # e.g. prompt longer than the context: the client's doing
            return ApiError(400, str(exc))
        return ApiError(500, f"engine error: {type(exc).__name__}: {exc}", kind="server_error")


def grammar_param(message: str, has_format: bool, tool_mode: str) -> str:
    """Which field a grammar refusal is about: the one its message names, else the one sent."""
    for field in ("tool_choice", "tools", "response_format"):
        if field in message:
            return field
    return "response_format" if has_format and tool_mode != "forced" else "tools"
