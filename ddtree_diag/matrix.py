"""Probe matrices: TOML files plus command-line overrides, expanded into ProbeCases.

A matrix file (all sections optional)::

    [defaults]                 # scalars for every case
    max_tokens = 48
    temperature = 0.0
    repeat = 1

    [axes]                     # lists; the matrix is their cartesian product
    enable_thinking = [false, true]
    tree_budget = [16, 64]     # "default" = let the server choose
    temperature = [0.0]
    max_tokens = [48]

    [prompts.hello]            # named prompts: text = "..." or messages = [{role, content}, ...]
    text = "Say hello in one short sentence."

    [prompts.city]             # workloads: structured output, tool calls, long context, prefix cache
    text = "Give the capital of France as JSON."
    json_schema = { type = "object", properties = { city = { type = "string" } }, required = ["city"] }
    # response_format = "json_object" | { type = "json_schema", json_schema = {...} }
    # tools = [{ name = "get_weather", parameters = {...} }]   tool_choice = "required" | "auto" | NAME
    # fill_tokens = [0, 2048, 8192]   # the prompt filled with a document to ~N tokens, question last
    # prefix_cache = true              # each case sent twice in a row: first, repeat

    [extra]                    # extra request fields, sent verbatim with every case
    [gate]                     # thresholds, read by `ddtree-diag gate`
    [load]                     # the load sweep's budget per level: seconds, requests (ddtree_diag.load)

``[axes] concurrency = [1, 4, 16]`` is no axis of the cases: it asks for the load sweep at those levels.

Cases come out in a stable order: prompt, thinking, budget, temperature, max_tokens, repeat.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ddtree_diag.budget import parse_budget
from ddtree_diag.checks import structured
from ddtree_diag.errors import UsageError
from ddtree_diag.records import ProbeCase

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Request fields the tool sets itself: an [extra] copy would quietly change what a case means.
_CORE_FIELDS = {
    "model": "pass --model",
    "messages": "write the prompt under [prompts]",
    "stream": "pass --stream or --no-stream",
    "max_tokens": "use the max_tokens axis",
    "max_completion_tokens": "use the max_tokens axis",
    "temperature": "use the temperature axis",
    "tree_budget": "use the tree_budget axis",
    "n": "a case reads one choice",
}
_TOP_KEYS = {"name", "description", "defaults", "axes", "prompts", "extra", "gate", "baseline", "load"}
_DEFAULT_KEYS = {"max_tokens", "temperature", "repeat", "enable_thinking", "tree_budget", "system"}
_AXIS_KEYS = {"enable_thinking", "tree_budget", "temperature", "max_tokens", "concurrency"}
_PROMPT_KEYS = {
    "text", "messages", "system", "response_format", "json_schema", "tools", "tool_choice", "fill_tokens",
    "prefix_cache", "enable_thinking", "max_tokens",
}
MAX_FILL_TOKENS = 1 << 20
_ROLES = {"system", "user", "assistant", "developer", "tool"}


@dataclass
class Prompt:
    """One named prompt: its messages and the workload it asks for."""

    messages: list[dict[str, Any]]
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    fill_tokens: list[int | None] = field(default_factory=lambda: [None])  # None / 0: as written
    fill_declared: bool = False  # the matrix gave fill_tokens (--fill then replaces only those)
    prefix_cache: bool = False
    # This prompt's own axis values (a reasoning prompt thinks, a long one needs more tokens);
    # None: the matrix's axis
    enable_thinking: list[bool | None] | None = None
    max_tokens: list[int] | None = None

    def variants(self) -> list[tuple[int | None, str | None]]:
        """(context tokens, cache role) for each case this prompt makes per matrix cell."""
        roles: list[str | None] = ["first", "repeat"] if self.prefix_cache else [None]
        return [(fill, role) for fill in self.fill_tokens for role in roles]


@dataclass
class Matrix:
    """A parsed matrix: prompts and axis values, before expansion."""

    prompts: dict[str, Prompt] = field(default_factory=dict)
    enable_thinking: list[bool | None] = field(default_factory=lambda: [False, True])
    tree_budget: list[int | None] = field(default_factory=lambda: [None])
    temperature: list[float] = field(default_factory=lambda: [0.0])
    max_tokens: list[int] = field(default_factory=lambda: [48])
    repeat: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    concurrency: list[int] | None = None  # the load sweep's levels (None: no sweep)
    load: dict[str, Any] = field(default_factory=dict)  # the sweep's [load] table
    source: str | None = None  # the file it came from

    def cases(self) -> list[ProbeCase]:
        if not self.prompts:
            raise UsageError("no prompt to probe: give --prompt TEXT or a --matrix with [prompts]")
        cases = []
        cells = (
            (prompt_id, prompt, thinking, budget, temperature, max_tokens, repeat)
            for prompt_id, prompt in self.prompts.items()
            for thinking, budget, temperature, max_tokens, repeat in itertools.product(
                prompt.enable_thinking or self.enable_thinking,
                self.tree_budget,
                self.temperature,
                prompt.max_tokens or self.max_tokens,
                range(self.repeat),
            )
        )
        for prompt_id, prompt, thinking, budget, temperature, max_tokens, repeat in cells:
            # A prefix-cache pair's two requests are adjacent: the repeat follows its first at once.
            for context_tokens, cache_role in prompt.variants():
                cases.append(
                    ProbeCase(
                        prompt_id=prompt_id,
                        messages=prompt.messages,
                        enable_thinking=thinking,
                        tree_budget=budget,
                        temperature=temperature,
                        max_tokens=max_tokens,
                        repeat=repeat,
                        extra=dict(self.extra),
                        response_format=prompt.response_format,
                        tools=prompt.tools,
                        tool_choice=prompt.tool_choice,
                        context_tokens=context_tokens,
                        cache_role=cache_role,
                    )
                )
        return cases


def load_matrix(path: str | Path) -> Matrix:
    """Read a matrix TOML file. UsageError names the file, and the key or line at fault."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"matrix file not found: {path} (built-in matrices: {', '.join(builtin_names())})") from None
    except OSError as exc:
        raise UsageError(
            f"cannot read matrix file {path}: {exc.strerror} (built-in matrices: {', '.join(builtin_names())})"
        ) from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None
    return matrix_from_dict(data, source=str(path))


def matrix_from_dict(data: dict[str, Any], source: str = "<matrix>") -> Matrix:
    _no_unknown(data, _TOP_KEYS, source, "")
    matrix = Matrix(source=source)
    defaults = _table(data, "defaults", source)
    _no_unknown(defaults, _DEFAULT_KEYS, source, "defaults.")
    axes = _table(data, "axes", source)
    _no_unknown(axes, _AXIS_KEYS, source, "axes.")
    for key in _AXIS_KEYS:
        if key in axes:
            values = axes[key]
            if not isinstance(values, list) or not values:
                raise UsageError(f"{source}: axes.{key} must be a non-empty list")
            section = "axes"
        elif key in defaults:
            values, section = [defaults[key]], "defaults"
        else:
            continue
        setattr(matrix, key, [_axis_value(key, v, f"{source}: {section}.{key}") for v in values])
    if "repeat" in defaults:
        matrix.repeat = _positive_int(defaults["repeat"], f"{source}: defaults.repeat")
    system = defaults.get("system")
    if system is not None and not isinstance(system, str):
        raise UsageError(f"{source}: defaults.system must be a string")
    for prompt_id, spec in _table(data, "prompts", source).items():
        matrix.prompts[prompt_id] = _prompt(prompt_id, spec, system, source)
    matrix.extra = _table(data, "extra", source)
    for key, instead in _CORE_FIELDS.items():
        if key in matrix.extra:
            raise UsageError(f"{source}: [extra] cannot set {key!r}: {instead}")
    matrix.gate = _table(data, "gate", source)
    matrix.baseline = _table(data, "baseline", source)
    matrix.load = _table(data, "load", source)
    return matrix


def _table(data: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise UsageError(f"{source}: [{key}] must be a table")
    return value


def _no_unknown(table: dict[str, Any], allowed: set[str], source: str, prefix: str) -> None:
    for key in table:
        if key not in allowed:
            hint = ", ".join(sorted(allowed))
            raise UsageError(f"{source}: unknown key {prefix}{key!r} (known: {hint})")


def _prompt(prompt_id: str, spec: Any, system: str | None, source: str) -> Prompt:
    where = f"{source}: prompts.{prompt_id}"
    prompt = Prompt(_prompt_messages(prompt_id, spec, system, source))
    if not isinstance(spec, dict):
        return prompt
    if "json_schema" in spec and "response_format" in spec:
        raise UsageError(f"{where}: give json_schema or response_format, not both")
    if "json_schema" in spec:
        schema = structured.check_schema(spec["json_schema"], f"{where}.json_schema")
        prompt.response_format = {"type": "json_schema",
                                  "json_schema": {"name": _schema_name(prompt_id), "schema": schema, "strict": True}}
    else:
        prompt.response_format = structured.response_format(spec.get("response_format"), f"{where}.response_format")
    prompt.tools = structured.tools(spec.get("tools"), f"{where}.tools")
    prompt.tool_choice = structured.tool_choice(spec.get("tool_choice"), prompt.tools, f"{where}.tool_choice")
    if "fill_tokens" in spec:
        fills = spec["fill_tokens"]
        prompt.fill_tokens = parse_fill(fills if isinstance(fills, list) else [fills], f"{where}.fill_tokens")
        prompt.fill_declared = True
    for key in ("enable_thinking", "max_tokens"):
        if key in spec:
            values = spec[key] if isinstance(spec[key], list) else [spec[key]]
            if not values:
                raise UsageError(f"{where}.{key} must not be empty")
            setattr(prompt, key, [_axis_value(key, v, f"{where}.{key}") for v in values])
    cache = spec.get("prefix_cache", False)
    if not isinstance(cache, bool):
        raise UsageError(f"{where}.prefix_cache must be true or false")
    prompt.prefix_cache = cache
    return prompt


def _schema_name(prompt_id: str) -> str:
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in prompt_id)[:64]
    return name or "answer"


def parse_fill(values: list[Any], where: str) -> list[int | None]:
    """Fill lengths in tokens: 0 = the prompt as written; ``2k`` / ``8k`` shorthands."""
    if not values:
        raise UsageError(f"{where} must be a non-empty list of token counts")
    out: list[int | None] = []
    for value in values:
        number = value
        if isinstance(value, str):
            text = value.strip().lower()
            scale = 1024 if text.endswith("k") else 1
            try:
                number = int(text[:-1] if scale > 1 else text) * scale
            except ValueError:
                number = value
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_FILL_TOKENS:
            raise UsageError(f"{where}: expected token counts 0-{MAX_FILL_TOKENS} (or 2k, 8k, ...), got {value!r}")
        fill = number or None
        if fill not in out:
            out.append(fill)
    return out


def _prompt_messages(
    prompt_id: str, spec: Any, system: str | None, source: str
) -> list[dict[str, Any]]:
    where = f"{source}: prompts.{prompt_id}"
    if isinstance(spec, str):
        spec = {"text": spec}
    if not isinstance(spec, dict):
        raise UsageError(f"{where} must be a string or a table with text or messages")
    _no_unknown(spec, _PROMPT_KEYS, source, f"prompts.{prompt_id}.")
    system = spec.get("system", system)
    if "messages" in spec:
        messages = check_messages(spec["messages"], where)
    elif isinstance(spec.get("text"), str) and spec["text"]:
        messages = [{"role": "user", "content": spec["text"]}]
    else:
        raise UsageError(f"{where} needs text = \"...\" or messages = [...]")
    if system and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Validate an OpenAI-style message list (roles and string content)."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise UsageError(f"{where}: messages[{index}] needs a role in {sorted(_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise UsageError(f"{where}: messages[{index}].content must be a string")
    return [dict(m) for m in messages]


def _axis_value(key: str, value: Any, where: str) -> Any:
    if key == "enable_thinking":
        return parse_thinking(value, where)
    if key == "tree_budget":
        return parse_budget(value, where)
    if key == "temperature":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise UsageError(f"{where}: temperature must be a finite number >= 0, got {value!r}")
        return float(value)
    return _positive_int(value, where)


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: expected an integer >= 1, got {value!r}")
    return value


def parse_thinking(value: Any, where: str = "--thinking") -> bool | None:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    if text in ("default", "unset", "none"):
        return None
    raise UsageError(f"{where}: expected on/off/default, got {value!r}")


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def apply_overrides(
    matrix: Matrix,
    *,
    prompts: list[str] | None = None,
    thinking: str | None = None,
    budget: str | None = None,
    temperature: str | None = None,
    max_tokens: str | None = None,
    repeat: int | None = None,
    fill: str | None = None,
) -> Matrix:
    """Command-line values replace the matrix's (each flag takes a comma list)."""
    if prompts:
        chosen: dict[str, Prompt] = {}
        for index, prompt in enumerate(prompts):
            prompt_id, spec = _resolve_prompt(prompt, matrix, index, len(prompts))
            if prompt_id in chosen and chosen[prompt_id] is not spec:
                # two files of one name in two folders (a/q.txt, b/q.txt): both run, the second as q-2
                taken = prompt_id
                prompt_id = next(f"{taken}-{n}" for n in range(2, len(prompts) + 2) if f"{taken}-{n}" not in chosen)
            chosen[prompt_id] = spec
        matrix.prompts = chosen
    if fill is not None:
        # --fill resizes the matrix's long-context prompts; with none, it makes every prompt one
        fills = parse_fill(split_list(fill), "--fill")
        declared = [p for p in matrix.prompts.values() if p.fill_declared]
        for spec in declared or matrix.prompts.values():
            spec.fill_tokens = list(fills)
    if thinking is not None:
        matrix.enable_thinking = [parse_thinking(v) for v in split_list(thinking)] or [None]
    if budget is not None:
        matrix.tree_budget = [parse_budget(v) for v in split_list(budget)] or [None]
    if temperature is not None:
        matrix.temperature = [
            _axis_value("temperature", _to_float(v), "--temperature") for v in split_list(temperature)
        ]
    if max_tokens is not None:
        matrix.max_tokens = [_axis_value("max_tokens", _to_int(v), "--max-tokens")
                             for v in split_list(max_tokens)]
    if repeat is not None:
        matrix.repeat = _positive_int(repeat, "--repeat")
    return matrix


def _to_float(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text  # rejected by the caller with the flag named


def _to_int(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def _resolve_prompt(prompt: str, matrix: Matrix, index: int, count: int) -> tuple[str, Prompt]:
    """--prompt is a matrix prompt id, @file (text, or JSON messages), or literal text."""
    if prompt in matrix.prompts:
        return prompt, matrix.prompts[prompt]
    if prompt.startswith("@"):
        path = Path(prompt[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--prompt {prompt}: cannot read file ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"--prompt {prompt}: not UTF-8 text (byte {exc.start})") from None
        prompt_id = path.stem or f"p{index}"
        if path.suffix == ".json":
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise UsageError(f"--prompt {prompt}: invalid JSON ({exc})") from None
            if isinstance(data, dict):
                data = data.get("messages")
            return prompt_id, Prompt(check_messages(data, f"--prompt {prompt}"))
        text = text.strip()
        if not text:
            raise UsageError(f"--prompt {prompt}: file is empty")
        return prompt_id, Prompt([{"role": "user", "content": text}])
    if not prompt.strip():
        raise UsageError("--prompt: empty prompt")
    prompt_id = "prompt" if count == 1 else f"prompt{index + 1}"
    return prompt_id, Prompt([{"role": "user", "content": prompt}])


# ---------------------------------------------------------------------------------------------
# Built-in matrices (package data in ddtree_diag/matrices) and the matrix a run asks for

DEFAULT_MATRIX = "smoke"


def builtin_names() -> list[str]:
    """Names of the matrices shipped with the tool."""
    folder = resources.files("ddtree_diag.matrices")
    return sorted(entry.name[: -len(".toml")] for entry in folder.iterdir() if entry.name.endswith(".toml"))


def builtin_matrix(name: str) -> Matrix | None:
    """A built-in matrix by bare name, or None. Read through importlib.resources, so it works from
    an installed package, a checkout and the single-file zipapp alike."""
    candidate = resources.files("ddtree_diag.matrices") / f"{name}.toml"
    if not candidate.is_file():
        return None
    return matrix_from_dict(tomllib.loads(candidate.read_text(encoding="utf-8")), source=f"{name} (built-in)")


@dataclass
class MatrixRequest:
    """What a command asked for: a matrix (file or built-in name) and the flags that override it."""

    matrix: str | None = None
    prompts: list[str] = field(default_factory=list)
    thinking: str | None = None
    budget: str | None = None
    temperature: str | None = None
    max_tokens: str | None = None
    repeat: int | None = None
    fill: str | None = None


def resolve_matrix(request: MatrixRequest) -> Matrix:
    """The matrix file (path or built-in name) with flag overrides applied."""
    spec = request.matrix
    if spec is None and not request.prompts:
        spec = DEFAULT_MATRIX
    if spec is None:
        matrix = Matrix()
    elif not Path(spec).exists() and os.sep not in spec and not spec.endswith(".toml"):
        found = builtin_matrix(spec)
        if found is None:
            raise UsageError(
                f"matrix {spec!r} is neither a file nor a built-in matrix (built-in matrices: "
                f"{', '.join(builtin_names())})"
            )
        matrix = found
    else:
        matrix = load_matrix(spec)
    return apply_overrides(
        matrix,
        prompts=request.prompts,
        thinking=request.thinking,
        budget=request.budget,
        temperature=request.temperature,
        max_tokens=request.max_tokens,
        repeat=request.repeat,
        fill=request.fill,
    )
