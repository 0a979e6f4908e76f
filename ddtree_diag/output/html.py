"""The HTML report: one self-contained file (inline CSS and SVG; no script, no font, no CDN) with
the verdict, the checks, the findings, plots and the per-case table; and the two-run diff view.

The page carries a Content-Security-Policy that allows nothing but its own inline styles and
data: images, so even a bug in escaping could not load or run anything. Every string from a
report (server output, error lines, model names, case ids) is escaped with ``svg.esc``. Cells read
as in the other formats: they come from ``output/cells.py``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

from ddtree_diag import __version__
from ddtree_diag.output import loadview
from ddtree_diag.output.cells import (
    DASH,
    Cell,
    acceptance_cell,
    by_budget_and_thinking,
    context_rows,
    fmt,
    lossless_cell,
    output_text,
    quality_cell,
    rounds_cell,
    ttft_cell,
    visible,
    workload_cell,
)
from ddtree_diag.output.depth import depth_figure
from ddtree_diag.output.markdown import checks_for
from ddtree_diag.output.reportfile import write_output
from ddtree_diag.output.svg import esc, grouped_bars, histogram, paired_bars
from ddtree_diag.records import Finding, ProbeResult, RunReport, budget_label, thinking_label
from ddtree_diag.redaction import redacted_report

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
OUTPUT_CHARS = 120

STYLE = """
:root { color-scheme: light; --ok: #1a7f37; --bad: #cf222e; --warn: #9a6700; --dim: #6e7781; --line: #d0d7de; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1400px;
       padding: 0 20px 40px; color: #1f2328; background: #fff; }
header.verdict { border-left: 8px solid var(--ok); padding: 8px 16px; margin: 16px 0; background: #f6f8fa; }
header.verdict.failed { border-left-color: var(--bad); }
h1 { font-size: 22px; margin: 4px 0; } h2 { font-size: 17px; margin: 24px 0 8px; border-bottom: 1px solid var(--line); }
table { border-collapse: collapse; margin: 6px 0; }
th, td { border: 1px solid var(--line); padding: 3px 7px; vertical-align: top; text-align: left; }
th { background: #f6f8fa; white-space: nowrap; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.out { min-width: 24ch; max-width: 48ch; overflow-wrap: anywhere; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; margin: 4px 0; font-size: 12px; background: #f6f8fa;
      padding: 4px 6px; }
.green, .ok { color: var(--ok); } .red, .bold-red, .bad { color: var(--bad); } .bold-red { font-weight: 600; }
.yellow, .warn { color: var(--warn); } .dim { color: var(--dim); }
.finding { margin: 6px 0 10px; } .finding .sev { font-weight: 600; text-transform: uppercase; font-size: 12px; }
.finding.error .sev { color: var(--bad); } .finding.warning .sev { color: var(--warn); }
.finding.info .sev { color: var(--dim); }
.plots { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
figure { margin: 0; } figcaption { font-weight: 600; margin-bottom: 4px; }
.multiples { display: flex; flex-wrap: wrap; gap: 14px; }
.multiples figure { border: 1px solid var(--line); padding: 6px; }
.multiples figcaption { font-weight: normal; font-size: 12px; max-width: 260px; overflow-wrap: anywhere; }
svg.chart { font: 11px system-ui, sans-serif; fill: #1f2328; overflow: visible; }
svg.chart .grid { stroke: #eaeef2; } svg.chart .axis { stroke: #57606a; }
svg.chart .reference { stroke: var(--bad); stroke-dasharray: 4 3; }
svg.chart .value { font-size: 10px; } svg.chart .small { font-size: 10px; } svg.chart .unknown { fill: var(--dim); }
tr.regressed td { background: #ffebe9; } tr.changed td { background: #fff8c5; }
footer { margin-top: 32px; color: var(--dim); font-size: 12px; }
"""


def _page(title: str, body: list[str], style: str = "") -> str:
    """The whole document around ``body``; ``style``: CSS added after ``STYLE`` (a fleet page's)."""
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="generator" content="ddtree-diag">',
        f"<title>{esc(title)}</title><style>{STYLE}{style}</style></head><body>",
        *body,
        f'<footer>ddtree-diag {esc(__version__)} · one self-contained file: no script, nothing loaded from the '
        "network</footer>",
        "</body></html>",
        "",
    ])


def _cell(cell: Cell, *, number: bool = False) -> str:
    classes = [c for c in [cell.style.replace(" ", "-") if cell.style else "", "num" if number else ""] if c]
    attr = f' class="{" ".join(classes)}"' if classes else ""
    return f"<td{attr}>{esc(cell.text)}</td>"


def _num(text: str) -> str:
    return f'<td class="num">{esc(text)}</td>'


# ---------------------------------------------------------------------------------------------
# One run


def html_report(report: RunReport, exit_code: int | None = None) -> str:
    """The whole report page for a finished run (secrets of the run masked, as in every output)."""
    report = redacted_report(report)
    title, header = run_header(report, exit_code)
    return _page(title, header + run_sections(report))


def run_header(report: RunReport, exit_code: int | None = None, *, name: str | None = None,
               level: int = 1) -> tuple[str, list[str]]:
    """A run's verdict header, and the page title it implies. A fleet's page shows one per target:
    ``name`` leads its heading, at ``level``. The report must already be redacted."""
    gate = checks_for(report)
    kind = "gate" if report.gate is not None else "probe"
    verdict = "passed" if gate.passed else "failed"
    if report.interrupted:
        verdict += f" ({report.stop_label() or 'interrupted: partial results'})"
    lead = f"ddtree-diag {kind}" if name is None else f"{esc(name)} · {kind}"
    body = [f'<header class="verdict {"passed" if gate.passed else "failed"}">',
            f"<h{level}>{lead}: {'✓' if gate.passed else '✗'} {esc(verdict)}</h{level}>"]
    target = report.target
    bits = [target.get("url") or target.get("engine") or target.get("target") or "", target.get("model") or "",
            f"dialect {target['dialect']}" if target.get("dialect") else "",
            f"matrix {target['matrix']}" if target.get("matrix") else ""]
    if any(bits):
        body.append("<p><b>Target:</b> " + " · ".join(esc(b) for b in bits if b) + "</p>")
    body.append(f"<p><b>Run:</b> {esc(_run_line(report, exit_code))}</p>")
    if report.started_at:
        body.append(f'<p class="dim">{esc(report.started_at)} → {esc(report.finished_at or "?")}</p>')
    body.append("</header>")
    return f"ddtree-diag {kind}: {verdict}", body


def run_sections(report: RunReport, *, level: int = 2, anchor: str = "") -> list[str]:
    """What a run's page shows under its header (checks, findings, plots, cases, rounds, notes).
    A fleet's page repeats it once per target: headings at ``level``, every id prefixed with
    ``anchor`` so it stays unique on the page. The report must already be redacted."""
    body = _checks(checks_for(report).checks)
    body += _findings(report)
    body += _plots(report)
    body += loadview.html_table(report)
    body += _cases(report)
    body += _rounds(report)
    if report.notes:
        body.append('<h2 id="notes">Notes</h2><ul>' + "".join(f"<li>{esc(n)}</li>" for n in report.notes) + "</ul>")
    return body if (level, anchor) == (2, "") else [_nested(line, level, anchor) for line in body]


# Our own markup only: every string from a report went through ``esc``, which turns ``<`` and
# ``"`` into entities, so neither pattern can match text a server sent.
_HEADING = re.compile(r"<(/?)h2([ >])")
_ID = re.compile(r' id="')


def _nested(line: str, level: int, anchor: str) -> str:
    """One line of ``run_sections`` with its h2 headings at ``level`` and its ids prefixed (the
    section builders, loadview's included, stay as they are for the single-run page)."""
    line = _HEADING.sub(lambda m: f"<{m.group(1)}h{level}{m.group(2)}", line)
    return _ID.sub(f' id="{anchor}', line) if anchor else line


def write_html(report: RunReport, path: str, exit_code: int | None = None) -> None:
    write_output(path, html_report(report, exit_code))


def _run_line(report: RunReport, exit_code: int | None) -> str:
    results = report.results
    failed = sum(1 for r in results if not r.ok)
    garbage = sum(1 for r in results if r.garbage)
    parts = [f"{len(results)} cases", f"{len(results) - failed} ok", f"{failed} failed", f"{garbage} garbage"]
    accepts = [r.spec.mean_acceptance_length for r in results if r.ok and r.spec.mean_acceptance_length is not None]
    if accepts:
        parts.append(f"mean acceptance {mean(accepts):.2f}")
    if exit_code is not None:
        parts.append(f"exit {exit_code}")
    return " · ".join(parts)


def _checks(checks: list[Any]) -> list[str]:
    return ['<h2 id="checks">Checks</h2>', *check_table(checks)]


def check_table(checks: list[Any]) -> list[str]:
    """A table of gate checks (✓/✗, name, detail), a run's or a fleet's."""
    rows = ["<tr><th></th><th>check</th><th>detail</th></tr>"]
    for check in checks:
        mark = '<td class="ok">✓</td>' if check.passed else '<td class="bad">✗</td>'
        rows.append(f"<tr>{mark}<td>{esc(check.name)}</td><td>{esc(check.detail)}</td></tr>")
    if not checks:
        rows.append('<tr><td class="ok">✓</td><td>(none configured)</td><td></td></tr>')
    return ["<table>", *rows, "</table>"]


def _findings(report: RunReport) -> list[str]:
    return ['<h2 id="findings">Findings</h2>', *finding_blocks(report.findings)]


def finding_blocks(findings: list[Finding]) -> list[str]:
    """Findings (severity, title, id, evidence, what to check), a run's or a fleet's."""
    if not findings:
        return ["<p>No findings.</p>"]
    out = []
    for item in findings:
        out.append(f'<div class="finding {esc(item.severity)}"><span class="sev">{esc(item.severity)}</span> '
                   f"<b>{esc(item.title)}</b> <code>{esc(item.id)}</code>")
        if item.evidence:
            out.append(f"<div>evidence: {esc(item.evidence)}</div>")
        if item.check:
            out.append(f"<div>check: {esc(item.check)}</div>")
        out.append("</div>")
    return out


def _grid_chart(report: RunReport, value: Callable[[ProbeResult], float | None], title: str, unit: str,
                digits: int, reference: float | None = None) -> str | None:
    grid = by_budget_and_thinking(report, value, single_cell=True)
    if grid is None:
        return None
    groups = [f"budget {budget_label(b)}" for b in grid.budgets]
    series = [f"thinking {thinking_label(m)}" for m in grid.modes]
    values = {(g, s): grid.mean(b, m) for g, b in enumerate(grid.budgets) for s, m in enumerate(grid.modes)}
    svg = grouped_bars(groups, series, values, title=title, y_label=unit, digits=digits, reference=reference)
    return f"<figure><figcaption>{esc(title)}</figcaption>{svg}</figure>"


def _context_chart(report: RunReport) -> str | None:
    """Acceptance and TTFT (s) per context length, side by side, when the run filled prompts."""
    rows = [r for r in context_rows(report) if r["acceptance"] is not None or r["ttft_s"] is not None]
    if not rows:
        return None
    title = "Acceptance and TTFT by context length"
    groups = [row["label"] for row in rows]
    values = {}
    for g, row in enumerate(rows):
        values[(g, 0)] = row["acceptance"]
        values[(g, 1)] = row["ttft_s"]
    svg = grouped_bars(groups, ["acceptance (tokens/round)", "TTFT (s)"], values, title=title,
                       y_label="tokens/round · s", digits=2, reference=1.0, x_label="prompt length")
    return f"<figure><figcaption>{esc(title)}</figcaption>{svg}</figure>"


def _plots(report: RunReport) -> list[str]:
    charts = [
        _grid_chart(report, lambda r: r.spec.mean_acceptance_length, "Mean acceptance by budget × thinking",
                    "tokens / round", 2, reference=1.0),
        _grid_chart(report, lambda r: r.timings.decode_tokens_per_second, "Client decode tok/s by budget",
                    "tok/s", 1),
        _grid_chart(report, lambda r: r.spec.server_tokens_per_second, "Server tok/s by budget", "tok/s", 1),
    ]
    charts.append(_context_chart(report))
    charts.append(depth_figure(report))  # one curve per budget × thinking group
    charts.append(loadview.html_chart(report))  # the load sweep's speed-up by concurrency
    shown = [c for c in charts if c]
    out = ['<h2 id="plots">Plots</h2>']
    if not shown:
        return [*out, "<p>No acceptance or speed numbers to plot.</p>"]
    out.append('<div class="plots">' + "".join(shown) + "</div>")
    if charts[0] is None:
        out.append('<p class="dim">The target reported no acceptance numbers.</p>')
    out.append('<p class="dim">The dashed line at 1.0 is plain decoding: every round commits only the target\'s '
               "own token.</p>")
    return out


def _details(result: ProbeResult) -> str:
    """The full texts and the evidence behind a case's verdicts, folded."""
    parts: list[str] = []
    if result.output:
        parts.append(f"<div>output:</div><pre>{esc(result.output)}</pre>")
    if result.reasoning:
        parts.append(f"<div>reasoning:</div><pre>{esc(result.reasoning)}</pre>")
    if result.error:
        parts.append(f"<div>error:</div><pre>{esc(result.error)}</pre>")
    if result.quality is not None and result.quality.reasons:
        items = "".join(f"<li><code>{esc(r.code)}</code> ({esc(r.severity)}): {esc(r.detail)}"
                        + (f" — <q>{esc(r.evidence)}</q>" if r.evidence else "") + "</li>"
                        for r in result.quality.reasons)
        parts.append(f"<div>quality reasons:</div><ul>{items}</ul>")
    baseline = result.baseline
    if baseline is not None and baseline.field is not None:
        expected, actual = esc(baseline.expected or ""), esc(baseline.actual or "")
        parts.append(f"<div>baseline ({esc(baseline.mode)}) differs in {esc(baseline.field)} at character "
                     f"{esc(fmt(baseline.char_index, 'd'))}:</div>"
                     f"<pre>expected: {expected}\nactual:   {actual}</pre>")
    if result.structured is not None:
        mark = "✓" if result.structured.passed else "✗"
        parts.append(f"<div>structured output ({esc(result.structured.kind)}): {mark} "
                     f"{esc(result.structured.detail)}</div>")
    if result.case.fill:
        fill = result.case.fill
        counted = "estimated" if fill.get("estimated") else "counted with the server's tokenizer"
        parts.append(f"<div>prompt filled to {esc(fmt(fill.get('tokens'), 'd'))} tokens ({counted}, "
                     f"{esc(fill.get('language') or '?')}); question: <q>{esc(fill.get('question') or '')}</q></div>")
    if result.cached_tokens is not None:
        parts.append(f"<div>prompt tokens from the prefix cache: {result.cached_tokens}</div>")
    if result.findings:
        parts.append("<div>named by findings: " + ", ".join(f"<code>{esc(f)}</code>" for f in result.findings)
                     + "</div>")
    if not parts:
        return ""
    return "<details><summary>details</summary>" + "".join(parts) + "</details>"


def _cases(report: RunReport) -> list[str]:
    out = ['<h2 id="cases">Cases</h2>']
    if not report.results:
        return [*out, "<p>No case ran.</p>"]
    show_lossless = any(r.baseline for r in report.results)
    workloads = [workload_cell(r) for r in report.results]
    show_workload = any(cell.text for cell in workloads)
    headers = ["#", "case", *(["workload"] if show_workload else []), "think", "budget", "tok", "finish", "rounds",
               "accept", "tok/s srv", "tok/s cli",
               "TTFT", "quality", *(["lossless"] if show_lossless else []), "output"]
    rows = ['<table class="cases">', "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr>"]
    for index, r in enumerate(report.results, 1):
        ok = r.ok
        cells = [_num(str(index)), f"<td>{_breakable(r.case_id)}</td>",
                 *([_cell(workloads[index - 1])] if show_workload else []),
                 f"<td>{esc(thinking_label(r.case.enable_thinking))}</td>", _num(budget_label(r.case.tree_budget)),
                 _num(fmt(r.completion_tokens, "d") if ok else DASH), f"<td>{esc(r.finish_reason or DASH)}</td>",
                 _cell(rounds_cell(r), number=True) if ok else _num(DASH),
                 _cell(acceptance_cell(r), number=True) if ok else _num(DASH),
                 _num(fmt(r.spec.server_tokens_per_second, ".1f") if ok else DASH),
                 _num(fmt(r.timings.decode_tokens_per_second, ".1f") if ok else DASH),
                 _cell(ttft_cell(r), number=True) if ok else _num(DASH),
                 _cell(quality_cell(r))]
        if show_lossless:
            cells.append(_cell(lossless_cell(r)) if ok else _num(DASH))
        cells.append(f'<td class="out">{esc(visible(output_text(r), OUTPUT_CHARS))}{_details(r)}</td>')
        rows.append(f'<tr id="case-{index}">' + "".join(cells) + "</tr>")
    rows.append("</table>")
    return out + rows


def _breakable(case_id: str) -> str:
    """A case id that may wrap after each ``/`` (escaped first: ``<wbr>`` is the only markup)."""
    return esc(case_id).replace("/", "/<wbr>")


def _rounds(report: RunReport) -> list[str]:
    """Per-round acceptance of every case that reports it: a histogram each, on one shared x axis."""
    known = [(i, r) for i, r in enumerate(report.results, 1) if r.ok and r.spec.acceptance_lengths]
    out = ['<h2 id="rounds">Per-round acceptance</h2>']
    if not known:
        return [*out, "<p>The target did not report per-round acceptance lengths (only the engine and servers "
                      "with the <code>ddtree</code> dialect do).</p>"]
    largest = max(max(r.spec.acceptance_lengths or [1]) for _, r in known)
    figures = []
    for index, result in known:
        lengths = result.spec.acceptance_lengths or []
        counts = Counter(int(n) for n in lengths)
        average = sum(lengths) / len(lengths)
        caption = f"#{index} {_breakable(result.case_id)} · {len(lengths)} rounds · mean {average:.2f}"
        svg = histogram(dict(counts), largest, title=f"rounds per acceptance length, case {result.case_id}")
        figures.append(f"<figure><figcaption>{caption}</figcaption>{svg}</figure>")
    missing = len(report.ok_results) - len(known)
    out.append('<div class="multiples">' + "".join(figures) + "</div>")
    if missing:
        out.append(f'<p class="dim">{missing} successful case(s) without per-round numbers.</p>')
    return out


# ---------------------------------------------------------------------------------------------
# Two runs


def html_diff(diff: Any, a_name: str, b_name: str) -> str:
    """The comparison page of ``diff A B`` (a ``diff.RunDiff``)."""
    regressed = diff.regressed
    verdict = f"{len(diff.regressions)} regression(s)" if regressed else "no regression"
    names = (Path(a_name).name or a_name, Path(b_name).name or b_name)
    body = [f'<header class="verdict {"failed" if regressed else "passed"}">',
            f"<h1>ddtree-diag diff: {'✗' if regressed else '✓'} {esc(verdict)}</h1>",
            f"<p><b>A:</b> {esc(a_name)}<br><b>B:</b> {esc(b_name)}</p>"]
    body += [f"<p>{esc(line)}</p>" for line in diff.summary]
    body.append("</header>")
    body += diff_sections(diff, names)
    return _page(f"ddtree-diag diff: {verdict}", body)


def diff_sections(diff: Any, names: tuple[str, str], *, level: int = 2, anchor: str = "") -> list[str]:
    """What a diff page shows under its header (regressions, plots, cases). A fleet's diff page
    repeats it once per target: its headings one level lower, its ids prefixed with ``anchor`` so
    they stay unique on the page."""
    h = f"h{level}"
    body: list[str] = []
    if diff.shared == 0:
        body.append('<p class="bad"><b>The two runs share no cases</b>: nothing could be compared case by case '
                    "(different matrices, prompts or max_tokens?).</p>")
    if diff.regressions:
        body.append(f'<{h} id="{anchor}regressions">Regressions</{h}><ul>'
                    + "".join(f'<li class="bad">{esc(r)}</li>' for r in diff.regressions) + "</ul>")
    shared = [c for c in diff.cases if c.a is not None and c.b is not None]
    labels = [f"#{i} {_short_id(c.case_id)}" for i, c in enumerate(shared, 1)]
    body.append(f'<{h} id="{anchor}plots">Plots</{h}>')
    charts = []
    accept = [(c.a.spec.mean_acceptance_length, c.b.spec.mean_acceptance_length) for c in shared]
    if any(x is not None or y is not None for x, y in accept):
        charts.append(("Mean acceptance per case (tokens/round)",
                       paired_bars(labels, [x for x, _ in accept], [y for _, y in accept], names=names,
                                   title="mean acceptance per case, A vs B")))
    speed = [(c.a.timings.decode_tokens_per_second, c.b.timings.decode_tokens_per_second) for c in shared]
    if any(x is not None or y is not None for x, y in speed):
        charts.append(("Client decode tok/s per case",
                       paired_bars(labels, [x for x, _ in speed], [y for _, y in speed], names=names, digits=1,
                                   title="client decode tok/s per case, A vs B")))
    if charts:
        body.append('<div class="plots">' + "".join(f"<figure><figcaption>{esc(t)}</figcaption>{s}</figure>"
                                                    for t, s in charts) + "</div>")
    else:
        body.append("<p>No shared case with acceptance or speed numbers.</p>")
    body.append(f'<{h} id="{anchor}cases">Cases</{h}><table><tr><th>case</th><th>accept A</th><th>accept B</th>'
                "<th>tok/s A</th><th>tok/s B</th><th>changes</th></tr>")
    for case in diff.cases:
        a, b = case.a, case.b
        row_class = "regressed" if case.regressions else "changed" if case.changes else ""
        items = [f'<div class="bad">✗ {esc(x)}</div>' for x in case.regressions]
        items += [f"<div>{esc(x)}</div>" for x in case.changes]
        if a is not None and b is not None and a.output != b.output:
            items.append(f"<pre>A: {esc(a.output)}\nB: {esc(b.output)}</pre>")
        body.append(
            (f'<tr class="{row_class}">' if row_class else "<tr>")
            + f"<td>{esc(case.case_id)}</td>"
            + _num(fmt(a.spec.mean_acceptance_length if a else None))
            + _num(fmt(b.spec.mean_acceptance_length if b else None))
            + _num(fmt(a.timings.decode_tokens_per_second if a else None, ".1f"))
            + _num(fmt(b.timings.decode_tokens_per_second if b else None, ".1f"))
            + f"<td>{''.join(items) or '<span class=dim>unchanged</span>'}</td></tr>"
        )
    body.append("</table>")
    return body


def _short_id(case_id: str) -> str:
    """prompt/think=on/budget=16/T=0/max=48/r0 -> prompt on 16 T0 r0 (a chart label)."""
    parts = case_id.split("/")
    if len(parts) != 6:
        return case_id
    prompt, think, budget, temperature, _max, repeat = parts
    return f"{prompt} {think.split('=', 1)[1]} {budget.split('=', 1)[1]} {temperature.replace('=', '')} {repeat}"
