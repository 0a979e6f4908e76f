"""DFlash block-diffusion draft: config, nn.Module, z-lab format load/save.

Forward contract (used by inference here and by draft training elsewhere)
-------------------------------------------------------------------------
``DFlashDraft.forward(noise_embeds, context_features, noise_positions, context_positions,
attention_mask=None, kv_cache=None) -> hidden``

- ``noise_embeds``: [B, Q, hidden] — the noise block embedded with the TARGET's ``embed_tokens``.
  At inference the block is ``[last committed token, mask_token_id × (block_size-1)]``.
- ``context_features``: [B, C, len(target_layer_ids) * hidden] — the target's hidden states after
  decoder layers ``target_layer_ids`` (HF ``hidden_states[id + 1]``), concatenated on the last dim
  in ``target_layer_ids`` order. C may be 0. The draft applies ``fc`` + ``hidden_norm`` itself.
- ``noise_positions``: [B, Q] or [Q] absolute positions (rope) of the noise tokens
  (inference: ``start .. start+block_size-1``); ``context_positions``: [B, C] or [C].
- Every layer: queries from the noise only; keys/values from [cached context, new context, noise]
  (``k_norm`` + rope on all keys, ``q_norm`` + rope on queries). Context features are never
  queries and never pass through a layer's ``input_layernorm``.
- ``attention_mask``: None = every noise query sees every key (bidirectional block + all context,
  the inference case). Otherwise bool (True = may attend) or additive float, broadcastable to
  [B, heads, Q, K] with K = cached + C + Q keys in that order (training: a block sees only the
  context before its start, e.g.).
- ``kv_cache``: a ``DraftKVCache``. The new context K/V are appended to it (they stay between
  rounds); the noise K/V are never stored. Without a cache nothing is kept.
- Returns the last layer's output after the final ``norm``: [B, Q, hidden]. Per-depth draft
  logits = TARGET ``lm_head(hidden[:, 1:])`` (positions 1..block_size-1).

Checkpoint format (z-lab): ``config.json`` is a Qwen3-style config with
``architectures: ["DFlashDraftModel"]``, ``block_size`` (top level, or inside ``dflash_config`` in
newer drafts), ``num_target_layers``, ``dflash_config: {target_layer_ids, mask_token_id}``,
optional ``layer_types``; rope as ``rope_theta`` (+ ``rope_scaling``) or ``rope_parameters``.
Weights in ``model.safetensors`` (or sharded ``*.safetensors``): ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``,
``layers.N.{input,post_attention}_layernorm``, ``fc``, ``hidden_norm``, ``norm``.
No embedding, no LM head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_diag.engine.rope import apply_rope, cos_sin, inv_freq
from ddtree_diag.engine.target import grouped_kv
from ddtree_diag.errors import UsageError

ARCHITECTURE = "DFlashDraftModel"


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", ...} or None
    vocab_size: int | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # for "sliding_attention" layers (Qwen3.6 drafts)
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, written back on save

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of draft layer ``layer`` (None: it attends to everything)."""
        if self.sliding_window is None or not self.layer_types or layer >= len(self.layer_types):
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftConfig:
        """Read a z-lab config.json dict, accepting the published format variants."""
        dflash = data.get("dflash_config") or {}
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            if k not in data
        ]
        if "target_layer_ids" not in dflash:
            missing.append("dflash_config.target_layer_ids")
        if "mask_token_id" not in dflash:
            missing.append("dflash_config.mask_token_id")
        block_size = data.get("block_size", dflash.get("block_size"))
        if block_size is None:
            missing.append("block_size")
        if missing:
            raise UsageError(f"draft config.json lacks {', '.join(missing)}")
        rope_theta = data.get("rope_theta")
        rope_scaling = data.get("rope_scaling")
        params = data.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        known = {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "block_size", "num_target_layers", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_scaling", "rope_parameters", "vocab_size", "max_position_embeddings",
            "attention_bias", "layer_types", "dflash_config", "sliding_window", "use_sliding_window",
        }
        return cls(
            hidden_size=int(data["hidden_size"]),
            num_hidden_layers=int(data["num_hidden_layers"]),
            num_attention_heads=int(data["num_attention_heads"]),
            num_key_value_heads=int(data.get("num_key_value_heads") or data["num_attention_heads"]),
            intermediate_size=int(data["intermediate_size"]),
            target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(block_size),
            num_target_layers=data.get("num_target_layers"),
            head_dim=data.get("head_dim"),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 1_000_000.0),
            rope_scaling=rope_scaling if isinstance(rope_scaling, dict) else None,
            vocab_size=data.get("vocab_size"),
            max_position_embeddings=int(data.get("max_position_embeddings", 40960)),
            attention_bias=bool(data.get("attention_bias", False)),
            layer_types=data.get("layer_types"),
            sliding_window=_sliding_window(data),
            extra={k: v for k, v in data.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json dict (Qwen3-style + DFlash fields)."""
        data: dict[str, Any] = dict(self.extra)
        data.update(
            {
                "architectures": [ARCHITECTURE],
                "model_type": data.get("model_type", "qwen3"),
                "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.dim_per_head,
                "intermediate_size": self.intermediate_size,
                "hidden_act": "silu",
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling,
                "max_position_embeddings": self.max_position_embeddings,
                "attention_bias": self.attention_bias,
                "block_size": self.block_size,
                "num_target_layers": self.num_target_layers,
                "dflash_config": {
                    "target_layer_ids": list(self.target_layer_ids),
                    "mask_token_id": self.mask_token_id,
                },
                "layer_types": self.layer_types or ["full_attention"] * self.num_hidden_layers,
                "sliding_window": self.sliding_window,
            }
        )
        if self.vocab_size is not None:
            data["vocab_size"] = self.vocab_size
        return data


def _sliding_window(data: dict[str, Any]) -> int | None:
    """The window of sliding-attention layers, when the config has any (``use_sliding_window``
    false turns it off, as in Qwen configs)."""
    window = data.get("sliding_window")
    if window is None or data.get("use_sliding_window") is False:
        return None
    if "sliding_attention" not in (data.get("layer_types") or []):
        return None
    return int(window)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like HF's Qwen3RMSNorm, so bf16 drafts match the reference numerics.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DraftKVCache:
    """Context-only K/V of every draft layer, preallocated: [layers, B, kv_heads, max_len, head_dim]."""

    def __init__(self, config: DraftConfig, max_len: int, batch: int = 1, device=None, dtype=None) -> None:
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_len, config.dim_per_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.zeros(max_len, dtype=torch.long, device=device)  # for sliding windows
        self.length = 0  # context tokens stored
        self.max_len = max_len

    def reset(self) -> None:
        self.length = 0


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        hd = config.dim_per_head
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm + rope) and values of ``x`` [B, T, hidden], as [B, kv_heads, T, head_dim]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        noise_rope: tuple[torch.Tensor, torch.Tensor],
        ctx_rope: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: DraftKVCache | None,
        layer: int,
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *noise_rope)
        k_noise, v_noise = self.project_kv(x, *noise_rope)
        k_ctx, v_ctx = self.project_kv(ctx, *ctx_rope)
        if cache is not None:
            start, end = cache.length, cache.length + ctx.shape[1]
            if end > cache.max_len:
                raise RuntimeError(f"draft cache full ({end} > {cache.max_len} context tokens)")
            cache.k[layer, :, :, start:end] = k_ctx
            cache.v[layer, :, :, start:end] = v_ctx
            k_ctx, v_ctx = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]
        k = torch.cat([k_ctx, k_noise], dim=2)
        v = torch.cat([v_ctx, v_noise], dim=2)
        k, v, gqa = grouped_kv(k, v, self.heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # HF's attribute name: the fast path's fused gate|up GEMM uses it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DFlashDraft(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Plain attribute, not a buffer: .to(bfloat16) must not round the rope frequencies.
        self._inv_freq = inv_freq(config.dim_per_head, config.rope_theta, config.rope_scaling)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def rope(self, positions: torch.Tensor, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, head_dim] for positions [T] or [B, T]."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(batch, -1)
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        return cos_sin(positions, self._inv_freq, dtype)

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_features: torch.Tensor,
        noise_positions: torch.Tensor,
        context_positions: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        kv_cache: DraftKVCache | None = None,
    ) -> torch.Tensor:
        batch = noise_embeds.shape[0]
        dtype = noise_embeds.dtype
        ctx = self.hidden_norm(self.fc(context_features.to(dtype)))
        noise_rope = self.rope(noise_positions, batch, dtype)
        ctx_rope = self.rope(context_positions, batch, dtype)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(dtype)
        windows = {self.config.layer_window(i) for i in range(len(self.layers))} - {None}
        key_positions = None
        if windows:
            cached = kv_cache.positions[: kv_cache.length] if kv_cache is not None else noise_positions[..., :0]
            key_positions = torch.cat(
                [_batched(cached, batch), _batched(context_positions, batch), _batched(noise_positions, batch)], dim=-1
            )
        if kv_cache is not None:
            end = kv_cache.length + context_features.shape[1]
            kv_cache.positions[kv_cache.length : end] = _batched(context_positions, 1)[0]
        hidden = noise_embeds
        for index, layer in enumerate(self.layers):
            mask = attention_mask
            window = self.config.layer_window(index)
            if window is not None:
                mask = _sliding_mask(_batched(noise_positions, batch), key_positions, window, attention_mask)
            attn = layer.self_attn(layer.input_layernorm(hidden), ctx, noise_rope, ctx_rope, mask, kv_cache, index)
            hidden = hidden + attn
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if kv_cache is not None:
            kv_cache.length += context_features.shape[1]
        return self.norm(hidden)

    def new_cache(self, max_len: int, batch: int = 1) -> DraftKVCache:
        param = self.fc.weight
        return DraftKVCache(self.config, max_len, batch, device=param.device, dtype=param.dtype)


def _batched(positions: torch.Tensor, batch: int) -> torch.Tensor:
    return positions.unsqueeze(0).expand(batch, -1) if positions.dim() == 1 else positions


def _sliding_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int, base: torch.Tensor | None
) -> torch.Tensor:
    """[B, 1, Q, K] bool: a query sees keys less than ``window`` positions behind it (and, with a
    ``base`` mask, only what that allows). The noise block stays bidirectional within itself."""
    near = key_positions[:, None, :] > query_positions[:, :, None] - window
    mask = near[:, None]
    if base is None:
        return mask
    if base.dtype == torch.bool:
        return mask & base
    return base.masked_fill(~mask, float("-inf"))


def _weight_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(directory.glob("*.safetensors"))


def load_draft(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDraft:
    """Load a z-lab-format draft directory (config.json + safetensors). Errors are one-line UsageErrors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / "config.json"
    if not directory.is_dir():
        raise UsageError(f"draft directory not found: {directory}")
    if not config_path.is_file():
        raise UsageError(f"draft directory has no config.json: {directory}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"draft config.json unreadable: {exc}") from exc
    config = DraftConfig.from_dict(raw)
    files = _weight_files(directory)
    if not files:
        raise UsageError(f"draft directory has no *.safetensors weights: {directory}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in load_file(str(path)).items():
            state[key.removeprefix("model.")] = tensor
    model = DFlashDraft(config)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UsageError(f"draft weights do not match its config.json ({detail}): {directory}")
    for key, tensor in state.items():
        want = model.state_dict()[key].shape
        if tensor.shape != want:
            raise UsageError(f"draft weight {key} has shape {tuple(tensor.shape)}, config says {tuple(want)}")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def save_draft(model: DFlashDraft, config: DraftConfig | None, directory: str | Path) -> Path:
    """Write z-lab format: config.json + model.safetensors (contiguous tensors, z-lab key names)."""
    from safetensors.torch import save_file

    config = config or model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
