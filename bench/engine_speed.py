"""Engine speed baseline: random-weight Qwen3-0.6B / Qwen3-8B-shaped targets, 5-layer DFlash draft.

Prints ms per decode round with the stage breakdown (draft, tree, verify, commit) for tree
budgets 16/64/256 at block size 16, and AR tokens/s. Random weights: acceptance is ~1 token per
round, so every round verifies a full tree — this measures per-round cost, not speedup.

    PYTHONPATH=. python bench/engine_speed.py [--shapes 0.6b,8b] [--new-tokens 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ddtree_diag.engine.draft import DFlashDraft, DraftConfig
from ddtree_diag.engine.generate import Engine
from ddtree_diag.engine.target import TargetModel

SHAPES = {
    # name: (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied embeddings)
    "0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "tiny": (128, 4, 4, 2, 32, 256, 1024, False),  # CPU smoke run
}


def draft_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """Evenly spaced target layers from 1 to target_layers-3 (z-lab's convention)."""
    start, end = 1, target_layers - 3
    return [round(start + i * (end - start) / (draft_layers - 1)) for i in range(draft_layers)]


def build(shape: str, device: str, dtype: torch.dtype, block_size: int, draft_layers: int) -> Engine:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[shape]
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=40960, tie_word_embeddings=tied,
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in the target dtype (8B in fp32 would not be cheap)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
            draft_config = DraftConfig(
                hidden_size=hidden, num_hidden_layers=draft_layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=inter,
                target_layer_ids=draft_layer_ids(layers, draft_layers), mask_token_id=vocab - 1,
                block_size=block_size, num_target_layers=layers, head_dim=head_dim, vocab_size=vocab,
            )  # fmt: skip
            draft = DFlashDraft(draft_config)
            with torch.no_grad():
                for name, p in draft.named_parameters():
                    if "norm" not in name:
                        p.normal_(0, 0.02)
            draft = draft.eval()
    finally:
        torch.set_default_dtype(previous)
    return Engine(TargetModel(model, max_len=1024), tokenizer=None, draft=draft)


def run_shape(shape: str, args: argparse.Namespace) -> None:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    started = time.perf_counter()
    engine = build(shape, args.device, dtype, args.block_size, args.draft_layers)
    built = time.perf_counter() - started
    params = sum(p.numel() for p in engine.target.hf.parameters()) / 1e9
    print(f"\n== Qwen3-{shape}-shaped random target ({params:.2f}B params), {args.draft_layers}-layer draft, "
          f"block {args.block_size}, {args.dtype} on {args.device} (built in {built:.1f}s)")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    vocab = engine.target.config.vocab_size
    prompt = torch.randint(0, vocab - 1, (args.prompt_tokens,), generator=gen).tolist()
    engine.generate_ids(prompt, tree_budget=16, max_tokens=8, stop_token_ids=[])  # warm-up
    engine.generate_ids(prompt, tree_budget=0, max_tokens=8, stop_token_ids=[])
    header = f"{'budget':>6} {'rounds':>6} {'tau':>5} {'ms/round':>9} {'draft':>7} {'tree':>7} {'verify':>7} "
    print(header + f"{'commit':>7} {'tok/s':>8} {'TTFT ms':>8}")
    for budget in [0, *args.budgets]:
        result = engine.generate_ids(
            prompt, tree_budget=budget, max_tokens=args.new_tokens, stop_token_ids=[]
        )
        rounds = max(result.decode_rounds, 1)
        per = {k: 1000 * v / rounds for k, v in result.stage_times.items()}
        ms_round = 1000 * (result.e2e_s - result.ttft_s) / rounds
        tau = result.mean_acceptance_length or 0
        print(
            f"{budget if budget else 'AR':>6} {result.decode_rounds:>6} {tau:>5.2f} "
            f"{ms_round:>9.2f} {per['draft']:>7.2f} {per['tree']:>7.2f} {per['verify']:>7.2f} "
            f"{per['commit']:>7.2f} {result.decode_tokens_per_second or 0:>8.1f} {1000 * result.ttft_s:>8.1f}"
        )
    if args.device.startswith("cuda"):
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.6b,8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    args = parser.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"engine_speed: torch {torch.__version__}, device {name}")
    for shape in args.shapes.split(","):
        run_shape(shape.strip(), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
