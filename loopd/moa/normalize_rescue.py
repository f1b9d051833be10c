# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
The tool-call rescue: a tool call written into a worker's text instead of the native
C{tool_calls} field (reference/mesh-moa.md §1.9 step 3.1, the guardrails'
C{rescue_tool_call_from_text} with no allowed-tools filter).

Shapes, tried in order, the first call found wins:
 1. JSON: the whole text, each fenced block, then each balanced C{{…}}/C{[…]} span
    (string-aware); at most 32 candidates. A value is an array of calls, an object with a
    C{tool_calls} array, or one call.
 2. C{name [ARGS] {json}} (Mistral) or C{name({json})}.
 3. Qwen XML: C{<function=NAME><parameter=K>V</parameter>…</function>}; V is JSON where it
    parses, else the trimmed string.
 4. Granite: C{<tool_call>{json}</tool_call>}.

A call needs a name and C{arguments}: string arguments must hold a JSON object, JSON null is
not arguments, and any other non-object becomes C{{}}. Only the first 64 KiB (characters
here) of the text is scanned.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from loopd.moa.normalize_json import (
    balanced_spans,
    decode_prefix,
    fenced_blocks,
    loads_strict,
    tool_arguments_of,
    tool_name_of,
)

__all__ = ["MAX_CANDIDATES", "SCAN_LIMIT", "rescue_tool_call"]

#: How much of a text the rescue looks at.
SCAN_LIMIT = 64 * 1024

#: How many JSON candidates the rescue tries.
MAX_CANDIDATES = 32

#: A call found in text: the tool's name and its arguments.
Call = tuple[str, dict[str, Any]]

_NAME = r"(?<![A-Za-z0-9_.\-])([A-Za-z_][A-Za-z0-9_.\-]*)"
_ARGS_MARKER = re.compile(_NAME + r"\s*\[ARGS\]\s*")
_PAREN = re.compile(_NAME + r"\(\s*(?=\{)")


def _arguments(value: Any) -> dict[str, Any] | None:
    """
    A rescued call's arguments, or C{None} when they disqualify the call.
    """
    if isinstance(value, str):
        try:
            value = loads_strict(value)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    if value is None:
        return None
    return value if isinstance(value, dict) else {}


def _call(value: Any) -> Call | None:
    """
    One call-shaped object as a call, or C{None}.
    """
    if not isinstance(value, dict):
        return None
    name = tool_name_of(value)
    present, raw = tool_arguments_of(value)
    arguments = _arguments(raw) if present else None
    if name is None or arguments is None:
        return None
    return name, arguments


def _first_call(value: Any) -> Call | None:
    """
    The first valid call in a parsed JSON value: an array of calls, an object with a
    C{tool_calls} array, or one call.
    """
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    calls = value if isinstance(value, list) else [value]
    for item in calls:
        found = _call(item)
        if found is not None:
            return found
    return None


def _json_candidates(text: str) -> Iterator[Any]:
    """
    Parse the JSON candidates of C{text} in order, at most L{MAX_CANDIDATES} of them.
    """
    seen: set[str] = set()
    candidates = [text.strip(), *fenced_blocks(text), *balanced_spans(text, MAX_CANDIDATES)]
    for candidate in candidates:
        if len(seen) == MAX_CANDIDATES:
            return
        if not candidate or candidate in seen:
            continue
        seen.add(candidate)
        try:
            yield loads_strict(candidate)
        except ValueError:
            continue


def _from_json(text: str) -> Call | None:
    """
    The first call among C{text}'s JSON candidates.
    """
    for value in _json_candidates(text):
        found = _first_call(value)
        if found is not None:
            return found
    return None


def _after_marker(text: str, pattern: re.Pattern[str], closing: str) -> Call | None:
    """
    The first C{name MARKER {json} CLOSING} call: the name is C{pattern}'s group, the JSON
    object starts where the match ends, and C{closing} (if any) must follow it.
    """
    for match in pattern.finditer(text):
        try:
            value, end = decode_prefix(text, match.end())
        except ValueError:
            continue
        if closing and not text[end:].lstrip().startswith(closing):
            continue
        arguments = _arguments(value) if isinstance(value, dict) else None
        if arguments is not None:
            return match.group(1), arguments
    return None


def _args_marker(text: str) -> Call | None:
    """
    A Mistral-style C{name [ARGS] {json}} call.
    """
    return _after_marker(text, _ARGS_MARKER, "")


def _paren(text: str) -> Call | None:
    """
    A C{name({json})} call.
    """
    return _after_marker(text, _PAREN, ")")


def _between(text: str, opener: str, closer: str) -> Iterator[str]:
    """
    Yield what lies between each C{opener} and the next C{closer}, left to right; stops at
    the first opener without a closer (no later one has any either).
    """
    position = 0
    while True:
        start = text.find(opener, position)
        if start == -1:
            return
        end = text.find(closer, start + len(opener))
        if end == -1:
            return
        yield text[start + len(opener) : end]
        position = end + len(closer)


def _xml_value(raw: str) -> Any:
    """
    A Qwen XML parameter's value: JSON where it parses, else the trimmed string.
    """
    value = raw.strip()
    try:
        return loads_strict(value)
    except ValueError:
        return value


def _qwen_xml(text: str) -> Call | None:
    """
    A Qwen XML C{<function=NAME><parameter=K>V</parameter>…</function>} call.
    """
    for body in _between(text, "<function=", "</function>"):
        name, bracket, rest = body.partition(">")
        name = name.strip()
        if not bracket or not name or "\n" in name:
            continue
        arguments: dict[str, Any] = {}
        for parameter in _between(rest, "<parameter=", "</parameter>"):
            key, inner_bracket, raw = parameter.partition(">")
            key = key.strip()
            if inner_bracket and key and "\n" not in key:
                arguments[key] = _xml_value(raw)
        return name, arguments
    return None


def _granite(text: str) -> Call | None:
    """
    A Granite C{<tool_call>{json}</tool_call>} call.
    """
    for body in _between(text, "<tool_call>", "</tool_call>"):
        try:
            value = loads_strict(body)
        except ValueError:
            continue
        found = _first_call(value)
        if found is not None:
            return found
    return None


_SHAPES: tuple[Callable[[str], Call | None], ...] = (
    _from_json,
    _args_marker,
    _paren,
    _qwen_xml,
    _granite,
)


def rescue_tool_call(text: str) -> Call | None:
    """
    Return the first tool call written in C{text} as C{(name, arguments)}, or C{None}.
    """
    text = text[:SCAN_LIMIT]
    for shape in _SHAPES:
        found = shape(text)
        if found is not None:
            return found
    return None
