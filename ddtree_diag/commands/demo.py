"""The ``demo`` command: start the reference server on a free loopback port with the embedded
default model, probe it over HTTP with the smoke matrix, render, stop the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import typer

from ddtree_diag.commands.options import DEBUG, DRAFT, NO_COLOR, TARGET
from ddtree_diag.errors import TransportError, UsageError


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        matrix: str = typer.Option("smoke", "--matrix", "-m", help="Matrix file or built-in name."),
        json_path: str | None = typer.Option(None, "--json", help="Write the JSON report to PATH ('-' = stdout)."),
        target: str | None = TARGET,
        draft: str | None = DRAFT,
        device: str | None = typer.Option(None, "--device", help="cuda or cpu."),
        quiet: bool = typer.Option(
            False, "--quiet", "-q", help="Nothing on stderr while the model loads and the cases run."),
        no_color: bool = NO_COLOR,
        debug: bool = DEBUG,
    ) -> None:
        """Start the reference server with the embedded model, probe it over HTTP, stop it."""
        from ddtree_diag.output.waiting import configured

        with configured(quiet=quiet, no_color=no_color):
            raise typer.Exit(run_demo(matrix=matrix, json_path=json_path, target=target, draft=draft,
                                      device=device, no_color=no_color, quiet=quiet))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(process: subprocess.Popen, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            message = (process.stderr.read() if process.stderr else "").strip().splitlines()
            last = message[-1] if message else f"exit code {process.returncode}"
            raise UsageError(f"the reference server did not start: {last}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TransportError(f"the reference server was not healthy after {timeout:.0f} s")


def run_demo(
    *,
    matrix: str = "smoke",
    json_path: str | None = None,
    target: str | None = None,
    draft: str | None = None,
    device: str | None = None,
    no_color: bool = False,
    quiet: bool = False,
    startup_timeout: float = 600.0,
) -> int:
    import importlib.util

    from ddtree_diag.engine.models import require_engine_extra

    # The server runs in a child process: say what is missing here, in one line, before starting it
    # (e.g. in the single-file build, which has neither the engine nor the server).
    require_engine_extra()
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise UsageError("demo needs the serve extra: pip install 'ddtree-diag[serve]'")
    from ddtree_diag.output.reportfile import check_writable

    check_writable(json_path, "--json")  # before the slow start, not after
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ddtree_diag", "serve", "--port", str(port)]
    for flag, value in (("--target", target), ("--draft", draft), ("--device", device)):
        if value:
            command += [flag, value]
    from ddtree_diag.output.waiting import waiting

    if target is None:
        # The first run dequantises the embedded GGUF into the cache (~2 min on 2 cores): do it
        # here, where it can be seen, rather than silently inside the server's start.
        from ddtree_diag.engine.embedded import ensure_target_dir

        ensure_target_dir()
    which = "the embedded default model" if target is None else target
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with waiting(f"demo: starting the reference server on {url} (loading {which})"):
            _wait_healthy(process, url, startup_timeout)
        from ddtree_diag.commands.options import RunFlags
        from ddtree_diag.commands.run import run_matrix

        flags = RunFlags(url=[url], json_path=json_path, no_color=no_color, quiet=quiet)
        return run_matrix(flags, matrix, gate=False)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
