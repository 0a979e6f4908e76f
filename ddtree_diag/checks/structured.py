"""Structured output: is an answer that had to be JSON (or a tool call) what was asked for?

A case asks for structure with an OpenAI ``response_format`` (``json_object``: any JSON object;
``json_schema``: valid against the schema) or with ``tools`` (a call whose arguments parse and
validate against the tool's ``parameters``). The check is per answer and pure; the findings compare
the speculative answer's check with the baseline's (a server that enforces structure only without
speculation is the bug; one that never enforces it is a configuration fact).

jsonschema is imported on first use: most runs never validate a schema, and the remote path
must start fast. The single-file build has no jsonschema (it needs a compiled extension): there,
answers are still parsed as JSON and tool calls matched by name, and schemas go unvalidated.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ddtree_diag.errors import UsageError
from ddtree_diag.records import ProbeCase, ProbeResult, StructuredCheck

KINDS = ("json_object", "json_schema", "tool_call")
TOOL_CHOICES = ("none", "auto", "required")
# Markup of a tool call that a server's tool parser should have turned into ``tool_calls``
# (Hermes/Qwen, Mistral, Llama 3.x, DeepSeek, GLM styles), or a bare {"name":…, "arguments":…}.
_TOOL_MARKUP = re.compile(
    r"<tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|<｜tool▁calls▁begin｜>|<\|tool_call\|>|<function=|"
    r"\{\s*\"name\"\s*:\s*\"[^\"]+\"\s*,\s*\"(?:arguments|parameters)\"\s*:"
)
_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```\s*$", re.S)
DETAIL_CHARS = 120


# ---------------------------------------------------------------------------------------------
# Request attributes (matrix prompts): normalised to the OpenAI wire format, refused in one line


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """A JSON Schema that jsonschema accepts as one (its own metaschema), or a UsageError."""
    if not isinstance(schema, dict):
        raise UsageError(f"{where} must be a JSON Schema object (a table), got {type(schema).__name__}")
    try:
        from jsonschema import SchemaError
        from jsonschema.validators import validator_for
    except ImportError:  # the single-file build has no jsonschema (compiled deps): the server checks it
        return schema

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
        raise UsageError(f"{where}{path} is not valid JSON Schema: {_short(exc.message)}") from None
    return schema


def response_format(value: Any, where: str) -> dict[str, Any] | None:
    """``"json_object"`` / ``"text"`` shorthands or an OpenAI response_format table."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be \"json_object\", \"text\" or a table with type")
    kind = value.get("type")
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise UsageError(f"{where}.type must be text, json_object or json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise UsageError(f"{where}.json_schema needs a schema table (and a name)")
    check_schema(spec["schema"], f"{where}.json_schema.schema")
    name = spec.get("name") or "answer"
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise UsageError(f"{where}.json_schema.name must be 1-64 letters, digits, _ or -, got {name!r}")
    return {"type": "json_schema", "json_schema": {**spec, "name": name}}


def tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """OpenAI ``tools`` (a bare ``{name, description, parameters}`` is wrapped as a function)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where} must be a non-empty list of tools")
    out, names = [], set()
    for index, tool in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(tool, dict):
            raise UsageError(f"{at} must be a table")
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict):
            raise UsageError(f"{at}.type must be \"function\"")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise UsageError(f"{at} has no name (function.name)")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise UsageError(f"{at}: tool name {name!r} must be 1-64 letters, digits, _, . or -")
        if name in names:
            raise UsageError(f"{at}: tool name {name!r} is used twice")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        check_schema(parameters, f"{at}.function.parameters")
        entry = {"name": name, "parameters": parameters}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        out.append({"type": "function", "function": entry})
    return out


def tool_choice(value: Any, tool_list: list[dict[str, Any]] | None, where: str) -> Any:
    """``none`` / ``auto`` / ``required`` / a tool's name / OpenAI's ``{type, function: {name}}``."""
    if value is None:
        return None
    if not tool_list:
        raise UsageError(f"{where} needs tools")
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value
    name = value
    if isinstance(value, dict):
        name = (value.get("function") or {}).get("name") if isinstance(value.get("function"), dict) else None
    known = [t["function"]["name"] for t in tool_list]
    if not isinstance(name, str) or name not in known:
        raise UsageError(f"{where} must be none, auto, required or a tool name ({', '.join(known)}), got {value!r}")
    return {"type": "function", "function": {"name": name}}


# ---------------------------------------------------------------------------------------------
# Answers


def expected_kind(case: ProbeCase) -> str | None:
    """What the case's answer must be: a tool call, JSON, JSON valid against a schema, or None."""
    if case.tools and case.tool_choice != "none":
        return "tool_call"
    kind = (case.response_format or {}).get("type")
    return kind if kind in ("json_object", "json_schema") else None


def must_call(case: ProbeCase) -> str | None:
    """The tool the answer must call (a name), ``"*"`` for any (required), or None (auto)."""
    choice = case.tool_choice
    if choice == "required":
        return "*"
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    return None


def check(result: ProbeResult) -> StructuredCheck | None:
    """The structured-output check of one answer (None: the case asks for no structure, or the
    request failed)."""
    case = result.case
    kind = expected_kind(case)
    if kind is None or not result.ok:
        return None
    cut = (result.finish_reason or "").lower() == "length"
    if kind == "tool_call":
        problem = tool_call_problem(case, result)
        if problem is None and not result.tool_calls:
            return StructuredCheck(kind, True, "answered in text (tool_choice auto)")
    else:
        problem = json_problem(result.output, case.response_format or {})
    if problem is None:
        unvalidated = kind != "json_object" and not can_validate()
        return StructuredCheck(kind, True, "valid JSON; schema not validated (no jsonschema in this build)"
                               if unvalidated else "valid")
    return StructuredCheck(kind, False, problem + (" (cut at max_tokens)" if cut else ""), cut=cut)


def can_validate() -> bool:
    """Whether schemas can be validated here (jsonschema is installed)."""
    from importlib.util import find_spec

    return find_spec("jsonschema") is not None


class DuplicateKey(ValueError):
    """A JSON object that names one key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys without a word, and a schema validator then
    # sees one: a key said twice is most often a span of the answer written twice
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise DuplicateKey(f"the key {key!r} appears twice in one object (a span written twice?)")
        seen.add(key)
    return dict(pairs)


def _loads(text: str) -> Any:
    """``json.loads`` that refuses an object naming a key twice (``DuplicateKey``)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def json_problem(text: str, fmt: dict[str, Any]) -> str | None:
    """Why ``text`` is not the JSON ``fmt`` asks for (None: it is)."""
    stripped = text.strip()
    if not stripped:
        return "empty answer, JSON expected"
    try:
        value = _loads(stripped)
    except DuplicateKey as exc:
        return str(exc)
    except ValueError as exc:
        fenced = _FENCE.match(stripped)
        if fenced and _parses(fenced.group(1)):
            return "JSON inside a Markdown code fence: the server did not enforce the format"
        return f"not JSON: {_short(str(exc))}"
    if fmt.get("type") == "json_object" and not isinstance(value, dict):
        return f"JSON {type(value).__name__}, an object expected"
    schema = (fmt.get("json_schema") or {}).get("schema")
    if fmt.get("type") == "json_schema" and isinstance(schema, dict):
        return schema_problem(value, schema)
    return None


def schema_problem(value: Any, schema: dict[str, Any]) -> str | None:
    """The first way ``value`` breaks ``schema`` (None: it is valid, or cannot be validated here)."""
    try:
        from jsonschema.validators import validator_for
    except ImportError:  # the single-file build: JSON and tool names are still checked
        return None

    validator = validator_for(schema)(schema)
    error = next(iter(sorted(validator.iter_errors(value), key=lambda e: list(e.path))), None)
    if error is None:
        return None
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f"does not match the schema at ${path}: {_short(error.message)}"


def tool_call_problem(case: ProbeCase, result: ProbeResult) -> str | None:
    """Why the answer is not a valid call of the case's tools (None: it is, or none was due)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in case.tools or []}
    calls = result.tool_calls or []
    wanted = must_call(case)
    if not calls:
        if has_tool_markup(result.output):
            return "a tool call left in the content: the server's tool parser did not extract it"
        if wanted == "*":
            return "no tool call (tool_choice required)"
        if wanted:
            return f"no tool call (tool_choice names {wanted})"
        return None
    for index, call in enumerate(calls):
        name = call.get("name")
        if name not in schemas:
            return f"tool_calls[{index}] calls {name!r}, not one of the tools ({', '.join(schemas)})"
        if wanted not in (None, "*") and name != wanted:
            return f"tool_calls[{index}] calls {name!r}, tool_choice names {wanted}"
        arguments = call.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = _loads(arguments) if arguments.strip() else {}
            except DuplicateKey as exc:
                return f"tool_calls[{index}] ({name}) arguments: {exc}"
            except ValueError as exc:
                return f"tool_calls[{index}] ({name}) arguments are not JSON: {_short(str(exc))}"
        if not isinstance(arguments, dict):
            return f"tool_calls[{index}] ({name}) arguments are not a JSON object"
        if isinstance(schemas[name], dict):
            problem = schema_problem(arguments, schemas[name])
            if problem:
                return f"tool_calls[{index}] ({name}) arguments {problem}"
    return None


def has_tool_markup(text: str) -> bool:
    """Text holding a tool call's markup (a parser that did not run)."""
    return bool(text) and _TOOL_MARKUP.search(text) is not None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _short(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= DETAIL_CHARS else line[: DETAIL_CHARS - 1] + "…"
