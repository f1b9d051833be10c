"""
Tests for L{loopd.write_now}: over a real Unix socket pair, one end a Twisted transport
(adopted by the real reactor, which these tests never let run before they look) and the
other a plain non-blocking socket, so that what reached the peer is read without a reactor
turn in between.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from loopd.test.support.peers import buffered, real_reactor
from loopd.write_now import flush, send_or_queue


class _Held(Protocol):
    """The adopted end: it only notes when it is gone."""

    def __init__(self) -> None:
        self.gone = False
        self._waiting: list[Deferred[None]] = []

    def closed(self) -> Deferred[None]:
        """Fires once the connection is gone (at once if it is)."""
        waiter: Deferred[None] = Deferred()
        if self.gone:
            waiter.callback(None)
        else:
            self._waiting.append(waiter)
        return waiter

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.gone = True
        for waiter in self._waiting:
            waiter.callback(None)


class WriteNowTests(TestCase):
    """What each function sends at once, what it leaves queued, and what it leaves alone."""

    def setUp(self) -> None:
        """A socket pair: C{self.transport} on one end, C{self.peer} the other."""
        ours, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.peer.setblocking(False)
        self.addCleanup(self.peer.close)
        self.protocol = _Held()
        factory = Factory.forProtocol(lambda: self.protocol)
        reactor = real_reactor()
        self.transport: Any = reactor.adoptStreamConnection(ours.fileno(), socket.AF_UNIX, factory)
        ours.close()  # the transport holds its own duplicate

    def tearDown(self) -> Any:
        """Close the transport and wait until it is gone."""
        self.transport.abortConnection()
        return self.protocol.closed()

    def received(self) -> bytes:
        """What the peer can read right now, without waiting."""
        try:
            return self.peer.recv(1 << 20)
        except BlockingIOError:
            return b""

    def test_write_alone_waits_for_the_reactor(self) -> None:
        """The premise: Twisted's own write sends nothing until the reactor turns."""
        self.transport.write(b"hello")
        self.assertEqual(self.received(), b"")
        self.assertEqual(buffered(self.transport), 5)

    def test_flush_sends_what_is_queued(self) -> None:
        """Pieces written one after another go out at once, in order, and nothing is held."""
        self.transport.write(b"he")
        self.transport.writeSequence([b"l", b"lo"])
        flush(self.transport)
        self.assertEqual(self.received(), b"hello")
        self.assertEqual(buffered(self.transport), 0)

    def test_send_or_queue_sends_at_once(self) -> None:
        """Nothing queued: the bytes go straight out."""
        send_or_queue(self.transport, b"hello")
        self.assertEqual(self.received(), b"hello")
        self.assertEqual(buffered(self.transport), 0)

    def test_send_or_queue_keeps_the_order(self) -> None:
        """Something queued already: the new bytes queue behind it, nothing jumps ahead."""
        self.transport.write(b"first ")
        send_or_queue(self.transport, b"second")
        self.assertEqual(self.received(), b"")
        flush(self.transport)
        self.assertEqual(self.received(), b"first second")

    def test_what_the_kernel_refuses_stays_queued(self) -> Any:
        """
        A peer that reads nothing: the socket takes what fits, the rest stays in the
        transport's queue (where backpressure sees it), and all of it arrives in order
        once the peer reads and the reactor writes.
        """
        data = bytes(range(256)) * 40_000  # far more than a socket buffer
        send_or_queue(self.transport, data)
        held = buffered(self.transport)
        self.assertGreater(held, 0)
        self.assertLess(held, len(data))
        self.transport.write(b"tail")
        flush(self.transport)
        self.assertGreater(buffered(self.transport), 0)
        got = bytearray()
        done: Deferred[None] = Deferred()

        def drain() -> None:
            got.extend(self.received())
            if len(got) < len(data) + 4:
                real_reactor().callLater(0, drain)
            else:
                done.callback(None)

        drain()
        return done.addCallback(lambda _: self.assertEqual(bytes(got), data + b"tail"))

    def test_closing_transport_left_to_twisted(self) -> Any:
        """
        After loseConnection the queue is Twisted's to send before the close: flush does
        not write then, and the peer gets every byte and then the end.
        """
        self.transport.write(b"last")
        self.transport.loseConnection()
        flush(self.transport)
        self.assertEqual(self.received(), b"")

        def check(_: None) -> None:
            self.peer.setblocking(True)
            self.assertEqual(self.peer.recv(100), b"last")
            self.assertEqual(self.peer.recv(100), b"")

        return self.protocol.closed().addCallback(check)

    def test_half_closed_transport_left_alone(self) -> None:
        """After loseWriteConnection nothing more is sent, whatever is asked."""
        self.transport.loseWriteConnection()
        send_or_queue(self.transport, b"late")
        flush(self.transport)
        self.assertEqual(self.received(), b"")

    def test_other_transports_written_as_usual(self) -> None:
        """A transport without a socket buffer (here an in-memory one) gets a plain write."""
        memory = StringTransport()
        send_or_queue(memory, b"abc")
        flush(memory)
        self.assertEqual(memory.value(), b"abc")
