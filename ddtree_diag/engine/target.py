"""Our own forward of an HF decoder-only target, with a cache we own.

Which targets (dense and Gated DeltaNet hybrids) and how they differ is in ``arch``. We use the
HF model's own weights and its norm / MLP / rotary modules.

What we add over HF: a preallocated KV cache (``KVCache``, full-attention layers) with explicit
compaction (no reliance on ``DynamicCache.crop``, whose semantics changed in transformers 5.23), an
arbitrary boolean attention mask over the block being verified (tree verification), per-token
positions, only the hidden states the draft needs, and for linear-attention layers a committed
recurrent state and conv window per layer that every tree node forks from its parent
(``gdn.gdn_layer_tree``: the parent-pointer scan) and that commit takes from the last accepted node.

Cache protocol: ``forward`` writes the block's K/V at slots [length, length+T) without advancing
``length`` and keeps each linear layer's per-node states aside; ``commit(keep)`` then compacts the
kept block entries (indices into the block, a root-to-node path in order) to slots
[length, length+len(keep)), takes the linear layers' state after ``keep[-1]``, and advances
``length``. Anything not committed is garbage and gets overwritten by the next forward. The fast
path (``fast.decoder``) uses the same ``KVCache`` with its own forward and recurrent buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ddtree_diag.engine import arch as arch_
from ddtree_diag.engine import gdn
from ddtree_diag.engine.rope import apply_rope

# Prompt rows per prefill forward, by device type (both decode paths run the same chunks). What a
# forward holds grows with its rows (on CUDA the fast path's attention bias is rows x the cache
# window per query head of a KV head: 8.6 GB for a whole 32k-token prompt on the 8B shape), so a
# long prompt goes in chunks, each attending to the rows committed before it. None: the whole
# prompt in one forward. On CPU the eager prompt runs SDPA's causal mode with no mask at all, which
# later chunks could not (bench.long_prompt, 24k tokens on its small shape: 9.7 s and 1,185 MiB
# whole, 16.9 s and 1,900 MiB in 8k chunks).
PREFILL_CHUNK: dict[str, int | None] = {"cuda": 8192, "cpu": None}


def prefill_chunks(prompt_len: int, device: torch.device | str, size: int | None = None) -> list[tuple[int, int]]:
    """The [begin, end) row ranges a prompt's prefill runs as on ``device`` (``size``: rows per
    chunk instead of ``PREFILL_CHUNK``'s)."""
    kind = torch.device(device).type
    size = size or PREFILL_CHUNK.get(kind, PREFILL_CHUNK["cuda"]) or max(prompt_len, 1)
    return [(begin, min(prompt_len, begin + size)) for begin in range(0, prompt_len, size)]


def prefill_in_chunks(
    prompt_len: int,
    device: torch.device | str,
    forward: Callable[[int, int], tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``forward(begin, end)`` (the rows' last logits, their features or None) over the
    prompt's ``prefill_chunks``, in order: the last chunk's logits and the features [T, n*H],
    filled chunk by chunk (no concatenated copy of a long prompt's)."""
    features = None
    for begin, end in prefill_chunks(prompt_len, device):
        logits, part = forward(begin, end)
        if part is not None:
            if features is None:
                features = part.new_empty(prompt_len, part.shape[1])
            features[begin:end] = part
    return logits, features


def grouped_kv(keys: torch.Tensor, values: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Keys/values [B, kv_heads, L, D] for SDPA over ``heads`` query heads, and its ``enable_gqa``.
    On CPU SDPA reads each KV head for its query heads in place (the same bits as over copies,
    tested; a copy of the cache per layer and round is what it saves: ~0.5 ms a layer at 2k
    context); elsewhere the KV heads are repeated, as the fp32 GPU equality runs were measured."""
    kv_heads = keys.shape[1]
    if kv_heads == heads:
        return keys, values, False
    if keys.device.type == "cpu":
        return keys, values, True
    rep = heads // kv_heads
    return keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1), False


def latent_qkv(
    attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-head latent attention's q, k [1, heads, T, nope + rope dims] and v [1, heads, T, v
    dims] for rows ``x`` [1, T, H], as HF's DeepSeek-V3 / GLM-4.7-Flash attention makes them: q
    from its (low-rank) projection, K and V expanded from the normed latent by the module's own
    ``expand_kv``, rotary on q's and the shared key's last dims (pairs interleaved in the weights
    where the config says ``rope_interleave``: de-interleaved first, as HF does; DeepSeek-V2's
    complex rotary is the same turn of interleaved pairs)."""
    t = x.shape[1]
    q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(1, t, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    latent, k_rot = torch.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    latent = attn.kv_a_layernorm(latent).view(1, 1, t, attn.kv_lora_rank)
    k_rot = k_rot.view(1, 1, t, attn.qk_rope_head_dim)
    # DeepSeek-V2 turns each pair as a complex number, in fp32 (its rotary module's cos/sin are,
    # and ``apply_rope`` turns in their dtype)
    if getattr(attn.config, "rope_interleave", False) or attn.config.model_type == "deepseek_v2":
        q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
    q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
    k, v = attn.expand_kv(latent, k_rot)
    return torch.cat((q_pass, q_rot), dim=-1), k, v


def qkv_sizes(heads: int, kv_heads: int, head_dim: int) -> list[int]:
    """The q, k, v widths of a fused q|k|v projection (Phi-3's ``qkv_proj``)."""
    return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs stored interleaved (x0, y0, x1, y1, ...) as halves (x0, x1, ..., y0, y1, ...)."""
    *lead, dims = x.shape
    return x.view(*lead, dims // 2, 2).transpose(-1, -2).reshape(*lead, dims)


# Head dims added to q and k that carry a sink's logit into the scores (a multiple of 8: SDPA's
# fused CUDA kernels want aligned head dims).
SINK_DIMS = 8


def sink_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``attend_with_sinks``'s additive mask from a bool mask [.., rows, keys]: 0 / -inf, then 0 for
    the sink's key slot. The same for every head and layer: built once per mask."""
    bias = torch.zeros(*allowed.shape[:-1], allowed.shape[-1] + 1, dtype=dtype, device=allowed.device)
    bias[..., :-1].masked_fill_(~allowed, float("-inf"))
    return bias


def attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    sinks: torch.Tensor,
    scale: float | None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA with attention sinks (gpt-oss): each row's softmax also spans one logit of its head
    (``sinks``, broadcast to q's [.., rows, 1]) that has no value, so the attended values' weights
    sum to less than one, as in HF's softmax over the scores with the sinks concatenated. The sink
    is one more key slot with a zero value whose score is the sink: q carries sink / scale in an
    extra dim that only that slot's key reads (1 there, 0 in every other key; exact where the
    scale is a power of two, as head_dim 64's is). So the mask (``sink_bias``) is one for every
    head and layer, and a layer copies only its K/V window with the slot added."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    extra = q.new_zeros(*q.shape[:-1], SINK_DIMS)
    extra[..., :1] = (sinks.float() / scale).to(q.dtype)
    q = torch.cat([q, extra], dim=-1)
    widened = keys.new_zeros(*keys.shape[:-2], keys.shape[-2] + 1, keys.shape[-1] + SINK_DIMS)
    widened[..., :-1, : keys.shape[-1]] = keys
    widened[..., -1, keys.shape[-1]] = 1
    values = torch.cat([values, values.new_zeros(*values.shape[:-2], 1, values.shape[-1])], dim=-2)
    return F.scaled_dot_product_attention(q, widened, values, attn_mask=bias, scale=scale, enable_gqa=enable_gqa)


class KVCache:
    """The target's K/V for its full-attention layers: ``k``, ``v`` [layers, 1, kv_heads, capacity,
    head_dim] (``v_head_dim``: V's, where narrower: latent attention). Slots [0, length) hold the
    committed tokens; a forward writes its block after them."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, capacity: int, device: torch.device, dtype: torch.dtype,
        v_head_dim: int | None = None,
    ) -> None:
        self.length = 0
        shape = (layers, 1, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros((*shape[:-1], v_head_dim or head_dim), device=device, dtype=dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reset(self, capacity: int | None = None) -> None:
        """Nothing committed; reallocate (zeroed) when ``capacity`` exceeds what is allocated."""
        self.length = 0
        if capacity is not None and capacity > self.capacity:
            grown = [torch.zeros((*t.shape[:3], capacity, t.shape[4]), device=t.device, dtype=t.dtype)
                     for t in (self.k, self.v)]
            self.k, self.v = grown

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [1, kv_heads, rows, head_dim] of cache layer ``layer`` at ``slots`` [rows]
        (a tensor: the fast path's start lives on the device); returns that layer's whole K and V."""
        keys, values = self.k[layer], self.v[layer]
        keys.index_copy_(2, slots, k.to(keys.dtype))
        values.index_copy_(2, slots, v.to(values.dtype))
        return keys, values

    def compact(self, keep: torch.Tensor, start: torch.Tensor | int | None = None) -> None:
        """Keep block rows ``keep`` (indices into the block written at ``start``, default
        ``length``): row start+keep[i] moves to slot start+i, so the accepted nodes follow the
        committed tokens in order. ``length`` is not advanced (see ``advance``)."""
        start = self.length if start is None else start
        dst = start + torch.arange(keep.shape[0], device=keep.device)
        self.move(start + keep, dst)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots ``src`` (int64, on the cache's device) are copied to slots ``dst``, every layer:
        what ``compact`` does, with the slots already worked out (the fast path's accept walk)."""
        self.k.index_copy_(3, dst, self.k.index_select(3, src))
        self.v.index_copy_(3, dst, self.v.index_select(3, src))

    def advance(self, count: int) -> None:
        """``count`` more slots are committed (after ``compact``, or a prefill written in order)."""
        self.length += count


def _plain_linear(module: torch.nn.Module) -> bool:
    """An ``nn.Linear`` with no bias and no forward of its own (hooks, a subclass): its output is
    ``x @ weight.T``, which ``torch.mm`` can write into a given buffer."""
    return type(module) is torch.nn.Linear and module.bias is None and not module._forward_hooks \
        and not module._forward_pre_hooks


class TargetModel:
    """Wraps an HF ``*ForCausalLM``; see the module docstring for the cache protocol."""

    def __init__(self, hf_model: torch.nn.Module, max_len: int) -> None:
        arch_.check_supported(hf_model.config)
        self.hf = hf_model
        self.config = arch_.text_config(hf_model.config)
        inner = hf_model.model
        self.inner = getattr(inner, "language_model", inner)  # a vision-language wrapper: its text model
        self.layers = list(self.inner.layers)
        self.num_layers = len(self.layers)
        self.arch = arch_.detect(self.config, self.layers, self.inner.rotary_emb)
        # Which layers attend (KV cache) and which are Gated DeltaNet (recurrent state).
        self.linear_layers = list(self.arch.linear_layers)
        self.attention_layers = list(self.arch.attention_layers)
        self.cache_slot = {layer: slot for slot, layer in enumerate(self.attention_layers)}
        attn = self.layers[self.attention_layers[0]].self_attn
        self.heads = self.config.num_attention_heads
        if self.arch.latent_attention:  # K and V expanded per head from the latent: one KV head a head
            self.head_dim, self.v_head_dim, self.kv_heads = attn.qk_head_dim, attn.v_head_dim, self.heads
        else:
            self.head_dim = self.v_head_dim = attn.head_dim
            self.kv_heads = self.config.num_key_value_heads
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        # Per layer: its sliding attention window or None (HF's own choice per layer: ``arch``)
        self.windows = self.arch.windows
        weight = self.inner.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.kv = KVCache(
            len(self.attention_layers), self.kv_heads, self.head_dim, max_len, self.device, self.dtype, self.v_head_dim
        )
        # Linear-attention layers: committed state [Hv, dk, dv] fp32 and conv window [conv_dim, K-1]
        # (None until something is committed), and what the last forward left to commit from.
        self.recurrent: dict[int, torch.Tensor | None] = dict.fromkeys(self.linear_layers)
        self.conv: dict[int, torch.Tensor | None] = dict.fromkeys(self.linear_layers)
        self._pending: dict[int, tuple[str, int, torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        """Committed tokens (the KV cache's)."""
        return self.kv.length

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def hybrid(self) -> bool:
        return self.arch.hybrid

    def reset(self, capacity: int | None = None) -> None:
        """Empty the cache and the recurrent state; grow the KV cache first when ``capacity``
        exceeds what is allocated. Nothing of an earlier request survives."""
        self.kv.reset(capacity)
        self.recurrent = dict.fromkeys(self.linear_layers)
        self.conv = dict.fromkeys(self.linear_layers)
        self._pending = {}

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding module's rows (what a DFlash draft embeds its noise block with)."""
        return self.inner.embed_tokens(token_ids)

    def embed_input(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's first hidden state: ``embed`` times Granite's embedding multiplier."""
        hidden = self.embed(token_ids)
        return hidden if self.arch.embedding_multiplier == 1.0 else hidden * self.arch.embedding_multiplier

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(hidden)

    def rope(
        self, hidden: torch.Tensor, positions: torch.Tensor, table: str = ""
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [1, 1, T, rotary dims] at ``positions`` [T], from the HF model's own rotary module
        (it knows the checkpoint's rope scaling and partial rotary; Qwen3.5's multimodal rope
        reduces to this for text, whose three position rows are equal). ``table``: a layer type,
        for a module with one table per type (Gemma 3)."""
        ids = positions[None]
        if self.arch.multimodal_rope:
            ids = ids[None].expand(3, 1, -1)  # one row per rope section (time, height, width); equal for text
        angles = self.inner.rotary_emb(hidden, ids, table) if table else self.inner.rotary_emb(hidden, ids)
        if torch.is_tensor(angles) and angles.is_complex():  # DeepSeek-V2: cos + i sin per pair, in fp32
            cos, sin = torch.cat([angles.real] * 2, dim=-1), torch.cat([angles.imag] * 2, dim=-1)
        else:
            cos, sin = angles
        if self.arch.rope_on_halves:  # half a head's angles: the usual rotation with them repeated
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos[:, None], sin[:, None]

    def layer_ropes(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin (``Arch.rope_tables``), each table computed once. A layer without
        rotary (SmolLM3's NoPE layers) gets cos 1 and sin 0, which leave q and k as they are, bit
        for bit (x * 1 + r * 0), in every rotary path (the fused kernels too)."""
        tables = self.arch.rope_tables or ("",) * self.num_layers
        made = {table: self.rope(hidden, positions, table) for table in dict.fromkeys(tables) if table is not None}
        if None in tables:
            cos, sin = next(iter(made.values())) if made else self.rope(hidden, positions)
            made[None] = (torch.ones_like(cos), torch.zeros_like(sin))
        return [made[table] for table in tables]

    def mlp(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = layer.mlp(x)
        return out[0] if isinstance(out, tuple) else out  # some MoE blocks also return router logits

    def _attention(
        self,
        layer_index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        attn = self.layers[layer_index].self_attn
        t = x.shape[1]
        gate = None
        if self.arch.latent_attention:
            q, k, v = latent_qkv(attn, x, cos, sin)
        else:
            if self.arch.fused_qkv:  # Phi-3: one q|k|v linear
                q, k, v = attn.qkv_proj(x).split(qkv_sizes(self.heads, self.kv_heads, self.head_dim), dim=-1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            if self.arch.qk_norm_whole:  # OLMo: over all heads at once, before the heads are split
                q, k = attn.q_norm(q), attn.k_norm(k)
            if self.arch.gated_query:
                q, gate = q.view(1, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
                gate = gate.reshape(1, t, self.heads * self.head_dim)
            q = q.reshape(1, t, self.heads, self.head_dim)
            k = k.view(1, t, self.kv_heads, self.head_dim)
            v = v.view(1, t, self.kv_heads, self.head_dim)
            if self.arch.qk_norm and not self.arch.qk_norm_whole:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = self.kv.write(self.cache_slot[layer_index], slots, k, v)
        end = self.length + t
        keys, values = keys[:, :, :end], values[:, :, :end]
        keys, values, gqa = grouped_kv(keys, values, self.heads)
        if self.arch.attention_sinks:  # ``mask``: ``sink_bias``'s, from ``forward``
            out = attend_with_sinks(q, keys, values, mask, attn.sinks.view(1, -1, 1, 1), self.scaling, gqa)
        else:
            # mask None: the rows are a prompt from slot 0 and the mask would be causal; SDPA's causal
            # mode skips the key blocks past the diagonal (half a long prompt's attention on CPU, the
            # same bits as the explicit mask: tested)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scaling, enable_gqa=gqa
            )
        out = out.transpose(1, 2).reshape(1, t, self.heads * self.v_head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return attn.o_proj(out)

    def _linear_attention(self, layer_index: int, x: torch.Tensor, parents: list[int] | None) -> torch.Tensor:
        """A Gated DeltaNet layer on the block: a committed chain (``parents`` None: the prompt,
        chunked) or a tree whose every node forks its parent's state (the parent-pointer scan)."""
        module = self.layers[layer_index].linear_attn
        state, conv = self.recurrent[layer_index], self.conv[layer_index]
        rows = x[0]
        if parents is None:
            out, final_state, final_conv = gdn.gdn_layer_prefill(module, rows, state, conv)
            self._pending[layer_index] = ("chain", rows.shape[0], final_state, final_conv)
        else:
            out, states, windows = gdn.gdn_layer_tree(module, rows, parents, state, conv)
            self._pending[layer_index] = ("tree", rows.shape[0], states, windows)
        return out[None]

    def _attention_mask(
        self, positions: torch.Tensor, block_mask: torch.Tensor | None, window: int | None = None
    ) -> torch.Tensor | None:
        """[1, 1, T, length + T] bool: every committed token, the block's own mask (None: causal)
        and a sliding ``window``. None where SDPA's causal mode gives the same: a prompt into an
        empty cache on CPU (``_attention``)."""
        t = positions.shape[0]
        reach = window is not None and self.length + t > window
        if block_mask is None and not self.length and not reach and self.device.type == "cpu":
            return None
        if block_mask is None:
            block_mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        mask = torch.ones(t, self.length + t, dtype=torch.bool, device=self.device)
        mask[:, self.length :] = block_mask
        if reach:
            key_pos = torch.cat([torch.arange(self.length, device=self.device), positions])
            mask &= key_pos[None, :] > positions[:, None] - window
        return mask[None, None]

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        block_mask: torch.Tensor | None = None,
        feature_layers: list[int] | None = None,
        parents: list[int] | None = None,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T tokens against the committed cache.

        token_ids, positions: [T]. block_mask: [T, T] bool among the block (None = causal); every
        token sees all committed tokens. ``parents`` (a tree's, parent -1 = the committed state):
        needed by hybrid targets whenever ``block_mask`` is given. Returns logits [T, V] (model
        dtype) and, when ``feature_layers`` is given, the concatenated hidden states after those
        layers [T, n*H] (HF ``hidden_states[id + 1]``; the last layer's entry is after the final
        norm, as in HF). ``last_only``: logits [1, V] of the last token only (all a prefill
        chooses from; a long prompt's [T, V] would be T x V floats the decode never reads).
        """
        t = token_ids.shape[0]
        if self.length + t > self.kv.capacity:
            raise RuntimeError(f"target KV cache full ({self.length + t} > {self.kv.capacity} tokens)")
        if self.hybrid and block_mask is not None and parents is None:
            raise ValueError("a hybrid target verifies a tree from its parents: pass parents with block_mask")
        # one mask per distinct window (full attention: None), shared by the layers that use it
        masks = {w: self._attention_mask(positions, block_mask, w) for w in {self.windows[i] for i in self.cache_slot}}
        if self.arch.attention_sinks:  # additive, with the sink's slot (a prompt's None: causal)
            causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
            masks = {w: sink_bias(causal if m is None else m, self.dtype) for w, m in masks.items()}
        hidden = self.embed_input(token_ids[None])
        ropes = self.layer_ropes(hidden, positions)
        slots = torch.arange(self.length, self.length + t, device=self.device)  # where the block's K/V go
        wanted = set(feature_layers or [])
        features: dict[int, torch.Tensor] = {}
        self._pending = {}
        for index, layer in enumerate(self.layers):
            x = hidden if self.arch.post_norms else layer.input_layernorm(hidden)
            if index in self.cache_slot:
                out = self._attention(index, x, *ropes[index], masks[self.windows[index]], slots)
            else:
                out = self._linear_attention(index, x, parents)
            if self.arch.post_norms:  # OLMo: each half's output normed, its input not
                hidden = hidden + layer.post_attention_layernorm(out)
                hidden = hidden + layer.post_feedforward_layernorm(self.mlp(layer, hidden))
            elif self.arch.sandwich_norms:  # Gemma: each half's output normed before its residual add
                hidden = hidden + layer.post_attention_layernorm(out)
                out = self.mlp(layer, layer.pre_feedforward_layernorm(hidden))
                hidden = hidden + layer.post_feedforward_layernorm(out)
            else:
                scale = self.arch.residual_multiplier  # Granite: each half's output scaled
                hidden = hidden + (out if scale == 1.0 else out * scale)
                out = self.mlp(layer, layer.post_attention_layernorm(hidden))
                hidden = hidden + (out if scale == 1.0 else out * scale)
            if index in wanted and index != self.num_layers - 1:
                features[index] = hidden
        return self.head(hidden, features, feature_layers, last_only)

    @torch.no_grad()
    def prefill(
        self, token_ids: torch.Tensor, feature_layers: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt [T] into the empty cache, committed, in ``prefill_chunks``: each chunk attends to
        the committed rows and causally to itself; linear layers carry their state across. Returns
        the last row's logits [1, V] and the features [T, n*H] (None without ``feature_layers``)."""
        positions = torch.arange(token_ids.shape[0], device=self.device)

        def chunk(begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            out = self.forward(token_ids[begin:end], positions[begin:end], None, feature_layers, last_only=True)
            self.commit(list(range(end - begin)))
            return out

        return prefill_in_chunks(token_ids.shape[0], self.device, chunk)

    def head(
        self,
        hidden: torch.Tensor,
        features: dict[int, torch.Tensor],
        feature_layers: list[int] | None,
        last_only: bool = False,
        normed: bool = False,
        out: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the last layer: final norm (the last layer's feature is taken after it, as in HF),
        LM head (of the last row only with ``last_only``), and the wanted layers' hidden states
        concatenated [T, n*H] (None if none). ``normed``: ``hidden`` is the final norm's output
        already (the fast path norms in its own kernel). ``out``: buffers of the results' shapes
        ("logits" [T, V], "features" [T, n*H]) to hold them: a plain LM head writes its GEMM's
        output there and the features are concatenated there, with no copy after (a 257-row
        verify's logits are 78 MB at the 8B shape: a 69 us copy on an H100). Returns the buffers,
        filled without autograd history."""
        if out is not None and torch.is_grad_enabled():  # a buffer is filled, never part of a graph
            with torch.no_grad():
                return self.head(hidden, features, feature_layers, last_only, normed, out)
        if not normed:
            hidden = self.inner.norm(hidden)
        if feature_layers and self.num_layers - 1 in feature_layers:
            features[self.num_layers - 1] = hidden
        rows = hidden[:, -1:] if last_only else hidden
        head = self.hf.lm_head
        logits = out["logits"] if out is not None else None
        if logits is not None and _plain_linear(head) and self.arch.logits_scaling == 1.0 \
                and logits.shape == (rows.shape[1], head.out_features) and logits.dtype == rows.dtype:
            # F.linear's own product (x @ W^T) into the buffer: the same GEMM, so the same bits
            torch.mm(rows[0], head.weight.t(), out=logits)
        else:
            computed = self.lm_head(rows)[0]
            if self.arch.logits_scaling != 1.0:  # Granite divides its logits (a draft reads lm_head's own)
                computed = computed / self.arch.logits_scaling
            logits = computed if logits is None else logits.copy_(computed)
        feats = None
        if feature_layers:
            parts = [features[i] for i in feature_layers]
            if out is None:
                feats = torch.cat(parts, dim=-1)[0]
            elif out["features"].shape == (hidden.shape[1], len(parts) * hidden.shape[-1]):
                feats = out["features"]
                torch.cat(parts, dim=-1, out=feats[None])
            else:  # as the logits: a buffer of another shape is still filled (or refused by copy_)
                feats = out["features"].copy_(torch.cat(parts, dim=-1)[0])
        return logits, feats

    def commit(self, keep: list[int]) -> None:
        """Keep block entries ``keep`` (indices into the last forward's block: a root-to-node path,
        in order). Linear layers keep the state after the last kept entry."""
        n = len(keep)
        if keep != list(range(n)):  # a prefix of the block is already in place
            self.kv.compact(torch.tensor(keep, device=self.device))
        for layer_index, (kind, rows, states, windows) in self._pending.items():
            if kind == "chain":
                if keep != list(range(rows)):
                    raise ValueError("a causal block commits whole: keep must be every row")
                self.recurrent[layer_index], self.conv[layer_index] = states, windows
            elif n:
                last = keep[-1]
                self.recurrent[layer_index], self.conv[layer_index] = states[last], windows[last]
        self._pending = {}
        self.kv.advance(n)

    def tree_state_bytes(self, budget: int) -> int:
        """Bytes of per-node recurrent state a tree of ``budget`` draft nodes holds in the scan
        (0 for a dense target): every linear layer keeps one state per node until commit."""
        if not self.hybrid:
            return 0
        return gdn.per_node_state_bytes(self.config, budget, self.dtype)
