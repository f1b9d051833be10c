# -*- test-case-name: loopd.test.test_message_style -*-
"""
How a configuration file words its problems: a L{MessageStyle} per kind of file.

A problem line names the path of the offending value and shows the value the way the file
spells it. loopd.toml's lines are L{TOML_STYLE}'s,
C{endpoint[0].expect.n_ctx: expected a positive integer, got "8192"}; the lease protocol's
llm-queue.json and models.json use L{JSON_STYLE}, the seed's
C{queues.zen.maxStreams must be a positive integer (got 0)} with values as JSON. Users and
scripts read these lines, so they change only on purpose. Pure code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "JSON_STYLE",
    "TOML_STYLE",
    "MessageStyle",
    "index_path",
    "json_member_path",
    "key_path",
    "render",
    "render_json",
    "toml_string",
]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_BARE_JSON_KEY = re.compile(r"[A-Za-z0-9_$-]+")
_RENDER_LIMIT = 60
_JSON_RENDER_LIMIT = 120


def key_path(parent: str, key: object) -> str:
    """
    Append C{key} to a dotted path; keys that are not bare TOML keys are quoted.
    """
    text = key if isinstance(key, str) else str(key)
    if not _BARE_KEY.fullmatch(text):
        text = toml_string(text)
    return f"{parent}.{text}" if parent else text


def json_member_path(parent: str, key: object) -> str:
    """
    Append C{key} to a JavaScript member path: C{parent.key}, or C{parent["key"]} for a key
    that is not a plain name (a URL).
    """
    text = key if isinstance(key, str) else str(key)
    if _BARE_JSON_KEY.fullmatch(text):
        return f"{parent}.{text}" if parent else text
    return f"{parent}[{json.dumps(text, ensure_ascii=False)}]"


def index_path(parent: str, index: int) -> str:
    """Append an array index to a dotted path: C{endpoint[2]}."""
    return f"{parent}[{index}]"


def toml_string(text: str) -> str:
    """Quote a string as a TOML basic string, escaping what TOML would."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def render(value: object) -> str:
    """
    Show a configuration value the way TOML spells it, shortened if long.

    Booleans read C{true}/C{false}, strings are quoted, a table reads C{a table}.
    """
    if isinstance(value, Mapping):
        return "a table"
    text = _render(value)
    if len(text) > _RENDER_LIMIT:
        text = text[: _RENDER_LIMIT - 3] + "..."
    return text


def _render(value: object) -> str:
    """Render without the length limit; nested tables are shown as C{{...}}."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_render(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{...}"
    if value is None:
        return "null"
    return str(value)


def render_json(value: object) -> str:
    """
    Show a value as compact JSON, the way JavaScript would print it, shortened if long.

    Integral floats read as integers (C{-3.0} is C{-3}); C{NaN} and C{Infinity} read so.
    """
    try:
        text = json.dumps(_plain(value), ensure_ascii=False, separators=(",", ":"), default=str)
    except RecursionError:
        text = "an object" if isinstance(value, Mapping) else "an array"
    if len(text) > _JSON_RENDER_LIMIT:
        text = text[: _JSON_RENDER_LIMIT - 3] + "..."
    return text


def _plain(value: object) -> object:
    """The value with integral floats made ints, as JavaScript would print them."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


@dataclass(frozen=True)
class MessageStyle:
    """
    How one kind of configuration file words its problems and treats unknown keys.

    The rules and readers are the same for every file; only the wording differs.
    """

    member: Callable[[str, object], str]
    """Appends a key to a path (L{key_path}, L{json_member_path})."""
    render: Callable[[object], str]
    """Shows a value in a message (L{render}, L{render_json})."""
    expected: str
    """The line for a value that broke a rule: a format of C{path}, C{expected} (the rule's
    phrase) and C{got} (the rendered value)."""
    note: str
    """The line for any other problem: a format of C{path} and C{message}."""
    table: str
    """What the file calls a table: the phrase for a value that should be one."""
    reject_unknown: bool
    """A key no rule knows is a problem; otherwise it is listed in
    L{loopd._validate.Problems.ignored}."""


TOML_STYLE: Final = MessageStyle(
    member=key_path,
    render=render,
    expected="{path}: expected {expected}, got {got}",
    note="{path}: {message}",
    table="a table",
    reject_unknown=True,
)
"""loopd.toml: C{limits.poll_ms: expected a positive integer, got 0}; unknown keys are errors."""

JSON_STYLE: Final = MessageStyle(
    member=json_member_path,
    render=render_json,
    expected="{path} must be {expected} (got {got})",
    note="{path} {message}",
    table="an object",
    reject_unknown=False,
)
"""
The lease protocol's llm-queue.json and models.json, in the seed's words:
C{queues.zen.maxStreams must be a positive integer (got 0)}. The seed names no error for a
key it does not read, so unknown keys are ignored.
"""
