"""Counting a chat prompt's tokens with the server's own tokenizer, and reading its context limit.

What each server offers (request and answer shapes as their sources document them):

- vLLM: ``POST /tokenize`` with ``{"model", "messages", "add_generation_prompt",
  "chat_template_kwargs"}`` renders the chat template and answers ``{"count", "max_model_len",
  "tokens"}``; ``max_model_len`` is the served context. ``GET /v1/models`` lists ``max_model_len``
  on each model. The reference server (``ddtree-diag serve``) answers both the same way.
- SGLang: ``POST /v1/tokenize`` (``/tokenize`` is an alias) takes ``"prompt"`` and, in recent
  versions, ``"messages"`` and ``"chat_template_kwargs"``; the answer has ``tokens``, ``count`` and
  ``max_model_len``, but that ``max_model_len`` is the tokenizer's ``model_max_length`` (131072
  for Qwen2.5-0.5B served at 32768), not the served context: it is never read for SGLang. The
  served context is ``max_model_len`` in ``GET /v1/models``; ``GET /server_info`` (formerly
  ``/get_server_info``) has the ``context_length`` server argument (null unless set).
  ``/get_model_info`` has no context field.
- llama.cpp: ``POST /apply-template`` ``{"messages"}`` -> ``{"prompt"}`` renders the chat template;
  ``POST /tokenize`` ``{"content", "add_special", "parse_special"}`` -> ``{"tokens": [...]}`` (ids,
  or ``{"id", "piece"}`` objects with ``with_pieces``); ``GET /props`` has the slot context as
  ``default_generation_settings.n_ctx``.

Everything here but ``count_prompt_tokens`` is pure (request bodies in, parsed answers out) and
never raises on what a server sends: junk reads as None. ``count_prompt_tokens`` does the HTTP
through a caller's ``httpx.Client`` (its headers carry the API key) and never raises either:
a server with none of these endpoints gives None, and the caller estimates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddtree_diag import jsonsafe

if TYPE_CHECKING:
    import httpx

# The ways to a count, in the order tried when nothing says which server this is.
ROUTE_VLLM = "vllm"  # POST /tokenize with messages (vLLM, the reference server, SGLang's alias)
ROUTE_SGLANG = "sglang"  # POST /v1/tokenize with messages (SGLang)
ROUTE_LLAMACPP = "llamacpp"  # POST /apply-template, then POST /tokenize with content
ROUTE_TEXT = "text"  # POST /v1/tokenize or /tokenize with the messages' text only (older SGLang)
ROUTES = (ROUTE_VLLM, ROUTE_SGLANG, ROUTE_LLAMACPP, ROUTE_TEXT)

SOURCES = {
    ROUTE_VLLM: "vLLM /tokenize",
    ROUTE_SGLANG: "SGLang /v1/tokenize",
    ROUTE_LLAMACPP: "llama.cpp /apply-template + /tokenize",
    ROUTE_TEXT: "/tokenize of the text (chat template estimated)",
}

# Larger than any real context or prompt; beyond it a number is junk (SGLang's tokenizer can say
# 1e30 when it has no model_max_length).
MAX_TOKENS = 1 << 27
MAX_BODY_BYTES = 64 << 20  # a 1M-token answer lists ~8 MB of ids
DEFAULT_TIMEOUT = 60.0
# A chat template's tokens around each message and the assistant's opening, for the text route.
TEMPLATE_TOKENS_PER_MESSAGE = 4
TEMPLATE_TOKENS_REPLY = 3


@dataclass(frozen=True)
class TokenCount:
    """What a server told about a prompt: ``count`` of its tokens (None if it could not count),
    ``max_context`` (the served context, None if unknown), where each came from, and whether the
    count is partly estimated (the text route: the chat template's tokens are guessed)."""

    count: int | None
    max_context: int | None
    source: str
    estimated: bool = False
    route: str | None = None  # which of ROUTES answered: pass it back to skip the others
    context_source: str | None = None


def token_number(value: Any) -> int | None:
    """A usable token count or context size: a positive integer up to MAX_TOKENS (integral
    floats accepted), else None. Booleans, strings, NaN and sentinels are junk."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    if isinstance(value, int) and 0 < value <= MAX_TOKENS:
        return value
    return None


# ---------------------------------------------------------------------------------------------
# Request bodies


def chat_tokenize_body(
    messages: Sequence[Mapping[str, Any]],
    *,
    model: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM's (and recent SGLang's) ``/tokenize`` body for a chat: the template is rendered with
    the assistant's opening, as a chat completion would."""
    body: dict[str, Any] = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt}
    if model:
        body["model"] = model
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    return body


def text_tokenize_body(text: str, *, model: str | None = None) -> dict[str, Any]:
    """vLLM's / SGLang's ``/tokenize`` body for plain text (special tokens such as BOS added)."""
    body: dict[str, Any] = {"prompt": text, "add_special_tokens": True}
    if model:
        body["model"] = model
    return body


def apply_template_body(
    messages: Sequence[Mapping[str, Any]], *, chat_template_kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """llama.cpp's ``/apply-template`` body (the server adds the assistant's opening itself)."""
    body: dict[str, Any] = {"messages": [dict(m) for m in messages]}
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    return body


def llamacpp_tokenize_body(prompt: str) -> dict[str, Any]:
    """llama.cpp's ``/tokenize`` body for a rendered prompt: special tokens in the text (the
    template's role markers) parsed as such, and BOS added as a completion request would."""
    return {"content": prompt, "add_special": True, "parse_special": True}


def messages_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The messages' texts one after another (the text route tokenizes this)."""
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Answers


def parse_tokenize(payload: Any) -> tuple[int | None, int | None]:
    """(count, max_model_len) from a ``/tokenize`` answer of vLLM's or SGLang's shape: ``count``,
    or the length of ``tokens`` when ``count`` is missing; a list ``count`` (a batch) is junk."""
    if not isinstance(payload, Mapping):
        return None, None
    count = token_number(payload.get("count"))
    if count is None and "count" not in payload:
        count = _tokens_length(payload.get("tokens"))
    return count, token_number(payload.get("max_model_len"))


def parse_llamacpp_tokenize(payload: Any) -> int | None:
    """The count from llama.cpp's ``/tokenize`` answer: ``{"tokens": [ids]}`` or, with pieces,
    ``{"tokens": [{"id", "piece"}, ...]}``."""
    return _tokens_length(payload.get("tokens")) if isinstance(payload, Mapping) else None


def _tokens_length(tokens: Any) -> int | None:
    if not isinstance(tokens, list) or not tokens:
        return None
    for token in tokens:
        ident = token.get("id") if isinstance(token, Mapping) else token
        if isinstance(ident, bool) or not isinstance(ident, int) or ident < 0:
            return None
    return token_number(len(tokens))


def parse_apply_template(payload: Any) -> str | None:
    """The rendered prompt from llama.cpp's ``/apply-template`` answer ``{"prompt": "..."}``."""
    prompt = payload.get("prompt") if isinstance(payload, Mapping) else None
    return prompt if isinstance(prompt, str) and prompt else None


def parse_models_context(payload: Any, model: str | None = None) -> int | None:
    """``max_model_len`` from a ``/v1/models`` answer (vLLM, SGLang, the reference server): the
    entry named ``model`` if it has one, else the first entry that has one."""
    listed = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(listed, list):
        return None
    entries = [m for m in listed if isinstance(m, Mapping)]
    if model is not None:
        named = [m for m in entries if m.get("id") == model]
        entries = named + [m for m in entries if m.get("id") != model]
    for entry in entries:
        value = token_number(entry.get("max_model_len"))
        if value is not None:
            return value
    return None


def parse_props_context(payload: Any) -> int | None:
    """llama.cpp's slot context from ``GET /props``: ``default_generation_settings.n_ctx`` (older
    builds also had a top-level ``n_ctx``)."""
    if not isinstance(payload, Mapping):
        return None
    settings = payload.get("default_generation_settings")
    if isinstance(settings, Mapping):
        value = token_number(settings.get("n_ctx"))
        if value is not None:
            return value
    return token_number(payload.get("n_ctx"))


def parse_sglang_server_info(payload: Any) -> int | None:
    """SGLang's ``context_length`` server argument from ``GET /server_info`` (null unless the
    server was started with ``--context-length``)."""
    return token_number(payload.get("context_length")) if isinstance(payload, Mapping) else None


# ---------------------------------------------------------------------------------------------
# HTTP


def _request(client: httpx.Client, method: str, url: str, body: Any, timeout: float) -> Any:
    """The JSON of a 200 answer, or None for anything else (refused, 404, not JSON, too big)."""
    import httpx

    try:
        with client.stream(method, url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                return None
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_BODY_BYTES:
                    return None
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, OSError, ValueError):
        return None
    try:
        return jsonsafe.loads(bytes(data), what="the tokenizer's answer")
    except ValueError:
        return None


def _routes(dialect: str | None) -> tuple[str, ...]:
    first = {"llamacpp": ROUTE_LLAMACPP, "sglang": ROUTE_SGLANG}.get(dialect or "", ROUTE_VLLM)
    return (first, *[r for r in ROUTES if r != first])


def _try_route(client: httpx.Client, base: str, route: str, messages: Sequence[Mapping[str, Any]],
               model: str | None, chat_template_kwargs: Mapping[str, Any] | None,
               timeout: float) -> tuple[int, int | None, bool] | None:
    """(count, max_model_len from the answer, estimated) by one route, or None."""
    if route in (ROUTE_VLLM, ROUTE_SGLANG):
        path = "/tokenize" if route == ROUTE_VLLM else "/v1/tokenize"
        body = chat_tokenize_body(messages, model=model, chat_template_kwargs=chat_template_kwargs)
        count, limit = parse_tokenize(_request(client, "POST", base + path, body, timeout))
        return (count, limit, False) if count is not None else None
    if route == ROUTE_LLAMACPP:
        body = apply_template_body(messages, chat_template_kwargs=chat_template_kwargs)
        prompt = parse_apply_template(_request(client, "POST", base + "/apply-template", body, timeout))
        if prompt is None:
            return None
        count = parse_llamacpp_tokenize(_request(client, "POST", base + "/tokenize",
                                                 llamacpp_tokenize_body(prompt), timeout))
        return (count, None, False) if count is not None else None
    text = messages_text(messages)
    for path in ("/v1/tokenize", "/tokenize"):
        count, _ = parse_tokenize(_request(client, "POST", base + path, text_tokenize_body(text, model=model),
                                           timeout))
        if count is not None:
            overhead = TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + TEMPLATE_TOKENS_REPLY
            return count + overhead, None, True
    return None


def _context(client: httpx.Client, base: str, model: str | None, dialect: str | None, route: str | None,
             answered: int | None, timeout: float) -> tuple[int | None, str | None]:
    """The served context: /v1/models first (every server that lists it lists the served value),
    then the tokenize answer's max_model_len (vLLM's is the served one; SGLang's is not), then
    llama.cpp's /props, then SGLang's /server_info."""
    value = parse_models_context(_request(client, "GET", base + "/v1/models", None, timeout), model)
    if value is not None:
        return value, "/v1/models max_model_len"
    sglang = dialect == "sglang" or route == ROUTE_SGLANG
    if answered is not None and not sglang:
        return answered, "/tokenize max_model_len"
    if dialect in (None, "auto", "llamacpp") or route == ROUTE_LLAMACPP:
        value = parse_props_context(_request(client, "GET", base + "/props", None, timeout))
        if value is not None:
            return value, "llama.cpp /props n_ctx"
    if dialect in (None, "auto", "sglang") or sglang:
        for path in ("/server_info", "/get_server_info"):
            value = parse_sglang_server_info(_request(client, "GET", base + path, None, timeout))
            if value is not None:
                return value, f"SGLang {path} context_length"
    return None, None


def count_prompt_tokens(
    client: httpx.Client,
    base_url: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    model: str | None = None,
    dialect: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    routes: Sequence[str] | None = None,
    with_context: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
) -> TokenCount | None:
    """Count ``messages`` as a chat prompt with the server's tokenizer at ``base_url`` (without
    ``/v1``), trying ``routes`` (default: all, the one ``dialect`` suggests first), and, with
    ``with_context``, find the served context. None when the server told neither; never raises."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    counted, route = None, None
    for name in routes if routes is not None else _routes(dialect):
        if name not in ROUTES:
            continue
        counted = _try_route(client, base, name, messages, model, chat_template_kwargs, timeout)
        if counted is not None:
            route = name
            break
    count, answered, estimated = counted if counted is not None else (None, None, False)
    limit, context_source = (None, None)
    if with_context:
        limit, context_source = _context(client, base, model, dialect, route, answered, timeout)
    if count is None and limit is None:
        return None
    source = SOURCES[route] if route is not None else "no tokenize endpoint"
    return TokenCount(count=count, max_context=limit, source=source, estimated=estimated, route=route,
                      context_source=context_source)


def token_counter(
    client: httpx.Client,
    base_url: str,
    *,
    model: str | None = None,
    dialect: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Callable[[list[dict[str, Any]]], int | None]:
    """``count(messages) -> int | None`` for ``workloads.filler.fill_messages``: the first call
    finds the route that answers, later calls use only that one. Counts from the text route are
    left out (their template part is a guess; the filler estimates on its own then)."""
    pinned: list[str] = []

    def count(messages: list[dict[str, Any]]) -> int | None:
        routes = pinned or [r for r in _routes(dialect) if r != ROUTE_TEXT]
        result = count_prompt_tokens(client, base_url, messages, model=model, dialect=dialect,
                                     chat_template_kwargs=chat_template_kwargs, routes=routes,
                                     with_context=False, timeout=timeout)
        if result is None or result.count is None or result.route is None:
            return None
        pinned[:] = [result.route]
        return result.count

    return count
