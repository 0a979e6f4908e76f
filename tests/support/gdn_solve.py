"""What the Gated DeltaNet solve tests share (``test_engine_gdn_solve``, ``_paths``, ``_decode``):
the solve kernel switched on and its calls recorded, random trees, and one solve run both ways
(the kernel and the PyTorch solve it replaces) on the same random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree_diag.engine import gdn
from ddtree_diag.engine.fast import kernels
from ddtree_diag.engine.tree import ancestor_mask
from tests.support.kernel_tests import DEVICE, record_calls, turn_kernels_on

TOKENS = 10  # per decode: every norm runs under the interpreter too, ~1 s a token on CPU


def record_solves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int | None]]:
    """The solve kernel on (CPU tensors too) for a test; returns a list of the (row count,
    max_path) it is called with (the ``solver`` fixture in conftest)."""
    turn_kernels_on(monkeypatch, "DDTREE_DIAG_GDN_KERNEL")
    module = kernels._triton_gdn()
    assert module is not None, "triton is installed but the solve kernel did not import"
    solved = []
    record_calls(monkeypatch, module, "tree_solve",
                 lambda conv_out, *_, **kw: solved.append((conv_out.shape[0], kw.get("max_path"))))
    return solved


def random_parents(n: int, shape: str, generator: torch.Generator) -> list[int]:
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "padded":  # a small tree, then padding rows that only see themselves (parent -1)
        used = max(1, n // 2)
        return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, used)] + [-1] * (n - used)
    return [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, n)]


def solve_both(n, shape, dtype, key_heads=2, value_heads=4, dk=32, dv=32, seed=0, with_paths=False, **tile):
    """(kernel's out, keys, updates, path decay), (the same from the PyTorch solve). ``with_paths``:
    the kernel gets the rows' path table (``path_table``) as a verify passes it."""
    generator = torch.Generator().manual_seed(seed)
    parents = random_parents(n, shape, generator)
    anc = ancestor_mask(parents).to(DEVICE)
    width = 2 * key_heads * dk + value_heads * dv

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(DEVICE)

    conv_out = rand(n, width).to(dtype)
    gates = rand(n, 2 * value_heads + 5, scale=2.0).to(dtype)  # a and b as strided column slices
    a, b = gates[:, :value_heads], gates[:, value_heads + 3 : 2 * value_heads + 3]
    a_log, dt_bias = rand(value_heads, scale=0.5), rand(value_heads).to(dtype)
    state = rand(value_heads, dk, dv, scale=0.2)
    q, k, v = conv_out.split([key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    reference, parts = gdn.parallel_gated_delta(
        q.reshape(n, key_heads, dk), k.reshape(n, key_heads, dk), v.reshape(n, value_heads, dv), g, b.sigmoid(),
        anc, state,
    )
    fp32 = dict(device=DEVICE, dtype=torch.float32)
    keys, updates = torch.full((value_heads, n, dk), 7.0, **fp32), torch.full((value_heads, n, dv), 7.0, **fp32)
    decay = torch.full((value_heads, n), 7.0, **fp32)
    module = kernels._triton_gdn()
    if with_paths:
        tile["paths"] = module.path_table(anc, tile["max_path"])
    out = module.tree_solve(conv_out, a, b, a_log, dt_bias, anc, state, keys, updates, decay, key_heads, dk, **tile)
    return (out.reshape(n, value_heads, dv), keys, updates, decay), (
        reference, parts.keys, parts.updates, parts.path_decay,
    )


CASES = [(5, "chain"), (17, "tree"), (40, "bushy"), (33, "padded"), (16, "chain"), (150, "tree")]
