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
    min_speedup = 1.0                # load sweep: aggregate tok/s with / without speculation at
                                     # every level, or per level: { 1 = 1.3, 16 = 1.0 }
    max_itl_p99_ms = 50              # load sweep: the speculative side's ITL p99 at every level
    against_acceptance_tolerance = 0.1   # with --against: acceptance drop allowed, a fraction
    against_tps_tolerance = 0.3      # ... tok/s drop allowed (both: default from the
                                     # known-good's repeat spread, see checks/against.py)
    against_fail_on_text_change = true   # a T=0 text unlike the known-good's fails (default)

Every threshold is optional; a missing one is not checked. ``CHECKS`` lists the checks, in the
order they are reported: each names the ``[gate]`` keys it reads (with their parsing) and judges
a run; ``parse_gate`` knows the keys from it and ``evaluate`` runs it. ``evaluate`` returns
``{"passed", "checks": [{"name", "passed", "detail", "cases"}]}``; a check's ``cases`` are the
case ids that made it fail (or, for a passing check, that it was measured on is not recorded).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from statistics import mean
from typing import Any

from ddtree_diag.checks import against as _against
from ddtree_diag.checks import speedup as _speedup
from ddtree_diag.checks.findings import CRITICAL_FINDINGS
from ddtree_diag.checks.lossless import ERROR, MISMATCH, NEAR_TIE, SKIPPED, repeat_disagreements
from ddtree_diag.errors import UsageError
from ddtree_diag.records import SEVERITIES, GateCheck, GateResult, ProbeResult, RunReport

__all__ = [
    "CANARY_ACCEPTANCE_MARGIN", "CHECKS", "CRITICAL_FINDINGS", "KEYS", "Check", "GateConfig", "Key",
    "canary_problems", "default_config", "describe_config", "evaluate", "parse_gate",
]

_SOURCES = ("client", "server")
CANARY_ACCEPTANCE_MARGIN = 0.3  # tokens/round, or 15 % if larger


@dataclass
class GateConfig:
    """The ``[gate]`` table, parsed (every field is one of ``KEYS``)."""

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
    # the load sweep (checks/speedup.py): a ratio for every level, or {level: ratio}
    min_speedup: float | dict[int, float] | None = None
    max_itl_p99_ms: float | None = None
    # ``gate --against``: drops allowed against the known-good run (None: from its repeat spread)
    against_acceptance_tolerance: float | None = None
    against_tps_tolerance: float | None = None
    against_fail_on_text_change: bool = True


def default_config(lossless: bool) -> GateConfig:
    """The checks a probe run shows, and a gate applies when its matrix sets no thresholds:
    no failed request, no garbage, and lossless when a baseline ran."""
    return GateConfig(max_failed=0, max_garbage=0, lossless=lossless)


def describe_config(config: GateConfig) -> str:
    """The thresholds a config sets, as ``key = value`` pairs (for notes)."""
    unset = GateConfig()
    shown = [f"{name} = {str(value).lower() if isinstance(value, bool) else value}"
             for name, value in vars(config).items() if value != getattr(unset, name)]
    return ", ".join(shown) or "none"


# ---------------------------------------------------------------------------------------------
# Keys: a [gate] value checked and converted (UsageError names the key)


@dataclass(frozen=True)
class Key:
    """One ``[gate]`` key and how its TOML value becomes the config's (``where`` names it)."""

    name: str
    parse: Callable[[Any, str], Any]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise UsageError(f"{where} must be a number >= 0, got {value!r}")
    return float(value)


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{where} must be an integer >= 0, got {value!r}")
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{where} must be true or false, got {value!r}")
    return value


def _source(value: Any, where: str) -> str:
    if value not in _SOURCES:
        raise UsageError(f"{where} must be \"client\" or \"server\", got {value!r}")
    return value


def _severity(value: Any, where: str) -> str:
    if value is False or value == "none":
        return "none"  # said explicitly: no findings check at all, not even the critical ones
    if value not in SEVERITIES:
        raise UsageError(f"{where} must be one of {', '.join(SEVERITIES)} or \"none\", got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Checks


@dataclass(frozen=True)
class Check:
    """One gate check: the ``[gate]`` keys it reads, and how it judges a run (``evaluate`` gives
    None when the config does not ask for it, or there is nothing to judge)."""

    name: str
    keys: tuple[Key, ...]
    evaluate: Callable[[RunReport, GateConfig], GateCheck | None]


def _check(name: str, passed: bool, detail: str, cases: list[str] | None = None) -> GateCheck:
    return GateCheck(name, passed, detail, list(dict.fromkeys(cases or [])))


def _count_check(name: str, hits: list[ProbeResult], most: int, what: str,
                 describe: Callable[[ProbeResult], str]) -> GateCheck:
    """At most ``most`` cases of a kind; the detail names the first three."""
    shown = "; ".join(f"{r.case_id}: {describe(r)}" for r in hits[:3])
    return _check(name, len(hits) <= most, f"{len(hits)} {what}, max {most}" + (f" — {shown}" if shown else ""),
                  [r.case_id for r in hits])


def _ran_cases(report: RunReport, config: GateConfig) -> GateCheck | None:
    return None if report.results else _check("ran_cases", False, "no case ran")


def _complete(report: RunReport, config: GateConfig) -> GateCheck | None:
    if not report.interrupted:
        return None
    return _check("complete", False, f"the run did not finish: {report.stop_label() or 'interrupted'}")


def _max_failed(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.max_failed is None:
        return None
    failed = [r for r in report.results if not r.ok]
    return _count_check("max_failed", failed, config.max_failed, "failed request(s)",
                        lambda r: f"{r.status}: {r.error}")


def _max_garbage(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.max_garbage is None:
        return None
    garbage = [r for r in report.ok_results if r.garbage]
    return _count_check("max_garbage", garbage, config.max_garbage, "garbage case(s)", _top_reason)


def _min_completion_tokens(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.min_completion_tokens is None:
        return None
    short = [r for r in report.ok_results
             if (r.completion_tokens if r.completion_tokens is not None else len(r.output.split()))
             < config.min_completion_tokens]
    return _check(
        "min_completion_tokens", not short,
        f"{len(short)} case(s) below {config.min_completion_tokens} completion tokens"
        + (": " + ", ".join(f"{r.case_id} ({r.completion_tokens})" for r in short[:4]) if short else ""),
        [r.case_id for r in short],
    )


def _min_mean_acceptance(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.min_mean_acceptance is None:
        return None
    ok = report.ok_results
    known = [r for r in ok if r.spec.mean_acceptance_length is not None]
    if not known:
        return _check("min_mean_acceptance", False,
                      "no case reported an acceptance length (does the server expose it?)",
                      [r.case_id for r in ok])
    value = mean(r.spec.mean_acceptance_length for r in known)
    low = [r for r in known if r.spec.mean_acceptance_length < config.min_mean_acceptance]
    passed = value >= config.min_mean_acceptance
    return _check(
        "min_mean_acceptance", passed,
        f"mean acceptance {value:.2f} over {len(known)} case(s), min {config.min_mean_acceptance:g}",
        [] if passed else [r.case_id for r in low],
    )


def _min_group_acceptance(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.min_group_acceptance is None:
        return None
    ok = report.ok_results
    groups: dict[str, list[ProbeResult]] = defaultdict(list)
    for r in ok:
        if r.spec.mean_acceptance_length is not None:
            groups[r.case.group_label].append(r)
    if not groups:
        return _check("min_group_acceptance", False, "no case reported an acceptance length",
                      [r.case_id for r in ok])
    values = {g: mean(r.spec.mean_acceptance_length for r in rs) for g, rs in groups.items()}
    low = [g for g, v in values.items() if v < config.min_group_acceptance]
    parts = ", ".join(f"{g}: {values[g]:.2f}" for g in groups)
    return _check(
        "min_group_acceptance", not low,
        (f"below {config.min_group_acceptance:g} in {', '.join(low)}; " if low else "") + f"per group: {parts}",
        [r.case_id for g in low for r in groups[g]],
    )


def _min_tokens_per_second(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.min_tokens_per_second is None:
        return None
    ok = report.ok_results
    source = config.tokens_per_second_source
    if source == "server":
        speeds = [(r, r.spec.server_tokens_per_second) for r in ok]
    else:
        speeds = [(r, r.timings.decode_tokens_per_second) for r in ok]
    speeds = [(r, v) for r, v in speeds if v is not None]
    name = "min_tokens_per_second"
    if not speeds:
        return _check(name, False, f"no {source}-side tok/s figure in any case", [r.case_id for r in ok])
    value = mean(v for _, v in speeds)
    passed = value >= config.min_tokens_per_second
    slow = [r.case_id for r, v in speeds if v < config.min_tokens_per_second]
    return _check(
        name, passed,
        f"mean {source} tok/s {value:.1f} over {len(speeds)} case(s), min {config.min_tokens_per_second:g}",
        [] if passed else slow,
    )


def _max_ttft_s(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.max_ttft_s is None:
        return None
    ok = report.ok_results
    ttfts = [(r, r.timings.ttft_s) for r in ok if r.timings.ttft_s is not None]
    if not ttfts:
        return _check("max_ttft_s", False, "no TTFT measured in any case (it needs --stream)",
                      [r.case_id for r in ok])
    slow = [r.case_id for r, v in ttfts if v > config.max_ttft_s]
    worst = max(v for _, v in ttfts)
    return _check(
        "max_ttft_s", not slow,
        f"slowest time to first token {worst:.2f} s over {len(ttfts)} case(s), max {config.max_ttft_s:g} s",
        slow,
    )


def _lossless(report: RunReport, config: GateConfig) -> GateCheck | None:
    return _lossless_check(report, config) if config.lossless else None


def _canary(report: RunReport, config: GateConfig) -> GateCheck | None:
    return _canary_check(report) if config.canary and report.canary is not None else None


def _findings(report: RunReport, config: GateConfig) -> GateCheck | None:
    if config.fail_on_findings == "none":
        return None
    if config.fail_on_findings is None:
        # Findings that say the run's own numbers or state cannot be trusted fail the gate even
        # when the matrix does not ask to fail on findings: every threshold above reads them.
        bad = [f for f in report.findings if f.id in CRITICAL_FINDINGS]
        if not bad:
            return None
        return _check(
            "critical_findings", False,
            f"{len(bad)} finding(s) that make the run untrustworthy: "
            + "; ".join(f"[{f.severity}] {f.title}" for f in bad),
            [c for f in bad for c in f.cases],
        )
    bad = [f for f in report.findings if f.at_least(config.fail_on_findings)]
    return _check(
        "findings", not bad,
        (f"{len(bad)} finding(s) at {config.fail_on_findings} or worse: "
         + "; ".join(f"[{f.severity}] {f.title}" for f in bad))
        if bad else f"no finding at {config.fail_on_findings} or worse",
        [c for f in bad for c in f.cases],
    )


CHECKS: tuple[Check, ...] = (
    Check("ran_cases", (), _ran_cases),
    Check("complete", (), _complete),
    Check("max_failed", (Key("max_failed", _count),), _max_failed),
    Check("max_garbage", (Key("max_garbage", _count),), _max_garbage),
    Check("min_completion_tokens", (Key("min_completion_tokens", _count),), _min_completion_tokens),
    Check("min_mean_acceptance", (Key("min_mean_acceptance", _number),), _min_mean_acceptance),
    Check("min_group_acceptance", (Key("min_group_acceptance", _number),), _min_group_acceptance),
    Check("min_tokens_per_second",
          (Key("min_tokens_per_second", _number), Key("tokens_per_second_source", _source)), _min_tokens_per_second),
    Check("max_ttft_s", (Key("max_ttft_s", _number),), _max_ttft_s),
    Check("min_speedup", (Key("min_speedup", _speedup.parse_min_speedup),), _speedup.min_speedup_check),
    Check("max_itl_p99_ms", (Key("max_itl_p99_ms", _speedup.parse_milliseconds),), _speedup.max_itl_p99_check),
    Check("lossless", (Key("lossless", _flag), Key("allow_near_ties", _flag)), _lossless),
    Check("canary", (Key("canary", _flag),), _canary),
    Check("findings", (Key("fail_on_findings", _severity),), _findings),  # "critical_findings" when unset
    # The against_* checks need the known-good run: evaluate() adds them when it is given one.
    Check("against", (Key("against_acceptance_tolerance", _against.fraction),
                      Key("against_tps_tolerance", _against.fraction),
                      Key("against_fail_on_text_change", _flag)), lambda report, config: None),
)
KEYS: dict[str, Key] = {key.name: key for check in CHECKS for key in check.keys}


def parse_gate(table: dict[str, Any], source: str = "<matrix>") -> GateConfig:
    """The ``[gate]`` table as a GateConfig; UsageError names the key at fault."""
    if not isinstance(table, dict):
        raise UsageError(f"{source}: [gate] must be a table")
    config = GateConfig()
    for key, value in table.items():
        if key not in KEYS:
            raise UsageError(f"{source}: unknown key gate.{key!r} (known: {', '.join(sorted(KEYS))})")
        setattr(config, key, KEYS[key].parse(value, f"{source}: gate.{key}"))
    return config


def evaluate(report: RunReport, config: GateConfig, against: _against.KnownGood | None = None) -> GateResult:
    """Apply every configured check to the run, and the ``against_*`` checks when a known-good
    run is given; the gate passes when all of them pass."""
    checks = [found for check in CHECKS if (found := check.evaluate(report, config)) is not None]
    if against is not None:
        checks += _against.compare(report, against, config)
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
                  [canary.case_id])


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
    compared = [r for r in report.ok_results if r.baseline and r.baseline.verdict not in ("", SKIPPED)]
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
                     f"at char {d.char_index})")
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
