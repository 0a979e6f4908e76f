"""Decoder layers shaped for the fast path: fused projections (one GEMM for q|k|v and one for
gate|up), the halves of a layer around attention as pure functions (one compiled graph serves
every layer, the layer being an input), and attention over a window of a static cache."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ddtree_diag.engine import gdn
from ddtree_diag.engine.arch import Arch
from ddtree_diag.engine.fast import kernels
from ddtree_diag.engine.rope import apply_rope
from ddtree_diag.engine.target import latent_qkv, qkv_sizes


def settle(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The hidden state with a deferred MLP output (``mlp_half``'s defer) added, where one waits."""
    return hidden if residual is None else hidden + residual


def residual_norm(
    norm: torch.nn.Module, hidden: torch.Tensor, delta: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, norm of it); without a delta (hidden, norm(hidden)). The add runs inside the
    norm's kernel (``kernels.add_rms_norm``)."""
    if delta is None:
        return hidden, kernels.rms_norm(norm, hidden)
    return kernels.add_rms_norm(norm, hidden, delta)


def target_pre_attention(
    layer, hidden, cos, sin, heads: int, kv_heads: int, head_dim: int, fused=None, *, arch: Arch,
    residual=None, cache=None,
):
    """A decoder layer up to attention: norm, q/k/v projections, q/k norms, rotary. Returns q, k, v
    as [1, heads, rows, head_dim], the output gate [1, rows, heads, head_dim] of a gated query,
    else None, and the layer's input hidden state. ``arch``: the target's ``arch.Arch`` (which
    norms, which projections, which twists), read as the eager forward reads it.
    ``residual``: the previous layer's MLP output, not yet added to ``hidden`` (``mlp_half`` with
    ``defer``): the add runs in the input norm's kernel, and the sum is the hidden state returned.
    ``cache``: (cache_k, cache_v, start) of this layer: where the one-kernel path applies
    (``kernels.norm_rope_cache``), k and v go straight into the cache at slots start.. and come
    back as None; the caller writes them otherwise.
    A pure function of its inputs, so on CUDA it can be compiled once and reused by every layer (the
    layer's weights are inputs, not constants). ``fused``: the layer's ``FusedWeights`` (one q|k|v
    GEMM instead of three). Norms, rotary and SwiGLU go through ``kernels`` (fused on CUDA)."""
    attn = layer.self_attn
    rows = hidden.shape[1]
    if arch.post_norms:  # OLMo: the input as it is
        hidden = x = settle(hidden, residual)
    else:
        hidden, x = residual_norm(layer.input_layernorm, hidden, residual)
    if arch.latent_attention:  # DeepSeek-V3: the caller writes k, v
        q, k, v = latent_qkv(attn, x, cos, sin)
        return q, k, v, None, hidden
    if fused is not None and fused.qkv_weight is not None:
        q, k, v = F.linear(x, fused.qkv_weight, fused.qkv_bias).split(fused.qkv_sizes, dim=-1)
    elif arch.fused_qkv:  # Phi-3: the checkpoint's own q|k|v linear
        q, k, v = attn.qkv_proj(x).split(qkv_sizes(heads, kv_heads, head_dim), dim=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    gate = None
    if arch.qk_norm_whole:  # OLMo: over all heads at once, then rotary alone
        q, k = attn.q_norm(q), attn.k_norm(k)
    per_head_norm = arch.qk_norm and not arch.qk_norm_whole
    if arch.gated_query:
        q, gate = q.view(1, rows, heads, 2 * head_dim).chunk(2, dim=-1)
        if gate.device.type == "cpu":
            # CPU: contiguous, as the eager forward has it: a SIMD sigmoid's tail of each strided
            # run goes through the scalar formula, whose last bits differ. A CUDA kernel computes
            # every element alike, so there ``target_post_attention`` reads the view in place.
            gate = gate.contiguous()
    q = q.reshape(1, rows, heads, head_dim)
    k = k.view(1, rows, kv_heads, head_dim)
    v = v.view(1, rows, kv_heads, head_dim)
    if cache is not None:
        written = kernels.norm_rope_cache(attn if per_head_norm else None, q, k, v, cos, sin, *cache)
        if written is not None:
            return written, None, None, gate, hidden
    if per_head_norm:
        q, k = kernels.norm_rope(attn.q_norm, q, cos, sin), kernels.norm_rope(attn.k_norm, k, cos, sin)
    else:
        q, k = kernels.rope(q, cos, sin), kernels.rope(k, cos, sin)
    return q, k, v.transpose(1, 2), gate, hidden


def target_post_attention(layer, hidden, attn_out, fused=None, gate=None, defer: bool = False,
                          arch: Arch | None = None):
    """The rest of a decoder layer: (gated) output projection, residual, then ``mlp_half``.
    ``gate``: [1, rows, heads, head_dim]; on CUDA a strided view of the q projection's output,
    read in place rather than after a copy (27B verify on an H200: the copy took 5.6 us a
    full-attention layer)."""
    if gate is not None:
        attn_out = (attn_out.view(gate.shape) * torch.sigmoid(gate)).view(attn_out.shape)
    return mlp_half(layer, hidden, fused, delta=layer.self_attn.o_proj(attn_out), defer=defer, arch=arch)


def mlp_half(layer, hidden, fused=None, delta=None, defer: bool = False, arch: Arch | None = None):
    """Residual ``hidden + delta`` (when given), norm, MLP (one gate|up GEMM when fused; the module
    itself otherwise, MoE included), residual. ``defer``: return (hidden, MLP output) instead of
    their sum, for the next norm to add in its own kernel (``add_rms_norm``): one elementwise
    kernel less per layer, the same sum. ``arch``: the target's ``arch.Arch`` (its norms'
    places, Granite's residual multiplier); None: a plain pre-norm layer (the draft's)."""
    if arch is not None and arch.post_norms:  # OLMo: each half's output normed, its input not
        if delta is not None:
            hidden = hidden + kernels.rms_norm(layer.post_attention_layernorm, delta)
        out = layer.mlp(hidden)
        out = kernels.rms_norm(layer.post_feedforward_layernorm, out[0] if isinstance(out, tuple) else out)
        return (hidden, out) if defer else hidden + out
    scale = None if arch is None or arch.residual_multiplier == 1.0 else arch.residual_multiplier
    if scale is not None and delta is not None:  # Granite: each half's output scaled before its add
        delta = delta * scale
    sandwich = arch is not None and arch.sandwich_norms
    if sandwich:  # Gemma: the attention's output normed before its add; the MLP's likewise
        if delta is not None:
            delta = kernels.rms_norm(layer.post_attention_layernorm, delta)
        hidden, x = residual_norm(layer.pre_feedforward_layernorm, hidden, delta)
    else:
        hidden, x = residual_norm(layer.post_attention_layernorm, hidden, delta)
    if fused is None or fused.gate_up_weight is None:
        out = layer.mlp(x)
        out = out[0] if isinstance(out, tuple) else out
    else:
        out = layer.mlp.down_proj(kernels.silu_mul(layer.mlp.act_fn, F.linear(x, fused.gate_up_weight)))
    if sandwich:
        out = kernels.rms_norm(layer.post_feedforward_layernorm, out)
    if scale is not None:
        out = out * scale
    return (hidden, out) if defer else hidden + out


class FusedWeights(torch.nn.Module):
    """One layer's q|k|v (and gate|up) projection weights as single tensors, so a verify batch runs
    one GEMM where the HF modules run three (two): fewer launches, and wide GEMMs that need no
    split-K at a few dozen rows. The modules' own weights become row slices (views) of the fused
    tensors, so memory does not grow and the eager path computes with the very same values.
    An nn.Module (tensors as buffers) so that a compiled layer half treats them as inputs, like the
    layer's own weights: one compiled graph for every layer. A layer without plain-linear
    attention (a Gated DeltaNet layer) fuses its MLP only; a MoE MLP is left alone."""

    def __init__(self, layer: torch.nn.Module, column_major: bool = False) -> None:
        super().__init__()
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.qkv_sizes: list[int] = []
        if self._attention_fusable(layer):
            attn = layer.self_attn
            projections = [attn.q_proj, attn.k_proj, attn.v_proj]
            self.qkv_sizes = [p.out_features for p in projections]
            self.qkv_weight = _fuse(projections, "weight", column_major)  # registered buffers: assignment keeps them
            self.qkv_bias = _fuse(projections, "bias") if projections[0].bias is not None else None
        if self._mlp_fusable(layer):
            self.gate_up_weight = _fuse([layer.mlp.gate_proj, layer.mlp.up_proj], "weight", column_major)
        # Gated DeltaNet (Qwen3.5 layout): in_proj_qkv | z | b | a as one GEMM. The b and a
        # projections are 48 columns each: as GEMMs of their own they are two launches of a few
        # us per layer that read almost nothing (48 such layers in a 27B round).
        self.register_buffer("linear_in_weight", None, persistent=False)
        self.linear_in_sizes: list[int] = []
        if self._linear_in_fusable(layer):
            gdn_module = layer.linear_attn
            projections = [gdn_module.in_proj_qkv, gdn_module.in_proj_z, gdn_module.in_proj_b, gdn_module.in_proj_a]
            self.linear_in_sizes = [p.out_features for p in projections]
            self.linear_in_weight = _fuse(projections, "weight", column_major)

    @classmethod
    def for_layer(cls, layer: torch.nn.Module, column_major: bool = False) -> FusedWeights | None:
        """The layer's fused weights, made once per layer: a decoder built later (another decode
        path) reuses them instead of fusing the views again (which would copy the weights).
        ``column_major``: the fused tensors are stored transposed (``store_column_major``), as
        the engine stores every other linear's weight on CUDA."""
        fused = layer.__dict__.get("_ddtree_fused")
        if fused is None and cls.supported(layer):
            fused = cls(layer, column_major)
            object.__setattr__(layer, "_ddtree_fused", fused)  # not a registered submodule
        return fused

    @classmethod
    def supported(cls, layer: torch.nn.Module) -> bool:
        return cls._attention_fusable(layer) or cls._mlp_fusable(layer) or cls._linear_in_fusable(layer)

    @staticmethod
    def _linear_in_fusable(layer: torch.nn.Module) -> bool:
        module = getattr(layer, "linear_attn", None)
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        projections = [getattr(module, name, None) for name in names]
        if not all(type(p) is torch.nn.Linear and p.bias is None for p in projections):
            return False  # Qwen3-Next's joint qkvz / ba layout, quantised or wrapped linears
        return len({(p.weight.dtype, p.weight.device, p.in_features) for p in projections}) == 1

    @staticmethod
    def _attention_fusable(layer: torch.nn.Module) -> bool:
        attn = getattr(layer, "self_attn", None)
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if not all(isinstance(p, torch.nn.Linear) and type(p) is torch.nn.Linear for p in projections):
            return False  # quantised or wrapped linears: leave them alone
        weights = [p.weight for p in projections]
        biases = {p.bias is None for p in projections}
        return len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1 and len(biases) == 1

    @staticmethod
    def _mlp_fusable(layer: torch.nn.Module) -> bool:
        mlp = getattr(layer, "mlp", None)
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        return (
            type(gate) is torch.nn.Linear and type(up) is torch.nn.Linear and gate.bias is None and up.bias is None
            and hasattr(mlp, "down_proj") and hasattr(mlp, "act_fn") and gate.out_features == up.out_features
            and gate.weight.dtype == up.weight.dtype
        )


def linear_attention_rows(
    module: torch.nn.Module,
    hidden: torch.Tensor,
    parents: torch.Tensor,
    ancestors: torch.Tensor,
    state: torch.Tensor,
    conv_state: torch.Tensor,
    fused: FusedWeights | None = None,
    kept: dict[str, torch.Tensor] | None = None,
    max_path: int | None = None,
    paths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, gdn.ParallelParts, torch.Tensor]:
    """A Gated DeltaNet layer over tree rows in one parallel solve (``gdn.parallel_gated_delta``),
    static shapes and no host sync. hidden [N, H] (after input_layernorm); parents [N] (-1: the
    committed state; padding rows too); ancestors [N, N]. Returns (out [N, H], the parts that
    rebuild the state after any node, the pre-conv inputs [N, conv_dim] that rebuild any node's
    conv window: ``gdn.conv_tail``). ``fused``: the layer's ``FusedWeights`` (one GEMM for the four
    input projections). ``kept``: the buffers commit reads (fp32 keys [Hv, N, dk], updates
    [Hv, N, dv], path_decay [Hv, N]; inputs [N, conv_dim]) that the Gated DeltaNet kernels
    (``triton_gdn``, ``triton_gdn_state``, where the kernels run) write into; what they wrote
    comes back as those very buffers.
    ``max_path``: a bound on the rows of a root-to-row path (the draft block), which lets the solve
    kernel pick its method with no host sync; ``paths``: the rows' path table for the solve kernel
    (``kernels.gdn_path_table``, built once for all layers)."""
    n = hidden.shape[0]
    kernel = module.conv_kernel_size
    if fused is not None and fused.linear_in_weight is not None:
        mixed, z, b, a = F.linear(hidden, fused.linear_in_weight).split(fused.linear_in_sizes, dim=-1)
        z = z.reshape(n, module.num_v_heads, module.head_v_dim)
    else:
        mixed, z, b, a = gdn.gdn_projections(module, hidden)
    weight = module.conv1d.weight.squeeze(1)
    state_kernels = kernels.gdn_state_kernels(mixed, module.activation) if kept is not None else None
    if state_kernels is not None:  # windows gathered and convolved in one kernel, inputs kept where commit reads them
        conv_out, inputs = state_kernels.conv_rows(
            mixed, parents, conv_state, weight, module.conv1d.bias, module.activation, inputs_out=kept["inputs"]
        )
    else:
        windows = gdn.conv_windows(mixed, parents, conv_state, kernel)
        conv_out = gdn.conv_from_windows(windows, weight, module.conv1d.bias, module.activation).to(hidden.dtype)
        inputs = mixed
    solver = kernels.gdn_solver(conv_out, module, a, b) if kept is not None else None
    if solver is not None:  # the whole solve in Triton, its parts written where commit reads them
        keys, updates, path_decay = kept["keys"], kept["updates"], kept["path_decay"]
        out_norm = kernels.gated_norm_for_solve(module.norm, z)  # z [n, Hv, dv]: read in place
        core = solver.tree_solve(
            conv_out, a, b, module.A_log, module.dt_bias, ancestors, state, keys, updates, path_decay,
            module.num_k_heads, module.head_k_dim, max_path=max_path, paths=paths, out_norm=out_norm,
        )
        parts = gdn.ParallelParts(keys, updates, path_decay, ancestors, state)
        if out_norm is not None:  # the solve normed and gated its output itself
            return module.out_proj(core), parts, inputs
    else:
        q, k, v = torch.split(conv_out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        g, beta = gdn.gdn_gates(module, b, a)
        core, parts = gdn.parallel_gated_delta(
            q.reshape(n, module.num_k_heads, module.head_k_dim), k.reshape(n, module.num_k_heads, module.head_k_dim),
            v.reshape(n, module.num_v_heads, module.head_v_dim), g, beta, ancestors, state,
        )
    normed = kernels.gated_rms_norm(module.norm, core.reshape(-1, module.head_v_dim), z)  # z [n, Hv, dv]: in place
    return module.out_proj(normed.reshape(n, module.value_dim)), parts, inputs


def column_major_weights(device: torch.device) -> bool:
    """Whether a model on ``device`` stores its linears' weights transposed (``store_column_major``):
    on CUDA, unless ``DDTREE_DIAG_WEIGHT_LAYOUT=rows`` keeps them as loaded."""
    return device.type == "cuda" and os.environ.get("DDTREE_DIAG_WEIGHT_LAYOUT", "").strip().lower() != "rows"


def store_models_column_major(*models: torch.nn.Module | None) -> None:
    """``store_column_major`` for every plain ``nn.Linear`` of the models, but an output head that
    shares its weight with the input embedding (the embedding reads rows of it)."""
    for model in models:
        if model is None:
            continue
        tied = set()
        embeddings = getattr(model, "get_input_embeddings", None)
        if embeddings is not None and embeddings() is not None:
            tied.add(id(embeddings().weight))
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.weight.is_contiguous() and id(module.weight) not in tied:
                store_column_major(module)


def store_column_major(linear: torch.nn.Linear) -> None:
    """Rebind ``linear``'s weight [out, in] to the same values stored transposed (an [in, out]
    tensor viewed as [out, in]: strides (1, out)). ``F.linear`` then runs cuBLAS's "NN" GEMM instead
    of "TN", whose kernels read the weight faster at a verify's few dozen rows: on the H200 (8B
    projections, 32 rows, ``python -m bench.gemm_shapes --layouts``) q|k|v 16.2 -> 14.4 us, gate|up
    50.6 -> 48.6, o 10.5 -> 10.1, down 30.1 -> 29.6, lm_head 307 -> 287, the same values bit for bit
    in all but one case of fifteen (down at 272 rows: another kernel, another summation order).
    The eager path and the HF model compute with this very parameter too. The old weight is freed
    once rebound: a model grows by one weight's size, for the copy, while it is relaid."""
    weight = linear.weight.detach()
    linear.weight = torch.nn.Parameter(weight.t().contiguous().t(), requires_grad=False)


def _fuse(linears: list[torch.nn.Linear], name: str, column_major: bool = False) -> torch.Tensor:
    """Concatenate the linears' ``name`` tensors along the output rows and rebind each linear's
    parameter to its slice of the result (``column_major``: the result stored transposed, see
    ``store_column_major``; the slices are then column blocks of that storage)."""
    parts = [getattr(lin, name).detach() for lin in linears]
    if column_major and parts[0].dim() == 2:  # one copy, made in the transposed layout
        fused = torch.cat([part.t() for part in parts], dim=1).t()
    else:
        fused = torch.cat(parts, dim=0)
    row = 0
    for lin in linears:
        rows = getattr(lin, name).shape[0]
        setattr(lin, name, torch.nn.Parameter(fused[row : row + rows], requires_grad=False))
        row += rows
    return fused


def draft_pre_attention(layer, hidden, cos, sin, heads: int, head_dim: int, fused=None, cache=None, residual=None):
    """A draft layer up to attention, for the noise block: q, k, v and the layer's input hidden
    state (see ``target_pre_attention``: ``residual`` added in the input norm's kernel; ``cache``:
    (draft_k, draft_v, first slot) of this layer, k and v then come back as None where the
    one-kernel write ran)."""
    attn = layer.self_attn
    hidden, x = residual_norm(layer.input_layernorm, hidden, residual)
    rows = hidden.shape[1]
    if fused is None or fused.qkv_weight is None:
        q = attn.q_norm(attn.q_proj(x).view(1, rows, heads, head_dim)).transpose(1, 2)
        k, v = attn.project_kv(x, cos, sin)
        return apply_rope(q, cos, sin), k, v, hidden
    q, k, v = F.linear(x, fused.qkv_weight, fused.qkv_bias).split(fused.qkv_sizes, dim=-1)
    if cache is not None:
        q_heads, kv = q.view(1, rows, heads, head_dim), (k.view(1, rows, -1, head_dim), v.view(1, rows, -1, head_dim))
        written = kernels.norm_rope_cache(attn, q_heads, *kv, cos, sin, *cache)
        if written is not None:
            return written, None, None, hidden
    q = kernels.norm_rope(attn.q_norm, q.view(1, rows, heads, head_dim), cos, sin)
    k = kernels.norm_rope(attn.k_norm, k.view(1, rows, -1, head_dim), cos, sin)  # as DraftAttention.project_kv
    return q, k, v.view(1, rows, -1, head_dim).transpose(1, 2), hidden


def draft_context_kv(attn, ctx, cos, sin):
    """``attn.project_kv(ctx, cos, sin)`` with the k norm and rotary through ``kernels``."""
    rows = ctx.shape[1]
    k = kernels.norm_rope(attn.k_norm, attn.k_proj(ctx).view(1, rows, attn.kv_heads, attn.head_dim), cos, sin)
    return k, attn.v_proj(ctx).view(1, rows, attn.kv_heads, attn.head_dim).transpose(1, 2)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean attention mask (True = may attend) as the additive bias SDPA would build from it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# SDPA backend on CUDA: memory-efficient (takes a mask, capturable) by default; DDTREE_DIAG_ATTENTION=
# cudnn | math picks another first (the speed bench compares them).
ATTENTION_BACKEND = os.environ.get("DDTREE_DIAG_ATTENTION", "efficient")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None):
    """SDPA; on CUDA pinned to ATTENTION_BACKEND with math as the fallback. CPU: PyTorch's own choice."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}.get(
            ATTENTION_BACKEND, SDPBackend.EFFICIENT_ATTENTION
        )
        with sdpa_kernel([first, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
