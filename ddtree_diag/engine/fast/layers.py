"""Decoder layers shaped for the fast path: fused projections (one GEMM for q|k|v and one for
gate|up), the halves of a layer around attention as pure functions (one compiled graph serves
every layer, the layer being an input), and attention over a window of a static cache."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ddtree_diag.engine.rope import apply_rope


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
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
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
        k, v = attn.project_kv(x, cos, sin)
        return apply_rope(q, cos, sin), k, v
    q, k, v = F.linear(x, fused.qkv_weight, fused.qkv_bias).split(fused.qkv_sizes, dim=-1)
    q = attn.q_norm(q.view(1, rows, heads, head_dim)).transpose(1, 2)
    k = attn.k_norm(k.view(1, rows, -1, head_dim)).transpose(1, 2)  # as DraftAttention.project_kv
    v = v.view(1, rows, -1, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean attention mask (True = may attend) as the additive bias SDPA would build from it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# SDPA backend on CUDA: memory-efficient (takes a mask, capturable) by default; DDTREE_ATTENTION=
# cudnn | math picks another first (the speed bench compares them).
ATTENTION_BACKEND = os.environ.get("DDTREE_ATTENTION", "efficient")


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
