"""Workload checks: structured output, reasoning separation, long context, prefix cache.

Each is a differential question: does the answer with speculation do what the same request
without it does (the lossless baseline, ``BaselineComparison``'s ``baseline_*`` fields and the
report's ``baseline_probes``)? The per-answer facts are pure functions here; the rules at the end
turn them into findings (``checks.findings`` registers them with the others).
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean
from typing import Any

from ddtree_diag.checks.findings_base import FindingKind, compare_advice, rule
from ddtree_diag.checks.quality.patterns import THINK_CLOSE, THINK_OPEN
from ddtree_diag.records import Finding, ProbeResult, RunReport, budget_label, thinking_label

# acceptance-falls-with-context: the longest context's acceptance below 60 % of the shortest's,
# and at least 0.5 tokens/round lower (the margins of thinking-acceptance-drop)
CONTEXT_ACCEPTANCE_RATIO = 0.6
CONTEXT_ACCEPTANCE_MIN_DROP = 0.5
# A prefix-cache hit: at least half the prompt served from the cache, or (no counters) a repeat
# whose time to first token is under half the first's, when the first took long enough to measure.
CACHE_HIT_FRACTION = 0.5
CACHE_TTFT_RATIO = 0.5
CACHE_MIN_FIRST_TTFT_S = 0.1  # below it, TTFT differences are launch overhead, not prefill
REASONING_PARSER_ADVICE = (
    "vLLM and SGLang: --reasoning-parser (qwen3, deepseek_r1, ...); llama.cpp: --jinja with "
    "--reasoning-format deepseek; a DDTree server: its reasoning split"
)


# ---------------------------------------------------------------------------------------------
# Per answer


def reasoning_leak(result: ProbeResult, baseline_reasoning: str | None = None) -> str | None:
    """How thinking text reached the content of a thinking-on answer (None: it did not, or
    thinking was not on): think tags in the content, or no separate reasoning where the
    baseline had one."""
    if result.case.enable_thinking is not True or not result.ok:
        return None
    content = result.output or ""
    if THINK_OPEN in content or THINK_CLOSE in content:
        tag = THINK_CLOSE if THINK_CLOSE in content else THINK_OPEN
        return f"{tag} in the content"
    if not (result.reasoning or "").strip() and (baseline_reasoning or "").strip():
        return "no reasoning_content, while the baseline separates its reasoning"
    return None


def cache_hit(repeat: ProbeResult, cold_ttft: float | None) -> tuple[bool | None, str]:
    """Whether ``repeat`` was served from the prefix cache: (hit, evidence); hit None = unknown.
    ``cold_ttft``: the time to first token of the same prompt sent cold."""
    if repeat.cached_tokens is not None:
        prompt = repeat.prompt_tokens
        needed = CACHE_HIT_FRACTION * prompt if prompt else 1
        return repeat.cached_tokens >= needed, f"{repeat.cached_tokens}/{prompt or '?'} prompt tokens cached"
    ttft = repeat.timings.ttft_s
    if ttft is None or cold_ttft is None or cold_ttft < CACHE_MIN_FIRST_TTFT_S:
        return None, "no cache counters, no usable TTFT"
    return ttft < CACHE_TTFT_RATIO * cold_ttft, f"TTFT {ttft * 1000:.0f} ms vs {cold_ttft * 1000:.0f} ms cold"


def cache_pairs(results: list[ProbeResult]) -> list[tuple[ProbeResult, ProbeResult]]:
    """(first, repeat) of every prefix-cache pair whose requests both succeeded."""
    firsts: dict[str, ProbeResult] = {}
    pairs = []
    for result in results:
        if not result.ok or result.case.cache_role is None:
            continue
        key = pair_key(result)
        if result.case.cache_role == "first":
            firsts[key] = result
        elif key in firsts:
            pairs.append((firsts[key], result))
    return pairs


def pair_key(result: ProbeResult) -> str:
    return result.case_id.replace("/cache=repeat/", "/cache=first/")


def workload_label(result: ProbeResult) -> str:
    """A short cell for the results table: ``json ✓``, ``tool ✗``, ``8k``, ``cache 2nd``..."""
    case = result.case
    parts = []
    if result.structured is not None:
        name = {"tool_call": "tool", "json_schema": "schema", "json_object": "json"}[result.structured.kind]
        parts.append(f"{name} {'✓' if result.structured.passed else '✗'}")
    if case.context_tokens is not None:  # the length asked for; the measured one is in the report
        parts.append(_k(case.context_tokens))
    if case.cache_role is not None:
        parts.append("cache 1st" if case.cache_role == "first" else "cache 2nd")
    return " ".join(parts)


def _k(tokens: int) -> str:
    for unit in (1024, 1000):
        if tokens >= unit and tokens % unit == 0:
            return f"{tokens // unit}k"
    return str(tokens)


def context_groups(results: list[ProbeResult]) -> dict[int, list[ProbeResult]]:
    """Results by prompt length (the fill's measured tokens, else the server's prompt count)."""
    groups: dict[int, list[ProbeResult]] = defaultdict(list)
    for result in results:
        if result.case.cache_role == "repeat":
            continue  # a cache hit's TTFT is not the context's
        tokens = (result.case.fill or {}).get("tokens") or result.prompt_tokens
        if tokens is None:
            tokens = 0
        groups[_context_key(result)].append(result)
    return dict(sorted(groups.items()))


def _context_key(result: ProbeResult) -> int:
    """The length asked for (0: as written): prompts filled to one size share a row, whatever
    their measured counts (each prompt's own words differ by a few tokens)."""
    return result.case.context_tokens or 0


def context_table(results: list[ProbeResult]) -> list[dict[str, Any]]:
    """Acceptance and TTFT per context length (one row per length with a long-context case):
    {"tokens", "label", "cases", "acceptance", "ttft_s", "garbage"}; [] when the run has no
    filled prompt."""
    if not any(r.case.context_tokens is not None for r in results):
        return []
    rows = []
    for asked, group in context_groups([r for r in results if r.ok]).items():
        accepts = [r.spec.mean_acceptance_length for r in group if r.spec.mean_acceptance_length is not None]
        ttfts = [r.timings.ttft_s for r in group if r.timings.ttft_s is not None]
        estimated = any((r.case.fill or {}).get("estimated") for r in group)
        measured = [int(r.case.fill["tokens"]) for r in group if (r.case.fill or {}).get("tokens")]
        tokens = round(mean(measured)) if measured else asked
        rows.append({
            "tokens": tokens,
            "label": "as written" if asked == 0 else f"{'~' if estimated else ''}{tokens} tokens",
            "cases": len(group),
            "acceptance": mean(accepts) if accepts else None,
            "ttft_s": mean(ttfts) if ttfts else None,
            "garbage": sum(1 for r in group if r.garbage),
        })
    return rows


# ---------------------------------------------------------------------------------------------
# Rules


STRUCTURED_OUTPUT_BROKEN = FindingKind(
    "structured-output-broken", ("error", "warning", "info"),
    "a JSON / JSON-schema / tool-call answer is invalid: error when the baseline's is valid, info when "
    "the baseline's is invalid too (the server does not enforce it), warning without a baseline",
)


@rule(STRUCTURED_OUTPUT_BROKEN)
def structured_output_broken(report: RunReport) -> list[Finding]:
    """Answers that had to be JSON or a tool call and are not, judged against the baseline."""
    failed = [r for r in report.ok_results if r.structured is not None and not r.structured.passed]
    if not failed:
        return []
    only_speculative, both, both_cut, unknown = [], [], [], []
    for result in failed:
        base = result.baseline.baseline_structured if result.baseline is not None else None
        if base is None:
            unknown.append(result)
        elif base.get("passed"):
            only_speculative.append(result)
        elif result.structured.cut and base.get("cut"):  # type: ignore[union-attr]
            both_cut.append(result)
        else:
            both.append(result)
    checked = [r for r in report.ok_results if r.structured is not None]
    out = []
    if only_speculative:
        out.append(STRUCTURED_OUTPUT_BROKEN.found(
            "Structured output breaks only with speculation",
            f"{len(only_speculative)}/{len(checked)} structured answers invalid with speculation, valid without: "
            + _problems(only_speculative),
            "The grammar must mask every drafted token by its own path and advance only by the accepted "
            "ones: a matcher fed draft tokens that were rejected, fed after it terminated, or skipped on "
            "the speculative path gives exactly this. Check the server's structured-output backend "
            "(xgrammar / llguidance / outlines) with speculation; vLLM and SGLang fixed several such bugs.",
            [r.case_id for r in only_speculative],
        ))
    if unknown:
        out.append(STRUCTURED_OUTPUT_BROKEN.found(
            "Structured output is invalid",
            f"{len(unknown)}/{len(checked)} structured answers invalid: " + _problems(unknown),
            f"Is structured output enforced at all on this server? {compare_advice(report)} to tell "
            "whether speculation is at fault.",
            [r.case_id for r in unknown], severity="warning",
        ))
    if both:
        out.append(STRUCTURED_OUTPUT_BROKEN.found(
            "Structured output is not enforced (with or without speculation)",
            f"{len(both)} structured answers invalid in the baseline too: " + _problems(both),
            "The server does not enforce response_format / tools: start it with a guided-decoding "
            "backend (vLLM --guided-decoding-backend / --structured-outputs-config, SGLang "
            "--grammar-backend, llama.cpp --jinja for tools) or send the grammar it expects.",
            [r.case_id for r in both], severity="info",
        ))
    if both_cut:
        out.append(STRUCTURED_OUTPUT_BROKEN.found(
            "Structured answers cut at max_tokens (with or without speculation)",
            f"{len(both_cut)} structured answers stopped at max_tokens before they were complete, in the "
            "baseline too: " + _problems(both_cut),
            "Not a speculation fault: raise max_tokens for these prompts, or bound the schema (maxLength, "
            "maximum, maxItems) so a small model cannot run on inside a value.",
            [r.case_id for r in both_cut], severity="info",
        ))
    return out


def _problems(results: list[ProbeResult], limit: int = 3) -> str:
    shown = [f"{r.case_id}: {r.structured.detail}" for r in results[:limit] if r.structured is not None]
    return "; ".join(shown) + (f" (+{len(results) - limit} more)" if len(results) > limit else "")


REASONING_IN_CONTENT = FindingKind(
    "reasoning-in-content", ("error", "warning"),
    "with thinking on, reasoning text or think tags land in `content`: error when the baseline separates "
    "them, warning when it leaks too (or there is no baseline)",
)


@rule(REASONING_IN_CONTENT)
def reasoning_in_content(report: RunReport) -> list[Finding]:
    """Thinking-on answers whose reasoning is in the content, against the baseline's."""
    only_speculative, other = [], []
    for result in report.ok_results:
        baseline = result.baseline
        leak = reasoning_leak(result, baseline.baseline_reasoning if baseline is not None else None)
        if leak is None:
            continue
        base_leak = baseline.baseline_reasoning_leak if baseline is not None else None
        (only_speculative if base_leak is False else other).append((result, leak))
    out = []
    if only_speculative:
        out.append(REASONING_IN_CONTENT.found(
            "Reasoning lands in the content only with speculation",
            f"{len(only_speculative)} thinking-on answers: "
            + "; ".join(f"{r.case_id}: {why}" for r, why in only_speculative[:3]),
            "The reasoning parser is skipped (or fed differently) on the speculative path: tokens "
            "committed several per round must pass through it like single ones. Check how the server "
            "streams multi-token steps into its reasoning parser.",
            [r.case_id for r, _ in only_speculative],
        ))
    if other:
        out.append(REASONING_IN_CONTENT.found(
            "Reasoning lands in the content",
            f"{len(other)} thinking-on answers: " + "; ".join(f"{r.case_id}: {why}" for r, why in other[:3]),
            f"The server does not separate reasoning: set its reasoning parser ({REASONING_PARSER_ADVICE}). "
            "Clients reading `content` get the thinking text.",
            [r.case_id for r, _ in other], severity="warning",
        ))
    return out


ACCEPTANCE_FALLS_WITH_CONTEXT = FindingKind(
    "acceptance-falls-with-context", ("warning",),
    "per budget × thinking, the longest context's acceptance < 60 % of the shortest's and ≥ 0.5 lower, "
    "with clean text",
)


@rule(ACCEPTANCE_FALLS_WITH_CONTEXT)
def acceptance_falls_with_context(report: RunReport) -> list[Finding]:
    """Acceptance at the longest context far below the shortest's, per budget × thinking."""
    cells: dict[tuple[int | None, bool | None], list[ProbeResult]] = defaultdict(list)
    for r in report.ok_results:
        if r.spec.mean_acceptance_length is not None and r.case.tree_budget != 0 and r.case.cache_role != "repeat":
            cells[(r.case.tree_budget, r.case.enable_thinking)].append(r)
    hits, cases = [], []
    for (budget, thinking), results in cells.items():
        groups = context_groups(results)
        if len(groups) < 2:
            continue
        (short_len, short), (long_len, long) = next(iter(groups.items())), list(groups.items())[-1]
        if any(r.garbage for r in long):
            continue  # garbage is its own finding; this one is about speed
        short_mean = mean(r.spec.mean_acceptance_length for r in short)  # type: ignore[misc]
        long_mean = mean(r.spec.mean_acceptance_length for r in long)  # type: ignore[misc]
        if long_mean < CONTEXT_ACCEPTANCE_RATIO * short_mean and short_mean - long_mean >= CONTEXT_ACCEPTANCE_MIN_DROP:
            hits.append(f"budget {budget_label(budget)} think={thinking_label(thinking)}: {long_mean:.2f} at "
                        f"{_words(long_len)} vs {short_mean:.2f} at {_words(short_len)}")
            cases += [r.case_id for r in long]
    if not hits:
        return []
    return [ACCEPTANCE_FALLS_WITH_CONTEXT.found(
        "Acceptance collapses at long context",
        "; ".join(hits) + f" (fires below {CONTEXT_ACCEPTANCE_RATIO:.0%} of the shortest context's)",
        "Short prompts look healthy, long ones do not: the draft's positions or context features past "
        "its trained length (rope scaling not applied to the draft, a sliding window the target does "
        "not have), a draft KV cache that is truncated, or context features taken from the wrong layer "
        "after chunked prefill.",
        cases,
    )]


def _words(tokens: int) -> str:
    return "the prompt as written" if tokens == 0 else f"{tokens} tokens"


PREFIX_CACHE_LOST = FindingKind(
    "prefix-cache-lost-with-speculation", ("warning",),
    "the repeat of a prefix-cache pair is served from the cache without speculation (the baseline) but "
    "not with it",
)


@rule(PREFIX_CACHE_LOST)
def prefix_cache_lost(report: RunReport) -> list[Finding]:
    """The baseline reuses its prefix cache for a repeated prompt, the speculative run does not."""
    baseline_by_case = {p.extras.get("baseline_of"): p for p in report.baseline_probes}
    lost = []
    for first, repeat in cache_pairs(report.results):
        hit, evidence = cache_hit(repeat, first.timings.ttft_s)
        base_first, base_repeat = baseline_by_case.get(first.case_id), baseline_by_case.get(repeat.case_id)
        if hit is not False or base_repeat is None or not base_repeat.ok:
            continue
        # each side against its own first request: a prefill without a draft is faster anyway, so
        # the baseline's TTFT against the speculative side's cold one would read as a hit
        base_cold = base_first.timings.ttft_s if base_first is not None and base_first.ok else None
        base_hit, base_evidence = cache_hit(base_repeat, base_cold)
        if base_hit:
            lost.append((repeat, f"{repeat.case_id}: {evidence}; baseline {base_evidence}"))
    if not lost:
        return []
    return [PREFIX_CACHE_LOST.found(
        "Speculation turns prefix-cache hits off",
        f"{len(lost)} repeated prompt(s) missed the cache with speculation, hit it without: "
        + "; ".join(e for _, e in lost[:3]),
        "Every repeat pays a full prefill with speculation on. Known causes: hybrid (Mamba / Gated "
        "DeltaNet) targets whose recurrent-state snapshots are not kept at block boundaries when "
        "drafting, a draft model whose cache is not prefix-shared, or a server that disables prefix "
        "caching with speculative decoding; check its cache options.",
        [r.case_id for r, _ in lost],
    )]


PREFIX_CACHE_CHANGES_OUTPUT = FindingKind(
    "prefix-cache-changes-output", ("error",),
    "at T=0 the repeat of a prefix-cache pair answers another text than the first (state leaking "
    "through the cache)",
)


@rule(PREFIX_CACHE_CHANGES_OUTPUT)
def prefix_cache_changes_output(report: RunReport) -> list[Finding]:
    """A T=0 prompt sent twice in a row answers two different texts."""
    from ddtree_diag.checks.lossless import around, first_difference

    changed = []
    for first, repeat in cache_pairs(report.results):
        if first.case.temperature != 0:
            continue
        for field in ("reasoning", "output", "tool_calls"):
            a, b = _text(first, field), _text(repeat, field)
            index = first_difference(b, a)
            if index is not None:
                changed.append((repeat, f"{repeat.case_id}: {field} differs at character {index} "
                                        f"({around(a, index)!r} vs {around(b, index)!r})"))
                break
    if not changed:
        return []
    return [PREFIX_CACHE_CHANGES_OUTPUT.found(
        "A prefix-cache hit changes the answer",
        f"{len(changed)} prompt(s) sent twice in a row answered differently: " + "; ".join(e for _, e in changed[:3]),
        "At T=0 a cached prefix must give the full prefill's answer. State leaks through the cache: "
        "recurrent (Gated DeltaNet / Mamba) state restored from the wrong block, draft context "
        "features not cached with the KV, or KV blocks reused across different prompts. Re-run with "
        "the server's prefix caching off to confirm.",
        [r.case_id for r, _ in changed],
    )]


def _text(result: ProbeResult, field: str) -> str:
    from ddtree_diag.checks.lossless import calls_text

    return calls_text(result.tool_calls) if field == "tool_calls" else getattr(result, field) or ""


WORKLOAD_RULES = [
    structured_output_broken,
    reasoning_in_content,
    acceptance_falls_with_context,
    prefix_cache_lost,
    prefix_cache_changes_output,
]

__all__ = ["WORKLOAD_RULES", "cache_hit", "cache_pairs", "context_table", "reasoning_leak", "workload_label"]
