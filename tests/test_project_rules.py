"""Rules of the project's own layout: environment variables are DDTREE_DIAG_* and listed in the
README; tests share helpers through tests/support/, never by importing conftest."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Variables of other tools the code reads or sets on purpose (documented where they are used).
FOREIGN = {"NO_COLOR", "COLUMNS", "GITHUB_STEP_SUMMARY", "XDG_CACHE_HOME", "OPENAI_API_KEY", "PATH",
           "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR", "TRITON_INTERPRET", "TRITON_CACHE_DIR",
           "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE"}  # read, as part of a cache key, never set
# os.environ["X"], os.environ.get("X"), os.getenv("X"), envvar="X" / envvar=["X", "Y"]
READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\(|envvar=\[?)\s*["']([A-Z][A-Z0-9_]+)["']""")
LISTED = re.compile(r"envvar=\[([^\]]*)\]")


def variables_in_code() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "ddtree_diag").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        found.update(READ.findall(text))
        for group in LISTED.findall(text):
            found.update(re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']", group))
    return found


def test_every_variable_of_ours_is_prefixed_and_in_the_readme():
    found = variables_in_code()
    assert {"DDTREE_DIAG_URL", "DDTREE_DIAG_API_KEY", "DDTREE_DIAG_CACHE"} <= found  # the scan sees them
    ours = found - FOREIGN
    assert all(name.startswith("DDTREE_DIAG_") for name in ours), sorted(n for n in ours if "DDTREE_DIAG_" not in n)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Environment variables") :]
    section = section[: section.index("\n## ", 3)]
    assert [name for name in sorted(ours) if f"`{name}`" not in section] == []


def test_tests_share_helpers_through_support_not_conftest():
    importers = [path.name for path in (ROOT / "tests").rglob("*.py")
                 if re.search(r"^\s*(from tests\.conftest|import tests\.conftest|from tests import conftest)",
                              path.read_text(encoding="utf-8"), re.M)]
    assert importers == []
    loose = [path.name for path in (ROOT / "tests").glob("*.py")
             if not path.name.startswith("test_") and path.name not in ("conftest.py", "__init__.py")]
    assert loose == [], "helpers belong in tests/support/"


def test_no_formatter_markers():
    """Formatting is by hand (``ruff check`` is enforced, ``ruff format`` is not), so a marker that
    shields a line from the formatter means nothing and is not written."""
    marker = "# fmt" + ":"
    marked = [str(path.relative_to(ROOT)) for folder in ("ddtree_diag", "tests", "bench", "scripts")
              for path in (ROOT / folder).rglob("*.py") if marker in path.read_text(encoding="utf-8")]
    assert marked == []


@pytest.mark.e2e
@pytest.mark.parametrize("bench", ["attention_kernel_speed", "gdn_kernel_speed", "gdn_solve_speed", "gemm_shapes"])
def test_a_gpu_only_bench_without_cuda_says_so_in_one_line(bench):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has CUDA: the bench would run")
    done = subprocess.run([sys.executable, "-m", f"bench.{bench}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"{bench}: needs a CUDA GPU (it times GPU kernels); none here"]


@pytest.mark.parametrize("name, tb_per_s, known", [
    ("NVIDIA H200", 4.8, True), ("NVIDIA H100 80GB HBM3", 3.35, True), ("NVIDIA H100 PCIe", 2.0, True),
    ("NVIDIA H100 NVL", 3.9, True), ("NVIDIA GH200 480GB", 4.0, True), ("NVIDIA A100-SXM4-40GB", 1.555, True),
    ("Some Future Card", 4.8, False),
])
def test_a_bench_floor_uses_the_cards_own_bandwidth(name, tb_per_s, known):
    """The weight-read floors the benches print are the card's: an H100's 3.35 TB/s, not an H200's
    4.8 (a card no row names gets the H200's and says so)."""
    pytest.importorskip("torch")
    from bench.graph_timing import hbm_tb_per_s

    assert hbm_tb_per_s(name) == (tb_per_s, known)
