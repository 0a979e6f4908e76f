"""Build Triton kernels for a Hopper GPU (sm_90) on a machine with none (``tests/test_kernel_builds.py``).

Run as a script in a process without ``TRITON_INTERPRET`` (under the interpreter ``@triton.jit``
makes interpreted functions, which Triton's compiler does not take). Reads a JSON list of launches
on stdin, each {"module", "kernel", "signature": [[name, type], ...], "constexprs": [[index,
value], ...], "options": {...}}; writes a JSON list with, per launch, null where it built to a cubin
within sm_90's shared memory, else the error's last line.
"""

from __future__ import annotations

import importlib
import json
import sys

import triton
import triton.language as tl

SHARED_PER_BLOCK = 227 * 1024  # sm_90's opt-in maximum


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):  # the probe: a kernel any Triton that can build at all builds
    offsets = tl.arange(0, BLOCK)
    tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)


def build(launch: dict) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    constexprs = {(index,): value for index, value in launch["constexprs"]}
    source = ASTSource(fn=kernel, signature=dict(launch["signature"]), constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    if not compiled.asm.get("cubin"):
        raise RuntimeError("no cubin came out")
    # what the launch would ask of the card: an H100's or H200's block gets at most 227 KiB of
    # shared memory (a kernel past it fails at its launch, not here)
    if compiled.metadata.shared > SHARED_PER_BLOCK:
        raise RuntimeError(f"needs {compiled.metadata.shared} bytes of shared memory, past {SHARED_PER_BLOCK}")


def main() -> None:
    results = []
    for launch in json.load(sys.stdin):
        try:
            build(launch)
            results.append(None)
        except Exception as exc:  # every launch gets its verdict
            lines = str(exc).strip().splitlines() or [""]
            results.append(f"{type(exc).__name__}: {lines[-1][:400]}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
