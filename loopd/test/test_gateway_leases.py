"""
Tests for L{loopd.gateway.leases}: L{GatewayLeases} over a real L{Scheduler}, both on one
C{task.Clock}. Requests take a lease per session, share it, keep it for a grace, beat it on
its own terms and notice when it is taken away.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock, LoopingCall
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.leases import GatewayLeases, LeaseHold, queue_status
from loopd.queue.protocol import LeaseProtocol
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter, Tier
from loopd.queue.terms import LeaseTerms

#: One slot; a 3 s TTL (a keyed beat every second); idle yield far away.
ONE = QueuePolicy(max_streams=1, lease_ttl_ms=3000, idle_yield_ms=30_000)
#: The grace most tests run with, in milliseconds.
GRACE_MS = 1000


class Harness:
    """A L{GatewayLeases} bound to a scheduler on a C{task.Clock}."""

    def __init__(self, policy: QueuePolicy = ONE, grace_ms: int = GRACE_MS, **queues: Any) -> None:
        """
        @param policy: every queue's policy but those in C{queues}.
        @param queues: queue key → its own L{QueuePolicy}.
        """
        self.clock = Clock()
        self.leases = GatewayLeases(self.clock, grace_ms)
        router = StaticRouter(defaults=policy, queues=queues)
        self.scheduler = Scheduler(self.clock, router, self.leases.on_grant)
        self.leases.bind(self.scheduler)
        self.queued: dict[str, list[int]] = {}
        self.beats: list[tuple[float, str]] = []
        beat = self.scheduler.beat

        def counted_beat(queue_key: str, session_key: str) -> bool:
            self.beats.append((self.clock.seconds(), session_key))
            return beat(queue_key, session_key)

        self.scheduler.beat = counted_beat  # type: ignore[method-assign]

    def acquire(self, session: str, role: Tier = "parent", queue: str = "q") -> Deferred[Any]:
        """One request of C{session} takes its lease; what on_queued says goes to L{queued}."""
        heard = self.queued.setdefault(session, [])
        return self.leases.acquire(queue, session, role, on_queued=heard.append)

    def entry(self, queue: str = "q") -> dict[str, Any]:
        """The status entry of C{queue}."""
        return next(q for q in self.scheduler.status() if q["queueKey"] == queue)

    def holders(self, queue: str = "q") -> list[str]:
        """The sessions holding a slot of C{queue}."""
        return [h["sessionKey"] for h in self.entry(queue)["holders"]]

    def waiting(self, queue: str = "q") -> list[str]:
        """The sessions waiting on C{queue}, in enqueue order."""
        return [w["sessionKey"] for w in self.entry(queue)["waiting"]]

    def switches(self, queue: str = "q") -> int:
        """The switches C{queue} has counted."""
        switches: int = self.entry(queue)["switches"]
        return switches

    def run_sweep(self, every: float = 0.05) -> None:
        """Sweep the scheduler every C{every} seconds from now on, as loopd does."""
        sweep = LoopingCall(self.scheduler.sweep)
        sweep.clock = self.clock
        sweep.start(every, now=False)

    def advance(self, seconds: float, step: float = 0.05) -> None:
        """Let C{seconds} pass in steps of C{step}, every timer running on time."""
        steps = round(seconds / step)
        self.clock.pump([step] * steps)


class SessionEndTests(SynchronousTestCase):
    """
    A request that ends its session gives the slot back without a grace.
    """

    def test_final_request_releases_at_once(self) -> None:
        """done(final=True): released when the request ends, the waiter granted at once."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.leases.done(hold, final=True)
        self.assertEqual(h.holders(), ["b"])
        self.successResultOf(waiter)

    def test_final_waits_for_the_sessions_other_requests(self) -> None:
        """With another request of the session still running, the slot stays until it ends."""
        h = Harness()
        first = self.successResultOf(h.acquire("a"))
        second = self.successResultOf(h.acquire("a"))
        h.acquire("b")
        h.leases.done(first, final=True)
        self.assertEqual(h.holders(), ["a"])
        h.leases.done(second)
        self.assertEqual(h.holders(), ["b"])


class GrantTests(SynchronousTestCase):
    """
    A request is granted at once into a free slot, or waits its turn and is told so.
    """

    def test_direct_grant(self) -> None:
        """A free slot: the hold fires at once, granted on the grant's terms, nobody told."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a", "child"))
        self.assertIsInstance(hold, LeaseHold)
        self.assertEqual((hold.granted, hold.terms), (True, LeaseTerms(3000, 30_000)))
        self.assertEqual(
            h.entry()["holders"], [{"sessionKey": "a", "role": "child", "group": None}]
        )
        self.assertEqual((h.queued["a"], h.switches()), ([], 0))

    def test_second_session_waits(self) -> None:
        """With the slot held, another session waits and hears how many wait ahead of it."""
        h = Harness()
        h.acquire("a")
        second = h.acquire("b")
        third = h.acquire("c")
        self.assertNoResult(second)
        self.assertNoResult(third)
        self.assertEqual((h.queued["b"], h.queued["c"]), ([0], [1]))
        self.assertEqual((h.holders(), h.waiting()), (["a"], ["b", "c"]))

    def test_queue_status(self) -> None:
        """queue_status is the status reply: op status and the scheduler's queues."""
        h = Harness()
        h.acquire("a")
        h.acquire("b")
        self.assertEqual(queue_status(h.scheduler), {"op": "status", "queues": [h.entry()]})

    def test_socket_grant_delivered(self) -> None:
        """A grant to a lease-socket connection is written to it as its granted reply."""
        h = Harness()
        peer = LeaseProtocol()
        transport = StringTransport()
        peer.makeConnection(transport)
        h.scheduler.acquire(peer, "q", "outside")
        granted = {
            "op": "granted",
            "queueKey": "q",
            "sessionKey": "outside",
            "leaseTtlMs": 3000,
            "idleYieldMs": 30_000,
        }
        self.assertEqual(json.loads(transport.value()), granted)
        self.assertTrue(transport.value().endswith(b"\n"))

    def test_socket_and_gateway_compete(self) -> None:
        """A socket client waits behind a gateway lease and is answered when it is granted."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        peer = LeaseProtocol()
        transport = StringTransport()
        peer.makeConnection(transport)
        h.scheduler.acquire(peer, "q", "outside")
        self.assertEqual(transport.value(), b"")
        h.leases.done(hold)
        h.advance(1.0)
        self.assertEqual(json.loads(transport.value())["op"], "granted")
        self.assertEqual((h.holders(), h.switches()), (["outside"], 1))


class SharingTests(SynchronousTestCase):
    """
    A session's concurrent requests share its one lease.
    """

    def test_one_holder(self) -> None:
        """Two running requests of a session: one hold, one scheduler holder, one grant."""
        h = Harness()
        first = self.successResultOf(h.acquire("a"))
        second = self.successResultOf(h.acquire("a"))
        self.assertIs(first, second)
        self.assertEqual(h.holders(), ["a"])
        self.assertEqual(h.scheduler.counters().grants, 1)

    def test_grace_after_last_done(self) -> None:
        """The grace starts when the last request of the session ends, not the first."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.acquire("a")
        h.leases.done(hold)
        h.advance(5.0)
        self.assertEqual(h.holders(), ["a"])
        h.leases.done(hold)
        h.advance(0.95)
        self.assertEqual(h.holders(), ["a"])
        h.advance(0.1)
        self.assertEqual(h.entry()["holders"], [])

    def test_waiting_requests_share(self) -> None:
        """Two waiting requests of a session are one waiter, and both fire with its grant."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        first, second = h.acquire("b"), h.acquire("b")
        self.assertEqual(h.waiting(), ["b"])
        h.leases.done(hold)
        h.advance(1.05)
        self.assertIs(self.successResultOf(first), self.successResultOf(second))
        self.assertEqual((h.holders(), h.scheduler.counters().grants), (["b"], 2))

    def test_every_waiting_request_hears_queued(self) -> None:
        """Each waiting request of a session is told it waits, not only the first one."""
        h = Harness()
        h.acquire("a")
        first: list[int] = []
        second: list[int] = []
        h.leases.acquire("q", "b", "parent", on_queued=first.append)
        h.leases.acquire("q", "b", "parent", on_queued=second.append)
        self.assertEqual((first, second), ([0], [0]))


class GraceTests(SynchronousTestCase):
    """
    After its request a session keeps its lease for the grace: its next turn is switch-free.
    """

    def test_next_turn_within_grace(self) -> None:
        """Within the grace the session's next request is granted at once; no switch."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.leases.done(hold)
        h.advance(0.9)
        again = self.successResultOf(h.acquire("a"))
        self.assertIs(again, hold)
        self.assertEqual((h.holders(), h.switches(), h.queued["a"]), (["a"], 0, []))
        h.advance(2.0)
        self.assertNoResult(waiter)

    def test_waiter_after_grace(self) -> None:
        """When the grace ends, the slot goes to the waiter, and that is a switch."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.leases.done(hold)
        h.advance(0.95)
        self.assertNoResult(waiter)
        h.advance(0.1)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertEqual((h.holders(), h.switches()), (["b"], 1))

    def test_no_grace(self) -> None:
        """With grace_ms 0 the lease is given back the moment the request ends."""
        h = Harness(grace_ms=0)
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.leases.done(hold)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertEqual(h.holders(), ["b"])

    def test_after_grace_queues_afresh(self) -> None:
        """A session whose grace ended while another took the slot waits like anyone."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.acquire("b")
        h.leases.done(hold)
        h.advance(1.05)
        self.assertNoResult(h.acquire("a"))
        self.assertEqual((h.waiting(), h.queued["a"]), (["a"], [0]))


class WithdrawTests(SynchronousTestCase):
    """
    Cancelling a waiting request (client gone, wait timed out) withdraws it.
    """

    def test_cancel_withdraws(self) -> None:
        """Cancelling the only waiting request of a session removes its waiter."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        waiter.cancel()
        self.failureResultOf(waiter, CancelledError)
        self.assertEqual(h.waiting(), [])
        h.leases.done(hold)
        h.advance(1.05)
        self.assertEqual(h.entry()["holders"], [])

    def test_cancel_one_of_two(self) -> None:
        """The session keeps waiting while another of its requests still waits."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        first, second = h.acquire("b"), h.acquire("b")
        first.cancel()
        self.failureResultOf(first, CancelledError)
        self.assertEqual(h.waiting(), ["b"])
        h.leases.done(hold)
        h.advance(1.05)
        granted = self.successResultOf(second)
        self.assertEqual((granted.session_key, granted.granted, h.holders()), ("b", True, ["b"]))

    def test_cancel_both(self) -> None:
        """Cancelling both waiting requests of a session leaves no waiter."""
        h = Harness()
        h.acquire("a")
        first, second = h.acquire("b"), h.acquire("b")
        first.cancel()
        second.cancel()
        self.failureResultOf(first, CancelledError)
        self.failureResultOf(second, CancelledError)
        self.assertEqual(h.waiting(), [])

    def test_wait_again_after_cancel(self) -> None:
        """A session that withdrew can wait again, and is granted in its turn."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        withdrawn = h.acquire("b")
        withdrawn.cancel()
        self.failureResultOf(withdrawn, CancelledError)
        again = h.acquire("b")
        self.assertEqual((h.waiting(), h.queued["b"]), (["b"], [0, 0]))
        h.leases.done(hold)
        h.advance(1.05)
        self.assertTrue(self.successResultOf(again).granted)


class BeatTests(SynchronousTestCase):
    """
    A running request's lease gets keyed beats on its own terms; a lease in its grace gets
    bare TTL refreshes only.
    """

    def test_running_lease_outlives_ttl(self) -> None:
        """Keyed beats keep a running request's lease alive for many TTLs."""
        h = Harness()
        h.acquire("a")
        h.scheduler.acquire("outside", "r", "x")
        h.advance(30.0, step=0.25)
        h.scheduler.sweep()
        self.assertEqual(h.holders(), ["a"])
        # The same TTL with nobody beating it: the lease lapsed.
        self.assertEqual(h.entry("r")["holders"], [])
        self.assertEqual(h.scheduler.counters().evictions, 1)

    def test_beat_period_from_terms(self) -> None:
        """Beats come every TTL / 3, at most half the idle-yield window, per lease."""
        h = Harness(fast=QueuePolicy(lease_ttl_ms=3000, idle_yield_ms=1000))
        h.acquire("a")
        h.acquire("b", queue="fast")
        h.advance(3.0, step=0.25)
        beats = [(round(t, 2), s) for t, s in h.beats]
        self.assertEqual([t for t, s in beats if s == "a"], [1.0, 2.0, 3.0])
        self.assertEqual([t for t, s in beats if s == "b"], [0.5, 1.0, 1.5, 2.0, 2.5, 3.0])

    def test_grace_renews_only(self) -> None:
        """In a grace longer than the TTL, bare renews keep the lease; no keyed beat."""
        h = Harness(QueuePolicy(lease_ttl_ms=3000, idle_yield_ms=0), grace_ms=20_000)
        hold = self.successResultOf(h.acquire("a"))
        h.leases.done(hold)
        h.advance(15.0, step=0.25)
        h.scheduler.sweep()
        self.assertEqual((h.holders(), h.beats), (["a"], []))
        h.advance(5.25, step=0.25)
        self.assertEqual(h.entry()["holders"], [])

    def test_short_idle_window_yields_in_grace(self) -> None:
        """An idle-yield window shorter than the grace hands the slot to a waiter early."""
        h = Harness(QueuePolicy(lease_ttl_ms=3000, idle_yield_ms=400))
        h.run_sweep()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.advance(1.0)
        self.assertNoResult(waiter)
        h.leases.done(hold)
        h.advance(0.6)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertEqual(h.holders(), ["b"])

    def test_long_idle_window_waits_for_grace(self) -> None:
        """An idle-yield window longer than the grace leaves the slot to the session."""
        h = Harness(QueuePolicy(lease_ttl_ms=3000, idle_yield_ms=1500))
        h.run_sweep()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.advance(1.0)
        h.leases.done(hold)
        h.advance(0.95)
        self.assertNoResult(waiter)
        h.advance(0.1)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")


class LostLeaseTests(SynchronousTestCase):
    """
    A lease taken away from outside is noticed; the session's next request queues afresh.
    """

    def test_lost_in_grace(self) -> None:
        """A lease cancelled during its grace: the session's next request waits again."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.leases.done(hold)
        h.scheduler.cancel("q", "a")
        self.successResultOf(waiter)
        again = h.acquire("a")
        self.assertNoResult(again)
        self.assertEqual((h.holders(), h.waiting(), h.queued["a"]), (["b"], ["a"], [0]))

    def test_lost_while_running(self) -> None:
        """A lease cancelled under a running request is dropped at its next beat."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.scheduler.cancel("q", "a")
        self.successResultOf(waiter)
        with capturedLogs() as events:
            h.advance(1.0)
        texts = [formatEvent(e) for e in events]
        self.assertIn("<LeaseHold 'a' on 'q'> lost its lease while a request ran", texts)
        self.assertEqual(h.leases.held_sessions("q"), {"b"})
        # The running request ends: its stale hold neither releases b nor starts a grace.
        h.leases.done(hold)
        h.advance(2.0)
        self.assertEqual(h.holders(), ["b"])
        self.assertNoResult(h.acquire("a"))
        self.assertEqual(h.waiting(), ["a"])

    def test_yielded_in_grace(self) -> None:
        """A lease idle-yielded during its grace: the session's next request waits."""
        h = Harness(QueuePolicy(lease_ttl_ms=3000, idle_yield_ms=400))
        h.run_sweep()
        hold = self.successResultOf(h.acquire("a"))
        h.acquire("b")
        h.leases.done(hold)
        h.advance(0.6)
        self.assertEqual(h.holders(), ["b"])
        self.assertNoResult(h.acquire("a"))
        self.assertEqual(h.waiting(), ["a"])


class StopTests(SynchronousTestCase):
    """
    Stopping gives every lease back and stops every timer.
    """

    def test_stop(self) -> None:
        """After stop() no queue has a holder, and no beat or grace timer is left."""
        h = Harness()
        running = self.successResultOf(h.acquire("a"))
        grace = self.successResultOf(h.acquire("c", queue="r"))
        h.leases.done(grace)
        self.assertTrue(running.granted)
        h.leases.stop()
        self.assertEqual([q["holders"] for q in h.scheduler.status()], [[], []])
        self.assertEqual(h.clock.getDelayedCalls(), [])
        self.assertEqual(h.leases.held_sessions("q"), set())

    def test_stop_leaves_outside_leases(self) -> None:
        """stop() gives back the gateway's leases only; a socket client keeps its own."""
        h = Harness(QueuePolicy(max_streams=2, lease_ttl_ms=3000))
        h.acquire("a")
        h.scheduler.acquire("outside", "q", "x")
        h.leases.stop()
        self.assertEqual(h.holders(), ["x"])
