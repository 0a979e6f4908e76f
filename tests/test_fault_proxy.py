"""The gate against planted server faults: a real fault proxy (tests/support/fault_proxy.py) in front of
the project's own `serve` on the embedded SmolLM2 + its draft (real text, real acceptance), one
proxy per fault. Every fault must fail the gate AND be named by a finding or a failing check;
the healthy pass-through must pass.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")

from tests.support.fault_proxy import EXPECTED, FAULTS, named, run_fault, start_serve
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


@pytest.mark.parametrize("fault", list(FAULTS))
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
