"""SGLang: chat_template_kwargs; `return_spec_tokens_details` asks for `sglext.spec_tokens_details`."""

from __future__ import annotations

from typing import Any

from ddtree_diag.backends.dialects.base import Dialect, ParsedResponse, first, integer, num
from ddtree_diag.records import ProbeCase, SpecMetrics


class SGLang(Dialect):
    name = "sglang"
    description = "SGLang: chat_template_kwargs; `sglext.spec_tokens_details` (return_spec_tokens_details)"
    owner_names = ("sglang",)
    budget_knob = "--speculative-num-draft-tokens at server start"
    detect_order = 20

    def shape(self, body: dict[str, Any], case: ProbeCase) -> None:
        super().shape(body, case)
        body["return_spec_tokens_details"] = True
        if not body.get("stream"):
            # builds before spec_tokens_details put the counters in choices[0].meta_info, sent only
            # when asked (and refused with stream=true)
            body["return_meta_info"] = True

    def detect(self, extras: dict[str, Any]) -> bool:
        return "sglext" in extras or "meta_info" in extras

    def read_spec(self, extras: dict[str, Any], parsed: ParsedResponse) -> SpecMetrics:
        sglext = extras.get("sglext")
        stats = None
        if isinstance(sglext, dict):
            stats = sglext.get("spec_tokens_details", sglext)
        if not isinstance(stats, dict):
            meta = extras.get("meta_info")  # the native /generate shape, if a proxy passes it on
            stats = meta if isinstance(meta, dict) else None
        if not isinstance(stats, dict) or integer(stats.get("spec_verify_ct")) is None:
            return SpecMetrics()
        rounds = integer(stats.get("spec_verify_ct"))
        # field names changed across versions: accept all of them
        accepted = integer(first(stats, "spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num"))
        mean = num(stats.get("spec_accept_length"))
        if mean is None and rounds and parsed.completion_tokens is not None:
            mean = parsed.completion_tokens / rounds
        return SpecMetrics(
            decode_rounds=rounds,
            mean_acceptance_length=mean,
            draft_tokens=integer(
                first(stats, "spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
            ),
            accepted_tokens=accepted,
            source="response.sglext.spec_tokens_details",
        )
