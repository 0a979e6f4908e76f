"""The load sweep: speculation against the baseline at each concurrency level.

End to end against the STAND-IN (its requests sleep per token: speculation ~3× faster than budget 0;
``--slow-spec-under-load 2`` makes speculation 9× slower than budget 0 once more than two requests
are in flight; ``--no-drafts`` drafts nothing). The planted differences are ~3× either way, and
every clock bound comes from tests/support/timing.py. Plus the pure parts: percentiles, ITL, the
flag, the plan, the findings and gate keys on hand-made levels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_diag import load
from ddtree_diag.checks import gate, speedup
from ddtree_diag.errors import UsageError
from ddtree_diag.records import LoadLevel, LoadSide, ProbeCase, ProbeResult, RunReport, Timings
from tests.support.processes import Server
from tests.support.timing import HEALTHY_MAX_ITL_P99_MS, LOAD_SECONDS_PER_TOKEN, SLOW_MAX_ITL_P99_MS

ONE_CASE = ("--thinking", "off", "--budget", "16", "--dialect", "ddtree")
OURS = {"speculation-slower-than-baseline", "speculation-inactive"}


def sweep(standin, cli, tmp_path: Path, *flags: str, args: tuple[str, ...] = ()) -> tuple[RunReport, str, Server]:
    """A probe of one case plus the sweep at 1,4 against a stand-in with ``flags``."""
    server = standin("--dialect", "ddtree", "--seconds-per-token", str(LOAD_SECONDS_PER_TOKEN), *flags)
    out = tmp_path / "run.json"
    result = cli("probe", "--url", server.url, *ONE_CASE, "--concurrency", "1,4", "--baseline", "budget0",
                 "--json", str(out), *args)
    assert result.code == 0, result.stdout + result.stderr
    return RunReport.from_dict(json.loads(out.read_text())), result.stdout, server


def ids(report: RunReport) -> set[str]:
    return {f.id for f in report.findings}


@pytest.mark.timing
def test_sweep_fills_the_load_levels_and_a_healthy_standin_is_quiet(standin, cli, tmp_path):
    summary, page = tmp_path / "s.md", tmp_path / "r.html"
    report, stdout, server = sweep(standin, cli, tmp_path, args=("--summary", str(summary), "--html", str(page)))
    assert [lv.concurrency for lv in report.load] == [1, 4]
    assert len(report.results) == 1  # the sweep's requests are not rows of the results
    for level in report.load:
        count = max(2 * level.concurrency, 1)
        for side in (level.speculative, level.baseline):
            assert (side.requests, side.failures) == (count, 0)
            assert side.completion_tokens == 7 * count and side.tokens_per_second > 0 and side.wall_s > 0
            for table in (side.ttft_s, side.itl_ms, side.e2e_s):
                assert all(table[p] is not None for p in ("p50", "p90", "p99")), table
                assert table["p50"] <= table["p90"] <= table["p99"]
        assert level.speculative.mean_acceptance > 2 and level.baseline.mean_acceptance == 1.0
        assert level.speedup == pytest.approx(level.speculative.tokens_per_second / level.baseline.tokens_per_second,
                                              rel=1e-3)
        assert level.speedup >= 1.0 and level.baseline_source == "same server, tree_budget=0"
    assert not ids(report) & OURS
    sent = server.requests()
    # main case + lossless baseline + 2+8 requests per side
    assert len([r for r in sent if r.get("tree_budget") == 16]) == 1 + 10
    assert len([r for r in sent if r.get("tree_budget") == 0]) == 1 + 10
    assert "speed-up under load" in stdout and "load sweep: concurrency 1, 4" in stdout
    assert "Speed-up under load" in summary.read_text() and 'id="load"' in page.read_text()
    assert RunReport.from_dict(report.to_dict()).load == report.load


@pytest.mark.timing
def test_speculation_slower_under_load_fires_at_the_high_level_only(standin, cli, tmp_path):
    report, stdout, _ = sweep(standin, cli, tmp_path, "--slow-spec-under-load", "2")
    one, four = report.load
    assert one.speedup >= 1.0 and four.speedup < speedup.SLOWER_RATIO
    found = next(f for f in report.findings if f.id == "speculation-slower-than-baseline")
    assert found.severity == "error" and found.title.endswith("at concurrency 4")
    assert found.evidence.startswith("concurrency 4: ") and "it pays at concurrency 1" in found.evidence
    assert "speculation-inactive" not in ids(report)
    assert found.title in stdout


@pytest.mark.timing
def test_no_drafts_fires_speculation_inactive(standin, cli, tmp_path):
    report, _, _ = sweep(standin, cli, tmp_path, "--no-drafts")
    found = next(f for f in report.findings if f.id == "speculation-inactive")
    assert found.severity == "error" and "0 drafted tokens" in found.evidence
    assert all(lv.speculative.draft_tokens == 0 and lv.speculative.mean_acceptance == 1.0 for lv in report.load)
    assert "speculation-slower-than-baseline" not in ids(report)


@pytest.mark.timing
def test_without_a_baseline_the_speedup_is_unknown(standin, cli, tmp_path):
    server = standin("--dialect", "ddtree", "--seconds-per-token", str(LOAD_SECONDS_PER_TOKEN))
    result = cli("probe", "--url", server.url, *ONE_CASE, "--concurrency", "1,2", "--load-requests", "2",
                 "--json", "-")
    report = RunReport.from_dict(json.loads(result.stdout))
    assert [lv.concurrency for lv in report.load] == [1, 2]
    assert all(lv.baseline is None and lv.speedup is None and "no baseline" in lv.note for lv in report.load)
    assert all(lv.speculative.requests == 2 for lv in report.load)
    assert any("speed-up unknown" in n or "no baseline" in n for n in report.notes)
    assert not ids(report) & OURS


# --- the gate ---------------------------------------------------------------------------------

GATED = """
[axes]
enable_thinking = [false]
tree_budget = [16]
concurrency = [1, 4]

[prompts.hello]
text = "Say hello in one short sentence."

[baseline]
mode = "budget0"

[gate]
max_failed = 0
{gate}
"""


def gate_sweep(standin, cli, tmp_path: Path, table: str, *flags: str) -> tuple[int, RunReport]:
    server = standin("--dialect", "ddtree", "--seconds-per-token", str(LOAD_SECONDS_PER_TOKEN), *flags)
    matrix = tmp_path / "m.toml"
    matrix.write_text(GATED.format(gate=table))
    out = tmp_path / "gate.json"
    result = cli("gate", str(matrix), "--url", server.url, "--dialect", "ddtree", "--json", str(out))
    assert out.exists(), result.stderr
    return result.code, RunReport.from_dict(json.loads(out.read_text()))


def check_named(report: RunReport, name: str):
    return next(c for c in report.gate.checks if c.name == name)


@pytest.mark.timing
def test_gate_min_speedup_and_max_itl_pass_on_a_healthy_standin(standin, cli, tmp_path):
    code, report = gate_sweep(standin, cli, tmp_path, f"min_speedup = 1.0\nmax_itl_p99_ms = {HEALTHY_MAX_ITL_P99_MS}")
    assert code == 0, [c.detail for c in report.gate.checks]
    assert check_named(report, "min_speedup").passed and check_named(report, "max_itl_p99_ms").passed


@pytest.mark.timing
def test_gate_min_speedup_and_max_itl_fail_where_speculation_is_slow(standin, cli, tmp_path):
    code, report = gate_sweep(standin, cli, tmp_path,
                              f"min_speedup = {{ 1 = 1.0, 4 = 1.0 }}\nmax_itl_p99_ms = {SLOW_MAX_ITL_P99_MS}",
                              "--slow-spec-under-load", "2")
    assert code == 1
    low = check_named(report, "min_speedup")
    assert not low.passed and low.detail.startswith("concurrency 4: ") and "concurrency 1:" not in low.detail
    itl = check_named(report, "max_itl_p99_ms")
    assert not itl.passed and itl.detail.startswith("concurrency 4: ") and "concurrency 1:" not in itl.detail
    # the same run judged with a ratio for level 1 only passes: the table names its levels
    again = gate.evaluate(report, gate.parse_gate({"min_speedup": {"1": 1.0}}))
    assert next(c for c in again.checks if c.name == "min_speedup").passed


BAD_GATES = [
    ('min_speedup = "fast"', "gate.min_speedup must be a number >= 0, or a table"),
    ("min_speedup = { 8 = 1.0 }", "gate.min_speedup names concurrency 8, which the sweep does not run"),
    ("min_speedup = { x = 1.0 }", "'x' is not a concurrency level"),
    ("min_speedup = {}", "got an empty table"),
    ("max_itl_p99_ms = -1", "gate.max_itl_p99_ms must be a number of milliseconds > 0"),
]


@pytest.mark.parametrize("table, needle", BAD_GATES)
def test_bad_gate_values_are_exit_2_in_one_line(cli, tmp_path, table, needle):
    matrix = tmp_path / "m.toml"
    matrix.write_text(GATED.format(gate=table))
    result = cli("gate", str(matrix), "--url", "http://127.0.0.1:1")
    assert result.code == 2 and needle in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, needle", [
    (("--concurrency", "1,x"), "--concurrency: expected an integer or a list such as 1,4,16, got 'x'"),
    (("--concurrency", "0,4"), "--concurrency: expected concurrency levels 1-1024, got 0"),
    (("--concurrency", "1,4", "--load-seconds", "0"), "--load-seconds must be a number of seconds > 0"),
    (("--load-requests", "5",), "--load-requests needs the load sweep"),
])
def test_bad_flags_are_exit_2_in_one_line(cli, args, needle):
    result = cli("probe", "--url", "http://127.0.0.1:1", *args)
    assert result.code == 2 and needle in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --- the plan, without a server ---------------------------------------------------------------


def prepared(matrix_text: str, tmp_path: Path, **plan: object):
    from ddtree_diag.backends import HttpTarget
    from ddtree_diag.matrix import MatrixRequest
    from ddtree_diag.orchestrator import RunPlan, prepare

    path = tmp_path / "m.toml"
    path.write_text(matrix_text)
    return prepare(RunPlan(target=HttpTarget(url="http://127.0.0.1:1"), matrix=MatrixRequest(matrix=str(path)),
                           **plan))


MATRIX = '[axes]\nconcurrency = [4, 1]\n[prompts.p]\ntext = "Hi"\n'


@pytest.mark.unit
def test_the_plan_reads_the_axis_the_load_table_and_the_flags(tmp_path):
    run = prepared(MATRIX + "[load]\nseconds = 5\nrequests = 3\n", tmp_path)
    assert (run.load.levels, run.load.seconds, run.load.requests) == ([1, 4], 5.0, 3)
    assert len(run.cases) == 2  # thinking off/on: concurrency is no axis of the cases
    flags = load.LoadRequest(levels=[2, 8], seconds=1.5)
    run = prepared(MATRIX + "[load]\nseconds = 5\n", tmp_path, load=flags)
    assert (run.load.levels, run.load.seconds, run.load.requests) == ([2, 8], 1.5, None)
    assert run.load.request_count(8, 2) == 16 and run.load.request_count(1, 5) == 5
    assert prepared('[prompts.p]\ntext = "Hi"\n', tmp_path).load is None


@pytest.mark.unit
@pytest.mark.parametrize("extra, plan, needle", [
    ("[load]\nsecs = 3\n", {}, "unknown key load.'secs'"),
    ("[load]\nrequests = 0\n", {}, "load.requests must be an integer >= 1"),
    ("[gate]\nmin_speedup = 1.0\n", {"gate": True}, "needs a baseline on the server's hardware"),
    ('[baseline]\nmode = "engine"\n[gate]\nmin_speedup = 1.0\n', {"gate": True}, "needs a baseline on the server"),
])
def test_bad_plans_are_refused_before_the_run(tmp_path, extra, plan, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        prepared(MATRIX + extra, tmp_path, **plan)


@pytest.mark.unit
def test_gate_sweep_keys_need_a_sweep(tmp_path):
    with pytest.raises(UsageError, match=r"gate\.max_itl_p99_ms needs the load sweep"):
        prepared('[prompts.p]\ntext = "Hi"\n[gate]\nmax_itl_p99_ms = 20\n', tmp_path, gate=True)
    with pytest.raises(UsageError, match=r"axes\.concurrency: expected an integer >= 1, got 0"):
        prepared('[axes]\nconcurrency = [0]\n[prompts.p]\ntext = "Hi"\n', tmp_path)
    with pytest.raises(UsageError, match=r"axes\.concurrency: expected concurrency levels 1-1024, got 5000"):
        prepared('[axes]\nconcurrency = [1, 5000]\n[prompts.p]\ntext = "Hi"\n', tmp_path)


@pytest.mark.unit
def test_concurrency_flag_one_value_or_a_sweep():
    assert load.parse_concurrency_flag("4") == (4, None)  # as before: the main run's parallel requests
    assert load.parse_concurrency_flag("4,") == (4, None)
    assert load.parse_concurrency_flag("16,4,1,4") == (1, [1, 4, 16])
    with pytest.raises(UsageError, match="--concurrency must be >= 1"):
        load.parse_concurrency_flag("0")


# --- statistics -------------------------------------------------------------------------------


@pytest.mark.unit
def test_percentiles_interpolate_between_ranks():
    assert load.percentile([], 50) is None
    assert load.percentile([7.0], 99) == 7.0
    assert load.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert load.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert load.percentile(list(range(1, 101)), 90) == pytest.approx(90.1)
    assert load.percentile([1.0, 2.0], 0) == 1.0 and load.percentile([1.0, 2.0], 100) == 2.0
    assert load.percentiles([0.010, 0.020], scale=1000) == {"p50": 15.0, "p90": 19.0, "p99": 19.9}
    assert load.percentiles([]) == {"p50": None, "p90": None, "p99": None}


def result(tokens: int, e2e: float, ttft: float | None, chunks: list | None = None, ok: bool = True) -> ProbeResult:
    r = ProbeResult(case=ProbeCase("p", []), completion_tokens=tokens, timings=Timings(e2e_s=e2e, ttft_s=ttft))
    if chunks is not None:
        r.extras["stream_chunks"] = chunks
    if not ok:
        r.status, r.error = "http_error", "HTTP 503: busy"
    return r


@pytest.mark.unit
def test_itl_is_the_gap_per_token():
    # over HTTP a chunk's tokens are unknown: 6 tokens in 3 chunks count 2 each
    http = result(6, 1.0, 0.1, [[0.1, None], [0.3, None], [0.7, None]])
    assert load.itl_samples(http) == pytest.approx([0.1, 0.2])
    # the engine says what each round committed
    engine = result(6, 1.0, 0.1, [[0.1, 1], [0.4, 3], [0.6, 2]])
    assert load.itl_samples(engine) == pytest.approx([0.1, 0.1])
    assert load.itl_samples(result(6, 1.0, 0.1, [[0.1, None]])) == [] and load.itl_samples(result(6, 1.0, None)) == []


@pytest.mark.unit
def test_a_side_is_summarised_from_its_requests():
    side = load.summarise([result(10, 1.0, 0.2), result(20, 2.0, 0.4), result(0, 0.1, None, ok=False)], wall_s=2.5)
    assert (side.requests, side.failures, side.completion_tokens) == (3, 1, 30)
    assert side.tokens_per_second == 12.0 and side.request_tokens_per_second_p50 == 10.0
    assert side.ttft_s["p50"] == pytest.approx(0.3) and side.itl_ms["p50"] is None
    assert side.errors == ["HTTP 503: busy"] and side.mean_acceptance is None
    assert load.speedup(side, LoadSide(tokens_per_second=4.0)) == 3.0 and load.speedup(side, None) is None


# --- findings and gate checks on hand-made levels ---------------------------------------------


def level(n: int, spec_tps: float, base_tps: float | None, accept: float | None = 2.5, drafted: int | None = None,
          itl_p99: float | None = 12.0) -> LoadLevel:
    spec = LoadSide(requests=8, tokens_per_second=spec_tps, mean_acceptance=accept, draft_tokens=drafted,
                    itl_ms={"p50": 10.0, "p90": 11.0, "p99": itl_p99})
    base = None if base_tps is None else LoadSide(requests=8, tokens_per_second=base_tps, mean_acceptance=1.0)
    return LoadLevel(n, spec, base, load.speedup(spec, base))


@pytest.mark.unit
def test_findings_keep_quiet_within_their_margins():
    quiet = RunReport(load=[level(1, 300, 100), level(16, 96, 100)])  # 0.96×: noise
    assert speedup.slower_than_baseline(quiet) == [] and speedup.speculation_inactive(quiet) == []
    low_acceptance = RunReport(load=[level(4, 50, 100, accept=1.3)])  # a weak draft, not this finding
    assert speedup.slower_than_baseline(low_acceptance) == []
    assert speedup.slower_than_baseline(RunReport(load=[level(4, 50, 100, accept=None)]))  # unreported: fires
    assert speedup.speculation_inactive(RunReport(load=[level(1, 100, None)])) == []  # no baseline: nothing to say


@pytest.mark.unit
def test_speculation_inactive_by_acceptance_and_by_speed():
    by_rounds = speedup.speculation_inactive(RunReport(load=[level(1, 100, 100, accept=1.0), level(4, 98, 100, 1.02)]))
    assert [f.severity for f in by_rounds] == ["error"] and "every round commits one token" in by_rounds[0].title
    by_speed = speedup.speculation_inactive(RunReport(load=[level(1, 102, 100, accept=None),
                                                            level(4, 99, 100, accept=None)]))
    assert [f.severity for f in by_speed] == ["warning"] and "1: 1.02×" in by_speed[0].evidence
    faster = RunReport(load=[level(1, 130, 100, accept=None), level(4, 99, 100, accept=None)])
    assert speedup.speculation_inactive(faster) == []


@pytest.mark.unit
def test_gate_checks_on_levels():
    report = RunReport(load=[level(1, 300, 100), level(4, 80, 100, itl_p99=None)])
    config = gate.parse_gate({"min_speedup": 1.0, "max_itl_p99_ms": 50})
    checks = {c.name: c for c in gate.evaluate(report, config).checks}
    assert not checks["min_speedup"].passed and "concurrency 4: 0.80× < 1" in checks["min_speedup"].detail
    assert not checks["max_itl_p99_ms"].passed and "ITL unknown at concurrency 4" in checks["max_itl_p99_ms"].detail
    assert gate.parse_gate({"min_speedup": {"1": 2, 4: 0.5}}).min_speedup == {1: 2.0, 4: 0.5}
    passed = gate.evaluate(report, gate.parse_gate({"min_speedup": {"1": 2.0, "4": 0.5}}))
    assert next(c for c in passed.checks if c.name == "min_speedup").passed


@pytest.mark.unit
def test_queueing_is_told_from_waiting_not_from_slowing():
    def measured(n: int, ttft: float, e2e: float) -> LoadLevel:
        return LoadLevel(n, LoadSide(requests=n, ttft_s={"p50": ttft}, e2e_s={"p50": e2e}))

    alone = measured(1, 0.05, 1.0)
    assert load.queueing([alone, measured(4, 0.06, 1.01)]) is None  # no waiting
    assert load.queueing([alone, measured(4, 3.0, 3.95)]) is not None  # waited 3 s, decoded in ~1 s
    assert load.queueing([alone, measured(4, 3.0, 12.0)]) is None  # everything slower: not a queue


@pytest.mark.unit
def test_single_worker_from_health():
    class Response:
        status_code = 200

    class Backend:
        transport_kind = "http"
        base_url = "http://x"

        def __init__(self, health: dict) -> None:
            self.health = health

        def _get(self, url: str):
            return Response(), json.dumps(self.health).encode()

    assert "one engine worker" in load.single_worker(Backend({"status": "ok", "workers": 1}))
    assert load.single_worker(Backend({"status": "ok"})) is None


@pytest.mark.unit
def test_old_reports_without_load_still_load():
    data = RunReport().to_dict()
    del data["load"]
    assert RunReport.from_dict(data).load == []
    data["load"] = [{"concurrency": 2, "speculative": {"requests": 3, "ttft_s": {"p50": 0.1, "p42": 1}}},
                    {"concurrency": "x"}, "junk"]
    (only,) = RunReport.from_dict(data).load
    assert only.speculative.requests == 3 and only.speculative.ttft_s == {"p50": 0.1} and only.baseline is None

