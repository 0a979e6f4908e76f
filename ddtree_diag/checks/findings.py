"""Findings: rules that read a whole run and name the likely cause, with the evidence.

Each rule is a pure function ``RunReport -> list[Finding]``, marked with the finding kinds it
reports (``@rule(KIND, ...)``); a finding is ``{"id", "severity" (error|warning|info), "title",
"evidence", "check", "cases": [case ids]}``. ``FINDINGS`` (read from ``RULES``) is the registry
of kinds: the README's findings table and the gate's critical set come from it. ``analyse`` runs
every rule, stores the findings on the report and puts each finding's id into the ``findings``
list of the results it names.

Thresholds are chosen so that healthy noise stays quiet: a rule needs a clear margin, and enough
data points, before it speaks (see each rule's docstring).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise
from statistics import mean, median

from ddtree_diag.budget import overrun
from ddtree_diag.checks.depth import DEPTH_RULES
from ddtree_diag.checks.findings_base import FindingKind, Rule, compare_advice, ids_of, looks_like_moe, rule, some
from ddtree_diag.checks.lossless import BASELINE_SPECULATED, MISMATCH, NEAR_TIE, repeat_disagreements
from ddtree_diag.checks.quality.registry import BY_CODE, LOOP_CODES, REPETITION
from ddtree_diag.checks.speedup import SPEEDUP_RULES
from ddtree_diag.checks.workloads import WORKLOAD_RULES
from ddtree_diag.records import IDENTICAL, SEVERITIES, Finding, ProbeResult, RunReport, budget_label, thinking_label

SENTENCE_END = (".", "!", "?", "。", "！", "？", "…", '"', "'", ")", "”", "’", "`", "*")

# Margins (see the rules). Module-level so tests and callers can read them.
THINKING_ACCEPTANCE_RATIO = 0.6  # thinking-on acceptance below 60% of thinking-off...
THINKING_ACCEPTANCE_MIN_DROP = 0.5  # ...and at least this many tokens/round lower
EARLY_STOP_MAX_TOKENS = 8
BUDGET_DROP_MARGIN = 0.25  # tokens/round, or 10% of the smaller budget's acceptance if larger
ROUNDS_TOLERANCE_TOKENS = 1
ROUNDS_TOLERANCE_FRACTION = 0.05
TPS_RATIO = 3.0
TPS_MIN_TOKENS = 6  # client decode tok/s of a 2-token answer is noise
REPEAT_DROP_MARGIN = 0.3  # tokens/round, or 15% of the first repeat's acceptance if larger
HIGH_ACCEPTANCE = 3.0
COLLAPSE_ACCEPTANCE = 1.1  # tokens/round at or below which speculation gains nothing
COLLAPSE_MIN_ROUNDS = 4  # a 3-token answer's acceptance says little
DECAY_MIN_POINTS = 6
DECAY_TAU = -0.6  # Kendall tau of acceptance against request order
DECAY_TAU_ERROR = -0.75
DECAY_DROP = 0.15  # the last third at least 15 % below the first (30 % for an error)


def _garbage(result: ProbeResult) -> bool:
    return result.garbage


def _codes(result: ProbeResult) -> list[str]:
    return result.quality.codes if result.quality is not None else []


def _accept(result: ProbeResult) -> float | None:
    return result.spec.mean_acceptance_length


def _tokens(count: int | None) -> str:
    return "? tokens" if count is None else f"{count} token{'s' if count != 1 else ''}"


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def garbage_kinds(codes: list[str]) -> list[str]:
    """What the reasons say about where the fault is, in words (each code's ``kind`` in the
    reason-code registry; every loop code is one "repetition", named last)."""
    kinds = [BY_CODE[c].kind for c in codes if c in BY_CODE and BY_CODE[c].kind and not BY_CODE[c].loop]
    if LOOP_CODES & set(codes):
        kinds.append(REPETITION)
    return list(dict.fromkeys(kinds))


# ---------------------------------------------------------------------------------------------
# Rules


GARBAGE_ONLY_THINKING = FindingKind(
    "garbage-only-thinking", ("error",),
    "thinking-on cases are garbage while every thinking-off case is clean",
)


@rule(GARBAGE_ONLY_THINKING)
def garbage_only_with_thinking(report: RunReport) -> list[Finding]:
    """Garbage in thinking-on cases while every thinking-off case is clean."""
    ok = report.ok_results
    on_bad = [r for r in ok if r.case.enable_thinking is True and _garbage(r)]
    off = [r for r in ok if r.case.enable_thinking is False and r.quality is not None]
    if not on_bad or not off or any(_garbage(r) for r in off):
        return []
    on_all = [r for r in ok if r.case.enable_thinking is True]
    codes = sorted({c for r in on_bad for c in _codes(r) if c != "truncated"})
    return [GARBAGE_ONLY_THINKING.found(
        "Garbage only when thinking is on",
        f"{len(on_bad)}/{len(on_all)} thinking-on cases are garbage ({', '.join(codes) or 'see quality'}), "
        f"0/{len(off)} thinking-off cases: {ids_of(on_bad)}",
        "The thinking path: the chat template's thinking block (a pre-filled <think>), the reasoning "
        "parser, and the KV/positions after a long prefix. A lower acceptance is expected there, "
        f"garbled text is not: {compare_advice(report)} to see whether verification is at fault.",
        [r.case_id for r in on_bad],
    )]


THINKING_ACCEPTANCE_DROP = FindingKind(
    "thinking-acceptance-drop", ("warning",),
    "per budget, thinking-on acceptance < 60 % of thinking-off and ≥ 0.5 lower (draft not trained on "
    "thinking traces)",
)


@rule(THINKING_ACCEPTANCE_DROP)
def thinking_acceptance_drop(report: RunReport) -> list[Finding]:
    """Per budget, mean acceptance with thinking on far below thinking off."""
    cells: dict[tuple[int | None, bool], list[ProbeResult]] = defaultdict(list)
    for r in report.ok_results:
        if r.case.enable_thinking is not None and _accept(r) is not None and r.case.tree_budget != 0:
            cells[(r.case.tree_budget, r.case.enable_thinking)].append(r)
    hits, cases = [], []
    for (budget, thinking), on in sorted(cells.items(), key=lambda kv: str(kv[0])):
        if not thinking or (budget, False) not in cells:
            continue
        off = cells[(budget, False)]
        on_mean, off_mean = mean(_accept(r) for r in on), mean(_accept(r) for r in off)
        if on_mean < THINKING_ACCEPTANCE_RATIO * off_mean and off_mean - on_mean >= THINKING_ACCEPTANCE_MIN_DROP:
            hits.append(f"budget {budget_label(budget)}: {on_mean:.2f} on vs {off_mean:.2f} off")
            cases += [r.case_id for r in on]
    if not hits:
        return []
    return [THINKING_ACCEPTANCE_DROP.found(
        "Acceptance with thinking on far below thinking off",
        "; ".join(hits) + f" (fires below {THINKING_ACCEPTANCE_RATIO:.0%} of thinking off)",
        "Was the draft trained on thinking traces? Drafts trained without them (e.g. z-lab's Qwen3 "
        "DFlash drafts) accept less in thinking mode; that costs speed, never correctness. If the "
        "text is also garbled, look for a template or state bug instead.",
        cases,
    )]


EARLY_STOP = FindingKind(
    "early-stop", ("error",),
    "`stop` after ≤ 8 tokens on an unfinished sentence (`Hello,`): stop-token / EOS handling",
)


@rule(EARLY_STOP)
def early_stop(report: RunReport) -> list[Finding]:
    """finish_reason=stop after a few tokens, on text that does not end a sentence."""
    hits = []
    for r in report.ok_results:
        if (r.finish_reason or "").lower() not in ("stop", "eos", "end_turn", "stop_sequence"):
            continue
        tokens = r.completion_tokens
        if tokens is not None and (tokens > EARLY_STOP_MAX_TOKENS or tokens >= r.case.max_tokens):
            continue
        text = (r.output or "").strip()
        if r.quality is not None:
            stopped = "premature_stop" in _codes(r) or ("empty_output" in _codes(r) and not r.reasoning)
        else:
            stopped = not text or not text.endswith(SENTENCE_END)
        if stopped and (tokens is not None or len(text) < 40):
            hits.append(r)
    if not hits:
        return []
    shown = some([f"{r.case_id}: {r.output!r} ({_tokens(r.completion_tokens)}, stop)" for r in hits], 4)
    return [EARLY_STOP.found(
        "Generation stops after a few tokens, mid-sentence",
        shown,
        "Stop-token / EOS handling: a stop id checked against draft tokens that were never "
        "accepted, an end-of-turn id from the wrong template, or max_tokens applied to rounds "
        f"instead of tokens. To tell the server's fault from the model's, {compare_advice(report)}.",
        [r.case_id for r in hits],
    )]


GARBAGE_HIGH_ACCEPTANCE = FindingKind(
    "garbage-high-acceptance", ("error",),
    "a repetitive garbage case has acceptance ≥ max(3, 1.25 × the healthy median): a loop inflating "
    "acceptance",
)


@rule(GARBAGE_HIGH_ACCEPTANCE)
def garbage_with_high_acceptance(report: RunReport) -> list[Finding]:
    """Repetitive garbage whose acceptance is high: a degenerate loop is easy to draft."""
    ok = report.ok_results
    healthy = [_accept(r) for r in ok if not _garbage(r) and _accept(r) is not None]
    bar = max(HIGH_ACCEPTANCE, 1.25 * median(healthy)) if healthy else HIGH_ACCEPTANCE
    hits = [
        r for r in ok
        if _garbage(r) and _accept(r) is not None and _accept(r) >= bar
        and (r.quality is None or LOOP_CODES & set(_codes(r)))
    ]
    if not hits:
        return []
    shown = "; ".join(
        f"{r.case_id}: acceptance {_accept(r):.2f}, {'/'.join(c for c in _codes(r) if c in LOOP_CODES)}"
        for r in hits[:4]
    )
    healthy_text = f"healthy median {median(healthy):.2f}" if healthy else "no healthy case to compare"
    return [GARBAGE_HIGH_ACCEPTANCE.found(
        "Garbage with high acceptance (a degenerate loop inflates acceptance)",
        f"{shown} ({healthy_text}; bar {bar:.2f})",
        "Acceptance is not a health signal here: the target is looping and the draft predicts the "
        "loop. Look for what sends the target into a loop — positions, RoPE offsets, a KV cache "
        "not trimmed to the accepted path, or repetition after a template leak.",
        [r.case_id for r in hits],
    )]


LOSSLESS_MISMATCH = FindingKind(
    "lossless-mismatch", ("error",),
    "a T=0 output differs from the baseline (verification / cache bug)",
)
LOSSLESS_NEAR_TIE = FindingKind(
    "lossless-near-tie", ("info",),
    "it differs only at a numerics near-tie",
)


@rule(LOSSLESS_MISMATCH, LOSSLESS_NEAR_TIE)
def baseline_divergence(report: RunReport) -> list[Finding]:
    """T=0 output differs from the non-speculative baseline (near-ties reported apart)."""
    out = []
    mismatches = [r for r in report.ok_results if r.baseline and r.baseline.verdict == MISMATCH]
    ties = [r for r in report.ok_results if r.baseline and r.baseline.verdict == NEAR_TIE]
    if mismatches:
        first = mismatches[0].baseline
        out.append(LOSSLESS_MISMATCH.found(
            "T=0 output differs from the non-speculative baseline",
            f"{len(mismatches)} case(s): {ids_of(mismatches)}; first at {first.field or 'output'} "
            f"char {first.char_index}"
            + (f" token {first.token_index}" if first.token_index is not None else "")
            + f": expected {first.expected!r}, got {first.actual!r}"
            + (f" — {first.detail}" if first.detail else ""),
            "Verification or cache bug: the accept walk must follow the target's own argmax; the KV "
            "cache and hidden states must keep only the accepted path; tree positions are "
            "start + depth with an ancestor-only mask."
            + (" This target is a mixture of experts: in bf16 a near-tie in a router picks another "
               "expert when the batch shape changes (a verify of many rows against one), which moves "
               "the logits by more than rounding; if a run in fp32 is identical, that is the cause, "
               "not the speculation." if looks_like_moe(report) else ""),
            [r.case_id for r in mismatches],
        ))
    if ties:
        gaps = [r.baseline.logprob_gap for r in ties if r.baseline]
        out.append(LOSSLESS_NEAR_TIE.found(
            "T=0 output differs from the baseline only at a numerics near-tie",
            f"{len(ties)} case(s): {ids_of(ties)}; top-2 gaps "
            f"{', '.join(f'{g:.3f}' for g in gaps if g is not None)} nats",
            "Expected in bf16/fp16 (batched verification rounds differently). Re-run in fp32 to confirm "
            "the outputs become identical.",
            [r.case_id for r in ties],
        ))
    return out


GARBAGE_ALSO_IN_BASELINE = FindingKind(
    "garbage-also-in-baseline", ("warning",),
    "garbage that the baseline says word for word: not speculation — the title names its kind "
    "(chat-template tokens, think tags, role markers, repetition…) and the check where to look (stop "
    "tokens, thinking toggle, weights)",
)


@rule(GARBAGE_ALSO_IN_BASELINE)
def garbage_also_in_baseline(report: RunReport) -> list[Finding]:
    """Garbage that the non-speculative baseline says word for word: not a speculation bug."""
    hits = [r for r in report.ok_results if _garbage(r) and r.baseline and r.baseline.verdict == IDENTICAL]
    if not hits:
        return []
    codes = sorted({c for r in hits for c in _codes(r) if c != "truncated"})
    kinds = garbage_kinds(codes)
    mode = hits[0].baseline.source or hits[0].baseline.mode
    where = []
    if {"template_leak", "role_leak"} & set(codes):
        where.append("the chat template and the stop tokens (an end-of-turn id the server does not stop on "
                     "lets the model write the next turn)")
    if {"thinking_leak", "unterminated_think"} & set(codes):
        where.append("the thinking toggle and the reasoning parser (how enable_thinking reaches the template)")
    if {"token_pieces", "escaped_text", "mojibake", "replacement_char"} & set(codes):
        where.append("the detokenizer and whatever sits between the server and this client (token strings "
                     "returned instead of text, a proxy encoding the JSON or HTML once more, the wrong codec)")
    if not where:
        where.append("the chat template (thinking block, special tokens), the prompt, and the model weights "
                     "or quantisation")
    return [GARBAGE_ALSO_IN_BASELINE.found(
        f"Garbage that the non-speculative baseline produces too: {', '.join(kinds) or 'see quality'}",
        f"{len(hits)} garbage case(s) identical to the baseline ({mode}): {ids_of(hits)}; "
        f"kind: {', '.join(kinds) or 'see quality'} (reasons: {', '.join(codes) or 'see quality'})",
        "Speculation is not what breaks these answers: the target says the same alone. Check "
        + "; ".join(where) + " — and whether the baseline shares the bug (same server, same template).",
        [r.case_id for r in hits],
    )]


REPEATS_DISAGREE = FindingKind(
    "repeats-disagree", ("error",),
    "T=0 repeats of one case differ",
)


@rule(REPEATS_DISAGREE)
def repeats_disagree(report: RunReport) -> list[Finding]:
    """T=0 repeats of the same case say different things."""
    disagreements = repeat_disagreements(report)
    if not disagreements:
        return []
    first = disagreements[0]
    return [REPEATS_DISAGREE.found(
        "T=0 repeats of the same case disagree",
        f"{len(disagreements)} pair(s); first {first.cases[0]} vs {first.cases[1]} at "
        f"{first.field} char {first.char_index}: {first.first!r} vs {first.other!r}",
        "Greedy decoding must be deterministic: state leaking between requests (a KV cache or "
        "draft context reused across requests), batch-dependent kernels, or a seed-dependent path "
        "at T=0.",
        [c for d in disagreements for c in d.cases],
    )]


ACCEPTANCE_NOT_RISING_WITH_BUDGET = FindingKind(
    "acceptance-not-rising-with-budget", ("warning",),
    "a larger budget's acceptance is lower than a smaller one's by > max(0.25, 10 %)",
)


@rule(ACCEPTANCE_NOT_RISING_WITH_BUDGET)
def acceptance_not_rising_with_budget(report: RunReport) -> list[Finding]:
    """A larger tree budget with clearly lower acceptance than a smaller one (same prompt,
    thinking, temperature, max_tokens)."""
    groups: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    members: dict[tuple, list[ProbeResult]] = defaultdict(list)
    for r in report.ok_results:
        budget = r.case.tree_budget
        if budget is None or budget <= 0 or _accept(r) is None or r.spec.server_wide:
            continue
        key = (r.case.prompt_id, r.case.enable_thinking, r.case.temperature, r.case.max_tokens)
        groups[key][budget].append(_accept(r))
        members[key].append(r)
    hits, cases = [], []
    for key, by_budget in groups.items():
        budgets = sorted(by_budget)
        if len(budgets) < 2:
            continue
        means = {b: mean(by_budget[b]) for b in budgets}
        for i, small in enumerate(budgets):
            for large in budgets[i + 1 :]:
                margin = max(BUDGET_DROP_MARGIN, 0.10 * means[small])
                if means[large] < means[small] - margin:
                    hits.append(f"{key[0]} think={thinking_label(key[1])}: budget {small} → {means[small]:.2f}, "
                                f"budget {large} → {means[large]:.2f}")
                    cases += [r.case_id for r in members[key] if r.case.tree_budget in (small, large)]
    if not hits:
        return []
    return [ACCEPTANCE_NOT_RISING_WITH_BUDGET.found(
        "Acceptance falls as the tree budget grows",
        "; ".join(dict.fromkeys(hits)),
        "A larger tree holds the smaller tree's best paths, so acceptance should not drop: check "
        "that the budget reaches the tree builder, the best-first order by path log-probability, "
        "and the verify mask/positions for deep or wide trees.",
        cases,
    )]


BUDGET_NOT_HONOURED = FindingKind(
    "budget-not-honoured", ("warning",),
    "a request's own numbers show more drafting than the tree budget it sent allows (any draft at "
    "budget 0; more than budget + 1 tokens a round), or the lossless baseline speculated",
)


def _budget_sent(result: ProbeResult) -> bool:
    """Whether the case's budget reached the server as a per-request setting: not where it is only
    the run's label (vLLM, SGLang, plain OpenAI fix the draft at start), nor for the engine's chain
    mode (its depth is the draft block's, whatever the budget)."""
    from ddtree_diag.backends.dialects import REGISTRY

    if result.dialect == "engine":
        return (result.extras or {}).get("mode") != "chain"
    dialect = REGISTRY.get(result.dialect or "")
    return dialect is not None and dialect.sends_budget


@rule(BUDGET_NOT_HONOURED)
def budget_not_honoured(report: RunReport) -> list[Finding]:
    """The server ignores the per-request budget: every budget's row then measured the server's
    own draft setting, and a budget0 baseline compared speculation with speculation."""
    hits, cases = [], []
    for r in report.ok_results:
        why = overrun(r.case.tree_budget, r.spec) if _budget_sent(r) else None
        if why is not None:
            hits.append(f"{r.case_id}: {why}")
            cases.append(r.case_id)
    speculated = [
        r for r in report.results
        if r.baseline is not None and (r.baseline.detail or "").startswith(BASELINE_SPECULATED)
    ]
    if speculated:
        hits.append(f"the baseline speculated for {ids_of(speculated)}")
    baseline_cases = [r.case_id for r in speculated]
    if not hits:
        return []
    dialect = str((report.target or {}).get("dialect") or "")
    known = (
        " llama.cpp's server compiles its per-request speculative.n_max out (the draft length is "
        "--draft-max at start), so only builds that restore it can sweep per request."
        if dialect == "llamacpp" else ""
    )
    url_baseline = not cases and all(r.baseline.mode == "url" for r in speculated)
    title = "The server does not honour the per-request tree budget"
    if url_baseline:
        title = "The lossless baseline speculates"
    return [BUDGET_NOT_HONOURED.found(
        title,
        some(hits, 6),
        "Each budget's numbers are the server's own draft setting, not the budget in the table, and "
        "a budget0 baseline is no non-speculative run." + known + " Sweep budgets by restarting the "
        "server at each, and check losslessness against a server without a draft (--baseline "
        "url:URL) or the target alone (--baseline engine).",
        cases + baseline_cases,
    )]


MAX_CHARS_PER_TOKEN = 40  # non-space characters; a run of "-" or spaces is one token, words are not


def _accounting(result: ProbeResult) -> tuple[list[str], list[str]]:
    """(contradictions, drifts) in one case's own spec numbers. A contradiction is impossible
    for a correct server (more accepted than drafted, acceptance above the budget's bound, a
    per-round list that does not match the round count or the mean, a token sum far off); a
    drift is a small mismatch of rounds × acceptance with the token count."""
    spec = result.spec
    tokens = result.completion_tokens
    accept = _accept(result)
    wrong: list[str] = []
    drift: list[str] = []
    # The usage block against what came back: no tokenizer packs 40 characters into a token, and
    # a server that honours max_tokens does not bill more (one over for an end-of-turn token).
    text_chars = len("".join((result.output + (result.reasoning or "")).split()))
    if tokens is not None and text_chars >= 200 and text_chars > MAX_CHARS_PER_TOKEN * max(tokens, 1):
        wrong.append(f"{tokens} completion tokens for {text_chars} characters of text")
    if tokens is not None and result.case.max_tokens and tokens > result.case.max_tokens + 1:
        wrong.append(f"{tokens} completion tokens with max_tokens {result.case.max_tokens}")
    if spec.server_wide:
        return wrong, drift
    budget = result.case.tree_budget if result.case.tree_budget is not None else spec.tree_budget
    if spec.draft_tokens is not None and spec.accepted_tokens is not None and spec.accepted_tokens > spec.draft_tokens:
        wrong.append(f"{spec.accepted_tokens} accepted of {spec.draft_tokens} drafted")
    if accept is not None and spec.decode_rounds:
        if accept < 1 - 1e-6:
            wrong.append(f"mean acceptance {accept:.2f} < 1 (every round commits at least the target's own token)")
        if budget is not None and budget > 0 and accept > budget + 1 + 1e-6:
            wrong.append(f"mean acceptance {accept:.2f} > tree_budget {budget} + 1")
        if budget == 0 and accept > 1 + 1e-6:
            wrong.append(f"mean acceptance {accept:.2f} at tree_budget 0 (no draft to accept)")
    lengths = spec.acceptance_lengths
    if lengths:
        if spec.decode_rounds is not None and len(lengths) != spec.decode_rounds:
            wrong.append(f"{len(lengths)} per-round lengths for {spec.decode_rounds} rounds")
        if accept is not None and abs(mean(lengths) - accept) > 0.05 + 0.02 * accept:
            wrong.append(f"per-round lengths average {mean(lengths):.2f}, reported mean {accept:.2f}")
        if budget is not None and budget > 0 and max(lengths) > budget + 1:
            wrong.append(f"a round accepted {max(lengths)} > tree_budget {budget} + 1")
        if tokens and abs(sum(lengths) - tokens) > max(3, 0.25 * tokens):
            wrong.append(f"per-round lengths sum to {sum(lengths)} for {tokens} completion tokens")
        if spec.accepted_tokens is not None and abs(sum(n - 1 for n in lengths) - spec.accepted_tokens) > 1:
            wrong.append(f"{spec.accepted_tokens} accepted tokens reported, per-round lengths say "
                         f"{sum(n - 1 for n in lengths)}")
    if not spec.derived and spec.decode_rounds and accept is not None and tokens:
        implied = spec.decode_rounds * accept
        tolerance = ROUNDS_TOLERANCE_TOKENS + ROUNDS_TOLERANCE_FRACTION * tokens
        clipped = (result.finish_reason or "") == "length" or tokens >= result.case.max_tokens
        upper = tolerance + (accept if clipped else 0)  # a last round clipped at max_tokens may count in full
        off = implied - tokens
        if off > upper or off < -tolerance:
            line = f"{spec.decode_rounds} rounds × {accept:.2f} = {implied:.1f} vs {tokens} completion tokens"
            if abs(off) > max(3 + tolerance, 0.25 * tokens):
                wrong.append(line)
            else:
                drift.append(line)
    return wrong, drift


METRICS_CONTRADICT = FindingKind(
    "metrics-contradict", ("error",),
    "a case's own numbers contradict each other or the text: usage billing fewer tokens than the text can"
    " hold (> 40 non-space characters per token) or more than max_tokens + 1, accepted > drafted, "
    "acceptance < 1 or > tree_budget + 1 (> 1 at budget 0), per-round lengths ≠ rounds or averaging ≠ the"
    " reported mean or summing far from the tokens, or rounds × acceptance off the completion tokens by >"
    " max(3 tokens + tolerance, 25 %): no threshold on them can be trusted",
    critical=True,
)


@rule(METRICS_CONTRADICT)
def metrics_contradict(report: RunReport) -> list[Finding]:
    """A server's own numbers contradict each other, or the token count by a wide margin."""
    hits = [(r, _accounting(r)[0]) for r in report.ok_results]
    hits = [(r, wrong) for r, wrong in hits if wrong]
    if not hits:
        return []
    return [METRICS_CONTRADICT.found(
        "The server's speculative-decoding numbers contradict each other",
        some([f"{r.case_id}: {', '.join(wrong[:2])}" for r, wrong in hits], 3),
        "The acceptance, rounds and tok/s this run measures come from these numbers, so no "
        "threshold on them can be trusted: look for the server counting rounds per draft step or "
        "per request, acceptance without the bonus token or over the tree instead of the accepted "
        "path, per-round lists that are not reset between requests, or a stats object from another "
        "request.",
        [r.case_id for r, _ in hits],
    )]


ROUNDS_ACCOUNTING = FindingKind(
    "rounds-accounting", ("warning",),
    "decode_rounds × mean acceptance differs from completion tokens by > 1 token + 5 % but within the "
    "wide margin above (not for derived or server-wide numbers)",
)


@rule(ROUNDS_ACCOUNTING)
def rounds_accounting(report: RunReport) -> list[Finding]:
    """decode_rounds × mean acceptance a little off the completion tokens (beyond 1 token + 5 %),
    in a case whose numbers do not otherwise contradict each other (that is metrics-contradict)."""
    hits = []
    for r in report.ok_results:
        wrong, drift = _accounting(r)
        if drift and not wrong:
            hits.append((r, drift[0]))
    if not hits:
        return []
    return [ROUNDS_ACCOUNTING.found(
        "decode_rounds × mean acceptance does not add up to the completion tokens",
        some([f"{r.case_id}: {line}" for r, line in hits], 4),
        "Metric accounting bug in the server: rounds counted per draft step or per request, "
        "acceptance without the bonus token, or the prefill token counted as a round. The "
        "acceptance numbers of this server cannot be trusted until it adds up.",
        [r.case_id for r, _ in hits],
    )]


ACCEPTANCE_COLLAPSE = FindingKind(
    "acceptance-collapse", ("error",),
    "2+ speculative cases (budget > 0 or the server's default, 4+ rounds) at mean acceptance ≤ 1.1, "
    "covering ≥ 75 % of the speculative cases, with mostly clean text: the draft helps nothing — draft "
    "not loaded, draft/target mismatch, hidden-state wiring (`target_layer_ids`), `mask_token_id`, "
    "positions",
    critical=True,
)


@rule(ACCEPTANCE_COLLAPSE)
def acceptance_collapse(report: RunReport) -> list[Finding]:
    """Speculative cases (budget > 0, or the server's default) whose acceptance stays at ~1: the
    draft's tokens are (almost) never accepted, while the text is fine."""
    spec_cases = [
        r for r in report.ok_results if r.case.tree_budget != 0 and _accept(r) is not None and not r.spec.server_wide
    ]
    # A short answer's acceptance says little: only cases with enough rounds count as collapsed.
    collapsed = [
        r for r in spec_cases
        if _accept(r) <= COLLAPSE_ACCEPTANCE and (r.spec.decode_rounds or 0) >= COLLAPSE_MIN_ROUNDS
    ]
    if len(collapsed) < 2:
        return []
    clean = [r for r in collapsed if not _garbage(r)]
    if len(collapsed) < 0.75 * len(spec_cases) or len(clean) * 2 < len(collapsed):
        return []
    budgets = sorted({budget_label(r.case.tree_budget) for r in collapsed})
    drafted = sum(r.spec.draft_tokens or 0 for r in collapsed)
    accepted = sum(r.spec.accepted_tokens or 0 for r in collapsed)
    counts = f"; {accepted} of {drafted} drafted tokens accepted" if drafted else ""
    return [ACCEPTANCE_COLLAPSE.found(
        "Speculation accepts (almost) nothing: acceptance ~1 with clean text",
        f"mean acceptance {mean(_accept(r) for r in collapsed):.2f} in {len(collapsed)}/{len(spec_cases)} "
        f"speculative case(s) (budget {', '.join(budgets)}){counts}: every round commits little more "
        f"than the target's own token, so the deployment runs at (or below) plain decoding speed",
        "The target is fine (the text is clean); the draft is not helping. Likely causes: the draft "
        "is not loaded or speculation silently fell back to plain decoding; the draft does not match "
        "this target (trained for another model, another tokenizer or vocabulary); the target's "
        "hidden states wired to the draft from the wrong layers (target_layer_ids, an off-by-one "
        "in the hidden-states index); the wrong mask_token_id; draft positions/RoPE offset from the "
        "target's; the tree budget not reaching the tree builder. "
        + _capitalised(compare_advice(report)) + " to confirm the output itself is right.",
        [r.case_id for r in collapsed],
    )]


SERVER_CLIENT_SPEED_MISMATCH = FindingKind(
    "server-client-speed-mismatch", ("warning",),
    "the median server/client tok/s ratio is beyond 3× (cases of ≥ 6 tokens; server figures may include "
    "prefill)",
)


@rule(SERVER_CLIENT_SPEED_MISMATCH)
def server_client_speed_mismatch(report: RunReport) -> list[Finding]:
    """Server-reported tok/s far from the client-measured decode tok/s (median over cases)."""
    pairs = []
    for r in report.ok_results:
        server, client = r.spec.server_tokens_per_second, r.timings.decode_tokens_per_second
        if server and client and (r.completion_tokens or 0) >= TPS_MIN_TOKENS:
            pairs.append((r, server / client))
    if len(pairs) < 1:
        return []
    ratio = median(p[1] for p in pairs)
    if 1 / TPS_RATIO <= ratio <= TPS_RATIO:
        return []
    far = [r for r, q in pairs if q > TPS_RATIO or q < 1 / TPS_RATIO]
    server_m = median(r.spec.server_tokens_per_second for r, _ in pairs)
    client_m = median(r.timings.decode_tokens_per_second for r, _ in pairs)
    return [SERVER_CLIENT_SPEED_MISMATCH.found(
        "Server-reported tok/s far from the client-measured tok/s",
        f"median server {server_m:.1f} tok/s vs client {client_m:.1f} tok/s (ratio {ratio:.2f}, "
        f"fires beyond {TPS_RATIO:g}x) over {len(pairs)} case(s)",
        "Server figures may include prefill or queueing (lower than the client's decode rate) or "
        "count per draft rather than per committed token (higher). Trust the client figure for "
        "gating, and check what the server divides by.",
        [r.case_id for r in far],
    )]


ACCEPTANCE_FALLING_ACROSS_REPEATS = FindingKind(
    "acceptance-falling-across-repeats", ("warning",),
    "acceptance drops monotonically across repeats by > max(0.3, 15 %) in at least half of the repeated "
    "cases (state leaking between requests)",
)


@rule(ACCEPTANCE_FALLING_ACROSS_REPEATS)
def acceptance_falling_across_repeats(report: RunReport) -> list[Finding]:
    """Acceptance drops monotonically across repeats, in most case groups."""
    groups: dict[str, list[ProbeResult]] = defaultdict(list)
    for r in report.ok_results:
        if _accept(r) is not None and not r.spec.server_wide:
            groups[r.case.group_key].append(r)
    eligible = {k: sorted(v, key=lambda r: r.case.repeat) for k, v in groups.items() if len(v) >= 2}
    if not eligible:
        return []
    falling = []
    for key, results in eligible.items():
        values = [_accept(r) for r in results]
        monotone = all(b < a for a, b in pairwise(values))
        margin = max(REPEAT_DROP_MARGIN, 0.15 * values[0])
        if monotone and values[-1] < values[0] - margin:
            falling.append((key, results, values))
    if not falling or len(falling) * 2 < len(eligible):
        return []
    shown = "; ".join(f"{key}: {' → '.join(f'{v:.2f}' for v in values)}" for key, _, values in falling[:3])
    return [ACCEPTANCE_FALLING_ACROSS_REPEATS.found(
        "Acceptance falls with every repeat of the same request",
        f"{len(falling)}/{len(eligible)} repeated cases: {shown}",
        "State leaking between requests: the draft's context cache, tree buffers or KV blocks not "
        "reset after a request, or a prefix cache handing the draft stale hidden states.",
        [r.case_id for _, results, _ in falling for r in results],
    )]


ACCEPTANCE_DECAYS_OVER_RUN = FindingKind(
    "acceptance-decays-over-run", ("warning", "error"),
    "acceptance falls with the order requests were sent in across the whole run (6+ requests, the canary "
    "included; each relative to its prompt's mean): Kendall tau ≤ −0.6 and the last third ≥ 15 % below "
    "the first (error at tau ≤ −0.75 and 30 %)",
)


@rule(ACCEPTANCE_DECAYS_OVER_RUN)
def acceptance_decays_over_run(report: RunReport) -> list[Finding]:
    """Acceptance falling with the order requests were sent in, across the whole run (each
    case's acceptance relative to its prompt's mean, so a matrix that ends on a harder prompt
    does not count): state carried from request to request."""
    points = [
        r for r in report.ok_results
        if r.seq is not None and _accept(r) is not None and r.case.tree_budget != 0 and not r.spec.server_wide
    ]
    if report.canary is not None and report.canary.ok and _accept(report.canary) is not None:
        points.append(report.canary)
    if len(points) < DECAY_MIN_POINTS:
        return []
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for r in points:
        by_prompt[r.case.prompt_id].append(_accept(r))
    points.sort(key=lambda r: r.seq)
    relative = [_accept(r) / mean(by_prompt[r.case.prompt_id]) for r in points]
    if len(by_prompt) == len(points):  # one case per prompt: nothing to normalise with
        relative = [_accept(r) for r in points]
    concordant = discordant = 0
    for i, a in enumerate(relative):
        for b in relative[i + 1 :]:
            concordant += b > a
            discordant += b < a
    tau = (concordant - discordant) / max(1, concordant + discordant)
    third = max(1, len(points) // 3)
    early = mean(_accept(r) for r in points[:third])
    late = mean(_accept(r) for r in points[-third:])
    if tau > DECAY_TAU or late > (1 - DECAY_DROP) * early:
        return []
    strong = tau <= DECAY_TAU_ERROR and late <= (1 - 2 * DECAY_DROP) * early
    return [ACCEPTANCE_DECAYS_OVER_RUN.found(
        "Acceptance falls with every request the server has served",
        f"over {len(points)} requests in the order sent: first third mean {early:.2f}, last third "
        f"{late:.2f} (Kendall tau {tau:.2f} against the request order, acceptance relative to each "
        f"prompt's mean); first {points[0].case_id}, last {points[-1].case_id}",
        "State carried between requests: the draft's context KV or hidden-state buffer not reset, "
        "tree buffers or a position counter that keep growing, a prefix cache handing the draft "
        "stale hidden states, or memory pressure from leaked blocks. Restart the server and re-run: "
        "if the first requests are fast again, it is state.",
        [r.case_id for r in points if r is not report.canary],
        severity="error" if strong else "warning",
    )]


CANARY_DIFFERS = FindingKind(
    "canary-differs", ("error",),
    "the gate's canary (its first case sent again at the end) gives another T=0 text, or an acceptance "
    "lower by > max(0.3, 15 %)",
    critical=True,
)


@rule(CANARY_DIFFERS)
def canary_differs(report: RunReport) -> list[Finding]:
    """The gate's canary (its first case sent again at the end) answered differently."""
    from ddtree_diag.checks.gate import canary_problems

    canary = report.canary
    if canary is None or not canary.ok:
        return []
    first = next((r for r in report.results if r.case_id == canary.case_id and r.ok), None)
    if first is None:
        return []
    problems = canary_problems(first, canary)
    if not problems:
        return []
    return [CANARY_DIFFERS.found(
        "The first case answers differently when sent again at the end of the run",
        f"{canary.case_id}, sent again after {canary.seq} request(s): " + "; ".join(problems),
        "At T=0 the same request must give the same answer and about the same acceptance at any "
        "point of a server's life: something is carried from request to request (KV cache or "
        "draft context not reset, a prefix cache returning stale entries, batch-dependent kernels, "
        "sampling state).",
        [canary.case_id],
    )]


RULES: list[Rule] = [
    garbage_only_with_thinking,
    garbage_with_high_acceptance,
    early_stop,
    baseline_divergence,
    garbage_also_in_baseline,
    repeats_disagree,
    thinking_acceptance_drop,
    acceptance_not_rising_with_budget,
    acceptance_collapse,
    budget_not_honoured,
    metrics_contradict,
    rounds_accounting,
    acceptance_falling_across_repeats,
    acceptance_decays_over_run,
    canary_differs,
    server_client_speed_mismatch,
    *WORKLOAD_RULES,
    *DEPTH_RULES,
    *SPEEDUP_RULES,
]



# The registry of findings, in RULES order: the README's table, the gate's critical set.
FINDINGS: tuple[FindingKind, ...] = tuple(kind for r in RULES for kind in r.kinds)  # type: ignore[attr-defined]
BY_ID: dict[str, FindingKind] = {kind.id: kind for kind in FINDINGS}
CRITICAL_FINDINGS: frozenset[str] = frozenset(kind.id for kind in FINDINGS if kind.critical)


def readme_table() -> str:
    """The README's findings table (a test keeps the README equal to it): the per-run kinds, then
    the fleet's cross-target ones (``checks.replicas``, which ``analyse`` does not run)."""
    from ddtree_diag.checks.replicas import FLEET_FINDINGS  # lazily: it is no rule of a single run

    lines = ["| id | severity | fires when |", "|---|---|---|"]
    lines += [f"| `{k.id}` | {' / '.join(k.severities)} | {k.fires_when} |" for k in (*FINDINGS, *FLEET_FINDINGS)]
    return "\n".join(lines)


def analyse(report: RunReport) -> list[Finding]:
    """Run every rule; store the findings on the report and their ids on the results named."""
    findings: list[Finding] = []
    for each_rule in RULES:
        findings.extend(each_rule(report))
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    report.findings = findings
    by_case = {r.case_id: r for r in report.results}
    for result in report.results:
        result.findings = []
    for item in findings:
        for case_id in item.cases:
            if case_id in by_case and item.id not in by_case[case_id].findings:
                by_case[case_id].findings.append(item.id)
    return findings

