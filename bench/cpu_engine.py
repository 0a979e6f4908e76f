"""The embedded default on this machine's CPU: where a decode round's time goes, and a long
prompt's first token and peak memory.

The in-process engine (SmolLM2-135M-Instruct + its trained DFlash draft, fp32, the eager loop: the
CPU default) decodes one short prompt at each budget and one long prompt (the project README's
first 7,000 characters, ~2,300 tokens; 48 new tokens) at AR and one budget, after a warm-up run
of each. Per budget: tokens, rounds, mean acceptance, decode tok/s and ms per round by stage
(draft, tree, verify, commit); for the long prompt also the first token's time. The peak RSS
comes from a fresh process that loads the engine and answers the long prompt once.

    python -m bench.cpu_engine [--budgets 0,4,16,64] [--long-budget 16] [--max-tokens 96]

Figures move with the CPU and its load: compare runs made on one machine, one after the other.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SHORT_PROMPT = "Explain in a few sentences why the sky is blue."
LONG_PROMPT_CHARS = 7000


def long_prompt() -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")[:LONG_PROMPT_CHARS]
    return text + "\n\nSummarise the text above in two sentences."


def load():
    from ddtree_diag.engine import load_engine
    from ddtree_diag.engine.embedded import default_model

    target, draft = default_model()
    return load_engine(target, draft=draft)


def timed(engine, prompt_ids: list[int], budget: int, max_tokens: int) -> dict:
    engine.generate(prompt_ids=prompt_ids, tree_budget=budget, max_tokens=max_tokens)  # warm-up
    start = time.perf_counter()
    gen = engine.generate(prompt_ids=prompt_ids, tree_budget=budget, max_tokens=max_tokens)
    seconds = time.perf_counter() - start
    decode = seconds - gen.ttft_s
    rounds = max(gen.decode_rounds, 1)
    return {
        "budget": budget, "prompt_tokens": len(prompt_ids), "tokens": gen.completion_tokens,
        "rounds": gen.decode_rounds, "acceptance": gen.mean_acceptance_length or 1.0,
        "first_token_s": gen.ttft_s, "decode_tok_s": (gen.completion_tokens - 1) / decode if decode > 0 else None,
        "ms_per_round": 1000 * decode / rounds,
        "stages_ms": {stage: 1000 * value / rounds for stage, value in gen.stage_times.items()},
    }


def peak_rss_mib() -> float:
    """This process's peak RSS: /proc's VmHWM where there is one (Linux's ru_maxrss carries the
    forking parent's peak across exec), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_child(budget: int) -> None:
    """In a fresh process: load, answer the long prompt once, print the peak RSS in MiB."""
    engine = load()
    ids = engine.render_prompt([{"role": "user", "content": long_prompt()}])
    loaded = peak_rss_mib()
    engine.generate(prompt_ids=ids, tree_budget=budget, max_tokens=8)
    print(json.dumps({"loaded_mib": loaded, "peak_mib": peak_rss_mib(), "prompt_tokens": len(ids)}))


def row(result: dict) -> str:
    stages = " ".join(f"{stage} {ms:5.1f}" for stage, ms in result["stages_ms"].items())
    rate = result["decode_tok_s"]
    return (f"{result['budget']:>6} {result['prompt_tokens']:>6} {result['tokens']:>4} {result['rounds']:>6} "
            f"{result['acceptance']:>6.2f} {result['first_token_s'] * 1000:>7.0f} "
            f"{'—' if rate is None else f'{rate:.1f}':>6} {result['ms_per_round']:>7.1f}   {stages}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0,4,16,64")
    parser.add_argument("--long-budget", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens of the short prompt's runs")
    parser.add_argument("--peak-rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_rss_child is not None:
        peak_rss_child(args.peak_rss_child)
        return 0
    import torch

    engine = load()
    print(f"cpu_engine: {engine.info()['model']} on CPU, {torch.get_num_threads()} threads, "
          f"{engine.decode_path} path; ms per round by stage")
    print(f"{'budget':>6} {'prompt':>6} {'tok':>4} {'rounds':>6} {'accept':>6} {'1st ms':>7} {'tok/s':>6} "
          f"{'ms/rnd':>7}   stages (ms)")
    short = engine.render_prompt([{"role": "user", "content": SHORT_PROMPT}])
    results = [timed(engine, short, int(b), args.max_tokens) for b in args.budgets.split(",")]
    long_ids = engine.render_prompt([{"role": "user", "content": long_prompt()}])
    results += [timed(engine, long_ids, b, 48) for b in sorted({0, args.long_budget})]
    for result in results:
        print(row(result))
    child = subprocess.run(
        [sys.executable, "-m", "bench.cpu_engine", "--peak-rss-child", str(args.long_budget)],
        capture_output=True, text=True,
    )
    if child.returncode != 0:
        print(f"peak RSS: the measuring process failed (exit {child.returncode}):\n{child.stderr.strip()}")
        return 1
    peak = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"peak RSS, a fresh process answering the {peak['prompt_tokens']}-token prompt at budget "
          f"{args.long_budget}: {peak['peak_mib']:.0f} MiB (loaded: {peak['loaded_mib']:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
