"""Helpers for the gate/lossless/findings/formats tests: small matrices and real runs.

Runs go through the real CLI against the STAND-IN server (tests/support/standin_server.py), whose fault
flags make one problem real at a time (a lossy server, a loop, a thinking-only bug...).
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree_diag.records import RunReport
from tests.support.processes import run_cli, start_standin
from tests.support.timing import HEALTHY_MAX_TTFT_S, HEALTHY_MIN_TOKENS_PER_SECOND

# One prompt, thinking off/on, budgets 16/64, two repeats, greedy: 8 cases.
SMALL = """
[defaults]
max_tokens = 32
temperature = 0.0
repeat = 2

[axes]
enable_thinking = [false, true]
tree_budget = [16, 64]

[prompts.hello]
text = "Say hello in one short sentence."
{extra}
"""

# Every threshold the gate knows, set so a healthy stand-in run passes all of them (the speed and
# TTFT bounds from tests/support/timing.py: far from what a healthy stand-in measures on a loaded box).
ALL_CHECKS = f"""
[baseline]
mode = "budget0"

[gate]
max_failed = 0
max_garbage = 0
lossless = true
min_completion_tokens = 2
min_mean_acceptance = 2.0
min_group_acceptance = 2.0
min_tokens_per_second = {HEALTHY_MIN_TOKENS_PER_SECOND}
tokens_per_second_source = "client"
max_ttft_s = {HEALTHY_MAX_TTFT_S}
fail_on_findings = "warning"
"""


def write_matrix(directory: Path, extra: str = ALL_CHECKS, name: str = "m.toml") -> Path:
    path = directory / name
    path.write_text(SMALL.format(extra=extra))
    return path


def gate_run(tmp_path: Path, flags: tuple[str, ...] = (), matrix: str | Path | None = None,
             args: tuple[str, ...] = (), dialect: str = "ddtree") -> tuple[int, RunReport, str]:
    """Start a stand-in with ``flags``, run ``gate`` on it; (exit code, report, stdout)."""
    matrix = matrix or write_matrix(tmp_path)
    server = start_standin("--dialect", dialect, *flags)
    try:
        out = tmp_path / f"run{len(list(tmp_path.glob('run*.json')))}.json"
        result = run_cli("gate", str(matrix), "--url", server.url, "--json", str(out), *args)
        assert out.exists(), result.stderr
        return result.code, RunReport.from_dict(json.loads(out.read_text())), result.stdout
    finally:
        server.process.terminate()
        server.process.wait(timeout=10)


def check(report: RunReport, name: str) -> dict:
    return next(c for c in report.gate.checks if c.name == name)


def finding_ids(report: RunReport) -> list[str]:
    return [f.id for f in report.findings]
