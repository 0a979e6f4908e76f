"""``probe`` and ``gate``: run a matrix, render it, write the reports, return the exit code.

Both take the same option set (``options.run_options``); gate adds a required MATRIX argument
and applies its ``[gate]`` thresholds. The work itself is the orchestrator's.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import typer

from ddtree_diag.commands.options import CHECKS_PANEL, RunFlags, run_options

if TYPE_CHECKING:
    from ddtree_diag.records import FleetReport, RunReport
    from ddtree_diag.targets import TargetSpec


# The matrices shipped in ddtree_diag/matrices (a test keeps this in step with the folder).
BUILTINS = "smoke, gate, workloads"


def register(app: typer.Typer) -> None:
    @app.command()
    @run_options
    def probe(
        flags: RunFlags,
        matrix: str | None = typer.Option(
            None, "--matrix", "-m",
            help=f"Matrix TOML file, or a built-in name ({BUILTINS}). \\[default: smoke; none with --prompt]",
        ),
    ) -> None:
        """Run a probe matrix against a server (--url) or the in-process engine (--engine)."""
        raise typer.Exit(run_matrix(flags, matrix, gate=False))

    @app.command()
    @run_options
    def gate(
        flags: RunFlags,
        matrix: str = typer.Argument(..., help=f"Matrix TOML with a \\[gate] table, or a built-in name ({BUILTINS})."),
        against: str | None = typer.Option(
            None, "--against", metavar="KNOWN_GOOD.json", rich_help_panel=CHECKS_PANEL,
            help="Also fail on a regression against a saved JSON report of a good run: cases that now fail or "
            "are garbage, T=0 text changes, acceptance and tok/s beyond noise-aware tolerances."),
    ) -> None:
        """Run a matrix and apply its \\[gate] thresholds: exit 0 pass, 1 fail (2 usage, 3 unreachable)."""
        raise typer.Exit(run_matrix(flags, matrix, gate=True, against=against))


def plan_from(flags: RunFlags, matrix: str | None, *, gate: bool, spec: TargetSpec | None = None) -> object:
    """The run's plan from its flags; ``spec``: one target of a fleet (its settings win)."""
    from ddtree_diag import jsonsafe
    from ddtree_diag.backends import EngineTarget, HttpTarget
    from ddtree_diag.backends.http import parse_size
    from ddtree_diag.load import LoadRequest, parse_concurrency_flag
    from ddtree_diag.matrix import MatrixRequest
    from ddtree_diag.orchestrator import RunPlan
    from ddtree_diag.redaction import clean_api_key

    url = spec.url if spec is not None else (flags.url or [None])[0]
    # Text that goes onto the wire must be Unicode: argv bytes that are not UTF-8 arrive as lone
    # surrogates and would fail deep inside the HTTP client.
    sent = [("--url", url), ("--model", flags.model), ("--api-key", flags.api_key)]
    for flag, value in sent + [("--prompt", prompt) for prompt in flags.prompt or []]:
        if value is not None and jsonsafe.has_surrogates(value):
            from ddtree_diag.errors import UsageError

            raise UsageError(f"{flag} is not valid UTF-8")
    concurrency, levels = parse_concurrency_flag(flags.concurrency)
    api_key = clean_api_key(flags.api_key)
    if spec is not None and spec.api_key_env:
        api_key = clean_api_key(spec.api_key, f"api_key_env {spec.api_key_env}") or api_key
    http = HttpTarget(
        url=url, via=flags.via, model=flags.model, dialect=flags.dialect, api_key=api_key,
        timeout=flags.timeout, max_response_bytes=parse_size(flags.max_response_bytes), stream=flags.stream,
        concurrency=concurrency,
    )
    baseline = flags.baseline
    if spec is not None:
        http = http.replace(
            via=spec.via, model=spec.model, dialect=spec.dialect or "auto", api_key=api_key,
            timeout=spec.timeout if spec.timeout is not None else flags.timeout, stream=spec.stream is not False,
            max_response_bytes=parse_size(spec.max_response_bytes or flags.max_response_bytes),
        )
        baseline = spec.baseline
    weights = EngineTarget(target=flags.target, gguf=flags.gguf, draft=flags.draft, device=flags.device,
                           dtype=flags.dtype, timeout=flags.timeout, concurrency=concurrency, devices=flags.devices)
    # --engine runs the cases in process; the other kind's flags serve the baseline and the scorer.
    target, other = (weights, {"http": http}) if flags.engine else (http, {"weights": weights})
    request = MatrixRequest(
        matrix=matrix, prompts=list(flags.prompt or []), thinking=flags.thinking, budget=flags.budget,
        temperature=flags.temperature, max_tokens=flags.max_tokens, repeat=flags.repeat,
        fill=flags.fill,
    )
    load = LoadRequest(levels=levels, seconds=flags.load_seconds, requests=flags.load_requests)
    return RunPlan(target=target, matrix=request, baseline=baseline, near_tie_gap=flags.near_tie_gap, gate=gate,
                   score_with=flags.score_with, load=load, **other)


def check_outputs(flags: RunFlags) -> None:
    """Every output path must be writable before the run starts (exit 2 at once, one line)."""
    from ddtree_diag.errors import UsageError
    from ddtree_diag.output.reportfile import check_writable

    seen: dict[str, str] = {}
    for path, flag in ((flags.json_path, "--json"), (flags.junit, "--junit"), (flags.summary, "--summary"),
                       (flags.html, "--html")):
        if path is None:
            continue
        if not path.strip():
            raise UsageError(f"{flag} needs a file path (got an empty one)")
        if path == "-" and flag != "--json":
            raise UsageError(f"{flag} takes a file path: only --json writes to stdout (-)")
        if path in seen:
            raise UsageError(f"{seen[path]} and {flag} both write {path}: give each its own file")
        seen[path] = flag
        check_writable(path, flag)


class _SignalWatch:
    """What ``signals_as_interrupts`` yields: ``defer()`` stops raising and only remembers a
    later signal in ``signal`` (the run ended; its reports are being written)."""

    def __init__(self) -> None:
        self.deferred = False
        self.signal: int | None = None

    def defer(self) -> None:
        self.deferred = True

    def handle(self, signum: int, frame: object) -> None:
        from ddtree_diag.errors import Terminated

        if self.deferred:
            self.signal = self.signal or signum
            return
        raise Terminated(signum, signal.Signals(signum).name)


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[_SignalWatch]:
    """SIGTERM (CI cancel, ``timeout``, a container stop) and SIGHUP (the SSH session closed)
    end a run as Ctrl-C does: what finished is judged, rendered and written. Main thread only."""
    watch = _SignalWatch()
    if threading.current_thread() is not threading.main_thread():
        yield watch
        return
    wanted = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {signum: signal.signal(signum, watch.handle) for signum in wanted}
    try:
        yield watch
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_matrix(flags: RunFlags, matrix: str | None, *, gate: bool, against: str | None = None) -> int:
    """Run the matrix, write the reports, render. Returns the exit code; DiagError propagates
    (exit 2/3). ``against``: a known-good JSON report to judge the run against (gate)."""
    if flags.targets or len(flags.url or []) > 1:
        return run_fleet(flags, matrix, gate=gate, against=against)
    if flags.deadline is not None:
        from ddtree_diag.errors import UsageError

        raise UsageError("--deadline is for fleets (--targets FILE or several --url): one run's requests each "
                         "time out at --timeout")
    from ddtree_diag import orchestrator
    from ddtree_diag.output.console import make_console, progress, render_report, silence_stdout
    from ddtree_diag.output.reportfile import is_stdout, write_report
    from ddtree_diag.records import RunReport

    json_to_stdout = is_stdout(flags.json_path)
    # With --json -, stdout carries JSON alone; the table goes to stderr.
    console = make_console(sys.stderr if json_to_stdout else sys.stdout, no_color=flags.no_color)
    status_console = make_console(sys.stderr, no_color=flags.no_color)
    prepared = orchestrator.prepare(plan_from(flags, matrix, gate=gate))  # type: ignore[arg-type]
    check_outputs(flags)
    known_good = None
    if against is not None:  # like the output paths: a bad file is exit 2 before any request
        from ddtree_diag.checks.against import check_cases_match, load_known_good

        known_good = load_known_good(against)
        check_cases_match(known_good, [case.case_id for case in prepared.cases])
    report = RunReport()
    tracker = progress(status_console, len(prepared.cases), quiet=flags.quiet)
    stopped_by: BaseException | None = None
    with signals_as_interrupts() as late:
        try:
            with tracker as advance:
                orchestrator.execute(prepared, report, on_result=advance, on_stage=tracker.note)
        except BaseException as exc:  # Ctrl-C, a signal, an unreachable target, a bug: keep what finished
            orchestrator.record_stop(report, exc)
            stopped_by = exc
        late.defer()  # from here a signal waits until every report is written
        try:
            orchestrator.judge(report, prepared.gate, known_good)
        except Exception:
            if stopped_by is None:
                raise
            # a partial report that cannot be judged is still written, and says why it stopped
        code = orchestrator.exit_code_for(report)
        # Files first: a reader that closes stdout early (``| head``) must not cost the reports.
        failures = write_outputs(report, flags, code, gate=gate)
        try:
            render_report(console, report, code)
            if json_to_stdout:
                write_report(report, "-")
        except BrokenPipeError:
            silence_stdout()
    return _ended(stopped_by, late, failures, code)


def write_outputs(report: RunReport | FleetReport, flags: RunFlags, code: int, *, gate: bool) -> list[str]:
    """Write the report files a run or a fleet asked for (JSON, JUnit, Markdown summary, HTML).
    Every one is attempted; returns the one-line errors of those that could not be written."""
    from ddtree_diag.errors import DiagError
    from ddtree_diag.output.reportfile import is_stdout, write_report
    from ddtree_diag.records import FleetReport

    if isinstance(report, FleetReport):
        from ddtree_diag.output import fleetview

        junit, summary, html = fleetview.write_fleet_junit, fleetview.write_fleet_summary, fleetview.write_html_fleet
    else:
        from ddtree_diag.output import junit as junit_module
        from ddtree_diag.output import markdown
        from ddtree_diag.output.html import write_html

        junit, summary, html = junit_module.write_junit, markdown.write_summary, write_html
    writers = []
    if flags.json_path and not is_stdout(flags.json_path):
        writers.append(lambda: write_report(report, flags.json_path))
    if flags.junit:
        writers.append(lambda: junit(report, flags.junit))
    if gate or flags.summary:
        writers.append(lambda: summary(report, flags.summary, code))
    if flags.html:
        writers.append(lambda: html(report, flags.html, code))
    failures: list[str] = []
    for write in writers:
        try:
            write()
        except DiagError as exc:
            failures.append(str(exc))
    return failures


def _ended(stopped_by: BaseException | None, late: _SignalWatch, failures: list[str], code: int) -> int:
    """After the reports are written: re-raise a stop that was not Ctrl-C or a signal (the CLI
    prints it as one line, with its exit code), say a signal ended the run, and fail a run whose
    reports could not be written (exit 2: nothing passes a CI gate without its report)."""
    from ddtree_diag.errors import Terminated, UsageError

    if stopped_by is not None and not isinstance(stopped_by, KeyboardInterrupt):
        for failure in failures:
            sys.stderr.write(f"ddtree-diag: error: {failure}\n")
        raise stopped_by
    if isinstance(stopped_by, Terminated):
        sys.stderr.write(f"ddtree-diag: terminated by {stopped_by.name}\n")
    if late.signal is not None:
        code = 128 + late.signal
    if failures:
        raise UsageError("; ".join(failures))
    return code


# ---------------------------------------------------------------------------------------------
# Fleets


def fleet_specs(flags: RunFlags) -> list[TargetSpec]:
    """The fleet's targets: the --targets file's, or one per --url. The flags given on the command
    line are every target's settings unless the target sets its own."""
    from ddtree_diag import targets
    from ddtree_diag.errors import UsageError

    if flags.engine:
        raise UsageError("a fleet is a set of servers: --engine cannot be combined with --targets or several --url")
    defaults = RunFlags()
    given = {
        "via": flags.via, "model": flags.model, "baseline": flags.baseline, "deadline": flags.deadline,
        "dialect": flags.dialect if flags.dialect != defaults.dialect else None,
        "timeout": flags.timeout if flags.timeout != defaults.timeout else None,
        "stream": False if not flags.stream else None,
        "max_response_bytes": flags.max_response_bytes if flags.max_response_bytes != defaults.max_response_bytes
        else None,
    }
    overrides = {key: value for key, value in given.items() if value is not None}
    if flags.targets:
        if flags.url:
            raise UsageError("give either --targets FILE or --url (DDTREE_DIAG_URL), not both")
        return targets.load_targets(flags.targets, overrides)
    return targets.from_urls(list(flags.url or []), overrides)


def run_fleet(flags: RunFlags, matrix: str | None, *, gate: bool, against: str | None = None) -> int:
    """``probe``/``gate`` over a fleet: every target in parallel (at most --parallel), then the
    fleet table, the cross-target findings and the fleet's exit code (the worst of its targets')."""
    from ddtree_diag import fleet, orchestrator
    from ddtree_diag.output import fleetview
    from ddtree_diag.output.console import make_console, progress, silence_stdout
    from ddtree_diag.output.reportfile import is_stdout, write_report
    from ddtree_diag.records import FleetReport

    specs = fleet_specs(flags)
    prepared = fleet.prepare(specs, lambda spec: plan_from(flags, matrix, gate=gate, spec=spec),  # type: ignore[arg-type,return-value]
                             gate=gate, parallel=flags.parallel, against=against)
    check_outputs(flags)
    json_to_stdout = is_stdout(flags.json_path)
    console = make_console(sys.stderr if json_to_stdout else sys.stdout, no_color=flags.no_color)
    status_console = make_console(sys.stderr, no_color=flags.no_color)
    report = FleetReport()
    tracker = progress(status_console, prepared.total_cases, quiet=flags.quiet)
    stopped_by: BaseException | None = None
    with signals_as_interrupts() as late:
        try:
            with tracker as advance:
                fleet.execute(prepared, report, on_result=lambda name, result: advance(result, target=name),
                              on_stage=lambda name, text: tracker.note(f"{name}: {text}"))
        except BaseException as exc:  # Ctrl-C or a signal: every target keeps what it finished
            orchestrator.record_stop(report, exc)  # type: ignore[arg-type]
            stopped_by = exc
        late.defer()
        first_gate = prepared.targets[0].run.gate if prepared.targets else None
        fleet.judge(report, gate=gate, fail_on=first_gate.fail_on_findings if first_gate is not None else None)
        code = fleet.exit_code_for(report)
        failures = write_outputs(report, flags, code, gate=gate)
        try:
            fleetview.render_fleet(console, report, code, detail=flags.detail)
            if json_to_stdout:
                write_report(report, "-")
        except BrokenPipeError:
            silence_stdout()
    return _ended(stopped_by, late, failures, code)
