"""Packaging: `pip install -e .` and a wheel build say nothing but success (no setuptools
deprecation or layout warnings), and the wheel holds the package with its data and nothing else.

Built from a copy of the project into a throwaway venv, with pip's own build isolation (it
fetches setuptools from the package index, as the single-file build does).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e
WARNING_MARKS = ("BuildBackendWarning", "SetuptoolsDeprecationWarning", "SetuptoolsWarning", "!!")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("project")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "ddtree_diag", copy / "ddtree_diag", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def setuptools_warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(mark in line for mark in WARNING_MARKS)]


def test_editable_install_has_no_setuptools_warnings(project, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    done = pip("--python", str(env / "bin" / "python"), "install", "--no-deps", "-v", "-e", str(project))
    assert done.returncode == 0, done.stderr[-2000:]
    assert setuptools_warnings(done.stdout + done.stderr) == []


def test_wheel_has_the_package_and_its_data_only(project, tmp_path):
    done = pip("wheel", "--no-deps", "-v", str(project), "-w", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert setuptools_warnings(done.stdout + done.stderr) == []
    names = zipfile.ZipFile(next(tmp_path.glob("ddtree_diag-*.whl"))).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"ddtree_diag"}
    for needed in ("ddtree_diag/matrices/smoke.toml", "ddtree_diag/backends/agent.py",
                   "ddtree_diag/data/draft-smollm2/model.safetensors", "ddtree_diag/data/smollm2_chat_template.jinja"):
        assert needed in names, needed  # fmt: skip
