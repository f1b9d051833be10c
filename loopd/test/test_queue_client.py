"""
Tests for L{loopd.queue.client.LeaseClient} (and the connection, link and lease modules
behind it).

In memory on a C{MemoryReactorClock}: the client's decisions (the beat and heartbeat periods
from the lease's terms, pause and resume, reply matching, the queue-wait warning, cancel, the
re-queue after C{granted: false}) and its connection (fail-open and C{QueueUnavailable} when
no daemon answers, the spawn and its bounded retries, a daemon that dies under a waiter or a
holder, C{close}). The daemon there is a script (L{ScriptServer}): the tests read what the
client sent and write the replies themselves. Then the client against the real scheduler and
wire layer in memory (L{loopd.testing.lease_daemon.FakeLeaseDaemon}), so the beats are
checked against the daemon's own rules.

Against a real daemon over a real Unix socket: the scheduler and wire layer in this process,
and the C{twist llmqueue} subprocess (spawned by the client, or started by the test and
killed). Time is real there, so the policies are short (C{leaseTtlMs} 1000, the minimum;
sweeps every 20 ms) and every wait is on a Deferred.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred, DeferredList, inlineCallbacks
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import Factory, ProcessProtocol, Protocol, connectionDone
from twisted.internet.task import deferLater
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd.queue.client import (
    ClientClosed,
    DuplicateLease,
    Lease,
    LeaseClient,
    LeaseEnded,
    QueueReplyError,
    QueueUnavailable,
    spawn_daemon,
)
from loopd.queue.paths import socket_path
from loopd.queue.protocol import LeaseFactory, LeaseProtocol, deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter
from loopd.queue.terms import LeaseTerms
from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist
from loopd.testing.lease_daemon import FakeLeaseDaemon
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor
from loopd.unixsocket import listen_unix

PATH = "/tmp/ld-memory/llm-queue.sock"
KEY = "http://gpu:8001/v1"


class Script(Protocol):
    """
    One daemon-side connection: records each message with the time it arrived.
    """

    def __init__(self, server: ScriptServer) -> None:
        """Record nothing yet."""
        self.server = server
        self.buffer = b""
        self.received: list[tuple[float, dict[str, Any]]] = []

    def connectionMade(self) -> None:
        """Join the server's connections."""
        self.server.connections.append(self)

    def dataReceived(self, data: bytes) -> None:
        """Record every complete line as a message."""
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self.received.append((self.server.clock.seconds(), json.loads(line)))

    def send(self, message: dict[str, Any]) -> None:
        """Write one message as a line."""
        assert self.transport is not None
        self.transport.write(json.dumps(message).encode() + b"\n")


class ScriptServer(Factory):
    """
    The scripted daemon: builds a L{Script} per connection and keeps them.
    """

    def __init__(self, clock: MemoryReactorClock) -> None:
        """Keep C{clock} to time-stamp messages."""
        self.clock = clock
        self.connections: list[Script] = []

    def buildProtocol(self, addr: Any) -> Script:
        """Return a new L{Script}."""
        return Script(self)


class Harness:
    """
    A client on a memory reactor, its scripted daemon listening at L{PATH} (unless
    C{listen=False}), and the warnings it gave.
    """

    def __init__(self, listen: bool = True, **client_options: Any) -> None:
        """Build the reactor, the net, the script and the client."""
        self.reactor = MemoryLoopdReactor()
        self.net = MemoryNet(self.reactor)
        self.server = ScriptServer(self.reactor)
        if listen:
            self.net.listen(PATH, self.server)
        self.warnings: list[str] = []
        client_options.setdefault("on_warning", self.warnings.append)
        self.client = LeaseClient(self.reactor, PATH, **client_options)

    @property
    def conn(self) -> Script:
        """The latest daemon-side connection."""
        self.net.pump()
        return self.server.connections[-1]

    def sent(self, op: str | None = None, keyed: bool | None = None) -> list[dict[str, Any]]:
        """The messages the daemon got (on every connection), optionally one op's only."""
        self.net.pump()
        messages = [m for c in self.server.connections for _t, m in c.received]
        return [
            m
            for m in messages
            if (op is None or m["op"] == op) and (keyed is None or ("queueKey" in m) == keyed)
        ]

    def times(self, op: str, keyed: bool) -> list[float]:
        """When the daemon got each C{op} message, keyed or bare."""
        self.net.pump()
        return [
            t
            for c in self.server.connections
            for t, m in c.received
            if m["op"] == op and ("queueKey" in m) == keyed
        ]

    def reply(self, message: dict[str, Any]) -> None:
        """The daemon writes C{message} on the latest connection."""
        self.conn.send(message)
        self.net.pump()

    def grant(self, session: str, key: str = KEY, **terms: Any) -> None:
        """The daemon grants C{session}, with C{terms} as extra fields."""
        self.reply({"op": "granted", "queueKey": key, "sessionKey": session, **terms})

    def hold(
        self, test: SynchronousTestCase, session: str = "s1", key: str = KEY, **terms: Any
    ) -> Lease:
        """Acquire and grant at once; return the held lease."""
        d = self.client.acquire(key, session)
        self.net.pump()
        self.grant(session, key, **terms)
        lease: Lease = test.successResultOf(d)
        return lease


class AcquireTests(SynchronousTestCase):
    """
    acquire writes the seed's message and fires only on its own granted reply.
    """

    def test_acquire_message(self) -> None:
        """acquire sends queueKey, sessionKey, role, group and activity."""
        h = Harness()
        h.client.acquire(KEY, "s1", role="child", group="g", activity=False)
        self.assertEqual(
            h.sent(),
            [
                {
                    "op": "acquire",
                    "queueKey": KEY,
                    "sessionKey": "s1",
                    "role": "child",
                    "activity": False,
                    "group": "g",
                }
            ],
        )

    def test_granted_fires_with_terms(self) -> None:
        """The granted reply fires the acquire with a held, queued lease on its terms."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=9000, idleYieldMs=4000)
        self.assertEqual((lease.held, lease.queued), (True, True))
        self.assertEqual(lease.terms, LeaseTerms(9000, 4000))

    def test_missing_terms_use_fallback(self) -> None:
        """A granted reply without terms gives the lease the client's fallback terms."""
        h = Harness(fallback_terms=LeaseTerms(6000, 0))
        lease = h.hold(self)
        self.assertEqual(lease.terms, LeaseTerms(6000, 0))

    def test_unrelated_granted_dropped(self) -> None:
        """A granted naming another session or queue does not fire the acquire."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        h.grant("s2")
        h.grant("s1", key="http://other:1/v1")
        self.assertNoResult(d)
        h.grant("s1")
        self.assertTrue(self.successResultOf(d).held)

    def test_early_granted_not_buffered(self) -> None:
        """A granted that arrives before its acquire is dropped, not kept for it."""
        h = Harness()
        status = h.client.status()
        h.grant("s1")
        h.reply({"op": "status", "queues": []})
        self.assertEqual(self.successResultOf(status), [])
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        self.assertNoResult(d)

    def test_duplicate_acquire(self) -> None:
        """A second acquire of the same keys fails with DuplicateLease."""
        h = Harness()
        h.client.acquire(KEY, "s1")
        self.failureResultOf(h.client.acquire(KEY, "s1"), DuplicateLease)

    def test_cancel_deferred(self) -> None:
        """Cancelling the acquire sends cancel, fails it, and drops its later grant."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(h.sent("cancel"), [{"op": "cancel", "queueKey": KEY, "sessionKey": "s1"}])
        h.grant("s1")
        self.assertEqual(h.sent("renew"), [])

    def test_cancel_before_connected_sends_nothing(self) -> None:
        """An acquire cancelled while still connecting is never sent."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(h.sent(), [])

    def test_client_cancel_op(self) -> None:
        """cancel() ends the client's own waiting lease and sends cancel once."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        self.successResultOf(h.client.cancel(KEY, "s1"))
        self.failureResultOf(d, CancelledError)
        self.assertEqual(len(h.sent("cancel")), 1)

    def test_role(self) -> None:
        """role() sends the role op, and the session's lease re-queues with the new role."""
        h = Harness()
        d = h.client.acquire(KEY, "s1", role="child")
        h.net.pump()
        h.grant("s1", leaseTtlMs=3000, idleYieldMs=0)
        self.successResultOf(d)
        self.successResultOf(h.client.role("s1", "parent"))
        self.assertEqual(h.sent("role"), [{"op": "role", "sessionKey": "s1", "role": "parent"}])
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.assertEqual([m["role"] for m in h.sent("acquire")], ["child", "parent"])

    def test_invalid_arguments(self) -> None:
        """An empty queue key or an unknown role is refused before anything is sent."""
        h = Harness()
        self.assertRaises(ValueError, h.client.acquire, "", "s1")
        self.assertRaises(ValueError, h.client.acquire, KEY, "s1", role="boss")
        self.assertEqual(h.sent(), [])

    def test_one_connection_in_order(self) -> None:
        """Ops made while connecting share one connection and go out in call order."""
        h = Harness()
        h.client.acquire(KEY, "s1")
        h.client.status()
        h.client.role("s1", "child")
        self.assertEqual([m["op"] for m in h.sent()], ["acquire", "status", "role"])
        self.assertEqual(len(h.server.connections), 1)


class InOrderReplyTests(SynchronousTestCase):
    """
    ok, status and error replies are matched first-in first-out; strays are dropped.
    """

    def test_status(self) -> None:
        """status() fires with the queues of the status reply."""
        h = Harness()
        d = h.client.status()
        h.reply({"op": "status", "queues": [{"queueKey": KEY}]})
        self.assertEqual(self.successResultOf(d), [{"queueKey": KEY}])

    def test_error_fails_request(self) -> None:
        """An error reply fails the oldest in-order request with QueueReplyError."""
        h = Harness()
        d = h.client.status()
        h.reply({"op": "error", "reason": "nope"})
        self.assertEqual(self.failureResultOf(d, QueueReplyError).value.reason, "nope")

    def test_release_fires_on_its_ok(self) -> None:
        """release() sends release, stops the beats, and fires on the next bare ok."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.reply({"op": "ok"})
        d = h.client.release(lease)
        self.assertEqual(
            h.sent("release"), [{"op": "release", "queueKey": KEY, "sessionKey": "s1"}]
        )
        self.assertNoResult(d)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": True})
        self.assertNoResult(d)
        h.reply({"op": "ok"})
        self.assertIsNone(self.successResultOf(d))
        h.net.advance(10)
        self.assertEqual(h.sent("renew"), [])
        self.assertTrue(lease.ended)

    def test_stray_keyed_ok_dropped(self) -> None:
        """A granted:false for a beat the client never sent leaves the lease held."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.assertTrue(lease.held)
        self.assertEqual(h.sent("acquire")[1:], [])

    @given(
        st.lists(
            st.fixed_dictionaries(
                {
                    "op": st.sampled_from(["granted", "ok", "status", "bogus"]),
                    "queueKey": st.sampled_from([KEY, "other"]),
                    "sessionKey": st.sampled_from(["s2", "s3"]),
                    "granted": st.booleans(),
                }
            ),
            max_size=8,
        )
    )
    def test_unrelated_replies_answer_nothing(self, strays: list[dict[str, Any]]) -> None:
        """No mix of replies for other sessions fires an acquire or ends a held lease."""
        h = Harness()
        held = h.hold(self, session="s1", leaseTtlMs=3000, idleYieldMs=0)
        d = h.client.acquire(KEY, "s4")
        for stray in strays:
            h.reply(stray)
        self.assertNoResult(d)
        self.assertTrue(held.held)


class BeatTests(SynchronousTestCase):
    """
    Keyed beats and the bare heartbeat run on the leases' own terms.
    """

    def test_beat_period_from_ttl(self) -> None:
        """A 9 s TTL beats every 3 s, with the lease's keys."""
        h = Harness()
        h.hold(self, leaseTtlMs=9000, idleYieldMs=0)
        h.net.advance(9.5)
        self.assertEqual(h.times("renew", keyed=True), [3.0, 6.0, 9.0])
        self.assertEqual(
            h.sent("renew", keyed=True)[0], {"op": "renew", "queueKey": KEY, "sessionKey": "s1"}
        )

    def test_short_idle_window(self) -> None:
        """A 1 s idle-yield window caps the beat at 500 ms whatever the TTL."""
        h = Harness()
        h.hold(self, leaseTtlMs=30000, idleYieldMs=1000)
        h.net.advance(1.6)
        self.assertEqual(h.times("renew", keyed=True), [0.5, 1.0, 1.5])

    def test_floor(self) -> None:
        """A TTL of 600 ms beats at the 250 ms floor, not every 200 ms."""
        h = Harness()
        h.hold(self, leaseTtlMs=600, idleYieldMs=0)
        h.net.advance(0.6)
        self.assertEqual(h.times("renew", keyed=True), [0.25, 0.5])

    def test_not_the_client_config(self) -> None:
        """The granted terms, not the fallback, set the period."""
        h = Harness(fallback_terms=LeaseTerms(3000, 0))
        h.hold(self, leaseTtlMs=12000, idleYieldMs=0)
        h.net.advance(4.5)
        self.assertEqual(h.times("renew", keyed=True), [4.0])

    def test_per_queue_ttl_and_heartbeat(self) -> None:
        """Each lease beats on its own queue's TTL; the heartbeat runs at the smallest."""
        h = Harness()
        h.hold(self, "s1", KEY, leaseTtlMs=9000, idleYieldMs=0)
        h.hold(self, "s2", "zen", leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(6.5)
        beats = [(m["queueKey"]) for m in h.sent("renew", keyed=True)]
        self.assertEqual(beats.count(KEY), 2)
        self.assertEqual(beats.count("zen"), 6)
        self.assertEqual(h.times("renew", keyed=False), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])

    def test_heartbeat_recomputed(self) -> None:
        """Releasing the short lease stretches the heartbeat; releasing all stops it."""
        h = Harness()
        long = h.hold(self, "s1", KEY, leaseTtlMs=9000, idleYieldMs=0)
        short = h.hold(self, "s2", "zen", leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(1.0)
        h.client.release(short)
        h.net.advance(6.5)
        self.assertEqual(h.times("renew", keyed=False), [1.0, 4.0, 7.0])
        h.client.release(long)
        h.net.advance(10)
        self.assertEqual(h.times("renew", keyed=False), [1.0, 4.0, 7.0])

    def test_no_heartbeat_without_lease(self) -> None:
        """A connection that holds nothing sends no heartbeat."""
        h = Harness()
        h.client.status()
        h.net.advance(120)
        self.assertEqual(h.sent("renew"), [])

    def test_pause_and_resume(self) -> None:
        """Paused: no keyed beats, heartbeat goes on; resumed: a beat at once, then periodic."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        lease.pause_beats()
        h.net.advance(3.5)
        self.assertEqual(h.times("renew", keyed=True), [])
        self.assertEqual(h.times("renew", keyed=False), [1.0, 2.0, 3.0])
        lease.resume_beats()
        h.net.advance(1.0)
        self.assertEqual(h.times("renew", keyed=True), [3.5, 4.5])


class RequeueTests(SynchronousTestCase):
    """
    A keyed beat answered granted:false re-queues the lease until it is granted again.
    """

    def test_requeue(self) -> None:
        """granted:false: not held, observers told, acquire resent, beats stop until re-grant."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        lost: list[Lease] = []
        lease.add_lost_observer(lost.append)
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.assertFalse(lease.held)
        self.assertEqual(lost, [lease])
        self.assertEqual(len(h.sent("acquire")), 2)
        held = lease.when_held()
        self.assertNoResult(held)
        h.net.advance(5.0)
        self.assertEqual(h.times("renew", keyed=True), [1.0])
        h.grant("s1", leaseTtlMs=6000, idleYieldMs=0)
        self.assertIs(self.successResultOf(held), lease)
        self.assertEqual((lease.held, lease.terms.lease_ttl_ms), (True, 6000))
        h.net.advance(2.0)
        self.assertEqual(h.times("renew", keyed=True), [1.0, 8.0])

    def test_granted_true_keeps(self) -> None:
        """granted:true changes nothing."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": True})
        self.assertTrue(lease.held)
        self.assertEqual(len(h.sent("acquire")), 1)

    def test_release_while_requeued(self) -> None:
        """Releasing a re-queued lease cancels its request and ends it."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.successResultOf(h.client.release(lease))
        self.assertEqual(len(h.sent("cancel")), 1)
        self.assertTrue(lease.ended)


class WarningTests(SynchronousTestCase):
    """
    queue_timeout_ms warns a waiting parent once; a child never.
    """

    def test_parent_warned_once(self) -> None:
        """A parent still waiting past the timeout is warned once and stays queued."""
        h = Harness(queue_timeout_ms=2000)
        d = h.client.acquire(KEY, "s1")
        h.net.advance(1.9)
        self.assertEqual(h.warnings, [])
        h.net.advance(10)
        self.assertEqual(len(h.warnings), 1)
        self.assertIn("s1", h.warnings[0])
        h.grant("s1")
        self.assertTrue(self.successResultOf(d).held)

    def test_child_never_warned(self) -> None:
        """A child waiting past the timeout is not warned."""
        h = Harness(queue_timeout_ms=2000)
        h.client.acquire(KEY, "c1", role="child")
        h.net.advance(60)
        self.assertEqual(h.warnings, [])

    def test_granted_in_time(self) -> None:
        """A parent granted before the timeout is not warned."""
        h = Harness(queue_timeout_ms=2000)
        h.client.acquire(KEY, "s1")
        h.net.advance(1.0)
        h.grant("s1")
        h.net.advance(60)
        self.assertEqual(h.warnings, [])


class Spawner:
    """
    A C{spawn} callable that counts its calls and may start the scripted daemon.
    """

    def __init__(self, harness: Harness, starts: bool) -> None:
        """Start at no calls; C{starts}: each call starts the scripted daemon."""
        self.harness = harness
        self.starts = starts
        self.calls = 0

    def __call__(self) -> None:
        """Count the call, and start the daemon if it should."""
        self.calls += 1
        if self.starts:
            self.harness.net.listen(PATH, self.harness.server)


class UnreachableTests(SynchronousTestCase):
    """
    No daemon: fail-open lets acquires through unqueued; otherwise they fail.
    """

    def test_fail_open(self) -> None:
        """No socket: the acquire fires with a held, unqueued lease on the fallback terms."""
        h = Harness(listen=False, fallback_terms=LeaseTerms(5000, 0))
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        lease = self.successResultOf(d)
        self.assertEqual(
            (lease.held, lease.queued, lease.terms), (True, False, LeaseTerms(5000, 0))
        )
        self.assertIsNone(self.successResultOf(h.client.release(lease)))
        h.net.advance(60)
        self.assertEqual(h.server.connections, [])

    def test_stale_socket_fails_open(self) -> None:
        """A refused connect (a stale socket file) fails open too."""
        h = Harness(listen=False)
        h.net.stop_listening(PATH, stale=True)
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        self.assertFalse(self.successResultOf(d).queued)

    def test_fail_closed(self) -> None:
        """With fail_open=False the acquire fails with QueueUnavailable."""
        h = Harness(listen=False, fail_open=False)
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        self.failureResultOf(d, QueueUnavailable)

    def test_status_never_fails_open(self) -> None:
        """status() has no open way: it fails with QueueUnavailable."""
        h = Harness(listen=False)
        d = h.client.status()
        h.net.pump()
        self.failureResultOf(d, QueueUnavailable)


class SpawnTests(SynchronousTestCase):
    """
    A connect that finds no daemon spawns it once and retries on reactor time.
    """

    def test_spawn_then_connect(self) -> None:
        """The spawn starts the daemon; a retry 100 ms later connects and sends the acquire."""
        h = Harness(listen=False)
        spawner = Spawner(h, starts=True)
        h.client = LeaseClient(h.reactor, PATH, spawn=spawner)
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        self.assertEqual((spawner.calls, h.sent()), (1, []))
        h.net.advance(0.1)
        self.assertEqual([m["op"] for m in h.sent()], ["acquire"])
        h.grant("s1")
        self.assertTrue(self.successResultOf(d).queued)
        self.assertEqual(spawner.calls, 1)

    def test_spawn_window_bounded(self) -> None:
        """A spawn that brings no daemon gives up after 3 s and fails open."""
        h = Harness(listen=False)
        spawner = Spawner(h, starts=False)
        h.client = LeaseClient(h.reactor, PATH, spawn=spawner)
        d = h.client.acquire(KEY, "s1")
        h.net.advance(2.9)
        self.assertNoResult(d)
        h.net.advance(0.2)
        self.assertFalse(self.successResultOf(d).queued)
        self.assertEqual(spawner.calls, 1)

    def test_spawn_once_per_attempt(self) -> None:
        """Each connect attempt that finds no daemon spawns once."""
        h = Harness(listen=False)
        spawner = Spawner(h, starts=False)
        h.client = LeaseClient(h.reactor, PATH, spawn=spawner, spawn_wait_ms=300)
        h.client.acquire(KEY, "s1")
        status = h.client.status()
        h.net.advance(1.0)
        self.failureResultOf(status, QueueUnavailable)
        h.client.acquire(KEY, "s2")
        h.net.advance(1.0)
        self.assertEqual(spawner.calls, 2)

    def test_no_spawn_when_daemon_answers(self) -> None:
        """A daemon that answers is never spawned."""
        h = Harness()
        spawner = Spawner(h, starts=True)
        h.client = LeaseClient(h.reactor, PATH, spawn=spawner)
        h.client.acquire(KEY, "s1")
        h.net.advance(1.0)
        self.assertEqual((spawner.calls, len(h.sent("acquire"))), (0, 1))


class DaemonDeathTests(SynchronousTestCase):
    """
    A daemon that dies releases the waiters and takes the holders' slots with it.
    """

    def test_waiter_released_open(self) -> None:
        """A waiting acquire gets an unqueued lease when the daemon dies."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        h.net.kill(PATH)
        h.net.pump()
        lease = self.successResultOf(d)
        self.assertEqual((lease.held, lease.queued), (True, False))

    def test_waiter_released_closed(self) -> None:
        """With fail_open=False the waiting acquire fails with QueueUnavailable."""
        h = Harness(fail_open=False)
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        h.net.kill(PATH)
        h.net.pump()
        self.failureResultOf(d, QueueUnavailable)

    def test_pending_replies_on_death(self) -> None:
        """A release awaiting its ok fires (the slot went anyway); a status fails."""
        h = Harness()
        lease = h.hold(self)
        release = h.client.release(lease)
        status = h.client.status()
        h.net.kill(PATH)
        h.net.pump()
        self.assertIsNone(self.successResultOf(release))
        self.failureResultOf(status, QueueUnavailable)

    def test_holder_requeues_on_new_daemon(self) -> None:
        """A holder whose daemon died is lost and re-queued on the next daemon."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        lost: list[Lease] = []
        lease.add_lost_observer(lost.append)
        h.net.kill(PATH)
        h.net.listen(PATH, h.server)
        h.net.pump()
        self.assertEqual((lost, lease.held), ([lease], False))
        self.assertEqual(len(h.server.connections), 2)
        self.assertEqual([m["op"] for _t, m in h.conn.received], ["acquire"])
        h.grant("s1", leaseTtlMs=3000, idleYieldMs=0)
        self.assertTrue(self.successResultOf(lease.when_held()).queued)

    def test_holder_unqueued_when_gone(self) -> None:
        """A holder whose daemon died and stays gone goes on unqueued with fail-open."""
        h = Harness()
        lease = h.hold(self)
        h.net.kill(PATH)
        h.net.pump()
        self.assertEqual((lease.held, lease.queued), (True, False))

    def test_holder_ends_when_gone_closed(self) -> None:
        """With fail_open=False that holder ends, and when_held fails QueueUnavailable."""
        h = Harness(fail_open=False)
        lease = h.hold(self)
        waits: list[Any] = []
        lease.add_lost_observer(lambda lost: waits.append(lost.when_held()))
        h.net.kill(PATH)
        h.net.pump()
        self.assertTrue(lease.ended)
        self.failureResultOf(waits[0], QueueUnavailable)
        self.failureResultOf(lease.when_held(), LeaseEnded)

    def test_reconnect_for_next_op(self) -> None:
        """After the daemon restarts, the next op connects again."""
        h = Harness()
        first = h.client.status()
        h.net.pump()
        h.net.kill(PATH)
        h.net.pump()
        self.failureResultOf(first, QueueUnavailable)
        h.net.listen(PATH, h.server)
        d = h.client.status()
        h.reply({"op": "status", "queues": []})
        self.assertEqual(self.successResultOf(d), [])


class CloseTests(SynchronousTestCase):
    """
    close() says bye, closes, and ends every lease.
    """

    def test_close(self) -> None:
        """bye is sent, the connection closes, waiters fail and later ops fail ClientClosed."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        waiting = h.client.acquire(KEY, "s2")
        h.net.pump()
        done = h.client.close()
        h.net.pump()
        self.assertIsNone(self.successResultOf(done))
        self.assertEqual(h.sent()[-1], {"op": "bye"})
        self.assertEqual(h.net.open_connections(), [])
        self.failureResultOf(waiting, ClientClosed)
        self.assertTrue(lease.ended)
        self.failureResultOf(h.client.acquire(KEY, "s3"), ClientClosed)
        self.failureResultOf(h.client.status(), ClientClosed)
        h.net.advance(10)
        self.assertEqual(h.sent("renew"), [])
        self.successResultOf(h.client.close())

    def test_close_while_connecting(self) -> None:
        """close() before the connection is made fires, and the acquire fails ClientClosed."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        self.successResultOf(h.client.close())
        self.failureResultOf(d, ClientClosed)
        h.net.pump()
        self.assertEqual(h.sent(), [])


class MemoryDaemonTests(SynchronousTestCase):
    """
    The client against the real scheduler on the same memory clock
    (L{loopd.testing.lease_daemon.FakeLeaseDaemon}, sweeping every 20 ms).
    """

    def test_beats_outlive_ttl(self) -> None:
        """A held lease stays held for ten TTLs while its client beats."""
        reactor = MemoryLoopdReactor()
        net = MemoryNet(reactor)
        daemon = FakeLeaseDaemon(net, PATH, policy=QueuePolicy(lease_ttl_ms=1000, idle_yield_ms=0))
        client = LeaseClient(reactor, PATH)
        d = client.acquire(KEY, "s1")
        net.pump()
        lease = self.successResultOf(d)
        net.advance(10.0)
        self.assertTrue(lease.held)
        self.assertEqual(daemon.holders(), ["s1"])

    def test_idle_yield_requeue(self) -> None:
        """A paused holder is yielded to a waiter, learns on resume, and is re-granted."""
        reactor = MemoryLoopdReactor()
        net = MemoryNet(reactor)
        FakeLeaseDaemon(net, PATH, policy=QueuePolicy(lease_ttl_ms=1000, idle_yield_ms=200))
        first, second = LeaseClient(reactor, PATH), LeaseClient(reactor, PATH)
        d = first.acquire(KEY, "s1")
        net.pump()
        lease = self.successResultOf(d)
        lease.pause_beats()
        other = second.acquire(KEY, "s2")
        net.advance(0.5)
        theirs = self.successResultOf(other)
        self.assertTrue(lease.held)
        lease.resume_beats()
        net.pump()
        self.assertFalse(lease.held)
        again = lease.when_held()
        released = second.release(theirs)
        net.pump()
        self.successResultOf(released)
        self.assertIs(self.successResultOf(again), lease)


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
