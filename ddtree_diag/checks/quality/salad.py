"""Subword salad (placeholder while the lexicon signal is built)."""

from __future__ import annotations


def find_word_salad(text, ctx, code_spans):
    return None
