"""Backends turn a ProbeCase into a ProbeResult.

Every backend (remote HTTP server, in-process engine) has the same small surface, so the
orchestrator, checks and renderers never know which one produced a result. ``make_backend`` is
the one factory: the probe's own target and every baseline are built through it from a
``TargetSpec``. Importing this module is light (no httpx, no torch).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Protocol

from ddtree_diag.errors import UsageError
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


@dataclass
class TargetSpec:
    """Where cases go: a server (``url``, optionally reached ``via`` a command prefix) or the
    in-process engine (``engine``: target/gguf + draft). Built from flags by the commands."""

    url: str | None = None
    via: str | None = None  # command prefix: make the HTTP requests from its far side
    model: str | None = None
    dialect: str = "auto"
    api_key: str | None = None
    timeout: float = 120.0  # seconds for a whole request (connect to last byte); engine: per case
    max_response_bytes: int = 8 << 20  # a bigger body fails its case
    stream: bool = True
    concurrency: int = 1
    engine: bool = False
    target: str | None = None
    gguf: str | None = None
    draft: str | None = None
    use_draft: bool = True  # False: the target alone (a non-speculative baseline)
    device: str | None = None
    dtype: str | None = None

    def replace(self, **changes: Any) -> TargetSpec:
        return dataclasses.replace(self, **changes)


def make_backend(spec: TargetSpec, *, transport: Any = None) -> Backend:
    """The backend for ``spec``. ``transport``: an already started ``--via`` agent to share (a
    baseline requested from the same far side); otherwise ``--via`` starts its own."""
    from ddtree_diag.redaction import register

    register(spec.api_key, spec.url)  # before anything can print them
    if spec.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    if spec.engine:
        if spec.url:
            raise UsageError("give either --url or --engine, not both")
        if spec.via is not None:
            raise UsageError("--via works with --url only (the engine runs in this process)")
        if not 0 < spec.timeout < float("inf"):  # NaN fails this too
            raise UsageError("--timeout must be a number of seconds > 0")
        from ddtree_diag.backends.engine import EngineBackend
        from ddtree_diag.engine.models import choose_models

        choice = choose_models(spec.target, spec.draft, spec.gguf, use_draft=spec.use_draft)
        return EngineBackend(
            target=choice.target, draft=choice.draft if spec.use_draft else None, gguf_file=choice.gguf_file,
            device=spec.device, dtype=spec.dtype, model_name=choice.name, timeout=spec.timeout,
        )  # fmt: skip
    if not spec.url:
        raise UsageError("no target: give --url URL (or set DDTREE_DIAG_URL), or --engine")
    from ddtree_diag.backends.http import HttpBackend

    own_transport = None
    if transport is None and spec.via is not None:
        from ddtree_diag.backends.via import AgentTransport

        # The far side's interpreter: python3 unless told (e.g. /opt/conda/bin/python).
        own_transport = AgentTransport(spec.via, python=os.environ.get("DDTREE_DIAG_VIA_PYTHON") or "python3")
    backend = HttpBackend(
        spec.url, model=spec.model, dialect=spec.dialect, api_key=spec.api_key, timeout=spec.timeout,
        stream=spec.stream, concurrency=spec.concurrency, max_response_bytes=spec.max_response_bytes,
        transport=transport or own_transport,
    )  # fmt: skip
    if own_transport is not None:
        try:
            own_transport.start(timeout=max(spec.timeout, 30.0))  # ssh may take a while to log in
        except BaseException:
            backend.close()
            raise
    return backend
