"""The compile-ahead pass in worker processes (engine/fast/ahead.py: ``start_workers``).

Where the workers run, each launch of the pass is handed to one (Triton's JIT hook, the launch's
serialized specialization) instead of compiled in a thread. What must hold: the workers build the
kernels for the parent's GPU into Triton's on-disk cache under the very keys the parent computes
(else every real launch would compile again), they start only where a pass will likely need them,
and they stop when left idle. Checked on this machine for a Hopper GPU (sm_90), with Triton's own
compiler, in a process of its own (``tests/support/ahead_workers.py``); whether they pay is a GPU
measurement (``bench.first_request``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ddtree_diag.engine.fast import ahead  # noqa: E402
from tests.support.kernel_tests import needs_async_compile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("no_compile_workers")


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory) -> dict:
    needs_async_compile()  # (the check compiles in threads too)
    scratch = tmp_path_factory.mktemp("ahead-workers")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(scratch / "triton"), "DDTREE_DIAG_CACHE": str(scratch / "tool")}
    env.pop("DDTREE_DIAG_COMPILE_AHEAD", None)
    done = subprocess.run([sys.executable, "-m", "tests.support.ahead_workers"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, f"the worker run failed: {done.stderr.strip().splitlines()[-3:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_workers_build_the_passs_kernels_under_the_keys_this_process_computes(worker_run):
    assert worker_run["started"] and worker_run["started_again"]
    report = worker_run["processes"]
    assert report.get("error") is None, report
    assert report["compiled_in"] == "processes" and report["kernels"] == 3
    # each kernel built once, by a worker: this process loaded it from the cache, not built it again
    assert worker_run["cubins"] == ["_argmax_chunk_kernel", "_argmax_merge_kernel", "_rms_norm_kernel"], worker_run
    # after the pass the kernels are in this process's memory: the same launches compile nothing
    assert worker_run["threads_same"]["compiled_in"] == "threads"
    assert worker_run["compiled_again"] == []
    # other launches do compile (the check above would see them)
    assert "_rms_norm_kernel" in worker_run["compiled_other"]
    assert worker_run["new_files_other"] > 0


@pytest.mark.e2e
def test_workers_do_not_start_on_a_warm_cache_and_stop_when_idle(worker_run):
    assert worker_run["started_when_warm"] is False
    assert worker_run["stopped_when_idle"] is True


@pytest.mark.e2e
def test_workers_do_not_run_the_parents_script_again(tmp_path):
    """A spawned child imports its parent's main module first; a script that loads its model at
    the top level, unguarded, would load it again in every worker. The workers start without it."""
    runs, script = tmp_path / "runs.txt", tmp_path / "unguarded.py"
    script.write_text(
        f"with open({str(runs)!r}, 'a') as out:\n"
        "    out.write('ran\\n')\n"
        "from ddtree_diag.engine.fast import ahead\n"
        "ahead._WORKERS.start(1)\n"
        "assert ahead._WORKERS.pool.submit(sum, [1, 2]).result(timeout=600) == 3\n"
        "ahead.stop_workers()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-3:]
    assert runs.read_text() == "ran\n"


@pytest.mark.parametrize(
    ("device", "dtype", "setting", "markers", "expected"),
    [
        ("cuda", torch.bfloat16, None, False, True),
        ("cuda", torch.float32, "on", False, True),  # the kernels cover fp32 too
        ("cpu", torch.bfloat16, None, False, False),  # no kernels compile on a CPU
        ("cuda", torch.float16, None, False, False),  # fp16 runs the modules: nothing to compile
        ("cuda", torch.bfloat16, "threads", False, False),
        ("cuda", torch.bfloat16, "off", False, False),
        ("cuda", torch.bfloat16, None, True, False),  # a pass ran for this cache: little left to compile
    ],
)
def test_workers_start_only_where_a_pass_will_need_them(monkeypatch, device, dtype, setting, markers, expected):
    started: list[int] = []
    monkeypatch.setattr(ahead._WORKERS, "start", lambda workers: started.append(workers) or True)
    monkeypatch.setattr(ahead, "_markers_present", lambda: markers)
    monkeypatch.delenv("DDTREE_DIAG_KERNELS", raising=False)
    monkeypatch.setattr("ddtree_diag.engine.fast.kernels._triton", lambda: object())
    if setting is None:
        monkeypatch.delenv("DDTREE_DIAG_COMPILE_AHEAD", raising=False)
    else:
        monkeypatch.setenv("DDTREE_DIAG_COMPILE_AHEAD", setting)
    assert ahead.start_workers(device, dtype, workers=3) is expected
    assert started == ([3] if expected else [])


def test_a_worker_finds_the_launcher_of_the_backend_that_compiles_for_the_target():
    """A worker builds each kernel's launcher (with Triton 3.6, a C module gcc builds) where the
    parent would otherwise build it at the first launch, one after another. Targets name the
    platform (``cuda``, ``hip``), Triton's backends the vendor (``nvidia``, ``amd``)."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    assert ahead._driver_class(GPUTarget("cuda", 90, 32)) is backends["nvidia"].driver
    if "amd" in backends:
        assert ahead._driver_class(GPUTarget("hip", "gfx942", 64)) is backends["amd"].driver
    with pytest.raises(RuntimeError, match="0 Triton backends"):
        ahead._driver_class(GPUTarget("metal", 1, 32))


def _cache_keys(first: str, *flags: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.support.cache_keys", first, *flags], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-3:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_a_kernels_cache_key_does_not_depend_on_what_a_process_touched_first():
    """The parent and each worker must find a kernel under one key. Triton before 3.9 let a
    kernel's key depend on whether its helpers' keys were computed before it (emulated here with
    ``--merge-first``, so the check holds on any Triton): the kernel modules settle every key,
    helpers first, as they are imported."""
    kernel_first = _cache_keys("_argmax_chunk_kernel,_first_max", "--merge-first")
    helper_first = _cache_keys("_first_max,_argmax_chunk_kernel", "--merge-first")
    assert kernel_first["keys"] == helper_first["keys"]
    assert len(kernel_first["keys"]) > 20  # every kernel module's functions, keyed
    assert kernel_first["keys"] == _cache_keys("")["keys"]  # and the keys Triton's own order gives
    settled = kernel_first["settled"]
    assert settled.index("_first_max") < settled.index("_argmax_chunk_kernel")
    assert settled.index("_first_max") < settled.index("_argmax_merge_kernel")


def test_a_pass_takes_the_workers_only_once_they_have_started():
    """Workers still importing would keep a pass waiting: it runs in threads instead."""
    from concurrent.futures import Future

    workers, started = ahead._Workers(), Future()
    workers.pool, workers.ready = object(), [started]
    assert workers.take() is None
    started.set_result(None)
    assert workers.take() is workers.pool
    assert workers.take() is None  # one pass at a time
    workers.busy = False


def test_markers_say_whether_a_pass_compiled_into_this_cache(monkeypatch, tmp_path):
    needs_async_compile()
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "tool"))
    monkeypatch.setattr(ahead, "_triton_cache_dir", lambda: str(tmp_path / "triton"))
    assert not ahead._markers_present()
    assert ahead.compile_ahead([lambda: None], identity="stages").error is None
    assert ahead._markers_present()
    monkeypatch.setattr(ahead, "_triton_cache_dir", lambda: str(tmp_path / "another"))  # another Triton cache
    assert not ahead._markers_present()


def test_a_pass_without_workers_runs_in_threads():
    needs_async_compile()
    assert ahead._WORKERS.take() is None  # none started in this process
    report = ahead.compile_ahead([lambda: None])
    assert report.error is None and report.compiled_in == "threads"


@pytest.mark.parametrize(("decode_path", "starts"), [(None, True), ("fast", True), ("eager", False),
                                                      ("fast-compile", False)])
def test_loading_an_engine_starts_the_workers_before_the_weights(monkeypatch, tmp_path, decode_path, starts):
    """``load_engine`` asks for the workers (``start_workers`` decides) before reading the weights,
    where the decode path is the one that compiles ahead."""
    pytest.importorskip("transformers")
    from ddtree_diag.engine import load_engine
    from tests.support import engine_fixtures as fx

    asked: list[tuple] = []
    monkeypatch.setattr(ahead, "start_workers", lambda device, dtype: asked.append((device.type, dtype)) or False)
    monkeypatch.delenv("DDTREE_DIAG_DECODE", raising=False)
    load_engine(fx.make_target(tmp_path / "t"), device="cpu", dtype="fp32", decode_path=decode_path)
    assert asked == ([("cpu", torch.float32)] if starts else [])


@pytest.mark.e2e
def test_on_a_gpu_the_workers_compile_without_a_cuda_context(monkeypatch, tmp_path):
    """A worker builds for the parent's GPU from its target alone: after compiling, none holds a
    CUDA context (each would cost hundreds of MiB of device memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    needs_async_compile()
    from tests.support.ahead_workers import launches, primary_context_active

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path / "tool"))
    ahead.stop_workers()
    assert ahead.start_workers("cuda", torch.bfloat16, workers=2)
    try:
        for started in ahead._WORKERS.ready:
            started.result()
        with torch.device("cuda"):
            report = ahead.compile_ahead([launches(torch.bfloat16)])
        assert report.error is None and report.compiled_in == "processes" and report.kernels == 3, report
        states = [future.result() for future in [ahead._WORKERS.pool.submit(primary_context_active) for _ in range(8)]]
    finally:
        ahead.stop_workers()
    assert not any(active for _pid, active in states), states
