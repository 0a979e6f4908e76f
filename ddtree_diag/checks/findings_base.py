"""What every findings rule shares: the kind of a finding, the ``@rule`` mark, and phrases.

Kept apart from ``checks.findings`` so rule modules (``checks.workloads``) can import it while
``checks.findings`` imports them into its one registry.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ddtree_diag.records import Finding, ProbeResult, RunReport


@dataclass(frozen=True)
class FindingKind:
    """One finding a rule can report: its stable id, the severities it fires at (most have one),
    what makes it fire (the README's line, Markdown) and whether it fails the gate even without
    ``fail_on_findings`` (``critical``: the run's own numbers or state cannot be trusted)."""

    id: str
    severities: tuple[str, ...]
    fires_when: str
    critical: bool = False

    def found(self, title: str, evidence: str, check: str, cases: list[str], severity: str | None = None) -> Finding:
        """A finding of this kind; ``severity`` only for a kind that fires at more than one."""
        severity = severity or self.severities[0]
        if severity not in self.severities:
            raise ValueError(f"{self.id} fires at {'/'.join(self.severities)}, not {severity}")
        return Finding(self.id, severity, title, evidence, check, list(dict.fromkeys(cases)))


Rule = Callable[[RunReport], list[Finding]]


def rule(*kinds: FindingKind) -> Callable[[Rule], Rule]:
    """Mark a rule with the finding kinds it reports (``FINDINGS`` is read from ``RULES``)."""

    def mark(fn: Rule) -> Rule:
        fn.kinds = kinds  # type: ignore[attr-defined]
        return fn

    return mark


def some(items: list[str], limit: int, sep: str = "; ") -> str:
    """The first ``limit`` items joined, and how many more there are."""
    return sep.join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def ids_of(results: list[ProbeResult], limit: int = 6) -> str:
    return some([r.case_id for r in results], limit, ", ")


# Names of mixture-of-experts checkpoints: "-A3B" / "-A22B" (active parameters), "8x7B", or a
# family that is MoE throughout (DeepSeek's R1 distills are dense Qwen / Llama models).
_MOE_NAME = re.compile(
    r"(?i)(?:\bmoe\b|-a\d+(?:\.\d+)?b\b|\d+x\d+(?:\.\d+)?b\b|mixtral|gpt-oss|qwen3-next|kimi-k2|olmoe|dbrx"
    r"|jamba|llama-4|deepseek-(?:v[23]|r1)(?!-distill)|glm-4\.[5-7])"
)


def looks_like_moe(report: RunReport) -> bool:
    """Whether the target is a mixture of experts: the engine says so (its config's experts), or
    a served model's name reads like one."""
    if report.target.get("experts"):
        return True
    return bool(_MOE_NAME.search(str(report.target.get("model") or "")))


def compare_advice(report: RunReport) -> str:
    """How to compare with a non-speculative run, in terms this target can take: ``budget0`` only
    where a per-request budget exists (the engine, ddtree, ddtree-mlx, llama.cpp)."""
    from ddtree_diag.backends.dialects import REGISTRY

    name = report.target.get("dialect") or ""
    if report.target.get("backend") == "engine" or name == "engine":
        return "compare with --baseline budget0 (the same engine without the draft)"
    dialect = REGISTRY.get(name)
    if dialect is not None and dialect.sends_budget:
        return "compare with --baseline budget0 (the same server at tree_budget=0)"
    knob = f" ({dialect.budget_knob})" if dialect is not None else ""
    return (
        f"compare with a server without speculation, --baseline url:URL, or with the target alone, "
        f"--baseline engine --target DIR; this server cannot switch speculation off per request{knob}"
    )
