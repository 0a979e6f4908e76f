"""The embedded default on the real SmolLM2-135M-Instruct (CPU, fp32): the GGUF target itself,
cache fidelity, lossless DDTree decoding with the packaged draft, the thinking axis, and that the
draft is trained. (Draft training on it: tests/test_training_real_model.py.)

Slow (about a minute on 2 cores after the first ~30 s cache build): marked real_model. The GGUF
is dequantised once for the whole module (``gguf_engine``), the cached directory loaded once
(``engine``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import embedded  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.real_model]

SMOKE = [{"role": "user", "content": "Say hello in one short sentence."}]
HELDOUT = [{"role": "user", "content": "Explain how a credit card works."}]
# From ddtree_diag/data/prompts/train.txt: the draft saw the target's answer to it in training.
TRAINING = [{"role": "user", "content": "Write a short paragraph about batteries."}]


@pytest.fixture(scope="session")
def target_dir(embedded_target_dir):
    return embedded_target_dir


@pytest.fixture(scope="session")
def engine(target_dir):
    from ddtree_diag.engine import load_engine

    return load_engine(target_dir, draft=embedded.default_draft_dir(), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def gguf_engine(target_dir):
    """The engine on the GGUF file itself (transformers dequantises it on load), no draft."""
    from ddtree_diag.engine import load_engine

    return load_engine(embedded.find_gguf(), device="cpu", dtype="fp32")


def test_gguf_target_loads_and_ar_decode_equals_hf_greedy(gguf_engine):
    engine = gguf_engine
    info = engine.info()
    assert info["model_type"] == "llama" and info["layers"] == 30 and info["draft"] is None
    assert info["model"] == "SmolLM2-135M-Instruct"  # the same name as the cached directory's
    assert engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in info["stop_token_ids"]
    messages = [{"role": "user", "content": "Say hello in one short sentence."}]
    gen = engine.generate(messages=messages, enable_thinking=False, max_tokens=24)
    assert gen.mode == "ar" and gen.tree_budget == 0
    prompt = engine.render_prompt(messages, enable_thinking=False)
    assert gen.token_ids == engine.greedy_reference(prompt, 24)
    assert gen.text.strip() and gen.finish_reason in ("stop", "length")


def test_cached_fp32_weights_are_exactly_the_gguf_weights(gguf_engine, engine):
    from_gguf, cached = gguf_engine.target.hf, engine.target.hf
    assert cached.dtype == torch.float32 and engine.info()["model"] == "SmolLM2-135M-Instruct"
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    ids = torch.tensor([[1, 4093, 198, 36218, 33662, 281, 582, 1890, 6330, 30, 2]])
    with torch.no_grad():
        assert torch.equal(from_gguf(ids).logits, cached(ids).logits)


def test_thinking_on_and_off_render_different_prompts(engine):
    off = engine.render_prompt(SMOKE, enable_thinking=False)
    on = engine.render_prompt(SMOKE, enable_thinking=True)
    assert off != on and off[: len(on)] == on  # off = on + the empty think block
    assert engine.tokenizer.decode(off[len(on) :]) == "<think>\n\n</think>\n\n"
    assert engine.render_prompt(SMOKE) == on  # unset = thinking on (Qwen3 default)


@pytest.mark.parametrize(
    ("messages", "thinking", "budget"),
    [(SMOKE, False, 64), (HELDOUT, False, 16), (SMOKE, True, 64)],
    ids=["smoke", "heldout", "think"],
)
def test_ddtree_output_equals_smollm2_greedy(engine, messages, thinking, budget):
    gen = engine.generate(messages=messages, enable_thinking=thinking, tree_budget=budget, max_tokens=24)
    assert gen.mode == "tree" and gen.decode_rounds >= 1
    reference = engine.greedy_reference(engine.render_prompt(messages, enable_thinking=thinking), 24)
    assert gen.token_ids == reference
    assert gen.text.strip()


def test_trained_draft_gets_tokens_accepted(engine):
    # On text like its training data the draft must carry several tokens per round; an untrained
    # draft stays at ~1.0 (every round commits only the bonus token).
    gen = engine.generate(messages=TRAINING, enable_thinking=False, tree_budget=64, max_tokens=32)
    assert gen.mean_acceptance_length > 1.5
    assert gen.token_ids == engine.greedy_reference(engine.render_prompt(TRAINING, enable_thinking=False), 32)
