"""A long prompt's prefill in chunks (``target.PREFILL_CHUNK`` rows a forward), on both decode paths.

Each chunk attends to the rows committed before it and causally to itself; Gated DeltaNet layers
carry their recurrent state and conv window from chunk to chunk. CUDA chunks long prompts; on CPU
the tests set a tiny chunk so a 17-token prompt takes several: the tokens must stay the target's
own greedy decode (HF's forward and cache), and the prefill's logits, features and state must
equal one whole-prompt forward up to float rounding.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine import target as target_module  # noqa: E402
from ddtree_diag.engine.fast import decoder as fast_decoder  # noqa: E402
from ddtree_diag.engine.target import prefill_chunks  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

PROMPT = list(range(40, 57))  # 17 tokens
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill")
    draft = fx.make_draft(root / "draft", block_size=4)
    targets = {
        "qwen3": fx.make_target(root / "qwen3"),
        "qwen3_5": fx.make_hybrid_target(root / "qwen3_5", pattern="LLAL"),
        "qwen3_next": fx.make_hybrid_target(root / "qwen3_next", kind="qwen3_next", pattern="ALLA"),
    }
    return {name: load_engine(path, draft, device="cpu", dtype="fp32") for name, path in targets.items()}


def test_chunks_cover_the_prompt_in_order(monkeypatch):
    assert prefill_chunks(17, "cpu", 5) == [(0, 5), (5, 10), (10, 15), (15, 17)]
    assert prefill_chunks(4, "cpu", 5) == [(0, 4)] and prefill_chunks(0, "cpu", 5) == []
    # CUDA: in chunks; CPU: whole (the eager prompt's causal mode needs no mask)
    cuda = target_module.PREFILL_CHUNK["cuda"]
    assert prefill_chunks(cuda + 1, "cuda:0") == [(0, cuda), (cuda, cuda + 1)]
    assert prefill_chunks(cuda + 1, "cpu") == [(0, cuda + 1)]
    monkeypatch.setitem(target_module.PREFILL_CHUNK, "cpu", 8)
    assert prefill_chunks(17, torch.device("cpu")) == [(0, 8), (8, 16), (16, 17)]


@pytest.mark.parametrize("chunk", (1, 5))
@pytest.mark.parametrize("model", ("qwen3", "qwen3_5", "qwen3_next"))
def test_a_chunked_prompt_decodes_to_the_targets_greedy_tokens_on_both_paths(engines, monkeypatch, model, chunk):
    engine = engines[model]
    reference = engine.greedy_reference(PROMPT, MAX_TOKENS, stop_ids=[])
    monkeypatch.setitem(target_module.PREFILL_CHUNK, "cpu", chunk)
    forwards: list[int] = []  # the fast path's prompt forwards, by rows
    fast = engine.decoder("fast-nograph")
    original = fast._target_forward

    def counted(tokens, *args, **kwargs):
        if kwargs.get("parents") is None and not kwargs.get("compiled", True):
            forwards.append(tokens.shape[0])
        return original(tokens, *args, **kwargs)

    monkeypatch.setattr(fast, "_target_forward", counted)
    previous = engine.decode_path
    try:
        for budget in (0, 4):
            runs = {}
            for path in ("eager", "fast-nograph"):
                engine.use_path(path)
                runs[path] = engine.generate_ids(PROMPT, tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[])
                assert runs[path].token_ids == reference, (path, budget)
            assert runs["eager"].acceptance_lengths == runs["fast-nograph"].acceptance_lengths
    finally:
        engine.use_path(previous)
    assert forwards == [end - begin for begin, end in prefill_chunks(len(PROMPT), "cpu", chunk)] * 2


@pytest.mark.parametrize("model", ("qwen3", "qwen3_5"))
def test_chunked_prefill_equals_one_forward_up_to_rounding(engines, monkeypatch, model):
    target = engines[model].target
    prompt = torch.tensor(PROMPT)
    layers = [0, 2]
    results = {}
    for chunk in (None, 5):
        monkeypatch.setitem(target_module.PREFILL_CHUNK, "cpu", chunk)
        target.reset(64)
        logits, features = target.prefill(prompt, layers)
        assert target.length == len(PROMPT)
        # the committed conv window owns its storage (a view would pin the chunk's whole conv input)
        assert all(target.conv[i].untyped_storage().nbytes() == target.conv[i].nbytes for i in target.linear_layers)
        state = {i: (target.recurrent[i].clone(), target.conv[i].clone()) for i in target.linear_layers}
        results[chunk] = (logits, features, target.kv.k[:, :, :, : len(PROMPT)].clone(), state)
    (logits, features, keys, state), (c_logits, c_features, c_keys, c_state) = results.values()
    assert c_logits.shape == logits.shape == (1, target.config.vocab_size)
    assert set(c_state) == set(state) == set(target.linear_layers)
    pairs = [(c_logits, logits), (c_features, features), (c_keys, keys)]
    pairs += [pair for index in state for pair in zip(c_state[index], state[index], strict=True)]
    for got, want in pairs:
        # fp32 GEMMs over other row counts: rounding apart, relative to the tensor's size
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1.0)


def test_the_fast_prefills_attention_bias_is_bounded_by_the_chunk(engines, monkeypatch):
    engine = engines["qwen3"]
    monkeypatch.setitem(target_module.PREFILL_CHUNK, "cpu", 5)
    shapes: list[tuple[int, ...]] = []
    original = fast_decoder.additive_mask

    def recorded(mask, dtype):
        shapes.append(tuple(mask.shape))
        return original(mask, dtype)

    monkeypatch.setattr(fast_decoder, "additive_mask", recorded)
    previous = engine.decode_path
    try:
        engine.use_path("fast-nograph")
        engine.generate_ids(PROMPT, tree_budget=0, max_tokens=2, stop_token_ids=[])
    finally:
        engine.use_path(previous)
    rep = engine.target.heads // engine.target.kv_heads
    prompt_biases = shapes[: len(prefill_chunks(len(PROMPT), "cpu", 5))]
    assert [rows for *_, rows, _ in prompt_biases] == [rep * 5, rep * 5, rep * 5, rep * 2]
