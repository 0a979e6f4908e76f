"""Device time of kernels as the engine runs them: captured in a CUDA graph and replayed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch


def graph_us(calls: list[Callable[[], object]], replays: int) -> float:
    """us per call of ``calls`` captured one after another in one CUDA graph, after two warm-up
    calls on a side stream (they compile and allocate); ``replays`` timed replays. Many calls per
    replay (each on its own buffers, or a layer's call repeated) keep a replay's own launch cost
    from counting against a 2 us kernel."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in (calls * 2)[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(calls))


def needs_cuda(bench: str) -> None:
    """One line and exit status 2 where there is no CUDA device: these benches time GPU kernels
    only (no interpreter smoke run), and a traceback from CUDA's lazy init says less."""
    if not torch.cuda.is_available():
        print(f"{bench}: needs a CUDA GPU (it times GPU kernels); none here", file=sys.stderr)
        raise SystemExit(2)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def kernel_bench_args(description: str, shapes_help: str, warm_help: str) -> argparse.Namespace:
    """The command line a one-kernel bench shares: ``--shapes`` (the bench parses them), ``--dtype``
    (returned as a torch dtype), ``--bandwidth`` (HBM TB/s for the floor) and ``--warm``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", default=None, help=shapes_help)
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--bandwidth", type=float, default=4.8, help="HBM TB/s for the floor (H200: 4.8)")
    parser.add_argument("--warm", action="store_true", help=warm_help)
    args = parser.parse_args()
    args.dtype = DTYPES[args.dtype]
    return args
