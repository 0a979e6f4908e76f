"""`diff A.json B.json` over fleet reports: targets matched by name, a missing target is a
regression, a single run judged against (or by) every target of a fleet; the console table, the
JSON and the HTML page; two single runs still diffed as before."""

from __future__ import annotations

import copy
import io
import json
from html.parser import HTMLParser

import pytest

from ddtree_diag.output.console import make_console
from ddtree_diag.output.diff import diff_runs
from ddtree_diag.output.fleetdiff import FleetDiff, diff_fleets, html_fleet_diff, render_fleet_diff
from ddtree_diag.output.html import CSP, html_diff
from ddtree_diag.output.reportfile import write_report
from ddtree_diag.records import FleetMember, FleetReport, RunReport
from tests.support import browser
from tests.support.reportkit import slower_copy, varied_report

needs_chromium = pytest.mark.skipif(browser.chromium() is None, reason=browser.MISSING)


def fleet(**runs: RunReport) -> FleetReport:
    """A fleet report with one target per keyword (``gpu_1`` is named ``gpu-1``)."""
    return FleetReport(targets=[FleetMember(name.replace("_", "-"), copy.deepcopy(run)) for name, run in runs.items()],
                       matrix="smoke (built-in)", tool_version="0.0.0")


def saved(tmp_path, name: str, report: RunReport | FleetReport) -> str:
    path = tmp_path / name
    write_report(report, str(path))
    return str(path)


class Ids(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: list[str] = []
        self.tags: set[str] = set()
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.ids += [value for key, value in attrs if key == "id" and value]


@pytest.fixture
def good() -> RunReport:
    return varied_report()


# ---- the CLI -----------------------------------------------------------------------------------


def test_one_replica_regressing_fails_and_is_named(cli, tmp_path, good):
    a = saved(tmp_path, "a.json", fleet(gpu_1=good, gpu_2=good, gpu_3=good))
    b = saved(tmp_path, "b.json", fleet(gpu_1=good, gpu_2=slower_copy(good), gpu_3=good))
    result = cli("diff", a, b)
    assert result.code == 1, result.stderr
    out = result.stdout
    assert "3 target(s) compared, 1 regressed: gpu-2" in out
    # the per-target table, then the regressed target's own case table under its rule
    assert out.index("| gpu-3") < out.index("target gpu-2") < out.rindex("regression: ")
    assert "target gpu-2" in out and "target gpu-1" not in out and "target gpu-3" not in out
    assert f"{b}[gpu-2]" in out and "acceptance 3.00 → 2.50" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| gpu-")}
    assert set(rows) == {"gpu-1", "gpu-2", "gpu-3"}
    assert "none" in rows["gpu-1"] and "✗" in rows["gpu-2"] and "none" in rows["gpu-3"]


def test_identical_fleets_pass(cli, tmp_path, good):
    a = saved(tmp_path, "a.json", fleet(gpu_1=good, gpu_2=good))
    result = cli("diff", a, a)
    assert result.code == 0, result.stdout + result.stderr
    assert "2 target(s) compared, 0 regressed" in result.stdout and "0 regression(s)" in result.stdout
    assert "regression:" not in result.stdout


def test_a_missing_target_is_a_regression_a_new_one_is_not(cli, tmp_path, good):
    a = saved(tmp_path, "a.json", fleet(gpu_1=good, gpu_2=good))
    b = saved(tmp_path, "b.json", fleet(gpu_1=good))
    c = saved(tmp_path, "c.json", fleet(gpu_1=good, gpu_2=good, gpu_3=good))
    missing = cli("diff", a, b)
    assert missing.code == 1
    assert "regression: target gpu-2 missing from B" in missing.stdout
    assert "missing from B: gpu-2" in missing.stdout
    grown = cli("diff", a, c)
    assert grown.code == 0, grown.stdout
    assert "new in B (not judged): gpu-3" in grown.stdout


def test_a_single_run_is_judged_against_every_target(cli, tmp_path, good):
    single = saved(tmp_path, "good.json", good)
    replicas = saved(tmp_path, "fleet.json", fleet(gpu_1=good, gpu_2=slower_copy(good), gpu_3=good))
    out = tmp_path / "diff.json"
    result = cli("diff", single, replicas, "--json", str(out))
    assert result.code == 1
    # the line may wrap at the console's width (xdist's tmp paths are long)
    assert (f"{single} is a single run: every target of {replicas} is judged against it"
            in " ".join(result.stdout.split()))
    data = json.loads(out.read_text())
    assert data["single_run"] == "A" and list(data["targets"]) == ["gpu-1", "gpu-2", "gpu-3"]
    assert all(d["shared_cases"] == len(good.results) for d in data["targets"].values())
    assert {line.split(":")[0] for line in data["regressions"]} == {"gpu-2"}
    assert any(line.startswith("A is a single run") for line in data["summary"])
    # the other way round: one candidate run judged against each replica of the fleet
    slow = saved(tmp_path, "slow.json", slower_copy(good))
    reverse = cli("diff", replicas, slow, "--json", "-")
    assert reverse.code == 1
    data = json.loads(reverse.stdout)
    assert data["single_run"] == "B" and list(data["targets"]) == ["gpu-1", "gpu-2", "gpu-3"]
    # gpu-2 was as slow as the candidate: only the other two see a regression
    assert [name for name, d in data["targets"].items() if d["regressed"]] == ["gpu-1", "gpu-3"]
    assert (f"{slow} is a single run: it is judged against every target of {replicas}"
            in " ".join(reverse.stderr.split()))


def test_json_shape(cli, tmp_path, good):
    a = saved(tmp_path, "a.json", fleet(gpu_1=good, gpu_2=good, gpu_4=good))
    b = saved(tmp_path, "b.json", fleet(gpu_1=good, gpu_2=slower_copy(good), gpu_3=good))
    result = cli("diff", a, b, "--json", "-")
    assert result.code == 1
    data = json.loads(result.stdout)  # nothing but JSON on stdout; the tables went to stderr
    assert "target gpu-2" in result.stderr
    assert data["kind"] == "fleet" and data["regressed"] is True and data["single_run"] is None
    assert list(data["targets"]) == ["gpu-1", "gpu-2"]
    per_target = data["targets"]["gpu-2"]
    assert set(per_target) == {"regressed", "regressions", "summary", "shared_cases", "cases"}
    assert per_target["regressed"] is True and data["targets"]["gpu-1"]["regressions"] == []
    assert data["regressions"][0] == "target gpu-4 missing from B"
    assert data["regressions"][1:] == [f"gpu-2: {line}" for line in per_target["regressions"]]
    assert data["missing_from_b"] == ["gpu-4"] and data["new_in_b"] == ["gpu-3"]
    assert isinstance(data["summary"], list) and data["summary"][-1] == f"{len(data['regressions'])} regression(s)"


def test_html_page_has_a_section_per_target(cli, tmp_path, good):
    a = saved(tmp_path, "a.json", fleet(gpu_1=good, **{"gpu_<2>": good}))
    b = saved(tmp_path, "b.json", fleet(gpu_1=good, **{"gpu_<2>": slower_copy(good)}))
    page_path = tmp_path / "diff.html"
    result = cli("diff", a, b, "--html", str(page_path))
    assert result.code == 1
    page = page_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and CSP in page
    assert "ddtree-diag diff (fleet): ✗" in page
    assert "target gpu-1</h2>" in page and "target gpu-&lt;2&gt;</h2>" in page and "<2>" not in page
    assert "acceptance 3.00 → 2.50" in page
    parsed = Ids(page)
    assert len(parsed.ids) == len(set(parsed.ids))  # one section per target, ids still unique
    assert {"target-1-diff", "target-1-cases", "target-2-regressions"} <= set(parsed.ids)
    assert "script" not in parsed.tags


def test_two_single_runs_diff_as_before(cli, tmp_path, good):
    a, b = saved(tmp_path, "a.json", good), saved(tmp_path, "b.json", slower_copy(good))
    page_path = tmp_path / "diff.html"
    result = cli("diff", a, b, "--json", "-", "--html", str(page_path))
    assert result.code == 1
    data = json.loads(result.stdout)
    assert "kind" not in data and data == json.loads(json.dumps(diff_runs(good, slower_copy(good)).to_dict()))
    assert page_path.read_text(encoding="utf-8") == html_diff(diff_runs(good, slower_copy(good)), a, b)


def test_a_fleet_that_does_not_parse_is_one_line(cli, tmp_path, good):
    data = fleet(gpu_1=good).to_dict()
    data["targets"][0]["report"] = "nope"
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    result = cli("diff", str(path), str(path))
    assert result.code == 2 and "has no report" in result.stderr and "Traceback" not in result.stderr


# ---- in process --------------------------------------------------------------------------------


def test_diff_fleets_wants_a_fleet(good):
    with pytest.raises(ValueError, match="diff_runs"):
        diff_fleets(good, good)


def test_a_repeated_target_name_compares_the_first(good):
    repeated = FleetReport(targets=[FleetMember("gpu-1", good), FleetMember("gpu-1", slower_copy(good))])
    diff = diff_fleets(fleet(gpu_1=good), repeated)
    assert not diff.regressed
    assert "target gpu-1 appears more than once in B: only the first is compared" in diff.summary


def test_fleets_without_a_common_target_say_so(good):
    diff = diff_fleets(fleet(gpu_1=good), fleet(gpu_9=good))
    assert isinstance(diff, FleetDiff) and diff.targets == {}
    assert diff.regressions == ["target gpu-1 missing from B"]
    assert "no target was compared: the fleets share no target name" in diff.summary
    assert "<h2" in html_fleet_diff(diff, "a.json", "b.json")


@pytest.mark.parametrize("width", [80, 120])
def test_console_fits_the_width(monkeypatch, width, good):
    monkeypatch.setenv("COLUMNS", str(width))
    buffer = io.StringIO()
    diff = diff_fleets(fleet(gpu_1=good, gpu_2=good), fleet(gpu_1=good, gpu_2=slower_copy(good)))
    render_fleet_diff(make_console(buffer), diff, "runs/a.json", "runs/b.json")
    lines = buffer.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    assert any(line.startswith("---") and "target gpu-2" in line for line in lines)  # the rule, plain off a tty


def test_targets_are_listed_in_a_s_order_then_those_new_in_b(good):
    diff = diff_fleets(fleet(gpu_1=good, gpu_4=good, gpu_2=good), fleet(gpu_3=good, gpu_2=good, gpu_1=good))
    assert diff.names() == ["gpu-1", "gpu-4", "gpu-2", "gpu-3"]
    buffer = io.StringIO()
    render_fleet_diff(make_console(buffer), diff, "a.json", "b.json")
    rows = [line.split("|")[1].strip() for line in buffer.getvalue().splitlines() if line.startswith("| gpu-")]
    assert rows == diff.names()


@pytest.mark.e2e
@needs_chromium
def test_fleet_diff_page_renders_in_chromium_without_console_messages(tmp_path, good):
    diff = diff_fleets(fleet(gpu_1=good, gpu_2=good), fleet(gpu_1=good, gpu_2=slower_copy(good)))
    path = tmp_path / "diff.html"
    path.write_text(html_fleet_diff(diff, "a.json", "b.json"), encoding="utf-8")
    page = browser.load(path)
    assert page.returncode == 0 and page.console == [], page.console
    assert page.dom.count("<svg") == 4  # two charts per target
