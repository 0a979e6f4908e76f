"""JUnit XML for CI test reporters.

Built with ElementTree (never by string concatenation) from a finished RunReport: one testcase
per case × check, failing when that check failed because of that case, plus one run-level
testcase for a failed check that names no case. Findings go to ``system-out``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from ddtree_diag.output.cells import visible
from ddtree_diag.output.markdown import checks_for
from ddtree_diag.output.reportfile import write_output
from ddtree_diag.records import Finding, GateCheck, ProbeResult, RunReport
from ddtree_diag.redaction import redacted_report


def junit_xml(report: RunReport) -> str:
    report = redacted_report(report)
    suites = ET.Element("testsuites", name="ddtree-diag")
    tests, failures = add_suite(suites, report)
    set_totals(suites, tests, failures)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def add_suite(parent: ET.Element, report: RunReport, *, name: str | None = None,
              classname: str = "ddtree-diag") -> tuple[int, int]:
    """One run's ``<testsuite>`` under ``parent``; returns its (tests, failures). A fleet builds
    one per target: ``name`` is the target's, ``classname`` prefixes every testcase's class so the
    targets' identical case ids stay apart in a CI reporter. The report must already be redacted."""
    gate = checks_for(report)
    suite = ET.SubElement(parent, "testsuite",
                          name=_xml_safe(name) if name is not None
                          else "ddtree-diag " + ("gate" if report.gate is not None else "probe"))
    if report.started_at:
        suite.set("timestamp", report.started_at)
    properties = ET.SubElement(suite, "properties")
    for key in ("url", "engine", "model", "dialect", "matrix"):
        if report.target.get(key):
            ET.SubElement(properties, "property", name=key, value=_xml_safe(str(report.target[key])))
    by_id = {r.case_id: r for r in report.results}
    tests = failures = 0
    for check in gate.checks:
        named = [c for c in check.cases if c in by_id]
        for result in report.results:
            tests += 1
            case = ET.SubElement(suite, "testcase", classname=f"{classname}.{check.name}",
                                 name=_xml_safe(result.case_id))
            if result.timings.e2e_s is not None:
                case.set("time", f"{result.timings.e2e_s:.3f}")
            if not check.passed and result.case_id in named:
                failures += 1
                failure = ET.SubElement(case, "failure", message=_xml_safe(check.detail), type=check.name)
                failure.text = _xml_safe(_case_failure_text(check, result))
        if not check.passed and not named:
            tests += 1
            failures += 1
            case = ET.SubElement(suite, "testcase", classname=f"{classname}.{check.name}", name="(run)")
            failure = ET.SubElement(case, "failure", message=_xml_safe(check.detail), type=check.name)
            failure.text = _xml_safe(check.detail)
    if report.findings:
        out = ET.SubElement(suite, "system-out")
        out.text = findings_text(report.findings)
    set_totals(suite, tests, failures)
    suite.set("skipped", "0")
    return tests, failures


def findings_text(findings: list[Finding]) -> str:
    """Findings as a ``system-out`` text: severity and title, evidence, what to check."""
    return _xml_safe("\n".join(
        f"[{f.severity}] {f.title}\n  evidence: {f.evidence}\n  check: {f.check}" for f in findings
    ))


def set_totals(element: ET.Element, tests: int, failures: int) -> None:
    element.set("tests", str(tests))
    element.set("failures", str(failures))
    element.set("errors", "0")


def _case_failure_text(check: GateCheck, result: ProbeResult) -> str:
    lines = [check.detail, f"case: {result.case_id}"]
    if not result.ok:
        lines.append(f"status: {result.status}: {result.error}")
    else:
        lines.append(f"output: {visible(result.output, 200)}")
        if result.quality is not None and result.quality.garbage:
            for reason in result.quality.reasons[:3]:
                lines.append(f"quality: {reason.code}: {reason.detail}")
        baseline = result.baseline
        if baseline is not None and baseline.verdict not in ("identical", "skipped"):
            lines.append(f"baseline: {baseline.detail}")
            if baseline.expected is not None:
                lines.append(f"  expected: {visible(baseline.expected, 200)}")
                lines.append(f"  actual:   {visible(baseline.actual or '', 200)}")
        if result.spec.mean_acceptance_length is not None:
            lines.append(f"acceptance: {result.spec.mean_acceptance_length:.2f}")
    return "\n".join(lines)


def _xml_safe(text: str) -> str:
    """XML 1.0 cannot hold most control characters, even escaped: make them visible."""
    return "".join(
        ch if ch in "\t\n\r" or (0x20 <= ord(ch) <= 0xD7FF) or (0xE000 <= ord(ch) <= 0xFFFD)
        or 0x10000 <= ord(ch) <= 0x10FFFF else f"\\x{ord(ch):02x}"
        for ch in text
    )


def write_junit(report: RunReport, path: str) -> None:
    write_output(path, junit_xml(report))
