"""Result records shared by every backend, check and renderer.

One ProbeCase in, one ProbeResult out, whatever produced it (HTTP server or in-process engine).
Unknown numbers are ``None`` — never 0 — so renderers can show "—" and checks can skip them.
Records round-trip through plain dicts (the JSON report) with ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1

# ProbeResult.status values.
STATUS_OK = "ok"
STATUS_HTTP_ERROR = "http_error"  # the server answered, with a 4xx/5xx or a body we cannot use
STATUS_TRANSPORT_ERROR = "transport_error"  # connection refused, DNS, dropped stream
STATUS_TIMEOUT = "timeout"
STATUS_ENGINE_ERROR = "engine_error"  # the in-process engine raised
STATUSES = (STATUS_OK, STATUS_HTTP_ERROR, STATUS_TRANSPORT_ERROR, STATUS_TIMEOUT, STATUS_ENGINE_ERROR)
# Statuses that mean "could not talk to the target" (exit code 3).
TRANSPORT_STATUSES = (STATUS_TRANSPORT_ERROR, STATUS_TIMEOUT)


@dataclass
class ProbeCase:
    """One cell of the probe matrix."""

    prompt_id: str
    messages: list[dict[str, Any]]
    enable_thinking: bool | None = None  # None = do not send the toggle
    tree_budget: int | None = None  # None = server default
    temperature: float = 0.0
    max_tokens: int = 48
    repeat: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # extra request fields, sent verbatim

    @property
    def case_id(self) -> str:
        """Stable, human-readable id: the same case gets the same id in every run."""
        think = {None: "default", True: "on", False: "off"}[self.enable_thinking]
        budget = "default" if self.tree_budget is None else str(self.tree_budget)
        return (
            f"{self.prompt_id}/think={think}/budget={budget}"
            f"/T={self.temperature:g}/max={self.max_tokens}/r{self.repeat}"
        )

    @property
    def group_key(self) -> str:
        """The case without its repeat index: repeats of one group must agree at T=0."""
        return self.case_id.rsplit("/r", 1)[0]

    @property
    def prompt_text(self) -> str:
        """The last user message, for checks that compare the answer with the question."""
        for message in reversed(self.messages):
            if message.get("role") == "user" and isinstance(message.get("content"), str):
                return message["content"]
        return ""


@dataclass
class SpecMetrics:
    """Speculative-decoding numbers, normalised across servers.

    Acceptance length counts the bonus token (the papers' tau): tokens committed per verify round.
    """

    decode_rounds: int | None = None
    mean_acceptance_length: float | None = None
    acceptance_lengths: list[int] | None = None  # per round, when the backend reports it
    draft_tokens: int | None = None
    accepted_tokens: int | None = None  # accepted draft tokens (bonus not included)
    server_tokens_per_second: float | None = None
    tree_budget: int | None = None  # as the server reports it, when it does
    # Where the numbers came from, e.g. "response.ddtree", "prometheus /metrics delta (server-wide)".
    source: str | None = None
    # True when a number was computed from others rather than reported (llama.cpp rounds).
    derived: bool = False
    # True when the source is a server-wide counter that other traffic could have moved.
    server_wide: bool = False

    @property
    def known(self) -> bool:
        return self.decode_rounds is not None or self.mean_acceptance_length is not None


@dataclass
class Timings:
    """Client-side timings (seconds), measured by the backend that ran the case."""

    e2e_s: float | None = None
    ttft_s: float | None = None  # only when streaming (or from the engine)
    decode_tokens_per_second: float | None = None
    # Engine-only stage breakdown, seconds summed over the generation (draft, tree, verify, commit).
    stages: dict[str, float] | None = None


@dataclass
class ProbeResult:
    case: ProbeCase
    status: str = STATUS_OK
    error: str | None = None  # one line, when status != ok
    http_status: int | None = None
    dialect: str | None = None
    model: str | None = None
    output: str = ""
    reasoning: str | None = None  # when the server separates the thinking text
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    timings: Timings = field(default_factory=Timings)
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    extras: dict[str, Any] = field(default_factory=dict)  # raw server extras, kept for the JSON
    quality: dict[str, Any] | None = None  # quality verdict as a dict (see quality.py)
    baseline: dict[str, Any] | None = None  # lossless comparison against a baseline
    findings: list[str] = field(default_factory=list)  # ids of run findings naming this case

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def case_id(self) -> str:
        return self.case.case_id

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["case"]["case_id"] = self.case.case_id
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        data = dict(data)
        case_data = {k: v for k, v in data.pop("case").items() if k != "case_id"}
        case = ProbeCase(**_known_fields(ProbeCase, case_data))
        timings = Timings(**_known_fields(Timings, data.pop("timings", None) or {}))
        spec = SpecMetrics(**_known_fields(SpecMetrics, data.pop("spec", None) or {}))
        return cls(case=case, timings=timings, spec=spec, **_known_fields(cls, data))


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """Keep only fields the dataclass knows, so newer reports still load in older code."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class RunReport:
    """A whole run: what was probed, every result, and the run-level verdicts."""

    results: list[ProbeResult] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)  # url or engine paths, model, dialect
    started_at: str | None = None  # ISO 8601, UTC
    finished_at: str | None = None
    interrupted: bool = False  # Ctrl-C or a fatal error: results are partial
    notes: list[str] = field(default_factory=list)  # run-level remarks (e.g. dialect detection)
    findings: list[dict[str, Any]] = field(default_factory=list)
    gate: dict[str, Any] | None = None
    tool_version: str = ""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "tool_version": self.tool_version,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "interrupted": self.interrupted,
            "target": self.target,
            "notes": self.notes,
            "results": [r.to_dict() for r in self.results],
            "findings": self.findings,
            "gate": self.gate,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"unsupported report schema_version {version!r} (expected {SCHEMA_VERSION})")
        fields = _known_fields(cls, data)
        fields["results"] = [ProbeResult.from_dict(r) for r in data.get("results", [])]
        return cls(**fields)
