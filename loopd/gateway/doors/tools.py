# -*- test-case-name: loopd.test.test_doors_tools -*-
"""
The tools a request offers the model, read the same way by every front door's reader: each
tool's name, description and JSON schema (L{offered_tool}), and a C{tool_choice} that names
one tool, which narrows the offer to it (L{narrowed}). Where the APIs put these differs
(chat completions under C{function} with C{parameters}, Messages C{input_schema}, Responses
flat with C{parameters}); the rules do not, and a fix to one is a fix to all.

Every refusal is a 400 C{invalid_request_error} naming the field, with the door's code.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from loopd.gateway.doors.fields import Fields, fail, show
from loopd.llama.types import ToolSchema

__all__ = ["OPENAI_TOOL_CHOICES", "TOOLS_CODE", "narrowed", "offered_tool", "openai_tool_choice"]

TOOLS_CODE: Final = "invalid_tools"
"""The code of a refused tool, in every door."""

OPENAI_TOOL_CHOICES: Final = ("auto", "none", "required")
"""The C{tool_choice} modes of OpenAI's APIs (chat completions and Responses)."""

_FIELDS = Fields(TOOLS_CODE, TOOLS_CODE)

#: The schema of a tool that gives none: it takes an object.
_ANY_OBJECT: Final = {"type": "object"}


def offered_tool(
    tool: Mapping[str, Any],
    where: str,
    offered: Sequence[ToolSchema],
    *,
    schema_key: str = "parameters",
    schema_required: bool = False,
) -> ToolSchema:
    """
    One tool from the object at C{where}: its C{name}, a non-empty string not among
    C{offered}; its optional C{description}, a string; its JSON schema under
    C{schema_key}, an object (absent: one that takes any object, or a 400 when
    C{schema_required}).

    @raise GatewayError: 400 C{invalid_tools} naming the field.
    """
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        fail(TOOLS_CODE, f"{where}.name", "expected a non-empty string")
    if any(other.name == name for other in offered):
        fail(TOOLS_CODE, f"{where}.name", f"{show(name)} is offered twice")
    description = tool.get("description")
    if description is not None:
        description = _FIELDS.string(description, f"{where}.description")
    schema = tool.get(schema_key)
    if schema is None:
        if schema_required:
            fail(TOOLS_CODE, f"{where}.{schema_key}", "required: a JSON schema object")
        schema = dict(_ANY_OBJECT)
    elif not isinstance(schema, dict):
        fail(TOOLS_CODE, f"{where}.{schema_key}", "expected a JSON schema object")
    return ToolSchema(name, description or "", schema)


def narrowed(
    tools: tuple[ToolSchema, ...], name: object, path: str, code: str
) -> tuple[ToolSchema, ...]:
    """
    The offer narrowed to the one tool a C{tool_choice} names (C{name}, the value at
    C{path}).

    @raise GatewayError: 400 C{code} naming C{path}: no string, or no such tool offered.
    """
    wanted = _FIELDS.string(name, path, code)
    chosen = tuple(tool for tool in tools if tool.name == wanted)
    if not chosen:
        fail(code, path, f"{show(wanted)} is not in tools")
    return chosen


def openai_tool_choice(
    value: object,
    tools: tuple[ToolSchema, ...],
    *,
    name_of: Callable[[dict[str, Any]], object],
    path: str,
    code: str,
) -> tuple[str | None, tuple[ToolSchema, ...]] | None:
    """
    OpenAI's C{tool_choice}, the same in chat completions and Responses, with the tools it
    leaves on offer: absent (C{None}, all of them), a mode of L{OPENAI_TOOL_CHOICES}, or
    C{{"type": "function", ...}}, whose name C{name_of} finds in it (at C{path}), which
    narrows the offer to that tool and makes the choice C{required}. C{None} for any other
    value, which the door refuses in its own words.

    @raise GatewayError: 400 C{code} at C{path}: a function choice that names no tool
        offered.
    """
    if value is None:
        return None, tools
    if isinstance(value, str) and value in OPENAI_TOOL_CHOICES:
        return value, tools
    if isinstance(value, dict) and value.get("type") == "function":
        return "required", narrowed(tools, name_of(value), path, code)
    return None
