"""
Tests for L{loopd.gateway.exchange}: every front door goes one way through the gateway.
Over the site with real HTTP parsing, against scripted fake llama-servers in memory on a
clock (L{loopd.testing.gateway.GatewayHarness}, L{loopd.testing.mesh.MeshHarness}): the
Anthropic and Responses doors get the same leased call, errors and mesh as chat
completions, each in its own shapes, and a pass-through field that cannot apply where the
request goes is a 400 naming it, with nothing sent upstream.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import (
    ClientConnection,
    GatewayHarness,
    Response,
    make_config,
)
from loopd.testing.llama_replies import answer
from loopd.testing.mesh import ASK, TWO, MeshHarness, mesh_config, says

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
ANTHROPIC_HI = {"model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSES_HI = {"model": "tiny", "input": "Hi"}


def post(harness: GatewayHarness, path: str, document: object) -> ClientConnection:
    """A new connection that POSTs C{document} as JSON to C{path}."""
    connection = harness.connect()
    body = json.dumps(document).encode()
    connection.request("POST", path, body, ["Content-Type: application/json"])
    return connection


def ask(harness: GatewayHarness, path: str, document: object) -> Response:
    """POST C{document} to C{path}, let a second pass, and return the response."""
    connection = post(harness, path, document)
    harness.advance(1.0)
    return connection.response()


def events(response: Response) -> list[tuple[str, dict[str, Any]]]:
    """The named events of an SSE body: (the C{event:} name, the JSON data), in order."""
    found = []
    for block in response.body.decode("utf-8").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        name = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
        data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        if name and data:
            found.append((name[0], json.loads(data[0])))
    return found


class DoorTestCase(SynchronousTestCase):
    """A one-slot gateway per test, over a scripted fake llama-server."""

    config = make_config(slots=1)

    def setUp(self) -> None:
        self.harness = GatewayHarness(self.config)
        self.fake = self.harness.fake

    def script(self, *replies: Any) -> None:
        """Queue upstream replies to the chat route."""
        self.fake.script("POST", CHAT, *replies)


class AnthropicThroughTheGatewayTests(DoorTestCase):
    """C{POST /v1/messages}: the one leased call, Anthropic's shapes."""

    def test_message(self) -> None:
        """A whole answer is Anthropic's message, from one upstream chat request."""
        self.script(answer({"content": "Hello"}))
        response = ask(self.harness, MESSAGES, ANTHROPIC_HI)
        self.assertEqual(response.status, 200)
        message = response.json()
        self.assertEqual((message["type"], message["role"]), ("message", "assistant"))
        self.assertEqual(message["content"], [{"type": "text", "text": "Hello"}])
        self.assertEqual(message["stop_reason"], "end_turn")
        (sent,) = self.fake.requests_to("POST", CHAT)
        self.assertEqual(sent.json["max_tokens"], 50)
        self.assertEqual(sent.json["messages"], [{"role": "user", "content": "Hi"}])

    def test_beta_query_and_headers(self) -> None:
        """
        Claude Code's C{?beta=true} and its C{anthropic-version} and C{anthropic-beta}
        headers are taken as they come.
        """
        self.script(answer({"content": "Hello"}))
        connection = self.harness.connect()
        headers = [
            "Content-Type: application/json",
            "anthropic-version: 2023-06-01",
            "anthropic-beta: interleaved-thinking-2025-05-14",
        ]
        connection.request(
            "POST", MESSAGES + "?beta=true", json.dumps(ANTHROPIC_HI).encode(), headers
        )
        self.harness.advance(1.0)
        response = connection.response()
        self.assertEqual(response.status, 200)
        self.assertEqual(response.json()["content"], [{"type": "text", "text": "Hello"}])

    def test_stream(self) -> None:
        """A streamed answer is Anthropic's event sequence."""
        self.script(answer({"content": "Hel"}, {"content": "lo"}))
        response = ask(self.harness, MESSAGES, {**ANTHROPIC_HI, "stream": True})
        self.assertEqual((response.status, response.complete), (200, True))
        names = [name for name, _ in events(response)]
        self.assertEqual(names[0], "message_start")
        self.assertEqual(names[-2:], ["message_delta", "message_stop"])
        texts = [
            data["delta"]["text"]
            for name, data in events(response)
            if name == "content_block_delta" and data["delta"]["type"] == "text_delta"
        ]
        self.assertEqual("".join(texts), "Hello")

    def test_busy_is_overloaded(self) -> None:
        """loopd's Busy (the slot taken and its queue full) is Anthropic's 529."""
        self.script(answer({"content": "a"}), answer({"content": "b"}))
        post(self.harness, MESSAGES, {**ANTHROPIC_HI, "stream": True})
        post(self.harness, MESSAGES, {**ANTHROPIC_HI, "stream": True})
        response = post(self.harness, MESSAGES, ANTHROPIC_HI).response()
        self.assertEqual(response.status, 529)
        body = response.json()
        self.assertEqual((body["type"], body["error"]["type"]), ("error", "overloaded_error"))
        self.assertEqual(len(self.fake.requests_to("POST", CHAT)), 1)

    def test_bad_request_in_anthropic_shape(self) -> None:
        """A request without max_tokens is a 400 in Anthropic's shape; nothing goes upstream."""
        body = {key: value for key, value in ANTHROPIC_HI.items() if key != "max_tokens"}
        response = post(self.harness, MESSAGES, body).response()
        self.assertEqual(response.status, 400)
        error = response.json()
        self.assertEqual(error["error"]["type"], "invalid_request_error")
        self.assertIn("max_tokens", error["error"]["message"])
        self.assertEqual(self.fake.requests, [])

    def test_unknown_model(self) -> None:
        """A model no endpoint serves is Anthropic's 404 not_found_error."""
        response = post(self.harness, MESSAGES, {**ANTHROPIC_HI, "model": "nope"}).response()
        self.assertEqual(response.status, 404)
        self.assertEqual(response.json()["error"]["type"], "not_found_error")


class ResponsesThroughTheGatewayTests(DoorTestCase):
    """C{POST /v1/responses}: the one leased call, the Responses API's shapes."""

    def test_response(self) -> None:
        """A whole answer is a completed response whose message has the text."""
        self.script(answer({"content": "Hello"}))
        response = ask(self.harness, RESPONSES, RESPONSES_HI)
        self.assertEqual(response.status, 200)
        body = response.json()
        self.assertEqual((body["object"], body["status"]), ("response", "completed"))
        (message,) = [item for item in body["output"] if item["type"] == "message"]
        self.assertEqual(message["content"][0]["text"], "Hello")

    def test_stream_sequence_numbers(self) -> None:
        """
        A stream's sequence numbers count from 0 in the order the events go out, though the
        stream opens only at the first piece, made before the opening (they went 3, 4, 0,
        1, 2, 5 ... before).
        """
        self.script(answer({"content": "Hel"}, {"content": "lo"}))
        response = ask(self.harness, RESPONSES, {**RESPONSES_HI, "stream": True})
        numbers = [data["sequence_number"] for name, data in events(response)]
        self.assertEqual(numbers, list(range(len(numbers))))
        self.assertEqual(events(response)[0][0], "response.created")

    def test_follow_up_by_previous_response_id(self) -> None:
        """A follow-up naming a stored response sends the whole conversation upstream."""
        self.script(answer({"content": "Hello"}), answer({"content": "Fine"}))
        first = ask(self.harness, RESPONSES, RESPONSES_HI).json()
        follow = {"model": "tiny", "input": "How are you?", "previous_response_id": first["id"]}
        self.assertEqual(ask(self.harness, RESPONSES, follow).status, 200)
        second = self.fake.requests_to("POST", CHAT)[1].json["messages"]
        self.assertEqual(
            [(m["role"], m["content"]) for m in second],
            [("user", "Hi"), ("assistant", "Hello"), ("user", "How are you?")],
        )

    def test_unknown_previous_response(self) -> None:
        """An unknown previous_response_id is a 400 that says so; nothing goes upstream."""
        body = {**RESPONSES_HI, "previous_response_id": "resp_unknown"}
        response = post(self.harness, RESPONSES, body).response()
        self.assertEqual(response.status, 400)
        self.assertIn("resp_unknown", response.json()["error"]["message"])
        self.assertEqual(self.fake.requests, [])


class PassThroughFieldTests(DoorTestCase):
    """A field passed to the server as it is goes only where it applies."""

    config = make_config(slots=1)

    def test_llama_field_to_openai_endpoint(self) -> None:
        """llama.cpp's grammar to an openai-kind endpoint is a 400 naming it."""
        tiny = dataclasses.replace(self.config.endpoints[0], kind="openai")
        harness = GatewayHarness(dataclasses.replace(self.config, endpoints=(tiny,)))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
        response = harness.post({**body, "grammar": "root ::= x"}).response()
        self.assertEqual(response.status, 400)
        error = response.json()["error"]
        self.assertEqual(error["code"], "unsupported_parameter")
        self.assertIn("grammar", error["message"])
        self.assertEqual(harness.fake.requests, [])

    def test_openai_field_to_openai_endpoint(self) -> None:
        """An OpenAI field such as seed reaches an openai-kind endpoint as sent."""
        tiny = dataclasses.replace(self.config.endpoints[0], kind="openai")
        harness = GatewayHarness(dataclasses.replace(self.config, endpoints=(tiny,)))
        harness.fake.script("POST", CHAT, answer({"content": "x"}))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "seed": 7}
        connection = harness.post(body)
        harness.advance(1.0)
        self.assertEqual(connection.response().status, 200)
        (sent,) = harness.fake.requests_to("POST", CHAT)
        self.assertEqual(sent.json["seed"], 7)

    def test_field_on_mesh(self) -> None:
        """On model mesh a pass-through field is a 400 naming it; no worker is asked."""
        harness = MeshHarness(mesh_config(TWO))
        response = harness.ask({**ASK, "response_format": {"type": "json_object"}}, 1.0)
        self.assertEqual(response.status, 400)
        self.assertIn("response_format", response.json()["error"]["message"])
        self.assertEqual(sum(harness.served().values()), 0)


IMAGE_URL = "data:image/png;base64,iVBORw0KGgo="
ANTHROPIC_IMAGE = {
    **ANTHROPIC_HI,
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "url", "url": IMAGE_URL}},
            ],
        }
    ],
}


class MediaTests(DoorTestCase):
    """Images go only to an endpoint whose config says it takes them (C{vision})."""

    def test_image_to_endpoint_without_vision(self) -> None:
        """An image to a named endpoint without vision is a 400 naming it, in the door's shape."""
        response = ask(self.harness, MESSAGES, ANTHROPIC_IMAGE)
        self.assertEqual(response.status, 400)
        body = response.json()
        self.assertEqual(body["error"]["type"], "invalid_request_error")
        self.assertIn("'tiny' does not take image input", body["error"]["message"])
        self.assertEqual(self.fake.requests, [])

    def test_image_to_endpoint_with_vision(self) -> None:
        """With vision = true the image goes upstream as an image_url part."""
        tiny = dataclasses.replace(self.config.endpoints[0], vision=True)
        harness = GatewayHarness(dataclasses.replace(self.config, endpoints=(tiny,)))
        harness.fake.script("POST", CHAT, answer({"content": "A dot."}))
        self.assertEqual(ask(harness, MESSAGES, ANTHROPIC_IMAGE).status, 200)
        (sent,) = harness.fake.requests_to("POST", CHAT)
        parts = sent.json["messages"][-1]["content"]
        self.assertIn({"type": "image_url", "image_url": {"url": IMAGE_URL}}, parts)


class MeshThroughADoorTests(SynchronousTestCase):
    """A mesh turn answers through the door the request came in by."""

    def test_anthropic_mesh(self) -> None:
        """Two agreeing workers: the answer is an Anthropic message with the x-moa headers."""
        harness = MeshHarness(mesh_config(TWO))
        harness.script(llama_70b=says("Paris.", 0.5), mistral_7b=says("Paris.", 0.5))
        body = {"model": "mesh", "max_tokens": 100, "messages": ASK["messages"]}
        connection = post(harness, MESSAGES, body)
        harness.advance(1.0)
        response = connection.response()
        self.assertEqual(response.status, 200)
        message = response.json()
        self.assertEqual(message["type"], "message")
        self.assertEqual(message["content"], [{"type": "text", "text": "Paris."}])
        self.assertIn("x-moa-turn", response.headers)

    def test_responses_mesh_stream(self) -> None:
        """Streamed through the Responses door, the mesh's answer ends completed."""
        harness = MeshHarness(mesh_config(TWO))
        harness.script(llama_70b=says("Paris.", 0.5), mistral_7b=says("Paris.", 0.5))
        body = {"model": "mesh", "input": ASK["messages"][-1]["content"], "stream": True}
        connection = post(harness, RESPONSES, body)
        harness.advance(1.0)
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True))
        named = events(response)
        self.assertEqual(named[0][0], "response.created")
        self.assertEqual(named[-1][0], "response.completed")
        done = [data for name, data in named if name == "response.output_text.done"]
        self.assertEqual([data["text"] for data in done], ["Paris."])
