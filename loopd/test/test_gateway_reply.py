"""
Tests for L{loopd.gateway.reply}: an exchange's answer to its client by phase, the same for
an endpoint's answer and a mesh turn's.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from loopd.gateway.reply import Phase, Reply
from loopd.llama import Flow


class _Exchange:
    """An exchange under way (the daemon's stop would call L{shutdown})."""

    def shutdown(self) -> None:
        """Nothing to stop."""


class _Request(DummyRequest):
    """
    A request whose client can go away (L{DummyRequest} never fails notifyFinish) and
    which keeps the producer registered (L{DummyRequest} would pull from it in a loop).
    """

    def __init__(self) -> None:
        super().__init__([b""])
        self.gone: Deferred[None] = Deferred()
        self.producer: object = None

    def notifyFinish(self) -> Deferred[None]:
        return self.gone

    def registerProducer(self, producer: object, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None


class ReplyTests(SynchronousTestCase):
    """L{Reply}."""

    def setUp(self) -> None:
        """A request, its exchange, the daemon's list of exchanges and a reply watched."""
        self.request = _Request()
        self.exchange = _Exchange()
        self.in_flight: set[object] = set()
        self.gone: list[str] = []
        self.reply = Reply(self.request, self.exchange, self.in_flight)  # type: ignore[arg-type]
        self.reply.watch(lambda: self.gone.append("gone"))

    def test_watch(self) -> None:
        """Watching counts the exchange under way; the reply is quiet."""
        self.assertEqual(self.in_flight, {self.exchange})
        self.assertIs(self.reply.phase, Phase.QUIET)
        self.assertFalse(self.reply.done)

    def test_open_once(self) -> None:
        """The stream opens once: its headers and opening, then nothing more on a second."""
        self.reply.open_stream(b"first", [(b"x-moa-turn", b"fanout")])
        self.reply.open_stream(b"second", [(b"x-other", b"1")])
        self.assertIs(self.reply.phase, Phase.STREAMING)
        self.assertEqual(self.request.responseCode, 200)
        headers = self.request.responseHeaders
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        self.assertEqual(headers.getRawHeaders(b"x-moa-turn"), [b"fanout"])
        self.assertFalse(headers.hasHeader(b"x-other"))
        self.assertEqual(self.request.written, [b"first"])

    def test_error_before_the_stream(self) -> None:
        """Before the stream opened, an error is a status with its body and headers."""
        self.reply.fail(
            lambda: b"event",
            lambda: self.reply.respond(502, {"error": "x"}, [(b"x-a", b"1")], with_length=True),
        )
        self.assertEqual(self.request.responseCode, 502)
        self.assertEqual(self.request.written, [b'{"error":"x"}'])
        self.assertEqual(self.request.responseHeaders.getRawHeaders(b"content-length"), [b"13"])
        self.assertEqual(self.request.finished, 1)
        self.assertTrue(self.reply.done)
        self.assertEqual(self.in_flight, set())

    def test_error_after_the_stream(self) -> None:
        """Once streaming, an error is the door's error event, which ends the stream."""
        self.reply.open_stream(b"open")
        self.reply.fail(lambda: b"event", lambda: self.fail("no status once streaming"))
        self.assertEqual(self.request.written, [b"open", b"event"])
        self.assertEqual(self.request.finished, 1)
        self.assertEqual(self.in_flight, set())

    def test_nothing_after_done(self) -> None:
        """A reply that ended answers no later error and opens no stream."""
        self.reply.respond(200, {})
        self.reply.fail(lambda: b"event", lambda: self.fail("answered twice"))
        self.reply.open_stream(b"open")
        self.assertEqual(self.request.written, [b"{}"])
        self.assertIs(self.reply.phase, Phase.DONE)

    def test_client_gone(self) -> None:
        """
        The client going away ends the reply (done, no longer under way) and calls the
        exchange's C{gone} once; the client going after the end calls nothing.
        """
        self.request.gone.errback(Failure(ConnectionError("gone")))
        self.assertEqual(self.gone, ["gone"])
        self.assertTrue(self.reply.done)
        self.assertEqual(self.in_flight, set())

    def test_client_gone_after_the_end(self) -> None:
        """The connection lost after the answer ended is no departure."""
        self.reply.respond(200, {})
        self.request.gone.errback(Failure(ConnectionError("gone")))
        self.assertEqual(self.gone, [])

    def test_flow(self) -> None:
        """A streaming reply's flow is registered by watching and unregistered at the end."""
        request = _Request()
        flow = Flow()
        reply = Reply(request, self.exchange, self.in_flight, flow)  # type: ignore[arg-type]
        reply.watch(lambda: None)
        self.assertIs(request.producer, flow)
        reply.open_stream(b"")
        reply.finish(b"last")
        self.assertIsNone(request.producer)
        self.assertEqual(request.written, [b"", b"last"])
