"""What the engine knows about target architectures, in one place.

The base is the Llama / Qwen2 / Qwen3 / Mistral / Ministral decoder: pre-norm layers, rotary,
GQA, optional q/k norms and q/k/v biases, sliding-window layers. The other families are that with
twists, each an ``Arch`` field (or a rule below) that the target forward and the fast path read:

- mixture of experts (Qwen3-MoE, e.g. Qwen3-Coder-30B-A3B; Qwen2-MoE; Mixtral; GLM-4.5/4.7 MoE;
  gpt-oss; DeepSeek): the MLP runs as HF's own module;
- gpt-oss: attention sinks (a learned logit per head that takes a share of every softmax:
  ``attention_sinks``), rotary on the two halves of a head (``rope_on_halves``);
- SmolLM3's NoPE layers and EXAONE 4's full-attention layers (where it slides) skip rotary;
  Gemma 3 and OLMo 3 keep a rotary table per layer type (``rope_tables``);
- Gemma 3: sandwich norms (each half's output normed before its residual add: ``sandwich_norms``)
  and an embedding scale (its embedding module's own);
- OLMo 2 / 3 and EXAONE 4: norms on each half's output only, none on its input (``post_norms``);
  OLMo norms q and k over all their heads at once (``qk_norm_whole``);
- Phi-3 / Phi-4: one q|k|v linear (``fused_qkv``; the fused gate|up MLP runs as HF's module);
- Granite: multipliers on the embeddings, on each half's output (the layer's
  ``residual_multiplier``) and a divisor on the logits (``embedding_multiplier``,
  ``logits_scaling``; its attention multiplier is the module's ``scaling``);
- DeepSeek-V3 / V2 and GLM-4.7-Flash (``glm4_moe_lite``): multi-head latent attention
  (``latent_attention``: K and V expanded per head from a compressed latent, rotary on a few dims
  of each head, V narrower than K; V2's rotary turns each pair as a complex number in fp32); the
  cache keeps K and V expanded;
- the Gated DeltaNet hybrids, Qwen3.5 / Qwen3.6 (``qwen3_5``, also their MoE variant) and
  Qwen3-Next (``qwen3_next``): linear-attention layers between full-attention layers with a gated
  query (``q_proj`` gives query|gate per head, the output is scaled by sigmoid(gate)) and partial
  rotary (HF's rotary module returns cos/sin for the rotated dims only; ``rope.apply_rope`` turns
  those and keeps the rest).

Which layers slide, and by how much, is each family's own rule (``layer_windows``). Settings our
forward does not apply (Gemma 2's softcapping, a bidirectional variant) and quantizations the
engine has not been checked with are refused, like unknown model types.

``detect`` reads a loaded HF model once into an ``Arch``; ``check_supported`` refuses the rest
from the config alone (before any weight is read). Norm styles are per module class
(``norm_style``): the fused kernels reproduce a norm only when they know where it applies its
weight. Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from ddtree_diag.errors import UsageError

DENSE_MODEL_TYPES = {
    "llama", "qwen2", "qwen3", "mistral", "ministral", "smollm3", "seed_oss", "gemma3_text",
    "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v3", "glm4_moe_lite", "olmo2", "olmo3",
    "phi3", "exaone4", "deepseek_v2", "granite",
}
# Model types whose rotary module returns cos/sin for half a head's dims, applied to its two halves
# (x1 * cos - x2 * sin, x2 * cos + x1 * sin): the usual rotation with cos/sin repeated once.
ROPE_ON_HALVES_TYPES = {"gpt_oss"}
# Gated-DeltaNet hybrids the engine verifies (trees included) with per-node recurrent state.
HYBRID_MODEL_TYPES = {"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES | HYBRID_MODEL_TYPES

# Config settings of supported types that our forward does not reproduce: refused when set (Gemma
# 2 style tanh softcapping of attention scores or logits; Gemma 3's bidirectional embedding variant).
UNSUPPORTED_SETTINGS = ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention")

# Where MoE configs keep their expert count (Qwen MoE, Mixtral / gpt-oss, GLM / DeepSeek)
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")

# Stop tokens besides EOS: the end-of-turn tokens of the chat templates we know, where the
# tokenizer's vocabulary has them (``stop_tokens``). In order of preference for the token that
# ends an ordinary answer (the likelihood check scores it): gpt-oss's <|return|> and GLM's
# <|user|> (a GLM answer ends by opening the next turn) before their <|endoftext|>; tool calls'
# <|call|> / <|observation|> last.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|return|>", "<|end|>", "<|user|>", "<|endoftext|>",
    "<|call|>", "<|observation|>",
)
# gpt-oss's harmony format: messages open a channel and its message, a turn ends with <|return|>
# (or <|call|>, a tool call); its <|end|> closes one message of the turn (the analysis channel's,
# before the final answer), so it is no stop there.
HARMONY_TOKENS = ("<|channel|>", "<|return|>")


def speaks_harmony(vocab: dict[str, int]) -> bool:
    """Whether a tokenizer's ``vocab`` (token -> id) is gpt-oss's harmony format's."""
    return all(token in vocab for token in HARMONY_TOKENS)


def stop_tokens(vocab: dict[str, int]) -> list[int]:
    """The ids of ``END_OF_TURN_TOKENS`` in a tokenizer's ``vocab`` (token -> id)."""
    harmony = speaks_harmony(vocab)
    return [vocab[token] for token in END_OF_TURN_TOKENS if token in vocab and not (harmony and token == "<|end|>")]

# RMSNorm classes by where they apply the weight. "cast": Llama / Qwen2 / Qwen3 / the DFlash draft
# (normalise in fp32, cast, then weight * x in the dtype). "offset": Qwen3.5 / Qwen3-Next
# (x * (1 + weight) in fp32, then cast). "gated": the Gated DeltaNet output norm (the "cast" style,
# then times silu(gate) in fp32, then cast). Any other norm runs as its own module.
NORM_STYLES = {
    "Qwen3RMSNorm": "cast", "Qwen2RMSNorm": "cast", "LlamaRMSNorm": "cast", "MistralRMSNorm": "cast",
    "MinistralRMSNorm": "cast", "SmolLM3RMSNorm": "cast", "SeedOssRMSNorm": "cast", "Gemma3RMSNorm": "offset",
    "Phi3RMSNorm": "cast", "Exaone4RMSNorm": "cast", "GraniteRMSNorm": "cast",
    "Qwen3MoeRMSNorm": "cast", "Qwen2MoeRMSNorm": "cast", "MixtralRMSNorm": "cast", "Glm4MoeRMSNorm": "cast",
    "Qwen3_5RMSNorm": "offset", "Qwen3_5MoeRMSNorm": "offset", "Qwen3NextRMSNorm": "offset",
    "Qwen3_5RMSNormGated": "gated", "Qwen3_5MoeRMSNormGated": "gated", "Qwen3NextRMSNormGated": "gated",
}


@dataclass(frozen=True)
class Arch:
    """One loaded target's architecture, detected once from its config and modules."""

    model_type: str
    linear_layers: tuple[int, ...]  # Gated DeltaNet layers (recurrent state); the rest attend (KV cache)
    num_layers: int
    gated_query: bool  # q_proj gives [query | gate] per head; the output is scaled by sigmoid(gate)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3, Qwen3.5)
    multimodal_rope: bool  # the rotary module takes one position row per rope section (Qwen3.5)
    rope_on_halves: bool = False  # cos/sin cover half a head: repeat them once (gpt-oss, ``ROPE_ON_HALVES_TYPES``)
    attention_sinks: bool = False  # each attention module has ``sinks`` [heads]: an extra logit per head (gpt-oss)
    # Per layer: the sliding attention window (a key is seen while query position - key position
    # < window), or None (full attention, or a Gated DeltaNet layer)
    windows: tuple[int | None, ...] = ()
    # Per layer: which of the rotary module's tables its attention uses: "" (its only one), a layer
    # type (Gemma 3: one table per type, each with its own base), or None (no rotary: SmolLM3's NoPE
    # layers)
    rope_tables: tuple[str | None, ...] = ()
    # Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash): ``target.latent_qkv``
    latent_attention: bool = False
    # OLMo's post norms: no input norm; post_attention_layernorm on the attention's output and
    # post_feedforward_layernorm on the MLP's, each before its residual add
    post_norms: bool = False
    # q and k normed over all their heads at once (OLMo: q_norm over heads * head_dim), not per head
    qk_norm_whole: bool = False
    # q|k|v from one linear, ``qkv_proj`` (Phi-3), split by heads
    fused_qkv: bool = False
    # Granite: the input embeddings times this, each half's output times ``residual_multiplier``
    # before its add (the layer's own), the logits divided by ``logits_scaling``
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Gemma's sandwich norms: post_attention_layernorm on the attention's output, then
    # pre_feedforward_layernorm before the MLP and post_feedforward_layernorm on its output
    sandwich_norms: bool = False

    @property
    def hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)


def text_config(config: Any) -> Any:
    """The language model's config (a vision-language checkpoint nests it as ``text_config``)."""
    return getattr(config, "text_config", None) or config


def is_hybrid(config: Any) -> bool:
    cfg = text_config(config)
    return cfg.model_type in HYBRID_MODEL_TYPES or "linear_attention" in (getattr(cfg, "layer_types", None) or [])


# Checkpoint quantizations the engine loads (HF's FP8 block-wise linears and gpt-oss's MXFP4
# experts, run as HF's modules or dequantized by HF where it has no kernels; a GGUF file, which HF
# always dequantizes); others are refused.
SUPPORTED_QUANTIZATION = ("fp8", "mxfp4", "gguf")


def quantization_method(config: Any) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (None when not quantized)."""
    for cfg in (config, text_config(config)):
        quantization = getattr(cfg, "quantization_config", None)
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
                quantization, "quant_method", None)
            return str(getattr(method, "value", method))
    return None


def check_supported(config: Any) -> None:
    """Refuse targets our forward cannot run exactly, with one line saying why."""
    cfg = text_config(config)
    model_type = getattr(cfg, "model_type", "?")
    method = quantization_method(config)
    if method is not None and method not in SUPPORTED_QUANTIZATION:
        raise UsageError(f"target is quantized with {method!r}, which the engine does not load "
                         f"(supported: {', '.join(SUPPORTED_QUANTIZATION)}: pass a GGUF file with --gguf)")
    if model_type in HYBRID_MODEL_TYPES or (model_type in DENSE_MODEL_TYPES and not is_hybrid(cfg)):
        for field in UNSUPPORTED_SETTINGS:
            if getattr(cfg, field, None):
                raise UsageError(
                    f"target {model_type!r} sets {field}={getattr(cfg, field)!r}, which the engine does not apply"
                )
        return
    kind = "hybrid (linear-attention) " if is_hybrid(cfg) else ""
    raise UsageError(
        f"target model_type {model_type!r} is a {kind}model the engine does not support "
        f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
    )


def detect(config: Any, layers: list[Any], rotary_emb: Any) -> Arch:
    """The ``Arch`` of a loaded HF text model: ``config`` its (text) config, ``layers`` its decoder
    layers, ``rotary_emb`` its rotary module."""
    linear = tuple(i for i, layer in enumerate(layers) if hasattr(layer, "linear_attn"))
    attention = [i for i in range(len(layers)) if i not in linear]
    if not attention:
        raise UsageError("the target has no full-attention layer: nothing for the engine's KV cache")
    attn = layers[attention[0]].self_attn
    return Arch(
        model_type=config.model_type,
        linear_layers=linear,
        num_layers=len(layers),
        gated_query=getattr(attn, "q_proj", None) is not None and not hasattr(attn, "kv_a_proj_with_mqa")
        and attn.q_proj.out_features == 2 * config.num_attention_heads * attn.head_dim,
        qk_norm=hasattr(attn, "q_norm"),
        multimodal_rope=hasattr(rotary_emb, "mrope_section"),
        rope_on_halves=config.model_type in ROPE_ON_HALVES_TYPES,
        attention_sinks=getattr(attn, "sinks", None) is not None,
        windows=layer_windows(config, layers, linear),
        rope_tables=rope_tables(config, layers, linear, rotary_emb),
        sandwich_norms=hasattr(layers[attention[0]], "pre_feedforward_layernorm"),
        latent_attention=hasattr(attn, "kv_a_proj_with_mqa"),
        post_norms=not hasattr(layers[attention[0]], "input_layernorm"),
        qk_norm_whole=hasattr(attn, "q_norm") and attn.q_norm.weight.shape[-1] != attn.head_dim,
        fused_qkv=hasattr(attn, "qkv_proj"),
        embedding_multiplier=float(getattr(config, "embedding_multiplier", 1.0) or 1.0),
        residual_multiplier=float(getattr(layers[attention[0]], "residual_multiplier", 1.0)),
        logits_scaling=float(getattr(config, "logits_scaling", 1.0) or 1.0),
    )


def rope_tables(config: Any, layers: list[Any], linear: tuple[int, ...], rotary_emb: Any) -> tuple[str | None, ...]:
    """Each layer's rotary table (``Arch.rope_tables``): a rotary module whose forward takes a
    ``layer_type`` keeps one per type (Gemma 3); a SmolLM3 attention with ``use_rope`` False has
    none, nor has an EXAONE 4 full-attention layer of a model that slides."""
    typed = "layer_type" in inspect.signature(rotary_emb.forward).parameters
    layer_types = getattr(config, "layer_types", None) or []
    tables: list[str | None] = []
    for index, layer in enumerate(layers):
        attn = None if index in linear else layer.self_attn
        # SmolLM3's NoPE layers; EXAONE 4's full-attention layers where it also slides ("global NoPE")
        nope = attn is not None and (not getattr(attn, "use_rope", True) or (
            getattr(attn, "is_sliding", None) is False and getattr(attn, "sliding_window", None) is not None))
        if nope:
            tables.append(None)
        else:
            tables.append(layer_types[index] if typed and index not in linear else "")
    return tuple(tables)


def layer_windows(config: Any, layers: list[Any], linear: tuple[int, ...] = ()) -> tuple[int | None, ...]:
    """Each layer's sliding attention window as HF's own layers apply it (None: full attention or
    a linear layer). Qwen2/Qwen3 and Ministral attention modules carry their own (``layer_types``:
    Qwen's slide from ``max_window_layers`` on, and none unless ``use_sliding_window``; the config's
    ``layer_types`` where a module does not say); Mistral and Mixtral slide every layer by the
    config's ``sliding_window`` (HF ignores their ``layer_types``), Phi-3 too; Llama, GLM-MoE and the hybrids
    never slide (gpt-oss and Qwen3-MoE modules carry their own); SmolLM3 slides its
    ``layer_types`` layers (its module's window is what flash attention reads; HF's masks slide
    even where ``use_sliding_window`` is off), and so does EXAONE 4 (its modules all carry the
    window)."""
    model_type = getattr(config, "model_type", "")
    config_window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        config_window = None
    layer_types = getattr(config, "layer_types", None) or []
    windows: list[int | None] = []
    for index, layer in enumerate(layers):
        attn = None if index in linear else layer.self_attn
        if attn is None:
            window = None
        elif model_type in ("smollm3", "exaone4"):  # HF's masks follow layer_types (the module's window is flash's)
            typed = index < len(layer_types) and layer_types[index] == "sliding_attention"
            window = getattr(config, "sliding_window", None) if typed else None
        elif hasattr(attn, "sliding_window"):
            window = attn.sliding_window
        elif model_type in ("mistral", "mixtral", "phi3"):
            window = config_window
        elif model_type in ("qwen2", "qwen3", "qwen2_moe", "ministral") and index < len(layer_types):
            window = config_window if layer_types[index] == "sliding_attention" else None
        else:
            window = None
        windows.append(int(window) if window else None)
    return tuple(windows)


def norm_style(module: Any) -> str | None:
    """The style (see ``NORM_STYLES``) of an RMSNorm module: "cast", "offset" or "gated"; else None."""
    cls = type(module)
    if cls.__module__.startswith("transformers."):
        return NORM_STYLES.get(cls.__name__)
    from ddtree_diag.engine.draft import RMSNorm  # the draft's own norm (imports torch: not at module load)

    return "cast" if cls is RMSNorm else None
