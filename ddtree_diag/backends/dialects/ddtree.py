"""Standalone DDTree servers (the story's server, and this project's ``serve``)."""

from __future__ import annotations

from typing import Any

from ddtree_diag.backends.dialects.base import Dialect, ParsedResponse, first, int_list, integer, num
from ddtree_diag.records import ProbeCase, SpecMetrics


class DDTree(Dialect):
    name = "ddtree"
    description = "standalone DDTree server: top-level enable_thinking and tree_budget, a `ddtree` object"
    owner_names = ("ddtree",)
    sends_budget = True
    budget_knob = "top-level tree_budget per request"
    detect_order = 10

    def shape(self, body: dict[str, Any], case: ProbeCase) -> None:
        if case.enable_thinking is not None:
            body["enable_thinking"] = case.enable_thinking
        if case.tree_budget is not None:
            body["tree_budget"] = case.tree_budget

    def detect(self, extras: dict[str, Any]) -> bool:
        return isinstance(extras.get("ddtree"), dict)

    def read_spec(self, extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
        stats = extras.get("ddtree")
        if not isinstance(stats, dict):
            return SpecMetrics()
        lengths = int_list(stats.get("acceptance_lengths"))
        rounds = integer(first(stats, "decode_rounds", "rounds", "num_rounds"))
        if rounds is None and lengths is not None:
            rounds = len(lengths)
        return SpecMetrics(
            decode_rounds=rounds,
            mean_acceptance_length=num(first(stats, "mean_acceptance_length", "mean_acceptance", "avg_acceptance")),
            acceptance_lengths=lengths,
            draft_tokens=integer(first(stats, "draft_tokens", "num_draft_tokens")),
            accepted_tokens=integer(first(stats, "accepted_tokens", "num_accepted_tokens")),
            server_tokens_per_second=num(first(stats, "tokens_per_second", "tok_per_sec")),
            tree_budget=integer(stats.get("tree_budget")),
            source="response.ddtree",
        )
