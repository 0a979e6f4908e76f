"""Comparing two runs (``diff A.json B.json``) case by case, and calling out regressions.

Cases are matched by case id. Per case: acceptance, tok/s, garbage, status, lossless verdict and
whether the text changed. A regression (B worse than A beyond a tolerance) makes the exit code 1:

- a case that was ok and now fails, or is missing from B;
- a case that was clean and is now garbage, or matched the baseline and now does not;
- mean acceptance lower by more than ``acceptance_tolerance`` (tokens/round) in a case;
- mean decode tok/s over the matched cases lower by more than ``tps_tolerance`` (a fraction) —
  on the whole run, since one short request's tok/s is noisy.

A T=0 text change alone is reported, and is a regression only with ``fail_on_text_change``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean
from typing import Any

from ddtree_diag.records import ProbeResult, RunReport


@dataclass
class Tolerances:
    acceptance: float = 0.25  # tokens/round, absolute, per case
    tps: float = 0.30  # fraction of A's mean tok/s
    fail_on_text_change: bool = False


@dataclass
class CaseDiff:
    case_id: str
    a: ProbeResult | None
    b: ProbeResult | None
    changes: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        def side(r: ProbeResult | None) -> dict[str, Any] | None:
            if r is None:
                return None
            return {"status": r.status, "acceptance": r.spec.mean_acceptance_length,
                    "tokens_per_second": _tps(r), "garbage": _garbage(r), "output": r.output}

        return {"case_id": self.case_id, "a": side(self.a), "b": side(self.b),
                "changes": self.changes, "regressions": self.regressions}


@dataclass
class RunDiff:
    cases: list[CaseDiff]
    regressions: list[str]  # every regression, one line each, case-level and run-level
    summary: list[str]
    shared: int = 0  # cases present in both runs

    @property
    def regressed(self) -> bool:
        return bool(self.regressions)

    def to_dict(self) -> dict[str, Any]:
        return {"regressed": self.regressed, "regressions": self.regressions, "summary": self.summary,
                "shared_cases": self.shared, "cases": [c.to_dict() for c in self.cases]}


def _garbage(result: ProbeResult | None) -> bool:
    return bool(result is not None and result.garbage)


def _tps(result: ProbeResult) -> float | None:
    return result.timings.decode_tokens_per_second


def _lossless_ok(result: ProbeResult) -> bool | None:
    return result.baseline.matches if result.baseline is not None else None


def diff_runs(a: RunReport, b: RunReport, tolerances: Tolerances | None = None) -> RunDiff:
    tol = tolerances or Tolerances()
    a_by = {r.case_id: r for r in a.results}
    b_by = {r.case_id: r for r in b.results}
    ids = list(a_by) + [i for i in b_by if i not in a_by]
    cases: list[CaseDiff] = []
    for case_id in ids:
        ra, rb = a_by.get(case_id), b_by.get(case_id)
        diff = CaseDiff(case_id, ra, rb)
        cases.append(diff)
        if rb is None:
            diff.regressions.append("missing from B")
            continue
        if ra is None:
            diff.changes.append("new in B")
            continue
        if ra.ok and not rb.ok:
            diff.regressions.append(f"now fails: {rb.status}: {rb.error}")
        elif not ra.ok and rb.ok:
            diff.changes.append("now succeeds")
        if not ra.ok or not rb.ok:
            continue
        if not _garbage(ra) and _garbage(rb):
            codes = [x.code for x in rb.quality.counting_reasons] if rb.quality is not None else []
            diff.regressions.append("now garbage" + (f" ({codes[0]})" if codes else ""))
        elif _garbage(ra) and not _garbage(rb):
            diff.changes.append("no longer garbage")
        if _lossless_ok(ra) is True and _lossless_ok(rb) is False:
            diff.regressions.append("no longer matches the lossless baseline")
        acc_a, acc_b = ra.spec.mean_acceptance_length, rb.spec.mean_acceptance_length
        if acc_a is not None and acc_b is not None:
            delta = acc_b - acc_a
            if delta < -tol.acceptance:
                diff.regressions.append(f"acceptance {acc_a:.2f} → {acc_b:.2f} ({delta:+.2f})")
            elif abs(delta) > 1e-9:
                diff.changes.append(f"acceptance {acc_a:.2f} → {acc_b:.2f} ({delta:+.2f})")
        elif acc_a is not None and acc_b is None:
            diff.changes.append("acceptance no longer reported")
        if ra.output != rb.output or (ra.reasoning or "") != (rb.reasoning or ""):
            line = "text changed"
            if ra.case.temperature == 0 and tol.fail_on_text_change:
                diff.regressions.append(line + " at T=0")
            else:
                diff.changes.append(line)
    regressions = [f"{c.case_id}: {r}" for c in cases for r in c.regressions]
    shared = sum(1 for i in ids if i in a_by and i in b_by)
    summary = []
    if not shared:
        summary.append(f"the runs share no cases (A has {len(a_by)}, B has {len(b_by)}): different matrices, "
                       "prompts or max_tokens? Nothing was compared case by case")
    matched = [(a_by[i], b_by[i]) for i in ids if i in a_by and i in b_by and a_by[i].ok and b_by[i].ok]
    speeds = [(_tps(x), _tps(y)) for x, y in matched if _tps(x) and _tps(y)]
    if speeds:
        speed_a, speed_b = mean(s for s, _ in speeds), mean(s for _, s in speeds)
        change = speed_b / speed_a - 1
        line = f"mean client tok/s {speed_a:.1f} → {speed_b:.1f} ({change:+.0%}) over {len(speeds)} case(s)"
        summary.append(line)
        if change < -tol.tps:
            regressions.append(f"run: {line}, beyond the {tol.tps:.0%} tolerance")
    accepts = [(x.spec.mean_acceptance_length, y.spec.mean_acceptance_length) for x, y in matched
               if x.spec.mean_acceptance_length is not None and y.spec.mean_acceptance_length is not None]
    if accepts:
        summary.append(f"mean acceptance {mean(a for a, _ in accepts):.2f} → {mean(b for _, b in accepts):.2f}")
    garbage_a = sum(_garbage(r) for r in a.results)
    garbage_b = sum(_garbage(r) for r in b.results)
    summary.append(f"garbage {garbage_a} → {garbage_b}; text changed in "
                   f"{sum(1 for c in cases if any(x.startswith('text changed') for x in c.changes + c.regressions))} "
                   f"case(s); {len(regressions)} regression(s)")
    return RunDiff(cases=cases, regressions=regressions, summary=summary, shared=shared)


def render_diff(console: Any, diff: RunDiff, a_name: str, b_name: str) -> None:
    """A table of the cases that changed (fitted to the console's width), then regressions and a
    summary. When the runs share no case, that comes first."""
    from rich.text import Text

    from ddtree_diag.output.cells import DASH, visible
    from ddtree_diag.output.fit import TEXT, Column, fit_tables, print_tables

    def fmt(value: float | None, spec: str = ".2f") -> str:
        return DASH if value is None else format(value, spec)

    if not diff.shared:
        console.print(Text(f"no shared cases: {a_name} and {b_name} have no case id in common", style="bold red"))
    changed = [c for c in diff.cases if c.changes or c.regressions]
    columns = [Column("case", TEXT, "left", [], key=True), Column("accept A"), Column("accept B"),
               Column("tok/s A"), Column("tok/s B"), Column("changes", TEXT, "left")]
    for case in changed:
        a, b = case.a, case.b
        lines = [Text(f"✗ {item}", style="bold red") for item in case.regressions]
        lines += [Text(item, style="yellow" if "text" in item else "") for item in case.changes]
        if b is not None and a is not None and a.output != b.output:
            lines.append(Text(f"A: {visible(a.output, 50)}", style="dim"))
            lines.append(Text(f"B: {visible(b.output, 50)}", style="dim"))
        values = [visible(case.case_id, 400), fmt(a.spec.mean_acceptance_length if a else None),
                  fmt(b.spec.mean_acceptance_length if b else None), fmt(_tps(a) if a else None, ".1f"),
                  fmt(_tps(b) if b else None, ".1f"), Text("\n").join(lines)]
        for column, value in zip(columns, values, strict=True):
            column.cells.append(value)
    if changed:
        print_tables(console, fit_tables(console, columns, f"{a_name} → {b_name}"))
    else:
        console.print("no case changed")
    for line in diff.regressions:
        console.print(Text(f"regression: {line}", style="bold red"))
    for line in diff.summary:
        console.print(Text(line))
