"""Cross-target findings (checks.replicas): the replica that differs from the others, or is slow.

Fleets are built from synthetic runs: every target runs the same cases; a helper changes one
target's text, acceptance or speed, and the tests check which finding names which target.
"""

from __future__ import annotations

from ddtree_diag.checks import findings, replicas
from ddtree_diag.checks.replicas import analyse_fleet, split_fleet_case
from ddtree_diag.records import (
    STATUS_TRANSPORT_ERROR,
    FleetMember,
    FleetReport,
    ProbeCase,
    ProbeResult,
    RunReport,
    SpecMetrics,
    Timings,
)

PROMPTS = ("hello", "story", "math", "code", "list", "json")


def _case(prompt: str, temperature: float = 0.0, repeat: int = 0) -> ProbeCase:
    return ProbeCase(prompt_id=prompt, messages=[{"role": "user", "content": f"{prompt}?"}],
                     enable_thinking=False, tree_budget=16, temperature=temperature, max_tokens=64, repeat=repeat)


def _result(case: ProbeCase, *, acceptance: float = 3.0, tps: float = 100.0, output: str | None = None) -> ProbeResult:
    return ProbeResult(
        case=case, dialect="ddtree", model="m",
        output=output if output is not None else f"The answer to {case.case_id}.",
        finish_reason="stop", prompt_tokens=20, completion_tokens=30,
        timings=Timings(e2e_s=0.4, decode_tokens_per_second=tps),
        spec=SpecMetrics(decode_rounds=10, mean_acceptance_length=acceptance, source="response.ddtree"),
    )


def _run(model: str = "Qwen3-8B", temperature: float = 0.0, **kw) -> RunReport:
    return RunReport(results=[_result(_case(p, temperature), **kw) for p in PROMPTS],
                     target={"url": "http://x/v1", "model": model})


def _fleet(*members: tuple[str, RunReport]) -> FleetReport:
    return FleetReport(targets=[FleetMember(name, report) for name, report in members])


def _three(**changes) -> FleetReport:
    """Three identical replicas gpu-a, gpu-b, gpu-c; ``changes`` (a -> a function on gpu-a's report)
    alter some."""
    fleet = _fleet(*[(f"gpu-{key}", _run()) for key in ("a", "b", "c")])
    for key, change in changes.items():
        change(fleet.member(f"gpu-{key}").report)
    return fleet


def _names_in(finding) -> set[str]:
    return {split_fleet_case(c)[0] for c in finding.cases}


def test_identical_replicas_find_nothing():
    fleet = _three()
    assert analyse_fleet(fleet) == [] and fleet.findings == []


def test_one_replica_with_other_t0_text_is_the_odd_one_out():
    def change(report: RunReport) -> None:
        report.results[1].output = "The answer is something else entirely."
        report.results[3].output = report.results[3].output + " And more."

    found = analyse_fleet(_three(b=change))
    assert [f.id for f in found] == ["replica-differs"]
    [item] = found
    assert item.severity == "error" and "gpu-b" in item.title
    assert "gpu-a" not in item.title and "gpu-c" not in item.title
    assert _names_in(item) == {"gpu-b"}
    assert {split_fleet_case(c)[1] for c in item.cases} == {_case("story").case_id, _case("code").case_id}
    assert "2/6" in item.title and "story" in item.evidence and "char" in item.evidence


def test_reasoning_and_tool_calls_are_part_of_the_answer():
    def change(report: RunReport) -> None:
        report.results[0].tool_calls = [{"id": "x", "name": "add", "arguments": '{"a": 2}'}]

    def same_calls_other_ids(report: RunReport) -> None:
        report.results[0].tool_calls = [{"id": "y", "name": "add", "arguments": '{"a": 1}'}]

    fleet = _three(a=same_calls_other_ids, b=same_calls_other_ids, c=change)
    fleet.member("gpu-b").report.results[0].tool_calls[0]["id"] = "z"  # ids differ by design
    [item] = analyse_fleet(fleet)
    assert _names_in(item) == {"gpu-c"} and "tool calls" in item.evidence

    fleet = _three(c=lambda report: setattr(report.results[2], "reasoning", "Let me think."))
    [item] = analyse_fleet(fleet)
    assert _names_in(item) == {"gpu-c"} and "reasoning" in item.evidence


def test_two_replicas_that_disagree_are_named_together():
    fleet = _fleet(("left", _run()), ("right", _run()))
    fleet.member("right").report.results[0].output = "Hi."
    [item] = analyse_fleet(fleet)
    assert item.id == "replica-differs" and item.severity == "error"
    assert "left" in item.title and "right" in item.title and "third replica" in item.title
    assert _names_in(item) == {"left", "right"}


def test_a_tie_broken_elsewhere_is_the_known_odd_replica():
    """c differs on the cases all three answered; on a case a failed, b and c disagree alone:
    that is c again, not a pair nobody can judge."""
    def change(report: RunReport) -> None:
        for result in report.results:
            result.output = "Something else."

    fleet = _three(c=change)
    fleet.member("gpu-a").report.results[0].status = STATUS_TRANSPORT_ERROR
    [item] = analyse_fleet(fleet)
    assert _names_in(item) == {"gpu-c"} and len(item.cases) == len(PROMPTS)


def test_text_differences_at_t_above_zero_are_sampling():
    fleet = _fleet(*[(name, _run(temperature=0.7)) for name in ("gpu-a", "gpu-b", "gpu-c")])
    for result in fleet.member("gpu-b").report.results:
        result.output = "A sampled answer."
    assert analyse_fleet(fleet) == []


def test_replica_without_draft_has_far_lower_acceptance():
    def no_draft(report: RunReport) -> None:
        for result in report.results:
            result.spec.mean_acceptance_length = 1.0

    found = analyse_fleet(_three(c=no_draft))
    [item] = found
    assert item.id == "replica-differs" and _names_in(item) == {"gpu-c"}
    assert "lower" in item.title and "1.00" in item.title and "3.00" in item.title
    assert "draft" in item.check

    # Two replicas: one finding, the lower one named first.
    fleet = _fleet(("x", _run()), ("y", _run(acceptance=1.0)))
    [item] = analyse_fleet(fleet)
    assert item.id == "replica-differs" and item.title.index("y") < item.title.index("x")


def test_higher_acceptance_is_named_too():
    def more(report: RunReport) -> None:
        for result in report.results:
            result.spec.mean_acceptance_length = 5.0

    [item] = analyse_fleet(_three(a=more))
    assert _names_in(item) == {"gpu-a"} and "higher" in item.title


def test_one_noisy_case_does_not_flag_and_small_differences_do_not_either():
    def noisy(report: RunReport) -> None:
        report.results[2].spec.mean_acceptance_length = 1.0
        report.results[4].timings.decode_tokens_per_second = 20.0

    assert analyse_fleet(_three(b=noisy)) == []

    def a_bit_lower(report: RunReport) -> None:  # 0.7 ratio but only 0.3 tokens/round apart
        for result in report.results:
            result.spec.mean_acceptance_length = 0.7

    fleet = _fleet(*[(name, _run(acceptance=1.0)) for name in ("gpu-a", "gpu-b", "gpu-c")])
    a_bit_lower(fleet.member("gpu-a").report)
    assert analyse_fleet(fleet) == []


def test_acceptance_prefers_t0_cases():
    """Sampled cases' acceptance differs from replica to replica; with T=0 cases present, only
    those are compared."""
    fleet = _three()
    for member in fleet.targets:
        sampled = 1.0 if member.name == "gpu-c" else 3.0
        member.report.results += [_result(_case(p, 0.8), acceptance=sampled) for p in PROMPTS]
    assert analyse_fleet(fleet) == []


def test_slow_replica_is_a_warning_with_both_speeds():
    def slow(report: RunReport) -> None:
        for result in report.results:
            result.timings.decode_tokens_per_second = 40.0

    [item] = analyse_fleet(_three(b=slow))
    assert item.id == "replica-slow" and item.severity == "warning"
    assert "gpu-b" in item.title and "40.0" in item.title and "100.0" in item.title
    assert _names_in(item) == {"gpu-b"} and "not the cause" in item.check

    fleet = _fleet(("x", _run()), ("y", _run(tps=40.0)))
    [item] = analyse_fleet(fleet)
    assert item.id == "replica-slow" and _names_in(item) == {"y"}


def test_speed_needs_three_shared_cases():
    """One or two short requests' tok/s is noise on a busy client: too few cases say nothing."""
    fleet = _fleet(*[(name, _run()) for name in ("p", "q", "r")])
    for member in fleet.targets:
        member.report.results = member.report.results[:2]
        if member.name == "q":
            for result in member.report.results:
                result.timings.decode_tokens_per_second = 40.0
    assert analyse_fleet(fleet) == []
    for member in fleet.targets:  # a third shared case: now it speaks
        extra = _run(tps=40.0 if member.name == "q" else 100.0).results[2]
        member.report.results.append(extra)
    assert [f.id for f in analyse_fleet(fleet)] == ["replica-slow"]


def test_slow_and_low_acceptance_both_fire_errors_first():
    def broken(report: RunReport) -> None:
        for result in report.results:
            result.spec.mean_acceptance_length = 1.0
            result.timings.decode_tokens_per_second = 35.0

    found = analyse_fleet(_three(a=broken))
    assert [f.id for f in found] == ["replica-differs", "replica-slow"]
    assert all(_names_in(f) == {"gpu-a"} for f in found)
    assert "acceptance is also lower" in found[1].check


def test_groups_are_compared_apart():
    fleet = _fleet(("a", _run()), ("b", _run(model="Llama-3-8B", acceptance=1.0, tps=30.0, output="Other.")))
    assert analyse_fleet(fleet) == []

    # An explicit group overrides the served model: these two are replicas after all.
    for member in fleet.targets:
        member.group = "pool"
    assert {f.id for f in analyse_fleet(fleet)} == {"replica-differs", "replica-slow"}

    # A group of one beside a group of three: only the three are compared.
    fleet = _three(c=lambda report: setattr(report.results[0], "output", "odd"))
    fleet.targets.append(FleetMember("alone", _run(model="Other", output="x", acceptance=1.0)))
    [item] = analyse_fleet(fleet)
    assert _names_in(item) == {"gpu-c"}


def test_failed_targets_are_not_replicas():
    def dead(report: RunReport) -> None:
        for result in report.results:
            result.status, result.output, result.error = STATUS_TRANSPORT_ERROR, "", "refused"
            result.spec, result.timings = SpecMetrics(), Timings()

    assert analyse_fleet(_three(c=dead)) == []
    fleet = _fleet(("gpu-a", _run()), ("gpu-b", _run()))
    dead(fleet.member("gpu-b").report)
    assert analyse_fleet(fleet) == []

    # A case that failed on one side is skipped, not compared.
    fleet = _three(b=lambda report: setattr(report.results[0], "status", STATUS_TRANSPORT_ERROR))
    fleet.member("gpu-b").report.results[0].output = ""
    assert analyse_fleet(fleet) == []


def test_fleet_kinds_are_in_the_readme_table_but_not_the_run_registry():
    table = findings.readme_table()
    assert all(f"| `{kind.id}` |" in table for kind in replicas.FLEET_FINDINGS)
    assert not {kind.id for kind in replicas.FLEET_FINDINGS} & set(findings.BY_ID)
    assert replicas.REPLICA_DIFFERS.severities == ("error",) and replicas.REPLICA_SLOW.severities == ("warning",)


def test_cases_entries_split_into_target_and_case():
    case_id = "hello/think=off/T=0/r0"
    assert split_fleet_case(replicas.fleet_case("gpu-1", case_id)) == ("gpu-1", case_id)
    assert split_fleet_case("hello/T=0/r0") == (None, "hello/T=0/r0")


def test_findings_survive_the_report_round_trip():
    fleet = _three(b=lambda report: setattr(report.results[0], "output", "odd"))
    analyse_fleet(fleet)
    again = FleetReport.from_dict(fleet.to_dict())
    assert [f.to_dict() for f in again.findings] == [f.to_dict() for f in fleet.findings]
