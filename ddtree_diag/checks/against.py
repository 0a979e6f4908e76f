"""Regression against a known-good run: ``ddtree-diag gate MATRIX --against known-good.json``.

The saved JSON report of a run that was fine is the reference; the gated run is compared with it
case by case (cases matched by id, as ``ddtree-diag diff`` does) and each kind of regression is one
gate check, reported after the matrix's own:

    against_cases              what was compared; cases in only one run are listed, never a failure
    against_failed             a case that succeeded in the known-good fails now
    against_garbage            a case that was clean is garbage now
    against_text               a T=0 answer differs from the known-good's (a failure unless
                               against_fail_on_text_change = false), or no longer matches the
                               lossless baseline it matched
    against_acceptance         a group's mean acceptance fell beyond its tolerance, or one case by
                               more than twice that (one case is noisier than a mean)
    against_tokens_per_second  a group's mean decode tok/s fell beyond its tolerance
    against_speedup            the load sweep's speed-up at a concurrency level fell beyond the tok/s
                               tolerance (only when both runs swept the same level)

Groups are the tree budget × thinking groups of the other gate checks (sampled cases apart).
Tolerances are fractions of the known-good's value. Unless the ``[gate]`` table sets them
(``against_acceptance_tolerance``, ``against_tps_tolerance``), they come from the known-good's own
noise: ``SPREAD_FACTOR`` × the largest relative range ((max − min) / mean) among the repeats of a
case of the group, between a floor and ``SPREAD_CEILING``; a group without repeats gets a fixed
default.

Run-level problems are settled before any request: a file that is not a report of this schema
(``load_known_good``) or that shares no case with the run (``check_cases_match``) is exit 2.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from statistics import mean
from typing import TYPE_CHECKING, Any

from ddtree_diag.checks.lossless import around, first_difference, repeat_disagreements
from ddtree_diag.errors import UsageError
from ddtree_diag.records import GateCheck, ProbeCase, ProbeResult, RunReport

if TYPE_CHECKING:
    from ddtree_diag.checks.gate import GateConfig

__all__ = [
    "ACCEPTANCE_FLOOR", "CHECK_NAMES", "DEFAULT_ACCEPTANCE_TOLERANCE", "DEFAULT_TPS_TOLERANCE",
    "SPREAD_CEILING", "SPREAD_FACTOR", "TPS_FLOOR", "KnownGood", "Tolerance", "check_cases_match", "compare",
    "comparison_group", "fraction", "load_known_good", "notes", "repeat_spread", "speedups", "tolerances",
]

# Without repeats to measure noise: a drop of 10 % in acceptance (deterministic at T=0 on most
# servers) or 30 % in tok/s (what ``diff`` allows: one short request's speed is noisy).
DEFAULT_ACCEPTANCE_TOLERANCE = 0.10
DEFAULT_TPS_TOLERANCE = 0.30
# With repeats: a wide multiple of the spread seen inside one run (another run adds its own noise),
# never below a floor (identical repeats must not make a 0 % tolerance).
SPREAD_FACTOR = 3.0
ACCEPTANCE_FLOOR = 0.05
TPS_FLOOR = 0.15
# ... and never above a ceiling: however noisy the known-good, a fall to a fifth is no noise.
SPREAD_CEILING = 0.8
CASE_FACTOR = 2.0  # one case's acceptance may fall this many times its group's tolerance

CHECK_NAMES = ("against_cases", "against_failed", "against_garbage", "against_text", "against_acceptance",
               "against_tokens_per_second", "against_speedup")

Metric = Callable[[ProbeResult], float | None]


def fraction(value: Any, where: str) -> float:
    """A ``[gate]`` tolerance: a fraction from 0 to 1 (0.2 = a 20 % drop allowed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise UsageError(f"{where} must be a fraction from 0 to 1 (0.2 = 20 %), got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------
# The known-good report, checked before anything is sent


@dataclass
class KnownGood:
    """The reference run and the path it was read from (named in every detail)."""

    path: str
    report: RunReport


def load_known_good(path: str) -> KnownGood:
    """Read ``--against PATH``; UsageError (exit 2, one line) when it is not a readable report of
    this schema version."""
    from ddtree_diag.output.reportfile import load_report

    try:
        report = load_report(path)
    except UsageError as exc:
        raise UsageError(f"--against: {exc}") from None
    return KnownGood(path, report)


def check_cases_match(known: KnownGood, case_ids: list[str]) -> None:
    """UsageError when the run about to start shares no case id with the known-good: the gate
    could compare nothing (another matrix, prompt set or max_tokens)."""
    theirs = [r.case_id for r in known.report.results]
    if set(theirs) & set(case_ids):
        return
    first_here = case_ids[0] if case_ids else "none"
    first_there = theirs[0] if theirs else "none"
    raise UsageError(
        f"--against {known.path}: none of this run's {len(case_ids)} case(s) is in the known-good run "
        f"({len(theirs)} case(s); another matrix, prompts or max_tokens?) — first here {first_here}, "
        f"first there {first_there}"
    )


def notes(report: RunReport, known: KnownGood) -> list[str]:
    """Run-level remarks: the known-good ran another model or matrix, or was not itself good."""
    out = []
    theirs, ours = known.report.target, report.target
    for key, what in (("model", "model"), ("matrix", "matrix")):
        if theirs.get(key) and ours.get(key) and theirs[key] != ours[key]:
            out.append(f"--against {known.path}: the known-good ran {what} {theirs[key]!r}, this run "
                       f"{ours[key]!r}: only the cases both have are compared")
    if known.report.interrupted:
        out.append(f"--against {known.path}: the known-good run was partial "
                   f"({known.report.stop_label() or 'interrupted'})")
    elif known.report.gate is not None and not known.report.gate.passed:
        out.append(f"--against {known.path}: the known-good run failed its own gate")
    return out


# ---------------------------------------------------------------------------------------------
# Tolerances from the known-good's own noise


@dataclass(frozen=True)
class Tolerance:
    """A drop allowed, as a fraction of the known-good's value, and where it came from."""

    fraction: float
    origin: str  # "[gate]", "3× spread 4%", "floor; spread 0%", "default: no repeats"

    def describe(self) -> str:
        return f"tol {self.fraction:.0%} ({self.origin})"


def comparison_group(case: ProbeCase) -> str:
    """The group a case's numbers are compared in: its budget × thinking group, sampled cases
    apart from greedy ones (sampling adds its own spread)."""
    label = case.group_label
    return label if case.temperature == 0 else f"{label} T={case.temperature:g}"


def repeat_spread(results: list[ProbeResult], metric: Metric) -> dict[str, float]:
    """Per comparison group, the largest relative range ((max − min) / mean) of ``metric`` among
    the repeats of one case. Groups without a case repeated (with the metric) are absent."""
    by_case: dict[str, list[float]] = defaultdict(list)
    group_of: dict[str, str] = {}
    for result in results:
        value = metric(result) if result.ok else None
        if value is None or not math.isfinite(value):
            continue
        by_case[result.case.group_key].append(value)
        group_of[result.case.group_key] = comparison_group(result.case)
    spread: dict[str, float] = {}
    for key, values in by_case.items():
        centre = mean(values) if len(values) > 1 else 0.0
        if centre <= 0:
            continue
        group = group_of[key]
        spread[group] = max(spread.get(group, 0.0), (max(values) - min(values)) / centre)
    return spread


def tolerances(results: list[ProbeResult], metric: Metric, configured: float | None, floor: float,
               default: float) -> dict[str, Tolerance]:
    """The tolerance of every comparison group of the known-good's ``results``: ``configured``
    when set, else ``SPREAD_FACTOR`` × the group's repeat spread (at least ``floor``, at most
    ``SPREAD_CEILING``),
    else ``default``."""
    groups = {comparison_group(r.case) for r in results}
    if configured is not None:
        return {g: Tolerance(configured, "[gate]") for g in groups}
    spread = repeat_spread(results, metric)
    out = {}
    for group in groups:
        if group not in spread:
            out[group] = Tolerance(default, "default: no repeats")
        elif SPREAD_FACTOR * spread[group] <= floor:
            out[group] = Tolerance(floor, f"floor; spread {spread[group]:.0%}")
        else:
            value = min(SPREAD_CEILING, SPREAD_FACTOR * spread[group])
            out[group] = Tolerance(value, f"{SPREAD_FACTOR:g}× spread {spread[group]:.0%}")
    return out


def speedups(report: RunReport) -> dict[str, float]:
    """Speed-up over plain decoding per concurrency level of the load sweep, ``{"c=4": 2.1}``
    (levels whose speed-up is unknown are left out; a report without a sweep gives nothing)."""
    out = {}
    for level in getattr(report, "load", None) or []:  # read loosely: reports from before the sweep
        value, concurrency = getattr(level, "speedup", None), getattr(level, "concurrency", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"c={concurrency}"] = float(value)
    return out


# ---------------------------------------------------------------------------------------------
# The checks


def _check(name: str, passed: bool, detail: str, cases: list[str] | None = None) -> GateCheck:
    return GateCheck(name, passed, detail, list(dict.fromkeys(cases or [])))


def _first(items: list[str], most: int = 3) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _acceptance(result: ProbeResult) -> float | None:
    return result.spec.mean_acceptance_length


def _change(before: float, after: float) -> float:
    return after / before - 1 if before > 0 else 0.0


Pair = tuple[ProbeResult, ProbeResult]  # (known-good, now), same case id


def compare(report: RunReport, known: KnownGood, config: GateConfig) -> list[GateCheck]:
    """The ``against_*`` checks of ``report`` against the known-good run, in ``CHECK_NAMES`` order
    (``against_speedup`` only when both runs carry speed-ups)."""
    theirs = {r.case_id: r for r in known.report.results}
    ours = {r.case_id: r for r in report.results}
    pairs = [(theirs[i], ours[i]) for i in ours if i in theirs]
    checks = [
        _cases(known, theirs, ours, pairs),
        _failed(pairs),
        _garbage(pairs),
        _text(known, pairs, config.against_fail_on_text_change),
        _acceptance_check(known, pairs, config.against_acceptance_tolerance),
        _speed_check(known, pairs, config.against_tps_tolerance, config.tokens_per_second_source),
    ]
    speedup = _speedup_check(report, known, config.against_tps_tolerance)
    return checks + ([speedup] if speedup is not None else [])


def _cases(known: KnownGood, theirs: dict[str, ProbeResult], ours: dict[str, ProbeResult],
           pairs: list[Pair]) -> GateCheck:
    only_there = [i for i in theirs if i not in ours]
    only_here = [i for i in ours if i not in theirs]
    started = f" (run {known.report.started_at})" if known.report.started_at else ""
    parts = [f"{len(pairs)} case(s) compared with {known.path}{started}"]
    if only_there:
        parts.append(f"{len(only_there)} only in the known-good (not run now): {_first(only_there)}")
    if only_here:
        parts.append(f"{len(only_here)} new, not in the known-good: {_first(only_here)}")
    # No pair only when the run stopped before any case of the known-good ran (an empty overlap
    # was refused before the run).
    return _check("against_cases", bool(pairs), "; ".join(parts))


def _failed(pairs: list[Pair]) -> GateCheck:
    bad = [now for was, now in pairs if was.ok and not now.ok]
    shown = "; ".join(f"{r.case_id}: {r.status}: {r.error}" for r in bad[:3])
    detail = (f"{len(bad)} case(s) that succeeded in the known-good fail now — {shown}" if bad
              else "no case that succeeded in the known-good fails now")
    return _check("against_failed", not bad, detail, [r.case_id for r in bad])


def _garbage(pairs: list[Pair]) -> GateCheck:
    bad = [now for was, now in pairs if was.ok and now.ok and not was.garbage and now.garbage]

    def reason(r: ProbeResult) -> str:
        counting = r.quality.counting_reasons if r.quality is not None else []
        return counting[0].code if counting else "garbage"

    shown = "; ".join(f"{r.case_id}: {reason(r)}" for r in bad[:3])
    detail = (f"{len(bad)} case(s) clean in the known-good are garbage now — {shown}" if bad
              else "no case that was clean in the known-good is garbage now")
    return _check("against_garbage", not bad, detail, [r.case_id for r in bad])


def _answer(result: ProbeResult) -> str:
    calls = "".join(f"\n<call {c.get('name')} {c.get('arguments')}>" for c in result.tool_calls or [])
    return (result.reasoning or "") + result.output + calls


def _text(known: KnownGood, pairs: list[Pair], fail_on_change: bool) -> GateCheck:
    greedy = [(was, now) for was, now in pairs if was.ok and now.ok and now.case.temperature == 0]
    if not greedy:
        return _check("against_text", True, "no T=0 case in both runs: no text compared")
    # Where the known-good's own T=0 repeats disagreed, its text is no reference: a change there
    # is noise the known-good already had.
    noisy = {d.group for d in repeat_disagreements(known.report)}
    changed = [(was, now) for was, now in greedy if _answer(was) != _answer(now)]
    counted = [(was, now) for was, now in changed if now.case.group_key not in noisy]
    excused = len(changed) - len(counted)
    unmatched = [now for was, now in greedy if was.baseline is not None and now.baseline is not None
                 and was.baseline.matches is True and now.baseline.matches is False]
    parts = [f"{len(greedy) - len(changed)}/{len(greedy)} T=0 answer(s) as in the known-good"]
    if counted:
        was, now = counted[0]
        at = first_difference(_answer(now), _answer(was)) or 0
        parts.append(f"first change: {now.case_id} at char {at}: known-good {around(_answer(was), at)!r}, "
                     f"now {around(_answer(now), at)!r}")
        if not fail_on_change:
            parts.append("not a failure (against_fail_on_text_change = false)")
    if excused:
        parts.append(f"{excused} more changed where the known-good's own repeats disagreed (not counted)")
    if unmatched:
        parts.append(f"{len(unmatched)} no longer match the lossless baseline they matched: "
                     f"{_first([r.case_id for r in unmatched])}")
    failing = ([now.case_id for _, now in counted] if fail_on_change else []) + [r.case_id for r in unmatched]
    return _check("against_text", not failing, "; ".join(parts), failing)


def _grouped(pairs: list[Pair]) -> dict[str, list[Pair]]:
    groups: dict[str, list[Pair]] = defaultdict(list)
    for pair in pairs:
        groups[comparison_group(pair[1].case)].append(pair)
    return groups


def _acceptance_check(known: KnownGood, pairs: list[Pair], configured: float | None) -> GateCheck:
    name = "against_acceptance"
    measured = [(was, now) for was, now in pairs if was.ok and now.ok and _acceptance(was) is not None]
    if not measured:
        return _check(name, True, "not compared: the known-good reports no acceptance in the cases run now")
    lost = [now.case_id for was, now in measured if _acceptance(now) is None]
    both = [(was, now) for was, now in measured if _acceptance(now) is not None]
    if not both:
        return _check(name, False, f"no case reports an acceptance now; the known-good did in {len(measured)}",
                      lost)
    table = tolerances(known.report.results, _acceptance, configured, ACCEPTANCE_FLOOR,
                       DEFAULT_ACCEPTANCE_TOLERANCE)
    fell_groups: list[str] = []
    fell_cases: list[str] = []
    shown: list[str] = []
    cases = list(lost)
    for group, members in _grouped(both).items():
        tolerance = table.get(group, Tolerance(DEFAULT_ACCEPTANCE_TOLERANCE, "default"))
        before, after = mean(_acceptance(w) for w, _ in members), mean(_acceptance(n) for _, n in members)
        change = _change(before, after)
        line = f"{group}: {before:.2f} → {after:.2f} ({change:+.0%}, {tolerance.describe()})"
        shown.append(line)
        if change < -tolerance.fraction:
            fell_groups.append(line)
            cases += [n.case_id for w, n in members if _acceptance(n) < _acceptance(w)]
        for was, now in members:
            case_change = _change(_acceptance(was), _acceptance(now))
            if case_change < -CASE_FACTOR * tolerance.fraction:
                fell_cases.append(f"{now.case_id} {_acceptance(was):.2f} → {_acceptance(now):.2f}")
                cases.append(now.case_id)
    parts = []
    if fell_groups:
        parts.append("fell beyond the tolerance in " + "; ".join(fell_groups))
    if fell_cases:
        parts.append(f"{len(fell_cases)} case(s) fell by more than {CASE_FACTOR:g}× their group's tolerance: "
                     f"{_first(fell_cases, 2)}")
    if lost:
        parts.append(f"{len(lost)} case(s) no longer report an acceptance: {_first(lost)}")
    if not fell_groups:  # the groups that fell are shown above with their numbers
        parts.append("per group: " + "; ".join(shown))
    return _check(name, not cases, "; ".join(parts), cases)


def _speed_metric(source: str) -> Metric:
    if source == "server":
        return lambda r: r.spec.server_tokens_per_second
    return lambda r: r.timings.decode_tokens_per_second


def _speed_check(known: KnownGood, pairs: list[Pair], configured: float | None, source: str) -> GateCheck:
    name = "against_tokens_per_second"
    metric = _speed_metric(source)
    both = [(w, n) for w, n in pairs if w.ok and n.ok and metric(w) and metric(n)]
    if not both:
        return _check(name, True, f"not compared: no case has a {source}-side tok/s in both runs")
    table = tolerances(known.report.results, metric, configured, TPS_FLOOR, DEFAULT_TPS_TOLERANCE)
    slow, shown, cases = [], [], []
    for group, members in _grouped(both).items():
        tolerance = table.get(group, Tolerance(DEFAULT_TPS_TOLERANCE, "default"))
        before, after = mean(metric(w) for w, _ in members), mean(metric(n) for _, n in members)
        change = _change(before, after)
        line = f"{group}: {before:.1f} → {after:.1f} ({change:+.0%}, {tolerance.describe()})"
        shown.append(line)
        if change < -tolerance.fraction:
            slow.append(line)
            cases += [n.case_id for _, n in members]
    overall = _change(mean(metric(w) for w, _ in both), mean(metric(n) for _, n in both))
    head = f"mean {source} tok/s {overall:+.0%} over {len(both)} case(s)"
    if slow:
        return _check(name, False, f"{head}; slower beyond the tolerance in " + "; ".join(slow), cases)
    return _check(name, True, f"{head}; per group: " + "; ".join(shown))


def _speedup_check(report: RunReport, known: KnownGood, configured: float | None) -> GateCheck | None:
    before, after = speedups(known.report), speedups(report)
    common = [k for k in before if k in after]
    if not common:
        return None
    tolerance = configured if configured is not None else DEFAULT_TPS_TOLERANCE
    shown = [f"{k}: {before[k]:.2f}× → {after[k]:.2f}×" for k in common]
    fell = [line for k, line in zip(common, shown, strict=True) if _change(before[k], after[k]) < -tolerance]
    detail = (f"speed-up fell beyond {tolerance:.0%} at " + "; ".join(fell) if fell
              else f"speed-up within {tolerance:.0%}: " + "; ".join(shown))
    return _check("against_speedup", not fell, detail)
