"""Load an engine: target (HF directory or GGUF), tokenizer + chat template, optional DFlash draft.

Public API (others build on it)::

    from ddtree_diag.engine import load_engine
    engine = load_engine(target, draft=None, gguf_file=None, device=None, dtype=None, decode_path=None)
    engine.info() -> dict                 # layers, hidden, draft ids/mask/block, dtype, device, memory
    engine.tokenizer                      # HF tokenizer of the target
    engine.render_prompt(messages, enable_thinking) -> list[int]
    gen = engine.generate(messages=..., enable_thinking=None, tree_budget=None, temperature=0.0,
                          max_tokens=256, seed=None, stop=None, top_logprobs=0, on_token=None,
                          mode="auto", prompt_ids=None) -> Generation
    engine.greedy_reference(prompt_ids, max_tokens, stop_ids=None) -> list[int]

``tree_budget=None`` = 64 with a draft, 0 (AR) without. ``device=None`` = cuda when available
else cpu; ``dtype=None`` = bfloat16 on cuda, float32 on cpu; ``decode_path=None`` = the fast
rounds of ``engine/fast`` (static shapes, CUDA graphs) on cuda, the eager reference loop on cpu
(``engine.use_path`` may switch between requests). Nothing is fetched from the network:
every path must exist locally. Mismatched inputs raise ``UsageError`` with one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddtree_diag.engine.models import model_id
from ddtree_diag.errors import UsageError

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def resolve_device(device: str | None) -> Any:
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise UsageError(f"unknown device {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} requested but CUDA is not available on this machine")
    if resolved.type not in ("cuda", "cpu"):
        raise UsageError(f"device {device!r} is not supported (cuda or cpu)")
    return resolved


def resolve_dtype(dtype: str | None, device: Any) -> Any:
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if name is None:
        raise UsageError(f"unknown dtype {dtype!r} (choose from bf16, fp16, fp32)")
    return getattr(torch, name)


def _target_location(target: str | Path, gguf_file: str | None) -> tuple[Path, str | None]:
    """(directory, gguf file name or None), accepting a .gguf path as target or as gguf_file."""
    target = Path(target).expanduser()
    if gguf_file is None and target.suffix == ".gguf":
        gguf_file = str(target)
        target = target.parent
    if gguf_file is not None:
        gguf_path = Path(gguf_file).expanduser()
        if not gguf_path.is_absolute() and not gguf_path.is_file():
            gguf_path = target / gguf_path
        if not gguf_path.is_file():
            raise UsageError(f"GGUF file not found: {gguf_file}")
        try:
            import gguf  # noqa: F401
        except ImportError as exc:
            raise UsageError("loading a GGUF target needs the 'gguf' package (pip install gguf)") from exc
        return gguf_path.parent, gguf_path.name
    if not target.is_dir():
        raise UsageError(f"target model directory not found: {target}")
    if not (target / "config.json").is_file():
        raise UsageError(f"target directory has no config.json (pass --gguf for a GGUF file): {target}")
    return target, None


def _stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(i) for i in eos)
    from ddtree_diag.engine.arch import stop_tokens

    ids.update(int(i) for i in stop_tokens(tokenizer.get_vocab()))
    return sorted(ids)


def check_draft_fits(draft_config: Any, target_config: Any) -> None:
    """One-line errors for a draft that cannot work with this target. (A tokenizer larger than the
    target's vocabulary is no error: Gemma 3's counts an image token past it, which text never
    produces; a prompt with an id outside the vocabulary is refused in ``Engine.generate``.)"""
    hidden = target_config.hidden_size
    layers = target_config.num_hidden_layers
    if draft_config.hidden_size != hidden:
        raise UsageError(f"draft hidden size {draft_config.hidden_size} does not match the target's {hidden}")
    bad = [i for i in draft_config.target_layer_ids if not 0 <= i < layers]
    if bad:
        raise UsageError(
            f"draft target_layer_ids {bad} do not exist in the target ({layers} layers: 0..{layers - 1})"
        )
    vocab = target_config.vocab_size
    if draft_config.vocab_size is not None and draft_config.vocab_size != vocab:
        raise UsageError(
            f"draft vocabulary size {draft_config.vocab_size} does not match the target's {vocab}"
        )
    if not 0 <= draft_config.mask_token_id < vocab:
        raise UsageError(
            f"draft mask_token_id {draft_config.mask_token_id} is outside the target vocabulary ({vocab})"
        )
    if draft_config.block_size < 2:
        raise UsageError(f"draft block_size {draft_config.block_size} must be at least 2")


def load_engine(
    target: str | Path,
    draft: str | Path | None = None,
    gguf_file: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    decode_path: str | None = None,
    model_name: str | None = None,
):
    """Load target (+ draft) into an ``Engine``; see the module docstring."""
    # Paths first: a mistyped directory is one line at once, not after importing transformers.
    directory, gguf_name = _target_location(target, gguf_file)
    if draft is not None and not Path(draft).expanduser().is_dir():
        raise UsageError(f"draft directory not found: {draft}")
    from ddtree_diag.output.waiting import waiting

    name = model_name or model_id(target, gguf_file)
    what = f"loading target model {name}" + (f" and draft {Path(draft).name}" if draft is not None else "")
    with waiting(what):  # imports torch and transformers, then reads the weights: seconds to minutes
        return _load(directory, gguf_name, target, draft, gguf_file, device, dtype, decode_path, name)


def _load(directory: Path, gguf_name: str | None, target: str | Path, draft: str | Path | None,
          gguf_file: str | None, device: str | None, dtype: str | None, decode_path: str | None,
          name: str) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ddtree_diag.engine.draft import load_draft

    hf_logging.disable_progress_bar()  # our own output stays readable; errors still surface
    hf_logging.set_verbosity_error()
    from ddtree_diag.engine.arch import check_supported, quantization_method, text_config
    from ddtree_diag.engine.fast.graphs import blas_setting
    from ddtree_diag.engine.generate import Engine
    from ddtree_diag.engine.target import TargetModel

    blas_setting()  # a bad DDTREE_DIAG_BLAS is one line before the weights load, not an error per request
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    kwargs = hf_kwargs(gguf_name)
    config = target_config(directory, gguf_name)
    check_supported(config)
    chosen = decode_path or os.environ.get("DDTREE_DIAG_DECODE")
    if chosen in (None, "fast"):  # the path that compiles its kernels ahead; their workers start now
        from ddtree_diag.engine.fast.ahead import start_workers

        start_workers(torch_device, torch_dtype)
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch_dtype, output_loading_info=True, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except Exception as exc:
        raise UsageError(f"cannot load the target from {directory}: {_first_line(exc)}") from exc
    missing = list(loading.get("missing_keys") or [])
    if missing:  # HF fills them with random values and says so only in a warning
        raise UsageError(f"the target checkpoint lacks {len(missing)} weight(s) the model needs, "
                         f"e.g. {sorted(missing)[0]!r}: an incomplete or mismatched checkpoint")
    # By device only: from_pretrained applied the dtype, and a cast here would also round what HF
    # keeps in fp32 on purpose (every rotary inv_freq: in bf16 the angles of position 1,000 come out
    # up to ~1 rad off; GLM-MoE's router bias; a keep-in-fp32 list's norms) or turn FP8 weights
    # into bf16 numbers their scales no longer describe.
    model = model.to(device=torch_device).eval()
    method = quantization_method(config)
    dequantized = method is not None and not quantization_method(model.config)  # HF drops the config then
    if dequantized:  # its dequantized weights in one dtype, the checkpoint's other tensors in another
        unify_dtype(model, torch_dtype)
    draft_model = None
    if draft is not None:
        draft_model = load_draft(Path(draft).expanduser(), device=torch_device, dtype=torch_dtype)
        check_draft_fits(draft_model.config, text_config(model.config))  # a VLM: its text model's
    info = {
        "model": name,
        "target_path": str(directory if gguf_name is None else directory / gguf_name),
        "draft_path": str(draft) if draft is not None else None,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }
    if method:  # HF dequantizes where it has no kernels for the method (a CPU always)
        dtype_name = str(torch_dtype).removeprefix("torch.")
        info["quantization"] = f"{method}, dequantized to {dtype_name}" if dequantized else method
    engine = Engine(
        TargetModel(model, max_len=256),
        tokenizer,
        draft=draft_model,
        stop_token_ids=_stop_token_ids(model, tokenizer),
        info=info,
    )
    # An explicit path wins; else DDTREE_DIAG_DECODE=eager|fast|fast-nograph|fast-compile; else
    # the device's default (fast on CUDA, eager on CPU).
    if chosen:
        try:
            engine.use_path(chosen)
        except ValueError as exc:
            where = "decode path" if decode_path else "DDTREE_DIAG_DECODE"
            raise UsageError(f"{where}: {exc}") from exc
    return engine


def unify_dtype(model: Any, dtype: Any) -> None:
    """Every floating parameter in ``dtype``, but those the model keeps in fp32 on purpose (its
    keep-in-fp32 lists); buffers as they are (the rotary frequencies stay fp32). For a checkpoint
    HF dequantized, whose other tensors it loaded in the checkpoint's own dtype."""
    import torch

    keep = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    for name, parameter in model.named_parameters():
        kept = parameter.dtype == torch.float32 and any(part in name.split(".") for part in keep)
        if parameter.is_floating_point() and parameter.dtype != dtype and not kept:
            parameter.data = parameter.data.to(dtype)


def hf_kwargs(gguf_name: str | None) -> dict[str, Any]:
    """What every transformers ``from_pretrained`` of the target takes: local files only, and the
    GGUF file's name when the target is one."""
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_name is not None:
        kwargs["gguf_file"] = gguf_name
    return kwargs


def target_config(directory: Path, gguf_name: str | None) -> Any:
    """The target's transformers config (``_target_location``'s result); UsageError, one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, **hf_kwargs(gguf_name))
    except Exception as exc:  # transformers raises many types for unknown/broken files
        what = f"GGUF file {gguf_name}" if gguf_name else f"config in {directory}"
        raise UsageError(f"transformers cannot load the {what}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
