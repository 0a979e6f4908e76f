"""The vectorised tree build on bf16-like draft log-probs: how often it proves its order (an
unproven round is redone with the exact host build) and what one build costs, for the default
(pointer doubling, then one pass of the heap's tie rule) against the tie rule alone.

    python -m bench.tree_build [--device cuda] [--draws 200] [--vocab 151936]

Prints one row per (budget, method): proven fraction over the draws and ms per build.
"""

from __future__ import annotations

import argparse
import time

import torch

from ddtree_diag.engine.fast import tree as fast_tree

METHODS = {  # name: (refine_steps, doubling_steps)
    "default": (fast_tree.REFINE_STEPS, fast_tree.DOUBLING_STEPS),
    "rule x4 (before)": (4, 0),
    "rule x8": (8, 0),
}


def draft_logprobs(seed: int, depth: int, vocab: int, device: str) -> torch.Tensor:
    """Random logits rounded to bf16 (the GPU's draft head), scale varied per draw."""
    gen = torch.Generator().manual_seed(seed)
    scale = (1.0, 2.0, 4.0, 8.0)[seed % 4]
    logits = (torch.randn(depth, vocab, generator=gen) * scale).bfloat16().float().to(device)
    return torch.log_softmax(logits, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--budgets", default="16,64,256")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    draws = [draft_logprobs(seed, args.depth, args.vocab, args.device) for seed in range(args.draws)]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'}), "
          f"vocab {args.vocab}, depth {args.depth}, {args.draws} draws")
    print(f"{'budget':>6}  {'method':<18} {'proven':>8}  {'ms/build':>9}")
    for budget in budgets:
        for name, (refine, doubling) in METHODS.items():
            for logprobs in draws[:3]:  # warm-up (kernels, allocator)
                fast_tree.build_tree_tensors(logprobs, budget, args.depth, refine, doubling)
            sync()
            proven, started = 0, time.perf_counter()
            for logprobs in draws:
                built = fast_tree.build_tree_tensors(logprobs, budget, args.depth, refine, doubling)
                proven += int(built["exact"])
            sync()
            ms = (time.perf_counter() - started) * 1000 / len(draws)
            print(f"{budget:>6}  {name:<18} {proven / len(draws):>8.3f}  {ms:>9.3f}")


if __name__ == "__main__":
    main()
