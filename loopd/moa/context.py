# -*- test-case-name: loopd.test.test_moa_context -*-
"""
What each mesh call sees: the context packing per role (reference C{mesh-moa.md} §1.5).

Every packer takes a L{Turn} and returns a L{Packed}: the messages, the tools to send
natively (None: send none) and the role's C{max_tokens}. The texts, budgets, windows and
byte cuts are v1's, with two changes the issue adopts from v2 (§6):

  - The tool-result turn keeps chained tool calls together (PR #713): a window of the last
    10 messages that never begins with a bare C{tool} message and always holds the latest
    tool-call round whole, anchored by the user message that started the tool chain. v1
    started one message before the last tool-calling assistant message: earlier rounds
    dropped out and the window could begin with an orphan C{tool} message. (Later v2 code
    also compacts tool results and adds an evidence message; neither is adopted.)
  - The loop guard (DESIGN decision 32): given a L{ToolLoop}, the tool-result reducer gets
    no tools and the guard instruction in its system prompt.

Packed messages are the llama client's message values: a packer keeps the request's own
messages and adds system and user messages of its own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from loopd.llama.types import Assistant, ChatMessage, System, Tool, ToolSchema, User
from loopd.moa.roles import Role
from loopd.moa.turn import ToolLoop, Turn

__all__ = [
    "FAST_MAX_TOKENS",
    "PREAMBLE",
    "REDUCER_MAX_TOKENS",
    "SPECIALIST_MAX_TOKENS",
    "STRONG_MAX_TOKENS",
    "Draft",
    "DraftLike",
    "Packed",
    "augmented_system_prompt",
    "cut_utf8",
    "loop_guard_text",
    "pack_fast",
    "pack_for_reducer",
    "pack_for_role",
    "pack_for_tool_result_turn",
    "pack_specialist",
    "pack_strong",
    "recent_messages",
    "shorten",
    "tool_summary",
    "utf8_length",
]

PREAMBLE: Final = (
    "[Multiple models are analyzing this request in parallel. "
    "Respond with your best answer or tool call. Be direct.]"
)
"""The first words of every packed system prompt."""

FAST_MAX_TOKENS: Final = 256
"""The Fast worker's budget."""
SPECIALIST_MAX_TOKENS: Final = 512
"""A Specialist worker's budget."""
STRONG_MAX_TOKENS: Final = 1024
"""The Strong or Generalist worker's budget (also a reducer packed as a worker)."""
REDUCER_MAX_TOKENS: Final = 2048
"""The reducer's budget, after a conflict and on a tool-result turn."""

SPECIALIST_WINDOW: Final = 4
"""The Specialist sees the last 4 messages of the history, filtered."""
STRONG_WINDOW: Final = 10
"""The Strong worker sees the last 10 messages of the history, filtered."""
TOOL_RESULT_WINDOW: Final = 10
"""The tool-result reducer sees about the last 10 messages (v2)."""
DESCRIPTION_MAX_BYTES: Final = 80
"""A tool description's first line longer than this is cut to 77 bytes plus "..."."""
PAYLOAD_MAX_BYTES: Final = 500
"""A worker payload longer than this is cut to 497 bytes plus "..." for the reducer."""

_ELLIPSIS: Final = "..."


@dataclass(frozen=True)
class Packed:
    """The context of one upstream call."""

    messages: tuple[ChatMessage, ...]
    """The chat messages, system prompt first."""
    tools: tuple[ToolSchema, ...] | None
    """The tools to declare upstream, or None to send no C{tools} field."""
    max_tokens: int
    """The role's budget."""


class DraftLike(Protocol):
    """
    What the reducer is shown of one worker's output after a conflict; the normalizer's
    L{loopd.moa.outcome.Outcome} has this shape, and so has L{Draft}.
    """

    @property
    def worker(self) -> str:
        """The worker's model name."""

    @property
    def text(self) -> str:
        """Its normalized payload."""

    @property
    def tool_name(self) -> str | None:
        """The tool it proposed, if any."""

    @property
    def tool_arguments(self) -> object:
        """The proposal's arguments (a JSON value), None when it had none."""


@dataclass(frozen=True)
class Draft:
    """A plain L{DraftLike}."""

    worker: str
    """The worker's model name."""
    text: str
    """Its normalized payload."""
    tool_name: str | None = None
    """The tool it proposed, if any."""
    tool_arguments: Any = None
    """The proposal's arguments (a JSON value), None when it had none."""


def utf8_length(text: str) -> int:
    """The length of C{text} in UTF-8 bytes (a lone surrogate counts 3, as WTF-8)."""
    return len(text.encode("utf-8", "surrogatepass"))


def cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of C{text} of at most C{max_bytes} UTF-8 bytes: never half a character."""
    if max_bytes <= 0:
        return ""
    used = 0
    for i, char in enumerate(text[:max_bytes]):
        code = ord(char)
        used += 1 if code < 0x80 else 2 if code < 0x800 else 3 if code < 0x10000 else 4
        if used > max_bytes:
            return text[:i]
    return text[:max_bytes]


def shorten(text: str, max_bytes: int) -> str:
    """
    C{text} when it fits in C{max_bytes} UTF-8 bytes, else its first C{max_bytes - 3}
    bytes (L{cut_utf8}) plus "...".
    """
    if utf8_length(text) <= max_bytes:
        return text
    return cut_utf8(text, max_bytes - len(_ELLIPSIS)) + _ELLIPSIS


def augmented_system_prompt(turn: Turn) -> str:
    """L{PREAMBLE}, then a blank line and the agent's system prompt when it sent one."""
    if turn.system_prompt is None:
        return PREAMBLE
    return f"{PREAMBLE}\n\n{turn.system_prompt}"


def recent_messages(messages: Sequence[ChatMessage], count: int) -> tuple[ChatMessage, ...]:
    """The last C{count} messages of the whole history, whatever their role."""
    return tuple(messages[max(len(messages) - count, 0) :])


def tool_summary(tool: ToolSchema) -> str:
    """
    C{"{name}: {first line of description}"}; a first line over 80 UTF-8 bytes is cut to 77
    bytes plus "...".
    """
    description = tool.description
    first = description.split("\n", 1)[0]
    if "\n" in description and first.endswith("\r"):
        first = first[:-1]
    return f"{tool.name}: {shorten(first, DESCRIPTION_MAX_BYTES)}"


def _native_tools(turn: Turn) -> tuple[ToolSchema, ...] | None:
    """The request's tools when it declared any, else None."""
    return turn.tools if turn.has_tools else None


def _with_last_user(messages: list[ChatMessage], turn: Turn) -> tuple[ChatMessage, ...]:
    """
    C{messages}, plus a user message with the last user text unless the last message's
    content is already exactly that text (a user turn with media parts never is).
    """
    if not messages or _content(messages[-1]) != turn.last_user_text:
        messages.append(User(turn.last_user_text))
    return tuple(messages)


def _content(message: ChatMessage) -> str | None:
    """A message's text content as it would be sent (None for media parts or no content)."""
    if isinstance(message, User):
        return None if message.parts else message.content
    if isinstance(message, (System, Tool, Assistant)):
        return message.content
    return None


def pack_fast(turn: Turn) -> Packed:
    """
    The Fast worker: the augmented system prompt, plus C{"\\n\\nAvailable tools: "} and the
    tool names joined with C{", "} when there are any, then the last user text; no native
    tools; 256 tokens.
    """
    system = augmented_system_prompt(turn)
    names = turn.allowed_tools
    if names:
        system += "\n\nAvailable tools: " + ", ".join(names)
    return Packed((System(system), User(turn.last_user_text)), None, FAST_MAX_TOKENS)


def pack_specialist(turn: Turn) -> Packed:
    """
    A Specialist worker: the augmented system prompt plus C{"\\n\\nAvailable tools:"} and a
    C{"\\n  - "} line per tool summary (L{tool_summary}); from the last 4 messages, the
    user ones and the assistant ones without tool calls; the last user text appended unless
    already last; the native tools; 512 tokens.
    """
    system = augmented_system_prompt(turn)
    summaries = [tool_summary(tool) for tool in turn.tools]
    if summaries:
        system += "\n\nAvailable tools:" + "".join(f"\n  - {s}" for s in summaries)
    messages: list[ChatMessage] = [System(system)]
    for message in recent_messages(turn.messages, SPECIALIST_WINDOW):
        if isinstance(message, User) or (isinstance(message, Assistant) and not message.tool_calls):
            messages.append(message)
    return Packed(_with_last_user(messages, turn), _native_tools(turn), SPECIALIST_MAX_TOKENS)


def pack_strong(turn: Turn) -> Packed:
    """
    The Strong or Generalist worker: the augmented system prompt; from the last 10
    messages every one that is not a system message (tool calls and results kept, so the
    window may begin with an orphan tool message, as in v1); the last user text appended
    unless already last; the native tools; 1024 tokens.
    """
    messages: list[ChatMessage] = [System(augmented_system_prompt(turn))]
    for message in recent_messages(turn.messages, STRONG_WINDOW):
        if not isinstance(message, System):
            messages.append(message)
    return Packed(_with_last_user(messages, turn), _native_tools(turn), STRONG_MAX_TOKENS)


def pack_for_role(turn: Turn, role: Role) -> Packed:
    """The worker context of C{role}; Generalist and Reducer are packed as Strong."""
    if role is Role.FAST:
        return pack_fast(turn)
    if role is Role.SPECIALIST:
        return pack_specialist(turn)
    return pack_strong(turn)


def _compact_json(value: object) -> str:
    """A JSON value as compact text, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def pack_for_reducer(turn: Turn, drafts: Sequence[DraftLike], reason: str) -> Packed:
    """
    The reducer after the workers disagreed: a system prompt of these lines: the augmented
    prompt, "", the disagreement C{reason}, the instruction to produce one final response,
    "", C{"## Worker outputs"}, then per draft C{"\\n[Worker {i} — {model}]:"} (1-based),
    its payload (over 500 UTF-8 bytes: 497 bytes plus "..."), and for a proposed tool
    C{"  → Proposed tool: {name}"} and, with arguments, C{"  → Arguments: {json}"}; then the
    last user text; the native tools; 2048 tokens.
    """
    lines = [
        augmented_system_prompt(turn),
        "",
        f"Multiple models analyzed this request and disagreed. Reason: {reason}",
        "Review their outputs below and produce ONE final response \u2014 "
        "either a direct answer or a tool call. Be concise.",
        "",
        "## Worker outputs",
    ]
    for number, draft in enumerate(drafts, 1):
        lines.append(f"\n[Worker {number} \u2014 {draft.worker}]:")
        lines.append(shorten(draft.text, PAYLOAD_MAX_BYTES))
        if draft.tool_name is not None:
            lines.append(f"  \u2192 Proposed tool: {draft.tool_name}")
            if draft.tool_arguments is not None:
                lines.append(f"  \u2192 Arguments: {_compact_json(draft.tool_arguments)}")
    messages = (System("\n".join(lines)), User(turn.last_user_text))
    return Packed(messages, _native_tools(turn), REDUCER_MAX_TOKENS)


def loop_guard_text(loop: ToolLoop) -> str:
    """The v2 loop-guard instruction (§6) for a repeated tool call."""
    return (
        f"Tool loop guard: the last {loop.count} completed tool calls all used `{loop.tool}`. "
        "Answer now from the gathered tool results. Do not call another tool. If the "
        "evidence is incomplete, say what can be determined and what is missing."
    )


def _last_index(messages: Sequence[ChatMessage], end: int, wanted: type[ChatMessage]) -> int:
    """The index of the last message of kind C{wanted} before C{end}, or -1."""
    for i in range(min(end, len(messages)) - 1, -1, -1):
        if isinstance(messages[i], wanted):
            return i
    return -1


def _last_caller(messages: Sequence[ChatMessage], end: int) -> int:
    """The index of the last assistant message with tool calls before C{end}, or -1."""
    for i in range(min(end, len(messages)) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, Assistant) and message.tool_calls:
            return i
    return -1


def _tool_result_start(messages: Sequence[ChatMessage]) -> int:
    """
    Where the tool-result window begins: the last 10 messages; earlier when the last
    tool-calling assistant message lies before them (the latest round is always whole);
    and moved back to the tool-calling assistant message before it when it would begin
    with a bare C{tool} message (system messages skipped when looking).
    """
    total = len(messages)
    start = max(total - TOOL_RESULT_WINDOW, 0)
    caller = _last_caller(messages, total)
    if 0 <= caller < start:
        start = caller
    first = start
    while first < total and isinstance(messages[first], System):
        first += 1
    if first < total and isinstance(messages[first], Tool):
        caller = _last_caller(messages, first)
        if caller >= 0:
            start = caller
    return start


def pack_for_tool_result_turn(turn: Turn, loop: ToolLoop | None = None) -> Packed:
    """
    The reducer of a tool-result turn (v2, PR #713): the augmented system prompt; then
    every message of the window that is not a system message, as it came. The window is
    the last 10 messages, reaching back to the last tool-calling assistant message when
    that is older, and to the tool-calling assistant message of a
    chained round it would otherwise cut (it never begins with a bare C{tool} message).
    When the window holds no user message, the user message that precedes the last tool
    result goes first. The native tools; 2048 tokens.

    With a C{loop} (L{loopd.moa.turn.detect_tool_loop}) the system prompt ends with
    L{loop_guard_text} after a blank line and no tools are sent.
    """
    system = augmented_system_prompt(turn)
    if loop is not None:
        system += "\n\n" + loop_guard_text(loop)
    messages = turn.messages
    last_tool = _last_index(messages, len(messages), Tool)
    anchor = _last_index(messages, last_tool, User) if last_tool >= 0 else -1
    start = _tool_result_start(messages)
    packed: list[ChatMessage] = [System(system)]
    window = messages[start:]
    if 0 <= anchor < start and not any(isinstance(m, User) for m in window):
        packed.append(messages[anchor])
    packed.extend(m for m in window if not isinstance(m, System))
    tools = None if loop is not None else _native_tools(turn)
    return Packed(tuple(packed), tools, REDUCER_MAX_TOKENS)
