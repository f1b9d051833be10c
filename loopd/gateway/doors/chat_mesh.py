# -*- test-case-name: loopd.test.test_doors_chat_mesh -*-
"""
The chat-completions door's answer to a mesh turn (C{model: "mesh"}, issue 6), in the
reference's own shapes (reference/mesh-moa.md §1.12, DESIGN §3 decision 33): the response
bodies and the chat SSE chunks of a streamed success (L{MeshChatAnswer}, which the chat door
gives for a mesh turn, L{loopd.gateway.doors.chat.ChatDoor.mesh_answer}). The other doors
answer a mesh turn as any answer of theirs. The C{x-moa-*} headers are the turn's report,
L{loopd.moa.report}.

Bodies follow the §1.12 table. Each has C{id}, C{object: "chat.completion"}, C{model:
"mesh"}, C{choices[0]} (C{index: 0}, C{message}, C{finish_reason}) and C{usage}. An answer is
C{{role: "assistant", content}} with C{"stop"}. A tool call is C{content: null} plus one
C{tool_calls} entry whose arguments are L{arguments_wire_string} (ARG_STRING), with
C{"tool_calls"}. A failure carries the message as content, C{"error"} as finish reason, and a
top-level C{error: {message, type: "moa_failure", code}}. Usage counts the text the body
carries (the content, ARG_STRING or the error message): C{ceil(scalars / 4)} completion
tokens, no prompt tokens (L{usage_for}).

Deliberate departures from v1, each on purpose:

  - Every body and every chunk has C{created} (integer seconds). v1 has none, but OpenAI SDKs
    expect it.
  - Nothing here reads a clock. Ids (the turn's, L{loopd.moa.report.moa_id} and
    L{loopd.moa.report.call_id}) and C{created} are parameters, so tests and replays are
    exact.
  - L{stream_chunks} puts C{usage} on the finishing chunk (v1 streams no usage at all). There
    is no separate C{choices: []} usage chunk, so every chunk has a real C{choices[0]} (issue
    6).
  - A streamed tool-call turn carries every entry of C{tool_calls}, as v1's chat SSE does
    (its Responses-API SSE drops them, §7 quirk 7). The departure is the entry itself: it is
    rebuilt as C{{index, id, type: "function", function: {name, arguments}}} with ARG_STRING
    arguments, where v1 copies C{function} verbatim. A missing id becomes C{"call_<index>"},
    where v1 puts C{"call_0"} on every entry.
  - The streamed content is the body's content as it stands. v1 runs C{strip_thinking} again
    on the SSE path only, but thinking is already gone by the time a body is built (the
    normalizer, §1.9), so the JSON and the streamed answer are the same text.
  - A failure body is never streamed: L{stream_chunks} raises C{ValueError} for one. The
    caller answers 502 with the JSON body and the headers, streaming request or not (§1.12,
    issue 6).
  - ARG_STRING is strict JSON on both sides. A string passes through only if it parses as a
    JSON object without C{NaN}/C{Infinity} (Python's C{json} would accept those; the Rust
    reference rejects them). An object that cannot be written as strict JSON (a non-finite
    number, a non-JSON value, nesting too deep) becomes C{"{}"}. An array counts as "any
    other value": C{"{}"}. So the wire string always parses as a JSON object.

Quirks of §7 that touch this module:

  - 3: this module writes C{tool_calls} for whatever name it is given. That a tool call goes
    out only for a tool the request declared is L{loopd.moa.tool_guard}'s decision.
  - 5 and 6: the labels say what happened, and the failure test is the only transport rule
    (L{is_failure}: a top-level C{error} key or C{finish_reason} C{"error"}). Decision 33 says
    which label and counts a turn reports: a grace exit is C{early-exit}, and a tool-result
    turn reports 1 worker, also when every reducer failed.
  - 7: the whole answer goes out in one delta, as in v1's chat SSE. The Responses-API shapes
    are not produced here.

Pure: values and functions, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from loopd import strict_json
from loopd.gateway.doors.door import MESH_MODEL, data_line, done_line
from loopd.gateway.errors import GatewayError, MeshTurnError
from loopd.llama.types import ChatEvent, Completion

__all__ = [
    "ERROR_TYPE",
    "MeshChatAnswer",
    "arguments_wire_string",
    "chat_response",
    "error_response",
    "is_failure",
    "stream_chunks",
    "tool_call_response",
    "usage_for",
]

MODEL: Final = MESH_MODEL
"""The C{model} of every body and chunk (§2 C{VIRTUAL_MODEL_NAME})."""


ERROR_TYPE: Final = "moa_failure"


_EMPTY_ARGUMENTS: Final = "{}"


def usage_for(text: str) -> dict[str, int]:
    """
    The usage of a body carrying C{text} (§1.12): C{completion_tokens} is C{ceil(n / 4)} for
    C{n} Unicode scalars (so 0 for C{""} and at least 1 otherwise), C{prompt_tokens} is 0, and
    C{total_tokens} equals C{completion_tokens}.
    """
    tokens = (len(text) + 3) // 4
    return {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}


def _is_json_object_text(text: str) -> bool:
    """
    Whether C{text} parses, as strict JSON, to an object.
    """
    try:
        parsed = strict_json.decode(text, interoperable=True)
    except strict_json.JSONError:
        return False
    return isinstance(parsed, dict)


def arguments_wire_string(arguments: object) -> str:
    """
    ARG_STRING (§1.12 C{tool_arguments_wire_string}), the C{function.arguments} of a tool
    call:

      - a string that parses to a JSON object goes out verbatim;
      - any other string is C{"{}"};
      - an object is serialized (compact, non-ASCII kept; C{"{}"} if it cannot be written
        as strict JSON);
      - null, a primitive or an array is C{"{}"}.
    """
    if isinstance(arguments, str):
        return arguments if _is_json_object_text(arguments) else _EMPTY_ARGUMENTS
    if isinstance(arguments, Mapping):
        try:
            return json.dumps(
                dict(arguments), separators=(",", ":"), ensure_ascii=False, allow_nan=False
            )
        except (TypeError, ValueError, RecursionError):
            return _EMPTY_ARGUMENTS
    return _EMPTY_ARGUMENTS


def _body(
    message: dict[str, Any], finish_reason: str, usage_text: str, completion_id: str, created: int
) -> dict[str, Any]:
    """
    The envelope every body shares around C{message}.
    """
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage_for(usage_text),
    }


def chat_response(content: str, *, completion_id: str, created: int) -> dict[str, Any]:
    """
    The body of an answer: C{content} from the assistant, finish reason C{"stop"}, usage
    counted from C{content}.
    """
    message = {"role": "assistant", "content": content}
    return _body(message, "stop", content, completion_id, created)


def tool_call_response(
    name: str, arguments: object, *, completion_id: str, call_id: str, created: int
) -> dict[str, Any]:
    """
    The body of a tool call: C{content: null} and one C{tool_calls} entry for C{name} with
    ARG_STRING arguments, finish reason C{"tool_calls"}, usage counted from ARG_STRING.
    """
    wire = arguments_wire_string(arguments)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": wire}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return _body(message, "tool_calls", wire, completion_id, created)


def error_response(message: str, code: str, *, completion_id: str, created: int) -> dict[str, Any]:
    """
    The body of a failed turn: C{message} as the assistant's content, finish reason
    C{"error"}, and C{error: {message, type: "moa_failure", code}}; usage counted from
    C{message}. C{code} is C{all_workers_failed}, C{all_reducers_failed} or
    C{no_usable_answer} (§1.12, §6).
    """
    body = _body(
        {"role": "assistant", "content": message}, "error", message, completion_id, created
    )
    body["error"] = {"message": message, "type": ERROR_TYPE, "code": code}
    return body


def _first_choice(body: Mapping[str, Any]) -> object:
    """
    C{body["choices"][0]}, or C{None} when there is no such thing.
    """
    choices = body.get("choices")
    if isinstance(choices, list) and choices:
        return choices[0]
    return None


def is_failure(body: object) -> bool:
    """
    Whether C{body} is a failure (§1.12 C{write_moa_response}): it has a top-level C{error}
    key, or C{choices[0].finish_reason} is C{"error"}. Anything that is not a JSON object is
    not a failure body.
    """
    if not isinstance(body, Mapping):
        return False
    if "error" in body:
        return True
    choice = _first_choice(body)
    return isinstance(choice, Mapping) and choice.get("finish_reason") == "error"


def _stream_tool_call(index: int, call: object) -> dict[str, Any]:
    """
    One C{tool_calls} entry of a body as a streamed delta entry.
    """
    if not isinstance(call, Mapping):
        raise ValueError(f"tool_calls[{index}] is not an object")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"tool_calls[{index}] has no function name")
    identifier = call.get("id")
    return {
        "index": index,
        "id": identifier if isinstance(identifier, str) and identifier else f"call_{index}",
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments_wire_string(function.get("arguments")),
        },
    }


def stream_chunks(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """
    The two C{chat.completion.chunk} objects that stream the success C{body}; the caller
    writes each as C{data: <json>} and then C{data: [DONE]}.

    The first carries the whole answer in its delta: C{{role: "assistant", content}}, or for
    a tool-call body C{{role: "assistant", tool_calls: [...]}} with every call. The second
    has an empty delta, the finish reason (C{"tool_calls"} or C{"stop"}) and the body's
    C{usage}. Both have the body's C{id} and C{created}, C{model: "mesh"} and a real
    C{choices[0]}.

    @raise ValueError: C{body} is a failure (failures go out as a 502, never streamed), or
        it is not a body of this module's shape.
    """
    if is_failure(body):
        raise ValueError("a failure body is never streamed; answer 502 with it instead")
    completion_id = body.get("id")
    created = body.get("created")
    if not isinstance(completion_id, str):
        raise ValueError("the body has no string id")
    if isinstance(created, bool) or not isinstance(created, int):
        raise ValueError("the body has no integer created")
    choice = _first_choice(body)
    message = choice.get("message") if isinstance(choice, Mapping) else None
    if not isinstance(message, Mapping):
        raise ValueError("the body has no choices[0].message")

    calls = message.get("tool_calls")
    delta: dict[str, Any] = {"role": "assistant"}
    if isinstance(calls, list) and calls:
        delta["tool_calls"] = [_stream_tool_call(i, call) for i, call in enumerate(calls)]
        finish_reason = "tool_calls"
        usage_text = "".join(call["function"]["arguments"] for call in delta["tool_calls"])
    else:
        content = message.get("content")
        delta["content"] = content if isinstance(content, str) else ""
        finish_reason = "stop"
        usage_text = delta["content"]
    usage = body.get("usage")
    if not isinstance(usage, Mapping):
        usage = usage_for(usage_text)

    last = _chunk(completion_id, created, {}, finish_reason)
    last["usage"] = dict(usage)
    return [_chunk(completion_id, created, delta, None), last]


def _chunk(
    completion_id: str, created: int, delta: dict[str, Any], finish_reason: str | None
) -> dict[str, Any]:
    """A C{chat.completion.chunk} of a mesh answer with one choice."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


class MeshChatAnswer:
    """
    One mesh turn's answer on chat completions (L{loopd.gateway.doors.door.Answer}): the
    whole answer in one delta at the end (§7 quirk 7), so nothing goes out while the turn
    runs but the turn's own progress comments, which the mesh exchange writes.
    """

    def __init__(self, answer_id: str, created: int) -> None:
        """
        @param answer_id: the turn's completion id (L{loopd.moa.report.moa_id}).
        @param created: the answer's C{created}, seconds of the epoch.
        """
        self._id = answer_id
        self._created = created

    def opening(self) -> bytes:
        """Nothing: the first chunk carries the role with the whole answer."""
        return b""

    def during(self, event: ChatEvent) -> bytes:
        """Nothing: the answer goes out whole, at its end (L{closing})."""
        return b""

    def keepalive(self) -> bytes:
        """A chunk of this answer whose first choice has an empty delta."""
        return data_line(_chunk(self._id, self._created, {}, None))

    def closing(self, completion: Completion) -> bytes:
        """The two chunks of L{stream_chunks} for the answer's body, then C{[DONE]}."""
        chunks = stream_chunks(self._body(completion))
        return b"".join(data_line(chunk) for chunk in chunks) + done_line()

    def stream_error(self, error: GatewayError) -> bytes:
        """
        A turn's failure as the failure body's C{error} object in one C{data:} event; any
        other error (the daemon stopping) as OpenAI's error body.
        """
        if isinstance(error, MeshTurnError):
            return data_line({"error": self._failure_body(error)["error"]})
        return data_line(error.body())

    def body(self, completion: Completion) -> object:
        """
        The body of the turn's answer: its first tool call (L{tool_call_response}), else
        its text (L{chat_response}).
        """
        return self._body(completion)

    def _body(self, completion: Completion) -> dict[str, Any]:
        """L{body}."""
        if completion.tool_calls:
            call = completion.tool_calls[0]
            return tool_call_response(
                call.name,
                call.arguments,
                completion_id=self._id,
                call_id=call.id,
                created=self._created,
            )
        return chat_response(
            completion.content or "", completion_id=self._id, created=self._created
        )

    def error(self, error: GatewayError) -> tuple[int, object]:
        """
        A turn's failure as 502 with the failure body (L{error_response}); any other error
        (the daemon stopping) as OpenAI's error body with its status.
        """
        if isinstance(error, MeshTurnError):
            return 502, self._failure_body(error)
        return error.status, error.body()

    def _failure_body(self, error: GatewayError) -> dict[str, Any]:
        """The failure body of a turn that failed with C{error}."""
        return error_response(
            error.message, error.code, completion_id=self._id, created=self._created
        )
