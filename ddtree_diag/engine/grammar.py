"""Constrained decoding with llguidance: JSON mode, JSON Schema and tool calls, in every mode.

``compile_constraint`` turns an OpenAI request's ``response_format`` / ``tools`` / ``tool_choice``
into a ``Constraint`` (an llguidance grammar, checked once), or None when nothing is constrained.
A decoder that gets one makes a ``GrammarState`` per generation and, every round:

1. ``tree(tokens, parents)``: walks the draft tree depth-first with one matcher (consume on the
   way down, roll back on the way up) and computes, for every node, the grammar's mask *after
   the path root→node*, i.e. for the token the target chooses after that node. A node whose token
   the mask of its parent forbids can never be accepted: it and its subtree are pruned.
2. ``apply(logits, ...)``: forbidden tokens' logits become -inf, so argmax (T=0) and sampling
   (T>0) choose only allowed tokens, on each row's own path: the accept walk then commits exactly
   what constrained AR would (lossless at T=0, the same distribution at T>0).
3. ``advance(tokens)``: the matcher takes the round's committed tokens; the generation ends right
   after the token that completes the grammar (finish "stop").

End of generation: llguidance allows its EOS (the HF tokenizer's ``eos_token_id``) where the
grammar may end. The engine stops on its own ``stop_ids`` (EOS plus the template's end-of-turn),
so a mask row's EOS bit stands for all of them: where the grammar may end, every stop id is
allowed; elsewhere none is. Where the grammar is complete (nothing else can follow), the
generation ends at once, without a stop token (there is nothing left for the model to choose).

Thinking templates (``thinking=True``): free text up to and including ``</think>`` comes first,
then optional whitespace, then the constrained part.

A constrained Generation's extras: ``grammar`` (the kind), ``grammar_pruned_nodes`` (draft nodes
ruled out before verify, summed over rounds) and ``grammar_mask_s`` (host seconds in llguidance
and mask work; on a GPU this includes waiting for the verify stage, which the tree's mask
computation overlaps).
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree_diag.errors import UsageError, one_line

# Compact JSON with a space after ',' and ':' (as json.dumps writes it): models emit it naturally,
# and no free whitespace means no runaway whitespace loops. "lenient": False makes llguidance
# refuse (not ignore) keywords it does not implement.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
# OpenAI's rule for function names; it also makes a name safe inside a grammar literal.
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
KINDS = ("json_object", "json_schema", "tool_call")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class GrammarError(UsageError):
    """A response_format / tools / tool_choice the engine cannot constrain to; one line."""


# ---- compiling ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    """A checked llguidance grammar for one request; ``matcher()`` gives a fresh matcher per
    generation (the grammar is compiled once here, a matcher from it takes about a millisecond)."""

    kind: str  # "json_object" | "json_schema" | "tool_call"
    grammar: str = field(repr=False)  # llguidance's serialised grammar
    tokenizer: Any = field(repr=False, compare=False)  # llguidance.LLTokenizer of the HF tokenizer
    tool_names: list[str] = field(default_factory=list)
    thinking: bool = False

    def matcher(self) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the start of the output."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {self.kind} grammar does not compile: {one_line(matcher.get_error(), 300)}")
        return matcher


def compile_constraint(
    tokenizer: Any,
    *,
    response_format: dict | None = None,
    tools: list | None = None,
    tool_choice: Any = None,
    thinking: bool = False,
) -> Constraint | None:
    """The constraint for an OpenAI request's fields, or None when the output is free text.

    A forced tool call (tool_choice "required" or a named function) wins over response_format
    (which constrains message content, and a forced call has none). tool_choice "auto"/None/"none"
    add no constraint: the tools are still checked (shape, name, a valid JSON Schema), so a
    malformed one is refused either way; whether llguidance supports every keyword matters only
    for the tools a call is forced to. ``strict`` is not read: the output always follows the schema.
    Raises ``GrammarError`` (one line naming the field) for anything malformed or unsupported."""
    spec = _response_format(response_format)
    checked_tools = _check_tools(tools)
    forced = _forced_tools(tool_choice, checked_tools)
    if forced:
        for name, parameters in forced:  # only what is constrained must be within llguidance's reach
            index = next(i for i, (n, _) in enumerate(checked_tools) if n == name)
            _check_supported(parameters, f"tools[{index}].function.parameters")
        kind, body, names = "tool_call", _tool_call_rules(forced), [name for name, _ in forced]
    elif spec is not None:
        kind, schema = spec
        body, names = f"body: %json {json.dumps(_with_options(schema))}", []
    else:
        return None
    llg_tokenizer = _llg_tokenizer(tokenizer)
    grammar = _grammar(body, llg_tokenizer, thinking)
    return Constraint(kind=kind, grammar=grammar, tokenizer=llg_tokenizer, tool_names=names, thinking=thinking)


def _response_format(response_format: Any) -> tuple[str, dict] | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", {"type": "object"}
    if kind != "json_schema":
        raise GrammarError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format.json_schema must be an object with a 'schema'")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise GrammarError("response_format.json_schema.schema must be a JSON Schema object")
    _check_schema(schema, "response_format.json_schema")
    _check_supported(schema, "response_format.json_schema")
    return "json_schema", schema


def _check_tools(tools: Any) -> list[tuple[str, dict]]:
    """[(name, parameters schema)] of well-formed tools, checked in order."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise GrammarError("tools must be a list")
    checked: list[tuple[str, dict]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise GrammarError(f"{where}.type must be 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise GrammarError(f"{where}.function must be an object")
        name = function.get("name")
        if not name:
            raise GrammarError(f"{where}.function has no name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise GrammarError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if any(name == seen for seen, _ in checked):
            raise GrammarError(f"{where}.function.name {name!r} is used by another tool")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise GrammarError(f"{where}.function.parameters must be a JSON Schema object")
        _check_schema(parameters, f"{where}.function.parameters")
        checked.append((name, parameters))
    return checked


def _forced_tools(tool_choice: Any, tools: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The tools one of which the output must call (empty: no call is forced)."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return []
    if tool_choice == "required":
        if not tools:
            raise GrammarError("tool_choice 'required' needs at least one tool")
        return tools
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not name:
            raise GrammarError("tool_choice.function has no name")
        for tool in tools:
            if tool[0] == name:
                return [tool]
        raise GrammarError(f"tool_choice names unknown tool {name!r}")
    raise GrammarError(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"
    )


def _check_schema(schema: dict, where: str) -> None:
    """A valid JSON Schema (jsonschema's check against its meta-schema)."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        at = "/".join(str(p) for p in exc.path)
        raise GrammarError(
            f"{where} is not a valid JSON Schema: {one_line(exc.message, 200)}" + (f" (at '{at}')" if at else "")
        ) from None


def _check_supported(schema: dict, where: str) -> None:
    """A schema llguidance implements whole (it names what it would otherwise drop)."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"{where} cannot be read: {one_line(exc, 200)}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:  # llguidance's warnings are features it would otherwise drop
        raise GrammarError(f"{where} {_unsupported(messages[0] if messages else 'is not supported')}")


def _unsupported(message: str) -> str:
    """llguidance's message as the rest of a one-line sentence naming what is unsupported."""
    keys = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if keys:
        names = [k.strip().strip('"') for k in keys.group(1).split(",") if k.strip()]
        label = "keyword" if len(names) == 1 else "keywords"
        return f"uses unsupported {label} " + ", ".join(f"'{n}'" for n in names)
    return f"is not supported: {one_line(message, 200)}"


def _with_options(schema: dict) -> dict:
    return {**schema, "x-guidance": JSON_OPTIONS}


def _tool_call_rules(tools: list[tuple[str, dict]]) -> str:
    """``{"name": N, "arguments": <N's parameters>}`` for one of ``tools``; each parameters schema
    is its own %json document, so its "#/..." references resolve as written."""
    lines = ["body: " + " | ".join(f"call{i}" for i in range(len(tools)))]
    for i, (name, parameters) in enumerate(tools):
        head = json.dumps('{"name": "' + name + '", "arguments": ')  # names are [A-Za-z0-9_-]
        lines.append(f'call{i}: {head} args{i} "}}"')
        lines.append(f"args{i}: %json {json.dumps(_with_options(parameters))}")
    return "\n".join(lines)


def _grammar(body_rules: str, llg_tokenizer: Any, thinking: bool) -> str:
    """The whole lark grammar: ``body`` (after the thinking block when ``thinking``), validated."""
    from llguidance import LLMatcher

    if thinking:
        prefix, rules = _think_prefix(llg_tokenizer)
        start = f"start: {prefix} /[ \\t\\r\\n]*/ body\n{rules}"
    else:
        start = "start: body\n"
    grammar = LLMatcher.grammar_from_lark(start + body_rules)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, llg_tokenizer)
    if is_error:
        raise GrammarError(f"the constraint does not compile: {one_line(messages[0], 300)}")
    return grammar


def _think_prefix(llg_tokenizer: Any) -> tuple[str, str]:
    """(expression, extra rules) for free text through "</think>": a special token (referenced by
    id; an optional "<think>" token may open the block) or plain text, matched lazily so that it
    ends at the first "</think>"."""
    ids = llg_tokenizer.tokenize_str("</think>", parse_special=True)
    if len(ids) == 1 and llg_tokenizer.is_special_token(ids[0]):
        opening = llg_tokenizer.tokenize_str("<think>", parse_special=True)
        special_open = len(opening) == 1 and llg_tokenizer.is_special_token(opening[0])
        opener = f"<[{opening[0]}]>? " if special_open else ""
        return f"{opener}/(?s:.*)/ <[{ids[0]}]>", ""
    return "think", "think[lazy]: /(?s:.*)<\\/think>/\n"


_TOKENIZERS: dict[int, tuple[weakref.ref, Any]] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _llg_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for an HF tokenizer: built once per tokenizer object (about a
    second for a 150k vocabulary) and dropped with it."""
    if tokenizer is None:
        raise GrammarError("constrained decoding needs the model's tokenizer")
    import llguidance.hf

    key = id(tokenizer)
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(key)
        if cached is not None and cached[0]() is tokenizer:
            return cached[1]
        try:
            built = llguidance.hf.from_tokenizer(tokenizer)
        except ValueError as exc:
            raise GrammarError(f"constrained decoding needs a fast (Rust) tokenizer: {one_line(exc, 200)}") from None
        if _misread(built, tokenizer):
            # llguidance reads the vocabulary from the tokenizer's JSON; some transformers releases
            # convert a GGUF tokenizer without its byte-level decoder, so every "Ġ" stays a literal
            # character and the masks are for other bytes. Give it the tokens' own bytes instead.
            built = _from_token_bytes(tokenizer)
            wrong = _misread(built, tokenizer)
            if wrong:
                raise GrammarError(
                    f"constrained decoding: llguidance reads this tokenizer's tokens differently from the tokenizer "
                    f"itself (token {wrong[0]}: {wrong[1]!r} vs {wrong[2]!r}); try another transformers release")
        _TOKENIZERS[key] = (weakref.ref(tokenizer, lambda _ref, key=key: _TOKENIZERS.pop(key, None)), built)
        return built


def _misread(llg_tokenizer: Any, tokenizer: Any) -> tuple[int, bytes, bytes] | None:
    """The first token whose bytes llguidance sees otherwise than the tokenizer decodes it (tokens
    that decode to whole characters, special ones left out), or None."""
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token in range(min(int(tokenizer.vocab_size), llg_tokenizer.vocab_size)):
        if token in specials:
            continue
        text = tokenizer.decode([token])
        if not text or "\ufffd" in text:
            continue  # a piece of a character (byte-level BPE): no text to compare
        theirs = llg_tokenizer.decode_bytes([token])
        if theirs != text.encode("utf-8"):
            return token, theirs, text.encode("utf-8")
    return None


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _from_token_bytes(tokenizer: Any) -> Any:
    """llguidance's tokenizer from each token's bytes: byte-level vocabularies through GPT-2's
    alphabet, others (and special tokens) through their text."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    alphabet = _byte_alphabet()
    size = max(int(tokenizer.vocab_size), len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    tokens = []
    for token, piece in enumerate(pieces):
        piece = piece or ""
        if token not in specials and piece and all(c in alphabet for c in piece):
            tokens.append(bytes(alphabet[c] for c in piece))
        else:
            tokens.append(piece.encode("utf-8"))

    class _Vocabulary:
        eos_token_id = tokenizer.eos_token_id
        bos_token_id = tokenizer.bos_token_id
        special_token_ids = sorted(specials)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return llguidance.LLTokenizer(TokenizerWrapper(_Vocabulary()), n_vocab=size)


# ---- decoding ----------------------------------------------------------------------------------


class GrammarState:
    """One generation's matcher and its rounds' masks (see the module docstring).

    Mask rows live on the host as llguidance's bitmask (uint32 words, bit t = token t allowed),
    already translated from llguidance's EOS to the engine's stop ids; ``apply`` unpacks them on
    the logits' device. ``free`` rows (pruned nodes, stop-token nodes, rows nothing could follow)
    are left unmasked: no accepted path reads them, and an all -inf row would break sampling."""

    def __init__(self, constraint: Constraint, stop_ids: set[int], vocab_size: int) -> None:
        self.constraint = constraint
        self.matcher = constraint.matcher()
        tokenizer = constraint.tokenizer
        self.words = (tokenizer.vocab_size + 31) // 32
        self.vocab = vocab_size
        self.stop_ids = {t for t in stop_ids if 0 <= t < min(vocab_size, 32 * self.words)}
        self.eos = [t for t in tokenizer.eos_tokens if t < 32 * self.words]
        self._rows = 0
        self._grow(64)
        self.free: list[bool] = []
        self.pruned = 0  # draft nodes the grammar ruled out before verify
        self.mask_seconds = 0.0
        self.complete = False

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` mask rows: one host buffer seen three ways, as llguidance's target
        (a pointer), as a torch tensor (for ``apply``) and as Python ints (the per-token checks)."""
        if rows <= self._rows:
            return
        self._buffer = bytearray(4 * self.words * rows)
        self.bits = torch.frombuffer(self._buffer, dtype=torch.int32).view(rows, self.words)
        self._words = memoryview(self._buffer).cast("I")
        self._rows = rows

    # ---- masks ---------------------------------------------------------------------------------
    def tree(self, tokens: list[int], parents: list[int]) -> list[bool]:
        """Masks for every node of a tree (node 0 = the root, the last committed token, already
        consumed); returns which nodes the grammar allows on their path (pruned ones False)."""
        started = time.perf_counter()
        n = len(tokens)
        if n > self._rows:
            self._grow(max(n, 2 * self._rows))
        self.free = [True] * n
        valid = [False] * n
        valid[0] = True
        children: list[list[int]] = [[] for _ in range(n)]
        for node in range(1, n):
            children[parents[node]].append(node)
        self._visit(0, tokens, children, valid)
        self.pruned += n - sum(valid)
        self.mask_seconds += time.perf_counter() - started
        return valid

    def _visit(self, node: int, tokens: list[int], children: list[list[int]], valid: list[bool]) -> None:
        """The matcher holds the path to ``node``: fill its row, then descend into allowed children."""
        matcher = self.matcher
        self._fill(node)
        for child in children[node]:
            token = tokens[child]
            if not self._allows(node, token):
                continue  # pruned, with its subtree
            valid[child] = True
            if token in self.stop_ids:
                continue  # the generation ends at a stop token: nothing after it is committed
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token} its own mask allowed: {matcher.get_error()}")
            self._visit(child, tokens, children, valid)
            matcher.rollback(1)

    def _fill(self, row: int) -> None:
        """Row ``row`` = the matcher's mask now, with its EOS bit standing for the stop ids."""
        base = row * self.words
        self.matcher.unsafe_compute_mask_ptr(self.bits.data_ptr() + 4 * base, 4 * self.words)
        if self.matcher.is_error():  # an empty mask would read as "free": never let that through
            raise RuntimeError(f"llguidance: {self.matcher.get_error()}")
        words = self._words
        ends = any(words[base + (t >> 5)] >> (t & 31) & 1 for t in self.eos)
        for t in self.eos:
            words[base + (t >> 5)] &= ~(1 << (t & 31)) & 0xFFFFFFFF
        if ends:
            for t in self.stop_ids:
                words[base + (t >> 5)] |= 1 << (t & 31)
        # nothing allowed (the grammar is complete and there is no stop id): leave it unmasked
        self.free[row] = not any(words[base : base + self.words])

    def _allows(self, row: int, token: int) -> bool:
        if not 0 <= token < 32 * self.words:
            return False
        return bool(self._words[row * self.words + (token >> 5)] >> (token & 31) & 1)

    def apply(self, logits: torch.Tensor, rows: list[int] | None = None) -> None:
        """Forbidden tokens' logits -> -inf, in place. ``logits`` [k, V] are the tree's rows
        ``rows`` (default: rows 0..k-1), on any device. Free rows are skipped (a tree's pruned
        nodes are often most of it), so only the masked rows are unpacked."""
        started = time.perf_counter()
        index = list(range(logits.shape[0])) if rows is None else rows
        masked = [i for i, row in enumerate(index) if not self.free[row]]
        if masked:
            device = logits.device
            count = len(masked)
            bits = self.bits[[index[i] for i in masked]].to(device)
            shifts = torch.arange(32, dtype=torch.int32, device=device)
            allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(count, 32 * self.words)
            if allowed.shape[1] >= self.vocab:
                allowed = allowed[:, : self.vocab]
            else:  # tokens the model has beyond the tokenizer's: never allowed
                pad = torch.zeros(count, self.vocab - allowed.shape[1], dtype=torch.bool, device=device)
                allowed = torch.cat([allowed, pad], dim=1)
            if count == logits.shape[0]:
                logits.masked_fill_(~allowed, float("-inf"))
            else:
                at = torch.tensor(masked, device=device)
                logits.index_copy_(0, at, logits.index_select(0, at).masked_fill_(~allowed, float("-inf")))
        self.mask_seconds += time.perf_counter() - started

    # ---- commit --------------------------------------------------------------------------------
    def advance(self, tokens: list[int]) -> tuple[int, bool]:
        """The matcher takes a round's committed tokens. Returns (how many of them stand, whether
        the grammar is complete after the last of those): the output ends at a completing token."""
        started = time.perf_counter()
        try:
            for i, token in enumerate(tokens):
                if token in self.stop_ids:
                    return i + 1, False  # the recorder ends the generation at it
                if not self.matcher.consume_token(token):
                    raise RuntimeError(f"llguidance refused committed token {token}: {self.matcher.get_error()}")
                if self.matcher.is_stopped():
                    self.complete = True
                    return i + 1, True
            return len(tokens), False
        finally:
            self.mask_seconds += time.perf_counter() - started

    def extras(self) -> dict[str, Any]:
        """What a Generation reports about the constraint."""
        return {
            "grammar": self.constraint.kind,
            "grammar_pruned_nodes": self.pruned,
            "grammar_mask_s": round(self.mask_seconds, 6),
        }
