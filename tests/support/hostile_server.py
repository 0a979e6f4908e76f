"""A HOSTILE loopback HTTP server for robustness tests — it imitates no product.

Each request is answered by a Python function the test gives (a "behaviour"), writing raw bytes
to a real socket with whatever timing it likes: a stream that never ends, one byte every 0.25 s,
headers and then silence, redirects, invalid UTF-8, huge bodies. The client under test talks to
it over real TCP on 127.0.0.1, so its sockets, timeouts and parsers all run for real.

    with HostileServer(lambda request, conn: conn.json(200, {...})) as server:
        ... server.url ...
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body or b"{}")


@dataclass
class Connection:
    sock: socket.socket
    stopping: threading.Event
    sent: list[bytes] = field(default_factory=list)

    def send(self, data: bytes) -> bool:
        """Write bytes; False once the client has gone (the behaviour should stop)."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def head(self, status: int = 200, headers: dict[str, str] | None = None, reason: str = "OK") -> bool:
        lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
        return self.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def body(self, status: int, data: bytes, content_type: str = "application/json",
             headers: dict[str, str] | None = None) -> bool:
        all_headers = {"Content-Type": content_type, "Content-Length": str(len(data)), "Connection": "close"}
        all_headers.update(headers or {})
        return self.head(status, all_headers) and self.send(data)

    def json(self, status: int, payload, headers: dict[str, str] | None = None) -> bool:
        return self.body(status, json.dumps(payload).encode(), headers=headers)

    def sse_head(self) -> bool:
        return self.head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                               "Connection": "close"})

    def wait(self, seconds: float) -> bool:
        """Sleep; False when the server is stopping."""
        return not self.stopping.wait(seconds)

    def hold(self) -> None:
        """Say nothing until the client hangs up (or the server stops)."""
        self.sock.settimeout(0.2)
        while not self.stopping.is_set():
            try:
                if not self.sock.recv(1024):
                    return
            except TimeoutError:
                continue
            except OSError:
                return


Behaviour = Callable[[Request, Connection], None]


def not_found_for_gets(behaviour: Behaviour) -> Behaviour:
    """GETs (/metrics, /v1/models) get a quick 404; POSTs get ``behaviour``."""

    def answer(request: Request, conn: Connection) -> None:
        if request.method == "GET":
            conn.json(404, {"error": {"message": "not found"}})
        else:
            behaviour(request, conn)

    return answer


class HostileServer:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.requests: list[Request] = []
        self._stopping = threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> HostileServer:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(10)
        try:
            request = _read_request(sock)
            if request is None:
                return
            self.requests.append(request)
            self.behaviour(request, Connection(sock, self._stopping))
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _read_request(sock: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Request(method, path, headers, rest[:length])


def drip(conn: Connection, data: bytes, every: float) -> None:
    """Send ``data`` one byte at a time, ``every`` seconds apart, until done or the client leaves."""
    for byte in data:
        if not conn.send(bytes([byte])) or not conn.wait(every):
            return


def forever(conn: Connection, data: bytes, every: float) -> None:
    """Send ``data`` again and again, ``every`` seconds apart, until the client leaves."""
    started = time.monotonic()
    while time.monotonic() - started < 600 and conn.send(data) and conn.wait(every):
        pass
