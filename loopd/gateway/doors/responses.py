# -*- test-case-name: loopd.test.test_doors_responses -*-
"""
The OpenAI Responses front door (C{POST /v1/responses}, DESIGN §3 decision 40), as Codex CLI
and the C{openai} SDK use it, and its writer: L{ResponsesDoor} reads a body into the
gateway's one request model (L{loopd.gateway.doors.responses_read}) and gives a
L{ResponsesAnswer} per exchange, which writes the C{response} object or its event stream.

The answer's stream is the SDK's: C{event: <type>} lines whose data carry C{type} and a
C{sequence_number} counting from 0; C{response.created}, C{response.in_progress}, the
output items as they arrive, and C{response.completed} (C{response.incomplete} with
C{incomplete_details.reason: max_output_tokens} when the answer hit its token bound, as
OpenAI's API does). loopd's own events are C{: loopd {...}} comment lines. A stream that
fails ends with an C{error} event (loopd's own code) and then C{response.failed}.

Pure: values and functions, no I/O, no twisted.web.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from loopd.gateway.doors.door import (
    EVENT_STREAM,
    MESH_MODEL,
    Answer,
    Header,
    compact_json,
    loopd_comment,
)
from loopd.gateway.doors.hosted_tools import HostedTools
from loopd.gateway.doors.responses_read import parse_responses
from loopd.gateway.doors.responses_store import ResponseStore, StoredResponse
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.llama.types import (
    ChatEvent,
    Completion,
    Content,
    FinishReason,
    Reasoning,
    ToolCallDelta,
)
from loopd.sse import encode_comment, encode_event

__all__ = ["ResponsesAnswer", "ResponsesDoor", "new_response_id", "responses_error"]


def new_response_id() -> str:
    """A fresh response id: C{resp_} and 24 random hex digits."""
    return "resp_" + os.urandom(12).hex()


def _new_id(prefix: str) -> str:
    """A fresh output item id with C{prefix} (C{msg}, C{rs}, C{fc})."""
    return f"{prefix}_{os.urandom(12).hex()}"


class ResponsesDoor:
    """
    The C{POST /v1/responses} front door (L{loopd.gateway.doors.door.Door}).

    @ivar name: C{responses}.
    """

    name = "responses"
    stream_type = EVENT_STREAM

    def __init__(self, store: ResponseStore, hosted_tools: HostedTools = "drop") -> None:
        """
        @param store: the finished responses that C{previous_response_id} continues, and
            where the answers of requests that do not say C{store: false} go.
        @param hosted_tools: what a hosted tool (C{web_search} ...) does to a request: it is
            left out (C{drop}) or refused (C{refuse}), L{loopd.gateway.doors.hosted_tools}.
        """
        self._store = store
        self._hosted_tools = hosted_tools

    def read(self, body: bytes, header: Header, anonymous: Callable[[], str]) -> GatewayRequest:
        """
        The request and its session (L{parse_responses}, with this door's store and hosted
        tools).

        @raise GatewayError: 400 C{invalid_request_error} naming the field.
        """
        return parse_responses(body, header, anonymous, self._store, self._hosted_tools)

    def answer(self, request: GatewayRequest, model: str, created: int) -> ResponsesAnswer:
        """The answer of C{request}, a new response with its own id."""
        return ResponsesAnswer(self._store, request, model, created)

    def mesh_answer(self, request: GatewayRequest, answer_id: str, created: int) -> Answer:
        """A mesh turn's answer: a response as any, from the model L{MESH_MODEL}."""
        return self.answer(request, MESH_MODEL, created)

    def error(self, error: GatewayError) -> tuple[int, object]:
        """OpenAI's error shape as Codex reads it (L{responses_error})."""
        return responses_error(error)


def responses_error(error: GatewayError) -> tuple[int, object]:
    """
    OpenAI's error shape: C{{"error": {"message", "type", "code", "param"}}} (C{param} the
    field the error is about, else C{null}), with the error's own status. loopd's
    C{context_exceeded} goes out as OpenAI's C{context_length_exceeded}, the code Codex acts
    on.
    """
    return error.status, {
        "error": {
            "message": error.message,
            "type": error.type,
            "code": _openai_code(error),
            "param": error.param,
        }
    }


def _openai_code(error: GatewayError) -> str:
    """The error's code as an OpenAI client knows it."""
    return "context_length_exceeded" if error.code == "context_exceeded" else error.code


# ---------------------------------------------------------------------------------------
# Writing


@dataclass
class _Item:
    """One output item of a streamed answer, as it was sent so far."""

    kind: str
    id: str
    index: int
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    namespace: str | None = None
    call_index: int = -1

    def json(self, status: str) -> dict[str, Any]:
        """The item as the C{response}'s C{output} has it."""
        text = "".join(self.text)
        if self.kind == "reasoning":
            return _reasoning_item(self.id, text, status)
        if self.kind == "message":
            return _message_item(self.id, text, status)
        return _call_item(self.id, self.call_id, (self.namespace, self.name), text, status)


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning item: the whole reasoning text as content, no summary."""
    content = [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def _output_text(text: str) -> dict[str, Any]:
    """An C{output_text} content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message item with one C{output_text} part (none while it opens)."""
    content = [_output_text(text)] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(
    item_id: str, call_id: str, name: tuple[str | None, str], arguments: str, status: str
) -> dict[str, Any]:
    """A function call item; C{name} is the tool's namespace (C{None}: none) and name."""
    namespace, own = name
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": own,
        "arguments": arguments,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _split_name(flat: str, namespaces: Mapping[str, tuple[str, str]]) -> tuple[str | None, str]:
    """A called tool's namespace and name as the client offered it (L{flat_tool_name})."""
    namespace, own = namespaces.get(flat, (None, flat))
    return namespace, own


def _usage(completion: Completion) -> dict[str, Any]:
    """The C{usage}: input counts the reused and the evaluated prompt tokens."""
    timings = completion.timings
    prompt = timings.cache_n + timings.prompt_n
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": timings.cache_n, "cache_write_tokens": 0},
        "output_tokens": timings.predicted_n,
        "output_tokens_details": {"reasoning_tokens": completion.reasoning_tokens},
        "total_tokens": prompt + timings.predicted_n,
    }


# The SDK's Response.error.code is one of a fixed list; loopd's own code goes in the
# error event before it. Codex acts on context_length_exceeded, which the list lacks.
_FAILED_CODES: Final = {429: "rate_limit_exceeded"}


def _failed_code(error: GatewayError) -> str:
    """The C{response.error.code} of a failed response."""
    if error.code == "context_exceeded":
        return "context_length_exceeded"
    return _FAILED_CODES.get(error.status, "server_error")


class ResponsesAnswer:
    """
    One response (L{loopd.gateway.doors.door.Answer}): its id, the output items streamed so far
    and the event sequence number; it stores the finished response in the door's store
    unless the request said C{store: false}.

    @ivar response_id: the response's id, C{resp_...}.
    """

    def __init__(
        self, store: ResponseStore, request: GatewayRequest, model: str, created: int
    ) -> None:
        """
        @param store: where the finished response goes.
        @param request: the request it answers.
        @param model: the endpoint's name (or C{mesh}), as the response names its model.
        @param created: seconds of the epoch.
        """
        self.response_id = new_response_id()
        self._store = store
        self._request = request
        self._model = model
        self._created = created
        # 0 and 1 are the opening's (L{opening}).
        self._sequence = 2
        self._items: list[_Item] = []
        self._open: _Item | None = None

    # -- the response object

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        completion: Completion | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The C{response} object with C{status} and C{output}, echoing the request."""
        request = self._request
        extras = request.extras
        reasoning = extras.get("reasoning") or {}
        text: dict[str, Any] = {
            "format": (extras.get("text") or {}).get("format") or {"type": "text"}
        }
        if (extras.get("text") or {}).get("verbosity") is not None:
            text["verbosity"] = extras["text"]["verbosity"]
        incomplete = None
        if completion is not None and completion.finish_reason is FinishReason.LENGTH:
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": extras.get("instructions"),
            "max_output_tokens": request.max_tokens,
            "metadata": extras.get("metadata") or {},
            "model": self._model,
            "output": output,
            "parallel_tool_calls": extras.get("parallel_tool_calls", True),
            "previous_response_id": extras.get("previous_response_id"),
            "prompt_cache_key": extras.get("prompt_cache_key"),
            "reasoning": {
                "effort": reasoning.get("effort"),
                "summary": reasoning.get("summary") or reasoning.get("generate_summary"),
            },
            "safety_identifier": extras.get("safety_identifier"),
            "service_tier": extras.get("service_tier", "default"),
            "store": self._stores,
            "temperature": request.temperature,
            "text": text,
            "tool_choice": request.tool_choice or "auto",
            "tools": [
                {
                    "type": "function",
                    "name": tool.name,
                    "description": tool.description or None,
                    "parameters": tool.parameters,
                }
                for tool in request.tools
            ],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": None if completion is None else _usage(completion),
            "user": extras.get("user"),
        }

    @property
    def _stores(self) -> bool:
        """Whether the finished response is kept for C{previous_response_id}."""
        return self._request.extras.get("store") is not False

    def _keep(self, completion: Completion) -> None:
        """Store the finished response, unless the request said C{store: false}."""
        if not self._stores:
            return
        messages = self._request.messages
        if "instructions" in self._request.extras:
            messages = messages[1:]
        self._store.put(self.response_id, StoredResponse(messages, completion.as_message()))

    @staticmethod
    def _final_status(completion: Completion) -> str:
        """C{incomplete} for an answer cut at its token bound, else C{completed}."""
        return "incomplete" if completion.finish_reason is FinishReason.LENGTH else "completed"

    def error(self, error: GatewayError) -> tuple[int, object]:
        """The door's error shape (L{responses_error})."""
        return responses_error(error)

    def body(self, completion: Completion) -> object:
        """
        The C{response} object: a reasoning item when the model thought, a message item
        when it answered text (or said nothing at all), a function call item per tool
        call; C{usage} with the cached tokens and the reasoning tokens.
        """
        status = self._final_status(completion)
        output: list[dict[str, Any]] = []
        if completion.reasoning_content:
            output.append(_reasoning_item(_new_id("rs"), completion.reasoning_content, status))
        if completion.content or not completion.tool_calls:
            output.append(_message_item(_new_id("msg"), completion.content or "", status))
        for call in completion.tool_calls:
            name = _split_name(call.name, self._request.tool_namespaces)
            output.append(_call_item(_new_id("fc"), call.id, name, call.arguments, status))
        self._keep(completion)
        return self._response(status, output, completion)

    # -- the stream

    def _event(self, kind: str, **fields: Any) -> bytes:
        """One event of the stream, with the next sequence number."""
        self._sequence += 1
        return _numbered(kind, self._sequence - 1, fields)

    def opening(self) -> bytes:
        """
        C{response.created} and C{response.in_progress}, with no output yet: sequence
        numbers 0 and 1, which the events are counted after even when the first of them
        was made before the stream opened (the gateway opens a stream at its first piece).
        """
        snapshot = self._response("in_progress", [])
        return _numbered("response.created", 0, {"response": snapshot}) + _numbered(
            "response.in_progress", 1, {"response": snapshot}
        )

    def keepalive(self) -> bytes:
        """
        C{response.in_progress} again, with the next sequence number and the response as
        it stands: Codex CLI's stream timer counts events with data, not comments, and the
        SDK's accumulator takes a repeated one as it takes the first.
        """
        output = [item.json("in_progress") for item in self._items]
        return self._event("response.in_progress", response=self._response("in_progress", output))

    def during(self, event: ChatEvent) -> bytes:
        """
        Text, thinking and tool call pieces as output item events (a new item when the kind
        of piece, or the tool call, changes; the previous one closed first); loopd's own
        events as C{: loopd} comment lines; C{b""} for the rest.
        """
        if isinstance(event, Reasoning) and event.text:
            item, opened = self._item("reasoning")
            return opened + self._event(
                "response.reasoning_text.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=self._add(item, event.text),
                **self._timings(event),
            )
        if isinstance(event, Content) and event.text:
            item, opened = self._item("message")
            return opened + self._event(
                "response.output_text.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=self._add(item, event.text),
                logprobs=[],
                **self._timings(event),
            )
        if isinstance(event, ToolCallDelta):
            return self._call_piece(event)
        comment = loopd_comment(event)
        return b"" if comment is None else encode_comment("loopd " + compact_json(comment))

    def _timings(self, event: Reasoning | Content | ToolCallDelta) -> dict[str, Any]:
        """The piece's server C{timings}, as an event's field, when the request asked."""
        if self._request.return_timings and event.timings is not None:
            return {"timings": event.timings}
        return {}

    @staticmethod
    def _add(item: _Item, text: str) -> str:
        """Record C{text} as sent on C{item}; give it back."""
        item.text.append(text)
        return text

    def _item(self, kind: str, call: ToolCallDelta | None = None) -> tuple[_Item, bytes]:
        """
        The open item if it is of C{kind} (and, for a call, the same call), else a new one
        opened after closing the open one: the item and the bytes that opened it.
        """
        current = self._open
        if current is not None and current.kind == kind:
            if call is None or call.index == current.call_index:
                return current, b""
        sent = self._close()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, _new_id(prefix), len(self._items))
        if call is not None:
            item.call_index = call.index
            item.call_id = call.id or _new_id("call")
            namespaces = self._request.tool_namespaces
            item.namespace, item.name = _split_name(call.name or "", namespaces)
        self._items.append(item)
        self._open = item
        sent += self._event(
            "response.output_item.added", output_index=item.index, item=item.json("in_progress")
        )
        part = None
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            part = _output_text("")
        if part is not None:
            sent += self._event(
                "response.content_part.added",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                part=part,
            )
        return item, sent

    def _call_piece(self, event: ToolCallDelta) -> bytes:
        """A piece of a tool call: its item opened on first sight, then argument deltas."""
        item, sent = self._item("function_call", event)
        if event.arguments:
            sent += self._event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=item.index,
                delta=self._add(item, event.arguments),
                **self._timings(event),
            )
        return sent

    def _close(self) -> bytes:
        """The C{.done} events of the open item, if any; none is open after."""
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            sent = self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            sent += self._event("response.content_part.done", **where, content_index=0, part=part)
        elif item.kind == "message":
            sent = self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            sent += self._event(
                "response.content_part.done", **where, content_index=0, part=_output_text(text)
            )
        else:
            sent = self._event(
                "response.function_call_arguments.done", **where, name=item.name, arguments=text
            )
        return sent + self._event(
            "response.output_item.done", output_index=item.index, item=item.json("completed")
        )

    def _missing(self, completion: Completion) -> list[ChatEvent]:
        """What C{completion} has that the stream did not carry (thinking, text, calls)."""
        kinds = {item.kind for item in self._items}
        calls = {item.call_index for item in self._items if item.kind == "function_call"}
        events: list[ChatEvent] = []
        if completion.reasoning_content and "reasoning" not in kinds:
            events.append(Reasoning(completion.reasoning_content))
        if completion.content and "message" not in kinds:
            events.append(Content(completion.content))
        for index, call in enumerate(completion.tool_calls):
            if index not in calls:
                events.append(ToolCallDelta(index, call.id, call.name, call.arguments))
        return events

    def closing(self, completion: Completion) -> bytes:
        """
        What the stream lacks of C{completion}, the C{.done} events of the open item, then
        C{response.completed} (C{response.incomplete} for an answer cut at its token
        bound) with the whole response.
        """
        sent = b"".join(self.during(event) for event in self._missing(completion))
        sent += self._close()
        status = self._final_status(completion)
        output = [item.json(status) for item in self._items]
        self._keep(completion)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return sent + self._event(kind, response=self._response(status, output, completion))

    def stream_error(self, error: GatewayError) -> bytes:
        """
        An C{error} event with loopd's own code, then C{response.failed} with the output
        sent so far (each item C{incomplete}) and C{error} (C{rate_limit_exceeded} for a
        429, C{context_length_exceeded}, else C{server_error}).
        """
        self._open = None
        sent = self._event("error", code=error.code, message=error.message, param=None)
        output = [item.json("incomplete") for item in self._items]
        failure = {"code": _failed_code(error), "message": error.message, "type": error.type}
        return sent + self._event(
            "response.failed", response=self._response("failed", output, error=failure)
        )


def _numbered(kind: str, sequence: int, fields: Mapping[str, Any]) -> bytes:
    """One event of a stream: C{kind} with C{sequence} and C{fields}."""
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return encode_event(kind, compact_json(payload))
