"""Lossless comparison: divergence location, near-tie classification, baseline specs, and the
logprobs the HTTP dialects now keep for it."""

from __future__ import annotations

import pytest

from ddtree_diag.backends import dialects
from ddtree_diag.checks import lossless
from ddtree_diag.errors import UsageError
from ddtree_diag.records import ProbeCase, ProbeResult, RunReport


def entry(token: str, logprob: float, *alternatives: tuple[str, float]) -> dict:
    top = [{"token": token, "logprob": logprob}] + [{"token": t, "logprob": lp} for t, lp in alternatives]
    return {"token": token, "logprob": logprob, "top_logprobs": top}


def result(output: str, *, repeat: int = 0, temperature: float = 0.0, logprobs=None, reasoning=None,
           **extras) -> ProbeResult:
    case = ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}], repeat=repeat,
                     temperature=temperature, tree_budget=16)
    r = ProbeResult(case=case, output=output, reasoning=reasoning)
    if logprobs is not None:
        r.extras["logprobs"] = {"content": logprobs}
    r.extras.update(extras)
    return r


SPEC = lossless.BaselineSpec(mode="budget0")
BASE_TOKENS = [entry("The", -0.01), entry(" cat", -0.7, (" dog", -0.72)), entry(" sat", -0.1, (" ran", -3.0))]


def test_first_difference_and_context():
    assert lossless.first_difference("abc", "abc") is None
    assert lossless.first_difference("abX", "abc") == 2
    assert lossless.first_difference("ab", "abc") == 2  # one is a prefix of the other
    assert lossless.around("Hello world", 6, chars=3) == "…lo ⟨wor…"
    assert lossless.around("abc", 3) == "abc⟨end of text⟩"


def test_identical():
    record = lossless.compare_result(result("The cat sat"), result("The cat sat", logprobs=BASE_TOKENS), SPEC)
    assert record.verdict == "identical" and record.baseline_output == "The cat sat"


def test_near_tie_when_the_runner_up_is_within_the_gap():
    record = lossless.compare_result(result("The dog sat"), result("The cat sat", logprobs=BASE_TOKENS), SPEC)
    assert record.verdict == "near_tie"
    assert record.char_index == 4 and record.token_index == 1
    assert record.logprob_gap == pytest.approx(0.02)
    assert record.expected == "The ⟨cat sat" and record.actual == "The ⟨dog sat"


def test_mismatch_when_the_gap_is_large_or_the_token_is_not_a_candidate():
    spec = lossless.BaselineSpec(mode="budget0", near_tie_gap=0.01)
    record = lossless.compare_result(result("The dog sat"), result("The cat sat", logprobs=BASE_TOKENS), spec)
    assert record.verdict == "mismatch" and "not a near-tie" in record.detail
    record = lossless.compare_result(result("The cow sat"), result("The cat sat", logprobs=BASE_TOKENS), SPEC)
    assert record.verdict == "mismatch" and "not among the baseline's top 2" in record.detail


def test_mismatch_without_logprobs_says_it_cannot_classify():
    record = lossless.compare_result(result("The dog sat"), result("The cat sat"), SPEC)
    assert record.verdict == "mismatch" and record.token_index is None
    assert "no logprobs" in record.detail


def test_token_ids_locate_the_divergence_without_logprobs():
    record = lossless.compare_result(result("The dog sat", token_ids=[1, 9, 3]),
                                     result("The cat sat", token_ids=[1, 2, 3]), SPEC)
    assert record.token_index == 1 and record.verdict == "mismatch"


def test_divergence_in_the_answer_after_separated_reasoning():
    # The baseline's tokens cover reasoning + answer; the answer sits at the end of them.
    tokens = [entry("Think", -0.1), entry(".", -0.1), entry("Yes", -0.5, ("No", -0.51))]
    record = lossless.compare_result(result("No", reasoning="Think."),
                                     result("Yes", reasoning="Think.", logprobs=tokens), SPEC)
    assert record.field == "output" and record.token_index == 2 and record.verdict == "near_tie"


def test_reasoning_divergence_is_found_first():
    record = lossless.compare_result(result("Yes", reasoning="Hmm"), result("Yes", reasoning="Hm!"), SPEC)
    assert record.field == "reasoning" and record.char_index == 2


def test_failed_baseline_is_an_error_not_a_mismatch():
    base = result("")
    base.status, base.error = "http_error", "HTTP 500: boom"
    record = lossless.compare_result(result("x"), base, SPEC)
    assert record.verdict == "error" and "HTTP 500" in record.detail


def test_repeat_disagreements_only_at_temperature_zero():
    report = RunReport(results=[result("a b c"), result("a b d", repeat=1),
                                result("x", temperature=0.7), result("y", temperature=0.7, repeat=1)])
    found = lossless.repeat_disagreements(report)
    assert len(found) == 1 and found[0].char_index == 4 and found[0].cases[1].endswith("/r1")


@pytest.mark.parametrize(
    "value, mode, url",
    [("budget0", "budget0", None), ("engine", "engine", None),
     ("url:http://h:1/v1", "url", "http://h:1"), ({"mode": "url", "url": "http://h:2"}, "url", "http://h:2"),
     ({"mode": "budget0", "near_tie_gap": 0.1}, "budget0", None)],
)
def test_parse_baseline(value, mode, url):
    spec = lossless.parse_baseline(value)
    assert spec.mode == mode and spec.url == url


@pytest.mark.parametrize("value", ["url:", "budget", {"mode": "budget0", "near_tie_gap": -1},
                                   {"mode": "budget0", "top_logprobs": 50}, {"mode": 3}])
def test_parse_baseline_errors(value):
    with pytest.raises(UsageError):
        lossless.parse_baseline(value)


def test_dialects_keep_logprobs_in_bodies_and_streams():
    case = ProbeCase(prompt_id="p", messages=[])
    content = [entry("Hi", -0.1), entry("!", -0.2)]
    body = {"choices": [{"message": {"content": "Hi!"}, "finish_reason": "stop", "logprobs": {"content": content}}]}
    assert dialects.parse_body("openai", body, case).extras["logprobs"] == {"content": content}
    stream = dialects.get("openai").accumulator()
    for item in content:
        stream.feed({"choices": [{"delta": {"content": item["token"]}, "logprobs": {"content": [item]}}]})
    assert stream.result(case).extras["logprobs"] == {"content": content}
