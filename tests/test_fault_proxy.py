"""The gate against planted server faults: a real fault proxy (tests/support/fault_proxy.py) in front of
the project's own `serve` on the embedded SmolLM2 + its draft (real text, real acceptance), one
proxy per fault. Every fault must fail the gate AND be named by a finding or a failing check;
the healthy pass-through must pass. The workload suite does the same on WORKLOAD_MATRIX (a JSON
schema, a required tool call, a thinking-on prompt, a long-context pair, a prefix-cache pair) for
the workload faults; its gate fails on warnings, so the warning-level findings fail it too.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")

from tests.support.fault_proxy import (
    EXPECTED,
    GATE_FAULTS,
    WORKLOAD_FAULTS,
    named,
    run_fault,
    start_serve,
    workload_findings,
)
from tests.support.processes import stop_serve

pytestmark = [pytest.mark.real_model, pytest.mark.engine]


@pytest.fixture(scope="module")
def upstream():
    try:
        process, url = start_serve()
    except RuntimeError as exc:
        pytest.skip(f"serve on the embedded model unavailable: {exc}")
    yield url
    stop_serve(process)


def _names(report) -> list[str]:
    return sorted({f"{f.id} ({f.severity})" for f in report.findings}
                  | {c.name for c in report.gate.checks if not c.passed})


@pytest.mark.parametrize("fault", GATE_FAULTS)
def test_gate_catches_and_names_each_planted_fault(upstream, fault, tmp_path):
    code, report, stdout = run_fault(upstream, fault, tmp_path)
    names = sorted({f.id for f in report.findings} | {c.name for c in report.gate.checks if not c.passed})
    if fault == "healthy":
        assert code == 0, (names, stdout[-3000:])
        assert report.canary is not None and report.canary.output == report.results[0].output
        return
    assert code == 1, (fault, names)
    missing = [e for e in EXPECTED[fault] if not named(report, e)]
    assert not missing, (fault, missing, names, [c.detail for c in report.gate.checks if not c.passed])


@pytest.mark.parametrize("fault", WORKLOAD_FAULTS)
def test_workload_findings_fire_on_their_planted_fault(upstream, fault, tmp_path):
    code, report, stdout = run_fault(upstream, fault, tmp_path, "workloads")
    names = _names(report)
    if fault == "healthy":
        # every structured answer valid, the thinking answer clean, the cache pair answered alike
        assert code == 0 and not workload_findings(report), (names, stdout[-3000:])
        structured = {r.case.prompt_id: r.structured for r in report.results if r.structured is not None}
        assert sorted(structured) == ["city", "weather"] and all(s.passed for s in structured.values()), structured
        weather = next(r for r in report.results if r.case.prompt_id == "weather")
        assert [c["name"] for c in weather.tool_calls] == ["get_weather"], weather.tool_calls
        assert json.loads(weather.tool_calls[0]["arguments"])["city"]
        # SmolLM2's template does not open a think block and the model opens none: an answer in content
        think = next(r for r in report.results if r.case.enable_thinking)
        assert (think.output or "").strip() and "</think>" not in think.output and not think.reasoning
        assert sorted(r.case.cache_role for r in report.results if r.case.cache_role) == ["first", "repeat"]
        assert {r.case.context_tokens for r in report.results} == {None, 600}
        return
    assert code == 1, (fault, names)
    missing = [e for e in EXPECTED[fault] if not named(report, e)]
    assert not missing, (fault, missing, names, [f.evidence for f in report.findings])
    # the planted fault names its own workload finding and no other
    wanted = {e.split(":")[1].split("@")[0] for e in EXPECTED[fault] if e.startswith("finding:")}
    assert set(workload_findings(report)) == wanted, (fault, names)
