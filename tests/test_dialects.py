"""Dialect request shaping and response parsing on documented body shapes (no I/O)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_diag.backends import dialects
from ddtree_diag.records import ProbeCase


def case(**kw) -> ProbeCase:
    base = dict(prompt_id="p", messages=[{"role": "user", "content": "hi"}], enable_thinking=True,
                tree_budget=32, max_tokens=48)
    base.update(kw)
    return ProbeCase(**base)


def body(extra: dict, content: str = "Hello there.", finish: str = "stop", completion: int = 9) -> dict:
    payload = {
        "id": "x", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": finish}],
        "usage": {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion},
    }
    payload.update(extra)
    return payload


@pytest.mark.parametrize(
    "dialect, present, absent",
    [
        ("ddtree", {"enable_thinking": True, "tree_budget": 32}, ["chat_template_kwargs"]),
        ("ddtree-mlx", {"chat_template_args": {"enable_thinking": True}, "tree_budget": 32},
         ["enable_thinking", "chat_template_kwargs", "stream_options"]),
        ("vllm", {"chat_template_kwargs": {"enable_thinking": True}}, ["tree_budget", "enable_thinking"]),
        ("sglang", {"chat_template_kwargs": {"enable_thinking": True}, "return_spec_tokens_details": True},
         ["tree_budget"]),
        ("llamacpp", {"chat_template_kwargs": {"enable_thinking": True}, "speculative.n_max": 32},
         ["tree_budget"]),
        ("openai", {"chat_template_kwargs": {"enable_thinking": True}},
         ["tree_budget", "return_spec_tokens_details"]),
    ],
)
def test_request_shape_per_dialect(dialect, present, absent):
    request = dialects.build_request(dialect, case(), "m", stream=True)
    for key, value in present.items():
        assert request[key] == value
    for key in absent:
        assert key not in request
    assert request["max_tokens"] == 48 and request["stream"] is True
    if dialect != "ddtree-mlx":
        assert request["stream_options"] == {"include_usage": True}


def test_unset_thinking_and_budget_are_not_sent():
    request = dialects.build_request("ddtree", case(enable_thinking=None, tree_budget=None), "m", stream=False)
    assert "enable_thinking" not in request and "tree_budget" not in request
    assert "stream_options" not in request


def test_minimal_request_has_only_the_core_and_user_extras():
    request = dialects.build_request("sglang", case(extra={"seed": 7}), "m", stream=True, minimal=True)
    assert set(request) == {"model", "messages", "max_tokens", "temperature", "stream", "seed"}


def test_ddtree_body():
    parsed = dialects.parse_body("ddtree", body({"ddtree": {
        "decode_rounds": 4, "mean_acceptance_length": 2.25, "tokens_per_second": 24.0,
        "acceptance_lengths": [3, 2, 2, 2]}}), case())
    spec = parsed.spec
    assert (spec.decode_rounds, spec.mean_acceptance_length, spec.server_tokens_per_second) == (4, 2.25, 24.0)
    assert spec.acceptance_lengths == [3, 2, 2, 2] and spec.source == "response.ddtree"
    assert parsed.output == "Hello there." and parsed.completion_tokens == 9


def test_ddtree_mlx_finish_reason_is_corrected_at_max_tokens():
    parsed = dialects.parse_body("ddtree-mlx", body(
        {"ddtree_stats": {"tree_budget": 64, "cycles": 16, "avg_acceptance": 3.0, "tok_per_sec": 20}},
        completion=48), case())
    assert parsed.finish_reason == "length" and parsed.notes
    assert parsed.spec.decode_rounds == 16 and parsed.spec.mean_acceptance_length == 3.0
    short = dialects.parse_body("ddtree-mlx", body({"ddtree_stats": {"cycles": 3, "avg_acceptance": 3.0}}),
                                case())
    assert short.finish_reason == "stop"


def test_vllm_metrics_and_null_metrics():
    parsed = dialects.parse_body("vllm", body({"metrics": {"speculative_decoding": {
        "mean_acceptance_length": 2.5, "num_spec_steps": 4, "num_draft_tokens": 12,
        "num_accepted_draft_tokens": 6}}}), case())
    assert parsed.spec.decode_rounds == 4 and parsed.spec.mean_acceptance_length == 2.5
    assert parsed.spec.draft_tokens == 12 and parsed.spec.accepted_tokens == 6
    off = dialects.parse_body("vllm", body({"metrics": None}), case())
    assert off.spec.decode_rounds is None and off.spec.mean_acceptance_length is None
    assert not off.spec.known


@pytest.mark.parametrize("accepted_key", ["spec_num_correct_drafts", "spec_accepted_drafts",
                                          "spec_accept_token_num"])
def test_sglang_accepts_renamed_fields(accepted_key):
    parsed = dialects.parse_body("sglang", body({"sglext": {"spec_tokens_details": {
        "spec_verify_ct": 3, accepted_key: 6, "spec_accept_length": 3.0}}}), case())
    assert parsed.spec.decode_rounds == 3 and parsed.spec.accepted_tokens == 6
    assert parsed.spec.mean_acceptance_length == 3.0


def test_sglang_acceptance_derived_from_rounds_when_missing():
    parsed = dialects.parse_body("sglang", body({"sglext": {"spec_tokens_details": {"spec_verify_ct": 3}}},
                                                completion=9), case())
    assert parsed.spec.mean_acceptance_length == 3.0


def test_sglang_asks_for_meta_info_only_where_it_is_allowed():
    # older builds carry the counters in choices[0].meta_info, sent on request; streams refuse it
    assert dialects.build_request("sglang", case(), "m", stream=False)["return_meta_info"] is True
    assert "return_meta_info" not in dialects.build_request("sglang", case(), "m", stream=True)


def test_sglang_reads_the_counters_of_a_choices_meta_info():
    payload = body({})
    payload["choices"][0]["meta_info"] = {
        "spec_verify_ct": 4, "spec_accepted_drafts": 8, "spec_proposed_drafts": 12, "spec_accept_length": 3.0,
        "prompt_tokens": 5, "completion_tokens": 12,
    }
    spec = dialects.parse_body("sglang", payload, case()).spec
    assert (spec.decode_rounds, spec.accepted_tokens, spec.draft_tokens, spec.mean_acceptance_length) == (4, 8, 12, 3.0)


@pytest.mark.parametrize(
    ("dialect", "extra"),
    [
        ("sglang", {"sglext": {"spec_tokens_details": {"spec_verify_ct": 0, "spec_accept_length": 0.0}}}),
        ("ddtree-mlx", {"ddtree_stats": {"tree_budget": 16, "cycles": 0, "avg_acceptance": 0}}),
    ],
)
def test_a_mean_of_zero_over_no_round_is_no_acceptance(dialect, extra):
    spec = dialects.parse_body(dialect, body(extra, completion=1), case()).spec
    assert spec.decode_rounds == 0 and spec.mean_acceptance_length is None


def test_llamacpp_rounds_are_derived_and_marked():
    parsed = dialects.parse_body("llamacpp", body({"timings": {
        "predicted_n": 30, "predicted_per_second": 55.0, "draft_n": 40, "draft_n_accepted": 20}}), case())
    spec = parsed.spec
    assert spec.decode_rounds == 10 and spec.mean_acceptance_length == 3.0 and spec.derived
    assert spec.server_tokens_per_second == 55.0 and spec.draft_tokens == 40
    plain = dialects.parse_body("llamacpp", body({"timings": {"predicted_n": 30, "predicted_per_second": 9}}),
                                case())
    assert plain.spec.decode_rounds is None and plain.spec.server_tokens_per_second == 9


def test_openai_reports_nothing_unknown_is_none():
    parsed = dialects.parse_body("openai", body({}), case())
    spec = parsed.spec
    assert spec.decode_rounds is None and spec.mean_acceptance_length is None
    assert spec.server_tokens_per_second is None


def test_reasoning_is_separated():
    payload = body({})
    payload["choices"][0]["message"]["reasoning_content"] = "Let me think."
    parsed = dialects.parse_body("vllm", payload, case())
    assert parsed.reasoning == "Let me think." and parsed.output == "Hello there."


@pytest.mark.parametrize("bad", [{}, {"choices": []}, {"choices": [{"delta": {}}]}, {"choices": ["x"]}])
def test_unusable_bodies_raise_one_line(bad):
    with pytest.raises(ValueError) as info:
        dialects.parse_body("openai", bad, case())
    assert "\n" not in str(info.value)


def test_error_object_in_a_200_answer_is_named():
    with pytest.raises(ValueError, match="server error in a 200 answer: out of memory"):
        dialects.parse_body("openai", {"error": {"message": "out of memory\nat ..."}}, case())


def test_stream_accumulator_merges_late_extras():
    acc = dialects.get("sglang").accumulator()
    acc.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert acc.feed({"choices": [{"delta": {"content": "Hel"}}]}) == "Hel"
    acc.feed({"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]})
    acc.feed({"choices": [], "sglext": {"spec_tokens_details": {"spec_verify_ct": 2, "spec_accept_length": 1.5}}})
    acc.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
    parsed = acc.result(case())
    assert parsed.output == "Hello" and parsed.finish_reason == "stop" and parsed.completion_tokens == 3
    assert parsed.spec.decode_rounds == 2 and parsed.spec.mean_acceptance_length == 1.5


@pytest.mark.parametrize(
    "extras, expected",
    [({"ddtree": {}}, "ddtree"), ({"ddtree_stats": {}}, "ddtree-mlx"), ({"sglext": None}, "sglang"),
     ({"timings": {}}, "llamacpp"), ({"metrics": None}, "vllm"), ({}, None)],
)
def test_detect_from_extras(extras, expected):
    assert dialects.detect_from_extras(extras) == expected


def test_detect_from_owner():
    assert dialects.detect_from_owner("vllm") == "vllm"
    assert dialects.detect_from_owner("llamacpp") == "llamacpp"
    assert dialects.detect_from_owner("openai") is None


@pytest.mark.parametrize("name", dialects.DIALECTS)
def test_every_registered_dialect_is_documented_and_builds_a_request(name):
    """A new dialect is covered by the registry-driven tests (here, the fuzz and the end-to-end
    probe over the stand-in); this one asks for its README row and a request it can send."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert f"| `{name}`" in readme, f"the README's dialect table has no row for {name}"
    case = ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}], enable_thinking=True,
                     tree_budget=16, max_tokens=8)
    body = dialects.build_request(name, case, "m", stream=True)
    assert body["model"] == "m" and body["messages"] == case.messages and body["stream"] is True
