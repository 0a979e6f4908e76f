"""Result records shared by every backend, check and renderer.

One ProbeCase in, one ProbeResult out, whatever produced it (HTTP server or in-process engine).
Unknown numbers are ``None`` — never 0 — so renderers can show "—" and checks can skip them.
Records round-trip through plain dicts (the JSON report) with ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

import dataclasses
import functools
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


def thinking_label(value: bool | None) -> str:
    """A case's thinking toggle in words: ``on``, ``off``, ``default`` (not sent)."""
    return {True: "on", False: "off", None: "default"}[value]


def budget_label(value: int | None) -> str:
    """A case's tree budget in words: the number, or ``default`` (the server's)."""
    return "default" if value is None else str(value)


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
    # Workloads (OpenAI wire format, sent by every dialect): structured output and tool calls.
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # Long context: the prompt is filled to about this many tokens (None: as written). ``fill``
    # records what was built: {"tokens", "estimated", "language", "question", "source"}.
    context_tokens: int | None = None
    fill: dict[str, Any] | None = None
    # Prefix-cache pair: "first" and "repeat" are the same prompt sent twice in a row.
    cache_role: str | None = None

    @property
    def case_id(self) -> str:
        """Stable, human-readable id: the same case gets the same id in every run."""
        workload = ""
        if self.context_tokens is not None:
            workload += f"/ctx={self.context_tokens}"
        if self.cache_role is not None:
            workload += f"/cache={self.cache_role}"
        return (
            f"{self.prompt_id}{workload}/think={thinking_label(self.enable_thinking)}"
            f"/budget={budget_label(self.tree_budget)}/T={self.temperature:g}/max={self.max_tokens}/r{self.repeat}"
        )

    @property
    def structured(self) -> bool:
        """Whether the answer must be JSON or a tool call (a response_format or tools)."""
        return bool(self.tools) or (self.response_format or {}).get("type") in ("json_object", "json_schema")

    @property
    def group_label(self) -> str:
        """The case's tree budget × thinking group: ``budget=16 think=on``."""
        return f"budget={budget_label(self.tree_budget)} think={thinking_label(self.enable_thinking)}"

    @property
    def group_key(self) -> str:
        """The case without its repeat index: repeats of one group must agree at T=0."""
        return self.case_id.rsplit("/r", 1)[0]

    @property
    def prompt_text(self) -> str:
        """The last user message, for checks that compare the answer with the question (a filled
        long-context prompt: its question, not the document around it)."""
        if self.fill and isinstance(self.fill.get("question"), str):
            return self.fill["question"]
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
    # Acceptance by depth (backends/depth.py): P(the draft token at depth k is accepted), index 0 =
    # depth 1, over ``acceptance_by_depth_rounds`` rounds; where it came from; and the deepest a
    # draft could reach when the server says (vLLM num_spec_tokens, /metrics positions). None = unknown.
    acceptance_by_depth: list[float] | None = None
    acceptance_by_depth_rounds: int | None = None
    acceptance_by_depth_source: str | None = None
    max_draft_depth: int | None = None

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


# ---------------------------------------------------------------------------------------------
# Check results. Typed here (every backend, check and renderer shares them); their dict forms are
# the JSON report's, unchanged.

GARBAGE_THRESHOLD = 0.5  # a verdict's score at or above this means garbage
SEVERITY_HARD, SEVERITY_SOFT, SEVERITY_INFO = "hard", "soft", "info"


@dataclass(frozen=True)
class Reason:
    """One named quality signal. Unpacks as ``(code, detail, evidence)``."""

    code: str
    detail: str
    evidence: str = ""
    weight: float = 0.0
    span: tuple[int, int] | None = None
    source: str = "text"  # "text" (the answer) or "reasoning"

    @property
    def severity(self) -> str:
        if self.weight <= 0:
            return SEVERITY_INFO
        return SEVERITY_HARD if self.weight >= GARBAGE_THRESHOLD else SEVERITY_SOFT

    def __iter__(self):
        return iter((self.code, self.detail, self.evidence))

    def __getitem__(self, index: int) -> Any:
        return (self.code, self.detail, self.evidence)[index]

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "detail": self.detail,
            "evidence": self.evidence,
            "severity": self.severity,
            "weight": round(self.weight, 3),
            "span": list(self.span) if self.span is not None else None,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reason:
        span = data.get("span")
        weight = data.get("weight")
        if weight is None:  # an older/foreign dict: recover a weight from the severity
            weight = {"hard": 0.7, "soft": 0.3}.get(data.get("severity", ""), 0.0)
        return cls(
            code=str(data["code"]),
            detail=str(data.get("detail", "")),
            evidence=str(data.get("evidence", "")),
            weight=float(weight),
            span=(int(span[0]), int(span[1])) if span else None,
            source=str(data.get("source", "text")),
        )


@dataclass
class Verdict:
    """The quality check's answer for one text."""

    garbage: bool
    score: float
    reasons: list[Reason] = field(default_factory=list)
    truncated: bool = False
    # --score-with: the model's scores of this text and the thresholds they were judged by
    # (checks.likelihood.LikelihoodScore.summary), whether or not a reason fired
    likelihood: dict[str, Any] | None = None

    @property
    def top_reason(self) -> Reason | None:
        """The heaviest reason (info reasons only when nothing else was found)."""
        if not self.reasons:
            return None
        return max(self.reasons, key=lambda r: r.weight)

    @property
    def counting_reasons(self) -> list[Reason]:
        """Reasons other than ``truncated`` (which never makes a text garbage)."""
        return [r for r in self.reasons if r.code != "truncated"]

    @property
    def mark(self) -> str:
        return "✗" if self.garbage else "✓"

    def summary(self, width: int | None = None) -> str:
        """One short line for a table cell: ``✓``, ``✓ truncated`` or ``✗ token_loop: …``,
        cut to ``width`` characters when given."""
        top = self.top_reason
        if top is None or (not self.garbage and top.weight > 0):
            line = self.mark
        elif not self.garbage:
            line = f"{self.mark} {top.code}"
        else:
            line = f"{self.mark} {top.code}: {top.detail}"
        if width is not None and len(line) > width:
            line = line[: max(1, width - 1)] + "…"
        return line

    @property
    def codes(self) -> list[str]:
        return [r.code for r in self.reasons]

    def to_dict(self) -> dict[str, Any]:
        return {
            "garbage": self.garbage,
            "score": round(self.score, 3),
            "truncated": self.truncated,
            "reasons": [r.to_dict() for r in self.reasons],
            **({"likelihood": self.likelihood} if self.likelihood is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(
            garbage=bool(data["garbage"]),
            score=float(data.get("score", 0.0)),
            reasons=[Reason.from_dict(r) for r in data.get("reasons", []) if isinstance(r, dict)],
            truncated=bool(data.get("truncated", False)),
            likelihood=data["likelihood"] if isinstance(data.get("likelihood"), dict) else None,
        )


@dataclass
class StructuredCheck:
    """Whether an answer that had to be JSON (or a tool call) is: ``kind`` is json_object,
    json_schema or tool_call; ``passed`` False names the first problem in ``detail``."""

    kind: str
    passed: bool
    detail: str = ""
    cut: bool = False  # the answer stopped at max_tokens (a failure may be the limit's, not the server's)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredCheck:
        return cls(str(data.get("kind", "")), bool(data.get("passed")), str(data.get("detail", "")),
                   bool(data.get("cut")))


# BaselineComparison.verdict values
IDENTICAL, NEAR_TIE, MISMATCH = "identical", "near_tie", "mismatch"
SKIPPED = "skipped"  # T>0 or the case itself failed: nothing to compare
BASELINE_ERROR = "error"  # the baseline request failed


@dataclass
class BaselineComparison:
    """The lossless check's answer for one case: its text against the non-speculative baseline's."""

    mode: str
    verdict: str
    detail: str = ""
    source: str | None = None  # the baseline, in words
    baseline_case_id: str | None = None
    baseline_output: str | None = None
    baseline_reasoning: str | None = None
    logprobs: str | None = None  # a note when the baseline server refused logprobs
    field: str | None = None  # "output" | "reasoning": where the texts differ
    char_index: int | None = None
    token_index: int | None = None
    expected: str | None = None  # the baseline around the divergence (…before⟨after…)
    actual: str | None = None
    logprob_gap: float | None = None
    top_logprobs: list[dict[str, Any]] | None = None
    # The baseline's own workload answers, for the differential checks: its structured-output
    # check, whether it kept reasoning out of the content, and its prefix-cache reuse
    baseline_structured: dict[str, Any] | None = None
    baseline_tool_calls: list[dict[str, Any]] | None = None
    baseline_reasoning_leak: bool | None = None

    @property
    def matches(self) -> bool | None:
        """True (identical or a near-tie), False (a mismatch), None (nothing was compared)."""
        if self.verdict in (IDENTICAL, NEAR_TIE):
            return True
        return False if self.verdict == MISMATCH else None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        # Only what was found: a skipped case carries mode, verdict and detail alone.
        keep = {"mode", "verdict", "detail"}
        if self.field is not None:
            keep |= {"field", "char_index", "token_index", "expected", "actual"}
        return {k: v for k, v in data.items() if k in keep or v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BaselineComparison:
        fields = _known_fields(cls, data)
        fields.setdefault("mode", "")
        fields.setdefault("verdict", "")
        return cls(**fields)


SEVERITIES = ("error", "warning", "info")  # finding severities, most severe first


@dataclass
class Finding:
    """A rule's conclusion about the whole run: a likely cause, the evidence, what to check."""

    id: str
    severity: str  # one of SEVERITIES
    title: str
    evidence: str
    check: str
    cases: list[str] = field(default_factory=list)

    def at_least(self, threshold: str) -> bool:
        """Whether this finding is as severe as ``threshold`` or more."""
        return SEVERITIES.index(self.severity) <= SEVERITIES.index(threshold)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        fields = _known_fields(cls, data)
        if fields.get("severity") not in SEVERITIES:
            fields["severity"] = "info"
        for key in ("id", "title", "evidence", "check"):
            fields[key] = str(fields.get(key) or "")
        fields["cases"] = [str(c) for c in fields.get("cases") or []]
        return cls(**fields)


@dataclass
class GateCheck:
    """One gate threshold applied to the run; ``cases`` are the case ids that made it fail."""

    name: str
    passed: bool
    detail: str
    cases: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class GateResult:
    passed: bool
    checks: list[GateCheck] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": [c.to_dict() for c in self.checks]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateResult:
        checks = [
            GateCheck(str(c.get("name", "")), bool(c.get("passed")), str(c.get("detail", "")),
                      [str(x) for x in c.get("cases") or []])
            for c in data.get("checks") or [] if isinstance(c, dict)
        ]
        return cls(bool(data.get("passed")), checks)


# ---------------------------------------------------------------------------------------------
# One case's result


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
    # Tool calls in the answer: [{"id", "name", "arguments" (the JSON string as sent)}]
    tool_calls: list[dict[str, Any]] | None = None
    # Prompt tokens the server served from its prefix cache, when it says (usage.prompt_tokens_details
    # .cached_tokens, llama.cpp timings.cache_n, a /metrics delta); None = not reported.
    cached_tokens: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    timings: Timings = field(default_factory=Timings)
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    extras: dict[str, Any] = field(default_factory=dict)  # raw server extras, kept for the JSON
    quality: Verdict | None = None  # the garbage-text verdict (None when the request failed)
    # The structured-output check (JSON / schema / tool call), for cases that ask for one
    structured: StructuredCheck | None = None
    baseline: BaselineComparison | None = None  # the lossless comparison, when a baseline ran
    findings: list[str] = field(default_factory=list)  # ids of run findings naming this case
    seq: int | None = None  # the order the request was sent in this run (0-based); None = unknown

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def case_id(self) -> str:
        return self.case.case_id

    @property
    def garbage(self) -> bool:
        return bool(self.quality is not None and self.quality.garbage)

    @property
    def acceptance(self) -> float | None:
        return self.spec.mean_acceptance_length

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["case"] = {**dataclasses.asdict(self.case), "case_id": self.case.case_id}
        data["timings"] = dataclasses.asdict(self.timings)
        data["spec"] = dataclasses.asdict(self.spec)
        data["extras"] = dict(self.extras)
        data["quality"] = self.quality.to_dict() if self.quality is not None else None
        data["structured"] = self.structured.to_dict() if self.structured is not None else None
        data["baseline"] = self.baseline.to_dict() if self.baseline is not None else None
        data["findings"] = list(self.findings)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        data = dict(data)
        case = data.pop("case")
        if not isinstance(case, dict):
            raise ValueError(f"case: expected an object, got {type(case).__name__}")
        case_data = {k: v for k, v in case.items() if k != "case_id"}
        case = ProbeCase(**_known_fields(ProbeCase, case_data))
        timings = Timings(**_known_fields(Timings, data.pop("timings", None) or {}))
        spec = SpecMetrics(**_known_fields(SpecMetrics, data.pop("spec", None) or {}))
        quality = data.pop("quality", None)
        baseline = data.pop("baseline", None)
        structured = data.pop("structured", None)
        return cls(
            case=case, timings=timings, spec=spec,
            quality=Verdict.from_dict(quality) if isinstance(quality, dict) else None,
            structured=StructuredCheck.from_dict(structured) if isinstance(structured, dict) else None,
            baseline=BaselineComparison.from_dict(baseline) if isinstance(baseline, dict) else None,
            **_known_fields(cls, data),
        )


# ---------------------------------------------------------------------------------------------
# The load sweep (ddtree_diag.load): does speculation pay at each concurrency level?

PERCENTILES = ("p50", "p90", "p99")


@dataclass
class LoadSide:
    """One side (speculative or baseline) of one concurrency level. Percentile tables are
    {"p50", "p90", "p99"} with None for unknown (TTFT and ITL need a streamed answer)."""

    requests: int = 0  # sent at this level
    failures: int = 0
    wall_s: float | None = None  # the first request sent to the last answer read
    completion_tokens: int = 0  # over the ok requests
    tokens_per_second: float | None = None  # aggregate: completion_tokens / wall_s
    request_tokens_per_second_p50: float | None = None  # per request: its tokens / its own time
    ttft_s: dict[str, float | None] = field(default_factory=dict)
    itl_ms: dict[str, float | None] = field(default_factory=dict)  # per token, see load.itl_samples
    e2e_s: dict[str, float | None] = field(default_factory=dict)
    mean_acceptance: float | None = None
    acceptance_source: str | None = None  # "per request", or a server-wide counter delta
    draft_tokens: int | None = None  # summed over the requests that report it (None: none did)
    stopped_by_time: bool = False  # the level's time budget ended it before its request count
    errors: list[str] = field(default_factory=list)  # the first distinct error lines

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadSide:
        fields = _known_fields(cls, data)
        for key in ("ttft_s", "itl_ms", "e2e_s"):
            table = fields.get(key)
            fields[key] = {k: v for k, v in table.items() if k in PERCENTILES} if isinstance(table, dict) else {}
        fields["errors"] = [str(e) for e in fields.get("errors") or []]
        return cls(**fields)


@dataclass
class LoadLevel:
    """One concurrency level of the sweep: the matrix's requests with ``concurrency`` in flight,
    with speculation and (when a baseline is known) without; ``speedup`` = aggregate tok/s
    speculative / baseline (None: unknown, ``note`` says why)."""

    concurrency: int
    speculative: LoadSide = field(default_factory=LoadSide)
    baseline: LoadSide | None = None
    speedup: float | None = None
    baseline_source: str | None = None  # the baseline, in words
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "speculative": self.speculative.to_dict(),
                "baseline": self.baseline.to_dict() if self.baseline is not None else None,
                "speedup": self.speedup, "baseline_source": self.baseline_source, "note": self.note}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadLevel:
        fields = _known_fields(cls, data)
        spec, base = fields.get("speculative"), fields.get("baseline")
        fields["speculative"] = LoadSide.from_dict(spec) if isinstance(spec, dict) else LoadSide()
        fields["baseline"] = LoadSide.from_dict(base) if isinstance(base, dict) else None
        return cls(**fields)


def _known_fields(cls: type, data: Any) -> dict[str, Any]:
    """Keep only fields the dataclass knows, so newer reports still load in older code; a field
    of a plain type (text, number, flag, list, table) holding another type is a ValueError naming
    it, so a hand-edited report fails in one line at load, not deep in the rendering."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    kinds = _field_kinds(cls)
    out = {}
    for key, value in data.items():
        if key not in kinds:
            continue
        allowed = kinds[key]
        if allowed is None:
            out[key] = value
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):  # true is no count
            raise ValueError(f"{key}: expected {_kind_words(allowed)}, got {type(value).__name__} {_short(value)}")
        out[key] = value
    return out


_PLAIN_KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "None": (type(None),),
}


@functools.cache
def _field_kinds(cls: type) -> dict[str, tuple[type, ...] | None]:
    """Each field's allowed JSON types, from its annotation; None where it is not plain (a nested
    record, Any): those are read by their own from_dict."""
    kinds: dict[str, tuple[type, ...] | None] = {}
    for item in dataclasses.fields(cls):
        allowed: tuple[type, ...] = ()
        for part in str(item.type).split(" | "):
            part = part.strip()
            if part in _PLAIN_KINDS:
                allowed += _PLAIN_KINDS[part]
            elif part.startswith("list["):
                allowed += (list,)
            elif part.startswith("dict["):
                allowed += (dict,)
            else:
                allowed = ()
                break
        kinds[item.name] = allowed or None
    return kinds


def _kind_words(allowed: tuple[type, ...]) -> str:
    names = {str: "text", int: "a number", float: "a number", bool: "true/false", list: "a list", dict: "an object",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names[kind] for kind in allowed))


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 30 else shown[:27] + "..."


@dataclass
class RunReport:
    """A whole run: what was probed, every result, and the run-level verdicts."""

    results: list[ProbeResult] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)  # url or engine paths, model, dialect
    started_at: str | None = None  # ISO 8601, UTC
    finished_at: str | None = None
    interrupted: bool = False  # Ctrl-C or a fatal error: results are partial
    # Why a partial run ended: {"reason": interrupted | terminated | unreachable | deadline | error,
    # "detail": one line, "exit_code": the run's exit code}; None for a run that finished.
    stopped: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # run-level remarks (e.g. dialect detection)
    findings: list[Finding] = field(default_factory=list)
    gate: GateResult | None = None
    # The gate's canary: its first case sent again after every other one (state carried between
    # requests shows as a different text or a lower acceptance). Not one of the results.
    canary: ProbeResult | None = None
    # Requests the baseline sent for the workload checks beyond the lossless comparison: each
    # prefix-cache pair again without speculation (first, repeat). Not among the results.
    baseline_probes: list[ProbeResult] = field(default_factory=list)
    # The load sweep (--concurrency 1,4,16 or [axes] concurrency): one entry per level, in order.
    load: list[LoadLevel] = field(default_factory=list)
    tool_version: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def ok_results(self) -> list[ProbeResult]:
        """The results whose request succeeded (the ones with an answer to judge)."""
        return [r for r in self.results if r.ok]

    def stop_label(self) -> str | None:
        """How a partial run ended, for a summary line: None when it finished."""
        if not self.interrupted:
            return None
        stopped = self.stopped or {}
        reason, detail = stopped.get("reason"), stopped.get("detail") or ""
        if reason == "interrupted":
            return "INTERRUPTED by Ctrl-C (partial)"
        if reason == "terminated":
            return f"TERMINATED by {detail or 'a signal'} (partial)"
        if reason == "unreachable":
            return "STOPPED, target unreachable" + (f": {detail}" if detail else "") + " (partial)"
        if reason == "deadline":
            return "STOPPED at its deadline" + (f": {detail}" if detail else "") + " (partial)"
        if reason == "error":
            return "STOPPED by an error" + (f": {detail}" if detail else "") + " (partial)"
        return "INTERRUPTED (partial)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "tool_version": self.tool_version,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "interrupted": self.interrupted,
            "stopped": self.stopped,
            "target": self.target,
            "notes": self.notes,
            "results": [r.to_dict() for r in self.results],
            "findings": [f.to_dict() for f in self.findings],
            "gate": self.gate.to_dict() if self.gate is not None else None,
            "canary": self.canary.to_dict() if self.canary is not None else None,
            "baseline_probes": [r.to_dict() for r in self.baseline_probes],
            "load": [level.to_dict() for level in self.load],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"unsupported report schema_version {version!r} (expected {SCHEMA_VERSION})")
        fields = _known_fields(cls, data)
        fields["results"] = _each_result(data.get("results", []), "results")
        if not isinstance(fields.get("stopped"), dict):
            fields["stopped"] = None
        fields["findings"] = [Finding.from_dict(f) for f in data.get("findings") or [] if isinstance(f, dict)]
        gate = data.get("gate")
        fields["gate"] = GateResult.from_dict(gate) if isinstance(gate, dict) else None
        canary = data.get("canary")
        fields["canary"] = ProbeResult.from_dict(canary) if isinstance(canary, dict) else None
        fields["baseline_probes"] = _each_result([r for r in data.get("baseline_probes") or [] if isinstance(r, dict)],
                                                 "baseline_probes")
        fields["load"] = [LoadLevel.from_dict(x) for x in data.get("load") or []
                          if isinstance(x, dict) and isinstance(x.get("concurrency"), int)]
        return cls(**fields)


def _each_result(items: Any, where: str) -> list[ProbeResult]:
    """Each saved result, a broken one named by its place ("results[3]: output: expected text")."""
    if not isinstance(items, list):
        raise ValueError(f"{where}: expected a list, got {type(items).__name__}")
    results = []
    for index, item in enumerate(items):
        try:
            results.append(ProbeResult.from_dict(item))
        except KeyError as exc:
            raise ValueError(f"{where}[{index}]: missing {exc}") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{where}[{index}]: {exc}") from None
    return results


# ---------------------------------------------------------------------------------------------
# Fleets: one run over many servers (replicas, containers, hosts)

FLEET_KIND = "fleet"  # a fleet report's "kind"; a single run's report has none


@dataclass
class FleetMember:
    """One target of a fleet: its name, its group (replicas compared with each other: by default
    the model it serves), where it was reached, and its own whole run."""

    name: str
    report: RunReport = field(default_factory=RunReport)
    group: str | None = None  # set in the targets file; None = group by the served model
    exit_code: int | None = None  # this target's own exit code, as a single run would give it
    source: str | None = None  # the report file it came from (``report --merge``)
    planned: int | None = None  # the cases the matrix has for it (a dead target ran none of them)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "group": self.group, "exit_code": self.exit_code, "source": self.source,
                "planned": self.planned, "report": self.report.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FleetMember:
        report = data.get("report")
        if not isinstance(report, dict):
            raise ValueError(f"fleet target {data.get('name')!r} has no report")
        def count(value: Any) -> int | None:
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        group, source = data.get("group"), data.get("source")
        return cls(
            name=str(data.get("name") or ""), report=RunReport.from_dict(report),
            group=str(group) if group is not None else None, exit_code=count(data.get("exit_code")),
            source=str(source) if source is not None else None, planned=count(data.get("planned")),
        )


@dataclass
class FleetReport:
    """A run over several targets: every target's own report, and what only the fleet shows (the
    replica that differs from the others, the slow one) with the fleet's verdict."""

    targets: list[FleetMember] = field(default_factory=list)
    started_at: str | None = None
    finished_at: str | None = None
    interrupted: bool = False
    stopped: dict[str, Any] | None = None  # as RunReport.stopped, for the fleet run as a whole
    notes: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)  # cross-target findings
    # gate: one check per target (its own gate or checks) plus the cross-target findings
    gate: GateResult | None = None
    matrix: str | None = None  # the matrix every target ran
    tool_version: str = ""
    schema_version: int = SCHEMA_VERSION

    def member(self, name: str) -> FleetMember | None:
        return next((m for m in self.targets if m.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "kind": FLEET_KIND,
            "tool_version": self.tool_version,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "interrupted": self.interrupted,
            "stopped": self.stopped,
            "matrix": self.matrix,
            "notes": self.notes,
            "findings": [f.to_dict() for f in self.findings],
            "gate": self.gate.to_dict() if self.gate is not None else None,
            "targets": [m.to_dict() for m in self.targets],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FleetReport:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"unsupported report schema_version {version!r} (expected {SCHEMA_VERSION})")
        fields = _known_fields(cls, data)
        fields["targets"] = [FleetMember.from_dict(m) for m in data.get("targets") or [] if isinstance(m, dict)]
        if not isinstance(fields.get("stopped"), dict):
            fields["stopped"] = None
        fields["findings"] = [Finding.from_dict(f) for f in data.get("findings") or [] if isinstance(f, dict)]
        gate = data.get("gate")
        fields["gate"] = GateResult.from_dict(gate) if isinstance(gate, dict) else None
        fields["notes"] = [str(n) for n in fields.get("notes") or []]
        return cls(**fields)


def is_fleet_dict(data: Any) -> bool:
    """Whether a loaded JSON report is a fleet's (``kind: fleet``) rather than a single run's."""
    return isinstance(data, dict) and data.get("kind") == FLEET_KIND
