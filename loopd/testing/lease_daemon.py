# -*- test-case-name: loopd.test.test_testing_lease_daemon -*-
"""
A lease daemon in memory, for programs that embed L{loopd.queue.client.LeaseClient}.

Public test kit (L{loopd.testing}): L{FakeLeaseDaemon} is the real lease scheduler
(L{loopd.queue.scheduler.Scheduler}) behind the real wire layer
(L{loopd.queue.protocol.LeaseFactory}), listening at a path of a
L{loopd.testing.memory_net.MemoryNet}. Nothing else is fake: there is no process and no
socket file, and its clock is the test's C{MemoryReactorClock}, so lease expiry, idle yield,
aging and the sweep happen at exact clock times.

Why the real scheduler and not a scripted peer: a program under test wants to know that it
holds, beats, releases and loses leases as C{twist llmqueue} would make it, and the real
rules (tiers, aging, idle yield, TTL, the terms in each C{granted}) are what it must meet. A
scripted peer would have each test hand-write the daemon's replies and would drift from the
real daemon as the protocol grows; the scheduler is pure and clock-injected, so the real one
is as deterministic as a script. (loopd's own tests of the client's byte-level behaviour
script the peer themselves, in L{loopd.test.test_queue_client}.) What is not modelled: the
C{llm-queue.json} file and its hot reload, the event log and idle exit of C{twist llmqueue};
give a policy per queue key instead.

Typical use::

    reactor = MemoryReactorClock()
    net = MemoryNet(reactor)
    daemon = FakeLeaseDaemon(net, policy=QueuePolicy(max_streams=1))
    client = LeaseClient(reactor, daemon.path)
    d = client.acquire("gpu", "session-1")
    net.pump()
    lease = self.successResultOf(d)
    assert daemon.holders("gpu") == ["session-1"]
    daemon.kill()  # the daemon dies: at the next pump the client loses its slot
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from twisted.internet.interfaces import IAddress
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure

from loopd.queue.protocol import LeaseFactory, LeaseProtocol, deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter
from loopd.testing.memory_net import MemoryNet

__all__ = ["DEFAULT_PATH", "FakeLeaseDaemon"]

#: Where L{FakeLeaseDaemon} listens unless told otherwise: in memory only.
DEFAULT_PATH = "/tmp/ld-memory/llm-queue.sock"


class _RecordingProtocol(LeaseProtocol):
    """
    The real connection, which also records each complete line that decodes to a JSON
    object, with the clock time it arrived, in its daemon's L{FakeLeaseDaemon.received}.
    """

    def __init__(self, daemon: FakeLeaseDaemon) -> None:
        """An empty copy of the line buffer."""
        super().__init__()
        self._daemon = daemon
        self._seen = b""

    def dataReceived(self, data: bytes) -> None:
        """Record every complete line, then let the real connection handle C{data}."""
        self._seen += data
        *lines, self._seen = self._seen.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self._daemon.received.append((self._daemon.net.reactor.seconds(), message))
        super().dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Forget the connection, then end it as the real one does."""
        if self in self._daemon.connections:
            self._daemon.connections.remove(self)
        super().connectionLost(reason)


class _Factory(LeaseFactory):
    """The real factory, building recording connections."""

    def __init__(self, daemon: FakeLeaseDaemon, scheduler: Scheduler, sweep_ms: int) -> None:
        """Sweep C{scheduler} every C{sweep_ms} on the daemon's clock."""
        super().__init__(scheduler, reactor=daemon.net.reactor, sweep_ms=sweep_ms)
        self._daemon = daemon

    def buildProtocol(self, addr: IAddress | None) -> LeaseProtocol:
        """A new recording connection bound to this factory."""
        connection = _RecordingProtocol(self._daemon)
        connection.factory = self
        self._daemon.connections.append(connection)
        return connection


class FakeLeaseDaemon:
    """
    The lease daemon's scheduler and wire layer, listening at L{path} on a L{MemoryNet}.

    @ivar net: the in-memory network it listens on; its reactor is the daemon's clock.
    @ivar path: the socket path clients connect to.
    @ivar scheduler: the running scheduler (a new one after each L{start}).
    @ivar connections: the client connections open now.
    @ivar received: every message clients sent, as C{(clock time, message)}, in order,
        across restarts.
    """

    def __init__(
        self,
        net: MemoryNet,
        path: str = DEFAULT_PATH,
        *,
        policy: QueuePolicy | None = None,
        queues: Mapping[str, QueuePolicy] | None = None,
        groups: Mapping[str, tuple[str, ...]] | None = None,
        sweep_ms: int = 20,
        listen: bool = True,
    ) -> None:
        """
        @param policy: every queue's policy but those in C{queues} (the seed's C{defaults};
            default: L{QueuePolicy}'s, one slot per queue).
        @param queues: queue key → its own policy.
        @param groups: group name → the queue keys that share its slots.
        @param sweep_ms: how often the scheduler's sweep runs (lapsed leases, idle yield).
        @param listen: whether to L{start} now; without it, clients find no socket until
            L{start} is called (to test a client that spawns its daemon, or fails open).
        """
        self.net = net
        self.path = path
        self.connections: list[LeaseProtocol] = []
        self.received: list[tuple[float, dict[str, Any]]] = []
        self._router = StaticRouter(
            defaults=policy or QueuePolicy(), queues=dict(queues or {}), groups=dict(groups or {})
        )
        self._sweep_ms = sweep_ms
        self.scheduler = Scheduler(net.reactor, self._router, deliver_grant)
        self._factory: _Factory | None = None
        self._ran = False
        if listen:
            self.start()

    @property
    def listening(self) -> bool:
        """Whether the daemon runs and accepts connections."""
        return self._factory is not None

    def start(self) -> None:
        """
        Listen at L{path}. After a L{stop} or L{kill} this is a restarted daemon: a fresh
        scheduler, with no leases and no waiters. A no-op while running.
        """
        if self._factory is not None:
            return
        if self._ran:
            self.scheduler = Scheduler(self.net.reactor, self._router, deliver_grant)
        self._ran = True
        self._factory = _Factory(self, self.scheduler, self._sweep_ms)
        self._factory.startFactory()
        self.net.listen(self.path, self._factory)

    def stop(self) -> None:
        """
        The daemon exits cleanly (SIGTERM): it removes its socket, so later connects fail
        with "no such file", and closes every connection (its clients see it closed at the
        next pump of the network, so a test may L{start} it again before they notice).
        """
        self.net.stop_listening(self.path)
        for connection in self.net.open_connections(self.path):
            connection.close_from_server()
        self._stop_factory()

    def kill(self) -> None:
        """
        The daemon dies: every connection is aborted (its client sees the connection lost at
        the next pump of the network) and the socket file is left stale, so later connects
        are refused.
        """
        self.net.kill(self.path)
        self._stop_factory()

    def _stop_factory(self) -> None:
        if self._factory is not None:
            self._factory.stopFactory()
            self._factory = None

    def status(self) -> list[dict[str, Any]]:
        """The C{queues} list a C{status} op would answer, now."""
        return self.scheduler.status()

    def holders(self, queue_key: str | None = None) -> list[str]:
        """The sessions holding a slot of C{queue_key}, or of any queue, in status order."""
        return self._sessions("holders", queue_key)

    def waiting(self, queue_key: str | None = None) -> list[str]:
        """The sessions waiting on C{queue_key}, or on any queue, in queue order."""
        return self._sessions("waiting", queue_key)

    def _sessions(self, kind: str, queue_key: str | None) -> list[str]:
        return [
            str(entry["sessionKey"])
            for queue in self.status()
            if queue_key is None or queue["queueKey"] == queue_key
            for entry in queue[kind]
        ]

    def ops(self, op: str | None = None) -> list[dict[str, Any]]:
        """The messages clients sent (see L{received}), only those of C{op} if given."""
        return [message for _, message in self.received if op is None or message.get("op") == op]
