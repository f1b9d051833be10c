# -*- test-case-name: loopd.test.test_doors_door -*-
"""
What a front door is (DESIGN §3 decision 40): one wire API (OpenAI chat completions,
Anthropic Messages, OpenAI Responses) reduced to two jobs, reading and writing.

A L{Door} reads a request's body and headers once into the gateway's one request model,
L{GatewayRequest}, or raises a L{GatewayError}; everything after it (the router, the mesh,
the leased upstream call, the sessions and graces, endpoint health) is the same for every
door and reads only that request (L{loopd.gateway.exchange}). For the way back the door
gives an L{Answer} per exchange, which turns the call's events and its completion into that
API's JSON body or its event stream, and its errors into that API's error shape. Every
door's stream carries loopd's own events (queued, waiting, progress, ...) the same way, as
C{: loopd {...}} comment lines (L{loopd_comment}).

Pure: protocols, values and their rendering, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol

from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.llama.types import (
    ChatEvent,
    Completion,
    Content,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    ThinkingCapped,
    ToolCallDelta,
    Waiting,
)
from loopd.sse import DONE, encode_comment, encode_data

__all__ = [
    "Answer",
    "Door",
    "EVENT_STREAM",
    "MESH_MODEL",
    "Header",
    "comment_line",
    "compact_json",
    "data_line",
    "done_line",
    "loopd_comment",
    "replay",
]

EVENT_STREAM = b"text/event-stream"
"""The content type of a stream of server-sent events."""

MESH_MODEL = "mesh"
"""The virtual model a mesh turn answers as (L{loopd.moa.roles.VIRTUAL_MODEL_NAME})."""

Header = Callable[[bytes], "bytes | None"]
"""A request's header by its lower-case name, C{None} when absent."""


class Answer(Protocol):
    """
    One exchange's answer in one door's shapes. The exchange calls L{opening} once, when
    the event stream opens (at the first thing worth sending, so that an error before it is
    still a status), then L{during} per event, then L{closing} or L{stream_error}; or, for a
    request that did not ask to stream, L{body} or the door's L{Door.error}.

    Each method that gives bytes gives whole server-sent events, framed (L{loopd.sse}).
    """

    def opening(self) -> bytes:
        """The bytes that open the event stream (a role chunk, a C{message_start} ...)."""

    def during(self, event: ChatEvent) -> bytes:
        """
        What one event of the call sends a streaming client: data events for text,
        thinking and tool calls, loopd's own events as comment lines (or the API's own
        keep-alive, such as Anthropic's C{ping}); C{b""} for nothing.
        """

    def keepalive(self) -> bytes:
        """
        A no-op data event of this API, sent while the answer has no token yet and nothing
        else went for a while (decision 44's long prompts, a queue wait): coding agents'
        stream timers count data events, not SSE comments. It must change nothing the
        client builds from the stream.
        """

    def closing(self, completion: Completion) -> bytes:
        """The bytes that end a stream that went well (finish, usage, C{[DONE]} ...)."""

    def stream_error(self, error: GatewayError) -> bytes:
        """The error event that ends a stream that failed after it opened."""

    def body(self, completion: Completion) -> object:
        """The JSON body of a non-streaming answer (status 200)."""

    def error(self, error: GatewayError) -> tuple[int, object]:
        """
        The status and JSON body of an error answered as a status once this answer exists
        (a failed call, a mesh turn's failure): the door's L{Door.error} for every answer
        but a mesh turn's on chat completions, whose failure has the reference's own body.
        """


class Door(Protocol):
    """
    One front door: how its API's requests are read and its answers written.

    @ivar name: the door's name in logs and metrics: C{chat}, C{messages}, C{responses}.
    @ivar stream_type: the content type of its streamed answers (L{EVENT_STREAM} for the
        three APIs of server-sent events; Ollama's NDJSON would say its own).
    """

    name: str
    stream_type: bytes

    def read(self, body: bytes, header: Header, anonymous: Callable[[], str]) -> GatewayRequest:
        """
        Decode and check one request: its body and headers, its session (decision 36,
        L{loopd.gateway.request.read_session} with the door's body ids; C{anonymous} gives
        the connection's id, asked only when the request names no session).

        @raise GatewayError: 400 naming the field for a bad or unsupported request.
        """

    def answer(self, request: GatewayRequest, model: str, created: int) -> Answer:
        """
        The answer of C{request} served by C{model} (the endpoint's name, or C{mesh}),
        stamped with C{created} (seconds of the epoch). A fail-over to another endpoint
        makes a new one.
        """

    def mesh_answer(self, request: GatewayRequest, answer_id: str, created: int) -> Answer:
        """
        The answer of a mesh turn (C{model: "mesh"}, L{loopd.gateway.mesh}): the turn's
        whole answer comes as one completion, replayed as events when streaming, and its
        failure as a L{loopd.gateway.errors.MeshTurnError}. Chat completions answer in the
        reference's mesh shapes with C{answer_id} as the completion's id; a door with no
        such shapes answers as it would for an endpoint named L{MESH_MODEL}.
        """

    def error(self, error: GatewayError) -> tuple[int, object]:
        """
        The status and JSON body of an error answered as a status, in the door's error
        shape. The status may differ from C{error.status} where the API says so (Anthropic
        answers loopd's Busy with 529 C{overloaded_error}).
        """


def compact_json(payload: object) -> str:
    """
    C{payload} as compact JSON text, non-ASCII text kept as it is: how every event a front
    door streams is encoded.
    """
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def data_line(payload: object) -> bytes:
    """One SSE C{data:} event carrying C{payload} as JSON."""
    return encode_data(compact_json(payload))


def done_line() -> bytes:
    """The C{data: [DONE]} event that ends an OpenAI stream."""
    return encode_data(DONE)


def comment_line(payload: object) -> bytes:
    """One C{: loopd} comment line carrying C{payload} as JSON (OpenAI clients ignore it)."""
    return encode_comment("loopd " + compact_json(payload))


def replay(completion: Completion) -> tuple[ChatEvent, ...]:
    """
    The events that stream C{completion} whole (its thinking, its text, each tool call),
    for an answer that was complete before its stream opened, such as a mesh turn's.
    """
    events: list[ChatEvent] = []
    if completion.reasoning_content:
        events.append(Reasoning(completion.reasoning_content))
    if completion.content:
        events.append(Content(completion.content))
    for index, call in enumerate(completion.tool_calls):
        events.append(ToolCallDelta(index, call.id, call.name, call.arguments))
    return tuple(events)


def loopd_comment(event: ChatEvent) -> dict[str, Any] | None:
    """
    loopd's own events, for the C{: loopd {...}} comment lines of a stream: C{queued}
    (C{ahead}), C{waiting} (C{slot_busy}, C{loading}), C{progress} (C{total}, C{cache},
    C{processed}), C{thinking_capped} (C{tokens}), C{retrying} (C{attempt}, C{after_ms},
    C{error}). None for the events that are chunks.
    """
    name = _COMMENTS.get(type(event))
    if name is None:
        return None
    fields = asdict(event)
    if isinstance(event, Progress):
        del fields["time_ms"]
    return {"event": name, **fields}


# The comment's fields are exactly the event's, in the same order (Progress's time_ms
# excepted, which the server's own prompt_progress chunk carries).
_COMMENTS: dict[type[ChatEvent], str] = {
    Queued: "queued",
    Waiting: "waiting",
    Progress: "progress",
    ThinkingCapped: "thinking_capped",
    Retrying: "retrying",
}
