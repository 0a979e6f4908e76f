"""Fast decode rounds: static shapes, device-side tree and accept, one host sync per round.

The eager loop in ``generate.py`` stays the readable reference; this module runs the same rounds
with the same outputs (T=0: token for token; T>0 on CPU: the same seeded draws) but shaped for a
GPU, gpt-fast style:

- Static KV caches (target and draft) written in place with ``index_copy_`` at slot tensors, and
  attention over a window [0, window) of the preallocated cache (the used slots rounded up to
  ``WINDOW``) with a mask built on the device from a cache-length tensor. Shapes change only when
  the window grows, so kernels do not re-plan and every stage is captured once per window as a
  CUDA graph.
- q|k|v and gate|up projections run as one GEMM each (``FusedWeights``).
- Trees padded to budget buckets (multiples of 16): the verify batch has the same shape every round.
- The best-first tree is built with tensor ops (``build_tree_tensors``), reproducing
  ``tree.build_tree``'s node order and tie-breaking exactly (see its docstring for why); when it
  cannot prove its order (a tie it could not resolve), the round is redone with the exact host
  build — counted in ``Generation.extras["fast_tree_fallbacks"]``.
- Accept walk, KV compaction and the next round's draft context are device ops; the host reads
  one small tensor per round (accepted count, bonus, kept nodes, their tokens).

On CUDA each stage (draft, tree, verify, and the T=0 accept/commit) is captured as a CUDA graph
once per shape, before the prefill of the first request that needs it (a capture's warm-up runs
scribble on the caches); ``_Stage.run`` replays it. A stage whose capture fails runs eagerly and
says so in ``Generation.extras["cuda_graph_errors"]``. Everywhere else the very same stage
functions run eagerly, which is what the CPU tests exercise. ``torch_compile`` (the
``fast-compile`` decode path) additionally compiles the decoder-layer halves and the tree build;
the CPU tests run that too.

T>0: rows are sampled with ``torch.multinomial`` in the eager path's order; on CPU the generator is
the eager path's, so a seed gives the same tokens; on CUDA it lives on the GPU (a different, equally
valid stream), and that sampling step runs outside the graphs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ddtree_diag.engine.draft import apply_rope
from ddtree_diag.engine.target import _rotate_half
from ddtree_diag.engine.tree import ancestor_mask, build_tree

if TYPE_CHECKING:
    from ddtree_diag.engine.generate import Engine, Generation

BUCKET = 16  # verify batches are padded to a multiple of this
REFINE_STEPS = 4  # tie-break refinement passes of the vectorised tree build
CACHE_ROUNDING = 512  # caches grow in these steps so graphs survive similar requests
# Attention reads only the first `window` cache slots, rounded up to this step: a round attends
# over about what is used (one graph per window) instead of the whole preallocated cache.
WINDOW = 256


def attention_window(needed: int, max_len: int) -> int:
    """Cache slots a round attends over when its highest used slot is below ``needed``."""
    return min(max_len, -(-needed // WINDOW) * WINDOW)


def bucket_size(tokens: int) -> int:
    """Padded verify batch for ``tokens`` rows (1 stays 1: an AR step is one row)."""
    return 1 if tokens <= 1 else -(-tokens // BUCKET) * BUCKET


def tree_node_count(budget: int, depth: int, vocab: int) -> int:
    """Draft nodes ``build_tree`` creates: min(budget, all paths of length <= depth over top_k)."""
    if budget <= 0 or depth <= 0:
        return 0
    top_k = min(budget, vocab)
    total = 0
    for d in range(1, depth + 1):
        total += top_k**d
        if total >= budget:
            return budget
    return total


# ---- vectorised tree build --------------------------------------------------------------------


def ranked_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` of a stable descending sort of each row (equal values: lower index first),
    via ``topk`` on unique int64 keys (order-preserving float bits, then the inverted index) —
    a full sort of a 150k vocabulary per depth is what this avoids."""
    bits = (values.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 ties 0.0, as in sort
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as signed ints
    # inverted index (vocab-1-index, not 2**32-1-index: a constant over int32 breaks Triton codegen)
    inverted = values.shape[-1] - 1 - torch.arange(values.shape[-1], device=values.device)
    keys = ordered * (1 << 32) + inverted
    ids = torch.topk(keys, k, dim=-1, sorted=True).indices
    return values.gather(-1, ids), ids


def build_tree_tensors(
    depth_logprobs: torch.Tensor, budget: int, depth_limit: torch.Tensor | int, refine_steps: int = REFINE_STEPS
) -> dict[str, torch.Tensor]:
    """``tree.build_tree`` with tensor ops only (no host sync), padded to ``budget`` nodes.

    ``depth_logprobs`` [D, V]; only depths 1..``depth_limit`` may hold nodes. Returns (device
    tensors) ``tokens_rank`` ([budget] token ids), ``parents`` ([budget] node index, 0 = root),
    ``depths``, ``valid`` (rows that are real nodes), ``count`` and ``exact`` (False when the
    order below could not be proven; the caller then uses ``build_tree``).

    Why it equals the heap: the heap pops nodes by (path score desc, push order asc). A node
    (ranks r1..rd) is pushed by exactly one node, its *pusher*: its previous sibling (rank-1) or,
    for rank 0, its parent; push order is (pop index of the pusher, sibling before child). So the
    pop order is the unique fixed point of "sort by (-score, 2·rank(pusher) + kind)", which we
    reach by a few refinement sorts starting from score order (ties are rare and short in
    practice) and then verify (the last pass moved none of the selected nodes). The candidates are per-depth
    beams of the ``budget`` best extensions of the previous beam; a node the heap pops cannot
    fall out of a beam unless a beam's first excluded candidate ties or beats the cut score,
    which is checked. Scores are float64 sums in the heap's order, so they are bit-identical.
    """
    device = depth_logprobs.device
    max_depth, vocab = depth_logprobs.shape
    top_k = min(budget, vocab)
    values, ids = ranked_top_k(depth_logprobs.float(), top_k)
    values = values.double()
    limit = torch.as_tensor(depth_limit, device=device)
    inf = torch.full((), float("inf"), dtype=torch.float64, device=device)

    # depth 1: every rank, in rank order; pool index = position in these concatenated arrays
    scores = [values[0]]
    ranks = [torch.arange(top_k, device=device)]
    parents = [torch.full((top_k,), -1, device=device)]
    pushers = [torch.arange(top_k, device=device) - 1]  # rank r pushed by rank r-1; rank 0: origin (-1)
    depths = [torch.ones(top_k, dtype=torch.long, device=device)]
    cut_scores = []  # first excluded candidate of each deeper beam (-inf: nothing excluded)
    offset, beam = 0, values[0]
    for depth in range(2, max_depth + 1):
        width = beam.shape[0]
        candidates = (beam[:, None] + values[depth - 1][None, :]).reshape(-1)  # parent-major
        sorted_scores, order = torch.sort(candidates, descending=True, stable=True)
        keep = min(budget, candidates.shape[0])
        cut_scores.append(sorted_scores[keep] if keep < candidates.shape[0] else -inf)
        where_in_beam = torch.empty_like(order)
        where_in_beam[order] = torch.arange(order.shape[0], device=device)
        order = order[:keep]
        parent_beam, rank = order // top_k, order % top_k
        new_offset = offset + width
        sibling_at = where_in_beam[(order - 1).clamp(min=0)]
        sibling = torch.where(sibling_at < keep, new_offset + sibling_at, torch.full_like(order, -2))
        scores.append(sorted_scores[:keep])
        ranks.append(rank)
        parents.append(offset + parent_beam)
        pushers.append(torch.where(rank > 0, sibling, offset + parent_beam))
        depths.append(torch.full((keep,), depth, device=device))
        offset, beam = new_offset, sorted_scores[:keep]

    score = torch.cat(scores)
    rank = torch.cat(ranks)
    parent = torch.cat(parents)
    pusher = torch.cat(pushers)  # -1 origin, -2 missing from the pool
    depth_of = torch.cat(depths)
    pool = score.shape[0]
    kind = (rank == 0).long()  # 0: pushed as a sibling, 1: pushed as a child
    invalid = (depth_of > limit).long()
    negative = -score

    def sorted_by(secondary: torch.Tensor) -> torch.Tensor:
        order = torch.sort(secondary, stable=True).indices
        order = order[torch.sort(negative[order], stable=True).indices]
        return order[torch.sort(invalid[order], stable=True).indices]

    order = sorted_by(torch.zeros(pool, dtype=torch.long, device=device))
    previous = order
    positions = torch.arange(pool, device=device)
    for _ in range(refine_steps):
        rank_of = torch.empty_like(order)
        rank_of[order] = positions
        pusher_rank = rank_of[pusher.clamp(min=0)]
        secondary = torch.where(pusher >= 0, 2 * pusher_rank + kind, torch.where(pusher == -1, -1, 2 * pool + 2))
        previous, order = order, sorted_by(secondary)

    n = min(budget, pool)
    count = torch.clamp((1 - invalid).sum(), max=budget)
    selected = order[:n]
    # index_select with a 1-element tensor: indexing with a 0-d tensor goes through __index__,
    # a host sync that CUDA-graph capture refuses (seen on the H200: cudaErrorStreamCaptureUnsupported).
    last = order.index_select(0, (count - 1).clamp(min=0).reshape(1))
    cut = score.index_select(0, last).squeeze(0)
    # One more pass moving none of the first `count` nodes proves them (induction on position:
    # a correct prefix fixes the next node's key, so an unchanged prefix is the heap's).
    exact = ((order[:n] == previous[:n]) | (positions[:n] >= count)).all()
    if cut_scores:
        cuts = torch.stack(cut_scores)  # beam of depth d+2 at index d
        deep_valid = torch.arange(2, max_depth + 1, device=device) <= limit
        exact = exact & ~((cuts >= cut) & deep_valid & (count >= budget)).any()
    node_of = torch.zeros(pool, dtype=torch.long, device=device)
    node_of[selected] = torch.arange(1, n + 1, device=device)
    parent_sel = parent[selected]
    parent_node = torch.where(parent_sel >= 0, node_of[parent_sel.clamp(min=0)], 0)
    valid = torch.arange(n, device=device) < count
    if n < budget:
        pad = budget - n
        zeros = torch.zeros(pad, dtype=torch.long, device=device)
        selected_tokens = torch.cat([ids[depth_of[selected] - 1, rank[selected]], zeros])
        parent_node = torch.cat([parent_node, zeros])
        depth_sel = torch.cat([depth_of[selected], zeros])
        valid = torch.cat([valid, torch.zeros(pad, dtype=torch.bool, device=device)])
    else:
        selected_tokens = ids[depth_of[selected] - 1, rank[selected]]
        depth_sel = depth_of[selected]
    return {
        "tokens": selected_tokens,
        "parents": parent_node,
        "depths": depth_sel,
        "valid": valid,
        "count": count,
        "exact": exact,
    }


def ancestors_from_parents(parents: torch.Tensor, rounds: int) -> torch.Tensor:
    """[T, T] bool ancestor-or-self mask from parent indices (-1: none), in ``rounds`` gathers
    (the tree depth), with no host sync."""
    size = parents.shape[0]
    eye = torch.eye(size, dtype=torch.bool, device=parents.device)
    parent = torch.where(parents >= 0, parents, torch.arange(size, device=parents.device))
    mask = eye
    for _ in range(rounds):
        mask = eye | mask[parent]
    return mask


# ---- the stages -------------------------------------------------------------------------------


def target_pre_attention(layer, hidden, cos, sin, heads: int, kv_heads: int, head_dim: int, fused=None):
    """A decoder layer up to attention: norm, q/k/v projections, q/k norms (Qwen3), rotary.
    Returns q, k, v as [1, heads, rows, head_dim]. A pure function of its inputs, so on CUDA it can
    be compiled once and reused by every layer (the layer's weights are inputs, not constants).
    ``fused``: the layer's ``FusedWeights`` (one q|k|v GEMM instead of three)."""
    attn = layer.self_attn
    rows = hidden.shape[1]
    x = layer.input_layernorm(hidden)
    if fused is not None:
        q, k, v = F.linear(x, fused.qkv_weight, fused.qkv_bias).split(fused.qkv_sizes, dim=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.view(1, rows, heads, head_dim)
    k = k.view(1, rows, kv_heads, head_dim)
    v = v.view(1, rows, kv_heads, head_dim)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k, v


def target_post_attention(layer, hidden, attn_out, fused=None):
    """The rest of a decoder layer: output projection, residual, norm, MLP, residual."""
    hidden = hidden + layer.self_attn.o_proj(attn_out)
    x = layer.post_attention_layernorm(hidden)
    if fused is None or fused.gate_up_weight is None:
        return hidden + layer.mlp(x)
    gate, up = F.linear(x, fused.gate_up_weight).chunk(2, dim=-1)
    return hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


class FusedWeights(torch.nn.Module):
    """One layer's q|k|v (and gate|up) projection weights as single tensors, so a verify batch runs
    one GEMM where the HF modules run three (two): fewer launches, and wide GEMMs that need no
    split-K at a few dozen rows. The modules' own weights become row slices (views) of the fused
    tensors, so memory does not grow and the eager path computes with the very same values.
    An nn.Module (tensors as buffers) so that a compiled layer half treats them as inputs, like the
    layer's own weights: one compiled graph for every layer."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv_sizes = [p.out_features for p in projections]
        self.register_buffer("qkv_weight", _fuse(projections, "weight"), persistent=False)
        bias = _fuse(projections, "bias") if projections[0].bias is not None else None
        self.register_buffer("qkv_bias", bias, persistent=False)
        self.register_buffer("gate_up_weight", None, persistent=False)
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if (
            gate is not None and up is not None and gate.bias is None and up.bias is None
            and hasattr(mlp, "down_proj") and hasattr(mlp, "act_fn") and gate.out_features == up.out_features
        ):  # fmt: skip
            self.gate_up_weight = _fuse([gate, up], "weight")  # a registered buffer: assignment keeps it one

    @classmethod
    def for_layer(cls, layer: torch.nn.Module) -> FusedWeights | None:
        """The layer's fused weights, made once per layer: a decoder built later (another decode
        path) reuses them instead of fusing the views again (which would copy the weights)."""
        fused = layer.__dict__.get("_ddtree_fused")
        if fused is None and cls.supported(layer):
            fused = cls(layer)
            object.__setattr__(layer, "_ddtree_fused", fused)  # not a registered submodule
        return fused

    @staticmethod
    def supported(layer: torch.nn.Module) -> bool:
        attn = getattr(layer, "self_attn", None)
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if not all(isinstance(p, torch.nn.Linear) and type(p) is torch.nn.Linear for p in projections):
            return False  # quantised or wrapped linears: leave them alone
        weights = [p.weight for p in projections]
        biases = {p.bias is None for p in projections}
        return len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1 and len(biases) == 1


def _fuse(linears: list[torch.nn.Linear], name: str) -> torch.Tensor:
    """Concatenate the linears' ``name`` tensors along the output rows and rebind each linear's
    parameter to its slice of the result."""
    fused = torch.cat([getattr(lin, name).detach() for lin in linears], dim=0)
    row = 0
    for lin in linears:
        rows = getattr(lin, name).shape[0]
        setattr(lin, name, torch.nn.Parameter(fused[row : row + rows], requires_grad=False))
        row += rows
    return fused


def draft_pre_attention(layer, hidden, cos, sin, heads: int, head_dim: int, fused=None):
    """A draft layer up to attention, for the noise block (see ``target_pre_attention``)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    rows = hidden.shape[1]
    if fused is None:
        q = attn.q_norm(attn.q_proj(x).view(1, rows, heads, head_dim)).transpose(1, 2)
        k, v = attn._kv(x, cos, sin)
        return apply_rope(q, cos, sin), k, v
    q, k, v = F.linear(x, fused.qkv_weight, fused.qkv_bias).split(fused.qkv_sizes, dim=-1)
    q = attn.q_norm(q.view(1, rows, heads, head_dim)).transpose(1, 2)
    k = attn.k_norm(k.view(1, rows, -1, head_dim)).transpose(1, 2)  # as DraftAttention._kv
    v = v.view(1, rows, -1, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean attention mask (True = may attend) as the additive bias SDPA would build from it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# SDPA backend on CUDA: memory-efficient (takes a mask, capturable) by default; DDTREE_ATTENTION=
# cudnn | math picks another first (the speed bench compares them).
ATTENTION_BACKEND = os.environ.get("DDTREE_ATTENTION", "efficient")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None):
    """SDPA; on CUDA pinned to ATTENTION_BACKEND with math as the fallback. CPU: PyTorch's own choice."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}.get(
            ATTENTION_BACKEND, SDPBackend.EFFICIENT_ATTENTION
        )
        with sdpa_kernel([first, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _Stage:
    """A stage function over static buffers; on CUDA captured once as a graph and replayed.

    The second warm-up run (outside the capture) uses ``torch.cuda.set_sync_debug_mode("error")``: an op
    that would synchronise with the host, which a capture refuses, raises there with its stack
    instead of breaking the capture. A failed capture can leave the graph memory pool in a
    "recording" state that breaks every later capture, so after one the decoder stops capturing
    (``FastDecoder.capture_broken``) and the remaining stages run eagerly: slower, never wrong.
    """

    def __init__(self, fn: Callable[[], None], graphs: bool, pool: Any = None) -> None:
        self.fn, self.graph = fn, None
        self.error: str | None = None
        self.capture_failed = False
        if graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            previous = torch.cuda.get_sync_debug_mode()
            try:
                with torch.cuda.stream(stream):
                    fn()  # warm-up outside the capture: allocator, cuBLAS handles, compilation + autotuning
                    torch.cuda.set_sync_debug_mode("error")
                    fn()  # the same again, now any host sync raises
            except RuntimeError as exc:
                self.error = "host sync in the warm-up: " + _where(exc)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
            if self.error is None:
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        fn()
                    self.graph = graph
                except RuntimeError as exc:  # an op that cannot be captured: stay correct, run eagerly
                    self.capture_failed = True
                    self.error = "capture: " + _where(exc)
                    torch.cuda.synchronize()

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def _where(exc: BaseException) -> str:
    """First line of an error plus the innermost frame of this package that raised it."""
    import traceback

    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ddtree_diag" in f.filename]
    if frames:
        frame = frames[-1]
        message += f" (at {Path(frame.filename).name}:{frame.lineno} {frame.line})"
    return message


class FastDecoder:
    """Runs ``Engine.generate_ids`` rounds the fast way; see the module docstring."""

    def __init__(self, engine: Engine, graphs: bool | None = None, torch_compile: bool = False) -> None:
        self.engine = engine
        self.target = engine.target
        self.draft = engine.draft
        self.device = engine.device
        self.graphs = (self.device.type == "cuda") if graphs is None else graphs
        self.max_len = 0
        self._cache_k: torch.Tensor | None = None  # the target cache our stages were built on
        self.stages: dict[tuple, _Stage] = {}
        self._pool = None
        self.capturing = False
        self.capture_broken = False  # a failed capture: capture nothing more (see _Stage)
        # torch_compile: torch.compile the two halves of a decoder layer (norms, rotary, SwiGLU
        # fused into a few kernels) and the tree build. One compiled graph per row count serves
        # every layer, since the layer is an input (inlined nn.Modules). The compiled kernels then
        # run inside the stage's CUDA graph. The prefill (its length varies) stays uncompiled.
        self.torch_compile = torch_compile
        self._pre_attention, self._post_attention = target_pre_attention, target_post_attention
        self._draft_pre_attention = draft_pre_attention
        self._build_tree = None  # None: the module's build_tree_tensors, looked up per call
        if torch_compile:
            import torch._dynamo

            # one compiled graph per row count and model: AR, draft block, each budget's bucket, for
            # every model in the process; the default limit (8) sends the rest back to eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._pre_attention = torch.compile(target_pre_attention, dynamic=False)
            self._post_attention = torch.compile(target_post_attention, dynamic=False)
            self._draft_pre_attention = torch.compile(draft_pre_attention, dynamic=False)
            self._build_tree = torch.compile(build_tree_tensors, dynamic=False)
        t = self.target
        self.rep = t.heads // t.kv_heads
        self.fused = [FusedWeights.for_layer(layer) for layer in t.layers]
        if self.draft is not None:
            dc = self.draft.config
            self.draft_fused = [FusedWeights.for_layer(layer) for layer in self.draft.layers]
            self.block = dc.block_size
            self.feature_layers = list(dc.target_layer_ids)
            self.d_heads, self.d_kv_heads, self.d_head_dim = (
                dc.num_attention_heads, dc.num_key_value_heads, dc.dim_per_head,
            )  # fmt: skip
        else:
            self.block, self.feature_layers = 1, []

    # ---- buffers ------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        """Static buffers for caches of ``capacity`` slots (rounded up); graphs die with them."""
        t, dev = self.target, self.device
        if capacity <= self.max_len and t.cache_k is self._cache_k:
            return
        # a whole number of CACHE_ROUNDING slots (aligned attention masks), never less than allocated
        t.reset(-(-max(capacity, t.max_len) // CACHE_ROUNDING) * CACHE_ROUNDING)
        self.max_len, self._cache_k = t.max_len, t.cache_k
        self.stages.clear()
        if self.graphs:
            self._pool = torch.cuda.graph_pool_handle()
        long = dict(dtype=torch.long, device=dev)
        self.slot_index = torch.arange(self.max_len, **long)
        self.start = torch.zeros((), **long)  # committed target tokens = the root's slot
        self.root = torch.zeros(1, **long)
        self.depth_limit = torch.zeros((), **long)
        self.result: dict[int, torch.Tensor] = {}
        if self.draft is not None:
            dc = self.draft.config
            shape = (dc.num_hidden_layers, 1, dc.num_key_value_heads, self.max_len, dc.dim_per_head)
            self.draft_k = torch.zeros(shape, device=dev, dtype=t.dtype)
            self.draft_v = torch.zeros(shape, device=dev, dtype=t.dtype)
            self.ctx_len = torch.zeros((), **long)  # context tokens in the draft cache
            self.pending = torch.zeros(self.block, len(self.feature_layers) * t.hidden_size, device=dev, dtype=t.dtype)
            self.pending_count = torch.zeros((), **long)
            self.mask_tail = torch.full((self.block - 1,), dc.mask_token_id, **long)
            self.logprobs = torch.zeros(self.block - 1, t.config.vocab_size, device=dev)
        self.trees: dict[int, dict[str, torch.Tensor]] = {}
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}

    def _tree_buffers(self, padded: int) -> dict[str, torch.Tensor]:
        if padded not in self.trees:
            long = dict(dtype=torch.long, device=self.device)
            self.trees[padded] = {
                "tokens": torch.zeros(padded, **long),
                "parents": torch.full((padded,), -1, **long),
                "depths": torch.zeros(padded, **long),
                "valid": torch.zeros(padded, dtype=torch.bool, device=self.device),
                "anc": torch.eye(padded, dtype=torch.bool, device=self.device),
                "exact": torch.ones((), dtype=torch.bool, device=self.device),
                "choice": torch.zeros(padded, **long),
            }
            t = self.target
            feats = len(self.feature_layers) * t.hidden_size
            self.outputs[padded] = {
                "logits": torch.zeros(padded, t.config.vocab_size, device=self.device, dtype=t.dtype),
                "features": torch.zeros(padded, max(feats, 1), device=self.device, dtype=t.dtype),
            }
            self.result[padded] = torch.zeros(3 + 2 * self.block, **long)
        return self.trees[padded]

    def _stage(self, key: tuple, fn: Callable[[], None]) -> _Stage:
        stage = self.stages.get(key)
        if stage is None:
            capture = self.graphs and self.capturing and not self.capture_broken
            stage = self.stages[key] = _Stage(fn, capture, self._pool)
            self.capture_broken = self.capture_broken or stage.capture_failed
        return stage

    # ---- target -------------------------------------------------------------------------------
    def _target_forward(
        self,
        tokens: torch.Tensor,
        depths: torch.Tensor,
        anc: torch.Tensor,
        with_features: bool,
        window: int,
        compiled: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``tokens`` at positions start+depth, K/V written at slots start.., attention over
        the cache slots [0, window): committed slots plus the rows' ancestors (``anc``).
        ``compiled=False`` (the prefill, whose length varies) never uses the compiled layer halves."""
        t = self.target
        pre, post = (self._pre_attention, self._post_attention) if compiled else (
            target_pre_attention, target_post_attention,
        )  # fmt: skip
        rows = tokens.shape[0]
        positions = self.start + depths
        slots = self.start + self.slot_index[:rows]
        key_slots = self.slot_index[:window]
        mask = (key_slots < self.start).unsqueeze(0).expand(rows, window).clone()
        mask.index_copy_(1, slots, anc)
        if t.sliding_window is not None:
            key_pos = key_slots.clone()
            key_pos.index_copy_(0, slots, positions)
            mask &= key_pos[None, :] > positions[:, None] - t.sliding_window
        # GQA without copying the cache: the query heads of one KV head become extra query rows.
        # The boolean mask becomes an additive bias once here rather than inside SDPA in every layer.
        bias = _additive_mask(mask.repeat(self.rep, 1)[None, None], t.dtype)
        hidden = t.embed(tokens[None])
        cos, sin = t.inner.rotary_emb(hidden, positions[None])
        cos, sin = cos[:, None], sin[:, None]
        wanted = set(self.feature_layers) if with_features else set()
        features: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(t.layers):
            fused = self.fused[index]
            q, k, v = pre(layer, hidden, cos, sin, t.heads, t.kv_heads, t.head_dim, fused)
            cache_k, cache_v = t.cache_k[index], t.cache_v[index]
            cache_k.index_copy_(2, slots, k)
            cache_v.index_copy_(2, slots, v)
            q = q.reshape(1, t.kv_heads, self.rep * rows, t.head_dim)
            out = _attend(q, cache_k[:, :, :window], cache_v[:, :, :window], bias, t.scaling)
            out = out.reshape(1, t.heads, rows, t.head_dim).transpose(1, 2).reshape(1, rows, t.heads * t.head_dim)
            hidden = post(layer, hidden, out, fused)
            if index in wanted and index != t.num_layers - 1:
                features[index] = hidden
        return t.head(hidden, features, self.feature_layers if with_features else None)

    def _verify(self, padded: int, with_features: bool, window: int) -> None:
        tree, out = self.trees[padded], self.outputs[padded]
        logits, feats = self._target_forward(tree["tokens"], tree["depths"], tree["anc"], with_features, window)
        out["logits"].copy_(logits)
        if feats is not None:
            out["features"].copy_(feats)

    # ---- draft --------------------------------------------------------------------------------
    def _write_context(self, features: torch.Tensor, first_slot: torch.Tensor | int) -> torch.Tensor:
        """Put context features' K/V in the draft cache at slots first_slot.. (positions = slots)."""
        d = self.draft
        count = features.shape[0]
        slots = first_slot + self.slot_index[:count]
        ctx = d.hidden_norm(d.fc(features[None].to(self.target.dtype)))
        rope = d._rope(slots, 1, ctx.dtype)
        for index, layer in enumerate(d.layers):
            k, v = layer.self_attn._kv(ctx, *rope)
            self.draft_k[index].index_copy_(2, slots, k)
            self.draft_v[index].index_copy_(2, slots, v)
        return slots

    def _draft(self, window: int) -> None:
        """Pending context into the draft cache, then the noise block → per-depth log-probs.
        Attends over the draft cache slots [0, window)."""
        d, block = self.draft, self.block
        ctx_slots = self._write_context(self.pending, self.ctx_len)
        noise_slots = ctx_slots + block  # scratch region after the (padded) context
        key_slots = self.slot_index[:window]
        visible = (key_slots < self.ctx_len + self.pending_count) | (
            (key_slots >= noise_slots[0]) & (key_slots < noise_slots[0] + block)
        )
        mask = visible[None, None, None, :]
        noise_ids = torch.cat([self.root, self.mask_tail])
        hidden = self.target.embed(noise_ids[None])
        rope = d._rope(self.start + self.slot_index[:block], 1, hidden.dtype)
        heads, kv_heads, head_dim = self.d_heads, self.d_kv_heads, self.d_head_dim
        for index, layer in enumerate(d.layers):
            fused = self.draft_fused[index]
            q, k, v = self._draft_pre_attention(layer, hidden, *rope, heads, head_dim, fused)
            self.draft_k[index].index_copy_(2, noise_slots, k)
            self.draft_v[index].index_copy_(2, noise_slots, v)
            q = q.reshape(1, kv_heads, (heads // kv_heads) * block, head_dim)
            out = _attend(q, self.draft_k[index][:, :, :window], self.draft_v[index][:, :, :window], mask)
            out = out.reshape(1, heads, block, head_dim).transpose(1, 2).reshape(1, block, heads * head_dim)
            hidden = self._post_attention(layer, hidden, out, fused)
        hidden = d.norm(hidden)
        logits = self.target.lm_head(hidden[0, 1:])
        self.logprobs.copy_(torch.log_softmax(logits.float(), dim=-1))

    # ---- tree ---------------------------------------------------------------------------------
    def _tree(self, padded: int, budget: int, mode: str) -> None:
        tree = self._tree_buffers(padded)
        exact = torch.ones((), dtype=torch.bool, device=self.device)
        if mode == "chain":
            depth_rows = torch.arange(1, self.block, device=self.device)
            tokens, parents, depths = self.logprobs.argmax(dim=-1), depth_rows - 1, depth_rows
            valid = depth_rows <= self.depth_limit
        else:
            built = (self._build_tree or build_tree_tensors)(self.logprobs, budget, self.depth_limit)
            tokens, parents, depths, valid = built["tokens"], built["parents"], built["depths"], built["valid"]
            exact = built["exact"]
        pad = padded - 1 - tokens.shape[0]
        long = dict(dtype=torch.long, device=self.device)
        zero, none = torch.zeros(pad, **long), torch.full((pad,), -1, **long)
        tree["tokens"].copy_(torch.cat([self.root, torch.where(valid, tokens, 0), zero]))
        tree["parents"].copy_(torch.cat([torch.full((1,), -1, **long), torch.where(valid, parents, -1), none]))
        tree["depths"].copy_(torch.cat([torch.zeros(1, **long), torch.where(valid, depths, 0), zero]))
        tree["valid"].copy_(torch.cat([torch.ones(1, dtype=torch.bool, device=self.device), valid, zero.bool()]))
        tree["anc"].copy_(ancestors_from_parents(tree["parents"], self.block - 1))
        tree["exact"].copy_(exact)

    def _host_tree(self, padded: int, budget: int, depth: int, root: int) -> None:
        """Exact fallback: ``tree.build_tree`` on the host, written into the static buffers."""
        built = build_tree(root, self.logprobs[:depth].cpu(), budget)
        tree = self.trees[padded]
        n = len(built.tokens)
        long = dict(dtype=torch.long)
        tokens = torch.zeros(padded, **long)
        parents = torch.full((padded,), -1, **long)
        depths = torch.zeros(padded, **long)
        tokens[:n], parents[:n], depths[:n] = (
            torch.tensor(built.tokens),
            torch.tensor(built.parents),
            torch.tensor(built.depths),
        )
        anc = torch.eye(padded, dtype=torch.bool)
        anc[:n, :n] = ancestor_mask(built.parents)
        valid = torch.arange(padded) < n
        for name, value in (
            ("tokens", tokens),
            ("parents", parents),
            ("depths", depths),
            ("anc", anc),
            ("valid", valid),
        ):
            tree[name].copy_(value)
        tree["exact"].fill_(True)

    # ---- accept + commit ----------------------------------------------------------------------
    def _commit(self, padded: int) -> None:
        """Accept walk on ``choice`` (the target's token per row), compact the target cache, queue
        the kept rows' features for the draft, advance; all guarded by the tree's ``exact``."""
        tree, out = self.trees[padded], self.outputs[padded]
        block = self.block
        choice, tokens, parents, depths = tree["choice"], tree["tokens"], tree["parents"], tree["depths"]
        rows = torch.arange(padded, device=self.device)
        compat = (tokens == choice[parents.clamp(min=0)]) & tree["valid"]
        compat = compat | (rows == 0)
        accepted = ~(tree["anc"] & ~compat[None, :]).any(dim=-1)
        keep_all = torch.zeros(block + 1, dtype=torch.long, device=self.device)
        keep_all.scatter_(0, torch.where(accepted, depths, block), rows)  # row at its depth; rest to a dump slot
        keep = keep_all[:block]
        count = accepted.sum()
        bonus = choice[keep.gather(0, (count - 1)[None])]
        ok = tree["exact"]
        dst = self.start + self.slot_index[:block]
        src = torch.where(ok, self.start + keep, dst)
        t = self.target
        t.cache_k.index_copy_(3, dst, t.cache_k.index_select(3, src))
        t.cache_v.index_copy_(3, dst, t.cache_v.index_select(3, src))
        if self.draft is not None and self.feature_layers:
            self.ctx_len.add_(torch.where(ok, self.pending_count, 0))
            self.pending.copy_(torch.where(ok, out["features"][keep], self.pending))
            self.pending_count.copy_(torch.where(ok, count, self.pending_count))
        self.start.add_(torch.where(ok, count, 0))
        self.root.copy_(torch.where(ok, bonus, self.root))
        self.result[padded].copy_(torch.cat([ok.long()[None], count[None], bonus, keep, tokens[keep]]))

    def _choose(self, padded: int, rows: int, temperature: float, generator: torch.Generator | None) -> None:
        logits = self.outputs[padded]["logits"]
        choice = self.trees[padded]["choice"]
        if temperature <= 0:
            choice.copy_(logits.argmax(dim=-1))
            return
        probs = torch.softmax(logits[:rows].float() / temperature, dim=-1)
        choice[:rows] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    # ---- the loop -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate_ids(
        self,
        prompt_ids: list[int],
        budget: int,
        mode: str,
        temperature: float,
        max_tokens: int,
        seed: int | None,
        stop: list[str] | None,
        top_logprobs: int,
        on_token: Callable[[list[int], str], bool] | None,
        stops: set[int],
    ) -> Generation:
        engine, t = self.engine, self.target
        cuda = self.device.type == "cuda"
        prompt_len = len(prompt_ids)
        vocab = t.config.vocab_size
        # One verify shape for the whole request (the tree's node count only shrinks, by the depth
        # limit, in the last rounds; those rows are padding) plus the 1-row shape of a last round.
        if mode == "tree":
            padded = bucket_size(budget + 1)
        elif mode == "chain":
            padded = bucket_size(self.block)
        else:
            padded = 1
        reach = max(padded, 2 * self.block) + 1  # a round uses cache slots below start + reach
        self._allocate(prompt_len + max_tokens + reach + 1)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(
                seed if seed is not None else int(torch.randint(0, 2**31, ()).item())
            )
        with_features = mode != "ar"
        # Create (on CUDA: capture) this request's stages before the prefill: a capture's warm-up
        # runs scribble on the caches and counters, which the prefill then resets.
        for value in (self.start, self.root, *((self.ctx_len, self.pending_count) if self.draft else ())):
            value.zero_()
        # One set per attention window the request can reach (the window grows with the context).
        self.capturing = True
        first_window = attention_window(prompt_len + reach, self.max_len)
        windows = range(first_window, attention_window(prompt_len + max_tokens + reach, self.max_len) + 1, WINDOW)
        steady = {w: self._stages_for(padded, budget, mode, temperature, with_features, w) for w in windows}
        last = {w: self._stages_for(1, budget, "ar", temperature, with_features, w) for w in windows}
        self.capturing = False

        stage_times = {"draft": 0.0, "tree": 0.0, "verify": 0.0, "commit": 0.0}
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        t_start = time.perf_counter()
        prompt = torch.tensor(prompt_ids, device=self.device)
        self.start.zero_()
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=self.device).tril()
        positions = torch.arange(prompt_len, device=self.device)
        prefill_window = attention_window(prompt_len, self.max_len)
        logits, features = self._target_forward(
            prompt, positions, causal, with_features, prefill_window, compiled=False
        )
        self.start.fill_(prompt_len)
        t.length = prompt_len
        last_logits = logits[-1:].float()
        if temperature <= 0:
            first = int(last_logits.argmax(dim=-1))
        else:  # as Engine._choose, with the generator on our device
            probs = torch.softmax(last_logits / temperature, dim=-1)
            first = int(torch.multinomial(probs, 1, generator=generator))
        if with_features:
            self.ctx_len.zero_()
            self._write_context(features, 0)
            self.ctx_len.fill_(prompt_len)
            self.pending_count.zero_()
        self.root.fill_(first)
        sync()
        ttft = time.perf_counter() - t_start

        output = [first]
        logprob_rows = [last_logits[0]] if top_logprobs > 0 else []
        acceptance_lengths: list[int] = []
        tree_sizes: list[int] = []
        fallbacks = 0
        finish, text_so_far = engine._after_first_token(first, stops, max_tokens, on_token)
        timer = _Timer(cuda)
        while finish is None:
            remaining = max_tokens - len(output)
            depth = min(self.block - 1, remaining - 1) if mode != "ar" else 0
            window = attention_window(t.length + reach, self.max_len)
            if depth <= 0:
                nodes, stages, rows = 0, last[window], 1
            else:
                nodes = depth if mode == "chain" else tree_node_count(budget, depth, vocab)
                stages, rows = steady[window], padded
            timer.start()
            if "draft" in stages:
                self.depth_limit.fill_(depth)
                stages["draft"].run()
            timer.mark("draft")
            stages["tree"].run()
            timer.mark("tree")
            stages["verify"].run()
            timer.mark("verify")
            state = generator.get_state() if generator is not None else None
            self._finish(stages, rows, nodes + 1, temperature, generator)
            result = self.result[rows].tolist()  # the round's one host sync
            if not result[0]:  # the vectorised tree could not prove its order: redo this round exactly
                fallbacks += 1
                self._host_tree(rows, budget, depth, int(self.root.item()))
                stages["verify"].run()
                if state is not None:
                    generator.set_state(state)
                self._finish(stages, rows, nodes + 1, temperature, generator)
                result = self.result[rows].tolist()
                assert result[0], "the exact host tree must be accepted"
            count, bonus = result[1], result[2]
            keep = result[3 : 3 + count]
            new_tokens = [*result[3 + self.block + 1 : 3 + self.block + count], bonus]
            if top_logprobs > 0:
                logprob_rows.extend(self.outputs[rows]["logits"][keep].float())
            t.length += count
            finish, text_so_far, committed = engine._after_round(
                output, new_tokens, stops, stop, max_tokens, on_token, text_so_far
            )
            acceptance_lengths.append(committed)
            tree_sizes.append(nodes)
            timer.mark("commit")
            timer.add_to(stage_times)

        return engine.assemble(
            output, stops, stop, finish, prompt_len, t_start, ttft, acceptance_lengths, tree_sizes,
            stage_times, logprob_rows, top_logprobs, budget if mode == "tree" else 0, mode,
            extras={
                "fast": True,
                "cuda_graphs": sorted("-".join(map(str, k)) for k, v in self.stages.items() if v.graph is not None),
                "cuda_graph_errors": sorted({v.error for v in self.stages.values() if v.error}),
                "fast_tree_fallbacks": fallbacks,
            },
        )  # fmt: skip

    def _finish(self, stages: dict[str, _Stage], padded: int, rows: int, temperature: float, generator) -> None:
        if "commit" in stages:  # T=0: argmax + accept + commit captured together
            stages["commit"].run()
        else:
            self._choose(padded, rows, temperature, generator)
            self._commit(padded)

    def _stages_for(
        self, padded: int, budget: int, mode: str, temperature: float, with_features: bool, window: int
    ) -> dict[str, _Stage]:
        """The stage callables of one round shape and attention window (created, and captured on
        CUDA, on first use)."""
        self._tree_buffers(padded)
        stages: dict[str, _Stage] = {}
        if mode != "ar":
            stages["draft"] = self._stage(("draft", window), lambda: self._draft(window))
        if mode == "ar":
            stages["tree"] = self._stage(("tree-ar", padded), lambda: self._ar_tree(padded))
        else:
            stages["tree"] = self._stage(("tree", mode, budget, padded), lambda: self._tree(padded, budget, mode))
        stages["verify"] = self._stage(
            ("verify", padded, with_features, window), lambda: self._verify(padded, with_features, window)
        )
        if temperature <= 0:

            def commit() -> None:
                self._choose(padded, padded, 0.0, None)
                self._commit(padded)

            stages["commit"] = self._stage(("commit", padded), commit)
        return stages

    def _ar_tree(self, padded: int) -> None:
        """Root only (an AR step, or the last round when no draft node could be committed)."""
        tree = self.trees[padded]
        rows = torch.arange(padded, device=self.device)
        tree["tokens"].copy_(torch.where(rows == 0, self.root, 0))
        tree["parents"].fill_(-1)
        tree["depths"].zero_()
        tree["valid"].copy_(rows == 0)
        tree["anc"].copy_(rows[:, None] == rows[None, :])
        tree["exact"].fill_(True)


class _Timer:
    """Stage times per round: CUDA events on the GPU (no sync until the round's own), else wall clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str, Any]] = []

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [("", self._now())]

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def add_to(self, totals: dict[str, float]) -> None:
        for (_, before), (name, after) in zip(self.marks, self.marks[1:], strict=False):
            if self.cuda:
                after.synchronize()
                totals[name] += before.elapsed_time(after) / 1000
            else:
                totals[name] += after - before


__all__ = ["FastDecoder", "ancestors_from_parents", "bucket_size", "build_tree_tensors", "tree_node_count"]
