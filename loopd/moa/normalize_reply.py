# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
What a backend's chat completion body holds for the mesh (reference/mesh-moa.md §1.8, text
extraction): the first native tool call, the content without thinking, the reasoning, and
the C{finish_reason}.

The reference turns a native tool call into a C{kind:} line text and parses it back; here the
call is kept as a value, which gives the same outcome without losing arguments that span
lines. Arguments given as an object rather than JSON text (some OpenAI-compatible servers do)
are taken as they are. Content given as a list of text parts is joined. Both
C{reasoning_content} (llama-server) and C{reasoning} (Ollama, the reference's field) count as
reasoning. Only the first tool call is kept, as in the reference (§7 quirk 8);
L{Reply.tool_calls} says how many there were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loopd.moa.normalize_json import normalize_tool_arguments
from loopd.moa.normalize_think import extract_thinking, strip_thinking

__all__ = ["UNKNOWN_TOOL", "Reply", "extract_reply"]

#: The name a native tool call without one gets.
UNKNOWN_TOOL = "unknown"


@dataclass(frozen=True)
class Reply:
    """
    The parts of a backend reply the normalizer reads.

    @ivar malformed: the body has no C{choices[0].message} object.
    @ivar content: the content, thinking stripped and trimmed; empty when there is none.
    @ivar reasoning: the thinking inside the content, else C{reasoning_content}, else
        C{reasoning}, trimmed; empty when there is none.
    @ivar tool_name: the first native tool call's name (L{UNKNOWN_TOOL} if it has none), or
        C{None} without native tool calls.
    @ivar tool_arguments: that call's arguments as a JSON object (C{{}} when they are not
        one); C{None} without native tool calls.
    @ivar tool_calls: how many native tool calls the reply had.
    @ivar finish_reason: C{choices[0].finish_reason}, if it is a string.
    """

    malformed: bool = False
    content: str = ""
    reasoning: str = ""
    tool_name: str | None = None
    tool_arguments: dict[str, Any] | None = field(default=None, hash=False)
    tool_calls: int = 0
    finish_reason: str | None = None


def _text(value: object) -> str:
    """
    A content value as text: a string, or the text parts of a list joined; else empty.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            part["text"]
            for part in value
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def _native_arguments(value: object) -> dict[str, Any]:
    """
    A native tool call's arguments as an object: JSON text holding an object, or an object;
    anything else is C{{}} (the sanitizer's rule, with the arguments present).
    """
    arguments = normalize_tool_arguments(True, value)
    return {} if arguments is None else arguments


def _first_tool_call(calls: list[Any]) -> tuple[str, dict[str, Any]]:
    """
    The name and arguments of the first entry of a non-empty C{tool_calls} array.
    """
    first = calls[0]
    function = first.get("function") if isinstance(first, dict) else None
    if not isinstance(function, dict):
        return UNKNOWN_TOOL, {}
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        name = UNKNOWN_TOOL
    return name, _native_arguments(function.get("arguments"))


def extract_reply(body: object) -> Reply:
    """
    Read a chat completion body (any JSON value) into a L{Reply}; never raises.
    """
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        return Reply(malformed=True)
    message = choice["message"]
    finish = choice.get("finish_reason")
    finish_reason = finish if isinstance(finish, str) else None
    raw = _text(message.get("content"))
    reasoning = extract_thinking(raw)
    for key in ("reasoning_content", "reasoning"):
        if not reasoning:
            reasoning = _text(message.get(key)).strip()
    calls = message.get("tool_calls")
    name: str | None = None
    arguments: dict[str, Any] | None = None
    count = 0
    if isinstance(calls, list) and calls:
        name, arguments = _first_tool_call(calls)
        count = len(calls)
    return Reply(
        content=strip_thinking(raw),
        reasoning=reasoning,
        tool_name=name,
        tool_arguments=arguments,
        tool_calls=count,
        finish_reason=finish_reason,
    )
