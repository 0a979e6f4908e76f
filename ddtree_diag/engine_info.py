"""``ddtree-diag engine-info``: load the engine and show what was loaded.

Kept out of cli.py so the CLI module never imports torch; the command calls ``run_engine_info``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return str(num_bytes)


def engine_info_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    draft = info.get("draft") or {}
    memory = info.get("memory") or {}
    rows = [
        ("model", str(info.get("model"))),
        ("target", str(info.get("target_path"))),
        ("model type", str(info.get("model_type"))),
        ("target layers", str(info.get("layers"))),
        ("hidden size", str(info.get("hidden_size"))),
        ("vocabulary", str(info.get("vocab_size"))),
        ("context length", str(info.get("context_length"))),
        ("device", str(info.get("device"))),
        ("dtype", str(info.get("dtype"))),
        ("stop token ids", ", ".join(map(str, info.get("stop_token_ids") or [])) or "—"),
        ("chat template", "yes" if info.get("chat_template") else "no (plain transcript)"),
        ("draft", str(info.get("draft_path")) if draft else "none (AR only)"),
    ]
    if draft:
        rows += [
            ("draft layers", str(draft.get("layers"))),
            ("target layer ids", ", ".join(map(str, draft.get("target_layer_ids", [])))),
            ("mask token id", str(draft.get("mask_token_id"))),
            ("block size", str(draft.get("block_size"))),
            ("draft heads", f"{draft.get('heads')} q / {draft.get('kv_heads')} kv × {draft.get('head_dim')}"),
        ]
    rows += [
        ("default tree budget", str(info.get("default_tree_budget"))),
        ("target weights", _size(memory.get("target_weights_bytes"))),
        ("draft weights", _size(memory.get("draft_weights_bytes"))),
    ]
    if "cuda_allocated_bytes" in memory:
        rows.append(("cuda allocated", _size(memory.get("cuda_allocated_bytes"))))
    return rows


def run_engine_info(
    target: str | Path,
    draft: str | Path | None = None,
    gguf_file: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    as_json: bool = False,
) -> int:
    """Print what the engine loaded (rich table, or JSON). Returns the exit code (0).

    Configuration problems raise ``ddtree_diag.errors.UsageError`` (one line, exit code 2)."""
    from ddtree_diag.engine import load_engine

    engine = load_engine(target, draft=draft, gguf_file=gguf_file, device=device, dtype=dtype)
    info = engine.info()
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ddtree-diag engine", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for name, value in engine_info_rows(info):
        table.add_row(name, value)
    Console().print(table)
    return 0
