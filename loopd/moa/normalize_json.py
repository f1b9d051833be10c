# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
JSON found in a worker's text (reference/mesh-moa.md §1.9 step 1 C{extract_json_object},
C{extract_tool_name_and_arguments} and the guardrails' C{normalize_tool_arguments}), and the
candidate scanners the tool-call rescue uses.

JSON here is strict, as the reference's parser is: C{NaN}, C{Infinity} and numbers that
overflow a float are not JSON; nesting too deep for the parser is "not JSON" too, never an
exception that escapes.
"""

from __future__ import annotations

from typing import Any

from loopd import strict_json

__all__ = [
    "balanced_spans",
    "brace_spans",
    "decode_prefix",
    "extract_json_object",
    "fenced_blocks",
    "loads_strict",
    "normalize_tool_arguments",
    "tool_arguments_of",
    "tool_name_of",
]

#: The fence around a Markdown code block.
FENCE = "```"


def loads_strict(text: str) -> Any:
    """
    Parse C{text} as one strict JSON document (surrounding whitespace allowed), as
    L{loopd.strict_json} reads interoperable JSON.

    @raise ValueError: C{text} is not JSON, or nests too deeply to parse.
    """
    return strict_json.decode(text, interoperable=True)


def decode_prefix(text: str, start: int) -> tuple[Any, int]:
    """
    Parse the strict JSON value that begins exactly at C{text[start]}.

    @return: the value and the index just past it.
    @raise ValueError: no JSON value begins there.
    """
    return strict_json.decode_prefix(text, start, interoperable=True)


def fenced_blocks(text: str) -> list[str]:
    """
    Return the contents of C{text}'s closed triple-backtick blocks, in order, each trimmed
    and without a leading C{json} label.
    """
    parts = text.split(FENCE)
    blocks = []
    for index in range(1, len(parts) - 1, 2):
        block = parts[index].strip()
        if block[:4].lower() == "json":
            block = block[4:].strip()
        blocks.append(block)
    return blocks


def brace_spans(text: str) -> list[str]:
    """
    Return C{text}'s top-level balanced C{{…}} spans, left to right, found by a brace counter
    that, as the reference's does, knows nothing of strings (§1.9 step 1c).
    """
    spans = []
    depth = 0
    start = 0
    for index, char in enumerate(text):
        if char == "{":
            if depth == 0:
                start = index
            depth += 1
        elif char == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append(text[start : index + 1])
    return spans


def balanced_spans(text: str, limit: int) -> list[str]:
    """
    Return up to C{limit} balanced C{{…}}/C{[…]} spans of C{text}, left to right, found by a
    string-aware scanner (brackets inside JSON strings do not count).

    A span that closes with the wrong bracket, or never closes, fails along with every span
    open around it, and the scan goes on after the point of failure; spans inside a span that
    closes are not returned separately. One linear pass.
    """
    spans: list[tuple[int, int]] = []
    stack: list[tuple[str, int]] = []
    in_string = False
    escaped = False
    pairs = {"}": "{", "]": "["}
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = bool(stack)
        elif char in "{[":
            stack.append((char, index))
        elif char in "}]" and stack:
            opener, start = stack.pop()
            if opener != pairs[char]:
                stack.clear()
                continue
            while spans and spans[-1][0] > start:
                spans.pop()
            spans.append((start, index + 1))
    return [text[start:end] for start, end in spans[:limit]]


def extract_json_object(text: str) -> dict[str, Any] | None:
    """
    Find the JSON object a worker's text carries (§1.9 step 1), trying in order: the whole
    trimmed text; each fenced block; each top-level balanced C{{…}} span from the first
    C{{} on (brace counter without strings). The first that parses as an object wins.

    The reference's "the first balanced span that parses" is read as: the spans one after
    the other, so C{"set {x} to {...}"} still finds the second.
    """
    candidates = [text.strip(), *fenced_blocks(text)]
    for candidate in candidates:
        if candidate.startswith("{"):
            found = _object(candidate)
            if found is not None:
                return found
    for span in brace_spans(text):
        found = _object(span)
        if found is not None:
            return found
    return None


def _object(text: str) -> dict[str, Any] | None:
    """
    C{text} parsed as a JSON object, or C{None}.
    """
    try:
        value = loads_strict(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _name(value: object) -> str | None:
    """
    C{value} if it is a non-empty string.
    """
    return value if isinstance(value, str) and value.strip() else None


def tool_name_of(call: dict[str, Any]) -> str | None:
    """
    Return the tool name of a tool-call-shaped object: C{function.name}, else C{name}, else
    C{function} as a string, else C{tool}; an empty name is no name.
    """
    function = call.get("function")
    if isinstance(function, dict):
        name = _name(function.get("name"))
        if name is not None:
            return name
    return _name(call.get("name")) or _name(function) or _name(call.get("tool"))


def tool_arguments_of(call: dict[str, Any]) -> tuple[bool, Any]:
    """
    Return whether a tool-call-shaped object has arguments and, if so, their raw value:
    C{function.arguments}, else C{arguments}.
    """
    function = call.get("function")
    if isinstance(function, dict) and "arguments" in function:
        return True, function["arguments"]
    if "arguments" in call:
        return True, call["arguments"]
    return False, None


def normalize_tool_arguments(present: bool, value: Any) -> dict[str, Any] | None:
    """
    Return a proposal's arguments as a JSON object, or C{None} when none were given.

    An object stays; a string holding a JSON object becomes that object; anything else
    (JSON null, a number, an array, a string that is not an object) becomes C{{}}, as the
    sanitizer of §1.9 says.
    """
    if not present:
        return None
    if isinstance(value, str):
        try:
            value = loads_strict(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}
