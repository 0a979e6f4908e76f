"""The Markdown summary for CI (a job summary, a PR comment).

It reads a finished RunReport only (gate verdict, findings, results), so ``report RUN.json``
re-renders a saved run exactly as the gate wrote it.
"""

from __future__ import annotations

import os
from pathlib import Path
from statistics import mean
from typing import Any

from ddtree_diag.output import loadview
from ddtree_diag.output.cells import (
    DASH,
    acceptance_cell,
    context_rows,
    fmt,
    lossless_cell,
    output_text,
    quality_cell,
    rounds_cell,
    visible,
    workload_cell,
)
from ddtree_diag.output.reportfile import append_output, write_output
from ddtree_diag.records import Finding, GateResult, RunReport
from ddtree_diag.redaction import redacted_report

OUTPUT_CHARS = 60


def checks_for(report: RunReport) -> GateResult:
    """The gate verdict, or — for a plain probe run — the probe's own pass/fail checks."""
    if report.gate is not None:
        return report.gate
    from ddtree_diag.checks.gate import default_config, evaluate

    return evaluate(report, default_config(lossless=any(r.baseline for r in report.results)))


def _cell(text: Any) -> str:
    """One Markdown table cell: no newlines, pipes escaped, control characters visible."""
    return visible(str(text), 10_000).replace("|", "\\|").replace("`", "'")


def finding_lines(findings: list[Finding], none: str) -> list[str]:
    """Findings as a Markdown list (severity, title, id, then evidence and check), or ``none``."""
    lines = [] if findings else [none]
    for item in findings:
        lines.append(f"- **{item.severity}** — {_cell(item.title)} (`{_cell(item.id)}`)")
        if item.evidence:
            lines.append(f"  - evidence: {_cell(item.evidence)}")
        if item.check:
            lines.append(f"  - check: {_cell(item.check)}")
    return lines


def markdown_summary(report: RunReport, exit_code: int | None = None) -> str:
    report = redacted_report(report)
    gate = checks_for(report)
    lines: list[str] = []
    title = "gate" if report.gate is not None else "probe"
    verdict = "✅ passed" if gate.passed else "❌ failed"
    if report.interrupted:
        verdict += f" ({report.stop_label() or 'interrupted: partial results'})"
    lines.append(f"## ddtree-diag {title}: {verdict}")
    lines.append("")
    target = report.target
    bits = [target.get("url") or target.get("engine") or target.get("target") or "",
            target.get("model") or "", f"dialect {target['dialect']}" if target.get("dialect") else "",
            f"matrix {Path(target['matrix']).name}" if target.get("matrix") else ""]
    if any(bits):
        lines.append("**Target:** " + " · ".join(_cell(b) for b in bits if b))
    results = report.results
    failed = sum(1 for r in results if not r.ok)
    garbage = sum(1 for r in results if r.garbage)
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
    for check in gate.checks:
        lines.append(f"| {'✅' if check.passed else '❌'} | {_cell(check.name)} | {_cell(check.detail)} |")
    if not gate.checks:
        lines.append("| ✅ | (none configured) | |")
    lines.append("")

    lines.append("### Findings")
    lines.append("")
    lines += finding_lines(report.findings, "No findings.")
    lines.append("")

    lines.append("### Cases")
    lines.append("")
    lines.append("| case | tok | finish | rounds | accept | tok/s srv | tok/s cli | quality | lossless | output |")
    lines.append("|---|---:|---|---:|---:|---:|---:|---|---|---|")
    for r in results:
        workload = workload_cell(r).text
        row = [
            _cell(r.case_id + (f" ({workload})" if workload else "")), fmt(r.completion_tokens, "d"),
            _cell(r.finish_reason or DASH),
            rounds_cell(r).text, acceptance_cell(r).text,
            fmt(r.spec.server_tokens_per_second, ".1f"), fmt(r.timings.decode_tokens_per_second, ".1f"),
            _cell(quality_cell(r).text), _cell(lossless_cell(r).text), _cell(visible(output_text(r), OUTPUT_CHARS)),
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    rows = context_rows(report)
    if rows:
        lines += ["### By context length", "", "| context | cases | accept | TTFT | garbage |",
                  "|---|---:|---:|---:|---:|"]
        for row in rows:
            ttft = DASH if row["ttft_s"] is None else f"{row['ttft_s'] * 1000:.0f}ms"
            lines.append(f"| {row['label']} | {row['cases']} | {fmt(row['acceptance'])} | {ttft} | {row['garbage']} |")
        lines.append("")
    lines += loadview.markdown_lines(report)  # the load sweep, when one ran
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
    publish(markdown_summary(report, exit_code), path)


def publish(text: str, path: str | None) -> None:
    """Markdown to ``path`` (atomically, when given) and appended to ``$GITHUB_STEP_SUMMARY``
    when that is set: a run's summary or a fleet's."""
    if path:
        write_output(path, text)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        append_output(step_summary, text + "\n")
