"""The ``serve`` command: check the address, load the engine, run the reference server."""

from __future__ import annotations

import socket
import sys

import typer

from ddtree_diag import budget
from ddtree_diag.commands.options import DEBUG, DEVICE, DRAFT, DTYPE, GGUF, TARGET
from ddtree_diag.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        target: str | None = TARGET,
        gguf: str | None = GGUF,
        draft: str | None = DRAFT,
        no_draft: bool = typer.Option(False, "--no-draft", help="Serve the target alone (plain AR)."),
        device: str | None = DEVICE,
        dtype: str | None = DTYPE,
        host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
        port: int = typer.Option(30000, "--port", help="TCP port."),
        api_key: str | None = typer.Option(
            None, "--api-key", envvar="DDTREE_DIAG_SERVE_API_KEY", show_default=False,
            help="Require this Bearer token.",
        ),
        model_name: str | None = typer.Option(None, "--model-name", help="Model id to report."),
        tree_budget: int | None = typer.Option(None, "--tree-budget", help="Default tree budget per request."),
        max_tree_budget: int | None = typer.Option(
            None, "--max-tree-budget",
            help=f"Largest tree_budget a request may ask for. \\[default: {budget.CPU_MAX_TREE_BUDGET} on CPU, "
            f"{budget.MAX_TREE_BUDGET} on CUDA]"),
        max_context: int | None = typer.Option(
            None, "--max-context",
            help="Largest prompt + max_tokens, in tokens. \\[default: the model's context; at most 4096 on CPU]"),
        request_timeout: float | None = typer.Option(
            None, "--request-timeout",
            help="Seconds of generation per request; past it the request gets a 408. "
            "\\[default: 120 on CPU, 600 on CUDA]"),
        devices: int = typer.Option(1, "--devices", help="Split the target over N devices (tensor parallel, "
                                    "one process per device, eager decode path)."),
        debug: bool = DEBUG,
    ) -> None:
        """Serve the in-process engine as an OpenAI-compatible server (the reference to compare with)."""
        run_serve(target=target, gguf=gguf, draft=draft, no_draft=no_draft, device=device, dtype=dtype,
                  host=host, port=port, api_key=api_key, model_name=model_name, tree_budget=tree_budget,
                  max_tree_budget=max_tree_budget, max_context=max_context,
                  request_timeout=request_timeout, devices=devices)


def check_port_free(host: str, port: int) -> None:
    """Fail before the slow model load when the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: expected 0-65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def run_serve(
    *,
    target: str | None,
    gguf: str | None,
    draft: str | None,
    no_draft: bool,
    device: str | None,
    dtype: str | None,
    host: str,
    port: int,
    api_key: str | None,
    model_name: str | None,
    tree_budget: int | None,
    max_tree_budget: int | None = None,
    max_context: int | None = None,
    request_timeout: float | None = None,
    devices: int = 1,
) -> None:
    budget.check_serve_flags(tree_budget, max_tree_budget)
    if devices < 1:
        raise UsageError(f"--devices must be >= 1, got {devices}")
    if max_context is not None and max_context < 2:
        raise UsageError("--max-context must be >= 2 tokens")
    if request_timeout is not None and not 0 < request_timeout < float("inf"):
        raise UsageError("--request-timeout must be a number of seconds > 0")
    if no_draft and draft:
        raise UsageError("--no-draft and --draft contradict each other: give one")
    from ddtree_diag.redaction import clean_api_key

    api_key = clean_api_key(api_key)
    check_port_free(host, port)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError("serve needs the serve extra: pip install 'ddtree-diag[serve]'") from None
    from ddtree_diag.engine.models import choose_models, load_chosen
    from ddtree_diag.server.app import serve
    from ddtree_diag.server.schema import ServerLimits

    choice = choose_models(target, draft, gguf, use_draft=not no_draft)
    if no_draft:
        choice.draft = None
    engine = load_chosen(choice, device=device, dtype=dtype, devices=devices)
    info = engine.info()
    where = f"{info.get('device')}" + (f" × {devices} (tensor parallel)" if devices > 1 else "")
    description = {
        "target": choice.target if not choice.embedded else "embedded:" + choice.name,
        "draft": choice.draft,
        "device": where,
        "dtype": info.get("dtype"),
        "block_size": (info.get("draft") or {}).get("block_size"),
    }
    limits = ServerLimits.for_engine(engine, max_tree_budget=max_tree_budget, max_context=max_context,
                                     request_timeout_s=request_timeout)
    if max_context is not None and max_context > engine.context_length:
        raise UsageError(f"--max-context {max_context} is over the model's context {engine.context_length}")
    budget.check_default_within(tree_budget, limits.max_tree_budget)
    name = model_name or choice.name
    sys.stderr.write(
        f"ddtree-diag serve: http://{host}:{port} · model {name} · draft "
        f"{'none' if choice.draft is None else choice.draft} · {where} {info.get('dtype')}\n"
    )
    sys.stderr.flush()
    serve(engine, model_name=name, host=host, port=port, api_key=api_key,
          default_tree_budget=tree_budget, description=description, limits=limits)
