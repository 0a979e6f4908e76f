"""A long answer's per-round host work: the output's text (stop strings, the stream) and top_logprobs.

Feeds a long output through ``GenerationRecorder`` in rounds of 4 tokens with a stop string and a
stream, as a decode loop does, and prints the host's ms per round at a few output lengths with
the text decoded from an anchor (the default) and whole every round; then what top_logprobs keep
per output token. Usage: ``python -m bench.long_output [--tokens 16384]`` (``make bench-long-output``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ddtree_diag.engine.decode import DecodeRequest, GenerationRecorder

ROUND = 4
TEXT = ("Speculative decoding keeps the target's text: the draft proposes, the target verifies — "
        "unicode too (ünïcödé, 漢字, 🙂). ")


def tokenizer():
    """The embedded SmolLM2's tokenizer (a real 49k-entry byte-level BPE)."""
    from transformers import AutoTokenizer

    from ddtree_diag.engine import embedded

    return AutoTokenizer.from_pretrained(embedded.ensure_target_dir())


def host_ms(ids: list[int], decode, incremental: bool, marks: list[int]) -> dict[int, float]:
    """Mean host ms of a round (bookkeeping, text, stop check, stream) over the 64 rounds up to
    each mark."""
    request = DecodeRequest(prompt_ids=[1], mode="tree", tree_budget=16, max_tokens=len(ids), stop_ids=set(),
                            stop=["NEVER PRESENT"], on_token=lambda _ids, _text: True)
    record = GenerationRecorder(request, decode, incremental=incremental)
    record.first_token(ids[0])
    near: dict[int, list[float]] = {mark: [] for mark in marks}
    position = 1
    while not record.done:
        started = time.perf_counter()
        record.round(ids[position : position + ROUND], tree_size=16)
        seconds = time.perf_counter() - started
        position += ROUND
        for mark in marks:
            if mark - 64 * ROUND < position <= mark:  # the 64 rounds up to the mark
                near[mark].append(seconds)
    assert record.result().text == decode(ids)
    return {mark: 1000 * sum(times) / len(times) for mark, times in near.items() if times}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    tok = tokenizer()
    ids = tok.encode(TEXT * (args.tokens // 20 + 1))[: args.tokens]
    marks = [m for m in (1024, 4096, 8192, 16384, 32768) if m <= len(ids)] or [len(ids)]
    print(f"long_output: {len(ids)} tokens in rounds of {ROUND}, SmolLM2 tokenizer, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("host ms per round at output length " + " / ".join(f"{m:,}" for m in marks))
    for incremental in (True, False):
        figures = host_ms(ids, lambda part: tok.decode(part, skip_special_tokens=True), incremental, marks)
        label = "from an anchor" if incremental else "whole each round"
        print(f"  {label:>18}: " + " / ".join(f"{figures[m]:.3f}" for m in marks if m in figures))
    vocab, k = 151936, 5
    print(f"top_logprobs={k} kept per output token: {2 * k * 4 + 4} bytes (top values, ids, own log-prob; "
          f"was a {vocab:,}-entry fp32 row, {4 * vocab:,} bytes: {4 * vocab * len(ids) / 2**30:.1f} GiB "
          f"at {len(ids):,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
