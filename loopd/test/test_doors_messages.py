"""
Tests for L{loopd.gateway.doors.messages}: Anthropic Messages bodies in (every bad input a 400
naming the field), the C{message} object, the event stream as the C{anthropic} SDK parses
it, and errors in Anthropic's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import anthropic
import httpx2
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.messages import MessagesDoor, anthropic_error, tool_input
from loopd.gateway.doors.messages_read import parse_messages
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.llama.types import (
    ChatEvent,
    Completion,
    Content,
    FinishReason,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    ThinkingCapped,
    Timings,
    ToolCall,
    ToolCallDelta,
    Waiting,
)
from loopd.test.support.sdk_streams import anthropic_message

USER = {"role": "user", "content": "Hi"}
TIMINGS = Timings(cache_n=90, prompt_n=10, predicted_n=7)


def encode(document: object) -> bytes:
    """A JSON request body."""
    return json.dumps(document).encode("utf-8")


def parse(**fields: Any) -> GatewayRequest:
    """Parse a body of one user message and C{max_tokens} 100, plus C{fields}."""
    return parse_messages(encode({"max_tokens": 100, "messages": [USER], **fields}))


def no_headers(name: bytes) -> bytes | None:
    """A request without headers."""
    return None


def headers(values: Mapping[bytes, bytes]) -> Any:
    """A request's header lookup over C{values}."""
    return values.get


class DoorTests(SynchronousTestCase):
    """L{MessagesDoor.read}, L{MessagesDoor.read_count}: the session."""

    def test_user_id_names_the_session(self) -> None:
        """metadata.user_id names the session when no header does."""
        body = encode({"max_tokens": 1, "messages": [USER], "metadata": {"user_id": " s1 "}})
        request = MessagesDoor().read(body, no_headers, lambda: "anon")
        self.assertEqual((request.session.id, request.session.anonymous), ("s1", False))

    def test_header_first(self) -> None:
        """Claude Code's session header comes before the body's id."""
        body = encode({"max_tokens": 1, "messages": [USER], "metadata": {"user_id": "s1"}})
        lookup = headers({b"x-claude-code-session-id": b"cc-7"})
        self.assertEqual(MessagesDoor().read(body, lookup, lambda: "anon").session.id, "cc-7")

    def test_anonymous(self) -> None:
        """Without an id the connection's anonymous one is used."""
        body = encode({"max_tokens": 1, "messages": [USER]})
        session = MessagesDoor().read(body, no_headers, lambda: "anon").session
        self.assertEqual((session.id, session.anonymous), ("anon", True))

    def test_bad_user_id(self) -> None:
        """A user_id that is not a string is a 400 naming it."""
        body = encode({"max_tokens": 1, "messages": [USER], "metadata": {"user_id": 3}})
        error = self.assertRaises(GatewayError, MessagesDoor().read, body, no_headers, str)
        self.assertIn("metadata.user_id", error.message)

    def test_read_count(self) -> None:
        """count_tokens reads without max_tokens; its session is the headers'."""
        body = encode({"model": "tiny", "messages": [USER]})
        request = MessagesDoor().read_count(body, headers({b"x-session-id": b"s"}))
        self.assertEqual((request.max_tokens, request.session.id), (None, "s"))
        self.assertEqual(MessagesDoor().read_count(body, no_headers).session.id, "")


def completion(
    content: str | None = "Hello.",
    reasoning: str | None = "Hmm.",
    calls: tuple[ToolCall, ...] = (),
    finish: FinishReason = FinishReason.STOP,
) -> Completion:
    """A finished answer with L{TIMINGS}."""
    return Completion("c", content, reasoning, calls, finish, TIMINGS)


class BodyTests(SynchronousTestCase):
    """L{MessagesAnswer.body}: the C{message} object."""

    def body(self, done: Completion) -> dict[str, Any]:
        """The answer's body, checked by the SDK's own model."""
        body = MessagesDoor().answer(parse(), "tiny", 0).body(done)
        assert isinstance(body, dict)
        anthropic.types.Message.model_validate(body)
        return body

    def test_text_and_thinking(self) -> None:
        """A thinking block (signature ""), a text block, end_turn, usage apart."""
        body = self.body(completion())
        self.assertTrue(body["id"].startswith("msg_"))
        self.assertEqual(
            {k: v for k, v in body.items() if k != "id"},
            {
                "type": "message",
                "role": "assistant",
                "model": "tiny",
                "content": [
                    {"type": "thinking", "thinking": "Hmm.", "signature": ""},
                    {"type": "text", "text": "Hello."},
                ],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 10,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 90,
                    "output_tokens": 7,
                },
            },
        )

    def test_tool_use(self) -> None:
        """Tool calls are tool_use blocks, their input parsed; stop_reason tool_use."""
        calls = (ToolCall("a", "read", '{"path": "x"}'), ToolCall("b", "list", ""))
        body = self.body(completion(None, None, calls, FinishReason.TOOL_CALLS))
        self.assertEqual(
            body["content"],
            [
                {"type": "tool_use", "id": "a", "name": "read", "input": {"path": "x"}},
                {"type": "tool_use", "id": "b", "name": "list", "input": {}},
            ],
        )
        self.assertEqual(body["stop_reason"], "tool_use")

    def test_stop_reasons(self) -> None:
        """length is max_tokens."""
        self.assertEqual(
            self.body(completion(finish=FinishReason.LENGTH))["stop_reason"], "max_tokens"
        )
        self.assertEqual(self.body(completion(None, None))["content"], [])

    def test_tool_input(self) -> None:
        """Arguments that are not a JSON object are kept as text."""
        self.assertEqual(tool_input('{"a": [1]}'), {"a": [1]})
        self.assertEqual(tool_input("  "), {})
        self.assertEqual(tool_input("{oops"), {"_raw_arguments": "{oops"})
        self.assertEqual(tool_input("[1]"), {"_raw_arguments": "[1]"})


def events(raw: bytes) -> list[tuple[str, Any]]:
    """The named events of a stream, each with its decoded data (comments left out)."""
    out = []
    for frame in raw.decode().split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if lines:
            name = lines[0].removeprefix("event: ")
            out.append((name, json.loads(lines[1].removeprefix("data: "))))
    return out


def stream_bytes(pieces: Iterable[ChatEvent], done: Completion) -> bytes:
    """A whole stream of C{pieces} ending with C{done}."""
    answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
    return answer.opening() + b"".join(answer.during(e) for e in pieces) + answer.closing(done)


def sdk_client(status: int, body: bytes, content_type: str) -> anthropic.Anthropic:
    """An SDK client whose every request is answered with C{body}."""

    def handle(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, headers={"content-type": content_type}, content=body)

    transport = httpx2.MockTransport(handle)
    return anthropic.Anthropic(
        api_key="token",
        base_url="http://loopd",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


PIECES: tuple[ChatEvent, ...] = (
    Queued(1),
    Waiting(True),
    Progress(100, 90, 100),
    Reasoning("Let me "),
    Reasoning("think."),
    ThinkingCapped(2),
    Content("Hi "),
    Content(""),
    Content("there."),
    ToolCallDelta(0, "call_a", "read", ""),
    ToolCallDelta(0, None, None, '{"path": '),
    ToolCallDelta(0, None, None, '"x"}'),
    Retrying(1, 10, "boom"),
    ToolCallDelta(1, "call_b", None, "{}"),
    ToolCallDelta(1, None, "list", ""),
)


DONE = completion(
    "Hi there.",
    "Let me think.",
    (ToolCall("call_a", "read", '{"path": "x"}'), ToolCall("call_b", "list", "{}")),
    FinishReason.TOOL_CALLS,
)


class StreamTests(SynchronousTestCase):
    """The event stream, event by event and as the SDK accumulates it."""

    def test_sdk_accumulates_the_same_message(self) -> None:
        """The SDK's MessageStream over the stream gives the non-streaming body's message."""
        message = anthropic_message(stream_bytes(PIECES, DONE))
        body = MessagesDoor().answer(parse(), "tiny", 0).body(DONE)
        assert isinstance(body, dict)
        self.assertEqual([block.to_dict() for block in message.content], body["content"])
        self.assertEqual((message.stop_reason, message.stop_sequence), ("tool_use", None))
        self.assertEqual(message.usage.to_dict(), body["usage"])
        self.assertEqual(message.model, "tiny")

    def test_events(self) -> None:
        """
        Each event, in order: the waits' pings, the message's start at the first progress
        event, blocks that start and stop as the kind of piece changes.
        """
        raw = stream_bytes(PIECES, DONE)
        names = [name for name, _ in events(raw)]
        self.assertEqual(
            names,
            [
                "ping",
                "ping",
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ],
        )
        for name, data in events(raw):
            self.assertEqual(data["type"], name)
        parsed = events(raw)
        self.assertEqual(
            parsed[3][1],
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        )
        self.assertEqual(parsed[6][1]["delta"], {"type": "signature_delta", "signature": ""})
        self.assertEqual(
            parsed[12][1]["content_block"],
            {"type": "tool_use", "id": "call_a", "name": "read", "input": {}},
        )
        self.assertEqual(
            parsed[13][1],
            {
                "type": "content_block_delta",
                "index": 2,
                "delta": {"type": "input_json_delta", "partial_json": '{"path": '},
            },
        )
        self.assertEqual(
            parsed[-2][1],
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {
                    "input_tokens": 10,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 90,
                    "output_tokens": 7,
                },
            },
        )
        start = parsed[2][1]["message"]
        self.assertEqual((start["content"], start["stop_reason"]), ([], None))
        self.assertEqual(
            start["usage"],
            {
                "input_tokens": 10,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 90,
                "output_tokens": 0,
            },
        )

    def test_loopd_events_are_comments(self) -> None:
        """loopd's own events are comment lines; queued and waiting also send a ping."""
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        self.assertEqual(
            answer.during(Queued(2)),
            b': loopd {"event":"queued","ahead":2}\n\nevent: ping\ndata: {"type":"ping"}\n\n',
        )
        started = answer.during(Progress(3, 1, 2))
        self.assertTrue(started.startswith(b"event: message_start\n"))
        self.assertTrue(
            started.endswith(b': loopd {"event":"progress","total":3,"cache":1,"processed":2}\n\n')
        )
        self.assertEqual(
            answer.during(Progress(3, 1, 3)),
            b': loopd {"event":"progress","total":3,"cache":1,"processed":3}\n\n',
        )
        self.assertEqual(answer.during(Content("")), b"")

    def test_start_without_progress(self) -> None:
        """
        An endpoint that reports no progress: the message starts, its usage zero, before
        the first piece; or before the end when there is no piece at all.
        """
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        self.assertEqual(answer.opening(), b"")
        first = events(answer.during(Content("Hi")))
        self.assertEqual([name for name, _ in first][:2], ["message_start", "content_block_start"])
        self.assertEqual(first[0][1]["message"]["usage"]["input_tokens"], 0)
        empty = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        names = [name for name, _ in events(empty.closing(completion(None, None)))]
        self.assertEqual(names, ["message_start", "message_delta", "message_stop"])

    def test_frames(self) -> None:
        """Every event is C{event: <type>}, one C{data:} line of JSON, a blank line."""
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        self.assertEqual(
            answer.closing(completion(None, None))[-40:],
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n'[-40:],
        )
        frame = answer.during(Content("a\nb"))
        self.assertEqual(frame.count(b"\ndata: "), 2)
        self.assertTrue(frame.endswith(b'"text":"a\\nb"}}\n\n'))

    def test_empty_answer(self) -> None:
        """An answer with nothing in it still starts and ends as the SDK expects."""
        message = anthropic_message(
            stream_bytes((), completion(None, None, finish=FinishReason.LENGTH))
        )
        self.assertEqual((message.content, message.stop_reason), ([], "max_tokens"))

    def test_stream_error(self) -> None:
        """A failure after the stream opened is an error event, which the SDK raises."""
        answer = MessagesDoor().answer(parse(stream=True), "tiny", 0)
        failure = GatewayError(502, "the model server failed", "upstream_error", "protocol")
        raw = answer.opening() + answer.during(Content("Hi")) + answer.stream_error(failure)
        self.assertEqual(
            events(raw)[-1],
            (
                "error",
                {
                    "type": "error",
                    "error": {"type": "api_error", "message": "the model server failed"},
                },
            ),
        )
        error = self.assertRaises(anthropic.APIStatusError, anthropic_message, raw)
        self.assertIn("the model server failed", str(error))


class ErrorTests(SynchronousTestCase):
    """L{anthropic_error}: Anthropic's error shape and status."""

    def test_types(self) -> None:
        """Each status has Anthropic's type; Busy is 529 overloaded."""
        cases = [
            (GatewayError(400, "m", "invalid_request_error", "x"), 400, "invalid_request_error"),
            (GatewayError(401, "m", "authentication_error", "x"), 401, "authentication_error"),
            (GatewayError(403, "m", "x", "x"), 403, "permission_error"),
            (
                GatewayError(404, "m", "invalid_request_error", "model_not_found"),
                404,
                "not_found_error",
            ),
            (GatewayError(405, "m", "invalid_request_error", "x"), 405, "invalid_request_error"),
            (GatewayError(413, "m", "invalid_request_error", "x"), 413, "request_too_large"),
            (GatewayError(429, "m", "rate_limit_error", "busy"), 529, "overloaded_error"),
            (GatewayError(429, "m", "rate_limit_error", "http"), 429, "rate_limit_error"),
            (GatewayError(500, "m", "server_error", "internal_error"), 500, "api_error"),
            (GatewayError(502, "m", "upstream_error", "connect"), 502, "api_error"),
            (
                GatewayError(503, "m", "server_error", "endpoint_unavailable"),
                503,
                "overloaded_error",
            ),
            (GatewayError(504, "m", "timeout", "stalled"), 504, "timeout_error"),
        ]
        for error, status, kind in cases:
            self.assertEqual(
                anthropic_error(error),
                (status, {"type": "error", "error": {"type": kind, "message": "m"}}),
            )
            self.assertEqual(MessagesDoor().error(error), anthropic_error(error))

    def test_prompt_too_long(self) -> None:
        """A prompt over the context says so as Anthropic does, for Claude Code's compaction."""
        error = GatewayError(
            400, "the request exceeds the context", "invalid_request_error", "context_exceeded"
        )
        _, body = anthropic_error(error)
        self.assertEqual(
            body["error"]["message"], "prompt is too long: the request exceeds the context"
        )

    def test_sdk_reads_them(self) -> None:
        """The SDK raises its own error class for each: 529 is OverloadedError."""
        for error, kind in (
            (GatewayError(429, "full", "rate_limit_error", "busy"), anthropic.OverloadedError),
            (
                GatewayError(401, "no", "authentication_error", "token"),
                anthropic.AuthenticationError,
            ),
            (GatewayError(400, "bad", "invalid_request_error", "x"), anthropic.BadRequestError),
        ):
            status, body = anthropic_error(error)
            client = sdk_client(status, json.dumps(body).encode(), "application/json")
            raised = self.assertRaises(
                kind, client.messages.create, model="tiny", max_tokens=1, messages=[USER]
            )
            self.assertEqual(raised.body, body)
