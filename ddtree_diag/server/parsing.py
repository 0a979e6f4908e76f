"""What the generated text means: reasoning, content and tool calls, streamed or whole.

Pure text processing, no I/O. Each parser is fed the text as it arrives (``feed``) and flushed at
the end (``finish``); both return OpenAI ``delta`` objects. A non-streaming answer is the same
parser fed the whole text once, then ``assemble``d into one message, so a streamed answer and a
whole one cannot disagree.

- ``ReasoningSplitter``: text before the first ``</think>`` is reasoning (a leading ``<think>``
  dropped), after it content (leading newlines dropped); no end tag at all: everything is
  reasoning (vLLM's Qwen3 parser does the same). A tag cut across chunks is held back.
- ``ForcedToolCall``: the answer of a tool-call constraint (``tool_choice`` "required" or a named
  function): one call, its arguments streamed as they are generated.
- ``TaggedToolCalls``: ``tool_choice`` "auto": Hermes/Qwen ``<tool_call>{...}</tool_call>`` blocks
  become tool calls, the text around them stays content, a block that does not parse stays too.
- ``harmony_as_think``: a gpt-oss answer (harmony messages, decoded with their special tokens)
  rewritten in the forms above, so the same parsers read it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Any

Delta = dict[str, Any]

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


# Harmony (gpt-oss): each message of an answer is "[<|start|>ROLE[ to=RECIPIENT]]<|channel|>NAME
# [ to=RECIPIENT][ <|constrain|>FORMAT]<|message|>BODY", the body ended by <|end|>, <|return|> or
# <|call|> (or where the next message starts); the last one may still be growing.
_HARMONY_HEADER_RE = re.compile(
    r"(?:<\|start\|>(?P<role>[^<]*))?<\|channel\|>(?P<channel>[^<\s]*)(?P<header>[^<]*)"
    r"(?:<\|constrain\|>[^<]*)?<\|message\|>"
)
_HARMONY_BODY_END_RE = re.compile(r"<\|(?:end|return|call)\|>|(?=<\|(?:start|channel)\|>)")
_HARMONY_RECIPIENT_RE = re.compile(r"\bto=(?:functions\.)?(?P<name>[^\s<]+)")
_HARMONY_CHANNEL = "<|channel|>"
_HARMONY_SPECIAL_RE = re.compile(r"<\|(?:start|end|return|call|channel|message|constrain|endoftext|startoftext)\|>")


def harmony_as_think(text: str) -> str:
    """A gpt-oss answer decoded with its special tokens, in the forms the parsers here read: its
    analysis messages as one ``<think>`` block (closed when the first other message starts), then
    the final messages' text and the commentary preambles (apart by a blank line), and each tool
    call (a message to a recipient, named in the channel's header or the role's) as a Hermes
    ``<tool_call>`` block, closed once its arguments end or form a whole JSON object (the stop
    token that ends the call is not in a finished answer's text). A growing answer's rewrite only
    grows, so a stream of it stays consistent: a header still arriving adds nothing yet, and
    analysis after the answer has started is left out. Text without harmony tokens is unchanged."""
    if not text.strip():
        return ""  # a leading space may still become a role header's
    first = text.find("<|")
    lead = text if first < 0 else text[:first]
    # the first message's role header (" to=functions.f"): a recipient, not text
    lead_role = lead if _HARMONY_RECIPIENT_RE.match(lead.strip()) else ""
    if lead_role or not lead.strip():
        lead = ""
    if _HARMONY_CHANNEL not in text:
        if lead_role or any(token in text for token in ("<|start|>", "<|message|>")):
            return lead  # a message's header is arriving
        return _HARMONY_SPECIAL_RE.sub("", text)
    reasoning: list[str] = []
    content: list[str] = [lead] if lead.strip() else []
    answering = bool(content)
    position = 0
    for header in _HARMONY_HEADER_RE.finditer(text):
        if header.start() < position:
            continue
        stop = _HARMONY_BODY_END_RE.search(text, header.end())
        body = text[header.end() : stop.start() if stop else len(text)]
        position = stop.end() if stop else len(text)
        role = header["role"] if header["role"] is not None else (lead_role if header.start() == first else "")
        recipient = _HARMONY_RECIPIENT_RE.search(header["header"]) or _HARMONY_RECIPIENT_RE.search(role)
        if header["channel"] == "analysis" and recipient is None:
            if not answering:
                reasoning.append(body)
            continue
        answering = True
        if recipient is None:
            content.append(body)
            continue
        ended = stop is not None or _is_json_object(body)
        arguments = body.strip() or ("{}" if ended else "")
        content.append(f'{CALL_START}\n{{"name": {json.dumps(recipient["name"])}, "arguments": {arguments}'
                       + (f"}}\n{CALL_END}" if ended else ""))
    head = THINK_START + "\n".join(reasoning) + (THINK_END if answering else "") if reasoning else ""
    return head + "\n\n".join(content)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag`` (held back until
    the next chunk says whether the tag is there)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Splits a thinking model's text at its first ``</think>``; ``feed``/``finish`` give
    ``(reasoning, content)`` pieces.

    ``prefilled``: the prompt already opened the think block (Qwen3.5/3.6, DeepSeek-R1 templates):
    the text is reasoning up to ``</think>``, all of it when the tag never comes. Otherwise
    (Qwen3's template, one that ignores thinking) only a text that itself opens with ``<think>`` has
    reasoning; any other is all content, as vLLM's Qwen3 parser reads it."""

    def __init__(self, prefilled: bool = True) -> None:
        self.pending = ""
        # [detect ->] start -> reasoning -> after_end (dropping newlines) -> content
        self.state = "start" if prefilled else "detect"

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        if self.state == "detect":
            head = self.pending.lstrip()
            if THINK_START.startswith(head):
                return "", ""  # could still be the opening tag
            if head.startswith(THINK_START):
                self.pending, self.state = head, "start"
            else:
                self.state = "content"
        if self.state == "start":
            if THINK_START.startswith(self.pending):
                return "", ""  # could still become the optional leading tag
            self.pending = self.pending.removeprefix(THINK_START)
            self.state = "reasoning"
        if self.state == "reasoning":
            end = self.pending.find(THINK_END)
            if end < 0:
                cut = len(self.pending) - held_suffix(self.pending, THINK_END)
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:end], self.pending[end + len(THINK_END):]
            self.state = "after_end"
        if self.state == "after_end":
            self.pending = self.pending.lstrip("\n")
            if not self.pending:
                return reasoning, ""
            self.state = "content"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: a partial tag is text after all (still reasoning: no end tag)."""
        rest, self.pending = self.pending, ""
        if self.state == "detect":  # a text too short to open a think block is content
            self.state = "content"
            return "", rest
        if self.state in ("start", "reasoning"):
            if self.state == "start":
                rest = rest.removeprefix(THINK_START)
            self.state = "reasoning"
            return rest, ""
        return "", rest


def call_delta(index: int, call_id: str | None = None, name: str | None = None, arguments: str = "") -> Delta:
    """One ``delta.tool_calls`` entry: the first of a call carries its id, type and name."""
    entry: dict[str, Any] = {"index": index}
    function: dict[str, Any] = {"arguments": arguments}
    if call_id is not None:
        entry.update(id=call_id, type="function")
        function = {"name": name, "arguments": arguments}
    entry["function"] = function
    return {"tool_calls": [entry]}


def call_from_json(value: Any, names: Iterable[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of ``{"name": N, "arguments": {...}}`` (or
    ``"parameters"``) naming one of ``names``; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in set(names):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class ValueEnd:
    """Finds where one JSON value ends in text that arrives in pieces (strings and escapes
    tracked, so a brace inside a string does not count)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.started = False

    def scan(self, text: str) -> int | None:
        """Index just past the value's end in ``text`` (None: not ended yet)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1  # a bare string value
                continue
            if ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif ch == '"':
                self.in_string = self.started = True
            elif not ch.isspace() and not self.started:
                self.started = True  # a bare number or literal: ends at , or } (not expected here)
        return None


# The start of a constrained call, up to its arguments value: {"name": "N", "arguments":
CALL_HEAD = re.compile(r'\s*(?:<tool_call>\s*)?\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
                       r'\s*"(?:arguments|parameters)"\s*:\s*')


class ForcedToolCall:
    """The text of a tool-call constraint, as one tool call.

    The call's header goes out once its name has been generated; its arguments stream as they are
    generated, exactly as the model wrote them (the string a client reassembles is the one a
    non-streamed answer holds). Text of another shape (arguments first, a list of calls, or a named
    function's bare arguments) is read whole at the end.
    """

    def __init__(self, tool_names: list[str], named: str | None = None,
                 make_id: Callable[[], str] = new_call_id) -> None:
        self.tool_names = list(tool_names)
        self.named = named  # tool_choice named this function
        self.make_id = make_id
        self.text = ""
        self.args_start: int | None = None  # where the arguments value starts in self.text
        self.sent = 0  # arguments characters already sent
        self.end = ValueEnd()
        self.args_done = False
        self.calls = 0
        self.complete = False

    def feed(self, text: str) -> list[Delta]:
        self.text += text
        deltas: list[Delta] = []
        if self.args_start is None:
            head = CALL_HEAD.match(self.text)
            if head is None:
                return []
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                return []
            if name not in self.tool_names:
                return []  # not a call we can name: read it whole at the end
            self.args_start = head.end()
            self.calls = 1
            deltas.append(call_delta(0, self.make_id(), name))
        if not self.args_done:
            if not self.sent:  # whitespace before the value belongs to no one (chunking must not matter)
                while self.args_start < len(self.text) and self.text[self.args_start].isspace():
                    self.args_start += 1
            start = self.args_start + self.sent
            unseen = self.text[start:]
            end = self.end.scan(unseen)
            piece = unseen if end is None else unseen[:end]
            self.args_done = end is not None
            if piece:
                self.sent += len(piece)
                deltas.append(call_delta(0, arguments=piece))
        return deltas

    def finish(self) -> list[Delta]:
        if self.args_start is not None:
            arguments = self.text[self.args_start: self.args_start + self.sent]
            self.complete = self.args_done and _is_json_object(arguments)
            return []
        calls = self.whole_calls()
        if not calls:
            return [{"content": self.text}] if self.text else []
        self.complete = True
        self.calls = len(calls)
        return [call_delta(i, self.make_id(), name, arguments) for i, (name, arguments) in enumerate(calls)]

    def whole_calls(self) -> list[tuple[str, str]]:
        text = self.text.strip()
        if text.startswith(CALL_START):
            text = text.removeprefix(CALL_START).removesuffix(CALL_END).strip()
        try:
            value = json.loads(text)
        except ValueError:
            return []
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(item, self.tool_names) for item in items]
        if calls and all(calls):
            return calls  # type: ignore[return-value]
        if self.named is not None and isinstance(value, dict):  # the named function's arguments alone
            return [(self.named, json.dumps(value, ensure_ascii=False))]
        return []


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class TaggedToolCalls:
    """``tool_choice`` "auto": ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
    in the content become tool calls; the text around them, and any block that does not parse,
    stays content. A block is sent once it is closed (or the text ends)."""

    def __init__(self, tool_names: list[str], make_id: Callable[[], str] = new_call_id) -> None:
        self.tool_names = list(tool_names)
        self.make_id = make_id
        self.pending = ""
        self.in_block = False
        self.calls = 0

    def feed(self, text: str) -> list[Delta]:
        self.pending += text
        deltas: list[Delta] = []
        while True:
            if not self.in_block:
                start = self.pending.find(CALL_START)
                if start < 0:
                    cut = len(self.pending) - held_suffix(self.pending, CALL_START)
                    _content(deltas, self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return deltas
                _content(deltas, self.pending[:start])
                self.pending = self.pending[start:]
                self.in_block = True
            end = self.pending.find(CALL_END)
            if end < 0:
                return deltas
            block, self.pending = self.pending[: end + len(CALL_END)], self.pending[end + len(CALL_END):]
            self.in_block = False
            deltas.extend(self._block(block))

    def finish(self) -> list[Delta]:
        rest, self.pending = self.pending, ""
        if self.in_block:  # the text ended inside a block (some models stop before the end tag)
            self.in_block = False
            return self._block(rest)
        return [{"content": rest}] if rest else []

    def _block(self, block: str) -> list[Delta]:
        inner = block.removeprefix(CALL_START).removesuffix(CALL_END).strip()
        try:
            call = call_from_json(json.loads(inner), self.tool_names)
        except ValueError:
            call = None
        if call is None:
            return [{"content": block}]
        index, self.calls = self.calls, self.calls + 1
        return [call_delta(index, self.make_id(), call[0], call[1])]


def _content(deltas: list[Delta], text: str) -> None:
    if text:
        deltas.append({"content": text})


def tool_mode(has_tools: bool, tool_choice: Any) -> str:
    """How an answer with tools is read: "none" (no tools, or tool_choice "none"), "auto" (tagged
    calls in the text) or "forced" (a grammar makes the answer a call: "required" or a name)."""
    if not has_tools or tool_choice == "none":
        return "none"
    return "auto" if tool_choice in (None, "auto") else "forced"


class AnswerParser:
    """Reasoning separation, then tool calls, over one answer's text.

    ``tool_mode``: "none" (content is the text), "auto" (``TaggedToolCalls``) or "forced"
    (``ForcedToolCall``: the constraint made the answer a call).
    """

    def __init__(self, *, thinking: bool = False, prefilled: bool = True, tool_mode: str = "none",
                 tool_names: list[str] | None = None, named: str | None = None,
                 make_id: Callable[[], str] = new_call_id) -> None:
        self.splitter = ReasoningSplitter(prefilled) if thinking else None
        self.tools: ForcedToolCall | TaggedToolCalls | None = None
        if tool_mode == "forced":
            self.tools = ForcedToolCall(tool_names or [], named, make_id)
        elif tool_mode == "auto":
            self.tools = TaggedToolCalls(tool_names or [], make_id)

    def feed(self, text: str) -> list[Delta]:
        if self.splitter is None:
            return self._content(text)
        reasoning, content = self.splitter.feed(text)
        return _merge(([{"reasoning_content": reasoning}] if reasoning else []) + self._content(content))

    def finish(self) -> list[Delta]:
        deltas: list[Delta] = []
        if self.splitter is not None:
            reasoning, content = self.splitter.finish()
            if reasoning:
                deltas.append({"reasoning_content": reasoning})
            deltas += self._content(content)
        if self.tools is not None:
            deltas += self.tools.finish()
        return _merge(deltas)

    def _content(self, text: str) -> list[Delta]:
        if self.tools is None:
            return [{"content": text}] if text else []
        return self.tools.feed(text) if text else []

    @property
    def tool_calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    def finish_reason(self, generation_reason: str) -> str:
        """"tool_calls" when the answer is complete tool calls; otherwise the generation's."""
        if self.tool_calls and generation_reason == "stop":
            if isinstance(self.tools, ForcedToolCall) and not self.tools.complete:
                return generation_reason
            return "tool_calls"
        return generation_reason

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as a ``message``'s fields (role excluded)."""
        return assemble(self.feed(text) + self.finish(), reasoning=self.splitter is not None)


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent text pieces of one kind as one delta (fewer, larger chunks)."""
    merged: list[Delta] = []
    for delta in deltas:
        if merged and "tool_calls" not in delta and merged[-1].keys() == delta.keys():
            key = next(iter(delta))
            merged[-1] = {key: merged[-1][key] + delta[key]}
        else:
            merged.append(delta)
    return merged


def assemble(deltas: list[Delta], *, reasoning: bool = False) -> dict[str, Any]:
    """One message from deltas (as a client reassembles a stream): texts joined, each call's
    argument pieces joined by ``index``. ``content`` is None when the answer is only tool calls."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", ()):
            call = calls.setdefault(entry["index"], {"id": entry.get("id"), "type": "function",
                                                     "function": {"name": None, "arguments": ""}})
            if "id" in entry:
                call["id"] = entry["id"]
                call["function"]["name"] = entry["function"]["name"]
            call["function"]["arguments"] += entry["function"].get("arguments", "")
    message: dict[str, Any] = {"content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
        if not content.strip():
            message["content"] = None
    if reasoning:
        message["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas) or None
    return message
