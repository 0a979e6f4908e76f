"""Build dist/ddtree-diag.pyz: the remote-probing tool as one file (``python3 ddtree-diag.pyz probe ...``).

The zipapp holds the ddtree_diag package, the built-in matrices and the pure-Python runtime
dependencies, installed with ``pip install --target`` for Python 3.10 as pure wheels only. Compiled
modules cannot be imported from a zip (and would tie the file to one platform), so:
- ``regex`` (a core dependency, compiled) is left out: the quality module must fall back to the
  standard library when it is missing;
- ``jsonschema`` is left out too (it needs ``rpds-py``, compiled): structured answers are still
  checked as JSON and tool calls by name, and the report says their schemas were not validated;
- typer is pinned below 0.26: later releases vendor click (cli.py imports click itself) and from
  0.29 need pydantic, whose core is compiled;
- any other extension module that sneaks in fails the build, naming it.
The engine extra (torch, transformers) is never included: engine commands say they need it. Nor
is what only the engine uses: the packaged draft weights, the training prompts and the chat
template (under ``ddtree_diag/data``) and the training code (``ddtree_diag/training``), so the file
stays small (a few MB). The word lists under ``data/lexicon`` stay: the quality check reads them.
Pygments (rich needs it to import) keeps only the lexers rich itself names (Python, plain text):
the tool never highlights code (typer's help runs in "rich" mode, tracebacks are the standard
library's), and the other 1 MB of lexers would be a quarter of the file.
Bytecode: the modules that ``--help`` and the remote path import (found by importing them from
the staging folder) are also compiled by the building interpreter into ``module.pyc`` beside
``module.py`` (zipimport looks only there, never in ``__pycache__``, and cannot write a cache of
its own), as unchecked-hash pycs (PEP 552: no timestamps to compare with the zip's). A Python of
the same version starts from them, about four times faster; any other version sees a foreign
magic number, skips the pyc and compiles the source as before. Modules nothing imports at start
(most of pygments, wcwidth's tables...) stay source only: compiling everything would double the
file for no gain at start.
After building, the file is smoke-tested with ``python -I -S`` (no site-packages at all): it must
print its version and import every module of the remote path.

Usage: python scripts/build_pyz.py [--out dist/ddtree-diag.pyz] [--keep-staging DIR]
"""

from __future__ import annotations

import argparse
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import zipapp
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYGMENTS_LEXERS_KEPT = {"__init__.py", "_mapping.py", "python.py", "special.py"}  # see the docstring
COMPILED = {"regex", "jsonschema"}  # core dependencies that are (or need) extension modules: not vendored
PINS = ["typer>=0.12,<0.26", "click>=8.1"]  # see the module docstring
TARGET_PYTHON = "3.10"  # the oldest Python the tool supports: pulls tomli, exceptiongroup...
EXTENSION_SUFFIXES = (".so", ".pyd", ".dylib", ".dll")
# Parts of the package only the engine uses (it cannot run from the zipapp): left out. Paths are
# relative to the package; data/lexicon (the quality check's word lists) is kept.
ENGINE_ONLY = ("training", "data/draft-smollm2", "data/prompts", "data/smollm2_chat_template.jinja")
# Modules the remote path imports at run time; the smoke test imports each from the zip.
REMOTE_MODULES = [
    "ddtree_diag.cli", "ddtree_diag.orchestrator", "ddtree_diag.matrix", "ddtree_diag.commands.run",
    "ddtree_diag.output.console", "ddtree_diag.output.reportfile", "ddtree_diag.output.junit",
    "ddtree_diag.backends.http", "ddtree_diag.backends.via", "ddtree_diag.checks.quality",
    "ddtree_diag.checks.findings", "ddtree_diag.checks.gate",
    "httpx", "httpx_sse", "rich.table", "prometheus_client.parser", "ftfy",
]
MAIN = """import sys

if sys.version_info < (3, 10):
    sys.exit("ddtree-diag needs Python >= 3.10 (this is %d.%d)" % sys.version_info[:2])
from ddtree_diag.cli import main

main()
"""


def requirements() -> list[str]:
    """pyproject's core dependencies, markers dropped (ship for 3.10 too), compiled ones out."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    wanted = []
    for spec in data["project"]["dependencies"]:
        requirement = spec.split(";")[0].strip()
        name = re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0].lower()
        if name in COMPILED or name == "typer":
            continue
        wanted.append(requirement)
    return wanted + PINS


def install(staging: Path) -> None:
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--target", str(staging), "--no-compile", "--only-binary=:all:",
        "--python-version", TARGET_PYTHON, "--implementation", "py", "--abi", "none", "--platform", "any",
        *requirements(),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"build_pyz: pip install failed:\n{done.stderr.strip()}")
    extensions = [p.relative_to(staging) for p in staging.rglob("*") if p.suffix in EXTENSION_SUFFIXES]
    if extensions:
        sys.exit(f"build_pyz: compiled modules cannot run from a zipapp: {', '.join(map(str, extensions))}")
    shutil.rmtree(staging / "bin", ignore_errors=True)
    lexers = staging / "pygments" / "lexers"
    for module in lexers.glob("*.py"):
        if module.name not in PYGMENTS_LEXERS_KEPT:
            module.unlink()


def copy_package(staging: Path) -> None:
    package = ROOT / "ddtree_diag"
    caches = shutil.ignore_patterns("__pycache__", "*.pyc")

    def ignore(directory: str, names: list[str]) -> set[str]:
        left_out = set(caches(directory, names))
        here = Path(directory).relative_to(package)
        return left_out | {name for name in names if (here / name).as_posix() in ENGINE_ONLY}

    shutil.copytree(package, staging / "ddtree_diag", ignore=ignore)  # built-in matrices too
    (staging / "__main__.py").write_text(MAIN, encoding="utf-8")


# Run from the staging folder with no site-packages: prints the file of every module it imported.
STARTUP_PROBE = """import contextlib, io, sys
for module in sys.argv[1:]:
    __import__(module)
from ddtree_diag.cli import app
for args in (["--help"], ["probe", "--help"], ["text-check", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        app(args, prog_name="ddtree-diag")
for module in list(sys.modules.values()):
    print(getattr(module, "__file__", None) or "")
"""


def startup_modules(staging: Path) -> list[Path]:
    """The staged source files that ``--help`` and the remote path import."""
    code = f"import sys; sys.path.insert(0, {str(staging)!r})" + chr(10) + STARTUP_PROBE
    command = [sys.executable, "-I", "-S", "-B", "-c", code, *REMOTE_MODULES]  # -B: no __pycache__ in staging
    done = subprocess.run(command, capture_output=True, text=True, env={"COLUMNS": "120"})
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "?"
        sys.exit(f"build_pyz: the remote path does not import from the staging folder: {last}")
    root = staging.resolve()
    files = {Path(line).resolve() for line in done.stdout.splitlines() if line.endswith(".py")}
    return sorted(f for f in files if f.is_relative_to(root))


def compile_bytecode(staging: Path) -> int:
    """``x.pyc`` beside each start-up module's ``x.py`` for this interpreter (see the docstring);
    returns how many. A module this Python cannot compile keeps only its source."""
    compiled = 0
    for source in startup_modules(staging):
        relative = source.relative_to(staging.resolve()).as_posix()
        try:
            py_compile.compile(str(source), cfile=str(source.with_suffix(".pyc")), dfile=relative, doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        except py_compile.PyCompileError:
            continue
        compiled += 1
    return compiled


def smoke_test(archive: Path) -> None:
    """Run the file with no site-packages: --version, and import the whole remote path."""
    isolated = [sys.executable, "-I", "-S"]
    version = subprocess.run([*isolated, str(archive), "--version"], capture_output=True, text=True)
    if version.returncode != 0 or "ddtree-diag" not in version.stdout:
        sys.exit(f"build_pyz: {archive} --version failed: {(version.stderr or version.stdout).strip()}")
    # ... and the quality check's word lists are inside (a salad check without them sees nothing).
    code = (f"import sys; sys.path.insert(0, {str(archive)!r})\nfor m in {REMOTE_MODULES!r}: __import__(m)\n"
            "from ddtree_diag.checks.quality import lexicon\nassert 'the' in lexicon.words('en'), 'no lexicon'\n"
            "import io, rich.console, rich.syntax\n"
            "rich.console.Console(file=io.StringIO()).print(rich.syntax.Syntax('x = 1', 'python'))")
    imports = subprocess.run([*isolated, "-c", code], capture_output=True, text=True)
    if imports.returncode != 0:
        last = imports.stderr.strip().splitlines()[-1] if imports.stderr.strip() else "?"
        sys.exit(f"build_pyz: the remote path does not import from the zipapp: {last}")


def build(out: Path, keep_staging: Path | None = None) -> Path:
    with tempfile.TemporaryDirectory(prefix="ddtree-pyz-") as temp:
        staging = keep_staging or Path(temp) / "app"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        install(staging)
        copy_package(staging)
        compile_bytecode(staging)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        zipapp.create_archive(staging, partial, interpreter="/usr/bin/env python3", compressed=True)
        partial.replace(out)  # never leave a half-written file under the real name
    smoke_test(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "ddtree-diag.pyz")
    parser.add_argument("--keep-staging", type=Path, default=None, help="Build in DIR and keep it.")
    args = parser.parse_args()
    out = build(args.out.resolve(), args.keep_staging)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
