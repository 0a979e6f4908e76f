"""Gated DeltaNet (linear attention) over a draft TREE, for hybrid Qwen3.5 / Qwen3-Next targets.

A hybrid target interleaves full-attention layers (a mask handles the tree) with Gated DeltaNet
layers whose recurrent state cannot be masked: every tree node needs its own state, forked from
its parent's. This module is the pure-PyTorch core for those layers:

- ``gated_delta_step``: one step of the gated delta rule, the same math (and op order) as the
  loop body of transformers' ``torch_recurrent_gated_delta_rule``, so fp32 results agree with it.
- ``tree_gated_delta``: state[i] = step(state[parent[i]], node i), one batched step per depth
  level (nodes at equal depth never depend on each other). A chain is parents = [-1, 0, 1, ...];
  plain AR is N = 1.
- ``tree_causal_conv``: the short depthwise causal conv that precedes the recurrence; node i's
  window is its ancestors' inputs topped up from the committed conv state.
- ``gdn_layer_tree``: a real transformers ``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet``
  (also ``Qwen3_5MoeGatedDeltaNet``, same layout as Qwen3.5) run on tree rows with its own weights.

Shapes carry no batch dimension (the engine verifies one sequence). Committed state layout:
- recurrent state ``[num_v_heads, head_k_dim, head_v_dim]``, kept in fp32 like transformers' cache;
- conv state ``[conv_dim, L]`` with L >= K-1: the last L committed *pre-conv* inputs, oldest first
  (transformers' cache keeps L = K columns per layer; only the last K-1 matter). Fewer than K-1
  committed tokens: left-pad with zeros, as transformers does at prefill.
Commit after accepting tree node a: recurrent state = states[a], conv state = windows[a].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ddtree_diag.engine.arch import text_config

# transformers' l2norm (aligned with the FLA kernels) adds eps inside the rsqrt.
L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------------
# Tree bookkeeping


def _parents_tensor(parents: torch.Tensor | list[int], device: torch.device | None = None) -> torch.Tensor:
    p = torch.as_tensor(parents, dtype=torch.long, device=device)
    if p.ndim != 1:
        raise ValueError(f"parents must be 1-D, got shape {tuple(p.shape)}")
    n = p.shape[0]
    idx = torch.arange(n, device=p.device)
    if bool(((p < -1) | (p >= idx)).any()):
        raise ValueError("parents must be in topological order: -1 <= parents[i] < i")
    return p


def tree_depths(parents: torch.Tensor | list[int]) -> torch.Tensor:
    """Depth of each node: 0 for a node whose parent is the committed state (-1)."""
    p = _parents_tensor(parents).tolist()
    depth: list[int] = []
    for parent in p:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return torch.tensor(depth, dtype=torch.long)


def root_path(parents: torch.Tensor | list[int], node: int) -> list[int]:
    """Node indices from the tree's top (parent -1) down to ``node`` inclusive."""
    p = _parents_tensor(parents).tolist()
    path = []
    while node >= 0:
        path.append(node)
        node = p[node]
    return path[::-1]


# ----------------------------------------------------------------------------------------------
# Gated delta rule


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., Hk, dk] -> fp32 [..., Hv, dk]: head repeat, optional l2norm, q scaled by 1/sqrt(dk).

    Done once for all nodes, before any step. Each q/k head serves num_v_heads // num_k_heads
    *consecutive* value heads (repeat_interleave, not tile), as in transformers.
    """
    num_k_heads = k.shape[-2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads {num_v_heads} is not a multiple of num_k_heads {num_k_heads}")
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=-2)
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # Divide (not multiply by dk**-0.5): the recurrent reference divides, and we want its exact bits.
    q = q / (q.shape[-1] ** 0.5)
    return q, k


def gated_delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated-delta-rule step on prepared (``prepare_qk``) fp32 inputs; returns (out, new_state).

    state [..., H, dk, dv]; q, k [..., H, dk]; v [..., H, dv]; g (log decay, <= 0), beta [..., H].
    """
    state = state * g.exp()[..., None, None]
    # What the decayed state already predicts for key k; only the correction is written.
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q.unsqueeze(-1)).sum(dim=-2)
    return out, state


def _zero_state(num_v_heads: int, dk: int, dv: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(num_v_heads, dk, dv, dtype=torch.float32, device=device)


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain chain over T tokens: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv].

    Returns (out [T, Hv, dv] in q's dtype, final state [Hv, dk, dv] fp32).
    """
    num_v_heads, dv = v.shape[-2:]
    qp, kp = prepare_qk(q, k, num_v_heads, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    state = _zero_state(num_v_heads, kp.shape[-1], dv, v.device) if initial_state is None else initial_state.float()
    outs = []
    for t in range(v.shape[0]):
        out, state = gated_delta_step(state, qp[t], kp[t], vf[t], gf[t], bf[t])
        outs.append(out)
    return torch.stack(outs).to(q.dtype), state


def tree_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor | list[int],
    root_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over a tree of N nodes in topological order (parents[i] < i, -1 = root_state).

    q, k [N, Hk, dk]; v [N, Hv, dv]; g, beta [N, Hv]; root_state [Hv, dk, dv] (None = zeros).
    Returns (out [N, Hv, dv] in q's dtype, states [N, Hv, dk, dv] fp32): node i's output and the
    state after node i, each equal to running the chain over node i's root path from root_state.
    """
    n = v.shape[0]
    num_v_heads, dv = v.shape[-2:]
    p = _parents_tensor(parents, device=v.device)
    qp, kp = prepare_qk(q, k, num_v_heads, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    dk = kp.shape[-1]
    if root_state is None:
        root_state = _zero_state(num_v_heads, dk, dv, v.device)
    # Slot n holds the committed state, so parent -1 indexes it directly.
    states = torch.empty(n + 1, num_v_heads, dk, dv, dtype=torch.float32, device=v.device)
    states[n] = root_state.float()
    outs = torch.empty(n, num_v_heads, dv, dtype=torch.float32, device=v.device)
    src = torch.where(p < 0, torch.full_like(p, n), p)
    # Levels are found on the CPU (the tree is tiny); only their index lists go to the device.
    depth = tree_depths(p.cpu())
    for d in range(int(depth.max()) + 1 if n else 0):
        idx = (depth == d).nonzero().squeeze(-1).to(v.device)
        out, new = gated_delta_step(states[src[idx]], qp[idx], kp[idx], vf[idx], gf[idx], bf[idx])
        states[idx] = new
        outs[idx] = out
    return outs.to(q.dtype), states[:n]


@dataclass
class ParallelParts:
    """What ``parallel_gated_delta`` keeps to rebuild the state after any node (``state_after``):
    per value head, the prepared keys, the solved updates and each node's path log-decay."""

    keys: torch.Tensor  # [Hv, N, dk] fp32
    updates: torch.Tensor  # [Hv, N, dv] fp32 (u_j: what node j writes, beta-scaled delta)
    path_decay: torch.Tensor  # [Hv, N] fp32: sum of g over the node's root path (itself included)
    ancestors: torch.Tensor  # [N, N] bool: j is i or an ancestor of i
    root_state: torch.Tensor  # [Hv, dk, dv] fp32


def parallel_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ancestors: torch.Tensor,
    root_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, ParallelParts]:
    """The gated delta rule over a tree in one parallel (WY) solve, without per-node states.

    Unrolling a node's root path: S_i = e^{G_i} S0 + sum_{j in path(i)} e^{G_i - G_j} k_j u_j^T, with
    G_i the summed log decay along the path and u_j = beta_j (v_j - (decayed parent state)^T k_j).
    Substituting gives (I + L) U = beta * (V - e^{G} K S0), L[i, j] = beta_i e^{G_i - G_j} k_i . k_j
    for j a strict ancestor of i: a unit lower-triangular system in topological order. A chain's
    mask is the lower triangle (the chunked form transformers uses); a tree's is its ancestor
    mask, and cross-branch terms vanish, so every node gets its own root path's result.

    q, k [N, Hk, dk]; v [N, Hv, dv]; g, beta [N, Hv]; ancestors [N, N] bool (diagonal set).
    Returns (out [N, Hv, dv] in q's dtype, parts for ``state_after``). Static shapes and no host
    sync: capturable in a CUDA graph.
    """
    num_v_heads, dv = v.shape[-2:]
    qp, kp = prepare_qk(q, k, num_v_heads, use_qk_l2norm)
    queries, keys = qp.transpose(0, 1), kp.transpose(0, 1)  # [Hv, N, dk]
    values, rates = v.float().transpose(0, 1), beta.float().transpose(0, 1)[..., None]  # [Hv, N, dv], [Hv, N, 1]
    path_decay = (ancestors.float() @ g.float()).transpose(0, 1)  # [Hv, N]
    if root_state is None:
        root_state = torch.zeros(num_v_heads, keys.shape[-1], dv, dtype=torch.float32, device=v.device)
    root_state = root_state.float()
    n = ancestors.shape[0]
    strict = ancestors & ~torch.eye(n, dtype=torch.bool, device=ancestors.device)
    gaps = path_decay[:, :, None] - path_decay[:, None, :]  # G_i - G_j (<= 0 along a path)
    inf = torch.full((), float("-inf"), device=v.device)
    strict_decay = torch.where(strict, gaps, inf).exp()
    system = rates * strict_decay * (keys @ keys.transpose(1, 2))
    system = system + torch.eye(n, device=v.device)
    rhs = rates * (values - path_decay.exp()[..., None] * (keys @ root_state))
    updates = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    path_weights = torch.where(ancestors, gaps, inf).exp() * (queries @ keys.transpose(1, 2))
    out = path_decay.exp()[..., None] * (queries @ root_state) + path_weights @ updates
    return out.transpose(0, 1).to(q.dtype), ParallelParts(keys, updates, path_decay, ancestors, root_state)


def state_after(parts: ParallelParts, node: torch.Tensor | int) -> torch.Tensor:
    """The recurrent state [Hv, dk, dv] after ``node`` (an index, or a 1-element device tensor so a
    CUDA graph can pick it): e^{G_a} S0 + sum over the node's path of e^{G_a - G_j} k_j u_j^T."""
    index = torch.as_tensor(node, device=parts.keys.device).reshape(1)
    on_path = parts.ancestors.index_select(0, index)[0]  # [N]
    decay_a = parts.path_decay.index_select(1, index)  # [Hv, 1]
    inf = torch.full((), float("-inf"), device=parts.keys.device)
    weights = torch.where(on_path[None, :], decay_a - parts.path_decay, inf).exp()  # [Hv, N]
    written = parts.keys.transpose(1, 2) @ (weights[..., None] * parts.updates)
    return decay_a.exp()[..., None] * parts.root_state + written


def chunked_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A committed chain of T tokens (the prompt) in chunks of ``chunk`` parallel solves, carrying
    the state: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv] -> (out [T, Hv, dv], final state).
    Our own form, so no prefill depends on a library's chunked kernel and its version."""
    state = initial_state
    outs = []
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    for start in range(0, v.shape[0], chunk):
        end = min(start + chunk, v.shape[0])
        size = end - start
        out, parts = parallel_gated_delta(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], causal[:size, :size], state,
            use_qk_l2norm,
        )
        outs.append(out)
        state = state_after(parts, size - 1)
    if state is None:
        state = _zero_state(v.shape[-2], k.shape[-1], v.shape[-1], v.device)
    return torch.cat(outs) if outs else v.new_zeros(v.shape), state


# ----------------------------------------------------------------------------------------------
# Short causal conv


def _committed_tail(conv_state: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` committed columns of [C, L], zero-padded on the left when L < width."""
    if conv_state.shape[-1] >= width:
        return conv_state[:, conv_state.shape[-1] - width :]
    return F.pad(conv_state, (width - conv_state.shape[-1], 0))


def tree_conv_windows(
    x: torch.Tensor, parents: torch.Tensor | list[int], conv_state: torch.Tensor, width: int
) -> torch.Tensor:
    """Per-node input windows [N, C, width], oldest first, ending with the node itself.

    Window = the node's ancestors (nearest last) topped up from the committed history.
    x [N, C] are the pre-conv inputs of the nodes; conv_state [C, L] the committed inputs.
    """
    return conv_windows(x, _parents_tensor(parents, device=x.device), conv_state, width)


def conv_windows(x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor, width: int) -> torch.Tensor:
    """``tree_conv_windows`` for a parents tensor already known to be topological (no check, no
    host sync: the fast path runs it inside a CUDA graph)."""
    n = x.shape[0]
    p = parents
    hist = max(width - 1, 0)
    # One table of rows: committed history (slots 0..hist-1, newest last) then the nodes.
    table = torch.cat([_committed_tail(conv_state, hist).transpose(0, 1).to(x.dtype), x], dim=0)
    # prev[r]: the row one step earlier in time than row r (committed rows walk back in history;
    # the oldest is never stepped past within `width` steps, its clamp is just a placeholder).
    prev_hist = torch.arange(hist, device=x.device) - 1
    prev_nodes = torch.where(p < 0, torch.full_like(p, hist - 1), p + hist)
    prev = torch.cat([prev_hist, prev_nodes]).clamp(min=0)
    rows = [torch.arange(n, device=x.device) + hist]
    for _ in range(width - 1):
        rows.append(prev[rows[-1]])
    idx = torch.stack(rows[::-1], dim=1)  # [N, width], oldest first
    return table[idx].transpose(1, 2)


def conv_tail(x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The conv state [C, K-1] after committing tree row ``last`` (a 1-element long tensor): the
    tail of its ``conv_windows`` window, i.e. the inputs of the K-1 newest rows on its root path,
    topped up from ``conv_state`` [C, K-1] where the path is shorter. No host sync."""
    hist = conv_state.shape[-1]
    columns = []
    at = last.reshape(1)
    for step in range(hist):
        from_tree = x[at.clamp(min=0)][0]
        from_state = conv_state[:, (hist + at).clamp(0, hist - 1)][:, 0].to(x.dtype)
        columns.append(torch.where(at >= 0, from_tree, from_state))
        if step < hist - 1:
            at = torch.where(at >= 0, parents[at.clamp(min=0)], at - 1)
    return torch.stack(columns[::-1], dim=1).to(conv_state.dtype)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r}")


def tree_causal_conv(
    x: torch.Tensor,
    parents: torch.Tensor | list[int],
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv (+ activation) of each node over its own root path: x [N, C] -> [N, C].

    weight [C, K] (``module.conv1d.weight.squeeze(1)``), conv_state [C, L >= K-1] committed inputs.
    """
    windows = tree_conv_windows(x, parents, conv_state, weight.shape[-1])
    return conv_from_windows(windows, weight, bias, activation).to(x.dtype)


def conv_from_windows(
    windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """[N, C, K] windows -> [N, C]. Uses F.conv1d (one output per window) like transformers."""
    c = windows.shape[1]
    out = F.conv1d(windows.to(weight.dtype), weight.unsqueeze(1), bias, groups=c)[:, :, -1]
    return _activate(out, activation)


def commit_conv_state(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    parents: torch.Tensor | list[int],
    node: int,
    width: int | None = None,
) -> torch.Tensor:
    """New committed conv state [C, width] after accepting the root-to-``node`` path of the tree.

    = the last ``width`` inputs of (committed history + accepted path); width defaults to the
    current state's width, so transformers' K-column layout round-trips.
    """
    width = conv_state.shape[-1] if width is None else width
    path = x[root_path(parents, node)].transpose(0, 1).to(conv_state.dtype)
    return _committed_tail(torch.cat([conv_state, path], dim=-1), width)


# ----------------------------------------------------------------------------------------------
# Memory


def per_node_state_bytes(config: Any, budget: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of per-node GDN state for a tree of budget+1 nodes over all linear-attention layers.

    Per node and layer: recurrent state Hv × dk × dv (``state_dtype``; transformers keeps it in
    fp32 even for bf16 models) + a conv window of K-1 inputs × conv_dim (``dtype``, the model's).
    """
    cfg = text_config(config)
    layers = sum(1 for t in (cfg.layer_types or []) if t == "linear_attention")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * hk * dk + hv * dv
    state = hv * dk * dv * torch.empty(0, dtype=state_dtype).element_size()
    window = conv_dim * (cfg.linear_conv_kernel_dim - 1) * torch.empty(0, dtype=dtype).element_size()
    return (budget + 1) * layers * (state + window)


# ----------------------------------------------------------------------------------------------
# A whole transformers GatedDeltaNet layer on tree rows


def gdn_projections(
    module: torch.nn.Module, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, hidden] -> (pre-conv mixed qkv [N, conv_dim], z [N, Hv, dv], b [N, Hv], a [N, Hv]).

    Qwen3.5 (and Qwen3.5-MoE) have separate in_proj_qkv / z / b / a. Qwen3-Next projects qkvz and
    ba jointly, grouped per *key head*: each group holds [q, k, v·r, z·r] and [b·r, a·r] with
    r = Hv // Hk value heads; we regroup to the flat [q | k | v] layout the conv weights expect.
    """
    n = hidden.shape[0]
    hk, hv = module.num_k_heads, module.num_v_heads
    dk, dv = module.head_k_dim, module.head_v_dim
    if hasattr(module, "in_proj_qkvz"):
        r = hv // hk
        qkvz = module.in_proj_qkvz(hidden).view(n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(module.in_proj_ba(hidden).view(n, hk, 2 * r), [r, r], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return mixed, z.reshape(n, hv, dv), b.reshape(n, hv), a.reshape(n, hv)
    mixed = module.in_proj_qkv(hidden)
    z = module.in_proj_z(hidden).view(n, hv, dv)
    return mixed, z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def gdn_gates(module: torch.nn.Module, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta): log decay g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b)."""
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return g, b.sigmoid()


def gdn_layer_tree(
    module: torch.nn.Module,
    hidden: torch.Tensor,
    parents: torch.Tensor | list[int],
    cache_state: torch.Tensor | None,
    conv_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a transformers GatedDeltaNet layer on tree rows (the layer's input, after input_layernorm).

    hidden [N, hidden]; parents as in ``tree_gated_delta``; cache_state [Hv, dk, dv] committed
    recurrent state (None = zeros, i.e. no history); conv_state [conv_dim, L] committed pre-conv
    inputs (None = zeros). Returns (out [N, hidden], states [N, Hv, dk, dv] fp32,
    windows [N, conv_dim, K-1]): commit node a with states[a] and windows[a].
    """
    n = hidden.shape[0]
    kernel = module.conv_kernel_size
    mixed, z, b, a = gdn_projections(module, hidden)
    if conv_state is None:
        conv_state = mixed.new_zeros(mixed.shape[1], kernel - 1)
    windows = tree_conv_windows(mixed, parents, conv_state, kernel)
    conv_out = conv_from_windows(windows, module.conv1d.weight.squeeze(1), module.conv1d.bias, module.activation)
    conv_out = conv_out.to(hidden.dtype)
    q, k, v = torch.split(conv_out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(n, module.num_k_heads, module.head_k_dim)
    k = k.reshape(n, module.num_k_heads, module.head_k_dim)
    v = v.reshape(n, module.num_v_heads, module.head_v_dim)
    g, beta = gdn_gates(module, b, a)
    core, states = tree_gated_delta(q, k, v, g, beta, parents, cache_state)
    # The module's own gated RMSNorm works per value head: rows of head_v_dim.
    normed = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    out = module.out_proj(normed.reshape(n, module.value_dim))
    return out, states, windows[:, :, 1:]


def gdn_layer_prefill(
    module: torch.nn.Module,
    hidden: torch.Tensor,
    cache_state: torch.Tensor | None,
    conv_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the layer over a committed chain of T rows (prompt prefill), keeping only the final state.

    ``gdn_layer_tree`` on a chain would hold T per-node states (GiBs for a long prompt); this uses
    our chunked parallel form (``chunked_gated_delta``), carrying only the running state.
    Returns (out [T, hidden], final recurrent state [Hv, dk, dv] fp32, conv state [conv_dim, K-1]).
    """
    t = hidden.shape[0]
    kernel = module.conv_kernel_size
    mixed, z, b, a = gdn_projections(module, hidden)
    if conv_state is None:
        conv_state = mixed.new_zeros(mixed.shape[1], kernel - 1)
    # One long depthwise conv over (committed tail + new inputs): T outputs, no padding needed.
    full = torch.cat([_committed_tail(conv_state, kernel - 1).to(mixed.dtype), mixed.transpose(0, 1)], dim=-1)
    weight = module.conv1d.weight.squeeze(1)
    conv_out = F.conv1d(full[None].to(weight.dtype), weight.unsqueeze(1), module.conv1d.bias, groups=full.shape[0])
    conv_out = _activate(conv_out[0], module.activation).transpose(0, 1).to(hidden.dtype)
    q, k, v = torch.split(conv_out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(t, module.num_k_heads, module.head_k_dim)
    k = k.reshape(t, module.num_k_heads, module.head_k_dim)
    v = v.reshape(t, module.num_v_heads, module.head_v_dim)
    g, beta = gdn_gates(module, b, a)
    core, state = chunked_gated_delta(q, k, v, g, beta, cache_state)
    normed = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    out = module.out_proj(normed.reshape(t, module.value_dim))
    # a copy: a view would keep the whole [conv_dim, K-1+T] input alive in the committed state
    # (8,192 rows of the 27B shape: ~170 MB a layer)
    return out, state, full[:, full.shape[-1] - (kernel - 1) :].clone()
