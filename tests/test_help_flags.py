"""On/off flags take no value, so ``--help`` shows no type after them (no ``<bool>``, no
``BOOLEAN``), while options that take a value keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.processes import ROOT


def help_of(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "ddtree_diag", *args, "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("command", [(), ("probe",), ("gate",), ("text-check",), ("demo",), ("report",)])
def test_on_off_flags_show_no_type(command):
    out = help_of(*command)
    assert "<bool>" not in out and "BOOLEAN" not in out, out
    assert "--help" in out


@pytest.mark.e2e
def test_probe_help_keeps_the_types_of_options_that_take_a_value():
    out = help_of("probe")
    stream = next(line for line in out.splitlines() if "--no-stream" in line)
    assert "<" not in stream.split("--no-stream", 1)[1].split("Stream", 1)[0]
    assert any("--timeout" in line and ("<float>" in line or "FLOAT" in line) for line in out.splitlines())


def test_the_dialect_help_names_every_registered_dialect():
    from ddtree_diag.backends.dialects import DIALECTS
    from ddtree_diag.commands.options import DIALECT_NAMES

    assert DIALECT_NAMES == DIALECTS


@pytest.mark.e2e
def test_the_top_level_help_loads_no_records_dialects_or_report_files():
    # `ddtree-diag --help` must stay fast: the records' dataclasses, the dialect registry and the
    # report-file helpers are loaded by the commands that use them, not by the CLI's import.
    code = ("import sys\nimport ddtree_diag.cli\n"
            "heavy = ('ddtree_diag.records', 'ddtree_diag.backends', 'ddtree_diag.output.reportfile',\n"
            "         'torch', 'httpx')\n"
            "print([m for m in heavy if m in sys.modules])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"
