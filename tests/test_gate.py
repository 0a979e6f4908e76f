"""`ddtree-diag gate` end to end: real CLI, real HTTP, STAND-IN server with real faults.

For every gate check: one run where the server really has the problem and the check fails,
and the healthy run where every check (all configured at once) passes.
"""

from __future__ import annotations

import json

import pytest

from ddtree_diag.checks.gate import GateConfig, evaluate, parse_gate
from ddtree_diag.errors import UsageError
from tests.support.gatekit import check, finding_ids, gate_run, write_matrix
from tests.support.processes import ROOT
from tests.support.timing import SLOW_MIN_TOKENS_PER_SECOND, SLOW_SECONDS_PER_TOKEN

CHECKS = ["max_failed", "max_garbage", "lossless", "min_completion_tokens", "min_mean_acceptance",
          "min_group_acceptance", "min_tokens_per_second", "max_ttft_s", "findings", "canary"]


@pytest.mark.e2e
def test_healthy_run_passes_every_check(tmp_path):
    code, report, stdout = gate_run(tmp_path)
    assert code == 0, stdout
    assert report.gate.passed is True
    assert sorted(c.name for c in report.gate.checks) == sorted(CHECKS)
    assert all(c.passed and not c.cases for c in report.gate.checks)
    assert report.findings == []
    assert all(r.baseline.verdict == "identical" for r in report.results)
    assert "gate: PASSED" in stdout


@pytest.mark.e2e
def test_shipped_gate_matrix_passes_a_healthy_server(tmp_path):
    code, report, stdout = gate_run(tmp_path, matrix="gate")
    assert code == 0, stdout
    assert len(report.results) == 40  # 5 prompts × thinking 2 × budgets 2 × repeat 2
    assert all(r.structured.passed for r in report.results if r.structured is not None)
    assert {r.case.max_tokens for r in report.results} == {64}
    assert report.target["matrix"] == "gate (built-in)"
    names = {c.name for c in report.gate.checks}
    assert {"lossless", "max_garbage", "max_failed", "findings"} <= names


@pytest.mark.e2e
def test_failed_requests_fail_max_failed(tmp_path):
    matrix = tmp_path / "fail.toml"
    matrix.write_text('[axes]\nenable_thinking = [false]\n[prompts.ok]\ntext = "Say hi."\n'
                      '[prompts.boom]\ntext = "FAIL:500"\n[gate]\nmax_failed = 0\n')
    code, report, _ = gate_run(tmp_path, matrix=matrix)
    assert code == 1
    failed = check(report, "max_failed")
    assert not failed.passed and failed.cases == ["boom/think=off/budget=default/T=0/max=48/r0"]
    assert "HTTP 500" in failed.detail


@pytest.mark.e2e
def test_garbage_fails_max_garbage(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--thinking-garbage",))
    assert code == 1
    garbage = check(report, "max_garbage")
    assert not garbage.passed
    assert garbage.cases and all("think=on" in c for c in garbage.cases)
    assert "4 garbage case(s), max 0" in garbage.detail


@pytest.mark.e2e
def test_lossy_server_fails_lossless(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--lossy",))
    assert code == 1
    lossless = check(report, "lossless")
    assert not lossless.passed and len(lossless.cases) == 8
    assert "0/8 T=0 case(s) match" in lossless.detail


@pytest.mark.e2e
def test_repeats_that_disagree_fail_lossless(tmp_path):
    # budget0 baseline agrees with one of the two alternating answers; repeats never agree.
    code, report, _ = gate_run(tmp_path, ("--flaky-text",))
    assert code == 1
    assert "repeat pair(s) disagree" in check(report, "lossless").detail


@pytest.mark.e2e
def test_early_stop_fails_min_completion_tokens(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--early-stop",))
    assert code == 1
    short = check(report, "min_completion_tokens")
    assert not short.passed and all("think=off" in c for c in short.cases)


@pytest.mark.e2e
def test_low_acceptance_fails_mean_and_group_checks(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--thinking-low-acceptance",))
    assert code == 1
    mean = check(report, "min_mean_acceptance")
    assert not mean.passed and "mean acceptance 1.67" in mean.detail
    group = check(report, "min_group_acceptance")
    assert not group.passed
    assert "budget=16 think=on" in group.detail and "budget=64 think=on" in group.detail
    assert all("think=on" in c for c in group.cases) and len(group.cases) == 4


ONE_CASE = ("--thinking", "off", "--budget", "16", "--repeat", "1")  # a slow server's check needs no more


@pytest.mark.e2e
@pytest.mark.timing
def test_slow_server_fails_min_tokens_per_second(tmp_path):
    matrix = write_matrix(tmp_path, f"[gate]\nmin_tokens_per_second = {SLOW_MIN_TOKENS_PER_SECOND}\n")
    code, report, _ = gate_run(tmp_path, ("--seconds-per-token", str(SLOW_SECONDS_PER_TOKEN)), matrix=matrix,
                               args=ONE_CASE)
    assert code == 1
    speed = check(report, "min_tokens_per_second")
    assert not speed.passed and "mean client tok/s" in speed.detail
    assert all(r.timings.decode_tokens_per_second < SLOW_MIN_TOKENS_PER_SECOND for r in report.results)


@pytest.mark.e2e
@pytest.mark.timing
def test_slow_first_token_fails_max_ttft(tmp_path):
    matrix = write_matrix(tmp_path, "[gate]\nmax_ttft_s = 0.3\n")
    code, report, _ = gate_run(tmp_path, ("--first-token-delay", "0.6"), matrix=matrix, args=ONE_CASE)
    assert code == 1
    ttft = check(report, "max_ttft_s")
    assert not ttft.passed and "slowest time to first token" in ttft.detail
    assert set(ttft.cases) == {r.case_id for r in report.results if r.ok}
    assert all(r.timings.ttft_s >= 0.6 for r in report.results if r.ok)


def test_max_ttft_needs_a_streamed_case():
    from ddtree_diag.records import ProbeCase, ProbeResult, RunReport

    report = RunReport(results=[ProbeResult(case=ProbeCase(prompt_id="p", messages=[]), status="ok", output="hi")])
    [result] = evaluate(report, parse_gate({"max_ttft_s": 1.0})).checks
    assert not result.passed and "--stream" in result.detail


@pytest.mark.e2e
def test_server_side_speed_source(tmp_path):
    matrix = write_matrix(tmp_path, '[gate]\nmin_tokens_per_second = 1000\ntokens_per_second_source = "server"\n')
    code, report, _ = gate_run(tmp_path, matrix=matrix)
    assert code == 1
    assert "mean server tok/s" in check(report, "min_tokens_per_second").detail


@pytest.mark.e2e
def test_error_finding_fails_findings_check(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--loop",))
    assert code == 1
    assert "garbage-high-acceptance" in finding_ids(report)
    findings = check(report, "findings")
    assert not findings.passed and "Garbage with high acceptance" in findings.detail


@pytest.mark.e2e
def test_warning_finding_fails_only_at_warning_level(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--inverse-budget",))
    assert code == 1 and not check(report, "findings").passed
    lenient = write_matrix(tmp_path, '[gate]\nfail_on_findings = "error"\n', name="lenient.toml")
    code, report, _ = gate_run(tmp_path, ("--inverse-budget",), matrix=lenient)
    assert code == 0 and "acceptance-not-rising-with-budget" in finding_ids(report)


@pytest.mark.e2e
def test_near_tie_passes_lossless_unless_the_gap_is_tightened(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--lossy", "--tie-gap", "0.01"))
    assert code == 0
    assert all(r.baseline.verdict == "near_tie" for r in report.results)
    assert all(r.baseline.logprob_gap == pytest.approx(0.01) for r in report.results)
    assert check(report, "lossless").passed and "8 near-tie(s) allowed" in check(report, "lossless").detail
    assert [(f.id, f.severity) for f in report.findings] == [("lossless-near-tie", "info")]
    code, report, _ = gate_run(tmp_path, ("--lossy", "--tie-gap", "0.01"), args=("--near-tie-gap", "0.001"))
    assert all(r.baseline.verdict == "mismatch" for r in report.results)
    assert code == 1 and not check(report, "lossless").passed


def test_url_baseline_against_a_second_server(tmp_path, standin):
    plain = standin("--dialect", "openai")
    matrix = write_matrix(tmp_path, f'[gate]\nlossless = true\n[baseline]\nmode = "url"\nurl = "{plain.url}"\n')
    code, report, _ = gate_run(tmp_path, matrix=matrix)
    assert code == 0 and all(r.baseline.verdict == "identical" for r in report.results)
    assert all(r.baseline.mode == "url" for r in report.results)
    code, report, _ = gate_run(tmp_path, ("--lossy",), matrix=matrix, dialect="vllm")
    assert code == 1 and all(r.baseline.verdict == "mismatch" for r in report.results)
    # the baseline server got no tree budget and was asked for logprobs
    sent = [r for r in plain.requests() if r.get("max_tokens") == 32]
    assert sent and all("tree_budget" not in r and r.get("logprobs") is True for r in sent)


@pytest.mark.engine
@pytest.mark.real_model
def test_baseline_server_that_refuses_logprobs(tmp_path, standin):
    strict = standin("--dialect", "openai", "--strict")  # 400 on any field beyond the OpenAI core
    matrix = write_matrix(tmp_path, f'[gate]\nlossless = true\n[baseline]\nmode = "url"\nurl = "{strict.url}"\n')
    code, report, _ = gate_run(tmp_path, matrix=matrix)
    assert code == 0, report.notes
    assert all(r.baseline.verdict == "identical" for r in report.results)
    assert any("refused logprobs" in n for n in report.notes)


@pytest.mark.engine
@pytest.mark.real_model
def test_engine_baseline_compares_with_the_target_alone(standin, cli, tmp_path):
    pytest.importorskip("torch")
    from tests.support import engine_fixtures as fx

    target = fx.make_target(tmp_path / "target")  # a tiny random model: loads in a moment
    server = standin("--dialect", "ddtree")  # says a canned sentence the random model will not say
    result = cli("probe", "--url", server.url, "--thinking", "off", "--budget", "16", "--max-tokens", "8",
                 "--baseline", "engine", "--target", str(target), "--device", "cpu", "--dtype", "fp32",
                 "--json", "-", timeout=600)
    report = json.loads(result.stdout)
    baseline = report["results"][0]["baseline"]
    assert baseline["mode"] == "engine" and baseline["baseline_output"].strip()
    assert baseline["verdict"] == "mismatch" and result.code == 1


@pytest.mark.parametrize(
    "table, needle",
    [("[gate]\nmin_acceptance = 2\n", "gate.'min_acceptance'"),
     ("[gate]\nmax_garbage = -1\n", "gate.max_garbage"),
     ("[gate]\nlossless = true\n", "needs a baseline"),
     ('[gate]\nfail_on_findings = "fatal"\n', "gate.fail_on_findings"),
     ('[baseline]\nmode = "budget1"\n', "expected budget0"),
     ('[baseline]\nmode = "budget0"\nurl = "http://x"\n', "only used with mode"),
     ('[baseline]\nmodes = "budget0"\n', "baseline: unknown key 'modes'")],
)
def test_bad_gate_config_is_exit_2_naming_the_key(cli, tmp_path, table, needle):
    matrix = write_matrix(tmp_path, table)
    result = cli("gate", str(matrix), "--url", "http://127.0.0.1:1")
    assert result.code == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_budget0_baseline_refused_for_a_server_without_budget(standin, cli, tmp_path):
    server = standin("--dialect", "vllm")
    result = cli("probe", "--url", server.url, "--baseline", "budget0", "--thinking", "off")
    assert result.code == 2 and "needs a server that takes a per-request tree budget" in result.stderr
    assert not [r for r in server.requests() if r.get("max_tokens") == 48], "refused before the run"


def test_bad_baseline_flag_is_exit_2(cli):
    result = cli("probe", "--url", "http://127.0.0.1:1", "--baseline", "nope")
    assert result.code == 2 and "expected budget0, url:URL or engine" in result.stderr


def test_probe_baseline_flag(standin, cli, tmp_path):
    server = standin("--dialect", "ddtree", "--lossy")
    result = cli("probe", "--url", server.url, "--baseline", "budget0", "--json", "-")
    assert result.code == 1
    report = json.loads(result.stdout)
    assert report["gate"] is None
    first = report["results"][0]["baseline"]
    assert first["verdict"] == "mismatch" and first["char_index"] == 13 and first["token_index"] == 3
    assert first["expected"].endswith("⟨nice to meet you.") and first["actual"].endswith("⟨good to meet you.")
    assert [t["token"] for t in first["top_logprobs"]] == ["nice ", "good "]
    assert "lossless" in result.stderr and "✗ mismatch @13" in result.stderr
    assert report["results"][0]["findings"] == ["lossless-mismatch"]
    baseline_requests = [r for r in server.requests() if r.get("tree_budget") == 0]
    assert len(baseline_requests) == 2  # one per thinking mode: repeats would share it


def test_gate_config_unit():
    config = parse_gate({"min_mean_acceptance": 2, "tokens_per_second_source": "server"})
    assert config.min_mean_acceptance == 2.0 and config.tokens_per_second_source == "server"
    with pytest.raises(UsageError, match="tokens_per_second_source"):
        parse_gate({"tokens_per_second_source": "both"})
    from ddtree_diag.records import RunReport

    verdict = evaluate(RunReport(), GateConfig())
    assert verdict.passed is False and verdict.checks[0].name == "ran_cases"


def test_readme_documents_every_gate_key():
    readme = (ROOT / "README.md").read_text()
    for key in ("min_mean_acceptance", "min_group_acceptance", "min_tokens_per_second",
                "tokens_per_second_source", "max_garbage", "max_failed", "min_completion_tokens",
                "lossless", "allow_near_ties", "fail_on_findings", "canary"):
        assert key in readme, key


def test_engine_baseline_for_a_remote_model_needs_its_target(standin, cli):
    """The embedded model is only the baseline of a server that runs it; anything else must be named."""
    server = standin("--dialect", "ddtree")
    result = cli("probe", "--url", server.url, "--baseline", "engine", "--thinking", "off", "--budget", "16")
    assert result.code == 2
    assert "--baseline engine needs the server's target model" in result.stderr


@pytest.mark.e2e
def test_canary_resends_the_first_case_and_catches_state_carried_over(tmp_path):
    code, report, _ = gate_run(tmp_path, ("--acceptance-decay",))
    assert code == 1
    canary = check(report, "canary")
    assert not canary.passed and "acceptance fell" in canary.detail
    assert report.canary.case_id == report.results[0].case_id and report.canary.seq == len(report.results)
    assert "canary-differs" in finding_ids(report)
    off = write_matrix(tmp_path, "[gate]\nmax_failed = 0\ncanary = false\n", name="nocanary.toml")
    code, report, _ = gate_run(tmp_path, ("--acceptance-decay",), matrix=off)
    assert report.canary is None and "canary" not in {c.name for c in report.gate.checks}
    assert [r.seq for r in report.results] == list(range(len(report.results)))


@pytest.mark.e2e
def test_critical_findings_fail_a_gate_that_does_not_ask_for_findings(tmp_path):
    lenient = write_matrix(tmp_path, "[gate]\nmax_failed = 0\n", name="lenient.toml")
    code, report, _ = gate_run(tmp_path, ("--rounds-mismatch",), matrix=lenient)
    assert code == 1
    critical = check(report, "critical_findings")
    assert not critical.passed and "contradict" in critical.detail


def test_score_with_target_needs_the_target(standin, cli):
    server = standin("--dialect", "ddtree")
    result = cli("probe", "--url", server.url, "--score-with", "target", "--thinking", "off")
    assert result.code == 2 and "--score-with target needs" in result.stderr


def test_critical_findings_check_unless_findings_are_switched_off():
    from ddtree_diag.records import Finding, RunReport

    report = RunReport(findings=[Finding("metrics-contradict", "error", "numbers contradict", "e", "c", ["x"])])
    unset = evaluate(report, parse_gate({"max_failed": 0}))
    assert [c.name for c in unset.checks if not c.passed] == ["ran_cases", "critical_findings"]
    off = evaluate(report, parse_gate({"max_failed": 0, "fail_on_findings": "none"}))
    assert [c.name for c in off.checks if not c.passed] == ["ran_cases"]
    warning_only = RunReport(findings=[Finding("rounds-accounting", "warning", "drift", "e", "c", ["x"])])
    assert "critical_findings" not in {c.name for c in evaluate(warning_only, parse_gate({})).checks}


def test_the_gate_keys_are_the_checks_keys():
    """parse_gate knows exactly the keys the checks read, and each is a GateConfig field."""
    import dataclasses

    from ddtree_diag.checks import gate

    assert set(gate.KEYS) == {f.name for f in dataclasses.fields(GateConfig)}
    assert len(gate.KEYS) == sum(len(c.keys) for c in gate.CHECKS)  # no key read by two checks
    with pytest.raises(UsageError, match="known: " + ", ".join(sorted(gate.KEYS))):
        parse_gate({"min_acceptance": 2})
    described = gate.describe_config(gate.default_config(lossless=True))
    assert described == "max_garbage = 0, max_failed = 0, lossless = true"


def test_every_gate_key_is_in_the_readme_and_docstring_samples():
    """The [gate] samples are written by hand; every key the gate knows must appear in both."""
    from ddtree_diag.checks import gate as gate_module

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sample = readme[readme.index("## CI gate") :]
    start = sample.index("\n[gate]\n")
    sample = sample[start : sample.index("```", start)]
    for key in gate_module.KEYS:
        assert f"\n{key} =" in sample, f"README's [gate] sample lacks {key}"
        assert f"    {key} =" in gate_module.__doc__, f"gate.py's docstring lacks {key}"
