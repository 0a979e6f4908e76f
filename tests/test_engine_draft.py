"""DFlash draft module: z-lab format round trip, format variants, cache contract."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from ddtree_diag.engine.draft import DFlashDraft, DraftConfig, load_draft, save_draft  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402

pytestmark = pytest.mark.engine


def tiny_config(**overrides) -> DraftConfig:
    fields = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, target_layer_ids=[0, 2], mask_token_id=299, block_size=4,
        num_target_layers=4, head_dim=16, vocab_size=300,
    )  # fmt: skip
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
