"""
Tests for L{loopd.llama.chat}: one chat request against the scripted fake llama-server in
memory on a C{MemoryReactorClock} (L{MemoryNet}), every limit between 50 and 200 ms. Nothing
sleeps: the clock jumps from one scheduled call to the next, so every event, failure and close
has an exact clock time, which the tests assert (to 1e-9 s: sums of 0.05 are not exact in
binary).

Beyond the answer, its waits and its failures: the edge cases tests found (a limit judged on
float clock sums, an error body that stops arriving, a late /slots answer after the headers,
a 429's Retry-After); the thinking cap, where at C{thinking.cap} reasoning tokens the call
asks the server to end the reasoning on a second connection and reads on, and C{overrun} more
reasoning tokens, or a control call without C{success: true}, is L{ThinkingOverrun};
cancellation, which must close the control connection too; and endpoints of kind C{openai},
which have neither polls nor control. The thinking streams are real transcripts:
C{reasoning-end.sse} reasons up to C{predicted_n} 13 and then answers; C{error.sse} reasons
until the server fails, far past any cap used here.

Prompt processing (L{PrefillTests}, decision 44) runs on the shipped limits instead (30 s of
liveness, 5 s polls, batches a minute long), with C{/slots} answering as llama.cpp's server
does during a prefill: the slot processing, its counters moving only from batch to batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd.errors import (
    Http,
    LoadTimeout,
    Protocol,
    Stalled,
    StreamClosedEarly,
    ThinkingOverrun,
    WaitTimeout,
)
from loopd.llama.chat import ChatCall
from loopd.llama.flow import Flow
from loopd.llama.request import LLAMA_ONLY_FIELDS
from loopd.llama.types import (
    ChatEvent,
    ChatRequest,
    Completion,
    Content,
    FinishReason,
    Progress,
    Reasoning,
    ThinkingCapped,
    Timings,
    ToolCall,
    ToolCallDelta,
    User,
    Waiting,
)
from loopd.settings import Caps, Config, Endpoint, Limits, Thinking
from loopd.testing.fake_llama import (
    CHAT,
    CONTROL,
    JSON_HEADERS,
    LOADING,
    NOT_FOUND,
    SLOTS,
    SSE_HEADERS,
    ConnectionRecord,
    FakeLlama,
    Piece,
    RecordedRequest,
    Reply,
    ReplySource,
    error_reply,
    event_bytes,
    json_reply,
    sse_reply,
)
from loopd.testing.llama_replies import chunk, control_reply, slots_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

FIXTURES = Path(loopd.__file__).resolve().parent.parent / "fixtures" / "transcripts"
#: The fake's socket path: in memory only, nothing is created on disk.
PATH = "/tmp/ld-chat/llama.sock"
LIMITS = Limits(poll_ms=50, busy_wait_ms=200, load_wait_ms=150, idle_grace_ms=100, liveness_ms=80)
REQUEST = ChatRequest(slot=0, messages=(User("Hi"),))
HELLO = ["Hello", " from", " the", " tiny", " model", "!"]
THOUGHT = ["Let", " me", " think", " about", " this", "..."]
ANSWER, THINKING = "".join(HELLO), "".join(THOUGHT)
#: The events of thinking.sse; they stay the same when the transcripts are re-recorded.
THINKING_EVENTS: list[ChatEvent] = [Progress(21, 20, 20), Progress(21, 20, 21)]
THINKING_EVENTS += [*map(Reasoning, THOUGHT), *map(Content, HELLO)]
NEVER = math.inf
#: A chat request that is never answered, not even with headers (a slot that never frees).
UNANSWERED = sse_reply([], headers_delay=NEVER)


def make_config(kind: Any = "llama-server", model: str | None = "tiny", **changes: Any) -> Config:
    """One endpoint at L{PATH}, of this kind and model, the test limits, and C{changes}."""
    endpoint = Endpoint(name="tiny", socket=PATH, kind=kind, model=model)
    return Config(endpoints=(endpoint,), max_tokens=300, limits=LIMITS, **changes)


def at(seconds: float | None) -> float | None:
    """A clock time rounded to the nanosecond, to compare with the time a test expects."""
    return None if seconds is None else round(seconds, 9)


def transcript_events(name: str) -> list[bytes]:
    """The SSE events of a recorded transcript, each with its blank line, C{[DONE]} included."""
    raw = (FIXTURES / name).read_bytes()
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def transcript_chunks(name: str) -> list[dict[str, Any]]:
    """The JSON chunks of a recorded transcript, C{[DONE]} left out."""
    data = [event.decode("utf-8").strip()[6:] for event in transcript_events(name)]
    return [json.loads(text) for text in data if text != "[DONE]"]


def stream(events: list[bytes], delay_s: float = 0.0, **changes: Any) -> Reply:
    """A 200 stream of these raw events, one piece each C{delay_s} apart, no C{[DONE]} added."""
    reply = sse_reply([Piece(delay_s, event) for event in events], done=False)
    return dataclasses.replace(reply, **changes)


def last_timings(name: str) -> Timings:
    """The timings of the last chunk of a transcript, which the completion must keep."""
    timings = transcript_chunks(name)[-1]["timings"]
    keys = ("cache_n", "prompt_n", "predicted_n", "predicted_per_second", "prompt_per_second")
    return Timings(*(timings[key] for key in keys))


class Harness:
    """One L{ChatCall} against a L{FakeLlama} on a L{MemoryNet}; events and end timed."""

    def __init__(
        self, config: Config | None = None, request: ChatRequest = REQUEST, flow: Flow | None = None
    ) -> None:
        """
        A fresh clock, fake and network; C{config} defaults to L{make_config}'s. The call
        attaches to C{flow}, if given.
        """
        self.flow = flow
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)
        self.config = config or make_config()
        self.request = request
        self.events: list[tuple[float, ChatEvent]] = []
        self.ended_at: float | None = None

    def start(self, chat: Reply | None = None, slots: ReplySource | None = None) -> Deferred[Any]:
        """Script the chat reply and the default C{/slots} answer, then run the call."""
        if chat is not None:
            self.fake.script("POST", CHAT, chat)
        if slots is not None:
            self.fake.set_default("GET", SLOTS, slots)
        endpoint = self.config.endpoints[0]
        call = ChatCall(self.reactor, self.config, endpoint, self.request, self._event, self.flow)
        d = call.run()
        d.addBoth(self._ended)
        self.net.pump()
        return d

    def _event(self, event: ChatEvent) -> None:
        self.events.append((self.reactor.seconds(), event))

    def _ended(self, result: object) -> object:
        self.ended_at = self.reactor.seconds()
        return result

    def run(self, chat: Reply | None = None, slots: ReplySource | None = None) -> Deferred[Any]:
        """L{start}, then L{run_to_end}."""
        d = self.start(chat, slots)
        self.run_to_end()
        return d

    def run_to_end(self, limit: float = 10.0) -> None:
        """Run the clock to the call's end, not past it (a timer left is still seen)."""
        while self.ended_at is None:
            due = [call.getTime() for call in self.reactor.getDelayedCalls()]
            soonest = min((when for when in due if when <= limit), default=None)
            if soonest is None:
                return
            self.net.run_to(soonest)

    def of(self, *kinds: type[ChatEvent]) -> list[ChatEvent]:
        """The events of these kinds (every event when none is given), in order."""
        return [event for _, event in self.events if not kinds or isinstance(event, kinds)]

    def times(self, kind: type[ChatEvent]) -> list[float | None]:
        """The clock times of the events of one kind."""
        return [at(when) for when, event in self.events if isinstance(event, kind)]

    def chat_connection(self) -> ConnectionRecord:
        """The connection that carried the chat request."""
        [request] = self.fake.requests_to("POST", CHAT)
        return request.connection

    def slots_polls(self) -> list[float | None]:
        """The clock times at which C{/slots} was asked."""
        return [at(r.received_at) for r in self.fake.requests_to("GET", SLOTS)]


class ChatTestCase(SynchronousTestCase):
    """Assertions shared by the chat tests; no tests of its own."""

    def assert_closed_by_client(self, record: ConnectionRecord, when: float) -> None:
        """The client closed C{record}'s connection at clock time C{when}."""
        self.assertEqual((record.client_closed, at(record.closed_at)), (True, at(when)))

    def assert_settled(self, h: Harness, when: float) -> None:
        """The call ended at clock time C{when}; no timer is left, no connection is open."""
        h.net.pump()
        self.assertEqual(at(h.ended_at), at(when))
        self.assertEqual((h.reactor.getDelayedCalls(), h.net.open_connections()), ([], []))

    def assert_failed(self, h: Harness, d: Deferred[Any], kind: Any, when: float) -> Any:
        """C{d} failed with C{kind} at clock time C{when}, and settled; returns the error."""
        error = self.failureResultOf(d, kind).value
        self.assert_settled(h, when)
        return error

    def assert_answered(self, h: Harness, d: Deferred[Any], when: float) -> Completion:
        """C{d} fired with a completion at clock time C{when}, and settled; returns it."""
        completion: Completion = self.successResultOf(d)
        self.assert_settled(h, when)
        return completion


class StreamTests(ChatTestCase):
    """A whole recorded stream gives its events in order and the completion."""

    def test_thinking_transcript(self) -> None:
        """thinking.sse: events in order, the completion, and no /slots poll."""
        h = Harness()
        d = h.run(stream(transcript_events("thinking.sse"), 0.01))
        first_id, timings = transcript_chunks("thinking.sse")[0]["id"], last_timings("thinking.sse")
        expected = Completion(first_id, ANSWER, THINKING, (), FinishReason.STOP, timings, 7)
        # 17 events 10 ms apart; the answer ends with the 17th, [DONE].
        self.assertEqual(self.assert_answered(h, d, 0.17), expected)
        self.assertEqual(h.of(), THINKING_EVENTS)
        self.assertEqual(h.slots_polls(), [])

    def test_request_body(self) -> None:
        """The body on the wire has the seed's fields, from the request and the config."""
        h = Harness(request=ChatRequest(slot=1, messages=(User("Hi"),)))
        h.start(stream(transcript_events("plain.sse")))
        [request] = h.fake.requests_to("POST", CHAT)
        seed = dict(model="tiny", stream=True, id_slot=1, cache_prompt=True, return_progress=True)
        seed.update(timings_per_token=True, reasoning_control=True, max_tokens=300)
        self.assertEqual({key: request.json.get(key) for key in seed}, seed)
        self.assertEqual(request.json["messages"], [{"role": "user", "content": "Hi"}])
        self.assertEqual(request.header("connection"), "close")

    def test_tool_call_transcript(self) -> None:
        """tool-call.sse: reasoning, then tool-call deltas, then the assembled call."""
        h = Harness()
        d = h.start(stream(transcript_events("tool-call.sse")))
        completion = self.assert_answered(h, d, 0)
        first = transcript_chunks("tool-call.sse")[9]["choices"][0]["delta"]["tool_calls"][0]
        progress = [Progress(total=469, cache=1, processed=n) for n in (1, 469)]
        self.assertEqual(h.of()[:8], progress + [Reasoning(text) for text in THOUGHT])
        deltas = h.of()[8:]
        self.assertEqual(deltas[0], ToolCallDelta(0, first["id"], "get_weather", "{"))
        self.assertEqual((len(deltas), h.of(ToolCallDelta)), (12, deltas))
        call = ToolCall(first["id"], "get_weather", '{"city":"test"}')
        self.assertEqual(
            (completion.tool_calls, completion.finish_reason, completion.content),
            ((call,), FinishReason.TOOL_CALLS, None),
        )

    def test_progress_counts_as_life(self) -> None:
        """progress.sse 60 ms apart: seven Progress events, well past the liveness limit."""
        h = Harness()
        events = transcript_events("progress.sse")
        d = h.run(stream(events, 0.06))
        self.assertEqual(self.assert_answered(h, d, 0.06 * len(events)).content, ANSWER)
        progress = [Progress(3044, 0, n) for n in (0, 512, 1024, 1536, 2048, 2560, 3044)]
        self.assertEqual(h.of(Progress), progress)
        self.assertEqual(h.times(Progress), [at(0.06 * n) for n in range(1, 8)])

    @given(st.lists(st.tuples(st.integers(1, 7720), st.integers(0, 79)), max_size=30))
    def test_any_split_same_completion(self, cuts: list[tuple[int, int]]) -> None:
        """Any split of thinking.sse into pieces under the liveness limit: the same result."""
        raw = b"".join(transcript_events("thinking.sse"))
        delays = dict(sorted(cuts))
        bounds = sorted({0, len(raw), *(min(cut, len(raw)) for cut in delays)})
        pieces = [
            Piece(delays.get(start, 0) / 1000, raw[start:end])
            for start, end in zip(bounds, bounds[1:], strict=False)
        ]
        h = Harness()
        d = h.run(sse_reply(pieces, done=False))
        completion = self.assert_answered(h, d, sum(piece.delay_s for piece in pieces))
        self.assertEqual(
            (completion.content, completion.reasoning_content, completion.reasoning_tokens),
            (ANSWER, THINKING, 7),
        )
        self.assertEqual(completion.timings, last_timings("thinking.sse"))
        self.assertEqual(h.of(), THINKING_EVENTS)


class FirstByteTests(ChatTestCase):
    """Before the first byte: a /slots poll and a Waiting event every poll_ms."""

    def test_busy_then_wait_timeout(self) -> None:
        """A busy slot waits busy_wait_ms from the first busy poll, then WaitTimeout."""
        h = Harness()
        d = h.run(UNANSWERED, slots_reply(True))
        self.assert_failed(h, d, WaitTimeout, 0.25)
        polls = [0.05, 0.1, 0.15, 0.2, 0.25]
        self.assertEqual((h.slots_polls(), h.times(Waiting)), (polls, polls))
        self.assertEqual(h.of(), [Waiting(slot_busy=True)] * 5)
        self.assertEqual(len({r.connection.number for r in h.fake.requests}), 6)
        self.assert_closed_by_client(h.chat_connection(), 0.25)

    def test_busy_slot_of_the_request(self) -> None:
        """The slot judged is the request's own: slot 1 busy, slot 0 idle, still busy."""
        h = Harness(request=ChatRequest(slot=1, messages=(User("Hi"),)))
        d = h.run(UNANSWERED, slots_reply([False, True]))
        self.assert_failed(h, d, WaitTimeout, 0.25)
        self.assertEqual(set(h.of()), {Waiting(slot_busy=True)})

    def test_busy_clock_restarts(self) -> None:
        """Busy, idle, then busy again: the busy wait counts from the second busy spell."""
        h = Harness()
        d = h.start(UNANSWERED, slots_reply(True))
        h.fake.script("GET", SLOTS, slots_reply(True), slots_reply(False))
        h.net.run_to(0.3)
        self.assertNoResult(d)
        busy, idle = Waiting(slot_busy=True), Waiting(slot_busy=False)
        self.assertEqual(h.of(), [busy, idle, busy, busy, busy, busy])
        d.cancel()
        self.assert_failed(h, d, CancelledError, 0.3)

    def test_loading_503_then_load_timeout(self) -> None:
        """/slots answering 503 (loading) waits load_wait_ms, then LoadTimeout."""
        h = Harness()
        d = h.run(UNANSWERED, LOADING)
        self.assert_failed(h, d, LoadTimeout, 0.2)
        self.assertEqual(h.times(Waiting), [0.05, 0.1, 0.15, 0.2])
        self.assertEqual(set(h.of()), {Waiting(slot_busy=False, loading=True)})
        self.assert_closed_by_client(h.chat_connection(), 0.2)

    def test_slots_refused_or_silent_is_loading(self) -> None:
        """/slots refused, or closed without a byte of reply: loading, then LoadTimeout."""
        for refused in [True, False]:
            h = Harness()
            d = h.start(UNANSWERED, Reply(head=b""))
            if refused:
                h.net.stop_listening(PATH, stale=True)
            h.run_to_end()
            self.assert_failed(h, d, LoadTimeout, 0.2)
            self.assertEqual(h.times(Waiting), [0.05, 0.1, 0.15, 0.2])
            self.assertEqual(set(h.of()), {Waiting(slot_busy=False, loading=True)})
            self.assertEqual(h.slots_polls(), [] if refused else [0.05, 0.1, 0.15, 0.2])
            self.assert_closed_by_client(h.chat_connection(), 0.2)

    def test_hanging_slots_is_loading(self) -> None:
        """A /slots poll with no answer within poll_ms counts as failing, and is closed."""
        h = Harness()
        d = h.run(UNANSWERED, dataclasses.replace(slots_reply(False), headers_delay=NEVER))
        # Each poll waits poll_ms for its answer, so the judgements come 100 ms apart.
        self.assert_failed(h, d, LoadTimeout, 0.3)
        self.assertEqual(h.slots_polls(), [0.05, 0.15, 0.25])
        self.assertEqual(h.times(Waiting), [0.1, 0.2, 0.3])
        self.assertEqual(set(h.of()), {Waiting(slot_busy=False, loading=True)})
        polls = [r.connection for r in h.fake.requests_to("GET", SLOTS)]
        for record, closed in zip(polls, [0.1, 0.2, 0.3], strict=True):
            self.assert_closed_by_client(record, closed)

    def test_idle_then_stalled(self) -> None:
        """An idle slot and still no byte for idle_grace_ms: Stalled."""
        h = Harness()
        d = h.run(UNANSWERED, slots_reply(False))
        self.assert_failed(h, d, Stalled, 0.15)
        self.assertEqual(h.times(Waiting), [0.05, 0.1, 0.15])
        self.assertEqual(set(h.of()), {Waiting(slot_busy=False)})
        self.assert_closed_by_client(h.chat_connection(), 0.15)

    def test_idle_grace_counts_from_first_idle_poll(self) -> None:
        """Busy, then idle: the idle grace counts from the first idle poll."""
        h = Harness()
        h.fake.script("GET", SLOTS, slots_reply(True))
        d = h.run(UNANSWERED, slots_reply(False))
        self.assert_failed(h, d, Stalled, 0.2)
        self.assertEqual(h.of(), [Waiting(slot_busy=True)] + [Waiting(slot_busy=False)] * 3)

    def test_busy_then_free_then_answer(self) -> None:
        """A slot busy, then free, then the answer: a completion, no error, no more polls."""
        h = Harness()
        h.fake.script("GET", SLOTS, slots_reply(True), slots_reply(True))
        d = h.run(stream(transcript_events("plain.sse"), headers_delay=0.17), slots_reply(False))
        self.assertEqual(self.assert_answered(h, d, 0.17).content, ANSWER)
        waits = [Waiting(slot_busy=True)] * 2 + [Waiting(slot_busy=False)]
        self.assertEqual(h.of(Waiting), waits)
        self.assertEqual(h.slots_polls(), [0.05, 0.1, 0.15])

    def test_late_slots_answer_after_headers(self) -> None:
        """A /slots answer that comes after the headers adds no Waiting and ends nothing."""
        h = Harness()
        late = dataclasses.replace(slots_reply(True), headers_delay=0.03)
        events = transcript_events("plain.sse")
        d = h.run(stream(events, 0.01, headers_delay=0.06), late)
        self.assertEqual(self.assert_answered(h, d, 0.06 + 0.01 * len(events)).content, ANSWER)
        self.assertEqual((h.slots_polls(), h.of(Waiting)), ([0.05], []))


class LivenessTests(ChatTestCase):
    """After the first byte: silence past liveness_ms is Stalled; anything sent is life."""

    def test_silence_after_data(self) -> None:
        """Two chunks, then silence: Stalled liveness_ms after the last byte, closed."""
        h = Harness()
        d = h.run(stream(transcript_events("thinking.sse")[:2], 0.03, end="silence"))
        self.assert_failed(h, d, Stalled, 0.14)
        self.assertEqual(h.times(Progress), [0.03, 0.06])
        self.assert_closed_by_client(h.chat_connection(), 0.14)

    def test_silence_after_headers(self) -> None:
        """Headers and then nothing: Stalled liveness_ms after the headers."""
        h = Harness()
        d = h.run(stream([], end="silence", headers_delay=0.02))
        self.assert_failed(h, d, Stalled, 0.1)
        self.assertEqual(h.of(), [])
        self.assert_closed_by_client(h.chat_connection(), 0.1)

    def test_pieces_just_inside_liveness(self) -> None:
        """Every piece 79 ms after the one before keeps the stream alive to the end."""
        h = Harness()
        events = transcript_events("plain.sse")
        d = h.run(stream(events, 0.079))
        self.assertEqual(self.assert_answered(h, d, 0.079 * len(events)).content, ANSWER)

    def test_one_gap_past_liveness(self) -> None:
        """One gap of 81 ms among 79 ms ones: Stalled 80 ms after the piece before it."""
        h = Harness()
        pieces = [Piece(0.079, event) for event in transcript_events("plain.sse")]
        pieces[5] = dataclasses.replace(pieces[5], delay_s=0.081)
        d = h.run(sse_reply(pieces, done=False))
        self.assert_failed(h, d, Stalled, 0.079 * 5 + 0.08)
        self.assert_closed_by_client(h.chat_connection(), 0.079 * 5 + 0.08)

    def test_ping_counts_as_life(self) -> None:
        """SSE ping comments 70 ms apart keep a quiet stream alive for half a second."""
        h = Harness()
        events = transcript_events("plain.sse")
        pieces = [Piece(0, events[0]), *[Piece(0.07, b":\n\n")] * 7]
        pieces += [Piece(0.07, event) for event in events[1:]]
        d = h.run(sse_reply(pieces, done=False))
        completion = self.assert_answered(h, d, 0.07 * (len(pieces) - 1))
        self.assertEqual(completion.content, ANSWER)


class EndingTests(ChatTestCase):
    """The ways a stream ends badly, each a typed error."""

    def test_no_finish_reason(self) -> None:
        """A body without a finish_reason, with or without [DONE]: StreamClosedEarly."""
        events = transcript_events("plain.sse")
        for body in [events[:-2] + events[-1:], events[:-2]]:
            h = Harness()
            d = h.run(stream(body, 0.01))
            self.assert_failed(h, d, StreamClosedEarly, 0.01 * len(body))
            self.assertEqual(h.of(Content), [Content(text) for text in HELLO])

    def test_body_cut(self) -> None:
        """A body cut between events or mid-line: StreamClosedEarly at the cut."""
        events = transcript_events("thinking.sse")
        for body, thought in [(events[:8], 5), (events[:7] + [events[7][:40]], 4)]:
            h = Harness()
            d = h.run(stream(body, 0.01, end="cut"))
            self.assert_failed(h, d, StreamClosedEarly, 0.08)
            self.assertEqual(h.of(Reasoning), [Reasoning(text) for text in THOUGHT[:thought]])

    def test_error_event(self) -> None:
        """error.sse: the mid-stream error event is Http 500 with its body, no completion."""
        h = Harness()
        events = transcript_events("error.sse")
        d = h.run(stream(events, 0.001))
        error = self.assert_failed(h, d, Http, 0.001 * len(events))
        self.assertEqual((error.status, error.context_exceeded), (500, False))
        message = json.loads(error.body)["error"]["message"]
        self.assertEqual(message, "Context size has been exceeded.")
        self.assertEqual(len(h.of(Reasoning)), 107)

    def test_context_exceeded(self) -> None:
        """HTTP 400 exceed_context_size_error before the stream: Http with context_exceeded."""
        h = Harness()
        message = "request (9 tokens) exceeds the available context size (8 tokens)"
        reply = error_reply(400, "exceed_context_size_error", message, n_prompt_tokens=9, n_ctx=8)
        d = h.start(reply)
        error = self.assert_failed(h, d, Http, 0)
        self.assertEqual((error.status, error.context_exceeded), (400, True))
        self.assertEqual(json.loads(error.body)["error"]["n_ctx"], 8)

    def test_http_503(self) -> None:
        """HTTP 503 on the chat itself: Http 503, not a context problem."""
        h = Harness()
        d = h.run(dataclasses.replace(LOADING, headers_delay=0.03))
        error = self.assert_failed(h, d, Http, 0.03)
        self.assertEqual((error.status, error.context_exceeded, h.of()), (503, False, []))

    def test_sse_line_over_cap(self) -> None:
        """An SSE line over Caps.sse_line_bytes: Protocol, and the connection closed."""
        h = Harness(make_config(caps=Caps(sse_line_bytes=1024)))
        chunk = transcript_chunks("plain.sse")[3]
        chunk["choices"][0]["delta"]["content"] = "x" * 1024
        events = transcript_events("plain.sse")
        d = h.run(stream([*events[:3], event_bytes(chunk), *events[3:]], 0.01))
        self.assert_failed(h, d, Protocol, 0.04)
        self.assertEqual(len(h.of(Progress)), 2)
        self.assert_closed_by_client(h.chat_connection(), 0.04)

    def test_header_block_over_cap(self) -> None:
        """A header block over Caps.header_bytes: Protocol, and the connection closed."""
        h = Harness(make_config(caps=Caps(header_bytes=512)))
        headers = (*SSE_HEADERS, ("X-Filler", "y" * 512))
        d = h.run(stream([], end="silence", headers=headers, headers_delay=0.02))
        self.assert_failed(h, d, Protocol, 0.02)
        self.assert_closed_by_client(h.chat_connection(), 0.02)


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

    def test_cap_waits_for_an_id(self) -> None:
        """
        Chunks without an id up to past the cap: no control with a null id; it goes with
        the first id that shows, and the overrun counts from there.
        """
        h = capped(6)
        h.fake.set_default("POST", CONTROL, control_reply(True))
        chunks = transcript_chunks("reasoning-end.sse")
        # Chunk n + 1 has predicted_n n: the ids of chunks 0..8 (predicted_n up to 7) go.
        for sent in chunks[:9]:
            del sent["id"]
        events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
        d = h.run(stream([*events, b"data: [DONE]\n\n"], STEP))
        self.assertTrue(self.assert_answered(h, d, ANSWERED).thinking_capped)
        [control] = h.fake.requests_to("POST", CONTROL)
        self.assertEqual(control.json["id"], chunks[9]["id"])
        self.assertEqual(at(control.received_at), at(chunk_time(8)))
        self.assertEqual(h.of(ThinkingCapped), [ThinkingCapped(8)])

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


#: The shipped limits: liveness_ms 30 s, poll_ms 5 s, so a silent prompt is asked about at
#: 25 s, and prefill_stall_ms 10 minutes.
DEFAULTS = Limits()
#: A prompt of three batches of 2,048 tokens, none from the cache, each batch a minute long.
BATCH, BATCHES, MINUTE = 2048, 3, 60.0
TOTAL = BATCH * BATCHES


def prefill_config(kind: Any = "llama-server", **limits: Any) -> Config:
    """L{make_config} with the shipped limits, and C{limits} changed."""
    return dataclasses.replace(make_config(kind), limits=dataclasses.replace(DEFAULTS, **limits))


def progress(processed: int) -> bytes:
    """A progress event of the prompt of L{TOTAL} tokens: its role-only chunk."""
    role = {"role": "assistant", "content": None}
    return event_bytes(chunk(role, progress=(TOTAL, 0, processed)))


def answer_events(*deltas: dict[str, Any]) -> list[bytes]:
    """The chunks of an answer: these deltas, then the finish with its timings."""
    finish = chunk({}, "stop", timings={"cache_n": 0, "prompt_n": TOTAL, "predicted_n": 2})
    return [event_bytes(chunk(delta)) for delta in deltas] + [event_bytes(finish)]


def slow_prompt(*after: Piece, end: Any = "close") -> Reply:
    """
    The headers at 0, then a progress event at the start and one at the end of each batch
    of L{slow_prompt}'s prompt, a minute apart, then C{after}, then C{[DONE]} when C{end} is
    C{"close"}.
    """
    pieces = [Piece(0 if n == 0 else MINUTE, progress(n * BATCH)) for n in range(BATCHES + 1)]
    return sse_reply([*pieces, *after], done=end == "close", end=end)


def working_slots(request: RecordedRequest, fake: FakeLlama) -> Reply:
    """
    C{/slots} as llama.cpp's server answers it during L{slow_prompt}'s prompt: the slot
    processing, C{n_prompt_tokens} counting the batch under way and
    C{n_prompt_tokens_processed} the batches done; neither moves within a batch.
    """
    done = min(int(fake.clock.seconds() // MINUTE), BATCHES)
    under_way = min(done + 1, BATCHES)
    return slots_reply(True, counters=(under_way * BATCH, done * BATCH, 0))


class PrefillTests(ChatTestCase):
    """
    Before the first delta (decision 44): a slot that /slots shows processing is alive though
    a batch of the prompt takes longer than liveness_ms; nothing advancing is still Stalled.
    With the shipped limits (liveness_ms 30 s, poll_ms 5 s) on the clock.
    """

    def run_prefill(self, h: Harness, chat: Reply, slots: ReplySource | None = None) -> Any:
        """Run the call on C{h} to its end, over the long clock of the shipped limits."""
        d = h.start(chat, slots)
        h.run_to_end(limit=3600)
        return d

    def test_batches_longer_than_liveness(self) -> None:
        """
        Batches a minute apart while /slots shows the slot processing and, batch by batch,
        advancing: the answer, with no stall; /slots asked 25 s into each silence and 25 s
        after each answer that showed it working, never reported as Waiting.
        """
        h = Harness(prefill_config())
        reply = slow_prompt(*(Piece(0, event) for event in answer_events({"content": "Hi"})))
        d = self.run_prefill(h, reply, working_slots)
        completion = self.assert_answered(h, d, BATCHES * MINUTE)
        self.assertEqual(completion.content, "Hi")
        self.assertEqual(h.of(Progress), [Progress(TOTAL, 0, n * BATCH) for n in range(4)])
        self.assertEqual(h.times(Progress), [0, 60, 120, 180])
        self.assertEqual(h.slots_polls(), [25, 50, 85, 110, 145, 170])
        self.assertEqual(h.of(Waiting), [])

    def test_nothing_advancing_stalls_within_liveness(self) -> None:
        """
        Silent after a progress event, and /slots shows nothing working: idle, hanging,
        answering 503, answering what is not slots, or cut. Stalled liveness_ms after the
        last byte, as before, saying what /slots showed; every connection closed.
        """
        hanging = dataclasses.replace(slots_reply(True), headers_delay=NEVER)
        cut = dataclasses.replace(slots_reply(True), end="cut")
        findings = [
            (slots_reply(False), "/slots shows the slot idle"),
            (hanging, "/slots has not answered"),
            (LOADING, "/slots failed"),
            (json_reply(200, {"not": "slots"}), "/slots answered badly"),
            (cut, "/slots failed"),
        ]
        for slots, finding in findings:
            h = Harness(prefill_config())
            d = self.run_prefill(h, stream([progress(0)], end="silence"), slots)
            error = self.assert_failed(h, d, Stalled, 30)
            self.assertTrue(str(error).startswith(f"no data for 30000 ms; {finding}"), error)
            self.assertEqual(h.slots_polls(), [25])
            self.assert_closed_by_client(h.chat_connection(), 30)

    def test_processing_without_advancing_is_bounded(self) -> None:
        """
        /slots shows the slot processing forever with the same counters and no byte comes:
        Stalled at the first poll prefill_stall_ms after the last byte.
        """
        h = Harness(prefill_config(prefill_stall_ms=100_000))
        d = self.run_prefill(h, stream([progress(0)], end="silence"), slots_reply(True))
        error = self.assert_failed(h, d, Stalled, 100)
        self.assertEqual(str(error), "slot processing but not advancing for 100000 ms")
        self.assertEqual(h.slots_polls(), [25, 50, 75, 100])

    def test_slots_counters_alone_show_advance(self) -> None:
        """
        No progress event at all, but /slots counters moving at each poll: alive. Once they
        stop (at 110 s), Stalled at the first poll prefill_stall_ms after the last move.
        """

        def moving(request: RecordedRequest, fake: FakeLlama) -> Reply:
            seconds = min(int(fake.clock.seconds()), 110)
            return slots_reply(True, counters=(seconds, seconds, 0))

        h = Harness(prefill_config(prefill_stall_ms=100_000))
        d = self.run_prefill(h, stream([], end="silence"), moving)
        self.assert_failed(h, d, Stalled, 225)
        self.assertEqual(h.slots_polls(), [25.0 * n for n in range(1, 10)])

    def test_first_delta_ends_prefill(self) -> None:
        """
        After the first piece of reasoning, content or a tool call the plain liveness limit
        applies: silence liveness_ms after it is Stalled, though /slots shows the slot
        processing, and /slots is not asked.
        """
        call = {"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {}}]}
        deltas: list[dict[str, Any]] = [{"content": "Hi"}, {"reasoning_content": "Hm"}, call]
        for delta in deltas:
            h = Harness(prefill_config())
            reply = slow_prompt(Piece(0, event_bytes(chunk(delta))), end="silence")
            d = self.run_prefill(h, reply, working_slots)
            error = self.assert_failed(h, d, Stalled, BATCHES * MINUTE + 30)
            self.assertEqual(str(error), "no data for 30000 ms")
            self.assertEqual(h.slots_polls(), [25, 50, 85, 110, 145, 170])

    def test_byte_drops_the_poll(self) -> None:
        """A progress event while a poll is out: the poll is closed, its answer unheard."""
        h = Harness(prefill_config())
        slow = dataclasses.replace(slots_reply(False), headers_delay=3)
        pieces = [Piece(0, progress(0)), Piece(26, progress(TOTAL))]
        pieces += [Piece(0, event) for event in answer_events({"content": "Hi"})]
        d = self.run_prefill(h, sse_reply(pieces), slow)
        self.assertEqual(self.assert_answered(h, d, 26).content, "Hi")
        [poll] = h.fake.requests_to("GET", SLOTS)
        self.assertEqual(at(poll.received_at), 25)
        self.assert_closed_by_client(poll.connection, 26)

    def test_slots_unavailable_keeps_old_rule(self) -> None:
        """
        /slots not there (404, or 501 from a server run with --no-slots): Stalled
        liveness_ms after the last byte, as before; the call asks it once only.
        """
        no_slots = error_reply(501, "not_supported_error", "This server does not support slots")
        for slots, status in [(NOT_FOUND, 404), (no_slots, 501)]:
            h = Harness(prefill_config())
            pieces = [Piece(0, progress(0)), Piece(28, progress(BATCH))]
            d = self.run_prefill(h, sse_reply(pieces, done=False, end="silence"), slots)
            error = self.assert_failed(h, d, Stalled, 58)
            unavailable = f"/slots is not available (HTTP {status})"
            self.assertEqual(str(error), f"no data for 30000 ms; {unavailable}")
            self.assertEqual(h.slots_polls(), [25])

    def test_slots_unavailable_old_times(self) -> None:
        """A whole minute-long batch without /slots: Stalled at liveness_ms, as before."""
        h = Harness(prefill_config())
        d = self.run_prefill(h, slow_prompt(), NOT_FOUND)
        self.assert_failed(h, d, Stalled, 30)
        self.assertEqual(h.of(), [Progress(TOTAL, 0, 0)])

    def test_openai_plain_liveness(self) -> None:
        """An openai endpoint: a minute's silence after the headers, Stalled at liveness_ms."""
        h = Harness(prefill_config(kind="openai"))
        d = self.run_prefill(h, slow_prompt(), working_slots)
        self.assertEqual(str(self.assert_failed(h, d, Stalled, 30)), "no data for 30000 ms")
        self.assertEqual([r.path for r in h.fake.requests], [CHAT])

    def test_request_slot_decides(self) -> None:
        """
        Slot 1 processing, slot 0 idle: a request pinned to slot 0 is Stalled, one that let
        the server choose (slot -1) is alive, since the server did not say which it chose.
        """
        for slot, alive in [(0, False), (-1, True)]:
            h = Harness(prefill_config(), ChatRequest(slot=slot, messages=(User("Hi"),)))
            reply = slow_prompt(*(Piece(0, event) for event in answer_events({"content": "Hi"})))
            d = self.run_prefill(h, reply, slots_reply([False, True]))
            if alive:
                self.assertEqual(self.assert_answered(h, d, 180).content, "Hi")
            else:
                self.assert_failed(h, d, Stalled, 30)

    def test_cancel_during_poll(self) -> None:
        """Cancelled while a prefill poll is out: CancelledError, both connections closed."""
        h = Harness(prefill_config())
        hanging = dataclasses.replace(slots_reply(True), headers_delay=NEVER)
        d = h.start(slow_prompt(), hanging)
        h.net.run_to(27)
        [poll] = h.fake.requests_to("GET", SLOTS)
        self.assertTrue(poll.connection.open)
        d.cancel()
        self.assert_failed(h, d, CancelledError, 27)
        self.assert_closed_by_client(h.chat_connection(), 27)
        self.assert_closed_by_client(poll.connection, 27)

    def test_paused_flow(self) -> None:
        """
        A flow paused while a poll is out: the poll is closed, and nothing is asked or judged
        while paused, however long. From the resume liveness counts afresh and /slots (slow
        to answer, 3 s) shows the slot processing again until the prompt is done.
        """
        flow = Flow()
        h = Harness(prefill_config(), flow=flow)
        slow = dataclasses.replace(slots_reply(True), headers_delay=3)
        pieces = [Piece(0, progress(0)), Piece(1100, progress(TOTAL))]
        pieces += [Piece(0, event) for event in answer_events({"content": "Hi"})]
        d = h.start(sse_reply(pieces), slow)
        h.net.run_to(26)
        flow.pauseProducing()
        h.net.pump()
        [poll] = h.fake.requests_to("GET", SLOTS)
        self.assert_closed_by_client(poll.connection, 26)
        h.net.run_to(1000)
        self.assertNoResult(d)
        flow.resumeProducing()
        h.run_to_end(limit=3600)
        self.assertEqual(self.assert_answered(h, d, 1100).content, "Hi")
        self.assertEqual(h.slots_polls(), [25, 1025, 1053, 1081])
