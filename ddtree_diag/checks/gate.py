"""The CI gate: a matrix's ``[gate]`` thresholds applied to a finished run.

    [gate]
    min_mean_acceptance = 2.0        # mean over every case that reports acceptance
    min_group_acceptance = 1.5       # the same, per tree budget × thinking group
    min_tokens_per_second = 20       # mean decode tok/s ...
    tokens_per_second_source = "client"   # ... measured by the client, or "server"
    max_ttft_s = 2.0                 # every streamed case's time to first token, seconds
    max_garbage = 0                  # cases whose text is garbage
    max_failed = 0                   # cases whose request failed (HTTP/engine error)
    min_completion_tokens = 4        # every ok case produced at least this many tokens
    lossless = true                  # T=0 output = non-speculative baseline; repeats agree
    allow_near_ties = true           # a numerics near-tie is not a lossless failure
    fail_on_findings = "error"       # fail when a finding this severe (or worse) fires
    canary = true                    # send the first case again at the end; text (T=0) and
                                     # acceptance must not change (default: true)

Every threshold is optional; a missing one is not checked. ``evaluate`` returns
``{"passed", "checks": [{"name", "passed", "detail", "cases"}]}``; a check's ``cases`` are the
case ids that made it fail (or, for a passing check, that it was measured on is not recorded).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from statistics import mean
from typing import Any

from ddtree_diag.checks.lossless import ERROR, MISMATCH, NEAR_TIE, SKIPPED, repeat_disagreements
from ddtree_diag.errors import UsageError
from ddtree_diag.records import SEVERITIES, GateCheck, GateResult, ProbeResult, RunReport

_SOURCES = ("client", "server")
CANARY_ACCEPTANCE_MARGIN = 0.3  # tokens/round, or 15 % if larger
# Findings that fail the gate even without fail_on_findings (see evaluate).
CRITICAL_FINDINGS = frozenset({"acceptance-collapse", "metrics-contradict", "canary-differs"})


@dataclass
class GateConfig:
    min_mean_acceptance: float | None = None
    min_group_acceptance: float | None = None
    min_tokens_per_second: float | None = None
    tokens_per_second_source: str = "client"
    max_ttft_s: float | None = None
    max_garbage: int | None = None
    max_failed: int | None = None
    min_completion_tokens: int | None = None
    lossless: bool = False
    allow_near_ties: bool = True
    fail_on_findings: str | None = None  # a severity; "none" = never; None (unset) = critical findings only
    canary: bool = True


_FLOATS = ("min_mean_acceptance", "min_group_acceptance", "min_tokens_per_second", "max_ttft_s")
_INTS = ("max_garbage", "max_failed", "min_completion_tokens")
_BOOLS = ("lossless", "allow_near_ties", "canary")
_KNOWN = {*_FLOATS, *_INTS, *_BOOLS, "tokens_per_second_source", "fail_on_findings"}


def default_config(lossless: bool) -> GateConfig:
    """The checks a probe run shows, and a gate applies when its matrix sets no thresholds:
    no failed request, no garbage, and lossless when a baseline ran."""
    return GateConfig(max_failed=0, max_garbage=0, lossless=lossless)


def describe_config(config: GateConfig) -> str:
    """The thresholds a config sets, as ``key = value`` pairs (for notes)."""
    unset = GateConfig()
    shown = [f"{name} = {str(value).lower() if isinstance(value, bool) else value}"
             for name, value in vars(config).items() if value != getattr(unset, name)]  # fmt: skip
    return ", ".join(shown) or "none"


def parse_gate(table: dict[str, Any], source: str = "<matrix>") -> GateConfig:
    """The ``[gate]`` table as a GateConfig; UsageError names the key at fault."""
    if not isinstance(table, dict):
        raise UsageError(f"{source}: [gate] must be a table")
    config = GateConfig()
    for key, value in table.items():
        where = f"{source}: gate.{key}"
        if key not in _KNOWN:
            raise UsageError(f"{source}: unknown key gate.{key!r} (known: {', '.join(sorted(_KNOWN))})")
        if key in _FLOATS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise UsageError(f"{where} must be a number >= 0, got {value!r}")
            value = float(value)
        elif key in _INTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{where} must be an integer >= 0, got {value!r}")
        elif key in _BOOLS:
            if not isinstance(value, bool):
                raise UsageError(f"{where} must be true or false, got {value!r}")
        elif key == "tokens_per_second_source":
            if value not in _SOURCES:
                raise UsageError(f"{where} must be \"client\" or \"server\", got {value!r}")
        elif key == "fail_on_findings":
            if value is False or value == "none":
                value = "none"  # said explicitly: no findings check at all, not even the critical ones
            elif value not in SEVERITIES:
                raise UsageError(f"{where} must be one of {', '.join(SEVERITIES)} or \"none\", got {value!r}")
        setattr(config, key, value)
    return config


def _check(name: str, passed: bool, detail: str, cases: list[str] | None = None) -> GateCheck:
    return GateCheck(name, passed, detail, list(dict.fromkeys(cases or [])))


def _count_check(name: str, hits: list[ProbeResult], most: int, what: str,
                 describe: Callable[[ProbeResult], str]) -> GateCheck:  # fmt: skip
    """At most ``most`` cases of a kind; the detail names the first three."""
    shown = "; ".join(f"{r.case_id}: {describe(r)}" for r in hits[:3])
    return _check(name, len(hits) <= most, f"{len(hits)} {what}, max {most}" + (f" — {shown}" if shown else ""),
                  [r.case_id for r in hits])  # fmt: skip


def _ok(report: RunReport) -> list[ProbeResult]:
    return [r for r in report.results if r.ok]


def _group(result: ProbeResult) -> str:
    case = result.case
    budget = "default" if case.tree_budget is None else case.tree_budget
    think = {True: "on", False: "off", None: "default"}[case.enable_thinking]
    return f"budget={budget} think={think}"


def evaluate(report: RunReport, config: GateConfig) -> GateResult:
    """Apply every configured check to the run; the gate passes when all of them pass."""
    checks: list[GateCheck] = []
    results = report.results
    ok = _ok(report)

    if not results:
        checks.append(_check("ran_cases", False, "no case ran"))
    if report.interrupted:
        checks.append(_check("complete", False, f"the run did not finish: {report.stop_label() or 'interrupted'}"))

    if config.max_failed is not None:
        failed = [r for r in results if not r.ok]
        checks.append(_count_check("max_failed", failed, config.max_failed, "failed request(s)",
                                   lambda r: f"{r.status}: {r.error}"))  # fmt: skip

    if config.max_garbage is not None:
        garbage = [r for r in ok if r.garbage]
        checks.append(_count_check("max_garbage", garbage, config.max_garbage, "garbage case(s)", _top_reason))

    if config.min_completion_tokens is not None:
        short = [r for r in ok if (r.completion_tokens if r.completion_tokens is not None else len(r.output.split()))
                 < config.min_completion_tokens]  # fmt: skip
        checks.append(_check(
            "min_completion_tokens", not short,
            f"{len(short)} case(s) below {config.min_completion_tokens} completion tokens"
            + (": " + ", ".join(f"{r.case_id} ({r.completion_tokens})" for r in short[:4]) if short else ""),
            [r.case_id for r in short],
        ))  # fmt: skip

    if config.min_mean_acceptance is not None:
        known = [r for r in ok if r.spec.mean_acceptance_length is not None]
        if not known:
            checks.append(_check("min_mean_acceptance", False,
                                 "no case reported an acceptance length (does the server expose it?)",
                                 [r.case_id for r in ok]))  # fmt: skip
        else:
            value = mean(r.spec.mean_acceptance_length for r in known)
            low = [r for r in known if r.spec.mean_acceptance_length < config.min_mean_acceptance]
            passed = value >= config.min_mean_acceptance
            checks.append(_check(
                "min_mean_acceptance", passed,
                f"mean acceptance {value:.2f} over {len(known)} case(s), min {config.min_mean_acceptance:g}",
                [] if passed else [r.case_id for r in low],
            ))  # fmt: skip

    if config.min_group_acceptance is not None:
        groups: dict[str, list[ProbeResult]] = defaultdict(list)
        for r in ok:
            if r.spec.mean_acceptance_length is not None:
                groups[_group(r)].append(r)
        if not groups:
            checks.append(_check("min_group_acceptance", False, "no case reported an acceptance length",
                                 [r.case_id for r in ok]))  # fmt: skip
        else:
            values = {g: mean(r.spec.mean_acceptance_length for r in rs) for g, rs in groups.items()}
            low = [g for g, v in values.items() if v < config.min_group_acceptance]
            parts = ", ".join(f"{g}: {values[g]:.2f}" for g in groups)
            checks.append(_check(
                "min_group_acceptance", not low,
                (f"below {config.min_group_acceptance:g} in {', '.join(low)}; " if low else "")
                + f"per group: {parts}",
                [r.case_id for g in low for r in groups[g]],
            ))  # fmt: skip

    if config.min_tokens_per_second is not None:
        source = config.tokens_per_second_source
        if source == "server":
            speeds = [(r, r.spec.server_tokens_per_second) for r in ok]
        else:
            speeds = [(r, r.timings.decode_tokens_per_second) for r in ok]
        speeds = [(r, v) for r, v in speeds if v is not None]
        name = "min_tokens_per_second"
        if not speeds:
            checks.append(_check(name, False, f"no {source}-side tok/s figure in any case",
                                 [r.case_id for r in ok]))  # fmt: skip
        else:
            value = mean(v for _, v in speeds)
            passed = value >= config.min_tokens_per_second
            slow = [r.case_id for r, v in speeds if v < config.min_tokens_per_second]
            checks.append(_check(
                name, passed,
                f"mean {source} tok/s {value:.1f} over {len(speeds)} case(s), min {config.min_tokens_per_second:g}",
                [] if passed else slow,
            ))  # fmt: skip

    if config.max_ttft_s is not None:
        ttfts = [(r, r.timings.ttft_s) for r in ok if r.timings.ttft_s is not None]
        if not ttfts:
            checks.append(_check("max_ttft_s", False, "no TTFT measured in any case (it needs --stream)",
                                 [r.case_id for r in ok]))  # fmt: skip
        else:
            slow = [r.case_id for r, v in ttfts if v > config.max_ttft_s]
            worst = max(v for _, v in ttfts)
            checks.append(_check(
                "max_ttft_s", not slow,
                f"slowest time to first token {worst:.2f} s over {len(ttfts)} case(s), max {config.max_ttft_s:g} s",
                slow,
            ))  # fmt: skip

    if config.lossless:
        checks.append(_lossless_check(report, config))

    if config.canary and report.canary is not None:
        checks.append(_canary_check(report))

    if config.fail_on_findings == "none":
        pass
    elif config.fail_on_findings is None:
        # Findings that say the run's own numbers or state cannot be trusted fail the gate even
        # when the matrix does not ask to fail on findings: every threshold above reads them.
        bad = [f for f in report.findings if f.id in CRITICAL_FINDINGS]
        if bad:
            checks.append(_check(
                "critical_findings", False,
                f"{len(bad)} finding(s) that make the run untrustworthy: "
                + "; ".join(f"[{f.severity}] {f.title}" for f in bad),
                [c for f in bad for c in f.cases],
            ))  # fmt: skip
    else:
        bad = [f for f in report.findings if f.at_least(config.fail_on_findings)]
        checks.append(_check(
            "findings", not bad,
            (f"{len(bad)} finding(s) at {config.fail_on_findings} or worse: "
             + "; ".join(f"[{f.severity}] {f.title}" for f in bad))
            if bad else f"no finding at {config.fail_on_findings} or worse",
            [c for f in bad for c in f.cases],
        ))  # fmt: skip

    return GateResult(all(c.passed for c in checks), checks)


def _canary_check(report: RunReport) -> GateCheck:
    canary = report.canary
    first = next((r for r in report.results if r.case_id == canary.case_id), None)
    if first is None or not first.ok or not canary.ok:
        what = canary.error if not canary.ok else "the first case failed"
        return _check("canary", canary.ok, f"canary not comparable: {what}", [canary.case_id])
    problems = canary_problems(first, canary)
    if not problems:
        return _check("canary", True, f"{canary.case_id} sent again after {canary.seq} request(s): same answer")
    return _check("canary", False, f"{canary.case_id} sent again at the end: " + "; ".join(problems),
                  [canary.case_id])  # fmt: skip


def canary_problems(first: ProbeResult, canary: ProbeResult) -> list[str]:
    """How the canary differs from the first run of its case: the text at T=0, the acceptance."""
    problems = []
    if first.case.temperature != 0:
        return problems  # sampled answers differ by design
    a, b = (first.reasoning or "") + first.output, (canary.reasoning or "") + canary.output
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        problems.append(f"the T=0 text differs from char {at} ({a[at:at + 30]!r} first, {b[at:at + 30]!r} at the end)")
    before, after = first.spec.mean_acceptance_length, canary.spec.mean_acceptance_length
    if before is not None and after is not None and after < before - max(CANARY_ACCEPTANCE_MARGIN, 0.15 * before):
        problems.append(f"acceptance fell from {before:.2f} to {after:.2f}")
    return problems


def _lossless_check(report: RunReport, config: GateConfig) -> GateCheck:
    compared = [r for r in _ok(report) if r.baseline and r.baseline.verdict not in ("", SKIPPED)]
    if not any(r.baseline for r in report.results):
        if report.interrupted:
            return _check("lossless", False, "the run stopped before the baseline ran")
        return _check("lossless", False, "lossless = true but no baseline ran (set [baseline] mode or --baseline)")
    bad_verdicts = {MISMATCH, ERROR} | (set() if config.allow_near_ties else {NEAR_TIE})
    bad = [r for r in compared if r.baseline.verdict in bad_verdicts]
    ties = [r for r in compared if r.baseline.verdict == NEAR_TIE]
    disagreements = repeat_disagreements(report)
    parts = [f"{len(compared) - len(bad)}/{len(compared)} T=0 case(s) match the baseline"]
    if ties:
        parts.append(f"{len(ties)} near-tie(s){' allowed' if config.allow_near_ties else ''}")
    if bad:
        first = bad[0].baseline
        parts.append(f"first: {bad[0].case_id}: {first.detail}")
    if disagreements:
        d = disagreements[0]
        parts.append(f"{len(disagreements)} repeat pair(s) disagree (first {d.cases[0]} vs {d.cases[1]} "
                     f"at char {d.char_index})")  # fmt: skip
    if not compared:
        return _check("lossless", False, "no T=0 case could be compared with the baseline")
    cases = [r.case_id for r in bad] + [c for d in disagreements for c in d.cases]
    return _check("lossless", not bad and not disagreements, "; ".join(parts), cases)


def _top_reason(result: ProbeResult) -> str:
    counting = result.quality.counting_reasons if result.quality is not None else []
    if not counting:
        return "garbage"
    top = counting[0]
    return f"{top.code}: {top.detail}"[:120]
