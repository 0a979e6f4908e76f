"""Shared fixtures: real servers on loopback ports, the CLI run as a real subprocess, and the
test markers.

Every test carries exactly one of the kind markers, which mean what they say:

- ``unit``: in-process only. No subprocess, no socket: a guard makes either fail the test.
- ``e2e``: starts processes or servers (the CLI, the stand-in, the reference server) and talks
  to them over real loopback HTTP or pipes.
- ``real_model``: loads the embedded SmolLM2-135M (slow on CPU).
- ``gpu``: needs CUDA (skipped elsewhere; CI has none).

A test gets ``e2e`` from the fixtures it uses (``standin``, ``cli``, ...) or a mark in its file;
anything unmarked is ``unit``. ``engine`` (needs torch) is orthogonal.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import Server, run_cli, start_standin

# Output width does not depend on the terminal the tests run in (pytest-xdist's workers get
# COLUMNS=80): consoles that are not a terminal use their documented default of 200 columns, and
# the tests that check other widths give their consoles one explicitly.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# Every hypothesis test sees the same examples on every run (CI included) and keeps no example
# database: a property either holds on its fixed sample or fails every time, never now and then.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("fixed", derandomize=True, database=None)
    _hypothesis_settings.load_profile("fixed")
except ImportError:  # hypothesis is in the dev extra; without it, its tests are skipped
    pass

# Without an NVIDIA GPU, Triton kernels run through Triton's interpreter (numpy on the CPU), so the
# fast path's fused kernels are tested there too. Triton reads this when it is first imported, so
# it is set before any test module imports it.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test`), each worker and the servers it starts share the cores with the
# other workers: give each its share of threads instead of letting torch take every core in each.
# Set before any test module imports torch.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


@pytest.fixture
def standin():
    """Factory: standin("--dialect", "vllm") -> Server; all are stopped after the test."""
    servers: list[Server] = []

    def start(*args: str) -> Server:
        server = start_standin(*args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.process.terminate()
        server.process.wait(timeout=10)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def probe_target(standin) -> str:
    """URL of a healthy server for end-to-end tests that need nothing special from it (--via, the
    zipapp): the stand-in, which starts in a fraction of a second (the reference server loads a
    model first; tests/test_server.py probes it)."""
    return standin("--dialect", "ddtree").url


@pytest.fixture(scope="session")
def embedded_target_dir() -> Path:
    """The embedded SmolLM2's dequantised cache directory (built once per machine, under a lock);
    skips where the GGUF package or the gguf reader is not installed."""
    from ddtree_diag.engine import embedded
    from ddtree_diag.errors import UsageError

    try:
        embedded.find_gguf()
    except UsageError as exc:
        pytest.skip(str(exc))
    pytest.importorskip("gguf")
    return embedded.ensure_target_dir()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core box: extra intra-op threads only spin against each other."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_compile_workers():
    """No compile workers before or after the test: a pass takes them where they run, so one test's
    (real ones start on a GPU) would change where the next one's pass compiles."""
    from ddtree_diag.engine.fast import ahead

    ahead.stop_workers()
    yield
    ahead.stop_workers()


@pytest.fixture
def solver(monkeypatch):
    """The Gated DeltaNet solve kernel on (CPU tensors too), its calls recorded: a list of the (row
    count, max_path) it is called with (``tests.support.gdn_solve``, the ``test_engine_gdn_*``
    modules)."""
    from tests.support.gdn_solve import record_solves

    return record_solves(monkeypatch)


# ---------------------------------------------------------------------------------------------
# Kind markers (see the module docstring)

KINDS = ("unit", "e2e", "real_model", "gpu")
COMPILERS = {"g++", "gcc", "c++", "cc", "clang", "clang++"}
E2E_FIXTURES = {"standin", "cli", "probe_target", "server", "servers", "reference_server", "pyz"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        kinds = [k for k in KINDS if item.get_closest_marker(k)]
        if not kinds:
            uses_processes = E2E_FIXTURES & set(getattr(item, "fixturenames", ()))
            item.add_marker(pytest.mark.e2e if uses_processes else pytest.mark.unit)
    # Slow files first: with `-n auto --dist loadfile` each file runs whole on one worker, and a
    # long file handed out last would leave the other workers idle at the end. A file's weight is
    # its slowest kind (real model, then processes, then in-process); the order within a file and
    # among equals is kept.
    weight: dict[str, int] = {}
    for item in items:
        kind = 0 if item.get_closest_marker("real_model") else 1 if item.get_closest_marker("e2e") else 2
        weight[item.nodeid.split("::")[0]] = min(kind, weight.get(item.nodeid.split("::")[0], 2))
    items.sort(key=lambda item: weight[item.nodeid.split("::")[0]])


def _called_from(path_part: str, depth: int = 12) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if path_part in frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        frame = frame.f_back
    return False


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request, monkeypatch):
    """A ``unit`` test that starts a process or opens a socket is mislabelled: fail it."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(what):
        def method(*args, **kwargs):
            raise AssertionError(f"a unit test must not {what}: mark it e2e")

        return method

    start_process = subprocess.Popen.__init__

    def only_compilers(self, args, *rest, **kwargs):
        # torch.compile's C++ backend runs the compiler and probes what it built: build steps of
        # the code under test, not processes the test starts
        argv = [args] if isinstance(args, (str, bytes)) else list(args)
        program = os.path.basename(str(argv[0])) if argv else ""
        if program in COMPILERS or _called_from("torch/_inductor"):
            return start_process(self, args, *rest, **kwargs)
        raise AssertionError(f"a unit test must not start a process ({program}): mark it e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", only_compilers)
    monkeypatch.setattr(socket.socket, "connect", refuse("open a network connection"))
    monkeypatch.setattr(socket.socket, "bind", refuse("listen on a socket"))
