# -*- test-case-name: loopd.test.test_moa_normalize -*-
"""
What a backend's finished reply holds for the mesh (reference/mesh-moa.md §1.8, text
extraction): the first native tool call, the content without thinking, the reasoning, and
the C{finish_reason}.

The reply is the llama client's L{Completion} (the client assembled the stream and refused
what is not a chat completion). The reference turns a native tool call into a C{kind:} line
text and parses it back; here the call is kept as a value, which gives the same outcome
without losing arguments that span lines. Only the first tool call is kept, as in the
reference (§7 quirk 8); L{Reply.tool_calls} says how many there were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loopd.llama.types import Completion
from loopd.moa.normalize_json import normalize_tool_arguments
from loopd.moa.normalize_think import extract_thinking, strip_thinking

__all__ = ["UNKNOWN_TOOL", "Reply", "extract_reply"]

#: The name a native tool call without one gets.
UNKNOWN_TOOL = "unknown"


@dataclass(frozen=True)
class Reply:
    """
    The parts of a backend reply the normalizer reads.

    @ivar content: the content, thinking stripped and trimmed; empty when there is none.
    @ivar reasoning: the thinking inside the content, else the C{reasoning_content},
        trimmed; empty when there is none.
    @ivar tool_name: the first native tool call's name (L{UNKNOWN_TOOL} if it has none), or
        C{None} without native tool calls.
    @ivar tool_arguments: that call's arguments as a JSON object (C{{}} when they are not
        one); C{None} without native tool calls.
    @ivar tool_calls: how many native tool calls the reply had.
    @ivar finish_reason: why generation stopped (C{stop}, C{tool_calls}, C{length}).
    """

    content: str = ""
    reasoning: str = ""
    tool_name: str | None = None
    tool_arguments: dict[str, Any] | None = field(default=None, hash=False)
    tool_calls: int = 0
    finish_reason: str | None = None


def extract_reply(completion: Completion) -> Reply:
    """Read a finished reply into a L{Reply}; never raises."""
    raw = completion.content or ""
    reasoning = extract_thinking(raw) or (completion.reasoning_content or "").strip()
    name: str | None = None
    arguments: dict[str, Any] | None = None
    if completion.tool_calls:
        first = completion.tool_calls[0]
        name = first.name if first.name.strip() else UNKNOWN_TOOL
        parsed = normalize_tool_arguments(True, first.arguments)
        arguments = {} if parsed is None else parsed
    return Reply(
        content=strip_thinking(raw),
        reasoning=reasoning,
        tool_name=name,
        tool_arguments=arguments,
        tool_calls=len(completion.tool_calls),
        finish_reason=completion.finish_reason.value,
    )
