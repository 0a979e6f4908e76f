"""The Gated DeltaNet conv and commit kernels (engine/fast/triton_gdn_state.py) against the PyTorch
functions they replace: ``gdn.conv_windows`` + ``gdn.conv_from_windows`` (the tree-row conv) and
``gdn.state_after`` + the tail of ``last``'s window (the commit), on chains, bushy trees, trees
padded with parent -1 rows, and single rows.

Without a GPU the kernels run through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``);
on a GPU the same checks run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ddtree_diag.engine import gdn  # noqa: E402
from ddtree_diag.engine.fast import triton_gdn_state  # noqa: E402
from tests.support.kernel_tests import DEVICE, MARKS, skip_without_gpu  # noqa: E402

pytestmark = MARKS

WIDTH = 4  # the conv kernel size of every Qwen3.5 / Qwen3-Next checkpoint


@pytest.fixture(autouse=True)
def _needs_device():
    skip_without_gpu()


def random_parents(n: int, shape: str, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Topological parents for ``n`` real rows then ``padding`` rows of -1: a chain, a bushy tree
    (each node's parent anywhere earlier) or a forest (some nodes hang off the committed state)."""
    parents = []
    for i in range(n):
        if i == 0:
            parents.append(-1)
        elif shape == "chain":
            parents.append(i - 1)
        elif shape == "bushy":
            parents.append(int(torch.randint(0, i, (1,), generator=generator)))
        else:  # forest
            parents.append(int(torch.randint(-1, i, (1,), generator=generator)))
    return torch.tensor(parents + [-1] * padding, dtype=torch.long)


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: j is i or an ancestor of i."""
    n = parents.shape[0]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        if parents[i] >= 0:
            anc[i] |= anc[int(parents[i])]
    return anc


CASES = [
    (1, "chain", 0),
    (17, "chain", 0),
    (17, "bushy", 0),
    (13, "forest", 4),
    (40, "bushy", 0),
    (30, "chain", 10),
]


# the trees above, each with a bias / activation pair (Qwen3.5's conv: no bias, silu)
CONV_CASES = [
    (*case, use_bias, activation)
    for case, (use_bias, activation) in zip(
        CASES, [(False, "silu"), (True, "silu"), (True, None), (False, "silu"), (True, "silu"), (False, None)],
        strict=True,
    )
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "shape", "padding", "use_bias", "activation"), CONV_CASES)
def test_conv_rows_matches_reference(n, shape, padding, use_bias, activation, dtype):
    """Each row's window from its parent chain: the reference's windows (forests and padding rows
    too)."""
    generator = torch.Generator().manual_seed(n * 31 + padding + len(shape))
    channels = 300  # two channel blocks, the second partly outside: the edge masks run
    parents = random_parents(n, shape, padding, generator)
    rows = parents.shape[0]
    # mixed is a column slice of a wider projection output, as the fused GEMM hands it over
    wide = torch.randn(rows, channels + 24, generator=generator).to(dtype)
    mixed = wide[:, 8 : 8 + channels]
    conv_state = torch.randn(channels, WIDTH - 1, generator=generator).to(dtype)
    weight = (0.5 * torch.randn(channels, WIDTH, generator=generator)).to(dtype)
    bias = torch.randn(channels, generator=generator).to(dtype)
    b = bias if use_bias else None
    windows = gdn.conv_windows(mixed, parents, conv_state, WIDTH)
    expected = gdn.conv_from_windows(windows, weight, b, activation).to(dtype)
    out, kept = triton_gdn_state.conv_rows(
        mixed.to(DEVICE), parents.to(DEVICE), conv_state.to(DEVICE), weight.to(DEVICE),
        None if b is None else b.to(DEVICE), activation,
    )
    assert out.dtype == dtype and kept.dtype == dtype
    assert kept.is_contiguous() and torch.equal(kept.cpu(), mixed)  # the inputs, copied: exact
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    else:  # the sum's order may move a value across a rounding boundary: one bf16 step
        torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=8e-3, atol=8e-3)
        assert (out.cpu() != expected).float().mean() < 0.05


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_conv_rows_rounds_where_inputs_and_weight_differ_in_dtype(x_dtype, w_dtype):
    """Windows rounded to the weight's dtype before the products, the output to the inputs' (the
    kernel skips both roundings where the dtypes agree)."""
    generator = torch.Generator().manual_seed(5)
    channels = 300
    parents = random_parents(17, "bushy", 0, generator)
    mixed = torch.randn(17, channels, generator=generator).to(x_dtype)
    conv_state = torch.randn(channels, WIDTH - 1, generator=generator).to(x_dtype)
    weight = (0.5 * torch.randn(channels, WIDTH, generator=generator)).to(w_dtype)
    windows = gdn.conv_windows(mixed, parents, conv_state, WIDTH)
    expected = gdn.conv_from_windows(windows, weight, None, "silu").to(x_dtype)
    out, _ = triton_gdn_state.conv_rows(mixed.to(DEVICE), parents.to(DEVICE), conv_state.to(DEVICE),
                                        weight.to(DEVICE), None, "silu")
    assert out.dtype == x_dtype
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=8e-3, atol=8e-3)
    assert (out.cpu() != expected).float().mean() < 0.05
    if x_dtype == torch.float32:  # the windows were rounded to bf16: fp32 windows would miss
        unrounded = gdn.conv_from_windows(windows, weight.float(), None, "silu")
        assert (out.cpu() != unrounded).float().mean() > 0.5


def test_conv_rows_writes_inputs_into_a_buffer_and_pads_a_short_state():
    """A caller's buffer receives the inputs; a conv state narrower than K-1 reads zeros past its
    oldest column, as the reference left-pads it."""
    generator = torch.Generator().manual_seed(3)
    parents = torch.tensor([-1, 0, 1, 0, -1])
    mixed = torch.randn(5, 64, generator=generator)
    conv_state = torch.randn(64, 1, generator=generator)
    weight = torch.randn(64, WIDTH, generator=generator)
    windows = gdn.conv_windows(mixed, parents, conv_state, WIDTH)
    expected = gdn.conv_from_windows(windows, weight, None, "silu")
    buffer = torch.full((5, 64), 7.0, device=DEVICE)
    out, kept = triton_gdn_state.conv_rows(
        mixed.to(DEVICE), parents.to(DEVICE), conv_state.to(DEVICE), weight.to(DEVICE), None, "silu", buffer
    )
    assert kept is buffer
    assert torch.equal(buffer.cpu(), mixed)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "shape", "padding"), CASES)
def test_conv_tail_is_the_tail_of_the_rows_window(n, shape, padding):
    """``gdn.conv_tail`` (what the commit's PyTorch path keeps) against the reference's windows."""
    generator = torch.Generator().manual_seed(n + padding)
    parents = random_parents(n, shape, padding, generator)
    rows = parents.shape[0]
    mixed = torch.randn(rows, 24, generator=generator).to(torch.bfloat16)
    conv_state = torch.randn(24, WIDTH - 1, generator=generator).to(torch.bfloat16)
    windows = gdn.conv_windows(mixed, parents, conv_state, WIDTH)
    for last in range(rows):
        tail = gdn.conv_tail(mixed, parents, conv_state, torch.tensor([last]))
        assert torch.equal(tail, windows[last, :, 1:]), last


def commit_inputs(n: int, shape: str, padding: int, heads: int, dk: int, dv: int, channels: int, dtype):
    generator = torch.Generator().manual_seed(n * 7 + padding)
    parents = random_parents(n, shape, padding, generator)
    rows = parents.shape[0]
    anc = ancestors(parents)
    g = -torch.rand(rows, heads, generator=generator)  # log decays are <= 0
    return {
        "state": torch.randn(heads, dk, dv, generator=generator),
        "conv_state": torch.randn(channels, WIDTH - 1, generator=generator).to(dtype),
        "keys": torch.randn(heads, rows, dk, generator=generator),
        "updates": torch.randn(heads, rows, dv, generator=generator),
        "path_decay": (anc.float() @ g).transpose(0, 1).contiguous(),
        "inputs": torch.randn(rows, channels, generator=generator).to(dtype),
        "parents": parents,
        "anc": anc,
    }


def accepted_path(parents: torch.Tensor, last: int, width: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(path, count) as the accept walk hands them to the commit: ``last``'s root path, root
    first, padded with other rows (which must not count) to ``width``; the rows on it."""
    path = [last]
    while int(parents[path[-1]]) >= 0:
        path.append(int(parents[path[-1]]))
    path = path[::-1]
    padded = path + [(last + 1 + i) % len(parents) for i in range(width - len(path))]
    return torch.tensor(padded, device=DEVICE), torch.tensor([len(path)], device=DEVICE)


def window_tail(inputs: dict, last: int) -> torch.Tensor:
    """The conv state the commit must leave: the tail of row ``last``'s window (the reference)."""
    windows = gdn.conv_windows(inputs["inputs"], inputs["parents"], inputs["conv_state"], WIDTH)
    return windows[last, :, 1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "shape", "padding"), CASES)
def test_commit_states_matches_state_after(n, shape, padding, dtype):
    # dk, dv not multiples of the tile: edge masks; several heads and tiles per head
    inputs = commit_inputs(n, shape, padding, heads=3, dk=80, dv=72, channels=50, dtype=dtype)
    for last in sorted({0, n - 1, n // 2}):
        parts = gdn.ParallelParts(
            inputs["keys"], inputs["updates"], inputs["path_decay"], inputs["anc"], inputs["state"]
        )
        expected = gdn.state_after(parts, last)
        on_device = {name: value.to(DEVICE) for name, value in inputs.items()}
        for ok in (True, False) if last == n - 1 else (True,):
            state, conv_state = on_device["state"].clone(), on_device["conv_state"].clone()
            triton_gdn_state.commit_states(
                state, conv_state, on_device["keys"], on_device["updates"], on_device["path_decay"],
                on_device["inputs"], on_device["parents"], *accepted_path(inputs["parents"], last, width=max(16, n)),
                torch.tensor(ok, device=DEVICE),
            )
            if ok:
                torch.testing.assert_close(state.cpu(), expected, rtol=1e-5, atol=1e-5)
                assert torch.equal(conv_state.cpu(), window_tail(inputs, last))
            else:  # nothing moves
                assert torch.equal(state.cpu(), inputs["state"])
                assert torch.equal(conv_state.cpu(), inputs["conv_state"])


def test_commit_states_full_head_size():
    """128 x 128 heads (the real checkpoints' size: two 64-wide tiles each way) on a padded tree."""
    inputs = commit_inputs(9, "bushy", 7, heads=2, dk=128, dv=128, channels=96, dtype=torch.bfloat16)
    parts = gdn.ParallelParts(inputs["keys"], inputs["updates"], inputs["path_decay"], inputs["anc"], inputs["state"])
    expected = gdn.state_after(parts, 8)
    on_device = {name: value.to(DEVICE) for name, value in inputs.items()}
    triton_gdn_state.commit_states(
        on_device["state"], on_device["conv_state"], on_device["keys"], on_device["updates"],
        on_device["path_decay"], on_device["inputs"], on_device["parents"], *accepted_path(inputs["parents"], 8),
        torch.tensor(True, device=DEVICE),
    )
    torch.testing.assert_close(on_device["state"].cpu(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(on_device["conv_state"].cpu(), window_tail(inputs, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_of_stacked_layers_equals_each_layer_alone(dtype):
    """The decoder commits every layer in one launch (each tensor a stack [layers, ...]): each
    layer's state and conv window must come out as that layer's own commit leaves them, from its
    own keys, updates, decays and inputs (a layer offset wrong by one would read a neighbour's),
    and a round that is not ok must leave every layer as it was."""
    layers, n = 3, 11
    per_layer = [commit_inputs(n, "bushy", 3, heads=2, dk=48, dv=40, channels=70, dtype=dtype) for _ in range(layers)]
    parents = per_layer[0]["parents"]  # one round: the tree is every layer's, the values are not
    generator = torch.Generator().manual_seed(5)
    for layer_inputs in per_layer[1:]:
        for name in ("state", "conv_state", "keys", "updates", "inputs"):
            value = layer_inputs[name]
            layer_inputs[name] = torch.randn(value.shape, generator=generator).to(value.dtype)
        layer_inputs["path_decay"] = layer_inputs["path_decay"] * torch.rand(1, generator=generator)
    names = ("state", "conv_state", "keys", "updates", "path_decay", "inputs")
    stacked = {name: torch.stack([x[name] for x in per_layer]).to(DEVICE) for name in names}
    path = accepted_path(parents, n - 1)
    for ok in (True, False):
        state, conv_state = stacked["state"].clone(), stacked["conv_state"].clone()
        triton_gdn_state.commit_states(
            state, conv_state, stacked["keys"], stacked["updates"], stacked["path_decay"], stacked["inputs"],
            parents.to(DEVICE), *path, torch.tensor(ok, device=DEVICE),
        )
        for layer, x in enumerate(per_layer):
            alone = {name: x[name].to(DEVICE).clone() for name in names}
            triton_gdn_state.commit_states(
                alone["state"], alone["conv_state"], alone["keys"], alone["updates"], alone["path_decay"],
                alone["inputs"], parents.to(DEVICE), *path, torch.tensor(ok, device=DEVICE),
            )
            assert torch.equal(state[layer], alone["state"]), (ok, layer)
            assert torch.equal(conv_state[layer], alone["conv_state"]), (ok, layer)
            if not ok:
                assert torch.equal(state[layer].cpu(), x["state"])
                assert torch.equal(conv_state[layer].cpu(), x["conv_state"])
        if ok:  # and each layer moved (the layers differ, so a shared read would show)
            assert not torch.equal(state[0], state[1]) and not torch.equal(state.cpu(), stacked["state"].cpu())


@pytest.mark.parametrize("history", [1, 2, 5])
def test_commit_keeps_a_conv_state_of_any_width(history):
    """A conv state narrower or wider than K-1 columns: the commit leaves the last ``history``
    inputs of (committed history + accepted path), as the reference's ``commit_conv_state``."""
    parents = torch.tensor([-1, 0, 1, 2, 1, -1, 5, -1])
    inputs = commit_inputs(len(parents), "chain", 0, heads=2, dk=16, dv=16, channels=40, dtype=torch.float32)
    inputs["parents"], inputs["anc"] = parents, ancestors(parents)
    inputs["conv_state"] = torch.randn(40, history, generator=torch.Generator().manual_seed(history))
    on_device = {name: value.to(DEVICE) for name, value in inputs.items()}
    for last in range(len(parents)):
        conv_state = on_device["conv_state"].clone()
        triton_gdn_state.commit_states(
            on_device["state"].clone(), conv_state, on_device["keys"], on_device["updates"],
            on_device["path_decay"], on_device["inputs"], on_device["parents"], *accepted_path(parents, last),
            torch.tensor(True, device=DEVICE),
        )
        want = gdn.commit_conv_state(inputs["conv_state"], inputs["inputs"], parents.tolist(), last)
        assert torch.equal(conv_state.cpu(), want), last
        assert torch.equal(gdn.conv_tail(inputs["inputs"], parents, inputs["conv_state"], torch.tensor([last])), want)


def test_commit_of_many_random_trees_reads_every_old_conv_column_before_writing():
    """The commit rebuilds each channel's conv window in place: where the accepted path is shorter
    than the window, new columns come from old ones of the same channel, read by other threads of
    the program. Many channels a program and many random trees, so that on a GPU a write racing
    ahead of a read would show (under the interpreter the threads run in order: a smoke test)."""
    generator = torch.Generator().manual_seed(3)
    trials = 60 if DEVICE == "cuda" else 4
    for trial in range(trials):
        n = int(torch.randint(2, 40, (1,), generator=generator))
        parents = random_parents(n, ("chain", "bushy", "forest")[trial % 3], trial % 5, generator)
        history = (1, 3, 7)[trial % 3]
        inputs = commit_inputs(n, "chain", 0, heads=1, dk=16, dv=16, channels=512, dtype=torch.bfloat16)
        rows = parents.shape[0]
        inputs["inputs"] = torch.randn(rows, 512, generator=generator).to(torch.bfloat16)
        inputs["conv_state"] = torch.randn(512, history, generator=generator).to(torch.bfloat16)
        inputs["parents"] = parents
        for name in ("keys", "updates", "path_decay"):
            inputs[name] = inputs[name][:, :1].expand(-1, rows, *inputs[name].shape[2:]).contiguous()
        last = int(torch.randint(0, n, (1,), generator=generator))
        on_device = {name: value.to(DEVICE) for name, value in inputs.items() if name != "anc"}
        conv_state = on_device["conv_state"].clone()
        triton_gdn_state.commit_states(
            on_device["state"].clone(), conv_state, on_device["keys"], on_device["updates"],
            on_device["path_decay"], on_device["inputs"], on_device["parents"],
            *accepted_path(parents, last, width=max(16, rows)), torch.tensor(True, device=DEVICE),
        )
        want = gdn.commit_conv_state(inputs["conv_state"], inputs["inputs"], parents.tolist(), last)
        assert torch.equal(conv_state.cpu(), want), (trial, n, history, last)
