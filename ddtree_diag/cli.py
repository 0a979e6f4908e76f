"""Command-line interface (typer). Thin: parse flags, call the module that does the work.

Heavy modules (httpx, torch, transformers) are imported inside commands, so ``--help`` and the
remote path start fast. Errors become one line on stderr and a documented exit code.
"""

from __future__ import annotations

import sys
import traceback

import typer

from ddtree_diag import __version__
from ddtree_diag.errors import EXIT_INTERRUPTED, EXIT_USAGE, DiagError

app = typer.Typer(
    name="ddtree-diag",
    help="Is this speculative-decoding deployment healthy? Probe it, check its text, gate on it.\n\n"
    "Exit codes: 0 ok · 1 a check failed · 2 usage/config error · 3 target unreachable · "
    "130 interrupted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_DEBUG_HELP = "Show tracebacks instead of one-line errors."
_DEBUG = typer.Option(False, "--debug", help=_DEBUG_HELP)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ddtree-diag {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
    debug: bool = _DEBUG,
) -> None:
    """ddtree-diag"""


# Options shared by the commands that run a matrix (probe, gate).
_URL = typer.Option(None, "--url", envvar="DDTREE_DIAG_URL", show_envvar=True,
                    help="Base URL of the OpenAI-compatible server (with or without /v1).")  # fmt: skip
_VIA = typer.Option(None, "--via", envvar="DDTREE_DIAG_VIA", show_envvar=True,
                    help="Make the requests from the far side of this command prefix, e.g. "
                    "\"ssh root@gpu-host pct exec 200 --\" (needs python3 >= 3.8 there, nothing else).")  # fmt: skip
_BASELINE_HELP = ("Lossless check at T=0 against a non-speculative baseline: budget0 (same server, "
                  "tree_budget=0), url:URL (a server without speculation) or engine (target alone).")
_NEAR_TIE_HELP = "Top-2 logprob gap (nats) under which a T=0 divergence is a numerics near-tie (default 0.05)."
_API_KEY = typer.Option(None, "--api-key", envvar=["DDTREE_DIAG_API_KEY", "OPENAI_API_KEY"],
                        show_default=False, show_envvar=True,
                        help="Bearer token (never printed or saved).")  # fmt: skip

# Options shared by several commands (typer only reads these defaults).
_NO_COLOR = typer.Option(False, "--no-color", help="No colour (NO_COLOR is honoured too).")
_NEAR_TIE_GAP = typer.Option(None, "--near-tie-gap", help=_NEAR_TIE_HELP)
_ENGINE = typer.Option(False, "--engine", help="Run in-process (HF target + DFlash draft).")
_ENGINE_TARGET = typer.Option(None, "--target", help="Engine: target HF model dir.")
_ENGINE_GGUF = typer.Option(None, "--gguf", help="Engine: target GGUF file.")
_ENGINE_DRAFT = typer.Option(None, "--draft", help="Engine: DFlash draft dir (z-lab format).")
_ENGINE_DEVICE = typer.Option(None, "--device", help="Engine: cuda or cpu (default: cuda if present).")
_ENGINE_DTYPE = typer.Option(None, "--dtype", help="Engine: bf16, fp16 or fp32.")
_TARGET = typer.Option(None, "--target", help="Target HF model dir (default: embedded SmolLM2).")
_GGUF = typer.Option(None, "--gguf", help="Target GGUF file.")
_DRAFT = typer.Option(None, "--draft", help="DFlash draft dir (default: the embedded one).")
_DEVICE = typer.Option(None, "--device", help="cuda or cpu (default: cuda if present).")
_DTYPE = typer.Option(None, "--dtype", help="bf16, fp16 or fp32.")


@app.command()
def probe(
    url: str | None = _URL,
    via: str | None = _VIA,
    model: str | None = typer.Option(None, "--model", help="Model id (default: first from /v1/models)."),
    prompt: list[str] | None = typer.Option(
        None, "--prompt", "-p",
        help="Prompt: literal text, @file (text or JSON messages), or a prompt id from --matrix. Repeatable.",
    ),
    thinking: str | None = typer.Option(None, "--thinking",
                                           help="enable_thinking values, e.g. off,on (default off,on)."),
    budget: str | None = typer.Option(None, "--budget",
                                         help="Tree budgets, e.g. 16,64 ('default' = server's own)."),
    temperature: str | None = typer.Option(None, "--temperature", help="Temperature(s), e.g. 0 or 0,0.7."),
    max_tokens: str | None = typer.Option(None, "--max-tokens", help="max_tokens value(s), e.g. 48."),
    repeat: int | None = typer.Option(None, "--repeat", help="Run every case N times."),
    matrix: str | None = typer.Option(None, "--matrix", "-m",
                                         help="Matrix TOML file, or a built-in name (smoke, gate)."),
    dialect: str = typer.Option("auto", "--dialect",
                                help="auto|ddtree|ddtree-mlx|vllm|sglang|llamacpp|openai"),
    api_key: str | None = _API_KEY,
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds per request."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream (SSE) to measure TTFT."),
    concurrency: int = typer.Option(1, "--concurrency",
                                    help="Parallel requests (default 1: clean per-request numbers)."),
    json_path: str | None = typer.Option(None, "--json",
                                            help="Write the JSON report to PATH ('-' = stdout only)."),
    no_color: bool = _NO_COLOR,
    engine: bool = _ENGINE,
    target: str | None = _ENGINE_TARGET,
    gguf: str | None = _ENGINE_GGUF,
    draft: str | None = _ENGINE_DRAFT,
    device: str | None = _ENGINE_DEVICE,
    dtype: str | None = _ENGINE_DTYPE,
    baseline: str | None = typer.Option(None, "--baseline", help=_BASELINE_HELP),
    near_tie_gap: float | None = _NEAR_TIE_GAP,
    debug: bool = _DEBUG,
) -> None:
    """Run a probe matrix against a server (--url) or the in-process engine (--engine)."""
    from ddtree_diag.probe import ProbeOptions, run_probe

    options = ProbeOptions(
        url=url, model=model, prompts=list(prompt or []), thinking=thinking, budget=budget,
        temperature=temperature, max_tokens=max_tokens, repeat=repeat, matrix=matrix,
        dialect=dialect, api_key=api_key, timeout=timeout, stream=stream, concurrency=concurrency,
        json_path=json_path, no_color=no_color, via=via, engine=engine, target=target, gguf=gguf,
        draft=draft, device=device, dtype=dtype, baseline=baseline, near_tie_gap=near_tie_gap,
    )  # fmt: skip
    raise typer.Exit(run_probe(options))


@app.command("text-check")
def text_check(
    file: str = typer.Argument("-", help="File to check, or - for stdin."),
    prompt: str | None = typer.Option(None, "--prompt", help="The prompt the text answers (enables script checks)."),
    finish_reason: str | None = typer.Option(None, "--finish-reason", help="The server's finish_reason."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
    jsonl: bool = typer.Option(False, "--jsonl", help="Input is JSON lines {text, prompt, finish_reason, ...}."),
    debug: bool = _DEBUG,
) -> None:
    """Flag text no healthy model would write (loops, leaks, script switches...): exit 1 if garbage."""
    from ddtree_diag.textcheck import run_text_check

    raise typer.Exit(run_text_check(file, prompt, as_json, jsonl, finish_reason))


@app.command()
def gate(
    matrix: str = typer.Argument(..., help="Matrix TOML with a \\[gate] table, or a built-in name (gate)."),
    url: str | None = _URL,
    via: str | None = _VIA,
    model: str | None = typer.Option(None, "--model", help="Model id (default: first from /v1/models)."),
    dialect: str = typer.Option("auto", "--dialect",
                                help="auto|ddtree|ddtree-mlx|vllm|sglang|llamacpp|openai"),
    api_key: str | None = _API_KEY,
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds per request."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream (SSE) to measure TTFT."),
    baseline: str | None = typer.Option(None, "--baseline",
                                        help=_BASELINE_HELP + " Overrides the matrix's \\[baseline]."),
    near_tie_gap: float | None = _NEAR_TIE_GAP,
    junit: str | None = typer.Option(None, "--junit", help="Write JUnit XML (one testcase per case × check)."),
    summary: str | None = typer.Option(None, "--summary",
                                       help="Write a Markdown summary (also appended to $GITHUB_STEP_SUMMARY)."),
    json_path: str | None = typer.Option(None, "--json", help="Write the JSON report to PATH ('-' = stdout only)."),
    no_color: bool = _NO_COLOR,
    engine: bool = _ENGINE,
    target: str | None = _ENGINE_TARGET,
    gguf: str | None = _ENGINE_GGUF,
    draft: str | None = _ENGINE_DRAFT,
    device: str | None = _ENGINE_DEVICE,
    dtype: str | None = _ENGINE_DTYPE,
    debug: bool = _DEBUG,
) -> None:
    """Run a matrix and apply its \\[gate] thresholds: exit 0 pass, 1 fail (2 usage, 3 unreachable)."""
    from ddtree_diag.probe import ProbeOptions, run_probe

    options = ProbeOptions(
        url=url, via=via, model=model, matrix=matrix, dialect=dialect, api_key=api_key, timeout=timeout,
        stream=stream, json_path=json_path, no_color=no_color, engine=engine, target=target,
        gguf=gguf, draft=draft, device=device, dtype=dtype, baseline=baseline,
        near_tie_gap=near_tie_gap, gate=True, junit_path=junit, summary_path=summary,
    )  # fmt: skip
    raise typer.Exit(run_probe(options))


@app.command()
def report(
    run: str = typer.Argument(..., help="A JSON report written by probe/gate --json."),
    format: str = typer.Option("table", "--format", "-f", help="table | markdown | junit"),
    output: str | None = typer.Option(None, "--output", "-o", help="Write to PATH instead of stdout."),
    no_color: bool = _NO_COLOR,
    debug: bool = _DEBUG,
) -> None:
    """Re-render a saved run (exit code as the run's: 0 pass, 1 a check failed)."""
    from ddtree_diag.rerender import rerender

    raise typer.Exit(rerender(run, format, output=output, no_color=no_color))


@app.command()
def diff(
    a: str = typer.Argument(..., help="The reference run (JSON report)."),
    b: str = typer.Argument(..., help="The run to judge against it."),
    acceptance_tolerance: float = typer.Option(0.25, "--acceptance-tolerance",
                                               help="Per-case acceptance drop (tokens/round) allowed."),
    tps_tolerance: float = typer.Option(0.30, "--tps-tolerance",
                                        help="Drop of the mean client tok/s allowed, as a fraction (0.3 = 30%)."),
    fail_on_text_change: bool = typer.Option(False, "--fail-on-text-change",
                                             help="A changed T=0 text is a regression too."),
    json_path: str | None = typer.Option(None, "--json", help="Write the comparison as JSON to PATH."),
    no_color: bool = _NO_COLOR,
    debug: bool = _DEBUG,
) -> None:
    """Compare two runs case by case; exit 1 on a regression beyond the tolerances."""
    from ddtree_diag.rerender import run_diff

    raise typer.Exit(run_diff(a, b, acceptance_tolerance=acceptance_tolerance, tps_tolerance=tps_tolerance,
                              fail_on_text_change=fail_on_text_change, json_path=json_path,
                              no_color=no_color))  # fmt: skip


@app.command()
def serve(
    target: str | None = _TARGET,
    gguf: str | None = _GGUF,
    draft: str | None = _DRAFT,
    no_draft: bool = typer.Option(False, "--no-draft", help="Serve the target alone (plain AR)."),
    device: str | None = _DEVICE,
    dtype: str | None = _DTYPE,
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
    port: int = typer.Option(30000, "--port", help="TCP port."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="DDTREE_DIAG_SERVE_API_KEY",
                                          show_default=False, help="Require this Bearer token."),
    model_name: str | None = typer.Option(None, "--model-name", help="Model id to report."),
    tree_budget: int | None = typer.Option(None, "--tree-budget", help="Default tree budget per request."),
    debug: bool = _DEBUG,
) -> None:
    """Serve the in-process engine as an OpenAI-compatible server (the reference to compare with)."""
    from ddtree_diag.serve_cmd import run_serve

    run_serve(target=target, gguf=gguf, draft=draft, no_draft=no_draft, device=device, dtype=dtype,
              host=host, port=port, api_key=api_key, model_name=model_name, tree_budget=tree_budget)  # fmt: skip


@app.command("engine-info")
def engine_info(
    target: str | None = _TARGET,
    gguf: str | None = _GGUF,
    draft: str | None = _DRAFT,
    device: str | None = _DEVICE,
    dtype: str | None = _DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    debug: bool = _DEBUG,
) -> None:
    """Load a target (+ draft) and print what was loaded: layers, target layer ids, mask token, memory."""
    from ddtree_diag.engine_info import run_engine_info
    from ddtree_diag.models import choose_models

    choice = choose_models(target, draft, gguf)
    raise typer.Exit(run_engine_info(choice.target, draft=choice.draft, gguf_file=choice.gguf_file,
                                     device=device, dtype=dtype, as_json=as_json))


@app.command()
def demo(
    matrix: str = typer.Option("smoke", "--matrix", "-m", help="Matrix file or built-in name."),
    json_path: str | None = typer.Option(None, "--json", help="Write the JSON report to PATH ('-' = stdout)."),
    target: str | None = _TARGET,
    draft: str | None = _DRAFT,
    device: str | None = typer.Option(None, "--device", help="cuda or cpu."),
    no_color: bool = typer.Option(False, "--no-color", help="No colour."),
    debug: bool = _DEBUG,
) -> None:
    """Start the reference server with the embedded model, probe it over HTTP, stop it."""
    from ddtree_diag.demo import run_demo

    raise typer.Exit(run_demo(matrix=matrix, json_path=json_path, target=target, draft=draft, device=device,
                              no_color=no_color))


@app.command(
    "train-draft",
    add_help_option=False,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def train_draft(ctx: typer.Context) -> None:
    """Train a DFlash draft by self-distillation (block-diffusion objective); --help for its flags."""
    from ddtree_diag.models import require_engine_extra

    require_engine_extra()
    from ddtree_diag.draft_training import main as train_main

    try:
        code = train_main(list(ctx.args))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        code = exc.code if isinstance(exc.code, int) else 2
    raise typer.Exit(code)


def _click_exit_code(exc: Exception) -> int | None:
    """Exit code for click's own exceptions, or None for anything else. typer >= 0.26 bundles its
    own copy of click, so these are matched by shape rather than by class."""
    name = type(exc).__name__
    if name == "Abort":
        sys.stderr.write("ddtree-diag: interrupted\n")
        return EXIT_INTERRUPTED
    if name == "Exit" and isinstance(getattr(exc, "exit_code", None), int):
        return exc.exit_code
    if callable(getattr(exc, "show", None)) and isinstance(getattr(exc, "exit_code", None), int):
        exc.show()  # click's usage errors: "Usage: ... Error: ..." on stderr
        return EXIT_USAGE
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app and map every failure to one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    command = typer.main.get_command(app)
    try:
        # Without standalone mode click returns the code of a typer.Exit instead of raising it.
        returned = command.main(args=args, prog_name="ddtree-diag", standalone_mode=False)
        code = returned if isinstance(returned, int) else 0
    except KeyboardInterrupt:
        sys.stderr.write("ddtree-diag: interrupted\n")
        code = EXIT_INTERRUPTED
    except DiagError as exc:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"ddtree-diag: error: {exc}\n")
        code = exc.exit_code
    except Exception as exc:
        code = _click_exit_code(exc)
        if code is None:  # a bug of ours: one line, the traceback only on request
            if debug:
                traceback.print_exc()
            first = str(exc).splitlines()[0] if str(exc) else ""
            sys.stderr.write(f"ddtree-diag: internal error: {type(exc).__name__}: {first} (rerun with --debug)\n")
            code = EXIT_USAGE
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
