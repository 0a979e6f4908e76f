"""llama.cpp's llama-server: `timings` with draft counts (no round count: rounds are derived)."""

from __future__ import annotations

from typing import Any

from ddtree_diag.backends.dialects.base import Dialect, ParsedResponse, integer, num
from ddtree_diag.records import ProbeCase, SpecMetrics


class LlamaCpp(Dialect):
    name = "llamacpp"
    description = "llama.cpp: chat_template_kwargs, speculative.n_max; `timings` (rounds derived)"
    owner_names = ("llamacpp", "llama.cpp")
    sends_budget = True  # a chain's budget is its draft length: speculative.n_max
    budget_knob = "speculative.n_max per request"
    close_after_stream = True
    detect_order = 30

    def shape(self, body: dict[str, Any], case: ProbeCase) -> None:
        super().shape(body, case)
        if case.tree_budget is not None:
            # For a chain draft the tree budget is the draft length: verify at most N draft tokens.
            body["speculative.n_max"] = case.tree_budget

    def detect(self, extras: dict[str, Any]) -> bool:
        return isinstance(extras.get("timings"), dict)

    def read_spec(self, extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
        timings = extras.get("timings")
        if not isinstance(timings, dict):
            return SpecMetrics()
        if parsed.cached_tokens is None:
            parsed.cached_tokens = integer(timings.get("cache_n"))  # prompt tokens reused from the cache
        spec = SpecMetrics(server_tokens_per_second=num(timings.get("predicted_per_second")), source="response.timings")
        predicted = integer(timings.get("predicted_n"))
        drafted = integer(timings.get("draft_n"))
        accepted = integer(timings.get("draft_n_accepted"))
        if drafted is not None and accepted is not None and predicted and predicted > 0 and accepted >= 0:
            # No round count: each round commits its accepted drafts plus one token of its own,
            # so rounds ~= predicted - accepted (+-1 for the prefill token).
            spec.draft_tokens = drafted
            spec.accepted_tokens = accepted
            spec.decode_rounds = max(predicted - accepted, 1)
            spec.mean_acceptance_length = predicted / spec.decode_rounds
            spec.derived = True
            spec.source = "response.timings (rounds derived: predicted_n - draft_n_accepted)"
        return spec
