"""Prompt files for draft training: read without torch, so ``train-draft`` checks them first."""

from __future__ import annotations

from pathlib import Path


def load_prompts(path: str | Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with '#' are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]
