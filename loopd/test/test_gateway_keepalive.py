"""
Tests for keeping a waiting client (issue 24 item 3, L{loopd.gateway.exchange}): during a
10-minute wait before the first token, on a C{task.Clock}-driven gateway, what each front
door's client sees. Coding agents' stream timers count data events, not SSE comments (Codex
CLI gives up after 300 s without one, Qwen Code after 240 s, Claude Code's watchdog after
300 s), so every C{[server] keepalive_ms} a no-op event of the door's API goes out, and the
real SDKs still make the whole answer of the stream.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from loopd.settings import Limits, Server
from loopd.test.support.sdk_streams import anthropic_message, chat_completion, responses_final
from loopd.testing.fake_llama import CHAT, SLOTS, sse_reply
from loopd.testing.gateway import ClientConnection, GatewayHarness, Response, make_config
from loopd.testing.llama_replies import TIMINGS, answer, chunk, slots_reply

#: The shipped waits, so that ten minutes of a busy slot is a wait and not a timeout.
LIMITS = Limits()
#: How long the wait lasts before the first token, in seconds.
WAIT = 600
#: The shipped interval between keep-alive events, in seconds.
KEEPALIVE = Server().keepalive_ms / 1000
USER = {"role": "user", "content": "Hi"}


@dataclasses.dataclass(frozen=True)
class DoorCase:
    """
    How one front door is asked, and how its client tells a data event from a keep-alive.

    @ivar path: the door's route.
    @ivar body: a streamed request.
    @ivar keepalive: whether one event (its name and its data) is a keep-alive.
    @ivar final_text: the answer's text, as the door's SDK accumulates the whole stream.
    """

    path: str
    body: dict[str, Any]
    keepalive: Callable[[str | None, Any], bool]
    final_text: Callable[[bytes], str]


def _chat_keepalive(name: str | None, data: Any) -> bool:
    """A chunk whose first choice has an empty delta and no finish."""
    if not isinstance(data, dict) or not data.get("choices"):
        return False
    choice = data["choices"][0]
    return choice["delta"] == {} and choice["finish_reason"] is None


def _chat_text(raw: bytes) -> str:
    """The content of the openai SDK's accumulated completion."""
    return str(chat_completion(raw).choices[0].message.content)


def _messages_text(raw: bytes) -> str:
    """The text blocks of the anthropic SDK's accumulated message."""
    message = anthropic_message(raw)
    return "".join(block.text for block in message.content if block.type == "text")


def _responses_text(raw: bytes) -> str:
    """The output text of the openai SDK's accumulated response."""
    return str(responses_final(raw).output_text)


DOORS = {
    "chat": DoorCase(
        "/v1/chat/completions",
        {"model": "tiny", "stream": True, "messages": [USER]},
        _chat_keepalive,
        _chat_text,
    ),
    "messages": DoorCase(
        "/v1/messages",
        {"model": "tiny", "stream": True, "max_tokens": 50, "messages": [USER]},
        lambda name, data: name == "message_delta" and data["delta"]["stop_reason"] is None,
        _messages_text,
    ),
    "responses": DoorCase(
        "/v1/responses",
        {"model": "tiny", "stream": True, "input": "Hi"},
        lambda name, data: name == "response.in_progress",
        _responses_text,
    ),
}


def data_events(response: Response) -> list[tuple[str | None, Any]]:
    """Each data event of a stream so far: its C{event:} name (if any) and its JSON."""
    found = []
    for event in response.events():
        name = None
        payload = None
        for line in event.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                payload = line[len("data: ") :]
        if payload is not None and payload != "[DONE]":
            found.append((name, json.loads(payload)))
    return found


class KeepaliveTests(SynchronousTestCase):
    """A ten-minute wait before the first token, through each door."""

    def wait_through(
        self, door: DoorCase, harness: GatewayHarness
    ) -> tuple[ClientConnection, list[float]]:
        """
        Ask C{door} on C{harness} and let the clock run second by second through the wait
        and the answer; the connection, and when each data event arrived.
        """
        connection = harness.connect()
        body = json.dumps(door.body).encode()
        connection.request("POST", door.path, body, ["Content-Type: application/json"])
        arrivals: list[float] = []
        seen = 0
        for second in range(1, 2 * WAIT):
            harness.advance(1)
            so_far = connection.responses()
            events = data_events(so_far[0]) if so_far else []
            arrivals += [float(second)] * (len(events) - seen)
            seen = len(events)
            if so_far and so_far[0].complete:
                break
        return connection, arrivals

    def assert_kept(self, name: str, harness: GatewayHarness) -> None:
        """
        Through door C{name}: the stream's headers by the first keep-alive, a data event at
        least every C{keepalive_ms} all through the ten-minute wait, about one keep-alive
        per interval, and the SDK's accumulation of the whole stream the model's answer.
        """
        door = DOORS[name]
        connection, arrivals = self.wait_through(door, harness)
        response = connection.response()
        self.assertEqual((response.status, response.complete), (200, True))
        self.assertEqual(response.headers["content-type"], "text/event-stream")
        waited = [0.0, *(second for second in arrivals if second <= WAIT), float(WAIT)]
        gaps = [later - earlier for earlier, later in zip(waited, waited[1:], strict=False)]
        self.assertLessEqual(max(gaps), KEEPALIVE, gaps)
        kept = [event for event in data_events(response) if door.keepalive(*event)]
        self.assertIn(len(kept), range(int(WAIT // KEEPALIVE) - 1, int(WAIT // KEEPALIVE) + 2))
        self.assertEqual(door.final_text(response.body), "Hello")

    def slot_wait(self) -> GatewayHarness:
        """A server whose slot stays busy ten minutes, then answers C{Hello} (no leases)."""
        harness = GatewayHarness(make_config(limits=LIMITS))
        harness.fake.set_default("GET", SLOTS, slots_reply(True))
        reply = answer({"content": "Hello"}, delay_s=0.2)
        harness.fake.script("POST", CHAT, dataclasses.replace(reply, headers_delay=WAIT))
        return harness

    def long_prompt(self) -> GatewayHarness:
        """
        A server that starts at once but processes the prompt for ten minutes, one progress
        chunk a minute (batches slower than a default liveness window), then answers.
        """
        harness = GatewayHarness(
            make_config(limits=dataclasses.replace(LIMITS, liveness_ms=90_000))
        )
        harness.fake.set_default("GET", SLOTS, slots_reply(True))
        batches = [chunk(progress=(10_000, 0, 1_000 * n)) for n in range(1, 10)]
        pieces = [*batches, chunk({"content": "Hello"}), chunk({}, "stop", timings=TIMINGS)]
        harness.fake.script("POST", CHAT, sse_reply(pieces, delay_s=WAIT / 10))
        return harness

    def test_chat_slot_wait(self) -> None:
        """Chat completions: empty-delta chunks through a busy slot's ten minutes."""
        self.assert_kept("chat", self.slot_wait())

    def test_messages_slot_wait(self) -> None:
        """Messages: C{message_start}, then C{message_delta}s that change nothing."""
        self.assert_kept("messages", self.slot_wait())

    def test_responses_slot_wait(self) -> None:
        """Responses: C{response.in_progress} again and again, numbered in sequence."""
        self.assert_kept("responses", self.slot_wait())

    def test_long_prompt(self) -> None:
        """
        Each door through a ten-minute prompt whose progress comes once a minute: the
        progress comments alone would leave an agent six minutes without a data event.
        """
        for name in DOORS:
            with self.subTest(name):
                self.assert_kept(name, self.long_prompt())

    def test_none_once_tokens_flow(self) -> None:
        """An answer that starts at once gets no keep-alive, however long it streams."""
        harness = GatewayHarness(make_config(limits=LIMITS))
        pieces = [chunk({"content": "a"}) for _ in range(40)]
        harness.fake.script(
            "POST", CHAT, sse_reply([*pieces, chunk({}, "stop", timings=TIMINGS)], delay_s=1)
        )
        connection, _ = self.wait_through(DOORS["chat"], harness)
        kept = [event for event in data_events(connection.response()) if _chat_keepalive(*event)]
        # The finish chunk has an empty delta too, but a finish reason: no keep-alive.
        self.assertEqual(kept, [])
