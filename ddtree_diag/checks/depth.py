"""The acceptance-by-depth finding: rounds that pile up at one length and never go past it.

A draft that is merely weak accepts less and less the deeper it goes, smoothly: each depth needs
every shallower one, and the draft's guesses get worse with distance. A draft-length or position
bug looks different: depth k accepted in most rounds and depth k + 1 in none, although the draft
reaches deeper (the server verifies fewer tokens than it drafts, or gives every draft token past
the first the wrong position so only the first ones can match).
"""

from __future__ import annotations

from ddtree_diag.backends import depth
from ddtree_diag.checks.findings_base import FindingKind, Rule, rule, some
from ddtree_diag.records import Finding, ProbeResult, RunReport

CAP_MIN_ROUNDS = 20  # rounds in a group before its curve is judged
CAP_MIN_AT_DEPTH = 10  # rounds that accepted depth k: "never k + 1" after fewer means little
CAP_ACCEPTED = 0.5  # depth k accepted at least this often: a strong draft, not a weak one
# When only the tree budget bounds the depth (a DDTree server does not say its draft's block size):
# published DFlash drafts use blocks of 8 or more, so a tree reaches depth 7 when its budget allows.
ASSUMED_BLOCK_DEPTH = 7


def _depth_limit(result: ProbeResult, report: RunReport, source_limit: int | None) -> tuple[int | None, str]:
    """How deep this case's draft could reach, and what says so; (None, "") when nothing does."""
    if source_limit is not None:
        return source_limit, "the server's own per-depth numbers"
    budget = result.case.tree_budget if result.case.tree_budget is not None else result.spec.tree_budget
    if not isinstance(budget, int) or budget <= 0:
        return None, ""
    if report.target.get("backend") == "engine" or result.dialect == "engine":
        block = report.target.get("block_size")
        if isinstance(block, int) and block > 1:
            return min(budget, block - 1), f"tree budget {budget}, draft block size {block}"
        return None, ""
    if result.dialect in ("ddtree", "ddtree-mlx"):
        assumed = f"tree budget {budget}, block size assumed ≥ {ASSUMED_BLOCK_DEPTH + 1}"
        return min(budget, ASSUMED_BLOCK_DEPTH), assumed
    if result.dialect == "llamacpp":
        return budget, f"speculative.n_max {budget}"  # a chain's draft length
    return None, ""


def group_limit_why(report: RunReport, results: list[ProbeResult]) -> tuple[int | None, str]:
    """How deep every case of a group could draft (the smallest), and what says so; None when a
    case's depth nothing says (its rounds may end where they do by design)."""
    limits = [_depth_limit(r, report, d.limit) for r in results if (d := depth.case_depth(r)) is not None]
    known = [(limit, why) for limit, why in limits if limit is not None]
    if not known or len(known) < len(limits):
        return None, ""
    return min(known)


def group_limit(report: RunReport, results: list[ProbeResult]) -> int | None:
    return group_limit_why(report, results)[0]


ACCEPTANCE_CAPPED_AT_DEPTH = FindingKind(
    "acceptance-capped-at-depth", ("error",),
    f"per budget × thinking ({CAP_MIN_ROUNDS}+ rounds), the draft token at some depth k is accepted in ≥ "
    f"{CAP_ACCEPTED * 100:.0f} % of rounds ({CAP_MIN_AT_DEPTH}+) and the one at depth k + 1 in none, although the "
    "draft reaches deeper (the server's num_speculative_tokens, or the median per_step_drafted where vLLM gives it, or "
    "/metrics positions, the engine's block size, a tree "
    f"budget > k with a block size assumed ≥ {ASSUMED_BLOCK_DEPTH + 1}, llama.cpp's n_max): a draft-length or "
    "position bug, not a weak draft (whose curve decays smoothly)",
)


@rule(ACCEPTANCE_CAPPED_AT_DEPTH)
def acceptance_capped_at_depth(report: RunReport) -> list[Finding]:
    """Per group: the deepest depth ever accepted is accepted often, and the draft goes deeper."""
    hits, cases, depths = [], [], []
    for label, results, pooled in depth.groups(report):
        probabilities = pooled.probabilities
        reached = [k for k, p in enumerate(probabilities, 1) if p > 0]
        if not reached or pooled.rounds < CAP_MIN_ROUNDS:
            continue
        k = reached[-1]
        if probabilities[k - 1] < CAP_ACCEPTED or pooled.accepted[k - 1] < CAP_MIN_AT_DEPTH:
            continue
        limit, why = group_limit_why(report, results)
        if limit is None or limit <= k:
            continue
        curve = depth.curve_text(pooled.extended(limit))
        hits.append(f"{label}: depth {k} accepted in {probabilities[k - 1] * 100:.0f} % of {pooled.rounds:.0f} rounds, "
                    f"depth {k + 1} in none, though drafts reach depth {limit} ({why}); by depth {curve}")
        cases += [r.case_id for r in results]
        depths.append(k)
    if not hits:
        return []
    k = min(depths)
    return [ACCEPTANCE_CAPPED_AT_DEPTH.found(
        f"No round accepts more than {k} draft token{'s' if k != 1 else ''}: acceptance stops dead at depth {k}",
        some(hits, 3) + f" (fires when depth k is accepted in ≥ {CAP_ACCEPTED * 100:.0f} % of rounds and k + 1 never)",
        "Rounds pile up at one length while the draft goes deeper: a draft-length or position bug, not a "
        "weak draft (a weak draft's acceptance decays smoothly with depth). Check the number of draft tokens "
        "the server really verifies against what it drafts (vLLM num_speculative_tokens, SGLang "
        "speculative_num_steps / num_draft_tokens, llama.cpp --draft-max, a DFlash draft's block_size − 1); "
        "the position ids of draft tokens past the first (they must be start + depth; a draft fed one "
        "position for all its tokens matches only at the first ones); a tree builder or verifier with a "
        "fixed depth limit; and the attention mask / KV of tokens past that depth. If the draft's block size "
        f"really is {k + 1}, this is its limit: a larger block drafts deeper.",
        cases,
    )]


DEPTH_RULES: list[Rule] = [acceptance_capped_at_depth]
