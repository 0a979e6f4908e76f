"""Gate outputs (JUnit, Markdown, $GITHUB_STEP_SUMMARY) and the `report` / `diff` commands,
on real runs against the STAND-IN server."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ddtree_diag.checks import findings, gate
from ddtree_diag.output import junit, markdown
from ddtree_diag.records import RunReport, Verdict
from tests.support.gatekit import ALL_CHECKS, write_matrix
from tests.support.processes import run_cli, start_standin

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A healthy run and a lossy one, each with every gate output written."""
    base = tmp_path_factory.mktemp("formats")
    matrix = write_matrix(base)
    out = {}
    for name, flags in (("healthy", ()), ("lossy", ("--lossy",))):
        server = start_standin("--dialect", "ddtree", *flags)
        step = base / f"{name}.step.md"
        step.write_text("# earlier step\n")
        try:
            result = run_cli("gate", str(matrix), "--url", server.url, "--json", str(base / f"{name}.json"),
                             "--junit", str(base / f"{name}.xml"), "--summary", str(base / f"{name}.md"),
                             env={"GITHUB_STEP_SUMMARY": str(step)})
        finally:
            server.process.terminate()
            server.process.wait(timeout=10)
        out[name] = {"code": result.code, "json": base / f"{name}.json", "xml": base / f"{name}.xml",
                     "md": base / f"{name}.md", "step": step, "stdout": result.stdout}
    return out


def load(path: Path) -> RunReport:
    return RunReport.from_dict(json.loads(path.read_text()))


def test_junit_counts_match_the_gate(runs):
    lossy = runs["lossy"]
    assert lossy["code"] == 1
    report = load(lossy["json"])
    root = ET.parse(lossy["xml"]).getroot()
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    checks = report.gate.checks
    assert len(cases) == len(checks) * len(report.results) == int(root.get("tests")) == int(suite.get("tests"))
    failed = [c for c in cases if c.find("failure") is not None]
    # lossless (every case) and findings (lossless-mismatch is an error) fail; nothing else does
    assert {c.get("classname") for c in failed} == {"ddtree-diag.lossless", "ddtree-diag.findings"}
    assert len(failed) == int(root.get("failures")) == 16
    lossless_failure = next(c for c in failed if c.get("classname") == "ddtree-diag.lossless").find("failure")
    assert lossless_failure.get("message") == next(c for c in checks if c.name == "lossless").detail
    assert "expected: Hello! It is ⟨nice to meet you." in lossless_failure.text
    assert "T=0 output differs" in suite.findtext("system-out")


def test_junit_of_a_healthy_run_has_no_failures(runs):
    root = ET.parse(runs["healthy"]["xml"]).getroot()
    assert int(root.get("tests")) == 8 * 10 and int(root.get("failures")) == 0  # 10 checks, the canary too
    assert root.find("testsuite/properties/property[@name='dialect']").get("value") == "ddtree"


def test_junit_run_level_failure_and_xml_unsafe_text():
    report = RunReport()  # no case ran: the gate fails with no case to blame
    from ddtree_diag.checks.gate import GateConfig, evaluate

    report.gate = evaluate(report, GateConfig(max_failed=0))
    root = ET.fromstring(junit.junit_xml(report).encode())
    case = root.find("testsuite/testcase")
    assert case.get("name") == "(run)" and case.find("failure").get("message") == "no case ran"
    assert junit._xml_safe("a\x00b\x1bc") == "a\\x00b\\x1bc"


def normalised(report: RunReport) -> RunReport:
    """Fix what changes between runs (port, timings) so the summary can be a snapshot."""
    report = RunReport.from_dict(report.to_dict())
    report.target["url"] = "http://127.0.0.1:PORT"
    report.target["matrix"] = "m.toml"
    report.started_at = report.finished_at = "2026-01-01T00:00:00+00:00"
    for r in report.results:
        r.timings.decode_tokens_per_second = 400.0
        r.timings.e2e_s = r.timings.ttft_s = 0.01
        r.spec.server_tokens_per_second = 450.0
    # The gate and findings quote those numbers: judge the normalised run again.
    findings.analyse(report)
    report.gate = gate.evaluate(report, gate.parse_gate(tomllib.loads(ALL_CHECKS)["gate"]))
    return report


def test_markdown_summary_snapshot(runs):
    lossy = runs["lossy"]
    report = load(lossy["json"])
    written = lossy["md"].read_text()
    assert written == markdown.markdown_summary(report, 1), "the file is the report's summary"
    text = markdown.markdown_summary(normalised(report), 1)
    snapshot = DATA / "gate_summary_lossy.md"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        snapshot.write_text(text)
    assert text == snapshot.read_text()


def test_github_step_summary_is_appended(runs):
    step = runs["healthy"]["step"].read_text()
    assert step.startswith("# earlier step\n")
    assert runs["healthy"]["md"].read_text() in step
    assert "## ddtree-diag gate: ✅ passed" in step


@pytest.mark.e2e
def test_report_rerenders_every_format(runs):
    path = str(runs["lossy"]["json"])
    markdown = run_cli("report", path, "--format", "markdown")
    assert markdown.code == 1 and markdown.stdout == runs["lossy"]["md"].read_text()
    junit = run_cli("report", path, "--format", "junit")
    assert junit.code == 1 and ET.fromstring(junit.stdout.encode()).get("failures") == "16"
    table = run_cli("report", path)
    assert table.code == 1
    assert "gate: FAILED" in table.stdout and "T=0 output differs from the non-speculative baseline" in table.stdout
    assert "✗ mismatch @13" in table.stdout
    healthy = run_cli("report", str(runs["healthy"]["json"]), "--format", "table")
    assert healthy.code == 0 and "gate: PASSED" in healthy.stdout


def test_report_of_a_probe_run_without_gate(standin, tmp_path):
    server = standin("--dialect", "ddtree")
    path = tmp_path / "probe.json"
    assert run_cli("probe", "--url", server.url, "--json", str(path)).code == 0
    junit = run_cli("report", str(path), "--format", "junit")
    root = ET.fromstring(junit.stdout.encode())
    assert junit.code == 0 and root.get("tests") == str(2 * 4) and root.get("failures") == "0"
    assert "## ddtree-diag probe: ✅ passed" in run_cli("report", str(path), "--format", "markdown").stdout


@pytest.mark.parametrize("args, needle", [(["nope.json"], "report not found"),
                                          (["{json}", "--format", "pdf"], "--format must be one of")])
@pytest.mark.e2e
def test_report_usage_errors(runs, args, needle):
    args = [a.replace("{json}", str(runs["healthy"]["json"])) for a in args]
    result = run_cli("report", *args)
    assert result.code == 2 and needle in result.stderr


@pytest.mark.e2e
def test_diff_same_run_is_clean(runs):
    path = str(runs["healthy"]["json"])
    result = run_cli("diff", path, path)
    assert result.code == 0 and "no case changed" in result.stdout and "0 regression(s)" in result.stdout


@pytest.mark.e2e
def test_diff_flags_a_real_regression(runs, tmp_path):
    out = tmp_path / "diff.json"
    # --tps-tolerance 1: the two runs' speeds differ with the machine's load, not with the fault
    result = run_cli("diff", str(runs["healthy"]["json"]), str(runs["lossy"]["json"]), "--json", str(out),
                     "--tps-tolerance", "1")
    assert result.code == 1
    assert "no longer matches the lossless baseline" in result.stdout and "text changed" in result.stdout
    data = json.loads(out.read_text())
    assert data["regressed"] is True and len(data["regressions"]) == 8
    assert all("lossless baseline" in line or "text changed" in line for line in data["regressions"])


@pytest.mark.e2e
def test_diff_json_to_stdout_is_only_json(runs):
    result = run_cli("diff", str(runs["healthy"]["json"]), str(runs["lossy"]["json"]), "--json", "-")
    assert result.code == 1
    assert json.loads(result.stdout)["regressed"] is True  # nothing but JSON on stdout
    assert "text changed" in result.stderr


def write_altered(runs, tmp_path, change) -> str:
    report = load(runs["healthy"]["json"])
    for r in report.results:
        change(r)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(report.to_dict()))
    return str(path)


@pytest.mark.e2e
def test_diff_acceptance_tolerance(runs, tmp_path):
    def drop(r):
        r.spec.mean_acceptance_length -= 0.5

    b = write_altered(runs, tmp_path, drop)
    a = str(runs["healthy"]["json"])
    result = run_cli("diff", a, b)
    assert result.code == 1 and "acceptance 2.33 → 1.83 (-0.50)" in result.stdout
    assert run_cli("diff", a, b, "--acceptance-tolerance", "0.6").code == 0


@pytest.mark.e2e
def test_diff_speed_tolerance(runs, tmp_path):
    def halve(r):
        r.timings.decode_tokens_per_second /= 2

    b = write_altered(runs, tmp_path, halve)
    a = str(runs["healthy"]["json"])
    result = run_cli("diff", a, b)
    assert result.code == 1 and "(-50%)" in result.stdout and "beyond the 30% tolerance" in result.stdout
    assert run_cli("diff", a, b, "--tps-tolerance", "0.6").code == 0


@pytest.mark.e2e
def test_diff_new_garbage_and_missing_case(runs, tmp_path):
    report = load(runs["healthy"]["json"])
    report.results[0].quality = Verdict.from_dict({"garbage": True, "reasons": [{"code": "token_loop"}]})
    dropped = report.results.pop()
    path = tmp_path / "b.json"
    path.write_text(json.dumps(report.to_dict()))
    result = run_cli("diff", str(runs["healthy"]["json"]), str(path))
    assert result.code == 1
    assert "now garbage (token_loop)" in result.stdout and f"{dropped.case_id}: missing from B" in result.stdout
