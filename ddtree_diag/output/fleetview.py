"""A fleet's report in every format: the console, Markdown (a CI job summary), one HTML page and
JUnit XML.

Every format shows the fleet first (one row per target, in the run's order: status, cases,
acceptance, tok/s, garbage, lossless, findings, why it failed), then the cross-target findings
and the fleet gate, then each target exactly as its own single-run report would show it. The
figures of a row come from ``checks.fleetstats`` and the cells from ``output/cells.py``, so a
target reads the same in every format and on its own.
"""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from rich.console import Console
from rich.text import Text

from ddtree_diag.checks.fleetstats import (
    CONFIG,
    DEADLINE,
    FAILED,
    INTERRUPTED,
    PASSED,
    STOPPED,
    UNKNOWN_GROUP,
    UNREACHABLE,
    MemberStats,
    member_stats,
)
from ddtree_diag.output.cells import DASH, Cell, acceptance_style, fmt, visible
from ddtree_diag.output.console import print_findings, print_gate, render_report
from ddtree_diag.output.fit import FREE, NUMBER, TEXT, Column, fit_tables, print_tables
from ddtree_diag.output.html import _page, check_table, finding_blocks, run_header, run_sections
from ddtree_diag.output.junit import _xml_safe, add_suite, findings_text, set_totals
from ddtree_diag.output.markdown import _cell, checks_for, finding_lines, markdown_summary, publish
from ddtree_diag.output.reportfile import write_output
from ddtree_diag.output.svg import esc, grouped_bars
from ddtree_diag.records import SEVERITIES, FleetMember, FleetReport, RunReport
from ddtree_diag.redaction import redacted_report

DETAIL_HINT = "per-target detail: --detail, or `ddtree-diag report FLEET.json --target NAME`"
STATUS_ORDER = (PASSED, FAILED, UNREACHABLE, CONFIG, DEADLINE, STOPPED, INTERRUPTED)
NAMES_SHOWN = 5  # targets named per status in the summary line; the rest are counted
NAME_CHARS = 40  # a target's name in a table cell (hosts and container ids can be long)
DETAIL_CHARS = 160
# GitHub refuses a job summary over 1 MiB: the per-target sections are left out past this
# (failing targets are kept first); the fleet table, findings and checks are always there.
MARKDOWN_DETAIL_BUDGET = 800_000
CHART_TARGETS = 64  # more targets than this make a bar chart no one can read: the table says it


# ---------------------------------------------------------------------------------------------
# What every format shows of a target


@dataclass
class TargetRow:
    member: FleetMember
    stats: MemberStats
    detail: str  # why it failed or stopped ("" when it passed)
    anchor: str  # its section's id on the HTML page


def target_rows(fleet: FleetReport) -> list[TargetRow]:
    """One row per target, in the run's order (the fleet must already be redacted)."""
    rows = []
    for index, member in enumerate(fleet.targets, 1):
        stats = member_stats(member)
        rows.append(TargetRow(member, stats, _detail(member.report, stats), f"target-{index}"))
    return rows


def _detail(report: RunReport, stats: MemberStats) -> str:
    """Why a target did not pass: how it stopped, its first failed gate check, or (a probe run)
    the first of the probe's own checks that failed."""
    if stats.detail:
        return stats.detail
    if stats.status == PASSED:
        return ""
    first = next((c for c in checks_for(report).checks if not c.passed), None)
    return f"{first.name}: {first.detail}" if first is not None else ""


def status_cell(stats: MemberStats) -> Cell:
    if stats.status == PASSED:
        return Cell(f"✓ {PASSED}", "green")
    # an interrupted target was stopped by the operator, not found wanting
    return Cell(f"✗ {stats.status}", "yellow" if stats.status == INTERRUPTED else "bold red")


def cases_text(stats: MemberStats) -> str:
    """Successful cases of all that ran: ``12/13``."""
    return f"{stats.ok}/{stats.cases}"


def acceptance_of(stats: MemberStats) -> Cell:
    return Cell(fmt(stats.acceptance), acceptance_style(stats.acceptance))


def garbage_of(stats: MemberStats) -> Cell:
    """Garbage answers; unknown (—) for a target that answered nothing."""
    if not stats.ok and not stats.garbage:
        return Cell(DASH, "dim")
    return Cell(str(stats.garbage), "bold red" if stats.garbage else "")


def lossless_of(stats: MemberStats) -> Cell:
    """``12 =`` (identical to the baseline), ``12 = / 1 ≠``; unknown without a baseline."""
    if not stats.identical and not stats.mismatched:
        return Cell(DASH, "dim")
    if stats.mismatched:
        return Cell(f"{stats.identical} = / {stats.mismatched} ≠", "bold red")
    return Cell(f"{stats.identical} =", "green")


def findings_of(stats: MemberStats) -> Cell:
    """The target's own findings by severity: ``1 error, 2 warning``."""
    counts = [f"{stats.findings[s]} {s}" for s in SEVERITIES if stats.findings.get(s)]
    if not counts:
        return Cell("none", "dim")
    style = "bold red" if stats.findings.get("error") else "yellow" if stats.findings.get("warning") else ""
    return Cell(", ".join(counts), style)


def fleet_passed(fleet: FleetReport, rows: list[TargetRow] | None = None) -> bool:
    """The fleet gate's verdict; without a gate, whether every target passed and no
    cross-target finding is an error (what the fleet's exit code says)."""
    if fleet.gate is not None:
        return fleet.gate.passed
    rows = target_rows(fleet) if rows is None else rows
    return all(r.stats.status == PASSED for r in rows) and not any(f.severity == "error" for f in fleet.findings)


def _stop_label(fleet: FleetReport) -> str | None:
    # the same words as a single run's summary (a RunReport holds the logic)
    return RunReport(interrupted=fleet.interrupted, stopped=fleet.stopped).stop_label()


def fleet_summary_line(fleet: FleetReport, exit_code: int | None = None, *, prefix: str = "FLEET: ") -> str:
    """``FLEET: 5 targets · 4 passed · 1 failed (gpu-3) · exit 1``: every status with its count,
    the targets that did not pass named, the cross-target findings, how a partial run ended."""
    statuses = [member_stats(m).status for m in fleet.targets]
    parts = [f"{len(statuses)} target{'s' if len(statuses) != 1 else ''}"]
    for status in (*STATUS_ORDER, *sorted(set(statuses) - set(STATUS_ORDER))):
        names = [visible(m.name, NAME_CHARS) for m, s in zip(fleet.targets, statuses, strict=True) if s == status]
        if not names:
            continue
        part = f"{len(names)} {status}"
        if status != PASSED:
            shown = ", ".join(names[:NAMES_SHOWN])
            part += f" ({shown}{f', +{len(names) - NAMES_SHOWN} more' if len(names) > NAMES_SHOWN else ''})"
        parts.append(part)
    if fleet.findings:
        errors = sum(f.severity == "error" for f in fleet.findings)
        count = len(fleet.findings)
        parts.append(f"{count} cross-target finding{'s' if count != 1 else ''}"
                     + (f" ({errors} error{'s' if errors != 1 else ''})" if errors else ""))
    if fleet.interrupted:
        parts.append(_stop_label(fleet) or "INTERRUPTED (partial)")
    if exit_code is not None:
        parts.append(f"exit {exit_code}")
    return prefix + " · ".join(parts)


def _groups_vary(rows: list[TargetRow]) -> bool:
    """A group column only when the fleet serves more than one model (or named groups)."""
    return len({r.stats.group for r in rows} - {UNKNOWN_GROUP}) > 1


def _title(fleet: FleetReport, rows: list[TargetRow]) -> str:
    title = f"fleet: {len(rows)} target{'s' if len(rows) != 1 else ''}"
    return title + (f" · matrix {fleet.matrix}" if fleet.matrix else "")


# ---------------------------------------------------------------------------------------------
# Console


def _text(cell: Cell) -> Text:
    return Text(cell.text, style=cell.style)


def fleet_columns(rows: list[TargetRow]) -> list[Column]:
    """The fleet table as columns (widths bounded: a name or a reason cannot widen it past use)."""
    columns = [Column("target", TEXT, "left", [visible(r.member.name, NAME_CHARS) for r in rows], key=True)]
    if _groups_vary(rows):
        columns.append(Column("group", TEXT, "left", [visible(r.stats.group, NAME_CHARS) for r in rows]))
    columns += [
        Column("status", TEXT, "left", [_text(status_cell(r.stats)) for r in rows]),
        Column("cases ok", NUMBER, "right", [cases_text(r.stats) for r in rows]),
        Column("accept", NUMBER, "right", [_text(acceptance_of(r.stats)) for r in rows]),
        Column("tok/s", NUMBER, "right", [fmt(r.stats.tokens_per_second, ".1f") for r in rows]),
        Column("garbage", NUMBER, "right", [_text(garbage_of(r.stats)) for r in rows]),
        Column("lossless", TEXT, "left", [_text(lossless_of(r.stats)) for r in rows]),
        Column("findings", TEXT, "left", [_text(findings_of(r.stats)) for r in rows]),
        Column("detail", FREE, "left", [visible(r.detail, DETAIL_CHARS) for r in rows]),
    ]
    return columns


def render_fleet(console: Console, fleet: FleetReport, exit_code: int | None, *, detail: bool = False) -> None:
    """The fleet table, the cross-target findings, (``detail``: every target's own report under a
    rule naming it,) the fleet gate and the summary line."""
    fleet = redacted_report(fleet)
    rows = target_rows(fleet)
    dropped: list[str] = []
    if rows:
        print_tables(console, fit_tables(console, fleet_columns(rows), _title(fleet, rows), on_dropped=dropped.append))
    else:
        console.print(Text("the fleet has no target", style="bold red"))
    if dropped:
        console.print(Text(f"left out at {console.width} columns: {dropped[0]} (see --detail or --html)", style="dim"))
    for note in fleet.notes:
        console.print(Text(f"note: {visible(note, 10_000)}", style="dim"))
    if fleet.findings:
        console.print(Text("cross-target findings:", style="bold"))
        print_findings(console, fleet.findings)
    if detail:
        rule = "─" if console.is_terminal else "-"  # a CI log may not render box characters
        for row in rows:
            console.rule(Text(f"target {visible(row.member.name, 200)}"), characters=rule)
            render_report(console, row.member.report, row.stats.exit_code)
        if rows:
            console.rule(Text("fleet"), characters=rule)
    elif rows:
        console.print(Text(DETAIL_HINT, style="dim"))
    print_gate(console, fleet.gate, label="fleet gate")
    console.print(Text(fleet_summary_line(fleet, exit_code)))


# ---------------------------------------------------------------------------------------------
# Markdown


def _demoted(markdown: str) -> str:
    """A run's summary one heading level down, to sit under the fleet's. Only headings start a
    line with ``#`` there: cells, findings and notes start with ``|``, ``-`` or ``**``."""
    return "\n".join("#" + line if line.startswith("#") else line for line in markdown.split("\n"))


def _md_findings(fleet: FleetReport) -> list[str]:
    return ["### Cross-target findings", "", *finding_lines(fleet.findings, "No cross-target findings."), ""]


def _md_table(rows: list[TargetRow]) -> list[str]:
    groups = _groups_vary(rows)
    headers = ["target", *(["group"] if groups else []), "status", "cases ok", "accept", "tok/s", "garbage",
               "lossless", "findings", "detail"]
    aligns = ["---", *(["---"] if groups else []), "---", "---:", "---:", "---:", "---:", "---", "---", "---"]
    lines = ["### Targets", "", "| " + " | ".join(headers) + " |", "|" + "|".join(aligns) + "|"]
    for row in rows:
        stats = row.stats
        cells = [_cell(visible(row.member.name, NAME_CHARS)), *([_cell(stats.group)] if groups else []),
                 status_cell(stats).text, cases_text(stats), acceptance_of(stats).text,
                 fmt(stats.tokens_per_second, ".1f"), str(stats.garbage), lossless_of(stats).text,
                 findings_of(stats).text, _cell(visible(row.detail, DETAIL_CHARS))]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _within_budget(sections: list[tuple[TargetRow, str]], budget: int) -> set[str]:
    """The anchors of the per-target sections that fit ``budget`` bytes: targets that did not
    pass first (they are what a reader opens), then the rest, each group in the run's order."""
    kept: set[str] = set()
    used = 0
    failing = [s for s in sections if s[0].stats.status != PASSED]
    ordered = failing + [s for s in sections if s[0].stats.status == PASSED]
    for row, text in ordered:
        size = len(text.encode("utf-8", "surrogatepass"))
        if used + size <= budget:
            kept.add(row.anchor)
            used += size
    return kept


def fleet_markdown(fleet: FleetReport, exit_code: int | None = None) -> str:
    """The fleet's Markdown summary: verdict, fleet table, cross-target findings, fleet gate,
    then each target's own summary folded in a ``<details>``."""
    fleet = redacted_report(fleet)
    rows = target_rows(fleet)
    passed = fleet_passed(fleet, rows)
    verdict = "✅ passed" if passed else "❌ failed"
    if fleet.interrupted:
        verdict += f" ({_stop_label(fleet) or 'interrupted: partial results'})"
    kind = "gate" if fleet.gate is not None else "probe"
    lines = [f"## ddtree-diag fleet {kind}: {verdict}", "",
             "**Fleet:** " + _cell(fleet_summary_line(fleet, exit_code, prefix=""))]
    if fleet.matrix:
        lines.append(f"**Matrix:** {_cell(fleet.matrix)}")
    lines.append("")
    lines += _md_table(rows) if rows else ["The fleet has no target.", ""]
    lines += _md_findings(fleet)
    if fleet.gate is not None:
        lines += ["### Fleet checks", "", "| | check | detail |", "|---|---|---|"]
        lines += [f"| {'✅' if c.passed else '❌'} | {_cell(c.name)} | {_cell(c.detail)} |" for c in fleet.gate.checks]
        lines.append("")
    if fleet.notes:
        lines += ["<details><summary>Notes</summary>", "", *(f"- {_cell(n)}" for n in fleet.notes), "", "</details>",
                  ""]
    sections = [(row, _demoted(markdown_summary(row.member.report, row.stats.exit_code))) for row in rows]
    kept = _within_budget(sections, MARKDOWN_DETAIL_BUDGET)
    if rows:
        lines += ["### Per target", ""]
    for row, text in sections:
        if row.anchor not in kept:
            continue
        summary = html.escape(f"{visible(row.member.name, 200)} — {status_cell(row.stats).text}")
        # blank lines around the Markdown: GitHub renders it inside <details> only then
        lines += [f"<details><summary>{summary}</summary>", "", text, "", "</details>", ""]
    left_out = [visible(r.member.name, NAME_CHARS) for r, _ in sections if r.anchor not in kept]
    if left_out:
        lines += [f"{len(left_out)} target(s) left out to keep the summary under GitHub's 1 MiB: "
                  f"{_cell(', '.join(left_out[:20]))}{', …' if len(left_out) > 20 else ''} "
                  "(`ddtree-diag report FLEET.json --target NAME`)", ""]
    return "\n".join(lines)


def write_fleet_summary(fleet: FleetReport, path: str | None, exit_code: int | None = None) -> None:
    """As ``markdown.write_summary``: to ``path`` (when given) and to ``$GITHUB_STEP_SUMMARY``."""
    publish(fleet_markdown(fleet, exit_code), path)


# ---------------------------------------------------------------------------------------------
# HTML

FLEET_STYLE = """
section.target { border-top: 3px solid var(--line); margin-top: 36px; }
section.target header.verdict h2 { border: 0; margin: 4px 0; font-size: 19px; }
h3 { font-size: 15px; margin: 20px 0 6px; border-bottom: 1px solid var(--line); }
a.up { font-size: 12px; }
"""


def _html_cell(cell: Cell, *, number: bool = False) -> str:
    classes = [c for c in (cell.style.replace(" ", "-"), "num" if number else "") if c]
    return (f'<td class="{" ".join(classes)}">' if classes else "<td>") + f"{esc(cell.text)}</td>"


def _html_table(rows: list[TargetRow]) -> list[str]:
    groups = _groups_vary(rows)
    headers = ["target", *(["group"] if groups else []), "status", "cases ok", "accept", "tok/s", "garbage",
               "lossless", "findings", "detail"]
    out = ['<table class="targets">', "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr>"]
    for row in rows:
        stats = row.stats
        cells = [f'<td><a href="#{row.anchor}">{esc(visible(row.member.name, 200))}</a></td>',
                 *([f"<td>{esc(stats.group)}</td>"] if groups else []),
                 _html_cell(status_cell(stats)), _html_cell(Cell(cases_text(stats)), number=True),
                 _html_cell(acceptance_of(stats), number=True),
                 _html_cell(Cell(fmt(stats.tokens_per_second, ".1f")), number=True),
                 _html_cell(garbage_of(stats), number=True), _html_cell(lossless_of(stats)),
                 _html_cell(findings_of(stats)), f"<td>{esc(row.detail)}</td>"]
        out.append(("<tr>" if stats.status == PASSED else '<tr class="regressed">') + "".join(cells) + "</tr>")
    out.append("</table>")
    return out


def _html_charts(rows: list[TargetRow]) -> list[str]:
    """Acceptance and tok/s per target, side by side, when there are a few targets to compare."""
    if not 2 <= len(rows) <= CHART_TARGETS:
        return []
    names = [visible(r.member.name, NAME_CHARS) for r in rows]
    figures = []
    for title, unit, digits, values, reference in (
        ("Mean acceptance per target", "tokens / round", 2, [r.stats.acceptance for r in rows], 1.0),
        ("Median decode tok/s per target", "tok/s", 1, [r.stats.tokens_per_second for r in rows], None),
    ):
        if all(v is None for v in values):
            continue
        svg = grouped_bars(names, [unit], {(g, 0): v for g, v in enumerate(values)}, title=title, y_label=unit,
                           digits=digits, reference=reference)
        figures.append(f"<figure><figcaption>{esc(title)}</figcaption>{svg}</figure>")
    if not figures:
        return []
    return ['<h2 id="fleet-plots">Plots</h2>', '<div class="plots">' + "".join(figures) + "</div>"]


def html_fleet(fleet: FleetReport, exit_code: int | None = None) -> str:
    """One self-contained page: the fleet (verdict, table, plots, cross-target findings, fleet
    checks), then one section per target with what its own report page shows."""
    fleet = redacted_report(fleet)
    rows = target_rows(fleet)
    passed = fleet_passed(fleet, rows)
    kind = "gate" if fleet.gate is not None else "probe"
    verdict = "passed" if passed else "failed"
    if fleet.interrupted:
        verdict += f" ({_stop_label(fleet) or 'interrupted: partial results'})"
    body = [f'<header class="verdict {"passed" if passed else "failed"}">',
            f"<h1>ddtree-diag fleet {kind}: {'✓' if passed else '✗'} {esc(verdict)}</h1>",
            f"<p><b>Fleet:</b> {esc(fleet_summary_line(fleet, exit_code, prefix=''))}</p>"]
    if fleet.matrix:
        body.append(f"<p><b>Matrix:</b> {esc(fleet.matrix)}</p>")
    if fleet.started_at:
        body.append(f'<p class="dim">{esc(fleet.started_at)} → {esc(fleet.finished_at or "?")}</p>')
    body.append("</header>")
    body.append('<h2 id="targets">Targets</h2>')
    body += _html_table(rows) if rows else ['<p class="bad">The fleet has no target.</p>']
    body += _html_charts(rows)
    body += ['<h2 id="fleet-findings">Cross-target findings</h2>', *finding_blocks(fleet.findings)]
    if fleet.gate is not None:
        body += ['<h2 id="fleet-checks">Fleet checks</h2>', *check_table(fleet.gate.checks)]
    if fleet.notes:
        body.append('<h2 id="fleet-notes">Notes</h2><ul>' + "".join(f"<li>{esc(n)}</li>" for n in fleet.notes)
                    + "</ul>")
    for row in rows:
        _, header = run_header(row.member.report, row.stats.exit_code, name=row.member.name, level=2)
        body.append(f'<section class="target" id="{row.anchor}">')
        body += header
        body += run_sections(row.member.report, level=3, anchor=f"{row.anchor}-")
        body.append('<p><a class="up" href="#targets">↑ all targets</a></p></section>')
    return _page(f"ddtree-diag fleet {kind}: {verdict}", body, style=FLEET_STYLE)


def write_html_fleet(fleet: FleetReport, path: str, exit_code: int | None = None) -> None:
    write_output(path, html_fleet(fleet, exit_code))


# ---------------------------------------------------------------------------------------------
# JUnit


def fleet_junit_xml(fleet: FleetReport) -> str:
    """One ``<testsuite>`` per target (what ``junit_xml`` gives for its run, testcase classes
    prefixed with the target's name), then a ``fleet`` suite: one testcase per fleet gate check,
    or without a gate one per target (failing when its own exit code is not 0) and one per
    cross-target finding (failing at error), so the XML fails exactly when the fleet does."""
    fleet = redacted_report(fleet)
    rows = target_rows(fleet)
    suites = ET.Element("testsuites", name="ddtree-diag")
    tests = failures = 0
    for row in rows:
        t, f = add_suite(suites, row.member.report, name=row.member.name, classname=f"ddtree-diag.{row.member.name}")
        tests, failures = tests + t, failures + f
    suite = ET.SubElement(suites, "testsuite", name="fleet")
    if fleet.started_at:
        suite.set("timestamp", fleet.started_at)
    # (classname, name, passed, detail, failure type)
    cases: list[tuple[str, str, bool, str, str]] = []
    if fleet.gate is not None:
        cases += [("ddtree-diag.fleet", c.name, c.passed, c.detail, c.name) for c in fleet.gate.checks]
    else:
        for row in rows:
            detail = row.stats.status + (f": {row.detail}" if row.detail else "")
            cases.append(("ddtree-diag.fleet", f"target {row.member.name}", row.stats.status == PASSED, detail,
                          row.stats.status))
        cases += [(f"ddtree-diag.fleet.{f.id}", f.title, f.severity != "error", f"[{f.severity}] {f.evidence}", f.id)
                  for f in fleet.findings]
    own_failures = 0
    for classname, name, passed, detail, kind in cases:
        case = ET.SubElement(suite, "testcase", classname=_xml_safe(classname), name=_xml_safe(name))
        if not passed:
            own_failures += 1
            failure = ET.SubElement(case, "failure", message=_xml_safe(detail), type=_xml_safe(kind))
            failure.text = _xml_safe(detail)
    if fleet.findings:
        ET.SubElement(suite, "system-out").text = findings_text(fleet.findings)
    set_totals(suite, len(cases), own_failures)
    suite.set("skipped", "0")
    set_totals(suites, tests + len(cases), failures + own_failures)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def write_fleet_junit(fleet: FleetReport, path: str) -> None:
    write_output(path, fleet_junit_xml(fleet))

