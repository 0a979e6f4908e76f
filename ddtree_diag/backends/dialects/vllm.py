"""vLLM: chat_template_kwargs, per-request `metrics.speculative_decoding` (>= 0.29 with
--per-request-spec-decode-metrics), else server-wide /metrics counters."""

from __future__ import annotations

from typing import Any

from ddtree_diag.backends.dialects.base import Dialect, ParsedResponse, first, integer, num
from ddtree_diag.records import SpecMetrics


class VLLM(Dialect):
    name = "vllm"
    description = "vLLM: chat_template_kwargs; `metrics.speculative_decoding` or /metrics counters"
    owner_names = ("vllm",)
    budget_knob = "num_speculative_tokens in --speculative-config at server start"
    detect_order = 50  # "metrics" is a generic name: after the specific extras

    def detect(self, extras: dict[str, Any]) -> bool:
        return "metrics" in extras  # vLLM sends "metrics": null when per-request metrics are off

    def read_spec(self, extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
        metrics = extras.get("metrics")
        stats = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
        if not isinstance(stats, dict):
            return SpecMetrics()
        rounds = integer(first(stats, "num_spec_steps", "num_drafts"))
        accepted = integer(first(stats, "num_accepted_draft_tokens", "num_accepted_tokens"))
        mean = num(stats.get("mean_acceptance_length"))
        if mean is None and rounds and accepted is not None:
            mean = 1 + accepted / rounds
        return SpecMetrics(
            decode_rounds=rounds,
            mean_acceptance_length=mean,
            draft_tokens=integer(stats.get("num_draft_tokens")),
            accepted_tokens=accepted,
            source="response.metrics.speculative_decoding",
        )
