"""Start-up time and per-request overhead of the remote path.

Prints: wall time of `ddtree-diag --help` (goal <= 0.3 s), whether importing the CLI pulls in
torch/transformers (it must not), and the probe's per-request overhead against a bare httpx
POST to the same local server (goal <= 5 ms). Run: make bench-cli
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from tests.support.processes import start_standin  # noqa: E402


def help_wall_time(runs: int = 10) -> list[float]:
    exe = Path(sys.executable).with_name("ddtree-diag")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "ddtree_diag"]
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([*command, "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return times


def heavy_imports() -> list[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ddtree_diag.cli"],
                          capture_output=True, text=True, cwd=ROOT)
    names = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    total = [line for line in done.stderr.splitlines() if line.rstrip().endswith("ddtree_diag.cli")]
    print("  importtime line:", total[-1].strip() if total else "?")
    return [n for n in names if n.split(".")[0] in ("torch", "transformers", "httpx")]


def request_overhead(count: int = 200) -> tuple[float, float]:
    import httpx

    from ddtree_diag.backends.dialects import build_request
    from ddtree_diag.backends.http import HttpBackend
    from ddtree_diag.records import ProbeCase

    server = start_standin("--dialect", "ddtree")
    try:
        case = ProbeCase(prompt_id="p", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                         enable_thinking=False, tree_budget=16)
        url = f"{server.url}/v1/chat/completions"
        body = build_request("ddtree", case, "standin-model", stream=False)
        with httpx.Client() as client:
            for _ in range(20):
                client.post(url, json=body)
            bare = []
            for _ in range(count):
                started = time.perf_counter()
                client.post(url, json=body).json()
                bare.append(time.perf_counter() - started)
        backend = HttpBackend(server.url, model="standin-model", dialect="ddtree", stream=False)
        backend.prepare([case])
        for _ in range(20):
            backend.run(case)
        probe = []
        for _ in range(count):
            started = time.perf_counter()
            backend.run(case)
            probe.append(time.perf_counter() - started)
        backend.close()
    finally:
        server.process.terminate()
    return statistics.median(bare), statistics.median(probe)


def main() -> None:
    times = help_wall_time()
    print(f"ddtree-diag --help: median {statistics.median(times) * 1000:.0f} ms, "
          f"min {min(times) * 1000:.0f} ms over {len(times)} runs (goal <= 300 ms)")
    heavy = heavy_imports()
    print(f"  heavy modules imported by `import ddtree_diag.cli`: {heavy or 'none'}")
    bare, probe = request_overhead()
    print(f"per request (local stand-in, non-streamed): bare httpx {bare * 1000:.2f} ms, "
          f"probe backend {probe * 1000:.2f} ms, overhead {(probe - bare) * 1000:.2f} ms (goal <= 5 ms)")


if __name__ == "__main__":
    main()
