"""Server-wide spec counters parsed with prometheus_client, and before/after deltas."""

from __future__ import annotations

import pytest

from ddtree_diag.backends.metrics import parse_spec_counters

PAGE = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 0.0
"""


def test_sums_engines_and_ignores_created():
    counters = parse_spec_counters(PAGE)
    assert counters is not None and counters.prefix == "vllm:"
    assert counters.drafts == 15 and counters.draft_tokens == 60 and counters.accepted_tokens == 30
    assert counters.accepted_per_position == {0: 12.0, 1: 8.0}


def test_names_without_total_suffix_and_llamacpp_prefix():
    page = "llamacpp:spec_decode_num_drafts 4\nllamacpp:spec_decode_num_accepted_tokens 6\n"
    counters = parse_spec_counters(page)
    assert counters.prefix == "llamacpp:" and counters.drafts == 4 and counters.accepted_tokens == 6


def test_delta_gives_rounds_and_mean_acceptance_marked_server_wide():
    before = parse_spec_counters(PAGE)
    after = parse_spec_counters(PAGE.replace("} 10.0", "} 14.0").replace("} 30.0", "} 38.0"))
    spec = after.delta(before)
    assert spec.decode_rounds == 4 and spec.accepted_tokens == 8
    assert spec.mean_acceptance_length == pytest.approx(3.0)
    assert spec.server_wide and "server-wide" in spec.source


def test_zero_rounds_leaves_acceptance_unknown():
    counters = parse_spec_counters(PAGE)
    assert counters.delta(counters).mean_acceptance_length is None


def test_page_without_spec_counters():
    assert parse_spec_counters("# TYPE up gauge\nup 1\n") is None


def test_garbage_page_raises_value_error():
    with pytest.raises(ValueError):
        parse_spec_counters("this is { not prometheus\n")
