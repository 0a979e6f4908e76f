"""Our own forward of an HF decoder-only target, with a KV cache we own.

Supports the Llama / Qwen2 / Qwen3 / Mistral family (pre-norm decoder layers, rope, GQA, optional
q/k norm and q/k/v bias) using the HF model's own weights and its norm / MLP / rotary modules.
What we add over HF: a preallocated KV cache with explicit commit/compaction (no reliance on
``DynamicCache.crop``, whose semantics changed in transformers 5.23), an arbitrary boolean
attention mask over the block being verified (tree verification), per-token positions, and only
the hidden states the draft needs.

Cache protocol: ``forward`` writes the block's K/V at slots [length, length+T) without advancing
``length``; ``commit(keep)`` then moves the kept block entries (indices into the block, in order)
to slots [length, length+len(keep)) and advances ``length``. Anything not committed is garbage
and gets overwritten by the next forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ddtree_diag.engine.rope import apply_rope
from ddtree_diag.errors import UsageError

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
# Hybrid Gated-DeltaNet / linear-attention targets: recurrent state cannot be verified with a mask.
HYBRID_MODEL_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_6", "qwen3_6_moe"}


def is_hybrid(config: Any) -> bool:
    text_config = getattr(config, "text_config", None) or config
    model_type = getattr(text_config, "model_type", "") or getattr(config, "model_type", "")
    layer_types = getattr(text_config, "layer_types", None) or []
    return model_type in HYBRID_MODEL_TYPES or any(t == "linear_attention" for t in layer_types)


def check_supported(config: Any) -> None:
    """Refuse targets our forward cannot run exactly, with one line saying why."""
    model_type = getattr(config, "model_type", "?")
    if is_hybrid(config):
        raise UsageError(
            f"target model_type {model_type!r} is a hybrid Gated-DeltaNet (linear-attention) model: "
            "tree verification needs per-node recurrent state forking and rollback, which this engine "
            "does not implement, so it refuses the model rather than produce corrupted output"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UsageError(
            f"target model_type {model_type!r} is not supported by the engine "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )


class TargetModel:
    """Wraps an HF ``*ForCausalLM``; see the module docstring for the cache protocol."""

    def __init__(self, hf_model: torch.nn.Module, max_len: int) -> None:
        check_supported(hf_model.config)
        self.hf = hf_model
        self.config = hf_model.config
        self.inner = hf_model.model
        self.layers = list(self.inner.layers)
        self.num_layers = len(self.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        self.sliding_window = getattr(self.config, "sliding_window", None)
        if getattr(self.config, "use_sliding_window", True) is False:
            self.sliding_window = None
        weight = self.inner.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_len = max_len
        shape = (self.num_layers, 1, self.kv_heads, max_len, self.head_dim)
        self.cache_k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.cache_v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.length = 0

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def reset(self, capacity: int | None = None) -> None:
        """Empty the cache; grow it first when ``capacity`` exceeds what is allocated."""
        self.length = 0
        if capacity is not None and capacity > self.max_len:
            shape = (self.num_layers, 1, self.kv_heads, capacity, self.head_dim)
            self.cache_k = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.cache_v = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.max_len = capacity

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(token_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(hidden)

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, 1, T, D] at ``positions`` [T], from the HF model's own rotary module (it
        knows the checkpoint's rope scaling)."""
        cos, sin = self.inner.rotary_emb(hidden, positions[None])
        return cos[:, None], sin[:, None]

    def _attention(
        self, layer_index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        attn = self.layers[layer_index].self_attn
        t = x.shape[1]
        q = attn.q_proj(x).view(1, t, self.heads, self.head_dim)
        k = attn.k_proj(x).view(1, t, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(1, t, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start, end = self.length, self.length + t
        self.cache_k[layer_index, :, :, start:end] = k
        self.cache_v[layer_index, :, :, start:end] = v
        keys = self.cache_k[layer_index, :, :, :end]
        values = self.cache_v[layer_index, :, :, :end]
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(1, t, self.heads * self.head_dim))

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        block_mask: torch.Tensor | None = None,
        feature_layers: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T tokens against the committed cache.

        token_ids, positions: [T]. block_mask: [T, T] bool among the block (None = causal); every
        token sees all committed tokens. Returns logits [T, V] (model dtype) and, when
        ``feature_layers`` is given, the concatenated hidden states after those layers [T, n*H]
        (HF ``hidden_states[id + 1]``; the last layer's entry is after the final norm, as in HF).
        """
        t = token_ids.shape[0]
        if self.length + t > self.max_len:
            raise RuntimeError(f"target KV cache full ({self.length + t} > {self.max_len} tokens)")
        if block_mask is None:
            block_mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        mask = torch.ones(t, self.length + t, dtype=torch.bool, device=self.device)
        mask[:, self.length :] = block_mask
        if self.sliding_window is not None and self.length + t > self.sliding_window:
            key_pos = torch.cat([torch.arange(self.length, device=self.device), positions])
            mask &= key_pos[None, :] > positions[:, None] - self.sliding_window
        mask = mask[None, None]
        hidden = self.embed(token_ids[None])
        cos, sin = self.rope(hidden, positions)
        wanted = set(feature_layers or [])
        features: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            residual = hidden
            hidden = residual + self._attention(index, layer.input_layernorm(hidden), cos, sin, mask)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if index in wanted and index != self.num_layers - 1:
                features[index] = hidden
        return self.head(hidden, features, feature_layers)

    def head(
        self, hidden: torch.Tensor, features: dict[int, torch.Tensor], feature_layers: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last layer: final norm (the last layer's feature is taken after it, as in HF),
        LM head, and the wanted layers' hidden states concatenated [T, n*H] (None if none)."""
        hidden = self.inner.norm(hidden)
        if feature_layers and self.num_layers - 1 in feature_layers:
            features[self.num_layers - 1] = hidden
        logits = self.lm_head(hidden)[0]
        feats = torch.cat([features[i] for i in feature_layers], dim=-1)[0] if feature_layers else None
        return logits, feats

    def commit(self, keep: list[int]) -> None:
        """Keep block entries ``keep`` (indices into the last forward's block, ascending)."""
        n = len(keep)
        if keep != list(range(n)):
            src = torch.tensor(keep, device=self.device) + self.length
            dst = slice(self.length, self.length + n)
            self.cache_k[:, :, :, dst] = self.cache_k[:, :, :, src]
            self.cache_v[:, :, :, dst] = self.cache_v[:, :, :, src]
        self.length += n
