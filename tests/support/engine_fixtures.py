"""Tiny random-weight targets (Qwen3 and the other dense families, hybrids) + DFlash draft, written
to disk in their real formats.

Used by the engine tests: the engine then loads them through its real loader (HF directory with
tokenizer and chat template; z-lab draft directory).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

from tests.support.processes import launch_serve, stop_serve

# Shared by the engine test modules.
BUDGETS = (0, 1, 2, 4, 16, 64)
PROMPTS = ([257, 84, 82, 68], [5, 9, 200, 31, 31, 7, 118, 64, 3], list(range(40, 57)))
MAX_TOKENS = 24

VOCAB = 300
HIDDEN = 64
TARGET_LAYERS = 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


# gpt-oss's harmony format: its special tokens and a template of its shape (a generation starts
# after "<|start|>assistant"; the model writes "<|channel|>analysis<|message|>...<|end|>" first).
HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def make_tokenizer(directory: Path, harmony: bool = False):
    """The tiny byte-level tokenizer with a ChatML template (``harmony``: gpt-oss's tokens and
    template shape instead, ending turns with <|return|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS + (HARMONY_SPECIALS if harmony else [])
    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(sorted(byte_tokens))}
    for tok in specials:
        vocab[tok] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|return|>" if harmony else "<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials,
    )
    tokenizer.chat_template = HARMONY_TEMPLATE if harmony else CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


# Dense families the engine supports: HF config and model class names.
DENSE_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "ministral": ("MinistralConfig", "MinistralForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    # mixture-of-experts kin (the MLP runs as the HF module) and gpt-oss (attention sinks)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    # multi-head latent attention (with an MoE)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
}
# Latent attention's shapes: a compressed latent of 16, per head 16 + 8 rotary dims of q/k and 12
# of v (narrower than k, as in DeepSeek-V3: 128 + 64 and 128); the rotary module's head_dim is
# the rotary dims.
SMALL_LATENT = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=12,
                    num_key_value_heads=4)
# A small MoE for the families that have one (each family names its expert count its own way)
SMALL_MOE = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=32, **SMALL_LATENT),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=None, **SMALL_LATENT),
    "glm4_moe_lite": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                          first_k_dense_replace=1, q_lora_rank=None, **SMALL_LATENT),
}


def randomize(model, keep: tuple[str, ...] = ()) -> None:
    """Random weights large enough that every path matters: norms (and parameters ending in
    ``keep``) stay at their initial values; attention sinks get a wide spread, so that a forward
    without them differs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(keep):
                continue
            p.normal_(0, 2.0 if "sinks" in name else 0.25 if p.dim() > 1 else 0.05)


def make_target(directory: Path, seed: int = 0, model_type: str = "qwen3", **config) -> Path:
    """Random dense target (Qwen3 by default; ``model_type`` any of ``DENSE_FAMILIES``) with weights
    large enough that argmax gaps are not tiny; ``config``: overrides of the HF config's fields."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    fields = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=False,
    )
    if model_type == "llama":
        fields["attention_bias"] = True
    fields.update(SMALL_MOE.get(model_type, {}))
    fields.update(config)
    config_name, model_name = DENSE_FAMILIES[model_type]
    torch.manual_seed(seed)
    hf_config = getattr(transformers, config_name)(**fields)
    if (hf_config.pad_token_id or 0) >= VOCAB:  # a family's default pad id past the tiny vocabulary
        hf_config.pad_token_id = None
    model = getattr(transformers, model_name)(hf_config)
    randomize(model)
    model.save_pretrained(directory)
    return directory


def rewrite_checkpoint(directory: Path, tensors=None, **config) -> None:
    """Rewrite a saved checkpoint in place: ``tensors(state) -> state`` on its weights, ``config``
    fields set in its config.json."""
    import safetensors.torch

    weights = directory / "model.safetensors"
    if tensors is not None:
        safetensors.torch.save_file(tensors(safetensors.torch.load_file(str(weights))), str(weights),
                                    metadata={"format": "pt"})
    if config:
        path = directory / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config, indent=1))


def fp8_quantize(state: dict, block: int = 16) -> dict:
    """The projections' weights as HF's block-wise FP8 checkpoints store them: e4m3 codes in
    [block x block] tiles, each with its scale (``weight_scale_inv``: the tile's max / 448); the
    other tensors in bf16, as such checkpoints ship them."""
    out = {name: weight.to(torch.bfloat16) if weight.is_floating_point() else weight for name, weight in state.items()}
    for name, weight in state.items():
        if name.endswith("proj.weight") and weight.dim() == 2:
            rows, cols = weight.shape
            tiles = weight.reshape(rows // block, block, cols // block, block)
            scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448.0
            out[name] = (tiles / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale.float()
    return out


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def make_gemma3_vlm_target(directory: Path, seed: int = 0, sliding_window: int = 6) -> Path:
    """Random Gemma 3 vision-language checkpoint (a tiny vision tower around a 4-layer text model
    whose layers 0, 1 and 3 slide), as Gemma 3 ships from 4B up."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    make_tokenizer(directory)
    text = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=sliding_window, pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 2,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 4,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    randomize(model)
    model.save_pretrained(directory)
    return directory


# Hybrid (Gated DeltaNet) layer patterns: L = linear attention, A = full attention.
HYBRID_PATTERNS = {"linear-first": "LLAL", "full-first": "ALLA", "linear-last": "LALL"}


def make_hybrid_target(
    directory: Path, kind: str = "qwen3_5", pattern: str = "LLAL", seed: int = 0, **config
) -> Path:
    """Random hybrid target (``qwen3_5``: Qwen3.5/3.6 text model; ``qwen3_5_moe``: its MoE variant;
    ``qwen3_next``: Qwen3-Next; the MoE kinds with a small MoE) with the given layer pattern, saved
    with the tiny tokenizer and chat template; ``config``: overrides of the HF config's fields."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    layer_types = ["linear_attention" if c == "L" else "full_attention" for c in pattern]
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=len(pattern), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, layer_types=layer_types,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=False,
    )
    common.update(config)
    torch.manual_seed(seed)
    small_moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if kind == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**common, intermediate_size=96, **small_moe))
    elif kind == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, **small_moe))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, intermediate_size=128))
    randomize(model, keep=("A_log", "dt_bias"))  # the decay gates at their (stable) initial values
    model.save_pretrained(directory)
    return directory


def make_draft(
    directory: Path, block_size: int = 4, layer_ids=(0, 2), layers: int = 2, seed: int = 1
) -> Path:
    from ddtree_diag.engine.draft import DFlashDraft, DraftConfig, save_draft

    mask_id = VOCAB - 1  # unused by the tokenizer, like z-lab's dedicated mask token
    config = DraftConfig(
        hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, target_layer_ids=list(layer_ids), mask_token_id=mask_id,
        block_size=block_size, num_target_layers=TARGET_LAYERS, head_dim=16, vocab_size=VOCAB,
    )
    torch.manual_seed(seed)
    model = DFlashDraft(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    save_draft(model, config, directory)
    return directory


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def start_server(target: Path, draft: Path | None, *extra: str) -> tuple[subprocess.Popen, str]:
    """``ddtree-diag serve`` on a tiny model as a real subprocess; (process, url) once healthy."""
    args = ["--target", str(target), "--device", "cpu", "--dtype", "fp32", *extra]
    if draft is not None:
        args += ["--draft", str(draft)]
    # One intra-op thread: tiny matmuls on a shared 2-core box only thrash with more (10x slower).
    return launch_serve(*args, env={"OMP_NUM_THREADS": "1"})


@contextlib.contextmanager
def serving(target: Path, draft: Path | None, *extra: str) -> Iterator[str]:
    """``start_server`` for the length of a ``with`` block: yields the URL, stops the server."""
    process, url = start_server(target, draft, *extra)
    try:
        yield url
    finally:
        stop_serve(process)


def tiny_models(root: Path) -> tuple[Path, Path]:
    """The server tests' pair: a tiny random Qwen3 target and a block-4 draft for it."""
    return make_target(root / "target"), make_draft(root / "draft", block_size=4)


# Tensor methods that read a value into Python (a host sync on a GPU).
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")


def refusing_host_reads(fn):
    """``fn`` wrapped so that, while it runs, reading any tensor's value into Python raises."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"host read Tensor.{name} inside a round stage")

        return method

    def run():
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        try:
            fn()
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)

    return run

