"""Packaging: `pip install -e .` says nothing but success (no setuptools deprecation or layout
warnings). Installed from a copy of the project into a throwaway venv, with pip's own build
isolation (it fetches setuptools from the package index, as the single-file build does).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.e2e
WARNING_MARKS = ("BuildBackendWarning", "SetuptoolsDeprecationWarning", "SetuptoolsWarning", "!!")


@pytest.fixture
def project(tmp_path) -> Path:
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "ddtree_diag", copy / "ddtree_diag", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=300)


def setuptools_warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(mark in line for mark in WARNING_MARKS)]


def test_editable_install_has_no_setuptools_warnings(project, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    done = pip("--python", str(env / "bin" / "python"), "install", "--no-deps", "-v", "-e", str(project))
    assert done.returncode == 0, done.stderr[-2000:]
    assert setuptools_warnings(done.stdout + done.stderr) == []
