"""Constrained decoding cost: ms per round with and without a JSON-Schema constraint.

Per decode path and mode (AR, chain, tree budgets), the same prompt is decoded unconstrained (no
stop ids: it runs to --tokens) and under a json_schema constraint (it ends where the JSON is
complete); the best of --repeat runs after one warm-up. Columns: rounds and mean acceptance of
the constrained run, ms per round unconstrained / constrained, of which llguidance mask work
(``Generation.extras["grammar_mask_s"]``) per round, draft nodes pruned per round, and whether the
constrained tokens equal constrained AR's on that path (and the unconstrained ones unconstrained
AR's: in bf16 a near-tie may flip either).

    python -m bench.grammar_speed --model tiny        # tiny random Qwen3 + random draft (CPU)
    python -m bench.grammar_speed --model embedded    # SmolLM2-135M + its trained draft (CPU)
    python -m bench.grammar_speed --model 0.6b --tokenizer DIR   # random Qwen3-0.6B shape, bf16, CUDA

With $OUT set, the report is also written to $OUT/grammar_speed.txt.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from ddtree_diag.engine.grammar import compile_constraint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a fictional person as JSON with name, age and hobbies."}]
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def load(model: str, tokenizer_dir: str | None, device: str, dtype: str | None):
    """(engine, prompt ids, paths to run)."""
    from ddtree_diag.engine import embedded, load_engine

    if model == "tiny":
        from tests.support import engine_fixtures as fx

        root = Path(tempfile.mkdtemp())
        engine = load_engine(fx.make_target(root / "t"), fx.make_draft(root / "d", block_size=4),
                             device=device, dtype="fp32")
        return engine, fx.PROMPTS[1], ["eager", "fast-nograph"]
    if model == "embedded":
        engine = load_engine(embedded.ensure_target_dir(), draft=embedded.default_draft_dir(), device=device,
                             dtype="fp32")
        return engine, engine.render_prompt(MESSAGES, enable_thinking=False), ["eager", "fast-nograph"]
    from transformers import AutoTokenizer

    from bench.engine_speed import build

    dtype = dtype or ("bf16" if device == "cuda" else "fp32")
    engine = build(model, device, torch.bfloat16 if dtype == "bf16" else torch.float32, 16, 5)
    engine.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = engine.tokenizer(MESSAGES[0]["content"], add_special_tokens=False)["input_ids"]
    return engine, prompt, ["fast"] if device == "cuda" else ["fast-nograph"]


def best(engine, runs: int, **kwargs):
    results = [engine.generate_ids(**kwargs) for _ in range(runs)]
    return min(results, key=lambda g: (g.e2e_s - g.ttft_s) / max(g.decode_rounds, 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | embedded | a bench.engine_speed shape (0.6b, 8b)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer directory (with a shape)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--budgets", default="16,64")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--paths", default=None, help="comma list of decode paths (default: per model)")
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="of a shape (default: bf16 on CUDA)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, prompt, paths = load(args.model, args.tokenizer, args.device, args.dtype)
    paths = args.paths.split(",") if args.paths else paths
    constraint = compile_constraint(
        engine.tokenizer, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    )
    configs = [("ar", 0), ("chain", 0)] + [("tree", int(b)) for b in args.budgets.split(",")]
    if engine.draft is None:
        configs = configs[:1]
    say(f"model {args.model} on {args.device}, prompt {len(prompt)} tokens, up to {args.tokens} new, "
        f"best of {args.repeat}")
    say(f"{'path':>12} {'mode':>8} {'rounds':>6} {'tau':>5} {'free ms':>8} {'json ms':>8} {'mask ms':>8} "
        f"{'pruned':>7} {'=AR':>4} {'free=AR':>7}")
    for path in paths:
        engine.use_path(path)
        reference = free_reference = None
        for mode, budget in configs:
            common = dict(prompt_ids=prompt, mode=mode, tree_budget=budget, max_tokens=args.tokens)
            engine.generate_ids(**common, stop_token_ids=[])  # warm-up (CUDA: graph capture)
            engine.generate_ids(**common, constraint=constraint)
            free = best(engine, args.repeat, **common, stop_token_ids=[])
            constrained = best(engine, args.repeat, **common, constraint=constraint)
            if reference is None:
                reference, free_reference = constrained.token_ids, free.token_ids
            rounds = max(constrained.decode_rounds, 1)
            free_ms = 1000 * (free.e2e_s - free.ttft_s) / max(free.decode_rounds, 1)
            json_ms = 1000 * (constrained.e2e_s - constrained.ttft_s) / rounds
            mask_ms = 1000 * constrained.extras["grammar_mask_s"] / rounds
            pruned = constrained.extras["grammar_pruned_nodes"] / rounds
            label = mode if mode != "tree" else f"tree{budget}"
            say(f"{path:>12} {label:>8} {constrained.decode_rounds:>6} {constrained.mean_acceptance_length or 0:>5.2f} "
                f"{free_ms:>8.2f} {json_ms:>8.2f} {mask_ms:>8.2f} {pruned:>7.1f} "
                f"{'yes' if constrained.token_ids == reference else 'NO':>4} "
                f"{'yes' if free.token_ids == free_reference else 'NO':>7}")
        say(f"  constrained output: {engine.decode_text(reference)[:120]!r}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "grammar_speed.txt").write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
