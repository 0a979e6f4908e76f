"""A long prompt's prefill: the first token's time and the peak memory, whole or in chunks.

Random-weight targets of bench.engine_speed's shapes (8B on CUDA, the small one on CPU). Each
configuration (prompt length, decode path, prefill chunk) runs in a fresh process: a warm-up
request of 64 tokens, then the long prompt at tree budget 16 for 8 new tokens. Printed per row:
the first token's seconds, the peak memory (CUDA: allocated by torch; CPU: the process's peak
RSS) and whether the tokens equal those of the whole-prompt run of the same path.

    python -m bench.long_prompt                       # CUDA: 8b at 8k/32k tokens, eager and fast
    python -m bench.long_prompt --shape small --tokens 24000 --paths eager,fast-nograph   # CPU

"chunk" is ``target.PREFILL_CHUNK`` for the device: "whole" runs the prompt as one forward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def child(shape: str, tokens: int, path: str, chunk: int | None) -> dict:
    import torch

    from bench.cpu_engine import peak_rss_mib
    from bench.engine_speed import build
    from ddtree_diag.engine import target as target_module

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    target_module.PREFILL_CHUNK[device] = chunk
    engine = build(shape, device, torch.bfloat16 if cuda else torch.float32, block_size=16, draft_layers=5)
    engine.use_path(path)
    vocab = engine.target.config.vocab_size
    prompt = [(i * 7919) % (vocab - 2) for i in range(tokens)]
    engine.generate_ids(prompt[:64], tree_budget=16, max_tokens=4, stop_token_ids=[])  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gen = engine.generate_ids(prompt, tree_budget=16, max_tokens=8, stop_token_ids=[])
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mib()
    return {"first_token_s": gen.ttft_s, "peak_mib": peak, "tokens": gen.token_ids, "device": device}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="bench.engine_speed shape (default: 8b on CUDA, small on CPU)")
    parser.add_argument("--tokens", default="8192,32768", help="comma list of prompt lengths")
    parser.add_argument("--paths", default="eager,fast")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        shape, tokens, path, chunk = args.child
        print(json.dumps(child(shape, int(tokens), path, int(chunk) or None)))
        return 0
    import torch

    from ddtree_diag.engine.target import PREFILL_CHUNK

    chunk_rows = PREFILL_CHUNK["cuda"]  # the CUDA default, on either device
    shape = args.shape or ("8b" if torch.cuda.is_available() else "small")
    print(f"shape {shape}; prompt lengths {args.tokens}; chunk {chunk_rows} rows or the whole prompt")
    print(f"{'tokens':>7} {'path':>13} {'chunk':>6} {'first token s':>14} {'peak MiB':>9}  tokens == whole")
    for tokens in map(int, args.tokens.split(",")):
        for path in args.paths.split(","):
            whole = None
            for chunk in (0, chunk_rows):
                out = subprocess.run(
                    [sys.executable, "-m", "bench.long_prompt", "--child", shape, str(tokens), path, str(chunk)],
                    capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                )
                if out.returncode != 0:
                    last = (out.stderr.strip().splitlines() or ["?"])[-1]
                    print(f"{tokens:>7} {path:>13} {chunk or 'whole':>6}  failed: {last}")
                    continue
                result = json.loads(out.stdout.strip().splitlines()[-1])
                if not chunk:
                    whole = result["tokens"]
                same = "—" if not chunk or whole is None else ("yes" if result["tokens"] == whole else "no")
                print(f"{tokens:>7} {path:>13} {chunk or 'whole':>6} {result['first_token_s']:>14.2f} "
                      f"{result['peak_mib']:>9.0f}  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
