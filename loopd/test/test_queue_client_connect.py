"""
L{loopd.queue.client.LeaseClient}'s connection, in memory on a C{MemoryReactorClock}: fail-open
and C{QueueUnavailable} when no daemon answers, the spawn and its bounded retries, a daemon
that dies under a waiter or a holder, and C{close}. Also the client against the real
scheduler and wire layer in memory, so the beats are checked against the daemon's own rules.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.client import (
    ClientClosed,
    Lease,
    LeaseClient,
    LeaseEnded,
    QueueUnavailable,
)
from loopd.queue.protocol import LeaseFactory, deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter
from loopd.queue.terms import LeaseTerms
from loopd.test.test_queue_client import KEY, PATH, Harness
from loopd.testing.memory_net import MemoryNet


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


def _daemon(reactor: MemoryReactorClock, net: MemoryNet, policy: QueuePolicy) -> Scheduler:
    """The real scheduler and wire layer listening at PATH in memory, sweeping every 20 ms."""
    scheduler = Scheduler(reactor, StaticRouter(defaults=policy), deliver_grant)
    factory: Any = LeaseFactory(scheduler, reactor=reactor, sweep_ms=20)
    factory.startFactory()
    net.listen(PATH, factory)
    return scheduler


class MemoryDaemonTests(SynchronousTestCase):
    """
    The client against the real scheduler on the same memory clock.
    """

    def holders(self, scheduler: Scheduler) -> list[Any]:
        """The sessions holding a slot, in every queue."""
        return [h["sessionKey"] for q in scheduler.status() for h in q["holders"]]

    def test_beats_outlive_ttl(self) -> None:
        """A held lease stays held for ten TTLs while its client beats."""
        reactor = MemoryReactorClock()
        net = MemoryNet(reactor)
        scheduler = _daemon(reactor, net, QueuePolicy(lease_ttl_ms=1000, idle_yield_ms=0))
        client = LeaseClient(reactor, PATH)
        d = client.acquire(KEY, "s1")
        net.pump()
        lease = self.successResultOf(d)
        net.advance(10.0)
        self.assertTrue(lease.held)
        self.assertEqual(self.holders(scheduler), ["s1"])

    def test_idle_yield_requeue(self) -> None:
        """A paused holder is yielded to a waiter, learns on resume, and is re-granted."""
        reactor = MemoryReactorClock()
        net = MemoryNet(reactor)
        _daemon(reactor, net, QueuePolicy(lease_ttl_ms=1000, idle_yield_ms=200))
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
