"""One fleet target in figures: what the fleet table, the cross-target findings and the fleet gate
read of each target's own run (status, acceptance, tok/s, garbage, lossless, findings).

Pure functions over records: no I/O, no rendering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean, median

from ddtree_diag.errors import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TRANSPORT, EXIT_USAGE
from ddtree_diag.records import SEVERITIES, FleetMember, ProbeResult, RunReport

# A target's status, in words (the fleet table's first column).
PASSED, FAILED, UNREACHABLE, CONFIG, STOPPED, INTERRUPTED, DEADLINE = (
    "passed", "failed", "unreachable", "config", "stopped", "interrupted", "deadline")

# Worst first: the fleet's exit code is the worst of its targets' (and its own checks').
# An interrupted run outranks everything (the operator stopped it); a configuration error (a bad
# key, 401) must be fixed before any verdict means something; an unreachable target means its
# verdict is unknown; a failed check is a verdict.
EXIT_ORDER = (EXIT_INTERRUPTED, EXIT_USAGE, EXIT_TRANSPORT, EXIT_CHECK_FAILED, EXIT_OK)


def worst_exit(codes: list[int]) -> int:
    """The worst of several exit codes, by ``EXIT_ORDER`` (a signal's 128+N counts as interrupted)."""
    def rank(code: int) -> int:
        if code in EXIT_ORDER:
            return EXIT_ORDER.index(code)
        return 0 if code >= 128 else EXIT_ORDER.index(EXIT_CHECK_FAILED)

    return min(codes, key=rank) if codes else EXIT_OK


def member_exit(member: FleetMember) -> int:
    """The target's own exit code: the one recorded when it ran, else recomputed from its report."""
    if member.exit_code is not None:
        return member.exit_code
    from ddtree_diag.orchestrator import exit_code_for

    return exit_code_for(member.report)


def status_of(member: FleetMember) -> str:
    code = member_exit(member)
    report = member.report
    reason = (report.stopped or {}).get("reason") if report.interrupted else None
    if reason == "deadline":
        return DEADLINE
    if reason == "unreachable" or code == EXIT_TRANSPORT:
        return UNREACHABLE
    if reason in ("interrupted", "terminated"):
        return INTERRUPTED
    if reason is not None:
        return STOPPED  # an error of ours or the target's configuration
    if code == EXIT_USAGE:
        return CONFIG
    return PASSED if code == EXIT_OK else FAILED


def decode_tps(result: ProbeResult) -> float | None:
    """The case's decode tok/s as the client measured it, else as the server reported it."""
    tps = result.timings.decode_tokens_per_second
    return tps if tps is not None else result.spec.server_tokens_per_second


@dataclass
class MemberStats:
    """One target of a fleet, summarised for the fleet table and the cross-target checks."""

    name: str
    group: str  # replicas are compared within a group
    status: str
    exit_code: int
    cases: int = 0
    ok: int = 0
    garbage: int = 0
    acceptance: float | None = None  # mean over the ok cases that report it
    tokens_per_second: float | None = None  # median decode tok/s over the ok cases
    identical: int = 0  # lossless verdicts (near-ties counted with identical)
    mismatched: int = 0
    findings: dict[str, int] = field(default_factory=dict)  # severity -> count, own findings
    gate_passed: bool | None = None  # None: no gate ran
    detail: str | None = None  # why it stopped, or the first failed check

    @property
    def failed(self) -> int:
        return self.cases - self.ok


UNKNOWN_GROUP = "—"  # a target never reached: its model is unknown, it is compared with nothing


def group_of(member: FleetMember) -> str:
    """The replicas a target is compared with: its ``group``, else the model it serves."""
    if member.group:
        return member.group
    model = member.report.target.get("model")
    return str(model) if model else UNKNOWN_GROUP


def member_stats(member: FleetMember) -> MemberStats:
    report: RunReport = member.report
    ok = report.ok_results
    accepts = [r.spec.mean_acceptance_length for r in ok if r.spec.mean_acceptance_length is not None]
    speeds = [tps for r in ok if (tps := decode_tps(r)) is not None]
    verdicts = [r.baseline.matches for r in report.results if r.baseline is not None]
    by_severity = {s: n for s in SEVERITIES if (n := sum(f.severity == s for f in report.findings))}
    stats = MemberStats(
        name=member.name, group=group_of(member), status=status_of(member), exit_code=member_exit(member),
        cases=max(len(report.results), member.planned or 0), ok=len(ok), garbage=sum(r.garbage for r in report.results),
        acceptance=mean(accepts) if accepts else None, tokens_per_second=median(speeds) if speeds else None,
        identical=sum(v is True for v in verdicts), mismatched=sum(v is False for v in verdicts),
        findings=by_severity, gate_passed=report.gate.passed if report.gate is not None else None,
    )
    if report.interrupted:
        stats.detail = report.stop_label()
    elif report.gate is not None and not report.gate.passed:
        first = next((c for c in report.gate.checks if not c.passed), None)
        stats.detail = f"{first.name}: {first.detail}" if first is not None else None
    return stats
