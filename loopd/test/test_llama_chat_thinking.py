"""
Tests for the thinking cap of L{loopd.llama.chat}: at C{thinking.cap} reasoning tokens the
call asks the server to end the reasoning on a second connection and reads on; C{overrun}
more reasoning tokens, or a control call without C{success: true}, is L{ThinkingOverrun}.
Also here, to keep each module under 500 lines: cancellation, which must close the control
connection too, and endpoints of kind C{openai}, which have neither polls nor control.

Same set-up as L{loopd.test.test_llama_chat}: the fake llama-server in memory, on a clock.
The streams are real transcripts: C{reasoning-end.sse} reasons up to C{predicted_n} 13 and
then answers; C{error.sse} reasons until the server fails, far past any cap used here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError

from loopd.config import Thinking
from loopd.errors import ThinkingOverrun, WaitTimeout
from loopd.llama.request import LLAMA_ONLY_FIELDS
from loopd.llama.types import ChatRequest, Content, Reasoning, ThinkingCapped, User, Waiting
from loopd.test.test_llama_chat import (
    ANSWER,
    HELLO,
    NEVER,
    PATH,
    THINKING_EVENTS,
    UNANSWERED,
    ChatTestCase,
    Harness,
    at,
    make_config,
    stream,
    transcript_chunks,
    transcript_events,
)
from loopd.testing.fake_llama import CHAT, CONTROL, NOT_FOUND, SLOTS, Reply, error_reply
from loopd.testing.llama_replies import control_reply, slots_reply

#: The last reasoning token count of reasoning-end.sse; the answer follows.
LAST_REASONING = 13
#: The time between two events of a stream.
STEP = 0.01
REASONING_END = transcript_events("reasoning-end.sse")
#: When reasoning-end.sse, sent one event every STEP, has been sent whole.
ANSWERED = STEP * len(REASONING_END)
#: A control call that is never answered.
NO_ANSWER = Reply(headers_delay=NEVER)


def capped(cap: int, overrun: int = 100, model: str | None = "tiny", **request: Any) -> Harness:
    """A harness whose config has this cap and overrun, for a request with C{request} set."""
    config = make_config(thinking=Thinking(cap=cap, overrun=overrun), model=model)
    return Harness(config, ChatRequest(slot=0, messages=(User("Hi"),), **request))


def chunk_time(predicted_n: int) -> float:
    """
    When the reasoning chunk with this C{predicted_n} arrives in a transcript sent one event
    every L{STEP}: chunks 0 and 1 are progress, chunk C{n + 1} has C{predicted_n} C{n}.
    """
    return STEP * (predicted_n + 2)


class CapTests(ChatTestCase):
    """Reaching the cap sends reasoning_end, reports ThinkingCapped and reads on."""

    def test_cap_sends_control_and_reads_on(self) -> None:
        """At the cap: the control on a second connection, ThinkingCapped, a whole answer."""
        h = capped(6)
        h.fake.set_default("POST", CONTROL, control_reply(True))
        d = h.run(stream(REASONING_END, STEP))
        completion = self.assert_answered(h, d, ANSWERED)
        self.assertEqual(
            (completion.thinking_capped, completion.reasoning_tokens, completion.content),
            (True, LAST_REASONING, ANSWER),
        )
        [control] = h.fake.requests_to("POST", CONTROL)
        chunk_id = transcript_chunks("reasoning-end.sse")[0]["id"]
        self.assertEqual(control.json, {"id": chunk_id, "action": "reasoning_end", "model": "tiny"})
        self.assertNotEqual(control.connection.number, h.chat_connection().number)
        self.assertEqual(at(control.received_at), at(chunk_time(6)))
        self.assertEqual(h.times(ThinkingCapped), [at(chunk_time(6))])
        events = h.of()
        index = events.index(ThinkingCapped(6))
        around = [Reasoning(" this"), ThinkingCapped(6), Reasoning("...")]
        self.assertEqual(events[index - 1 : index + 2], around)
        self.assertEqual(h.of(Content), [Content(text) for text in HELLO])

    def test_control_without_model(self) -> None:
        """An endpoint without a model id sends only id and action."""
        h = capped(3, model=None)
        h.fake.set_default("POST", CONTROL, control_reply(True))
        d = h.run(stream(REASONING_END, STEP))
        self.assertTrue(self.assert_answered(h, d, ANSWERED).thinking_capped)
        [control] = h.fake.requests_to("POST", CONTROL)
        self.assertEqual(set(control.json), {"id", "action"})
        self.assertEqual(h.of(ThinkingCapped), [ThinkingCapped(3)])

    def test_control_pending_at_the_end(self) -> None:
        """A control still unanswered when the answer ends is closed with the call."""
        h = capped(6)
        h.fake.set_default("POST", CONTROL, NO_ANSWER)
        d = h.run(stream(REASONING_END, STEP))
        self.assertTrue(self.assert_answered(h, d, ANSWERED).thinking_capped)
        [control] = h.fake.requests_to("POST", CONTROL)
        self.assert_closed_by_client(control.connection, ANSWERED)

    @given(st.integers(min_value=1, max_value=16), st.integers(min_value=0, max_value=16))
    def test_cap_and_overrun_any(self, cap: int, overrun: int) -> None:
        """For any cap and overrun: capped iff reached, overrun iff reasoning went on enough."""
        h = capped(cap, overrun)
        h.fake.set_default("POST", CONTROL, control_reply(True))
        d = h.run(stream(REASONING_END, STEP))
        reached = cap <= LAST_REASONING
        # The overrun is judged from the chunk after the cap on, so an overrun of 0 acts as 1.
        limit = cap + max(overrun, 1)
        if reached and limit <= LAST_REASONING:
            self.assert_failed(h, d, ThinkingOverrun, chunk_time(limit))
        else:
            self.assertEqual(self.assert_answered(h, d, ANSWERED).thinking_capped, reached)
        self.assertEqual(h.of(ThinkingCapped), [ThinkingCapped(cap)] if reached else [])
        self.assertEqual(len(h.fake.requests_to("POST", CONTROL)), int(reached))


class NoCapTests(ChatTestCase):
    """No control call when thinking is off or the answer starts before the cap."""

    def test_thinking_off(self) -> None:
        """thinking=False: no reasoning_control in the body and never a control call."""
        h = capped(3, overrun=1, thinking=False)
        d = h.run(stream(REASONING_END, STEP))
        self.assertFalse(self.assert_answered(h, d, ANSWERED).thinking_capped)
        self.assertEqual((h.fake.requests_to("POST", CONTROL), h.of(ThinkingCapped)), ([], []))
        [request] = h.fake.requests_to("POST", CHAT)
        self.assertNotIn("reasoning_control", request.json)
        self.assertEqual(request.json["chat_template_kwargs"], {"enable_thinking": False})

    def test_content_before_cap(self) -> None:
        """thinking.sse answers at 7 reasoning tokens: a cap of 8 is never reached."""
        h = capped(8, overrun=1)
        events = transcript_events("thinking.sse")
        d = h.run(stream(events, STEP))
        completion = self.assert_answered(h, d, STEP * len(events))
        self.assertEqual((completion.thinking_capped, completion.reasoning_tokens), (False, 7))
        self.assertEqual((h.fake.requests_to("POST", CONTROL), h.of(ThinkingCapped)), ([], []))


class OverrunTests(ChatTestCase):
    """ThinkingOverrun: reasoning that goes on, or a control call that does not succeed."""

    def test_reasoning_goes_on(self) -> None:
        """overrun more tokens after the cap: ThinkingOverrun and the stream closed then."""
        h = capped(10, overrun=20)
        h.fake.set_default("POST", CONTROL, control_reply(True))
        d = h.run(stream(transcript_events("error.sse"), STEP))
        self.assert_failed(h, d, ThinkingOverrun, chunk_time(30))
        self.assertEqual(h.of(ThinkingCapped), [ThinkingCapped(10)])
        self.assertEqual(len(h.of(Reasoning)), 29)
        self.assert_closed_by_client(h.chat_connection(), chunk_time(30))

    def test_control_refused(self) -> None:
        """A control reply with success false: ThinkingOverrun when it arrives."""
        h = capped(6)
        refusal = dataclasses.replace(control_reply(False), headers_delay=0.015)
        h.fake.set_default("POST", CONTROL, refusal)
        d = h.run(stream(REASONING_END, STEP))
        error = self.assert_failed(h, d, ThinkingOverrun, chunk_time(6) + 0.015)
        self.assertIn("no active completion for this id", str(error))
        self.assert_closed_by_client(h.chat_connection(), chunk_time(6) + 0.015)

    def test_control_fails(self) -> None:
        """A control call answered 404 or 400, cut, or refused: ThinkingOverrun at once."""
        bad_request = error_reply(400, "invalid_request_error", "missing completion id")
        cut = dataclasses.replace(control_reply(True), end="cut")
        for reply in [NOT_FOUND, bad_request, cut, None]:
            h = capped(6)
            d = h.start(stream(REASONING_END, STEP))
            if reply is None:
                h.net.stop_listening(PATH, stale=True)
            else:
                h.fake.set_default("POST", CONTROL, reply)
            h.run_to_end()
            self.assert_failed(h, d, ThinkingOverrun, chunk_time(6))
            self.assertEqual(h.of(ThinkingCapped), [ThinkingCapped(6)])
            self.assert_closed_by_client(h.chat_connection(), chunk_time(6))


class CancelTests(ChatTestCase):
    """Cancelling the Deferred closes every connection of the call at once."""

    def test_cancel_before_headers(self) -> None:
        """Cancelled while waiting, a /slots poll in flight: both connections closed."""
        h = Harness()
        d = h.start(UNANSWERED, dataclasses.replace(slots_reply(True), headers_delay=NEVER))
        h.net.run_to(0.07)
        d.cancel()
        self.assert_failed(h, d, CancelledError, 0.07)
        [poll] = h.fake.requests_to("GET", SLOTS)
        self.assert_closed_by_client(h.chat_connection(), 0.07)
        self.assert_closed_by_client(poll.connection, 0.07)

    def test_cancel_mid_stream(self) -> None:
        """Cancelled mid-stream: CancelledError, the stream closed then, no more events."""
        h = Harness()
        d = h.start(stream(transcript_events("thinking.sse"), 0.03))
        h.net.run_to(0.1)
        d.cancel()
        self.assert_failed(h, d, CancelledError, 0.1)
        h.net.run_to(1)
        self.assertEqual(h.of(), THINKING_EVENTS[:2])
        self.assert_closed_by_client(h.chat_connection(), 0.1)

    def test_cancel_with_control_pending(self) -> None:
        """Cancelled while the control call is unanswered: both connections closed."""
        h = capped(6)
        h.fake.set_default("POST", CONTROL, NO_ANSWER)
        d = h.start(stream(REASONING_END, STEP))
        h.net.run_to(0.1)
        d.cancel()
        self.assert_failed(h, d, CancelledError, 0.1)
        [control] = h.fake.requests_to("POST", CONTROL)
        self.assert_closed_by_client(h.chat_connection(), 0.1)
        self.assert_closed_by_client(control.connection, 0.1)


class OpenAITests(ChatTestCase):
    """An endpoint of kind openai: a plain first-byte timeout, no /slots, no control."""

    def test_first_byte_timeout(self) -> None:
        """No first byte within busy_wait_ms: WaitTimeout, with no /slots poll at all."""
        h = Harness(make_config(kind="openai"))
        d = h.run(UNANSWERED)
        self.assert_failed(h, d, WaitTimeout, 0.2)
        self.assertEqual((h.of(), [r.path for r in h.fake.requests]), ([], [CHAT]))
        self.assert_closed_by_client(h.chat_connection(), 0.2)

    def test_late_answer(self) -> None:
        """An answer after poll_ms but within busy_wait_ms: a completion, still no poll."""
        h = Harness(make_config(kind="openai"))
        events = transcript_events("plain.sse")
        d = h.run(stream(events, STEP, headers_delay=0.15))
        self.assertEqual(self.assert_answered(h, d, 0.15 + STEP * len(events)).content, ANSWER)
        self.assertEqual(([r.path for r in h.fake.requests], h.of(Waiting)), ([CHAT], []))

    def test_no_control_no_llama_fields(self) -> None:
        """Reasoning past the cap: no control call, no llama.cpp-only field in the body."""
        h = Harness(make_config(kind="openai", thinking=Thinking(cap=3, overrun=1)))
        h.fake.set_default("POST", CONTROL, control_reply(True))
        d = h.run(stream(REASONING_END, STEP))
        completion = self.assert_answered(h, d, ANSWERED)
        self.assertEqual((completion.content, completion.thinking_capped), (ANSWER, False))
        self.assertEqual([r.path for r in h.fake.requests], [CHAT])
        self.assertEqual(h.of(Waiting, ThinkingCapped), [])
        body = h.fake.requests[0].json
        self.assertEqual(set(body) & (LLAMA_ONLY_FIELDS | {"reasoning_control"}), set())
        self.assertEqual((body["stream"], body["max_tokens"], body["model"]), (True, 300, "tiny"))
