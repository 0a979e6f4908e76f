"""Lossless check of the engine on a device: T=0 output == the target's own greedy decode.

fp32: every case must match exactly. bf16: counts the cases that differ and judges each at its
first divergent token with ``divergence.first_divergence`` (the plain forward's gap in nats and in
rounding steps: a near-tie flip vs a real bug).
``--paths eager,fast`` (default: both) runs every case through both decode paths; fast must also
equal eager token for token in fp32.

    python -m bench.engine_gpu_check [--device cuda] [--quick] [--paths fast]

Targets: the tiny test fixtures (written to disk, loaded through the real loader) and medium
random ones (HF default init, where near-ties are common) built in memory; dense (Qwen3) and
hybrid (Qwen3.5-style, Gated DeltaNet) for each (``--targets``). A family name of the fixtures
(``gpt_oss``, ``qwen3_moe``, ``gemma3_text``, ... : ``engine_fixtures.DENSE_FAMILIES``) runs its
tiny fixture only: the sinks, MoE, sandwich-norm and NoPE paths on the device.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from ddtree_diag.engine import load_engine
from ddtree_diag.engine.arch import EXPERT_COUNT_FIELDS
from ddtree_diag.engine.divergence import first_divergence
from ddtree_diag.engine.draft import DFlashDraft, DraftConfig
from ddtree_diag.engine.generate import DECODE_PATHS, Engine
from ddtree_diag.engine.target import TargetModel
from tests.support import engine_fixtures as fx

BUDGETS = [0, 1, 2, 4, 16, 64]


def _with_draft(model: torch.nn.Module, device: str, dtype: torch.dtype, block_size: int) -> Engine:
    """An engine on a mid-size random target (8 layers, hidden 512, vocab 8192) with a random
    2-layer draft reading its layers 1, 4 and 6."""
    draft_config = DraftConfig(
        hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1536, target_layer_ids=[1, 4, 6], mask_token_id=8191, block_size=block_size,
        num_target_layers=8, head_dim=64, vocab_size=8192,
    )
    draft = DFlashDraft(draft_config).to(device=device, dtype=dtype).eval()
    return Engine(TargetModel(model, max_len=512), tokenizer=None, draft=draft)


def medium_engine(device: str, dtype: torch.dtype, block_size: int) -> Engine:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()
    return _with_draft(model, device, dtype, block_size)


def medium_hybrid_engine(device: str, dtype: torch.dtype, block_size: int) -> Engine:
    """A mid-size random Qwen3.5-style hybrid: 8 layers, 3 Gated DeltaNet to 1 full attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(device=device, dtype=dtype).eval()
    return _with_draft(model, device, dtype, block_size)


def judged(engine: Engine, prompt: list[int], reference: list[int], other: list[int]) -> str:
    """Where ``other`` leaves ``reference`` and whether the plain forward calls it a near-tie."""
    with torch.no_grad():
        found = first_divergence(engine.target.hf, prompt, reference, other)
    return "length differs" if found is None else found.describe()


PATHS: list[str] = ["eager", "fast"]


def error_against_fp32(exact: Engine, rounded: Engine, prompts: list[list[int]]) -> str:
    """How far bf16 logits stray from fp32 ones of the same weights (teacher-forced over each
    prompt), HF's own bf16 forward against the engine's. Where a family is noisy in bf16 (gpt-oss's
    tiny fixture strays by up to ~3 logits in HF itself), a divergence past the near-tie threshold
    is still rounding if the engine strays no further than HF does."""
    hf_errors, engine_errors = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor(prompt, device=rounded.device)
            truth = exact.target.hf(ids[None]).logits[0].float()
            hf_errors.append((rounded.target.hf(ids[None]).logits[0].float() - truth).abs())
            rounded.target.reset()
            logits, _ = rounded.target.forward(ids, torch.arange(len(prompt), device=rounded.device))
            rounded.target.reset()
            engine_errors.append((logits.float() - truth).abs())
    hf_error, engine_error = torch.cat(hf_errors), torch.cat(engine_errors)
    return (
        f"logits against fp32 (teacher-forced): HF bf16 mean {hf_error.mean():.4f} max {hf_error.max():.3f}; "
        f"engine bf16 mean {engine_error.mean():.4f} max {engine_error.max():.3f}"
    )


def check(
    name: str, engines: dict[int, Engine], prompts: list[list[int]], max_tokens: int
) -> tuple[int, int]:
    """Returns (cases, cases that differ from greedy or, fast vs eager, from each other)."""
    cases = differ = fallbacks = 0
    for prompt in prompts:
        any_engine = next(iter(engines.values()))
        reference = any_engine.greedy_reference(prompt, max_tokens, stop_ids=[])
        for block_size, engine in engines.items():
            for budget in BUDGETS:
                outputs = {}
                for path in PATHS:
                    engine.use_path(path)
                    gen = engine.generate_ids(prompt, tree_budget=budget, max_tokens=max_tokens, stop_token_ids=[])
                    outputs[path] = gen.token_ids
                    fallbacks += gen.extras.get("fast_tree_fallbacks", 0)
                    cases += 1
                    if gen.token_ids != reference:
                        differ += 1
                        print(
                            f"  DIFF {name} {path} block={block_size} budget={budget} prompt_len={len(prompt)}: "
                            + judged(engine, prompt, reference, gen.token_ids)
                        )
                for path, tokens in outputs.items():
                    if "eager" in outputs and path != "eager" and tokens != outputs["eager"]:
                        differ += 1
                        print(
                            f"  {path} != eager {name} block={block_size} budget={budget} prompt_len={len(prompt)}: "
                            + judged(engine, prompt, outputs["eager"], tokens)
                        )
    print(f"{name} ({'+'.join(PATHS)}): {differ}/{cases} cases differ; fast tree fallbacks {fallbacks}")
    return cases, differ


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer prompts/tokens (CPU smoke run)")
    parser.add_argument("--paths", default="eager,fast", help="decode paths: " + ", ".join(DECODE_PATHS))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="tree budgets (0 = AR)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="fp32, bf16 or both")
    parser.add_argument(
        "--targets", default="dense,hybrid",
        help="dense (Qwen3), hybrid (Qwen3.5-style), and/or fixture families (gpt_oss, qwen3_moe, gemma3_text, ...)",
    )
    parser.add_argument(
        "--all-experts", action="store_true",
        help="MoE fixtures route every token to all their experts: with no discrete router choice left to "
        "flip, every bf16 divergence should be a near-tie",
    )
    args = parser.parse_args()
    if args.all_experts:
        for settings in fx.SMALL_MOE.values():
            count = next(settings[name] for name in EXPERT_COUNT_FIELDS if name in settings)
            settings["num_experts_per_tok"] = count
    targets = args.targets.split(",")
    PATHS[:] = args.paths.split(",")
    BUDGETS[:] = [int(b) for b in args.budgets.split(",")]
    dtypes = args.dtypes.split(",")
    gen = torch.Generator().manual_seed(0)
    n_prompts, max_tokens = (2, 16) if args.quick else (4, 48)
    started = time.perf_counter()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny_prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (5, 13, 31, 70)][
            :n_prompts
        ]
        tiny = {"dense": fx.make_target, "hybrid": fx.make_hybrid_target}
        tiny |= {family: partial(fx.make_target, model_type=family) for family in fx.DENSE_FAMILIES}
        for kind in targets:
            target = tiny[kind](root / f"target-{kind}")
            drafts = {bs: fx.make_draft(root / f"d{bs}-{kind}", block_size=bs) for bs in (4, 8)}
            for dtype in dtypes:
                engines = {
                    bs: load_engine(target, d, device=args.device, dtype=dtype) for bs, d in drafts.items()
                }
                _, differ = check(f"tiny-{kind}-{dtype}", engines, tiny_prompts, max_tokens)
                failures += differ if dtype == "fp32" else 0
                if dtype == "bf16" and differ:
                    exact = load_engine(target, drafts[4], device=args.device, dtype="fp32")
                    print(f"  tiny-{kind}-bf16 " + error_against_fp32(exact, engines[4], tiny_prompts))
    medium_prompts = [torch.randint(0, 8000, (n,), generator=gen).tolist() for n in (7, 50, 200, 9)][
        :n_prompts
    ]
    builders = {"dense": medium_engine, "hybrid": medium_hybrid_engine}
    for kind in (kind for kind in targets if kind in builders):
        for dtype in [{"fp32": torch.float32, "bf16": torch.bfloat16}[name] for name in dtypes]:
            engines = {bs: builders[kind](args.device, dtype, bs) for bs in (8, 16)}
            label = f"medium-{kind}-" + ("fp32" if dtype == torch.float32 else "bf16")
            _, differ = check(label, engines, medium_prompts, max_tokens)
            failures += differ if dtype == torch.float32 else 0
            del engines
    print(f"device={args.device} torch={torch.__version__} elapsed={time.perf_counter() - started:.1f}s")
    print("fp32 lossless: " + ("PASS" if failures == 0 else f"FAIL ({failures} cases)"))
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
