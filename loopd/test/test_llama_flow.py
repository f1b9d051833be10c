"""
Tests for L{loopd.llama.flow}, backpressure through the llama client: the L{Flow} alone;
chats with a flow on a clock against the fake llama-server in memory; and one chat over a
real Unix socket whose upstream is a push producer, paused when loopd stops reading.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http import HTTPChannel, Request
from zope.interface import implementer
from zope.interface.verify import verifyObject

from loopd.errors import Http, Stalled
from loopd.llama import ChatEvent, ChatRequest, Client, Completion, Content, Retrying, User
from loopd.llama.chat import ChatCall
from loopd.llama.flow import Flow, IFlowReader
from loopd.settings import Config, Endpoint, Limits, Retry
from loopd.test.support.peers import real_reactor
from loopd.test.support.streaming import ReadCounter, StreamingUpstream
from loopd.testing.fake_llama import (
    CHAT,
    FakeLlama,
    Piece,
    event_bytes,
    json_reply,
    sse_reply,
)
from loopd.testing.llama_replies import template_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

#: Where the fake listens; MemoryNet never touches the file system.
PATH = "/tmp/ld-memory/llama.sock"

#: The stream's headers come at once: only liveness (and poll_ms, the connect timeout) count.
LIMITS = Limits(poll_ms=100, liveness_ms=100)
#: Waits of 50, 100 and 200 ms before retries 1, 2 and 3, without jitter (random is 0.5).
RETRY = Retry(attempts=4, backoff_ms=(50, 100, 200), jitter=0.25, total_ms=300_000)


def make_config(socket: str = PATH, limits: Limits = LIMITS) -> Config:
    """A config with one llama-server endpoint at C{socket}."""
    endpoint = Endpoint(name="tiny", socket=socket, model="tiny")
    return Config(endpoints=(endpoint,), limits=limits, retry=RETRY)


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """One streamed chat-completion chunk as llama-server sends it."""
    choice = {"finish_reason": finish, "index": 0, "delta": delta}
    out: dict[str, Any] = {"choices": [choice], "id": "chatcmpl-1"}
    out["object"] = "chat.completion.chunk"
    if finish is not None:
        out["timings"] = {"cache_n": 3, "prompt_n": 10, "predicted_n": 2}
    return out


def content(text: str, delay_s: float) -> Piece:
    """A content delta sent C{delay_s} after the write before it."""
    return Piece(delay_s, event_bytes(chunk({"content": text})))


def finish(delay_s: float) -> Piece:
    """The chunk with the finish_reason, sent C{delay_s} after the write before it."""
    return Piece(delay_s, event_bytes(chunk({}, "stop")))


def sha256(text: str) -> str:
    """The SHA-256 of C{text} in UTF-8, as hex."""
    return hashlib.sha256(text.encode()).hexdigest()


def request() -> ChatRequest:
    """A one-message chat request pinned to slot 0."""
    return ChatRequest(slot=0, messages=(User("Hi"),))


@implementer(IFlowReader)
class RecordingReader:
    """An L{IFlowReader} that records what its flow told it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def cancel(self) -> None:
        self.calls.append("cancel")


class FlowTests(SynchronousTestCase):
    """The flow on its own: what reaches its readers and when."""

    def test_provides(self) -> None:
        """A Flow is an IPushProducer, and a chat call is an IFlowReader."""
        self.assertTrue(verifyObject(IPushProducer, Flow()))
        config = make_config()
        call = ChatCall(MemoryLoopdReactor(), config, config.endpoints[0], request(), print)
        self.assertTrue(verifyObject(IFlowReader, call))

    def test_pause_and_resume_reach_every_reader(self) -> None:
        """Pausing and resuming reach each attached reader once, however often repeated."""
        flow, first, second = Flow(), RecordingReader(), RecordingReader()
        flow.attach(first)
        flow.attach(second)
        flow.attach(first)
        self.assertEqual(flow.readers, (first, second))
        for step in (flow.pauseProducing, flow.pauseProducing, flow.resumeProducing):
            step()
        flow.resumeProducing()
        self.assertEqual((first.calls, second.calls), (["pause", "resume"], ["pause", "resume"]))
        self.assertFalse(flow.paused)

    def test_attach_while_paused(self) -> None:
        """A reader attached to a paused flow is paused at once; a detached one hears nothing."""
        flow, early, late = Flow(), RecordingReader(), RecordingReader()
        flow.attach(early)
        flow.pauseProducing()
        flow.detach(early)
        flow.detach(early)
        flow.attach(late)
        flow.resumeProducing()
        self.assertEqual((early.calls, late.calls), (["pause"], ["pause", "resume"]))
        self.assertEqual(flow.readers, (late,))

    def test_stop(self) -> None:
        """Stopping cancels the attached readers and any attached later; then nothing more."""
        flow, attached, later = Flow(), RecordingReader(), RecordingReader()
        flow.attach(attached)
        flow.stopProducing()
        flow.attach(later)
        flow.pauseProducing()
        flow.resumeProducing()
        flow.stopProducing()
        self.assertEqual((attached.calls, later.calls), (["cancel"], ["cancel"]))
        self.assertEqual((flow.readers, flow.stopped), ((), True))

    def test_registered_on_web_request(self) -> None:
        """
        Registered on a twisted.web request, the flow is paused and resumed with the
        connection's send buffer and stopped when the connection goes.
        """
        channel = HTTPChannel()
        channel.makeConnection(StringTransport())
        flow, reader = Flow(), RecordingReader()
        Request(channel).registerProducer(flow, True)
        flow.attach(reader)
        # What the transport does when its buffer fills, drains, and the connection goes.
        channel.pauseProducing()
        self.assertTrue(flow.paused)
        channel.resumeProducing()
        channel.stopProducing()
        self.assertEqual(reader.calls, ["pause", "resume", "cancel"])


class Chat:
    """One chat started on the client: its Deferred and the events it heard."""

    def __init__(self, start: Callable[..., Deferred[Completion]]) -> None:
        self.events: list[ChatEvent] = []
        self.deferred = start(self.events.append)

    @property
    def content(self) -> str:
        """The content deltas heard so far, joined."""
        return "".join(e.text for e in self.events if isinstance(e, Content))


class ChatFlowTestCase(SynchronousTestCase):
    """A client with a flow, talking to the scripted fake llama-server in memory."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)
        config = make_config()
        self.client = Client(self.reactor, config, config.endpoints[0], random=lambda: 0.5)
        self.flow = Flow()

    def chat(self) -> Chat:
        """Start one attempt with the test's flow."""
        return Chat(lambda sink: self.client.chat(request(), sink, flow=self.flow))

    def chat_with_retry(self, **options: Any) -> Chat:
        """Start a chat with retries, the test's flow and C{options}."""
        retry = self.client.chat_with_retry
        return Chat(lambda s: retry(request(), s, flow=self.flow, **options))

    def assert_quiet(self) -> None:
        """No timer is left, every connection is closed and the flow holds no reader."""
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.net.open_connections(), [])
        self.assertEqual(self.flow.readers, ())


class LivenessTests(ChatFlowTestCase):
    """While the flow is paused the liveness limit (100 ms) is suspended."""

    def test_paused_from_the_start(self) -> None:
        """Paused from its start, a stream never stalls; after the resume, 100 ms of silence do."""
        self.fake.script("POST", CHAT, sse_reply([content("a", 0.05)], end="silence"))
        self.flow.pauseProducing()
        call = self.chat()
        self.net.advance(0.01)
        self.assertEqual(len(self.flow.readers), 1)
        self.net.advance(10)
        self.assertNoResult(call.deferred)
        # Bytes already read are still delivered while paused.
        self.assertEqual(call.content, "a")
        self.flow.resumeProducing()
        self.net.advance(0.099)
        self.assertNoResult(call.deferred)
        self.net.advance(0.001)
        self.failureResultOf(call.deferred, Stalled)
        self.assert_quiet()

    def test_paused_mid_stream(self) -> None:
        """Data arriving while paused is delivered; the limit still counts from the resume."""
        pieces = [content("a", 0.05), content("b", 0.1), content("c", 0.9), finish(0.2)]
        self.fake.script("POST", CHAT, sse_reply(pieces, delay_s=0.05))
        call = self.chat()
        self.net.run_to(0.06)
        self.flow.pauseProducing()
        self.net.run_to(0.5)
        self.assertNoResult(call.deferred)
        self.assertEqual(call.content, "ab")
        self.flow.resumeProducing()
        # Unpaused, the silence after "b" (150 ms) would have stalled the call at 250 ms;
        # paused, the limit counts from the resume and ends it at 600 ms, before "c" (1.05 s).
        self.net.run_to(0.599)
        self.assertNoResult(call.deferred)
        self.net.run_to(0.6)
        self.failureResultOf(call.deferred, Stalled)
        self.assert_quiet()


class RetryFlowTests(ChatFlowTestCase):
    """Each attempt of chat_with_retry attaches to the flow in the flow's state."""

    def setUp(self) -> None:
        super().setUp()
        # A resumed answer's continuation is rendered first (loopd.llama.resume).
        self.fake.set_default("POST", "/apply-template", template_reply())

    def test_retry_starts_paused(self) -> None:
        """
        A flow paused during the backoff wait pauses the next attempt from its start: its
        silence of a second is not Stalled, and the answer after it completes the chat.
        """
        late = sse_reply([content("ok", 1.0), finish(0.01)])
        self.fake.script("POST", CHAT, sse_reply([content("par", 0.01)], done=False), late)
        call = self.chat_with_retry()
        self.net.run_to(0.02)
        self.assertEqual(self.flow.readers, ())
        self.flow.pauseProducing()
        self.net.run_to(0.5)
        self.assertEqual(len(self.flow.readers), 1)
        self.net.advance(1)
        # "par" was delivered, so the retry continued it.
        self.assertEqual(self.successResultOf(call.deferred).content, "parok")
        self.assertEqual(len(self.fake.requests_to("POST", CHAT)), 2)
        self.assertEqual(len([e for e in call.events if isinstance(e, Retrying)]), 1)
        self.assert_quiet()

    def test_retry_starts_resumed(self) -> None:
        """A flow resumed during the backoff wait lets the next attempt stall in 100 ms."""
        silent = sse_reply([content("a", 0.0)], end="silence")
        self.fake.script("POST", CHAT, sse_reply([content("par", 0.01)], done=False), silent)
        self.flow.pauseProducing()
        call = self.chat_with_retry(retryable=lambda e: not isinstance(e, Stalled))
        self.net.run_to(0.02)
        self.flow.resumeProducing()
        # The first attempt ends at 10 ms, the second starts 50 ms later and stalls 100 ms on.
        self.net.run_to(0.159)
        self.assertEqual(len(self.fake.requests_to("POST", CHAT)), 2)
        self.assertNoResult(call.deferred)
        self.net.run_to(0.16)
        self.failureResultOf(call.deferred, Stalled)
        self.assert_quiet()


class DetachTests(ChatFlowTestCase):
    """A chat call detaches from its flow however it ends."""

    def test_attached_while_streaming(self) -> None:
        """The call attaches when the stream's headers arrive and detaches on completion."""
        reply = sse_reply([content("ok", 0.05), finish(0.05)], headers_delay=0.05)
        self.fake.script("POST", CHAT, reply)
        call = self.chat()
        self.net.run_to(0.049)
        self.assertEqual(self.flow.readers, ())
        self.net.run_to(0.05)
        self.assertEqual(len(self.flow.readers), 1)
        self.net.advance(1)
        self.successResultOf(call.deferred)
        self.assert_quiet()

    def test_error_event(self) -> None:
        """An error event ends the call with Http, detached (the liveness tests: Stalled)."""
        error = {"error": {"code": 500, "message": "boom", "type": "server_error"}}
        self.fake.script("POST", CHAT, sse_reply([content("a", 0.01), error], done=False))
        call = self.chat()
        self.net.advance(1)
        self.failureResultOf(call.deferred, Http)
        self.assert_quiet()

    def test_error_status_never_attaches(self) -> None:
        """An error status is read under its cap without attaching: no consumer needs it."""
        error = {"error": {"code": 400, "message": "no", "type": "invalid_request_error"}}
        self.fake.script("POST", CHAT, json_reply(400, error, delay_s=0.05))
        self.flow.pauseProducing()
        call = self.chat()
        self.net.run_to(0.01)
        self.assertEqual(self.flow.readers, ())
        self.net.advance(1)
        self.assertEqual(self.failureResultOf(call.deferred, Http).value.status, 400)
        self.assert_quiet()

    def test_cancel(self) -> None:
        """Cancelling a paused chat detaches it and closes its connection."""
        self.fake.script("POST", CHAT, sse_reply([content("a", 0.01)], end="silence"))
        self.flow.pauseProducing()
        call = self.chat()
        self.net.advance(1)
        self.assertEqual(len(self.flow.readers), 1)
        call.deferred.cancel()
        self.failureResultOf(call.deferred, CancelledError)
        self.net.pump()
        self.assertTrue(self.fake.connections[0].client_closed)
        self.assert_quiet()

    def test_stopped_flow_cancels(self) -> None:
        """
        Stopping the flow cancels the streaming chat (its connection closed, its slot
        free); a chat started on the stopped flow fails at once and sends nothing.
        """
        self.fake.script("POST", CHAT, sse_reply([content("a", 0.01)], end="silence"))
        call = self.chat()
        self.net.advance(0.05)
        self.flow.stopProducing()
        self.failureResultOf(call.deferred, CancelledError)
        self.net.pump()
        self.assertTrue(self.fake.connections[0].client_closed)
        self.assertFalse(self.client.gate.in_flight(0))
        late = self.chat()
        self.failureResultOf(late.deferred, CancelledError)
        self.net.pump()
        self.assertEqual(len(self.fake.requests_to("POST", CHAT)), 1)
        self.assert_quiet()


#: The real-socket answer: 256 content deltas of 16 KiB, 4 MiB in all.
PIECES = 256
PIECE_CHARS = 16 * 1024


class SocketFlowTests(TestCase):
    """Backpressure over a real Unix socket, on the real reactor."""

    timeout = 60

    @inlineCallbacks
    def test_paused_flow_pauses_the_upstream(self) -> Any:
        """
        With the flow paused before the chat starts, the upstream's transport pauses it
        while loopd has read well under 1 MiB; after the resume the completion holds every
        byte of the 4 MiB answer.
        """
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "llama.sock")
        texts = [os.urandom(PIECE_CHARS // 2).hex() for _ in range(PIECES)]
        reply = sse_reply([chunk({"content": text}) for text in texts] + [chunk({}, "stop")])
        wire = [reply.render_head(), *(reply.frame(p.data) for p in reply.pieces), b"0\r\n\r\n"]
        total = sum(map(len, wire))
        engaged: Deferred[None] = Deferred()
        closed: Deferred[None] = Deferred()
        # One connection is expected: a second one would find this one's state and fail.
        upstream = StreamingUpstream(reactor, wire, engaged, closed)
        port = reactor.listenUNIX(path, Factory.forProtocol(lambda: upstream))
        self.addCleanup(port.stopListening)
        counter = ReadCounter(self.patch)
        config = make_config(path, Limits())
        client = Client(reactor, config, config.endpoints[0])
        flow = Flow()
        flow.pauseProducing()
        completion = client.chat(request(), lambda event: None, flow=flow)

        def too_early(result: object) -> object:
            # A flow that does not pause the read lets the whole answer through unpaused.
            if not engaged.called:
                engaged.errback(Failure(AssertionError("the answer came while paused")))
            return result

        completion.addBoth(too_early)
        yield engaged
        self.assertLess(counter.read, 256 * 1024)
        self.assertLess(upstream.sent, total // 2)
        flow.resumeProducing()
        answer = yield completion
        yield closed
        self.assertEqual(upstream.sent, total)
        self.assertEqual(len(answer.content), PIECES * PIECE_CHARS)
        # Compared by digest: a failing assertEqual would print 4 MiB twice.
        self.assertEqual(sha256(answer.content), sha256("".join(texts)))
        self.assertEqual(flow.readers, ())
