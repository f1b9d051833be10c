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

from loopd.gateway.doors.messages import MessagesDoor
from loopd.gateway.doors.messages_read import parse_messages
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
from loopd.settings import Doors
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import GatewayHarness, Response, make_config
from loopd.testing.llama_replies import answer

USER = {"role": "user", "content": "Hi"}
TOOL = {"name": "read", "description": "Read a file.", "input_schema": {"type": "object"}}
PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
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


def completion(
    content: str | None = "Hello.",
    reasoning: str | None = "Hmm.",
    calls: tuple[ToolCall, ...] = (),
    finish: FinishReason = FinishReason.STOP,
) -> Completion:
    """A finished answer with L{TIMINGS}."""
    return Completion("c", content, reasoning, calls, finish, TIMINGS)


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


def sdk_stream(raw: bytes) -> anthropic.types.Message:
    """What the SDK's own stream accumulation makes of C{raw}."""
    client = sdk_client(200, raw, "text/event-stream")
    with client.messages.stream(model="tiny", max_tokens=100, messages=[USER]) as stream:  # type: ignore[list-item]
        return stream.get_final_message()


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


class GatewayTests(SynchronousTestCase):
    """The door behind the gateway's C{/v1/messages} route, over a fake llama-server."""

    def post(self, document: object, *headers: str) -> Response:
        """POST C{document} to C{/v1/messages?beta=true}; the response once all is said."""
        connection = self.harness.connect()
        lines = ["Content-Type: application/json", "anthropic-version: 2023-06-01", *headers]
        connection.request("POST", "/v1/messages?beta=true", encode(document), lines)
        self.harness.advance(1)
        return connection.response()

    def setUp(self) -> None:
        """A gateway over one fake llama-server, C{tiny}."""
        self.harness = GatewayHarness()

    def test_stream(self) -> None:
        """A streamed answer as the SDK reads it; the request's fields reach the server."""
        self.harness.fake.script(
            "POST", CHAT, answer({"reasoning_content": "Hm."}, {"content": "Hi"})
        )
        document = {
            "model": "tiny",
            "max_tokens": 50,
            "top_k": 5,
            "stream": True,
            "system": "x-anthropic-billing-header: cch=1;\nBe brief.",
            "messages": [USER],
            "thinking": {"type": "enabled", "budget_tokens": 64},
        }
        response = self.post(document, "anthropic-beta: interleaved-thinking-2025-05-14")
        self.assertEqual(response.status, 200)
        message = sdk_stream(response.body)
        self.assertEqual(
            [block.to_dict() for block in message.content],
            [
                {"type": "thinking", "thinking": "Hm.", "signature": ""},
                {"type": "text", "text": "Hi"},
            ],
        )
        [sent] = self.harness.fake.requests_to("POST", CHAT)
        assert sent.json is not None
        self.assertEqual(sent.json["messages"][0], {"role": "system", "content": "Be brief."})
        self.assertEqual((sent.json["top_k"], sent.json["max_tokens"]), (5, 50))

    def test_message(self) -> None:
        """A non-streaming answer is the message object."""
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        response = self.post({"model": "tiny", "max_tokens": 50, "messages": [USER]})
        body = response.json()
        self.assertEqual((response.status, body["type"]), (200, "message"))
        self.assertEqual(body["content"], [{"type": "text", "text": "Hello"}])

    def test_dropped_header(self) -> None:
        """
        A request with server tools is answered with them named in C{X-Loopd-Dropped} and
        counted in C{loopd_dropped_tools_total}; the server sees only the custom tools.
        """
        self.harness.fake.script("POST", CHAT, answer({"content": "Hello"}))
        tools = [{"type": "web_search_20250305", "name": "web_search"}, TOOL]
        document = {"model": "tiny", "max_tokens": 50, "messages": [USER], "tools": tools}
        response = self.post(document)
        self.assertEqual(response.status, 200)
        self.assertEqual(response.headers["x-loopd-dropped"], "web_search_20250305")
        [sent] = self.harness.fake.requests_to("POST", CHAT)
        assert sent.json is not None
        self.assertEqual([t["function"]["name"] for t in sent.json["tools"]], ["read"])
        key = frozenset({("door", "messages"), ("tool", "web_search_20250305")})
        self.assertEqual(self.harness.scrape()[("loopd_dropped_tools_total", key)], 1)
        plain = self.post({"model": "tiny", "max_tokens": 50, "messages": [USER]})
        self.assertNotIn("x-loopd-dropped", plain.headers)

    def test_hosted_tools_refused(self) -> None:
        """With C{[doors] hosted_tools = "refuse"} such a request is a 400, nothing sent."""
        self.harness = GatewayHarness(make_config(doors=Doors(hosted_tools="refuse")))
        tools = [{"type": "web_fetch_20250910", "name": "web_fetch"}]
        response = self.post({"model": "tiny", "max_tokens": 5, "messages": [USER], "tools": tools})
        self.assertEqual(response.status, 400)
        self.assertIn("tools[0].type: web_fetch_20250910", response.json()["error"]["message"])
        self.assertEqual(self.harness.fake.requests, [])

    def test_refusal(self) -> None:
        """A refused request is a 400 in Anthropic's shape, and nothing reaches the server."""
        response = self.post({"model": "tiny", "messages": [USER]})
        self.assertEqual(response.status, 400)
        self.assertEqual(
            response.json(),
            {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "max_tokens: required: a positive integer",
                },
            },
        )
        self.assertEqual(self.harness.fake.requests, [])
