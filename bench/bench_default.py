"""Benchmark of the embedded default: SmolLM2-135M-Instruct + its trained DFlash draft.

Prints mean acceptance length (committed tokens per verify round, bonus included, pooled over
prompts) for tree budgets 0/4/16/64/256 with thinking off and on, on the smoke prompt and the
held-aside prompts (ddtree_diag/data/prompts/heldout.txt, never used for training), T=0, and
checks every output against SmolLM2's own greedy decode (HF forward, ``greedy_reference``).

    python -m bench.bench_default                      # the full table (slow on CPU: ~2 h on 2 cores)
    python -m bench.bench_default --limit 5 --budgets 0,64 --max-tokens 48   # a quick look
    python -m bench.bench_default --simulate           # all budgets in minutes, no lossless check

Goal: mean acceptance >= 2.5 at budget 64, thinking off; lossless everywhere.
Answers are 128 tokens by default (the length the training job evaluates with): the first tokens
of an answer are the hardest to guess, so shorter caps report less (``--max-tokens 64``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SMOKE_PROMPT = "Say hello in one short sentence."


@dataclass
class Cell:
    prompts: int = 0
    rounds: int = 0
    committed: int = 0  # tokens committed by verify rounds (sum of acceptance lengths)
    completion_tokens: int = 0
    lossless: int = 0
    decode_seconds: float = 0.0

    @property
    def mean_acceptance(self) -> float | None:
        return self.committed / self.rounds if self.rounds else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.completion_tokens / self.decode_seconds if self.decode_seconds else None


def _strip_stop(ids: list[int], stops: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stops else ids


def run(args: argparse.Namespace) -> dict:
    from ddtree_diag.engine import load_engine
    from ddtree_diag.engine.embedded import default_draft_dir, ensure_target_dir

    t0 = time.time()
    target_dir = ensure_target_dir()
    engine = load_engine(
        target_dir, draft=args.draft or default_draft_dir(), device=args.device, dtype=args.dtype
    )
    load_s = time.time() - t0
    stops = set(engine.stop_token_ids)
    sets = _prompt_sets(args)
    budgets = [int(b) for b in args.budgets.split(",")]
    modes = [m == "on" for m in args.thinking.split(",")]
    cells: dict[tuple[str, bool, int], Cell] = {}
    mismatches: list[str] = []
    for thinking in modes:
        for set_name, prompts in sets.items():
            for prompt in prompts:
                ids = engine.render_prompt([{"role": "user", "content": prompt}], enable_thinking=thinking)
                reference = _strip_stop(engine.greedy_reference(ids, args.max_tokens), stops)
                for budget in budgets:
                    gen = engine.generate(prompt_ids=ids, tree_budget=budget, max_tokens=args.max_tokens)
                    cell = cells.setdefault((set_name, thinking, budget), Cell())
                    cell.prompts += 1
                    cell.rounds += len(gen.acceptance_lengths)
                    cell.committed += sum(gen.acceptance_lengths)
                    cell.completion_tokens += gen.completion_tokens
                    cell.decode_seconds += max(gen.e2e_s - gen.ttft_s, 0.0)
                    if _strip_stop(list(gen.token_ids), stops) == reference:
                        cell.lossless += 1
                    else:
                        mismatches.append(f"{set_name} thinking={thinking} budget={budget}: {prompt!r}")
                if args.verbose:
                    print(
                        f"  done: {set_name} thinking={'on' if thinking else 'off'} {prompt[:50]!r}",
                        flush=True,
                    )
    info = engine.info()
    return {
        "mode": "engine",
        "target": str(target_dir),
        "draft": str(args.draft or default_draft_dir()),
        "engine": {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool, list, dict))},
        "load_seconds": round(load_s, 1),
        "max_tokens": args.max_tokens,
        "budgets": budgets,
        "cells": [
            {
                "set": s,
                "thinking": "on" if t else "off",
                "budget": b,
                **asdict(c),
                "mean_acceptance": c.mean_acceptance,
                "tokens_per_second": c.tokens_per_second,
            }
            for (s, t, b), c in cells.items()
        ],
        "mismatches": mismatches,
        "seconds": round(time.time() - t0, 1),
    }


def _cell_row(set_name: str, thinking: bool, budget: int, cell: Cell) -> dict:
    row = {"set": set_name, "thinking": "on" if thinking else "off", "budget": budget, **asdict(cell)}
    row.update(mean_acceptance=cell.mean_acceptance, tokens_per_second=cell.tokens_per_second)
    return row


def run_simulated(args: argparse.Namespace) -> dict:
    """Fast path: the same table from one teacher-forced draft pass per prompt. At T=0 the target's
    output is its greedy decode, so each round's acceptance follows from the draft's per-depth
    distribution at that position (draft_training.simulate_acceptance); no tree is verified, so
    nothing is checked for losslessness. Agrees with the engine up to fp32 rounding."""
    import torch

    from ddtree_diag.engine.draft import load_draft
    from ddtree_diag.engine.embedded import default_draft_dir, ensure_target_dir
    from ddtree_diag.training import draft as dt

    t0 = time.time()
    target_dir = ensure_target_dir()
    target, tokenizer = dt.load_target(target_dir, args.device)
    draft = load_draft(args.draft or default_draft_dir(), device=args.device, dtype=torch.float32)
    load_s = time.time() - t0
    budgets = [int(b) for b in args.budgets.split(",")]
    cells: dict[tuple[str, bool, int], Cell] = {}
    for thinking in [m == "on" for m in args.thinking.split(",")]:
        for set_name, prompts in _prompt_sets(args).items():
            records = dt.generate_greedy(target, tokenizer, prompts, args.max_tokens, 1, thinking)
            for record in records:
                values, indices = dt.depth_topk(
                    draft, target, record, draft.config.mask_token_id, max([*budgets, 1])
                )
                for budget in budgets:
                    lengths = dt.simulate_acceptance(record["response_ids"], values, indices, budget)
                    cell = cells.setdefault((set_name, thinking, budget), Cell())
                    cell.prompts += 1
                    cell.rounds += len(lengths)
                    cell.committed += sum(lengths)
                    cell.completion_tokens += len(record["response_ids"])
    return {
        "mode": "simulated",
        "target": str(target_dir),
        "draft": str(args.draft or default_draft_dir()),
        "load_seconds": round(load_s, 1),
        "max_tokens": args.max_tokens,
        "budgets": budgets,
        "cells": [_cell_row(s, t, b, c) for (s, t, b), c in cells.items()],
        "mismatches": [],
        "seconds": round(time.time() - t0, 1),
    }


def _prompt_sets(args: argparse.Namespace) -> dict[str, list[str]]:
    heldout_file = Path(__file__).resolve().parents[1] / "ddtree_diag" / "data" / "prompts" / "heldout.txt"
    heldout = [line.strip() for line in heldout_file.read_text().splitlines() if line.strip()]
    return {"smoke": [SMOKE_PROMPT], "heldout": heldout[: args.limit]}


def render(report: dict) -> str:
    cells = {(c["set"], c["thinking"], c["budget"]): c for c in report["cells"]}
    columns = sorted(
        {(c["set"], c["thinking"]) for c in report["cells"]}, key=lambda k: (k[0] != "smoke", k[1])
    )
    lines = [
        f"embedded default ({report['mode']}): target {Path(report['target']).name}, "
        f"draft {Path(report['draft']).name}, "
        f"T=0, max_tokens {report['max_tokens']}, load {report['load_seconds']}s, total {report['seconds']}s",
        "mean acceptance length (tokens per verify round, bonus included; pooled over prompts)",
        f"{'budget':>6} | "
        + " | ".join(f"{s} ({len_prompts(report, s)}) think {t}".rjust(22) for s, t in columns),
    ]
    for budget in report["budgets"]:
        row = []
        for s, t in columns:
            cell = cells.get((s, t, budget))
            acc = cell and cell["mean_acceptance"]
            tps = cell and cell["tokens_per_second"]
            row.append((f"{acc:.2f}" if acc else "-") + (f" ({tps:.1f} tok/s)" if tps else ""))
        lines.append(f"{budget:>6} | " + " | ".join(v.rjust(22) for v in row))
    total = sum(c["prompts"] for c in report["cells"])
    lossless = sum(c["lossless"] for c in report["cells"])
    if report["mode"] == "engine":
        lines.append(f"lossless vs SmolLM2 greedy (HF forward): {lossless}/{total} generations identical")
    else:
        lines.append("simulated from teacher-forced draft predictions (no decoding, lossless not checked)")
    lines += [f"  MISMATCH {m}" for m in report["mismatches"]]
    goal = cells.get(("heldout", "off", 64))
    if goal and goal["mean_acceptance"]:
        verdict = "met" if goal["mean_acceptance"] >= 2.5 else "NOT met"
        lines.append(
            f"goal: held-out, thinking off, budget 64, {report['max_tokens']}-token answers: "
            f"{goal['mean_acceptance']:.2f} (>= 2.5 {verdict})"
        )
    return "\n".join(lines)


def len_prompts(report: dict, set_name: str) -> int:
    return max((c["prompts"] for c in report["cells"] if c["set"] == set_name), default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0,4,16,64,256")
    parser.add_argument("--thinking", default="off,on", help="off,on | off | on")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="first N held-out prompts only")
    parser.add_argument("--draft", default=None, help="draft directory (default: the packaged one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument(
        "--simulate", action="store_true", help="fast: teacher-forced acceptance, no decoding"
    )
    args = parser.parse_args(argv)
    report = run_simulated(args) if args.simulate else run(args)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if not report["mismatches"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
