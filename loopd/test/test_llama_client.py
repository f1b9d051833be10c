"""
Tests for L{loopd.llama.client.Client}, in memory on a clock: a scripted fake llama-server
on a L{MemoryNet}, every limit between 50 and 200 ms, no sleeping.

Chats pass the slot gate (one in flight per slot, a bounded queue, cancellation), retries go
back through it, and C{props}, C{slots} and C{tokenize} read the server's answers. The facade
test checks that C{loopd.llama} exports the seed's names.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

import loopd.llama
from loopd.errors import ProxyRefused
from loopd.llama import (
    Busy,
    ChatEvent,
    ChatRequest,
    Client,
    Completion,
    Connect,
    Content,
    FinishReason,
    Http,
    InferError,
    Protocol,
    Queued,
    Reasoning,
    Retrying,
    SlotGate,
    SlotState,
    Stalled,
    StreamClosedEarly,
    User,
)
from loopd.settings import Config, Endpoint, Limits, Retry
from loopd.testing.fake_llama import (
    CHAT,
    LOADING,
    PROPS,
    SLOTS,
    TOKENIZE,
    End,
    FakeLlama,
    Piece,
    RecordedRequest,
    Reply,
    error_reply,
    json_reply,
    sse_reply,
)
from loopd.testing.llama_replies import props_reply, slots_reply, template_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

#: The route that renders a chat body with the server's template.
APPLY_TEMPLATE = "/apply-template"
#: Where the fake listens; MemoryNet never touches the file system.
PATH = "/tmp/ld-memory/llama.sock"
#: A path nobody listens on.
NOWHERE = "/tmp/ld-memory/nobody.sock"

LIMITS = Limits(
    poll_ms=100,
    busy_wait_ms=200,
    load_wait_ms=200,
    idle_grace_ms=150,
    liveness_ms=100,
    queue_depth=2,
)
#: Waits of 50, 100 and 200 ms before retries 1, 2 and 3, with the default 25 % jitter.
RETRY = Retry(attempts=4, backoff_ms=(50, 100, 200), jitter=0.25, total_ms=300_000)


def make_config(socket: str = PATH) -> Config:
    """A config with one llama-server endpoint at C{socket} and the short limits above."""
    endpoint = Endpoint(name="tiny", socket=socket, model="tiny")
    return Config(endpoints=(endpoint,), limits=LIMITS, retry=RETRY)


def chunk(request_id: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """One streamed chat-completion chunk as llama-server sends it."""
    choice = {"finish_reason": finish, "index": 0, "delta": delta}
    out: dict[str, Any] = {"choices": [choice], "id": request_id, "object": "chat.completion.chunk"}
    if finish is not None:
        out["timings"] = {"cache_n": 3, "prompt_n": 10, "predicted_n": 2}
    return out


def answer(text: str, delay_s: float = 0.0, request_id: str = "chatcmpl-1") -> Reply:
    """A whole streamed answer: C{text} as content, then the finish, each after C{delay_s}."""
    return sse_reply(
        [chunk(request_id, {"content": text}), chunk(request_id, {}, "stop")], delay_s=delay_s
    )


def unfinished(end: End = "close") -> Reply:
    """
    A stream that delivers nothing (a role chunk) and no finish_reason, ending in C{end}.
    """
    return sse_reply([chunk("chatcmpl-x", {"role": "assistant", "content": None})], end=end)


def counted(
    delta: dict[str, Any], generated: int, request_id: str = "chatcmpl-a"
) -> dict[str, Any]:
    """A chunk of one token's piece, with llama-server's per-token timings."""
    sent = chunk(request_id, delta)
    sent["timings"] = {"cache_n": 0, "prompt_n": 12, "predicted_n": generated}
    return sent


def cut_after(*deltas: dict[str, Any], end: End = "cut") -> Reply:
    """
    A stream of the role chunk and one counted chunk per delta (the role's token is the
    first), then an end with no finish_reason: a server killed mid-answer.
    """
    role = chunk("chatcmpl-a", {"role": "assistant", "content": None})
    pieces = [counted(d, n) for n, d in enumerate(deltas, start=2)]
    return sse_reply([role, *pieces], end=end)


def finishing(*deltas: dict[str, Any], timings: dict[str, Any]) -> Reply:
    """A stream of C{deltas} then the finish chunk with C{timings}."""
    last = chunk("chatcmpl-b", {}, "stop")
    last["timings"] = timings
    return sse_reply([*(chunk("chatcmpl-b", d) for d in deltas), last])


def ms(seconds: float | None) -> int:
    """A clock time in whole milliseconds, free of float rounding."""
    assert seconds is not None
    return round(seconds * 1000)


def request(slot: int = 0, text: str = "Hi") -> ChatRequest:
    """A one-message chat request pinned to C{slot}."""
    return ChatRequest(slot=slot, messages=(User(text),))


class Call:
    """One chat started on the client: its Deferred, its events and when it ended."""

    def __init__(self, reactor: MemoryReactorClock, start: Callable[..., Any]) -> None:
        self.events: list[ChatEvent] = []
        self.ended_at: float | None = None
        self.deferred: Deferred[Completion] = start(self.events.append)

        def ended(result: object) -> object:
            self.ended_at = reactor.seconds()
            return result

        self.deferred.addBoth(ended)

    @property
    def queued(self) -> list[int]:
        """The C{ahead} of every Queued event, in order."""
        return [e.ahead for e in self.events if isinstance(e, Queued)]

    @property
    def retries(self) -> list[Retrying]:
        """The Retrying events, in order."""
        return [e for e in self.events if isinstance(e, Retrying)]


class ClientTestCase(SynchronousTestCase):
    """A client talking to a scripted fake llama-server in memory."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)
        config = make_config()
        # One client, so plain chats and retries share its gate; 0.5 makes the jitter zero.
        self.client = Client(self.reactor, config, config.endpoints[0], random=lambda: 0.5)

    def chat(self, slot: int = 0, text: str = "Hi") -> Call:
        """Start a chat through the client's gate."""
        return Call(self.reactor, lambda sink: self.client.chat(request(slot, text), sink))

    def chat_with_retry(self, slot: int = 0, text: str = "Hi") -> Call:
        """Start a chat with retries; the jitter source answers 0.5, so no jitter."""
        retry = self.client.chat_with_retry
        return Call(self.reactor, lambda sink: retry(request(slot, text), sink))

    def chats(self) -> list[RecordedRequest]:
        """The chat requests the fake has received, in order."""
        return self.fake.requests_to("POST", CHAT)

    def gate(self) -> SlotGate:
        """The client's gate: by default a SlotGate of limits.queue_depth."""
        gate = self.client.gate
        assert isinstance(gate, SlotGate)
        return gate

    def assert_quiet(self) -> None:
        """No timer is left and every connection is closed."""
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.net.open_connections(), [])


class GateTests(ClientTestCase):
    """Every chat passes the slot gate: one in flight per slot."""

    def test_same_slot_in_turn(self) -> None:
        """A second chat on a busy slot hears Queued(ahead=1) and is sent only after the first."""
        self.fake.script("POST", CHAT, answer("one", delay_s=0.05), answer("two"))
        first, second = self.chat(text="first"), self.chat(text="second")
        self.assertEqual((first.queued, second.queued), ([], [1]))
        self.net.run_to(0.149)
        self.assertEqual([r.json["messages"][0]["content"] for r in self.chats()], ["first"])
        self.assertNoResult(second.deferred)
        self.net.advance(1)
        self.assertEqual(self.successResultOf(first.deferred).content, "one")
        self.assertEqual(self.successResultOf(second.deferred).content, "two")
        # Content at 50 ms, the finish at 100 ms, [DONE] and the close at 150 ms.
        self.assertEqual(ms(first.ended_at), 150)
        _, later = self.chats()
        self.assertEqual(later.json["messages"][0]["content"], "second")
        self.assertEqual(later.received_at, first.ended_at)
        self.assertLessEqual(ms(self.fake.connections[0].closed_at), ms(later.connection.opened_at))
        self.assert_quiet()

    def test_different_slots_together(self) -> None:
        """Chats on different slots go at once and run side by side."""
        self.fake.set_default(
            "POST", CHAT, lambda r, fake: answer(f"slot {r.json['id_slot']}", delay_s=0.05)
        )
        calls = [self.chat(slot=0), self.chat(slot=1)]
        self.net.pump()
        sent = [(r.json["id_slot"], ms(r.received_at)) for r in self.chats()]
        self.assertEqual(sent, [(0, 0), (1, 0)])
        self.net.advance(1)
        results = [self.successResultOf(c.deferred).content for c in calls]
        self.assertEqual(results, ["slot 0", "slot 1"])
        self.assertEqual([(c.queued, ms(c.ended_at)) for c in calls], [([], 150), ([], 150)])
        self.assert_quiet()

    def test_full_queue_busy(self) -> None:
        """With queue_depth chats waiting, one more fails with Busy at once."""
        self.fake.set_default("POST", CHAT, answer("ok", delay_s=0.05))
        running = self.chat()
        waiting = [self.chat(), self.chat()]
        refused = self.chat()
        failure = self.failureResultOf(refused.deferred, Busy)
        self.assertEqual(self.gate().waiting(0), LIMITS.queue_depth)
        self.assertIsInstance(failure.value, InferError)
        self.assertEqual([w.queued for w in waiting], [[1], [2]])
        self.assertEqual(refused.events, [])
        self.net.advance(1)
        self.assertEqual(len(self.chats()), 3)
        for call in [running, *waiting]:
            self.assertEqual(self.successResultOf(call.deferred).content, "ok")
        self.assert_quiet()

    def test_cancel_waiting(self) -> None:
        """A cancelled waiter leaves the queue: the one behind moves up and still runs."""
        self.fake.set_default("POST", CHAT, answer("ok", delay_s=0.05))
        running, cancelled, behind = self.chat(), self.chat(text="never"), self.chat(text="later")
        self.assertEqual(behind.queued, [2])
        cancelled.deferred.cancel()
        self.failureResultOf(cancelled.deferred, CancelledError)
        self.assertEqual(behind.queued, [2, 1])
        self.assertEqual(self.gate().waiting(0), 1)
        self.net.advance(1)
        self.successResultOf(running.deferred)
        self.assertEqual(self.successResultOf(behind.deferred).content, "ok")
        sent = [r.json["messages"][0]["content"] for r in self.chats()]
        self.assertEqual(sent, ["Hi", "later"])
        self.assert_quiet()

    def test_cancel_running(self) -> None:
        """Cancelling a running chat closes its connection and the next chat goes."""
        self.fake.script("POST", CHAT, unfinished("silence"), answer("next"))
        running, waiting = self.chat(), self.chat()
        self.net.run_to(0.05)
        self.assertTrue(self.fake.connections[0].open)
        running.deferred.cancel()
        self.failureResultOf(running.deferred, CancelledError)
        self.net.pump()
        record = self.fake.connections[0]
        self.assertEqual((record.client_closed, ms(record.closed_at)), (True, 50))
        self.net.advance(1)
        self.assertEqual(self.successResultOf(waiting.deferred).content, "next")
        self.assertEqual(ms(self.chats()[1].received_at), 50)
        self.assertFalse(self.gate().in_flight(0))
        self.assert_quiet()


class RetryTests(ClientTestCase):
    """chat_with_retry repeats what is worth repeating, through the gate each time."""

    def test_503_then_success(self) -> None:
        """A 503 is retried after the first wait of the schedule, with one Retrying event."""
        self.fake.script("POST", CHAT, LOADING, answer("ok"))
        call = self.chat_with_retry()
        self.net.advance(1)
        self.assertEqual(self.successResultOf(call.deferred).content, "ok")
        [retrying] = call.retries
        self.assertEqual((retrying.attempt, retrying.after_ms), (1, 50))
        self.assertIn("503", retrying.error)
        self.assertEqual([ms(r.received_at) for r in self.chats()], [0, 50])
        self.assert_quiet()

    def test_retry_goes_through_gate(self) -> None:
        """A retry that finds its slot taken waits at the gate, and is sent once it is free."""
        self.fake.script("POST", CHAT, LOADING, answer("other", delay_s=0.075), answer("mine"))
        mine = self.chat_with_retry(text="mine")
        self.net.pump()
        other = self.chat(text="other")  # takes the slot during the backoff wait
        self.assertEqual(other.queued, [])
        self.net.run_to(0.05)
        self.assertEqual(mine.queued, [1])
        self.assertEqual(len(self.chats()), 2)
        self.net.advance(1)
        self.assertEqual(self.successResultOf(other.deferred).content, "other")
        self.assertEqual(self.successResultOf(mine.deferred).content, "mine")
        sent = [(r.json["messages"][0]["content"], ms(r.received_at)) for r in self.chats()]
        self.assertEqual(sent, [("mine", 0), ("other", 0), ("mine", ms(other.ended_at))])
        self.assert_quiet()

    def test_stream_closed_early_then_success(self) -> None:
        """A stream that ends without a finish_reason (StreamClosedEarly) is retried."""
        self.fake.script("POST", CHAT, unfinished(), unfinished(), answer("ok"))
        plain = self.chat()
        self.net.pump()
        self.failureResultOf(plain.deferred, StreamClosedEarly)
        call = self.chat_with_retry()
        self.net.advance(1)
        self.assertEqual(self.successResultOf(call.deferred).content, "ok")
        self.assertEqual([(r.attempt, r.after_ms) for r in call.retries], [(1, 50)])
        self.assertEqual(len(self.chats()), 3)
        self.assert_quiet()

    def test_server_restarted_mid_stream(self) -> None:
        """A server killed mid-stream (StreamClosedEarly) and back within the wait is retried."""
        self.fake.script("POST", CHAT, unfinished("silence"), answer("whole"))
        call = self.chat_with_retry()
        self.net.run_to(0.02)
        self.net.kill(PATH)
        self.net.pump()
        [retrying] = call.retries
        self.assertEqual((retrying.attempt, retrying.after_ms), (1, 50))
        self.net.listen(PATH, self.fake)
        self.net.advance(1)
        done = self.successResultOf(call.deferred)
        self.assertEqual((done.content, done.finish_reason), ("whole", FinishReason.STOP))
        self.assertEqual([ms(r.received_at) for r in self.chats()], [0, 70])
        self.assert_quiet()

    def test_stalled_then_success(self) -> None:
        """Silence past liveness_ms (Stalled) is retried, after the stall and the wait."""
        self.fake.script("POST", CHAT, unfinished("silence"), unfinished("silence"), answer("ok"))
        plain = self.chat()
        self.net.advance(1)
        self.failureResultOf(plain.deferred, Stalled)
        start = self.reactor.seconds()
        call = self.chat_with_retry()
        self.net.advance(1)
        self.assertEqual(self.successResultOf(call.deferred).content, "ok")
        self.assertEqual([(r.attempt, r.after_ms) for r in call.retries], [(1, 50)])
        # Stalled at start + liveness_ms (100 ms), the retry sent 50 ms later.
        self.assertEqual(ms(self.chats()[2].received_at - start), 150)
        # The stalled attempt's own connection (a /slots poll came before it gave up).
        self.assertTrue(self.chats()[1].connection.client_closed)
        self.assert_quiet()

    def test_400_not_retried(self) -> None:
        """A 400 (the prompt does not fit) fails at once, with no Retrying event."""
        too_long = error_reply(400, "exceed_context_size_error", "too long", n_ctx=8)
        self.fake.script("POST", CHAT, too_long, answer("never"))
        call = self.chat_with_retry()
        self.net.advance(1)
        failure = self.failureResultOf(call.deferred, Http)
        self.assertEqual((failure.value.status, failure.value.context_exceeded), (400, True))
        self.assertEqual((call.retries, len(self.chats()), ms(call.ended_at)), ([], 1, 0))
        self.assert_quiet()

    def test_four_attempts_then_last_error(self) -> None:
        """Four attempts in all, waiting 50, 100 and 200 ms; the last attempt's error wins."""
        self.fake.script("POST", CHAT, LOADING, LOADING, LOADING, unfinished())
        call = self.chat_with_retry()
        self.net.advance(10)
        self.failureResultOf(call.deferred, StreamClosedEarly)
        schedule = [(r.attempt, r.after_ms) for r in call.retries]
        self.assertEqual(schedule, [(1, 50), (2, 100), (3, 200)])
        self.assertEqual([ms(r.received_at) for r in self.chats()], [0, 50, 150, 350])
        self.assert_quiet()

    def test_unreachable_retried(self) -> None:
        """A socket nobody listens on fails every attempt with Connect."""
        config = make_config(NOWHERE)
        client = Client(self.reactor, config, config.endpoints[0], random=lambda: 0.5)
        call = Call(self.reactor, lambda sink: client.chat_with_retry(request(), sink))
        self.net.advance(10)
        self.failureResultOf(call.deferred, Connect)
        self.assertEqual([r.attempt for r in call.retries], [1, 2, 3])
        self.assertEqual(self.fake.requests, [])
        self.assert_quiet()


class ResumeTests(ClientTestCase):
    """
    A retry never repeats what reached the sink: before the first piece it starts again,
    after it a llama-server is asked to continue the partial answer, and otherwise the
    attempt's error ends the answer.
    """

    def setUp(self) -> None:
        """The fake renders continuations as the tiny model's template does."""
        super().setUp()
        self.fake.set_default("POST", APPLY_TEMPLATE, template_reply())

    def pieces(self, call: Call) -> list[tuple[str, str]]:
        """The text pieces the sink received, in order, as (kind, text)."""
        return [
            ("content" if isinstance(e, Content) else "reasoning", e.text)
            for e in call.events
            if isinstance(e, (Content, Reasoning))
        ]

    def test_nothing_delivered_retried_as_it_was(self) -> None:
        """A stream cut before any piece is sent again byte for byte."""
        self.fake.script("POST", CHAT, unfinished("cut"), answer("whole"))
        call = self.chat_with_retry()
        self.net.advance(1)
        self.assertEqual(self.successResultOf(call.deferred).content, "whole")
        first, second = self.chats()
        self.assertEqual(first.body, second.body)
        self.assertEqual(len(call.retries), 1)
        self.assert_quiet()

    def test_delivered_answer_resumed(self) -> None:
        """
        After reasoning and part of the content were delivered, the retry sends the
        conversation with the partial answer as the final assistant message, max_tokens
        less the 4 tokens generated; the sink gets the rest once, and the completion is the
        whole answer with the counts of one.
        """
        cut = cut_after(
            {"reasoning_content": "Let"}, {"reasoning_content": " me"}, {"content": "Hel"}
        )
        rest = finishing(
            {"role": "assistant", "content": None},
            {"content": "lo"},
            {"content": "!"},
            timings={"cache_n": 20, "prompt_n": 3, "predicted_n": 3},
        )
        self.fake.script("POST", CHAT, cut, rest)
        call = self.chat_with_retry()
        self.net.advance(1)
        done = self.successResultOf(call.deferred)
        first, second = self.chats()
        self.assertEqual(
            second.json["messages"],
            [
                *first.json["messages"],
                {"role": "assistant", "content": "Hel", "reasoning_content": "Let me"},
            ],
        )
        self.assertEqual(second.json["max_tokens"], first.json["max_tokens"] - 4)
        changed = {"messages", "max_tokens", "continue_final_message", "add_generation_prompt"}
        others = {k: v for k, v in second.json.items() if k not in changed}
        self.assertEqual(others, {k: v for k, v in first.json.items() if k in others})
        self.assertEqual(sorted(others), sorted(set(first.json) - changed))
        self.assertEqual(
            (second.json["continue_final_message"], second.json["add_generation_prompt"]),
            ("content", False),
        )
        (rendered,) = self.fake.requests_to("POST", APPLY_TEMPLATE)
        self.assertEqual(rendered.json["messages"], second.json["messages"])
        self.assertEqual(
            self.pieces(call),
            [
                ("reasoning", "Let"),
                ("reasoning", " me"),
                ("content", "Hel"),
                ("content", "lo"),
                ("content", "!"),
            ],
        )
        self.assertEqual((done.content, done.reasoning_content), ("Hello!", "Let me"))
        self.assertEqual(done.finish_reason, FinishReason.STOP)
        # 4 + 3 generated; the prompt less the 4 tokens of the partial answer.
        self.assertEqual(
            (done.timings.cache_n, done.timings.prompt_n, done.timings.predicted_n), (19, 0, 7)
        )
        self.assertEqual(done.reasoning_tokens, 3)
        self.assertEqual(len(call.retries), 1)
        self.assert_quiet()

    def test_thinking_answer_resumed(self) -> None:
        """Cut while still thinking: the prefill is the reasoning alone, content null."""
        cut = cut_after({"reasoning_content": "Let"}, {"reasoning_content": " me"})
        rest = finishing(
            {"reasoning_content": " think"},
            {"content": "Hi"},
            timings={"cache_n": 0, "prompt_n": 15, "predicted_n": 4},
        )
        self.fake.script("POST", CHAT, cut, rest)
        call = self.chat_with_retry()
        self.net.advance(1)
        done = self.successResultOf(call.deferred)
        _, second = self.chats()
        self.assertEqual(
            second.json["messages"][-1],
            {"role": "assistant", "content": None, "reasoning_content": "Let me"},
        )
        self.assertEqual(second.json["continue_final_message"], "reasoning_content")
        self.assertEqual((done.reasoning_content, done.content), ("Let me think", "Hi"))
        self.assertEqual((done.timings.prompt_n, done.timings.predicted_n), (12, 7))
        self.assert_quiet()

    def test_resumed_twice(self) -> None:
        """A continuation cut in turn is continued from everything delivered by both."""
        first_cut = cut_after({"content": "Hel"})
        second_cut = cut_after({"content": "lo"}, {"content": " wo"})
        rest = finishing(
            {"content": "rld"}, timings={"cache_n": 0, "prompt_n": 20, "predicted_n": 1}
        )
        self.fake.script("POST", CHAT, first_cut, second_cut, rest)
        call = self.chat_with_retry()
        self.net.advance(1)
        done = self.successResultOf(call.deferred)
        first, second, third = self.chats()
        self.assertEqual(second.json["messages"][-1], {"role": "assistant", "content": "Hel"})
        self.assertEqual(third.json["messages"][-1], {"role": "assistant", "content": "Hello wo"})
        self.assertEqual(first.json["max_tokens"] - third.json["max_tokens"], 2 + 3)
        self.assertEqual(done.content, "Hello world")
        self.assertEqual(done.timings.predicted_n, 6)
        self.assertEqual([c for _, c in self.pieces(call)], ["Hel", "lo", " wo", "rld"])
        self.assert_quiet()

    def test_echoed_thought_not_repeated(self) -> None:
        """
        Cut mid-thought, then a continuation whose stream sends the delivered reasoning back
        first, before any token (llama.cpp b11434 did, on the real server: "... Let meLet me
        think about this..."): the sink and the completion have each piece once.
        """
        cut = cut_after({"reasoning_content": "Let"}, {"reasoning_content": " me"})
        echo = counted({"reasoning_content": "Let me"}, 0, "chatcmpl-b")
        rest = [counted({"reasoning_content": " think"}, 1, "chatcmpl-b")]
        rest.append(counted({"content": "Hi"}, 2, "chatcmpl-b"))
        last = chunk("chatcmpl-b", {}, "stop")
        last["timings"] = {"cache_n": 0, "prompt_n": 15, "predicted_n": 2}
        self.fake.script("POST", CHAT, cut, sse_reply([echo, *rest, last]))
        call = self.chat_with_retry()
        self.net.advance(1)
        done = self.successResultOf(call.deferred)
        self.assertEqual(
            self.pieces(call),
            [
                ("reasoning", "Let"),
                ("reasoning", " me"),
                ("reasoning", " think"),
                ("content", "Hi"),
            ],
        )
        self.assertEqual((done.reasoning_content, done.content), ("Let me think", "Hi"))
        self.assertEqual(done.timings.predicted_n, 5)
        self.assert_quiet()

    def test_echoed_answer_not_repeated(self) -> None:
        """
        Cut mid-answer: the reasoning echoed with a newline and no count, the content at
        count 0 (as b11434 sent them), then the rest; nothing reaches the sink twice.
        """
        cut = cut_after({"reasoning_content": "Hmm"}, {"content": "Hel"})
        echo = [chunk("chatcmpl-b", {"reasoning_content": "Hmm\n"})]
        echo.append(counted({"content": "Hel"}, 0, "chatcmpl-b"))
        last = chunk("chatcmpl-b", {}, "stop")
        last["timings"] = {"cache_n": 0, "prompt_n": 15, "predicted_n": 1}
        rest = sse_reply([*echo, counted({"content": "lo"}, 1, "chatcmpl-b"), last])
        self.fake.script("POST", CHAT, cut, rest)
        call = self.chat_with_retry()
        self.net.advance(1)
        done = self.successResultOf(call.deferred)
        self.assertEqual(
            self.pieces(call), [("reasoning", "Hmm"), ("content", "Hel"), ("content", "lo")]
        )
        self.assertEqual((done.reasoning_content, done.content), ("Hmm", "Hello"))
        self.assert_quiet()

    def test_thought_closed_when_not_left_open(self) -> None:
        """
        A template that does not leave the cut thought open: the continuation closes it and
        asks for the answer; reasoning it streams anyway (a second thought) is dropped.
        """
        self.fake.set_default("POST", APPLY_TEMPLATE, template_reply(open_thought=False))
        cut = cut_after({"reasoning_content": "Let"}, {"reasoning_content": " me"})
        rest = finishing(
            {"reasoning_content": "Let"},
            {"content": "Hi"},
            timings={"cache_n": 0, "prompt_n": 15, "predicted_n": 2},
        )
        self.fake.script("POST", CHAT, cut, rest)
        call = self.chat_with_retry()
        self.net.advance(1)
        done = self.successResultOf(call.deferred)
        _, second = self.chats()
        self.assertEqual(
            second.json["messages"][-1],
            {"role": "assistant", "content": "", "reasoning_content": "Let me"},
        )
        self.assertEqual(second.json["continue_final_message"], "content")
        self.assertEqual(
            self.pieces(call), [("reasoning", "Let"), ("reasoning", " me"), ("content", "Hi")]
        )
        self.assertEqual((done.reasoning_content, done.content), ("Let me", "Hi"))
        self.assert_quiet()

    def test_content_not_rendered_not_resumed(self) -> None:
        """
        Cut content the template's prompt does not end with: no continuation, the error that
        cut the stream ends the answer.
        """
        fresh = json_reply(200, {"prompt": "<|im_start|>assistant\n"})
        self.fake.set_default("POST", APPLY_TEMPLATE, fresh)
        self.fake.script("POST", CHAT, cut_after({"content": "Hel"}), answer("never"))
        call = self.chat_with_retry()
        with capturedLogs() as logged:
            self.net.advance(1)
        self.failureResultOf(call.deferred, StreamClosedEarly)
        self.assertEqual(len(self.chats()), 1)
        self.assertEqual(len(self.fake.requests_to("POST", APPLY_TEMPLATE)), 1)
        self.assertEqual(self.pieces(call), [("content", "Hel")])
        self.assertIn("template", " ".join(formatEvent(e) for e in logged))
        self.assert_quiet()

    def test_tool_call_started_not_retried(self) -> None:
        """A tool call that had started streaming is not resumed: the error ends the answer."""
        call_delta = {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f"}}]}
        self.fake.script("POST", CHAT, cut_after({"content": "Ok"}, call_delta), answer("never"))
        call = self.chat_with_retry()
        with capturedLogs() as logged:
            self.net.advance(1)
        self.failureResultOf(call.deferred, StreamClosedEarly)
        self.assertEqual((len(self.chats()), call.retries), (1, []))
        self.assertIn("tool call", " ".join(formatEvent(e) for e in logged))
        self.assert_quiet()

    def test_openai_endpoint_not_resumed(self) -> None:
        """An openai endpoint promises no prefill: delivered content ends with the error."""
        endpoint = Endpoint(name="tiny", socket=PATH, model="tiny", kind="openai")
        config = Config(endpoints=(endpoint,), limits=LIMITS, retry=RETRY)
        client = Client(self.reactor, config, endpoint, random=lambda: 0.5)
        self.fake.script("POST", CHAT, cut_after({"content": "Hel"}), answer("Hello"))
        call = Call(self.reactor, lambda sink: client.chat_with_retry(request(), sink))
        self.net.advance(1)
        self.failureResultOf(call.deferred, StreamClosedEarly)
        self.assertEqual((len(self.chats()), call.retries), (1, []))
        self.assertEqual(self.pieces(call), [("content", "Hel")])
        self.assert_quiet()

    def test_max_tokens_used_up_not_resumed(self) -> None:
        """A partial answer that has used its max_tokens is not continued."""
        self.fake.script("POST", CHAT, cut_after({"content": "a"}, {"content": "b"}), answer("c"))
        limited = dataclasses.replace(request(), max_tokens=3)
        call = Call(self.reactor, lambda sink: self.client.chat_with_retry(limited, sink))
        self.net.advance(1)
        self.failureResultOf(call.deferred, StreamClosedEarly)
        self.assertEqual(len(self.chats()), 1)
        self.assert_quiet()


class InfoTests(ClientTestCase):
    """props, slots and tokenize read the server's answers, or fail with a typed error."""

    def result(self, d: Deferred[Any]) -> Any:
        """Pump the network and return the Deferred's result."""
        self.net.pump()
        return self.successResultOf(d)

    def failure(self, d: Deferred[Any], kind: type[InferError]) -> Any:
        """Pump the network and return the Deferred's error, which must be of C{kind}."""
        self.net.pump()
        return self.failureResultOf(d, kind).value

    def test_props(self) -> None:
        """props() is the server's /props object."""
        self.fake.script("GET", PROPS, props_reply(total_slots=2, n_ctx=512))
        props = self.result(self.client.props())
        self.assertEqual(props["total_slots"], 2)
        self.assertEqual(props["default_generation_settings"]["n_ctx"], 512)
        self.assertEqual([r.method for r in self.fake.requests_to("GET", PROPS)], ["GET"])

    def test_slots(self) -> None:
        """slots() is the server's /slots as SlotStates, with the busy slot's counters."""
        self.fake.script("GET", SLOTS, slots_reply([True, False]))
        slots = self.result(self.client.slots())
        self.assertEqual(slots, (SlotState(0, True, (60, 3, 1)), SlotState(1, False)))

    def test_tokenize(self) -> None:
        """tokenize() posts the text without special tokens added and returns the ids."""
        self.fake.script("POST", TOKENIZE, json_reply(200, {"tokens": [15496, 11, 995]}))
        self.assertEqual(self.result(self.client.tokenize("Hello, world")), [15496, 11, 995])
        [sent] = self.fake.requests_to("POST", TOKENIZE)
        self.assertEqual(sent.json, {"content": "Hello, world", "add_special": False})

    def test_error_status(self) -> None:
        """Any status but 200 is Http with that status and the body."""
        self.fake.script("GET", PROPS, LOADING)
        self.fake.script("GET", SLOTS, error_reply(501, "not_supported_error", "slots off"))
        props = self.failure(self.client.props(), Http)
        self.assertEqual(props.status, 503)
        self.assertEqual(json.loads(props.body), json.loads(LOADING.body))
        self.assertEqual(self.failure(self.client.slots(), Http).status, 501)
        # Nothing scripted for /tokenize: llama-server's 404.
        self.assertEqual(self.failure(self.client.tokenize("x"), Http).status, 404)
        self.assert_quiet()

    def test_wrong_shape(self) -> None:
        """An answer of the wrong shape, or not JSON at all, is Protocol."""
        self.fake.script("GET", PROPS, json_reply(200, [1, 2]))
        self.fake.script("GET", SLOTS, json_reply(200, {"slots": []}))
        bad_tokens: list[Any] = [[1, 2], {"tokens": "1 2"}, {"tokens": [1, "2"]}, {}]
        self.fake.script("POST", TOKENIZE, *(json_reply(200, bad) for bad in bad_tokens))
        self.failure(self.client.props(), Protocol)
        self.failure(self.client.slots(), Protocol)
        for _ in bad_tokens:
            self.failure(self.client.tokenize("x"), Protocol)
        not_json = dataclasses.replace(props_reply(), pieces=[Piece(0, b"{not json")])
        self.fake.script("GET", PROPS, not_json)
        self.failure(self.client.props(), Protocol)
        self.assert_quiet()

    def test_tokenize_booleans(self) -> None:
        """Booleans are not token ids (JSON true is not a number): Protocol."""
        self.fake.script("POST", TOKENIZE, json_reply(200, {"tokens": [1, True]}))
        self.failure(self.client.tokenize("x"), Protocol)

    def test_unreachable(self) -> None:
        """A socket nobody listens on is Connect, for a chat and for each info call."""
        config = make_config(NOWHERE)
        client = Client(self.reactor, config, config.endpoints[0])
        calls: list[Deferred[Any]] = [client.props(), client.slots(), client.tokenize("x")]
        for d in calls:
            self.failure(d, Connect)
        chat = client.chat(request(), lambda e: None)
        self.assertIsInstance(self.failure(chat, Connect), InferError)
        self.assertIsInstance(client.gate, SlotGate)
        self.assertFalse(cast(SlotGate, client.gate).in_flight(0))
        self.assertEqual(self.fake.requests, [])
        self.assert_quiet()


def refusal(limit: str) -> Reply:
    """What an inferproxy sends a connection over C{limit}."""
    return Reply(status=503, headers=[(ProxyRefused.HEADER, limit), ("Retry-After", "1")])


#: A /slots answer that never comes: a frozen server.
FROZEN_SLOTS = dataclasses.replace(slots_reply(True), headers_delay=math.inf)
#: A chat answer that never comes, not even its headers.
UNANSWERED = sse_reply([], headers_delay=math.inf)


class ConnectionTests(ClientTestCase):
    """
    Every connection goes through the endpoint's pacing; a refusal by its inferproxy is a
    refusal, never a dead server; polls do not pile up.
    """

    def test_one_connection_per_chat(self) -> None:
        """A chat whose answer starts at once makes one connection to the endpoint: its own."""
        self.fake.set_default("POST", CHAT, answer("ok"))
        for _ in range(3):
            call = self.chat()
            self.net.advance(0.01)
            self.successResultOf(call.deferred)
        self.assertEqual(len(self.fake.connections), 3)
        self.assertEqual([r.target for r in self.fake.requests], [CHAT] * 3)
        self.assertEqual(self.client.pacer.stats.connections, 3)

    def test_eleventh_chat_waits_for_token(self) -> None:
        """
        Ten sequential chats go at once (the burst), the eleventh waits 0.5 s for a token
        instead of being refused and retried 2 s later; the wait is counted.
        """
        self.fake.set_default("POST", CHAT, answer("ok"))
        for _ in range(10):
            call = self.chat()
            self.net.pump()
            self.successResultOf(call.deferred)
        self.assertEqual(self.reactor.seconds(), 0)
        eleventh = self.chat_with_retry()
        self.net.advance(0.499)
        self.assertNoResult(eleventh.deferred)
        self.net.advance(0.001)
        self.net.pump()
        self.assertEqual(self.successResultOf(eleventh.deferred).content, "ok")
        self.assertEqual(ms(eleventh.ended_at), 500)
        self.assertEqual(eleventh.retries, [])
        stats = self.client.pacer.stats
        self.assertEqual((stats.connections, stats.waits, stats.refusals), (11, 1, {}))
        self.assertAlmostEqual(stats.waited_seconds, 0.5)

    def test_cap_refusal_fails_fast_not_retried(self) -> None:
        """
        A refusal at the inferproxy's connection cap fails the chat at once with
        ProxyRefused naming the endpoint and the cap; it is not a Connect and not retried.
        """
        self.fake.set_default("POST", CHAT, refusal(ProxyRefused.CONNECTIONS))
        call = self.chat_with_retry()
        self.net.advance(10)
        error = self.failureResultOf(call.deferred, ProxyRefused).value
        self.assertNotIsInstance(error, Connect)
        self.assertIn("endpoint tiny", str(error))
        self.assertIn("connection limit", str(error))
        self.assertEqual((ms(call.ended_at), call.retries), (0, []))
        self.assertEqual(len(self.chats()), 1)
        self.assert_quiet()

    def test_rate_refusal_waits_a_token_not_a_backoff(self) -> None:
        """
        An accept-rate refusal (someone else drained the proxy's bucket) is sent again when
        a token is due, 0.5 s later, with no Retrying event: the server is not taken for dead.
        """
        self.fake.script("POST", CHAT, refusal(ProxyRefused.ACCEPT_RATE), answer("ok"))
        # The first-byte wait counts from the refused connection: poll_ms above the token's
        # 0.5 s keeps the polls out of this test.
        limits = dataclasses.replace(LIMITS, poll_ms=1000)
        config = dataclasses.replace(make_config(), limits=limits)
        self.client = Client(self.reactor, config, config.endpoints[0], random=lambda: 0.5)
        call = self.chat_with_retry()
        self.net.advance(1)
        self.assertEqual(self.successResultOf(call.deferred).content, "ok")
        self.assertEqual((ms(call.ended_at), call.retries), (500, []))
        self.assertEqual(self.client.pacer.stats.refusals, {ProxyRefused.ACCEPT_RATE: 1})

    def test_waiting_chats_share_one_poll(self) -> None:
        """
        Two chats waiting for their answers (slots 0 and 1) share one /slots poll per
        poll_ms: never two polls in flight.
        """
        self.fake.set_default("POST", CHAT, UNANSWERED)
        self.fake.set_default("GET", SLOTS, slots_reply([True, True]))
        calls = [self.chat(slot=0), self.chat(slot=1)]
        self.net.advance(0.15)
        polls = self.fake.requests_to("GET", SLOTS)
        self.assertEqual(len(polls), 1)
        self.net.advance(0.1)
        self.assertEqual(len(self.fake.requests_to("GET", SLOTS)), 2)
        for call in calls:
            call.deferred.cancel()
            self.failureResultOf(call.deferred, CancelledError)
        self.net.advance(1)
        self.assert_quiet()

    def test_abandoned_poll_aborted(self) -> None:
        """
        A /slots poll that a frozen server never answers is given up after poll_ms and its
        connection closed then; at most one poll connection is ever open.
        """
        self.fake.set_default("POST", CHAT, UNANSWERED)
        self.fake.set_default("GET", SLOTS, FROZEN_SLOTS)
        call = self.chat()
        most = 0
        for _ in range(40):
            self.net.advance(0.01)
            polls = [c for c in self.fake.connections if c.request and c.request.target == SLOTS]
            most = max(most, sum(1 for c in polls if c.open))
        self.assertEqual(most, 1)
        self.failureResultOf(call.deferred)
        polls = [c for c in self.fake.connections if c.request and c.request.target == SLOTS]
        self.assertGreater(len(polls), 1)
        self.assertTrue(all(c.client_closed for c in polls))
        self.net.advance(1)
        self.assert_quiet()


#: The seed's names (section 3), by kind.
MESSAGES = "System User Assistant Tool".split()
EVENTS = "Queued Waiting Progress Reasoning Content ToolCallDelta ThinkingCapped Retrying".split()
ERRORS = """Busy Connect WaitTimeout LoadTimeout Stalled StreamClosedEarly ThinkingOverrun Http
    Protocol""".split()
OTHERS = """Client ChatRequest ChatMessage ToolSchema ChatEvent Completion Timings FinishReason
    InferError cache_outcome""".split()


class FacadeTests(SynchronousTestCase):
    """loopd.llama exports the seed's public names."""

    def test_all_exists(self) -> None:
        """Every name in loopd.llama.__all__ is an attribute of the package."""
        missing = [name for name in loopd.llama.__all__ if not hasattr(loopd.llama, name)]
        self.assertEqual(missing, [])

    def test_seed_names(self) -> None:
        """The seed's interface names are all exported."""
        seed = {*MESSAGES, *EVENTS, *ERRORS, *OTHERS}
        self.assertEqual(len(seed), 31)
        self.assertEqual(seed - set(loopd.llama.__all__), set())

    def test_kinds(self) -> None:
        """Messages, events and errors are kinds of their base; the finish reasons are three."""
        llama = loopd.llama
        for name in MESSAGES:
            self.assertTrue(issubclass(getattr(llama, name), llama.ChatMessage), name)
        for name in EVENTS:
            self.assertTrue(issubclass(getattr(llama, name), llama.ChatEvent), name)
        for name in ERRORS:
            kind = getattr(llama, name)
            self.assertTrue(issubclass(kind, InferError), name)
            self.assertIs(getattr(InferError, name), kind)
        reasons = {reason.value for reason in FinishReason}
        self.assertEqual(reasons, {"stop", "tool_calls", "length"})
        self.assertTrue(callable(llama.cache_outcome))
