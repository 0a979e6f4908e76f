"""However a run ends, every report it asked for is written and says how it ended: a target
that is down from the start, SIGTERM (a CI cancel, ``timeout``), a gate stopped before its
baseline; and a gate whose matrix sets no thresholds still checks what a probe shows."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from tests.support.gatekit import write_matrix
from tests.support.hostile_server import HostileServer
from tests.support.processes import ROOT, free_port, run_cli

pytestmark = pytest.mark.e2e


def outputs(tmp_path) -> dict:
    names = {"--json": "run.json", "--junit": "junit.xml", "--summary": "summary.md", "--html": "run.html"}
    return {flag: tmp_path / name for flag, name in names.items()}


def output_flags(paths: dict) -> list[str]:
    return [part for flag, path in paths.items() for part in (flag, str(path))]


def test_target_down_at_the_start_of_a_gate_writes_every_report(tmp_path):
    paths = outputs(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_cli("gate", "gate", "--url", url, *output_flags(paths))
    assert result.code == 3, result.stderr
    assert result.stderr.strip().count("\n") == 0 and url[7:] in result.stderr  # one line naming the target
    report = json.loads(paths["--json"].read_text())
    assert report["interrupted"] is True
    assert report["stopped"]["reason"] == "unreachable" and report["stopped"]["exit_code"] == 3
    suite = ET.parse(paths["--junit"]).getroot().find("testsuite")
    assert int(suite.get("failures")) >= 1
    summary = paths["--summary"].read_text()
    assert "target unreachable" in summary and "exit 3" in summary
    assert "target unreachable" in paths["--html"].read_text()
    # the saved report keeps the run's exit code, not a generic "interrupted"
    shown = run_cli("report", str(paths["--json"]))
    assert shown.code == 3 and "target unreachable" in shown.stdout and "INTERRUPTED" not in shown.stdout


def test_sigterm_mid_gate_writes_every_report_and_exits_143(standin, tmp_path):
    """A gate with a baseline, stopped by SIGTERM while its cases run: the reports are written
    and the lossless check says the run stopped (not that the matrix lacks a baseline)."""
    server = standin("--dialect", "ddtree", "--seconds-per-token", "0.05")
    matrix = write_matrix(tmp_path)  # 8 cases, [baseline] mode = "budget0", gate.lossless = true
    paths = outputs(tmp_path)
    process = subprocess.Popen(
        [sys.executable, "-m", "ddtree_diag", "gate", str(matrix), "--url", server.url, *output_flags(paths)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(int(r.get("max_tokens") or 0) > 1 for r in server.requests()) < 3:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert "terminated by SIGTERM" in err and "Traceback" not in err
    assert "TERMINATED by SIGTERM" in out  # the table and its summary line were rendered
    report = json.loads(paths["--json"].read_text())
    assert report["stopped"] == {"reason": "terminated", "detail": "SIGTERM", "exit_code": 143}
    assert 0 < len(report["results"]) < 8
    checks = {c["name"]: c for c in report["gate"]["checks"]}
    assert checks["complete"]["passed"] is False
    assert "stopped before the baseline" in checks["lossless"]["detail"]
    assert "[baseline] mode" not in checks["lossless"]["detail"]
    assert ET.parse(paths["--junit"]).getroot().find("testsuite") is not None
    assert "TERMINATED by SIGTERM" in paths["--summary"].read_text()
    assert run_cli("report", str(paths["--json"])).code == 143


def test_a_gate_without_thresholds_applies_the_default_checks(standin, tmp_path):
    healthy = standin("--dialect", "ddtree")
    path = tmp_path / "smoke.json"
    result = run_cli("gate", "smoke", "--url", healthy.url, "--json", str(path))
    assert result.code == 0, result.stdout + result.stderr
    report = json.loads(path.read_text())
    assert {"max_failed", "max_garbage"} <= {c["name"] for c in report["gate"]["checks"]}
    assert any("sets no [gate] thresholds" in n and "max_garbage = 0" in n for n in report["notes"])
    assert "sets no [gate] thresholds" in result.stdout
    looping = standin("--dialect", "ddtree", "--loop")
    assert run_cli("gate", "smoke", "--url", looping.url).code == 1  # garbage now fails the bare gate


SECRET = "sk-live-REASON-key-77"


def echo_in_reason_phrase(request, conn):
    """A server that repeats the credential in its HTTP reason phrase (the status line)."""
    auth = request.headers.get("authorization", "")
    if request.method == "GET" and request.path == "/v1/models":
        conn.json(200, {"data": [{"id": "m"}]})
        return
    # no body: the reason phrase is all a client can show
    conn.head(502, {"Content-Length": "0", "Connection": "close"}, reason=f"Bad Gateway for {auth}")


@pytest.mark.parametrize("credential", ["api-key", "url-password"])
def test_progress_lines_mask_a_key_echoed_in_the_reason_phrase(tmp_path, credential):
    paths = outputs(tmp_path)
    with HostileServer(echo_in_reason_phrase) as server:
        if credential == "api-key":
            url, extra, secrets = server.url, ("--api-key", SECRET), (SECRET,)
        else:
            url, extra = server.url.replace("http://", f"http://bob:{SECRET}@"), ()
            secrets = (SECRET, base64.b64encode(f"bob:{SECRET}".encode()).decode())
        result = run_cli("probe", "--url", url, "--thinking", "off", "--budget", "16,64", *extra, *output_flags(paths))
        assert result.code == 1, result.stderr
        assert "[1/2]" in result.stderr and "Bad Gateway for" in result.stderr  # the per-case progress lines
        seen = result.stdout + result.stderr + "".join(p.read_text() for p in paths.values())
        for secret in secrets:
            assert secret not in seen
