"""``--via``: make the probe's HTTP requests from the far side of a command prefix.

DDTree servers often listen on 127.0.0.1 inside a container on a GPU host. With
``--via "ssh root@gpu-host pct exec 200 --"`` the local tool starts a small stdlib-only agent
(ddtree_diag/agent.py) on the far side and hands it every HTTP request; everything else (matrix,
dialects, quality, findings, gate, rendering) stays local. AgentTransport is an
``httpx.BaseTransport``, so HttpBackend, its SSE parsing and its error handling run unchanged.

How the agent gets there (the robust way, and why):
- ``python3 -`` would read the program from stdin until EOF, leaving no stdin for requests, and a
  whole agent in ``-c`` meets ARG_MAX and every quoting layer on the way. So the command is
  ``PREFIX python3 -I -S -c BOOTSTRAP`` with a short fixed BOOTSTRAP that checks the Python version,
  reads ONE line from stdin (the agent source, zlib + base64: no quoting issue at all) and exec()s
  it; the agent then keeps reading JSON-line requests from the same stdin.
- ``-I -S``: no user site, no PYTHON* variables, no site-packages: the agent sees only the stdlib,
  and a stray module on the far side cannot shadow ``json``. ``-c`` writes no .pyc: nothing is
  left behind; the agent exits when its stdin closes.
- Quoting: the prefix is split with shlex. Commands such as ``pct exec``, ``docker exec -i``,
  ``kubectl exec -i`` and ``sh -c 'exec "$@"' sh`` pass our words through as argv, but ssh joins
  its remote words with spaces and a remote shell re-parses them. So each ``ssh`` word in the
  prefix adds one round of shlex.quote to the words we append (``ssh jump ssh gpu`` = two rounds).
- Terminals break the byte stream (echo, CR/LF), so ``-t``/``-it`` in the prefix is refused.

Wire protocol: see agent.py. Client timings include the pipe; the pipe's round trip is measured at
start and reported. The agent stamps its events with its own clock, so streamed cases also get the
far side's TTFT and e2e without the pipe (result.extras["via_far_side"]).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import queue
import re
import shlex
import subprocess
import threading
import time
import zlib
from collections import deque
from importlib import resources
from typing import Any

import httpx

from ddtree_diag.backends import deadline as deadlines
from ddtree_diag.errors import TransportError, UsageError

# Runs on the far side before anything else; Python-2-safe so an old python3 fails with a clear line.
BOOTSTRAP = (
    'import sys;v=sys.version_info;v<(3,8)and sys.exit("ddtree-diag: the --via agent needs Python >= 3.8, '
    'found %d.%d"%v[:2]);import zlib,base64;exec(zlib.decompress(base64.b64decode(sys.stdin.buffer.readline())))'
)
MIN_AGENT_PYTHON = "3.8"
_SHELL_HOPS = ("ssh", "ssh.exe")  # prefix words whose remote side re-parses the command line
_TTY_FLAGS = ("-t", "-tt", "-it", "-ti", "--tty")
_SLACK_S = 15.0  # beyond the request's own timeouts, for a slow pipe, before we give up on the agent
_GONE = "gone"


def agent_source() -> str:
    """The agent program as text (works from a checkout, a wheel or a zipapp)."""
    return resources.files("ddtree_diag.backends").joinpath("agent.py").read_text(encoding="utf-8")


def agent_line() -> bytes:
    """The one stdin line the bootstrap exec()s."""
    return base64.b64encode(zlib.compress(agent_source().encode("utf-8"), 9)) + b"\n"


def agent_command(via: str, python: str = "python3") -> list[str]:
    """argv for ``VIA python3 -I -S -c BOOTSTRAP``, quoted once per ssh hop. UsageError if bad."""
    try:
        prefix = shlex.split(via)
    except ValueError as exc:
        raise UsageError(f"bad --via {via!r}: {exc}") from None
    tty = [word for word in prefix if word in _TTY_FLAGS]
    if tty:
        raise UsageError(f"--via: drop {tty[0]}: the agent needs a plain pipe, not a terminal")
    words = [python, "-I", "-S", "-c", BOOTSTRAP]
    for _hop in range(sum(os.path.basename(word) in _SHELL_HOPS for word in prefix)):
        words = [shlex.quote(word) for word in words]
    return prefix + words


# What the far side prints when it really is too old: the bootstrap's own exit line (sys.exit with
# the version found), Python 2 refusing -I (its usage line follows), or the agent not parsing.
_TOO_OLD_EXIT = re.compile(r"^(?:ddtree-diag: )?(the --via agent needs Python >= [\d.]+, found \d+\.\d+)$")
_PY2_USAGE = "[-c cmd | -m mod | file | -]"
# Our own start-up command echoed back by a shell or a runtime ("...: python3 -I -S -c import sys;...")
_ECHOED_BOOTSTRAP = re.compile(r"import sys;v=sys\.version_info(?:.*?readline\(\)\)\)\)|.*)")
_ERROR_WORDS = ("error", "not found", "no such", "denied", "cannot", "can't", "could not", "unable", "fail",
                "refused", "invalid", "unknown", "illegal", "fatal", "unexpected")


def _echo_removed(line: str) -> str:
    """A far-side line with our echoed bootstrap program cut down to a marker."""
    return _ECHOED_BOOTSTRAP.sub("<bootstrap>", line)


def _first_error_line(lines: list[str]) -> str:
    """The far side's own first error line: a Python exception line (``XError: ...``) wins over
    its ``Traceback`` header; then the first line with an error word; else the last line."""
    cleaned = [_echo_removed(line) for line in lines]
    for line in cleaned:
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", line):
            return line
    for line in cleaned:
        if line.startswith("Traceback ") or line.startswith("File "):
            continue
        if any(word in line.lower() for word in _ERROR_WORDS):
            return line
    return cleaned[-1] if cleaned else ""


def startup_failure(code: int | None, stderr_lines: list[str], python: str = "python3") -> str:
    """One line saying why the agent never said hello, from the prefix's exit code and stderr.
    "Too old" only when the far side's Python says so itself; a line that merely repeats our
    start-up command (which contains the version check's text) is not that."""
    lines = [line.strip() for line in stderr_lines if line.strip()]
    for line in lines:
        found = _TOO_OLD_EXIT.match(line)
        if found:
            return f"{python} on the far side is too old: {found.group(1)}"
    option = next((line for line in lines if re.fullmatch(r"Unknown option: -[IS]", line)), None)
    if option is not None and any(_PY2_USAGE in line for line in lines):  # Python 2 has no -I
        return f"{python} on the far side is too old (the agent needs Python >= {MIN_AGENT_PYTHON}): {option}"
    if any(line.startswith("SyntaxError:") for line in lines) and any('File "<string>"' in line for line in lines):
        error = next(line for line in lines if line.startswith("SyntaxError:"))
        return (f"{python} on the far side cannot parse the agent, so it is probably too old (the agent needs "
                f"Python >= {MIN_AGENT_PYTHON}): {error[:200]}")
    name = re.compile(rf"(^|[\s'\"`:‘“]){re.escape(python)}($|[\s'\"`:’”])")
    missing = ("not found", "no such file", "failed to exec", "executable file not found")
    for line in lines:
        shown = _echo_removed(line)
        if name.search(shown) and any(m in shown.lower() for m in missing):
            return f"{python} missing on the far side (the --via command said: {shown[:200]})"
    first = _first_error_line(lines)[:200]
    if code == 127 or "not found" in first.lower():
        return f"a command in the --via prefix was not found on the way: {first or f'exit {code}'}"
    return f"the --via command exited with code {code} before the agent started: {first or 'no message'}"


class AgentTransport(httpx.BaseTransport):
    """An httpx transport that sends each request to the far-side agent over the prefix's pipes.

    Thread-safe: requests carry ids, one reader thread routes the agent's events to per-request
    queues, so ``--concurrency`` works too. If the agent dies, the request in flight and every
    later one fail with httpx.RemoteProtocolError ("... dropped"), i.e. a transport_error case.
    """

    def __init__(self, via: str, *, python: str = "python3") -> None:
        self.via = via
        self.python = python
        self.argv = agent_command(via, python)
        self.agent_python: str | None = None
        self.pipe_round_trip_s: float | None = None
        self._process: subprocess.Popen | None = None
        self._pending: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._hello: dict[str, Any] | None = None
        self._ready = threading.Event()  # hello received, or the process is gone
        self._gone: str | None = None  # why the agent is no longer there
        self._closing = False
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._stderr_thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Start the prefix + agent and wait for its hello. TransportError (exit 3) with one line."""
        try:
            self._process = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        except FileNotFoundError:
            raise TransportError(f"--via: prefix command not found: {self.argv[0]}") from None
        except PermissionError:
            raise TransportError(f"--via: prefix command is not executable: {self.argv[0]}") from None
        self._stderr_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_thread.start()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        with contextlib.suppress(OSError):  # if it already exited, the exit status says why
            self._write(agent_line())
        if not self._ready.wait(timeout):
            self.close()
            raise TransportError(
                f"--via: no answer from the agent within {timeout:.0f} s through {self.via!r}"
                + (f" (last message: {self._stderr_tail[-1].strip()[:160]})" if self._stderr_tail else "")
            )
        if self._hello is None:
            self.close()
            raise TransportError(startup_failure(self._process.poll(), list(self._stderr_tail), self.python))
        self.agent_python = str(self._hello.get("python"))
        if self._hello.get("error"):
            self.close()
            raise TransportError(f"python3 on the far side is {self.agent_python}: {self._hello['error']}")
        self.pipe_round_trip_s = self._ping()

    def close(self) -> None:
        """Close the agent's stdin (it exits), then make sure the prefix process is gone."""
        process = self._process
        if process is None or self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            process.wait(timeout=3)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def shared(self) -> httpx.BaseTransport:
        """The same agent for a second client (e.g. the lossless baseline's HttpBackend); closing
        that client leaves the agent running for its owner."""
        return _SharedAgentTransport(self)

    def describe(self) -> dict[str, Any]:
        """For the report's target: how requests travelled."""
        rtt = self.pipe_round_trip_s
        return {
            "command": self.via,
            "agent_python": self.agent_python,
            "pipe_round_trip_ms": None if rtt is None else round(rtt * 1000, 2),
        }

    def note(self) -> str:
        rtt = self.pipe_round_trip_s
        rtt_text = "?" if rtt is None else f"{rtt * 1000:.1f} ms"
        return (
            f"via: {self.via} (agent on Python {self.agent_python}; pipe round trip {rtt_text}, "
            "included in client timings and TTFT)"
        )

    # -- httpx ---------------------------------------------------------------------------------

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._process is None:
            try:
                self.start()
            except TransportError as exc:
                raise httpx.ConnectError(str(exc), request=request) from None
        timeouts = request.extensions.get("timeout") or {}
        connect, read = timeouts.get("connect"), timeouts.get("read")
        wait = None if read is None else (connect or 0.0) + read + _SLACK_S
        left = deadlines.remaining()  # the whole-request deadline (--timeout), enforced on both sides
        body = request.read()
        request_id, events = self._register(request)
        message = {
            "id": request_id,
            "method": request.method,
            "url": str(request.url),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.headers.raw],
            "body": base64.b64encode(body).decode("ascii") if body else "",
            "timeout": {"connect": connect, "read": read},
            "deadline": None if left is None else max(left, 0.0),
        }
        try:
            self._write(json.dumps(message).encode("utf-8") + b"\n")
        except OSError:
            self._forget(request_id)
            self._wait_gone()
            raise httpx.RemoteProtocolError(self._gone or "the --via process ended", request=request) from None
        head = self._next_event(request_id, events, wait, request)
        if head["event"] != "head":
            self._forget(request_id)
            raise httpx.RemoteProtocolError(f"--via agent sent {head['event']!r} before the head", request=request)
        stream = _AgentStream(self, request_id, events, wait, request, started=head.get("t0"), now=head.get("t"))
        return httpx.Response(
            head["status"],
            headers=[(k, v) for k, v in head.get("headers", [])],
            stream=stream,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": str(head.get("reason", "")).encode(),
                "via_stream": stream,  # HttpBackend reads far-side times from it (elapsed())
            },
        )

    def _next_event(self, request_id: int, events: queue.Queue, wait: float | None, request) -> dict:
        """The request's next event; agent-side failures raise the httpx exception they stand for.
        Waits no longer than the request's deadline, whatever the agent or the pipe does."""
        left = deadlines.remaining()
        if left is not None:
            wait = max(left, 0.0) if wait is None else min(wait, max(left, 0.0))
        try:
            event = events.get(timeout=wait)
        except queue.Empty:
            self.cancel(request_id)
            if deadlines.expired():
                raise deadlines.DeadlineExceeded("deadline passed waiting on --via", request=request) from None
            raise httpx.ReadTimeout(f"no answer through --via within {wait:.0f} s", request=request) from None
        kind = event.get("event")
        if kind == "error":
            self._forget(request_id)
            raise _exception_for(event, request)
        if kind == _GONE:
            raise httpx.RemoteProtocolError(self._gone or "the --via process ended", request=request)
        return event

    def cancel(self, request_id: int) -> None:
        """Stop routing a request's events; tell the agent to stop reading its response."""
        if self._forget(request_id) and self._gone is None:
            with contextlib.suppress(OSError):
                self._write(json.dumps({"op": "cancel", "id": request_id}).encode() + b"\n")

    # -- plumbing ------------------------------------------------------------------------------

    def _register(self, request) -> tuple[int, queue.Queue]:
        events: queue.Queue = queue.Queue()
        with self._lock:
            if self._gone is not None:
                raise httpx.RemoteProtocolError(self._gone, request=request)
            request_id = next(self._ids)
            self._pending[request_id] = events
        return request_id, events

    def _forget(self, request_id: int) -> bool:
        with self._lock:
            return self._pending.pop(request_id, None) is not None

    def _write(self, data: bytes) -> None:
        assert self._process is not None and self._process.stdin is not None
        with self._write_lock:
            self._process.stdin.write(data)
            self._process.stdin.flush()

    def _ping(self) -> float | None:
        """Best of three round trips through the pipe (agent does no I/O but the echo)."""
        best = None
        for _attempt in range(3):
            request_id, events = self._register(None)
            started = time.perf_counter()
            try:
                self._write(json.dumps({"op": "ping", "id": request_id}).encode() + b"\n")
                event = events.get(timeout=10)
            except (OSError, queue.Empty):
                self._forget(request_id)
                return best
            self._forget(request_id)
            if event.get("event") != "pong":
                return best
            elapsed = time.perf_counter() - started
            best = elapsed if best is None else min(best, elapsed)
        return best

    def _read_stdout(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # e.g. a login banner printed before python3 started
            if not isinstance(event, dict):
                continue
            if event.get("event") == "hello" and self._hello is None:
                self._hello = event
                self._ready.set()
                continue
            with self._lock:
                events = self._pending.get(event.get("id"))
            if events is not None:
                events.put(event)
        code = self._process.wait()
        if self._stderr_thread is not None:
            self._stderr_thread.join(timeout=2)
        tail = [line.strip() for line in self._stderr_tail if line.strip()]
        with self._lock:
            if self._closing:
                self._gone = "the --via agent was closed"
            else:
                how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
                self._gone = f"the --via process ended ({how})" + (f": {tail[-1][:160]}" if tail else "")
            pending = list(self._pending.values())
        for events in pending:
            events.put({"event": _GONE})
        self._ready.set()

    def _read_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:
            self._stderr_tail.append(line.decode("utf-8", "replace"))

    def _wait_gone(self) -> None:
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return
            self._ready.wait(5)


class _SharedAgentTransport(httpx.BaseTransport):
    def __init__(self, owner: AgentTransport) -> None:
        self.owner = owner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.owner.handle_request(request)

    def close(self) -> None:
        pass  # the owner closes the agent


class _AgentStream(httpx.SyncByteStream):
    """A response body that yields chunks as the agent relays them (SSE stays incremental)."""

    def __init__(self, transport: AgentTransport, request_id: int, events: queue.Queue, wait: float | None,
                 request: httpx.Request, started: float | None = None, now: float | None = None) -> None:
        self.far_started = started  # agent clock when it began the request
        self.far_now = now  # agent clock of the latest event handed out
        self.transport = transport
        self.request_id = request_id
        self.events = events
        self.wait = wait
        self.request = request
        self.finished = False

    def __iter__(self):
        while not self.finished:
            event = self.transport._next_event(self.request_id, self.events, self.wait, self.request)
            self.far_now = event.get("t", self.far_now)
            if event["event"] == "chunk":
                yield base64.b64decode(event["data"])
            elif event["event"] == "end":
                self.finished = True
                self.transport._forget(self.request_id)

    def elapsed(self) -> float | None:
        """Far-side seconds from the request's start to the chunk being parsed now: the pipe's
        latency is not in it."""
        if self.far_started is None or self.far_now is None:
            return None
        return self.far_now - self.far_started

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.transport.cancel(self.request_id)


def _exception_for(event: dict[str, Any], request: httpx.Request) -> httpx.HTTPError:
    """The httpx exception HttpBackend already turns into the right status and one-line reason."""
    kind = event.get("kind")
    message = f"{event.get('message', '')} (seen from the far side of --via)"
    if kind == "connect_timeout":
        return httpx.ConnectTimeout(message, request=request)
    if kind == "read_timeout":
        return httpx.ReadTimeout(message, request=request)
    if kind == "deadline":
        return deadlines.DeadlineExceeded(message, request=request)
    if kind in ("refused", "dns", "connect"):
        return httpx.ConnectError(message, request=request)
    if kind == "protocol":
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.TransportError(message, request=request)
