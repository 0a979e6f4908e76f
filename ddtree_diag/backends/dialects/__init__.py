"""Server dialects as plug-ins: one object per server family (see ``base.Dialect``).

``get(name)`` returns a dialect; ``DIALECTS`` lists the names; ``detect_from_extras`` and
``detect_from_owner`` recognise a server from a plain response or from /v1/models. Facts per
server are in shared/DESIGN.md ("Server dialects") and the README.
"""

from __future__ import annotations

from typing import Any

from ddtree_diag.backends.dialects.base import (
    Dialect,
    ParsedResponse,
    StreamAccumulator,
    extras_of,
)
from ddtree_diag.backends.dialects.ddtree import DDTree
from ddtree_diag.backends.dialects.ddtree_mlx import DDTreeMLX
from ddtree_diag.backends.dialects.llamacpp import LlamaCpp
from ddtree_diag.backends.dialects.openai import OpenAI
from ddtree_diag.backends.dialects.sglang import SGLang
from ddtree_diag.backends.dialects.vllm import VLLM
from ddtree_diag.records import ProbeCase

REGISTRY: dict[str, Dialect] = {d.name: d for d in (DDTree(), DDTreeMLX(), VLLM(), SGLang(), LlamaCpp(), OpenAI())}
DIALECTS = tuple(REGISTRY)

__all__ = [
    "DIALECTS",
    "REGISTRY",
    "Dialect",
    "ParsedResponse",
    "StreamAccumulator",
    "build_request",
    "detect_from_extras",
    "detect_from_owner",
    "extras_of",
    "get",
    "parse_body",
]


def get(dialect: str | Dialect) -> Dialect:
    """The dialect object for a name (a Dialect passes through). KeyError for an unknown name."""
    return dialect if isinstance(dialect, Dialect) else REGISTRY[dialect]


def build_request(
    dialect: str | Dialect, case: ProbeCase, model: str, *, stream: bool, minimal: bool = False
) -> dict[str, Any]:
    return get(dialect).build_request(case, model, stream=stream, minimal=minimal)


def parse_body(dialect: str | Dialect, body: dict[str, Any], case: ProbeCase) -> ParsedResponse:
    return get(dialect).parse_body(body, case)


def detect_from_extras(extras: dict[str, Any]) -> str | None:
    """The dialect a response's extra objects identify, or None when they say nothing."""
    for dialect in sorted(REGISTRY.values(), key=lambda d: d.detect_order):
        if dialect.detect(extras):
            return dialect.name
    return None


def detect_from_owner(owned_by: Any) -> str | None:
    """The dialect that /v1/models' ``owned_by`` names, when it names one we know."""
    owner = owned_by.lower() if isinstance(owned_by, str) else ""
    for dialect in sorted(REGISTRY.values(), key=lambda d: d.detect_order):
        if any(name in owner for name in dialect.owner_names):
            return dialect.name
    return None
