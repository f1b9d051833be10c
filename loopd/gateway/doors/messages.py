# -*- test-case-name: loopd.test.test_doors_messages -*-
"""
The Anthropic Messages front door, C{POST /v1/messages} (issue 14, DESIGN §3 decision 40),
and its writer: L{MessagesDoor} reads a Messages body into the gateway's one request model
(L{loopd.gateway.doors.messages_read}) and writes the answer as Anthropic's C{message} object
or its event stream, errors in Anthropic's shape (L{anthropic_error}). C{POST
/v1/messages/count_tokens} reads its body with L{MessagesDoor.read_count}; its I/O is
L{loopd.gateway.token_count}'s.

What is written: a non-streaming answer is a C{message} with a C{thinking} block (its
C{signature} C{""}), a C{text} block, C{tool_use} blocks, C{stop_reason} C{max_tokens}
(the answer hit the token bound), C{tool_use} (it calls tools) or C{end_turn}, and C{usage}
in Anthropic's sense: C{input_tokens} are the prompt tokens the server evaluated,
C{cache_read_input_tokens} the ones it reused (their sum is the prompt). loopd's completion
does not say which stop string ended it, so a stop sequence reads as C{end_turn} with
C{stop_sequence} C{null}. A stream is C{message_start} (sent once the server's first
progress event gives the prompt's size, which its usage carries as llama-server's does, or
before the first piece without one; loopd's C{ping}s for a wait may come before it, and
every SDK skips them), then per block
C{content_block_start}, its deltas (C{thinking_delta} then a C{signature_delta},
C{text_delta}, C{input_json_delta}) and C{content_block_stop}, a new block each time the
kind of piece changes, then C{message_delta} (stop reason and the whole usage) and
C{message_stop}; loopd's own events go as C{: loopd} comment lines, and C{queued} and
C{waiting} also as C{ping} events, which the SDK skips.

Pure: no I/O, no reactor, no twisted.web.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from loopd import strict_json
from loopd.gateway.doors.door import (
    EVENT_STREAM,
    MESH_MODEL,
    Answer,
    Header,
    comment_line,
    compact_json,
    loopd_comment,
)
from loopd.gateway.doors.hosted_tools import HostedTools
from loopd.gateway.doors.messages_read import parse_messages
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import (
    GatewayRequest,
    read_session,
)
from loopd.llama.types import (
    ChatEvent,
    Completion,
    Content,
    FinishReason,
    Progress,
    Queued,
    Reasoning,
    Timings,
    ToolCallDelta,
    Waiting,
)
from loopd.sse import encode_event

__all__ = [
    "MessagesAnswer",
    "MessagesDoor",
    "anthropic_error",
    "new_message_id",
    "tool_input",
]

# ---------------------------------------------------------------------------------------
# The door


#: The body field that names a request's session, after the headers (decision 36).
_BODY_SESSION_ID = "metadata.user_id"


class MessagesDoor:
    """
    The Anthropic Messages door: Anthropic's request, Anthropic's answers and error shape.
    """

    name = "messages"
    stream_type = EVENT_STREAM

    def __init__(self, hosted_tools: HostedTools = "drop") -> None:
        """
        @param hosted_tools: what a server tool does to a request: left out (C{drop}) or
            refused (C{refuse}), L{loopd.gateway.doors.hosted_tools}.
        """
        self._hosted_tools = hosted_tools

    def read(self, body: bytes, header: Header, anonymous: Callable[[], str]) -> GatewayRequest:
        """
        The request (L{parse_messages}) and its session: the headers of decision 36, then
        the body's C{metadata.user_id}. C{anthropic-version}, C{anthropic-beta} and the
        query string (C{?beta=true}) change nothing.

        @raise GatewayError: 400 naming the field.
        """
        document = parse_messages(body, hosted_tools=self._hosted_tools)
        return _with_session(document, header, anonymous)

    def read_count(self, body: bytes, header: Header) -> GatewayRequest:
        """
        A C{POST /v1/messages/count_tokens} body: a Messages request whose C{max_tokens}
        is optional. Its session (for the router's placement) is the one its headers or
        C{metadata.user_id} name, else an anonymous one with an empty id.

        @raise GatewayError: 400 naming the field.
        """
        document = parse_messages(body, counting=True, hosted_tools=self._hosted_tools)
        return _with_session(document, header, lambda: "")

    def answer(self, request: GatewayRequest, model: str, created: int) -> Answer:
        """A fresh message id's answer for C{model}; Anthropic's message has no C{created}."""
        return MessagesAnswer(new_message_id(), model)

    def mesh_answer(self, request: GatewayRequest, answer_id: str, created: int) -> Answer:
        """A mesh turn's answer: a message as any, from the model L{MESH_MODEL}."""
        return self.answer(request, MESH_MODEL, created)

    def error(self, error: GatewayError) -> tuple[int, object]:
        """Anthropic's error shape and status (L{anthropic_error})."""
        return anthropic_error(error)


def _with_session(
    request: GatewayRequest, header: Header, anonymous: Callable[[], str]
) -> GatewayRequest:
    """C{request} with the session its headers, then its C{metadata.user_id}, name."""
    metadata = request.extras.get("metadata") or {}
    session = read_session(header, anonymous, [(_BODY_SESSION_ID, metadata.get("user_id"))])
    return dataclasses.replace(request, session=session)


def new_message_id() -> str:
    """A fresh message id: C{msg_} and 24 random hex digits."""
    return "msg_" + os.urandom(12).hex()


# ---------------------------------------------------------------------------------------
# Errors

#: The Anthropic error type of each status loopd answers; any other 4xx is an
#: C{invalid_request_error}, any other 5xx an C{api_error}.
_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

#: How Claude Code recognises a prompt over the context (it then compacts the conversation).
_TOO_LONG = "prompt is too long: "


def anthropic_error(error: GatewayError) -> tuple[int, dict[str, Any]]:
    """
    The status and Anthropic error body, C{{"type": "error", "error": {"type",
    "message"}}}, of C{error}: its status with the type Anthropic gives it (400
    C{invalid_request_error}, 401 C{authentication_error}, 403 C{permission_error}, 404
    C{not_found_error}, 413 C{request_too_large}, 429 C{rate_limit_error}, 503
    C{overloaded_error} (an endpoint unavailable or loading: try again later), 504
    C{timeout_error}, another 4xx C{invalid_request_error}, another 5xx C{api_error}), but
    loopd's Busy (code C{busy}), which is 529 C{overloaded_error} as Anthropic answers
    overload. A prompt over the context (C{context_exceeded}) says C{prompt is too long:}
    first, as Anthropic's does.
    """
    status = 529 if error.code == "busy" else error.status
    kind = _ERROR_TYPES.get(status) or (
        "invalid_request_error" if 400 <= status < 500 else "api_error"
    )
    message = error.message
    if error.code == "context_exceeded" and not message.startswith(_TOO_LONG):
        message = _TOO_LONG + message
    return status, {"type": "error", "error": {"type": kind, "message": message}}


# ---------------------------------------------------------------------------------------
# The answer


def _event(payload: dict[str, Any]) -> bytes:
    """One Anthropic stream event: C{event: <type>} and C{payload} as compact JSON."""
    return encode_event(str(payload["type"]), compact_json(payload))


def _usage(timings: Timings) -> dict[str, int]:
    """Anthropic's C{usage}: evaluated and reused prompt tokens apart, generated tokens."""
    return {
        "input_tokens": timings.prompt_n,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": timings.cache_n,
        "output_tokens": timings.predicted_n,
    }


def _stop_reason(completion: Completion) -> str:
    """C{max_tokens}, C{tool_use} or C{end_turn}."""
    if completion.finish_reason is FinishReason.LENGTH:
        return "max_tokens"
    if completion.finish_reason is FinishReason.TOOL_CALLS or completion.tool_calls:
        return "tool_use"
    return "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """
    A tool call's input from the arguments the model wrote: their JSON object; C{{}} for
    none (empty or blank text); C{{"_raw_arguments": <text>}} when they are not a JSON
    object, so that the client sees what the model wrote (a tool then refuses the input,
    and the model sees why) rather than losing it.
    """
    if not arguments.strip():
        return {}
    try:
        value = strict_json.decode(arguments)
    except strict_json.JSONError:
        value = None
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def _blocks(completion: Completion) -> list[dict[str, Any]]:
    """The content blocks of a finished answer: thinking, text, tool uses."""
    blocks: list[dict[str, Any]] = []
    if completion.reasoning_content:
        blocks.append(
            {"type": "thinking", "thinking": completion.reasoning_content, "signature": ""}
        )
    if completion.content:
        blocks.append({"type": "text", "text": completion.content})
    blocks.extend(
        {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}
        for call in completion.tool_calls
    )
    return blocks


@dataclass
class _Pending:
    """A tool call seen before its name: its id and the argument text so far."""

    id: str | None
    arguments: str


class MessagesAnswer:
    """
    One Messages answer (the module docstring gives its shapes): the C{message} object, or
    the event stream, which this object follows block by block.

    @ivar message_id: the message's id.
    @ivar model: the model named in the message.
    """

    def __init__(self, message_id: str, model: str) -> None:
        """@param message_id: the message's id. @param model: the endpoint's name."""
        self.message_id = message_id
        self.model = model
        self._blocks = 0
        self._open: tuple[str, int] | None = None
        self._pending: dict[int, _Pending] = {}
        self._started = False

    def _message(
        self, content: list[dict[str, Any]], completion: Completion | None
    ) -> dict[str, Any]:
        """The C{message} object; before the completion, with no stop reason and no usage."""
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None if completion is None else _stop_reason(completion),
            "stop_sequence": None,
            "usage": _usage(Timings() if completion is None else completion.timings),
        }

    def opening(self) -> bytes:
        """
        Nothing yet: C{message_start} waits for the prompt's size (L{_start}), which Claude
        Code reads its context window from, as llama-server's own stream gives it.
        """
        return b""

    def _start(self, progress: Progress | None) -> bytes:
        """
        C{message_start}, once: the message without content, its usage the prompt's tokens
        to evaluate and those reused as the server's first progress event says (all zero
        without one: an endpoint that reports no progress).
        """
        if self._started:
            return b""
        self._started = True
        message = self._message([], None)
        if progress is not None:
            message["usage"] = {
                **message["usage"],
                "input_tokens": max(0, progress.total - progress.cache),
                "cache_read_input_tokens": progress.cache,
            }
        return _event({"type": "message_start", "message": message})

    def during(self, event: ChatEvent) -> bytes:
        """
        The events of one piece: a block's deltas (with the stop of the block before and
        the start of this one when the kind of piece changes); loopd's own events as a
        comment, and C{queued} and C{waiting} also as a C{ping}. C{message_start} goes
        before the first progress event's comment or the first piece, whichever comes
        first.
        """
        if not self._started:
            if isinstance(event, Progress):
                return self._start(event) + self._during(event)
            if isinstance(event, (Reasoning, Content, ToolCallDelta)):
                return self._start(None) + self._during(event)
        return self._during(event)

    def _during(self, event: ChatEvent) -> bytes:
        """L{during}, the message started where it must be."""
        if isinstance(event, Reasoning) and event.text:
            return self._switch(
                "thinking", 0, {"type": "thinking", "thinking": "", "signature": ""}
            ) + (self._delta({"type": "thinking_delta", "thinking": event.text}))
        if isinstance(event, Content) and event.text:
            return self._switch("text", 0, {"type": "text", "text": ""}) + self._delta(
                {"type": "text_delta", "text": event.text}
            )
        if isinstance(event, ToolCallDelta):
            return self._tool(event)
        comment = loopd_comment(event)
        if comment is None:
            return b""
        ping = _event({"type": "ping"}) if isinstance(event, (Queued, Waiting)) else b""
        return comment_line(comment) + ping

    def _switch(self, kind: str, key: int, start: dict[str, Any]) -> bytes:
        """Nothing if block C{(kind, key)} is open; else stop the open one and start it."""
        if self._open == (kind, key):
            return b""
        out = self._stop()
        self._open = (kind, key)
        out += _event(
            {"type": "content_block_start", "index": self._blocks, "content_block": start}
        )
        self._blocks += 1
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        """A delta of the open block."""
        return _event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _stop(self) -> bytes:
        """The stop of the open block (a thinking block's signature first), if one is open."""
        if self._open is None:
            return b""
        out = b""
        if self._open[0] == "thinking":
            out = self._delta({"type": "signature_delta", "signature": ""})
        self._open = None
        return out + _event({"type": "content_block_stop", "index": self._blocks - 1})

    def _tool(self, event: ToolCallDelta) -> bytes:
        """
        A piece of a tool call: its block starts once its name is known (with its id and an
        empty input), and its argument text goes as C{input_json_delta}s.
        """
        if self._open == ("tool", event.index):
            return self._arguments(event.arguments)
        pending = self._pending.setdefault(event.index, _Pending(None, ""))
        pending.id = pending.id or event.id
        pending.arguments += event.arguments
        if event.name is None:
            return b""
        return self._start_tool(event.index, event.name)

    def keepalive(self) -> bytes:
        """
        A C{message_delta} that changes nothing (no stop reason, no output tokens), after
        C{message_start} if it has not gone yet (its usage then zero: the prompt's size is
        not known): Claude Code's stream watchdog counts C{message_*} and
        C{content_block_*} events, not C{ping}.
        """
        delta = {"stop_reason": None, "stop_sequence": None}
        keep = _event({"type": "message_delta", "delta": delta, "usage": {"output_tokens": 0}})
        return self._start(None) + keep

    def _start_tool(self, index: int, name: str) -> bytes:
        """Start the block of pending tool call C{index}, with its arguments so far."""
        pending = self._pending.pop(index)
        call_id = pending.id or "toolu_" + os.urandom(12).hex()
        start = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        return self._switch("tool", index, start) + self._arguments(pending.arguments)

    def _arguments(self, text: str) -> bytes:
        """An C{input_json_delta} of C{text}, nothing for none."""
        if not text:
            return b""
        return self._delta({"type": "input_json_delta", "partial_json": text})

    def closing(self, completion: Completion) -> bytes:
        """
        The stop of the open block (a tool call still without a name starts first, named
        C{""}), C{message_delta} with the stop reason and the whole usage, C{message_stop}.
        """
        out = self._start(None)
        out += b"".join(self._start_tool(index, "") for index in sorted(self._pending))
        out += self._stop()
        delta = {"stop_reason": _stop_reason(completion), "stop_sequence": None}
        out += _event(
            {"type": "message_delta", "delta": delta, "usage": _usage(completion.timings)}
        )
        return out + _event({"type": "message_stop"})

    def stream_error(self, error: GatewayError) -> bytes:
        """An C{error} event in Anthropic's error shape (the SDK raises it)."""
        return _event(anthropic_error(error)[1])

    def error(self, error: GatewayError) -> tuple[int, object]:
        """Anthropic's error shape and status (L{anthropic_error})."""
        return anthropic_error(error)

    def body(self, completion: Completion) -> object:
        """The C{message} object of a non-streaming answer."""
        return self._message(_blocks(completion), completion)
