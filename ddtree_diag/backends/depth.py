"""Acceptance by depth: the probability that the draft token at depth k (1-based) is accepted.

A verify round that commits L tokens (bonus included) accepted L − 1 draft tokens, so the draft
token at depth k was accepted iff L − 1 ≥ k. Servers say it in different shapes, all reduced here
to one ``Depth`` (rounds that accepted depth k, over all rounds):

- per-round lengths: the engine, the ``ddtree`` dialect's ``acceptance_lengths``; vLLM's
  ``per_step_accepted`` (``--per-request-spec-decode-metrics detailed``: accepted drafts per step);
- a histogram where index j counts the rounds that accepted exactly j draft tokens (bonus
  excluded): vLLM's ``metrics.speculative_decoding.acceptance_histogram`` (dense, length
  ``num_spec_tokens`` + 1), SGLang's ``spec_correct_drafts_histogram`` (older ``spec_accept_histogram``;
  only as long as the most drafts any round accepted, so it does not say how deep a draft goes);
- per-position counters (vLLM and llama.cpp ``/metrics``
  ``…_num_accepted_tokens_per_pos_total{position}``, position 0 = depth 1): accepted at a position
  over the drafts (verify rounds) — the curve vLLM's own docs give.

The curve of one case is stored on its ``SpecMetrics`` (``acceptance_by_depth`` and its rounds,
source and the deepest a draft could reach when the server says); ``pool`` adds cases up per
budget × thinking group, weighting each by its rounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median_low
from typing import TYPE_CHECKING, Any

from ddtree_diag.backends.dialects.base import int_list, integer
from ddtree_diag.records import ProbeResult, RunReport, SpecMetrics

if TYPE_CHECKING:
    from ddtree_diag.backends.metrics import SpecCounters

MAX_DEPTH = 1024  # deeper than any draft: a histogram or position beyond it is junk


@dataclass(frozen=True)
class Depth:
    """Rounds that accepted the draft token at each depth (index 0 = depth 1), over ``rounds``;
    ``limit``: the deepest a draft could reach, when the source says (None = unknown)."""

    accepted: tuple[float, ...]
    rounds: float
    source: str
    limit: int | None = None

    @property
    def probabilities(self) -> list[float]:
        return [min(1.0, a / self.rounds) for a in self.accepted] if self.rounds > 0 else []

    def extended(self, limit: int | None) -> Depth:
        """The curve with one more depth, never accepted, when a draft could reach it: a round that
        never goes past depth k shows as a drop to 0 at k + 1 (the counts say nothing deeper)."""
        depth = len(self.accepted)
        if limit is None or limit <= depth:
            return self
        return Depth((*self.accepted, 0.0), self.rounds, self.source, self.limit)


def from_lengths(lengths: Sequence[int], source: str = "per-round acceptance lengths",
                 limit: int | None = None) -> Depth | None:
    """From per-round acceptance lengths (bonus included); None when there are none or one is < 1."""
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        return None
    deepest = max(1, max(lengths) - 1)
    if deepest > MAX_DEPTH:
        return None
    accepted = tuple(float(sum(1 for n in lengths if n - 1 >= k)) for k in range(1, deepest + 1))
    return Depth(accepted, float(len(lengths)), source, limit)


def from_histogram(histogram: Sequence[int], source: str, limit: int | None = None) -> Depth | None:
    """From ``histogram[j]`` = rounds that accepted exactly j draft tokens; None when empty."""
    rounds = sum(histogram)
    if not histogram or rounds <= 0 or len(histogram) - 1 > MAX_DEPTH or min(histogram) < 0:
        return None
    deepest = max(1, len(histogram) - 1)
    accepted = tuple(float(sum(histogram[k:])) for k in range(1, deepest + 1))
    return Depth(accepted, float(rounds), source, limit)


def from_positions(accepted_per_position: Mapping[int, float], drafts: float, source: str) -> Depth | None:
    """From per-position accepted counts (position 0 = depth 1) over ``drafts`` verify rounds. Every
    position the server exports counts as one a draft can reach (vLLM exports 0 … k − 1)."""
    positions = sorted(p for p in accepted_per_position if 0 <= p < MAX_DEPTH)
    if drafts <= 0 or not positions:
        return None
    deepest = positions[-1] + 1
    accepted = tuple(max(0.0, float(accepted_per_position.get(p, 0.0))) for p in range(deepest))
    return Depth(accepted, float(drafts), source, deepest)


def from_counters(after: SpecCounters, before: SpecCounters) -> Depth | None:
    """Per-position acceptance between two ``/metrics`` scrapes (server-wide: other traffic counts
    too); None when either scrape is unusable, has no per-position counters or went backwards."""
    if not (after.usable and before.usable) or not after.accepted_per_position:
        return None
    drafts = after.drafts - before.drafts
    delta = {p: after.accepted_per_position[p] - before.accepted_per_position.get(p, 0.0)
             for p in after.accepted_per_position}
    if drafts <= 0 or min(delta.values()) < 0:
        return None
    return from_positions(delta, drafts, f"prometheus /metrics delta ({after.prefix}"
                                         "spec_decode_num_accepted_tokens_per_pos; server-wide)")


def _vllm(extras: Mapping[str, Any]) -> Depth | None:
    metrics = extras.get("metrics")
    stats = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(stats, dict):
        return None
    k = integer(stats.get("num_spec_tokens"))
    steps = int_list(stats.get("per_step_accepted"))
    if steps is not None:  # "detailed": exact per round
        drafted = int_list(stats.get("per_step_drafted"))
        if drafted and len(drafted) == len(steps) and len(set(drafted)) > 1:
            # variable-length drafting (n-gram, suffix, adaptive): a round cannot accept past what
            # it drafted, so the depth most rounds reach is the median draft, not num_spec_tokens
            # (a fixed draft shorter than num_spec_tokens keeps it: that is the bug to see)
            k = median_low(drafted) or None
        return from_lengths([n + 1 for n in steps], "response.metrics.speculative_decoding.per_step_accepted", k)
    histogram = int_list(stats.get("acceptance_histogram"))
    if histogram is None:
        return None
    # dense, num_spec_tokens + 1 buckets: its length says how deep a draft goes
    return from_histogram(histogram, "response.metrics.speculative_decoding.acceptance_histogram",
                          max(k or 0, len(histogram) - 1) or None)


def _sglang(extras: Mapping[str, Any]) -> Depth | None:
    sources = []
    sglext = extras.get("sglext")
    if isinstance(sglext, dict):
        details = sglext.get("spec_tokens_details")
        sources.append(("response.sglext.spec_tokens_details", details if isinstance(details, dict) else sglext))
    if isinstance(extras.get("meta_info"), dict):
        sources.append(("response.meta_info", extras["meta_info"]))
    for where, stats in sources:
        for key in ("spec_correct_drafts_histogram", "spec_accept_histogram"):  # the older name last
            histogram = int_list(stats.get(key))
            if histogram is not None:
                # grows with the most drafts a round accepted: it does not say how deep a draft goes
                return from_histogram(histogram, f"{where}.{key}")
    return None


def _numbers(values: Any) -> bool:
    """A stored curve as a report should hold it: a non-empty list of probabilities."""
    return isinstance(values, list) and bool(values) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in values)


def case_depth(result: ProbeResult) -> Depth | None:
    """One case's curve: the one stored on its spec numbers, else computed from its per-round
    lengths or the server's raw objects (reports written before the curve was stored)."""
    spec = result.spec
    stored = spec.acceptance_by_depth
    if _numbers(stored) and isinstance(spec.acceptance_by_depth_rounds, int) and spec.acceptance_by_depth_rounds > 0:
        rounds = float(spec.acceptance_by_depth_rounds)
        limit = spec.max_draft_depth
        limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
        return Depth(tuple(p * rounds for p in stored), rounds, str(spec.acceptance_by_depth_source or "report"),
                     limit)
    if spec.acceptance_lengths:
        source = f"{spec.source}.acceptance_lengths" if spec.source else "per-round acceptance lengths"
        found = from_lengths(spec.acceptance_lengths, source)
        if found is not None:
            return found
    extras = result.extras or {}
    return _vllm(extras) or _sglang(extras)


def store(spec: SpecMetrics, depth: Depth | None) -> None:
    """Write a curve onto a case's spec numbers."""
    if depth is None or depth.rounds <= 0:
        return
    # rounded for reading, but a depth accepted even once never reads as "never"
    spec.acceptance_by_depth = [max(round(p, 6), 1e-6) if p > 0 else 0.0 for p in depth.probabilities]
    spec.acceptance_by_depth_rounds = round(depth.rounds)
    spec.acceptance_by_depth_source = depth.source
    spec.max_draft_depth = depth.limit


def fill(result: ProbeResult) -> None:
    """Store the case's curve when it has none yet (every backend's results pass through here);
    a case that drafted nothing (budget 0, plain autoregressive) has none."""
    if speculative(result) and result.spec.acceptance_by_depth is None:
        store(result.spec, case_depth(result))


def wants_counters(result: ProbeResult) -> bool:
    """Whether a ``/metrics`` scrape after the case would add the curve: the answer's own numbers
    stand but say nothing per depth (llama.cpp's timings, vLLM without per-request metrics)."""
    return speculative(result) and result.spec.acceptance_by_depth is None and case_depth(result) is None


def pool(depths: Iterable[Depth]) -> Depth | None:
    """Cases added up, each weighted by its rounds; a shorter curve counts 0 beyond its end (no
    round of it accepted deeper). The limit is the smallest a case's source gave."""
    items = [d for d in depths if d.rounds > 0]
    if not items:
        return None
    deepest = max(len(d.accepted) for d in items)
    accepted = tuple(sum(d.accepted[k] if k < len(d.accepted) else 0.0 for d in items) for k in range(deepest))
    limits = [d.limit for d in items if d.limit is not None]
    sources = list(dict.fromkeys(d.source for d in items))
    return Depth(accepted, sum(d.rounds for d in items), "; ".join(sources), min(limits) if limits else None)


def speculative(result: ProbeResult) -> bool:
    """A case that drafted at all: not budget 0, not the engine's plain autoregressive mode."""
    return result.ok and result.case.tree_budget != 0 and (result.extras or {}).get("mode") != "ar"


def groups(report: RunReport) -> list[tuple[str, list[ProbeResult], Depth]]:
    """(group label, its cases, pooled curve) per budget × thinking group with a curve, in the
    order the groups first appear."""
    members: dict[str, list[ProbeResult]] = {}
    for result in report.results:
        if speculative(result) and case_depth(result) is not None:
            members.setdefault(result.case.group_label, []).append(result)
    out = []
    for label, results in members.items():
        pooled = pool(d for d in (case_depth(r) for r in results) if d is not None)
        if pooled is not None:
            out.append((label, results, pooled))
    return out


def short(p: float) -> str:
    """A probability in 1–4 characters: ``1`` and ``0`` only when exact, else ``.92``, ``<.01``."""
    if p <= 0:
        return "0"
    if p >= 1:
        return "1"
    text = f"{p:.2f}"
    return "<.01" if text == "0.00" else (".99" if text == "1.00" else text[1:])


def curve_text(depth: Depth, most: int = 12) -> str:
    """``.92 .71 .40 .12 0``: the first ``most`` depths, ``…`` when there are more."""
    values = [short(p) for p in depth.probabilities]
    return " ".join(values[:most]) + (" …" if len(values) > most else "")
