"""Backends turn a ProbeCase into a ProbeResult.

Every backend (remote HTTP server, in-process engine) has the same small surface, so the
orchestrator, checks and renderers never know which one produced a result: what differs between
them (does a tree budget reach the decoder, how the lossless baseline is made, how requests
travel) is asked of the backend through ``Backend``'s capabilities, never probed by name.

``make_backend`` is the one factory: the probe's own target and every baseline are built through
it from a target, ``HttpTarget`` (a server, optionally reached ``--via`` a command prefix) or
``EngineTarget`` (the in-process engine). Importing this module is light (no httpx, no torch).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Protocol

from ddtree_diag.errors import UsageError
from ddtree_diag.records import ProbeCase, ProbeResult

# How a backend's requests travel (``Backend.transport_kind``).
TRANSPORT_HTTP = "http"  # our own sockets to the server
TRANSPORT_VIA = "via"  # an agent on the far side of a command prefix (--via) makes them
TRANSPORT_IN_PROCESS = "in-process"  # no requests: the engine runs in this process


@dataclass
class HttpTarget:
    """A server: ``url`` (its base, ``/v1`` optional), optionally reached ``via`` a command prefix."""

    url: str | None = None
    model: str | None = None
    dialect: str = "auto"
    api_key: str | None = None
    timeout: float = 120.0  # seconds for a whole request (connect to last byte)
    max_response_bytes: int = 8 << 20  # a bigger body fails its case
    stream: bool = True
    concurrency: int = 1
    via: str | None = None  # command prefix: make the HTTP requests from its far side

    def replace(self, **changes: Any) -> HttpTarget:
        return dataclasses.replace(self, **changes)

    def baseline(self, url: str) -> HttpTarget:
        """A second server with this one's request settings, asked one plain request at a time
        from here (a ``--via`` agent is shared with it by the caller, not started again)."""
        return HttpTarget(url=url, api_key=self.api_key, timeout=self.timeout,
                          max_response_bytes=self.max_response_bytes, stream=False)


@dataclass
class EngineTarget:
    """The in-process engine: ``target`` (a HF folder) or ``gguf``, with a DFlash ``draft``
    (neither: the embedded default model)."""

    target: str | None = None
    gguf: str | None = None
    draft: str | None = None
    device: str | None = None
    dtype: str | None = None
    timeout: float = 120.0  # seconds of generation per case
    use_draft: bool = True  # False: the target alone (a non-speculative baseline)
    concurrency: int = 1
    devices: int = 1  # > 1: the target split over that many devices (engine.parallel); the baseline stays on 1

    def replace(self, **changes: Any) -> EngineTarget:
        return dataclasses.replace(self, **changes)

    @property
    def has_weights(self) -> bool:
        """Whether the deployment's own weights were named (else: the embedded default model)."""
        return self.target is not None or self.gguf is not None

    def baseline(self) -> EngineTarget:
        """The same weights without the draft: the target alone, greedy."""
        return EngineTarget(target=self.target, gguf=self.gguf, device=self.device, dtype=self.dtype,
                            timeout=self.timeout, use_draft=False)


Target = HttpTarget | EngineTarget


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

    # -- capabilities (what the orchestrator and the checks ask instead of the backend's name) --

    @property
    def dialect_name(self) -> str | None:
        """The wire format results are read in ("engine" in-process; None before detection)."""
        ...

    @property
    def sends_budget(self) -> bool:
        """Whether a case's tree budget reaches the decoder (so budget0 is a baseline); a server
        whose dialect is not known yet is assumed to take one."""
        ...

    @property
    def budget_knob(self) -> str:
        """Where the budget is set when it is not per request, for advice."""
        ...

    @property
    def transport_kind(self) -> str:
        """TRANSPORT_HTTP, TRANSPORT_VIA or TRANSPORT_IN_PROCESS."""
        ...

    @property
    def openai_logprobs(self) -> bool:
        """Whether asking a case for ``logprobs`` returns OpenAI per-token logprobs (which the
        lossless check uses to tell a near-tie from a bug)."""
        ...

    def baseline_target(self, mode: str, url: str | None, *, http: HttpTarget,
                        weights: EngineTarget | None) -> Target | None:
        """Where the lossless baseline (``mode``: budget0 | url | engine) runs; None = this
        backend itself at budget 0. ``http``: the run's request settings (api key, timeout, size
        cap) for a baseline server; ``weights``: the deployment's weights, when named."""
        ...

    def count_tokens(self, messages: list[dict[str, Any]], thinking: bool | None) -> int | None:
        """Prompt tokens of ``messages`` after the chat template, by the target's own tokenizer;
        None when it cannot say (a server without a tokenizer endpoint)."""
        ...

    def context_limit(self) -> int | None:
        """The target's context length in tokens (prompt + answer), None when unknown."""
        ...

    def shared_transport(self) -> Any:
        """This backend's way to the server for a baseline client to share (a ``--via`` agent);
        None when a baseline opens its own."""
        ...


def engine_baseline(weights: EngineTarget | None, *, timeout: float, model: str | None) -> EngineTarget:
    """``--baseline engine`` for a server: the target alone from --target/--gguf, else the
    embedded default model, which is only the right baseline when the server runs that model."""
    from ddtree_diag.engine.models import EMBEDDED_MODEL_NAME

    if (weights is None or not weights.has_weights) and model != EMBEDDED_MODEL_NAME:
        raise UsageError("--baseline engine needs the server's target model: --target DIR or --gguf FILE")
    return (weights or EngineTarget()).baseline().replace(timeout=timeout)


def make_backend(target: Target, *, transport: Any = None, http: HttpTarget | None = None) -> Backend:
    """The backend for ``target``. ``transport``: an already started ``--via`` agent to share (a
    baseline requested from the same far side); otherwise ``--via`` starts its own. ``http``: the
    run's HTTP settings beside an engine target, which must name no --url and no --via."""
    if isinstance(target, HttpTarget):
        from ddtree_diag.redaction import register

        register(target.api_key, target.url)  # before anything can print them
    if target.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    if isinstance(target, EngineTarget):
        if http is not None and http.url:
            raise UsageError("give either --url or --engine, not both")
        if http is not None and http.via is not None:
            raise UsageError("--via works with --url only (the engine runs in this process)")
        return _engine_backend(target)
    if isinstance(target, HttpTarget):
        return _http_backend(target, transport)
    raise TypeError(f"not a target: {type(target).__name__}")


def _engine_backend(target: EngineTarget) -> Backend:
    if not 0 < target.timeout < float("inf"):  # NaN fails this too
        raise UsageError("--timeout must be a number of seconds > 0")
    from ddtree_diag.backends.engine import EngineBackend
    from ddtree_diag.engine.models import choose_models

    choice = choose_models(target.target, target.draft, target.gguf, use_draft=target.use_draft)
    return EngineBackend(
        target=choice.target, draft=choice.draft if target.use_draft else None, gguf_file=choice.gguf_file,
        device=target.device, dtype=target.dtype, model_name=choice.name, timeout=target.timeout,
        devices=target.devices,
    )


def _http_backend(target: HttpTarget, transport: Any) -> Backend:
    if not target.url:
        raise UsageError("no target: give --url URL (or set DDTREE_DIAG_URL), or --engine")
    from ddtree_diag.backends.http import HttpBackend

    own_transport = None
    if transport is None and target.via is not None:
        from ddtree_diag.backends.via import AgentTransport

        # The far side's interpreter: python3 unless told (e.g. /opt/conda/bin/python).
        own_transport = AgentTransport(target.via, python=os.environ.get("DDTREE_DIAG_VIA_PYTHON") or "python3")
    backend = HttpBackend(
        target.url, model=target.model, dialect=target.dialect, api_key=target.api_key, timeout=target.timeout,
        stream=target.stream, concurrency=target.concurrency, max_response_bytes=target.max_response_bytes,
        transport=transport or own_transport,
    )
    if own_transport is not None:
        try:
            own_transport.start(timeout=max(target.timeout, 30.0))  # ssh may take a while to log in
        except BaseException:
            backend.close()
            raise
    return backend
