"""Findings: each rule fires on a run that really has its problem and stays quiet on a healthy one.

Two sources of runs: the STAND-IN server started with a fault flag (the problem is real on the
wire), and a real healthy run's records with one field altered (margins and noise).
"""

from __future__ import annotations

import dataclasses

import pytest

from ddtree_diag.checks import findings
from ddtree_diag.checks.quality import assess_result
from ddtree_diag.records import RunReport
from tests.support.gatekit import finding_ids, gate_run

STORY_GARBAGE = "Thinking to the 1. 1. 题目:\nuser:\n# user: 1.\n# 1. 1. 1. 年 1 1. 三角形\n1."


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> RunReport:
    code, report, stdout = gate_run(tmp_path_factory.mktemp("healthy"))
    assert code == 0, stdout
    return report


def altered(report: RunReport) -> RunReport:
    """A copy of a real run, to alter one field of."""
    return RunReport.from_dict(report.to_dict())


@pytest.mark.parametrize("rule", findings.RULES, ids=lambda r: r.__name__)
def test_every_rule_is_quiet_on_a_healthy_run(healthy, rule):
    assert rule(healthy) == []


@pytest.mark.parametrize(
    "flags, expected",
    [(("--thinking-garbage",), "garbage-only-thinking"),
     (("--thinking-low-acceptance",), "thinking-acceptance-drop"),
     (("--early-stop",), "early-stop"),
     (("--loop",), "garbage-high-acceptance"),
     (("--lossy",), "lossless-mismatch"),
     (("--lossy", "--tie-gap", "0.01"), "lossless-near-tie"),
     (("--flaky-text",), "repeats-disagree"),
     (("--inverse-budget",), "acceptance-not-rising-with-budget"),
     (("--rounds-mismatch",), "metrics-contradict"),
     (("--server-tps", "5000"), "server-client-speed-mismatch"),
     (("--acceptance-decay",), "acceptance-falling-across-repeats"),
     (("--ignore-budget",), "budget-not-honoured"),  # its budget0 baseline speculates
     (("--early-stop",), "garbage-also-in-baseline")],  # the stand-in says it at budget 0 too
)
@pytest.mark.e2e
def test_each_rule_fires_on_a_server_with_the_fault(tmp_path, flags, expected):
    _code, report, stdout = gate_run(tmp_path, flags)
    assert expected in finding_ids(report), (finding_ids(report), stdout[-2000:])
    item = next(f for f in report.findings if f.id == expected)
    assert item.severity in findings.SEVERITIES and item.title and item.evidence and item.check
    assert item.cases, "a finding names the cases it is about"
    by_id = {r.case_id: r for r in report.results}
    assert all(expected in by_id[c].findings for c in item.cases)
    assert item.title in stdout  # shown under the table


@pytest.mark.e2e
def test_story_run_names_thinking_and_early_stop(tmp_path):
    # The story: thinking off stops at "Hello,", thinking on is garbage.
    _code, report, _ = gate_run(tmp_path, ("--early-stop", "--thinking-garbage"))
    ids = finding_ids(report)
    assert "early-stop" in ids and "garbage-only-thinking" not in ids  # off is garbage too
    early = next(f for f in report.findings if f.id == "early-stop")
    assert "'Hello,'" in early.evidence and all("think=off" in c for c in early.cases)


@pytest.mark.e2e
def test_a_llamacpp_server_that_ignores_the_budget_fails_the_lossless_check_and_says_why(tmp_path):
    """Current llama.cpp servers drop a request's speculative.n_max: the budget0 baseline then
    speculates too, and comparing its text would prove nothing."""
    code, report, _ = gate_run(tmp_path, ("--ignore-budget",), dialect="llamacpp")
    assert code != 0
    compared = [r for r in report.results if r.baseline is not None and r.case.temperature == 0]
    assert compared and all(r.baseline.verdict == "error" for r in compared)
    assert all(r.baseline.detail.startswith("the baseline speculated") for r in compared)
    assert "draft tokens were proposed" in compared[0].baseline.detail
    item = next(f for f in report.findings if f.id == "budget-not-honoured")
    assert "speculative.n_max" in item.check and "--baseline url:URL" in item.check
    assert set(item.cases) == {r.case_id for r in compared}
    # the same server honouring the budget: quiet, and the baseline compares
    code, report, _ = gate_run(tmp_path, (), dialect="llamacpp")
    assert "budget-not-honoured" not in finding_ids(report)
    assert {r.baseline.verdict for r in report.results if r.baseline is not None} == {"identical"}


@pytest.mark.e2e
def test_a_url_baseline_that_speculates_is_no_baseline(tmp_path):
    from tests.support.processes import start_standin

    speculating = start_standin("--dialect", "vllm")  # reports its speculation per request
    try:
        _, report, _ = gate_run(tmp_path, (), dialect="vllm", args=("--baseline", f"url:{speculating.url}"))
    finally:
        speculating.process.terminate()
        speculating.process.wait(timeout=10)
    compared = [r for r in report.results if r.baseline is not None and r.case.temperature == 0]
    assert compared and {r.baseline.verdict for r in compared} == {"error"}
    assert all("it is no non-speculative run" in r.baseline.detail for r in compared)
    item = next(f for f in report.findings if f.id == "budget-not-honoured")
    assert item.title == "The lossless baseline speculates"


def test_a_budget_that_is_only_a_label_is_never_not_honoured(healthy):
    """vLLM and SGLang fix the draft at start: a matrix's budget is the run's label there, sent to
    nobody; the engine's chain mode drafts its block whatever the budget."""
    run = altered(healthy)
    for r in run.results:
        r.spec.decode_rounds, r.spec.mean_acceptance_length = 10, r.case.tree_budget + 3.0
    assert [f.id for f in findings.budget_not_honoured(run)] == ["budget-not-honoured"]  # ddtree: sent
    for dialect, mode in [("vllm", None), ("sglang", None), ("openai", None), ("engine", "chain")]:
        for r in run.results:
            r.dialect = dialect
            r.extras = {"mode": mode} if mode else {}
        assert findings.budget_not_honoured(run) == [], dialect
    for r in run.results:
        r.extras = {"mode": "tree"}
    assert findings.budget_not_honoured(run)  # the engine's tree mode takes the budget


@pytest.mark.parametrize(
    ("budget", "numbers", "overrun"),
    [
        (0, {"draft_tokens": 30, "accepted_tokens": 12}, "30 draft tokens were proposed and 12 accepted"),
        (0, {"draft_tokens": 0, "accepted_tokens": 0, "decode_rounds": 40, "mean_acceptance_length": 1.0}, None),
        (0, {"decode_rounds": 47, "mean_acceptance_length": 48 / 47}, None),  # the prefill's token counted
        (0, {"decode_rounds": 20, "mean_acceptance_length": 2.4}, "2.40 tokens were committed per round"),
        (2, {"decode_rounds": 10, "mean_acceptance_length": 3.9}, "at most 3 possible"),
        (2, {"decode_rounds": 10, "mean_acceptance_length": 3.1}, None),  # one token over: a count one off
        (2, {"mean_acceptance_length": 3.6}, None),  # no rounds: a short answer over one counted round
        (0, {"mean_acceptance_length": 2.0}, None),
        (4, {"acceptance_lengths": [1, 5, 6]}, "a round committed 6 tokens"),
        (4, {"acceptance_lengths": [1, 5, 5], "draft_tokens": 300, "decode_rounds": 3}, None),  # block drafts
        (None, {"draft_tokens": 30, "accepted_tokens": 12}, None),  # nothing sent: the server's own
        (0, {"draft_tokens": 30, "server_wide": True}, None),  # other traffic moves server-wide counters
    ],
)
def test_the_budget_overrun_rule(budget, numbers, overrun):
    from ddtree_diag.budget import overrun as budget_overrun
    from ddtree_diag.records import SpecMetrics

    why = budget_overrun(budget, SpecMetrics(**numbers))
    assert (why is None) if overrun is None else (why is not None and overrun in why), why


# --- records from a real run with one field altered: margins ----------------------------------


def test_rounds_accounting_margin(healthy):
    run = altered(healthy)
    target = run.results[0]
    target.spec.decode_rounds += 1  # 4 rounds × 2.33 = 9.3 for 7 tokens: a drift
    hits = findings.rounds_accounting(run)
    assert [f.cases for f in hits] == [[target.case_id]]
    assert findings.metrics_contradict(run) == []
    target.spec.decode_rounds += 3  # 7 rounds × 2.33 = 16 for 7 tokens: a contradiction
    assert findings.rounds_accounting(run) == []
    assert [f.cases for f in findings.metrics_contradict(run)] == [[target.case_id]]
    run = altered(healthy)
    for r in run.results:  # off by less than one token: the prefill token, rounding
        r.spec.mean_acceptance_length = (r.completion_tokens + 0.9) / r.spec.decode_rounds
    assert findings.rounds_accounting(run) == []


def test_speed_mismatch_margin(healthy):
    run = altered(healthy)
    for r in run.results:
        r.spec.server_tokens_per_second = r.timings.decode_tokens_per_second * 2.5
    assert findings.server_client_speed_mismatch(run) == []
    for r in run.results:
        r.spec.server_tokens_per_second = r.timings.decode_tokens_per_second / 5
    assert [f.id for f in findings.server_client_speed_mismatch(run)] == ["server-client-speed-mismatch"]


def test_budget_margin(healthy):
    run = altered(healthy)
    for r in run.results:
        if r.case.tree_budget == 64:
            r.spec.mean_acceptance_length -= 0.15  # noise
    assert findings.acceptance_not_rising_with_budget(run) == []
    for r in run.results:
        if r.case.tree_budget == 64:
            r.spec.mean_acceptance_length -= 0.6
    hit = findings.acceptance_not_rising_with_budget(run)
    assert hit and all("budget=64" in c or "budget=16" in c for c in hit[0].cases)


def test_thinking_acceptance_margin(healthy):
    run = altered(healthy)
    for r in run.results:
        if r.case.enable_thinking:
            r.spec.mean_acceptance_length = 2.0  # 86% of thinking off: normal
    assert findings.thinking_acceptance_drop(run) == []
    for r in run.results:
        if r.case.enable_thinking:
            r.spec.mean_acceptance_length = 1.2
    hit = findings.thinking_acceptance_drop(run)
    assert hit and "1.20 on vs 2.33 off" in hit[0].evidence


def test_repeat_drop_margin(healthy):
    run = altered(healthy)
    for r in run.results:
        if r.case.repeat == 1:
            r.spec.mean_acceptance_length -= 0.1
    assert findings.acceptance_falling_across_repeats(run) == []
    for r in run.results:
        if r.case.repeat == 1:
            r.spec.mean_acceptance_length -= 0.8
    assert findings.acceptance_falling_across_repeats(run)


def test_garbage_high_acceptance_needs_high_acceptance(healthy):
    run = altered(healthy)
    loop = run.results[0]
    loop.output = "the " * 32
    loop.finish_reason = "length"
    loop.completion_tokens = 32
    assess_result(loop)
    assert loop.quality.garbage
    assert findings.garbage_with_high_acceptance(run) == []  # a loop at normal acceptance
    loop.spec.mean_acceptance_length = 6.0
    assert findings.garbage_with_high_acceptance(run)[0].cases == [loop.case_id]


def test_garbage_only_thinking_needs_clean_thinking_off(healthy):
    run = altered(healthy)
    for r in run.results:
        if r.case.enable_thinking:
            r.output = STORY_GARBAGE
            assess_result(r)
    hit = findings.garbage_only_with_thinking(run)
    assert hit and len(hit[0].cases) == 4
    off = next(r for r in run.results if r.case.enable_thinking is False)
    off.output = STORY_GARBAGE
    assess_result(off)
    assert findings.garbage_only_with_thinking(run) == []


def test_early_stop_is_quiet_on_a_complete_short_answer(healthy):
    run = altered(healthy)
    short = run.results[0]
    short.output, short.completion_tokens = "Hello!", 2
    assess_result(short)
    assert findings.early_stop(run) == []
    short.output = "Hello,"
    assess_result(short)
    assert findings.early_stop(run)[0].cases == [short.case_id]


def test_repeats_disagree_from_altered_text(healthy):
    run = altered(healthy)
    r1 = next(r for r in run.results if r.case.repeat == 1)
    r1.output = r1.output.replace("nice", "good")
    hit = findings.repeats_disagree(run)
    assert hit and r1.case_id in hit[0].cases and "char 13" in hit[0].evidence


@pytest.mark.parametrize(("target", "moe"), [
    ({"model": "Qwen/Qwen3-Coder-30B-A3B-Instruct"}, True),
    ({"model": "openai/gpt-oss-20b"}, True),
    ({"model": "tiny", "backend": "engine", "experts": {"count": 4, "per_token": 2}}, True),
    ({"model": "Qwen/Qwen3-8B"}, False),
    ({"model": "deepseek-r1-distill-qwen-7b"}, False),
])
def test_a_mismatch_on_an_moe_target_names_router_flips_as_a_cause(healthy, target, moe):
    run = altered(healthy)
    run.target = target
    run.results[0].baseline = dataclasses.replace(run.results[0].baseline, verdict="mismatch", field="output",
                                                  char_index=0, expected="⟨a", actual="⟨b", detail="x")
    found = findings.baseline_divergence(run)[0]
    assert found.id == "lossless-mismatch" and "accept walk" in found.check
    assert ("mixture of experts" in found.check) == moe


def test_analyse_orders_by_severity_and_tags_results(healthy):
    run = altered(healthy)
    for r in run.results:
        r.spec.server_tokens_per_second = 1.0  # warning
    run.results[0].baseline = dataclasses.replace(run.results[0].baseline, verdict="mismatch", field="output",
                                                  char_index=0, expected="⟨a", actual="⟨b", detail="x")
    out = findings.analyse(run)
    assert [f.id for f in out] == ["lossless-mismatch", "server-client-speed-mismatch"]
    assert run.results[0].findings == ["lossless-mismatch", "server-client-speed-mismatch"]
    assert run.findings is out


# --------------------------------------------------------------------------------------------
# Collapse, metric contradictions, state across the run, the canary: a real healthy run with
# the numbers a faulty server would send. Every rule is also quiet on the healthy run above.


def test_acceptance_collapse_is_an_error_that_names_causes(healthy):
    run = altered(healthy)
    for r in run.results:
        r.spec.mean_acceptance_length = 1.0
        r.spec.decode_rounds = r.completion_tokens
        r.spec.acceptance_lengths = None
    [item] = findings.acceptance_collapse(run)
    assert item.severity == "error" and "draft" in item.check and "target_layer_ids" in item.check
    assert "mask_token_id" in item.check and len(item.cases) == len(run.results)
    assert "--baseline budget0" in item.check  # the ddtree dialect takes a per-request budget
    run.target["dialect"] = "vllm"  # a server whose budget is fixed at start: no budget0 advice
    [item] = findings.acceptance_collapse(run)
    assert "budget0" not in item.check and "--baseline url:URL" in item.check
    # Half the cases collapsing is a budget problem, not a collapse; so is garbage at acceptance 1.
    half = altered(healthy)
    for r in half.results[: len(half.results) // 2]:
        r.spec.mean_acceptance_length, r.spec.decode_rounds = 1.0, r.completion_tokens
    assert findings.acceptance_collapse(half) == []


@pytest.mark.parametrize(
    "change, words",
    [(lambda r: setattr(r.spec, "accepted_tokens", (r.spec.draft_tokens or 10) + 5) or
      setattr(r.spec, "draft_tokens", r.spec.draft_tokens or 10), "drafted"),
     (lambda r: setattr(r.spec, "mean_acceptance_length", r.case.tree_budget + 3.0), "tree_budget"),
     (lambda r: setattr(r.spec, "acceptance_lengths", [2] * (r.spec.decode_rounds + 3)), "per-round lengths for"),
     (lambda r: setattr(r.spec, "mean_acceptance_length", 0.5), "< 1"),
     (lambda r: setattr(r.spec, "decode_rounds", r.spec.decode_rounds * 4), "completion tokens"),
     (lambda r: setattr(r, "output", "tokenizers split words " * 20), "characters of text"),
     (lambda r: setattr(r, "completion_tokens", r.case.max_tokens + 5), "max_tokens")],
    ids=["accepted>drafted", "above-budget", "lengths-vs-rounds", "below-one", "rounds-x-acceptance",
         "usage-below-the-text", "usage-above-max-tokens"],
)
def test_metric_contradictions_are_errors(healthy, change, words):
    run = altered(healthy)
    change(run.results[0])
    hits = findings.metrics_contradict(run)
    assert [f.cases for f in hits] == [[run.results[0].case_id]], hits
    assert hits[0].severity == "error" and words in hits[0].evidence


def test_acceptance_decaying_over_the_run_order_is_found_across_cases(healthy):
    run = altered(healthy)
    for r in [*run.results, run.canary]:  # no repeat falls alone: the decay is over the run
        r.spec.mean_acceptance_length = max(1.0, 3.0 * 0.85 ** r.seq)
    [item] = findings.acceptance_decays_over_run(run)
    assert item.severity == "error" and "order" in item.evidence
    reordered = altered(run)
    reordered.canary = None
    for r in reordered.results:  # the same numbers sent in another order: no trend
        r.seq = (r.seq * 5) % len(reordered.results)
    assert findings.acceptance_decays_over_run(reordered) == []


def test_canary_that_differs_is_an_error(healthy):
    run = altered(healthy)
    first = run.results[0]
    run.canary = dataclasses.replace(first, output=first.output + " extra", seq=len(run.results))
    [item] = findings.canary_differs(run)
    assert item.severity == "error" and "differs from char" in item.evidence
    run.canary = dataclasses.replace(first, seq=len(run.results))
    assert findings.canary_differs(run) == []


def test_garbage_shared_with_the_baseline_is_named_by_kind(healthy):
    run = altered(healthy)
    for r in run.results:
        r.output = "Hello!<|im_end|>\n<|im_start|>user\nhi"
        assess_result(r)
        r.baseline.verdict = "identical"
    [item] = findings.garbage_also_in_baseline(run)
    assert "chat-template tokens" in item.title and "stop tokens" in item.check
    for r in run.results:  # undecoded pieces the baseline returns too: the serving path, not the model
        r.output = "ĠThe Ġsky Ġis Ġblue Ġbecause Ġof ĠRayleigh Ġscattering."
        assess_result(r)
    [item] = findings.garbage_also_in_baseline(run)
    assert "undecoded token pieces" in item.title and "detokenizer" in item.check


def test_findings_come_from_one_registry_and_the_readme_shows_it():
    """Every rule names the kinds it reports; their ids, severities, critical flags and README
    lines are one registry, and the README's findings table is generated from it."""
    from ddtree_diag.checks import gate
    from tests.support.processes import ROOT

    ids = [kind.id for kind in findings.FINDINGS]
    assert len(set(ids)) == len(ids) and all(rule.kinds for rule in findings.RULES)
    assert all(set(kind.severities) <= set(findings.SEVERITIES) for kind in findings.FINDINGS)
    assert gate.CRITICAL_FINDINGS is findings.CRITICAL_FINDINGS
    assert {"acceptance-collapse", "metrics-contradict", "canary-differs"} == findings.CRITICAL_FINDINGS
    assert findings.readme_table() in (ROOT / "README.md").read_text(encoding="utf-8")
    # every finding is built by its registered kind (FindingKind.found), none by hand
    sources = {name: (ROOT / f"ddtree_diag/checks/{name}.py").read_text(encoding="utf-8")
               for name in ("findings", "findings_base", "workloads")}
    assert sum(source.count("Finding(") for source in sources.values()) == 1


def test_a_finding_keeps_to_its_registered_severities():
    kind = findings.BY_ID["acceptance-decays-over-run"]
    assert kind.found("t", "e", "c", ["a", "a"], severity="error").cases == ["a"]
    assert findings.BY_ID["early-stop"].found("t", "e", "c", []).severity == "error"
    with pytest.raises(ValueError, match="early-stop"):
        findings.BY_ID["early-stop"].found("t", "e", "c", [], severity="info")


def test_garbage_kinds_read_the_reason_code_registry():
    from ddtree_diag.checks.quality.registry import BY_CODE

    assert findings.garbage_kinds(["punct_run", "template_leak", "truncated", "word_salad"]) == [
        "chat-template tokens", "word salad", "repetition"]
    assert findings.garbage_kinds(["not_greedy"]) == []
    assert all(BY_CODE[code].kind == "repetition" for code in findings.LOOP_CODES)
