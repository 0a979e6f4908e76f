"""Far-side agent for ``--via``: makes HTTP requests for the local tool and streams the answers back.

This file is never imported by the tool. ddtree_diag/via.py reads it as text and sends it through
the ``--via`` command prefix to ``python3 -c BOOTSTRAP`` on the far side, as one base64 line on
stdin. It must therefore run on any Python >= 3.8 with nothing but the standard library (it is run
with ``-I -S``: no site-packages), and it writes no files.

Protocol: JSON lines. Requests arrive on stdin:
    {"id": 1, "method": "POST", "url": "http://...", "headers": [[k, v], ...], "body": "<b64>",
     "timeout": {"connect": 10, "read": 120}, "deadline": 120}
    ("deadline": seconds the whole request may take, or null; past it the agent stops reading)
    {"op": "ping", "id": 2}            -> {"id": 2, "event": "pong", "t": ...}
    {"op": "cancel", "id": 1}          (the local side stopped reading that response)
Answers go to stdout, interleaved between requests but in order within one request:
    {"event": "hello", "python": "3.11.7", "pid": 123, "t": ...}   once, at start
    {"id": 1, "event": "head", "status": 200, "reason": "OK", "headers": [[k, v], ...], "t0": ..., "t": ...}
    {"id": 1, "event": "chunk", "data": "<b64>", "t": ...}          as the body arrives
    {"id": 1, "event": "end", "t": ...}
    {"id": 1, "event": "error", "kind": "refused|dns|connect|connect_timeout|read_timeout|protocol|other",
     "message": "..."}       (kind "deadline" too)
``t`` is the agent's monotonic clock in seconds when the event was sent; ``t0`` when the request
started (so far-side TTFT = t of the chunk holding the first token - t0). The agent exits at EOF on stdin.
"""

import base64
import http.client
import json
import os
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

MIN_PYTHON = (3, 8)
CHUNK_BYTES = 65536

_out = sys.stdout.buffer
_out_lock = threading.Lock()
_cancelled = set()


def send(message):
    message["t"] = time.monotonic()
    line = json.dumps(message, separators=(",", ":")).encode("ascii") + b"\n"
    with _out_lock:
        _out.write(line)
        _out.flush()


class DeadlinePassed(Exception):
    pass


def classify(exc, connecting):
    """(kind, message) for an exception; the local side maps kind to an httpx exception type."""
    if isinstance(exc, DeadlinePassed):
        return "deadline", "the request's deadline passed"
    if isinstance(exc, socket.gaierror):
        return "dns", f"name resolution failed: {exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "refused", f"connection refused: {exc}"
    if isinstance(exc, socket.timeout):
        return ("connect_timeout" if connecting else "read_timeout"), "timed out"
    if connecting and isinstance(exc, OSError):
        return "connect", str(exc) or type(exc).__name__
    if isinstance(exc, (http.client.HTTPException, ConnectionError)):
        return "protocol", f"{type(exc).__name__}: {exc}"
    return "other", f"{type(exc).__name__}: {exc}"


def fetch(request):
    """Run one request; every outcome becomes events, never an exception."""
    request_id = request["id"]
    started = time.monotonic()  # far-side clock: the local side measures TTFT from here too
    timeout = request.get("timeout") or {}
    connect_timeout = timeout.get("connect")
    read_timeout = timeout.get("read")
    deadline = request.get("deadline")
    ends = None if deadline is None else started + deadline

    def bounded(limit):
        """A socket timeout no longer than the time the request has left."""
        if ends is None:
            return limit
        left = ends - time.monotonic()
        if left <= 0:
            raise DeadlinePassed()
        return left if limit is None else min(limit, left)

    parts = urlsplit(request["url"])
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    connection = None
    connecting = True
    try:
        if parts.scheme == "https":
            import ssl

            connection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=bounded(connect_timeout), context=ssl.create_default_context()
            )
        else:
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=bounded(connect_timeout))
        connection.connect()
        connecting = False
        # Kept: getresponse() hands a closing connection's socket over to the response.
        sock = connection.sock
        sock.settimeout(bounded(read_timeout))
        # The headers are exactly the ones httpx built (Host, Content-Length, ...): add none.
        connection.putrequest(request["method"], path, skip_host=True, skip_accept_encoding=True)
        for name, value in request.get("headers") or []:
            connection.putheader(name, value)
        body = base64.b64decode(request["body"]) if request.get("body") else None
        connection.endheaders(body)
        response = connection.getresponse()
        send(
            {
                "id": request_id,
                "event": "head",
                "status": response.status,
                "t0": started,
                "reason": response.reason,
                "headers": [[k, v] for k, v in response.getheaders()],
            }
        )
        while request_id not in _cancelled:
            # read1: whatever has arrived (de-chunked, still content-encoded), so SSE events
            # travel as soon as the server sends them.
            sock.settimeout(bounded(read_timeout))
            data = response.read1(CHUNK_BYTES)
            if not data:
                break
            send({"id": request_id, "event": "chunk", "data": base64.b64encode(data).decode("ascii")})
        send({"id": request_id, "event": "end"})
    except Exception as exc:  # reported to the local side, which decides
        if isinstance(exc, socket.timeout) and ends is not None and time.monotonic() >= ends - 0.005:
            exc = DeadlinePassed()
        kind, message = classify(exc, connecting)
        send({"id": request_id, "event": "error", "kind": kind, "message": message})
    finally:
        _cancelled.discard(request_id)
        if connection is not None:
            connection.close()


def main():
    version = ".".join(str(part) for part in sys.version_info[:3])
    if sys.version_info < MIN_PYTHON:  # the bootstrap checks first; this guards a direct run
        send({"event": "hello", "python": version, "pid": os.getpid(), "error": "the --via agent needs Python >= 3.8"})
        return
    send({"event": "hello", "python": version, "pid": os.getpid()})
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            # The local side closed the pipe (or died): leave now. os._exit, because a normal
            # shutdown can abort while a daemon fetch thread still holds stdout's lock.
            with _out_lock:
                os._exit(0)
        try:
            request = json.loads(line.decode("utf-8"))
        except ValueError:
            continue
        op = request.get("op", "request")
        if op == "ping":
            send({"id": request.get("id"), "event": "pong"})
        elif op == "cancel":
            _cancelled.add(request.get("id"))
        else:
            threading.Thread(target=fetch, args=(request,), daemon=True).start()


if __name__ == "__main__":  # exec()'d by the bootstrap in __main__'s namespace
    main()
