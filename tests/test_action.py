"""The GitHub Action (action.yml + scripts/action-gate.sh): its shape, and its gate step run for
real against the STAND-IN server with the environment GitHub gives a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.support.gatekit import write_matrix
from tests.support.processes import ROOT
from tests.support.timing import AGAINST_SELF_TPS_TOLERANCE

yaml = pytest.importorskip("yaml")

SCRIPT = ROOT / "scripts" / "action-gate.sh"


@pytest.fixture(scope="module")
def action() -> dict:
    return yaml.safe_load((ROOT / "action.yml").read_text())


@pytest.mark.unit
def test_action_is_a_composite_with_the_documented_inputs(action):
    assert action["runs"]["using"] == "composite"
    inputs = action["inputs"]
    assert inputs["url"]["required"] is False and inputs["targets"]["required"] is False  # one or the other
    assert {"url", "targets", "matrix", "baseline", "against", "api-key"} <= set(inputs)
    assert inputs["against"]["required"] is False and inputs["against"]["default"] == ""
    steps = action["runs"]["steps"]
    install = next(s for s in steps if "pip install" in s.get("run", ""))
    assert "$GITHUB_ACTION_PATH" in install["run"]  # installs the action's own checkout
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()"
    for name in ("junit.xml", "report.html", "report.json"):
        assert name in upload["with"]["path"]
    gate = next(s for s in steps if s.get("id") == "gate")
    assert gate["env"]["DDTREE_DIAG_API_KEY"] == "${{ inputs.api-key }}"
    assert gate["env"]["INPUT_AGAINST"] == "${{ inputs.against }}"
    assert gate["env"]["INPUT_TARGETS"] == "${{ inputs.targets }}"
    assert steps[-1]["env"]["GATE_EXIT"] == "${{ steps.gate.outputs.exit-code }}"
    # inputs reach the shell through the environment only (no script injection)
    for step in steps:
        assert "${{" not in step.get("run", ""), step.get("name")


@pytest.mark.unit
def test_readme_documents_the_action(action):
    readme = (ROOT / "README.md").read_text()
    assert "uses: " in readme and "ddtree-diag@" in readme
    for name in action["inputs"]:
        assert f"`{name}`" in readme, name


def run_gate_step(tmp_path: Path, url: str, **inputs: str) -> tuple[int, dict[str, str], str, Path]:
    """Run the gate step's script as a GitHub runner would: inputs as env, GITHUB_OUTPUT and
    GITHUB_STEP_SUMMARY files, `ddtree-diag` on PATH (here: this checkout)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "ddtree-diag"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m ddtree_diag "$@"\n')
    shim.chmod(0o755)
    output, summary = tmp_path / "github_output", tmp_path / "step_summary"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_DIAG_", "OPENAI_", "INPUT_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", GITHUB_OUTPUT=str(output),
               GITHUB_STEP_SUMMARY=str(summary), DDTREE_DIAG_URL=url,
               **{f"INPUT_{k.upper()}": v for k, v in inputs.items()})
    done = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines()) if output.exists() else {}
    return done.returncode, outputs, summary.read_text() if summary.exists() else "", tmp_path / "ddtree-diag"


def test_gate_step_writes_every_report_and_the_summary(standin, tmp_path):
    server = standin("--dialect", "ddtree")
    matrix = write_matrix(tmp_path, extra='[gate]\nmax_garbage = 0\n')
    code, outputs, summary, out = run_gate_step(tmp_path, server.url, matrix=str(matrix),
                                                args="--max-tokens 16 --timeout '30'")
    assert code == 0 and outputs == {"exit-code": "0"}
    for name in ("junit.xml", "report.html", "report.json", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    assert summary.startswith("## ddtree-diag gate: ✅ passed")
    results = json.loads((out / "report.json").read_text())["results"]
    assert results and all(r["case"]["max_tokens"] == 16 for r in results)  # the args input was applied


def test_gate_step_records_a_failed_gate_and_still_exits_0(standin, tmp_path):
    server = standin("--dialect", "ddtree", "--lossy")
    code, outputs, summary, _ = run_gate_step(tmp_path, server.url, matrix="gate", baseline="budget0",
                                                output_dir="reports")
    assert code == 0 and outputs == {"exit-code": "1"}  # the action's last step fails the job with it
    assert (tmp_path / "reports" / "junit.xml").is_file() and "❌ failed" in summary


def test_gate_step_passes_the_against_input(standin, tmp_path):
    server = standin("--dialect", "ddtree")
    # a wide tok/s tolerance: the second run may be slower on a loaded machine
    gate = f"[gate]\nmax_garbage = 0\nagainst_tps_tolerance = {AGAINST_SELF_TPS_TOLERANCE}\n"
    matrix = write_matrix(tmp_path, extra=gate)
    code, outputs, _, out = run_gate_step(tmp_path, server.url, matrix=str(matrix), args="--max-tokens 16")
    assert code == 0 and outputs == {"exit-code": "0"}
    known = tmp_path / "known-good.json"
    (out / "report.json").rename(known)
    code, outputs, summary, out = run_gate_step(tmp_path, server.url, matrix=str(matrix), against=str(known),
                                                args="--max-tokens 16")
    assert outputs == {"exit-code": "0"}, summary
    checks = json.loads((out / "report.json").read_text())["gate"]["checks"]
    assert {"against_cases", "against_text"} <= {c["name"] for c in checks}
    assert "against_text" in summary
    missing = run_gate_step(tmp_path, server.url, matrix=str(matrix), against=str(tmp_path / "nope.json"))
    assert missing[1] == {"exit-code": "2"}


def test_gate_step_gates_a_fleet_from_the_targets_input(standin, tmp_path):
    servers = [standin("--dialect", "ddtree") for _ in range(2)]
    targets = tmp_path / "fleet.toml"
    targets.write_text("".join(f'[[target]]\nname = "r{i}"\nurl = "{s.url}"\n' for i, s in enumerate(servers)))
    code, outputs, summary, out = run_gate_step(tmp_path, "", matrix="smoke", targets=str(targets),
                                                args="--max-tokens 16")
    assert code == 0 and outputs == {"exit-code": "0"}, summary
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "fleet" and [t["name"] for t in report["targets"]] == ["r0", "r1"]
    assert "r0" in summary and "r1" in summary
    assert ET.parse(out / "junit.xml").getroot().find("testsuite") is not None
    # several URLs in the url input: the same fleet
    code, outputs, _, out = run_gate_step(tmp_path, " ".join(s.url for s in servers), matrix="smoke",
                                          args="--max-tokens 16")
    assert outputs == {"exit-code": "0"} and len(json.loads((out / "report.json").read_text())["targets"]) == 2


@pytest.mark.e2e
def test_gate_step_without_a_run_says_so_in_the_summary(tmp_path):
    code, outputs, summary, _ = run_gate_step(tmp_path, "http://127.0.0.1:9", matrix="no-such-matrix")
    assert code == 0 and outputs == {"exit-code": "2"}
    assert summary.startswith("## ddtree-diag gate: error (exit 2)")
    bad_args = run_gate_step(tmp_path, "http://127.0.0.1:9", args="--timeout 'unbalanced")
    assert bad_args[1] == {"exit-code": "2"}
