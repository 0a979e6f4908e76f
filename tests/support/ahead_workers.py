"""The compile-ahead pass in worker processes, for a Hopper GPU (sm_90), on a machine with none
(``tests/test_engine_ahead_workers.py``).

Run as a script in a process without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit``
makes interpreted functions, which Triton's compiler does not take), with ``TRITON_CACHE_DIR`` and
``DDTREE_DIAG_CACHE`` set to empty directories. This process stands in for a GPU process: its
Triton driver is ``ahead._TargetOnly`` for sm_90, so the pass's launches reach Triton's JIT as on
a GPU. Prints one JSON object: what each step did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from ddtree_diag.engine.fast import ahead, triton_argmax, triton_kernels


def cache_entries() -> set[str]:
    root = Path(os.environ["TRITON_CACHE_DIR"])
    return {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()} if root.exists() else set()


def builds_differ_in() -> dict[str, list[str]]:
    """For a kernel built more than once: the metadata fields in which its builds differ (what made
    the parent's cache key another than a worker's)."""
    root, builds = Path(os.environ["TRITON_CACHE_DIR"]), {}
    for path in root.rglob("*.json") if root.exists() else ():
        if not path.name.startswith("__grp__") and path.with_suffix(".cubin").exists():
            builds.setdefault(path.stem, []).append(json.loads(path.read_text()))
    return {
        name: sorted(key for key in set().union(*metadata) if len({json.dumps(m.get(key)) for m in metadata}) > 1)
        for name, metadata in builds.items() if len(metadata) > 1
    }


def launches(dtype: torch.dtype):
    """A stage function: a split argmax (two kernels) and an RMSNorm over ``dtype`` rows (made
    inside the pass: fake tensors)."""

    def stage() -> None:
        triton_argmax.argmax(torch.empty(3, 5000, dtype=dtype))
        triton_kernels.rms_norm(torch.empty(5, 256, dtype=dtype), torch.empty(256, dtype=dtype), 1e-6, False)

    return stage


def primary_context_active() -> tuple[int, bool]:
    """In a worker, on a GPU machine: (its pid, whether it holds device 0's CUDA context)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    return os.getpid(), bool(active.value)


def main() -> None:
    driver.set_active(ahead._TargetOnly(GPUTarget("cuda", 90, 32)))
    out: dict = {"started": ahead.start_workers("cuda", torch.bfloat16, workers=2)}
    out["started_again"] = ahead.start_workers("cuda", torch.bfloat16, workers=2)  # the same workers
    for started in ahead._WORKERS.ready:  # (a pass takes them once they have started)
        started.result()
    report = ahead.compile_ahead([launches(torch.bfloat16)], identity="bf16 stages")
    out["processes"] = report.as_dict()
    # one build of each kernel, the workers': were the key this process computes another, its
    # load after the pass would have built each again
    out["cubins"] = sorted(Path(name).stem for name in cache_entries() if name.endswith(".cubin"))
    out["builds_differ_in"] = builds_differ_in()

    # The same launches again, in threads (the workers stopped): each kernel is already in this
    # process's memory, so Triton calls its JIT cache hook (before any compile) for none.
    ahead.stop_workers()
    from triton import knobs

    hooked: list[str] = []
    knobs.runtime.jit_cache_hook = lambda *, fn, **_: hooked.append(fn.name) or False
    before = cache_entries()
    out["threads_same"] = ahead.compile_ahead([launches(torch.bfloat16)]).as_dict()
    out["compiled_again"] = sorted(hooked)
    # other launches (fp32 rows) do compile, and add files: the checks above can see a miss
    out["threads_other"] = ahead.compile_ahead([launches(torch.float32)]).as_dict()
    out["compiled_other"] = sorted(set(hooked))
    out["new_files_other"] = len(cache_entries() - before)
    knobs.runtime.jit_cache_hook = None

    # A marker now exists for this cache and these kernels: no workers start for the next process.
    out["started_when_warm"] = ahead.start_workers("cuda", torch.bfloat16, workers=2)
    # Workers left idle stop by themselves (a later pass then runs in threads).
    ahead.WORKERS_IDLE_S = 0.2
    ahead._WORKERS.start(1)
    ahead._WORKERS.timer.join(timeout=60)
    out["stopped_when_idle"] = ahead._WORKERS.take() is None
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
