"""
Tests for L{loopd.gateway.channel}: the gateway's hardened HTTP connection. Protocol-level
bad input gets a JSON error in the gateway's shape and the connection closes; header blocks
and bodies have deadlines and a rate floor on the site's clock; a listener keeps at most
C{[server] max_connections} open; a pipelining client that does not read makes the channel
stop reading, so what loopd holds stays bounded (that one over a real Unix socket).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd.gateway.channel import origin_form
from loopd.gateway.site import Gateway
from loopd.llama import Client
from loopd.settings import Config, Endpoint, Limits, Server
from loopd.test.support.peers import buffered, real_reactor
from loopd.testing.gateway import (
    BODY_BYTES,
    ClientConnection,
    GatewayHarness,
    Response,
    make_config,
    read_responses,
)

#: A request that always works: the models list.
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: loopd\r\n\r\n"


def head(*lines: str) -> bytes:
    """A request head to C{/v1/models} with the given header lines, up to its blank line."""
    return ("\r\n".join(["GET /v1/models HTTP/1.1", "Host: loopd", *lines]) + "\r\n\r\n").encode()


def chunked(body: bytes) -> bytes:
    """A chunked POST head to the chat route followed by C{body} (raw chunk framing)."""
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: loopd\r\nTransfer-Encoding: chunked\r\n"
    return start + b"\r\n" + body


#: Each bad input the hardening issue names: (name, raw bytes, status, error code).
BAD_INPUTS: list[tuple[str, bytes, int, str]] = [
    ("request_line_one_word", b"GARBAGE\r\n\r\n", 400, "bad_request"),
    ("request_line_bad_version", b"GET /v1/models HTTP/2.0\r\n\r\n", 400, "bad_request"),
    ("request_line_bad_method", b"G(T /v1/models HTTP/1.1\r\n\r\n", 400, "bad_request"),
    ("request_line_space_in_target", b"GET /v1/ models HTTP/1.1\r\n\r\n", 400, "bad_request"),
    ("header_without_colon", head("Accept json"), 400, "bad_request"),
    ("header_name_with_space", head("Bad Name: x"), 400, "bad_request"),
    ("header_value_with_nul", head("X-Thing: a\x00b"), 400, "bad_request"),
    ("content_length_words", head("Content-Length: ten"), 400, "bad_request"),
    ("content_length_negative", head("Content-Length: -1"), 400, "bad_request"),
    ("content_length_signed", head("Content-Length: +5"), 400, "bad_request"),
    ("content_length_list", head("Content-Length: 1, 1"), 400, "bad_request"),
    ("content_length_twice", head("Content-Length: 1", "Content-Length: 2"), 400, "bad_request"),
    ("content_length_4301_digits", head("Content-Length: " + "9" * 4301), 413, "too_large"),
    ("content_length_10_to_12", head("Content-Length: 1000000000000"), 413, "too_large"),
    ("content_length_past_cap", head(f"Content-Length: {BODY_BYTES + 1}"), 413, "too_large"),
    (
        "identity_with_content_length",
        head("Transfer-Encoding: identity", "Content-Length: 2") + b"{}",
        400,
        "bad_request",
    ),
    ("transfer_encoding_gzip", head("Transfer-Encoding: gzip"), 400, "bad_request"),
    (
        "chunked_with_content_length",
        head("Transfer-Encoding: chunked", "Content-Length: 5"),
        400,
        "bad_request",
    ),
    (
        "chunked_twice",
        head("Transfer-Encoding: chunked", "Transfer-Encoding: chunked"),
        400,
        "bad_request",
    ),
    ("chunk_size_not_hex", chunked(b"zz\r\nab\r\n0\r\n\r\n"), 400, "bad_request"),
    ("chunk_without_crlf", chunked(b"2\r\nabXY"), 400, "bad_request"),
    (
        "chunks_past_cap",
        chunked(b"".join(b"400\r\n" + b"x" * 1024 + b"\r\n" for _ in range(3))),
        413,
        "too_large",
    ),
    ("header_line_over_16k", head("X-Long: " + "a" * 17_000), 431, "header_too_large"),
    (
        "headers_over_16k_in_all",
        head(*[f"X-Pad-{n}: " + "a" * 1000 for n in range(20)]),
        431,
        "header_too_large",
    ),
    ("headers_over_500", head(*[f"X-H{n}: v" for n in range(501)]), 431, "header_too_large"),
]


#: What the error message says for some of L{BAD_INPUTS}, by name.
MESSAGES = {
    "request_line_one_word": "the request line",
    "header_without_colon": "a header line",
    "header_value_with_nul": "a header line",
    "content_length_words": "Content-Length is not a number",
    "content_length_twice": "more than one",
    "identity_with_content_length": "'identity' is not supported",
    "chunked_with_content_length": "more than one",
    "chunk_size_not_hex": "the chunked body",
    "content_length_4301_digits": str(BODY_BYTES),
    "header_line_over_16k": "16384",
    "headers_over_500": "500",
}


class BadInputTests(SynchronousTestCase):
    """
    Each protocol-level bad input is one JSON error in the gateway's shape, then the
    connection closes, nothing is logged as an error, and a new connection still works.
    """

    def refused(self, name: str, raw: bytes, status: int, code: str) -> None:
        """
        Send C{raw} on a fresh connection; assert the refusal (its message naming what
        was wrong, for the inputs of L{MESSAGES}) and that the gateway lives on.
        """
        reason = MESSAGES
        harness = GatewayHarness()
        connection = harness.connect()
        connection.send(raw)
        responses = connection.responses()
        self.assertEqual([r.status for r in responses], [status], connection.transport.value())
        (response,) = responses
        self.assertEqual(response.headers["content-type"], "application/json")
        self.assertEqual(response.headers["connection"], "close")
        error = response.json()["error"]
        self.assertEqual(sorted(error), ["code", "message", "param", "type"])
        self.assertEqual((error["code"], error["type"]), (code, "invalid_request_error"))
        self.assertIn(reason.get(name, ""), error["message"])
        self.assertTrue(connection.transport.disconnecting)
        self.assertEqual(harness.fake.requests, [])
        self.assertEqual(self.flushLoggedErrors(), [])
        later = harness.connect()
        later.send(MODELS)
        self.assertEqual(later.response().status, 200)

    def test_nothing_more_after_a_refusal(self) -> None:
        """
        Bytes after the refused part (here a whole good request) are not read: one answer.
        """
        harness = GatewayHarness()
        connection = harness.connect()
        connection.send(head("Content-Length: 1000000000000") + MODELS)
        self.assertEqual([r.status for r in connection.responses()], [413])

    def test_form_content_type_left_to_the_door(self) -> None:
        """
        A body that claims to be a form is not parsed as one (Twisted would refuse this
        one as a malformed multipart body and close): the chat door reads it, and finds
        no messages.
        """
        harness = GatewayHarness()
        connection = harness.connect()
        body = b"{}"
        connection.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: loopd\r\n"
            b"Content-Type: multipart/form-data; boundary=x\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        response = connection.response()
        self.assertEqual(response.status, 400)
        self.assertEqual(response.headers["content-type"], "application/json")
        self.assertEqual(response.json()["error"]["code"], "missing_messages")
        self.assertEqual(harness.fake.requests, [])

    def test_chunks_past_cap_answered_before_the_end(self) -> None:
        """
        A chunked body is refused as soon as it passes the cap, before its last chunk.
        """
        harness = GatewayHarness()
        connection = harness.connect()
        connection.send(chunked(b""))
        for _ in range(BODY_BYTES // 512):
            connection.send(b"200\r\n" + b"x" * 512 + b"\r\n")
            self.assertEqual(connection.responses(), [])
        connection.send(b"1\r\nx\r\n")
        self.assertEqual([r.status for r in connection.responses()], [413])
        self.assertTrue(connection.transport.disconnecting)


#: Pieces of HTTP, right and wrong, that L{AnyBytesTests} strings together.
PIECES = st.sampled_from(
    [
        b"GET",
        b"POST",
        b" ",
        b"/v1/models",
        b"/metrics",
        b"/nope",
        b"HTTP/1.1",
        b"HTTP/1.0",
        b"\r\n",
        b"\r\n\r\n",
        b"\n",
        b":",
        b"Host: loopd",
        b"Content-Length: ",
        b"Transfer-Encoding: ",
        b"chunked",
        b"identity",
        b"0",
        b"5",
        b"ff",
        b"99999999999999999999999",
        b"Connection: close",
        b"Expect: 100-continue",
        b"\x00",
        b"\t",
        b"xxxxx",
    ]
)


class AnyBytesTests(SynchronousTestCase):
    """
    Whatever bytes arrive, in whatever pieces, the channel raises nothing, logs no error,
    answers every refusal in the gateway's JSON shape, and after every deadline has passed
    no request is left half-read on an open connection.
    """

    @given(
        st.lists(PIECES | st.binary(max_size=6), max_size=40).map(b"".join),
        st.lists(st.integers(1, 64), max_size=6),
    )
    def test_any_bytes(self, raw: bytes, cuts: list[int]) -> None:
        """Every answer is well-formed; an error is JSON; nothing is left pending."""
        harness = GatewayHarness()
        connection = harness.connect()
        for cut in cuts:
            piece, raw = raw[:cut], raw[cut:]
            connection.send(piece)
        connection.send(raw)
        harness.advance(30)
        for response in connection.responses():
            self.assertTrue(response.complete)
            if response.status >= 400:
                self.assertEqual(response.headers["content-type"], "application/json")
                self.assertEqual(
                    sorted(response.json()["error"]), ["code", "message", "param", "type"]
                )
        self.assertEqual(self.flushLoggedErrors(), [])
        channel = connection.channel
        if not connection.transport.disconnecting:
            self.assertEqual(channel._buffer.strip(), b"")


def _bad_input_test(
    name: str, raw: bytes, status: int, code: str
) -> Callable[[BadInputTests], None]:
    """A test method that sends C{raw} and expects C{status} with C{code}."""

    def test(self: BadInputTests) -> None:
        self.refused(name, raw, status, code)

    return test


for _name, _raw, _status, _code in BAD_INPUTS:
    _method = _bad_input_test(_name, _raw, _status, _code)
    _method.__name__ = f"test_{_name}"
    _method.__doc__ = f"{_name.replace('_', ' ')}: {_status} {_code}."
    setattr(BadInputTests, _method.__name__, _method)


def _slow_harness(**server: Any) -> GatewayHarness:
    """A harness whose [server] table has C{server}'s fields over the test defaults."""
    base = make_config()
    return GatewayHarness(make_config(server=dataclasses.replace(base.server, **server)))


def _timed_out(case: SynchronousTestCase, connection: ClientConnection) -> Response:
    """Assert one 408 JSON refusal and a closed connection; return it."""
    (response,) = connection.responses()
    case.assertEqual(response.status, 408)
    case.assertEqual(response.json()["error"]["code"], "request_timeout")
    case.assertTrue(connection.transport.disconnecting)
    return response


class DeadlineTests(SynchronousTestCase):
    """
    A header block has C{header_timeout_ms} from its first byte; a body must keep the rate
    floor over each C{body_timeout_ms} window. Both on the site's clock.
    """

    def test_header_byte_every_9s_closed_at_10s(self) -> None:
        """
        A header block that trickles one byte every 9 s (each byte well inside the idle
        timeout) is refused with 408 at 10 s from its first byte.
        """
        harness = GatewayHarness()
        connection = harness.connect()
        connection.send(b"G")
        harness.advance(9)
        connection.send(b"E")
        harness.advance(0.999)
        self.assertEqual((connection.responses(), connection.transport.disconnecting), ([], False))
        harness.advance(0.001)
        _timed_out(self, connection)

    def test_silent_connection_closed_at_the_header_deadline(self) -> None:
        """
        A connection that never sends a byte is closed at C{header_timeout_ms} from its
        accept (10 s), quietly (no answer, nothing logged), not held to the 60 s idle
        timeout; its place under the connection cap is free again (issue 26, item 2).
        """
        harness = GatewayHarness()
        connection = harness.connect()
        with capturedLogs() as events:
            harness.advance(9.999)
            self.assertFalse(connection.transport.disconnecting)
            harness.advance(0.001)
        self.assertTrue(connection.transport.disconnecting)
        self.assertEqual(connection.transport.value(), b"")
        self.assertEqual([formatEvent(event) for event in events], [])

    def test_first_header_deadline_from_the_accept(self) -> None:
        """The first request's header block has 10 s from the accept, not from its first byte."""
        harness = GatewayHarness()
        connection = harness.connect()
        harness.advance(5)
        connection.send(b"GET /v1/mo")
        harness.advance(4.5)
        self.assertEqual(connection.responses(), [])
        harness.advance(0.5)
        _timed_out(self, connection)

    def test_header_in_time_answered(self) -> None:
        """A header block completed just inside the deadline is answered as usual."""
        harness = GatewayHarness()
        connection = harness.connect()
        connection.send(MODELS[:10])
        harness.advance(9.9)
        connection.send(MODELS[10:])
        harness.advance(1)
        self.assertEqual([r.status for r in connection.responses()], [200])
        self.assertFalse(connection.transport.disconnecting)

    def test_deadline_per_request(self) -> None:
        """Each request on a kept-alive connection gets its own header deadline."""
        harness = GatewayHarness()
        connection = harness.connect()
        for _ in range(3):
            connection.send(MODELS[:5])
            harness.advance(9)
            connection.send(MODELS[5:])
            harness.advance(9)
        self.assertEqual([r.status for r in connection.responses()], [200, 200, 200])

    def test_idle_keepalive_closed_quietly(self) -> None:
        """
        A kept-alive connection left idle (Claude Code's C{HEAD /} probe leaves one) is
        closed at the site's idle timeout, 60 s, with nothing logged.
        """
        harness = GatewayHarness()
        connection = harness.connect()
        with capturedLogs() as events:
            connection.send(MODELS)
            harness.advance(59)
            self.assertFalse(connection.transport.disconnecting)
            harness.advance(1)
        self.assertTrue(connection.transport.disconnecting)
        self.assertEqual([formatEvent(event) for event in events], [])

    def test_idle_keepalive_not_refused(self) -> None:
        """A kept-alive connection idle between requests gets no 408 (the idle timeout rules)."""
        harness = GatewayHarness()
        connection = harness.connect()
        connection.send(MODELS + b"\r\n")
        harness.advance(30)
        self.assertEqual([r.status for r in connection.responses()], [200])
        self.assertFalse(connection.transport.disconnecting)

    def test_body_below_floor_refused(self) -> None:
        """
        A body that trickles at 1 byte per second, under the floor of 1024 per second, is
        refused with 408 when its first window of 10 s ends.
        """
        harness = GatewayHarness()
        connection = harness.connect()
        connection.send(head("Content-Length: 1000"))
        for _ in range(9):
            connection.send(b"x")
            harness.advance(1)
        connection.send(b"x")
        harness.advance(0.999)
        self.assertEqual(connection.responses(), [])
        harness.advance(0.001)
        response = _timed_out(self, connection)
        self.assertIn("1024", response.json()["error"]["message"])

    def test_silent_body_refused(self) -> None:
        """With no rate floor, a body that stops for a whole window is still refused."""
        harness = _slow_harness(body_min_bytes_per_s=0, body_timeout_ms=5000)
        connection = harness.connect()
        connection.send(head("Content-Length: 10") + b"12345")
        harness.advance(4)
        connection.send(b"6")
        harness.advance(5)
        self.assertEqual(connection.responses(), [])
        harness.advance(1)
        _timed_out(self, connection)

    def test_body_at_floor_accepted(self) -> None:
        """A body that keeps the floor in every window is read to its end and answered."""
        harness = _slow_harness(body_min_bytes_per_s=100)
        connection = harness.connect()
        connection.send(head(f"Content-Length: {BODY_BYTES}"))
        for _ in range(BODY_BYTES // 128):
            connection.send(b"x" * 128)
            harness.advance(1)
        self.assertEqual([r.status for r in connection.responses()], [200])
        self.assertFalse(connection.transport.disconnecting)


class ConnectionCapTests(SynchronousTestCase):
    """
    A listener keeps at most C{max_connections} open: a newer connection is answered 503
    and closed, the open ones carry on, and a freed place is taken again.
    """

    def test_newest_refused_others_work(self) -> None:
        """The third connection under a cap of 2 is refused; the first two still answer."""
        harness = _slow_harness(max_connections=2)
        first, second = harness.connect(), harness.connect()
        third = harness.connect()
        (refusal,) = third.responses()
        self.assertEqual(refusal.status, 503)
        error = refusal.json()["error"]
        self.assertEqual((error["code"], error["type"]), ("too_many_connections", "server_error"))
        self.assertTrue(third.transport.disconnecting)
        for connection in (first, second):
            connection.send(MODELS)
            self.assertEqual([r.status for r in connection.responses()], [200])
            self.assertFalse(connection.transport.disconnecting)

    def test_place_freed_when_a_connection_goes(self) -> None:
        """Once an open connection closes, a new one is served."""
        harness = _slow_harness(max_connections=1)
        first = harness.connect()
        self.assertEqual(harness.connect().responses()[0].status, 503)
        first.drop()
        later = harness.connect()
        later.send(MODELS)
        self.assertEqual([r.status for r in later.responses()], [200])


class RefusalMetricsTests(SynchronousTestCase):
    """
    C{/metrics} counts the channel's refusals by status and code, and the open connections.
    """

    def refusals(self, harness: GatewayHarness) -> dict[tuple[str, str], float]:
        """The loopd_http_refusals_total samples, keyed by (status, code)."""
        return {
            (dict(labels)["status"], dict(labels)["code"]): value
            for (name, labels), value in harness.scrape().items()
            if name == "loopd_http_refusals_total"
        }

    def test_each_refusal_counted(self) -> None:
        """A malformed request, a body too large and a connection over the cap, each once."""
        harness = _slow_harness(max_connections=3)
        for raw in (b"GARBAGE\r\n\r\n", head(f"Content-Length: {BODY_BYTES + 1}")):
            refused = harness.connect()
            refused.send(raw)
            refused.drop()
        open_ones = [harness.connect() for _ in range(3)]
        self.assertEqual(harness.connect().responses()[0].status, 503)
        open_ones.pop().drop()
        samples = harness.scrape()
        refusals = {
            (dict(labels)["status"], dict(labels)["code"]): value
            for (name, labels), value in samples.items()
            if name == "loopd_http_refusals_total"
        }
        self.assertEqual(
            refusals,
            {
                ("400", "bad_request"): 1.0,
                ("413", "too_large"): 1.0,
                ("503", "too_many_connections"): 1.0,
            },
        )
        # The two left open, and the scrape's own connection.
        self.assertEqual(samples[("loopd_http_connections_open", frozenset())], 3.0)

    def test_good_requests_not_counted(self) -> None:
        """A request that is answered normally is no refusal."""
        harness = GatewayHarness(make_config())
        connection = harness.connect()
        connection.send(MODELS)
        self.assertEqual([r.status for r in connection.responses()], [200])
        self.assertEqual(self.refusals(harness), {})


class HoldTests(SynchronousTestCase):
    """
    While the transport has asked the channel to pause (its buffer is full), pipelined
    requests after the one answered are held unparsed, and parsed once it drains.
    """

    def test_held_until_transport_drains(self) -> None:
        """Three pipelined requests under a full transport: one answer, then all three."""
        harness = GatewayHarness()
        connection = harness.connect()
        connection.channel.pauseProducing()
        connection.send(MODELS * 3)
        self.assertEqual(len(connection.responses()), 1)
        connection.channel.resumeProducing()
        self.assertEqual([r.status for r in connection.responses()], [200, 200, 200])
        self.assertFalse(connection.transport.disconnecting)

    def test_held_client_dropped_by_idle_timeout(self) -> None:
        """A client that never drains what it was sent is dropped by the idle timeout."""
        harness = GatewayHarness()
        connection = harness.connect()
        connection.channel.pauseProducing()
        connection.send(MODELS * 2)
        harness.advance(59)
        self.assertFalse(connection.transport.disconnecting)
        harness.advance(1)
        self.assertTrue(connection.transport.disconnecting)
        self.assertEqual(len(connection.responses()), 1)


#: Pipelined requests sent by a client that does not read.
PIPELINED = 4000
#: What loopd may hold for that connection: the transport's own 64 KiB write buffer before
#: it pushes back, one answer past it, and one read of input (64 KiB) beside.
PIPELINE_BOUND = 192 * 1024


class PipelinedWriter(Protocol):
    """
    A client that writes many pipelined requests and reads nothing until told to; then it
    keeps everything it reads and fires C{done} when the connection closes.
    """

    transport: Any

    def __init__(self, wire: bytes, done: Deferred[bytes]) -> None:
        self._wire = wire
        self._done = done
        self.received: list[bytes] = []

    def connectionMade(self) -> None:
        """Stop reading, then send everything."""
        self.transport.pauseProducing()
        self.transport.write(self._wire)

    def read_again(self) -> None:
        """Read everything from now on."""
        self.transport.resumeProducing()

    def dataReceived(self, data: bytes) -> None:
        """Keep it."""
        self.received.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Hand over everything read."""
        self._done.callback(b"".join(self.received))


def _held(channel: Any) -> int:
    """
    What loopd holds for one connection: its transport's unsent bytes and the request bytes
    read but not yet parsed (twisted.web's private buffers).
    """
    queued = sum(len(piece) for piece in channel._dataBuffer) + len(channel._buffer)
    return buffered(channel.transport) + queued


class PipelineTests(TestCase):
    """A pipelining client that does not read, over a real Unix socket."""

    timeout = 120

    @inlineCallbacks
    def test_pipelined_unread_bounded(self) -> Any:
        """
        4,000 pipelined C{GET /v1/models} from a client that does not read: the channel
        stops reading while its answers wait, so what loopd holds stays under the bound;
        when the client reads, every answer arrives, in order.
        """
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "loopd.sock")
        endpoint = Endpoint(name="tiny", socket=os.path.join(directory, "no.sock"), selftest=False)
        config = Config(endpoints=(endpoint,), limits=Limits(), server=Server())
        gateway = Gateway(reactor, config, {"tiny": Client(reactor, config, endpoint)})
        site = gateway.site()
        channels: list[Any] = []
        peak = [0]
        build = site.buildProtocol

        built: Deferred[None] = Deferred()

        def recording(addr: Any) -> Any:
            channel = build(addr)
            channels.append(getattr(channel, "_channel", channel))
            make_connection = channel.makeConnection

            def connected(transport: Any) -> None:
                make_connection(transport)
                built.callback(None)

            channel.makeConnection = connected
            return channel

        site.buildProtocol = recording  # type: ignore[method-assign]
        port = reactor.listenUNIX(path, site)
        self.addCleanup(port.stopListening)

        done: Deferred[bytes] = Deferred()
        last = MODELS.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        client = PipelinedWriter(MODELS * (PIPELINED - 1) + last, done)
        reactor.connectUNIX(path, ClientFactory.forProtocol(lambda: client))

        def close() -> Deferred[Any]:
            if client.transport is not None and not client.transport.disconnected:
                client.transport.abortConnection()
            return done

        self.addCleanup(close)
        answered = [0]
        yield built
        (channel,) = channels
        transport = channel.transport
        write, write_sequence = transport.write, transport.writeSequence
        stop_reading = transport.stopReading
        # Fires once loopd stops reading (it holds the rest), or has answered everything
        # regardless of the client (no bound at all).
        settled: Deferred[None] = Deferred()

        def settle() -> None:
            if not settled.called:
                settled.callback(None)

        def measured(data: bytes) -> None:
            write(data)
            peak[0] = max(peak[0], _held(channel))

        def measured_sequence(pieces: list[bytes]) -> None:
            write_sequence(pieces)
            answered[0] += pieces[0].startswith(b"HTTP/")
            peak[0] = max(peak[0], _held(channel))
            if answered[0] >= PIPELINED:
                settle()

        def stopped() -> None:
            stop_reading()
            # Only the hold of a full output counts, not the read-ahead pause of a request.
            if getattr(channel, "_held", False):
                settle()

        transport.write, transport.writeSequence = measured, measured_sequence
        transport.stopReading = stopped
        yield settled
        peak[0] = max(peak[0], _held(channel))
        self.assertLess(answered[0], PIPELINED, f"every answer written unread, peak {peak[0]}")
        self.assertLess(peak[0], PIPELINE_BOUND)

        client.read_again()
        responses = read_responses((yield done))
        self.assertEqual({(r.status, r.complete) for r in responses}, {(200, True)})
        self.assertEqual(len(responses), PIPELINED)
        self.assertLess(peak[0], PIPELINE_BOUND)


class RequestTargetTests(SynchronousTestCase):
    """
    The request target's forms (RFC 9112 §3.2): the absolute form routed by its path (a
    proxy sends it; a server must take it), the asterisk form for C{OPTIONS} only, a JSON
    400 for any other method (issue 26, item 7).
    """

    def answer(self, request_line: str, body: bytes = b"") -> Any:
        """The one response to C{request_line} with C{body}, on a fresh gateway."""
        harness = GatewayHarness()
        connection = harness.connect()
        head = f"{request_line}\r\nHost: loopd\r\nContent-Length: {len(body)}\r\n\r\n"
        connection.send(head.encode() + body)
        harness.advance(1)
        return connection.response()

    def test_origin_form(self) -> None:
        """An absolute-form target reads as its path and query; any other stays."""
        cases = {
            b"http://loopd/v1/models": b"/v1/models",
            b"HTTPS://127.0.0.1:8080/v1/models?x=1": b"/v1/models?x=1",
            b"http://loopd": b"/",
            b"http://loopd?x=1": b"/?x=1",
            b"/v1/models": b"/v1/models",
            b"*": b"*",
            b"/a://b": b"/a://b",
        }
        self.assertEqual({target: origin_form(target) for target in cases}, cases)

    @given(st.binary().map(lambda tail: b"/" + tail))
    def test_origin_form_kept(self, target: bytes) -> None:
        """A target in origin form (starting with C{/}) is left as it is."""
        self.assertEqual(origin_form(target), target)

    def test_absolute_form_routed(self) -> None:
        """An absolute-form target is answered by the route of its path."""
        response = self.answer("GET http://loopd/v1/models HTTP/1.1")
        self.assertEqual(response.status, 200)
        self.assertIn("tiny", [model["id"] for model in response.json()["data"]])

    def test_absolute_form_not_found(self) -> None:
        """An unknown path in absolute form is a 404 naming the path, not the URL cut."""
        response = self.answer("GET http://loopd/nowhere?x=1 HTTP/1.1")
        self.assertEqual(response.status, 404)
        self.assertEqual(response.json()["error"]["message"], "no route /nowhere")

    def test_absolute_form_in_the_doors_shape(self) -> None:
        """A refusal under a door's path in absolute form is in that door's shape."""
        response = self.answer("POST http://loopd/v1/messages HTTP/1.1", b"{}")
        self.assertEqual((response.status, response.json()["type"]), (400, "error"))

    def test_asterisk(self) -> None:
        """C{GET *} is a JSON 400 naming the rule; C{OPTIONS *} is answered as before."""
        response = self.answer("GET * HTTP/1.1")
        self.assertEqual(response.status, 400)
        self.assertEqual(response.headers["content-type"], "application/json")
        self.assertEqual(response.json()["error"]["code"], "bad_request_target")
        self.assertIn("OPTIONS only", response.json()["error"]["message"])
        self.assertEqual(self.answer("OPTIONS * HTTP/1.1").status, 200)
