"""Rotary position embeddings: one helper for the target, the draft and the fast path."""

from __future__ import annotations

import math
from typing import Any

import torch

from ddtree_diag.errors import UsageError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., T, D] by ``cos``/``sin`` broadcastable to it. When cos covers fewer than D
    dims (partial rotary, as in Qwen3.5/3.6), only the first ``cos.shape[-1]`` dims turn. The result
    keeps ``x``'s dtype: OLMo's rotary module gives fp32 cos/sin to bf16 heads, and HF turns them in
    fp32 and rounds once."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return (x * cos + rotate_half(x) * sin).to(x.dtype)
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat([(turned * cos + rotate_half(turned) * sin).to(x.dtype), kept], dim=-1)


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse rope frequencies: default, or Llama-3 frequency scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return freqs.float()
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * freqs / factor + smooth * freqs
        out = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(mid, smoothed, out).float()
    raise UsageError(f"rope type {rope_type!r} is not supported (default and llama3 are)")


def cos_sin(
    positions: torch.Tensor, frequencies: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, D] for positions [B, T] (the head axis left for broadcasting)."""
    angles = positions.float().unsqueeze(-1) * frequencies  # [B, T, D/2]
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)
