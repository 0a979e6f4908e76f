"""The single-file build (scripts/build_pyz.py, ``make pyz``): built once per session, then run
with no site-packages at all (``-I -S``) against a real server on loopback.

The build needs PyPI (pip keeps its own cache, so repeated sessions are quick).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.processes import ROOT

SMALL = ("--thinking", "off", "--max-tokens", "16")  # few, short cases (the smoke matrix's budgets)


@pytest.fixture(scope="session")
def pyz(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pyz") / "ddtree-diag.pyz"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_pyz.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def target(probe_target) -> str:
    return probe_target  # tests/conftest.py picks the server


def run_pyz(pyz: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    # -I: no PYTHONPATH, no user site; -S: no site-packages. Only the zip and the stdlib remain.
    return subprocess.run([python, "-I", "-S", str(pyz), *args], capture_output=True, text=True,
                          timeout=120, cwd=pyz.parent)


def essentials(report: dict) -> list[tuple]:
    return [(r["case"]["case_id"], r["status"], r["output"], r["spec"]["decode_rounds"]) for r in report["results"]]


MAX_BYTES = 8 * 1024 * 1024  # sources ~4 MB with the word lists (3.2 MB), plus bytecode of the start-up modules


def test_pyz_leaves_out_engine_only_data_and_stays_small(pyz):
    names = zipfile.ZipFile(pyz).namelist()
    engine_only = [n for n in names if n.startswith(("ddtree_diag/data/", "ddtree_diag/training/"))
                   and not n.startswith(("ddtree_diag/data/lexicon/", "ddtree_diag/data/filler/"))
                   and not n.endswith("/")]
    assert not engine_only
    assert "ddtree_diag/data/lexicon/index.json" in names, "the quality check's word lists travel with it"
    assert "ddtree_diag/data/filler/en.json" in names, "so do the long-context filler's"
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".gguf"))], "no weights"
    assert pyz.stat().st_size <= MAX_BYTES, f"{pyz.stat().st_size / 1e6:.1f} MB"


def test_pyz_text_verdicts_equal_the_installed_tool(pyz):
    from ddtree_diag.checks.quality import assess

    sentence = ("the process works by splitting the input into small parts and then sorting each part before "
                "merging the sorted parts back together into one list which is returned to the caller")
    words = sentence.split()
    texts = [
        " ".join(words) + ".",
        " ".join(w + words[i + 1] if i % 2 == 0 else w for i, w in enumerate(words[:-1]) if i % 3 != 1),  # glued
        " ".join(w + " " + w for w in words) + ".",  # doubled words
        "Die Antwort ist einfach: wir teilen die Eingabe und sortieren jeden Teil getrennt.",
    ]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    result = subprocess.run([sys.executable, "-I", "-S", str(pyz), "text-check", "--jsonl", "-"], input=lines,
                            capture_output=True, text=True, timeout=120)
    got = [json.loads(line) for line in result.stdout.splitlines()]
    expected = [assess(t).to_dict() for t in texts]
    assert [(g["garbage"], [r["code"] for r in g["reasons"]]) for g in got] == [
        (e["garbage"], [r["code"] for r in e["reasons"]]) for e in expected]
    assert [e["garbage"] for e in expected] == [False, True, True, False]


def test_pyz_vendors_no_compiled_module_and_no_engine_dependency(pyz):
    names = zipfile.ZipFile(pyz).namelist()
    assert "__main__.py" in names and "ddtree_diag/backends/agent.py" in names
    assert "ddtree_diag/matrices/smoke.toml" in names, "built-in matrices travel with the tool"
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dylib"))]
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"torch", "transformers", "regex", "pydantic_core"}
    assert {"httpx", "rich", "typer", "click"} <= tops


def test_pyz_starts_from_bytecode_on_the_building_python_and_from_source_on_others(pyz):
    """zipimport reads ``module.pyc`` beside ``module.py`` (never ``__pycache__``): the building
    interpreter imports the start-up modules from it; another version skips the foreign magic
    number and compiles the source."""
    import importlib.util

    names = set(zipfile.ZipFile(pyz).namelist())
    assert not [n for n in names if "__pycache__" in n]
    for module in ("ddtree_diag/cli", "ddtree_diag/commands/options", "rich/console", "typer/main", "click/core"):
        assert f"{module}.py" in names and f"{module}.pyc" in names, module
    with zipfile.ZipFile(pyz) as archive:
        assert archive.read("ddtree_diag/cli.pyc")[:4] == importlib.util.MAGIC_NUMBER
    code = f"import sys; sys.path.insert(0, {str(pyz)!r}); import ddtree_diag.cli as m; print(m.__file__)"
    here = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and here.stdout.strip().endswith("ddtree_diag/cli.pyc"), here.stderr
    others = sorted(Path.home().glob(".pyenv/versions/3.1[0-9].*/bin/python3"))
    others = [p for p in others if f"/{sys.version_info[0]}.{sys.version_info[1]}." not in str(p)]
    if not others:
        pytest.skip("no other Python 3 version on this machine")
    there = subprocess.run([str(others[0]), "-I", "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert there.returncode == 0 and there.stdout.strip().endswith("ddtree_diag/cli.py"), there.stderr
    assert run_pyz(pyz, "--version", python=str(others[0])).stdout.startswith("ddtree-diag ")


def test_pyz_probes_like_the_installed_tool(pyz, target, cli):
    direct = cli("probe", "--url", target, "--json", "-", *SMALL)
    result = run_pyz(pyz, "probe", "--url", target, "--json", "-", *SMALL)
    assert result.returncode == 0, result.stderr
    report, expected = json.loads(result.stdout), direct.json()
    assert report["target"]["matrix"] == "smoke (built-in)"
    assert essentials(report) == essentials(expected)


def test_pyz_probes_via_a_prefix(pyz, target):
    result = run_pyz(pyz, "probe", "--url", target, "--via", "sh -c 'exec \"$@\"' sh", "--json", "-", *SMALL)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["target"]["via"]["agent_python"]
    assert all(r["status"] == "ok" and r["output"] for r in report["results"])


@pytest.mark.parametrize("args", [("probe", "--engine", "--target", "some/model"), ("probe", "--engine"),
                                  ("engine-info",), ("serve",), ("demo",), ("train-draft", "--out", "d")])
def test_pyz_engine_commands_say_they_need_the_engine_extra(pyz, args):
    result = run_pyz(pyz, *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and ("needs the engine extra" in result.stderr
                                                or "needs the serve extra" in result.stderr), result.stderr


def test_pyz_usage_errors_stay_one_line(pyz):
    version = run_pyz(pyz, "--version")
    assert version.returncode == 0 and version.stdout.startswith("ddtree-diag ")
    bad = run_pyz(pyz, "probe", "--url", "ftp://x")
    assert bad.returncode == 2 and "bad --url" in bad.stderr and "Traceback" not in bad.stderr


def test_pyz_on_the_oldest_supported_python(pyz, target):
    oldest = sorted(Path.home().glob(".pyenv/versions/3.10.*/bin/python3.10"))
    if not oldest:
        pytest.skip("no Python 3.10 on this machine")
    result = run_pyz(pyz, "probe", "--url", target, "--json", "-", *SMALL, python=str(oldest[0]))
    assert result.returncode == 0, result.stderr
    assert all(r["status"] == "ok" for r in json.loads(result.stdout)["results"])


def test_pyz_runs_the_workloads_matrix_without_jsonschema(pyz, tmp_path):
    """The single file has no jsonschema (it needs a compiled extension) but ships the filler's word
    lists: JSON answers are still parsed, tool calls matched by name, long prompts filled."""
    from tests.support.processes import start_standin

    server = start_standin("--dialect", "ddtree")
    try:
        result = run_pyz(pyz, "probe", "--url", server.url, "--matrix", "workloads", "--thinking", "off",
                         "--fill", "0,1000", "--json", "-")
    finally:
        server.process.kill()
        server.process.wait()
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    checked = {r["case"]["prompt_id"]: r["structured"] for r in report["results"] if r["structured"]}
    assert checked["city_json"]["passed"] and checked["weather_tool"]["passed"], checked
    assert "schema not validated" in checked["city_json"]["detail"]
    filled = [r["case"]["fill"] for r in report["results"] if r["case"]["context_tokens"] == 1000]
    assert filled and all(f["language"] == "en" and 900 <= f["tokens"] <= 1000 for f in filled)
