"""Cross-target findings: what only a fleet shows — the replica that differs from the others.

Replicas are the targets of one group (``fleetstats.group_of``: the targets file's ``group``, else
the served model). Only targets with at least one ok result are compared (a target that failed
entirely is the fleet gate's business, not a replica to compare), and only on the cases they
both answered. Three rules:

- ``replica-differs`` (text): at T=0 every replica must give the same answer (text, reasoning,
  tool calls) to the same case. Where a strict majority agrees, each replica with another answer
  is the odd one out; where two replicas disagree with nobody to break the tie, both are named.
- ``replica-differs`` (acceptance): a replica whose per-case acceptance is far from the group's.
- ``replica-slow``: a replica whose per-case decode tok/s is far below the group's.

Numbers are per-case ratios summarised by their median, so one noisy case cannot flag a replica.
A finding's ``cases`` are ``"<target name>: <case id>"`` strings (``fleet_case``): the cases of
the named target(s) that show the difference.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import mean, median

from ddtree_diag.checks.findings_base import FindingKind, some
from ddtree_diag.checks.fleetstats import decode_tps, group_of
from ddtree_diag.checks.lossless import around, calls_text, first_difference
from ddtree_diag.output.cells import visible
from ddtree_diag.records import SEVERITIES, Finding, FleetMember, FleetReport, ProbeResult

# Margins. Module-level so tests and callers can read them.
ACCEPTANCE_RATIO = 0.75  # median per-case ratio below this (or above its inverse)...
ACCEPTANCE_MIN_DIFF = 0.5  # ...and the means at least this many tokens/round apart
MIN_SHARED_CASES = 2  # cases compared before a number speaks (1 when the matrix has only 1)
SLOW_RATIO = 0.7  # median per-case decode tok/s below 70 % of the group's
# One short request's tok/s moves by a third on a busy client or network: speed needs more cases
# than text or acceptance (which do not depend on the clock) before it speaks.
MIN_SLOW_CASES = 3
MIN_TPS_TOKENS = 6  # the decode tok/s of a 2-token answer is noise
EXCERPT_LIMIT = 90  # characters of each side shown around the first difference

REPLICA_DIFFERS = FindingKind(
    "replica-differs", ("error",),
    "fleets, among the replicas of one group (its `group`, else the served model): one gives a different "
    "T=0 answer (text, reasoning or tool calls) from the majority's on the same case — or two disagree "
    "with no third to tell which is odd; or its median per-case acceptance is < 0.75× or > 1.33× the "
    "group's and ≥ 0.5 tokens/round apart (2+ shared cases, T=0 ones when they report it): other "
    "weights, template or image, or no draft",
)
REPLICA_SLOW = FindingKind(
    "replica-slow", ("warning",),
    "fleets: a replica's median per-case decode tok/s is < 70 % of its group's (3+ shared cases of ≥ 6 "
    "tokens): GPU, driver, image flags or host load",
)
FLEET_FINDINGS: tuple[FindingKind, ...] = (REPLICA_DIFFERS, REPLICA_SLOW)


def fleet_case(target: str, case_id: str) -> str:
    """A fleet finding's ``cases`` entry: ``"<target name>: <case id>"``."""
    return f"{target}: {case_id}"


def split_fleet_case(entry: str) -> tuple[str | None, str]:
    """``(target name, case id)`` of a ``cases`` entry; ``(None, entry)`` for a plain case id."""
    target, sep, case_id = entry.partition(": ")
    return (target, case_id) if sep else (None, entry)


# ---------------------------------------------------------------------------------------------
# The replicas of one group


@dataclass
class _Group:
    name: str
    members: list[FleetMember]
    # each member's ok results by case id (the first one when a case id repeats)
    results: dict[str, dict[str, ProbeResult]] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]


def _groups(fleet: FleetReport) -> list[_Group]:
    """The groups with two or more targets that have an ok result, in the fleet's order."""
    groups: dict[str, _Group] = {}
    for member in fleet.targets:
        ok: dict[str, ProbeResult] = {}
        for result in member.report.results:
            if result.ok:
                ok.setdefault(result.case_id, result)
        if not ok:
            continue  # failed entirely: nothing to compare (the fleet gate reports it)
        group = groups.setdefault(group_of(member), _Group(group_of(member), []))
        group.members.append(member)
        group.results[member.name] = ok
    return [g for g in groups.values() if len(g.members) >= 2]


def _names(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'s' if count != 1 else ''}"


# ---------------------------------------------------------------------------------------------
# Text: T=0 answers must be identical across replicas

Answer = tuple[str, str, str]  # (reasoning, output, tool calls): the order they are generated in
FIELDS = ("reasoning", "output", "tool calls")


def _answer(result: ProbeResult) -> Answer:
    # Tool calls compare by name and arguments: their ids differ by design.
    return (result.reasoning or "", result.output or "", calls_text(result.tool_calls))


def _where(expected: Answer, actual: Answer) -> str:
    """The first difference between two answers: field, character, both sides around it."""
    for name, want, got in zip(FIELDS, expected, actual, strict=True):
        index = first_difference(got, want)
        if index is not None:
            return (f"{name} char {index}: \"{visible(around(want, index), EXCERPT_LIMIT)}\" vs "
                    f"\"{visible(around(got, index), EXCERPT_LIMIT)}\"")
    return "identical"


@dataclass
class _Split:
    """A T=0 case with no majority answer among the replicas that answered it."""

    case_id: str
    answers: dict[str, Answer]  # member name -> answer


def _text_findings(group: _Group) -> list[Finding]:
    # the T=0 case ids in the matrix's order (as the targets ran them)
    t0 = list(dict.fromkeys(cid for ok in group.results.values() for cid, r in ok.items() if r.case.temperature == 0))
    # name -> [(case id, the agreed answer, its own, who agreed)]
    odd: dict[str, list[tuple[str, Answer, Answer, list[str]]]] = defaultdict(list)
    splits: list[_Split] = []
    compared = 0
    for case_id in t0:
        answers = {name: _answer(ok[case_id]) for name, ok in group.results.items() if case_id in ok}
        if len(answers) < 2:
            continue
        compared += 1
        ranked = Counter(answers.values()).most_common()
        if len(ranked) == 1:
            continue
        if ranked[0][1] > ranked[1][1]:  # a strict majority
            agreed = ranked[0][0]
            holders = [n for n, a in answers.items() if a == agreed]
            for name, answer in answers.items():
                if answer != agreed:
                    odd[name].append((case_id, agreed, answer, holders))
        else:
            splits.append(_Split(case_id, answers))
    # A tie that only a replica already odd elsewhere breaks (A odd on the cases all three answered,
    # and here only A and B answered): it is A's, not a pair nobody can judge.
    unresolved = []
    for split in splits:
        rest = {name: a for name, a in split.answers.items() if name not in odd}
        if rest and len(set(rest.values())) == 1:
            agreed = next(iter(rest.values()))
            for name, answer in split.answers.items():
                if answer != agreed:
                    odd[name].append((split.case_id, agreed, answer, list(rest)))
        else:
            unresolved.append(split)

    out = []
    for member in group.members:
        cases = odd.get(member.name)
        if not cases:
            continue
        case_id, expected, actual, holders = cases[0]
        others = len(group.members) - 1
        out.append(REPLICA_DIFFERS.found(
            f"Replica {member.name} gives a different T=0 answer from the other {_plural(others, 'replica')} "
            f"of {group.name} ({len(cases)}/{compared} cases)",
            f"{len(cases)} of {compared} T=0 case(s) differ from the answer the others agree on; first "
            f"{case_id}: {_where(expected, actual)} ({_names(holders)} vs {member.name})",
            f"{member.name} is not the same deployment as the others. At T=0 a lossless server says what "
            "its target alone says, so compare on it: the weights' checksums (target and draft), the "
            "image / server version and its flags (dtype, quantisation, attention backend, tensor "
            "parallel size), the chat template and tokenizer files, the GPU driver / CUDA version. A "
            "late first difference in a long answer can be a bf16 near-tie on other hardware; an early "
            f"one is another model or template. Run {member.name} alone with --baseline to see whether "
            "its speculation is lossless against its own target.",
            [fleet_case(member.name, c) for c, _, _, _ in cases],
        ))
    if unresolved:
        involved = [m.name for m in group.members if any(m.name in s.answers for s in unresolved)]
        first = unresolved[0]
        distinct = list(dict.fromkeys(first.answers.values()))
        holders = [next(n for n, a in first.answers.items() if a == answer) for answer in distinct[:2]]
        pair = len(involved) == 2
        title = (f"Replicas {_names(involved)} give different T=0 answers ({len(unresolved)}/{compared} cases); "
                 + ("a third replica would tell which is odd" if pair else "no majority tells which is odd"))
        out.append(REPLICA_DIFFERS.found(
            title,
            f"{len(unresolved)} T=0 case(s) of {group.name} with no majority answer; first {first.case_id}: "
            f"{_where(first.answers[holders[0]], first.answers[holders[1]])} ({holders[0]} vs {holders[1]})",
            "These replicas are not the same deployment. Compare on each: the weights' checksums "
            "(target and draft), the image / server version and its flags, the chat template and "
            "tokenizer files, the GPU driver / CUDA version; run each alone with --baseline to see "
            "which is lossless against its own target"
            + (", or add a third replica to the fleet." if pair else "."),
            [fleet_case(name, s.case_id) for s in unresolved for name in s.answers],
        ))
    return out


# ---------------------------------------------------------------------------------------------
# Numbers: a replica's per-case ratio to the group, summarised by the median


@dataclass
class _Ratio:
    """One target's numbers against its group's, over the cases they share."""

    name: str
    ratio: float  # median of the per-case ratios
    own: float  # the target's mean over the shared cases
    others: float  # the others' (median per case) mean over the same cases
    reference: float  # the reference's mean over the same cases (see _reference)
    cases: list[tuple[str, float]]  # (case id, per-case ratio)


def _reference(own: float, others: list[float]) -> float:
    """What a target's number on a case is compared with: the median of every replica's number on
    it, the target's own included — with three replicas the median of the two others is their mean,
    so one broken replica would drag the healthy ones' reference halfway and flag them too. With
    two replicas: the other one."""
    return others[0] if len(others) == 1 else median([own, *others])


def _ratios(group: _Group, value: Callable[[ProbeResult], float | None], case_ids: set[str]) -> list[_Ratio]:
    values: dict[str, dict[str, float]] = {}
    for name, ok in group.results.items():
        values[name] = {cid: v for cid, r in ok.items() if cid in case_ids and (v := value(r)) is not None and v > 0}
    out = []
    for name, own_values in values.items():
        rows = []
        for case_id, own in own_values.items():  # the matrix's order
            others = [vals[case_id] for other, vals in values.items() if other != name and case_id in vals]
            if others:
                rows.append((case_id, own, median(others), _reference(own, others)))
        if rows:
            out.append(_Ratio(
                name, median(own / ref for _, own, _, ref in rows), mean(own for _, own, _, _ in rows),
                mean(o for _, _, o, _ in rows), mean(ref for _, _, _, ref in rows),
                [(case_id, own / ref) for case_id, own, _, ref in rows],
            ))
    return out


def _enough(ratio: _Ratio, case_ids: set[str]) -> bool:
    return len(ratio.cases) >= min(MIN_SHARED_CASES, len(case_ids))


def _accept(result: ProbeResult) -> float | None:
    return result.spec.mean_acceptance_length


def _acceptance_pool(group: _Group) -> tuple[set[str], str]:
    """The speculative cases acceptance is compared on: the T=0 ones when two replicas report
    acceptance on one (sampling moves acceptance), else every case."""
    seen: dict[str, int] = defaultdict(int)
    for ok in group.results.values():
        for case_id, r in ok.items():
            if r.case.tree_budget != 0 and _accept(r) is not None:  # budget 0 speculates nothing
                seen[case_id] += 1
    shared = {cid for cid, n in seen.items() if n >= 2}
    any_result = {cid: r for ok in group.results.values() for cid, r in ok.items()}
    t0 = {cid for cid in shared if any_result[cid].case.temperature == 0}
    return (t0, "T=0 cases") if t0 else (shared, "cases")


def _acceptance_far(ratio: _Ratio) -> bool:
    far = ratio.ratio < ACCEPTANCE_RATIO or ratio.ratio > 1 / ACCEPTANCE_RATIO
    return far and abs(ratio.own - ratio.reference) >= ACCEPTANCE_MIN_DIFF


ACCEPTANCE_CHECK_LOWER = (
    "Is the draft loaded on {name} (its start-up log, its speculative config, /metrics draft counters)? "
    "Acceptance near 1.0 means every round commits only the target's own token: speculation is off "
    "or the draft does not match. Otherwise compare with the others: the draft checkpoint and its "
    "checksum, the tree budget / num_speculative_tokens, the image version and flags, the chat "
    "template (thinking on or off changes what the draft sees)."
)
ACCEPTANCE_CHECK_HIGHER = (
    "{name} commits more tokens per round than the others: a different draft, a larger tree budget "
    "/ num_speculative_tokens, or different text (a repetition loop is easy to draft: see its own "
    "findings). Compare the draft checkpoint, the speculative settings and the image version."
)


def _acceptance_findings(group: _Group) -> tuple[list[Finding], set[str]]:
    """replica-differs by acceptance; also the names of the targets found lower."""
    pool, pool_label = _acceptance_pool(group)
    ratios = [r for r in _ratios(group, _accept, pool) if _enough(r, pool)]
    flagged = [r for r in ratios if _acceptance_far(r)]
    if not flagged:
        return [], set()
    low, high = ACCEPTANCE_RATIO, 1 / ACCEPTANCE_RATIO
    if len(ratios) == 2:
        # Two replicas are each other's reference, so both cross the margin: one finding, the
        # lower one named first (a draft that is not loaded is the usual cause).
        lower, other = sorted(ratios, key=lambda r: r.own)
        shown = {c for c, q in lower.cases if q < low or q > high}
        return [REPLICA_DIFFERS.found(
            f"Replica {lower.name}'s acceptance is far lower than replica {other.name}'s: {lower.own:.2f} vs "
            f"{other.own:.2f} tokens/round ({group.name}); a third replica would tell which is odd",
            f"median per-case ratio {lower.ratio:.2f} over {len(lower.cases)} shared {pool_label} "
            f"(fires below {low:.2f} or above {high:.2f}, ≥ {ACCEPTANCE_MIN_DIFF} tokens/round apart)",
            ACCEPTANCE_CHECK_LOWER.format(name=lower.name)
            + f" If {lower.name} is the healthy one, {other.name} commits more than it should: a third "
            "replica tells which.",
            [fleet_case(r.name, c) for r in (lower, other) for c, _ in r.cases if c in shown],
        )], {lower.name}
    found, lower_names = [], set()
    by_name = {r.name: r for r in flagged}
    for member in group.members:
        ratio = by_name.get(member.name)
        if ratio is None:
            continue
        lower = ratio.ratio < 1
        if lower:
            lower_names.add(member.name)
        found.append(REPLICA_DIFFERS.found(
            f"Replica {member.name}'s acceptance is far {'lower' if lower else 'higher'} than its group's "
            f"({group.name}): {ratio.own:.2f} vs the others' {ratio.others:.2f} tokens/round",
            f"median per-case ratio to the group {ratio.ratio:.2f} over {len(ratio.cases)} shared {pool_label} "
            f"(fires below {low:.2f} or above {high:.2f}, ≥ {ACCEPTANCE_MIN_DIFF} tokens/round apart); "
            f"mean acceptance {ratio.own:.2f} vs the others' {ratio.others:.2f} (group {group.name}: "
            f"{_names(group.names)})",
            (ACCEPTANCE_CHECK_LOWER if lower else ACCEPTANCE_CHECK_HIGHER).format(name=member.name),
            [fleet_case(member.name, c) for c, q in ratio.cases if (q < low if lower else q > high)],
        ))
    return found, lower_names


def _tps(result: ProbeResult) -> float | None:
    tokens = result.completion_tokens
    return decode_tps(result) if tokens is None or tokens >= MIN_TPS_TOKENS else None


def _slow_findings(group: _Group, low_acceptance: set[str]) -> list[Finding]:
    pool = {cid for ok in group.results.values() for cid, r in ok.items() if _tps(r) is not None}
    out = []
    by_name = {r.name: r for r in _ratios(group, _tps, pool)}
    for member in group.members:
        ratio = by_name.get(member.name)
        if ratio is None or len(ratio.cases) < MIN_SLOW_CASES or ratio.ratio >= SLOW_RATIO:
            continue
        others = len(group.members) - 1
        if member.name in low_acceptance:
            why = (f"Its acceptance is also lower than the others' (replica-differs): a replica that commits "
                   f"fewer tokens per round decodes slower — fix that first (is the draft loaded on "
                   f"{member.name}?). Then check")
        elif any(_accept(r) is not None for r in group.results[member.name].values()):
            why = "Its acceptance is not far from the others', so the draft is not the cause. Check"
        else:
            why = "Check"
        out.append(REPLICA_SLOW.found(
            f"Replica {member.name} decodes slower than the other {_plural(others, 'replica')} of {group.name}: "
            f"{ratio.own:.1f} vs {ratio.others:.1f} tok/s",
            f"median per-case decode tok/s ratio to the group {ratio.ratio:.2f} over {len(ratio.cases)} shared "
            f"case(s) (fires below {SLOW_RATIO:.2f}); mean {ratio.own:.1f} tok/s vs the others' "
            f"{ratio.others:.1f} (group {group.name}: {_names(group.names)}); slowest: "
            + some([f"{c} {q:.2f}" for c, q in sorted(ratio.cases, key=lambda x: x[1])], 3),
            why + " its GPU (model, clocks, power cap, thermal throttling, another process on it: "
            "nvidia-smi), the driver / CUDA version, the image and its flags (attention backend, CUDA "
            "graphs, tensor parallel size, quantisation), and the host and the network to it (client "
            "timings include the network).",
            [fleet_case(member.name, c) for c, q in ratio.cases if q < SLOW_RATIO],
        ))
    return out


def analyse_fleet(fleet: FleetReport) -> list[Finding]:
    """Compare the replicas of each group; store the findings (most severe first) on the fleet
    report and return them. Each finding's ``cases`` are ``"<target>: <case id>"`` entries."""
    findings: list[Finding] = []
    for group in _groups(fleet):
        findings.extend(_text_findings(group))
        accepted, low = _acceptance_findings(group)
        findings.extend(accepted)
        findings.extend(_slow_findings(group, low))
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    fleet.findings = findings
    return findings
