"""
Tests for L{loopd.gateway.doors.messages}: Anthropic Messages bodies in (every bad input a 400
naming the field), the C{message} object, the event stream as the C{anthropic} SDK parses
it, and errors in Anthropic's shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.settings import Doors
from loopd.test.support.sdk_streams import anthropic_message
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import GatewayHarness, Response, make_config
from loopd.testing.llama_replies import answer

USER = {"role": "user", "content": "Hi"}
TOOL = {"name": "read", "description": "Read a file.", "input_schema": {"type": "object"}}


def encode(document: object) -> bytes:
    """A JSON request body."""
    return json.dumps(document).encode("utf-8")


def headers(values: Mapping[bytes, bytes]) -> Any:
    """A request's header lookup over C{values}."""
    return values.get


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
        message = anthropic_message(response.body)
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
