"""Remote backend: probe an OpenAI-compatible server over HTTP (httpx, SSE streaming).

Every failure of one request becomes a ProbeResult with a one-line reason; the run goes on.
Whatever a server sends (a stream that never ends, a body of 100,000 nested brackets, NaN where a
count belongs, invalid UTF-8, a redirect, 500 MiB) makes at most its own case fail:

- ``--timeout S`` is a whole-request deadline (``deadline.Deadline``): connect to last byte,
  streamed or not; a case that runs out of time is ``timeout``.
- ``--max-response-bytes`` caps every body we read; over it, the case fails with that reason.
- Bodies are read as strict UTF-8 and parsed with ``jsonsafe.loads`` (depth-limited); parsing is
  the dialects' job and never raises on odd types.

Timings are measured here, on the client: end-to-end, time to first token (streaming) and decode
tokens per second between the first and the last token.
"""

from __future__ import annotations

import codecs
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from httpx_sse import EventSource

from ddtree_diag import errors, jsonsafe
from ddtree_diag.backends import (
    TRANSPORT_HTTP,
    TRANSPORT_VIA,
    EngineTarget,
    HttpTarget,
    Target,
    depth,
    dialects,
    engine_baseline,
)
from ddtree_diag.backends import deadline as deadlines
from ddtree_diag.backends.deadline import Deadline
from ddtree_diag.backends.metrics import SpecCounters, parse_prefix_cache_hits, parse_spec_counters
from ddtree_diag.errors import TransportError, UsageError
from ddtree_diag.records import (
    STATUS_HTTP_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    STATUS_TRANSPORT_ERROR,
    ProbeCase,
    ProbeResult,
)
from ddtree_diag.redaction import clean_api_key, redact, register, url_without_password

DEFAULT_MAX_RESPONSE_BYTES = 8 << 20  # 8 MiB: a 4096-token streamed answer with top-5 logprobs is ~4 MiB
ERROR_BODY_BYTES = 64 << 10  # of an error body only the start is shown
AUTH_STATUSES = (401, 403)
AUTH_HINT = "pass --api-key KEY (or set DDTREE_DIAG_API_KEY / OPENAI_API_KEY)"
PARSER_GAP = "a reply ddtree-diag could not read"  # the catch-all's words; the fuzz tests look for them


class BadReply(Exception):
    """The server answered with something we cannot use (the case is ``http_error``)."""


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size and count % size == 0:
            return f"{count // size} {unit}"
    return f"{count} bytes"


def parse_size(text: str | int) -> int:
    """``8388608``, ``8M``, ``8MiB``, ``512k`` -> bytes (binary units). UsageError if bad."""
    if isinstance(text, int):
        value = text
    else:
        raw = str(text).strip().lower().removesuffix("b").removesuffix("i")
        scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1:], 1)
        digits = raw[:-1] if scale > 1 else raw
        try:
            value = int(float(digits) * scale)
        except (ValueError, OverflowError):
            raise UsageError(f"--max-response-bytes: expected a size such as 8M or 1048576, got {text!r}") from None
    if value < 1024:
        raise UsageError(f"--max-response-bytes must be at least 1024 bytes, got {value}")
    return value


def normalise_url(url: str) -> str:
    """Base URL without a trailing ``/v1`` (endpoints are added per call). UsageError if bad."""
    text = (url or "").strip()
    try:
        parts = urlsplit(text)
        port_ok = True
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            port_ok = False
    except ValueError:  # e.g. an unbalanced [ in an IPv6 host
        raise UsageError(f"bad --url {redact(url)!r}: expected http://HOST[:PORT][/PATH]") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"bad --url {redact(url)!r}: expected http://HOST[:PORT][/PATH]")
    if not port_ok or parts.port == 0:
        raise UsageError(f"bad --url {redact(url)!r}: port is not a number in 1-65535")
    path = parts.path.rstrip("/")
    # an endpoint pasted from the server's docs: the base is what comes before it
    for suffix in ("/chat/completions", "/completions", "/models", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return f"{parts.scheme}://{parts.netloc}{path}"


def host_of(url: str) -> str:
    """HOST:PORT of a URL, never its userinfo."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "the server"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}" if port is not None else host


def describe_transport_error(exc: Exception, url: str) -> tuple[str, str]:
    """(status, one-line reason) for an httpx exception."""
    host = host_of(url)
    if isinstance(exc, httpx.TimeoutException):
        kind = {
            httpx.ConnectTimeout: "connect",
            httpx.ReadTimeout: "read",
            httpx.WriteTimeout: "write",
            httpx.PoolTimeout: "pool",
        }.get(type(exc), "request")
        return STATUS_TIMEOUT, f"{kind} timeout talking to {host}"
    text = redact(str(exc) or type(exc).__name__)
    lowered = text.lower()
    if isinstance(exc, httpx.ConnectError):
        if "name or service not known" in lowered or "nodename nor servname" in lowered or (
            "name resolution" in lowered or "getaddrinfo" in lowered or "no address associated" in lowered
        ):
            return STATUS_TRANSPORT_ERROR, f"cannot resolve host {urlsplit(url).hostname!r}"
        if "refused" in lowered:
            return STATUS_TRANSPORT_ERROR, f"connection refused by {host} (is the server running?)"
        if urlsplit(url).scheme == "https" and any(
            sign in lowered for sign in ("wrong_version_number", "wrong version number", "unexpected_eof",
                                         "record layer failure", "http_request")):
            # a TLS handshake with a plain-HTTP port ends in EOF or a wrong version number
            return STATUS_TRANSPORT_ERROR, f"TLS handshake with {host} failed: {text} (does it serve plain http://?)"
        return STATUS_TRANSPORT_ERROR, f"cannot connect to {host}: {text}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return STATUS_TRANSPORT_ERROR, f"connection to {host} dropped: {text}"
    return STATUS_TRANSPORT_ERROR, f"{type(exc).__name__} talking to {host}: {text}"


def one_line(text: object, limit: int = 240) -> str:
    """``errors.one_line`` at the length a case's error gets."""
    return errors.one_line(text, limit)


def error_message(data: bytes, reason_phrase: str = "") -> str:
    """The server's own error message (OpenAI error object or FastAPI detail), one line."""
    try:
        body = jsonsafe.loads(data)
    except ValueError:
        text = data.decode("utf-8", "replace")
        return one_line(text, 200) or reason_phrase or "(empty body)"
    return message_of(body) or one_line(jsonsafe.dumps(jsonsafe.finite(body), indent=None), 200)


def message_of(body: Any) -> str | None:
    """The message of a parsed error object, one line: OpenAI's ``{"error": {"message"}}``, a flat
    ``{"message"}`` (older vLLM, llama.cpp's stream field) or FastAPI's ``{"detail"}``; None when
    it holds none."""
    if not isinstance(body, dict):
        return None
    error = body.get("error", body.get("detail", body.get("message")))
    if isinstance(error, dict):
        error = error.get("message", error)
    return None if error is None else one_line(jsonsafe.displayable(str(error)))


def http_failure(response: httpx.Response, data: bytes, *, api_key_given: bool, url: str | None = None) -> str:
    """One line for a non-2xx answer: redirects name their Location, 401/403 say what to pass, a
    404 names the URL that answered it (``url``, shown without a password)."""
    code = response.status_code
    if 300 <= code < 400:
        location = response.headers.get("location")
        where = f" to {redact(location)!r}" if location else " without a Location"
        return f"HTTP {code}: redirect{where} (requests are not followed: use that URL as --url)"
    message = error_message(data, response.reason_phrase)
    if code in AUTH_STATUSES:
        advice = "the API key was refused; check --api-key" if api_key_given else f"the server wants a key: {AUTH_HINT}"
        return f"HTTP {code}: {message} ({advice})"
    if code == 404 and url:
        return f"HTTP 404 from {url_without_password(url)}: {message}"
    return f"HTTP {code}: {message}"


def listed_models(payload: Any) -> list[dict[str, Any]] | None:
    """The usable entries of a /v1/models answer; None when it is not a model list."""
    listed = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(listed, list):
        return None
    return [m for m in listed if isinstance(m, dict) and _usable_name(m.get("id"))]


def served_ids(models: list[dict[str, Any]], shown: int = 5) -> str:
    """``'a', 'b', 'c' and 4 more (7 in all)``: the first few ids a server lists, one line."""
    ids = [one_line(repr(m["id"]), 80) for m in models]
    text = ", ".join(ids[:shown])
    if len(ids) > shown:
        text += f" and {len(ids) - shown} more"
    return f"{text} ({len(ids)} in all)" if len(ids) > 1 else text


@dataclass
class _Progress:
    """What arrived before a failure, for its one-line reason."""

    headers: bool = False
    bytes: int = 0
    events: int = 0
    characters: int = 0

    def describe(self) -> str:
        if not self.headers:
            return "no response headers"
        if self.events:
            return f"{self.bytes} bytes, {self.events} stream events, {self.characters} characters of text"
        return f"headers and {self.bytes} body bytes"


class HttpBackend:
    """Probe one OpenAI-compatible server."""

    name = "http"

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        dialect: str = "auto",
        api_key: str | None = None,
        timeout: float = 120.0,
        stream: bool = True,
        concurrency: int = 1,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        api_key = clean_api_key(api_key)
        register(api_key, url)
        if dialect != "auto" and dialect not in dialects.DIALECTS:
            raise UsageError(
                f"unknown --dialect {dialect!r}; choose auto or one of {', '.join(dialects.DIALECTS)}"
            )
        if not timeout > 0 or timeout != timeout or timeout == float("inf"):
            raise UsageError("--timeout must be a number of seconds > 0")
        if max_response_bytes < 1024:
            raise UsageError("--max-response-bytes must be at least 1024")
        self.base_url = normalise_url(url)
        self.model = model
        # None until prepare() detects it (dialect "auto")
        self.dialect: dialects.Dialect | None = None if dialect == "auto" else dialects.get(dialect)
        self.stream = stream
        self.timeout = timeout
        self.concurrency = concurrency
        self.max_response_bytes = max_response_bytes
        self.api_key_given = bool(api_key)
        self.transport = transport  # None = ours (deadline-aware sockets); via.AgentTransport for --via
        headers = {"Accept": "application/json, text/event-stream"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.Client(
            headers=headers,
            # Per-operation limits; the whole request is bounded by a Deadline of the same length.
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            trust_env=False,  # a loopback probe must not go through a proxy from the environment
            transport=transport if transport is not None else deadlines.DeadlineTransport(),
            follow_redirects=False,  # a redirect is reported, never followed (it would drop a POST body)
        )
        self.detection_note: str | None = None
        self.path_hint: str | None = None  # --url's path answers 404 where its root answers
        self.metrics_prefix: str | None = None  # set when /metrics exposes spec counters
        self.strict_fields_dropped = False
        self._metrics_lock = threading.Lock()  # before/after scrapes must not interleave
        self._counters: dict[bool | None, Any] = {}  # token counters by thinking mode (long-context fills)
        self._context: tuple[int | None] | None = None  # the served context, once looked up
        # The load sweep's ITL: each content chunk's arrival (seconds from the request's start) in
        # extras["stream_chunks"] as [t, None] pairs (tokens per chunk unknown over HTTP). Off for
        # the main run: its reports need no per-chunk times.
        self.keep_chunk_times = False

    # -- capabilities (see backends.Backend) ----------------------------------------------------

    @property
    def via(self) -> Any:
        """The ``--via`` agent this backend owns (None: our own sockets, or a shared agent)."""
        from ddtree_diag.backends.via import AgentTransport

        return self.transport if isinstance(self.transport, AgentTransport) else None

    @property
    def dialect_name(self) -> str | None:
        return self.dialect.name if self.dialect is not None else None

    @property
    def sends_budget(self) -> bool:
        return self.dialect is None or self.dialect.sends_budget

    @property
    def budget_knob(self) -> str:
        return self.dialect.budget_knob if self.dialect is not None else "unknown until the dialect is detected"

    @property
    def transport_kind(self) -> str:
        return TRANSPORT_VIA if self.via is not None else TRANSPORT_HTTP

    openai_logprobs = True

    def baseline_target(self, mode: str, url: str | None, *, http: HttpTarget,
                        weights: EngineTarget | None) -> Target:
        if mode == "engine":
            return engine_baseline(weights, timeout=http.timeout, model=self.model)
        if mode == "budget0":  # this server, as detected: only the budget changes
            return http.baseline(self.base_url).replace(model=self.model, dialect=self.dialect_name or "auto")
        return http.baseline(url)

    def shared_transport(self) -> httpx.BaseTransport | None:
        return self.via.shared() if self.via is not None else None

    # -- reading bodies ------------------------------------------------------------------------

    def _chunks(self, response: httpx.Response, progress: _Progress, limit: int | None = None) -> Iterator[bytes]:
        """The body's bytes (decoded from any content-encoding), checked against the size cap
        and the deadline between chunks."""
        limit = self.max_response_bytes if limit is None else limit
        for chunk in response.iter_bytes():
            progress.bytes += len(chunk)
            if progress.bytes > limit:
                raise BadReply(f"response larger than {format_bytes(limit)} (--max-response-bytes)")
            deadlines.check()
            yield chunk

    def _read_all(self, response: httpx.Response, progress: _Progress) -> bytes:
        return b"".join(self._chunks(response, progress))

    def _read_error_body(self, response: httpx.Response, progress: _Progress) -> bytes:
        """The start of an error body (enough for its message); the rest is not read."""
        data = bytearray()
        for chunk in self._chunks(response, progress, limit=1 << 62):
            data += chunk
            if len(data) >= ERROR_BODY_BYTES:
                break
        return bytes(data[:ERROR_BODY_BYTES])

    @staticmethod
    def _strict_utf8(chunks: Iterator[bytes]) -> Iterator[bytes]:
        """Pass the bytes on, failing at the first byte that is not UTF-8."""
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        offset = 0
        for chunk in chunks:
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                bad = (bytes(decoder.getstate()[0]) + chunk)[exc.start : exc.start + 4].hex(" ")
                raise BadReply(f"invalid UTF-8 in the stream near byte {offset + exc.start} ({bad})") from None
            offset += len(chunk)
            yield chunk
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise BadReply("invalid UTF-8 in the stream: it ends inside a character") from None

    # -- setup -------------------------------------------------------------------------------

    def prepare(self, cases: list[ProbeCase]) -> list[str]:
        notes: list[str] = []
        if self.via is not None:
            notes.append(self.via.note())
        owned_by = None
        reply = None  # the 1-token probe's answer, when the model check sent it (detection reads it too)
        # Read even when --model and --dialect are both given: a model the server does not list
        # would make every case a 404. Then only a usable list counts (anything else: go on).
        soft = self.model is not None and self.dialect is not None
        models = self._list_models(soft=soft)
        if self.model is None:
            if not models:
                raise UsageError(f"{self._shown_url}/v1/models lists no model; pass --model NAME")
            self.model = models[0]["id"]
            notes.append(f"model: {self.model} (first of {len(models)} from /v1/models)")
        elif models and self.model not in {entry["id"] for entry in models}:
            # Unlisted is not always unserved (llama.cpp and SGLang answer any name): one 1-token
            # request decides, and only a refusal stops the run.
            shown_model = one_line(repr(self.model), 120)
            reply = self._probe_reply(cases[0]) if cases else None
            answered = reply[0].status_code if reply is not None and reply[0] is not None else None
            if answered is not None and answered < 300:
                notes.append(f"model: {shown_model} is not listed by /v1/models (it lists {served_ids(models)}); "
                             "the server answered it anyway")
            else:
                refused = f"; a 1-token request for it answered HTTP {answered}" if answered else ""
                raise UsageError(
                    f"--model {shown_model} is not served by {self._shown_url}: its /v1/models "
                    f"lists {served_ids(models)}{refused}; pass one of those (or no --model: the first is taken)"
                )
        for entry in models or []:
            if entry.get("id") == self.model:
                owned_by = entry.get("owned_by")
        if self.dialect is None:
            name, why = self._detect(cases[0] if cases else None, owned_by, reply)
            self.dialect = dialects.get(name)
            self.detection_note = f"dialect: {name} (auto: {why})"
            notes.append(self.detection_note)
        else:
            notes.append(f"dialect: {self.dialect.name} (--dialect)")
        counters = self._scrape_metrics()
        if counters is not None:
            self.metrics_prefix = counters.prefix
        if self.concurrency > 1 and self.metrics_prefix:
            notes.append(
                "concurrency > 1: server-wide /metrics counters mix requests, so they are not "
                "attributed to cases"
            )
        if not self.dialect.sends_budget and any(c.tree_budget is not None for c in cases):
            notes.append(
                f"{self.dialect.name}: {self.dialect.budget_knob}, so the budget axis is a label only "
                "and is not sent"
            )
        return notes

    @property
    def _shown_url(self) -> str:
        return url_without_password(self.base_url)

    def _get(self, url: str, *, method: str = "GET", json: Any = None) -> tuple[httpx.Response, bytes]:
        """One whole request inside the deadline: (response, body bytes; for errors, the start)."""
        progress = _Progress()
        with Deadline(self.timeout), self.client.stream(method, url, json=json) as response:
            progress.headers = True
            if response.status_code >= 300:
                return response, self._read_error_body(response, progress)
            return response, self._read_all(response, progress)

    def _list_models(self, *, soft: bool = False) -> list[dict[str, Any]] | None:
        """The usable entries of GET /v1/models; None when it answered no model list. Without
        --model that is a UsageError (nothing to probe); ``soft``: nothing here is an error."""
        url = f"{self.base_url}/v1/models"
        shown = url_without_password(url)
        need = self.model is None  # without --model, /v1/models must answer
        try:
            response, data = self._get(url)
        except httpx.HTTPError as exc:
            if soft:
                return None
            raise TransportError(f"GET {shown}: {describe_transport_error(exc, url)[1]}") from None
        except BadReply as exc:
            if need:
                raise UsageError(f"GET {shown}: {exc}; pass --model NAME") from None
            return None
        if response.status_code >= 300:
            message = http_failure(response, data, api_key_given=self.api_key_given)
            if response.status_code in AUTH_STATUSES and not soft:
                raise UsageError(f"GET {shown} answered {message}")
            if response.status_code == 404:
                self.path_hint = self._path_hint()
            if need:
                advice = self.path_hint or "pass --model NAME (or check the path in --url)"
                raise UsageError(f"GET {shown} answered {message}; {advice}")
            return None
        try:
            payload = jsonsafe.loads(data, what="the /v1/models answer")
        except ValueError as exc:
            if need:
                raise UsageError(f"GET {shown}: {exc}; pass --model NAME") from None
            return None
        models = listed_models(payload)
        if models is None and need:
            raise UsageError(f"GET {shown} did not answer a model list ({{\"data\": [...]}}); pass --model NAME")
        return models

    def _path_hint(self) -> str | None:
        """After a 404 from PATH/v1/models: when --url has a path and the server answers a model
        list at its root (or at the root's /v1), the path looks wrong; say where it answers."""
        parts = urlsplit(self.base_url)
        if not parts.path.strip("/"):
            return None
        root = f"{parts.scheme}://{parts.netloc}"
        try:
            response, data = self._get(f"{root}/v1/models")
            models = listed_models(jsonsafe.loads(data)) if response.status_code == 200 else None
        except (httpx.HTTPError, BadReply, ValueError):
            return None
        if models is None:
            return None
        shown = url_without_password(root)
        return (f"the path {parts.path!r} in --url looks wrong: {shown}/v1/models answers "
                f"({served_ids(models) or 'no models listed'}); try --url {shown}")

    def _probe_reply(self, case: ProbeCase) -> tuple[httpx.Response | None, bytes, str | None]:
        """One plain 1-token chat request for ``self.model``: (response, body, None), or (None,
        b"", why no answer came). A 401/403 is a UsageError at once."""
        probe = ProbeCase(prompt_id="detect", messages=case.messages, max_tokens=1)
        body = dialects.build_request("openai", probe, self.model or "", stream=False)
        url = f"{self.base_url}/v1/chat/completions"
        try:
            response, data = self._get(url, method="POST", json=body)
        except httpx.HTTPError as exc:
            return None, b"", describe_transport_error(exc, url)[1]
        except BadReply as exc:
            return None, b"", str(exc)
        if response.status_code in AUTH_STATUSES:
            raise UsageError(http_failure(response, data, api_key_given=self.api_key_given))
        return response, data, None

    def _detect(
        self, case: ProbeCase | None, owned_by: Any, reply: tuple[httpx.Response | None, bytes, str | None] | None
    ) -> tuple[str, str]:
        """Decide the dialect from one tiny plain request (``reply``, when one was already sent),
        then /v1/models' owned_by. An error reply is never read for hints: only a usable chat
        completion is."""
        failure = None
        if case is not None:
            response, data, failure = reply or self._probe_reply(case)
            if response is not None and response.status_code >= 300:
                failure = self._http_failure(response, data, f"{self.base_url}/v1/chat/completions")
            elif response is not None:
                found, failure = self._detect_from_reply(data)
                if found:
                    return found
        found_name = dialects.detect_from_owner(owned_by)
        if found_name:
            why = f"/v1/models owned_by={owned_by!r}"
            return found_name, why + (f"; the detection request failed: {failure}" if failure else "")
        if failure:
            return "openai", (f"the detection request failed ({failure}), so it says nothing; "
                              "assuming plain OpenAI (pass --dialect to choose)")
        return "openai", "no speculative-decoding fields in the response"

    @staticmethod
    def _detect_from_reply(data: bytes) -> tuple[tuple[str, str] | None, str | None]:
        """((dialect, why) or None, why nothing was read)."""
        try:
            payload = jsonsafe.loads(data, what="the detection reply")
        except ValueError as exc:
            return None, str(exc)
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return None, "the reply is not a chat completion (no choices[0])"
        try:
            extras = dialects.extras_of(payload, choices[0])
            found = dialects.detect_from_extras(extras)
        except Exception as exc:  # a parser gap must not end the run: detection just says nothing
            return None, f"{PARSER_GAP} ({type(exc).__name__})"
        if not found:
            return None, None
        keys = ", ".join(sorted(str(k) for k in extras if k != "usage"))
        return (found, f"response carries {one_line(keys, 160)}"), None

    # -- one case ----------------------------------------------------------------------------

    def run(self, case: ProbeCase) -> ProbeResult:
        assert self.model is not None and self.dialect is not None, "prepare() first"
        try:
            return self._run(case)
        except BadReply as exc:  # raised outside a request (e.g. by a counter delta)
            return ProbeResult(case=case, dialect=self.dialect.name, model=self.model,
                               status=STATUS_HTTP_ERROR, error=one_line(str(exc)))
        except Exception as exc:
            # A reply the parsers did not foresee: this case fails with the reason, the run goes on.
            error = one_line(f"{PARSER_GAP} ({type(exc).__name__}: {exc}); please report it")
            return ProbeResult(case=case, dialect=self.dialect.name, model=self.model, status=STATUS_HTTP_ERROR,
                               error=error)

    def _run(self, case: ProbeCase) -> ProbeResult:
        result = ProbeResult(case=case, dialect=self.dialect.name, model=self.model)
        use_counters = self.metrics_prefix is not None and self.concurrency == 1
        if use_counters:
            with self._metrics_lock:
                before = self._scrape_metrics()
        else:
            before = None
        cache_before = self._prefix_cache_hits() if case.cache_role is not None and self.concurrency == 1 else None
        minimal = self.strict_fields_dropped
        self._request(case, result, minimal=minimal)
        if (
            result.status == STATUS_HTTP_ERROR
            and result.http_status == 400
            and not minimal
            and any(f in (result.error or "") for f in self._added_fields(case))
        ):
            # A strict server rejected a field it does not know: retry with the OpenAI core only.
            self.strict_fields_dropped = True
            rejected = result.error
            result = ProbeResult(case=case, dialect=self.dialect.name, model=self.model)
            self._request(case, result, minimal=True)
            result.extras["retried_without_extra_fields"] = rejected
        if cache_before is not None and result.ok and result.cached_tokens is None:
            # no per-request count in the answer: the server's counter moved by this request's hits
            cache_after = self._prefix_cache_hits()
            if cache_after is not None and cache_after >= cache_before:
                result.cached_tokens = round(cache_after - cache_before)
                result.extras["cached_tokens_source"] = "prometheus /metrics delta (prefix_cache_hits; server-wide)"
        if before is not None and result.ok and not result.spec.known:
            after = self._scrape_metrics()
            if after is not None and after.prefix == before.prefix:
                delta = after.delta(before)
                if delta is not None:
                    result.spec = delta
                else:
                    result.extras.setdefault("notes", []).append(
                        "/metrics counters went backwards or are not usable numbers: spec numbers unknown"
                    )
        elif before is not None and depth.wants_counters(result):
            # the answer's numbers stand (llama.cpp timings) but say nothing per depth: /metrics does
            after = self._scrape_metrics()
            if after is not None and after.prefix == before.prefix:
                depth.store(result.spec, depth.from_counters(after, before))
        return result

    def _added_fields(self, case: ProbeCase) -> set[str]:
        """The fields this dialect adds beyond the OpenAI core (a strict server may reject one)."""
        full = self.dialect.build_request(case, "", stream=self.stream)
        return set(full) - set(self.dialect.build_request(case, "", stream=self.stream, minimal=True))

    def _request(self, case: ProbeCase, result: ProbeResult, *, minimal: bool) -> None:
        url = f"{self.base_url}/v1/chat/completions"
        body = self.dialect.build_request(case, self.model or "", stream=self.stream, minimal=minimal)
        # Some servers (llama.cpp) close the connection after a streamed answer: do not reuse it.
        headers = {"Connection": "close"} if self.dialect.close_after_stream else None
        for attempt in (1, 2):
            progress = _Progress()
            started = time.perf_counter()
            with Deadline(self.timeout) as deadline:
                try:
                    if self.stream:
                        self._streamed(url, body, headers, case, result, started, progress)
                    else:
                        self._plain(url, body, headers, case, result, started, progress)
                    return
                except BadReply as exc:
                    result.status, result.error = STATUS_HTTP_ERROR, one_line(str(exc))
                except httpx.TimeoutException as exc:
                    if deadline.expired or isinstance(exc, deadlines.DeadlineExceeded):
                        result.status = STATUS_TIMEOUT
                        result.error = (f"no complete answer within {self.timeout:g} s (--timeout): "
                                        f"{progress.describe()} from {host_of(url)}")
                    else:
                        result.status, result.error = describe_transport_error(exc, url)
                except httpx.RemoteProtocolError as exc:
                    # A keep-alive connection the server closed while idle fails before the server
                    # saw the request: safe to send once more on a new connection.
                    if attempt == 1 and "without sending" in str(exc) and not progress.headers:
                        continue
                    result.status, result.error = describe_transport_error(exc, url)
                except httpx.HTTPError as exc:
                    result.status, result.error = describe_transport_error(exc, url)
            result.timings.e2e_s = time.perf_counter() - started
            return

    def _http_failure(self, response: httpx.Response, data: bytes, url: str) -> str:
        """``http_failure`` for a request to ``url``; a 404 also gets the path hint, if any."""
        message = http_failure(response, data, api_key_given=self.api_key_given, url=url)
        if response.status_code == 404 and self.path_hint:
            message += f" ({self.path_hint})"
        return message

    def _failed_status(self, response: httpx.Response, result: ProbeResult, progress: _Progress,
                       started: float, url: str) -> bool:
        """Fill the result for a non-2xx answer; True when it was one."""
        if response.status_code < 300:
            return False
        data = self._read_error_body(response, progress)
        result.timings.e2e_s = time.perf_counter() - started
        result.status = STATUS_HTTP_ERROR
        result.error = self._http_failure(response, data, url)
        return True

    def _plain(self, url, body, headers, case, result: ProbeResult, started: float, progress: _Progress) -> None:
        with self.client.stream("POST", url, json=body, headers=headers) as response:
            progress.headers = True
            result.http_status = response.status_code
            if self._failed_status(response, result, progress, started, url):
                return
            data = self._read_all(response, progress)
            content_type = response.headers.get("content-type", "no content-type")
        result.timings.e2e_s = time.perf_counter() - started
        self._from_json_body(data, content_type, case, result)

    def _from_json_body(self, data: bytes, content_type: str, case: ProbeCase, result: ProbeResult) -> None:
        try:
            payload = jsonsafe.loads(data, what="the response body")
        except jsonsafe.InvalidUTF8 as exc:
            result.status, result.error = STATUS_HTTP_ERROR, str(exc)
            return
        except ValueError as exc:
            preview = data[:60].decode("utf-8", "replace")
            result.status = STATUS_HTTP_ERROR
            if data.lstrip()[:1] in (b"{", b"["):
                result.error = one_line(str(exc))
            else:
                result.error = one_line(f"non-JSON body ({content_type}): {preview!r}")
            return
        if not isinstance(payload, dict):
            result.status, result.error = STATUS_HTTP_ERROR, "response body is not a JSON object"
            return
        try:
            parsed = self.dialect.parse_body(payload, case)
        except ValueError as exc:
            result.status, result.error = STATUS_HTTP_ERROR, one_line(str(exc))
            return
        self._fill(result, parsed)
        _fail_if_cut_short(result)
        timings = result.timings
        if result.completion_tokens and timings.e2e_s:
            timings.decode_tokens_per_second = result.completion_tokens / timings.e2e_s

    def _streamed(self, url, body, headers, case, result: ProbeResult, started: float, progress: _Progress) -> None:
        accumulator = self.dialect.accumulator()
        first_token_at = last_token_at = None
        arrivals: list[float] | None = [] if self.keep_chunk_times else None
        with self.client.stream("POST", url, json=body, headers=headers) as response:
            progress.headers = True
            result.http_status = response.status_code
            if self._failed_status(response, result, progress, started, url):
                return
            content_type = response.headers.get("content-type", "")
            if "text/event-stream" not in content_type.lower():
                # Some servers ignore stream=true and answer one JSON body.
                data = self._read_all(response, progress)
                result.timings.e2e_s = time.perf_counter() - started
                self._from_json_body(data, content_type or "no content-type", case, result)
                result.extras.setdefault("stream_ignored_by_server", True)
                return
            far = response.extensions.get("via_stream")  # --via: the agent's clock, no pipe latency
            far_ttft = None
            # The checked bytes go through httpx-sse's parser as a response of their own.
            checked = httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"},
                                     content=error_field_as_event(self._strict_utf8(self._chunks(response, progress))))
            try:
                for event in EventSource(checked).iter_sse():
                    progress.events += 1
                    data = event.data
                    if event.event == "error":
                        result.status = STATUS_HTTP_ERROR
                        result.error = f"server error in stream: {error_message(data.encode(), '(no message)')}"
                        break
                    if data.strip() == "[DONE]":
                        accumulator.saw_done = True
                        break
                    if not data.strip() or event.event not in ("", "message"):
                        continue  # keep-alives: empty events, named ones (sse-starlette's ``ping``)
                    try:
                        chunk = jsonsafe.loads(data, what=f"stream event {progress.events}")
                    except ValueError as exc:
                        result.status = STATUS_HTTP_ERROR
                        result.error = one_line(f"{exc}: {data[:60]!r}" if "not valid JSON" in str(exc) else str(exc))
                        break
                    if not isinstance(chunk, dict):
                        continue
                    if chunk.get("error") or chunk.get("object") == "error":
                        # vLLM / SGLang send {"error": {...}}, old vLLM a flat error object, and
                        # OpenRouter an error beside a choice: every one ends the answer
                        result.status = STATUS_HTTP_ERROR
                        message = message_of(chunk) or one_line(jsonsafe.displayable(str(chunk)), 200)
                        result.error = f"server error in stream: {message}"
                        break
                    added = accumulator.feed(chunk)
                    if added:
                        progress.characters += len(added)
                        last_token_at = time.perf_counter()
                        if arrivals is not None:
                            arrivals.append(last_token_at)
                        if first_token_at is None:
                            first_token_at = last_token_at
                            far_ttft = far.elapsed() if far is not None else None
            except Exception:
                # Timed out, too large, invalid UTF-8: keep what arrived for the report.
                result.output = "".join(accumulator.output_parts)
                raise
            finally:
                checked.close()
            if far is not None:
                result.extras["via_far_side"] = {"ttft_s": far_ttft, "e2e_s": far.elapsed()}
        ended = time.perf_counter()
        parsed = accumulator.result(case)
        self._fill(result, parsed)
        timings = result.timings
        timings.e2e_s = ended - started
        if arrivals:
            result.extras["stream_chunks"] = [[round(t - started, 6), None] for t in arrivals]
        if first_token_at is not None:
            timings.ttft_s = first_token_at - started
            tokens = result.completion_tokens
            span = (last_token_at or first_token_at) - first_token_at
            if tokens and tokens > 1 and span > 0:
                timings.decode_tokens_per_second = (tokens - 1) / span
        if result.status == STATUS_OK and not accumulator.saw_done and not parsed.finish_reason:
            result.status = STATUS_TRANSPORT_ERROR
            result.error = (
                f"stream ended before [DONE] after {accumulator.chunks} chunks "
                f"({len(parsed.output)} characters kept)"
            )
        _fail_if_cut_short(result)

    @staticmethod
    def _fill(result: ProbeResult, parsed: dialects.ParsedResponse) -> None:
        result.output = parsed.output
        result.reasoning = parsed.reasoning
        result.tool_calls = parsed.tool_calls
        result.cached_tokens = parsed.cached_tokens
        result.finish_reason = parsed.finish_reason
        result.prompt_tokens = parsed.prompt_tokens
        result.completion_tokens = parsed.completion_tokens
        result.spec = parsed.spec
        # The server's raw objects are kept for the report; non-finite numbers become null here.
        replaced: list[str] = []
        result.extras.update(jsonsafe.finite(parsed.extras, "", replaced))
        if parsed.model:
            result.model = parsed.model
        notes = list(parsed.notes)
        if replaced:
            shown = ", ".join(replaced[:5]) + (f" and {len(replaced) - 5} more" if len(replaced) > 5 else "")
            notes.append(f"non-finite numbers from the server kept as null: {shown}")
        if notes:
            result.extras["notes"] = notes

    # -- server-wide counters ------------------------------------------------------------------

    def _metrics_page(self) -> str | None:
        """The server's Prometheus page, None when it has none (or answers anything but 200)."""
        try:
            response, data = self._get(f"{self.base_url}/metrics")
        except (httpx.HTTPError, BadReply):
            return None
        return data.decode("utf-8", "replace") if response.status_code == 200 else None

    def _prefix_cache_hits(self) -> float | None:
        """The server's prefix-cache hit counter (tokens), None when /metrics has none."""
        page = self._metrics_page()
        return parse_prefix_cache_hits(page) if page is not None else None

    def _scrape_metrics(self) -> SpecCounters | None:
        page = self._metrics_page()
        if page is None:
            return None
        try:
            return parse_spec_counters(page)
        except ValueError:
            return None

    def count_tokens(self, messages: list[dict[str, Any]], thinking: bool | None) -> int | None:
        """With the server's own tokenizer endpoint (vLLM, SGLang, llama.cpp, ours); None without."""
        from ddtree_diag.backends import tokenize

        if thinking not in self._counters:
            kwargs = {"enable_thinking": thinking} if thinking is not None else None
            self._counters[thinking] = tokenize.token_counter(
                self.client, self.base_url, model=self.model, dialect=self.dialect_name, chat_template_kwargs=kwargs,
                timeout=self.timeout)
        return self._counters[thinking](messages)

    def context_limit(self) -> int | None:
        """The served context (vLLM's /v1/models max_model_len, llama.cpp's /props n_ctx, ...)."""
        from ddtree_diag.backends import tokenize

        if self._context is None:
            found = tokenize.count_prompt_tokens(
                self.client, self.base_url, [{"role": "user", "content": "Hello."}], model=self.model,
                dialect=self.dialect_name, timeout=self.timeout)
            self._context = (found.max_context if found is not None else None,)
        return self._context[0]

    def target_info(self) -> dict[str, Any]:
        via = self.via.describe() if self.via is not None else None
        return {
            "backend": "http",
            **({"via": via} if via else {}),
            "url": self._shown_url,
            "model": self.model,
            "dialect": self.dialect.name if self.dialect is not None else None,
            "dialect_detection": self.detection_note,
            "stream": self.stream,
            "metrics_counters": self.metrics_prefix,
        }

    def close(self) -> None:
        self.client.close()  # closes a given transport too


# finish reasons that say the server stopped the answer itself, not the model or max_tokens
CUT_SHORT_REASONS = {"abort", "error", "cancelled", "canceled"}


def _fail_if_cut_short(result: ProbeResult) -> None:
    """An answer the server aborted (SGLang / vLLM ``abort``, OpenRouter ``error``) is no healthy
    answer, whatever its text: the case fails with the reason."""
    if result.status == STATUS_OK and (result.finish_reason or "").lower() in CUT_SHORT_REASONS:
        result.status = STATUS_HTTP_ERROR
        result.error = (f"the server ended the answer with finish_reason {result.finish_reason!r} "
                        f"after {len(result.output)} characters")


_LINE_END = re.compile(rb"[\r\n]")
_ERROR_FIELD = b"error:"


def error_field_as_event(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Pass SSE bytes on, with each line that starts ``error:`` made an ``error`` event.

    llama.cpp's server reports a failure mid-stream as a line of its own field, ``error: {json}``,
    which an SSE parser drops as an unknown field (and then sends ``[DONE]``): rewritten to
    ``event: error`` + ``data: {json}``, the stream's loop sees it. Bytes pass at once; only a
    chunk that ends inside a line's first six bytes waits for the next."""
    at_line_start, pending = True, b""
    for chunk in chunks:
        data, pending = pending + chunk, b""
        out, position = bytearray(), 0
        while position < len(data):
            if at_line_start:
                head = data[position : position + len(_ERROR_FIELD)]
                if head == _ERROR_FIELD:
                    out += b"event: error\ndata:"
                    position += len(_ERROR_FIELD)
                elif _ERROR_FIELD.startswith(head) and position + len(head) == len(data):
                    pending = data[position:]  # maybe "error:" cut by the chunk's end
                    break
                at_line_start = False
                continue
            end = _LINE_END.search(data, position)
            if end is None:
                out += data[position:]
                break
            out += data[position : end.end()]
            position, at_line_start = end.end(), True
        if out:
            yield bytes(out)
    if pending:
        yield pending


def _usable_name(name: Any) -> bool:
    """A model id we can send back: a non-blank string that is valid Unicode (a lone surrogate
    from a JSON escape cannot be encoded into the next request)."""
    return isinstance(name, str) and bool(name.strip()) and not jsonsafe.has_surrogates(name)
