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
