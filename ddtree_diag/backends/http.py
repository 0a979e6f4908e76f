"""Remote backend: probe an OpenAI-compatible server over HTTP (httpx, SSE streaming).

Every failure of one request becomes a ProbeResult with a one-line reason; the run goes on.
Timings are measured here, on the client: end-to-end, time to first token (streaming) and decode
tokens per second between the first and the last token.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from httpx_sse import EventSource

from ddtree_diag.backends import dialects
from ddtree_diag.backends.metrics import SpecCounters, parse_spec_counters
from ddtree_diag.errors import TransportError, UsageError
from ddtree_diag.records import (
    STATUS_HTTP_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    STATUS_TRANSPORT_ERROR,
    ProbeCase,
    ProbeResult,
)


def normalise_url(url: str) -> str:
    """Base URL without a trailing ``/v1`` (endpoints are added per call). UsageError if bad."""
    text = (url or "").strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"bad --url {url!r}: expected http://HOST[:PORT][/PATH]")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise UsageError(f"bad --url {url!r}: port is not a number in 1-65535") from None
    path = parts.path.rstrip("/")
    for suffix in ("/chat/completions", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return f"{parts.scheme}://{parts.netloc}{path}"


def describe_transport_error(exc: Exception, url: str) -> tuple[str, str]:
    """(status, one-line reason) for an httpx exception."""
    host = urlsplit(url).netloc
    if isinstance(exc, httpx.TimeoutException):
        kind = {
            httpx.ConnectTimeout: "connect",
            httpx.ReadTimeout: "read",
            httpx.WriteTimeout: "write",
            httpx.PoolTimeout: "pool",
        }.get(type(exc), "request")
        return STATUS_TIMEOUT, f"{kind} timeout talking to {host}"
    text = str(exc) or type(exc).__name__
    lowered = text.lower()
    if isinstance(exc, httpx.ConnectError):
        if "name or service not known" in lowered or "nodename nor servname" in lowered or (
            "name resolution" in lowered or "getaddrinfo" in lowered
        ):
            return STATUS_TRANSPORT_ERROR, f"cannot resolve host {urlsplit(url).hostname!r}"
        if "refused" in lowered:
            return STATUS_TRANSPORT_ERROR, f"connection refused by {host} (is the server running?)"
        return STATUS_TRANSPORT_ERROR, f"cannot connect to {host}: {text}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return STATUS_TRANSPORT_ERROR, f"connection to {host} dropped: {text}"
    return STATUS_TRANSPORT_ERROR, f"{type(exc).__name__} talking to {host}: {text}"


def _error_message(response: httpx.Response) -> str:
    """The server's own error message (OpenAI error object or FastAPI detail), one line."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip().replace("\n", " ")
        return text[:160] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error).replace("\n", " ")[:240]
    return json.dumps(body)[:160]


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
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if dialect != "auto" and dialect not in dialects.DIALECTS:
            raise UsageError(
                f"unknown --dialect {dialect!r}; choose auto or one of {', '.join(dialects.DIALECTS)}"
            )
        # None until prepare() detects it (dialect "auto")
        if timeout <= 0:
            raise UsageError("--timeout must be > 0 seconds")
        self.base_url = normalise_url(url)
        self.model = model
        self.dialect: dialects.Dialect | None = None if dialect == "auto" else dialects.get(dialect)
        self.stream = stream
        self.timeout = timeout
        self.concurrency = concurrency
        self.transport = transport  # None = httpx's own; via.AgentTransport for --via
        headers = {"Accept": "application/json, text/event-stream"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            trust_env=False,  # a loopback probe must not go through a proxy from the environment
            transport=transport,
        )
        self.detection_note: str | None = None
        self.metrics_prefix: str | None = None  # set when /metrics exposes spec counters
        self.strict_fields_dropped = False
        self._metrics_lock = threading.Lock()  # before/after scrapes must not interleave

    # -- setup -------------------------------------------------------------------------------

    def prepare(self, cases: list[ProbeCase]) -> list[str]:
        notes: list[str] = []
        if hasattr(self.transport, "note"):
            notes.append(self.transport.note())
        owned_by = None
        if self.model is None or self.dialect is None:
            models = self._list_models()
            if self.model is None:
                if not models:
                    raise UsageError(
                        f"{self.base_url}/v1/models lists no model; pass --model NAME"
                    )
                self.model = models[0]["id"]
                notes.append(f"model: {self.model} (first of {len(models)} from /v1/models)")
            for entry in models:
                if entry.get("id") == self.model:
                    owned_by = entry.get("owned_by")
        if self.dialect is None:
            name, why = self._detect(cases[0] if cases else None, owned_by)
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

    def _list_models(self) -> list[dict[str, Any]]:
        url = f"{self.base_url}/v1/models"
        try:
            response = self.client.get(url)
        except httpx.HTTPError as exc:
            raise TransportError(describe_transport_error(exc, url)[1]) from None
        if response.status_code >= 400:
            if self.model is None:
                raise UsageError(
                    f"GET /v1/models answered HTTP {response.status_code} "
                    f"({_error_message(response)}); pass --model NAME"
                )
            return []
        try:
            data = response.json().get("data", [])
        except (ValueError, AttributeError):
            data = []
        return [m for m in data if isinstance(m, dict) and m.get("id")]

    def _detect(self, case: ProbeCase | None, owned_by: str | None) -> tuple[str, str]:
        """Decide the dialect from one tiny plain request, then /v1/models' owned_by."""
        if case is not None:
            probe = ProbeCase(prompt_id="detect", messages=case.messages, max_tokens=1)
            body = dialects.build_request("openai", probe, self.model or "", stream=False)
            try:
                response = self.client.post(f"{self.base_url}/v1/chat/completions", json=body)
                payload = response.json() if response.status_code < 400 else None
            except (httpx.HTTPError, ValueError):
                payload = None  # the real cases will report the problem
            if isinstance(payload, dict):
                choices = payload.get("choices") or [{}]
                choice = choices[0] if isinstance(choices[0], dict) else {}
                extras = dialects.extras_of(payload, choice)
                found = dialects.detect_from_extras(extras)
                if found:
                    keys = ", ".join(sorted(k for k in extras if k not in ("usage",)))
                    return found, f"response carries {keys}"
        found = dialects.detect_from_owner(owned_by)
        if found:
            return found, f"/v1/models owned_by={owned_by!r}"
        return "openai", "no speculative-decoding fields in the response"

    # -- one case ----------------------------------------------------------------------------

    def run(self, case: ProbeCase) -> ProbeResult:
        assert self.model is not None and self.dialect is not None, "prepare() first"
        result = ProbeResult(case=case, dialect=self.dialect.name, model=self.model)
        use_counters = self.metrics_prefix is not None and self.concurrency == 1
        if use_counters:
            with self._metrics_lock:
                before = self._scrape_metrics()
        else:
            before = None
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
        if before is not None and result.ok and not result.spec.known:
            after = self._scrape_metrics()
            if after is not None and after.prefix == before.prefix:
                result.spec = after.delta(before)
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
        started = time.perf_counter()
        for attempt in (1, 2):
            try:
                if self.stream:
                    self._streamed(url, body, headers, case, result, started)
                else:
                    self._plain(url, body, headers, case, result, started)
                return
            except httpx.RemoteProtocolError as exc:
                # A keep-alive connection the server closed while idle fails before the server
                # saw the request: safe to send once more on a new connection.
                if attempt == 1 and "without sending" in str(exc) and not result.output:
                    started = time.perf_counter()
                    continue
                result.status, result.error = describe_transport_error(exc, url)
            except httpx.HTTPError as exc:
                result.status, result.error = describe_transport_error(exc, url)
            result.timings.e2e_s = time.perf_counter() - started
            return

    def _plain(self, url, body, headers, case, result: ProbeResult, started: float) -> None:
        response = self.client.post(url, json=body, headers=headers)
        result.http_status = response.status_code
        result.timings.e2e_s = time.perf_counter() - started
        if response.status_code >= 400:
            result.status = STATUS_HTTP_ERROR
            result.error = f"HTTP {response.status_code}: {_error_message(response)}"
            return
        self._from_json_body(response, case, result)

    def _from_json_body(self, response: httpx.Response, case: ProbeCase, result: ProbeResult) -> None:
        try:
            payload = response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content-type")
            preview = response.text[:60].replace("\n", " ")
            result.status = STATUS_HTTP_ERROR
            result.error = f"non-JSON body ({kind}): {preview!r}"
            return
        if not isinstance(payload, dict):
            result.status, result.error = STATUS_HTTP_ERROR, "response body is not a JSON object"
            return
        try:
            parsed = self.dialect.parse_body(payload, case)
        except ValueError as exc:
            result.status, result.error = STATUS_HTTP_ERROR, str(exc)
            return
        self._fill(result, parsed)
        timings = result.timings
        if result.completion_tokens and timings.e2e_s:
            timings.decode_tokens_per_second = result.completion_tokens / timings.e2e_s

    def _streamed(self, url, body, headers, case, result: ProbeResult, started: float) -> None:
        with self.client.stream("POST", url, json=body, headers=headers) as response:
            result.http_status = response.status_code
            if response.status_code >= 400:
                response.read()
                result.timings.e2e_s = time.perf_counter() - started
                result.status = STATUS_HTTP_ERROR
                result.error = f"HTTP {response.status_code}: {_error_message(response)}"
                return
            content_type = response.headers.get("content-type", "")
            if "text/event-stream" not in content_type:
                # Some servers ignore stream=true and answer one JSON body.
                response.read()
                result.timings.e2e_s = time.perf_counter() - started
                self._from_json_body(response, case, result)
                result.extras.setdefault("stream_ignored_by_server", True)
                return
            accumulator = self.dialect.accumulator()
            first_token_at = last_token_at = None
            far = response.extensions.get("via_stream")  # --via: the agent's clock, no pipe latency
            far_ttft = None
            for event in EventSource(response).iter_sse():
                data = event.data
                if data == "[DONE]":
                    accumulator.saw_done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    result.status = STATUS_HTTP_ERROR
                    result.error = f"stream chunk is not JSON: {data[:60]!r}"
                    break
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    result.status = STATUS_HTTP_ERROR
                    result.error = f"server error in stream: {_stream_error(chunk)}"
                    break
                if accumulator.feed(chunk):
                    last_token_at = time.perf_counter()
                    if first_token_at is None:
                        first_token_at = last_token_at
                        far_ttft = far.elapsed() if far is not None else None
            if far is not None:
                result.extras["via_far_side"] = {"ttft_s": far_ttft, "e2e_s": far.elapsed()}
        ended = time.perf_counter()
        parsed = accumulator.result(case)
        self._fill(result, parsed)
        timings = result.timings
        timings.e2e_s = ended - started
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

    @staticmethod
    def _fill(result: ProbeResult, parsed: dialects.ParsedResponse) -> None:
        result.output = parsed.output
        result.reasoning = parsed.reasoning
        result.finish_reason = parsed.finish_reason
        result.prompt_tokens = parsed.prompt_tokens
        result.completion_tokens = parsed.completion_tokens
        result.spec = parsed.spec
        result.extras.update(parsed.extras)
        if parsed.model:
            result.model = parsed.model
        if parsed.notes:
            result.extras["notes"] = parsed.notes

    # -- server-wide counters ------------------------------------------------------------------

    def _scrape_metrics(self) -> SpecCounters | None:
        try:
            response = self.client.get(f"{self.base_url}/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        try:
            return parse_spec_counters(response.text)
        except ValueError:
            return None

    def target_info(self) -> dict[str, Any]:
        via = self.transport.describe() if hasattr(self.transport, "describe") else None
        return {
            "backend": "http",
            **({"via": via} if via else {}),
            "url": self.base_url,
            "model": self.model,
            "dialect": self.dialect.name if self.dialect is not None else None,
            "dialect_detection": self.detection_note,
            "stream": self.stream,
            "metrics_counters": self.metrics_prefix,
        }

    def close(self) -> None:
        self.client.close()  # closes a given transport too


def _stream_error(chunk: dict[str, Any]) -> str:
    error = chunk.get("error")
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error).replace("\n", " ")[:200]
