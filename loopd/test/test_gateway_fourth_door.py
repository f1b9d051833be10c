"""
A fourth API is a reader, a writer and an entry in the table of doors
(L{loopd.gateway.doors.table}), with no edit to the exchange: a small door for a
newline-delimited JSON API shaped like Ollama's C{/api/chat}, added to a gateway's table,
answers through the same exchange as the three real doors, in its own shapes and its own
stream's content type.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.door import MESH_MODEL, Answer, Header
from loopd.gateway.doors.fields import Fields, decode_body
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest, read_session
from loopd.llama.types import ChatEvent, ChatMessage, Completion, Content, System, User
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import GatewayHarness
from loopd.testing.llama_replies import answer

PATH = b"/api/chat"
_FIELDS = Fields("invalid_request", "invalid_request")


def _line(payload: object) -> bytes:
    """One NDJSON line."""
    return json.dumps(payload).encode() + b"\n"


class _NdjsonAnswer:
    """The writer: one line per piece of text, a last line with C{done: true}."""

    def __init__(self, model: str) -> None:
        self._model = model

    def opening(self) -> bytes:
        return b""

    def during(self, event: ChatEvent) -> bytes:
        if isinstance(event, Content) and event.text:
            message = {"role": "assistant", "content": event.text}
            return _line({"model": self._model, "message": message, "done": False})
        return b""

    def keepalive(self) -> bytes:
        return b""

    def closing(self, completion: Completion) -> bytes:
        return _line({"model": self._model, "done": True, "done_reason": "stop"})

    def stream_error(self, error: GatewayError) -> bytes:
        return _line({"error": error.message})

    def body(self, completion: Completion) -> object:
        message = {"role": "assistant", "content": completion.content or ""}
        return {"model": self._model, "message": message, "done": True}

    def error(self, error: GatewayError) -> tuple[int, object]:
        return error.status, {"error": error.message}


class _NdjsonDoor:
    """The reader and the door: C{model}, C{messages} (system and user text), C{stream}."""

    name = "ndjson"
    stream_type = b"application/x-ndjson"

    def read(self, body: bytes, header: Header, anonymous: Callable[[], str]) -> GatewayRequest:
        document = decode_body(body)
        messages: list[ChatMessage] = []
        for i, message in enumerate(document.get("messages") or ()):
            item = _FIELDS.mapping(message, f"messages[{i}]")
            text = _FIELDS.string(item.get("content"), f"messages[{i}].content")
            messages.append(System(text) if item.get("role") == "system" else User(text))
        request = GatewayRequest(
            model=document.get("model"),
            messages=tuple(messages),
            stream=_FIELDS.flag(document.get("stream"), "stream", True),
        )
        return replace(request, session=read_session(header, anonymous))

    def answer(self, request: GatewayRequest, model: str, created: int) -> Answer:
        return _NdjsonAnswer(model)

    def mesh_answer(self, request: GatewayRequest, answer_id: str, created: int) -> Answer:
        return self.answer(request, MESH_MODEL, created)

    def error(self, error: GatewayError) -> tuple[int, object]:
        return error.status, {"error": error.message}


class FourthDoorTests(SynchronousTestCase):
    """A door added to the table answers through the one exchange."""

    def setUp(self) -> None:
        """A gateway whose table has the NDJSON door at C{/api/chat}."""
        self.harness = GatewayHarness()
        gateway = self.harness.gateway
        doors = gateway.doors
        gateway.doors = replace(doors, by_path=(*doors.by_path, (PATH, _NdjsonDoor())))
        self.harness.site = gateway.site()
        self.harness.fake.script("POST", CHAT, answer({"content": "Hel"}, {"content": "lo"}))

    def post(self, document: dict[str, Any]) -> Any:
        """POST C{document} to the new door; its one response."""
        connection = self.harness.connect()
        connection.request("POST", PATH.decode(), json.dumps(document).encode())
        self.harness.advance(1)
        return connection.response()

    def test_stream(self) -> None:
        """A streamed answer is the door's lines, under its own content type."""
        response = self.post({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        self.assertEqual(response.status, 200)
        self.assertEqual(response.headers["content-type"], "application/x-ndjson")
        lines = [json.loads(line) for line in response.body.splitlines()]
        self.assertEqual(
            [(line.get("message", {}).get("content"), line["done"]) for line in lines],
            [("Hel", False), ("lo", False), (None, True)],
        )
        (sent,) = self.harness.fake.requests_to("POST", CHAT)
        self.assertEqual(sent.json["messages"], [{"role": "user", "content": "Hi"}])

    def test_body(self) -> None:
        """An answer not streamed is the door's JSON body."""
        response = self.post(
            {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "Hi"}]}
        )
        self.assertEqual(
            response.json(),
            {"model": "tiny", "message": {"role": "assistant", "content": "Hello"}, "done": True},
        )

    def test_refusal_in_its_shape(self) -> None:
        """The door's reader's refusal, and the gateway's own, are in the door's shape."""
        bad = self.post({"model": "tiny", "messages": [{"role": "user", "content": 3}]})
        self.assertEqual((bad.status, bad.json()), (400, {"error": bad.json()["error"]}))
        self.assertIn("messages[0].content", bad.json()["error"])
        unknown = self.post({"model": "nowhere", "messages": [{"content": "Hi"}]})
        self.assertEqual(unknown.status, 404)
        self.assertEqual(list(unknown.json()), ["error"])
