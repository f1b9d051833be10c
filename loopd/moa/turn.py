# -*- test-case-name: loopd.test.test_moa_turn -*-
"""
What a mesh request is: its turn kind and the values every later step reads from it
(reference C{mesh-moa.md} §1.3), plus v2's tool-loop detection (§6, DESIGN decision 32).

L{read_turn} takes the parsed JSON body of a C{/v1/chat/completions} request and returns a
frozen L{Turn}: nothing is kept across requests. Pure functions over JSON-like values.

A C{tools} value that is not an array is treated as no tools at all (the reference would
forward it verbatim); every other rule is v1's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Final

__all__ = [
    "LOOP_THRESHOLD",
    "ToolCall",
    "ToolLoop",
    "Turn",
    "TurnKind",
    "classify",
    "detect_tool_loop",
    "ingest_tool_calls",
    "json_equal",
    "last_user_text",
    "message_role",
    "read_turn",
    "system_prompt",
    "text_of",
    "tool_names",
]

LOOP_THRESHOLD: Final = 3
"""Identical completed tool calls in a row that make a loop (v2's force-answer threshold)."""


class TurnKind(str, Enum):
    """How a mesh turn is served; the value is the C{x-moa-turn} spelling where there is one."""

    FRESH = "fresh"
    """A new question: the workers fan out."""
    TOOL_RESULT = "tool-result"
    """The agent returns a tool result: the reducer alone answers."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call of the caller's history, with its result once a C{tool} message gave one."""

    call_id: str
    """The call's C{id}, never empty."""
    name: str
    """C{function.name}, never empty."""
    arguments: Any
    """C{function.arguments} as sent (usually a JSON string), None when missing or null."""
    result: str | None = None
    """The C{content} of the C{tool} message that answered it ("" when not a string)."""


@dataclass(frozen=True)
class ToolLoop:
    """The tail of the history repeats one tool call (v2 loop detection)."""

    tool: str
    """The repeated tool's name."""
    count: int
    """How many identical completed calls end the history (at least L{LOOP_THRESHOLD})."""


@dataclass(frozen=True)
class Turn:
    """
    One mesh request as the later steps see it.

    C{messages} and C{tools} hold the request's own JSON values; treat them as read-only.
    """

    kind: TurnKind
    """Fresh or tool result (L{classify})."""
    messages: tuple[Any, ...]
    """The request's C{messages}, empty when missing or not an array."""
    tools: tuple[Any, ...]
    """The request's C{tools}, empty when missing or not an array."""
    tool_calls: tuple[ToolCall, ...]
    """The history's tool calls with their results (L{ingest_tool_calls})."""
    last_user_text: str
    """The text of the last C{user} message (L{last_user_text})."""
    system_prompt: str | None
    """The first C{system} message's content when a string (L{system_prompt})."""

    @property
    def has_tools(self) -> bool:
        """Whether the request declared at least one tool."""
        return bool(self.tools)

    @property
    def allowed_tools(self) -> tuple[str, ...]:
        """The declared tool names (C{tools[*].function.name}), in request order."""
        return tool_names(self.tools)


def message_role(message: object) -> str:
    """A message's C{role} when it is a string, else "" (also for a message that is no object)."""
    if isinstance(message, Mapping):
        role = message.get("role")
        if isinstance(role, str):
            return role
    return ""


def _non_empty_string(value: object) -> str | None:
    """C{value} when it is a non-empty string, else None."""
    return value if isinstance(value, str) and value else None


def ingest_tool_calls(messages: Sequence[Any]) -> tuple[ToolCall, ...]:
    """
    The tool calls of the history with their results (§1.3 "Ingest").

    Each entry of an C{assistant} message's C{tool_calls} array is a call; one whose C{id} or
    C{function.name} is missing or empty is dropped. A C{tool} message gives its C{content}
    (a string, else "") as the result of the first call with its C{tool_call_id} that has no
    result yet; a C{tool} message without a C{tool_call_id}, or matching no such call,
    changes nothing.
    """
    calls: list[ToolCall] = []
    for message in messages:
        role = message_role(message)
        if role == "assistant":
            entries = message.get("tool_calls")
            if not isinstance(entries, list):
                continue
            for entry in entries:
                if not isinstance(entry, Mapping):
                    continue
                function = entry.get("function")
                if not isinstance(function, Mapping):
                    continue
                call_id = _non_empty_string(entry.get("id"))
                name = _non_empty_string(function.get("name"))
                if call_id is None or name is None:
                    continue
                calls.append(ToolCall(call_id, name, function.get("arguments")))
        elif role == "tool":
            call_id = _non_empty_string(message.get("tool_call_id"))
            if call_id is None:
                continue
            content = message.get("content")
            for i, call in enumerate(calls):
                if call.call_id == call_id and call.result is None:
                    result = content if isinstance(content, str) else ""
                    calls[i] = replace(call, result=result)
                    break
    return tuple(calls)


def classify(messages: Sequence[Any]) -> TurnKind:
    """
    The turn kind (§1.3): scanning from the last message back, a C{tool} message makes a
    L{TurnKind.TOOL_RESULT} turn and an C{assistant} message a L{TurnKind.FRESH} one; every
    other role (user, system, missing) is skipped, and reaching the start is Fresh. So a
    user nudge after a tool result is still a tool-result turn.
    """
    for message in reversed(messages):
        role = message_role(message)
        if role == "tool":
            return TurnKind.TOOL_RESULT
        if role == "assistant":
            return TurnKind.FRESH
    return TurnKind.FRESH


def text_of(content: object) -> str | None:
    """
    The text of a message's C{content}: a string as is; an array's C{{"type": "text"}}
    parts joined with a newline (None when it has none); None for anything else.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ]
        if texts:
            return "\n".join(texts)
    return None


def last_user_text(messages: Sequence[Any]) -> str:
    """The text (L{text_of}) of the last C{user} message, "" when there is none or no text."""
    for message in reversed(messages):
        if message_role(message) == "user":
            return text_of(message.get("content")) or ""
    return ""


def system_prompt(messages: Sequence[Any]) -> str | None:
    """The content of the first C{system} message when it is a string, else None."""
    for message in messages:
        if message_role(message) == "system":
            content = message.get("content")
            return content if isinstance(content, str) else None
    return None


def tool_names(tools: Sequence[Any]) -> tuple[str, ...]:
    """The C{function.name} of each tool that has a string one, in order."""
    names = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str):
            names.append(name)
    return tuple(names)


def read_turn(body: object) -> Turn:
    """
    Read a request body (the parsed JSON) into a L{Turn}. Only C{messages} and C{tools}
    are read; a body that is not an object is an empty Fresh turn.
    """
    fields: Mapping[str, Any] = body if isinstance(body, Mapping) else {}
    raw_messages = fields.get("messages")
    raw_tools = fields.get("tools")
    messages = tuple(raw_messages) if isinstance(raw_messages, list) else ()
    tools = tuple(raw_tools) if isinstance(raw_tools, list) else ()
    return Turn(
        kind=classify(messages),
        messages=messages,
        tools=tools,
        tool_calls=ingest_tool_calls(messages),
        last_user_text=last_user_text(messages),
        system_prompt=system_prompt(messages),
    )


def json_equal(left: object, right: object) -> bool:
    """
    Equality of two JSON values as JSON sees it: booleans are not numbers, C{1 == 1.0},
    objects compare regardless of key order, arrays in order.
    """
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left is right
    if isinstance(left, int | float) and isinstance(right, int | float):
        return left == right
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        return left.keys() == right.keys() and all(json_equal(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(json_equal, left, right))
    if type(left) is not type(right):
        return False
    return left == right


def detect_tool_loop(calls: Sequence[ToolCall], threshold: int = LOOP_THRESHOLD) -> ToolLoop | None:
    """
    v2's loop detection (§6): the completed calls (those with a result), in history order,
    end with at least C{threshold} calls of the same name and identical raw arguments
    (L{json_equal}). The L{ToolLoop} counts the whole identical run at the end.
    """
    completed = [call for call in calls if call.result is not None]
    if not completed:
        return None
    last = completed[-1]
    count = 0
    for call in reversed(completed):
        if call.name != last.name or not json_equal(call.arguments, last.arguments):
            break
        count += 1
    return ToolLoop(last.name, count) if count >= threshold else None
