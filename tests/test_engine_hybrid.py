"""Hybrid Gated-DeltaNet targets (Qwen3.5/3.6 text models, Qwen3-Next): CPU, fp32, lossless.

The ground truth is the target's greedy decode by full forwards without any cache (HF's own
forward over the whole sequence each step), so neither our cache nor HF's is trusted.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ddtree_diag.engine import load_engine  # noqa: E402
from ddtree_diag.engine.tree import ancestor_mask, build_tree  # noqa: E402
from ddtree_diag.errors import UsageError  # noqa: E402
from tests.support import engine_fixtures as fx  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

BUDGETS = (0, 1, 2, 4, 16, 64)
MAX_TOKENS = 20
# Longer than one GDN chunk (64 tokens) so the prefill crosses a chunk boundary.
PROMPTS = ([(7 * i + 3) % 250 + 10 for i in range(70)], [(11 * i) % 240 + 12 for i in range(97)])
CONFIGS = [("qwen3_5", name) for name in fx.HYBRID_PATTERNS] + [("qwen3_next", "linear-first")]


def full_forward_greedy(engine, prompt: list[int], max_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """Greedy decode by a full forward over the whole sequence each step: no cache at all."""
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens:
            sequence = torch.tensor([ids], device=engine.device)
            token = int(engine.target.hf(sequence, use_cache=False).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in stop_ids:
                break
    return out


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """{(kind, pattern): (engine with a block-4 draft, {prompt: reference})}."""
    root = tmp_path_factory.mktemp("hybrid")
    made = {}
    for kind, name in CONFIGS:
        pattern = fx.HYBRID_PATTERNS[name]
        target = fx.make_hybrid_target(root / f"{kind}-{name}", kind=kind, pattern=pattern)
        draft = fx.make_draft(root / f"draft-{kind}-{name}", block_size=4, layer_ids=(0, len(pattern) - 2),
                              layers=1)
        engine = load_engine(target, draft, device="cpu", dtype="fp32")
        references = {tuple(p): full_forward_greedy(engine, p, MAX_TOKENS) for p in PROMPTS}
        made[(kind, name)] = (engine, references)
    return made


def check_accounting(gen) -> None:
    assert gen.decode_rounds == len(gen.acceptance_lengths) == len(gen.tree_sizes)
    assert sum(gen.acceptance_lengths) == gen.completion_tokens - 1
    assert all(n >= 1 for n in gen.acceptance_lengths)


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_greedy_output_equals_full_forward_greedy_for_every_budget(hybrid, config):
    engine, references = hybrid[config]
    assert engine.target.hybrid and engine.info()["hybrid"]["layer_pattern"] == fx.HYBRID_PATTERNS[config[1]]
    for prompt in PROMPTS:
        for budget in BUDGETS:
            gen = engine.generate_ids(prompt, tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[])
            assert gen.token_ids == references[tuple(prompt)], (config, budget)
            check_accounting(gen)
            assert gen.mode == ("ar" if budget == 0 else "tree")


@pytest.mark.parametrize("block_size", (2, 8))
def test_lossless_at_other_block_sizes_and_in_chain_mode(hybrid, tmp_path, block_size):
    _, references = hybrid[("qwen3_5", "linear-first")]
    target = fx.make_hybrid_target(tmp_path / "target", pattern=fx.HYBRID_PATTERNS["linear-first"])  # same weights
    draft = fx.make_draft(tmp_path / f"d{block_size}", block_size=block_size, layer_ids=(0, 2), layers=1)
    engine = load_engine(target, draft, device="cpu", dtype="fp32")
    for budget in (1, 4, 16, 64):
        gen = engine.generate_ids(PROMPTS[0], tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[])
        assert gen.token_ids == references[tuple(PROMPTS[0])], (block_size, budget)
        assert max(gen.tree_sizes) <= budget
        check_accounting(gen)
    chain = engine.generate_ids(PROMPTS[0], mode="chain", max_tokens=MAX_TOKENS, stop_token_ids=[])
    assert chain.token_ids == references[tuple(PROMPTS[0])] and chain.mode == "chain"


def test_stop_tokens_end_the_answer_where_the_target_would(hybrid):
    engine, references = hybrid[("qwen3_5", "full-first")]
    reference = references[tuple(PROMPTS[1])]
    stop = reference[7]  # a token the target greedily produces mid-answer
    expected = reference[: reference.index(stop) + 1]
    for budget in (0, 4, 64):
        gen = engine.generate_ids(PROMPTS[1], tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
        assert gen.token_ids == expected and gen.finish_reason == "stop", budget
        check_accounting(gen)


@pytest.mark.parametrize("config", [("qwen3_5", "linear-last"), ("qwen3_next", "linear-first")],
                         ids=["qwen3_5", "qwen3_next"])
def test_every_tree_node_equals_the_model_over_its_root_path_alone(hybrid, config):
    """One verify forward over a real best-first tree: each node's logits and its hidden states
    at the draft's feature layers equal HF's full forward over prompt + that node's path."""
    engine, _ = hybrid[config]
    target = engine.target
    prompt = PROMPTS[0]
    gen = torch.Generator().manual_seed(3)
    depth_logprobs = torch.log_softmax(torch.randn(6, target.config.vocab_size, generator=gen) * 3, dim=-1)
    tree = build_tree(prompt[-1], depth_logprobs, budget=40)
    target.reset(len(prompt) + 64)
    context = torch.tensor(prompt[:-1])
    target.forward(context, torch.arange(len(context)))
    target.commit(list(range(len(context))))
    start = target.length
    positions = torch.tensor(tree.depths) + start
    logits, _ = target.forward(torch.tensor(tree.tokens), positions, ancestor_mask(tree.parents), None,
                               parents=tree.parents)
    with torch.no_grad():
        for node in range(len(tree.tokens)):
            path, walk = [], node
            while walk >= 0:
                path.append(tree.tokens[walk])
                walk = tree.parents[walk]
            sequence = list(context) + path[::-1]
            expected = target.hf(torch.tensor([sequence]), use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, rtol=1e-4, atol=1e-3, msg=f"node {node}")


def test_oracle_draft_reaches_acceptance_equal_to_the_block_size(hybrid, monkeypatch):
    engine, _ = hybrid[("qwen3_5", "linear-first")]
    prompt = PROMPTS[0]
    full = list(prompt) + full_forward_greedy(engine, prompt, 40)
    vocab = engine.target.config.vocab_size

    def oracle(root, start, context, positions, depth):
        assert full[start] == root
        logits = torch.full((depth, vocab), -20.0)
        for d in range(1, depth + 1):
            logits[d - 1, full[start + d]] = 20.0
        return torch.log_softmax(logits, dim=-1)

    monkeypatch.setattr(engine.decoder("eager"), "_draft_logprobs", oracle)
    gen = engine.generate_ids(prompt, tree_budget=16, max_tokens=29, stop_token_ids=[])
    assert gen.token_ids == full[len(prompt) : len(prompt) + 29]
    assert gen.acceptance_lengths[:-1] == [4] * (len(gen.acceptance_lengths) - 1)  # block size 4, every round
    assert gen.mean_acceptance_length > 3.8


def test_a_request_after_a_long_one_is_unaffected(hybrid):
    """Recurrent state and conv windows are reset between requests."""
    engine, references = hybrid[("qwen3_next", "linear-first")]
    first = engine.generate_ids(PROMPTS[0], tree_budget=16, max_tokens=MAX_TOKENS, stop_token_ids=[])
    engine.generate_ids(PROMPTS[1] * 3, tree_budget=64, max_tokens=60, stop_token_ids=[])
    again = engine.generate_ids(PROMPTS[0], tree_budget=16, max_tokens=MAX_TOKENS, stop_token_ids=[])
    assert first.token_ids == again.token_ids == references[tuple(PROMPTS[0])]


def test_seeded_sampling_is_reproducible(hybrid):
    engine, _ = hybrid[("qwen3_5", "linear-last")]
    kwargs = dict(tree_budget=16, max_tokens=MAX_TOKENS, stop_token_ids=[], temperature=0.9)
    first = engine.generate_ids(PROMPTS[0], seed=5, **kwargs)
    assert engine.generate_ids(PROMPTS[0], seed=5, **kwargs).token_ids == first.token_ids
    assert any(engine.generate_ids(PROMPTS[0], seed=s, **kwargs).token_ids != first.token_ids for s in (6, 7, 8))


def test_engine_info_states_the_layer_pattern_and_per_node_state_memory(hybrid):
    engine, _ = hybrid[("qwen3_5", "full-first")]
    info = engine.info()["hybrid"]
    assert info["layer_pattern"] == "ALLA" and info["linear_attention_layers"] == 2
    states = info["tree_state_bytes"]
    # per node and linear layer: Hv*dk*dv fp32 state + conv_dim*(K-1) window (4*16*8*4 + 112*3*4 bytes)
    per_node_layer = 4 * 16 * 8 * 4 + (2 * 2 * 16 + 4 * 8) * 3 * 4
    assert states[64] == 65 * 2 * per_node_layer and states[16] < states[64] < states[256]


def test_a_tree_whose_state_does_not_fit_is_refused_in_one_line(hybrid, monkeypatch):
    from ddtree_diag.engine import generate

    engine, _ = hybrid[("qwen3_5", "full-first")]
    monkeypatch.setattr(generate, "free_memory_bytes", lambda device: 1000)
    with pytest.raises(UsageError, match=r"tree_budget 64 needs .* GiB of per-node recurrent state"):
        engine.generate_ids(PROMPTS[0], tree_budget=64, max_tokens=4)
    assert engine.generate_ids(PROMPTS[0], tree_budget=0, max_tokens=4).completion_tokens == 4  # AR needs none


def test_vision_language_checkpoint_loads_its_text_model(tmp_path):
    """A Qwen3.5 checkpoint that also carries a vision tower: the engine loads the language model
    and decodes with a draft."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    fx.make_tokenizer(tmp_path / "t")
    text = Qwen3_5TextConfig(
        vocab_size=fx.VOCAB, hidden_size=fx.HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": fx.HIDDEN,
              "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2}
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision))
    model.save_pretrained(tmp_path / "t")
    engine = load_engine(tmp_path / "t", fx.make_draft(tmp_path / "d", block_size=4), device="cpu", dtype="fp32")
    assert engine.target.hybrid and engine.target.num_layers == 4
    prompt = PROMPTS[0][:20]
    expected = full_forward_greedy(engine, prompt, 6)
    for budget in (0, 4):
        assert engine.generate_ids(prompt, max_tokens=6, stop_token_ids=[], tree_budget=budget).token_ids == expected


def test_installed_transformers_keeps_gdn_state_in_multi_token_cached_forwards(hybrid):
    """Releases before the 2026-04 fix restarted a multi-token cached GDN forward from a zero
    state, which breaks any speculative reference built on HF's cache. The pinned range must be
    past it: HF's own prefill + multi-token cached forward equals its full forward here."""
    engine, _ = hybrid[("qwen3_5", "linear-first")]
    hf = engine.target.hf
    sequence = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        full = hf(sequence, use_cache=False).logits[0, -8:]
        prefix = hf(sequence[:, :-8], use_cache=True)
        cached = hf(sequence[:, -8:], past_key_values=prefix.past_key_values, use_cache=True).logits[0]
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The fast path: Gated DeltaNet layers solved in one parallel form inside the round's stages


def run_path(engine, path, prompt, **kwargs):
    previous = engine.decode_path
    engine.use_path(path)
    try:
        return engine.generate_ids(prompt, stop_token_ids=[], **kwargs)
    finally:
        engine.use_path(previous)


@pytest.mark.parametrize("config", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_fast_path_equals_the_eager_scan(hybrid, config):
    engine, references = hybrid[config]
    for budget in (0, 1, 4, 64):
        quick = run_path(engine, "fast", PROMPTS[0], tree_budget=budget, max_tokens=MAX_TOKENS)
        assert quick.token_ids == references[tuple(PROMPTS[0])], (config, budget)
        assert quick.extras["fast"] and quick.extras["fast_tree_fallbacks"] == 0
    eager = run_path(engine, "eager", PROMPTS[1], tree_budget=16, max_tokens=MAX_TOKENS, temperature=0.9, seed=2)
    quick = run_path(engine, "fast", PROMPTS[1], tree_budget=16, max_tokens=MAX_TOKENS, temperature=0.9, seed=2)
    assert quick.token_ids == eager.token_ids  # on CPU both sample with the same generator stream
    chain = run_path(engine, "fast", PROMPTS[0], mode="chain", max_tokens=MAX_TOKENS)
    assert chain.token_ids == references[tuple(PROMPTS[0])]


# Config variants the fixtures' default shape does not reach: Qwen3.5's MoE variant, three value
# heads a key head, head dims that are no power of two, another conv window, full rotary on one KV
# head, Qwen3-Next with dense MLP layers among its sparse ones.
VARIANTS = {
    "qwen3_5-moe": ("qwen3_5_moe", "LLAL", {}),
    "three-value-heads-a-key-head": ("qwen3_5", "LLAL", dict(linear_num_value_heads=6)),
    "odd-head-dims": ("qwen3_5", "LALL", dict(linear_key_head_dim=24, linear_value_head_dim=12)),
    "conv-window-3": ("qwen3_5", "LLAL", dict(linear_conv_kernel_dim=3)),
    "full-rotary-one-kv-head": ("qwen3_5", "ALLA", dict(num_key_value_heads=1, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0))),
    "next-dense-layers": ("qwen3_next", "LALA", dict(mlp_only_layers=[0, 2])),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_decode_the_full_forward_greedy_on_both_paths(variant, tmp_path):
    kind, pattern, config = VARIANTS[variant]
    target = fx.make_hybrid_target(tmp_path / "target", kind=kind, pattern=pattern, **config)
    draft = fx.make_draft(tmp_path / "draft", block_size=4, layer_ids=(0, 2), layers=1)
    engine = load_engine(target, draft, device="cpu", dtype="fp32")
    assert engine.target.arch.model_type.startswith(kind) and engine.info()["hybrid"]["layer_pattern"] == pattern
    prompt = PROMPTS[0]
    reference = full_forward_greedy(engine, prompt, 16)
    for path in ("eager", "fast"):
        for budget in (0, 4, 16):
            gen = run_path(engine, path, prompt, tree_budget=budget, max_tokens=16)
            assert gen.token_ids == reference, (path, budget)
            check_accounting(gen)


def test_hybrid_round_stages_never_read_device_values_on_the_host(hybrid):
    """The CPU twin of "the hybrid round captures as CUDA graphs": no stage reads a tensor's value
    into Python (the parallel solve, the conv windows and the commit of the recurrent state
    included); the decoder's one read per round comes after the stages."""
    engine, references = hybrid[("qwen3_5", "linear-first")]
    decoder = engine.decoder("fast")
    decoder.stages.clear()
    try:
        run_path(engine, "fast", PROMPTS[0], tree_budget=16, max_tokens=4)
        for stage in decoder.stages.values():
            stage.fn = fx.refusing_host_reads(stage.fn)
        quick = run_path(engine, "fast", PROMPTS[0], tree_budget=16, max_tokens=MAX_TOKENS)
        assert quick.token_ids == references[tuple(PROMPTS[0])]
    finally:
        decoder.stages.clear()


# ---------------------------------------------------------------------------------------------
# The commands on a hybrid target


@pytest.mark.e2e
def test_train_draft_engine_info_and_probe_on_a_hybrid_target(tmp_path, cli):
    """train-draft writes a draft for a hybrid target (layers spread over its depth, a mask token
    no text uses, copied from its full-attention layers); engine-info describes the pair; probe
    --engine runs it with the lossless check against the target alone."""
    target = fx.make_hybrid_target(tmp_path / "target", pattern="LLALLLAL")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to three.\nName a colour.\n")
    trained = cli("train-draft", "--out", str(tmp_path / "draft"), "--prompts", str(prompts), "--target-dir",
                  str(target), "--max-new-tokens", "12", "--steps", "3", "--batch-size", "2", "--anchors", "2",
                  "--block-size", "4", "--draft-layers", "1", "--init-from-target", "--device", "cpu",
                  "--gen-batch-size", "3", timeout=300)
    assert trained.code == 0, trained.stderr[-2000:]
    info = cli("engine-info", "--target", str(target), "--draft", str(tmp_path / "draft"), "--device", "cpu",
               "--json")
    assert info.code == 0, info.stderr
    data = info.json()
    assert data["hybrid"]["layer_pattern"] == "LLALLLAL"
    assert data["draft"]["target_layer_ids"] == [1, 2, 3, 4, 5] and data["draft"]["block_size"] == 4
    from transformers import AutoTokenizer

    # the model's vocabulary is padded past the tokenizer: the first padding row is the mask token
    assert data["draft"]["mask_token_id"] == len(AutoTokenizer.from_pretrained(target)) < fx.VOCAB
    probe = cli("probe", "--engine", "--target", str(target), "--draft", str(tmp_path / "draft"), "--device", "cpu",
                "--dtype", "fp32", "--budget", "0,16", "--thinking", "off", "--max-tokens", "12",
                "--baseline", "engine", "--json", "-", timeout=300)
    report = probe.json()
    assert [r["status"] for r in report["results"]] == ["ok", "ok"], probe.stderr
    assert all(r["baseline"]["verdict"] == "identical" for r in report["results"])
    assert report["results"][1]["spec"]["decode_rounds"] >= 1


@pytest.mark.e2e
def test_reference_server_serves_a_hybrid_target_losslessly(tmp_path, cli):
    target = fx.make_hybrid_target(tmp_path / "target", kind="qwen3_next", pattern="LALL")
    draft = fx.make_draft(tmp_path / "draft", block_size=4, layer_ids=(0, 2), layers=1)
    with fx.serving(target, draft) as url:
        result = cli("probe", "--url", url, "--budget", "16,64", "--max-tokens", "16", "--baseline", "budget0",
                     "--json", "-")
    report = result.json()
    assert report["target"]["dialect"] == "ddtree" and len(report["results"]) == 4
    assert all(r["baseline"]["verdict"] == "identical" for r in report["results"]), result.stderr
    assert all(r["spec"]["decode_rounds"] for r in report["results"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_fast_path_with_cuda_graphs_is_lossless_in_fp32(tmp_path):
    """On a GPU: every stage of the hybrid round (the parallel Gated DeltaNet solve and the state
    commit included) captures as a CUDA graph, and the output equals the full-forward greedy."""
    target = fx.make_hybrid_target(tmp_path / "target", pattern="LLAL")
    draft = fx.make_draft(tmp_path / "draft", block_size=8, layer_ids=(0, 2), layers=1)
    engine = load_engine(target, draft, device="cuda", dtype="fp32")
    assert engine.decode_path == "fast"
    for prompt in PROMPTS:
        reference = full_forward_greedy(engine, prompt, MAX_TOKENS)
        for budget in BUDGETS:
            quick = engine.generate_ids(prompt, tree_budget=budget, max_tokens=MAX_TOKENS, stop_token_ids=[])
            assert quick.token_ids == reference, budget
            assert quick.extras["cuda_graph_errors"] == [] and quick.extras["cuda_graphs"]
        eager = run_path(engine, "eager", prompt, tree_budget=64, max_tokens=MAX_TOKENS)
        assert eager.token_ids == reference


def test_compiled_fast_path_equals_the_full_forward_greedy(hybrid, monkeypatch):
    """fast-compile on a hybrid target (the CPU twin: aot_eager traces the compiled layer halves):
    an attention layer after a Gated DeltaNet layer takes that layer's deferred MLP output once."""
    engine, references = hybrid[("qwen3_5", "linear-first")]
    monkeypatch.setenv("DDTREE_DIAG_COMPILE_BACKEND", "aot_eager")
    engine._decoders.pop("fast-compile", None)  # built afresh, with that backend
    try:
        for budget in (0, 4):
            quick = run_path(engine, "fast-compile", PROMPTS[0], tree_budget=budget, max_tokens=MAX_TOKENS)
            assert quick.token_ids == references[tuple(PROMPTS[0])], budget
    finally:
        engine._decoders.pop("fast-compile", None)
