"""Word lists of 39 languages written with spaces (ddtree_diag/data/lexicon/, built by
scripts/build_lexicon.py from wordfreq's frequency lists): which language a text is in, and
whether a word is one of that language's 16,000 most frequent, or a word of 5+ letters among its
32,000 most frequent (technical and inflected words; salad's pieces are short).

Loaded lazily (a list on the first text that needs it, ~5-10 ms each) through importlib.resources,
so it also works from the single-file build.
"""

from __future__ import annotations

import gzip
import json
import unicodedata
from functools import cache
from importlib import resources
from typing import Any


@cache
def index() -> dict[str, dict[str, Any]]:
    """Per language: script, words kept, coverage of running text, short words missed, top words."""
    try:
        raw = resources.files("ddtree_diag").joinpath("data/lexicon/index.json").read_text(encoding="utf-8")
    except (OSError, ModuleNotFoundError):
        return {}
    return json.loads(raw)


@cache
def words(lang: str) -> frozenset[str]:
    raw = resources.files("ddtree_diag").joinpath(f"data/lexicon/{lang}.txt.gz").read_bytes()
    return frozenset(gzip.decompress(raw).decode("utf-8").split("\n"))


@cache
def sorted_words(lang: str) -> tuple[str, ...]:
    """The language's words in order, for prefix lookups (bisect)."""
    return tuple(sorted(words(lang)))


@cache
def _top_words() -> tuple[dict[str, tuple[str, ...]], dict[str, list[str]]]:
    """Each frequent word with the languages it is frequent in; the languages of each script."""
    langs_of: dict[str, list[str]] = {}
    by_script: dict[str, list[str]] = {}
    for lang, info in index().items():
        by_script.setdefault(info["script"], []).append(lang)
        for word in info["top"]:
            langs_of.setdefault(word, []).append(lang)
    return {w: tuple(v) for w, v in langs_of.items()}, by_script


@cache
def script_of_char(ch: str) -> str:
    """The Unicode script word of a letter's name (LATIN, CYRILLIC, ARABIC, ...)."""
    return unicodedata.name(ch, "?").split(" ")[0]


def identify(tokens: list[str], limit: int = 400) -> list[tuple[str, float]]:
    """Languages of the tokens' main script, best first, with the share of tokens that are among
    the language's 150 most frequent words (case-folded tokens expected)."""
    sample = tokens[:limit]
    if not sample:
        return []
    scripts: dict[str, int] = {}
    for token in sample:
        script = script_of_char(token[0])
        scripts[script] = scripts.get(script, 0) + 1
    script = max(scripts, key=scripts.get)
    langs_of, by_script = _top_words()
    hits = dict.fromkeys(by_script.get(script, ()), 0)
    for token in sample:
        for lang in langs_of.get(token, ()):
            if lang in hits:
                hits[lang] += 1
    total = scripts[script]
    return sorted(((lang, count / total) for lang, count in hits.items()), key=lambda kv: -kv[1])
