"""The server's Prometheus counters (/metrics), named as vLLM and llama.cpp name theirs."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]


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
        )
        # The same names vLLM and llama.cpp use, so server-wide probing works here too.
        self.drafts = Counter("ddtree_spec_decode_num_drafts", "Verify rounds with a draft", registry=r)
        self.draft_tokens = Counter("ddtree_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter(
            "ddtree_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )

    def count(self, status: int | str) -> None:
        """One request answered (or abandoned: ``cancelled``) with this status."""
        self.requests.labels(status=str(status)).inc()

    def record(self, generation: Any) -> None:
        self.prompt_tokens.inc(generation.prompt_tokens)
        self.generation_tokens.inc(generation.completion_tokens)
        if generation.mode != "ar":
            self.drafts.inc(generation.decode_rounds)
            self.draft_tokens.inc(sum(generation.tree_sizes))
            self.accepted_tokens.inc(sum(length - 1 for length in generation.acceptance_lengths))

    def finished(self, generation: Any, started: float) -> None:
        """A completed generation: its tokens, a 200, and its latency since ``started``."""
        self.record(generation)
        self.count(200)
        self.latency.observe(time.perf_counter() - started)

    def page(self) -> bytes:
        return generate_latest(self.registry)
