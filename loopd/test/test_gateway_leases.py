"""
Tests for the gateway's leases (L{loopd.gateway.leases}). First L{GatewayLeases} over a real
L{Scheduler}, both on one C{task.Clock}: requests take a lease per session, share it, keep it
for a grace, beat it on its own terms and notice when it is taken away. Then the same leases
through the gateway's HTTP front, in memory against the scripted fake llama-server on a
C{MemoryReactorClock} (L{loopd.testing.gateway.GatewayHarness} with leases, the scheduler
built as C{twist loopd} builds it: L{QueueHost} over the endpoints' slot counts):
C{X-Session-Role}, waiting for a lease (the queued comment, C{busy_wait_ms}, a client that
leaves), slot choice under leases, C{GET /v1/queue} and the C{loopd_lease_*} metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock, LoopingCall
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.grace import LEARN_SAMPLES, SwitchCosts
from loopd.gateway.leases import GatewayLeases, LeaseHold, queue_status
from loopd.llama.info import CacheOutcome
from loopd.llama.types import Timings
from loopd.queue.protocol import LeaseProtocol
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter, Tier
from loopd.queue.terms import LeaseTerms
from loopd.settings import Config
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import (
    HI,
    LIMITS,
    ClientConnection,
    GatewayHarness,
    Response,
    make_config,
    outcome,
)
from loopd.testing.llama_replies import answer

#: One slot; a 3 s TTL (a keyed beat every second); idle yield far away.
ONE = QueuePolicy(max_streams=1, lease_ttl_ms=3000, idle_yield_ms=30_000)
#: The grace most tests run with, in milliseconds.
GRACE_MS = 1000
#: A context whose re-prefill, at the prior speed on an endpoint that learned every switch
#: loses the cache, costs 10 s: more than any grace here, so a waiter waits for the whole
#: grace (decision 37).
COSTLY = Timings(prompt_n=10_000)
#: A returning session that found its cache.
HIT = CacheOutcome(loss=False, expected=100, cached=100)
#: A returning session that lost it.
LOSS = CacheOutcome(loss=True, expected=100, cached=0)


def learn(
    costs: SwitchCosts, endpoint: str, outcome: CacheOutcome, times: int = LEARN_SAMPLES
) -> None:
    """
    Let C{endpoint} see C{times} returning sessions with C{outcome} (on slot -1, which no
    test uses), so that its loss share is known.
    """
    for n in range(times):
        costs.observe(endpoint, -1, f"was-{n}", Timings(), None)
        costs.observe(endpoint, -1, "back", Timings(), outcome)


def learn_losses(costs: SwitchCosts, endpoints: Iterable[str]) -> None:
    """Let each of C{endpoints} learn that every switch loses the cache (L{learn})."""
    for endpoint in endpoints:
        learn(costs, endpoint, LOSS)


class Harness:
    """A L{GatewayLeases} bound to a scheduler on a C{task.Clock}."""

    def __init__(
        self,
        policy: QueuePolicy = ONE,
        grace_ms: int = GRACE_MS,
        learning: bool = False,
        **queues: Any,
    ) -> None:
        """
        @param policy: every queue's policy but those in C{queues}.
        @param learning: leave the endpoints fresh (their loss share still learned); by
            default C{q} and the C{queues} have learned that every switch loses the cache.
        @param queues: queue key → its own L{QueuePolicy}.
        """
        self.clock = Clock()
        self.leases = GatewayLeases(self.clock, grace_ms)
        if not learning:
            learn_losses(self.leases.costs, ("q", *queues))
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

    def served(self, hold: LeaseHold, timings: Timings = COSTLY) -> None:
        """A completion of C{hold}'s session on slot 0 was accounted (priced by C{timings})."""
        self.leases.observe(hold.queue_key, hold.session_key, 0, hold.session_key, timings, None)

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
        h.served(hold)
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
        h.served(hold)
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


#: A context whose re-prefill costs 0.5 s at the prior speed (1,000 tokens/s) where every
#: switch loses the cache.
HALF_SECOND = Timings(prompt_n=500)


class CostTests(SynchronousTestCase):
    """
    While a request waits, a grace lasts only until the slot has idled beside it for the
    holder's expected re-prefill (decision 37); nobody waiting, the whole grace; while the
    endpoint's loss share is still learned, a switch is free.
    """

    def test_waiter_cuts_at_reprefill(self) -> None:
        """b waits from 0.2 s; a's re-prefill costs 0.5 s: the slot goes to b at 0.7 s."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.served(hold, HALF_SECOND)
        h.leases.done(hold)
        h.advance(0.2)
        waiter = h.acquire("b")
        h.advance(0.45)
        self.assertNoResult(waiter)
        h.advance(0.1)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertEqual((h.holders(), h.switches(), h.leases.cut_short), (["b"], 1, {"q": 1}))

    def test_nobody_waits(self) -> None:
        """
        Nobody waiting: the session keeps its slot for the whole grace, however cheap, on an
        endpoint that learned its loss share as on one still learning it.
        """
        for learning in (False, True):
            h = Harness(learning=learning)
            hold = self.successResultOf(h.acquire("a"))
            h.served(hold, Timings(prompt_n=1))
            h.leases.done(hold)
            h.advance(0.95)
            self.assertEqual(h.holders(), ["a"], learning)
            h.advance(0.1)
            self.assertEqual((h.entry()["holders"], h.leases.cut_short), ([], {}), learning)

    def test_waited_while_running(self) -> None:
        """
        b waited through a's 0.6 s turn: that was work, not the grace, so the slot still
        idles beside b for a's 0.5 s re-prefill, and goes to b at 1.1 s.
        """
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.advance(0.6)
        h.served(hold, HALF_SECOND)
        h.leases.done(hold)
        h.advance(0.45)
        self.assertNoResult(waiter)
        h.advance(0.1)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertEqual(h.leases.cut_short, {"q": 1})

    def test_waiter_leaves(self) -> None:
        """A waiter that gives up gives the holder its whole grace back."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.served(hold, HALF_SECOND)
        h.leases.done(hold)
        h.advance(0.2)
        waiter = h.acquire("b")
        waiter.cancel()
        self.failureResultOf(waiter, CancelledError)
        h.advance(0.75)
        self.assertEqual(h.holders(), ["a"])
        h.advance(0.1)
        self.assertEqual(h.entry()["holders"], [])

    def test_next_turn_before_the_cut(self) -> None:
        """The bet won: a's next turn comes before the cut, switch-free; b still waits."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.served(hold, HALF_SECOND)
        h.leases.done(hold)
        waiter = h.acquire("b")
        h.advance(0.3)
        self.assertIs(self.successResultOf(h.acquire("a")), hold)
        self.assertNoResult(waiter)
        self.assertEqual((h.switches(), h.leases.cut_short), (0, {}))

    def test_unpriced_hold(self) -> None:
        """A hold with no completion (its request failed) protects nothing: cut at once."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.leases.done(hold)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")

    def test_learned_zero_loss_share(self) -> None:
        """
        An endpoint whose returning sessions all found their cache (a host-RAM cache):
        switches are free, so even a 10,000-token holder gives way at once.
        """
        h = Harness(learning=True)
        learn(h.leases.costs, "q", HIT, times=4)
        self.assertEqual(h.leases.costs.costs("q").loss_share, 0.0)
        hold = self.successResultOf(h.acquire("a"))
        h.served(hold, COSTLY)
        h.leases.done(hold)
        waiter = h.acquire("b")
        self.assertEqual(self.successResultOf(waiter).session_key, "b")

    def test_learning_gives_way(self) -> None:
        """
        A fresh endpoint, its loss share unknown: a switch is priced at nothing, so a
        waiter takes even a 10,000-token holder's slot as soon as its request ends.
        """
        h = Harness(learning=True)
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.served(hold, COSTLY)
        h.leases.done(hold)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertIsNone(h.leases.costs.costs("q").loss_share)

    def test_learned_losses_keep(self) -> None:
        """
        Once the endpoint has shown LEARN_SAMPLES returning sessions that lost their cache,
        a 10,000-token holder keeps its slot beside a waiter for the whole grace.
        """
        h = Harness(learning=True)
        learn(h.leases.costs, "q", LOSS, times=LEARN_SAMPLES - 1)
        self.assertIsNone(h.leases.costs.costs("q").loss_share)
        learn(h.leases.costs, "q", LOSS, times=1)
        self.assertEqual(h.leases.costs.costs("q").loss_share, 1.0)
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.served(hold, COSTLY)
        h.leases.done(hold)
        h.advance(0.95)
        self.assertNoResult(waiter)
        h.advance(0.1)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertEqual(h.leases.cut_short, {})

    def test_tiers_choose_who_gets_it(self) -> None:
        """
        A child waits from 0.1 s, a parent from 0.3 s: the child's wait cuts the grace at
        0.6 s, and the slot goes to the parent, as the scheduler's tiers say.
        """
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.served(hold, HALF_SECOND)
        h.leases.done(hold)
        h.advance(0.1)
        child = h.acquire("c", "child")
        h.advance(0.2)
        parent = h.acquire("p")
        h.advance(0.25)
        self.assertEqual(h.holders(), ["a"])
        h.advance(0.1)
        self.assertEqual(self.successResultOf(parent).session_key, "p")
        self.assertNoResult(child)

    def test_socket_client_counts(self) -> None:
        """A lease-socket client's wait cuts the grace too, and it is granted the slot."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.served(hold, HALF_SECOND)
        h.leases.done(hold)
        peer = LeaseProtocol()
        transport = StringTransport()
        peer.makeConnection(transport)
        h.scheduler.acquire(peer, "q", "outside")
        h.advance(0.45)
        self.assertEqual(transport.value(), b"")
        h.advance(0.1)
        self.assertEqual(json.loads(transport.value())["op"], "granted")
        self.assertEqual(h.holders(), ["outside"])

    def test_two_holders_one_waiter(self) -> None:
        """
        Two slots in grace, one waiter: the cheaper holder gives way; once the waiter is
        granted, the other holder has its whole grace again.
        """
        h = Harness(QueuePolicy(max_streams=2, lease_ttl_ms=3000, idle_yield_ms=30_000))
        cheap = self.successResultOf(h.acquire("cheap"))
        dear = self.successResultOf(h.acquire("dear"))
        h.served(cheap, Timings(prompt_n=200))
        h.served(dear, HALF_SECOND)
        h.leases.done(cheap)
        h.leases.done(dear)
        waiter = h.acquire("b")
        h.advance(0.25)
        self.assertEqual(self.successResultOf(waiter).session_key, "b")
        self.assertEqual(sorted(h.holders()), ["b", "dear"])
        h.advance(0.7)
        self.assertEqual(sorted(h.holders()), ["b", "dear"])
        h.advance(0.1)
        self.assertEqual(h.holders(), ["b"])


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
        h.served(hold)
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


class SessionGoneTests(SynchronousTestCase):
    """
    L{GatewayLeases.end}: a session that is gone (its connection closed) gives its slot back
    at once, in its grace or, while a request of it still runs, when that request ends.
    """

    def test_in_grace_released_at_once(self) -> None:
        """A hold in its grace is released by end(); the waiter is granted at once."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.served(hold)
        h.leases.done(hold)
        self.assertEqual(h.holders(), ["a"])
        h.leases.end("a")
        self.assertEqual(h.holders(), ["b"])
        self.successResultOf(waiter)
        # The grace's timer went with the lease: only the new holder's beats are left.
        self.assertEqual(len(h.clock.getDelayedCalls()), 1)

    def test_running_released_when_done(self) -> None:
        """A hold whose request still runs is kept until done(), then released (no grace)."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        waiter = h.acquire("b")
        h.leases.end("a")
        self.assertEqual(h.holders(), ["a"])
        h.leases.done(hold)
        self.assertEqual(h.holders(), ["b"])
        self.successResultOf(waiter)

    def test_unknown_session(self) -> None:
        """end() of a session that holds nothing changes nothing."""
        h = Harness()
        hold = self.successResultOf(h.acquire("a"))
        h.leases.end("nobody")
        h.leases.done(hold)
        self.assertEqual(h.holders(), ["a"])


STREAM = {**HI, "stream": True}
#: Limits under which a lease wait never times out in these tests.
PATIENT = dataclasses.replace(LIMITS, busy_wait_ms=60_000)


def long_answer(seconds: float) -> Any:
    """An upstream answer that streams a delta every 50 ms for about C{seconds}."""
    return answer(*[{"content": "x"}] * round(seconds / 0.05 - 1))


def costly(text: str) -> Any:
    """An upstream answer C{text} whose context is L{COSTLY}: a waiter waits a whole grace."""
    return answer({"content": text}, timings=dataclasses.asdict(COSTLY))


class LeaseHarness(GatewayHarness):
    """L{GatewayHarness} whose gateway takes leases, as C{twist loopd} wires them."""

    def __init__(self, config: Config, grace_ms: int = 1000, learning: bool = False) -> None:
        """
        A gateway over C{config} with a lease scheduler and a grace of C{grace_ms}.

        @param learning: leave the endpoints fresh (their loss share still learned); by
            default each has learned that every switch loses the cache.
        """
        super().__init__(config, leases=True, grace_ms=grace_ms)
        assert self.leases is not None
        if not learning:
            learn_losses(self.leases.costs, [e.name for e in config.endpoints])

    def chat(
        self,
        document: object,
        session: str | None = None,
        role: str | None = None,
        end: str | None = None,
    ) -> ClientConnection:
        """POST C{document} on a new connection, with C{X-Session-Id}/C{-Role}/C{-End}."""
        headers = ["Content-Type: application/json"]
        if end is not None:
            headers.append(f"X-Session-End: {end}")
        if session is not None:
            headers.append(f"X-Session-Id: {session}")
        if role is not None:
            headers.append(f"X-Session-Role: {role}")
        connection = self.connect()
        connection.request("POST", CHAT, json.dumps(document).encode(), headers)
        return connection

    def status(self) -> Any:
        """
        C{GET /v1/queue}'s JSON body (asserting a 200) without the gateway's C{endpoints}
        (asserting it is there): the lease protocol's own status reply.
        """
        response = self.get("/v1/queue").response()
        assert response.status == 200, response
        body = response.json()
        del body["endpoints"]
        return body

    def queue(self, key: str = "tiny") -> dict[str, Any]:
        """The status entry of queue C{key}."""
        entry: dict[str, Any] = next(q for q in self.status()["queues"] if q["queueKey"] == key)
        return entry

    def waiting(self, key: str = "tiny") -> list[str]:
        """The sessions waiting on queue C{key}, by C{GET /v1/queue}."""
        return [w["sessionKey"] for w in self.queue(key)["waiting"]]

    def holders(self, key: str = "tiny") -> list[str]:
        """The sessions holding a slot of queue C{key}, by C{GET /v1/queue}."""
        return [h["sessionKey"] for h in self.queue(key)["holders"]]


class LeaseTestCase(SynchronousTestCase):
    """A lease harness per test, and the checks the tests share."""

    config = make_config(slots=1, limits=PATIENT)
    grace_ms = 1000
    #: Whether the endpoints start fresh, their loss share still learned (L{LeaseHarness}).
    learning = False

    def setUp(self) -> None:
        self.harness = LeaseHarness(self.config, self.grace_ms, self.learning)
        self.fake = self.harness.fake

    def script(self, *replies: Any) -> None:
        """Queue upstream replies to the chat route."""
        self.fake.script("POST", CHAT, *replies)

    def chats_sent(self) -> int:
        """How many chat requests reached the fake server."""
        return len(self.fake.requests_to("POST", CHAT))

    def error_status(self, connection: ClientConnection, status: int, code: str) -> dict[str, Any]:
        """Assert a whole JSON error answer with C{status} and C{code}; return the error."""
        response = connection.response()
        self.assertEqual((response.status, response.complete), (status, True))
        error: dict[str, Any] = response.json()["error"]
        self.assertEqual(error["code"], code)
        return error


def content(response: Response) -> str:
    """The text of a streamed answer."""
    chunks = [d for d in response.data() if d != "[DONE]" and d.get("choices")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


class RoleTests(LeaseTestCase):
    """
    C{X-Session-Role} sets the lease's tier: parent (also when absent) or child.
    """

    config = make_config(slots=2, limits=PATIENT)

    def test_accepted(self) -> None:
        """parent, child, any case, or no header at all: the request is answered."""
        roles = [None, "parent", "child", "Child"]
        self.script(*[answer({"content": "ok"}) for _ in roles])
        connections = [self.harness.chat(HI, f"s{i}", role) for i, role in enumerate(roles)]
        self.harness.advance(5)
        self.assertEqual([c.response().status for c in connections], [200] * len(roles))
        self.assertEqual(self.chats_sent(), len(roles))

    def test_refused(self) -> None:
        """Any other value is 400 invalid_session_role; nothing upstream, no lease."""
        for value in ["boss", "parent, child"]:
            connection = self.harness.chat(HI, "s", value)
            error = self.error_status(connection, 400, "invalid_session_role")
            self.assertEqual(error["type"], "invalid_request_error")
        self.assertEqual(self.fake.requests, [])
        self.assertEqual(self.harness.status(), {"op": "status", "queues": []})

    def test_child_in_status(self) -> None:
        """A child's request holds its lease as a child; a parent's as a parent."""
        self.script(long_answer(1.0), long_answer(1.0))
        self.harness.chat(STREAM, "kid", "child")
        self.harness.chat(STREAM, "boss")
        self.harness.advance(0.1)
        self.assertEqual(
            self.harness.queue()["holders"],
            [
                {"sessionKey": "kid", "role": "child", "group": None},
                {"sessionKey": "boss", "role": "parent", "group": None},
            ],
        )


class WaitTests(LeaseTestCase):
    """
    A request whose endpoint's queue is full waits for a lease before it goes upstream.
    """

    def test_queued_comment(self) -> None:
        """A streamed request that waits hears a queued comment, then gets its answer."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        waiting = self.harness.chat(STREAM, "b")
        response = waiting.response()
        self.assertEqual((response.status, response.complete), (200, False))
        self.assertEqual(response.comments(), [{"event": "queued", "ahead": 0}])
        self.assertEqual(content(response), "")
        self.assertEqual((self.chats_sent(), self.harness.waiting()), (1, ["b"]))
        self.harness.advance(2)
        response = waiting.response()
        self.assertEqual((response.complete, content(response)), (True, "second"))
        events = response.events()
        queued = [i for i, e in enumerate(events) if e.startswith(': loopd {"event":"queued"')]
        answered = [i for i, e in enumerate(events) if '"content":"second"' in e]
        self.assertLess(queued[-1], answered[0])
        self.assertEqual(self.chats_sent(), 2)

    def test_second_waits_for_grace(self) -> None:
        """
        The waiter goes upstream only when the holder's grace has ended, when the holder's
        re-prefill would cost more than the whole grace.
        """
        self.script(costly("first"), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "b")
        self.harness.advance(1.05)
        self.assertEqual(self.chats_sent(), 1)
        self.harness.advance(0.1)
        self.assertEqual(self.chats_sent(), 2)
        self.assertEqual(self.harness.queue()["switches"], 1)

    def test_session_end_skips_grace(self) -> None:
        """X-Session-End: true hands the slot on when the answer ends, with no grace."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a", end="true")
        self.harness.chat(STREAM, "b")
        self.harness.advance(0.5)
        self.assertEqual(self.chats_sent(), 2)
        self.assertEqual(self.harness.holders(), ["b"])

    def test_session_end_false_keeps_grace(self) -> None:
        """X-Session-End: 0 (or false) is an ordinary request: the grace holds the slot."""
        self.script(costly("first"), answer({"content": "second"}))
        self.harness.chat(STREAM, "a", end="0")
        self.harness.chat(STREAM, "b")
        self.harness.advance(0.5)
        self.assertEqual((self.chats_sent(), self.harness.holders()), (1, ["a"]))

    def test_session_end_refused(self) -> None:
        """Any other X-Session-End is 400 invalid_session_end; nothing upstream, no lease."""
        connection = self.harness.chat(HI, "s", end="soon")
        self.error_status(connection, 400, "invalid_session_end")
        self.assertEqual(self.fake.requests, [])
        self.assertEqual(self.harness.status(), {"op": "status", "queues": []})

    def test_client_gone_while_waiting(self) -> None:
        """A client that leaves while waiting leaves no waiter, and nothing goes upstream."""
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "b").drop()
        self.assertEqual(self.harness.waiting(), [])
        self.harness.advance(3)
        self.assertEqual(self.chats_sent(), 1)
        self.assertEqual(self.harness.scrape()[outcome("tiny", "client_gone")], 1.0)
        self.assertEqual(self.harness.gateway.in_flight, set())


class WaitTimeoutTests(LeaseTestCase):
    """
    A wait for a lease longer than C{limits.busy_wait_ms} (200 ms here) is WaitTimeout.
    """

    config = make_config(slots=1)

    def test_wait_timeout(self) -> None:
        """A non-stream wait past busy_wait_ms is 504 wait_timeout and leaves no waiter."""
        self.script(long_answer(2.0))
        self.harness.chat(STREAM, "a")
        waiting = self.harness.chat(HI, "b")
        self.harness.advance(0.15)
        self.assertEqual(waiting.responses(), [])
        self.harness.advance(0.1)
        self.assertEqual(self.error_status(waiting, 504, "wait_timeout")["type"], "timeout")
        self.assertEqual(self.harness.waiting(), [])
        self.assertEqual(self.chats_sent(), 1)
        self.assertEqual(self.harness.scrape()[outcome("tiny", "wait_timeout")], 1.0)

    def test_wait_timeout_stream(self) -> None:
        """A streamed wait past busy_wait_ms ends with one wait_timeout event after queued."""
        self.script(long_answer(2.0))
        self.harness.chat(STREAM, "a")
        waiting = self.harness.chat(STREAM, "b")
        self.harness.advance(0.25)
        response = waiting.response()
        self.assertEqual((response.status, response.complete), (200, True))
        self.assertEqual(response.comments(), [{"event": "queued", "ahead": 0}])
        self.assertEqual(response.data()[-1]["error"]["code"], "wait_timeout")
        self.assertNotIn("[DONE]", response.data())
        self.assertEqual(self.harness.waiting(), [])
        self.assertEqual(self.chats_sent(), 1)


class AnonymousTests(LeaseTestCase):
    """
    A request without a session id belongs to its connection's anonymous session, which
    ends when the connection closes: no grace after it (DESIGN §3 decision 36).
    """

    def test_new_connection_per_request(self) -> None:
        """
        Ten sequential anonymous requests on one slot, each on a new connection closed
        after its answer (curl, an SDK making a client per request): each is answered
        within 0.2 s, none waits for the previous one's grace (1 s).
        """
        self.script(*[answer({"content": f"n{i}"}) for i in range(10)])
        for i in range(10):
            connection = self.harness.chat(HI)
            self.harness.advance(0.2)
            response = connection.response()
            self.assertEqual((response.status, response.complete), (200, True), f"request {i}")
            connection.drop()
        self.assertEqual(self.chats_sent(), 10)
        self.assertEqual(self.harness.holders(), [])

    def test_keep_alive_keeps_its_session(self) -> None:
        """
        A connection that stays open keeps its anonymous session and slot between requests
        (a second connection waits); when it closes, the slot goes to the waiter at once.
        """
        self.script(costly("a1"), costly("a2"), answer({"content": "b1"}))
        kept = self.harness.connect()
        kept.post(HI)
        self.harness.advance(0.2)
        other = self.harness.chat(HI)
        self.harness.advance(0.2)
        self.assertEqual((self.chats_sent(), len(self.harness.waiting())), (1, 1))
        kept.post(HI)
        self.harness.advance(0.2)
        self.assertEqual([r.status for r in kept.responses()], [200, 200])
        self.assertEqual((self.chats_sent(), other.responses()), (2, []))
        kept.drop()
        self.harness.advance(0.2)
        self.assertEqual(other.response().status, 200)
        self.assertEqual(self.chats_sent(), 3)

    def test_closed_mid_request(self) -> None:
        """A connection closed while its request runs gives the slot back with no grace."""
        self.script(long_answer(1.0), answer({"content": "b"}))
        self.harness.chat(STREAM).drop()
        other = self.harness.chat(HI)
        self.harness.advance(0.2)
        self.assertEqual(other.response().status, 200)


class AnonymousSlotTests(LeaseTestCase):
    """
    An anonymous request goes to the free slot whose last conversation is a prefix of its
    own (decision 36), as a client making a new connection per turn needs.
    """

    config = make_config(slots=2, limits=PATIENT)

    def test_prefix_slot(self) -> None:
        """
        On two slots, a's first turn runs on slot 0 and b's, meanwhile, on slot 1, each on a
        connection closed after it; b's second turn, on a new connection, goes back to slot
        1, whose last conversation is the beginning of its own (the older slot 0 would lose
        it).
        """
        b1 = [{"role": "user", "content": "b1"}]
        b2 = [*b1, {"role": "assistant", "content": "x"}, {"role": "user", "content": "b2"}]
        self.script(long_answer(1.0), answer({"content": "x"}), answer({"content": "x"}))
        first = self.harness.chat({"messages": [{"role": "user", "content": "a1"}]})
        self.harness.advance(0.1)
        second = self.harness.chat({"messages": b1})
        self.harness.advance(0.2)
        self.assertEqual(second.response().status, 200)
        second.drop()
        self.harness.advance(1.0)
        self.assertEqual(first.response().status, 200)
        first.drop()
        third = self.harness.chat({"messages": b2})
        self.harness.advance(0.2)
        self.assertEqual(third.response().status, 200)
        slots = [r.json["id_slot"] for r in self.fake.requests_to("POST", CHAT)]
        self.assertEqual(slots, [0, 1, 1])


class AgentIdTests(LeaseTestCase):
    """
    The ids agents already send name the session's lease (decision 36), over HTTP.
    """

    config = make_config(slots=2, limits=PATIENT)

    def holder_for(self, headers: list[str], document: object = STREAM) -> list[str]:
        """Who holds the queue while one long request with C{headers} runs."""
        self.script(long_answer(1.0))
        connection = self.harness.connect()
        body = json.dumps(document).encode()
        connection.request("POST", CHAT, body, ["Content-Type: application/json", *headers])
        self.harness.advance(0.1)
        return self.harness.holders()

    def test_header_names_the_session(self) -> None:
        """session-id (Codex CLI, the OpenAI SDK's default_headers) is the lease's session."""
        self.assertEqual(self.holder_for(["session-id: codex-1"]), ["codex-1"])

    def test_header_order(self) -> None:
        """X-Claude-Code-Session-Id wins over x-session-affinity and the body's user."""
        headers = ["x-session-affinity: oc", "X-Claude-Code-Session-Id: cc"]
        self.assertEqual(self.holder_for(headers, {**STREAM, "user": "u"}), ["cc"])

    def test_body_user(self) -> None:
        """Without a header, the chat body's user names the session."""
        self.assertEqual(self.holder_for([], {**STREAM, "user": "alice"}), ["alice"])

    def test_bad_value(self) -> None:
        """A bad session_id is 400 invalid_session_id naming it; nothing upstream, no lease."""
        connection = self.harness.connect()
        headers = ["Content-Type: application/json", "session_id: a\x01b"]
        connection.request("POST", CHAT, json.dumps(HI).encode(), headers)
        error = self.error_status(connection, 400, "invalid_session_id")
        self.assertIn("header session_id has a control character", error["message"])
        self.assertEqual(self.fake.requests, [])
        self.assertEqual(self.harness.status(), {"op": "status", "queues": []})


class SlotTests(LeaseTestCase):
    """
    A session in its grace keeps its home slot: nobody else is sent there meanwhile.
    """

    config = make_config(slots=2, limits=PATIENT)

    def slots_sent(self) -> list[int]:
        """The C{id_slot} of each chat request the fake received, in order."""
        return [r.json["id_slot"] for r in self.fake.requests_to("POST", CHAT)]

    def test_home_slot_kept_in_grace(self) -> None:
        """b, whose last slot a calls home in a's grace, goes to the other slot; a keeps 0."""
        self.script(answer({"content": "b1"}))
        self.harness.chat(STREAM, "b")
        self.harness.advance(1.2)
        # b called slot 0 home, and its grace is over. a takes slot 0, the occupied one
        # (decision 39), so c gets slot 1.
        self.script(long_answer(2.05), long_answer(0.55))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "c")
        self.harness.advance(2.3)
        self.assertEqual(self.harness.holders(), ["a"])
        # a is in its grace, c's is over: b's own last slot, 0, is a's home now.
        self.script(answer({"content": "b2"}), answer({"content": "a2"}))
        self.harness.chat(STREAM, "b")
        self.harness.advance(0.2)
        self.harness.chat(STREAM, "a")
        self.harness.advance(0.5)
        self.assertEqual(self.slots_sent(), [0, 0, 1, 1, 0])
        self.assertEqual(self.harness.queue()["switches"], 0)


class GatewayCostTests(LeaseTestCase):
    """
    Through the gateway: the holder's completion prices its grace with the endpoint's
    learned prompt speed, and C{/metrics} shows what was learned.
    """

    grace_ms = 5000

    def test_learned_speed_cuts(self) -> None:
        """
        a's answer evaluated 2,000 tokens at 4,000 tokens/s (a 0.5 s re-prefill, every switch
        a loss as the endpoint learned); b waits from the start: b goes upstream 0.5 s after
        a's answer, not after a's 5 s grace.
        """
        timings = {"prompt_n": 2000, "prompt_per_second": 4000.0}
        self.script(answer({"content": "a"}, timings=timings), answer({"content": "b"}))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "b")
        self.harness.advance(0.15)
        self.assertEqual((self.chats_sent(), self.harness.holders()), (1, ["a"]))
        self.harness.advance(0.4)
        self.assertEqual((self.chats_sent(), self.harness.holders()), (1, ["a"]))
        self.harness.advance(0.1)
        self.assertEqual((self.chats_sent(), self.harness.holders()), (2, ["b"]))
        samples = self.harness.scrape()
        tiny = frozenset({("endpoint", "tiny")})
        self.assertEqual(samples[("loopd_grace_prompt_tokens_per_second", tiny)], 4000.0)
        self.assertEqual(samples[("loopd_grace_cache_loss_share", tiny)], 1.0)
        self.assertEqual(samples[("loopd_grace_cut_short_total", tiny)], 1.0)


class GatewayLearningTests(LeaseTestCase):
    """
    Through the gateway on a fresh endpoint: returning sessions teach it the loss share,
    which C{/metrics} shows as NaN until it is known.
    """

    learning = True

    def test_returning_session_hit(self) -> None:
        """
        a, then b on a's slot (a gives way at once: nothing learned yet), then a again
        finding its 100 tokens cached (a server whose RAM cache restored it): one returning
        session, a hit, and the share still unknown; a second one like it makes it 0.
        """
        self.script(
            answer({"content": "a1"}, timings={"prompt_n": 100}),
            answer({"content": "b1"}, timings={"prompt_n": 100}),
            answer({"content": "a2"}, timings={"cache_n": 100, "prompt_n": 10}),
            answer({"content": "b2"}, timings={"cache_n": 100, "prompt_n": 10}),
        )
        tiny = frozenset({("endpoint", "tiny")})
        self.assertTrue(math.isnan(self.harness.scrape()[("loopd_grace_cache_loss_share", tiny)]))
        first = self.harness.chat(STREAM, "a")
        self.harness.advance(0.05)
        second = self.harness.chat(STREAM, "b")
        self.harness.advance(0.2)
        third = self.harness.chat(STREAM, "a")
        self.harness.advance(1.0)
        replies = [content(c.response()) for c in (first, second, third)]
        self.assertEqual(replies, ["a1", "b1", "a2"])
        samples = self.harness.scrape()
        self.assertEqual(samples[("loopd_grace_returning_sessions", tiny)], 1.0)
        self.assertTrue(math.isnan(samples[("loopd_grace_cache_loss_share", tiny)]))
        fourth = self.harness.chat(STREAM, "b")
        self.harness.advance(0.5)
        self.assertEqual(content(fourth.response()), "b2")
        samples = self.harness.scrape()
        self.assertEqual(samples[("loopd_grace_returning_sessions", tiny)], 2.0)
        self.assertEqual(samples[("loopd_grace_cache_loss_share", tiny)], 0.0)


class QueueRouteTests(LeaseTestCase):
    """
    C{GET /v1/queue} serves the lease protocol's status reply, only when there are leases.
    """

    config = make_config(slots=2, limits=PATIENT)

    def test_absent_without_leases(self) -> None:
        """A gateway without leases answers 404 not_found for /v1/queue."""
        self.error_status(GatewayHarness(self.config).get("/v1/queue"), 404, "not_found")

    def test_status(self) -> None:
        """The status reply: op status and each queue's streams, switches, holders, waiters."""
        self.assertEqual(self.harness.status(), {"op": "status", "queues": []})
        self.script(long_answer(1.0))
        self.harness.chat(STREAM, "a", "child")
        entry = {
            "queueKey": "tiny",
            "maxStreams": 2,
            "switches": 0,
            "holders": [{"sessionKey": "a", "role": "child", "group": None}],
            "waiting": [],
        }
        self.assertEqual(self.harness.status(), {"op": "status", "queues": [entry]})

    def test_endpoint_states(self) -> None:
        """Beside the lease status, C{endpoints} has each endpoint's health state and why."""
        self.harness.net.stop_listening(self.config.endpoints[0].socket)
        self.harness.post(HI)
        self.harness.advance(0.1)
        body = self.harness.get("/v1/queue").response().json()
        detail = "no socket (nothing is serving it)"
        self.assertEqual(body["endpoints"], {"tiny": {"state": "down", "detail": detail}})

    def test_get_only(self) -> None:
        """POST /v1/queue is 405 method_not_allowed."""
        connection = self.harness.connect()
        connection.request("POST", "/v1/queue", b"{}")
        self.error_status(connection, 405, "method_not_allowed")


class MetricsTests(LeaseTestCase):
    """
    C{/metrics} reads the lease scheduler: grants, switches and waiters.
    """

    def lease_samples(self) -> dict[str, float]:
        """The loopd_lease_* samples of one scrape, keyed by name and queue label."""
        return {
            name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels)): value
            for (name, labels), value in self.harness.scrape().items()
            if name.startswith("loopd_lease_")
        }

    def test_lease_metrics(self) -> None:
        """A waiter shows in waiters; its grant when a's grace is cut, in grants and switches."""
        self.assertEqual(
            self.lease_samples(),
            {
                "loopd_lease_grants_total": 0.0,
                "loopd_lease_releases_total": 0.0,
                "loopd_lease_evictions_total": 0.0,
                "loopd_lease_forgotten_queues_total": 0.0,
                "loopd_lease_forgotten_switches_total": 0.0,
                "loopd_lease_resting_queues": 0.0,
                "loopd_lease_resting_switches": 0.0,
            },
        )
        self.script(answer({"content": "first"}), answer({"content": "second"}))
        self.harness.chat(STREAM, "a")
        self.harness.chat(STREAM, "b")
        samples = self.lease_samples()
        self.assertEqual(samples["loopd_lease_grants_total"], 1.0)
        self.assertEqual(samples["loopd_lease_switches_total{queue=tiny}"], 0.0)
        self.assertEqual(samples["loopd_lease_waiters{queue=tiny}"], 1.0)
        self.assertEqual(samples["loopd_lease_holders{queue=tiny}"], 1.0)
        self.harness.advance(0.5)
        samples = self.lease_samples()
        self.assertEqual(samples["loopd_lease_grants_total"], 2.0)
        self.assertEqual(samples["loopd_lease_releases_total"], 1.0)
        self.assertEqual(samples["loopd_lease_switches_total{queue=tiny}"], 1.0)
        self.assertEqual(samples["loopd_lease_waiters{queue=tiny}"], 0.0)
        self.assertEqual(samples["loopd_lease_holders{queue=tiny}"], 1.0)
