"""The ``probe`` job: matrix -> backend -> checks -> render + JSON, and its exit code.

Kept apart from cli.py so other commands (gate, demo) reuse it and tests can call it directly.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ddtree_diag import findings, formats, gate, lossless
from ddtree_diag.errors import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TRANSPORT,
    UsageError,
)
from ddtree_diag.matrix import Matrix, apply_overrides, load_matrix
from ddtree_diag.records import TRANSPORT_STATUSES, RunReport

DEFAULT_MATRIX = "smoke"


@dataclass
class ProbeOptions:
    """Everything the probe command was asked for (CLI flags, already typed)."""

    url: str | None = None
    model: str | None = None
    prompts: list[str] = field(default_factory=list)
    thinking: str | None = None
    budget: str | None = None
    temperature: str | None = None
    max_tokens: str | None = None
    repeat: int | None = None
    matrix: str | None = None
    dialect: str = "auto"
    api_key: str | None = None
    timeout: float = 120.0
    stream: bool = True
    concurrency: int = 1
    json_path: str | None = None
    no_color: bool = False
    via: str | None = None  # command prefix: run the HTTP requests from its far side (ssh, pct exec...)
    # in-process engine instead of a URL
    engine: bool = False
    target: str | None = None
    gguf: str | None = None
    draft: str | None = None
    device: str | None = None
    dtype: str | None = None
    # checks after the run (issue 7)
    baseline: str | None = None  # budget0 | url:URL | engine; the gate also reads [baseline]
    near_tie_gap: float | None = None
    gate: bool = False  # apply the matrix's [gate] thresholds (the gate command)
    junit_path: str | None = None
    summary_path: str | None = None


def builtin_matrix_path(name: str) -> Path | None:
    """Matrices shipped with the tool (the repo's probes/ folder), by bare name."""
    # A checkout first (the probes/ folder next to the package), then the installed package data.
    local = Path(__file__).resolve().parent.parent / "probes" / f"{name}.toml"
    if local.is_file():
        return local
    try:
        candidate = resources.files("ddtree_diag.probes") / f"{name}.toml"
    except ModuleNotFoundError:
        return None
    return Path(str(candidate)) if candidate.is_file() else None


def _builtin_from_zipapp(name: str) -> Matrix:
    """A built-in matrix read as a zip member (the single-file build), where no real path exists."""
    from ddtree_diag.matrix import matrix_from_dict, tomllib

    candidate = resources.files("ddtree_diag.probes") / f"{name}.toml"
    return matrix_from_dict(tomllib.loads(candidate.read_text(encoding="utf-8")), source=f"{name} (built-in)")


def resolve_matrix(options: ProbeOptions) -> Matrix:
    """The matrix file (path or built-in name) with flag overrides applied."""
    spec = options.matrix
    if spec is None and not options.prompts:
        spec = DEFAULT_MATRIX
    if spec is None:
        matrix = Matrix()
    else:
        path = Path(spec)
        builtin = None
        if not path.exists() and os.sep not in spec and not spec.endswith(".toml"):
            builtin = builtin_matrix_path(spec)
            if builtin is None:
                raise UsageError(f"matrix {spec!r} is neither a file nor a built-in matrix")
            path = builtin
        zipped = builtin is not None and not builtin.is_file()
        matrix = _builtin_from_zipapp(spec) if zipped else load_matrix(path)
    return apply_overrides(
        matrix,
        prompts=options.prompts,
        thinking=options.thinking,
        budget=options.budget,
        temperature=options.temperature,
        max_tokens=options.max_tokens,
        repeat=options.repeat,
    )


def make_backend(options: ProbeOptions) -> Any:
    if options.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    if options.engine:
        if options.url:
            raise UsageError("give either --url or --engine, not both")
        if options.via is not None:
            raise UsageError("--via works with --url only (the engine runs in this process)")
        from ddtree_diag.backends.engine import EngineBackend
        from ddtree_diag.models import choose_models

        choice = choose_models(options.target, options.draft, options.gguf)
        return EngineBackend(
            target=choice.target,
            draft=choice.draft,
            gguf_file=choice.gguf_file,
            device=options.device,
            dtype=options.dtype,
        )
    if not options.url:
        raise UsageError("no target: give --url URL (or set DDTREE_DIAG_URL), or --engine")
    from ddtree_diag.backends.http import HttpBackend

    transport = None
    if options.via is not None:
        from ddtree_diag.via import AgentTransport

        # The far side's interpreter: python3 unless told (e.g. /opt/conda/bin/python).
        transport = AgentTransport(options.via, python=os.environ.get("DDTREE_DIAG_VIA_PYTHON") or "python3")
    backend = HttpBackend(
        options.url,
        model=options.model,
        dialect=options.dialect,
        api_key=options.api_key,
        timeout=options.timeout,
        stream=options.stream,
        concurrency=options.concurrency,
        transport=transport,
    )
    if transport is not None:
        try:
            transport.start(timeout=max(options.timeout, 30.0))  # ssh may take a while to log in
        except BaseException:
            backend.close()
            raise
    return backend


def exit_code_for(report: RunReport) -> int:
    if report.interrupted:
        return EXIT_INTERRUPTED
    if any(r.status in TRANSPORT_STATUSES for r in report.results):
        return EXIT_TRANSPORT
    if report.gate is not None:
        return EXIT_OK if report.gate.get("passed") else EXIT_CHECK_FAILED
    failed = any(not r.ok for r in report.results)
    garbage = any(r.quality and r.quality.get("garbage") for r in report.results)
    mismatch = any(r.baseline and r.baseline.get("verdict") == "mismatch" for r in report.results)
    return EXIT_CHECK_FAILED if failed or garbage or mismatch else EXIT_OK


def run_probe(options: ProbeOptions) -> int:
    """Run the probe and render it. Returns the exit code; DiagError propagates (exit 2/3)."""
    from ddtree_diag.render import make_console, render_report
    from ddtree_diag.report import write_report
    from ddtree_diag.runner import run_cases

    json_to_stdout = options.json_path == "-"
    # With --json -, stdout carries JSON alone; the table goes to stderr.
    console = make_console(sys.stderr if json_to_stdout else sys.stdout, no_color=options.no_color)
    status_console = make_console(sys.stderr, no_color=options.no_color)
    matrix = resolve_matrix(options)
    cases = matrix.cases()
    baseline, gate_config = resolve_checks(options, matrix)
    backend = make_backend(options)
    report = RunReport()
    try:
        report.notes.extend(backend.prepare(cases))
        report.target = backend.target_info()
        if matrix.source:
            report.target["matrix"] = matrix.source
        if baseline is not None:
            lossless.check_possible(baseline, backend)
        with _progress(status_console, len(cases)) as advance:
            run_cases(backend, cases, report, concurrency=options.concurrency, on_result=advance)
        if baseline is not None:
            report.notes.extend(lossless.run_baseline(report, backend, baseline, options))
    except KeyboardInterrupt:
        report.interrupted = True
    except BaseException:
        # A fatal error mid-run: keep what finished, then let the CLI report the error.
        report.interrupted = True
        report.target = report.target or backend.target_info()
        if options.json_path:
            write_report(report, options.json_path)
        raise
    finally:
        backend.close()
    findings.analyse(report)
    if gate_config is not None:
        report.gate = gate.evaluate(report, gate_config)
    code = exit_code_for(report)
    render_report(console, report, code)
    if options.json_path:
        write_report(report, options.json_path)
    if options.junit_path:
        formats.write_junit(report, options.junit_path)
    if options.gate or options.summary_path:
        formats.write_summary(report, options.summary_path, code)
    return code


def resolve_checks(
    options: ProbeOptions, matrix: Matrix
) -> tuple[lossless.BaselineSpec | None, gate.GateConfig | None]:
    """The baseline (--baseline, or the matrix's [baseline] for the gate) and the gate config;
    UsageError before anything is sent when they do not fit together."""
    source = matrix.source or "<matrix>"
    if options.baseline is not None:
        baseline = lossless.parse_baseline(options.baseline)
    elif options.gate:
        baseline = lossless.parse_baseline(matrix.baseline, f"{source}: baseline")
    else:
        baseline = None
    if baseline is not None and options.near_tie_gap is not None:
        if options.near_tie_gap < 0:
            raise UsageError("--near-tie-gap must be >= 0 (nats)")
        baseline.near_tie_gap = options.near_tie_gap
    gate_config = gate.parse_gate(matrix.gate, source) if options.gate else None
    if gate_config is not None and gate_config.lossless and baseline is None:
        raise UsageError(
            f"{source}: gate.lossless = true needs a baseline: add [baseline] mode = \"budget0\" "
            "(or \"url\" / \"engine\"), or pass --baseline"
        )
    return baseline, gate_config


class _progress:
    """A transient progress bar on a terminal for multi-case runs; a no-op elsewhere."""

    def __init__(self, console, total: int) -> None:
        self.console = console
        self.total = total
        self.progress = None

    def __enter__(self):
        if self.total <= 1 or not self.console.is_terminal:
            return lambda result: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("probing"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.description}"), console=self.console, transient=True,
        )  # fmt: skip
        self.progress.start()
        task = self.progress.add_task("", total=self.total)

        def advance(result) -> None:
            self.progress.update(task, advance=1, description=result.case_id)

        return advance

    def __exit__(self, *exc_info) -> None:
        if self.progress is not None:
            self.progress.stop()
