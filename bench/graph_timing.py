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


# HBM bandwidth by card (TB/s, the vendor's figure): the floors the benches print are the card's own.
# Checked in order: a name holding another comes first ("GH200" before "H200", "H100 PCIe" before
# the SXM part's plain "H100", "H200" before "H20", "L40" (and L40S) before "L4").
HBM_TB_PER_S = (("GH200", 4.0), ("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35),
                ("H800", 3.35), ("H20", 4.0), ("B200", 8.0), ("A100-SXM4-80GB", 2.039),
                ("A100 80GB PCIe", 1.935), ("A100", 1.555), ("L40", 0.864), ("L4", 0.3))
ASSUMED_TB_PER_S = 4.8  # a card not listed: an H200's, and the benches say it was assumed


def hbm_tb_per_s(device_name: str) -> tuple[float, bool]:
    """(TB/s, known) for a CUDA device's name; an unlisted card gets ``ASSUMED_TB_PER_S``."""
    for part, tb_per_s in HBM_TB_PER_S:
        if part in device_name:
            return tb_per_s, True
    return ASSUMED_TB_PER_S, False


def device_bandwidth(device: str | torch.device = "cuda") -> tuple[float, str]:
    """(bytes/s, a label such as "3.35 TB/s, H100") of the device the bench runs on."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return ASSUMED_TB_PER_S * 1e12, f"{ASSUMED_TB_PER_S} TB/s, assumed (no GPU)"
    name = torch.cuda.get_device_name(device)
    tb_per_s, known = hbm_tb_per_s(name)
    return tb_per_s * 1e12, f"{tb_per_s} TB/s, {name}" + ("" if known else " (not listed: assumed)")


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
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="HBM TB/s for the floor (default: the card's own, e.g. H200 4.8, H100 3.35)")
    parser.add_argument("--warm", action="store_true", help=warm_help)
    args = parser.parse_args()
    args.dtype = DTYPES[args.dtype]
    if args.bandwidth is None:
        args.bandwidth = device_bandwidth()[0] / 1e12
    return args


def print_plans(
    kind: str, width: int, floor_us: float, default: tuple[int, int], times: dict[tuple[int, int], float],
    units: tuple[str, str], check: str,
) -> tuple[tuple[int, int], float]:
    """A launch-plan sweep's line for one shape: the HBM floor, the default plan's time and every
    plan's, fastest first (a plan (a, b) shown as "a<units[0]>/b<units[1]>"), then the best and
    ``check`` (what the bench verified of the plans). Returns the best plan and its time."""
    def name(plan: tuple[int, int]) -> str:
        return f"{plan[0]}{units[0]}/{plan[1]}{units[1]}"

    ranked = sorted(times.items(), key=lambda item: item[1])
    cells = ", ".join(f"{name(plan)} {us:.2f}" for plan, us in ranked)
    best, best_us = ranked[0]
    print(f"{kind:>{width}} | floor {floor_us:.2f} | default {name(default)} {times[default]:.2f} | {cells}")
    print(f"{'':>{width}} | best {name(best)} {best_us:.2f} us; {check}")
    return best, best_us
