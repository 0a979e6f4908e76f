"""JSON that cannot hurt us: parsing what a server sends, writing what we save.

Servers send anything: invalid UTF-8, 100,000 nested brackets (``json.loads`` raises
RecursionError, not ValueError), ``NaN``/``Infinity`` literals and ``1e999`` (Python reads them as
non-finite floats), strings with lone surrogates. ``loads`` turns every unusable body into a
ValueError with one line; ``finite`` and ``dumps`` make the reports strict JSON (RFC 8259: no
NaN/Infinity) and writable as UTF-8.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64  # real replies nest ~8 levels (choices > logprobs > content > top_logprobs > bytes)
_SURROGATE = re.compile("[\ud800-\udfff]")


class InvalidUTF8(ValueError):
    """The bytes are not UTF-8 (the message says where)."""


def decode_utf8(data: bytes, what: str = "the body") -> str:
    """Strict UTF-8 (a leading BOM is dropped); InvalidUTF8 names the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 4].hex(" ")
        raise InvalidUTF8(f"invalid UTF-8 in {what} at byte {exc.start} ({bad})") from None


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), counted up to ``limit + 1``."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level) for child in children)
    return deepest


def loads(data: bytes | str, *, what: str = "the body", max_depth: int = MAX_DEPTH) -> Any:
    """Parse a server's JSON. ValueError (one line) for invalid UTF-8, invalid JSON, or nesting
    deeper than ``max_depth``. NaN/Infinity are read as floats; ``finite`` cleans them later."""
    text = decode_utf8(data, what) if isinstance(data, (bytes, bytearray)) else data
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON ({exc})") from None
    if depth(value, max_depth) > max_depth:
        raise ValueError(f"{what} is JSON nested deeper than {max_depth} levels")
    return value


def finite(value: Any, path: str = "", found: list[str] | None = None, _level: int = 0) -> Any:
    """A copy of ``value`` with every non-finite float replaced by None; the JSON paths of the
    replaced numbers are appended to ``found``. Nesting beyond 2 × MAX_DEPTH is cut (a string
    says so), so saving never recurses without bound."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        if found is not None:
            found.append(path or "(value)")
        return None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if _level > 2 * MAX_DEPTH:
        return f"(nested deeper than {2 * MAX_DEPTH} levels: cut)"
    if isinstance(value, dict):
        return {str(k): finite(v, f"{path}.{k}" if path else str(k), found, _level + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v, f"{path}[{i}]", found, _level + 1) for i, v in enumerate(value)]
    return str(value)


def dumps(value: Any, *, indent: int | None = 2) -> str:
    """Strict JSON text (``allow_nan=False``: pass the value through ``finite`` first). Lone
    surrogates, which UTF-8 cannot hold, are written as ``\\udXXX`` escapes: the same JSON value."""
    text = json.dumps(value, indent=indent, ensure_ascii=False, allow_nan=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def has_surrogates(text: str) -> bool:
    """Lone surrogates: text that cannot be encoded as UTF-8, so never sent (argv bytes that are
    not UTF-8, or a ``\\ud800`` escape in a reply)."""
    return _SURROGATE.search(text) is not None


def displayable(text: str) -> str:
    """Text that any UTF-8 stream can carry: lone surrogates shown as ``\\udXXX``."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _SURROGATE.search(text) else text
