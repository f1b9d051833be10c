"""
A Responses door to read bodies and write answers with, for the tests of its reader and its
writer (L{loopd.gateway.doors.responses_read}, L{loopd.gateway.doors.responses}): a door
over a store on a fake clock (L{DoorCase}), a finished completion, and a stream's events
checked against the openai SDK's own event types (L{events_of}).
"""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.doors.responses import ResponsesDoor
from loopd.gateway.doors.responses_store import ResponseStore
from loopd.gateway.errors import GatewayError
from loopd.gateway.request import GatewayRequest
from loopd.llama.types import Completion, FinishReason, Timings, ToolCall
from loopd.sse import SSEComment, SSEDecoder, SSEEvent

__all__ = ["DoorCase", "completion", "events_of"]

_EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
_NO_HEADERS: dict[bytes, bytes] = {}


def completion(
    content: str | None = "hello",
    reasoning: str | None = None,
    calls: tuple[ToolCall, ...] = (),
    finish: FinishReason = FinishReason.STOP,
) -> Completion:
    """A finished completion with 3 cached, 4 evaluated and 5 generated tokens."""
    return Completion("c", content, reasoning, calls, finish, Timings(3, 4, 5), 2)


class DoorCase(SynchronousTestCase):
    """A door over a store on a fake clock."""

    def setUp(self) -> None:
        """A fresh store and door."""
        self.clock = Clock()
        self.store = ResponseStore(self.clock.seconds)
        self.door = ResponsesDoor(self.store)

    def read(
        self, body: dict[str, Any] | bytes, headers: dict[bytes, bytes] = _NO_HEADERS
    ) -> GatewayRequest:
        """Read C{body} (a dict is encoded) with C{headers}."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.door.read(raw, headers.get, lambda: "conn-1")

    def refused(self, body: dict[str, Any] | bytes, code: str, *fragments: str) -> GatewayError:
        """Assert C{body} is a 400 with C{code} whose message has every fragment."""
        error: GatewayError = self.assertRaises(GatewayError, self.read, body)
        self.assertEqual((error.status, error.code), (400, code), error.message)
        for fragment in fragments:
            self.assertIn(fragment, error.message)
        return error


def events_of(data: bytes) -> list[dict[str, Any]]:
    """The events of a stream, each checked: data type = event name, SDK-valid."""
    found = []
    for item in SSEDecoder().feed(data):
        if isinstance(item, SSEComment):
            continue
        assert isinstance(item, SSEEvent)
        payload = json.loads(item.data)
        assert payload["type"] == item.event, (payload["type"], item.event)
        _EVENTS.validate_python(payload)
        found.append(payload)
    return found
