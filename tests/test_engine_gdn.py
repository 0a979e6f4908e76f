"""Gated DeltaNet on a draft tree: every node must equal transformers' own chain computation.

References are transformers' pure-torch fallbacks (``torch_recurrent_gated_delta_rule``,
``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``) and the real ``Qwen3_5GatedDeltaNet`` /
``Qwen3NextGatedDeltaNet`` modules run on [committed prefix + the node's root path]. CPU, fp32.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as q3n  # noqa: E402

from ddtree_diag.engine.gdn import (  # noqa: E402
    chunked_gated_delta,
    commit_conv_state,
    gated_delta_step,
    gdn_layer_prefill,
    gdn_layer_tree,
    parallel_gated_delta,
    per_node_state_bytes,
    prepare_qk,
    recurrent_gated_delta,
    root_path,
    state_after,
    tree_causal_conv,
    tree_conv_windows,
    tree_depths,
    tree_gated_delta,
)

pytestmark = pytest.mark.engine

HK, HV, DK, DV = 2, 4, 16, 8  # two value heads per key head: exercises the head repetition
EXACT = 1e-6  # same op order as the recurrent reference: fp32 rounding noise at most
CHUNKED = 1e-4  # the chunked (WY) form reassociates sums


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def rule_inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HK, DK, generator=gen)
    k = torch.randn(n, HK, DK, generator=gen)
    v = torch.randn(n, HV, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(n, HV, generator=gen))  # log decay <= 0
    beta = torch.rand(n, HV, generator=gen)
    return q, k, v, g, beta


def hf_rule(rule, q, k, v, g, beta, state):
    """transformers' rule on unbatched inputs (adds / drops the batch dim). q/k heads are repeated
    for the value heads first: newer releases do that inside the rule, older ones in the layer."""
    repeat = v.shape[-2] // q.shape[-2]
    q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    out, final = rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None],
        initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[0], final[0]


def random_state(seed: int = 1) -> torch.Tensor:
    return torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.5


TREES = {
    "single": [-1],
    "chain": [-1, *range(0, 19)],
    "star": [-1] + [0] * 15,
    "deep": [-1, 0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 12, 6, 14, 13],
    "forest": [-1, -1, 0, 1, -1, 2, 3, 4, 4],
}


def random_parents(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


ALL_TREES = {**TREES, "random80": random_parents(80, 3), "random33": random_parents(33, 4)}


# ---------------------------------------------------------------------------------------------
# The recurrence


def test_single_step_matches_transformers_recurrent_rule():
    torch.manual_seed(0)
    q, k, v, g, beta = rule_inputs(1)
    for state in (None, random_state()):
        ref_out, ref_state = hf_rule(q35.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
        out, new = recurrent_gated_delta(q, k, v, g, beta, state)
        assert err(out, ref_out) <= EXACT and err(new, ref_state) <= EXACT
        # The bare step on prepared inputs is the same computation.
        qp, kp = prepare_qk(q, k, HV)
        s0 = torch.zeros(HV, DK, DV) if state is None else state
        step_out, step_state = gated_delta_step(s0, qp[0], kp[0], v[0], g[0], beta[0])
        assert err(step_out, ref_out[0]) <= EXACT and err(step_state, ref_state) <= EXACT


@pytest.mark.parametrize("length", [5, 64, 150])
def test_chain_matches_recurrent_and_chunked_rules(length):
    torch.manual_seed(0)
    q, k, v, g, beta = rule_inputs(length, seed=length)
    state = random_state()
    ours, ours_state = recurrent_gated_delta(q, k, v, g, beta, state)
    for module in (q35, q3n):
        rec_out, rec_state = hf_rule(module.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
        assert err(ours, rec_out) <= EXACT and err(ours_state, rec_state) <= EXACT
        chunk_out, chunk_state = hf_rule(module.torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
        assert err(ours, chunk_out) <= CHUNKED and err(ours_state, chunk_state) <= CHUNKED
    # A chain is a tree: same answer through the per-level path.
    tree_out, tree_states = tree_gated_delta(q, k, v, g, beta, [-1, *range(length - 1)], state)
    assert err(tree_out, ours) <= EXACT and err(tree_states[-1], ours_state) <= EXACT


@pytest.mark.parametrize("name", list(ALL_TREES))
def test_tree_nodes_equal_their_root_path_chain(name):
    torch.manual_seed(0)
    parents = ALL_TREES[name]
    q, k, v, g, beta = rule_inputs(len(parents), seed=len(parents))
    root = random_state()
    out, states = tree_gated_delta(q, k, v, g, beta, parents, root)
    assert out.shape == (len(parents), HV, DV) and states.shape == (len(parents), HV, DK, DV)
    for node in range(len(parents)):
        path = root_path(parents, node)
        ref_out, ref_state = hf_rule(
            q35.torch_recurrent_gated_delta_rule, q[path], k[path], v[path], g[path], beta[path], root
        )
        assert err(out[node], ref_out[-1]) <= EXACT, (name, node)
        assert err(states[node], ref_state) <= EXACT, (name, node)


def test_tree_helpers():
    assert tree_depths(TREES["deep"]).tolist() == [0, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 7, 7, 8, 8]
    assert root_path(TREES["deep"], 16) == [0, 7, 8, 9, 10, 11, 12, 13, 16]
    assert root_path(TREES["forest"], 6) == [1, 3, 6] and root_path(TREES["forest"], 8) == [4, 8]
    with pytest.raises(ValueError):
        tree_depths([-1, 2, 0])  # a parent after its child


# ---------------------------------------------------------------------------------------------
# The short causal conv


@pytest.mark.parametrize("history", [0, 1, 2, 9])
@pytest.mark.parametrize("name", ["chain", "deep", "forest", "random33"])
def test_tree_conv_equals_conv_over_root_path(name, history):
    torch.manual_seed(0)
    parents, channels, kernel = ALL_TREES[name], 12, 4
    weight = torch.randn(channels, kernel)
    bias = torch.randn(channels)
    past = torch.randn(channels, history)  # committed pre-conv inputs, oldest first
    x = torch.randn(len(parents), channels)
    # transformers' cache keeps K columns (zero-padded at prefill); we also accept exactly K-1.
    hf_state = torch.nn.functional.pad(past, (max(kernel - history, 0), 0))[:, -kernel:]
    for state in (hf_state, hf_state[:, 1:]):
        out = tree_causal_conv(x, parents, state, weight, bias, "silu")
        windows = tree_conv_windows(x, parents, state, kernel)
        for node in range(len(parents)):
            seq = torch.cat([past, x[root_path(parents, node)].T], dim=1)
            ref = q35.causal_conv1d_fn(seq[None], weight, bias, activation="silu")[0, :, -1]
            assert err(out[node], ref) <= EXACT, (name, history, node)
            # The node's window is the committed conv state after accepting its path.
            new_state = commit_conv_state(state, x, parents, node, width=kernel - 1)
            assert torch.equal(new_state, windows[node, :, 1:])
            padded = torch.nn.functional.pad(seq, (kernel, 0))
            assert torch.equal(commit_conv_state(hf_state, x, parents, node), padded[:, -kernel:])


# ---------------------------------------------------------------------------------------------
# Whole transformers layers


def tiny_config(kind: str):
    common = dict(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=HK, linear_num_value_heads=HV,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
    )
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(**common)
    return Qwen3NextConfig(**common, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32)


def tiny_layer(kind: str, layer_idx: int = 1):
    torch.manual_seed(11)
    config = tiny_config(kind)
    cls = q35.Qwen3_5GatedDeltaNet if kind == "qwen3_5" else q3n.Qwen3NextGatedDeltaNet
    module = cls(config, layer_idx).eval()
    with torch.no_grad():  # a non-trivial gated-norm weight and time-step bias
        module.norm.weight.uniform_(0.5, 1.5)
        module.dt_bias.normal_()
    return config, module


def hf_cached_states(module, config, rows):
    """Run the module over rows with transformers' own cache; return its (recurrent, conv) state."""
    cache = DynamicCache(config=config)
    module(rows[None], cache_params=cache)
    layer = cache.layers[module.layer_idx]
    return layer.recurrent_states[0][0], layer.conv_states[0][0]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_prefill_matches_module_forward_and_cache(kind):
    config, module = tiny_layer(kind)
    prefix = torch.randn(70, config.hidden_size)  # longer than one GDN chunk (64)
    with torch.no_grad():
        ref = module(prefix[None])[0]
        ref_state, ref_conv = hf_cached_states(module, config, prefix)
        out, state, conv = gdn_layer_prefill(module, prefix, None, None)
        assert err(out, ref) <= CHUNKED and err(state, ref_state) <= CHUNKED  # our own chunked form
        assert err(conv, ref_conv[:, 1:]) <= EXACT  # projections of different row counts: BLAS rounding
        # Continuing from a committed state equals one forward over everything.
        more = torch.randn(9, config.hidden_size)
        out2, state2, conv2 = gdn_layer_prefill(module, more, state, conv)
        ref_all = module(torch.cat([prefix, more])[None])[0]
        ref_state2, ref_conv2 = hf_cached_states(module, config, torch.cat([prefix, more]))
        assert err(out2, ref_all[-9:]) <= CHUNKED and err(state2, ref_state2) <= CHUNKED
        assert err(conv2, ref_conv2[:, 1:]) <= EXACT


@pytest.mark.parametrize(
    ("tree", "history"), [("single", 70), ("chain", 70), ("star", 70), ("deep", 70), ("random33", 70), ("deep", 0)]
)
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_layer_tree_node_equals_module_forward_on_its_path(kind, tree, history):
    config, module = tiny_layer(kind)
    parents = ALL_TREES[tree]
    prefix = torch.randn(history, config.hidden_size)  # 70: longer than one GDN chunk (64)
    nodes = torch.randn(len(parents), config.hidden_size)
    with torch.no_grad():
        if history:
            committed, conv = hf_cached_states(module, config, prefix)  # K-column transformers layout
        else:
            committed, conv = None, None  # nothing committed: zero state, zero conv history
        out, states, windows = gdn_layer_tree(module, nodes, parents, committed, conv)
        assert out.shape == nodes.shape and windows.shape == (len(parents), module.conv_dim, 3)
        for node in range(len(parents)):
            seq = torch.cat([prefix, nodes[root_path(parents, node)]])
            ref = module(seq[None])[0, -1]  # no cache: chunked rule over the whole sequence
            assert err(out[node], ref) <= CHUNKED, (kind, tree, node)
            if node % 3 and node != len(parents) - 1:
                continue  # states: a third of the nodes keeps the test fast; the rule tests check them all
            ref_state, ref_conv = hf_cached_states(module, config, seq)
            assert err(states[node], ref_state) <= CHUNKED, (kind, tree, node)
            assert err(windows[node], ref_conv[:, 1:]) <= EXACT


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_layer_tree_ar_step_matches_cached_decode(kind):
    """N = 1 is a plain decode step: transformers' own single-token cached path (recurrent rule)."""
    config, module = tiny_layer(kind)
    prefix = torch.randn(70, config.hidden_size)
    token = torch.randn(1, config.hidden_size)
    with torch.no_grad():
        cache = DynamicCache(config=config)
        module(prefix[None], cache_params=cache)
        layer = cache.layers[module.layer_idx]
        committed, conv = layer.recurrent_states[0][0].clone(), layer.conv_states[0][0].clone()
        ref = module(token[None], cache_params=cache)[0]
        out, states, windows = gdn_layer_tree(module, token, [-1], committed, conv)
        assert err(out, ref) <= EXACT
        assert err(states[0], layer.recurrent_states[0][0]) <= EXACT
        assert err(windows[0], layer.conv_states[0][0][:, 1:]) <= EXACT
        # A chain tree equals that many single-token cached decode steps.
        committed, conv = layer.recurrent_states[0][0].clone(), layer.conv_states[0][0].clone()
        rows = torch.randn(6, config.hidden_size)
        steps = torch.cat([module(rows[i : i + 1][None], cache_params=cache)[0] for i in range(6)])
        out, states, windows = gdn_layer_tree(module, rows, [-1, 0, 1, 2, 3, 4], committed, conv)
        assert err(out, steps) <= EXACT
        assert err(states[-1], layer.recurrent_states[0][0]) <= EXACT
        assert err(windows[-1], layer.conv_states[0][0][:, 1:]) <= EXACT


def test_per_node_state_bytes_counts_what_the_layer_returns():
    for kind in ("qwen3_5", "qwen3_next"):
        config, module = tiny_layer(kind)
        linear_layers = config.layer_types.count("linear_attention")
        assert linear_layers == 3
        budget = 7
        with torch.no_grad():
            _, states, windows = gdn_layer_tree(module, torch.randn(budget + 1, 64), random_parents(8, 0), None, None)
        per_layer = states.numel() * states.element_size() + windows.numel() * windows.element_size()
        assert per_node_state_bytes(config, budget, torch.float32) == linear_layers * per_layer
    # Qwen3.5 defaults: 24 GDN layers, 32 value heads of 128×128 fp32 state, conv_dim 8192, bf16 windows.
    big = Qwen3_5TextConfig()
    assert per_node_state_bytes(big, 0, torch.bfloat16) == 24 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)


# ---------------------------------------------------------------------------------------------
# The parallel (WY) form: the fast path's tree verify and the prefill


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


@pytest.mark.parametrize("name", sorted(ALL_TREES))
def test_parallel_form_equals_the_scan_on_every_node(name):
    """The one-solve form gives each node the output of its own root path (the scan's), and the
    state rebuilt after any node equals the scan's per-node state."""
    parents = ALL_TREES[name]
    if min(parents[1:] or [0]) < -1 or parents.count(-1) > 1:
        pytest.skip("the parallel form takes one root (the committed state)")
    q, k, v, g, beta = rule_inputs(len(parents), seed=5)
    root = random_state()
    scan_out, scan_states = tree_gated_delta(q, k, v, g, beta, parents, root)
    out, parts = parallel_gated_delta(q, k, v, g, beta, ancestor_matrix(parents), root)
    assert err(out, scan_out) <= CHUNKED, name
    for node in range(len(parents)):
        assert err(state_after(parts, node), scan_states[node]) <= CHUNKED, (name, node)


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_chunked_chain_equals_the_recurrent_rule(length):
    q, k, v, g, beta = rule_inputs(length, seed=9)
    root = random_state()
    out, final = chunked_gated_delta(q, k, v, g, beta, root)
    ref_out, ref_state = hf_rule(q35.torch_recurrent_gated_delta_rule, q, k, v, g, beta, root)
    assert err(out, ref_out) <= CHUNKED and err(final, ref_state) <= CHUNKED
