# -*- test-case-name: loopd.test.test_doors_chat_read -*-
"""
The gateway's one request model (DESIGN §3 decision 40): L{GatewayRequest}, what a front door
makes of a request's body and headers, and the only thing every later stage reads: the
C{auto} router, the mesh, the translation to the upstream request, the leases.

A front door (today C{POST /v1/chat/completions}, L{loopd.gateway.doors.chat_read}) decodes and
checks a body once and hands on a L{GatewayRequest}; nothing after it sees the body again.
The session the request belongs to comes from its headers and, after them, the ids a front door
finds in its body (L{read_session}, L{session_id}; DESIGN §3 decision 36).

Pure: values and functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from loopd.gateway.errors import GatewayError
from loopd.llama.types import ChatMessage, ChatRequest, ToolSchema, User
from loopd.queue.scheduler_types import Tier

__all__ = [
    "END_HEADER",
    "MAX_SESSION_ID_BYTES",
    "ROLE_HEADER",
    "SESSION_HEADER",
    "SESSION_ID_HEADERS",
    "NO_SESSION",
    "GatewayRequest",
    "SessionRef",
    "ThinkingSwitch",
    "Tier",
    "read_session",
    "session_id",
]

SESSION_HEADER: Final = b"x-session-id"
"""The header that names a request's session."""
SESSION_ID_HEADERS: Final = (
    (b"x-session-id", "X-Session-Id"),
    (b"x-claude-code-session-id", "X-Claude-Code-Session-Id"),
    (b"session-id", "session-id"),
    (b"session_id", "session_id"),
    (b"x-session-affinity", "x-session-affinity"),
    (b"x-litellm-session-id", "x-litellm-session-id"),
    (b"agent-session-id", "agent-session-id"),
)
"""
The headers that name a request's session, in the order they are read (decision 36), each
by its lower-case name and as error messages show it: loopd's own, Claude Code's, Codex CLI's
and pi's, OpenCode's and pi's affinity, LiteLLM's, Goose's (C{agent-session-id}, after
decision 36's list: Goose sends no other).
"""
MAX_SESSION_ID_BYTES: Final = 256
"""The longest session id loopd takes, in bytes of UTF-8."""
ROLE_HEADER: Final = b"x-session-role"
"""The header that gives the session's tier: C{parent} or C{child}."""
END_HEADER: Final = b"x-session-end"
"""The header that says this is the session's last request."""

_ENDS: Final = {b"true": True, b"1": True, b"false": False, b"0": False}
_ROLES: Final[Mapping[bytes, Tier]] = {b"parent": "parent", b"child": "child"}
_T = TypeVar("_T")

#: The part kinds of a user turn that carry media, by the modality each needs.
_MEDIA_KINDS: Final = {"image_url": "vision", "input_audio": "audio"}


@dataclass(frozen=True)
class SessionRef:
    """
    The session a request belongs to: the key of its lease and of its slot history.

    @ivar id: the id the request names (L{session_id}), or its connection's anonymous id.
    @ivar tier: its lease tier, from C{X-Session-Role}.
    @ivar ends: the request is the session's last (C{X-Session-End}): no grace after it.
    @ivar anonymous: the request named no session: C{id} is its connection's.
    @ivar conversation: the key of the session's conversation the request belongs to, once
        the gateway placed it (DESIGN decision 45, L{loopd.gateway.sessions}); empty: the
        session's id.
    @ivar continues: the request continues that conversation's last request (its cache
        outcome counts).
    """

    id: str
    tier: Tier = "parent"
    ends: bool = False
    anonymous: bool = False
    conversation: str = ""
    continues: bool = True

    @property
    def key(self) -> str:
        """The key of the request's lease, slot history and C{auto} home."""
        return self.conversation or self.id


NO_SESSION: Final = SessionRef("")
"""The session of a request read without its headers (a tool, a test): no id, a parent."""


@dataclass(frozen=True)
class ThinkingSwitch:
    """
    One thinking switch a request set, as the front door read it.

    @ivar name: where it was set: C{reasoning} (the object), C{reasoning_effort}, an alias
        such as C{enable_thinking} at the top level, C{thinking_budget}, or
        C{chat_template_kwargs.<alias>}.
    @ivar on: whether it turns thinking on.
    """

    name: str
    on: bool


#: The two switches the plain path honours (README: "the thinking switches").
_PLAIN_SWITCHES: Final = frozenset({"reasoning_effort", "chat_template_kwargs.enable_thinking"})


@dataclass(frozen=True)
class GatewayRequest:
    """
    One chat request, decoded and checked, in the form every stage after the front door reads.

    @ivar model: the endpoint it names, C{auto}, C{mesh}, or C{None} when it names none
        (which is C{auto}).
    @ivar messages: the conversation, in order; a user turn keeps its image and audio parts.
    @ivar tools: the tools on offer (narrowed to the one C{tool_choice} names, if it names
        one).
    @ivar tool_choice: C{auto}, C{none} or C{required}; C{None} leaves the server's default.
    @ivar max_tokens: the request's own bound on generated tokens, or C{None}.
    @ivar temperature: the request's sampling temperature, or C{None} for the configured one.
    @ivar top_p: the request's top_p, or C{None} for the configured one.
    @ivar stop: its stop strings.
    @ivar thinking_switches: every thinking switch it set, in the order the rules of
        L{thinking_override} read them.
    @ivar stream: answer with server-sent events.
    @ivar include_usage: a streamed answer ends with a usage chunk.
    @ivar session: the session it belongs to.
    @ivar thinking_cap: the request's own thinking cap in reasoning tokens (Anthropic's
        C{thinking.budget_tokens}, a Responses C{reasoning.effort}), below the config's;
        C{None} for the config's.
    @ivar fields: the body fields the front door passes to the server as they are
        (L{ChatRequest.fields}; L{loopd.gateway.doors.params}).
    @ivar return_progress: a streamed answer carries the server's C{prompt_progress}
        chunks, as llama-server's own stream does when asked (loopd always asks the
        server for them; its own C{progress} comments go out either way).
    @ivar return_timings: a streamed answer's pieces carry the server's per-token
        C{timings} (C{timings_per_token}), as llama-server's own stream does when asked
        (loopd always asks the server for them).
    @ivar extras: the body's top-level fields loopd does not model, as sent, so that no
        later stage has to read the body again.
    @ivar dropped: the hosted tools the door left out, by type (C{web_search}), each once,
        in the order met (decision 43, L{loopd.gateway.doors.hosted_tools}): the route names them
        in the answer's C{X-Loopd-Dropped} header, logs and counts them.
    @ivar tool_namespaces: the tools the door flattened out of a namespace (Codex CLI's
        C{{"type": "namespace"}} tools), each by the flat name the model sees
        (C{multi_agent_v1__spawn_agent}) to its namespace and its name there, so that the
        answer names their calls the way the client offered them.
    """

    model: str | None
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSchema, ...] = ()
    tool_choice: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    thinking_switches: tuple[ThinkingSwitch, ...] = ()
    stream: bool = False
    include_usage: bool = False
    session: SessionRef = NO_SESSION
    thinking_cap: int | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)
    return_progress: bool = False
    return_timings: bool = False
    extras: Mapping[str, Any] = field(default_factory=dict, compare=False)
    dropped: tuple[str, ...] = ()
    tool_namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict, compare=False)

    @property
    def thinking(self) -> bool:
        """
        Whether a request for one endpoint (or C{auto}) may think: on unless
        C{reasoning_effort} is C{"none"} or C{chat_template_kwargs.enable_thinking} is false.
        """
        return all(s.on for s in self.thinking_switches if s.name in _PLAIN_SWITCHES)

    @property
    def thinking_override(self) -> bool | None:
        """
        The caller's thinking choice by the mesh's rules (reference C{mesh-moa.md} §1.6):
        the last switch set wins, in the order C{reasoning}, C{reasoning_effort}, the
        top-level aliases, C{thinking_budget}, the aliases in C{chat_template_kwargs};
        C{None} when the request set none.
        """
        return self.thinking_switches[-1].on if self.thinking_switches else None

    @property
    def modalities(self) -> frozenset[str]:
        """The media its user turns carry: C{vision} for images, C{audio} for audio."""
        return frozenset(
            _MEDIA_KINDS[kind]
            for message in self.messages
            if isinstance(message, User)
            for part in message.parts
            if isinstance(kind := part.get("type"), str) and kind in _MEDIA_KINDS
        )

    def chat_request(self, *, slot: int = -1) -> ChatRequest:
        """The llama client's request for one endpoint: this request pinned to C{slot}."""
        return ChatRequest(
            slot=slot,
            messages=self.messages,
            tools=self.tools,
            thinking=self.thinking,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            tool_choice=self.tool_choice,
            thinking_cap=self.thinking_cap,
            fields=self.fields,
        )


def read_session(
    header: Callable[[bytes], bytes | None],
    anonymous: Callable[[], str],
    body_ids: Sequence[tuple[str, object]] = (),
) -> SessionRef:
    """
    The session of a request: its id (L{session_id}, else C{anonymous()}, the id of its
    connection), C{X-Session-Role} (C{parent}, also when absent, or C{child}, any case) and
    C{X-Session-End} (C{true} or C{1}; absent, C{false} or C{0}: not).

    @param header: the request's header by lower-case name, C{None} when it has none.
    @param anonymous: gives the id of the request's connection, asked only when needed.
    @param body_ids: the front door's candidate ids from the body, as for L{session_id}.
    @raise GatewayError: 400 C{invalid_session_id} for a bad id (L{session_id}), 400
        C{invalid_session_role} or C{invalid_session_end} for any other value of those
        headers.
    """
    tier = _header_choice(header, ROLE_HEADER, _ROLES, "parent", "parent or child")
    ends = _header_choice(header, END_HEADER, _ENDS, False, "true or false")
    named = session_id(header, body_ids)
    if named is None:
        return SessionRef(anonymous(), tier, ends, anonymous=True)
    return SessionRef(named, tier, ends)


def session_id(
    header: Callable[[bytes], bytes | None], body_ids: Sequence[tuple[str, object]] = ()
) -> str | None:
    """
    The session id a request names: the first of L{SESSION_ID_HEADERS} it carries, else the
    first of C{body_ids} that is not C{None}; C{None} when it names none. Only that first
    one is read, and it must be 1 to L{MAX_SESSION_ID_BYTES} bytes of UTF-8 without control
    characters (surrounding spaces are not part of it).

    @param header: the request's header by lower-case name, C{None} when it has none.
    @param body_ids: the ids a front door found in the body, in its order of decision 36,
        each as (the field's name in error messages, its value as sent, C{None} when
        absent); the chat front door gives C{user}, the Anthropic and Responses ones
        C{metadata.user_id} and C{prompt_cache_key}.
    @raise GatewayError: 400 C{invalid_session_id}, naming the header or field, for a bad
        id or a body id that is not a string.
    """
    for name, shown in SESSION_ID_HEADERS:
        value = header(name)
        if value is not None:
            return _checked_id(shown, value.strip(b" \t"), "header")
    for shown, candidate in body_ids:
        if candidate is None:
            continue
        if not isinstance(candidate, str):
            raise _bad_id(f"field {shown} must be a string, got {type(candidate).__name__}")
        return _checked_id(shown, candidate.strip(" \t").encode("utf-8", "surrogatepass"), "field")
    return None


def _checked_id(shown: str, value: bytes, kind: str) -> str:
    """
    C{value}, a session id from C{kind} C{shown}, decoded.

    @raise GatewayError: 400 C{invalid_session_id} when it is empty, too long, not UTF-8 or
        has a control character.
    """
    where = f"{kind} {shown}"
    if not value:
        raise _bad_id(f"{where} is empty")
    if len(value) > MAX_SESSION_ID_BYTES:
        raise _bad_id(f"{where} is {len(value)} bytes, over {MAX_SESSION_ID_BYTES}")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad_id(f"{where} is not UTF-8") from None
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text):
        raise _bad_id(f"{where} has a control character")
    return text


def _bad_id(reason: str) -> GatewayError:
    """The 400 of a bad session id, saying why."""
    return GatewayError(
        400,
        f"bad session id: {reason} (1 to {MAX_SESSION_ID_BYTES} bytes of UTF-8, no control "
        "characters)",
        "invalid_request_error",
        "invalid_session_id",
    )


def _header_choice(
    header: Callable[[bytes], bytes | None],
    name: bytes,
    choices: Mapping[bytes, _T],
    default: _T,
    expected: str,
) -> _T:
    """
    The value header C{name} gives among C{choices} (any case), C{default} when absent.

    @raise GatewayError: 400 C{invalid_<header name>} for any other value.
    """
    value = header(name)
    if value is None:
        return default
    chosen = choices.get(value.strip().lower())
    if chosen is None:
        shown_name = "-".join(part.capitalize() for part in name.decode().split("-"))
        shown = value.decode("utf-8", "backslashreplace")
        code = "invalid_" + name.decode().removeprefix("x-").replace("-", "_")
        raise GatewayError(
            400, f"{shown_name} must be {expected}, got {shown!r}", "invalid_request_error", code
        )
    return chosen
