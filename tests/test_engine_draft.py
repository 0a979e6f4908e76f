"""DFlash draft module: z-lab format round trip, format variants, cache contract."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

F = torch.nn.functional

from ddtree_diag.engine.draft import DFlashDraft, DraftConfig, load_draft, save_draft  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402

pytestmark = pytest.mark.engine


def tiny_config(**overrides) -> DraftConfig:
    fields = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, target_layer_ids=[0, 2], mask_token_id=299, block_size=4,
        num_target_layers=4, head_dim=16, vocab_size=300,
    )
    fields.update(overrides)
    return DraftConfig(**fields)


def random_draft(config: DraftConfig, seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    model = DFlashDraft(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def inputs(config: DraftConfig, ctx_len: int = 5, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, config.block_size, config.hidden_size, generator=gen)
    ctx = torch.randn(1, ctx_len, len(config.target_layer_ids) * config.hidden_size, generator=gen)
    return noise, ctx


def test_save_load_round_trip_is_exact_and_in_zlab_format(tmp_path):
    config = tiny_config()
    model = random_draft(config)
    save_draft(model, config, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["block_size"] == 4 and raw["num_target_layers"] == 4
    assert raw["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": 299}
    assert raw["layer_types"] == ["full_attention", "full_attention"]
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    for key in (
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_proj.weight",
        "layers.0.self_attn.k_norm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    ):
        assert key in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)

    loaded = load_draft(tmp_path)
    noise, ctx = inputs(config)
    pos_ctx, pos_noise = torch.arange(5), torch.arange(5, 9)
    with torch.no_grad():
        assert torch.equal(model(noise, ctx, pos_noise, pos_ctx), loaded(noise, ctx, pos_noise, pos_ctx))


def test_cache_keeps_context_only_and_matches_one_shot():
    config = tiny_config()
    model = random_draft(config)
    noise, ctx = inputs(config, ctx_len=7)
    with torch.no_grad():
        one_shot = model(noise, ctx, torch.arange(7, 11), torch.arange(7))
        cache = model.new_cache(32)
        model(noise, ctx[:, :3], torch.arange(3, 7), torch.arange(3), kv_cache=cache)
        assert cache.length == 3  # the noise block was not stored
        chunked = model(noise, ctx[:, 3:], torch.arange(7, 11), torch.arange(3, 7), kv_cache=cache)
        assert cache.length == 7
    torch.testing.assert_close(chunked, one_shot, rtol=1e-5, atol=1e-5)


def test_attention_mask_all_true_equals_none_and_masking_changes_output():
    config = tiny_config()
    model = random_draft(config)
    noise, ctx = inputs(config)
    args = (noise, ctx, torch.arange(5, 9), torch.arange(5))
    full = torch.ones(1, 1, 4, 9, dtype=torch.bool)
    hidden_context = full.clone()
    hidden_context[..., 2:5] = False  # hide three context tokens
    with torch.no_grad():
        torch.testing.assert_close(model(*args, attention_mask=full), model(*args))
        assert not torch.allclose(model(*args, attention_mask=hidden_context), model(*args))


def test_format_variants_load(tmp_path):
    # Newer drafts: block_size in dflash_config, rope_parameters, no layer_types; heads*head_dim != hidden.
    config = tiny_config(num_attention_heads=4, head_dim=32)
    model = random_draft(config)
    save_draft(model, config, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["dflash_config"]["block_size"] = raw.pop("block_size")
    raw.pop("layer_types")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_draft(tmp_path)
    assert loaded.config.block_size == 4 and loaded.config.dim_per_head == 32
    noise, ctx = inputs(config)
    with torch.no_grad():
        out = loaded(noise, ctx, torch.arange(5, 9), torch.arange(5))
    assert out.shape == (1, 4, 64)
    assert torch.equal(out, model(noise, ctx, torch.arange(5, 9), torch.arange(5)).detach())


def test_bad_draft_directories_raise_one_line_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_draft(tmp_path / "nope")
    with pytest.raises(UsageError, match=r"no config\.json"):
        load_draft(tmp_path)
    config = tiny_config()
    save_draft(random_draft(config), config, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match="do not match"):
        load_draft(tmp_path)
    del raw["dflash_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match="target_layer_ids"):
        load_draft(tmp_path)


def qwen36_style_config(raw: dict, window: int) -> dict:
    """A published Qwen3.6 draft's config shape: sliding-attention layers with a window,
    block_size at the top level, rope as rope_parameters."""
    raw = dict(raw)
    raw["layer_types"] = ["sliding_attention", "full_attention"]
    raw["sliding_window"] = window
    raw["use_sliding_window"] = True
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000_000.0}
    raw.pop("rope_theta", None)
    return raw


def test_sliding_window_draft_layers_load_and_forget_what_is_out_of_reach(tmp_path):
    """Qwen3.6-style drafts: a sliding layer sees the context less than ``window`` positions behind
    each query; context further back changes nothing, context within reach does."""
    config = tiny_config(num_hidden_layers=2)
    save_draft(random_draft(config), config, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    window = 6
    all_sliding = qwen36_style_config(raw, window)
    all_sliding["layer_types"] = ["sliding_attention"] * 2
    (tmp_path / "config.json").write_text(json.dumps(all_sliding))
    draft = load_draft(tmp_path)
    assert draft.config.layer_window(0) == window and draft.config.rope_theta == 10_000_000.0
    noise, ctx = inputs(config, ctx_len=20)
    start = 20  # the noise block sits at 20..23: keys at positions <= 20 - 6 are out of reach
    far, near = ctx.clone(), ctx.clone()
    far[:, :10] += 3.0  # positions 0..9: out of every query's window
    near[:, 18] += 3.0  # position 18: within reach
    with torch.no_grad():
        base = draft(noise, ctx, torch.arange(start, start + 4), torch.arange(20))
        assert torch.equal(draft(noise, far, torch.arange(start, start + 4), torch.arange(20)), base)
        assert not torch.allclose(draft(noise, near, torch.arange(start, start + 4), torch.arange(20)), base)
        # the cache path: the same answer when the context arrives over two rounds
        cache = draft.new_cache(64)
        draft(noise, ctx[:, :12], torch.arange(12, 16), torch.arange(12), kv_cache=cache)
        cached = draft(noise, ctx[:, 12:], torch.arange(start, start + 4), torch.arange(12, 20), kv_cache=cache)
    torch.testing.assert_close(cached, base)


def test_qwen36_style_draft_is_lossless_and_fast_equals_eager(tmp_path):
    """A draft in the published Qwen3.6 format (one sliding layer with a short window, one full)
    on a hybrid target: output equals greedy, and the fast path's draft masks equal eager's."""
    from ddtree_diag.engine import load_engine
    from tests.support import engine_fixtures as fx

    target = fx.make_hybrid_target(tmp_path / "target", pattern="LLAL")
    directory = fx.make_draft(tmp_path / "draft", block_size=4, layer_ids=(0, 2), layers=2)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(qwen36_style_config(raw, window=8)))
    engine = load_engine(target, directory, device="cpu", dtype="fp32")
    prompt = [(5 * i + 1) % 250 + 10 for i in range(40)]
    reference = engine.greedy_reference(prompt, 16, stop_ids=[])
    eager = engine.generate_ids(prompt, tree_budget=16, max_tokens=16, stop_token_ids=[])
    engine.use_path("fast")
    quick = engine.generate_ids(prompt, tree_budget=16, max_tokens=16, stop_token_ids=[])
    assert eager.token_ids == quick.token_ids == reference
    assert eager.acceptance_lengths == quick.acceptance_lengths  # the draft proposed the same trees


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "none", "additive"])
def test_grouped_kv_attention_has_the_bits_of_attention_over_repeated_heads(dtype, mask_kind):
    # the target's and the draft's attention read KV heads in place on CPU (enable_gqa); the
    # engine's losslessness was measured over repeated heads, so the two must agree bit for bit
    from ddtree_diag.engine.target import grouped_kv

    gen = torch.Generator().manual_seed(5)
    for heads, kv_heads, head_dim, rows, keys_len in ((9, 3, 64, 17, 150), (16, 8, 128, 1, 700), (4, 1, 16, 5, 9)):
        q = torch.randn(1, heads, rows, head_dim, generator=gen).to(dtype)
        k = torch.randn(1, kv_heads, keys_len, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, keys_len, head_dim, generator=gen).to(dtype)
        mask = None
        if mask_kind == "bool":
            mask = torch.rand(1, 1, rows, keys_len, generator=gen) > 0.3
            mask[..., 0] = True
        elif mask_kind == "additive":
            mask = torch.randn(1, 1, rows, keys_len, generator=gen).to(dtype)
        rep = heads // kv_heads
        want = F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask, scale=0.1
        )
        keys, values, gqa = grouped_kv(k, v, heads)
        assert gqa and keys is k  # no copy on CPU
        got = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.1, enable_gqa=gqa)
        assert torch.equal(got, want)
    same_k = torch.randn(1, 4, 3, 8)
    kept = grouped_kv(same_k, same_k, 4)
    assert kept[0] is same_k and kept[2] is False
