"""Draft training on the real SmolLM2-135M-Instruct (CPU): a tiny training run writes a loadable
draft, and the prompts the target writes itself are finished, distinct, reproducible and avoid the
excluded ones. Slow: marked real_model (a file of its own, so a parallel run can put it beside the
other real-model file)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.engine, pytest.mark.real_model]


def test_tiny_draft_training_run_on_cpu_writes_a_loadable_draft(embedded_target_dir, tmp_path):
    from ddtree_diag.engine.draft import load_draft
    from ddtree_diag.training import draft as dt

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a color.\nSay hi.\n")
    settings = dt.TrainSettings(
        prompts_file=str(prompts), out_dir=str(tmp_path / "draft"), target_dir=str(embedded_target_dir),
        block_size=4, num_draft_layers=1, max_new_tokens=6, steps=2, batch_size=2, anchors_per_seq=2,
        device="cpu", log_every=1, follow_up_tokens=4, sampled_prompts=2, gen_batch_size=4,
    )
    lines: list[str] = []
    result = dt.train_draft(settings, log=lines.append)
    assert result["summary"]["steps_done"] == 2 and result["summary"]["sequences"] >= 3
    assert any('"loss"' in line for line in lines)
    assert any(line.startswith("sampled ") for line in lines)  # prompts the target wrote itself
    draft = load_draft(tmp_path / "draft")
    assert draft.config.block_size == 4 and draft.config.target_layer_ids == [1, 8, 14, 20, 27]
    assert draft.config.mask_token_id == dt.SMOLLM2_MASK_TOKEN_ID


def test_sampled_user_prompts_are_finished_distinct_and_avoid_excluded_ones(embedded_target_dir):
    from ddtree_diag.training import draft as dt

    model, tokenizer = dt.load_target(embedded_target_dir, "cpu")
    excluded = ["What is the capital of France?"]
    # 32 new tokens: the target's questions run 10-25 tokens, longer ones are dropped as cut off
    prompts = dt.sample_user_prompts(model, tokenizer, 2, batch_size=6, seed=3, exclude=excluded, max_new_tokens=32)
    assert 1 <= len(prompts) <= 2
    assert len({p.lower() for p in prompts}) == len(prompts)
    for prompt in prompts:
        assert 3 <= len(prompt.split()) <= 60 and "<|" not in prompt
        assert not dt.too_similar(prompt, excluded)
    # same seed, same prompts: the training data can be regenerated
    again = dt.sample_user_prompts(model, tokenizer, 2, batch_size=6, seed=3, exclude=excluded, max_new_tokens=32)
    assert again == prompts
