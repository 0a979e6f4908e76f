"""Device time of kernels as the engine runs them: captured in a CUDA graph and replayed."""

from __future__ import annotations

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
