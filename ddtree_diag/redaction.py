"""Secrets never shown or saved: the API key and any password in a URL (``http://user:pass@host``).

One process-wide ``REDACTOR`` holds the secrets of this run (registered when a run is planned
and when a backend is made); everything shown or saved passes through it: the console table,
notes, errors, the JSON report, JUnit, Markdown, and the CLI's one-line errors. Text a server
echoes back (an error body repeating the Authorization header) is caught the same way, because
redaction works on the final strings, not on where they came from. Error messages are also
redacted where they are made, so a result in memory is already clean.
"""

from __future__ import annotations

import base64
import re
import threading
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from ddtree_diag.errors import UsageError

MASK = "***"
# Below this length a secret is masked only where it stands alone: an "e" or a "1" masked inside
# every word would mangle the report (and its own field names) without hiding anything.
SHORT_SECRET = 8


class Redactor:
    def __init__(self) -> None:
        self._secrets: set[str] = set()
        self._lock = threading.Lock()

    def add(self, secret: str | None) -> None:
        """Register a secret (an API key); the ways it travels (as is, URL-quoted) go with it."""
        if not secret:
            return
        with self._lock:
            self._secrets.update(s for s in {secret, quote(secret, safe=""), unquote(secret)} if s)

    def add_url(self, url: str | None) -> None:
        """Register the password of a URL with userinfo, and the Basic auth token made from it."""
        if not url:
            return
        try:
            parts = urlsplit(url.strip())
        except ValueError:
            return
        if parts.password is None:
            return
        self.add(parts.password)
        user = parts.username or ""
        for pair in {f"{user}:{parts.password}", f"{unquote(user)}:{unquote(parts.password)}"}:
            self.add(base64.b64encode(pair.encode("utf-8", "surrogatepass")).decode("ascii"))

    def clear(self) -> None:
        with self._lock:
            self._secrets.clear()

    @property
    def active(self) -> bool:
        return bool(self._secrets)

    def text(self, text: str) -> str:
        if not self._secrets or not isinstance(text, str):
            return text
        for secret in sorted(self._secrets, key=len, reverse=True):  # longest first: no partial leftovers
            if secret not in text:
                continue
            if len(secret) >= SHORT_SECRET:
                text = text.replace(secret, MASK)
            else:
                text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", MASK, text)
        return text

    def data(self, value: Any) -> Any:
        """A copy of a JSON-like value with every string (keys too: a server's own objects may
        echo a secret as a key) redacted."""
        if not self._secrets:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value


REDACTOR = Redactor()


def clean_api_key(key: str | None, where: str = "--api-key") -> str | None:
    """The key as an Authorization header can carry it: whitespace around it dropped (the newline
    of ``echo`` or of a mounted secret file); a space, control or non-ASCII character inside it
    is a UsageError naming its position, never the key. An empty key is no key."""
    if key is None:
        return None
    key = key.strip()
    for position, char in enumerate(key, 1):
        if not "!" <= char <= "~":
            kind = ("a space" if char.isspace() else "a control character" if char.isascii()
                    else "a non-ASCII character")
            raise UsageError(f"{where} holds {kind} at character {position}: an HTTP header cannot carry it "
                             "(the key is not shown)")
    return key or None


def register(api_key: str | None = None, *urls: str | None) -> None:
    REDACTOR.add(api_key)
    for url in urls:
        REDACTOR.add_url(url)


def redact(text: str) -> str:
    return REDACTOR.text(text)


def redact_data(value: Any) -> Any:
    return REDACTOR.data(value)


def url_without_password(url: str) -> str:
    """``http://user:pass@host/x`` -> ``http://user:***@host/x``; other URLs unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{parts.username or ''}:{MASK}@{host}" + (f":{port}" if port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redacted_report(report: Any) -> Any:
    """A RunReport or FleetReport with every string redacted (the same object when there is
    nothing to hide)."""
    if not REDACTOR.active:
        return report
    from ddtree_diag.records import FleetReport, RunReport

    cls = FleetReport if isinstance(report, FleetReport) else RunReport
    return cls.from_dict(redact_data(report.to_dict()))
