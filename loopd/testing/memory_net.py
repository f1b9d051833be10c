# -*- test-case-name: loopd.test.test_fake_llama -*-
"""
Unix-socket connections in memory, for clients running on a C{MemoryReactorClock}.

Public test kit (L{loopd.testing}): every Unix-socket client of loopd (L{loopd.llama.Client},
L{loopd.queue.client.LeaseClient}, the gateway's upstream calls) and of a program that embeds
it reaches its server here without a socket file, on one clock the test moves.

A client connects with C{reactor.connectUNIX} (directly or through C{UNIXClientEndpoint}),
which the memory reactor only records in C{reactor.unixClients}. L{MemoryNet} takes those
attempts, wires each to a protocol of the server factory listening at its path with
C{twisted.test.iosim}, and moves bytes both ways when pumped:

 - L{MemoryNet.pump} connects pending attempts and moves bytes until nothing moves. An
   attempt on a path nobody listens on fails the client's connection: C{ConnectError}
   (no such file) or, after L{MemoryNet.kill} or C{stop_listening(path, stale=True)},
   C{ConnectionRefusedError} (a stale socket file, as after a crash).
 - L{MemoryNet.advance} moves the clock forward to each scheduled call in turn and pumps
   after each, so bytes written by a timer reach the peer before a later timer runs, and
   time lands exactly on every scheduled time.
 - L{MemoryConnection} closes or aborts one connection from either side. An abort drops the
   aborting side's unsent bytes and the peer sees C{ConnectionLost}; a close delivers what
   was written first and the peer sees C{ConnectionDone}.

Limits, inherited from iosim's C{FakeTransport}; tests that need these use real sockets:

 - no backpressure: C{pauseProducing} and C{resumeProducing} do nothing, so a slow reader
   never slows a writer, and the buffers are unbounded;
 - no half-close: C{loseWriteConnection} does nothing;
 - connections are made only when pumped, and connect timeouts are not modelled.

Anything the client uses must run on the memory reactor, not the global one: twisted.web's
C{FileBodyProducer} writes through the global cooperator by default, so its body never goes
out here; give it C{Cooperator(scheduler=lambda f: reactor.callLater(0, f))}.

Typical use, with L{loopd.testing.fake_llama.FakeLlama} as the server::

    reactor = MemoryReactorClock()
    fake, net = FakeLlama(reactor), MemoryNet(reactor)
    net.listen(path, fake)
    d = client_under_test(reactor, path).chat(...)
    net.advance(0.2)
    self.successResultOf(d)
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any

from twisted.internet import error
from twisted.internet.address import UNIXAddress
from twisted.internet.interfaces import IProtocolFactory
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim

__all__ = [
    "MAX_PUMP_ROUNDS",
    "MemoryConnection",
    "MemoryNet",
    "connect_pending",
]

#: Pump rounds after which L{MemoryNet.pump} gives up: two protocols that answer each other
#: forever would otherwise hang the test.
MAX_PUMP_ROUNDS = 100_000


class _MemoryTransport(iosim.FakeTransport):
    """
    iosim's transport with a real abort: unsent bytes are dropped and the peer's connection
    ends with C{ConnectionLost} (iosim's own abort is a plain close).
    """

    peer: _MemoryTransport | None = None
    lost_reason: Exception | None = None

    def abortConnection(self) -> None:
        self.stream = []
        self.lost_reason = error.ConnectionAborted()
        if self.peer is not None:
            self.peer.lost_reason = error.ConnectionLost("aborted by the peer")
        self.disconnecting = True

    def reportDisconnect(self) -> None:
        if self.lost_reason is None:
            super().reportDisconnect()
        else:
            self.protocol.connectionLost(Failure(self.lost_reason))


@dataclass(eq=False)
class MemoryConnection:
    """
    One client connection wired to a server protocol in memory. The close and abort methods
    take effect at the next pump.
    """

    path: str
    client: Any
    server: Any
    client_transport: _MemoryTransport
    server_transport: _MemoryTransport
    pump: iosim.IOPump

    @property
    def closed(self) -> bool:
        """
        Whether both ends have been told the connection is lost.
        """
        return bool(self.client_transport.disconnected and self.server_transport.disconnected)

    def close_from_server(self) -> None:
        """
        The server closes the connection after its written bytes are delivered.
        """
        self.server_transport.loseConnection()

    def abort_from_server(self) -> None:
        """
        The server aborts: its unsent bytes are lost and the client sees C{ConnectionLost}.
        """
        self.server_transport.abortConnection()

    def close_from_client(self) -> None:
        """
        The client closes the connection after its written bytes are delivered.
        """
        self.client_transport.loseConnection()

    def abort_from_client(self) -> None:
        """
        The client aborts: its unsent bytes are lost and the server sees C{ConnectionLost}.
        """
        self.client_transport.abortConnection()


def _pop_connector(reactor: MemoryReactorClock, path: str) -> Any:
    for index, connector in enumerate(reactor.connectors):
        destination = connector.getDestination()
        if isinstance(destination, UNIXAddress) and destination.name is not None:
            if os.fsdecode(destination.name) == path:
                return reactor.connectors.pop(index)
    return None


def _take_pending(reactor: MemoryReactorClock) -> list[tuple[str, Any, Any]]:
    """
    Remove every recorded C{connectUNIX} attempt from C{reactor}, with its connector, skipping
    the attempts the client has cancelled.
    """
    taken = []
    while reactor.unixClients:
        address, factory, _timeout, _check_pid = reactor.unixClients.pop(0)
        path = os.fsdecode(address)
        connector = _pop_connector(reactor, path)
        if connector is None or not connector.stoppedConnecting:
            taken.append((path, factory, connector))
    return taken


def _wire(
    reactor: MemoryReactorClock, path: str, client_factory: Any, server_factory: IProtocolFactory
) -> MemoryConnection | None:
    client = client_factory.buildProtocol(UNIXAddress(path))
    if client is None:
        return None
    server = server_factory.buildProtocol(UNIXAddress(None))
    refused = server is None
    if refused:
        # A listener whose factory returns None accepts and closes at once.
        server = Protocol()
    client_transport = _MemoryTransport(
        client, isServer=False, hostAddress=UNIXAddress(None), peerAddress=UNIXAddress(path)
    )
    server_transport = _MemoryTransport(
        server, isServer=True, hostAddress=UNIXAddress(path), peerAddress=UNIXAddress(None)
    )
    client_transport.peer, server_transport.peer = server_transport, client_transport
    pump = iosim.connect(
        server, server_transport, client, client_transport, greet=False, clock=reactor
    )
    if refused:
        server_transport.loseConnection()
    return MemoryConnection(path, client, server, client_transport, server_transport, pump)


def connect_pending(
    reactor: MemoryReactorClock, server_factory: IProtocolFactory
) -> list[MemoryConnection]:
    """
    Wire every pending C{connectUNIX} attempt on C{reactor}, whatever its path, to a protocol
    from C{server_factory}. Pump the returned connections (C{connection.pump.flush()}) to
    move bytes; L{MemoryNet} does all of this per path.
    """
    made = []
    for path, client_factory, _connector in _take_pending(reactor):
        connection = _wire(reactor, path, client_factory, server_factory)
        if connection is not None:
            made.append(connection)
    return made


class MemoryNet:
    """
    Unix-socket listeners and connections in memory on one C{MemoryReactorClock}, which is
    both the clients' reactor and the servers' clock.
    """

    def __init__(self, reactor: MemoryReactorClock) -> None:
        """
        @param reactor: where clients' C{connectUNIX} attempts are recorded, and the clock
            L{advance} moves.
        """
        self.reactor = reactor
        self.connections: list[MemoryConnection] = []
        self._listeners: dict[str, IProtocolFactory] = {}
        self._stale: set[str] = set()

    def listen(self, path: str, factory: IProtocolFactory) -> None:
        """
        Accept connections to C{path} with protocols from C{factory}.
        """
        self._listeners[path] = factory
        self._stale.discard(path)

    def stop_listening(self, path: str, stale: bool = False) -> None:
        """
        Stop accepting on C{path}. Later attempts fail with C{ConnectError} (no such file),
        or with C{ConnectionRefusedError} if C{stale} (the socket file was left behind).
        Open connections are not touched.
        """
        self._listeners.pop(path, None)
        if stale:
            self._stale.add(path)

    def kill(self, path: str) -> None:
        """
        The server at C{path} dies: its connections are aborted and the socket file is stale.
        """
        self.stop_listening(path, stale=True)
        for connection in self.open_connections(path):
            connection.abort_from_server()

    def open_connections(self, path: str | None = None) -> list[MemoryConnection]:
        """
        The connections not yet closed at both ends, to C{path} or to any path.
        """
        return [c for c in self.connections if not c.closed and (path is None or c.path == path)]

    def connect_pending(self) -> list[MemoryConnection]:
        """
        Wire the pending connection attempts to their listeners, or fail them; no bytes move.
        """
        made = []
        for path, client_factory, connector in _take_pending(self.reactor):
            server_factory = self._listeners.get(path)
            if server_factory is None:
                if path in self._stale:
                    reason: Exception = error.ConnectionRefusedError()
                else:
                    reason = error.getConnectError((errno.ENOENT, os.strerror(errno.ENOENT)))
                client_factory.clientConnectionFailed(connector, Failure(reason))
                continue
            connection = _wire(self.reactor, path, client_factory, server_factory)
            if connection is not None:
                made.append(connection)
        self.connections.extend(made)
        return made

    def pump(self) -> None:
        """
        Connect pending attempts and move bytes and closes both ways until nothing moves.
        Calls due at the current time (C{callLater(0, ...)}) run too.
        """
        for _ in range(MAX_PUMP_ROUNDS):
            moved = bool(self.connect_pending())
            for connection in self.open_connections():
                moved = connection.pump.pump() or moved
            if not moved:
                return
        raise RuntimeError(f"MemoryNet.pump: still moving bytes after {MAX_PUMP_ROUNDS} rounds")

    def advance(self, seconds: float) -> None:
        """
        Let C{seconds} pass (see L{run_to}).
        """
        self.run_to(self.reactor.seconds() + seconds)

    def run_to(self, when: float) -> None:
        """
        Let time pass up to the clock time C{when}: jump to each scheduled call up to then, in
        order, pumping after each, and pump again at the end.
        """
        clock = self.reactor
        self.pump()
        while True:
            due = [call.getTime() for call in clock.getDelayedCalls()]
            soonest = min((t for t in due if t <= when), default=None)
            if soonest is None:
                break
            # Setting the time, rather than advancing by a difference, lands exactly on it.
            clock.rightNow = max(clock.rightNow, soonest)
            clock.advance(0)
            self.pump()
        clock.rightNow = max(clock.rightNow, when)
        clock.advance(0)
        self.pump()
