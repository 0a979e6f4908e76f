"""The run itself: matrix -> backend -> cases -> baseline -> checks, in one direction.

Commands build a ``RunPlan`` from their flags and hand it here; this module knows nothing about
flags, consoles or files. ``prepare`` validates the whole plan before anything is sent (matrix,
baseline, gate thresholds); ``execute`` runs the cases and the baseline into a ``RunReport`` the
caller owns (so a partial report survives Ctrl-C and fatal errors); ``judge`` adds findings and
the gate verdict; ``exit_code_for`` maps the finished report to the documented exit code.

Cases run serially by default (clean per-request numbers, and server-wide counter deltas stay
attributable); ``concurrency > 1`` runs them on a thread pool and still reports them in matrix
order. The load sweep (``load``), when asked for, runs last: its requests are summarised per
concurrency level in ``report.load``, never added to the results.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import math
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from ddtree_diag import __version__
from ddtree_diag import load as load_sweep
from ddtree_diag.backends import Backend, EngineTarget, HttpTarget, Target, make_backend
from ddtree_diag.checks import findings, gate, lossless, speedup
from ddtree_diag.checks.against import KnownGood
from ddtree_diag.checks.against import notes as against_notes
from ddtree_diag.errors import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TRANSPORT,
    EXIT_USAGE,
    DiagError,
    Terminated,
    TransportError,
    UsageError,
    one_line,
)
from ddtree_diag.matrix import Matrix, MatrixRequest, resolve_matrix
from ddtree_diag.records import SKIPPED, TRANSPORT_STATUSES, BaselineComparison, ProbeCase, ProbeResult, RunReport
from ddtree_diag.redaction import register as register_secrets

OnResult = Callable[[ProbeResult], None]
OnStage = Callable[[str], None]


@dataclass
class RunPlan:
    """What to run: the target, the matrix, and the checks beyond the per-case quality verdict."""

    target: Target = field(default_factory=HttpTarget)  # where the cases run
    matrix: MatrixRequest = field(default_factory=MatrixRequest)
    baseline: str | None = None  # budget0 | url:URL | engine; the gate also reads [baseline]
    near_tie_gap: float | None = None
    gate: bool = False  # apply the matrix's [gate] thresholds
    score_with: str | None = None  # embedded | target | a model path: the target-likelihood check
    # The other kind's flags. ``http`` (engine runs): what a url: baseline is sent with (api key,
    # size cap), and the --url/--via that must not come with --engine. ``weights`` (server runs):
    # the deployment's weights (--target/--gguf/--device/--dtype) for --baseline engine and
    # --score-with target.
    http: HttpTarget | None = None
    weights: EngineTarget | None = None
    load: load_sweep.LoadRequest = field(default_factory=load_sweep.LoadRequest)  # the load sweep's flags

    @property
    def request_settings(self) -> HttpTarget:
        """The HTTP settings of this run: the probed server's, else the --url/--api-key flags."""
        if isinstance(self.target, HttpTarget):
            return self.target
        return self.http or HttpTarget(timeout=self.target.timeout)

    @property
    def local_weights(self) -> EngineTarget | None:
        """The deployment's weights in this process: the engine run's, else the flags' (or None)."""
        return self.target if isinstance(self.target, EngineTarget) else self.weights


@dataclass
class PreparedRun:
    plan: RunPlan
    matrix: Matrix
    cases: list[ProbeCase]
    baseline: lossless.BaselineSpec | None
    gate: gate.GateConfig | None
    notes: list[str] = field(default_factory=list)  # run-level remarks known before any request
    load: load_sweep.LoadPlan | None = None  # the load sweep, when asked for


def prepare(plan: RunPlan) -> PreparedRun:
    """Resolve the matrix and the checks; UsageError before anything is sent when they do not fit."""
    # Secrets first: any error below may quote a URL.
    baseline_url = plan.baseline[4:] if plan.baseline and plan.baseline.startswith("url:") else None
    register_secrets(plan.request_settings.api_key, plan.request_settings.url, baseline_url)
    matrix = resolve_matrix(plan.matrix)
    cases = matrix.cases()
    source = matrix.source or "<matrix>"
    if not isinstance(plan.target, HttpTarget):
        from ddtree_diag.budget import MAX_TREE_BUDGET

        # the engine verifies budget + 1 rows with a mask of that size squared: bound it as serve does
        over = sorted({c.tree_budget for c in cases if c.tree_budget is not None and c.tree_budget > MAX_TREE_BUDGET})
        if over:
            raise UsageError(f"tree budget {over[0]} is over the engine's limit {MAX_TREE_BUDGET}")
    if plan.baseline is not None:
        baseline = lossless.parse_baseline(plan.baseline)
    elif plan.gate:
        baseline = lossless.parse_baseline(matrix.baseline, f"{source}: baseline")
    else:
        baseline = None
    if plan.near_tie_gap is not None and not 0 <= plan.near_tie_gap < math.inf:
        raise UsageError(f"--near-tie-gap must be a finite number >= 0 (nats), got {plan.near_tie_gap}")
    if baseline is not None and plan.near_tie_gap is not None:
        baseline.near_tie_gap = plan.near_tie_gap
    if matrix.baseline and not (plan.gate and plan.baseline is None):
        lossless.parse_baseline(matrix.baseline, f"{source}: baseline")  # checked though this run does not use it
    notes = []
    gate_config = None
    if matrix.gate and not plan.gate:
        gate.parse_gate(matrix.gate, source)  # a probe ignores the [gate] table, but says when it is broken
    if plan.gate and matrix.gate:
        gate_config = gate.parse_gate(matrix.gate, source)
    elif plan.gate:
        # A gate that checks nothing would pass anything: check what a probe run shows.
        gate_config = gate.default_config(lossless=baseline is not None)
        notes.append(f"{source} sets no [gate] thresholds: the gate applies the default checks "
                     f"({gate.describe_config(gate_config)}); add a [gate] table for more")
    weights = plan.local_weights
    if plan.score_with == "target" and (weights is None or not weights.has_weights):
        raise UsageError("--score-with target needs the deployment's weights: --target DIR or --gguf FILE")
    if gate_config is not None and gate_config.lossless and baseline is None:
        raise UsageError(
            f"{source}: gate.lossless = true needs a baseline: add [baseline] mode = \"budget0\" "
            "(or \"url\" / \"engine\"), or pass --baseline"
        )
    load_plan = load_sweep.resolve_plan(plan.load, matrix.concurrency, matrix.load, source)
    speedup.check_config(gate_config, load_plan, baseline, remote=isinstance(plan.target, HttpTarget), source=source)
    return PreparedRun(plan, matrix, cases, baseline, gate_config, notes, load_plan)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def execute(
    run: PreparedRun, report: RunReport, on_result: OnResult | None = None, on_stage: OnStage | None = None
) -> RunReport:
    """Run every case (and the baseline) into ``report``. ``on_result`` hears of each finished
    case, ``on_stage`` of a stage starting (the baseline). KeyboardInterrupt and fatal errors
    propagate after the report is marked interrupted, so the caller can still write it."""
    report.tool_version = __version__
    report.started_at = report.started_at or _now()
    report.notes.extend(run.notes)
    backend = make_backend(run.plan.target, http=run.plan.http)
    try:
        report.notes.extend(backend.prepare(run.cases))
        report.target = backend.target_info()
        if run.matrix.source:
            report.target["matrix"] = run.matrix.source
        if run.baseline is not None:
            lossless.check_possible(run.baseline, backend)
            check_baseline_server(run, backend)
        report.notes.extend(fill_long_prompts(run.cases, backend, on_stage))
        scorer = load_scorer(run.plan, report)
        run_cases(backend, run.cases, report, concurrency=run.plan.target.concurrency, on_result=on_result,
                  scorer=scorer)
        if run.gate is not None and run.gate.canary and run.cases:
            report.canary = run_canary(backend, run.cases[0], seq=len(run.cases), scorer=scorer)
        if run.baseline is not None:
            if on_stage is not None:
                on_stage(f"baseline ({run.baseline.describe()}): running the T=0 cases without speculation")
            report.notes.extend(run_baseline(report, backend, run.baseline, run.plan))
        if run.load is not None:
            report.notes.extend(load_sweep.run_sweep(report, backend, run.baseline, run.plan, run.load, run.cases,
                                                     on_stage))
    except BaseException:
        report.interrupted = True
        report.target = report.target or backend.target_info()
        raise
    finally:
        report.finished_at = _now()
        backend.close()
    return report


def judge(report: RunReport, gate_config: gate.GateConfig | None, against: KnownGood | None = None) -> None:
    """Findings over the whole run, then the gate's thresholds (which may read the findings) and,
    with a known-good run (``gate --against``), the regression checks against it."""
    findings.analyse(report)
    if gate_config is not None:
        if against is not None:
            report.notes.extend(note for note in against_notes(report, against) if note not in report.notes)
        report.gate = gate.evaluate(report, gate_config, against)


def record_stop(report: RunReport, exc: BaseException) -> None:
    """Mark ``report`` partial and say why: Ctrl-C, a signal, an unreachable target, an error."""
    report.interrupted = True
    if isinstance(exc, Terminated):
        stop = {"reason": "terminated", "detail": exc.name, "exit_code": exc.exit_code}
    elif isinstance(exc, KeyboardInterrupt):
        stop = {"reason": "interrupted", "detail": "Ctrl-C", "exit_code": EXIT_INTERRUPTED}
    else:
        reason = getattr(exc, "stop_reason", None) or ("unreachable" if isinstance(exc, TransportError) else "error")
        code = exc.exit_code if isinstance(exc, DiagError) else EXIT_USAGE  # as the CLI exits on an internal error
        stop = {"reason": reason, "detail": one_line(exc) or type(exc).__name__, "exit_code": code}
    report.stopped = stop


def exit_code_for(report: RunReport) -> int:
    if report.interrupted:
        code = (report.stopped or {}).get("exit_code")
        return code if isinstance(code, int) and not isinstance(code, bool) else EXIT_INTERRUPTED
    if any(r.http_status in (401, 403) for r in report.results):
        return EXIT_USAGE  # credentials are configuration: pass --api-key
    if any(r.status in TRANSPORT_STATUSES for r in report.results):
        return EXIT_TRANSPORT
    if report.gate is not None:
        return EXIT_OK if report.gate.passed else EXIT_CHECK_FAILED
    failed = any(not r.ok for r in report.results)
    garbage = any(r.garbage for r in report.results)
    mismatch = any(r.baseline is not None and r.baseline.verdict == lossless.MISMATCH for r in report.results)
    return EXIT_CHECK_FAILED if failed or garbage or mismatch else EXIT_OK


# ---------------------------------------------------------------------------------------------
# Cases


def run_cases(
    backend: Backend,
    cases: list[ProbeCase],
    report: RunReport,
    *,
    concurrency: int = 1,
    on_result: OnResult | None = None,
    scorer: Any = None,
) -> RunReport:
    """Fill ``report.results`` in matrix order, each with its quality verdict (and the
    target-likelihood reasons when a scorer is given). KeyboardInterrupt propagates after the
    report is marked interrupted."""
    def finished(result: ProbeResult) -> None:
        assess_answer(result, scorer)
        if on_result is not None:
            on_result(result)

    try:
        if concurrency <= 1:
            for seq, case in enumerate(cases):
                result = backend.run(case)
                result.seq = seq
                finished(result)
                report.results.append(result)
        else:
            _run_pool(backend, cases, report, concurrency, finished)
    except KeyboardInterrupt:
        report.interrupted = True
        raise
    return report


def _run_pool(backend: Backend, cases: list[ProbeCase], report: RunReport, concurrency: int, finished) -> None:
    order = {id(case): index for index, case in enumerate(cases)}
    done: list[ProbeResult] = []
    pool = ThreadPoolExecutor(max_workers=concurrency)
    pending: set[Future] = set()
    sent = itertools.count()  # next() is atomic: the order requests actually started in

    def run_one(case: ProbeCase) -> ProbeResult:
        seq = next(sent)
        result = backend.run(case)
        result.seq = seq
        return result

    try:
        pending = {pool.submit(run_one, case) for case in cases}
        while pending:
            completed, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in completed:
                result = future.result()
                finished(result)
                done.append(result)
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        done.sort(key=lambda r: order[id(r.case)])
        report.results.extend(done)


def run_canary(backend: Backend, case: ProbeCase, seq: int, scorer: Any = None) -> ProbeResult:
    """Send the first case once more after all the others: a server that carries state from
    request to request answers it differently (text at T=0, or acceptance) the second time."""
    result = backend.run(case)
    result.seq = seq
    assess_answer(result, scorer)
    return result


def assess_answer(result: ProbeResult, scorer: Any = None) -> None:
    """The per-answer checks: the quality verdict, and the structured-output check when the case
    asks for JSON or a tool call."""
    from ddtree_diag.checks import structured
    from ddtree_diag.checks.quality import assess_result

    assess_result(result, scorer)
    result.structured = structured.check(result)
    from ddtree_diag.backends import depth

    depth.fill(result)  # acceptance by depth, from whatever shape the backend reported


# ---------------------------------------------------------------------------------------------
# Long-context prompts


def fill_long_prompts(cases: list[ProbeCase], backend: Backend, on_stage: OnStage | None = None) -> list[str]:
    """Fill every case with ``context_tokens`` to about that many tokens (a document in the
    prompt's language, the question last), counted with the target's own tokenizer where it has
    one. A fill that cannot fit the target's context is a UsageError before any case runs.
    Prefix-cache pairs get a line of their own at the top, so each pair's first request is cold."""
    wanted = [c for c in cases if c.context_tokens is not None or c.cache_role is not None]
    if not wanted:
        return []
    from ddtree_diag.workloads.filler import fill_messages

    if on_stage is not None and any(c.context_tokens for c in wanted):
        on_stage("long-context prompts: filling them with the target's tokenizer")
    limit = backend.context_limit()
    built: dict[tuple[Any, ...], Any] = {}
    estimated = set()
    for case in wanted:
        question = case.prompt_text
        messages = case.messages
        if case.cache_role is not None:
            messages = _salted(messages, case)
        if case.context_tokens is not None:
            key = (case.prompt_id, case.context_tokens, case.enable_thinking, repr(messages))
            if key not in built:
                built[key] = fill_messages(
                    messages, case.context_tokens,
                    count_tokens=lambda m, thinking=case.enable_thinking: backend.count_tokens(m, thinking),
                )
            filled = built[key]
            messages = filled.messages
            case.fill = {"tokens": filled.tokens, "estimated": filled.estimated, "language": filled.language,
                         "question": question}
            if filled.estimated:
                estimated.add(case.prompt_id)
            if limit is not None and filled.tokens + case.max_tokens > limit:
                raise UsageError(
                    f"prompt {case.prompt_id} filled to {filled.tokens} tokens + max_tokens {case.max_tokens} is "
                    f"beyond the target's context of {limit} tokens: choose a smaller --fill (or fill_tokens)"
                )
        case.messages = messages
    notes = []
    if estimated:
        notes.append(f"long-context prompts ({', '.join(sorted(estimated))}): token counts are estimated "
                     "(the server has no tokenizer endpoint)")
    return notes


def _salted(messages: list[dict[str, Any]], case: ProbeCase) -> list[dict[str, Any]]:
    """The messages with a line naming the pair at the very top: another pair (another budget,
    thinking mode or repeat) of the same prompt must not warm this pair's first request."""
    import zlib

    tag = f"{zlib.crc32(case.case_id.replace('/cache=repeat/', '/cache=first/').encode()):08x}"
    out = [dict(m) for m in messages]
    index = 0 if out[0].get("role") == "system" else None
    if index is None:
        out.insert(0, {"role": "system", "content": f"Session {tag}."})
    else:
        out[0]["content"] = f"Session {tag}. " + str(out[0].get("content") or "")
    return out


def load_scorer(plan: RunPlan, report: RunReport) -> Any:
    """The --score-with model, loaded once (slow: a model load). The greedy check needs the
    deployment's own weights: ``target``, or ``embedded`` when the target serves the embedded
    model."""
    if not plan.score_with:
        return None
    from ddtree_diag.checks.likelihood import EMBEDDED, scorer_for
    from ddtree_diag.engine.models import EMBEDDED_MODEL_NAME

    spec = plan.score_with
    weights = plan.local_weights or EngineTarget()
    if spec == "target":
        path, own = weights.target or weights.gguf, True
    elif spec == EMBEDDED:
        path, own = EMBEDDED, report.target.get("model") == EMBEDDED_MODEL_NAME
    else:
        path, own = spec, spec in (weights.target, weights.gguf)
    scorer = scorer_for(str(path), own_weights=own, device=weights.device)
    greedy = "with the greedy check at T=0" if own else "likelihood only (not the deployment's weights)"
    report.notes.append(f"answers scored with {scorer.name} ({greedy})")
    return scorer


# ---------------------------------------------------------------------------------------------
# The lossless baseline


def check_baseline_server(run: PreparedRun, backend: Backend) -> None:
    """A ``url:`` baseline is asked what it serves before the first case is sent: an unreachable
    one, or one that refuses the key, ends the run at once (exit 3 / 2), not after every case ran."""
    spec = run.baseline
    if spec is None or spec.mode != "url" or not any(case.temperature == 0 for case in run.cases):
        return
    where = backend.baseline_target(spec.mode, spec.url, http=run.plan.request_settings,
                                    weights=run.plan.local_weights)
    if not isinstance(where, HttpTarget):
        return
    shared = backend.shared_transport()
    probe = make_backend(where, transport=shared)
    try:
        probe.prepare([lossless.baseline_case(case, spec, logprobs=False) for case in run.cases[:1]])
    except (TransportError, UsageError) as exc:
        raise type(exc)(f"--baseline {spec.describe()}: {exc}") from None
    finally:
        probe.close()


def run_baseline(report: RunReport, backend: Backend, spec: lossless.BaselineSpec, plan: RunPlan) -> list[str]:
    """Fill ``result.baseline`` for every result; returns notes for the report. The backend says
    where its baseline runs (``Backend.baseline_target``: itself at budget 0, the same server, a
    second server or the engine)."""
    to_compare = []
    for result in report.results:
        reason = lossless.skip_reason(result)
        if reason is None:
            to_compare.append(result)
        else:
            result.baseline = BaselineComparison(mode=spec.mode, verdict=SKIPPED, detail=reason)
    if not to_compare:
        return [f"baseline ({spec.describe()}): no T=0 case to compare"]
    where = backend.baseline_target(spec.mode, spec.url, http=plan.request_settings, weights=plan.local_weights)
    # With --via the baseline is requested from the far side too: share the agent.
    shared = backend.shared_transport() if isinstance(where, HttpTarget) else None
    base_backend = backend if where is None else make_backend(where, transport=shared)
    notes: list[str] = []
    ask_logprobs = base_backend.openai_logprobs
    cache: dict[str, ProbeResult] = {}
    try:
        if base_backend is not backend:
            cases = [lossless.baseline_case(r.case, spec, logprobs=ask_logprobs) for r in to_compare]
            prepared = base_backend.prepare(cases)
            if spec.mode != "budget0":  # same server: its model and dialect are already noted
                notes.extend(f"baseline {n}" for n in prepared)
        for result in to_compare:
            # Repeats, and budgets the baseline does not use, share one baseline request:
            # greedy decoding without speculation is deterministic.
            key = lossless.baseline_case(result.case, spec, logprobs=False).group_key
            if key not in cache:
                cache[key] = _run_baseline_case(base_backend, result.case, spec, ask_logprobs)
                if result.case.cache_role is not None:
                    # the prefix-cache rules compare the baseline's pair with the speculative one
                    cache[key].extras["baseline_of"] = result.case_id
                    report.baseline_probes.append(cache[key])
            result.baseline = lossless.compare_result(result, cache[key], spec)
    finally:
        if base_backend is not backend:
            base_backend.close()
    if any(r.extras.get("logprobs_rejected") for r in cache.values()):
        notes.append("baseline server refused logprobs: divergences cannot be classified as near-ties")
    notes.append(lossless.summary_note(spec, to_compare))
    return notes


def _run_baseline_case(
    backend: Backend, case: ProbeCase, spec: lossless.BaselineSpec, ask_logprobs: bool
) -> ProbeResult:
    result = backend.run(lossless.baseline_case(case, spec, logprobs=ask_logprobs))
    if ask_logprobs and lossless.logprobs_refused(result):
        result = backend.run(lossless.baseline_case(case, spec, logprobs=False))
        result.extras["logprobs_rejected"] = True
    return result
