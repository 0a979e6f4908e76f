"""Report formats for CI: a Markdown summary and JUnit XML.

Both read a finished RunReport only (gate verdict, findings, results), so ``report RUN.json``
re-renders a saved run exactly as the gate wrote it. JUnit is built with ElementTree (never by
string concatenation): one testcase per case × check, failing when that check failed because of
that case, plus one run-level testcase for a failed check that names no case.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path
from statistics import mean
from typing import Any

from ddtree_diag.records import ProbeResult, RunReport
from ddtree_diag.report import write_atomic

DASH = "—"
OUTPUT_CHARS = 60


def checks_for(report: RunReport) -> dict[str, Any]:
    """The gate verdict, or — for a plain probe run — the probe's own pass/fail checks."""
    if report.gate is not None:
        return report.gate
    from ddtree_diag.gate import GateConfig, evaluate

    config = GateConfig(max_failed=0, max_garbage=0, lossless=any(r.baseline for r in report.results))
    return evaluate(report, config)


# ---------------------------------------------------------------------------------------------
# Markdown


def _cell(text: Any) -> str:
    """One Markdown table cell: no newlines, pipes escaped, control characters visible."""
    from ddtree_diag.render import visible

    return visible(str(text), 10_000).replace("|", "\\|").replace("`", "'")


def _num(value: float | int | None, spec: str = ".2f") -> str:
    return DASH if value is None else format(value, spec)


def _quality(result: ProbeResult) -> str:
    if not result.ok:
        return f"✗ {result.status}"
    quality = result.quality
    if quality is None:
        return DASH
    reasons = [r.get("code", "") for r in quality.get("reasons") or []]
    if quality.get("garbage"):
        return "✗ " + (reasons[0] if reasons else "garbage")
    return "✓ truncated" if quality.get("truncated") else "✓"


def _lossless(result: ProbeResult) -> str:
    baseline = result.baseline
    if not baseline:
        return DASH
    verdict = baseline.get("verdict", "")
    mark = {"identical": "✓", "near_tie": "≈ near-tie", "mismatch": "✗ mismatch", "error": "? error"}
    text = mark.get(verdict, verdict)
    if verdict in ("mismatch", "near_tie") and baseline.get("char_index") is not None:
        text += f" @{baseline['char_index']}"
    return text


def markdown_summary(report: RunReport, exit_code: int | None = None) -> str:
    gate = checks_for(report)
    lines: list[str] = []
    title = "gate" if report.gate is not None else "probe"
    verdict = "✅ passed" if gate["passed"] else "❌ failed"
    if report.interrupted:
        verdict += " (interrupted: partial results)"
    lines.append(f"## ddtree-diag {title}: {verdict}")
    lines.append("")
    target = report.target
    bits = [target.get("url") or target.get("engine") or target.get("target") or "",
            target.get("model") or "", f"dialect {target['dialect']}" if target.get("dialect") else "",
            f"matrix {Path(target['matrix']).name}" if target.get("matrix") else ""]  # fmt: skip
    if any(bits):
        lines.append("**Target:** " + " · ".join(_cell(b) for b in bits if b))
    results = report.results
    failed = sum(1 for r in results if not r.ok)
    garbage = sum(1 for r in results if r.quality and r.quality.get("garbage"))
    accepts = [r.spec.mean_acceptance_length for r in results if r.ok and r.spec.mean_acceptance_length is not None]
    run = [f"{len(results)} cases", f"{len(results) - failed} ok", f"{failed} failed", f"{garbage} garbage"]
    if accepts:
        run.append(f"mean acceptance {mean(accepts):.2f}")
    if exit_code is not None:
        run.append(f"exit {exit_code}")
    lines.append("**Run:** " + " · ".join(run))
    lines.append("")

    lines.append("### Checks")
    lines.append("")
    lines.append("| | check | detail |")
    lines.append("|---|---|---|")
    for check in gate["checks"]:
        lines.append(f"| {'✅' if check['passed'] else '❌'} | {_cell(check['name'])} | {_cell(check['detail'])} |")
    if not gate["checks"]:
        lines.append("| ✅ | (none configured) | |")
    lines.append("")

    lines.append("### Findings")
    lines.append("")
    if not report.findings:
        lines.append("No findings.")
    for item in report.findings:
        lines.append(f"- **{item.get('severity', 'info')}** — {_cell(item.get('title', ''))} (`{item.get('id')}`)")
        if item.get("evidence"):
            lines.append(f"  - evidence: {_cell(item['evidence'])}")
        if item.get("check"):
            lines.append(f"  - check: {_cell(item['check'])}")
    lines.append("")

    lines.append("### Cases")
    lines.append("")
    lines.append("| case | tok | finish | rounds | accept | tok/s srv | tok/s cli | quality | lossless | output |")
    lines.append("|---|---:|---|---:|---:|---:|---:|---|---|---|")
    for r in results:
        spec = r.spec
        mark = ("~" if spec.derived else "") + ("*" if spec.server_wide else "")
        output = r.output if r.ok else (r.error or "")
        if r.ok and not output and r.reasoning:
            output = f"[reasoning] {r.reasoning}"
        from ddtree_diag.render import visible

        row = [
            _cell(r.case_id), _num(r.completion_tokens, "d"), _cell(r.finish_reason or DASH),
            (mark + _num(spec.decode_rounds, "d")) if spec.decode_rounds is not None else DASH,
            (mark + _num(spec.mean_acceptance_length)) if spec.mean_acceptance_length is not None else DASH,
            _num(spec.server_tokens_per_second, ".1f"), _num(r.timings.decode_tokens_per_second, ".1f"),
            _cell(_quality(r)), _cell(_lossless(r)), _cell(visible(output, OUTPUT_CHARS)),
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    if report.notes:
        lines.append("<details><summary>Notes</summary>")
        lines.append("")
        lines.extend(f"- {_cell(n)}" for n in report.notes)
        lines.append("")
        lines.append("</details>")
        lines.append("")
    return "\n".join(lines)


def write_summary(report: RunReport, path: str | None, exit_code: int | None = None) -> None:
    """Write the Markdown summary to ``path`` (atomically) and append it to
    ``$GITHUB_STEP_SUMMARY`` when that is set (GitHub Actions' job summary)."""
    text = markdown_summary(report, exit_code)
    if path:
        write_atomic(path, text)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as handle:
            handle.write(text + "\n")


# ---------------------------------------------------------------------------------------------
# JUnit XML


def junit_xml(report: RunReport) -> str:
    gate = checks_for(report)
    suites = ET.Element("testsuites", name="ddtree-diag")
    suite = ET.SubElement(suites, "testsuite", name="ddtree-diag " + ("gate" if report.gate is not None else "probe"))
    if report.started_at:
        suite.set("timestamp", report.started_at)
    properties = ET.SubElement(suite, "properties")
    for key in ("url", "engine", "model", "dialect", "matrix"):
        if report.target.get(key):
            ET.SubElement(properties, "property", name=key, value=str(report.target[key]))
    by_id = {r.case_id: r for r in report.results}
    tests = failures = 0
    for check in gate["checks"]:
        named = [c for c in check["cases"] if c in by_id]
        for result in report.results:
            tests += 1
            case = ET.SubElement(suite, "testcase", classname=f"ddtree-diag.{check['name']}", name=result.case_id)
            if result.timings.e2e_s is not None:
                case.set("time", f"{result.timings.e2e_s:.3f}")
            if not check["passed"] and result.case_id in named:
                failures += 1
                failure = ET.SubElement(case, "failure", message=_xml_safe(check["detail"]), type=check["name"])
                failure.text = _xml_safe(_case_failure_text(check, result))
        if not check["passed"] and not named:
            tests += 1
            failures += 1
            case = ET.SubElement(suite, "testcase", classname=f"ddtree-diag.{check['name']}", name="(run)")
            failure = ET.SubElement(case, "failure", message=_xml_safe(check["detail"]), type=check["name"])
            failure.text = _xml_safe(check["detail"])
    if report.findings:
        out = ET.SubElement(suite, "system-out")
        out.text = _xml_safe("\n".join(
            f"[{f.get('severity')}] {f.get('title')}\n  evidence: {f.get('evidence')}\n  check: {f.get('check')}"
            for f in report.findings
        ))  # fmt: skip
    for element in (suite, suites):
        element.set("tests", str(tests))
        element.set("failures", str(failures))
        element.set("errors", "0")
    suite.set("skipped", "0")
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _case_failure_text(check: dict[str, Any], result: ProbeResult) -> str:
    from ddtree_diag.render import visible

    lines = [check["detail"], f"case: {result.case_id}"]
    if not result.ok:
        lines.append(f"status: {result.status}: {result.error}")
    else:
        lines.append(f"output: {visible(result.output, 200)}")
        if result.quality and result.quality.get("garbage"):
            for reason in (result.quality.get("reasons") or [])[:3]:
                lines.append(f"quality: {reason.get('code')}: {reason.get('detail')}")
        if result.baseline and result.baseline.get("verdict") not in (None, "identical", "skipped"):
            lines.append(f"baseline: {result.baseline.get('detail')}")
            if result.baseline.get("expected") is not None:
                lines.append(f"  expected: {visible(result.baseline['expected'], 200)}")
                lines.append(f"  actual:   {visible(result.baseline['actual'], 200)}")
        if result.spec.mean_acceptance_length is not None:
            lines.append(f"acceptance: {result.spec.mean_acceptance_length:.2f}")
    return "\n".join(lines)


def _xml_safe(text: str) -> str:
    """XML 1.0 cannot hold most control characters, even escaped: make them visible."""
    return "".join(
        ch if ch in "\t\n\r" or (0x20 <= ord(ch) <= 0xD7FF) or (0xE000 <= ord(ch) <= 0xFFFD)
        or 0x10000 <= ord(ch) <= 0x10FFFF else f"\\x{ord(ch):02x}"
        for ch in text
    )  # fmt: skip


def write_junit(report: RunReport, path: str) -> None:
    write_atomic(path, junit_xml(report))
