"""Comparing fleets (``diff A.json B.json`` where either report is a fleet's), target by target.

- Both fleets: targets are matched by name and each pair goes through ``diff.diff_runs``. A target
  of A that B lacks is a regression (a replica gone is worse than any slow one); a target only in
  B is reported, not judged.
- One side a single run: that run is the reference (A) or the candidate (B) of every target of the
  fleet, e.g. a known-good run judged against each replica of a new deployment.

The fleet regressed when any target did. Two single runs never come here (``diff_runs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_diag.output.diff import RunDiff, Tolerances, diff_runs, render_diff
from ddtree_diag.records import FLEET_KIND, FleetReport, RunReport


@dataclass
class FleetDiff:
    targets: dict[str, RunDiff]  # the compared targets, by name, in the fleet's order
    regressions: list[str]  # one line each: "<target>: <line>", or "target X missing from B"
    summary: list[str]
    missing: list[str] = field(default_factory=list)  # targets of A that B lacks
    new: list[str] = field(default_factory=list)  # targets only in B
    single: str | None = None  # "A" or "B": that side is one run, compared with every target
    order: list[str] = field(default_factory=list)  # every name once: A's order, then those only in B

    def names(self) -> list[str]:
        return self.order or [*self.targets, *self.missing, *self.new]

    @property
    def regressed(self) -> bool:
        return bool(self.regressions)

    def first_regression(self, name: str) -> str | None:
        if name in self.missing:
            return "missing from B"
        diff = self.targets.get(name)
        return diff.regressions[0] if diff is not None and diff.regressions else None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": FLEET_KIND, "regressed": self.regressed, "regressions": self.regressions,
                "summary": self.summary, "single_run": self.single, "missing_from_b": self.missing,
                "new_in_b": self.new, "targets": {name: d.to_dict() for name, d in self.targets.items()}}


def _members(fleet: FleetReport, side: str, notes: list[str]) -> dict[str, RunReport]:
    """A fleet's runs by target name. Names are unique in a targets file; a merged report could
    still repeat one, and then the first is compared (as ``FleetReport.member`` finds it)."""
    runs: dict[str, RunReport] = {}
    for member in fleet.targets:
        if member.name in runs:
            notes.append(f"target {member.name} appears more than once in {side}: only the first is compared")
            continue
        runs[member.name] = member.report
    return runs


def diff_fleets(a: RunReport | FleetReport, b: RunReport | FleetReport,
                tolerances: Tolerances | None = None) -> FleetDiff:
    """Compare two reports of which at least one is a fleet's (see the module docstring)."""
    if not isinstance(a, FleetReport) and not isinstance(b, FleetReport):
        raise ValueError("diff_fleets compares fleet reports; two single runs go through diff_runs")
    notes: list[str] = []
    summary: list[str] = []
    single: str | None = None
    if isinstance(a, FleetReport) and isinstance(b, FleetReport):
        runs_a, runs_b = _members(a, "A", notes), _members(b, "B", notes)
        pairs = [(name, runs_a[name], runs_b[name]) for name in runs_a if name in runs_b]
        missing = [name for name in runs_a if name not in runs_b]
        new = [name for name in runs_b if name not in runs_a]
        order = [*runs_a, *new]
    elif isinstance(b, FleetReport):
        assert isinstance(a, RunReport)
        single, missing, new = "A", [], []
        runs_b = _members(b, "B", notes)
        pairs = [(name, a, run) for name, run in runs_b.items()]
        order = list(runs_b)
        summary.append(f"A is a single run: each of the {len(runs_b)} target(s) of B is judged against it")
    else:
        assert isinstance(a, FleetReport) and isinstance(b, RunReport)
        single, missing, new = "B", [], []
        runs_a = _members(a, "A", notes)
        pairs = [(name, run, b) for name, run in runs_a.items()]
        order = list(runs_a)
        summary.append(f"B is a single run: it is judged against each of the {len(runs_a)} target(s) of A")
    targets = {name: diff_runs(run_a, run_b, tolerances) for name, run_a, run_b in pairs}
    # Missing targets first: a replica gone is the loudest thing a fleet diff can say.
    regressions = [f"target {name} missing from B" for name in missing]
    regressions += [f"{name}: {line}" for name, d in targets.items() for line in d.regressions]
    regressed = [name for name, d in targets.items() if d.regressed]
    if targets:
        line = f"{len(targets)} target(s) compared, {len(regressed)} regressed"
        if regressed:
            line += ": " + ", ".join(regressed)
        summary.append(line)
    else:
        summary.append("no target was compared: the fleets share no target name" if single is None
                       else "no target was compared: the fleet has no target")
    if missing:
        summary.append(f"missing from B: {', '.join(missing)}")
    if new:
        summary.append(f"new in B (not judged): {', '.join(new)}")
    summary += notes
    summary.append(f"{len(regressions)} regression(s)")
    return FleetDiff(targets=targets, regressions=regressions, summary=summary, missing=missing, new=new,
                     single=single, order=order)


def side_names(diff: FleetDiff, name: str, a_name: str, b_name: str) -> tuple[str, str]:
    """How one target's two sides are labelled: ``a.json[gpu-1]``, or the single run's own path."""
    return (a_name if diff.single == "A" else f"{a_name}[{name}]",
            b_name if diff.single == "B" else f"{b_name}[{name}]")


def render_fleet_diff(console: Any, diff: FleetDiff, a_name: str, b_name: str) -> None:
    """A table with one row per target (shared cases, regressions, the first one), then each
    regressed target's own case table under a rule naming it, then the fleet's regressions that
    belong to no target (a missing one) and the summary."""
    from rich.text import Text

    from ddtree_diag.output.cells import DASH, visible
    from ddtree_diag.output.fit import TEXT, Column, fit_tables, print_tables

    if diff.single == "A":
        console.print(Text(f"{a_name} is a single run: every target of {b_name} is judged against it"))
    elif diff.single == "B":
        console.print(Text(f"{b_name} is a single run: it is judged against every target of {a_name}"))
    columns = [Column("target", TEXT, "left", [], key=True), Column("shared cases"), Column("regressions"),
               Column("first regression", TEXT, "left")]
    names = diff.names()
    for name in names:
        run = diff.targets.get(name)
        first = diff.first_regression(name)
        if name in diff.new:
            status = Text("new in B (not judged)", style="yellow")
        elif first:
            status = Text(f"✗ {visible(first, 200)}", style="bold red")
        else:
            status = Text("none", style="green")
        count = len(run.regressions) if run is not None else (1 if name in diff.missing else 0)
        values = [visible(name, 200), str(run.shared) if run is not None else DASH, str(count), status]
        for column, value in zip(columns, values, strict=True):
            column.cells.append(value)
    if names:
        print_tables(console, fit_tables(console, columns, f"{a_name} → {b_name}: targets"))
    for name, run in diff.targets.items():
        if not run.regressed:
            continue
        # a plain rule off a terminal: a log or a CI page may not render box characters
        console.rule(Text(f"target {visible(name, 200)}"), characters="─" if console.is_terminal else "-")
        render_diff(console, run, *side_names(diff, name, a_name, b_name))
    if any(run.regressed for run in diff.targets.values()):
        console.rule(characters="─" if console.is_terminal else "-")
    for name in diff.missing:
        console.print(Text(f"regression: target {name} missing from B", style="bold red"))
    for line in diff.summary:
        console.print(Text(line))


def html_fleet_diff(diff: FleetDiff, a_name: str, b_name: str) -> str:
    """The comparison page of two reports where one is a fleet's: the per-target table, then one
    section per compared target with what ``html_diff`` shows for a single pair."""
    from ddtree_diag.output.cells import DASH
    from ddtree_diag.output.html import _page, diff_sections
    from ddtree_diag.output.svg import esc

    regressed = diff.regressed
    verdict = f"{len(diff.regressions)} regression(s)" if regressed else "no regression"
    body = [f'<header class="verdict {"failed" if regressed else "passed"}">',
            f"<h1>ddtree-diag diff (fleet): {'✗' if regressed else '✓'} {esc(verdict)}</h1>",
            f"<p><b>A:</b> {esc(a_name)}<br><b>B:</b> {esc(b_name)}</p>"]
    body += [f"<p>{esc(line)}</p>" for line in diff.summary]
    body.append("</header>")
    if diff.regressions:
        body.append('<h2 id="regressions">Regressions</h2><ul>'
                    + "".join(f'<li class="bad">{esc(r)}</li>' for r in diff.regressions) + "</ul>")
    body.append('<h2 id="targets">Targets</h2><table><tr><th>target</th><th>shared cases</th>'
                "<th>regressions</th><th>first regression</th></tr>")
    anchors = {name: f"target-{index}-" for index, name in enumerate(diff.targets, 1)}
    for name in diff.names():
        run = diff.targets.get(name)
        first = diff.first_regression(name)
        label = f'<a href="#{anchors[name]}diff">{esc(name)}</a>' if name in anchors else esc(name)
        count = len(run.regressions) if run is not None else (1 if name in diff.missing else 0)
        if name in diff.new:
            status, row = '<td class="warn">new in B (not judged)</td>', "changed"
        elif first:
            status, row = f'<td class="bad">✗ {esc(first)}</td>', "regressed"
        else:
            status, row = '<td class="ok">none</td>', ""
        body.append((f'<tr class="{row}">' if row else "<tr>") + f"<td>{label}</td>"
                    + f'<td class="num">{run.shared if run is not None else DASH}</td>'
                    + f'<td class="num">{count}</td>' + status + "</tr>")
    body.append("</table>")
    for name, run in diff.targets.items():
        a_label, b_label = side_names(diff, name, a_name, b_name)
        mark = "✗" if run.regressed else "✓"
        body.append(f'<h2 id="{anchors[name]}diff">{mark} target {esc(name)}</h2>')
        body.append(f'<p class="dim">{esc(a_label)} → {esc(b_label)}</p>')
        body += [f"<p>{esc(line)}</p>" for line in run.summary]
        # chart legends: the file names, as on a single diff page, then the target
        names = (f"{Path(a_name).name or a_name}" + ("" if diff.single == "A" else f" [{name}]"),
                 f"{Path(b_name).name or b_name}" + ("" if diff.single == "B" else f" [{name}]"))
        body += diff_sections(run, names, level=3, anchor=anchors[name])
    return _page(f"ddtree-diag diff (fleet): {verdict}", body)
