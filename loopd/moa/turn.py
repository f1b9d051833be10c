# -*- test-case-name: loopd.test.test_moa_turn -*-
"""
What a mesh request is: its turn kind and the values every later step reads from it
(reference C{mesh-moa.md} §1.3), plus v2's tool-loop detection (§6, DESIGN decision 32).

L{read_turn} takes the checked request's messages and tools (the gateway's one request
model, L{loopd.gateway.request.GatewayRequest}) and returns a frozen L{Turn}: nothing is
kept across requests. Pure functions over the llama client's message values.

The front door has already refused what v1 would have skipped (a message without a role, a
tool call without a function): what remains are the typed messages. A C{developer} message
is a system message, and a user turn's text is its text parts joined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Final

from loopd.llama.types import Assistant, ChatMessage, System, Tool, ToolSchema, User

__all__ = [
    "LOOP_THRESHOLD",
    "HistoryCall",
    "ToolLoop",
    "Turn",
    "TurnKind",
    "classify",
    "detect_tool_loop",
    "ingest_tool_calls",
    "last_user_text",
    "read_turn",
    "system_prompt",
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
class HistoryCall:
    """A tool call of the caller's history, with its result once a C{tool} message gave one."""

    call_id: str
    """The call's C{id}, never empty."""
    name: str
    """C{function.name}, never empty."""
    arguments: str
    """C{function.arguments} as sent (JSON text)."""
    result: str | None = None
    """The content of the C{tool} message that answered it."""


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
    """

    kind: TurnKind
    """Fresh or tool result (L{classify})."""
    messages: tuple[ChatMessage, ...]
    """The request's messages."""
    tools: tuple[ToolSchema, ...]
    """The request's tools."""
    tool_calls: tuple[HistoryCall, ...]
    """The history's tool calls with their results (L{ingest_tool_calls})."""
    last_user_text: str
    """The text of the last user message (L{last_user_text})."""
    system_prompt: str | None
    """The first system message's content (L{system_prompt})."""

    @property
    def has_tools(self) -> bool:
        """Whether the request declared at least one tool."""
        return bool(self.tools)

    @property
    def allowed_tools(self) -> tuple[str, ...]:
        """The declared tool names, in request order."""
        return tuple(tool.name for tool in self.tools)


def ingest_tool_calls(messages: Sequence[ChatMessage]) -> tuple[HistoryCall, ...]:
    """
    The tool calls of the history with their results (§1.3 "Ingest").

    Each tool call of an assistant message is a call; one whose id or name is empty is
    dropped. A tool message gives its content as the result of the first call with its
    C{tool_call_id} that has no result yet; a tool message with an empty C{tool_call_id},
    or matching no such call, changes nothing.
    """
    calls: list[HistoryCall] = []
    for message in messages:
        if isinstance(message, Assistant):
            calls.extend(
                HistoryCall(call.id, call.name, call.arguments)
                for call in message.tool_calls
                if call.id and call.name
            )
        elif isinstance(message, Tool) and message.tool_call_id:
            for i, call in enumerate(calls):
                if call.call_id == message.tool_call_id and call.result is None:
                    calls[i] = replace(call, result=message.content)
                    break
    return tuple(calls)


def classify(messages: Sequence[ChatMessage]) -> TurnKind:
    """
    The turn kind (§1.3): scanning from the last message back, a tool message makes a
    L{TurnKind.TOOL_RESULT} turn and an assistant message a L{TurnKind.FRESH} one; user and
    system messages are skipped, and reaching the start is Fresh. So a user nudge after a
    tool result is still a tool-result turn.
    """
    for message in reversed(messages):
        if isinstance(message, Tool):
            return TurnKind.TOOL_RESULT
        if isinstance(message, Assistant):
            return TurnKind.FRESH
    return TurnKind.FRESH


def last_user_text(messages: Sequence[ChatMessage]) -> str:
    """The text of the last user message, "" when there is none."""
    for message in reversed(messages):
        if isinstance(message, User):
            return message.content
    return ""


def system_prompt(messages: Sequence[ChatMessage]) -> str | None:
    """The content of the first system message, None when there is none."""
    for message in messages:
        if isinstance(message, System):
            return message.content
    return None


def read_turn(messages: Sequence[ChatMessage], tools: Sequence[ToolSchema] = ()) -> Turn:
    """Read a request's messages and tools into a L{Turn}."""
    history = tuple(messages)
    return Turn(
        kind=classify(history),
        messages=history,
        tools=tuple(tools),
        tool_calls=ingest_tool_calls(history),
        last_user_text=last_user_text(history),
        system_prompt=system_prompt(history),
    )


def detect_tool_loop(
    calls: Sequence[HistoryCall], threshold: int = LOOP_THRESHOLD
) -> ToolLoop | None:
    """
    v2's loop detection (§6): the completed calls (those with a result), in history order,
    end with at least C{threshold} calls of the same name and identical raw arguments (the
    same JSON text, as the reference compares them). The L{ToolLoop} counts the whole
    identical run at the end.
    """
    completed = [call for call in calls if call.result is not None]
    if not completed:
        return None
    last = completed[-1]
    count = 0
    for call in reversed(completed):
        if call.name != last.name or call.arguments != last.arguments:
            break
        count += 1
    return ToolLoop(last.name, count) if count >= threshold else None
