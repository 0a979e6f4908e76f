"""Whole-request deadlines (``--timeout S`` means connect to last byte, like curl ``--max-time``).

httpx's timeouts apply per operation: a server that drips one byte every 0.25 s, or sends SSE
keep-alive comments forever, never trips a 120 s read timeout. So a request runs inside
``Deadline(seconds)``, a context (a ContextVar: per thread, so ``--concurrency`` works), and

- ``DeadlineBackend``, the network backend of our httpx transport, clamps every socket operation
  (DNS lookup, connect, TLS handshake, each read and write) to the time left, so even a blocking
  read returns at the deadline whatever the server does;
- the reading loops (``HttpBackend``, the ``--via`` transport) check ``expired()`` between chunks.

When time is up the operation raises ``DeadlineExceeded`` (an httpx timeout), and the caller
reports the case as ``timeout``. Nothing here knows about dialects or cases.
"""

from __future__ import annotations

import contextvars
import functools
import ipaddress
import socket
import ssl
import threading
import time
from typing import Any

import httpcore
import httpx

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("ddtree_diag_deadline", default=None)


class DeadlineExceeded(httpx.TimeoutException):
    """The whole-request deadline passed (raised by our code, not by a socket timeout)."""


class Deadline:
    """``with Deadline(seconds) as deadline:`` every request made inside must finish in time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.at = self.started + seconds
        self._token: contextvars.Token | None = None

    def __enter__(self) -> Deadline:
        self.started = time.monotonic()
        self.at = self.started + self.seconds
        self._token = _DEADLINE.set(self.at)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._token is not None:
            _DEADLINE.reset(self._token)
            self._token = None

    @property
    def expired(self) -> bool:
        # A socket timeout set to the time left may wake a hair early: 5 ms of slack.
        return time.monotonic() >= self.at - 0.005

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def remaining() -> float | None:
    """Seconds left for the current request (None: no deadline set)."""
    at = _DEADLINE.get()
    return None if at is None else at - time.monotonic()


def expired() -> bool:
    left = remaining()
    return left is not None and left <= 0


def check(what: str = "the answer") -> None:
    """Raise DeadlineExceeded when the current request's time is up."""
    if expired():
        raise DeadlineExceeded(f"deadline passed while reading {what}")


def clamp(timeout: float | None) -> float | None:
    """A per-operation timeout no longer than the time left; raises when none is left."""
    left = remaining()
    if left is None:
        return timeout
    if left <= 0:
        raise DeadlineExceeded("deadline passed")
    return left if timeout is None else min(timeout, left)


# ---------------------------------------------------------------------------------------------
# The network backend: every socket operation bounded by the time left.


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            timeout = clamp(timeout)
        except DeadlineExceeded:
            raise httpcore.ReadTimeout("deadline passed") from None
        return self._stream.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            timeout = clamp(timeout)
        except DeadlineExceeded:
            raise httpcore.WriteTimeout("deadline passed") from None
        self._stream.write(buffer, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        try:
            timeout = clamp(timeout)
        except DeadlineExceeded:
            raise httpcore.ConnectTimeout("deadline passed") from None
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


def _resolve(host: str, port: int, timeout: float | None) -> list[str]:
    """The host's addresses; the lookup runs on a helper thread so a hung resolver cannot hold the
    request past its deadline (getaddrinfo itself has no timeout)."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    answer: dict[str, Any] = {}
    done = threading.Event()

    def lookup() -> None:
        try:
            answer["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            answer["error"] = exc
        done.set()

    threading.Thread(target=lookup, daemon=True, name="ddtree-diag-dns").start()
    if not done.wait(timeout):
        raise httpcore.ConnectTimeout(f"name lookup of {host} took longer than the deadline")
    if "error" in answer:
        raise httpcore.ConnectError(str(answer["error"]))
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in answer["infos"]:
        if sockaddr[0] not in addresses:
            addresses.append(str(sockaddr[0]))
    return addresses


class DeadlineBackend(httpcore.SyncBackend):
    """httpcore's own socket backend with every operation clamped to the current deadline."""

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:
        if remaining() is None:
            return _DeadlineStream(super().connect_tcp(host, port, timeout, local_address, socket_options))
        try:
            addresses = _resolve(host, port, clamp(timeout))
        except DeadlineExceeded:
            raise httpcore.ConnectTimeout("deadline passed") from None
        failure: Exception | None = None
        for address in addresses:  # as socket.create_connection does: the first that answers
            try:
                stream = super().connect_tcp(address, port, clamp(timeout), local_address, socket_options)
            except DeadlineExceeded:
                raise httpcore.ConnectTimeout("deadline passed") from None
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
                continue
            return _DeadlineStream(stream)
        raise failure or httpcore.ConnectError(f"no address for {host}")


@functools.lru_cache(maxsize=1)
def shared_ssl_context() -> ssl.SSLContext:
    """One verifying SSL context for every transport of the process: building one loads the CA
    bundle (~28 ms of CPU), and a fleet builds a transport per target. SSLContext is thread-safe."""
    return httpx.create_ssl_context(trust_env=False)


class DeadlineTransport(httpx.HTTPTransport):
    """httpx's HTTP transport over ``DeadlineBackend``. httpx takes no network backend, so the
    connection pool it builds is replaced by the same pool with ours (same limits as httpx's
    defaults); a test over a real socket checks that the deadline holds."""

    def __init__(self) -> None:
        ssl_context = shared_ssl_context()
        super().__init__(verify=ssl_context, trust_env=False)
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=DeadlineBackend(),
        )
