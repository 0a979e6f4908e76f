"""`ddtree-diag gate MATRIX --against known-good.json`: regression checks against a saved run.

End to end (real CLI, the STAND-IN server): a run judged against its own saved report passes; a
planted regression (lossy text, low acceptance, a slow server) fails its against_* check naming
the cases, in the JSON and the JUnit XML; a bad --against file is exit 2 before any request.
In process: the tolerances derived from the known-good's repeat spread, and each check's verdict.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree_diag.checks import against
from ddtree_diag.checks.gate import evaluate, parse_gate
from ddtree_diag.errors import UsageError
from ddtree_diag.output.reportfile import report_json
from ddtree_diag.records import ProbeCase, ProbeResult, RunReport, SpecMetrics, Timings, Verdict
from tests.support.gatekit import check, gate_run, write_matrix
from tests.support.timing import AGAINST_FAST_TOKENS_PER_SECOND, AGAINST_SELF_TPS_TOLERANCE, SLOW_SECONDS_PER_TOKEN

AGAINST_CHECKS = ["against_cases", "against_failed", "against_garbage", "against_text", "against_acceptance",
                  "against_tokens_per_second"]
# The stand-in's speed depends on the machine's load: the self-comparison allows any tok/s drop.
GATE = f"[gate]\nmax_failed = 0\nagainst_tps_tolerance = {AGAINST_SELF_TPS_TOLERANCE}\n"
ONE_CASE = ("--thinking", "off", "--budget", "16", "--repeat", "1")


def known_good(tmp_path: Path, matrix: Path) -> Path:
    """A healthy stand-in's gate run, saved as the known-good report."""
    code, _, stdout = gate_run(tmp_path, matrix=matrix)
    assert code == 0, stdout
    saved = tmp_path / "known-good.json"
    (tmp_path / "run0.json").rename(saved)
    return saved


def junit_failures(path: Path) -> dict[str, list[str]]:
    """Per JUnit classname, the testcase names that failed."""
    failed: dict[str, list[str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        failed.setdefault(case.get("classname"), [])
        if case.find("failure") is not None:
            failed[case.get("classname")].append(case.get("name"))
    return failed


# ---------------------------------------------------------------------------------------------
# End to end


@pytest.mark.e2e
def test_a_run_passes_against_its_own_saved_report(tmp_path):
    matrix = write_matrix(tmp_path, GATE)
    saved = known_good(tmp_path, matrix)
    code, report, stdout = gate_run(tmp_path, matrix=matrix, args=("--against", str(saved)))
    assert code == 0, stdout
    names = [c.name for c in report.gate.checks]
    assert names[-len(AGAINST_CHECKS):] == AGAINST_CHECKS
    assert all(check(report, name).passed and not check(report, name).cases for name in AGAINST_CHECKS)
    assert check(report, "against_cases").detail.startswith(f"8 case(s) compared with {saved}")
    assert "8/8 T=0 answer(s) as in the known-good" in check(report, "against_text").detail
    # identical repeats: the acceptance tolerance is the floor, the tok/s one the matrix's
    assert "tol 5% (floor; spread 0%)" in check(report, "against_acceptance").detail
    assert "tol 100% ([gate])" in check(report, "against_tokens_per_second").detail
    assert "✓ against_text" in stdout


@pytest.mark.e2e
def test_lossy_server_fails_against_text_naming_every_case(tmp_path):
    matrix = write_matrix(tmp_path, GATE)
    saved = known_good(tmp_path, matrix)
    junit = tmp_path / "gate.xml"
    code, report, stdout = gate_run(tmp_path, ("--lossy",), matrix=matrix,
                                    args=("--against", str(saved), "--junit", str(junit)))
    assert code == 1, stdout
    text = check(report, "against_text")
    assert not text.passed and text.cases == [r.case_id for r in report.results] and len(text.cases) == 8
    assert "0/8 T=0 answer(s) as in the known-good" in text.detail
    assert "'Hello! It is ⟨nice to meet you.', now 'Hello! It is ⟨good to meet you.'" in text.detail
    assert check(report, "against_failed").passed and check(report, "against_garbage").passed
    failures = junit_failures(junit)
    assert set(AGAINST_CHECKS) <= {name.removeprefix("ddtree-diag.") for name in failures}
    assert sorted(failures["ddtree-diag.against_text"]) == sorted(text.cases)
    assert failures["ddtree-diag.against_failed"] == []
    assert "✗ against_text" in stdout and "gate: FAILED" in stdout


@pytest.mark.e2e
def test_low_acceptance_fails_against_acceptance_in_the_groups_that_fell(tmp_path):
    matrix = write_matrix(tmp_path, GATE)
    saved = known_good(tmp_path, matrix)
    junit = tmp_path / "gate.xml"
    code, report, _ = gate_run(tmp_path, ("--thinking-low-acceptance",), matrix=matrix,
                               args=("--against", str(saved), "--junit", str(junit)))
    assert code == 1
    acceptance = check(report, "against_acceptance")
    assert not acceptance.passed and len(acceptance.cases) == 4
    assert all("think=on" in c for c in acceptance.cases)
    assert "budget=16 think=on: 2.33 → 1.00" in acceptance.detail
    assert "budget=64 think=on: 2.33 → 1.00" in acceptance.detail
    assert acceptance.detail.startswith("fell beyond the tolerance in budget=16 think=on")
    assert "think=off:" not in acceptance.detail  # the groups that held are not listed as falling
    assert check(report, "against_text").passed  # the same text, decoded with fewer tokens a round
    assert sorted(junit_failures(junit)["ddtree-diag.against_acceptance"]) == sorted(acceptance.cases)


@pytest.mark.e2e
@pytest.mark.timing
def test_slow_server_fails_against_tokens_per_second(tmp_path):
    matrix = write_matrix(tmp_path, "[gate]\nmax_failed = 0\n")
    saved = known_good(tmp_path, matrix)
    # The known-good decoded at 10× what the slow stand-in can reach, on any machine.
    data = json.loads(saved.read_text())
    for result in data["results"]:
        result["timings"]["decode_tokens_per_second"] = AGAINST_FAST_TOKENS_PER_SECOND
    saved.write_text(json.dumps(data))
    code, report, _ = gate_run(tmp_path, ("--seconds-per-token", str(SLOW_SECONDS_PER_TOKEN)), matrix=matrix,
                               args=("--against", str(saved), *ONE_CASE))
    assert code == 1
    speed = check(report, "against_tokens_per_second")
    assert not speed.passed and speed.cases == ["hello/think=off/budget=16/T=0/max=32/r0"]
    assert "slower beyond the tolerance in budget=16 think=off: 250.0 →" in speed.detail
    assert "tol 15% (floor; spread 0%)" in speed.detail
    # the seven cases this run did not send are listed, and are no failure
    cases = check(report, "against_cases")
    assert cases.passed and "1 case(s) compared" in cases.detail and "7 only in the known-good" in cases.detail
    assert [c.name for c in report.gate.checks if not c.passed] == ["against_tokens_per_second"]


def _write_report(path: Path, report: RunReport) -> Path:
    path.write_text(report_json(report))
    return path


@pytest.mark.parametrize("kind, needle", [
    ("missing", "report not found"),
    ("directory", "is a directory"),
    ("not json", "not a ddtree-diag JSON report"),
    ("other json", "not a ddtree-diag JSON report"),
    ("other schema", "unsupported report schema_version 2"),
    ("other matrix", "none of this run's 8 case(s) is in the known-good run"),
])
def test_a_bad_against_file_is_exit_2_before_any_request(standin, cli, tmp_path, kind, needle):
    server = standin("--dialect", "ddtree")
    path = tmp_path / "known.json"
    if kind == "directory":
        path.mkdir()
    elif kind == "not json":
        path.write_text("<html>not json</html>")
    elif kind == "other json":
        path.write_text('{"regressed": false, "cases": []}')
    elif kind == "other schema":
        path.write_text(json.dumps({**json.loads(report_json(RunReport())), "schema_version": 2}))
    elif kind == "other matrix":
        _write_report(path, RunReport(results=[_result("elsewhere", 0, 2.0, 100.0)]))
    result = cli("gate", str(write_matrix(tmp_path, GATE)), "--url", server.url, "--against", str(path))
    assert result.code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--against" in lines[0] and needle in lines[0], result.stderr
    assert not [r for r in server.requests() if "messages" in r], "nothing is sent"


# ---------------------------------------------------------------------------------------------
# In process: tolerances and verdicts


def _result(prompt: str, repeat: int, acceptance: float | None, tps: float | None, *, thinking: bool = False,
            output: str = "Hello there.", status: str = "ok", garbage: bool = False,
            temperature: float = 0.0) -> ProbeResult:
    case = ProbeCase(prompt_id=prompt, messages=[], enable_thinking=thinking, tree_budget=16, repeat=repeat,
                     temperature=temperature)
    return ProbeResult(case=case, status=status, output=output if status == "ok" else "",
                       error=None if status == "ok" else "HTTP 500",
                       spec=SpecMetrics(mean_acceptance_length=acceptance),
                       timings=Timings(decode_tokens_per_second=tps),
                       quality=Verdict(garbage=garbage, score=0.9 if garbage else 0.0) if status == "ok" else None)


def _acceptance(r: ProbeResult) -> float | None:
    return r.spec.mean_acceptance_length


def test_tolerance_from_the_known_goods_repeat_spread():
    results = [
        _result("a", 0, 2.0, 100), _result("a", 1, 2.2, 100),  # think=off: spread 0.2 / 2.1
        _result("b", 0, 3.0, 100), _result("b", 1, 3.0, 100),  # think=off as well, no spread
        _result("c", 0, 2.0, 100, thinking=True),  # think=on: no repeat
        _result("d", 0, 1.0, 100, thinking=True, temperature=0.7),  # sampled: a group apart
        _result("d", 1, 3.0, 100, thinking=True, temperature=0.7),
    ]
    spread = against.repeat_spread(results, _acceptance)
    off, on, sampled = "budget=16 think=off", "budget=16 think=on", "budget=16 think=on T=0.7"
    assert spread[off] == pytest.approx(0.2 / 2.1)  # the noisiest case of the group
    assert on not in spread and spread[sampled] == pytest.approx(1.0)
    table = against.tolerances(results, _acceptance, None, floor=0.05, default=0.1)
    assert table[off].fraction == pytest.approx(3 * 0.2 / 2.1) and table[off].origin == "3× spread 10%"
    assert table[on] == against.Tolerance(0.1, "default: no repeats")
    assert table[sampled].fraction == against.SPREAD_CEILING  # noisy, but a fall to a fifth is no noise
    quiet = [_result("b", 0, 3.0, 100), _result("b", 1, 3.0, 100)]
    assert against.tolerances(quiet, _acceptance, None, floor=0.05, default=0.1)[off] == against.Tolerance(
        0.05, "floor; spread 0%")
    assert {t.origin for t in against.tolerances(results, _acceptance, 0.2, 0.05, 0.1).values()} == {"[gate]"}


def _against(report: RunReport, known: RunReport, gate: dict | None = None) -> dict:
    verdict = evaluate(report, parse_gate(gate or {}), against.KnownGood("known.json", known))
    return {c.name: c for c in verdict.checks if c.name.startswith("against_")}


def test_each_regression_fails_its_check_naming_the_case():
    known = RunReport(results=[_result("ok", 0, 3.0, 100), _result("boom", 0, 3.0, 100),
                               _result("junk", 0, 3.0, 100), _result("gone", 0, 3.0, 100)])
    now = RunReport(results=[_result("ok", 0, 3.0, 100), _result("boom", 0, None, None, status="http_error"),
                             _result("junk", 0, 3.0, 100, garbage=True), _result("new", 0, 3.0, 100)])
    checks = _against(now, known)
    assert checks["against_failed"].cases == ["boom/think=off/budget=16/T=0/max=48/r0"]
    assert "HTTP 500" in checks["against_failed"].detail
    assert checks["against_garbage"].cases == ["junk/think=off/budget=16/T=0/max=48/r0"]
    cases = checks["against_cases"]
    assert cases.passed and "1 only in the known-good (not run now): gone/" in cases.detail
    assert "1 new, not in the known-good: new/" in cases.detail
    assert checks["against_text"].passed and checks["against_acceptance"].passed
    assert "against_speedup" not in checks  # neither report carries speed-ups


def test_text_changes_fail_unless_switched_off_or_the_known_good_already_disagreed():
    known = RunReport(results=[_result("a", 0, 3.0, 100), _result("a", 1, 3.0, 100),
                               _result("b", 0, 3.0, 100, output="one"), _result("b", 1, 3.0, 100, output="two")])
    now = RunReport(results=[_result("a", 0, 3.0, 100, output="Hello here."), _result("a", 1, 3.0, 100),
                             _result("b", 0, 3.0, 100, output="three"), _result("b", 1, 3.0, 100, output="two")])
    text = _against(now, known)["against_text"]
    assert not text.passed and text.cases == ["a/think=off/budget=16/T=0/max=48/r0"]
    assert "2/4 T=0 answer(s) as in the known-good" in text.detail
    assert "1 more changed where the known-good's own repeats disagreed (not counted)" in text.detail
    lenient = _against(now, known, {"against_fail_on_text_change": False})["against_text"]
    assert lenient.passed and "not a failure (against_fail_on_text_change = false)" in lenient.detail


def test_acceptance_per_group_and_per_case():
    known = RunReport(results=[_result(p, 0, 3.0, 100) for p in "abcd"])
    # one case falls 27 %: the group mean only 7 % (within a 10 % tolerance), the case beyond 2×10 %
    now = RunReport(results=[_result("a", 0, 2.2, 100)] + [_result(p, 0, 3.0, 100) for p in "bcd"])
    acceptance = _against(now, known)["against_acceptance"]
    assert not acceptance.passed and acceptance.cases == ["a/think=off/budget=16/T=0/max=48/r0"]
    assert "1 case(s) fell by more than 2× their group's tolerance" in acceptance.detail
    assert "budget=16 think=off: 3.00 → 2.80 (-7%, tol 10% (default: no repeats))" in acceptance.detail
    assert _against(now, known, {"against_acceptance_tolerance": 0.2})["against_acceptance"].passed
    lost = RunReport(results=[_result(p, 0, None, 100) for p in "abcd"])
    assert not _against(lost, known)["against_acceptance"].passed


def test_speed_falls_per_group_by_its_source():
    known = RunReport(results=[_result("a", 0, 3.0, 100), _result("b", 0, 3.0, 100)])
    now = RunReport(results=[_result("a", 0, 3.0, 60), _result("b", 0, 3.0, 70)])
    speed = _against(now, known)["against_tokens_per_second"]
    assert not speed.passed and len(speed.cases) == 2 and "100.0 → 65.0 (-35%, tol 30%" in speed.detail
    assert _against(now, known, {"against_tps_tolerance": 0.4})["against_tokens_per_second"].passed
    server = _against(now, known, {"tokens_per_second_source": "server"})["against_tokens_per_second"]
    assert server.passed and "no case has a server-side tok/s" in server.detail


def test_speedup_per_concurrency_level_when_both_runs_swept_it():
    def level(concurrency: int, speedup: float | None) -> SimpleNamespace:  # the load sweep's levels
        return SimpleNamespace(concurrency=concurrency, speedup=speedup)

    known, now = RunReport(results=[_result("a", 0, 3.0, 100)]), RunReport(results=[_result("a", 0, 3.0, 100)])
    known.load = [level(1, 2.0), level(8, 1.5), level(16, 1.2)]
    now.load = [level(1, 2.0), level(8, 0.9), level(16, None)]
    assert against.speedups(now) == {"c=1": 2.0, "c=8": 0.9}
    speedup = _against(now, known)["against_speedup"]
    assert not speedup.passed and speedup.detail == "speed-up fell beyond 30% at c=8: 1.50× → 0.90×"
    assert _against(now, known, {"against_tps_tolerance": 0.5})["against_speedup"].passed


def test_notes_name_another_model_or_matrix():
    known = RunReport(results=[_result("a", 0, 3.0, 100)], target={"model": "old-model", "matrix": "gate.toml"})
    now = RunReport(results=[_result("a", 0, 3.0, 100)], target={"model": "new-model", "matrix": "gate.toml"})
    [note] = against.notes(now, against.KnownGood("known.json", known))
    assert note.startswith("--against known.json: the known-good ran model 'old-model', this run 'new-model'")


@pytest.mark.parametrize("table, needle", [
    ({"against_acceptance_tolerance": 1.5}, "gate.against_acceptance_tolerance must be a fraction from 0 to 1"),
    ({"against_tps_tolerance": "30%"}, "gate.against_tps_tolerance must be a fraction"),
    ({"against_fail_on_text_change": "yes"}, "gate.against_fail_on_text_change must be true or false"),
    ({"against_tolerance": 0.1}, "unknown key gate.'against_tolerance'"),
])
def test_bad_against_keys_are_named(table, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_gate(table, "m.toml")


def test_no_shared_case_is_refused_before_the_run():
    known = against.KnownGood("known.json", RunReport(results=[_result("a", 0, 3.0, 100)]))
    against.check_cases_match(known, ["x", "a/think=off/budget=16/T=0/max=48/r0"])
    with pytest.raises(UsageError, match="none of this run's 1 case"):
        against.check_cases_match(known, ["x"])
