"""
The scripted fake llama-server (L{loopd.testing.fake_llama}, with the answers of
L{loopd.testing.llama_replies}) and the in-memory Unix network (L{loopd.testing.memory_net}):
over a real socket with real clients, and in memory on a C{MemoryReactorClock}, where every
byte arrives at an exact clock time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import stat
import tempfile
from typing import Any

import treq
from hypothesis import given
from hypothesis import strategies as st
from treq.client import HTTPClient
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.error import (
    ConnectError,
    ConnectingCancelledError,
    ConnectionDone,
    ConnectionLost,
    ConnectionRefusedError,
)
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, ResponseFailed, readBody
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from loopd.test.support.peers import real_reactor
from loopd.testing.fake_llama import (
    CHAT,
    CONTROL,
    LOADING,
    PROPS,
    SLOTS,
    FakeLlama,
    Piece,
    Reply,
    RequestParser,
    error_reply,
    event_bytes,
    json_reply,
    sse_reply,
)
from loopd.testing.llama_replies import control_reply, props_reply, slots_reply
from loopd.testing.memory_net import MemoryNet, connect_pending

PATH = "/tmp/ld-memory/llama.sock"
NOT_FOUND_BODY = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


@implementer(IAgentEndpointFactory)
class UnixEndpoints:
    """Sends every request of an C{Agent} to one Unix socket."""

    def __init__(self, reactor: Any, path: str) -> None:
        self._reactor = reactor
        self._path = path

    def endpointForURI(self, uri: Any) -> UNIXClientEndpoint:
        return UNIXClientEndpoint(self._reactor, self._path)


class Collector(Protocol):
    """Collects a response body; C{done} fires when it ends, and C{reason} says why."""

    on_data: Any = None

    def __init__(self) -> None:
        self.data = b""
        self.done: Deferred[None] = Deferred()
        self.reason: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if self.on_data is not None:
            self.on_data(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.reason = reason
        self.done.callback(None)


class RawClient(Protocol):
    """Sends C{request} on connect and records each read with the clock time it came."""

    transport: Any

    def __init__(self, clock: MemoryReactorClock, request: bytes) -> None:
        self.clock = clock
        self.request = request
        self.reads: list[tuple[float, bytes]] = []
        self.lost: tuple[float, Failure] | None = None

    def connectionMade(self) -> None:
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.reads.append((self.clock.seconds(), data))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost = (self.clock.seconds(), reason)

    @property
    def received(self) -> bytes:
        """Everything read so far."""
        return b"".join(data for _, data in self.reads)


def http_request(method: str, target: str, obj: Any = None, *headers: str) -> bytes:
    """A request as a client writes it, with a JSON body if C{obj} is not C{None}."""
    body = b"" if obj is None else json.dumps(obj).encode()
    lines = [f"{method} {target} HTTP/1.1", "Host: llama", *headers]
    if obj is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def split_response(raw: bytes) -> tuple[bytes, bytes]:
    """The head (without its blank line) and the body of a raw response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


class RealSocketTests(TestCase):
    """The fake serves real clients over a real Unix socket."""

    timeout = 30

    def setUp(self) -> None:
        self.reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "llama.sock")
        self.fake = FakeLlama(self.reactor)
        port = self.fake.listen(self.reactor, self.path)
        self.addCleanup(port.stopListening)
        self.addCleanup(self.fake.close_all)
        self.agent = Agent.usingEndpointFactory(
            self.reactor, UnixEndpoints(self.reactor, self.path)
        )
        self.http = HTTPClient(self.agent)

    @inlineCallbacks
    def test_chunked_sse(self) -> Any:
        """A streamed reply arrives whole, chunked, and the JSON request is recorded."""
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)
        self.fake.script("POST", CHAT, sse_reply([{"n": 1}, "two"], delay_s=0.01))
        response = yield self.http.post("http://llama" + CHAT, json={"stream": True})
        body = yield treq.content(response)
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["text/event-stream"])
        self.assertEqual(body, b'data: {"n":1}\n\ndata: two\n\ndata: [DONE]\n\n')
        yield self.fake.all_closed()
        [request] = self.fake.requests
        self.assertEqual(
            (request.method, request.path, request.json), ("POST", CHAT, {"stream": True})
        )
        self.assertFalse(self.fake.connections[0].client_closed)

    @inlineCallbacks
    def test_cut(self) -> Any:
        """A cut chunked stream delivers its pieces, then fails the body with data loss."""
        self.fake.script("POST", CHAT, sse_reply([{"n": 1}], end="cut"))
        response = yield self.agent.request(b"POST", b"http://llama" + CHAT.encode())
        collector = Collector()
        response.deliverBody(collector)
        yield collector.done
        assert collector.reason is not None
        self.assertTrue(collector.reason.check(ResponseFailed))
        self.assertEqual(collector.data, b'data: {"n":1}\n\n')

    @inlineCallbacks
    def test_length_json_and_404(self) -> Any:
        """A length-framed JSON reply and the 404 for an unscripted route."""
        self.fake.set_default("GET", PROPS, props_reply(total_slots=2))
        response = yield self.http.get("http://llama" + PROPS)
        props = yield treq.json_content(response)
        self.assertEqual(props["total_slots"], 2)
        self.assertEqual(response.length, len(props_reply(total_slots=2).body))
        missing = yield self.http.get("http://llama/nothing")
        self.assertEqual((missing.code, (yield treq.json_content(missing))), (404, NOT_FOUND_BODY))

    @inlineCallbacks
    def test_client_close_recorded(self) -> Any:
        """A client that stops reading a silent stream closes it, and the fake records that."""
        self.fake.script("POST", CHAT, sse_reply([{"n": 1}], end="silence"))
        response = yield self.agent.request(b"POST", b"http://llama" + CHAT.encode())
        collector = Collector()
        collector.on_data = lambda c: c.transport.stopProducing()
        response.deliverBody(collector)
        yield collector.done
        yield self.fake.all_closed()
        self.assertTrue(self.fake.connections[0].client_closed)
        self.assertIsNotNone(self.fake.connections[0].closed_at)


class MemoryTests(SynchronousTestCase):
    """The fake in memory, on a clock: every byte at its scripted time."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)

    def connect(self, request: bytes, path: str = PATH) -> RawClient:
        client = RawClient(self.reactor, request)
        d = connectProtocol(UNIXClientEndpoint(self.reactor, path), client)
        self.net.pump()
        self.successResultOf(d)
        return client

    def test_delays_at_scripted_times(self) -> None:
        """Head after headers_delay, each piece after its delay, then the close."""
        pieces = [Piece(0.125, b"a"), Piece(0, b"b"), Piece(0.5, b"c")]
        reply = Reply(pieces=pieces, framing="close", headers_delay=0.25)
        self.fake.script("GET", "/x", reply)
        client = self.connect(http_request("GET", "/x"))
        self.net.advance(10)
        self.assertEqual(client.reads, [(0.25, reply.render_head()), (0.375, b"ab"), (0.875, b"c")])
        record = self.fake.connections[0]
        self.assertEqual(
            (record.reply_ended_at, record.closed_at, record.client_closed), (0.875, 0.875, False)
        )
        assert client.lost is not None
        self.assertEqual(client.lost[0], 0.875)
        self.assertTrue(client.lost[1].check(ConnectionDone))

    def test_headers_delay(self) -> None:
        """Nothing at all, not even the status line, before headers_delay; never for inf."""
        self.fake.script("GET", SLOTS, dataclasses.replace(slots_reply(), headers_delay=1.0))
        self.fake.script("GET", SLOTS, dataclasses.replace(slots_reply(), headers_delay=math.inf))
        client = self.connect(http_request("GET", SLOTS))
        never = self.connect(http_request("GET", SLOTS))
        self.net.run_to(0.999)
        self.assertEqual(client.reads, [])
        self.assertEqual(len(self.fake.requests), 2)
        self.net.run_to(1.0)
        self.assertEqual(client.reads[0][0], 1.0)
        self.assertTrue(client.received.startswith(b"HTTP/1.1 200 OK\r\n"))
        self.net.advance(10**6)
        self.assertEqual((never.reads, never.lost), ([], None))

    def test_silence_then_close_all(self) -> None:
        """Silence keeps the connection open with nothing more; close_all aborts it."""
        self.fake.script("POST", CHAT, sse_reply([{"n": 1}], end="silence"))
        client = self.connect(http_request("POST", CHAT, {}))
        self.net.advance(3600)
        head, body = split_response(client.received)
        self.assertIn(b"Transfer-Encoding: chunked", head)
        self.assertEqual(body, b'f\r\ndata: {"n":1}\n\n\r\n')
        self.assertIsNone(client.lost)
        self.assertTrue(self.fake.connections[0].open)
        closed = self.fake.close_all()
        self.net.pump()
        self.successResultOf(closed)
        assert client.lost is not None
        self.assertTrue(client.lost[1].check(ConnectionLost))

    def test_requests_recorded(self) -> None:
        """Method, target, path, query, headers, raw body, parsed JSON and time are recorded."""
        self.net.advance(2)
        self.connect(http_request("POST", CHAT + "?a=1", {"k": [1]}, "X-Test: yes"))
        [request] = self.fake.requests
        self.assertEqual(
            (request.method, request.target, request.path, request.query, request.received_at),
            ("POST", CHAT + "?a=1", CHAT, "a=1", 2.0),
        )
        self.assertEqual((request.header("x-TEST"), request.header("absent")), ("yes", None))
        self.assertEqual((request.body, request.json), (b'{"k": [1]}', {"k": [1]}))
        self.assertIs(request.connection, self.fake.connections[0])
        self.assertEqual(self.fake.requests_to("post", CHAT), [request])

    def test_malformed_requests(self) -> None:
        """A bad request line or a chunked body is answered 400 and recorded as an error."""
        for raw in [b"NONSENSE\r\n\r\n", b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"]:
            client = self.connect(raw)
            self.assertTrue(client.received.startswith(b"HTTP/1.1 400 Bad Request\r\n"))
            self.assertEqual(json.loads(split_response(client.received)[1])["error"]["code"], 400)
        self.assertEqual(self.fake.requests, [])
        self.assertTrue(all(record.error for record in self.fake.connections))

    def test_client_abort_recorded(self) -> None:
        """A client abort is recorded with its clock time and stops the script."""
        self.fake.script("POST", CHAT, sse_reply([{"n": 1}, {"n": 2}], delay_s=0.25))
        client = self.connect(http_request("POST", CHAT, {}))
        self.net.run_to(0.375)
        client.transport.abortConnection()
        self.net.pump()
        record = self.fake.connections[0]
        self.assertEqual((record.client_closed, record.closed_at), (True, 0.375))
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertNotIn(b'"n":2', bytes(record.sent))

    def test_unscripted_404(self) -> None:
        """An unscripted route, or a route whose scripts ran out, gets llama-server's 404."""
        self.fake.script("GET", PROPS, props_reply())
        self.connect(http_request("GET", PROPS))
        for target in ["/nothing", PROPS]:
            client = self.connect(http_request("GET", target))
            head, body = split_response(client.received)
            self.assertTrue(head.startswith(b"HTTP/1.1 404 Not Found\r\n"))
            self.assertEqual(json.loads(body), NOT_FOUND_BODY)
        self.assertEqual([r.path for r in self.fake.unscripted], ["/nothing", PROPS])

    def test_fifo_then_default(self) -> None:
        """Scripts are used first in first out, then the default, here a callable."""

        def control(request: Any, fake: FakeLlama) -> Reply:
            fake.state["calls"] = fake.state.get("calls", 0) + 1
            return control_reply(request.json["id"] == "ok")

        self.fake.script("POST", CONTROL, LOADING, error_reply(400, "invalid_request_error", "x"))
        self.fake.set_default("POST", CONTROL, control)
        self.assertEqual(self.fake.pending(), {("POST", CONTROL): 2})
        bodies = []
        for ident in ["a", "b", "ok", "bad"]:
            client = self.connect(http_request("POST", CONTROL, {"id": ident}))
            bodies.append(json.loads(split_response(client.received)[1]))
        self.assertEqual([b.get("error", {}).get("code") for b in bodies[:2]], [503, 400])
        self.assertEqual(
            bodies[2:],
            [{"success": True}, {"success": False, "message": "no active completion for this id"}],
        )
        self.assertEqual((self.fake.pending(), self.fake.state["calls"]), ({}, 2))

    def test_framing_and_ends(self) -> None:
        """Chunked close ends with the last chunk; cut does not; a cut length body is short."""
        self.fake.script("POST", CHAT, sse_reply(["x"]), sse_reply(["x"], end="cut"))
        self.fake.script("GET", SLOTS, dataclasses.replace(slots_reply(), end="cut"))
        closed, cut = (self.connect(http_request("POST", CHAT, {})) for _ in range(2))
        self.assertTrue(
            closed.received.endswith(b"9\r\ndata: x\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        )
        self.assertTrue(cut.received.endswith(b"9\r\ndata: x\n\n\r\n"))
        short = self.connect(http_request("GET", SLOTS))
        head, body = split_response(short.received)
        self.assertIn(b"Content-Length: %d\r\n" % (len(body) + 1), head + b"\r\n")
        self.assertEqual([r.client_closed for r in self.fake.connections], [False] * 3)

    def test_head_override_and_long_stream(self) -> None:
        """A scripted head is sent byte for byte; thousands of pieces do not recurse."""
        events = [{"i": i} for i in range(5000)]
        self.fake.script(
            "POST", CHAT, dataclasses.replace(sse_reply(events), head=b"HTTP/1.0 200 X\r\n\r\n")
        )
        client = self.connect(http_request("POST", CHAT, {}))
        self.assertTrue(client.received.startswith(b'HTTP/1.0 200 X\r\n\r\nf\r\ndata: {"i":0}'))
        self.assertTrue(client.received.endswith(b"0\r\n\r\n"))

    def test_connect_failures(self) -> None:
        """No listener: ConnectError; killed server: its connections lost, then refused."""
        missing = connectProtocol(UNIXClientEndpoint(self.reactor, "/tmp/none"), Protocol())
        cancelled = connectProtocol(UNIXClientEndpoint(self.reactor, PATH), Protocol())
        cancelled.cancel()
        self.net.pump()
        self.failureResultOf(missing, ConnectError)
        self.failureResultOf(cancelled, ConnectingCancelledError)
        self.assertEqual(self.net.connections, [])
        self.fake.script("POST", CHAT, sse_reply([], end="silence"))
        client = self.connect(http_request("POST", CHAT, {}))
        self.net.kill(PATH)
        self.net.pump()
        assert client.lost is not None
        self.assertTrue(client.lost[1].check(ConnectionLost))
        refused = connectProtocol(UNIXClientEndpoint(self.reactor, PATH), Protocol())
        self.net.pump()
        self.failureResultOf(refused, ConnectionRefusedError)

    def test_server_close_and_abort(self) -> None:
        """A server close delivers written bytes first; an abort drops them."""
        for abort in [False, True]:
            self.fake.script("POST", CHAT, sse_reply([Piece(1.0, b"late")], end="silence"))
            client = self.connect(http_request("POST", CHAT, {}))
            self.reactor.advance(1.0)  # the fake writes, nothing is pumped yet
            connection = self.net.open_connections()[0]
            (connection.abort_from_server if abort else connection.close_from_server)()
            self.net.pump()
            self.assertEqual(b"late" in client.received, not abort)
            assert client.lost is not None
            self.assertTrue(client.lost[1].check(ConnectionLost if abort else ConnectionDone))

    def test_timers_interleave_with_bytes(self) -> None:
        """advance delivers a timer's bytes before a later timer on the other side runs."""
        self.fake.script("POST", CHAT, sse_reply([Piece(0.25, b"x")], end="silence"))
        client = self.connect(http_request("POST", CHAT, {}))
        seen: list[bytes] = []
        self.reactor.callLater(0.5, lambda: seen.append(client.received))
        self.net.advance(1)
        self.assertTrue(seen[0].endswith(b"1\r\nx\r\n"))

    def test_agent_and_connect_pending(self) -> None:
        """twisted.web's Agent works over MemoryNet; connect_pending wires by hand."""
        agent = Agent.usingEndpointFactory(self.reactor, UnixEndpoints(self.reactor, PATH))
        self.fake.script(
            "GET", SLOTS, dataclasses.replace(slots_reply([True, False]), headers_delay=0.5)
        )
        d = agent.request(b"GET", b"http://llama/slots")
        self.net.pump()
        self.assertNoResult(d)
        self.net.run_to(0.5)
        body = readBody(self.successResultOf(d))
        self.net.pump()
        busy, idle = json.loads(self.successResultOf(body))
        self.assertEqual(
            idle, {"id": 1, "n_ctx": 4096, "speculative": False, "is_processing": False}
        )
        self.assertEqual((busy["is_processing"], busy["next_token"][0]["n_decoded"]), (True, 1))
        client = RawClient(self.reactor, http_request("GET", "/nothing"))
        connectProtocol(UNIXClientEndpoint(self.reactor, "/anywhere"), client)
        [connection] = connect_pending(self.reactor, self.fake)
        connection.pump.flush()
        self.assertIn(b"404", client.received)


class HelperTests(SynchronousTestCase):
    """The reply builders give llama-server's shapes; the request parser takes any split."""

    def test_reply_shapes(self) -> None:
        """Events, errors, control and props bodies are llama-server's."""
        self.assertEqual(event_bytes({"a": [1, 2]}), b'data: {"a":[1,2]}\n\n')
        self.assertEqual(event_bytes(b":\n\n"), b":\n\n")
        self.assertEqual(sse_reply(["x"], end="cut").body, b"data: x\n\n")
        error = json.loads(error_reply(400, "exceed_context_size_error", "m", n_ctx=8).body)
        self.assertEqual(
            error,
            {
                "error": {
                    "code": 400,
                    "message": "m",
                    "type": "exceed_context_size_error",
                    "n_ctx": 8,
                }
            },
        )
        self.assertEqual(json.loads(LOADING.body)["error"]["type"], "unavailable_error")
        self.assertEqual(
            json.loads(control_reply(False, "why").body), {"success": False, "message": "why"}
        )
        props = json.loads(props_reply(n_ctx=64, total_slots=3).body)
        self.assertEqual(
            (props["default_generation_settings"]["n_ctx"], props["total_slots"]), (64, 3)
        )
        self.assertEqual(
            json_reply(201, []).render_head().split(b"\r\n")[0], b"HTTP/1.1 201 Created"
        )
        self.assertRaises(ValueError, Reply, end="later")
        self.assertRaises(ValueError, Reply, pieces=[Piece(-1, b"")])

    @given(st.lists(st.integers(min_value=0, max_value=200), max_size=8))
    def test_parser_any_split(self, cuts: list[int]) -> None:
        """Every split of a request into reads parses to the same request, only at the end."""
        raw = http_request("POST", CHAT, {"messages": ["hi"] * 5}, "A: b")
        bounds = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
        parser = RequestParser()
        results = [parser.feed(raw[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        self.assertEqual(results[:-1], [None] * (len(results) - 1))
        headers = [
            ("Host", "llama"),
            ("A", "b"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(raw.partition(b"\r\n\r\n")[2]))),
        ]
        body = raw.partition(b"\r\n\r\n")[2]
        self.assertEqual(results[-1], ("POST", CHAT, headers, body))
