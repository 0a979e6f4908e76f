"""Processes the tests start: the CLI as a real subprocess, the stand-in and the reference server
on free loopback ports. Fixtures over these live in tests/conftest.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin_server.py"


def sigint_default() -> None:
    """``preexec_fn`` for a child that a test stops with SIGINT: a shell runs background jobs with
    SIGINT ignored, the child would inherit that, and Python then never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_serve(
    *serve_args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``ddtree-diag serve ARGS`` on a free loopback port as a real subprocess; (process, url) once
    /health answers 200. stderr goes to a file (``process.log``): a pipe nobody reads would block a
    server that logs a lot. The caller terminates the process."""
    import tempfile
    import time

    import httpx

    port = free_port()
    args = [sys.executable, "-m", "ddtree_diag", "serve", "--port", str(port), *serve_args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the process
    process = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    process.log = log  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"serve exited: {log.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("serve did not become healthy")


def stop_serve(process: subprocess.Popen) -> None:
    """Stop a server ``launch_serve`` started and close its log."""
    process.terminate()
    process.wait(timeout=30)
    process.log.close()  # type: ignore[attr-defined]


@dataclass
class Server:
    url: str
    process: subprocess.Popen

    def requests(self) -> list[dict]:
        import httpx

        return httpx.get(f"{self.url}/_requests").json()


def start_standin(*args: str) -> Server:
    """Start the STAND-IN dialect server (tests/support/standin_server.py) and wait for its port."""
    process = subprocess.Popen(
        [sys.executable, str(STANDIN), "--port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    if not line.startswith("PORT "):
        process.kill()
        raise RuntimeError(f"stand-in server did not start: {line!r}")
    return Server(url=f"http://127.0.0.1:{int(line.split()[1])}", process=process)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        return json.loads(self.stdout)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> CliResult:
    """Run `python -m ddtree_diag ARGS` as a real process (real exit codes, real stdout)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("DDTREE_DIAG_", "OPENAI_"))}
    full_env.pop("NO_COLOR", None)
    full_env.pop("COLUMNS", None)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-m", "ddtree_diag", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT,
    )
    return CliResult(done.returncode, done.stdout, done.stderr)
