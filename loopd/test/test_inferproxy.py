"""
Tests for L{loopd.inferproxy}: the token bucket, the limits, the relay and its teardown, in
memory with L{task.Clock} and string transports; then the forwarder over real sockets, a Unix
listener in a short temporary directory in front of a TCP server on 127.0.0.1, driven by the
real reactor (half-close, backpressure and teardown need real transports).
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred, gatherResults, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ConnectionLost, ConnectionRefusedError
from twisted.internet.interfaces import (
    IHalfCloseableProtocol,
    IProtocolFactory,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

from loopd.inferproxy import (
    MAX_LINGERING_REFUSALS,
    REFUSAL_LINGER_SECONDS,
    InferProxyFactory,
    InferProxyService,
    ProxyLimits,
    TokenBucket,
    parse_upstream,
    upstream_endpoint,
)
from loopd.test.support.peers import (
    ObservedProxyFactory,
    Peer,
    UpstreamFactory,
    buffered,
    open_fds,
    proxy_events,
    real_reactor,
    set_reset_on_close,
)


class HalfCloseTransport(StringTransport):
    """
    A string transport that records half-closes and, like a real transport, tolerates
    unregistering a producer that is not registered.
    """

    write_closed = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True

    def unregisterProducer(self) -> None:
        self.producer = None
        self.streaming = None


@implementer(IStreamClientEndpoint)
class FakeEndpoint:
    """
    An upstream endpoint whose connection attempts the test completes or fails by hand.
    """

    def __init__(self) -> None:
        self.attempts: list[tuple[IProtocolFactory, Deferred[Any]]] = []
        self.cancelled = 0

    def _cancel(self, d: Deferred[Any]) -> None:
        self.cancelled += 1
        d.errback(CancelledError())

    def connect(self, factory: IProtocolFactory) -> Deferred[Any]:
        d: Deferred[Any] = Deferred(self._cancel)
        self.attempts.append((factory, d))
        return d


class Harness:
    """
    A factory with a fake endpoint and a clock, and helpers to open pairs.
    """

    def __init__(self, limits: ProxyLimits | None = None) -> None:
        self.clock = Clock()
        self.endpoint = FakeEndpoint()
        self.factory = InferProxyFactory(self.endpoint, self.clock, limits or ProxyLimits(), "up:1")

    def accept(self) -> tuple[Protocol, HalfCloseTransport]:
        client = self.factory.buildProtocol(None)
        assert client is not None
        transport = HalfCloseTransport()
        client.makeConnection(transport)
        return client, transport

    def refusal(self) -> bytes | None:
        """
        Accept one connection: C{None} when a pair opened, else the refusal it was sent
        (which must half-close it, not close it).
        """
        before = self.factory.open_pairs
        _, transport = self.accept()
        if self.factory.open_pairs == before + 1:
            return None
        assert transport.write_closed, "a refusal half-closes"
        sent: bytes = transport.value()
        return sent

    def connect_upstream(self) -> tuple[Any, HalfCloseTransport]:
        factory, d = self.endpoint.attempts[-1]
        upstream: Any = factory.buildProtocol(None)  # type: ignore[arg-type]
        assert upstream is not None
        transport = HalfCloseTransport()
        upstream.makeConnection(transport)
        d.callback(upstream)
        return upstream, transport

    def pair(
        self,
    ) -> tuple[Protocol, HalfCloseTransport, Protocol, HalfCloseTransport]:
        client, client_transport = self.accept()
        upstream, upstream_transport = self.connect_upstream()
        return client, client_transport, upstream, upstream_transport


class TokenBucketTests(SynchronousTestCase):
    """
    L{TokenBucket} reads time only from its clock.
    """

    def test_burst_then_refill(self) -> None:
        """
        A full bucket of 10 gives 10 tokens, refuses the 11th, and at 2 per second has a
        token again 0.5 s later.
        """
        clock = Clock()
        bucket = TokenBucket(clock, 10, 2.0)
        self.assertEqual([bucket.take() for _ in range(11)], [True] * 10 + [False])
        clock.advance(0.49)
        self.assertFalse(bucket.take())
        clock.advance(0.01)
        self.assertTrue(bucket.take())
        self.assertFalse(bucket.take())

    def test_capacity_caps_refill(self) -> None:
        """
        A long idle time refills the bucket to its burst size, not beyond.
        """
        clock = Clock()
        bucket = TokenBucket(clock, 3, 2.0)
        clock.advance(1000)
        self.assertEqual([bucket.take() for _ in range(4)], [True] * 3 + [False])

    @given(
        st.integers(1, 20),
        st.sampled_from([Fraction(1, 2), Fraction(1), Fraction(2), Fraction(10)]),
        st.lists(st.tuples(st.integers(0, 8), st.integers(0, 12)), min_size=1, max_size=30),
    )
    def test_matches_exact_model(
        self, burst: int, rate: Fraction, steps: list[tuple[int, int]]
    ) -> None:
        """
        Under any interleaving of clock steps (in quarter seconds) and attempts, the bucket
        grants exactly what an exact rational model of a token bucket grants.
        """
        clock = Clock()
        bucket = TokenBucket(clock, burst, float(rate))
        tokens = Fraction(burst)
        for quarters, attempts in steps:
            clock.advance(quarters / 4)
            tokens = min(Fraction(burst), tokens + rate * Fraction(quarters, 4))
            for _ in range(attempts):
                expected = tokens >= 1
                if expected:
                    tokens -= 1
                self.assertEqual(bucket.take(), expected)


class LimitTests(SynchronousTestCase):
    """
    L{InferProxyFactory.buildProtocol} refuses what is over a limit, and says which.
    """

    def test_ninth_connection_refused(self) -> None:
        """
        With 8 pairs open the 9th accept is refused with a log line naming the connection
        limit; once a pair closes, a new one is accepted.
        """
        harness = Harness(ProxyLimits(burst=100))
        pairs = [harness.pair() for _ in range(8)]
        self.assertEqual(harness.factory.open_pairs, 8)
        with capturedLogs() as events:
            refusal = harness.refusal()
        self.assertEqual(len(events), 1)
        self.assertIn("connection limit", events[0]["log_format"])
        assert refusal is not None
        self.assertTrue(refusal.startswith(b"HTTP/1.1 503 "))
        self.assertIn(b"\r\nX-Inferproxy-Refused: connections\r\n", refusal)
        client, _, upstream, _ = pairs[0]
        client.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(harness.factory.open_pairs, 8)
        upstream.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(harness.factory.open_pairs, 7)
        self.assertIsNone(harness.refusal())

    def test_eleventh_burst_connection_refused(self) -> None:
        """
        The 11th connection of a burst is refused with a log line naming the rate limit, and
        one is accepted again 0.5 s later.
        """
        harness = Harness(ProxyLimits(max_connections=100))
        for _ in range(10):
            self.assertIsNone(harness.refusal())
        with capturedLogs() as events:
            refusal = harness.refusal()
        self.assertEqual(len(events), 1)
        self.assertIn("accept rate limit", events[0]["log_format"])
        assert refusal is not None
        self.assertIn(b"\r\nX-Inferproxy-Refused: accept-rate\r\n", refusal)
        self.assertIn(b"\r\nRetry-After: 1\r\n", refusal)
        harness.clock.advance(0.5)
        self.assertIsNone(harness.refusal())

    def test_refusal_lingers_until_read(self) -> None:
        """
        A refused connection is half-closed, not closed: what the client sends is dropped,
        and it goes when the client closes, or is aborted after REFUSAL_LINGER_SECONDS.
        """
        harness = Harness(ProxyLimits(max_connections=1, burst=100))
        harness.pair()
        refused, transport = harness.accept()
        self.assertTrue(transport.write_closed)
        self.assertFalse(transport.disconnecting)
        self.assertEqual(harness.factory.lingering_refusals, 1)
        refused.dataReceived(b"POST /v1/chat/completions HTTP/1.1\r\n")
        self.assertEqual(harness.endpoint.attempts[1:], [])
        harness.clock.advance(REFUSAL_LINGER_SECONDS - 0.001)
        self.assertFalse(transport.disconnecting)
        harness.clock.advance(0.001)
        self.assertTrue(transport.disconnected)
        refused.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(harness.factory.lingering_refusals, 0)
        self.assertEqual(harness.clock.getDelayedCalls(), [])

    def test_lingering_refusals_bounded(self) -> None:
        """
        Past MAX_LINGERING_REFUSALS lingering refused connections, one more gets its answer
        and is closed at once.
        """
        harness = Harness(ProxyLimits(max_connections=1, burst=100))
        harness.pair()
        for _ in range(MAX_LINGERING_REFUSALS):
            harness.accept()
        _, transport = harness.accept()
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 503 "))
        self.assertFalse(transport.write_closed)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(harness.factory.lingering_refusals, MAX_LINGERING_REFUSALS)

    def test_cap_refusal_spends_no_token(self) -> None:
        """
        A connection refused by the cap does not use up the bucket.
        """
        harness = Harness(ProxyLimits(max_connections=1, burst=2, refill_per_second=1))
        harness.pair()
        for _ in range(5):
            self.assertIsNotNone(harness.refusal())
        self.assertEqual(harness.factory._bucket.take(), True)

    def test_limits_validated(self) -> None:
        """
        Limits below one, or rates that are not positive, are refused.
        """
        for bad in (
            {"max_connections": 0},
            {"burst": 0},
            {"refill_per_second": 0},
            {"connect_timeout": -1},
        ):
            self.assertRaises(ValueError, ProxyLimits, **bad)


class RelayTests(SynchronousTestCase):
    """
    A pair relays bytes unchanged, passes half-closes on and closes when both directions are
    done.
    """

    def test_client_paused_until_upstream_connects(self) -> None:
        """
        Nothing is read from the client before the upstream connection exists.
        """
        harness = Harness()
        _, client_transport = harness.accept()
        self.assertEqual(client_transport.producerState, "paused")
        harness.connect_upstream()
        self.assertEqual(client_transport.producerState, "producing")

    def test_each_transport_produces_for_the_other(self) -> None:
        """
        Each transport is registered as the other's streaming producer: this is the
        backpressure.
        """
        _, client_transport, _, upstream_transport = Harness().pair()
        self.assertIs(client_transport.producer, upstream_transport)
        self.assertIs(upstream_transport.producer, client_transport)
        self.assertTrue(client_transport.streaming)
        self.assertTrue(upstream_transport.streaming)

    def test_sides_are_half_closeable(self) -> None:
        """
        Both sides provide L{IHalfCloseableProtocol}, so EOF is not a full close.
        """
        client, _, upstream, _ = Harness().pair()
        self.assertTrue(IHalfCloseableProtocol.providedBy(client))
        self.assertTrue(IHalfCloseableProtocol.providedBy(upstream))

    @given(
        st.lists(st.tuples(st.booleans(), st.binary(min_size=1, max_size=64)), max_size=40),
        st.booleans(),
    )
    def test_bytes_arrive_identical(
        self, chunks: list[tuple[bool, bytes]], client_eof_first: bool
    ) -> None:
        """
        Any interleaving of byte chunks in both directions arrives identical on the other
        side, each EOF is passed on after the data before it, and the pair closes once both
        directions are done.
        """
        client, client_transport, upstream, upstream_transport = Harness().pair()
        for from_client, chunk in chunks:
            (client if from_client else upstream).dataReceived(chunk)
        up = b"".join(c for from_client, c in chunks if from_client)
        down = b"".join(c for from_client, c in chunks if not from_client)
        self.assertEqual(upstream_transport.value(), up)
        self.assertEqual(client_transport.value(), down)
        sides = {
            "client": (client, client_transport),
            "up": (upstream, upstream_transport),
        }
        first, second = ("client", "up") if client_eof_first else ("up", "client")
        first_side, first_transport = sides[first]
        second_side, second_transport = sides[second]
        first_side.readConnectionLost()  # type: ignore[attr-defined]
        self.assertTrue(second_transport.write_closed)
        self.assertFalse(first_transport.write_closed)
        second_side.dataReceived(b"late")
        self.assertTrue(first_transport.value().endswith(b"late"))
        second_side.writeConnectionLost()  # type: ignore[attr-defined]
        self.assertFalse(client_transport.disconnecting)
        self.assertFalse(upstream_transport.disconnecting)
        second_side.readConnectionLost()  # type: ignore[attr-defined]
        self.assertTrue(first_transport.write_closed)
        first_side.writeConnectionLost()  # type: ignore[attr-defined]
        self.assertTrue(client_transport.disconnecting)
        self.assertTrue(upstream_transport.disconnecting)

    def test_eof_unregisters_producer_first(self) -> None:
        """
        Passing an EOF on unregisters the finished side as the peer's producer, so a paused
        producer cannot hold the half-close back.
        """
        client, _, _, upstream_transport = Harness().pair()
        client.readConnectionLost()  # type: ignore[attr-defined]
        self.assertIsNone(upstream_transport.producer)
        self.assertTrue(upstream_transport.write_closed)

    def test_failure_closes_peer(self) -> None:
        """
        When one side fails, its peer is unregistered from it and closed, and the pair's slot
        comes back once both are gone.
        """
        harness = Harness()
        client, client_transport, upstream, _ = harness.pair()
        upstream.connectionLost(Failure(ConnectionLost()))
        self.assertIsNone(client_transport.producer)
        self.assertTrue(client_transport.disconnecting)
        self.assertEqual(harness.factory.open_pairs, 1)
        client.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(harness.factory.open_pairs, 0)

    def test_upstream_refused_closes_client(self) -> None:
        """
        An upstream that refuses the connection closes the client at once, frees the slot
        and logs one line naming the upstream.
        """
        harness = Harness()
        client, client_transport = harness.accept()
        with capturedLogs() as events:
            harness.endpoint.attempts[-1][1].errback(Failure(ConnectionRefusedError()))
        self.assertTrue(client_transport.disconnected)
        self.assertEqual(client_transport.value(), b"")
        self.assertEqual(len(events), 1)
        self.assertIn("up:1", events[0]["log_format"].format(**events[0]))
        client.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(harness.factory.open_pairs, 0)

    def test_client_gone_cancels_upstream_attempt(self) -> None:
        """
        A client that disconnects while the upstream connection is being made cancels that
        attempt, silently.
        """
        harness = Harness()
        client, _ = harness.accept()
        with capturedLogs() as events:
            client.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(harness.endpoint.cancelled, 1)
        self.assertEqual(events, [])
        self.assertEqual(harness.factory.open_pairs, 0)


class ParseUpstreamTests(SynchronousTestCase):
    """
    L{parse_upstream} reads HOST:PORT and refuses anything else with a reason.
    """

    def test_forms(self) -> None:
        """
        Names, IPv4 and bracketed IPv6 addresses are accepted.
        """
        self.assertEqual(parse_upstream("localhost:8080"), ("localhost", 8080))
        self.assertEqual(parse_upstream("127.0.0.1:1"), ("127.0.0.1", 1))
        self.assertEqual(parse_upstream("[::1]:65535"), ("::1", 65535))

    def test_bad(self) -> None:
        """
        A missing host or port, a port out of range and a bare IPv6 address are refused.
        """
        for bad in ("localhost", ":80", "h:0", "h:65536", "h:x", "::1:80", "h:-1"):
            self.assertRaises(ValueError, parse_upstream, bad)


class UpstreamEndpointTests(SynchronousTestCase):
    """
    L{upstream_endpoint} connects to addresses directly and resolves only names.
    """

    def test_kinds(self) -> None:
        """
        IPv4 and IPv6 literals get plain TCP endpoints; a name gets a resolving one. (The
        classes are named as strings: only inferproxy.py may import TCP client APIs.)
        """
        clock = Clock()

        def kind(host: str) -> str:
            return type(upstream_endpoint(clock, host, 1, 1.0)).__name__

        self.assertEqual(kind("127.0.0.1"), "TCP4ClientEndpoint")
        self.assertEqual(kind("::1"), "TCP6ClientEndpoint")
        self.assertEqual(kind("localhost"), "HostnameEndpoint")


class ProxySocketTests(TestCase):
    """
    The forwarder relays, half-closes, applies backpressure and tears down over real
    sockets.
    """

    timeout = 15

    def start(
        self,
        configure: Callable[[Peer], None] = lambda peer: None,
        limits: ProxyLimits | None = None,
        upstream_port: int | None = None,
    ) -> UpstreamFactory:
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "infer.sock")
        upstream = UpstreamFactory(configure)
        if upstream_port is None:
            port = reactor.listenTCP(0, upstream, interface="127.0.0.1")
            self.addCleanup(port.stopListening)
            upstream_port = port.getHost().port
        self.proxy = ObservedProxyFactory(
            upstream_endpoint(reactor, "127.0.0.1", upstream_port, 5.0),
            reactor,
            limits or ProxyLimits(max_connections=64, burst=10**6, refill_per_second=1e6),
            f"127.0.0.1:{upstream_port}",
        )
        service = InferProxyService(reactor, self.path, self.proxy)
        service.startService()
        self.addCleanup(service.stopService)
        return upstream

    def connect(self, peer: Peer | None = None) -> Deferred[Peer]:
        """
        Connect a client L{Peer} to the proxy's socket.
        """
        client = peer or Peer()
        endpoint = UNIXClientEndpoint(real_reactor(), self.path)
        connecting: Deferred[Peer] = endpoint.connect(Factory.forProtocol(lambda: client))
        return connecting

    @inlineCallbacks
    def synchronise(self, client: Peer, server: Peer) -> Any:
        """
        Send one byte through so that the pair is known to be complete, then forget it.
        """
        seen: Deferred[None] = Deferred()
        server.on_data = lambda peer, data: seen.callback(None)
        client.transport.write(b"!")
        yield seen
        server.on_data = lambda peer, data: None
        del server.received[:]

    @inlineCallbacks
    def test_client_close_frees_pair_to_frozen_upstream(self) -> Any:
        """
        A client that closes its socket (not a half-close) while the upstream never answers
        nor closes: the proxy closes the upstream connection too, and the pair is freed.
        """

        def frozen(peer: Peer) -> None:
            peer.on_eof = lambda p: None

        upstream = self.start(frozen)
        arrived = upstream.next_peer()
        client = yield self.connect()
        server = yield arrived
        yield self.synchronise(client, server)
        client.transport.loseConnection()
        yield server.closed
        yield self.proxy.all_closed()
        self.assertEqual(self.proxy.open_pairs, 0)

    @inlineCallbacks
    def test_half_close_from_client(self) -> Any:
        """
        A client that sends and then shuts down its writing still gets the reply the
        upstream sends only after seeing that EOF.
        """

        def configure(peer: Peer) -> None:
            def reply(peer: Peer) -> None:
                peer.transport.write(b"GOT:" + bytes(peer.received))
                peer.transport.loseConnection()

            peer.on_eof = reply

        self.start(configure)
        client = yield self.connect()
        client.transport.write(b"hello")
        client.transport.loseWriteConnection()
        yield client.closed
        self.assertEqual(bytes(client.received), b"GOT:hello")
        yield self.proxy.all_closed()

    @inlineCallbacks
    def test_half_close_from_upstream(self) -> Any:
        """
        An upstream that sends and then shuts down its writing still gets the reply the
        client sends only after seeing that EOF; both close once both directions are done.
        """

        def configure(peer: Peer) -> None:
            def greet(peer: Peer) -> None:
                peer.transport.write(b"banner")
                peer.transport.loseWriteConnection()

            peer.on_connect = greet

        upstream = self.start(configure)
        arrived = upstream.next_peer()
        client = Peer()

        def answer(peer: Peer) -> None:
            peer.transport.write(b"reply:" + bytes(peer.received))
            peer.transport.loseWriteConnection()

        client.on_eof = answer
        yield self.connect(client)
        server = yield arrived
        yield server.eof
        self.assertEqual(bytes(server.received), b"reply:banner")
        server.transport.loseConnection()
        yield gatherResults([client.closed, server.closed])
        yield self.proxy.all_closed()

    @inlineCallbacks
    def check_bounded(self, slow_upstream: bool) -> Any:
        total = 16 * 1024 * 1024
        payload = os.urandom(1024 * 1024) * 16
        upstream = self.start()
        arrived = upstream.next_peer()
        client = yield self.connect()
        server = yield arrived
        yield self.synchronise(client, server)
        writer, reader = (client, server) if slow_upstream else (server, client)
        reader.transport.pauseProducing()
        side = self.proxy.sides[-1]
        towards_reader = side.peer.transport if slow_upstream else side.transport
        from_writer = side.transport if slow_upstream else side.peer.transport
        peak = [0]
        engaged: Deferred[None] = Deferred()
        original_write = towards_reader.write
        original_pause = from_writer.pauseProducing

        def write(data: bytes) -> None:
            original_write(data)
            peak[0] = max(peak[0], buffered(towards_reader))

        def pause() -> None:
            original_pause()
            if not engaged.called:
                engaged.callback(None)

        towards_reader.write = write
        from_writer.pauseProducing = pause
        done: Deferred[None] = Deferred()
        reader.on_data = lambda peer, data: (
            done.callback(None) if len(peer.received) >= total and not done.called else None
        )
        writer.transport.write(payload)
        yield engaged
        reader.transport.resumeProducing()
        yield done
        self.assertEqual(hashlib.sha256(reader.received).digest(), hashlib.sha256(payload).digest())
        self.assertLess(peak[0], 512 * 1024)
        client.transport.loseConnection()
        yield self.proxy.all_closed()

    def test_slow_upstream_reader(self) -> Any:
        """
        A fast client writing 16 MiB to an upstream that does not read pauses reading from
        the client: the proxy buffers less than 512 KiB, and every byte arrives once the
        upstream reads.
        """
        return self.check_bounded(slow_upstream=True)

    def test_slow_client_reader(self) -> Any:
        """
        A fast upstream writing 16 MiB to a client that does not read is paused in the
        same way, with the same bound.
        """
        return self.check_bounded(slow_upstream=False)

    @inlineCallbacks
    def test_upstream_refuses(self) -> Any:
        """
        When the upstream refuses the connection the client is closed at once, having
        received nothing, and the slot is free again.
        """
        probe = real_reactor().listenTCP(0, Factory(), interface="127.0.0.1")
        dead_port = probe.getHost().port
        yield probe.stopListening()
        self.start(upstream_port=dead_port)
        with capturedLogs() as captured:
            client = yield self.connect()
            yield client.closed
        events = proxy_events(captured)
        self.assertEqual(bytes(client.received), b"")
        self.assertEqual(len(events), 1)
        self.assertIn("unreachable", events[0]["log_format"])
        yield self.proxy.all_closed()

    @inlineCallbacks
    def test_upstream_dies_mid_stream(self) -> Any:
        """
        An upstream that resets its connection mid-stream closes the client, after the
        client has received what was sent before.
        """
        upstream = self.start(lambda peer: setattr(peer, "on_connect", lambda p: None))
        arrived = upstream.next_peer()
        client = Peer()
        got_partial: Deferred[None] = Deferred()
        client.on_data = lambda peer, data: (
            got_partial.callback(None) if not got_partial.called else None
        )
        yield self.connect(client)
        server = yield arrived
        server.transport.write(b"partial")
        yield got_partial
        set_reset_on_close(server.transport)
        server.transport.abortConnection()
        yield client.closed
        self.assertEqual(bytes(client.received), b"partial")
        yield self.proxy.all_closed()

    @inlineCallbacks
    def test_client_dies_mid_stream(self) -> Any:
        """
        A client that vanishes while the upstream is streaming closes the upstream side, as
        llama-server needs to stop generating.
        """

        def stream(peer: Peer) -> None:
            def more() -> None:
                if peer.transport.connected and not peer.closed.called:
                    peer.transport.write(b"token " * 100)
                    real_reactor().callLater(0, more)

            more()

        upstream = self.start(lambda peer: setattr(peer, "on_connect", stream))
        arrived = upstream.next_peer()
        client = Peer()
        got_some: Deferred[None] = Deferred()
        client.on_data = lambda peer, data: got_some.callback(None) if not got_some.called else None
        yield self.connect(client)
        server = yield arrived
        yield got_some
        client.transport.abortConnection()
        yield server.closed
        yield self.proxy.all_closed()

    @inlineCallbacks
    def test_thousand_connections_leak_nothing(self) -> Any:
        """
        1,000 sequential connections, each relaying a round trip, leave the process's open
        file count where it started.
        """

        def echo(peer: Peer) -> None:
            peer.on_data = lambda p, data: p.transport.write(data)

        self.start(echo)

        @inlineCallbacks
        def round_trip() -> Any:
            client = Peer()
            answered: Deferred[None] = Deferred()
            client.on_data = lambda peer, data: answered.callback(None)
            yield self.connect(client)
            client.transport.write(b"x")
            yield answered
            client.transport.loseConnection()
            yield client.closed
            yield self.proxy.all_closed()

        yield round_trip()
        # Files that earlier tests left to the garbage collector must not close during the
        # count (which then read one fewer): collect them first.
        gc.collect()
        before = open_fds()
        for _ in range(1000):
            yield round_trip()
        self.assertEqual(open_fds(), before)

    @inlineCallbacks
    def test_ninth_concurrent_connection_refused(self) -> Any:
        """
        With 8 connections open, a 9th gets the 503 naming the connection limit and is
        closed without reaching the upstream, and one log line names the limit.
        """

        def echo(peer: Peer) -> None:
            peer.on_data = lambda p, data: p.transport.write(data)

        upstream = self.start(echo, ProxyLimits(burst=100))
        clients = []
        for _ in range(8):
            client = Peer()
            answered: Deferred[None] = Deferred()
            client.on_data = lambda peer, data, d=answered: d.callback(None)  # type: ignore[misc]
            yield self.connect(client)
            client.transport.write(b"x")
            yield answered
            clients.append(client)
        with capturedLogs() as captured:
            ninth = yield self.connect()
            yield ninth.closed
        events = proxy_events(captured)
        self.assertTrue(bytes(ninth.received).startswith(b"HTTP/1.1 503 "))
        self.assertIn(b"X-Inferproxy-Refused: connections", bytes(ninth.received))
        self.assertEqual(len(upstream.peers), 8)
        self.assertEqual(len(events), 1)
        self.assertIn("connection limit", events[0]["log_format"])
        for client in clients:
            client.transport.loseConnection()
        yield self.proxy.all_closed()

    @inlineCallbacks
    def test_echo_both_directions(self) -> Any:
        """
        4 MiB of random bytes written in uneven pieces come back identical through an echo
        upstream while both directions are busy.
        """

        def echo(peer: Peer) -> None:
            peer.on_data = lambda p, data: p.transport.write(data)

        self.start(echo)
        payload = os.urandom(4 * 1024 * 1024)
        client = Peer()
        done: Deferred[None] = Deferred()
        client.on_data = lambda peer, data: (
            done.callback(None) if len(peer.received) >= len(payload) and not done.called else None
        )
        yield self.connect(client)
        offset, size = 0, 1
        while offset < len(payload):
            client.transport.write(payload[offset : offset + size])
            offset += size
            size = size * 7 % 65521 + 1
        yield done
        self.assertEqual(bytes(client.received), payload)
        client.transport.loseConnection()
        yield self.proxy.all_closed()
