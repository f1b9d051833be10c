"""
A llama-server stand-in for backpressure tests over real sockets: it streams a long answer
as a push producer and shows when its reader stopped reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from loopd import http
from loopd.testing.fake_llama import RequestParser


class ReadCounter:
    """
    Counts every byte loopd's HTTP client reads from any socket, while installed: what the
    HTTP parser, the SSE decoder and the assembler hold is at most that much.

    @ivar read: the bytes read so far.
    """

    def __init__(self, patch: Any) -> None:
        """
        @param patch: a trial test's C{patch}, which undoes the counting after the test.
        """
        self.read = 0
        original = http._CappedClientProtocol.dataReceived

        def counting(protocol: Any, data: bytes) -> None:
            self.read += len(data)
            original(protocol, data)

        patch(http._CappedClientProtocol, "dataReceived", counting)


@implementer(IPushProducer)
class StreamingUpstream(Protocol):
    """
    Streams a long answer as a push producer registered on its own transport: it writes one
    piece per reactor turn, as a generating server does, and only while its transport has
    not paused it. A reader that keeps up never fills the transport's buffer, so a pause
    means the reader stopped reading. It writes C{wire}, the whole response piece by piece,
    once a whole request has arrived; fires C{paused} at its first pause (unless fired
    already) and C{closed} when the connection is lost.

    @ivar sent: the bytes handed to the transport so far.
    """

    transport: Any

    def __init__(
        self,
        reactor: Any,
        wire: Sequence[bytes],
        paused: Deferred[None],
        closed: Deferred[None],
    ) -> None:
        """
        @param reactor: the real reactor (its C{callLater(0)} is a turn).
        @param wire: the response, head first, piece by piece.
        """
        self._reactor = reactor
        self._wire = list(wire)
        self._next = 0
        self._parser = RequestParser()
        self._paused = False
        self._turn: Any = None
        self._paused_once = paused
        self._closed = closed
        self.sent = 0

    @property
    def total(self) -> int:
        """The bytes of the whole response."""
        return sum(map(len, self._wire))

    def connectionMade(self) -> None:
        """Be the transport's producer, so its buffer tells when the reader lags."""
        self.transport.registerProducer(self, True)

    def dataReceived(self, data: bytes) -> None:
        """Start the answer once the request is whole."""
        if self._next == 0 and self._turn is None and self._parser.feed(data) is not None:
            self._schedule()

    def _schedule(self) -> None:
        if not self._paused and self._turn is None:
            self._turn = self._reactor.callLater(0, self._write_next)

    def _write_next(self) -> None:
        self._turn = None
        if self._paused:
            return
        piece = self._wire[self._next]
        self._next += 1
        self.sent += len(piece)
        self.transport.write(piece)
        if self._next == len(self._wire):
            self.transport.unregisterProducer()
            self.transport.loseConnection()
        else:
            self._schedule()

    def pauseProducing(self) -> None:
        """The reader lags: stop writing."""
        self._paused = True
        if not self._paused_once.called:
            self._paused_once.callback(None)

    def resumeProducing(self) -> None:
        """The reader caught up: write on."""
        self._paused = False
        self._schedule()

    def stopProducing(self) -> None:
        """The connection is going: write no more."""
        self._paused = True

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Stop the next turn's write; say so."""
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None
        self._closed.callback(None)
