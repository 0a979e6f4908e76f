"""The official DDTree code (github.com/liranringel/ddtree) as a baseline in the speed bench.

Its files are never part of this project: pass the directory that holds its ``ddtree.py``,
``dflash.py`` and ``model/`` (``python -m bench.engine_speed --official-dir DIR``). Loading it
takes three bench-time adjustments, all local to its own modules (nothing of transformers is
patched globally):

- ``datasets`` and ``loguru`` are imported at import time but only used by its dataset loader and
  logging: stand-ins are put in ``sys.modules`` when the real packages are absent;
- ``DynamicCache.crop(n)`` with a positive absolute length raises from transformers 5.23 on; its
  modules get a subclass that turns an absolute length into the equivalent negative crop;
- its timer synchronises CUDA: on a CPU-only smoke run it becomes a plain clock;
- the target runs on SDPA (its verify pass sends a custom 4-D mask) and its vendored draft class
  loads our z-lab-format draft directory as published drafts are loaded.

``official_round_ms`` times one ``ddtree_generate`` call the way the project's bench times its own
decode: wall clock after the prefill, divided by the decode rounds the call reports.
"""

from __future__ import annotations

import importlib
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch


def _stand_ins() -> None:
    for name in ("datasets", "loguru"):
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            if name == "loguru":
                module.logger = types.SimpleNamespace(info=print, warning=print, debug=lambda *a, **k: None)
            else:
                for attr in ("load_dataset", "Features", "Sequence", "Value"):
                    setattr(module, attr, None)
            sys.modules[name] = module


def load_official(directory: str | Path) -> types.SimpleNamespace:
    """Import the official modules from ``directory`` (and only from there)."""
    directory = Path(directory).resolve()
    if not (directory / "ddtree.py").is_file():
        raise SystemExit(f"--official-dir {directory}: no ddtree.py there")
    _stand_ins()
    sys.path.insert(0, str(directory))
    try:
        for name in ("ddtree", "dflash", "model", "model.dflash", "model.utils"):
            sys.modules.pop(name, None)
        ddtree = importlib.import_module("ddtree")
        dflash = importlib.import_module("dflash")
        model = importlib.import_module("model")
    finally:
        sys.path.remove(str(directory))
    if Path(ddtree.__file__).resolve().parent != directory:
        raise SystemExit(f"--official-dir: imported ddtree from {ddtree.__file__}, not {directory}")
    from transformers import DynamicCache

    class AbsoluteCropCache(DynamicCache):
        """crop(absolute length) as transformers < 5.23 did it."""

        def crop(self, max_length: int) -> None:
            if max_length > 0:
                max_length = max_length - self.get_seq_length()
                if max_length >= 0:
                    return
            super().crop(max_length)

    for module in (ddtree, dflash):
        module.DynamicCache = AbsoluteCropCache
        if not torch.cuda.is_available():  # its timer synchronises CUDA; the CPU smoke run has none
            module.cuda_time = time.perf_counter
    return types.SimpleNamespace(ddtree=ddtree, dflash=dflash, model=model)


def load_official_draft(official: types.SimpleNamespace, draft_dir: str | Path, dtype: torch.dtype, device: Any):
    return (
        official.model.DFlashDraftModel.from_pretrained(str(draft_dir), attn_implementation="sdpa", dtype=dtype)
        .to(device)
        .eval()
    )


def official_round_ms(
    official: types.SimpleNamespace, draft: Any, target: Any, prompt: list[int], budget: int, new_tokens: int,
    block_size: int,
) -> dict[str, Any]:
    """One official ``ddtree_generate`` (budget 0: its AR baseline, DFlash with block size 1)."""
    target.config._attn_implementation = "sdpa"  # its verify pass sends a custom 4-D mask
    input_ids = torch.tensor([prompt], device=target.device)
    kwargs = dict(model=draft, target=target, input_ids=input_ids, mask_token_id=draft.mask_token_id,
                  max_new_tokens=new_tokens, stop_token_ids=None, temperature=0.0)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    if budget <= 0:
        result = official.dflash.dflash_generate(block_size=1, **kwargs)
    else:
        result = official.ddtree.ddtree_generate(block_size=block_size, tree_budget=budget, **kwargs)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    rounds = max(int(result.decode_rounds), 1)
    decode_s = wall - float(result.time_to_first_token)
    lengths = list(result.acceptance_lengths)
    stages = {k: 1000 * float(v) / rounds for k, v in result.stage_times.items()
              if k in ("draft", "tree_build", "tree_compile", "verify", "commit")}
    return {
        "rounds": rounds,
        "tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "ms_per_round": 1000 * decode_s / rounds,
        "stage_ms_per_round": stages,
        "ttft_ms": 1000 * float(result.time_to_first_token),
        "tokens": result.output_ids[0, len(prompt) :].tolist(),
    }
