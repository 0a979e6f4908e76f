"""Server-wide speculative-decoding counters from a Prometheus ``/metrics`` page.

vLLM (``vllm:spec_decode_*``), llama.cpp started with ``--metrics`` (``llamacpp:spec_decode_*``)
and our own reference server (``ddtree_spec_decode_*``) expose the same four counters. A case's
numbers are the difference between a scrape before and after it. They count every request the
server handled in between, so the source is marked server-wide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ddtree_diag.records import SpecMetrics

_DRAFTS = "spec_decode_num_drafts"
_DRAFT_TOKENS = "spec_decode_num_draft_tokens"
_ACCEPTED = "spec_decode_num_accepted_tokens"
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


# Counters beyond 2**53 lose integer precision as floats: a delta of two of them means nothing.
MAX_COUNTER = float(1 << 53)


@dataclass
class SpecCounters:
    """One scrape: totals summed over every label set (one series per engine)."""

    prefix: str  # e.g. "vllm:", "llamacpp:", "ddtree_"
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)
    usable: bool = True  # False when a sample was NaN, infinite, negative or too large to subtract

    def delta(self, before: SpecCounters) -> SpecMetrics | None:
        """The spec numbers between two scrapes; None when either scrape holds unusable numbers
        or a counter went backwards (a server restart between the scrapes)."""
        if not (self.usable and before.usable):
            return None
        rounds = self.drafts - before.drafts
        drafted = self.draft_tokens - before.draft_tokens
        accepted = self.accepted_tokens - before.accepted_tokens
        if min(rounds, drafted, accepted) < 0:
            return None
        metrics = SpecMetrics(
            decode_rounds=round(rounds),
            draft_tokens=round(drafted),
            accepted_tokens=round(accepted),
            source=f"prometheus /metrics delta ({self.prefix}{_DRAFTS}; server-wide)",
            server_wide=True,
        )
        if rounds > 0:
            # Each draft (verify round) commits its accepted tokens plus one of the target's own.
            metrics.mean_acceptance_length = 1 + accepted / rounds
        from ddtree_diag.backends import depth  # it reads SpecCounters: imported here, not above

        depth.store(metrics, depth.from_counters(self, before))
        return metrics


def _base_name(name: str) -> str:
    """Strip the suffixes the exposition format adds to counters."""
    for suffix in ("_total", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def parse_spec_counters(text: str) -> SpecCounters | None:
    """Read spec-decode counters out of an exposition page; None when it has none.

    Raises ValueError on a page the Prometheus parser cannot read. NaN, infinite, negative or
    over-2**53 samples mark the scrape unusable (its delta is unknown), never a wrong number.
    """
    from prometheus_client.parser import text_string_to_metric_families

    found: SpecCounters | None = None
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises bare ValueError/IndexError/TypeError on bad pages
        raise ValueError(f"unreadable /metrics page: {type(exc).__name__}") from None
    for family in families:
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # creation timestamps, not counts
            name = _base_name(sample.name)
            for kind in (_PER_POS, _DRAFT_TOKENS, _ACCEPTED, _DRAFTS):
                if name.endswith(kind):
                    break
            else:
                continue
            prefix = name[: -len(kind)]
            if found is None:
                found = SpecCounters(prefix=prefix)
            elif found.prefix != prefix:
                continue  # a second exporter on the same page; keep the first
            try:
                value = float(sample.value)
            except (TypeError, ValueError, OverflowError):
                value = math.nan
            if not (math.isfinite(value) and 0 <= value <= MAX_COUNTER):
                found.usable = False
                continue
            if kind == _DRAFTS:
                found.drafts += value
            elif kind == _DRAFT_TOKENS:
                found.draft_tokens += value
            elif kind == _ACCEPTED:
                found.accepted_tokens += value
            else:
                try:
                    position = int(str(sample.labels.get("position", -1)))
                except ValueError:
                    position = -1
                found.accepted_per_position[position] = found.accepted_per_position.get(position, 0.0) + value
    if found is not None and max(found.drafts, found.draft_tokens, found.accepted_tokens) > MAX_COUNTER:
        found.usable = False  # sums of many series
    return found


_CACHED_TOKENS = frozenset({"sglang:cached_tokens"})


def parse_prefix_cache_hits(text: str) -> float | None:
    """Prompt tokens served from the prefix cache so far (vLLM's ``vllm:prefix_cache_hits_total``,
    older ``gpu_prefix_cache_hits``; SGLang's ``sglang:cached_tokens_total``, counted as each request
    finishes; summed over engines), None when the page has no such counter or an unusable sample. A
    before/after delta around one request is that request's hits."""
    from prometheus_client.parser import text_string_to_metric_families

    total, seen = 0.0, False
    try:
        families = list(text_string_to_metric_families(text))
    except Exception:  # the parser raises bare ValueError/IndexError/TypeError on bad pages
        return None
    for family in families:
        for sample in family.samples:
            name = _base_name(sample.name)
            if sample.name.endswith("_created") or not (name.endswith("prefix_cache_hits") or name in _CACHED_TOKENS):
                continue
            try:
                value = float(sample.value)
            except (TypeError, ValueError, OverflowError):
                return None
            if not (math.isfinite(value) and 0 <= value <= MAX_COUNTER):
                return None
            total, seen = total + value, True
    return total if seen else None
