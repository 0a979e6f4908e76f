"""A saved report edited by hand (or cut, or from another tool) is one line naming the broken field
and exit 2 in ``report`` and ``diff``, never an internal error deep in the rendering."""

from __future__ import annotations

import json

import pytest

from ddtree_diag.errors import UsageError
from ddtree_diag.output.reportfile import load_any, report_json
from ddtree_diag.records import ProbeCase, ProbeResult, RunReport


def saved(tmp_path, change) -> str:
    report = RunReport(results=[ProbeResult(case=ProbeCase(prompt_id="p", messages=[]), output="Hi.")])
    data = json.loads(report_json(report))
    change(data)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    return str(path)


BROKEN = {
    "output a number": (lambda d: d["results"][0].__setitem__("output", 5), "results[0]: output: expected text"),
    "target text": (lambda d: d.__setitem__("target", "x"), "target: expected an object"),
    "results text": (lambda d: d.__setitem__("results", "x"), "results: expected a list"),
    "no case": (lambda d: d["results"][0].pop("case"), "results[0]: missing 'case'"),
    "spec text": (lambda d: d["results"][0].__setitem__("spec", "x"), "results[0]: expected a JSON object"),
    "result a list": (lambda d: d["results"].__setitem__(0, [1]), "results[0]: expected a JSON object"),
    "tokens as text": (lambda d: d["results"][0].__setitem__("completion_tokens", "7"),
                       "results[0]: completion_tokens: expected a number or null"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_field_is_named_at_load(tmp_path, name):
    change, needle = BROKEN[name]
    with pytest.raises(UsageError) as caught:
        load_any(saved(tmp_path, change))
    assert needle in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("command", ["report", "diff"])
def test_report_and_diff_refuse_a_broken_report_in_one_line(cli, tmp_path, command):
    broken = saved(tmp_path, BROKEN["output a number"][0])
    result = cli(command, broken, broken) if command == "diff" else cli(command, broken)
    assert result.code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "output: expected text" in lines[0] and "internal error" not in lines[0]


def test_an_intact_report_still_loads(tmp_path):
    report = load_any(saved(tmp_path, lambda d: None))
    assert report.results[0].output == "Hi."


def test_a_fully_filled_report_written_by_the_tool_loads_back_equal(tmp_path):
    """Every field the tool writes passes the load's type checks: counts as ints, rates as floats
    (or ints), flags, optional fields as null, nested records."""
    from ddtree_diag.records import (
        BaselineComparison,
        Finding,
        GateCheck,
        GateResult,
        Reason,
        SpecMetrics,
        StructuredCheck,
        Timings,
        Verdict,
    )

    case = ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}], enable_thinking=True,
                     tree_budget=16, temperature=0.0, max_tokens=32, repeat=1)
    result = ProbeResult(
        case=case, output="Hi.", reasoning="think", tool_calls=[{"id": "c", "name": "f", "arguments": "{}"}],
        cached_tokens=3, finish_reason="stop", prompt_tokens=5, completion_tokens=2, http_status=200,
        timings=Timings(ttft_s=0.1, e2e_s=1, decode_tokens_per_second=40.5),
        spec=SpecMetrics(mean_acceptance_length=2.5, decode_rounds=4),
        quality=Verdict(garbage=False, score=0.0, reasons=[Reason("truncated", "cut", "", 0.0, None)]),
        structured=StructuredCheck("json_object", True), extras={"notes": ["n"]}, findings=["f1"], seq=0,
        baseline=BaselineComparison(mode="budget0", verdict="identical", char_index=None),
    )
    report = RunReport(results=[result], target={"url": "http://h"}, notes=["n"],
                       findings=[Finding("f1", "info", "t", "e", "c", ["p"])],
                       gate=GateResult(passed=True, checks=[GateCheck("max_garbage", True, "ok")]))
    path = tmp_path / "full.json"
    path.write_text(report_json(report))
    loaded = load_any(path)
    assert report_json(loaded) == report_json(report)
