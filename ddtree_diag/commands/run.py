"""``probe`` and ``gate``: run a matrix, render it, write the reports, return the exit code.

Both take the same option set (``options.run_options``); gate adds a required MATRIX argument
and applies its ``[gate]`` thresholds. The work itself is the orchestrator's.
"""

from __future__ import annotations

import sys

import typer

from ddtree_diag.commands.options import RunFlags, run_options


def register(app: typer.Typer) -> None:
    @app.command()
    @run_options
    def probe(
        flags: RunFlags,
        matrix: str | None = typer.Option(
            None, "--matrix", "-m", help="Matrix TOML file, or a built-in name (smoke, gate). \\[default: smoke]"
        ),
    ) -> None:
        """Run a probe matrix against a server (--url) or the in-process engine (--engine)."""
        raise typer.Exit(run_matrix(flags, matrix, gate=False))

    @app.command()
    @run_options
    def gate(
        flags: RunFlags,
        matrix: str = typer.Argument(..., help="Matrix TOML with a \\[gate] table, or a built-in name (gate)."),
    ) -> None:
        """Run a matrix and apply its \\[gate] thresholds: exit 0 pass, 1 fail (2 usage, 3 unreachable)."""
        raise typer.Exit(run_matrix(flags, matrix, gate=True))


def plan_from(flags: RunFlags, matrix: str | None, *, gate: bool) -> object:
    from ddtree_diag.backends import TargetSpec
    from ddtree_diag.matrix import MatrixRequest
    from ddtree_diag.orchestrator import RunPlan

    target = TargetSpec(
        url=flags.url, via=flags.via, model=flags.model, dialect=flags.dialect, api_key=flags.api_key,
        timeout=flags.timeout, stream=flags.stream, concurrency=flags.concurrency, engine=flags.engine,
        target=flags.target, gguf=flags.gguf, draft=flags.draft, device=flags.device, dtype=flags.dtype,
    )  # fmt: skip
    request = MatrixRequest(
        matrix=matrix, prompts=list(flags.prompt or []), thinking=flags.thinking, budget=flags.budget,
        temperature=flags.temperature, max_tokens=flags.max_tokens, repeat=flags.repeat,
    )  # fmt: skip
    return RunPlan(target=target, matrix=request, baseline=flags.baseline, near_tie_gap=flags.near_tie_gap, gate=gate,
                   score_with=flags.score_with)  # fmt: skip


def run_matrix(flags: RunFlags, matrix: str | None, *, gate: bool) -> int:
    """Run the matrix and render it. Returns the exit code; DiagError propagates (exit 2/3)."""
    from ddtree_diag import orchestrator
    from ddtree_diag.output import junit, markdown
    from ddtree_diag.output.console import make_console, progress, render_report
    from ddtree_diag.output.reportfile import write_report
    from ddtree_diag.records import RunReport

    json_to_stdout = flags.json_path == "-"
    # With --json -, stdout carries JSON alone; the table goes to stderr.
    console = make_console(sys.stderr if json_to_stdout else sys.stdout, no_color=flags.no_color)
    status_console = make_console(sys.stderr, no_color=flags.no_color)
    prepared = orchestrator.prepare(plan_from(flags, matrix, gate=gate))  # type: ignore[arg-type]
    report = RunReport()
    try:
        with progress(status_console, len(prepared.cases)) as advance:
            orchestrator.execute(prepared, report, on_result=advance)
    except KeyboardInterrupt:
        pass  # execute marked the report interrupted; render and write what finished
    except BaseException:
        # A fatal error mid-run: keep what finished, then let the CLI report the error.
        if flags.json_path:
            write_report(report, flags.json_path)
        raise
    orchestrator.judge(report, prepared.gate)
    code = orchestrator.exit_code_for(report)
    render_report(console, report, code)
    if flags.json_path:
        write_report(report, flags.json_path)
    if flags.junit:
        junit.write_junit(report, flags.junit)
    if gate or flags.summary:
        markdown.write_summary(report, flags.summary, code)
    return code
