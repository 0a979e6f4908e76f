"""Backends turn a ProbeCase into a ProbeResult.

Every backend (remote HTTP server, in-process engine) has the same small surface, so the runner,
checks and renderers never know which one produced a result.
"""

from __future__ import annotations

from typing import Any, Protocol

from ddtree_diag.records import ProbeCase, ProbeResult


class Backend(Protocol):
    name: str  # "http" or "engine"

    def prepare(self, cases: list[ProbeCase]) -> list[str]:
        """Resolve the model, detect the dialect, load weights...; return notes for the report."""
        ...

    def run(self, case: ProbeCase) -> ProbeResult:
        """Run one case. Failures become a ProbeResult with a non-ok status, never an exception,
        except for configuration errors (DiagError) that make every case pointless."""
        ...

    def target_info(self) -> dict[str, Any]:
        """What was probed (url or model paths, model id, dialect), for the report header."""
        ...

    def close(self) -> None: ...
