"""Options shared by commands, defined once.

``run_options`` gives a command the whole option set of a matrix run (target, matrix overrides,
checks, outputs): probe and gate take exactly the same flags. The decorated function receives
them packed as one ``RunFlags`` argument named ``flags``; typer sees them as ordinary parameters
(the wrapper publishes the combined signature).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields
from typing import Any

import typer


def _flags_show_no_type() -> None:
    """On/off flags (``--quiet``, ``--stream/--no-stream``, ``--help``) take no value, so help
    shows no type after them: newer typer prints ``<bool>`` there, older click ``BOOLEAN``."""
    try:
        from typer import core
    except ImportError:  # pragma: no cover
        return
    option = getattr(core, "TyperOption", None)
    for name in ("display_type_rich", "make_metavar"):
        original = getattr(option, name, None)
        if original is None or getattr(original, "flagless", False):
            continue

        def patched(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if getattr(self, "is_flag", False) and not getattr(self, "count", False):
                return None if _original.__name__ == "display_type_rich" else ""
            return _original(self, *args, **kwargs)

        patched.flagless = True  # type: ignore[attr-defined]
        patched.__name__ = name
        setattr(option, name, patched)


_flags_show_no_type()

DEBUG_HELP = "Show tracebacks instead of one-line errors."
DEBUG = typer.Option(False, "--debug", help=DEBUG_HELP)
NO_COLOR = typer.Option(False, "--no-color", help="No colour (NO_COLOR is honoured too).")
NEAR_TIE_HELP = "Top-2 logprob gap (nats) under which a T=0 divergence is a numerics near-tie."
# Spelled out rather than read from the dialect registry: importing the registry (and the records it
# builds on) costs tens of ms of every `--help`. A test keeps the two lists equal.
DIALECT_NAMES = ("ddtree", "ddtree-mlx", "vllm", "sglang", "llamacpp", "openai")
DIALECT_HELP = "Server dialect: " + " | ".join(("auto", *DIALECT_NAMES)) + "."

# Help panels of the run options (probe, gate): what to probe, what to send, what to check, where
# the results go, and the in-process engine.
TARGET_PANEL, FLEET_PANEL, MATRIX_PANEL, CHECKS_PANEL, OUTPUT_PANEL, ENGINE_PANEL = (
    "Target", "Fleet (many servers)", "Matrix (overrides the matrix file)", "Checks", "Output", "In-process engine")


def target_option(panel: str | None = None) -> Any:
    return typer.Option(None, "--target", help="Target HF model dir (default: embedded SmolLM2).",
                        rich_help_panel=panel)


def gguf_option(panel: str | None = None) -> Any:
    return typer.Option(None, "--gguf", help="Target GGUF file.", rich_help_panel=panel)


def draft_option(panel: str | None = None) -> Any:
    return typer.Option(None, "--draft", help="DFlash draft dir, z-lab format (default: the embedded one).",
                        rich_help_panel=panel)


def device_option(panel: str | None = None) -> Any:
    return typer.Option(None, "--device", help="cuda or cpu (default: cuda if present).", rich_help_panel=panel)


def dtype_option(panel: str | None = None) -> Any:
    return typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: bf16 on cuda, fp32 on cpu).",
                        rich_help_panel=panel)


# The engine flags as most commands take them (serve, engine-info, demo, train); the run options
# put the same definitions in their own panel.
TARGET, GGUF, DRAFT, DEVICE, DTYPE = target_option(), gguf_option(), draft_option(), device_option(), dtype_option()


@dataclass
class RunFlags:
    """The flags of a matrix run (probe and gate), typed."""

    url: list[str] | None = None  # more than one: a fleet
    via: str | None = None
    model: str | None = None
    dialect: str = "auto"
    api_key: str | None = None
    timeout: float = 120.0
    max_response_bytes: str = "8M"
    stream: bool = True
    targets: str | None = None  # a fleet's targets file
    parallel: int = 8
    deadline: float | None = None
    detail: bool = False
    concurrency: str = "1"  # one value: parallel requests; a list: the load sweep's levels
    load_seconds: float | None = None
    load_requests: int | None = None
    prompt: list[str] | None = None
    thinking: str | None = None
    budget: str | None = None
    temperature: str | None = None
    max_tokens: str | None = None
    repeat: int | None = None
    fill: str | None = None
    baseline: str | None = None
    near_tie_gap: float | None = None
    json_path: str | None = None
    junit: str | None = None
    summary: str | None = None
    html: str | None = None
    quiet: bool = False
    no_color: bool = False
    engine: bool = False
    target: str | None = None
    gguf: str | None = None
    draft: str | None = None
    device: str | None = None
    dtype: str | None = None
    devices: int = 1
    score_with: str | None = None
    debug: bool = False


# (name, annotation, typer option) in help order; the names are RunFlags' fields.
_RUN_OPTIONS: list[tuple[str, Any, Any]] = [
    ("url", list[str] | None, typer.Option(
        None, "--url", metavar="URL", envvar="DDTREE_DIAG_URL", show_envvar=True, rich_help_panel=TARGET_PANEL,
        help="Base URL of the OpenAI-compatible server (with or without /v1). Repeat it for a fleet.")),
    ("via", str | None, typer.Option(
        None, "--via", envvar="DDTREE_DIAG_VIA", show_envvar=True, rich_help_panel=TARGET_PANEL,
        help="Make the requests from the far side of this command prefix, e.g. "
        "\"ssh root@gpu-host pct exec 200 --\" (needs python3 >= 3.8 there, nothing else).")),
    ("model", str | None, typer.Option(None, "--model", rich_help_panel=TARGET_PANEL,
                                       help="Model id (default: first from /v1/models).")),
    ("dialect", str, typer.Option("auto", "--dialect", help=DIALECT_HELP, rich_help_panel=TARGET_PANEL)),
    ("api_key", str | None, typer.Option(
        None, "--api-key", envvar=["DDTREE_DIAG_API_KEY", "OPENAI_API_KEY"], show_default=False,
        show_envvar=True, rich_help_panel=TARGET_PANEL, help="Bearer token (never printed or saved).")),
    ("timeout", float, typer.Option(
        120.0, "--timeout", rich_help_panel=TARGET_PANEL,
        help="Seconds for a whole request, connect to last byte (streamed or not); past it the case is a timeout. "
        "With --engine: each case's generation.")),
    ("max_response_bytes", str, typer.Option(
        "8M", "--max-response-bytes", rich_help_panel=TARGET_PANEL,
        help="Largest response body read (bytes, or with K/M/G); a bigger one fails its case.")),
    ("stream", bool, typer.Option(True, "--stream/--no-stream", help="Stream (SSE) to measure TTFT.",
                                  rich_help_panel=TARGET_PANEL)),
    ("targets", str | None, typer.Option(
        None, "--targets", metavar="FILE", rich_help_panel=FLEET_PANEL,
        help="A fleet: a TOML file of named targets (url, via, dialect, model, api_key_env, baseline, …; "
        "patterns such as url = \"http://gpu-{n}:8000\" with n = [1, 2, 3]). Every target runs the matrix.")),
    ("parallel", int, typer.Option(
        8, "--parallel", rich_help_panel=FLEET_PANEL,
        help="Fleet: targets run at once (each runs its own cases one at a time).")),
    ("deadline", float | None, typer.Option(
        None, "--deadline", metavar="SECONDS", rich_help_panel=FLEET_PANEL,
        help="Fleet: time for each target's whole run; past it the target is stopped with what it finished "
        "(a target's own deadline key wins). \\[default: none; each request still times out at --timeout]")),
    ("detail", bool, typer.Option(
        False, "--detail", rich_help_panel=FLEET_PANEL, help="Fleet: every target's own tables after the fleet's.")),
    ("concurrency", str, typer.Option(
        "1", "--concurrency", metavar="N|N,N,…", rich_help_panel=TARGET_PANEL,
        help="One value: parallel requests (1: clean per-request numbers). Two or more, e.g. 1,4,16: the load "
        "sweep, speculation against the baseline at each level (the cases then run one at a time).")),
    ("load_seconds", float | None, typer.Option(
        None, "--load-seconds", rich_help_panel=TARGET_PANEL,
        help="Load sweep: time budget per level and side; no request starts after it. "
        "\\[default: the matrix's \\[load] seconds, else 60]")),
    ("load_requests", int | None, typer.Option(
        None, "--load-requests", rich_help_panel=TARGET_PANEL,
        help="Load sweep: requests per level and side. \\[default: the matrix's \\[load] requests, else "
        "max(2 × level, cases)]")),
    ("prompt", list[str] | None, typer.Option(
        None, "--prompt", "-p", rich_help_panel=MATRIX_PANEL, metavar="TEXT|@FILE",
        help="Prompt: literal text, @file (text or JSON messages), or a prompt id from the matrix. Repeatable.")),
    ("thinking", str | None, typer.Option(
        None, "--thinking", rich_help_panel=MATRIX_PANEL,
        help="enable_thinking values, e.g. off,on ('default' = not sent). \\[default: the matrix's, else off,on]")),
    ("budget", str | None, typer.Option(
        None, "--budget", rich_help_panel=MATRIX_PANEL,
        help="Tree budgets, e.g. 16,64 ('default' = the server's own). \\[default: the matrix's (smoke: 16,64); "
        "with --prompt and no --matrix: default]")),
    ("temperature", str | None, typer.Option(
        None, "--temperature", rich_help_panel=MATRIX_PANEL,
        help="Temperature(s), e.g. 0 or 0,0.7. \\[default: the matrix's, else 0]")),
    ("max_tokens", str | None, typer.Option(
        None, "--max-tokens", rich_help_panel=MATRIX_PANEL,
        help="max_tokens value(s), e.g. 48. \\[default: the matrix's (smoke: 48), else 48]")),
    ("repeat", int | None, typer.Option(
        None, "--repeat", help="Run every case N times. \\[default: the matrix's, else 1]",
        rich_help_panel=MATRIX_PANEL)),
    ("fill", str | None, typer.Option(
        None, "--fill", rich_help_panel=MATRIX_PANEL, metavar="TOKENS",
        help="Long context: fill every prompt with a document to about N tokens, question last, e.g. 0,2k,8k "
        "(0 = as written; counted with the server's tokenizer where it has one). \\[default: the matrix's]")),
    ("baseline", str | None, typer.Option(
        None, "--baseline", rich_help_panel=CHECKS_PANEL,
        help="Lossless check at T=0 against a non-speculative baseline: budget0 (same server, "
        "tree_budget=0), url:URL (a server without speculation) or engine (target alone). "
        "Overrides a matrix's \\[baseline].")),
    ("near_tie_gap", float | None, typer.Option(
        None, "--near-tie-gap", help=NEAR_TIE_HELP + " \\[default: 0.05]", rich_help_panel=CHECKS_PANEL)),
    ("json_path", str | None, typer.Option(
        None, "--json", rich_help_panel=OUTPUT_PANEL,
        help="Write the JSON report to PATH ('-' = stdout only, the table goes to stderr).")),
    ("junit", str | None, typer.Option(None, "--junit", help="Write JUnit XML (one testcase per case × check).",
                                       rich_help_panel=OUTPUT_PANEL)),
    ("summary", str | None, typer.Option(
        None, "--summary", help="Write a Markdown summary (also appended to $GITHUB_STEP_SUMMARY).",
        rich_help_panel=OUTPUT_PANEL)),
    ("html", str | None, typer.Option(
        None, "--html", rich_help_panel=OUTPUT_PANEL,
        help="Write a self-contained HTML report with plots (no script, nothing from the network).")),
    ("quiet", bool, typer.Option(
        False, "--quiet", "-q", rich_help_panel=OUTPUT_PANEL,
        help="No progress: no bar or model-load spinner on a terminal, no per-case or load lines in a log.")),
    ("no_color", bool, typer.Option(False, "--no-color", help="No colour (NO_COLOR is honoured too).",
                                    rich_help_panel=OUTPUT_PANEL)),
    ("engine", bool, typer.Option(False, "--engine", help="Run in-process (HF target + DFlash draft).",
                                  rich_help_panel=ENGINE_PANEL)),
    ("target", str | None, target_option(ENGINE_PANEL)),
    ("gguf", str | None, gguf_option(ENGINE_PANEL)),
    ("draft", str | None, draft_option(ENGINE_PANEL)),
    ("device", str | None, device_option(ENGINE_PANEL)),
    ("dtype", str | None, dtype_option(ENGINE_PANEL)),
    ("devices", int, typer.Option(
        1, "--devices", rich_help_panel=ENGINE_PANEL,
        help="Split the engine's target over N devices (tensor parallel, one process per device, eager path).")),
    ("score_with", str | None, typer.Option(
        None, "--score-with", rich_help_panel=CHECKS_PANEL,
        help="Also score every answer with a model, teacher-forced in one forward (needs the engine extra): "
        "embedded (SmolLM2), target (the --target/--gguf weights: at T=0 every token must be their argmax) "
        "or a model path. Adds low_likelihood / not_greedy reasons.")),
    ("debug", bool, DEBUG),
]
assert [name for name, _, _ in _RUN_OPTIONS] == [f.name for f in fields(RunFlags)]


def run_options(command: Any) -> Any:
    """Append the run option set to ``command``'s own parameters; it gets them as ``flags``."""
    own = [p for p in inspect.signature(command).parameters.values() if p.name != "flags"]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
        for name, annotation, option in _RUN_OPTIONS
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        flags = RunFlags(**{name: kwargs.pop(name) for name, _, _ in _RUN_OPTIONS})
        from ddtree_diag.output.waiting import configured

        with configured(quiet=flags.quiet, no_color=flags.no_color):  # what slow loads say on stderr
            return command(flags=flags, **kwargs)

    own_hints = {k: v for k, v in command.__annotations__.items() if k != "flags"}
    wrapper.__annotations__ = {**own_hints, **{name: annotation for name, annotation, _ in _RUN_OPTIONS}}
    wrapper.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
    del wrapper.__wrapped__  # typer must read the published signature, not the original's
    return wrapper
