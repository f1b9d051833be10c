"""
L{loopd.inferproxy} over real sockets: a Unix listener in a short temporary directory in
front of a TCP server on 127.0.0.1, driven by the real reactor.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, gatherResults, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import capturedLogs
from twisted.trial.unittest import TestCase

from loopd.inferproxy import InferProxyService, ProxyLimits, upstream_endpoint
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
        before = open_fds()
        for _ in range(1000):
            yield round_trip()
        self.assertEqual(open_fds(), before)

    @inlineCallbacks
    def test_ninth_concurrent_connection_refused(self) -> Any:
        """
        With 8 connections open, a 9th is closed at once without reaching the upstream, and
        one log line names the connection limit.
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
        self.assertEqual(bytes(ninth.received), b"")
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
