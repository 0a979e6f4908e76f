"""Draft training: the block-diffusion training forward matches inference, the loss learns,
anchors and masks are right, and the simulated DDTree acceptance walks trees correctly."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from ddtree_diag.engine.draft import DFlashDraft, DraftConfig  # noqa: E402
from ddtree_diag.training import draft as dt  # noqa: E402

pytestmark = pytest.mark.engine

HIDDEN, VOCAB = 32, 50


def tiny_draft(block_size: int = 4, layers: int = 2) -> DFlashDraft:
    torch.manual_seed(0)
    config = DraftConfig(
        hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, target_layer_ids=[0, 1], mask_token_id=VOCAB - 1,
        block_size=block_size, rope_theta=10000.0,
    )
    return DFlashDraft(config).eval()


def test_block_mask_sees_context_strictly_before_the_anchor_and_only_its_own_block():
    mask = dt.block_attention_mask(torch.tensor([[2, 4]]), context_len=6, block_size=2)
    assert mask.shape == (1, 1, 4, 6 + 4)
    expected_first_block = [1, 1, 0, 0, 0, 0, 1, 1, 0, 0]  # context (6) | blocks (2 x 2)
    expected_second_block = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert mask[0, 0, 0].int().tolist() == expected_first_block
    assert mask[0, 0, 1].int().tolist() == expected_first_block
    assert mask[0, 0, 2].int().tolist() == expected_second_block
    assert mask[0, 0, 3].int().tolist() == expected_second_block


def test_training_forward_equals_one_inference_call_per_anchor():
    """Many blocks in one masked forward must give what the engine computes for each block alone:
    context = features of positions < anchor, noise block at anchor.., no mask."""
    draft = tiny_draft()
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    seq_len = 12
    features = torch.randn(1, seq_len, 2 * HIDDEN)
    input_ids = torch.randint(0, VOCAB - 1, (1, seq_len))
    anchors = torch.tensor([[3, 4, 9]])
    with torch.no_grad():
        batched = dt.draft_block_hidden(
            draft, embed, features, input_ids, anchors, draft.config.mask_token_id
        )
        for index, anchor in enumerate(anchors[0].tolist()):
            block = torch.full((1, draft.block_size), draft.config.mask_token_id)
            block[0, 0] = input_ids[0, anchor]
            alone = draft(
                embed(block), features[:, :anchor],
                torch.arange(anchor, anchor + draft.block_size), torch.arange(anchor),
            )
            torch.testing.assert_close(batched[0, index], alone[0], rtol=1e-5, atol=1e-5)


def test_anchors_lie_in_the_response_with_a_token_after_them():
    rng = random.Random(0)
    anchors, valid = dt.sample_anchors([3, 5], [10, 8], n_anchors=4, rng=rng)
    first = anchors[0][valid[0]].tolist()
    second = anchors[1][valid[1]].tolist()
    assert len(first) == 4 and all(3 <= a <= 8 for a in first) and first == sorted(set(first))
    assert second == [5, 6]  # only two candidates: positions 5 and 6 (seq_len 8)
    assert valid[1].tolist() == [True, True, False, False]


def test_loss_weights_depths_and_falls_when_training_on_a_fixed_batch():
    draft = tiny_draft()
    draft.train()
    embed = torch.nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    torch.manual_seed(1)
    features = torch.randn(2, 16, 2 * HIDDEN)
    input_ids = torch.randint(0, VOCAB - 1, (2, 16))
    anchors = torch.tensor([[4, 8, 11], [5, 6, 12]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    optimizer = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, acc = dt.block_loss(
            draft, embed, lm_head, features, input_ids, [16, 14], anchors, valid, VOCAB - 1, gamma=4.0
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert acc.shape == (draft.block_size - 1,)
    assert losses[-1] < 0.5 * losses[0]


def test_gamma_follows_the_public_recipe_per_block_size():
    base = dict(prompts_file="p", out_dir="o")
    assert dt.TrainSettings(block_size=16, **base).gamma() == 7.0
    assert dt.TrainSettings(block_size=8, **base).gamma() == 4.0
    assert dt.TrainSettings(block_size=8, loss_gamma=2.5, **base).gamma() == 2.5


def one_hot_topk(rows: list[list[int]], vocab: int = 10, depth: int = 3, k: int = 4):
    """Draft top-k per anchor: at each depth the listed tokens in rank order, logprob -(rank+1)."""
    values = torch.full((len(rows), depth, k), -50.0)
    indices = torch.zeros((len(rows), depth, k), dtype=torch.long)
    for a, per_depth in enumerate(rows):
        for d in range(depth):
            ranked = per_depth[d] if d < len(per_depth) else []
            rest = [t for t in range(vocab) if t not in ranked]
            order = (list(ranked) + rest)[:k]
            indices[a, d] = torch.tensor(order)
            values[a, d, : len(ranked)] = -torch.arange(1, len(ranked) + 1, dtype=torch.float)
    return values, indices


def test_simulated_acceptance_walks_the_tree_along_the_greedy_tokens():
    response = [5, 1, 2, 3, 4, 7, 8]
    # A perfect draft: top-1 at every depth is the next greedy token.
    perfect = [
        [[response[i + d + 1]] if i + d + 1 < len(response) else [] for d in range(3)] for i in range(7)
    ]
    values, indices = one_hot_topk(perfect)
    assert dt.simulate_acceptance(response, values, indices, budget=0) == [1] * 6
    assert dt.simulate_acceptance(response, values, indices, budget=3) == [
        4,
        2,
    ]  # 3 drafted + bonus, then the end
    # The right first token only at rank 2: a budget of 1 misses it, a budget of 2 finds it.
    second = [[[9, response[i + 1]] if i + 1 < len(response) else []] for i in range(7)]
    values, indices = one_hot_topk(second)
    assert dt.simulate_acceptance(response, values, indices, budget=1) == [1] * 6
    assert dt.simulate_acceptance(response, values, indices, budget=2) == [2, 2, 2]


def test_too_similar_flags_rewordings_of_held_aside_prompts_only():
    held = ["Explain how a credit card works.", "Why do onions make people cry?"]
    assert dt.too_similar("explain how a credit card works", held)
    assert dt.too_similar("Explain how credit cards work.", held)
    assert not dt.too_similar("How does a debit card differ from cash?", held)
    assert not dt.too_similar("anything at all", [])


def test_a_vision_language_target_trains_a_draft_for_its_language_model(tmp_path):
    """Gemma 3 from 4B up ships as a vision-language model: training reads the text model's config
    and embeddings (the wrapper's config has no hidden size), and the engine then runs the draft."""
    pytest.importorskip("transformers")
    from ddtree_diag.engine import load_engine
    from tests.support import engine_fixtures as fx

    target = fx.make_gemma3_vlm_target(tmp_path / "target")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nsay hi\n")
    settings = dt.TrainSettings(
        prompts_file=str(prompts), out_dir=str(tmp_path / "draft"), target_dir=str(target), block_size=4,
        num_draft_layers=1, max_new_tokens=6, steps=2, batch_size=2, anchors_per_seq=2, device="cpu",
        log_every=1, gen_batch_size=4, init_from_target=True,
    )
    result = dt.train_draft(settings, log=lambda *_: None)
    assert result["summary"]["steps_done"] == 2
    engine = load_engine(target, tmp_path / "draft", device="cpu")
    assert engine.draft.config.hidden_size == fx.HIDDEN and engine.draft.config.num_target_layers == 4
    expected = engine.generate_ids([40, 41, 42], tree_budget=0, max_tokens=6, stop_token_ids=[]).token_ids
    assert engine.generate_ids([40, 41, 42], tree_budget=4, max_tokens=6, stop_token_ids=[]).token_ids == expected


@pytest.mark.parametrize(("args", "needle"), [
    (["--prompts", "{tmp}/none.txt"], "--prompts {tmp}/none.txt: no such file"),
    (["--prompts", "{tmp}/latin.txt"], "not UTF-8 text"),
    (["--prompts", "{tmp}/empty.txt"], "no prompts in it"),
    (["--eval-prompts", "{tmp}/none.txt"], "--eval-prompts"),
    (["--eval-out", "{tmp}"], "--eval-out"),
    (["--block-size", "0"], "--block-size must be >= 2"),
    (["--steps", "-1"], "--steps must be >= 1"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--mask-token-id", "-5"], "--mask-token-id must be >= 0"),
    (["--target-dir", "{tmp}/none"], "no such directory"),
])
def test_train_draft_flags_are_checked_before_any_model_loads(cli, tmp_path, args, needle):
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    out = tmp_path / "draft"
    result = cli("train-draft", "--out", str(out), *[a.format(tmp=tmp_path) for a in args])
    assert result.code == 2 and needle.format(tmp=tmp_path) in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_layer_ids_and_a_mask_token_the_target_lacks_are_refused_before_generation():
    from types import SimpleNamespace

    from ddtree_diag.errors import UsageError

    target = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=4, vocab_size=100))
    dt.check_against_target(dt.TrainSettings(prompts_file="p", out_dir="o", target_layer_ids=[1, 3]), target)
    with pytest.raises(UsageError, match="the target has 4 layers"):
        dt.check_against_target(dt.TrainSettings(prompts_file="p", out_dir="o", target_layer_ids=[1, 4]), target)
    with pytest.raises(UsageError, match="vocabulary has 100 ids"):
        dt.check_against_target(dt.TrainSettings(prompts_file="p", out_dir="o", mask_token_id=100), target)
