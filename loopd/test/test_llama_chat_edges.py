"""
Edge cases of L{loopd.llama.chat} that tests found: a limit judged on float clock sums, an
error body that stops arriving, a late /slots answer after the headers; a 429's Retry-After.
"""

from __future__ import annotations

import dataclasses

from loopd.errors import Http, Stalled, WaitTimeout
from loopd.llama.types import Waiting
from loopd.test.test_llama_chat import (
    ANSWER,
    UNANSWERED,
    ChatTestCase,
    Harness,
    stream,
    transcript_events,
)
from loopd.testing.fake_llama import JSON_HEADERS, LOADING, Piece, Reply, error_reply, json_reply
from loopd.testing.llama_replies import slots_reply


class ChatEdgeTests(ChatTestCase):
    """
    Behaviour that once went wrong.
    """

    def test_limit_judged_exactly(self) -> None:
        """Loading twice, then busy from 0.15: WaitTimeout at 0.35, not a poll later."""
        h = Harness()
        h.fake.script("GET", "/slots", LOADING, LOADING)
        d = h.run(UNANSWERED, slots_reply(True))
        self.assert_failed(h, d, WaitTimeout, 0.35)
        self.assertEqual(h.of(Waiting).count(Waiting(slot_busy=True)), 5)

    def test_error_body_silence_stalls(self) -> None:
        """A 503 whose body stops after its first bytes: Stalled liveness_ms later, closed."""
        h = Harness()
        reply = Reply(
            503, JSON_HEADERS, [Piece(0.02, b'{"error":')], content_length=100, end="silence"
        )
        d = h.run(reply)
        self.assert_failed(h, d, Stalled, 0.1)
        self.assert_closed_by_client(h.chat_connection(), 0.1)

    def test_late_bad_slots_answer_after_headers(self) -> None:
        """A malformed /slots answer arriving after the headers does not end the stream."""
        h = Harness()
        late = dataclasses.replace(json_reply(200, {"not": "a list"}), headers_delay=0.03)
        events = transcript_events("plain.sse")
        d = h.run(stream(events, 0.01, headers_delay=0.06), late)
        self.assertEqual(self.assert_answered(h, d, 0.06 + 0.01 * len(events)).content, ANSWER)

    def test_http_429_retry_after(self) -> None:
        """HTTP 429 with Retry-After: Http 429 carrying the seconds; none without the header."""
        for header, expected in (((("Retry-After", "2"),), 2.0), ((), None)):
            h = Harness()
            limited = error_reply(429, "rate_limit_error", "slow down")
            d = h.start(dataclasses.replace(limited, headers=header))
            error = self.assert_failed(h, d, Http, 0)
            self.assertEqual((error.status, error.retry_after), (429, expected))
