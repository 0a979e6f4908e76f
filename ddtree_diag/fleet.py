"""A run over a fleet: the same matrix against every target, targets in parallel.

Each target is an ordinary run (``orchestrator.prepare`` / ``execute`` / ``judge``) with its own
``RunReport``: its cases run one at a time as in a single run, so every case's numbers stay its
own, and at most ``parallel`` targets run at once. A dead target fails fast on its own (its
first request), a slow one is stopped at its deadline; neither holds up the others. Ctrl-C (or
a signal) stops every target where it is: what finished is kept, as in a single run.

When every target is done the fleet is judged as a whole: the replicas of one model are compared
with each other (``checks.replicas``), and with a gate every target must pass its own checks.
The fleet's exit code is the worst of its targets' and of its own checks (``fleetstats.worst_exit``).

Everything is validated before the first request: every target's settings, the matrix, the
known-good runs (``--against``): a bad one is a UsageError (exit 2).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtree_diag import orchestrator
from ddtree_diag.checks import fleetstats
from ddtree_diag.checks.against import KnownGood
from ddtree_diag.errors import EXIT_CHECK_FAILED, EXIT_OK, TransportError, UsageError, one_line
from ddtree_diag.records import FleetMember, FleetReport, GateCheck, GateResult, ProbeResult, RunReport
from ddtree_diag.targets import TargetSpec

DEFAULT_PARALLEL = 8
OnTargetResult = Callable[[str, ProbeResult], None]
OnTargetStage = Callable[[str, str], None]


class DeadlinePassed(TransportError):
    """A target's whole run went past its deadline (``deadline`` / ``--deadline``)."""

    stop_reason = "deadline"


@dataclass
class PreparedTarget:
    spec: TargetSpec
    run: orchestrator.PreparedRun
    known_good: KnownGood | None = None


@dataclass
class PreparedFleet:
    targets: list[PreparedTarget]
    parallel: int = DEFAULT_PARALLEL
    gate: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def total_cases(self) -> int:
        return sum(len(t.run.cases) for t in self.targets)


def prepare(specs: list[TargetSpec], plan_for: Callable[[TargetSpec], orchestrator.RunPlan], *, gate: bool,
            parallel: int = DEFAULT_PARALLEL, against: str | None = None) -> PreparedFleet:
    """Every target's run prepared (its matrix, baseline and gate checked) before anything is
    sent; ``against``: a known-good report for every target (a fleet report: matched by name; a
    target's own ``against`` key wins). UsageError naming the target on the first problem."""
    if parallel < 1:
        raise UsageError("--parallel must be >= 1")
    known_fleet = _load_against(against) if against else None
    prepared = []
    for spec in specs:
        try:
            run = orchestrator.prepare(plan_for(spec))
            if run.baseline is not None and run.baseline.mode == "engine":
                # every target would load the weights again, in parallel: one machine's memory
                raise UsageError("baseline engine is not for a fleet (each target would load the weights): use "
                                 "budget0 or url:URL per target, or run the engine baseline on one target")
            known = _known_good_for(spec, known_fleet, against)
            if known is not None:
                from ddtree_diag.checks.against import check_cases_match

                check_cases_match(known, [case.case_id for case in run.cases])
        except UsageError as exc:
            raise UsageError(f"target {spec.name!r}: {exc}") from None
        prepared.append(PreparedTarget(spec, run, known))
    return PreparedFleet(prepared, parallel=parallel, gate=gate)


def _load_against(path: str) -> FleetReport | KnownGood:
    from ddtree_diag.output.reportfile import load_any

    try:
        loaded = load_any(path)
    except UsageError as exc:
        raise UsageError(f"--against: {exc}") from None
    return loaded if isinstance(loaded, FleetReport) else KnownGood(path, loaded)


def _known_good_for(spec: TargetSpec, known: FleetReport | KnownGood | None, path: str | None) -> KnownGood | None:
    if spec.against:
        from ddtree_diag.checks.against import load_known_good

        return load_known_good(spec.against)
    if known is None or isinstance(known, KnownGood):
        return known
    member = known.member(spec.name)
    if member is None:
        names = ", ".join(m.name for m in known.targets[:5]) or "none"
        raise UsageError(f"--against {path}: the known-good fleet has no target {spec.name!r} (it has {names})")
    return KnownGood(f"{path}#{spec.name}", member.report)


class _Slot:
    """One target's run in progress: its report (the main thread may snapshot it), and whether the
    main thread has given up on it (deadline, Ctrl-C): the worker then stops at its next case."""

    def __init__(self, target: PreparedTarget, member: FleetMember) -> None:
        self.target = target
        self.member = member
        self.report = RunReport()
        self.started: float | None = None
        self.done = threading.Event()
        self.abandoned = False
        self.lock = threading.Lock()  # the worker finishing and the main thread giving up may race

    @property
    def deadline(self) -> float | None:
        return self.target.spec.deadline

    def overdue(self, now: float) -> bool:
        return self.deadline is not None and self.started is not None and now - self.started > self.deadline


def execute(fleet: PreparedFleet, report: FleetReport, *, on_result: OnTargetResult | None = None,
            on_stage: OnTargetStage | None = None) -> FleetReport:
    """Run every target into ``report.targets`` (in the targets' order), at most ``parallel`` at
    once. KeyboardInterrupt (Ctrl-C, a signal) propagates after every target still running or
    not started is recorded as stopped, with what it finished."""
    from ddtree_diag import __version__

    report.tool_version = __version__
    report.started_at = report.started_at or orchestrator._now()
    report.notes.extend(fleet.notes)
    if fleet.targets:
        report.matrix = fleet.targets[0].run.matrix.source
    slots = []
    for target in fleet.targets:
        member = FleetMember(name=target.spec.name, group=target.spec.group, planned=len(target.run.cases))
        report.targets.append(member)
        slots.append(_Slot(target, member))
    waiting = list(reversed(slots))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not waiting:
                    return
                slot = waiting.pop()
                slot.started = time.monotonic()
            _run_target(slot, on_result, on_stage)

    threads = [threading.Thread(target=worker, name=f"fleet-{i}", daemon=True)
               for i in range(min(fleet.parallel, len(slots)))]
    try:
        for thread in threads:
            thread.start()
        _wait(slots, on_stage)
    except BaseException as exc:  # Ctrl-C or a signal: stop every target where it is
        with lock:
            waiting.clear()
        for slot in slots:
            if not slot.done.is_set():
                _give_up(slot, exc if slot.started is not None else KeyboardInterrupt("not started"))
        report.interrupted = True
        raise
    finally:
        report.finished_at = orchestrator._now()
    return report


def _wait(slots: list[_Slot], on_stage: OnTargetStage | None) -> None:
    """Until every target is done; a target past its deadline is stopped from here (its worker
    may be blocked in a request: it is left to finish that alone, and its answer is dropped)."""
    for slot in slots:
        while not slot.done.wait(0.2):
            now = time.monotonic()
            for other in slots:
                if not other.done.is_set() and other.overdue(now):
                    _give_up(other, DeadlinePassed(_deadline_detail(other)))
                    if on_stage is not None:
                        on_stage(other.member.name, f"stopped: {_deadline_detail(other)}")


def _deadline_detail(slot: _Slot) -> str:
    ran = len(slot.report.results)
    total = len(slot.target.run.cases)
    return f"deadline of {slot.deadline:g} s passed with {ran} of {total} cases run"


def _give_up(slot: _Slot, exc: BaseException) -> None:
    """Record ``slot`` as stopped by ``exc`` from the main thread, from a copy of what it has so far."""
    with slot.lock:
        if slot.done.is_set():
            return
        slot.abandoned = True
        _stop_copy(slot, exc)


def _stop_copy(slot: _Slot, exc: BaseException) -> None:
    try:  # the worker may still be adding to it: what it had a moment ago
        snapshot = RunReport.from_dict(slot.report.to_dict())
    except RuntimeError:  # a dict that changed size while it was copied
        snapshot = RunReport(results=list(slot.report.results), target=dict(slot.report.target))
    if not snapshot.target:
        snapshot.target = {"url": slot.target.spec.url, "name": slot.member.name}
    if isinstance(exc, KeyboardInterrupt) and slot.started is None:
        snapshot.interrupted = True
        snapshot.stopped = {"reason": "interrupted", "detail": "not started", "exit_code": 130}
    else:
        orchestrator.record_stop(snapshot, exc)
    _finish(slot, snapshot)


def _finish(slot: _Slot, report: RunReport) -> None:
    """Judge ``report`` and make it the target's (the caller holds ``slot.lock``)."""
    try:
        orchestrator.judge(report, slot.target.run.gate, slot.target.known_good)
    except Exception as exc:  # a partial report that cannot be judged is still kept
        report.notes.append(f"not judged: {one_line(exc)}")
    slot.member.report = report
    slot.member.exit_code = orchestrator.exit_code_for(report)
    slot.done.set()


def _run_target(slot: _Slot, on_result: OnTargetResult | None, on_stage: OnTargetStage | None) -> None:
    name = slot.member.name
    report = slot.report

    def result_done(result: ProbeResult) -> None:
        if slot.abandoned:
            raise _Abandoned()
        if on_result is not None:
            on_result(name, result)

    def stage(text: str) -> None:
        if on_stage is not None and not slot.abandoned:
            on_stage(name, text)

    try:
        orchestrator.execute(slot.target.run, report, on_result=result_done, on_stage=stage)
    except _Abandoned:
        return
    except BaseException as exc:  # every failure is this target's own, recorded in its report
        if slot.abandoned:
            return
        orchestrator.record_stop(report, exc)
    report.target.setdefault("name", name)
    if slot.target.spec.group:
        report.target.setdefault("group", slot.target.spec.group)
    with slot.lock:
        if slot.abandoned:
            return
        _finish(slot, report)
    if on_stage is not None:
        stats = fleetstats.member_stats(slot.member)
        on_stage(name, f"{stats.status}" + (f": {stats.detail}" if stats.detail else ""))


class _Abandoned(Exception):
    """Raised in a worker whose target the main thread gave up on: stop at this case."""


# ---------------------------------------------------------------------------------------------
# The fleet's own verdict


def judge(report: FleetReport, *, gate: bool, fail_on: str | None = None) -> None:
    """Cross-target findings, and with ``gate`` the fleet gate: every target passes its own
    checks, and no cross-target finding at ``fail_on`` (default: error) or worse."""
    from ddtree_diag.checks.replicas import analyse_fleet

    analyse_fleet(report)
    if not gate:
        report.gate = None
        return
    threshold = fail_on if fail_on and fail_on != "none" else "error"
    checks = []
    for member in report.targets:
        stats = fleetstats.member_stats(member)
        detail = stats.status + (f": {stats.detail}" if stats.detail else "")
        checks.append(GateCheck(f"target {member.name}", stats.exit_code == EXIT_OK, detail))
    if fail_on != "none":
        bad = [f for f in report.findings if f.at_least(threshold)]
        detail = ("; ".join(f"[{f.severity}] {f.title}" for f in bad) if bad
                  else f"no cross-target finding at {threshold} or worse")
        checks.append(GateCheck("replicas", not bad, detail, [c for f in bad for c in f.cases]))
    report.gate = GateResult(all(c.passed for c in checks), checks)


def exit_code_for(report: FleetReport) -> int:
    """The worst of the targets' exit codes and the fleet's own checks (``fleetstats.EXIT_ORDER``)."""
    codes = [fleetstats.member_exit(m) for m in report.targets]
    if report.interrupted and report.stopped:
        code = report.stopped.get("exit_code")
        if isinstance(code, int) and not isinstance(code, bool):
            codes.append(code)
    if report.gate is not None:
        codes.append(EXIT_OK if report.gate.passed else EXIT_CHECK_FAILED)
    elif any(f.severity == "error" for f in report.findings):
        codes.append(EXIT_CHECK_FAILED)
    return fleetstats.worst_exit(codes)


def merge(reports: list[tuple[str, RunReport | FleetReport]]) -> FleetReport:
    """Join saved runs (single runs and fleets, from several machines) into one fleet report.
    A single run's target is named by its recorded name, else its host (else its file's stem);
    a name twice is a UsageError. The fleet's own verdict is recomputed by the caller (``judge``)."""
    from pathlib import Path

    from ddtree_diag.backends.http import host_of

    fleet = FleetReport()
    seen: dict[str, str] = {}
    for path, loaded in reports:
        if isinstance(loaded, FleetReport):
            members = [FleetMember(m.name, m.report, m.group, m.exit_code, m.source or path, m.planned)
                       for m in loaded.targets]
            fleet.notes.extend(f"{path}: {note}" for note in loaded.notes)
        else:
            target = loaded.target
            name = str(target.get("name") or (host_of(target["url"]) if target.get("url") else Path(path).stem))
            members = [FleetMember(name, loaded, target.get("group"), None, path)]
        for member in members:
            if member.name in seen:
                raise UsageError(f"--merge: target {member.name!r} is in both {seen[member.name]} and {path}: "
                                 "targets must have different names")
            seen[member.name] = path
            fleet.targets.append(member)
    starts = [m.report.started_at for m in fleet.targets if m.report.started_at]
    ends = [m.report.finished_at for m in fleet.targets if m.report.finished_at]
    fleet.started_at = min(starts) if starts else None
    fleet.finished_at = max(ends) if ends else None
    matrices = {m.report.target.get("matrix") for m in fleet.targets} - {None}
    if len(matrices) == 1:
        fleet.matrix = str(next(iter(matrices)))
    elif len(matrices) > 1:
        fleet.notes.append(f"the merged runs used {len(matrices)} matrices: replicas are compared on the "
                           "cases they share")
    from ddtree_diag import __version__

    fleet.tool_version = __version__
    return fleet
