# -*- test-case-name: loopd.test.test_llama_types -*-
"""
The llama client's values: what goes in (messages, tools, a request), what comes back while
it runs (events) and what comes back at the end (a completion). How it fails is
L{loopd.errors}.

All values are frozen dataclasses. Messages are the four kinds a chat template knows; an
assistant message has the same three fields as a recorded one (content, reasoning_content,
tool_calls), so a session log can be replayed without conversion.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "Assistant",
    "ChatEvent",
    "ChatMessage",
    "ChatRequest",
    "Choice",
    "Completion",
    "Content",
    "FinishReason",
    "Logprobs",
    "Progress",
    "Queued",
    "Reasoning",
    "Retrying",
    "System",
    "ThinkingCapped",
    "Timings",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolSchema",
    "User",
    "Waiting",
]

# ---------------------------------------------------------------------------------------
# What goes in


@dataclass(frozen=True)
class ToolCall:
    """
    One tool call of an assistant message.

    @ivar id: the call's id, which the tool result refers to.
    @ivar name: the function's name.
    @ivar arguments: the arguments as JSON text, exactly as the model wrote them.
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    """
    Base of the four message kinds: L{System}, L{User}, L{Assistant} and L{Tool}.
    """


@dataclass(frozen=True)
class System(ChatMessage):
    """
    The system prompt.
    """

    content: str


@dataclass(frozen=True)
class User(ChatMessage):
    """
    A user turn.

    @ivar content: its text (every text part joined, when it came in parts).
    @ivar parts: the content parts as the client sent them, when they carry an image or
        audio; sent upstream in place of C{content}. Empty for a text-only turn.
    """

    content: str
    parts: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Assistant(ChatMessage):
    """
    An earlier assistant turn, as it was completed.
    """

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Tool(ChatMessage):
    """
    The result of a tool call.
    """

    tool_call_id: str
    content: str


@dataclass(frozen=True)
class ToolSchema:
    """
    A tool offered to the model.

    @ivar parameters: the JSON schema of the arguments.
    """

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})


@dataclass(frozen=True)
class ChatRequest:
    """
    One chat request.

    @ivar slot: the server slot the request is pinned to (C{id_slot}), or C{-1} to let
        the server choose.
    @ivar messages: the conversation so far.
    @ivar tools: the tools offered; fixed for a session's epoch so the prompt prefix stays
        cacheable.
    @ivar thinking: whether the model may think before answering.
    @ivar max_tokens: a lower bound than the config's C{max_tokens} for this request; the
        config's value stays the ceiling.
    @ivar temperature: overrides the configured sampling temperature.
    @ivar top_p: overrides the configured top_p.
    @ivar stop: stop strings.
    @ivar tool_choice: C{"auto"}, C{"none"} or C{"required"}; unset leaves the server's
        default (auto).
    @ivar template_thinking: send C{chat_template_kwargs.enable_thinking} to an C{openai}
        endpoint too (a llama-server always gets it): the mesh's calls carry the thinking
        choice to every worker (DESIGN decision 28).
    @ivar session: the id of the session the request belongs to, which an C{openai}
        endpoint's C{affinity_header} or C{affinity_field} carries to the engine's own
        session affinity (DESIGN decision 42); C{None} sends none (an anonymous session).
    @ivar tier: the session's tier, which an endpoint with C{affinity_priority} sends as
        the request's priority.
    @ivar thinking_cap: a lower thinking cap than the config's C{thinking.cap} for this
        request (an Anthropic C{budget_tokens}, a Responses C{reasoning.effort}); the
        config's value stays the ceiling. Only a llama-server endpoint has the control
        that applies it.
    @ivar fields: more body fields for the server, sent as they are after the ones loopd
        sets (C{response_format}, C{seed}, C{logprobs}, llama.cpp's C{top_k}, C{grammar},
        ...); the front door has checked them and chosen which one endpoint kind takes.
    """

    slot: int
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSchema, ...] = ()
    thinking: bool = True
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    tool_choice: str | None = None
    template_thinking: bool = False
    session: str | None = None
    tier: Literal["parent", "child"] = "parent"
    thinking_cap: int | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# What comes back while it runs


@dataclass(frozen=True)
class ChatEvent:
    """
    Base of the events a running request reports.
    """


@dataclass(frozen=True)
class Queued(ChatEvent):
    """
    Waiting for loopd's own slot gate, with C{ahead} requests in front.
    """

    ahead: int


@dataclass(frozen=True)
class Waiting(ChatEvent):
    """
    Sent, and no byte back yet; one per C{/slots} poll.

    @ivar slot_busy: the slot is running another request.
    @ivar loading: C{/slots} failed or answered 503: the server is loading or restarting.
    """

    slot_busy: bool
    loading: bool = False


@dataclass(frozen=True)
class Progress(ChatEvent):
    """
    Prompt processing: C{processed} of C{total} tokens, C{cache} of them reused.

    @ivar time_ms: the milliseconds since the server started the prompt (its
        C{prompt_progress.time_ms}), when it said; not part of the equality.
    """

    total: int
    cache: int
    processed: int
    time_ms: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Reasoning(ChatEvent):
    """
    A piece of the thinking text.

    @ivar generated: the tokens generated so far, this piece's included, when the server
        said (its chunk's C{timings.predicted_n}); a resumed answer counts from it. Not part
        of the event's equality: it describes the piece, it is not the piece.
    @ivar logprobs: the C{logprobs.content} entries of the piece's chunk, as the server
        sent them (only when the request asked for C{logprobs}); not part of the equality.
    @ivar choice: the index of the choice it belongs to (a request for C{n} choices).
    @ivar timings: the C{timings} object of the piece's chunk as the server sent it (per
        token, since loopd asks for C{timings_per_token}); C{None} when it sent none. Not
        part of the equality.
    """

    text: str
    generated: int | None = field(default=None, compare=False)
    logprobs: tuple[Any, ...] = field(default=(), compare=False)
    choice: int = 0
    timings: Mapping[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Content(ChatEvent):
    """
    A piece of the answer.

    @ivar generated: as for L{Reasoning}.
    @ivar logprobs: as for L{Reasoning}.
    @ivar choice: as for L{Reasoning}.
    @ivar timings: as for L{Reasoning}.
    """

    text: str
    generated: int | None = field(default=None, compare=False)
    logprobs: tuple[Any, ...] = field(default=(), compare=False)
    choice: int = 0
    timings: Mapping[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ToolCallDelta(ChatEvent):
    """
    A piece of tool call C{index}: the id and name on first sight, then argument text.

    @ivar logprobs: as for L{Reasoning}.
    @ivar choice: as for L{Reasoning}.
    @ivar timings: as for L{Reasoning}.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str
    logprobs: tuple[Any, ...] = field(default=(), compare=False)
    choice: int = 0
    timings: Mapping[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Logprobs(ChatEvent):
    """
    The C{logprobs.content} entries of a chunk that carried no piece of text (the role
    chunk's C{<think>} token, a token of markup the server's parser holds back), as the
    server sent them.

    @ivar choice: the index of the choice they belong to.
    """

    entries: tuple[Any, ...]
    choice: int = 0


@dataclass(frozen=True)
class ThinkingCapped(ChatEvent):
    """
    Thinking reached the cap after C{tokens} tokens and the server was told to end it.
    """

    tokens: int


@dataclass(frozen=True)
class Retrying(ChatEvent):
    """
    Attempt C{attempt} failed with C{error}; the next starts in C{after_ms}.
    """

    attempt: int
    after_ms: int
    error: str


# ---------------------------------------------------------------------------------------
# What comes back at the end


class FinishReason(enum.Enum):
    """
    Why generation stopped.
    """

    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    LENGTH = "length"


@dataclass(frozen=True)
class Timings:
    """
    The server's counts for a request: C{cache_n} prompt tokens reused, C{prompt_n}
    evaluated, C{predicted_n} generated, and the generation and prompt-processing speeds
    when reported.
    """

    cache_n: int = 0
    prompt_n: int = 0
    predicted_n: int = 0
    predicted_per_second: float | None = None
    prompt_per_second: float | None = None

    @property
    def total(self) -> int:
        """
        The context the request used: C{cache_n + prompt_n + predicted_n}.
        """
        return self.cache_n + self.prompt_n + self.predicted_n


@dataclass(frozen=True)
class Choice:
    """
    One more choice of a finished turn that asked for C{n} choices (the first is the
    L{Completion} itself).

    @ivar index: its index in the answer's C{choices}.
    @ivar logprobs: its C{logprobs.content} entries, C{None} when none were sent.
    """

    index: int
    content: str | None
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    logprobs: tuple[Any, ...] | None = None

    def as_message(self) -> Assistant:
        """
        This choice as an assistant message.
        """
        return Assistant(self.content, self.reasoning_content, self.tool_calls)


@dataclass(frozen=True)
class Completion:
    """
    A finished assistant turn. Nothing is final before this exists.

    @ivar logprobs: the C{logprobs.content} entries of the answer, in order, as the server
        sent them; C{None} when the server sent none (the request did not ask). Not part
        of the equality.
    @ivar choices: the further choices of a request for C{n} choices, by index (the first
        is this completion's own content); empty for one. Not part of the equality.
    """

    id: str
    content: str | None
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    timings: Timings
    reasoning_tokens: int = 0
    thinking_capped: bool = False
    logprobs: tuple[Any, ...] | None = field(default=None, compare=False)
    choices: tuple[Choice, ...] = field(default=(), compare=False)

    def as_message(self) -> Assistant:
        """
        This completion as the assistant message of the next request.
        """
        return Assistant(self.content, self.reasoning_content, self.tool_calls)
