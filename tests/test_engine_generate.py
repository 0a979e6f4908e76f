"""Engine correctness on a tiny random Qwen3 target + random DFlash draft (CPU, fp32).

The ground truth is HF's own greedy decode of the same target (``generate(do_sample=False)`` and
``Engine.greedy_reference``, which runs HF's forward and cache, not ours).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import load_engine  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import BUDGETS, MAX_TOKENS, PROMPTS  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

BLOCK_SIZES = (2, 4, 8)




@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    target = fx.make_target(root / "target")
    drafts = {bs: fx.make_draft(root / f"draft{bs}", block_size=bs) for bs in BLOCK_SIZES}
    return root, target, drafts


@pytest.fixture(scope="module")
def engines(models):
    _, target, drafts = models
    return {bs: load_engine(target, drafts[bs], device="cpu", dtype="fp32") for bs in BLOCK_SIZES}


@pytest.fixture(scope="module")
def references(engines):
    engine = engines[4]
    return {tuple(p): engine.greedy_reference(p, MAX_TOKENS, stop_ids=[]) for p in PROMPTS}


def check_accounting(gen) -> None:
    assert gen.decode_rounds == len(gen.acceptance_lengths) == len(gen.tree_sizes)
    assert sum(gen.acceptance_lengths) == gen.completion_tokens - 1
    assert gen.completion_tokens == len(gen.token_ids)
    assert all(n >= 1 for n in gen.acceptance_lengths)


def test_greedy_reference_matches_hf_generate_and_our_forward_matches_hf_logits(engines):
    engine = engines[4]
    prompt = PROMPTS[1]
    hf = engine.target.hf
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=0
    )
    generated = expected[0, len(prompt) :].tolist()
    eos = hf.config.eos_token_id
    reference = engine.greedy_reference(prompt, MAX_TOKENS, stop_ids=[eos])
    assert reference == generated[: len(reference)]
    # our forward, prefill then one-token steps, gives HF's logits
    with torch.no_grad():
        full = hf(torch.tensor([prompt])).logits[0]
    engine.target.reset(64)
    ours, _ = engine.target.forward(torch.tensor(prompt[:5]), torch.arange(5))
    engine.target.commit(list(range(5)))
    rest, _ = engine.target.forward(torch.tensor(prompt[5:]), torch.arange(5, len(prompt)))
    torch.testing.assert_close(torch.cat([ours, rest]), full, rtol=1e-5, atol=1e-5)
    # a prefill's logits: the last row's only, the same values
    engine.target.reset(64)
    prompt_ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    last, features = engine.target.forward(prompt_ids, positions, None, [0, 1], last_only=True)
    assert last.shape == (1, full.shape[-1]) and features.shape[0] == len(prompt)
    torch.testing.assert_close(last, full[-1:], rtol=1e-5, atol=1e-5)


def test_a_prompt_from_an_empty_cache_takes_sdpa_causal_mode_with_the_explicit_masks_bits(engines):
    # on CPU a prompt into an empty cache runs SDPA's causal mode (no mask; key blocks past the
    # diagonal skipped); given the same causal mask explicitly, the forward builds and passes it
    target = engines[4].target
    vocab = target.config.vocab_size
    prompt = torch.arange(300) * 7 % vocab  # long enough for several of the kernel's query blocks
    positions = torch.arange(prompt.shape[0])
    outs = []
    for block_mask in (None, torch.ones(300, 300, dtype=torch.bool).tril()):
        target.reset(320)
        outs.append(target.forward(prompt, positions, block_mask, [0, 1]))
    (logits, features), (masked_logits, masked_features) = outs
    assert torch.equal(logits, masked_logits) and torch.equal(features, masked_features)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_lossless_random_draft_all_budgets(engines, references, block_size):
    engine = engines[block_size]
    for prompt in PROMPTS:
        for budget in BUDGETS:
            gen = engine.generate(prompt_ids=prompt, tree_budget=budget, max_tokens=MAX_TOKENS, stop=None)
            gen_ids = gen.token_ids
            ref = references[tuple(prompt)]
            ref = ref[: len(gen_ids)] if gen.finish_reason == "stop" else ref
            assert gen_ids == ref, (block_size, prompt, budget)
            check_accounting(gen)
            assert gen.mode == ("ar" if budget == 0 else "tree")
            assert all(size <= budget for size in gen.tree_sizes)
        chain = engine.generate(prompt_ids=prompt, mode="chain", max_tokens=MAX_TOKENS)
        check_accounting(chain)


def test_lossless_with_stop_tokens(engines, references):
    engine = engines[4]
    for prompt in PROMPTS:
        ref = references[tuple(prompt)]
        stop_token = ref[len(ref) // 2]
        cut = ref[: ref.index(stop_token) + 1]
        for budget in BUDGETS:
            gen = engine.generate_ids(
                prompt, tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token]
            )
            assert gen.token_ids == cut and gen.finish_reason == "stop", (prompt, budget)
            check_accounting(gen)
        assert engine.greedy_reference(prompt, MAX_TOKENS, stop_ids=[stop_token]) == cut


class Oracle:
    """Replaces the draft with one that knows the target's greedy continuation.

    ``demote``: depths (1-based) at which the right token is ranked second instead of first —
    chains then miss, a tree with enough budget still finds it (non-contiguous compaction).
    """

    def __init__(self, engine, prompt, demote=()):
        self.engine, self.demote = engine, set(demote)
        self.full = list(prompt) + engine.greedy_reference(prompt, 200, stop_ids=[])

    def __call__(self, root, start, context, context_positions, depth):
        assert self.full[start] == root  # the committed prefix is the greedy one
        vocab = self.engine.target.config.vocab_size
        logits = torch.zeros(depth, vocab)
        for d in range(1, depth + 1):
            right = self.full[start + d]
            wrong = (right + 1) % vocab
            logits[d - 1, right] = 20.0 if d not in self.demote else 19.0
            if d in self.demote:
                logits[d - 1, wrong] = 20.0
        return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("block_size", (4, 8))
def test_oracle_draft_accepts_full_blocks(engines, monkeypatch, block_size):
    engine = engines[block_size]
    prompt = PROMPTS[0]
    monkeypatch.setattr(engine.decoder("eager"), "_draft_logprobs", Oracle(engine, prompt))
    max_tokens = 1 + 3 * block_size + 2
    for mode, budget in (("tree", block_size - 1), ("tree", 64), ("chain", None)):
        gen = engine.generate(prompt_ids=prompt, tree_budget=budget, mode=mode, max_tokens=max_tokens)
        assert gen.acceptance_lengths == [block_size] * 3 + [2]  # last round clipped at max_tokens
        assert gen.finish_reason == "length"
        assert gen.token_ids == Oracle(engine, prompt).full[len(prompt) : len(prompt) + max_tokens]
        check_accounting(gen)


def test_demoted_oracle_tree_finds_second_rank_chain_does_not(engines, monkeypatch):
    engine = engines[8]
    prompt = PROMPTS[2]
    oracle = Oracle(engine, prompt, demote=(2, 5))
    monkeypatch.setattr(engine.decoder("eager"), "_draft_logprobs", oracle)
    expected = oracle.full[len(prompt) : len(prompt) + 17]
    chain = engine.generate(prompt_ids=prompt, mode="chain", max_tokens=17)
    tree = engine.generate(prompt_ids=prompt, tree_budget=64, max_tokens=17)
    small = engine.generate(prompt_ids=prompt, tree_budget=3, max_tokens=17)
    for gen in (chain, tree, small):
        assert gen.token_ids == expected
        check_accounting(gen)
    assert set(chain.acceptance_lengths) == {2}  # depth 2 is always wrong for the chain
    assert tree.acceptance_lengths == [8, 8]  # the tree holds the 2nd-ranked tokens too
    assert max(small.acceptance_lengths) < 8


def test_sampling_is_seeded_and_stays_on_target_support(engines):
    engine = engines[4]
    prompt = PROMPTS[1]
    kwargs = dict(prompt_ids=prompt, tree_budget=16, temperature=0.8, max_tokens=MAX_TOKENS)
    first = engine.generate(seed=7, **kwargs)
    assert engine.generate(seed=7, **kwargs).token_ids == first.token_ids
    assert any(engine.generate(seed=s, **kwargs).token_ids != first.token_ids for s in range(8, 12))
    check_accounting(first)
    assert first.token_ids != engine.greedy_reference(prompt, MAX_TOKENS, stop_ids=[])


def test_every_sampled_token_comes_from_the_target_conditional(engines, monkeypatch):
    """At T=1 with a draft whose accepted nodes are mostly later siblings (the ones a wrong tree
    mask or position would corrupt), the distribution each output token was drawn from (reported
    as top_logprobs, and the token's own log-prob) must equal HF's conditional given the committed
    prefix."""
    engine = engines[8]
    prompt = PROMPTS[0]
    hf = engine.target.hf

    def likely_draft(root, start, context, positions, depth):
        with torch.no_grad():
            full = torch.tensor([[*prompt, *committed[0]]])
            logits = hf(full).logits[0, -1:].float()
        # First rank a token the target almost never picks, then the target's likely tokens.
        logits[0, logits[0].argmin()] = logits.max() + 1
        return torch.log_softmax(logits.repeat(depth, 1), -1)

    committed: list[list[int]] = [[]]

    def record(new_ids, _text):
        committed[0] = committed[0] + list(new_ids)
        return True

    monkeypatch.setattr(engine.decoder("eager"), "_draft_logprobs", likely_draft)
    accepted_rounds = outside_top = 0
    for seed in range(6):
        committed[0] = []
        gen = engine.generate_ids(
            prompt, tree_budget=12, temperature=1.0, max_tokens=16, seed=seed, top_logprobs=5,
            stop_token_ids=[], on_token=record,
        )
        accepted_rounds += sum(n > 1 for n in gen.acceptance_lengths)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen.token_ids])).logits[0].float()
        conditional = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        expected = conditional.topk(5)
        # each sampled token's own log-prob, inside the top 5 or not
        own = conditional.gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(gen.token_logprobs), own, atol=1e-4, rtol=0)
        outside_top += sum(t not in [i for i, _ in top] for t, top in zip(gen.token_ids, gen.top_logprobs, strict=True))
        for i, top in enumerate(gen.top_logprobs):
            assert [t for t, _ in top] == expected.indices[i].tolist(), (seed, i)
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in top]), expected.values[i], atol=1e-4, rtol=0
            )
    assert accepted_rounds > 5  # tree nodes were accepted, so their verify rows were used
    assert outside_top > 0  # some sampled tokens were not among the top 5: their own log-prob is real


@pytest.mark.parametrize("rounds", [[[0x61], [0xDB], [0xB7, 0x62]], [[0x61, 0xE2], [0x82], [0xAC], [0x21]],
                                    [[0x61], [0xF0, 0x9F], [0x98, 0x80, 0x20]]])
def test_streamed_text_equals_the_final_text_when_tokens_split_characters(rounds):
    """Byte-level tokens can end inside a multi-byte character (it decodes as U+FFFD until the next
    token completes it): what on_token streams must add up to the final text and never carry the
    placeholder. Tokens here are bytes, rounds split characters on purpose."""
    from ddtree_diag.engine.decode import DecodeRequest, GenerationRecorder

    pieces: list[str] = []
    total = sum(len(tokens) for tokens in rounds)  # the last round reaches max_tokens: the stream ends there
    request = DecodeRequest(prompt_ids=[1], mode="tree", tree_budget=4, max_tokens=total, stop_ids=set(),
                            on_token=lambda ids, text: pieces.append(text) is None)
    record = GenerationRecorder(request, lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    first, *later = rounds
    record.first_token(first[0])
    for tokens in [first[1:], *later]:
        if tokens:
            record.round(tokens, tree_size=4)
    assert record.done and record.finish == "length"
    final = record.result().text
    assert "\ufffd" not in final and "".join(pieces) == final
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_round_decodes_its_text_once_for_the_stop_strings_and_the_stream():
    """The output's text is the round's largest host cost on a long answer: the stop-string
    check, the stream and the final record share one decode per output length."""
    from ddtree_diag.engine.decode import DecodeRequest, GenerationRecorder

    decoded: list[int] = []

    def decode(ids):
        decoded.append(len(ids))
        return bytes(ids).decode("utf-8", errors="replace")

    pieces: list[str] = []
    request = DecodeRequest(prompt_ids=[1], mode="tree", tree_budget=4, max_tokens=40, stop_ids=set(),
                            stop=["END"], on_token=lambda ids, text: pieces.append(text) is None)
    record = GenerationRecorder(request, decode)
    record.first_token(ord("a"))
    rounds = [b"bc", b"de", b"fEN", b"Dgh"]
    for tokens in rounds:
        record.round(list(tokens), tree_size=4)
        if record.done:
            break
    assert record.finish == "stop"
    result = record.result()
    assert result.text == "abcdef" and "".join(pieces) == "abcdefENDgh"[: len("".join(pieces))]
    assert decoded == [1, 3, 5, 8, 11]  # one decode per length: first token, then each round


def test_the_recorder_keeps_top_logprobs_not_vocabulary_rows():
    """Per round only the top-k log-probs and each chosen token's own are kept (a vocabulary-wide
    row per output token grows by gigabytes over a long answer); rows past a stop are dropped."""
    from ddtree_diag.engine.decode import DecodeRequest, GenerationRecorder

    vocab, stop = 1000, 7
    generator = torch.Generator().manual_seed(0)
    request = DecodeRequest(prompt_ids=[1], mode="tree", tree_budget=4, max_tokens=50, stop_ids={stop},
                            top_logprobs=3)
    record = GenerationRecorder(request, lambda ids: "")
    rows, tokens = [], []
    first = torch.randn(vocab, generator=generator)
    record.first_token(11, first)
    rows.append(first)
    tokens.append(11)
    for round_tokens in ([12, 13], [14, 15, 16], [17, stop, 18]):  # the last round stops at its 2nd token
        logits = torch.randn(len(round_tokens), vocab, generator=generator).to(torch.bfloat16)
        record.round(round_tokens, tree_size=4, logits=logits)
        rows.extend(logits)
        tokens.extend(round_tokens)
        assert all(part.shape[-1] == 3 for values, ids, _ in record.logprob_parts for part in (values, ids))
    result = record.result()
    kept = len(result.token_ids)
    assert result.token_ids == tokens[:kept] and result.token_ids[-1] == stop
    expected = torch.log_softmax(torch.stack(rows[:kept]).float(), dim=-1)
    assert len(result.top_logprobs) == len(result.token_logprobs) == kept
    for index, top in enumerate(result.top_logprobs):
        values, ids = expected[index].topk(3)
        assert [i for i, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values)
    own = expected[torch.arange(kept), torch.tensor(tokens[:kept])]
    torch.testing.assert_close(torch.tensor(result.token_logprobs), own)
