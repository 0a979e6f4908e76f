"""In-process DDTree engine (torch + transformers): HF target + z-lab DFlash draft, lossless.

Importing this package is light: torch/transformers load only when ``load_engine`` is called.

    from ddtree_diag.engine import load_engine
    engine = load_engine(target, draft=None, gguf_file=None, device=None, dtype=None,
                         decode_path=None, model_name=None)
    engine.info(); engine.tokenizer; engine.render_prompt(messages, enable_thinking)
    gen = engine.generate(messages=..., enable_thinking=None, tree_budget=None, temperature=0.0,
                          max_tokens=256, seed=None, stop=None, top_logprobs=0, on_token=None,
                          mode="auto", prompt_ids=None, constraint=None)  # -> decode.Generation
    constraint = grammar.compile_constraint(engine.tokenizer, response_format=..., tools=...,
                                            tool_choice=..., thinking=False)  # None: free text
    engine.greedy_reference(prompt_ids, max_tokens, stop_ids=None)  # HF-only greedy baseline

Modules: ``arch`` (supported target architectures and how they differ, detected once),
``target`` (our target forward and its ``KVCache``), ``gdn`` (Gated DeltaNet layers over a tree),
``draft`` (DFlash draft + z-lab format), ``rope``, ``tree`` (best-first tree, mask, accept walk),
``decode`` (the decode interface, the ``DecodeContext`` decoders read, the bookkeeping they
share), ``grammar`` (constrained decoding with llguidance: JSON mode, JSON Schema, tool calls;
each tree node masked on its own path), ``eager`` (the reference loop), ``fast`` (the same
rounds with static shapes, device-side tree/accept and CUDA graphs), ``generate`` (``Engine``:
prompts, stop tokens, the decode-path setting; it builds the decoders), ``load`` (paths, GGUF,
tokenizer, checks), ``models`` and ``embedded`` (which target and draft), ``info`` (what was
loaded). An Engine runs one generation at a time (it owns one KV cache): callers that serve
concurrent requests must serialise them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddtree_diag.engine.generate import Engine


def load_engine(
    target: str | Path,
    draft: str | Path | None = None,
    gguf_file: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    decode_path: str | None = None,
    model_name: str | None = None,
) -> Engine:
    """Load a target (HF directory or GGUF) and an optional DFlash draft; see ``load.load_engine``.
    ``decode_path=None``: the fast rounds (``engine/fast``) on CUDA, the eager loop on CPU.
    ``model_name``: the name ``info()`` reports (default: ``models.model_id`` of the target)."""
    from ddtree_diag.engine.load import load_engine as _load

    return _load(target, draft=draft, gguf_file=gguf_file, device=device, dtype=dtype, decode_path=decode_path,
                 model_name=model_name)


__all__ = ["load_engine"]
