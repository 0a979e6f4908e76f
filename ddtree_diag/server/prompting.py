"""A request's prompt: the chat template with the request's tools, as the server renders it.

``render`` is ``Engine.render_prompt`` (the same template kwargs, the same no-template
transcript, the same one-line error) plus ``tools`` and ``add_generation_prompt``, so a chat
request and ``/tokenize`` count the same tokens. A template that ignores ``tools`` (the embedded
SmolLM2 template, the tiny test models') still tells the model about them: a system note lists
them as JSON with the ``<tool_call>`` format the server parses.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Callable
from typing import Any

from ddtree_diag.errors import UsageError, one_line

TOOLS_NOTE = (
    "Functions you can call:\n{tools}\n"
    'To call one, answer <tool_call>{{"name": <name>, "arguments": <JSON object>}}</tool_call>'
)


def tools_note(tools: list[dict[str, Any]]) -> str:
    """The system note that lists ``tools`` for a template that does not: one compact JSON line
    per function (every token of it is prompt)."""
    lines = (json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":")) for t in tools)
    return TOOLS_NOTE.format(tools="\n".join(lines))


def with_tools_note(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tools note appended to the first system message (or as a new one)."""
    note = tools_note(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{note}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def render_text(tokenizer: Any, messages: list[dict[str, Any]], *, thinking: bool | None = None,
                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
    """The prompt's text (see the module docstring); UsageError when the template refuses."""
    if not getattr(tokenizer, "chat_template", None):
        if tools:
            messages = with_tools_note(messages, tools)
        text = "".join(f"{m.get('role')}: {m.get('content')}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    try:
        if not tools:
            return tokenizer.apply_chat_template(messages, **kwargs)
        text = tokenizer.apply_chat_template(messages, tools=tools, **kwargs)
        if text == tokenizer.apply_chat_template(messages, **kwargs):  # the template ignores tools
            text = tokenizer.apply_chat_template(with_tools_note(messages, tools), **kwargs)
        return text
    except Exception as exc:  # jinja's TemplateError (raise_exception in the template) and kin
        message = one_line(exc, 200) or type(exc).__name__
        raise UsageError(f"the chat template cannot render these messages: {message}") from None


def render(tokenizer: Any, messages: list[dict[str, Any]], *, thinking: bool | None = None,
           tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids (no special tokens added: the template has them)."""
    text = render_text(tokenizer, messages, thinking=thinking, tools=tools, add_generation_prompt=add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# Answers per tokenizer object, keyed by its id with a weak reference beside: an id is reused once
# its object is freed (a later tokenizer would find the freed one's answer), the reference tells.
_PER_TOKENIZER: dict[tuple[str, int, bool | None], tuple[Any, bool]] = {}


def _per_tokenizer(question: str, tokenizer: Any, setting: bool | None, answer: Callable[[], bool]) -> bool:
    """``answer()`` for this tokenizer object and setting, computed once while the object lives."""
    key = (question, id(tokenizer), setting)
    found = _PER_TOKENIZER.get(key)
    if found is not None and found[0]() is tokenizer:
        return found[1]
    value = answer()
    with contextlib.suppress(TypeError):  # an object without weak references (None among them): not kept
        _PER_TOKENIZER[key] = (weakref.ref(tokenizer), value)
    return value


def speaks_harmony(tokenizer: Any) -> bool:
    """Whether the tokenizer is gpt-oss's (harmony format): its answers always carry an analysis
    (reasoning) message, whatever the thinking setting, and read as ``parsing.harmony_as_think``
    puts them. Once per tokenizer (its vocabulary is a dict of 200k entries built on each call)."""
    from ddtree_diag.engine.arch import speaks_harmony as vocab_speaks_harmony

    return _per_tokenizer(
        "harmony", tokenizer, None,
        lambda: tokenizer is not None and vocab_speaks_harmony(tokenizer.get_vocab()),
    )


def think_prefilled(tokenizer: Any, thinking: bool | None) -> bool:
    """Whether the template opens the think block itself for this thinking setting (the prompt
    ends with ``<think>``), so the answer starts inside it. Templates that leave it to the model
    (Qwen3's) or never think (SmolLM2's) do not."""
    def answer() -> bool:
        if speaks_harmony(tokenizer):
            return False  # harmony_as_think opens its think block itself
        try:
            text = render_text(tokenizer, [{"role": "user", "content": "Hi"}], thinking=thinking)
        except UsageError:
            text = ""
        return text.rstrip().endswith("<think>")

    return _per_tokenizer("prefilled", tokenizer, thinking, answer)
