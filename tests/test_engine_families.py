"""The engine on the dense families' config variants, against HF's own greedy decode (CPU, fp32).

Each variant is a tiny random-weight checkpoint written to disk and loaded through the real loader.
The ground truth is HF's own forward of the same weights over the whole sequence (no cache): every
token of the engine's AR decode must be its argmax there, and the eager loop and the fast path's CPU
twin must give those tokens at every budget. The sliding-window variants use a window
shorter than the prompt, so attention that slides where HF does not (or not where it does) shows.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.arch import layer_windows  # noqa: E402
from ddtree_diag.engine.divergence import first_divergence  # noqa: E402
from ddtree_diag.engine.info import engine_info_rows  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

WINDOW = 6
PROMPT = list(range(40, 57))  # 17 tokens: longer than the window
MAX_TOKENS = 20
NEAR_TIE = 1e-4  # nats: a tie to float rounding, see the test

VARIANTS = {
    # Qwen2/Qwen3 slide only from max_window_layers on, and only with use_sliding_window
    "qwen2-upper-layers-slide": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3-window-set-no-layer-slides": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW)),
    "qwen3-window-off": ("qwen3", dict(use_sliding_window=False, sliding_window=WINDOW)),
    # Mistral slides every layer
    "mistral-every-layer-slides": ("mistral", dict(sliding_window=WINDOW)),
    "mistral-no-window": ("mistral", dict(sliding_window=None)),
    # Ministral: Mistral with sliding layers by layer_types; Llama ignores a sliding_window
    "ministral-alternating-layers": (
        "ministral", dict(sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"] * 2),
    ),
    "llama-window-ignored": ("llama", dict(sliding_window=WINDOW)),
    "llama-biases-tied-head": ("llama", dict(mlp_bias=True, tie_word_embeddings=True)),
    "llama-llama3-rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ))),
    "llama-yarn-rope": ("llama", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
    ))),
    "qwen3-one-kv-head": ("qwen3", dict(num_key_value_heads=1)),
    # SmolLM3: every fourth layer without rotary (NoPE), and with sliding on, those layers slide;
    # Seed-OSS: Llama with an output-projection bias
    "smollm3-nope-layers": ("smollm3", dict(num_hidden_layers=4)),
    "smollm3-nope-sliding": ("smollm3", dict(use_sliding_window=True, sliding_window=WINDOW)),
    "smollm3-layer-types-without-the-switch": ("smollm3", dict(
        use_sliding_window=False, sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )),
    "seed-oss-biases": ("seed_oss", dict(attention_bias=True, attention_out_bias=True)),
    # Gemma 3: sandwich norms, a rotary table per layer type (the sliding layers' own base), a
    # query scale that is not head_dim's, the embedding scale, GELU; sliding layers by layer_types
    "gemma3-sliding-local-rope": ("gemma3_text", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=64, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1_000_000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10.0)},
    )),
    # mixture-of-experts kin (fixtures' SMALL_MOE): Qwen3-MoE with a dense layer among the sparse
    # ones, and sliding everywhere once switched on; Qwen2-MoE's shared expert, and its sliding
    # layers (every other one below max_window_layers); Mixtral slides every layer like Mistral;
    # GLM-MoE: partial rotary, q/k norms, a first dense layer, a shared expert, a sigmoid router
    "qwen3-moe-dense-layer": ("qwen3_moe", dict(mlp_only_layers=[1])),
    "qwen3-moe-sliding": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=WINDOW)),
    "qwen2-moe-sliding-layers": (
        "qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3),
    ),
    "mixtral-every-layer-slides": ("mixtral", dict(sliding_window=WINDOW)),
    "glm4-moe": ("glm4_moe", dict(use_qk_norm=True, first_k_dense_replace=1, n_shared_experts=1)),
    # OLMo 2 / 3: post norms (no input norm), q/k normed over all heads at once; OLMo 3 slides its
    # layer_types layers, with a rotary table per layer type
    "olmo2-post-norms": ("olmo2", dict(pad_token_id=0)),
    "olmo3-sliding-layers": ("olmo3", dict(
        pad_token_id=0, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )),
    # Phi-3 / Phi-4: one q|k|v linear, a fused gate|up MLP; Phi-4-mini's partial rotary with
    # longrope factors (the short ones below original_max_position_embeddings); a window slides all
    "phi3-fused-qkv": ("phi3", dict(pad_token_id=0)),
    "phi4-mini-partial-rotary-longrope": ("phi3", dict(pad_token_id=0, original_max_position_embeddings=128,
                                                       max_position_embeddings=512, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
        short_factor=[1.0, 1.1, 1.2, 1.5, 2.0, 3.0], long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    ))),
    "phi3-sliding": ("phi3", dict(pad_token_id=0, sliding_window=WINDOW)),
    # EXAONE 4: post norms with per-head q/k norms; with a window, its layer_types layers slide and
    # its full-attention layers have no rotary
    "exaone4-hybrid-nope": ("exaone4", dict(
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )),
    "exaone4-full": ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 4)),
    # Granite: multipliers on the embeddings, each half's output and (a divisor) the logits, and
    # an attention scale that is not head_dim's
    "granite-multipliers": ("granite", dict(
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0,
    )),
    # multi-head latent attention: DeepSeek-V3 (a low-rank q, rotary pairs interleaved in the
    # weights, yarn with its attention-scale correction), GLM-4.7-Flash (a full-rank q)
    "deepseek-v3-latent-attention": ("deepseek_v3", dict(rope_interleave=True)),
    "deepseek-v3-yarn": ("deepseek_v3", dict(rope_interleave=False, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
    ))),
    "glm4-moe-lite-latent-attention": ("glm4_moe_lite", dict(rope_interleave=True)),
    "deepseek-v2-complex-rotary": ("deepseek_v2", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
        beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
    ))),
    # gpt-oss: attention sinks, rotary on a head's halves, q/k/v/o biases, every other layer slides
    "gpt-oss-sinks": ("gpt_oss", dict(sliding_window=WINDOW, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=128,
        beta_fast=32.0, beta_slow=1.0, truncate=False,
    ))),
}

# Each variant's windows, layer by layer, as HF's layers apply them.
EXPECTED_WINDOWS = {
    "qwen2-upper-layers-slide": (None, None, WINDOW, WINDOW),
    "qwen3-window-set-no-layer-slides": (None,) * 4,
    "qwen3-window-off": (None,) * 4,
    "mistral-every-layer-slides": (WINDOW,) * 4,
    "mistral-no-window": (None,) * 4,
    "ministral-alternating-layers": (None, WINDOW) * 2,
    "llama-window-ignored": (None,) * 4,
    "qwen3-moe-sliding": (WINDOW,) * 4,
    "smollm3-nope-sliding": (None, None, None, WINDOW),
    "smollm3-layer-types-without-the-switch": (None, WINDOW, None, WINDOW),
    "gemma3-sliding-local-rope": (WINDOW, WINDOW, None, WINDOW),
    "olmo3-sliding-layers": (WINDOW, WINDOW, WINDOW, None),
    "phi3-sliding": (WINDOW,) * 4,
    "exaone4-hybrid-nope": (WINDOW, WINDOW, WINDOW, None),
    "exaone4-full": (None,) * 4,
    "qwen2-moe-sliding-layers": (WINDOW, None, WINDOW, None),
    "mixtral-every-layer-slides": (WINDOW,) * 4,
    "glm4-moe": (None,) * 4,
    "gpt-oss-sinks": (WINDOW, None) * 2,
}


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return fx.make_draft(tmp_path_factory.mktemp("families") / "draft", block_size=4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_budget_and_both_paths_give_hf_greedy_tokens(variant, draft, tmp_path):
    model_type, config = VARIANTS[variant]
    engine = load_engine(fx.make_target(tmp_path / variant, model_type=model_type, **config), draft, device="cpu")
    tables = {  # SmolLM3: every fourth layer without rotary; Gemma 3: one table per layer type
        "smollm3": ("", "", "", None),
        "gemma3_text": ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention"),
        "olmo3": ("sliding_attention",) * 3 + ("full_attention",) if variant == "olmo3-sliding-layers" else None,
        "exaone4": ("", "", "", None) if variant == "exaone4-hybrid-nope" else None,
    }
    assert engine.target.arch.rope_tables == (tables.get(model_type) or ("",) * 4)
    assert engine.target.arch.sandwich_norms == (model_type == "gemma3_text")
    olmo = model_type in ("olmo2", "olmo3")
    assert (engine.target.arch.post_norms, engine.target.arch.qk_norm_whole) == (olmo or model_type == "exaone4", olmo)
    latent = model_type in ("deepseek_v3", "glm4_moe_lite", "deepseek_v2")
    assert engine.target.arch.latent_attention == latent
    if latent:  # K and V expanded per head: q/k 16 + 8 dims, v 12
        assert (engine.target.head_dim, engine.target.v_head_dim, engine.target.kv_heads) == (24, 12, 4)
        rows = dict(engine_info_rows(engine.info() | {"model": "m", "target_path": "t", "draft_path": "d"}))
        assert rows["latent attention"] == "latent 16; per head q/k 24 (8 rotary), v 12"
    if variant in EXPECTED_WINDOWS:
        windows = EXPECTED_WINDOWS[variant]
        assert engine.target.arch.windows == windows
        rows = dict(engine_info_rows(engine.info() | {"model": "m", "target_path": "t", "draft_path": "d"}))
        sliding = sum(window is not None for window in windows)
        assert rows.get("sliding window") == (f"{WINDOW} tokens on {sliding} of 4 layers" if sliding else None)
        assert ("mixture of experts" in rows) == (model_type in fx.SMALL_MOE)
        if model_type in fx.SMALL_MOE:
            assert rows["mixture of experts"].startswith("4 experts, 2 a token")
        assert ("attention sinks" in rows) == (model_type == "gpt_oss")
    # The ground truth: HF's own forward over the whole sequence (its masks and rotary, no cache):
    # each token of the eager AR decode must be its argmax there. (HF's cached decode is not one:
    # its cache slides whenever a config sets sliding_window, even where its Llama layers do not.)
    # Random weights can tie two tokens to a rounding step, and which one wins then depends on the
    # CPU's sum order (an AVX SIMD width breaks such a tie otherwise than AVX2): a token may lose
    # to another by at most NEAR_TIE nats, far below any real fault's gap.
    expected = engine.generate_ids(PROMPT, tree_budget=0, max_tokens=MAX_TOKENS, stop_token_ids=[]).token_ids
    with torch.no_grad():
        logits = engine.target.hf(torch.tensor([PROMPT + expected])).logits[0, len(PROMPT) - 1 : -1]
    picked = logits.gather(1, torch.tensor(expected)[:, None])[:, 0]
    shortfall = logits.max(dim=-1).values - picked
    assert float(shortfall.max()) <= NEAR_TIE, (shortfall.argmax().item(), float(shortfall.max()))
    previous = engine.decode_path
    try:
        for path in ("eager", "fast-nograph"):
            engine.use_path(path)
            for budget in (0, 4, 16):
                gen = engine.generate_ids(PROMPT, tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[])
                divergence = first_divergence(engine.target.hf, PROMPT, expected, gen.token_ids, near_tie_gap=NEAR_TIE)
                assert len(gen.token_ids) == len(expected), (path, budget)
                assert divergence is None or divergence.near_tie, (path, budget, divergence.describe())
    finally:
        engine.use_path(previous)


def test_layer_windows_read_each_layers_own_choice():
    from types import SimpleNamespace

    def layers(*attention_windows):
        made = []
        for window in attention_windows:
            attn = SimpleNamespace() if window == "absent" else SimpleNamespace(sliding_window=window)
            made.append(SimpleNamespace(self_attn=attn))
        return made

    def config(model_type, **fields):
        return SimpleNamespace(model_type=model_type, **fields)

    # the module's own attribute wins (Qwen2/Qwen3: None on the full-attention layers)
    assert layer_windows(config("qwen3", sliding_window=8, use_sliding_window=True), layers(None, 8, None)) == (
        None, 8, None,
    )
    # a Qwen module that does not say: the config's layer_types
    typed = config("qwen2", sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    assert layer_windows(typed, layers("absent", "absent")) == (None, 8)
    # Mistral: every layer, whatever layer_types says (HF ignores it); Llama never slides
    mistral = config("mistral", sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    assert layer_windows(mistral, layers("absent", "absent")) == (8, 8)
    assert layer_windows(config("llama", sliding_window=8), layers("absent", "absent")) == (None, None)
    # switched off, absent, zero: no window; linear (Gated DeltaNet) layers never have one
    off = config("mistral", sliding_window=8, use_sliding_window=False)
    assert layer_windows(off, layers("absent")) == (None,)
    assert layer_windows(config("mistral"), layers("absent")) == (None,)
    assert layer_windows(config("mistral", sliding_window=0), layers("absent")) == (None,)
    linear = [SimpleNamespace(linear_attn=object()), *layers("absent")]
    assert layer_windows(config("mistral", sliding_window=8), linear, linear=(0,)) == (None, 8)


def test_harmony_turns_end_at_return_not_at_a_messages_end():
    from types import SimpleNamespace

    from ddtree_diag.engine.arch import stop_tokens

    # gpt-oss: <|end|> closes the analysis message before the final answer; <|return|> / <|call|> end the turn
    harmony = {"<|start|>": 1, "<|end|>": 2, "<|return|>": 3, "<|call|>": 4, "<|channel|>": 5}
    assert sorted(stop_tokens(harmony)) == [3, 4]
    # elsewhere (Phi-3's template) <|end|> ends the turn
    assert stop_tokens({"<|end|>": 7, "<|assistant|>": 8}) == [7]
    # GLM: an answer ends by opening the next turn (<|user|>) or a tool result's (<|observation|>)
    glm = {"<|user|>": 5, "<|observation|>": 6, "<|endoftext|>": 4, "<|assistant|>": 3}
    assert sorted(stop_tokens(glm)) == [4, 5, 6]
    assert stop_tokens({"<|im_end|>": 9, "hello": 10}) == [9]
    # the likelihood check scores <|return|> as gpt-oss's end of an answer, not its <|endoftext|>
    from ddtree_diag.checks.likelihood import _end_of_turn_id

    vocab = {**harmony, "<|endoftext|>": 6}
    tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda name: vocab.get(name))
    assert _end_of_turn_id(tokenizer, sorted([6, *stop_tokens(vocab)])) == 3
    tokenizer = SimpleNamespace(convert_tokens_to_ids=lambda name: glm.get(name))
    assert _end_of_turn_id(tokenizer, stop_tokens(glm)) == 5


def test_a_gemma3_checkpoint_with_a_vision_tower_runs_its_text_model_with_a_draft(draft, tmp_path):
    """Gemma 3 from 4B up ships as a vision-language model: the engine runs its language model, and
    the draft is checked against the text config (the wrapper's config has no hidden size)."""
    fx.make_gemma3_vlm_target(tmp_path, sliding_window=WINDOW)
    engine = load_engine(tmp_path, draft, device="cpu")
    assert engine.target.windows == (WINDOW, WINDOW, None, WINDOW)
    expected = engine.generate_ids(PROMPT, tree_budget=0, max_tokens=MAX_TOKENS, stop_token_ids=[]).token_ids
    with torch.no_grad():
        logits = engine.target.hf(input_ids=torch.tensor([PROMPT + expected])).logits[0]
    assert logits[len(PROMPT) - 1 : -1].argmax(dim=-1).tolist() == expected
    assert engine.generate_ids(PROMPT, tree_budget=16, max_tokens=MAX_TOKENS, stop_token_ids=[]).token_ids == expected


@pytest.mark.parametrize("head_dim", [64, 24])  # a power-of-two scale, and one that is not
def test_attention_with_sinks_equals_hfs_softmax_over_scores_and_sinks(head_dim):
    """The engine's sink formulation (one more key slot, its score carried in an extra q/k dim)
    against HF's gpt-oss attention (the sinks concatenated to the scores), with GQA, a tree-like
    mask, and in the fast path's folded layout (the query heads of a KV head as row blocks)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from ddtree_diag.engine.target import attend_with_sinks, sink_bias

    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, rows, keys = 8, 2, 5, 11
    q = torch.randn(1, heads, rows, head_dim, generator=generator)
    k = torch.randn(1, kv_heads, keys, head_dim, generator=generator)
    v = torch.randn(1, kv_heads, keys, head_dim, generator=generator)
    sinks = torch.randn(heads, generator=generator) * 2
    allowed = torch.rand(rows, keys, generator=generator) > 0.4
    allowed[:, 0] = True  # every row sees something
    scale = head_dim**-0.5
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    additive = torch.zeros(rows, keys).masked_fill_(~allowed, float("-inf"))[None, None]
    want, _ = eager_attention_forward(module, q, k, v, additive, scale)  # [1, rows, heads, D]
    bias = sink_bias(allowed[None, None], torch.float32)
    got = attend_with_sinks(q, k, v, bias, sinks.view(1, -1, 1, 1), scale, enable_gqa=True)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-6)
    rep = heads // kv_heads  # the fast path's layout: [1, kv_heads, rep * rows, D]
    folded_sinks = sinks.view(kv_heads, rep, 1).expand(-1, -1, rows).reshape(1, kv_heads, rep * rows, 1)
    folded_bias = sink_bias(allowed.repeat(rep, 1)[None, None], torch.float32)
    folded = attend_with_sinks(q.reshape(1, kv_heads, rep * rows, head_dim), k, v, folded_bias, folded_sinks, scale)
    torch.testing.assert_close(folded.reshape(1, heads, rows, head_dim).transpose(1, 2), want, rtol=1e-5, atol=1e-6)
    # and the sinks matter here: without them the result is another one
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, additive, scale=scale, enable_gqa=True)
    assert not torch.allclose(plain.transpose(1, 2), want, atol=1e-3)


@pytest.mark.parametrize("model_type", sorted(fx.DENSE_FAMILIES))
def test_every_family_decodes_in_bf16_on_both_paths(model_type, draft, tmp_path):
    """bf16, the GPU default, where a family's modules may hand back another dtype than they take
    (OLMo's rotary gives fp32 cos/sin to bf16 heads): both decode paths run a tree round and an AR
    decode to the end. (Which tokens bf16 gives is for the GPU check's near-tie judge, not here.)"""
    target = fx.make_target(tmp_path / model_type, model_type=model_type)
    engine = load_engine(target, draft, device="cpu", dtype="bf16")
    assert engine.target.hf.dtype == torch.bfloat16
    vocab = engine.target.hf.get_output_embeddings().weight.shape[0]
    for path in ("eager", "fast-nograph"):
        engine.use_path(path)
        for budget in (0, 4):
            gen = engine.generate_ids(PROMPT, tree_budget=budget, max_tokens=6, stop_token_ids=[])
            assert len(gen.token_ids) == 6, (path, budget)
            assert all(0 <= token < vocab for token in gen.token_ids)


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3", "llama"])
def test_rotary_keeps_the_heads_dtype_and_hfs_rounding(model_type):
    """HF's rotary modules give OLMo fp32 cos/sin (turned in fp32, rounded once to the heads'
    dtype) and the others cos/sin in the heads' dtype: ``apply_rope`` returns the heads' dtype and
    HF's bits either way."""
    import importlib

    from ddtree_diag.engine.rope import apply_rope

    hf = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 7, 16, generator=generator).to(torch.bfloat16)
    k = torch.randn(1, 2, 7, 16, generator=generator).to(torch.bfloat16)
    angles = torch.arange(7.0)[:, None] * torch.logspace(0, -3, 8)[None]
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1)[None], torch.cat([angles.sin()] * 2, dim=-1)[None]
    if model_type == "llama":
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    assert got_q.dtype == got_k.dtype == torch.bfloat16
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
