"""
L{loopd.queue.client.LeaseClient} against a real daemon over a real Unix socket: the
scheduler and wire layer in this process for most tests, and the C{twist llmqueue}
subprocess for the rest (spawned by the client, or started by the test and killed).

Time is real here, so the policies are short (C{leaseTtlMs} 1000, the minimum; sweeps every
20 ms) and every wait is on a Deferred.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol, connectionDone
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from loopd.queue.client import Lease, LeaseClient, QueueUnavailable, spawn_daemon
from loopd.queue.paths import socket_path
from loopd.queue.protocol import LeaseFactory, LeaseProtocol, deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist
from loopd.unixsocket import listen_unix

KEY = "http://gpu:8001/v1"
SHORT = QueuePolicy(lease_ttl_ms=1000, idle_yield_ms=100)


class _Factory(LeaseFactory):
    """
    A lease factory that keeps its connections and a Deferred per connection's end.
    """

    def __init__(self, scheduler: Scheduler, reactor: Any) -> None:
        """Sweep every 20 ms on C{reactor}."""
        super().__init__(scheduler, reactor=reactor, sweep_ms=20)
        self.live: list[LeaseProtocol] = []
        self.ends: list[Deferred[None]] = []

    def buildProtocol(self, addr: Any) -> LeaseProtocol:
        """Build a connection and note when it ends."""
        connection = super().buildProtocol(addr)
        ended: Deferred[None] = Deferred()
        self.live.append(connection)
        self.ends.append(ended)
        lost = connection.connectionLost

        def forget(reason: Failure = connectionDone) -> None:
            lost(reason)
            self.live.remove(connection)
            ended.callback(None)

        connection.connectionLost = forget  # type: ignore[method-assign]
        return connection


class Daemon:
    """
    The scheduler and wire layer listening on a real socket in this process.
    """

    def __init__(self, reactor: Any, path: str, policy: QueuePolicy) -> None:
        """Listen at C{path} with C{policy} as every queue's defaults."""
        self.scheduler = Scheduler(reactor, StaticRouter(defaults=policy), deliver_grant)
        self.factory = _Factory(self.scheduler, reactor)
        self.port = listen_unix(reactor, path, self.factory)
        self.listening = True

    def kill(self) -> Any:
        """Die: stop listening and drop every connection at once."""
        self.listening = False
        for connection in list(self.factory.live):
            transport: Any = connection.transport
            transport.abortConnection()
        return self.port.stopListening()

    @inlineCallbacks
    def stop(self) -> Any:
        """Stop listening (if still) and wait until every connection has ended."""
        if self.listening:
            self.listening = False
            yield self.port.stopListening()
        yield DeferredList(self.factory.ends)


class _Watch(ProcessProtocol):
    """
    Fires C{ended} with the exit code of a process it watches.
    """

    def __init__(self) -> None:
        """Not ended yet."""
        self.ended: Deferred[int | None] = Deferred()

    def processEnded(self, reason: Failure) -> None:
        """Fire C{ended} with the exit code."""
        value: Any = reason.value
        self.ended.callback(0 if reason.check(ProcessDone) else value.exitCode)


class RealDaemonTests(TestCase):
    """
    The client against the in-process daemon over a real socket.
    """

    def setUp(self) -> None:
        """A short temp dir for the socket; clients and daemons stopped at the end."""
        self.reactor = real_reactor()
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = socket_path(self.directory)
        self.clients: list[LeaseClient] = []
        self.daemons: list[Daemon] = []
        self.addCleanup(self.stop_all)

    @inlineCallbacks
    def stop_all(self) -> Any:
        """Close the clients, then stop the daemons once their connections have ended."""
        yield DeferredList([client.close() for client in self.clients])
        yield DeferredList([daemon.stop() for daemon in self.daemons])

    def daemon(self, policy: QueuePolicy = SHORT) -> Daemon:
        """Start an in-process daemon on the test's socket."""
        daemon = Daemon(self.reactor, self.path, policy)
        self.daemons.append(daemon)
        return daemon

    def client(self, **options: Any) -> LeaseClient:
        """A client of the test's socket, closed at the end."""
        client = LeaseClient(self.reactor, self.path, **options)
        self.clients.append(client)
        return client

    @inlineCallbacks
    def test_beats_outlive_ttl(self) -> Any:
        """A held lease outlives its 1 s TTL by beating; a waiter stays queued meanwhile."""
        self.daemon(QueuePolicy(lease_ttl_ms=1000, idle_yield_ms=0))
        first, second = self.client(), self.client()
        lease = yield first.acquire(KEY, "s1")
        waiting = second.acquire(KEY, "s2")
        yield deferLater(self.reactor, 1.5, lambda: None)
        status = yield second.status()
        self.assertTrue(lease.held)
        self.assertEqual([h["sessionKey"] for h in status[0]["holders"]], ["s1"])
        self.assertFalse(waiting.called)
        yield first.release(lease)
        theirs = yield waiting
        self.assertTrue(theirs.queued)

    @inlineCallbacks
    def test_requeue_after_idle_yield(self) -> Any:
        """A paused holder is yielded to a waiter, re-queues on resume, and is re-granted."""
        self.daemon()
        first, second = self.client(), self.client()
        lease = yield first.acquire(KEY, "s1", activity=True)
        lease.pause_beats()
        lost: Deferred[Lease] = Deferred()
        lease.add_lost_observer(lost.callback)
        theirs = yield second.acquire(KEY, "s2")
        self.assertTrue(theirs.held)
        lease.resume_beats()
        self.assertIs((yield lost), lease)
        self.assertFalse(lease.held)
        status = yield first.status()
        self.assertEqual([w["sessionKey"] for w in status[0]["waiting"]], ["s1"])
        yield second.release(theirs)
        again = yield lease.when_held()
        self.assertEqual((again.held, again.queued), (True, True))

    @inlineCallbacks
    def test_fail_open(self) -> Any:
        """No daemon: the acquire goes through unqueued."""
        lease = yield self.client().acquire(KEY, "s1")
        self.assertEqual((lease.held, lease.queued), (True, False))

    @inlineCallbacks
    def test_fail_closed(self) -> Any:
        """No daemon and fail_open=False: the acquire fails with QueueUnavailable."""
        yield self.assertFailure(self.client(fail_open=False).acquire(KEY, "s1"), QueueUnavailable)

    @inlineCallbacks
    def test_daemon_death_mid_wait(self) -> Any:
        """A daemon that dies releases waiters: unqueued with fail-open, else an error."""
        daemon = self.daemon()
        holder, opened, closed = self.client(), self.client(), self.client(fail_open=False)
        held = yield holder.acquire(KEY, "s1")
        waiting_open = opened.acquire(KEY, "s2")
        waiting_closed = closed.acquire(KEY, "s3")
        yield holder.status()
        status = yield opened.status()
        self.assertEqual(len(status[0]["waiting"]), 2)
        yield daemon.kill()
        released = yield waiting_open
        self.assertEqual((released.held, released.queued), (True, False))
        yield self.assertFailure(waiting_closed, QueueUnavailable)
        yield held.when_held()
        self.assertFalse(held.queued)

    @inlineCallbacks
    def test_spawn_on_connect(self) -> Any:
        """A connect that finds no daemon runs spawn once and then connects."""
        calls: list[Daemon] = []
        client = self.client(spawn=lambda: calls.append(self.daemon()))
        lease = yield client.acquire(KEY, "s1")
        self.assertEqual((len(calls), lease.queued), (1, True))


class SubprocessDaemonTests(TestCase):
    """
    The client against C{twist llmqueue} as a child process.
    """

    def setUp(self) -> None:
        """A short temp dir as the agent dir."""
        self.reactor = real_reactor()
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = socket_path(self.directory)

    def client(self, **options: Any) -> LeaseClient:
        """A client of the test's socket, closed at the end."""
        client = LeaseClient(self.reactor, self.path, **options)
        self.addCleanup(client.close)
        return client

    def start(self, defaults: dict[str, Any]) -> Deferred[None]:
        """Write the config, start the daemon sweeping every 20 ms; fire when it listens."""
        with open(os.path.join(self.directory, "llm-queue.json"), "w") as config:
            json.dump({"defaults": defaults}, config)
        self.process: TwistProcess = spawn_twist(
            self.reactor,
            b"listening on",
            "llmqueue",
            "--agent-dir",
            self.directory,
            "--sweep-ms",
            "20",
        )
        self.addCleanup(stop_twist, self.process)
        return self.process.ready

    @inlineCallbacks
    def test_client_spawns_daemon(self) -> Any:
        """spawn_daemon starts the real daemon; bye on close lets it idle-exit with 0."""
        watch = _Watch()
        spawned: list[Any] = []

        def spawn() -> None:
            spawned.append(spawn_daemon(self.reactor, self.directory, watch))

        def kill_if_running() -> Any:
            if not watch.ended.called:
                spawned[0].signalProcess("KILL")
            return watch.ended

        self.addCleanup(kill_if_running)
        client = LeaseClient(self.reactor, self.path, spawn=spawn, spawn_wait_ms=10_000)
        lease = yield client.acquire(KEY, "s1")
        self.assertEqual((len(spawned), lease.queued), (1, True))
        yield client.close()
        self.assertEqual((yield watch.ended), 0)

    @inlineCallbacks
    def test_requeue_after_granted_false(self) -> Any:
        """The real daemon idle-yields a paused holder; its next beat re-queues it."""
        yield self.start({"leaseTtlMs": 1000, "idleYieldMs": 100, "daemonIdleExitMs": 600000})
        first, second = self.client(), self.client()
        lease = yield first.acquire(KEY, "s1", activity=True)
        self.assertEqual(lease.terms.idle_yield_ms, 100)
        lease.pause_beats()
        lost: Deferred[Lease] = Deferred()
        lease.add_lost_observer(lost.callback)
        theirs = yield second.acquire(KEY, "s2")
        lease.resume_beats()
        yield lost
        self.assertFalse(lease.held)
        yield second.release(theirs)
        yield lease.when_held()
        self.assertTrue(lease.queued)

    @inlineCallbacks
    def test_beats_outlive_ttl(self) -> Any:
        """Beats keep a lease past the real daemon's 1 s TTL while a waiter waits."""
        yield self.start({"leaseTtlMs": 1000, "idleYieldMs": 0, "daemonIdleExitMs": 600000})
        first, second = self.client(), self.client()
        lease = yield first.acquire(KEY, "s1")
        waiting = second.acquire(KEY, "s2")
        yield deferLater(self.reactor, 1.5, lambda: None)
        self.assertFalse(waiting.called)
        yield first.release(lease)
        yield waiting

    @inlineCallbacks
    def test_killed_daemon_releases_waiter(self) -> Any:
        """SIGKILL of the daemon releases a waiting acquire unqueued."""
        yield self.start({"leaseTtlMs": 1000, "daemonIdleExitMs": 600000})
        first, second = self.client(), self.client()
        yield first.acquire(KEY, "s1")
        waiting = second.acquire(KEY, "s2")
        yield second.status()
        yield stop_twist(self.process)
        released = yield waiting
        self.assertEqual((released.held, released.queued), (True, False))
