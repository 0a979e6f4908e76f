"""ddtree-mlx style servers: thinking only via chat_template_args, a `ddtree_stats` object,
``stream`` ignored, ``finish_reason`` always ``stop``."""

from __future__ import annotations

from typing import Any

from ddtree_diag.backends.dialects.base import Dialect, ParsedResponse, first, integer, num
from ddtree_diag.records import ProbeCase, SpecMetrics


class DDTreeMLX(Dialect):
    name = "ddtree-mlx"
    description = "ddtree-mlx: chat_template_args.enable_thinking, top-level tree_budget, `ddtree_stats`"
    owner_names = ("ddtree-mlx",)
    sends_budget = True
    budget_knob = "top-level tree_budget per request"
    ignores_stream = True
    detect_order = 5  # before ddtree: "ddtree-mlx" contains "ddtree"

    def shape(self, body: dict[str, Any], case: ProbeCase) -> None:
        if case.enable_thinking is not None:  # the only toggle it reads; thinking defaults off there
            body["chat_template_args"] = {"enable_thinking": case.enable_thinking}
        if case.tree_budget is not None:
            body["tree_budget"] = case.tree_budget

    def detect(self, extras: dict[str, Any]) -> bool:
        return isinstance(extras.get("ddtree_stats"), dict)

    def read_spec(self, extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
        stats = extras.get("ddtree_stats")
        if not isinstance(stats, dict):
            return SpecMetrics()
        return SpecMetrics(
            decode_rounds=integer(first(stats, "cycles", "decode_rounds")),
            mean_acceptance_length=num(first(stats, "avg_acceptance", "mean_acceptance_length")),
            # tok_per_sec includes prefill on these servers; kept as the server's own figure.
            server_tokens_per_second=num(first(stats, "tok_per_sec", "tokens_per_second")),
            tree_budget=integer(stats.get("tree_budget")),
            source="response.ddtree_stats",
        )

    def fix_quirks(self, parsed: ParsedResponse, case: ProbeCase) -> None:
        if (
            parsed.finish_reason == "stop"
            and parsed.completion_tokens is not None
            and parsed.completion_tokens >= case.max_tokens
        ):
            # It says "stop" even when it cut at max_tokens; report what happened.
            parsed.finish_reason = "length"
            parsed.notes.append("server said finish_reason=stop at max_tokens; reported as length")
