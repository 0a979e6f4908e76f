"""Lossless check: at T=0 speculative decoding must say exactly what the target alone says.

Each T=0 case is re-run without speculation (the *baseline*) and the two texts are compared:

- ``budget0``  — the same server with ``tree_budget=0`` (plain autoregressive through the same
  loop; only for dialects that send a budget: ddtree, ddtree-mlx, llamacpp);
- ``url:URL``  — a second server that does not speculate;
- ``engine``   — the in-process target alone (greedy), from ``--target``/``--gguf``.

A difference is located by character (and by token when the baseline returned per-token logprobs
or token ids). With logprobs, the divergence is classified: when the token the speculative run
chose is the baseline's runner-up and the two are within ``near_tie_gap`` nats, it is a numerics
near-tie (bf16 can flip those) rather than a verification or cache bug. T=0 repeats of a case
must also agree with each other (``repeat_disagreements``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddtree_diag.budget import AR_BUDGET, overrun
from ddtree_diag.errors import UsageError
from ddtree_diag.records import (
    BASELINE_ERROR,
    IDENTICAL,
    MISMATCH,
    NEAR_TIE,
    SKIPPED,
    STATUS_HTTP_ERROR,
    BaselineComparison,
    ProbeCase,
    ProbeResult,
    RunReport,
)

if TYPE_CHECKING:
    from ddtree_diag.backends import Backend

__all__ = [
    "ERROR", "IDENTICAL", "MISMATCH", "NEAR_TIE", "SKIPPED", "BaselineSpec", "baseline_case", "check_possible",
    "classify_divergence", "compare_result", "parse_baseline", "repeat_disagreements",
]

MODES = ("budget0", "url", "engine")
DEFAULT_NEAR_TIE_GAP = 0.05  # nats between the top-2 logprobs; bf16 rounding moves logits ~1e-2
DEFAULT_TOP_LOGPROBS = 5
CONTEXT_CHARS = 30  # characters shown either side of a divergence

ERROR = BASELINE_ERROR  # the baseline request failed, or it speculated
BASELINE_SPECULATED = "the baseline speculated"

_BASELINE_KEYS = {"mode", "url", "near_tie_gap", "top_logprobs"}


@dataclass
class BaselineSpec:
    mode: str  # one of MODES
    url: str | None = None  # for mode "url"
    near_tie_gap: float = DEFAULT_NEAR_TIE_GAP
    top_logprobs: int = DEFAULT_TOP_LOGPROBS

    def describe(self) -> str:
        return {
            "budget0": "same server, tree_budget=0",
            "url": f"non-speculative server {self.url}",
            "engine": "in-process target alone (greedy)",
        }[self.mode]


def parse_baseline(value: str | dict[str, Any] | None, where: str = "--baseline") -> BaselineSpec | None:
    """``budget0`` | ``url:URL`` | ``engine`` (a flag), or a matrix's ``[baseline]`` table."""
    if value is None:
        return None
    if isinstance(value, str):
        return _parse_mode(value, BaselineSpec(mode="budget0"), where)
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be a table")
    if not value:
        return None
    for key in value:
        if key not in _BASELINE_KEYS:
            raise UsageError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(_BASELINE_KEYS))})")
    spec = BaselineSpec(mode="budget0")
    gap = value.get("near_tie_gap", DEFAULT_NEAR_TIE_GAP)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or gap < 0:
        raise UsageError(f"{where}.near_tie_gap must be a number >= 0, got {gap!r}")
    spec.near_tie_gap = float(gap)
    top = value.get("top_logprobs", DEFAULT_TOP_LOGPROBS)
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise UsageError(f"{where}.top_logprobs must be an integer 0-20, got {top!r}")
    spec.top_logprobs = top
    mode = value.get("mode")
    if not isinstance(mode, str):
        raise UsageError(f"{where}.mode must be one of budget0, url, engine")
    if mode == "url":
        mode = f"url:{value.get('url') or ''}"
    elif value.get("url"):
        raise UsageError(f"{where}.url is only used with mode = \"url\"")
    return _parse_mode(mode, spec, where)


def _parse_mode(text: str, spec: BaselineSpec, where: str) -> BaselineSpec | None:
    text = text.strip()
    if text.lower() in ("none", "off", ""):
        return None
    if text.startswith("url:"):
        url = text[4:].strip()
        if not url:
            raise UsageError(f"{where}: url mode needs a URL, e.g. url:http://127.0.0.1:8001")
        from ddtree_diag.backends.http import normalise_url

        return dataclasses.replace(spec, mode="url", url=normalise_url(url))
    if text in ("budget0", "engine"):
        return dataclasses.replace(spec, mode=text, url=None)
    raise UsageError(f"{where}: expected budget0, url:URL or engine, got {text!r}")


# ---------------------------------------------------------------------------------------------
# Comparison (pure)


def first_difference(actual: str, expected: str) -> int | None:
    """Index of the first differing character; None when the texts are equal."""
    if actual == expected:
        return None
    for index, (a, b) in enumerate(zip(actual, expected, strict=False)):
        if a != b:
            return index
    return min(len(actual), len(expected))


def around(text: str, index: int, chars: int = CONTEXT_CHARS) -> str:
    """``…before⟨here⟩after…`` around ``index`` — the divergence point made visible."""
    start = max(0, index - chars)
    head = ("…" if start else "") + text[start:index]
    tail = text[index : index + chars] + ("…" if index + chars < len(text) else "")
    return f"{head}⟨{tail}" if tail else f"{head}⟨end of text⟩"


def logprob_entries(result: ProbeResult) -> list[dict[str, Any]] | None:
    """Per-token logprobs the server returned (OpenAI shape), or None."""
    logprobs = result.extras.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content:
        return None
    entries = [e for e in content if isinstance(e, dict) and isinstance(e.get("token"), str)]
    return entries if len(entries) == len(content) else None


def _token_ids(result: ProbeResult) -> list[int] | None:
    for key in ("token_ids", "output_token_ids"):
        ids = result.extras.get(key)
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return ids
    return None


def _locate_token(
    entries: list[dict[str, Any]], field_text: str, field: str, char_index: int
) -> tuple[int, int] | None:
    """(token index, char offset of that token in the field) covering ``char_index``, mapping the
    field's text into the concatenated token strings; None when they do not line up."""
    joined = "".join(e["token"] for e in entries)
    if field == "output" and joined.endswith(field_text):
        offset = len(joined) - len(field_text)
    else:
        offset = joined.find(field_text)
        if offset < 0:
            return None
    position = offset + char_index
    start = 0
    for index, entry in enumerate(entries):
        end = start + len(entry["token"])
        if start <= position < end or (position == end and index == len(entries) - 1):
            return index, start - offset
        start = end
    return None


def classify_divergence(
    entry: dict[str, Any], actual_rest: str, near_tie_gap: float
) -> tuple[str, str, float | None, list[dict[str, Any]]]:
    """Near-tie or real mismatch at one baseline token position.

    ``entry`` is the baseline's logprob entry there; ``actual_rest`` the speculative text from that
    token's start. Returns (verdict, detail, gap in nats or None, the top candidates)."""
    candidates = [c for c in entry.get("top_logprobs") or [] if isinstance(c, dict)]
    candidates = [
        c for c in candidates if isinstance(c.get("token"), str) and isinstance(c.get("logprob"), (int, float))
    ]
    candidates.sort(key=lambda c: -c["logprob"])
    top = [{"token": c["token"], "logprob": round(float(c["logprob"]), 4)} for c in candidates]
    expected = entry["token"]
    expected_lp = entry.get("logprob")
    if not isinstance(expected_lp, (int, float)):
        expected_lp = candidates[0]["logprob"] if candidates else None
    chosen = [c for c in candidates if c["token"] != expected and c["token"] and actual_rest.startswith(c["token"])]
    if len(candidates) < 2 or expected_lp is None:
        return MISMATCH, "no top_logprobs at the divergence: cannot tell a near-tie from a bug", None, top
    if not chosen:
        gap = float(expected_lp) - candidates[1]["logprob"] if candidates[0]["token"] == expected else None
        return (
            MISMATCH,
            f"the speculative token is not among the baseline's top {len(candidates)} candidates",
            None if gap is None else round(gap, 4),
            top,
        )
    best = max(chosen, key=lambda c: (len(c["token"]), c["logprob"]))
    gap = float(expected_lp) - float(best["logprob"])
    if gap <= near_tie_gap:
        return (
            NEAR_TIE,
            f"speculative run chose {best['token']!r}, {gap:.3f} nats below the baseline's {expected!r} "
            f"(<= {near_tie_gap:g}): a numerics near-tie",
            round(gap, 4),
            top,
        )
    return (
        MISMATCH,
        f"speculative run chose {best['token']!r}, {gap:.3f} nats below the baseline's {expected!r} "
        f"(> {near_tie_gap:g}): not a near-tie",
        round(gap, 4),
        top,
    )


def compare_result(result: ProbeResult, baseline: ProbeResult, spec: BaselineSpec) -> BaselineComparison:
    """The lossless comparison of one T=0 case with its baseline run."""
    record = BaselineComparison(
        mode=spec.mode, verdict=IDENTICAL, source=spec.describe(), baseline_case_id=baseline.case_id
    )
    if not baseline.ok:
        record.verdict = ERROR
        record.detail = f"baseline request failed: {baseline.status}: {baseline.error}"
        return record
    record.baseline_output = baseline.output
    record.baseline_reasoning = baseline.reasoning or None
    record.baseline_tool_calls = baseline.tool_calls
    speculated = overrun(AR_BUDGET, baseline.spec)
    if speculated is not None:  # speculation against speculation proves nothing
        record.verdict = ERROR
        record.detail = f"{BASELINE_SPECULATED} ({speculated}): " + (
            "the server does not honour a per-request budget; use --baseline url:URL (a server "
            "without a draft) or --baseline engine" if spec.mode == "budget0" else "it is no non-speculative run"
        )
        return record
    _baseline_workload(record, result, baseline)
    if baseline.extras.get("logprobs_rejected"):
        record.logprobs = "not accepted by the baseline server"
    fields = []
    if result.reasoning or baseline.reasoning:
        fields.append(("reasoning", result.reasoning or "", baseline.reasoning or ""))
    fields.append(("output", result.output, baseline.output))
    if result.tool_calls or baseline.tool_calls:
        fields.append(("tool_calls", calls_text(result.tool_calls), calls_text(baseline.tool_calls)))
    for field, actual, expected in fields:
        index = first_difference(actual, expected)
        if index is None:
            continue
        record.verdict = MISMATCH
        record.field, record.char_index = field, index
        record.expected, record.actual = around(expected, index), around(actual, index)
        detail = f"{field} differs from the baseline at character {index}"
        ids, base_ids = _token_ids(result), _token_ids(baseline)
        if ids is not None and base_ids is not None:
            record.token_index = first_difference_list(ids, base_ids)
        entries = logprob_entries(baseline)
        located = _locate_token(entries, expected, field, index) if entries else None
        if located is not None:
            token_index, token_start = located
            record.token_index = token_index
            verdict, why, gap, top = classify_divergence(
                entries[token_index], actual[token_start:], spec.near_tie_gap
            )
            record.verdict, record.logprob_gap, record.top_logprobs = verdict, gap, top
            detail += f" (token {token_index}): {why}"
        elif record.token_index is not None:
            detail += f" (token {record.token_index}); no logprobs to classify it"
        else:
            detail += "; no logprobs to tell a near-tie from a bug"
        record.detail = detail
        return record
    record.detail = "identical to the baseline"
    return record


def calls_text(calls: list[dict[str, Any]] | None) -> str:
    """Tool calls as one comparable text: ``name(arguments)`` each (call ids differ by design)."""
    return "".join(f"{c.get('name')}({c.get('arguments')})" for c in calls or [])


def _baseline_workload(record: BaselineComparison, result: ProbeResult, baseline: ProbeResult) -> None:
    """What the workload checks need of the baseline's answer: its structured-output check (run on
    the baseline's answer to the speculative case's request) and whether it kept reasoning apart."""
    from ddtree_diag.checks import structured, workloads

    own = dataclasses.replace(baseline, case=result.case)  # judged by the same request's rules
    check = structured.check(own)
    record.baseline_structured = check.to_dict() if check is not None else None
    if result.case.enable_thinking is True:
        record.baseline_reasoning_leak = workloads.reasoning_leak(own) is not None


def first_difference_list(a: list[Any], b: list[Any]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class RepeatDisagreement:
    """Two T=0 repeats of one case whose texts differ."""

    group: str  # the case id without its repeat index
    cases: list[str]  # [first repeat, the one that differs]
    field: str  # "reasoning" | "output"
    char_index: int
    first: str  # the first repeat around the divergence
    other: str


def repeat_disagreements(report: RunReport) -> list[RepeatDisagreement]:
    """T=0 repeats of one case whose texts differ from the first repeat's."""
    groups: dict[str, list[ProbeResult]] = {}
    for result in report.results:
        if result.ok and result.case.temperature == 0:
            groups.setdefault(result.case.group_key, []).append(result)
    out = []
    for group, results in groups.items():
        first = results[0]
        for other in results[1:]:
            for field in ("reasoning", "output"):
                expected, actual = getattr(first, field) or "", getattr(other, field) or ""
                index = first_difference(actual, expected)
                if index is not None:
                    out.append(RepeatDisagreement(
                        group, [first.case_id, other.case_id], field, index, around(expected, index),
                        around(actual, index),
                    ))
                    break
    return out


# ---------------------------------------------------------------------------------------------
# What the baseline runs (the orchestrator runs it)


def check_possible(spec: BaselineSpec, backend: Backend) -> None:
    """Refuse a baseline that cannot mean anything for this target (before the run starts, after
    ``backend.prepare`` has detected its dialect)."""
    if spec.mode == "budget0" and not backend.sends_budget:
        raise UsageError(
            f"--baseline budget0 needs a server that takes a per-request tree budget; {backend.dialect_name} "
            f"does not ({backend.budget_knob}): use --baseline url:URL (a server without speculation) "
            "or --baseline engine"
        )


def baseline_case(case: ProbeCase, spec: BaselineSpec, *, logprobs: bool) -> ProbeCase:
    """The case as the baseline runs it: no speculation, and per-token logprobs when asked."""
    extra = dict(case.extra)
    if logprobs and spec.top_logprobs:
        extra.update(logprobs=True, top_logprobs=spec.top_logprobs)
    budget = AR_BUDGET if spec.mode in ("budget0", "engine") else None  # url: send no budget at all
    return dataclasses.replace(case, tree_budget=budget, extra=extra)


def logprobs_refused(result: ProbeResult) -> bool:
    """A baseline request that a server rejected because it asked for logprobs."""
    return (
        result.status == STATUS_HTTP_ERROR
        and result.http_status in (400, 422)
        and "logprob" in (result.error or "").lower()
    )


def skip_reason(result: ProbeResult) -> str | None:
    """Why a case is not compared with the baseline (None: it is)."""
    if not result.ok:
        return "the case itself failed"
    if result.case.temperature != 0:
        return "T>0: sampled output is not comparable"
    return None


def summary_note(spec: BaselineSpec, compared: list[ProbeResult]) -> str:
    counts: dict[str, int] = {}
    for result in compared:
        verdict = result.baseline.verdict if result.baseline else ERROR
        counts[verdict] = counts.get(verdict, 0) + 1
    summary = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
    return f"lossless baseline: {spec.describe()}; {summary}"
