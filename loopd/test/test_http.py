"""
L{loopd.http}: one HTTP/1.1 request per Unix-socket connection, size caps, cancel and abort.

Most tests run in memory: the connection that L{request} asks a C{MemoryReactorClock} for is
made over a C{StringTransport}, and the test plays the server by feeding raw response bytes,
split wherever it likes. A few run over real Unix sockets in a short temp directory.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.address import UNIXAddress
from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

import loopd
from loopd.errors import Connect, ProxyRefused, StreamClosedEarly
from loopd.errors import Protocol as ProtocolError
from loopd.http import HttpCaps, HttpResponse, request
from loopd.test.support.peers import Peer, UpstreamFactory, real_reactor

SOCKET = "/tmp/ld-nowhere/infer.sock"

#: A real llama-server stream body (chunked framing removed), see fixtures/sse/README.md.
STREAM = (
    Path(loopd.__file__).resolve().parent.parent / "fixtures" / "sse" / "chat-nothink-stream.sse"
).read_bytes()

#: The headers llama-server sends with a stream (llama-server-api.md, section 1.1).
STREAM_HEADERS = (
    "Server: llama.cpp",
    "Access-Control-Allow-Origin: ",
    "Content-Type: text/event-stream",
    "Transfer-Encoding: chunked",
    "X-Accel-Buffering: no",
    "Connection: close",
)


def head(*headers: str, status: str = "200 OK") -> bytes:
    """A response's header block: status line, header lines, empty line."""
    return ("\r\n".join([f"HTTP/1.1 {status}", *headers]) + "\r\n\r\n").encode("latin-1")


def chunked(*parts: bytes) -> bytes:
    """C{parts} in chunked transfer coding, one chunk each, then the terminating chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


def events(body: bytes) -> list[bytes]:
    """An SSE body cut after each event, as llama-server writes one chunk per event."""
    pieces = re.findall(rb".*?\n\n", body, re.S)
    assert b"".join(pieces) == body
    return pieces


def padded_head(size: int, line_bytes: int = 1 << 20) -> bytes:
    """A header block of exactly C{size} bytes, padded with lines of about C{line_bytes}."""
    remaining = size - len(head("Content-Length: 2"))
    lines: list[str] = []
    while remaining > 0:
        take = remaining if remaining < 2 * line_bytes else line_bytes
        name = f"X-Pad-{len(lines):05d}: "
        lines.append(name + "a" * (take - len(name) - 2))
        remaining -= take
    block = head("Content-Length: 2", *lines)
    assert len(block) == size
    return block


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """C{data} cut at each offset in C{cuts}."""
    points = [0, *sorted(set(cuts)), len(data)]
    return [data[a:b] for a, b in pairwise(points) if b > a]


class Wire:
    """One request in memory: its reactor, its connection and the bytes the client sent."""

    def __init__(self, *args: Any, connect: bool = True, **options: Any) -> None:
        """Send C{request(reactor, SOCKET, *args, **options)}, by default a GET of /health."""
        self.reactor = MemoryReactorClock()
        self.result = request(self.reactor, SOCKET, *(args or ("GET", "/health")), **options)
        if connect:
            self.connect()

    def connect(self) -> None:
        """Complete the connection the client asked the reactor for."""
        address, factory, _timeout, _check_pid = self.reactor.unixClients[0]
        self.protocol = factory.buildProtocol(UNIXAddress(address))
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)

    def feed(self, *pieces: bytes) -> None:
        """Deliver response bytes to the client, one read per piece."""
        for piece in pieces:
            self.protocol.dataReceived(piece)

    def close(self, reason: type[Exception] = ConnectionDone) -> None:
        """The connection ends, cleanly (C{ConnectionDone}) or not."""
        self.protocol.connectionLost(Failure(reason()))

    def answer(self, *pieces: bytes) -> HttpResponse:
        """Feed C{pieces}, which complete the response headers, and take the response."""
        self.feed(*pieces)
        fired: list[Any] = []
        self.result.addBoth(fired.append)
        assert isinstance(fired[0], HttpResponse), fired
        return fired[0]

    def sent(self) -> tuple[str, dict[str, str], bytes]:
        """The request the client wrote: its request line, headers (lower-case names) and body."""
        head_bytes, _, body = self.transport.value().partition(b"\r\n\r\n")
        line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
        headers = {}
        for header in header_lines:
            name, _, value = header.partition(": ")
            headers[name.lower()] = value
        return line, headers, body


def collect(response: HttpResponse) -> tuple[list[bytes], Deferred[None]]:
    """Start delivering C{response}'s body into a list."""
    pieces: list[bytes] = []
    return pieces, response.deliver(pieces.append)


class RequestTests(SynchronousTestCase):
    """The bytes L{request} sends, and where."""

    def test_post(self):
        """A POST carries its method, path, Host, Connection: close, length, type and body."""
        wire = Wire("POST", "/v1/chat/completions", b'{"a": 1}')
        line, headers, body = wire.sent()
        self.assertEqual((line, body), ("POST /v1/chat/completions HTTP/1.1", b'{"a": 1}'))
        expected = {"host": "llama", "connection": "close", "content-length": "8"}
        self.assertEqual(headers, {**expected, "content-type": "application/json"})
        self.assertEqual([c[0] for c in wire.reactor.unixClients], [SOCKET])

    def test_get(self):
        """A GET without a body sends no Content-Type and no Content-Length."""
        line, headers, body = Wire("GET", "/slots?fail_on_no_slot=1").sent()
        self.assertEqual((line, body), ("GET /slots?fail_on_no_slot=1 HTTP/1.1", b""))
        self.assertEqual(headers, {"host": "llama", "connection": "close"})

    def test_extra_headers(self):
        """Extra headers are sent, and a caller's Content-Type replaces the default."""
        extra = {"Accept": "text/event-stream", "Content-Type": "x/y"}
        _, headers, _ = Wire("POST", "/tokenize", b"{}", extra).sent()
        self.assertEqual((headers["accept"], headers["content-type"]), tuple(extra.values()))

    def test_bad_arguments(self):
        """A reserved header, a target without a slash, a zero timeout or cap is refused."""
        reactor = MemoryReactorClock()
        for name in ("host", "Connection", "CONTENT-LENGTH", "Transfer-Encoding"):
            self.assertRaises(ValueError, request, reactor, SOCKET, "GET", "/", None, {name: "x"})
        self.assertRaises(ValueError, request, reactor, SOCKET, "GET", "health")
        self.assertRaises(ValueError, request, reactor, SOCKET, "GET", "/", connect_timeout=0)
        self.assertRaises(ValueError, HttpCaps, header_bytes=0)
        self.assertEqual(reactor.unixClients, [])


class ResponseTests(SynchronousTestCase):
    """Status, headers, the three kinds of body, and the ways a response breaks."""

    def test_status_and_headers(self):
        """Header names are lower case, a repeated header keeps its last value, all included."""
        wire = Wire()
        response = wire.answer(head("X-A: 1", "x-a: 2", "Content-Length: 0", status="503 No"))
        self.assertEqual(response.status, 503)
        self.assertEqual(response.headers, {"x-a": "2", "content-length": "0"})
        self.assertIsNone(self.successResultOf(collect(response)[1]))
        self.assertRaises(RuntimeError, response.read_body)

    @given(
        framing=st.sampled_from(["chunked", "length", "close"]),
        cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
    )
    def test_any_split(self, framing, cuts):
        """Chunked, Content-Length and read-to-close bodies arrive whole however they are split."""
        if framing == "chunked":
            raw = head(*STREAM_HEADERS) + chunked(*events(STREAM))
        elif framing == "length":
            raw = head(f"Content-Length: {len(STREAM)}") + STREAM
        else:
            raw = head("Content-Type: text/event-stream") + STREAM
        wire = Wire("POST", "/v1/chat/completions", b"{}")
        pieces: list[bytes] = []
        done = wire.result.addCallback(lambda response: response.deliver(pieces.append))
        wire.feed(*split(raw, cuts))
        if framing == "close":
            self.assertNoResult(done)
            wire.close()
        else:
            # A framed body ends at its framing, and the client then closes.
            self.assertTrue(wire.transport.disconnecting)
        self.assertIsNone(self.successResultOf(done))
        self.assertEqual(b"".join(pieces), STREAM)

    def test_read_to_close_reset(self):
        """A body without framing ended by a reset, not a clean close, was cut."""
        wire = Wire()
        _, done = collect(wire.answer(head(), b"half"))
        wire.close(ConnectionLost)
        self.failureResultOf(done, StreamClosedEarly)

    def test_closed_before_headers(self):
        """A connection closed before any byte or inside the header block: StreamClosedEarly."""
        for received in (b"", head(*STREAM_HEADERS)[:-3]):
            wire = Wire()
            wire.feed(received)
            wire.close()
            failure = self.failureResultOf(wire.result, StreamClosedEarly)
            self.assertTrue(failure.value.before_headers)

    def test_body_cut(self):
        """A chunked or Content-Length body cut short is StreamClosedEarly after what came."""
        size_line = b"%x\r\n" % len(STREAM)
        for response_head, cut, arrived in (
            (head(*STREAM_HEADERS), chunked(STREAM)[:999], STREAM[: 999 - len(size_line)]),
            (head("Content-Length: 9"), b"hi", b"hi"),
        ):
            wire = Wire()
            pieces, done = collect(wire.answer(response_head))
            wire.feed(cut)
            wire.close()
            failure = self.failureResultOf(done, StreamClosedEarly)
            self.assertFalse(failure.value.before_headers)
            self.assertEqual(b"".join(pieces), arrived)

    def test_malformed(self):
        """A status line or chunked framing that does not parse is Protocol."""
        wire = Wire()
        wire.feed(b"HTTP/1.1 two hundred\r\n\r\n")
        self.failureResultOf(wire.result, ProtocolError)
        wire = Wire()
        _, done = collect(wire.answer(head("Transfer-Encoding: chunked")))
        wire.feed(b"zz\r\nhello\r\n")
        self.failureResultOf(done, ProtocolError)

    def test_consumer_raises(self):
        """When on_data raises, the connection is aborted and deliver fails with that error."""
        wire = Wire()
        response = wire.answer(head(*STREAM_HEADERS))
        done = response.deliver(lambda data: [][len(data)])
        wire.feed(chunked(b"one", b"two"))
        self.failureResultOf(done, IndexError)
        self.assertTrue(wire.transport.disconnected)


class CapTests(SynchronousTestCase):
    """The header block is capped at 16 KiB in total; a body read whole at 4 MiB."""

    @given(
        over=st.booleans(),
        line_bytes=st.sampled_from([3000, 1 << 20]),
        cuts=st.lists(st.integers(min_value=0, max_value=16400), max_size=8),
    )
    def test_exact_cap_any_split(self, over, line_bytes, cuts):
        """16384 header bytes are accepted, 16385 are Protocol and abort, however split."""
        wire = Wire()
        wire.feed(*split(padded_head(16384 + over, line_bytes) + b"ok", cuts))
        if over:
            self.failureResultOf(wire.result, ProtocolError)
            self.assertTrue(wire.transport.disconnected)
        else:
            body = self.successResultOf(wire.result).read_body()
            self.assertEqual(self.successResultOf(body), b"ok")

    def test_total_not_per_line(self):
        """Short header lines adding up to more than the cap are refused, ended or not."""
        for received in (padded_head(16385, 80), head()[:-2] + b"X-More: bbbbbbbb\r\n" * 2000):
            wire = Wire()
            wire.feed(received)
            self.failureResultOf(wire.result, ProtocolError)
            self.assertTrue(wire.transport.disconnected)

    def test_interim_counts(self):
        """An interim 100 response is skipped, and its bytes count toward the cap."""
        interim = b"HTTP/1.1 100 Continue\r\n\r\n"
        wire = Wire()
        self.assertEqual(wire.answer(interim + padded_head(16384 - len(interim))).status, 200)
        wire = Wire()
        wire.feed(interim + padded_head(16385 - len(interim)))
        self.failureResultOf(wire.result, ProtocolError)

    def test_configured_cap(self):
        """The cap is HttpCaps's, also above Twisted's own 16 KiB limit on one header line."""
        wire = Wire(caps=HttpCaps(header_bytes=200))
        wire.feed(padded_head(201))
        self.failureResultOf(wire.result, ProtocolError)
        self.assertEqual(
            Wire(caps=HttpCaps(header_bytes=40000)).answer(padded_head(40000)).status, 200
        )

    def test_body_cap(self):
        """4 MiB exactly is read; one byte more is Protocol and aborts the connection."""
        block = b"x" * (1 << 20)
        for extra in (b"", b"y"):
            wire = Wire()
            body = wire.answer(head("Transfer-Encoding: chunked")).read_body()
            wire.feed(chunked(block, block, block, block, *([extra] if extra else [])))
            if extra:
                self.failureResultOf(body, ProtocolError)
                self.assertTrue(wire.transport.disconnected)
            else:
                self.assertEqual(len(self.successResultOf(body)), 4 * 1024 * 1024)

    def test_body_limits(self):
        """A limit argument replaces the cap; a Content-Length over it is refused at once."""
        wire = Wire()
        body = wire.answer(head("Transfer-Encoding: chunked")).read_body(limit=10)
        wire.feed(chunked(b"hello", b" world"))
        self.failureResultOf(body, ProtocolError)
        wire = Wire(caps=HttpCaps(body_bytes=100))
        self.failureResultOf(wire.answer(head("Content-Length: 101")).read_body(), ProtocolError)
        self.assertTrue(wire.transport.disconnected)


class CancelAbortTests(SynchronousTestCase):
    """Cancelling, the connect timeout, abort, and backpressure."""

    def test_cancel_while_connecting(self):
        """Cancelling before the connection is made stops connecting: CancelledError."""
        wire = Wire(connect=False)
        wire.result.cancel()
        self.failureResultOf(wire.result, CancelledError)
        self.assertTrue(wire.reactor.connectors[0].stoppedConnecting)
        self.assertEqual(wire.reactor.getDelayedCalls(), [])

    def test_cancel_before_headers(self):
        """Cancelling before the headers aborts the connection: CancelledError, not wrapped."""
        wire = Wire()
        wire.feed(b"HTTP/1.1 200 OK\r\nServer: ll")
        wire.result.cancel()
        self.assertIs(self.failureResultOf(wire.result).type, CancelledError)
        self.assertTrue(wire.transport.disconnected)

    def test_connect_timeout(self):
        """No connection after connect_timeout seconds of the reactor's clock is Connect."""
        wire = Wire(connect=False, connect_timeout=2.0)
        wire.reactor.advance(1.5)
        self.assertNoResult(wire.result)
        wire.reactor.advance(0.5)
        self.failureResultOf(wire.result, Connect)
        self.assertTrue(wire.reactor.connectors[0].stoppedConnecting)

    def test_connected_stops_timer(self):
        """Once connected, no connect timer is left on the reactor."""
        wire = Wire()
        self.assertEqual(wire.reactor.getDelayedCalls(), [])

    def test_refused(self):
        """
        A connection that fails is Connect: the socket's path in its C{path}, for the log,
        and a reason that names the kind of failure and no path.
        """
        wire = Wire(connect=False)
        _, factory, _, _ = wire.reactor.unixClients[0]
        factory.clientConnectionFailed(wire.reactor.connectors[0], Failure(ConnectionLost()))
        error = self.failureResultOf(wire.result, Connect).value
        self.assertEqual(error.path, SOCKET)
        self.assertNotIn(SOCKET, error.reason)
        self.assertEqual(error.reason, "the connection was lost while it was being made")

    def test_abort_mid_body(self):
        """abort() aborts the connection, cancels deliver and drops later bytes; twice is fine."""
        wire = Wire()
        response = wire.answer(head(*STREAM_HEADERS), chunked(b"first")[:-5])
        pieces, done = collect(response)
        response.abort()
        self.failureResultOf(done, CancelledError)
        self.assertTrue(wire.transport.disconnected)
        wire.feed(chunked(b"late"))
        response.abort()
        wire.close(ConnectionLost)
        self.assertEqual(pieces, [b"first"])

    def test_abort_before_deliver(self):
        """After abort(), read_body fails with CancelledError."""
        wire = Wire()
        response = wire.answer(head("Content-Length: 2"))
        response.abort()
        self.assertTrue(wire.transport.disconnected)
        self.failureResultOf(response.read_body(), CancelledError)

    def test_pause_resume(self):
        """pause() and resume() stop and restart reading, also with pause() before deliver()."""
        wire = Wire()
        response = wire.answer(head(*STREAM_HEADERS))
        response.pause()
        _, done = collect(response)
        for step, state in [(response.resume, "producing"), (response.pause, "paused")] * 2:
            self.assertNotEqual(wire.transport.producerState, state)
            step()
            self.assertEqual(wire.transport.producerState, state)
        response.resume()
        wire.feed(chunked(b"x"))
        self.successResultOf(done)


class RefusalTests(SynchronousTestCase):
    """
    An inferproxy's refusal (a 503 naming its limit) is ProxyRefused, read from the headers
    alone, the connection aborted; the connection callbacks say when it opens and closes.
    """

    def test_refusal(self) -> None:
        """A 503 with X-Inferproxy-Refused is ProxyRefused with its limit and Retry-After."""
        wire = Wire()
        wire.feed(head("X-Inferproxy-Refused: connections", "Retry-After: 1", status="503 X"))
        error = self.failureResultOf(wire.result, ProxyRefused).value
        self.assertEqual((error.limit, error.retry_after), (ProxyRefused.CONNECTIONS, 1.0))
        self.assertTrue(wire.transport.disconnecting)

    def test_refusal_odd_values(self) -> None:
        """A limit loopd does not know is "unknown"; a bad or huge Retry-After is dropped."""
        for value, limit, retry in (
            ("accept-rate", "Retry-After: 2.5", (ProxyRefused.ACCEPT_RATE, 2.5)),
            ("flood", "Retry-After: soon", ("unknown", None)),
            ("connections", "Retry-After: 1e9", (ProxyRefused.CONNECTIONS, None)),
        ):
            wire = Wire()
            wire.feed(head(f"X-Inferproxy-Refused: {value}", limit, status="503 X"))
            error = self.failureResultOf(wire.result, ProxyRefused).value
            self.assertEqual((error.limit, error.retry_after), retry)

    def test_plain_503_is_a_response(self) -> None:
        """A 503 without the header (llama-server loading) is an ordinary response."""
        wire = Wire()
        response = wire.answer(head("Content-Length: 0", status="503 Service Unavailable"))
        self.assertEqual(response.status, 503)

    def test_connection_callbacks(self) -> None:
        """on_connected fires when the connection is made, on_closed when it is gone."""
        seen: list[str] = []
        wire = Wire(
            connect=False,
            on_connected=lambda: seen.append("connected"),
            on_closed=lambda: seen.append("closed"),
        )
        self.assertEqual(seen, [])
        wire.connect()
        self.assertEqual(seen, ["connected"])
        wire.answer(head("Content-Length: 0"))
        wire.close()
        self.assertEqual(seen, ["connected", "closed"])

    def test_closed_when_never_connected(self) -> None:
        """A connection that could not be made still calls on_closed, once."""
        seen: list[str] = []
        wire = Wire(connect=False, on_closed=lambda: seen.append("closed"))
        _, factory, _, _ = wire.reactor.unixClients[0]
        factory.clientConnectionFailed(wire.reactor.connectors[0], Failure(ConnectionLost()))
        self.failureResultOf(wire.result, Connect)
        self.assertEqual(seen, ["closed"])


class SocketTests(TestCase):
    """Over real Unix sockets in a short temporary directory."""

    timeout = 20

    def setUp(self) -> None:
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "infer.sock")
        self.requested: Deferred[Peer] = Deferred()

    def serve(self, *script: bytes, close: bool = False) -> UpstreamFactory:
        """Listen at the socket path; a request's header block is answered with C{script}."""

        def on_data(peer: Peer, data: bytes) -> None:
            if b"\r\n\r\n" in peer.received and not self.requested.called:
                peer.transport.writeSequence(script)
                if close:
                    peer.transport.loseConnection()
                self.requested.callback(peer)

        factory = UpstreamFactory(lambda peer: setattr(peer, "on_data", on_data))
        self.addCleanup(real_reactor().listenUNIX(self.path, factory).stopListening)
        return factory

    @inlineCallbacks
    def test_chunked_stream(self):
        """A chunked stream over a real socket arrives whole; the client then closes."""
        self.serve(head(*STREAM_HEADERS), *[chunked(e)[:-5] for e in events(STREAM)], b"0\r\n\r\n")
        response = yield request(real_reactor(), self.path, "POST", "/v1/chat/completions", b"{}")
        self.assertEqual((yield response.read_body()), STREAM)
        peer = yield self.requested
        yield peer.closed
        self.assertTrue(peer.received.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n"))

    @inlineCallbacks
    def test_read_to_close(self):
        """A body without framing ends cleanly when the server closes its end."""
        self.serve(head(), b"until ", b"the end", close=True)
        response = yield request(real_reactor(), self.path, "GET", "/health")
        self.assertEqual((yield response.read_body()), b"until the end")
        yield (yield self.requested).closed

    @inlineCallbacks
    def test_missing_or_stale_socket(self):
        """No file at the socket path, or a socket file nobody listens on, is Connect."""
        yield self.assertFailure(request(real_reactor(), self.path, "GET", "/health"), Connect)
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(self.path)
        dead.close()
        yield self.assertFailure(request(real_reactor(), self.path, "GET", "/health"), Connect)

    @inlineCallbacks
    def test_cancel_before_headers(self):
        """Cancelling while the server is silent closes the connection: the server sees it."""
        self.serve()
        pending = request(real_reactor(), self.path, "POST", "/v1/chat/completions", b"{}")
        peer = yield self.requested
        pending.cancel()
        yield self.assertFailure(pending, CancelledError)
        yield peer.closed

    @inlineCallbacks
    def test_abort_mid_body(self):
        """abort() mid-body closes the connection (the server sees it); deliver is cancelled."""
        self.serve(head(*STREAM_HEADERS), chunked(b"data: first\n\n")[:-5])
        response = yield request(real_reactor(), self.path, "POST", "/v1/chat/completions", b"{}")
        first: Deferred[bytes] = Deferred()
        done = response.deliver(lambda data: None if first.called else first.callback(data))
        self.assertEqual((yield first), b"data: first\n\n")
        response.abort()
        yield self.assertFailure(done, CancelledError)
        yield (yield self.requested).closed
