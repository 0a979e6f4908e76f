"""First request of a shape in a fresh process: cold and warm Triton caches, with and without
compiling the kernels ahead (``engine/fast/ahead.py``).

Each row is its own process (``bench.engine_speed``, fast path, a few tokens a budget): "cold"
with a new empty ``TRITON_CACHE_DIR`` and ``DDTREE_DIAG_CACHE``, compiling each kernel at its first
launch, or ahead in threads, or ahead in the compile workers (the default on a cold cache); "warm"
a second process on the directories the last cold one left (Triton's compiled kernels, the compile
markers). Seconds of the first request per budget (AR first), and what the compile-ahead pass did.

    python -m bench.first_request [--shapes 8b,qwen3.6-27b] [--budgets 16,64] [--rows threads,processes]

Without CUDA it runs the small CPU shape, where no kernel compiles and no pass runs: a smoke run of
the bench itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {  # name: (row, DDTREE_DIAG_COMPILE_AHEAD, fresh directories)
    "off": ("cold, one kernel at a time", "off", True),
    "threads": ("cold, ahead in threads", "threads", True),
    "processes": ("cold, ahead in processes", "on", True),
    "warm": ("warm (second process)", "on", False),
}


def run_once(shape: str, budgets: str, ahead: str, cache: Path, extra: list[str]) -> list[dict]:
    """One ``engine_speed`` process; its records (one per budget, AR first)."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OUT=out, TRITON_CACHE_DIR=str(cache / "triton"), DDTREE_DIAG_CACHE=str(cache / "tool"))
        env["DDTREE_DIAG_COMPILE_AHEAD"] = ahead
        command = [
            sys.executable, "-m", "bench.engine_speed", "--shapes", shape, "--paths", "fast", "--no-profile",
            "--budgets", budgets, "--new-tokens", "16", *extra,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
            raise SystemExit(f"engine_speed failed for {shape}: {tail[0]}")
        return json.loads((Path(out) / f"engine_speed-{shape.strip()}.json").read_text())


def describe(record: dict) -> str:
    ahead = record.get("compile_ahead")
    if not ahead:
        return f"{record['first_request_s']:.1f}"
    if ahead.get("skipped"):
        return f"{record['first_request_s']:.1f} (pass skipped)"
    note = f"; {ahead['error']}" if ahead.get("error") else ""
    where = f" in {ahead['compiled_in']}" if ahead.get("compiled_in") else ""
    return f"{record['first_request_s']:.1f} (pass {ahead['seconds']:.1f} s, {ahead['kernels']} kernels{where}{note})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="comma list (default 8b,qwen3.6-27b; small without CUDA)")
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--rows", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)} (in this order)")
    args = parser.parse_args()
    rows = args.rows.split(",")
    if unknown := set(rows) - set(RUNS):
        parser.error(f"unknown rows: {', '.join(sorted(unknown))} (rows: {', '.join(RUNS)})")
    import torch

    cuda = torch.cuda.is_available()
    shapes = (args.shapes or ("8b,qwen3.6-27b" if cuda else "small")).split(",")
    extra = [] if cuda else ["--small"]
    budgets = ["AR", *args.budgets.split(",")]
    print(f"first_request: {torch.cuda.get_device_name() if cuda else 'cpu'}, seconds of a fresh process's "
          f"first request per budget ({' / '.join(budgets)})", flush=True)
    for shape in shapes:
        with tempfile.TemporaryDirectory() as scratch:
            cache = Path(scratch)
            for name in rows:
                row, ahead, fresh = RUNS[name]
                if fresh:
                    cache = Path(tempfile.mkdtemp(dir=scratch))
                records = run_once(shape, args.budgets, ahead, cache, extra)
                cells = " / ".join(describe(record) for record in records)
                print(f"{shape:>12} {row:<28} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
