"""Fast decode path (engine/fast) == the eager reference, on CPU in fp32.

The vectorised tree build must reproduce ``tree.build_tree`` node for node (order, parents,
tie-breaking); the fast rounds must give the eager rounds' tokens, acceptance and tree sizes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.fast import decoder as fast_decoder  # noqa: E402
from ddtree_diag.engine.fast import layers as fast_layers  # noqa: E402
from ddtree_diag.engine.fast import tree as fast_tree  # noqa: E402
from ddtree_diag.engine.tree import ancestor_mask, build_tree  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402
from tests.support.engine_fixtures import BUDGETS, MAX_TOKENS, PROMPTS  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]


# ---- vectorised tree build ----------------------------------------------------------------------


def assert_same_tree(logprobs: torch.Tensor, budget: int, depth: int) -> bool:
    """Compare with build_tree on the first ``depth`` rows; returns the build's ``exact`` flag."""
    built = fast_tree.build_tree_tensors(logprobs, budget, depth)
    reference = build_tree(7, logprobs[:depth], budget)
    n = reference.size
    assert int(built["count"]) == n == fast_tree.tree_node_count(budget, depth, logprobs.shape[1])
    assert built["valid"].tolist() == [True] * n + [False] * (budget - n)
    if not bool(built["exact"]):
        return False
    assert built["tokens"][:n].tolist() == reference.tokens[1:]
    assert built["parents"][:n].tolist() == reference.parents[1:]
    assert built["depths"][:n].tolist() == reference.depths[1:]
    return True


def test_vectorised_tree_equals_heap_on_random_logprobs():
    gen = torch.Generator().manual_seed(0)
    for trial in range(12):
        depth_rows, vocab = (3, 7, 15)[trial % 3], (5, 40, 300)[trial % 3]
        logprobs = torch.log_softmax(torch.randn(depth_rows, vocab, generator=gen) * (1 + trial % 4), -1)
        for budget in (1, 2, 3, 5, 16, 64, 100):
            for depth in sorted({1, depth_rows // 2 or 1, depth_rows}):
                assert assert_same_tree(logprobs, budget, depth), (trial, budget, depth)


def test_vectorised_tree_equals_heap_with_ties_and_zero_logprobs():
    """Quantised logits (many equal log-probs per depth, equal path sums across depths) and
    one-hot rows (log-prob exactly 0, so a child ties its parent): the tie-breaking cases."""
    gen = torch.Generator().manual_seed(1)
    exact = total = 0
    for trial in range(16):
        depth_rows, vocab = (4, 6, 15)[trial % 3], (6, 30, 300)[trial % 3]
        logits = torch.randint(0, 3 + trial % 3, (depth_rows, vocab), generator=gen).float()
        if trial % 4 == 1:
            logits[::2] = 0.0
            logits[::2, trial % vocab] = 200.0  # log-prob 0.0 exactly for that token
        if trial % 4 == 2:
            logits[:] = 0.0  # uniform: every path of a depth ties
        logprobs = torch.log_softmax(logits, -1)
        for budget in (1, 2, 5, 16, 64):
            for depth in (1, depth_rows):
                total += 1
                exact += assert_same_tree(logprobs, budget, depth)
    assert exact >= 0.9 * total  # unresolved ties are rare (and then the decoder rebuilds exactly)


def bf16_logprobs(seed: int, scale: float) -> torch.Tensor:
    """Log-probs of bf16 logits, the same bits on every CPU: a float32 log_softmax differs in its
    last bit with the SIMD width, and that bit makes or breaks ties between path sums."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(15, 8192, generator=gen) * scale).bfloat16().double()
    return torch.log_softmax(logits, -1).float()


def test_vectorised_tree_is_proven_on_bf16_rounded_logprobs():
    """bf16 logits (the GPU case) tie often within a depth, and equal logits make twin subtrees
    whose nodes tie along long pusher chains; the build must still settle and prove its order."""
    settled_by_rule_alone = total = 0
    for seed in range(4):
        for scale in (1.0, 4.0):
            logprobs = bf16_logprobs(seed, scale)
            assert logprobs.unique().numel() < logprobs.numel() // 4  # plenty of exact ties
            for budget in (16, 64, 256):
                for depth in (15, 2):
                    assert assert_same_tree(logprobs, budget, depth), (seed, scale, budget, depth)
                    rule_alone = fast_tree.build_tree_tensors(logprobs, budget, depth, 4, doubling_steps=0)
                    settled_by_rule_alone += bool(rule_alone["exact"])
                    total += 1
    # the inputs do hold chains that four passes of the tie rule alone cannot settle
    assert settled_by_rule_alone < total


def test_twin_subtrees_tie_along_a_long_chain():
    """Two equal best tokens at depth 1 make twin subtrees: every node ties its twin, and the
    order is decided only at the top of the chain, as many links up as the node is deep."""
    logits = -torch.arange(40.0).repeat(12, 1) * 0.75  # distinct log-probs per depth
    logits[0, 1] = logits[0, 0]  # twins at depth 1
    logprobs = torch.log_softmax(logits, -1)
    for budget in (8, 24, 64, 200):
        assert assert_same_tree(logprobs, budget, 12), budget


def test_ranked_top_k_is_a_stable_descending_sort():
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(-3, 3, (4, 50), generator=gen).float() / 2
    rows[0, :5] = float("-inf")
    rows[1, 7] = -0.0
    values, ids = torch.sort(rows, dim=-1, descending=True, stable=True)
    for k in (1, 7, 50):
        top_values, top_ids = fast_tree.ranked_top_k(rows, k)
        assert torch.equal(top_ids, ids[:, :k]) and torch.equal(top_values, values[:, :k])


def test_ancestor_mask_from_parent_tensor():
    tree = build_tree(7, torch.log_softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(2)), -1), 30)
    parents = torch.tensor(tree.parents)
    assert torch.equal(fast_tree.ancestors_from_parents(parents, 4), ancestor_mask(tree.parents))


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 7, 8, 15, 16])
def test_ancestor_mask_by_pointer_doubling_reaches_the_whole_depth(depth):
    """Random trees exactly ``depth`` deep (a chain to the bottom, other rows hung anywhere above),
    with padding rows (parent -1) after them: equal to the host's mask row by row."""
    generator = torch.Generator().manual_seed(depth)
    parents, depths = [-1, *range(depth)], list(range(depth + 1))
    for _ in range(20):
        parent = int(torch.randint(len(parents), (), generator=generator))
        if depths[parent] < depth:
            parents.append(parent)
            depths.append(depths[parent] + 1)
    padded = parents + [-1] * 5
    got = fast_tree.ancestors_from_parents(torch.tensor(padded), depth)
    assert torch.equal(got, ancestor_mask(padded))
    if depth >= 2:  # one step too few leaves the deepest row's root out
        assert not torch.equal(fast_tree.ancestors_from_parents(torch.tensor(padded), depth // 2), got)


def test_node_count():
    assert fast_tree.tree_node_count(64, 15, 151936) == 64
    assert fast_tree.tree_node_count(64, 2, 5) == 5 + 25
    assert fast_tree.tree_node_count(3, 0, 10) == 0


# ---- fast decoder == eager decoder ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    target = fx.make_target(root / "target")
    made = {}
    for block in (2, 4, 8):
        made[block] = load_engine(
            target, fx.make_draft(root / f"d{block}", block_size=block), device="cpu", dtype="fp32"
        )
    return made


def run_path(engine, path, **kwargs):
    """One generation on decode path ``path``; the engine's own setting is left as it was."""
    previous = engine.decode_path
    engine.use_path(path)
    try:
        return engine.generate_ids(**kwargs)
    finally:
        engine.use_path(previous)


def both(engine, path="fast", **kwargs):
    return run_path(engine, "eager", **kwargs), run_path(engine, path, **kwargs)


def assert_same(eager, quick, what):
    assert quick.token_ids == eager.token_ids, what
    assert quick.acceptance_lengths == eager.acceptance_lengths, what
    assert quick.tree_sizes == eager.tree_sizes, what
    assert quick.finish_reason == eager.finish_reason, what
    assert quick.mode == eager.mode and quick.extras["fast"] is True
    assert set(quick.stage_times) == {"draft", "tree", "verify", "commit"}
    assert quick.decode_rounds == len(quick.acceptance_lengths)


@pytest.mark.parametrize("block", (2, 4, 8))
def test_fast_equals_eager_greedy_all_budgets(engines, block):
    engine = engines[block]
    for prompt in PROMPTS:
        for budget in BUDGETS:
            eager, quick = both(engine, prompt_ids=prompt, tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[])
            assert_same(eager, quick, (block, prompt, budget))
            assert quick.extras["fast_tree_fallbacks"] == 0
        eager, quick = both(engine, prompt_ids=prompt, mode="chain", max_tokens=MAX_TOKENS, stop_token_ids=[])
        assert_same(eager, quick, (block, prompt, "chain"))


def test_fast_equals_eager_with_stops_lengths_and_top_logprobs(engines):
    engine = engines[4]
    reference = engine.greedy_reference(PROMPTS[1], MAX_TOKENS, stop_ids=[])
    stop_token = reference[len(reference) // 2]
    for budget in (0, 4, 64):
        for max_tokens in (1, 2, 5, MAX_TOKENS):
            eager, quick = both(
                engine, prompt_ids=PROMPTS[1], tree_budget=budget, max_tokens=max_tokens,
                stop_token_ids=[stop_token], top_logprobs=3,
            )
            assert_same(eager, quick, (budget, max_tokens))
            for row_eager, row_quick in zip(eager.top_logprobs, quick.top_logprobs, strict=True):
                assert [t for t, _ in row_quick] == [t for t, _ in row_eager]
                torch.testing.assert_close(
                    torch.tensor([lp for _, lp in row_quick]), torch.tensor([lp for _, lp in row_eager])
                )


def test_fast_sampling_uses_the_same_seeded_draws(engines):
    """On CPU the fast path samples the same rows with the same generator: same seed, same tokens."""
    engine = engines[8]
    for budget in (0, 2, 16):
        for seed in (3, 4):
            eager, quick = both(
                engine, prompt_ids=PROMPTS[0], tree_budget=budget, temperature=0.9, seed=seed,
                max_tokens=MAX_TOKENS, stop_token_ids=[],
            )
            assert_same(eager, quick, (budget, seed))


def test_unproven_tree_order_falls_back_to_the_exact_host_build(engines, monkeypatch):
    engine = engines[4]
    real = fast_tree.build_tree_tensors

    def doubtful(*args, **kwargs):
        built = real(*args, **kwargs)
        built["exact"] = torch.zeros((), dtype=torch.bool)
        # a wrong order too: the fallback must not commit anything from this round
        built["tokens"] = built["tokens"].flip(0)
        return built

    monkeypatch.setattr(fast_decoder, "build_tree_tensors", doubtful)
    events = logged_rounds(engine.decoder("fast"), monkeypatch)
    for temperature in (0.0, 0.9):
        events.clear()
        eager, quick = both(
            engine, prompt_ids=PROMPTS[2], tree_budget=16, temperature=temperature, seed=5,
            max_tokens=MAX_TOKENS, stop_token_ids=[],
        )
        assert_same(eager, quick, temperature)
        assert quick.extras["fast_tree_fallbacks"] == quick.decode_rounds - (quick.tree_sizes[-1] == 0)
        # a draft launched ahead of a redone round ran on the state before it: each round's tree
        # is built on a draft run after the redone round committed
        trees = [i for i, event in enumerate(events) if event == "tree"]
        assert trees and all(events[i - 1] == "draft" for i in trees), events
        assert any(between_reads(events))  # drafts were launched ahead (and dropped)


def test_fast_engine_reuses_buffers_across_requests_and_grows(engines):
    engine = engines[4]
    decoder = engine.decoder("fast")
    run_path(engine, "fast", prompt_ids=PROMPTS[0], tree_budget=16, max_tokens=8, stop_token_ids=[])
    first_len = decoder.max_len
    run_path(engine, "fast", prompt_ids=PROMPTS[1], tree_budget=16, max_tokens=8, stop_token_ids=[])
    assert decoder.max_len == first_len  # same static buffers
    long_prompt = list(range(10, 255)) * 2  # with its tokens and a round past the first 512 slots
    eager, quick = both(engine, prompt_ids=long_prompt, tree_budget=16, max_tokens=8, stop_token_ids=[])
    assert decoder.max_len > first_len
    assert quick.token_ids == eager.token_ids


def test_the_verify_batch_is_the_budget_and_the_root_unrounded(engines):
    engine = engines[4]
    decoder = engine.decoder("fast")
    for budget in (5, 16, 23):
        eager, quick = both(engine, prompt_ids=PROMPTS[0], tree_budget=budget, max_tokens=12, stop_token_ids=[])
        assert quick.token_ids == eager.token_ids
        assert budget + 1 in decoder.trees and decoder.outputs[budget + 1]["logits"].shape[0] == budget + 1
    assert not {32, 48} & set(decoder.trees)  # no batch rounded up to a multiple of 16


def test_fast_attention_window_grows_with_the_context_and_changes_nothing(engines, monkeypatch):
    """A request whose context crosses a WINDOW boundary switches to the next window's stages
    mid-request; tokens stay equal to eager's."""
    engine = engines[4]
    decoder = engine.decoder("fast")
    prompt = [(7 * i) % 250 + 10 for i in range(fast_decoder.WINDOW - 40)]
    windows_used = []
    real_draft = decoder._draft
    monkeypatch.setattr(decoder, "_draft", lambda window: windows_used.append(window) or real_draft(window))
    for budget in (0, 16):
        decoder.stages.clear()
        eager, quick = both(engine, prompt_ids=prompt, tree_budget=budget, max_tokens=60, stop_token_ids=[])
        assert_same(eager, quick, budget)
        windows = {key[-1] for key in decoder.stages if key[0] == "verify"}
        assert windows == {fast_decoder.WINDOW, 2 * fast_decoder.WINDOW}, windows
    # a draft launched ahead of its round uses the window that round has, as one launched in it does
    monkeypatch.setenv("DDTREE_DIAG_ROUND_AHEAD", "off")
    windows_ahead, windows_used[:] = list(windows_used), []
    run_path(engine, "fast", prompt_ids=prompt, tree_budget=16, max_tokens=60, stop_token_ids=[])
    assert windows_ahead == windows_used and len(set(windows_used)) == 2
    assert fast_decoder.attention_window(1, 4096) == fast_decoder.WINDOW
    assert fast_decoder.attention_window(fast_decoder.WINDOW + 1, 4096) == 2 * fast_decoder.WINDOW
    assert fast_decoder.attention_window(5000, 1024) == 1024


def test_fused_projections_share_the_modules_weights(engines):
    engine = engines[2]
    decoder = engine.decoder("fast")
    layer, fused = engine.target.layers[0], decoder.fused[0]
    attn = layer.self_attn
    assert fused is not None and fused.gate_up_weight is not None
    # the modules now compute with row slices of the fused tensors: no copy, same values
    assert attn.q_proj.weight.data_ptr() == fused.qkv_weight.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == fused.qkv_weight.untyped_storage().data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == fused.gate_up_weight.untyped_storage().data_ptr()
    # another decode path builds a new decoder: it reuses the fused tensors (no second copy)
    compiled = engine.decoder("fast-compile")
    assert compiled is not decoder and compiled.fused[0] is fused
    t = engine.target
    hidden, attn_out = torch.randn(1, 3, t.hidden_size), torch.randn(1, 3, attn.o_proj.in_features)
    cos, sin = t.rope(hidden, torch.arange(3))
    cos, sin = cos[:, None], sin[:, None]
    with torch.no_grad():
        shape, flags = (t.heads, t.kv_heads, t.head_dim), {"arch": t.arch}
        one_gemm = fast_layers.target_pre_attention(layer, hidden, cos, sin, *shape, fused, **flags)
        modules = fast_layers.target_pre_attention(layer, hidden, cos, sin, *shape, **flags)
        for a, b in zip(one_gemm, modules, strict=True):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(
            fast_layers.target_post_attention(layer, hidden, attn_out, fused, arch=t.arch),
            fast_layers.target_post_attention(layer, hidden, attn_out, arch=t.arch),
        )


def test_fast_defaults_to_cuda_only(engines):
    assert all(engine.decode_path == "eager" for engine in engines.values())  # loaded on CPU: eager by default


@pytest.mark.parametrize("demote", ((), (2, 5)))
def test_fast_equals_eager_with_an_oracle_draft_accepting_deep_paths(engines, monkeypatch, demote):
    """A draft that knows the greedy continuation (``demote``: right token ranked second at those
    depths): many tokens accepted per round, kept nodes non-contiguous, so the in-place KV
    compaction and the accept walk on the device are exercised."""
    engine = engines[8]
    prompt = PROMPTS[2]
    full = list(prompt) + engine.greedy_reference(prompt, 200, stop_ids=[])
    vocab = engine.target.config.vocab_size

    def oracle_logprobs(start: int, depth: int) -> torch.Tensor:
        logits = torch.zeros(depth, vocab)
        for d in range(1, depth + 1):
            right = full[start + d]
            logits[d - 1, right] = 19.0 if d in demote else 20.0
            if d in demote:
                logits[d - 1, (right + 1) % vocab] = 20.0
        return torch.log_softmax(logits, -1)

    monkeypatch.setattr(
        engine.decoder("eager"), "_draft_logprobs", lambda root, start, ctx, pos, depth: oracle_logprobs(start, depth)
    )
    decoder = engine.decoder("fast")

    def fast_draft(window: int) -> None:
        decoder.logprobs.copy_(oracle_logprobs(int(decoder.start), decoder.block - 1))

    monkeypatch.setattr(decoder, "_draft", fast_draft)
    decoder.stages.clear()
    try:
        for mode, budget in (("tree", 64), ("tree", 3), ("chain", None)):
            eager, quick = both(
                engine, prompt_ids=prompt, tree_budget=budget, mode=mode, max_tokens=21, stop_token_ids=[]
            )
            assert_same(eager, quick, (mode, budget))
            assert quick.token_ids == full[len(prompt) : len(prompt) + 21]
            if mode == "tree" and budget == 64:
                assert max(quick.acceptance_lengths) == 8
    finally:
        decoder.stages.clear()


def test_round_stages_never_read_device_values_on_the_host(engines):
    """The CPU twin of "no host sync inside a round": while any stage function runs (the
    functions that are captured as CUDA graphs on a GPU), reading a tensor's value into Python
    raises; the only read is the decoder's one ``tolist`` after the stages."""
    engine = engines[4]
    decoder = engine.decoder("fast")
    guarded = fx.refusing_host_reads
    try:
        for mode, budget in (("tree", 16), ("chain", None), ("ar", 0)):
            run_path(engine, "fast", prompt_ids=PROMPTS[1], tree_budget=budget, mode=mode, max_tokens=6,
                     stop_token_ids=[])
        stages = list(decoder.stages.values())
        assert len(stages) >= 7  # draft, tree (tree/chain/ar), verify and commit shapes
        for stage in stages:
            stage.fn = guarded(stage.fn)
        for mode, budget in (("tree", 16), ("chain", None), ("ar", 0)):
            eager, quick = both(
                engine, prompt_ids=PROMPTS[1], tree_budget=budget, mode=mode, max_tokens=MAX_TOKENS, stop_token_ids=[]
            )
            assert quick.token_ids == eager.token_ids
        assert all(stage.fn.__name__ == "run" for stage in decoder.stages.values())  # still guarded
        with pytest.raises(AssertionError, match=r"Tensor\.item"):
            guarded(lambda: decoder.start.item())()
    finally:
        decoder.stages.clear()


def logged_rounds(decoder, monkeypatch) -> list[str]:
    """The order in which ``decoder`` runs its stage functions and reads each round's result:
    "draft", "tree", "ar-tree" (the root alone), "verify", "read-start" (the copy queued), "read"
    (the host waits for it)."""
    events: list[str] = []
    for name, method in (("draft", "_draft"), ("tree", "_tree"), ("ar-tree", "_ar_tree"), ("verify", "_verify")):
        real = getattr(decoder, method)

        def logged(*args, name=name, real=real):
            events.append(name)
            return real(*args)

        monkeypatch.setattr(decoder, method, logged)
    real_start = decoder._start_read

    def start_read(padded):
        events.append("read-start")
        read = real_start(padded)

        def wait():
            events.append("read")
            return read()

        return wait

    monkeypatch.setattr(decoder, "_start_read", start_read)
    return events


def between_reads(events: list[str]) -> list[list[str]]:
    """The stages run between each round's queued copy and the host's read of it."""
    spans, inside = [], None
    for event in events:
        if event == "read-start":
            inside = []
        elif event == "read":
            spans.append(inside)
            inside = None
        elif inside is not None:
            inside.append(event)
    return spans


def ahead_on_and_off(engine, events: list[str], monkeypatch, **ask):
    """((generation, its logged events) with the round ahead on, the same with it off): one fast
    run each, ``events`` the list ``logged_rounds`` fills."""
    runs = {}
    for setting in ("on", "off"):
        monkeypatch.setenv("DDTREE_DIAG_ROUND_AHEAD", setting)
        events.clear()
        runs[setting] = run_path(engine, "fast", **ask), list(events)
    monkeypatch.delenv("DDTREE_DIAG_ROUND_AHEAD")
    return runs["on"], runs["off"]


@pytest.mark.parametrize("mode,budget", (("tree", 16), ("chain", None), ("ar", 0)))
def test_the_next_rounds_first_stages_run_before_this_rounds_result_is_read(engines, monkeypatch, mode, budget):
    """Round ahead: the next round's draft (AR: its tree and verify) is launched before the host
    reads this round's result, whenever the next round's shape cannot depend on it; never run twice,
    never for a round that does not come; the same tokens as with it switched off, and as eager."""
    engine = engines[4]
    decoder = engine.decoder("fast")
    events = logged_rounds(decoder, monkeypatch)
    ask = dict(prompt_ids=PROMPTS[1], tree_budget=budget, mode=mode, max_tokens=MAX_TOKENS, stop_token_ids=[])
    for temperature in (0.0, 0.9):
        eager = run_path(engine, "eager", temperature=temperature, seed=2, **ask)
        (ahead, ahead_events), (plain, plain_events) = ahead_on_and_off(
            engine, events, monkeypatch, temperature=temperature, seed=2, **ask
        )
        assert_same(eager, ahead, (mode, temperature))
        assert_same(plain, ahead, (mode, temperature))
        assert not any(between_reads(plain_events))
        spans = between_reads(ahead_events)
        assert len(spans) == ahead.decode_rounds
        head = ["ar-tree", "verify"] if mode == "ar" else ["draft"]
        # whatever a round commits, the next one exists and has a full-depth draft when this many
        # tokens are left before it (AR: the next forward exists when two are)
        sure = 2 if mode == "ar" else 2 * decoder.block
        emitted = 1  # the prefill's token
        for span, committed in zip(spans, ahead.acceptance_lengths, strict=True):
            remaining = MAX_TOKENS - emitted
            assert span in ([], head), spans
            if remaining >= sure:
                assert span == head, (remaining, spans)
            emitted += committed
        assert spans[-1] == []  # the request ends at max_tokens: no round after the last
        # no stage ran twice: as many drafts / verifies as the rounds without it
        for stage in ("draft", "tree", "ar-tree", "verify"):
            assert ahead_events.count(stage) == plain_events.count(stage), stage


def test_an_ar_round_asked_for_top_logprobs_is_launched_ahead_and_keeps_its_own_row(engines, monkeypatch):
    """AR with top log-probs (a lossless baseline's request): the next forward is launched ahead
    too, and each token's log-probs are still those of the row that chose it: the same as eager's
    and as with the round ahead off."""
    engine = engines[4]
    decoder = engine.decoder("fast")
    events = logged_rounds(decoder, monkeypatch)
    ask = dict(prompt_ids=PROMPTS[1], tree_budget=0, mode="ar", max_tokens=MAX_TOKENS, stop_token_ids=[],
               top_logprobs=3)
    for temperature in (0.0, 0.9):
        eager = run_path(engine, "eager", temperature=temperature, seed=5, **ask)
        (ahead, ahead_events), (plain, _) = ahead_on_and_off(
            engine, events, monkeypatch, temperature=temperature, seed=5, **ask
        )
        assert sum(span == ["ar-tree", "verify"] for span in between_reads(ahead_events)) >= MAX_TOKENS - 3
        for other in (eager, plain):
            assert_same(other, ahead, temperature)
            ids = [[[t for t, _ in row] for row in run.top_logprobs] for run in (ahead, other)]
            assert ids[0] == ids[1]
            torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in ahead.top_logprobs]),
                                       torch.tensor([[v for _, v in row] for row in other.top_logprobs]))
            torch.testing.assert_close(torch.tensor(ahead.token_logprobs), torch.tensor(other.token_logprobs))


def test_no_round_is_launched_ahead_where_its_attention_window_depends_on_this_one(engines):
    """Near a window boundary the next round's window depends on how many tokens this round
    commits: nothing is launched ahead there; one whole-window step before, the draft is, with the
    stages of that window."""
    engine = engines[4]
    decoder = engine.decoder("fast")
    run_path(engine, "fast", prompt_ids=PROMPTS[0], tree_budget=16, max_tokens=4, stop_token_ids=[])
    block, window = decoder.block, fast_decoder.WINDOW
    assert decoder.max_len >= 2 * window
    reach = 2 * block + 1
    ran = []

    class Recorded:
        def __init__(self, name):
            self.name = name

        def run(self):
            ran.append(self.name)

    stage_sets = {w: {"draft": Recorded(w)} for w in (window, 2 * window)}
    ar_sets = {w: {"tree": Recorded(("tree", w)), "verify": Recorded(("verify", w))} for w in (window, 2 * window)}
    kv = decoder.target.kv
    saved = kv.length
    try:
        # this round commits 1..block tokens: the next round attends over `window` slots only if
        # it commits fewer than `block`
        kv.length = window - reach - block + 1
        assert decoder._round_ahead(stage_sets, "tree", block - 1, 100, reach) is None
        assert decoder._round_ahead(ar_sets, "ar", 0, 100, reach) is not None  # AR commits 1
        kv.length = window - reach - block
        launched = decoder._round_ahead(stage_sets, "tree", block - 1, 100, reach)
        assert launched is not None and launched[1] == ("draft",)
        assert ran == [("tree", window), ("verify", window), window]  # both in the first window
    finally:
        kv.length = saved


def test_a_round_launched_ahead_of_a_stop_leaves_the_next_request_alone(engines, monkeypatch):
    """A stop token ends the request after a draft (AR: a forward) was launched for a round that
    never comes; the next requests still decode as eager does."""
    engine = engines[4]
    decoder = engine.decoder("fast")
    events = logged_rounds(decoder, monkeypatch)
    reference = engine.greedy_reference(PROMPTS[0], MAX_TOKENS, stop_ids=[])
    for budget in (16, 0):
        stop = reference[MAX_TOKENS // 2]
        events.clear()
        eager, quick = both(engine, prompt_ids=PROMPTS[0], tree_budget=budget, max_tokens=MAX_TOKENS,
                            stop_token_ids=[stop])
        assert_same(eager, quick, budget)
        assert quick.finish_reason == "stop"
        assert between_reads(events)[-1]  # the last round launched a successor that never ran on
        for prompt in PROMPTS:
            eager, quick = both(engine, prompt_ids=prompt, tree_budget=budget, max_tokens=MAX_TOKENS,
                                stop_token_ids=[])
            assert_same(eager, quick, (budget, prompt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_path_without_graphs_equals_eager_on_cuda_fp32(tmp_path):
    """On a GPU, the fast rounds without CUDA graphs give the eager path's tokens in fp32."""
    target = fx.make_target(tmp_path / "target")
    engine = load_engine(target, fx.make_draft(tmp_path / "d8", block_size=8), device="cuda", dtype="fp32")
    assert engine.decode_path == "fast"  # the default on CUDA
    for prompt in PROMPTS:
        for budget in BUDGETS:
            eager, quick = both(engine, "fast-nograph", prompt_ids=prompt, tree_budget=budget, max_tokens=MAX_TOKENS,
                                stop_token_ids=[])
            assert_same(eager, quick, (prompt, budget))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_fast_path_equals_eager_in_fp32(tmp_path):
    """On a GPU: the captured stages replay to the eager path's tokens (fp32), every stage was
    captured, and the engine defaults to the fast path there."""
    target = fx.make_target(tmp_path / "target")
    engine = load_engine(target, fx.make_draft(tmp_path / "d8", block_size=8), device="cuda", dtype="fp32")
    assert engine.decode_path == "fast"
    for prompt in PROMPTS:
        for budget in BUDGETS:
            for temperature in (0.0, 0.8):
                eager, quick = both(
                    engine, prompt_ids=prompt, tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[],
                    temperature=temperature, seed=1,
                )
                if temperature == 0:
                    assert_same(eager, quick, (prompt, budget))
                assert quick.extras["cuda_graph_errors"] == []
                assert quick.extras["cuda_graphs"]


def test_decode_paths_by_name(engines):
    from ddtree_diag.engine.eager import EagerDecoder
    from ddtree_diag.engine.fast import FastDecoder

    engine = engines[4]
    assert engine.decode_path == "eager"  # loaded on CPU
    nograph, compiled = engine.decoder("fast-nograph"), engine.decoder("fast-compile")
    assert isinstance(nograph, FastDecoder) and (nograph.graphs, nograph.torch_compile) == (False, False)
    assert compiled.torch_compile is True and compiled.graphs is False  # no CUDA: nothing to capture
    assert isinstance(engine.decoder(), EagerDecoder) and engine.decoder("fast-nograph") is nograph
    with pytest.raises(ValueError, match="unknown decode path 'turbo'"):
        engine.use_path("turbo")
    assert engine.decode_path == "eager"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_fast_path_equals_eager_on_cuda_fp32(tmp_path):
    """fast-compile on a GPU (compiled layer halves and tree build inside the captured stages)
    gives the eager path's tokens in fp32; every stage captured."""
    target = fx.make_target(tmp_path / "target")
    engine = load_engine(target, fx.make_draft(tmp_path / "d8", block_size=8), device="cuda", dtype="fp32")
    for prompt in PROMPTS[:2]:
        for budget in (0, 16):
            eager, quick = both(engine, "fast-compile", prompt_ids=prompt, tree_budget=budget, max_tokens=MAX_TOKENS,
                                stop_token_ids=[])
            assert_same(eager, quick, (prompt, budget))
            assert quick.extras["cuda_graph_errors"] == [] and quick.extras["cuda_graphs"]


def test_compiled_fast_path_equals_eager_on_cpu(engines, monkeypatch):
    """The CPU twin of the CUDA fast-compile path: torch.compile'd layer halves and tree build give
    the eager path's tokens, and the compiled graphs are shared by all layers (no per-layer
    recompiles: one graph per row count and function). Traced with the aot_eager backend: the same
    dynamo graphs and functionalisation as inductor without its C++ builds (a minute on a cold
    cache here); the CUDA test above runs inductor itself."""
    from torch._dynamo.utils import counters

    engine = engines[8]
    monkeypatch.setenv("DDTREE_DIAG_COMPILE_BACKEND", "aot_eager")
    engine._decoders.pop("fast-compile", None)  # built afresh, with that backend
    graphs_before = counters["stats"]["unique_graphs"]
    try:
        for budget in (0, 4):
            eager, quick = both(
                engine, "fast-compile", prompt_ids=PROMPTS[1], tree_budget=budget, max_tokens=MAX_TOKENS,
                stop_token_ids=[],
            )
            assert_same(eager, quick, budget)
        decoder = engine.decoder("fast-compile")
        assert decoder.torch_compile is True and decoder.compile_backend == "aot_eager"
        # AR: pre+post at 1 row; budget 4: target pre+post at 16 rows, draft pre+post at 8, the tree
        # build: 7 graphs for the 4 target and 2 draft layers, never one per layer
        assert counters["stats"]["unique_graphs"] - graphs_before <= 7
    finally:
        engine._decoders.pop("fast-compile", None)


def test_decode_path_from_the_environment(tmp_path, monkeypatch):
    from ddtree_diag.errors import UsageError

    target = fx.make_target(tmp_path / "target")
    monkeypatch.setenv("DDTREE_DIAG_DECODE", "fast-nograph")
    engine = load_engine(target, device="cpu", dtype="fp32")
    assert engine.decode_path == "fast-nograph"
    monkeypatch.setenv("DDTREE_DIAG_DECODE", "warp")
    with pytest.raises(UsageError, match="DDTREE_DIAG_DECODE: unknown decode path 'warp'"):
        load_engine(target, device="cpu", dtype="fp32")


def test_compiled_path_keeps_its_compile_cache_in_the_tool_cache(monkeypatch, tmp_path):
    """fast-compile puts inductor's persistent caches under the tool's cache dir (unless the user
    set TORCHINDUCTOR_CACHE_DIR), so a later process reuses the compiled stages."""
    monkeypatch.setenv("DDTREE_DIAG_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    fast_decoder.use_persistent_compile_cache()
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    fast_decoder.use_persistent_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"


def test_the_cuda_weight_layout_changes_no_token(tmp_path, monkeypatch):
    """The layout the engine gives weights on CUDA (every linear's weight stored transposed),
    forced on CPU: the eager and fast paths both compute with it and agree token for token (fp32),
    the fused projections are stored so too and still share the modules' storage."""
    target, draft = fx.make_target(tmp_path / "t"), fx.make_draft(tmp_path / "d", block_size=4)
    plain = load_engine(target, draft, device="cpu", dtype="fp32")  # as loaded
    assert plain.target.layers[1].mlp.down_proj.weight.is_contiguous()
    monkeypatch.setattr(fast_layers, "column_major_weights", lambda device: True)
    monkeypatch.setattr(fast_decoder, "column_major_weights", lambda device: True)
    engine = load_engine(target, draft, device="cpu", dtype="fp32")
    layer = engine.target.layers[1]
    for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight, engine.target.hf.lm_head.weight,
                   engine.draft.fc.weight, engine.draft.layers[0].mlp.down_proj.weight):
        assert weight.stride() == (1, weight.shape[0])
    assert torch.equal(layer.mlp.down_proj.weight, plain.target.layers[1].mlp.down_proj.weight)
    for budget in (0, 4):
        eager, quick = both(engine, "fast-nograph", prompt_ids=PROMPTS[0], tree_budget=budget, max_tokens=12,
                            stop_token_ids=[])
        assert_same(eager, quick, budget)
    fused = engine.decoder("fast-nograph").fused[1]
    assert fused.qkv_weight.stride() == (1, fused.qkv_weight.shape[0])
    storage = fused.qkv_weight.untyped_storage().data_ptr()
    assert layer.self_attn.k_proj.weight.untyped_storage().data_ptr() == storage
    assert torch.equal(layer.self_attn.k_proj.weight, plain.target.layers[1].self_attn.k_proj.weight)


def test_a_tied_output_head_keeps_the_embeddings_layout():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree_diag.engine.fast.layers import store_models_column_major

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
    )).eval()
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        before = model(ids).logits
        store_models_column_major(model, None)
        after = model(ids).logits
    assert model.lm_head.weight is model.get_input_embeddings().weight and model.lm_head.weight.is_contiguous()
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    assert o_proj.stride() == (1, o_proj.shape[0])
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize("column_major", (False, True))
def test_the_head_writes_logits_and_features_into_given_buffers(engines, column_major):
    """A verify's logits and features go straight into its static buffers (no copy of the logits
    after): the same values as the head computes on its own, for either weight layout, and a head
    that is not a plain linear (here one with a forward hook) still fills the buffer."""
    target = engines[4].target
    head = target.hf.lm_head
    saved = head.weight
    if column_major:
        fast_layers.store_column_major(head)
    try:
        gen = torch.Generator().manual_seed(3)
        rows, width = 7, target.hidden_size
        hidden = torch.randn(1, rows, width, generator=gen)
        layers = [0, target.num_layers - 1]
        features = {0: torch.randn(1, rows, width, generator=gen)}
        logits, feats = target.head(hidden, dict(features), layers)
        buffers = {"logits": torch.zeros(rows, head.out_features), "features": torch.zeros(rows, 2 * width)}
        got_logits, got_feats = target.head(hidden, dict(features), layers, out=buffers)
        assert got_logits is buffers["logits"] and got_feats is buffers["features"]
        assert torch.equal(got_logits, logits) and torch.equal(got_feats, feats)
        normed = target.inner.norm(hidden)
        again = target.head(normed, dict(features), layers, normed=True, out=buffers)[0]
        assert torch.equal(again, logits)
        handle = head.register_forward_hook(lambda module, args, output: output * 2)
        try:
            buffers["logits"].zero_()
            assert torch.equal(target.head(hidden, dict(features), layers, out=buffers)[0], 2 * logits)
            assert torch.equal(buffers["logits"], 2 * logits)
        finally:
            handle.remove()
    finally:
        head.weight = saved
