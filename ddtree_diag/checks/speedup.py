"""Does speculation pay here? Findings and gate checks over the load sweep (``RunReport.load``).

Findings (``SPEEDUP_RULES``, registered in ``checks.findings.RULES``):

- ``speculation-slower-than-baseline`` (error): at some level the speed-up (aggregate tok/s with
  speculation / without) is below ``SLOWER_RATIO`` while the speculative side's mean acceptance
  is above ``WORKING_ACCEPTANCE`` (or unreported): the draft is accepted, yet speculation costs
  more than it saves there. The margin under 1.0 is for noise.
- ``speculation-inactive``: error when the sweep's speculative requests report no drafted tokens
  at all, or a mean acceptance ≤ ``INACTIVE_ACCEPTANCE`` at every level (every round commits one
  token); warning when acceptance is unreported and every level's speed-up is within
  ``INDISTINGUISHABLE`` (speculative and baseline runs cannot be told apart by speed).

Gate keys (read by ``checks.gate``): ``min_speedup`` (a number for every level, or a table
``{level = ratio}``) and ``max_itl_p99_ms`` (the speculative side's ITL p99 at every level).
``check_config`` refuses before the run a gate that asks for them without a sweep to measure.
"""

from __future__ import annotations

import math
from typing import Any

from ddtree_diag.checks.findings_base import FindingKind, rule
from ddtree_diag.errors import UsageError
from ddtree_diag.records import Finding, GateCheck, LoadLevel, RunReport

SLOWER_RATIO = 0.95  # a speed-up under this is slower than the baseline, beyond noise
WORKING_ACCEPTANCE = 1.5  # tokens/round above which the draft is doing its part
INACTIVE_ACCEPTANCE = 1.05  # tokens/round at or below which every round commits one token
INDISTINGUISHABLE = (0.95, 1.10)  # speed-up band where the two runs cannot be told apart


def _level_line(level: LoadLevel) -> str:
    spec, base = level.speculative, level.baseline
    accept = "acceptance not reported" if spec.mean_acceptance is None else f"acceptance {spec.mean_acceptance:.2f}"
    base_tps = "?" if base is None or base.tokens_per_second is None else f"{base.tokens_per_second:.1f}"
    spec_tps = "?" if spec.tokens_per_second is None else f"{spec.tokens_per_second:.1f}"
    return (f"concurrency {level.concurrency}: {spec_tps} tok/s with speculation vs {base_tps} without "
            f"(speed-up {level.speedup:.2f}×, {accept})")


SLOWER = FindingKind(
    "speculation-slower-than-baseline", ("error",),
    f"a load-sweep level's speed-up (aggregate tok/s with speculation / without) is < {SLOWER_RATIO} while "
    f"the speculative mean acceptance is > {WORKING_ACCEPTANCE} (or unreported): speculation costs more than "
    "it saves there",
)


@rule(SLOWER)
def slower_than_baseline(report: RunReport) -> list[Finding]:
    """Levels where speculation, though accepted, is slower than the baseline."""
    slow = [lv for lv in report.load if lv.speedup is not None and lv.speedup < SLOWER_RATIO
            and (lv.speculative.mean_acceptance is None or lv.speculative.mean_acceptance > WORKING_ACCEPTANCE)]
    if not slow:
        return []
    pays = [f"{lv.concurrency} ({lv.speedup:.2f}×)" for lv in report.load
            if lv.speedup is not None and lv.speedup >= 1.0]
    evidence = "; ".join(_level_line(lv) for lv in slow)
    if pays:
        evidence += f"; it pays at concurrency {', '.join(pays)}"
    levels = ", ".join(str(lv.concurrency) for lv in slow)
    check = ("Verification costs grow with the batch: under load the target is compute-bound and every rejected "
             "draft token is wasted work. Lower the tree budget / num_speculative_tokens for high load (or switch "
             "speculation off above the level where it stops paying), check the draft's own cost per round, and "
             "that the server batches verification across requests instead of running them one by one.")
    if slow[0].concurrency == 1:
        check = ("Even alone, a round's drafting and verification cost more than its accepted tokens save on this "
                 "hardware (a tree budget too large for the target, a draft too slow for it, a CPU-bound "
                 "target): try a smaller tree budget or a chain, and time the draft and verify stages. " + check)
    return [SLOWER.found(f"Speculation is slower than no speculation at concurrency {levels}", evidence, check, [])]


INACTIVE = FindingKind(
    "speculation-inactive", ("error", "warning"),
    f"the load sweep's speculative requests report no drafted tokens, or acceptance ≤ {INACTIVE_ACCEPTANCE} at "
    "every level (every round commits one token) — error; or acceptance is unreported and every level's "
    f"speed-up is within {INDISTINGUISHABLE[0]}–{INDISTINGUISHABLE[1]} — warning: speculation is off or not "
    "configured",
)


@rule(INACTIVE)
def speculation_inactive(report: RunReport) -> list[Finding]:
    """The sweep's speculative side does not speculate, by the server's numbers or by its speed."""
    levels = [lv for lv in report.load if lv.speculative.requests > lv.speculative.failures]
    if not levels:
        return []
    check = ("Is speculation configured and loaded? The draft model / speculative config at server start "
             "(vLLM --speculative-config, SGLang --speculative-algorithm, llama.cpp -md), the tree budget the "
             "server applies, and its start-up log for a draft that failed to load.")
    drafted = [lv.speculative.draft_tokens for lv in levels if lv.speculative.draft_tokens is not None]
    if drafted and not any(drafted):
        return [INACTIVE.found(
            "Speculation is inactive: the server drafted no token",
            f"{len(drafted)} level(s) of speculative requests report 0 drafted tokens "
            f"(concurrency {', '.join(str(lv.concurrency) for lv in levels)})",
            check, [], severity="error",
        )]
    accepts = [(lv, lv.speculative.mean_acceptance) for lv in levels if lv.speculative.mean_acceptance is not None]
    if accepts and len(accepts) == len(levels) and all(a <= INACTIVE_ACCEPTANCE for _, a in accepts):
        shown = ", ".join(f"{lv.concurrency}: {a:.2f}" for lv, a in accepts)
        return [INACTIVE.found(
            "Speculation is inactive: every round commits one token",
            f"mean acceptance by concurrency level {shown} (≤ {INACTIVE_ACCEPTANCE}: nothing drafted is accepted)",
            check, [], severity="error",
        )]
    low, high = INDISTINGUISHABLE
    ratios = [lv.speedup for lv in levels]
    if not accepts and all(r is not None and low <= r <= high for r in ratios):
        shown = ", ".join(f"{lv.concurrency}: {lv.speedup:.2f}×" for lv in levels)
        return [INACTIVE.found(
            "Speculation looks inactive: with and without it run at the same speed",
            f"speed-up by concurrency level {shown} (within {low}–{high}), and the server reports no acceptance",
            check + " Ask the server for per-request numbers (vLLM --per-request-spec-decode-metrics, "
            "SGLang return_spec_tokens_details, /metrics) to tell for sure.",
            [], severity="warning",
        )]
    return []


SPEEDUP_RULES = [slower_than_baseline, speculation_inactive]


# ---------------------------------------------------------------------------------------------
# Gate keys and checks (``checks.gate`` lists them in its CHECKS)


def parse_min_speedup(value: Any, where: str) -> float | dict[int, float]:
    """A ratio for every level, or a table {level = ratio}."""
    expected = "a number >= 0, or a table {concurrency = ratio} such as { 1 = 1.2, 16 = 1.0 }"
    if isinstance(value, dict):
        if not value:
            raise UsageError(f"{where} must be {expected}, got an empty table")
        table = {}
        for key, ratio in value.items():
            level = int(key) if isinstance(key, str) and key.isdigit() else key
            if isinstance(level, bool) or not isinstance(level, int) or level < 1:
                raise UsageError(f"{where}: {key!r} is not a concurrency level (an integer >= 1)")
            table[level] = _ratio(ratio, f"{where}.{key}", expected)
        return table
    return _ratio(value, where, expected)


def _ratio(value: Any, where: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise UsageError(f"{where} must be {expected}, got {value!r}")
    return float(value)


def parse_milliseconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UsageError(f"{where} must be a number of milliseconds > 0, got {value!r}")
    return float(value)


def check_config(config: Any, load: Any, baseline: Any, *, remote: bool, source: str) -> None:
    """Refuse, before anything is sent, a gate whose sweep keys cannot be measured: no sweep, no
    baseline for the speed-up, or a per-level ratio for a level the sweep does not run."""
    if config is None:
        return
    wanted = [key for key in ("min_speedup", "max_itl_p99_ms") if getattr(config, key, None) is not None]
    if not wanted:
        return
    if load is None:
        raise UsageError(f"{source}: gate.{wanted[0]} needs the load sweep: add [axes] concurrency = [1, 4, 16] "
                         "or pass --concurrency 1,4,16")
    if config.min_speedup is None:
        return
    if baseline is None or (baseline.mode == "engine" and remote):
        raise UsageError(f"{source}: gate.min_speedup needs a baseline on the server's hardware: [baseline] mode = "
                         "\"budget0\" or \"url\" (or --baseline budget0 / url:URL)")
    if isinstance(config.min_speedup, dict):
        missing = sorted(set(config.min_speedup) - set(load.levels))
        if missing:
            raise UsageError(f"{source}: gate.min_speedup names concurrency {', '.join(map(str, missing))}, which "
                             f"the sweep does not run (levels: {', '.join(map(str, load.levels))})")


def _gate_check(name: str, passed: bool, detail: str) -> GateCheck:
    return GateCheck(name, passed, detail, [])


def min_speedup_check(report: RunReport, config: Any) -> GateCheck | None:
    wanted = config.min_speedup
    if wanted is None:
        return None
    if not report.load:
        return _gate_check("min_speedup", False, "no load-sweep level ran")
    bars = wanted if isinstance(wanted, dict) else {lv.concurrency: wanted for lv in report.load}
    parts, failed = [], []
    for level in report.load:
        if level.concurrency not in bars:
            continue
        bar = bars[level.concurrency]
        if level.speedup is None:
            failed.append(f"concurrency {level.concurrency}: speed-up unknown ({level.note or 'no baseline'})")
            continue
        parts.append(f"{level.concurrency}: {level.speedup:.2f}×")
        if level.speedup < bar:
            failed.append(f"concurrency {level.concurrency}: {level.speedup:.2f}× < {bar:g}")
    missing = sorted(set(bars) - {lv.concurrency for lv in report.load})
    failed += [f"concurrency {n}: not measured (the sweep stopped first)" for n in missing]
    limit = f"min {wanted:g}" if not isinstance(wanted, dict) else "min " + ", ".join(
        f"{n}: {v:g}" for n, v in sorted(wanted.items()))
    detail = (("; ".join(failed) + " — ") if failed else "") + f"speed-up by level {', '.join(parts) or '—'}, {limit}"
    return _gate_check("min_speedup", not failed, detail)


def max_itl_p99_check(report: RunReport, config: Any) -> GateCheck | None:
    limit = config.max_itl_p99_ms
    if limit is None:
        return None
    if not report.load:
        return _gate_check("max_itl_p99_ms", False, "no load-sweep level ran")
    values = [(lv.concurrency, lv.speculative.itl_ms.get("p99")) for lv in report.load]
    unknown = [n for n, v in values if v is None]
    slow = [f"concurrency {n}: {v:.1f} ms" for n, v in values if v is not None and v > limit]
    shown = ", ".join(f"{n}: {'—' if v is None else f'{v:.1f}'}" for n, v in values)
    problems = slow + ([f"ITL unknown at concurrency {', '.join(map(str, unknown))} (it needs --stream)"]
                       if unknown else [])
    detail = (("; ".join(problems) + " — ") if problems else "") + f"ITL p99 (ms) by level {shown}, max {limit:g}"
    return _gate_check("max_itl_p99_ms", not problems, detail)
