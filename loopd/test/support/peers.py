"""
Scriptable socket peers and observers for tests that run over real sockets.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from loopd.inferproxy import InferProxyFactory


def real_reactor() -> Any:
    """
    The global reactor that trial runs, imported when a test needs it.
    """
    from twisted.internet import reactor

    return reactor


@implementer(IHalfCloseableProtocol)
class Peer(Protocol):
    """
    A scriptable half-close-aware endpoint of a test connection: it records what it reads
    and fires Deferreds on EOF and on close. By default it closes when it reads EOF; once
    both its directions are shut it closes in any case.
    """

    transport: Any
    _write_closed = False

    def __init__(self) -> None:
        self.received = bytearray()
        self.eof: Deferred[None] = Deferred()
        self.closed: Deferred[None] = Deferred()
        self.on_connect: Callable[[Peer], None] = lambda peer: None
        self.on_data: Callable[[Peer, bytes], None] = lambda peer, data: None
        self.on_eof: Callable[[Peer], None] = lambda peer: peer.transport.loseConnection()
        self.connected_once: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.on_connect(self)
        self.connected_once.callback(None)

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        self.on_data(self, data)

    def readConnectionLost(self) -> None:
        self.eof.callback(None)
        self.on_eof(self)
        if self._write_closed:
            self.transport.loseConnection()

    def writeConnectionLost(self) -> None:
        self._write_closed = True
        if self.eof.called:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self.eof.called:
            self.eof.callback(None)
        self.closed.callback(None)


class UpstreamFactory(Factory):
    """
    Builds L{Peer}s for the TCP server, configured by a callback, and keeps them.
    """

    noisy = False

    def __init__(self, configure: Callable[[Peer], None] = lambda peer: None) -> None:
        self.configure = configure
        self.peers: list[Peer] = []
        self.arrived: list[Deferred[Peer]] = []

    def buildProtocol(self, addr: object) -> Peer:
        peer = Peer()
        self.configure(peer)
        self.peers.append(peer)
        peer.connected_once.addCallback(lambda _: self._arrive(peer))
        return peer

    def _arrive(self, peer: Peer) -> None:
        if self.arrived:
            self.arrived.pop(0).callback(peer)

    def next_peer(self) -> Deferred[Peer]:
        d: Deferred[Peer] = Deferred()
        self.arrived.append(d)
        return d


class ObservedProxyFactory(InferProxyFactory):
    """
    The forwarder under test, keeping its client-side protocols and firing waiters when
    the open pair count reaches zero.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sides: list[Any] = []
        self._idle_waiters: list[Deferred[None]] = []

    def buildProtocol(self, addr: Any) -> Any:
        side = super().buildProtocol(addr)
        if side is not None:
            self.sides.append(side)
        return side

    def pair_closed(self) -> None:
        super().pair_closed()
        if self.open_pairs == 0:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def all_closed(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if self.open_pairs == 0:
            d.callback(None)
        else:
            self._idle_waiters.append(d)
        return d


def buffered(transport: Any) -> int:
    """
    Bytes a real Twisted transport holds in its write buffer (private attributes of
    L{twisted.internet.abstract.FileDescriptor}).
    """
    held: int = len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    return held


def set_reset_on_close(transport: Any) -> None:
    """
    Make closing this TCP transport send a reset, as a crashed process's kernel may.
    """
    transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def proxy_events(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """
    The captured log events that the forwarder itself emitted.
    """
    return [e for e in events if e.get("log_namespace") == "loopd.inferproxy"]


def open_fds() -> int:
    """
    How many file descriptors this process has open.
    """
    return len(os.listdir("/proc/self/fd"))
