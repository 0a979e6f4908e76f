"""Shared fixtures: real servers on loopback ports, and the CLI run as a real subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STANDIN = Path(__file__).resolve().parent / "standin_server.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    process: subprocess.Popen

    def requests(self) -> list[dict]:
        import httpx

        return httpx.get(f"{self.url}/_requests").json()


def start_standin(*args: str) -> Server:
    """Start the STAND-IN dialect server (tests/standin_server.py) and wait for its port."""
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


@pytest.fixture
def standin():
    """Factory: standin("--dialect", "vllm") -> Server; all are stopped after the test."""
    servers: list[Server] = []

    def start(*args: str) -> Server:
        server = start_standin(*args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.process.terminate()
        server.process.wait(timeout=10)


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
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    done = subprocess.run(
        [sys.executable, "-m", "ddtree_diag", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    return CliResult(done.returncode, done.stdout, done.stderr)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def probe_target(standin) -> str:
    """URL of a healthy server for end-to-end tests that need nothing special from it (--via, the
    zipapp). Switch to the reference server here, in one line, once it exists."""
    return standin("--dialect", "ddtree").url
