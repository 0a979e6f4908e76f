"""``engine-info``: load a target (+ draft) and show what was loaded (engine extra)."""

from __future__ import annotations

import typer

from ddtree_diag.commands.options import DEBUG, DEVICE, DRAFT, DTYPE, GGUF, TARGET


def register(app: typer.Typer) -> None:
    @app.command("engine-info")
    def engine_info(
        target: str | None = TARGET,
        gguf: str | None = GGUF,
        draft: str | None = DRAFT,
        device: str | None = DEVICE,
        dtype: str | None = DTYPE,
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
        devices: int = typer.Option(1, "--devices", help="Plan a tensor-parallel split of the target over N "
                                    "devices (from the config; nothing is loaded): heads and memory per device."),
        debug: bool = DEBUG,
    ) -> None:
        """Load a target (+ draft) and print what was loaded: layers, target layer ids, mask token, memory."""
        raise typer.Exit(run_engine_info(target, gguf, draft, device, dtype, as_json, devices))


def run_engine_info(
    target: str | None, gguf: str | None, draft: str | None, device: str | None, dtype: str | None, as_json: bool,
    devices: int = 1,
) -> int:
    """Print what the engine loaded (a table, or JSON); with ``devices`` > 1, the planned split of
    the target over that many devices instead. Configuration problems raise UsageError."""
    import json

    from ddtree_diag.engine.info import engine_info_rows, split_rows
    from ddtree_diag.engine.models import choose_models, load_chosen

    if devices != 1:
        from ddtree_diag.engine.parallel import split_plan

        choice = choose_models(target, draft, gguf)
        info = split_plan(choice.target, choice.gguf_file, choice.draft, device, dtype, devices)
        info["model"] = choice.name
        rows = split_rows(info)
    else:
        engine = load_chosen(choose_models(target, draft, gguf), device=device, dtype=dtype)
        info = engine.info()
        rows = engine_info_rows(info)
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return 0
    from rich.table import Table

    from ddtree_diag.output.console import make_console

    console = make_console()
    if not console.is_terminal:  # piped or in a log: plain "field: value" lines to grep
        typer.echo("\n".join(f"{name}: {value}" for name, value in rows))
        return 0
    table = Table(title="ddtree-diag engine", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    return 0
