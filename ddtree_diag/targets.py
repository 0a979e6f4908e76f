"""Fleet targets: a TOML targets file, or ``--url`` given more than once.

    [defaults]                        # every target's, unless it sets its own
    dialect = "vllm"
    api_key_env = "FLEET_API_KEY"     # the key is read from this variable, never from the file

    [[target]]                        # three targets, gpu-1 .. gpu-3
    name = "gpu-{n}"
    url = "http://gpu-{n}:8000"
    n = [1, 2, 3]                     # or "1..3"

    [[target]]                        # one per container, reached through pct on the host
    name = "ct-{id}"
    via = "ssh root@pve pct exec {id} --"
    url = "http://127.0.0.1:8000"
    ids = [101, 102, 103]             # a plural list fills {ids} and {id}
    baseline = "budget0"

A key that is not a target setting and holds a list (or an ``"A..B"`` range of integers) is a
pattern variable: the target is repeated for every value (every combination, with several), and
``{name}`` placeholders in its strings are filled in. Every problem (an unknown key, a duplicate
name, a pattern that expands to nothing, an environment variable that is not set) is a
UsageError naming the file and the target, before any request is sent.

A target's own keys win over the command line's flags, which win over ``[defaults]``.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ddtree_diag.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class TargetSpec:
    """One server of a fleet, as the targets file (or a ``--url``) names it."""

    name: str
    url: str | None = None
    via: str | None = None
    dialect: str | None = None
    model: str | None = None
    api_key_env: str | None = None  # the variable holding the key (the key itself is never written)
    baseline: str | None = None  # budget0 | url:URL, as --baseline
    against: str | None = None  # this target's known-good JSON report (gate)
    group: str | None = None  # replicas compared with each other (default: the served model)
    timeout: float | None = None  # seconds per request, as --timeout
    deadline: float | None = None  # seconds for this target's whole run, as --deadline
    stream: bool | None = None
    max_response_bytes: str | None = None

    @property
    def api_key(self) -> str | None:
        """The key from its environment variable (checked present by ``load_targets``)."""
        return os.environ.get(self.api_key_env) if self.api_key_env else None


# Each setting's expected TOML type, for one-line errors.
_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "url": (str,), "via": (str,), "dialect": (str,), "model": (str,), "api_key_env": (str,),
    "baseline": (str,), "against": (str,), "group": (str,), "timeout": (int, float), "deadline": (int, float),
    "stream": (bool,), "max_response_bytes": (str, int),
}
SETTINGS = tuple(f.name for f in fields(TargetSpec))
assert set(SETTINGS) == set(_TYPES)
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_RANGE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")
MAX_TARGETS = 100_000  # a pattern typo (1..10000000) is an error, not an hour of expansion


def load_targets(path: str, overrides: dict[str, Any] | None = None) -> list[TargetSpec]:
    """The targets of a TOML file, expanded and checked. ``overrides``: settings the command line
    gave (they replace ``[defaults]``, never a target's own keys)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--targets {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"--targets {path}: is a directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--targets {path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--targets {path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - {"defaults", "target", "targets"})
    if unknown:
        raise UsageError(f"--targets {path}: unknown table or key {unknown[0]!r} (expected [defaults] and "
                         "[[target]] tables)")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise UsageError(f"--targets {path}: [defaults] must be a table")
    _check_settings(defaults, f"{path}: [defaults]", allow_variables=False)
    entries = [*_tables(data, "target", path), *_tables(data, "targets", path)]
    if not entries:
        raise UsageError(f"--targets {path}: no [[target]] table")
    specs: list[TargetSpec] = []
    for index, entry in enumerate(entries, 1):
        where = f"{path}: target {index}" + (f" ({entry['name']!r})" if isinstance(entry.get("name"), str) else "")
        merged = {**defaults, **(overrides or {}), **{k: v for k, v in entry.items() if k in SETTINGS}}
        variables = {k: v for k, v in entry.items() if k not in SETTINGS}
        specs.extend(_expand(merged, variables, where, len(specs)))
    return finish(specs, path)


def from_urls(urls: list[str], overrides: dict[str, Any] | None = None) -> list[TargetSpec]:
    """``--url`` given more than once: one target per URL, named by its host:port, every other
    setting from the command line."""
    specs = [_spec({**(overrides or {}), "url": url}, f"--url {url}") for url in urls]
    return finish(specs, "--url")


def finish(specs: list[TargetSpec], source: str) -> list[TargetSpec]:
    """Checks across targets: every name unique, every key variable set."""
    seen: dict[str, int] = {}
    for spec in specs:
        if spec.name in seen:
            raise UsageError(f"{source}: two targets are named {spec.name!r}: give each a name of its own "
                             "(e.g. name = \"gpu-{n}\")")
        seen[spec.name] = 1
        if spec.api_key_env and os.environ.get(spec.api_key_env) is None:
            raise UsageError(f"{source}: target {spec.name!r}: api_key_env {spec.api_key_env} is not set "
                             "in the environment")
        if spec.dialect not in (None, "auto"):
            from ddtree_diag.backends.dialects import DIALECTS

            if spec.dialect not in DIALECTS:
                raise UsageError(f"{source}: target {spec.name!r}: unknown dialect {spec.dialect!r}; choose auto "
                                 f"or one of {', '.join(DIALECTS)}")
    return specs


def _tables(data: dict[str, Any], key: str, path: str) -> list[dict[str, Any]]:
    value = data.get(key, [])
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise UsageError(f"--targets {path}: {key} must be [[{key}]] tables")
    return value


def _check_settings(table: dict[str, Any], where: str, *, allow_variables: bool) -> None:
    for key, value in table.items():
        if key == "api_key":
            raise UsageError(f"{where}: api_key is never written in a file: set api_key_env to the name of "
                             "an environment variable that holds it")
        if key not in _TYPES:
            if allow_variables:
                continue
            raise UsageError(f"{where}: unknown key {key!r} (known: {', '.join(SETTINGS)})")
        expected = _TYPES[key]
        if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
            names = " or ".join(t.__name__.replace("str", "a string").replace("float", "a number")
                                .replace("int", "an integer").replace("bool", "true/false") for t in expected)
            raise UsageError(f"{where}: {key} must be {names}, got {value!r}")


def _values(key: str, value: Any, where: str) -> list[str]:
    """A pattern variable's values as text: a list of strings/integers, or an ``A..B`` range."""
    if isinstance(value, str):
        match = _RANGE.match(value)
        if match is None:
            raise UsageError(f"{where}: unknown key {key!r} (known: {', '.join(SETTINGS)}; a pattern variable "
                             "is a list, e.g. n = [1, 2, 3], or a range, n = \"1..3\")")
        low, high = int(match.group(1)), int(match.group(2))
        if high - low >= MAX_TARGETS:
            raise UsageError(f"{where}: {key} = {value!r} expands to more than {MAX_TARGETS} targets")
        items: list[Any] = list(range(low, high + 1))
    elif isinstance(value, list):
        items = value
    else:
        raise UsageError(f"{where}: unknown key {key!r} (known: {', '.join(SETTINGS)})")
    if not items:
        raise UsageError(f"{where}: {key} = {value!r} expands to nothing")
    if not all(isinstance(item, (str, int)) and not isinstance(item, bool) for item in items):
        raise UsageError(f"{where}: {key} must list strings or integers")
    return [str(item) for item in items]


def _expand(settings: dict[str, Any], variables: dict[str, Any], where: str, numbered: int) -> list[TargetSpec]:
    _check_settings(settings, where, allow_variables=False)
    values = {key: _values(key, value, where) for key, value in variables.items()}
    # A plural variable also fills its singular placeholder: ids = [...] gives {ids} and {id}.
    names = {key: key for key in values}
    names |= {key[:-1]: key for key in values if key.endswith("s") and key[:-1] and key[:-1] not in values}
    texts = {k: v for k, v in settings.items() if isinstance(v, str)}
    used = set()
    for key, text in texts.items():
        for placeholder in _PLACEHOLDER.findall(text):
            if placeholder not in names:
                known = ", ".join(sorted(names)) or "none"
                raise UsageError(f"{where}: {key} uses {{{placeholder}}}, which no list defines (pattern "
                                 f"variables here: {known})")
            used.add(names[placeholder])
    unused = sorted(set(values) - used)
    if unused:
        raise UsageError(f"{where}: unknown key {unused[0]!r}: as a pattern variable it must appear as "
                         f"{{{unused[0]}}} in the name, url or via")
    if not values:
        return [_spec(settings, where)]
    order = list(values)
    combos = 1
    for key in order:
        combos *= len(values[key])
    if numbered + combos > MAX_TARGETS:
        raise UsageError(f"{where}: the pattern expands to more than {MAX_TARGETS} targets")
    specs = []
    for combo in itertools.product(*(values[key] for key in order)):
        chosen = dict(zip(order, combo, strict=True))

        def fill(text: str, chosen: dict[str, str] = chosen) -> str:
            return _PLACEHOLDER.sub(lambda m: chosen[names[m.group(1)]], text)

        filled = {k: fill(v) if isinstance(v, str) else v for k, v in settings.items()}
        specs.append(_spec(filled, where))
    return specs


def _spec(settings: dict[str, Any], where: str) -> TargetSpec:
    if not settings.get("url"):
        raise UsageError(f"{where}: no url (the server's base URL; with via, as seen from the far side)")
    from ddtree_diag.backends.http import normalise_url

    try:
        url = normalise_url(settings["url"])
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    for key in ("timeout", "deadline"):
        value = settings.get(key)
        if value is not None and not 0 < float(value) < float("inf"):
            raise UsageError(f"{where}: {key} must be a number of seconds > 0")
    size = settings.get("max_response_bytes")
    name = settings.get("name") or default_name(url, settings.get("via"))
    if not name.strip() or any(ch in name for ch in "\n\r\t"):
        raise UsageError(f"{where}: name {name!r} is not a usable target name")
    return TargetSpec(**{**settings, "name": name, "url": url,
                         "max_response_bytes": str(size) if size is not None else None})


def default_name(url: str, via: str | None) -> str:
    """A target without a name is named by its host:port, and the command it is reached through."""
    from ddtree_diag.backends.http import host_of

    host = host_of(url)
    return f"{host} via {via}" if via else host
