"""An in-process RunReport with everything a renderer must cope with: every axis varying, known
and unknown numbers, per-round acceptance, a failed case, garbage, a lossless mismatch, findings,
a gate, and hostile server text (markup, control characters, wide characters, very long lines).

Used by the layout (terminal widths) and HTML tests; built from the records alone, no server.
"""

from __future__ import annotations

import copy

from ddtree_diag.records import (
    BaselineComparison,
    Finding,
    GateCheck,
    GateResult,
    ProbeCase,
    ProbeResult,
    Reason,
    RunReport,
    SpecMetrics,
    Timings,
    Verdict,
)

HOSTILE = ('<script>alert("x")</script><img src=x onerror="alert(1)"> & </svg></table><!-- '
           "\x00\x1b[31mred\x1b[0m 题目:\nuser: 1. 1. 1. \ud800 ]]> {{7*7}}")
LONG_ERROR = "connection refused by 10.11.12.13:30000 after 3 retries " * 4


def _case(prompt: str, thinking: bool, budget: int, temperature: float = 0.0, repeat: int = 0) -> ProbeCase:
    return ProbeCase(prompt_id=prompt, messages=[{"role": "user", "content": f"{prompt}?"}],
                     enable_thinking=thinking, tree_budget=budget, temperature=temperature,
                     max_tokens=48 if prompt == "hello" else 128, repeat=repeat)


def _ok(case: ProbeCase, rounds: list[int], output: str, tps: float, server_tps: float | None = None,
        ttft: float | None = 0.125) -> ProbeResult:
    tokens = sum(rounds) + 1
    return ProbeResult(
        case=case, dialect="ddtree", model="m", output=output, finish_reason="stop",
        prompt_tokens=20, completion_tokens=tokens,
        timings=Timings(e2e_s=tokens / tps, ttft_s=ttft, decode_tokens_per_second=tps),
        spec=SpecMetrics(decode_rounds=len(rounds), mean_acceptance_length=round(sum(rounds) / len(rounds), 4),
                         acceptance_lengths=rounds, server_tokens_per_second=server_tps, source="response.ddtree"),
        quality=Verdict(garbage=False, score=0.0),
    )


def varied_report() -> RunReport:
    results = [
        _ok(_case("hello", False, 16), [3, 4, 2, 3], "Hello! It is nice to meet you.", 41.25, 44.5),
        _ok(_case("hello", False, 64), [4, 4, 5, 3, 1], "Hello! It is nice to meet you. " * 5, 38.5, 40.125),
        _ok(_case("hello", True, 16, repeat=1), [1, 2, 1, 1, 2, 1], HOSTILE, 12.75, None, None),
        _ok(_case("story", True, 64, temperature=0.7), [2, 2, 3, 1, 2, 2, 2], "Once upon a time 题目 " * 9, 23.0),
        ProbeResult(case=_case("story", False, 16, temperature=0.7), status="transport_error", error=LONG_ERROR),
    ]
    garbage = results[2]
    garbage.quality = Verdict(garbage=True, score=0.9, reasons=[
        Reason("degenerate_enumeration", "list markers that never advance", "1. 1. 1.", 0.9),
        Reason("script_mix", "CJK inside English", "题目", 0.7)])
    results[0].baseline = BaselineComparison(mode="budget0", verdict="identical")
    results[1].baseline = BaselineComparison(
        mode="budget0", verdict="mismatch", field="output", char_index=1234, token_index=310,
        expected="…meet ⟨you.", actual="…meet ⟨<b>them</b>.", detail="T=0 output differs")
    results[2].baseline = BaselineComparison(mode="budget0", verdict="near_tie", char_index=7)
    results[3].baseline = BaselineComparison(mode="budget0", verdict="skipped", detail="T>0")
    return RunReport(
        results=results,
        target={"url": "http://127.0.0.1:30000/v1", "model": "Qwen3-8B<script>", "dialect": "ddtree",
                "matrix": "smoke (built-in)"},
        notes=["dialect ddtree: the response carries a `ddtree` object " + "(detected from the first reply) " * 3],
        findings=[
            Finding("garbage-only-thinking", "error", "Thinking-on answers are garbage while thinking-off is clean",
                    "hello/think=on/budget=16/T=0/max=48/r1 garbage (degenerate_enumeration, acceptance 1.33); "
                    "every thinking-off case clean (acceptance 3.00 and 3.40)",
                    "the chat template's thinking branch, and what the draft was trained on",
                    cases=[garbage.case_id]),
            Finding("thinking-acceptance-drop", "warning", "Acceptance drops with thinking on",
                    "budget 16: 1.33 vs 3.00 (44 %)", "draft training data"),
        ],
        gate=GateResult(passed=False, checks=[
            GateCheck("max_garbage", False, "1 garbage case > 0 allowed", [garbage.case_id]),
            GateCheck("min_mean_acceptance", True, "mean acceptance 2.49 >= 1.10")]),
        started_at="2026-11-01T10:00:00+00:00", finished_at="2026-11-01T10:00:09+00:00", tool_version="0.0.0",
    )


def slower_copy(report: RunReport) -> RunReport:
    """The same run with every acceptance 0.5 lower and half the speed: a regression to diff."""
    other = copy.deepcopy(report)
    for result in other.results:
        if result.spec.mean_acceptance_length is not None:
            result.spec.mean_acceptance_length -= 0.5
        if result.timings.decode_tokens_per_second is not None:
            result.timings.decode_tokens_per_second /= 2
    other.results[0].output = "Hello there."
    return other
