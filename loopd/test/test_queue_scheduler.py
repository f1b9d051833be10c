"""
Tests for L{loopd.queue.scheduler}: one test per rule of the lease protocol seed, on
C{task.Clock}; then random operation sequences from a hypothesis state machine
(L{loopd.test.support.scheduler_machine.SchedulerMachine}), with the scheduler's invariants
checked after every step.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_rest import RESTING_KEY_CHARS, RESTING_QUEUES
from loopd.queue.scheduler_types import Grant, QueueEvent, QueuePolicy, StaticRouter
from loopd.test.support.scheduler_machine import SchedulerMachine

ONE = QueuePolicy(max_streams=1, lease_ttl_ms=10_000, idle_yield_ms=4_000)


class Harness:
    """A scheduler on a C{task.Clock} recording its grants and events."""

    def __init__(self, router: StaticRouter | None = None, forget: bool = False) -> None:
        """
        @param forget: drop a queue the router does not name once it is empty, as the
            daemons do; otherwise every queue is kept.
        """
        self.clock = Clock()
        self.grants: list[Grant] = []
        self.events: list[QueueEvent] = []
        self.router = router or StaticRouter(defaults=ONE)
        self.sched = Scheduler(
            self.clock,
            self.router,
            self.grants.append,
            self.events.append,
            keep=(lambda key: self.router.names(key)) if forget else None,
        )

    def reload(self, router: StaticRouter) -> None:
        """Apply a new router (and the names it keeps)."""
        self.router = router
        self.sched.reload(router)

    def keys(self) -> list[str]:
        """The queue keys status lists."""
        return [str(q["queueKey"]) for q in self.sched.status()]

    def sessions(self) -> list[str]:
        """Granted session keys in grant order."""
        return [g.session_key for g in self.grants]

    def queue(self, key: str = "q") -> dict[str, object]:
        """The status entry of one queue."""
        return next(q for q in self.sched.status() if q["queueKey"] == key)

    def holders(self, key: str = "q") -> list[str]:
        """Holder session keys of one queue."""
        return [h["sessionKey"] for h in self.queue(key)["holders"]]  # type: ignore[attr-defined]

    def waiting(self, key: str = "q") -> list[str]:
        """Waiting session keys of one queue, in enqueue order."""
        return [w["sessionKey"] for w in self.queue(key)["waiting"]]  # type: ignore[attr-defined]

    def names(self) -> list[str]:
        """Event names in order."""
        return [e.event for e in self.events]

    def advance_ms(self, ms: float) -> None:
        """Move the clock on."""
        self.clock.advance(ms / 1000.0)

    def switch(self, key: str) -> None:
        """
        Make one switch on the one-slot queue C{key} and leave it with no holder and no
        waiter: s1 holds, s2 waits, s1 releases (s2 is switched in), s2 releases.
        """
        self.sched.acquire("c1", key, "s1")
        self.sched.acquire("c2", key, "s2")
        self.sched.release(key, "s1")
        self.sched.release(key, "s2")

    def balanced(self) -> bool:
        """Whether the live, resting and forgotten switches add up to every switch."""
        counters = self.sched.counters()
        live = sum(int(q["switches"]) for q in self.sched.status())
        return live + counters.resting_switches + counters.forgotten_switches == counters.switches


class QueuesTests(SynchronousTestCase):
    """Queues, grants and their terms."""

    def test_unknown_key_gets_defaults(self) -> None:
        """A queue key nothing names is created on first use with the defaults."""
        h = Harness()
        grant = h.sched.acquire("c1", "q", "s1")
        self.assertEqual(grant, Grant("c1", "q", "q", "s1", 10_000, 4_000))
        self.assertEqual(
            h.sched.status(),
            [
                {
                    "queueKey": "q",
                    "maxStreams": 1,
                    "switches": 0,
                    "holders": [{"sessionKey": "s1", "role": "parent", "group": None}],
                    "waiting": [],
                }
            ],
        )

    def test_named_queue_uses_its_entry(self) -> None:
        """A named queue's maxStreams and TTL come from its entry."""
        h = Harness(StaticRouter(defaults=ONE, queues={"z": QueuePolicy(max_streams=2)}))
        h.sched.acquire("c", "z", "a")
        h.sched.acquire("c", "z", "b")
        self.assertEqual(h.sessions(), ["a", "b"])
        self.assertEqual(h.grants[0].lease_ttl_ms, 30_000)

    def test_busy_queue_waits_and_release_grants(self) -> None:
        """An acquire on a full queue waits; a release grants it, counted as one switch."""
        h = Harness()
        h.sched.acquire("c1", "q", "s1")
        self.assertIsNone(h.sched.acquire("c2", "q", "s2"))
        self.assertEqual(h.waiting(), ["s2"])
        h.sched.release("q", "s1")
        self.assertEqual(h.sessions(), ["s1", "s2"])
        self.assertEqual(h.grants[1].conn, "c2")
        self.assertEqual(h.queue()["switches"], 1)
        self.assertEqual(h.names(), ["grant", "queued", "release", "grant", "switch"])

    def test_direct_grant_is_not_a_switch(self) -> None:
        """A grant into a free slot does not count as a switch."""
        h = Harness()
        h.sched.acquire("c1", "q", "s1")
        h.sched.release("q", "s1")
        h.sched.acquire("c2", "q", "s2")
        self.assertEqual(h.queue()["switches"], 0)

    def test_holder_reacquire_is_granted_again(self) -> None:
        """A session that holds the slot and acquires again is granted at once."""
        h = Harness()
        h.sched.acquire("c1", "q", "s1")
        self.assertIsNotNone(h.sched.acquire("c1", "q", "s1"))
        self.assertEqual(h.sessions(), ["s1", "s1"])
        self.assertEqual(h.sched.counters().grants, 1)

    def test_waiter_reacquire_keeps_position(self) -> None:
        """A waiting session that acquires again keeps its place in the queue."""
        h = Harness()
        h.sched.acquire("c0", "q", "s0")
        h.sched.acquire("c1", "q", "s1")
        h.sched.acquire("c2", "q", "s2")
        h.sched.acquire("c1b", "q", "s1")
        self.assertEqual(h.waiting(), ["s1", "s2"])
        h.sched.release("q", "s0")
        self.assertEqual(h.grants[-1].conn, "c1b")

    def test_status_reports_group_label(self) -> None:
        """status reports each holder's and waiter's role and group."""
        h = Harness()
        h.sched.acquire("c1", "q", "s1", "child", "g1")
        h.sched.acquire("c2", "q", "s2", "parent", "g2")
        q = h.queue()
        self.assertEqual(q["holders"], [{"sessionKey": "s1", "role": "child", "group": "g1"}])
        self.assertEqual(q["waiting"], [{"sessionKey": "s2", "role": "parent", "group": "g2"}])


class TierTests(SynchronousTestCase):
    """Tiers, FIFO inside a tier, aging, fifo policy, role."""

    def _busy(self, h: Harness) -> None:
        """Occupy the one slot of queue q with session h0."""
        h.sched.acquire("c", "q", "h0")

    def test_parent_before_child(self) -> None:
        """A waiting parent is granted before a child that waited longer."""
        h = Harness()
        self._busy(h)
        h.sched.acquire("c", "q", "kid", "child")
        h.sched.acquire("c", "q", "dad", "parent")
        h.sched.release("q", "h0")
        self.assertEqual(h.sessions()[-1], "dad")

    def test_fifo_within_tier(self) -> None:
        """Waiters of one tier are granted in enqueue order."""
        h = Harness()
        self._busy(h)
        for s in ("p1", "p2", "p3"):
            h.sched.acquire("c", "q", s)
        for prev in ("h0", "p1", "p2"):
            h.sched.release("q", prev)
        self.assertEqual(h.sessions(), ["h0", "p1", "p2", "p3"])

    def test_aging_by_time(self) -> None:
        """A child that waited agingAfterMs is granted ahead of a waiting parent."""
        h = Harness(StaticRouter(defaults=QueuePolicy(aging_after_ms=5_000)))
        self._busy(h)
        h.sched.acquire("c", "q", "kid", "child")
        h.sched.acquire("c", "q", "dad")
        h.advance_ms(4_999)
        h.sched.release("q", "h0")
        self.assertEqual(h.sessions()[-1], "dad")
        h.advance_ms(1)
        h.sched.release("q", "dad")
        self.assertEqual(h.sessions()[-1], "kid")

    def test_aging_by_slots(self) -> None:
        """After agingAfterSlots consecutive parent grants a waiting child goes next."""
        h = Harness(StaticRouter(defaults=QueuePolicy(aging_after_slots=2, aging_after_ms=0)))
        self._busy(h)
        h.sched.acquire("c", "q", "kid", "child")
        for s in ("p1", "p2", "p3"):
            h.sched.acquire("c", "q", s)
        for prev in ("h0", "p1", "p2"):
            h.sched.release("q", prev)
        self.assertEqual(h.sessions(), ["h0", "p1", "p2", "kid"])

    def test_fifo_policy_ignores_tiers(self) -> None:
        """Under policy fifo a child that queued first is granted first."""
        h = Harness(StaticRouter(defaults=QueuePolicy(policy="fifo")))
        self._busy(h)
        h.sched.acquire("c", "q", "kid", "child")
        h.sched.acquire("c", "q", "dad")
        h.sched.release("q", "h0")
        self.assertEqual(h.sessions()[-1], "kid")

    def test_role_retiers_waiter_in_place(self) -> None:
        """role re-tiers a waiter, keeping its enqueue position."""
        h = Harness()
        self._busy(h)
        h.sched.acquire("c", "q", "a", "child")
        h.sched.acquire("c", "q", "b", "child")
        h.sched.acquire("c", "q", "p")
        h.sched.role("b", "parent")
        self.assertEqual(h.waiting(), ["a", "b", "p"])
        h.sched.release("q", "h0")
        self.assertEqual(h.sessions()[-1], "b")

    def test_role_leaves_holder_tier(self) -> None:
        """A holder keeps the tier it was granted with after a role op."""
        h = Harness()
        h.sched.acquire("c", "q", "s", "child")
        h.sched.role("s", "parent")
        self.assertEqual(h.queue()["holders"][0]["role"], "child")  # type: ignore[index]

    def test_absent_role_is_parent(self) -> None:
        """An acquire with no role is a parent."""
        h = Harness()
        h.sched.acquire("c", "q", "s")
        self.assertEqual(h.events[0].role, "parent")


class ReleaseTests(SynchronousTestCase):
    """release, cancel, disconnect."""

    def test_release_not_held_is_noop(self) -> None:
        """Releasing a lease that is not held changes nothing (§20)."""
        h = Harness()
        h.sched.acquire("c", "q", "s1")
        h.sched.acquire("c", "q", "s2")
        h.sched.release("q", "s2")
        h.sched.release("other", "s1")
        self.assertEqual((h.holders(), h.waiting()), (["s1"], ["s2"]))

    def test_cancel_drops_waiter(self) -> None:
        """cancel drops a queued request without a grant."""
        h = Harness()
        h.sched.acquire("c", "q", "s1")
        h.sched.acquire("c", "q", "s2")
        h.sched.cancel("q", "s2")
        h.sched.release("q", "s1")
        self.assertEqual((h.sessions(), h.waiting()), (["s1"], []))

    def test_cancel_releases_holder(self) -> None:
        """cancel of a granted session releases its slot to the next waiter."""
        h = Harness()
        h.sched.acquire("c", "q", "s1")
        h.sched.acquire("c", "q", "s2")
        h.sched.cancel("q", "s1")
        self.assertEqual(h.holders(), ["s2"])

    def test_disconnect_releases_and_drops(self) -> None:
        """A disconnect releases the connection's leases and drops its waiters."""
        h = Harness(StaticRouter(defaults=ONE))
        h.sched.acquire("c1", "q", "a")
        h.sched.acquire("c1", "r", "b")
        h.sched.acquire("c2", "q", "x")
        h.sched.acquire("c1", "q", "w")
        h.sched.disconnect("c1")
        self.assertEqual((h.holders("q"), h.waiting("q"), h.holders("r")), (["x"], [], []))
        self.assertEqual([e.reason for e in h.events if e.event == "release"], ["disconnect"] * 2)


class LeaseTests(SynchronousTestCase):
    """TTL, renew, beats, idle yield, terms."""

    def test_ttl_evicts_without_waiter(self) -> None:
        """A lapsed lease is evicted even with nobody waiting."""
        h = Harness()
        h.sched.acquire("c", "q", "s")
        h.advance_ms(10_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), [])
        self.assertEqual(h.events[-1], QueueEvent("evict", "q", "s", "parent", "ttl"))

    def test_lapsed_never_reported(self) -> None:
        """status never reports a lapsed lease, even before the sweep runs."""
        h = Harness()
        h.sched.acquire("c", "q", "s")
        h.sched.acquire("c", "q", "w")
        h.advance_ms(10_000)
        self.assertEqual(h.holders(), ["w"])

    def test_bare_renew_refreshes_every_lease(self) -> None:
        """A bare renew keeps every lease of the connection alive."""
        h = Harness()
        h.sched.acquire("c", "q", "a")
        h.sched.acquire("c", "r", "b")
        h.sched.acquire("d", "t", "x")
        h.advance_ms(9_000)
        h.sched.renew("c")
        h.advance_ms(9_000)
        self.assertEqual((h.holders("q"), h.holders("r"), h.holders("t")), (["a"], ["b"], []))

    def test_bare_renew_is_not_activity(self) -> None:
        """A bare renew does not reset the idle clock: the holder is still yielded."""
        h = Harness()
        h.sched.acquire("c", "q", "a", activity=True)
        h.sched.acquire("d", "q", "w")
        h.advance_ms(3_000)
        h.sched.renew("c")
        h.advance_ms(1_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["w"])

    def test_keyed_beat_resets_idle_clock(self) -> None:
        """A keyed beat refreshes the lease and its idle clock, and answers granted."""
        h = Harness()
        h.sched.acquire("c", "q", "a", activity=True)
        h.sched.acquire("d", "q", "w")
        h.advance_ms(3_000)
        self.assertTrue(h.sched.beat("q", "a"))
        h.advance_ms(3_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["a"])

    def test_beat_after_loss_is_not_granted(self) -> None:
        """A keyed beat for a lease that is gone answers not granted."""
        h = Harness()
        h.sched.acquire("c", "q", "a")
        h.sched.release("q", "a")
        self.assertFalse(h.sched.beat("q", "a"))
        self.assertFalse(h.sched.beat("nowhere", "a"))

    def test_idle_yield_to_waiter(self) -> None:
        """An activity-flagged holder silent past its window yields to a waiter."""
        h = Harness()
        h.sched.acquire("c", "q", "a", activity=True)
        h.sched.acquire("d", "q", "w")
        h.advance_ms(4_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["w"])
        self.assertIn(QueueEvent("release", "q", "a", "parent", "idle"), h.events)
        self.assertFalse(h.sched.beat("q", "a"))

    def test_lone_holder_not_yielded(self) -> None:
        """An idle holder with nobody waiting keeps its slot."""
        h = Harness()
        h.sched.acquire("c", "q", "a", activity=True)
        h.advance_ms(9_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["a"])

    def test_unflagged_not_yielded(self) -> None:
        """A lease without activity: true is never idle-yielded."""
        h = Harness()
        h.sched.acquire("c", "q", "a")
        h.sched.acquire("d", "q", "w")
        h.advance_ms(9_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["a"])

    def test_zero_window_disables_yield(self) -> None:
        """idleYieldMs 0 disables idle yield."""
        h = Harness(StaticRouter(defaults=QueuePolicy(idle_yield_ms=0)))
        h.sched.acquire("c", "q", "a", activity=True)
        h.sched.acquire("d", "q", "w")
        h.advance_ms(20_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["a"])

    def test_clocks_start_at_queued_grant(self) -> None:
        """A queued grant's TTL and idle clocks start when it is granted, not enqueued."""
        h = Harness()
        h.sched.acquire("c", "q", "a")
        h.sched.acquire("d", "q", "w", activity=True)
        h.sched.acquire("e", "q", "x")
        h.advance_ms(8_000)
        h.sched.release("q", "a")
        h.advance_ms(3_999)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["w"])

    def test_shorter_ttl_never_shortens_held_lease(self) -> None:
        """A reload that shortens the TTL leaves a held lease on its longer term."""
        h = Harness()
        h.sched.acquire("c", "q", "a")
        h.sched.reload(StaticRouter(defaults=QueuePolicy(lease_ttl_ms=2_000)))
        h.advance_ms(1_000)
        h.sched.renew("c")
        h.advance_ms(9_000)
        self.assertEqual(h.holders(), ["a"])
        h.sched.release("q", "a")
        self.assertEqual(h.sched.acquire("c", "q", "b").lease_ttl_ms, 2_000)  # type: ignore[union-attr]

    def test_longer_ttl_applies_at_once(self) -> None:
        """A reload that lengthens the TTL extends a held lease at once."""
        h = Harness()
        h.sched.acquire("c", "q", "a")
        h.sched.reload(StaticRouter(defaults=QueuePolicy(lease_ttl_ms=50_000)))
        h.advance_ms(40_000)
        self.assertEqual(h.holders(), ["a"])

    def test_idle_window_is_the_granted_one(self) -> None:
        """A changed idle-yield window applies at the next grant, not to a held lease."""
        h = Harness()
        h.sched.acquire("c", "q", "a", activity=True)
        h.sched.reload(StaticRouter(defaults=QueuePolicy(lease_ttl_ms=10_000, idle_yield_ms=0)))
        h.sched.acquire("d", "q", "w", activity=True)
        h.advance_ms(4_000)
        h.sched.sweep()
        self.assertEqual(h.holders(), ["w"])
        self.assertEqual(h.grants[-1].idle_yield_ms, 0)


class ReloadTests(SynchronousTestCase):
    """Passthrough, over-capacity, widening, groups."""

    def test_passthrough_grants_everyone(self) -> None:
        """enabled: false grants every session at once and reports maxStreams null."""
        h = Harness(StaticRouter(defaults=QueuePolicy(enabled=False)))
        for s in ("a", "b", "c"):
            h.sched.acquire("c", "q", s)
        self.assertEqual((h.holders(), h.queue()["maxStreams"]), (["a", "b", "c"], None))

    def test_widened_max_streams_grants_waiters(self) -> None:
        """A reload that widens maxStreams grants waiting sessions at once."""
        h = Harness()
        for s in ("a", "b", "c"):
            h.sched.acquire("c", "q", s)
        h.sched.reload(StaticRouter(defaults=QueuePolicy(max_streams=3)))
        self.assertEqual(h.holders(), ["a", "b", "c"])

    def test_over_capacity_no_preemption(self) -> None:
        """A narrowed queue keeps its holders, logs over-capacity and drains before granting."""
        h = Harness(StaticRouter(defaults=QueuePolicy(max_streams=2)))
        for s in ("a", "b", "w"):
            h.sched.acquire("c", "q", s)
        h.sched.reload(StaticRouter(defaults=QueuePolicy(max_streams=1)))
        self.assertEqual(
            h.events[-1],
            QueueEvent("config", "q", reason="over-capacity", holders=2, max_streams=1),
        )
        self.assertEqual((h.holders(), h.queue()["maxStreams"]), (["a", "b"], 1))
        h.sched.release("q", "a")
        self.assertEqual(h.holders(), ["b"])
        h.sched.release("q", "b")
        self.assertEqual(h.holders(), ["w"])

    def test_group_shares_slots_and_keys_replies(self) -> None:
        """Members of a group share its slots; a grant is keyed by the key the client used."""
        h = Harness(StaticRouter(defaults=ONE, groups={"gpu": ("u1", "u2")}))
        h.sched.acquire("c", "u1", "a")
        h.sched.acquire("d", "u2", "b")
        self.assertEqual((h.holders("gpu"), h.waiting("gpu")), (["a"], ["b"]))
        h.sched.release("u1", "a")
        self.assertEqual((h.grants[-1].queue_key, h.grants[-1].owner_key), ("u2", "gpu"))

    def test_reload_merge_moves_holders_and_waiters(self) -> None:
        """A reload into a group moves holders and waiters with their queue (over capacity)."""
        h = Harness()
        h.sched.acquire("c", "u1", "a")
        h.sched.acquire("d", "u2", "b")
        h.sched.acquire("e", "u2", "w")
        h.sched.reload(StaticRouter(defaults=ONE, groups={"gpu": ("u1", "u2")}))
        self.assertEqual([q["queueKey"] for q in h.sched.status()], ["gpu"])
        self.assertEqual((h.holders("gpu"), h.waiting("gpu")), (["a", "b"], ["w"]))
        self.assertEqual(h.events[-1].reason, "over-capacity")

    def test_reload_split_moves_back(self) -> None:
        """A reload that removes a group moves each member's sessions to its own queue."""
        h = Harness(StaticRouter(defaults=ONE, groups={"gpu": ("u1", "u2")}))
        h.sched.acquire("c", "u1", "a")
        h.sched.acquire("d", "u2", "b")
        h.sched.reload(StaticRouter(defaults=ONE))
        self.assertEqual((h.holders("u1"), h.holders("u2")), (["a"], ["b"]))
        self.assertEqual(h.sessions(), ["a", "b"])


class ForgetTests(SynchronousTestCase):
    """
    A queue the config does not name is dropped once it has no holder and no waiter; its
    switches rest in a bounded table, and a queue of that key created again resumes from
    them (issue 26, item 8). What is pushed out of the table, or merged away by a reload, is
    gone for good: it counts in the forgotten totals. Named queues stay.
    """

    def test_unnamed_queue_goes_after_release(self) -> None:
        """
        Acquire then release: the queue is gone from status; with no switch there is
        nothing to keep, so it is forgotten at once and nothing rests.
        """
        h = Harness(forget=True)
        h.sched.acquire("c1", "q", "s1")
        self.assertEqual(h.keys(), ["q"])
        h.sched.release("q", "s1")
        self.assertEqual(h.sched.status(), [])
        counters = h.sched.counters()
        self.assertEqual((counters.forgotten_queues, counters.resting_queues), (1, 0))

    def test_a_waiter_keeps_it(self) -> None:
        """A queue whose holder leaves while a session waits stays, with the waiter granted."""
        h = Harness(forget=True)
        h.sched.acquire("c1", "q", "s1")
        h.sched.acquire("c2", "q", "s2")
        h.sched.release("q", "s1")
        self.assertEqual((h.keys(), h.holders()), (["q"], ["s2"]))

    def test_switches_resume_after_a_rest(self) -> None:
        """
        A queue used, left idle (forgotten) and used again continues its switches from the
        old value; while it rests its switches count as resting, and the live, resting and
        forgotten switches add up to the total throughout.
        """
        h = Harness(forget=True)
        h.switch("q")
        counters = h.sched.counters()
        self.assertEqual(h.sched.status(), [])
        self.assertEqual((counters.switches, counters.grants, counters.releases), (1, 2, 2))
        self.assertEqual((counters.resting_queues, counters.resting_switches), (1, 1))
        self.assertEqual((counters.forgotten_queues, counters.forgotten_switches), (0, 0))
        self.assertTrue(h.balanced())
        h.sched.acquire("c1", "q", "s3")
        self.assertEqual(h.queue()["switches"], 1)
        counters = h.sched.counters()
        self.assertEqual((counters.resting_queues, counters.resting_switches), (0, 0))
        self.assertTrue(h.balanced())
        h.sched.release("q", "s3")
        h.switch("q")
        h.sched.acquire("c1", "q", "s3")
        self.assertEqual(h.queue()["switches"], 2)
        self.assertEqual(h.sched.counters().forgotten_switches, 0)
        self.assertTrue(h.balanced())

    def test_every_way_out(self) -> None:
        """cancel, disconnect and a TTL eviction forget an emptied queue too."""
        h = Harness(forget=True)
        h.sched.acquire("c1", "a", "s1")
        h.sched.acquire("c1", "b", "s1")
        h.sched.acquire("c2", "c", "s2")
        h.sched.acquire("c3", "c", "s3")
        h.sched.cancel("a", "s1")
        self.assertEqual(h.keys(), ["b", "c"])
        h.sched.disconnect("c1")
        self.assertEqual(h.keys(), ["c"])
        h.sched.cancel("c", "s3")
        h.advance_ms(10_000)
        self.assertEqual(h.sched.status(), [])
        self.assertEqual(h.sched.counters().forgotten_queues, 3)

    def test_named_queues_stay(self) -> None:
        """A queue the config names, and a group, stay when empty, with their switches."""
        router = StaticRouter(defaults=ONE, queues={"z": ONE}, groups={"gpu": ("u1",)})
        h = Harness(router, forget=True)
        h.sched.acquire("c1", "z", "s1")
        h.sched.acquire("c2", "z", "s2")
        h.sched.acquire("c1", "u1", "s1")
        h.sched.disconnect("c1")
        h.sched.disconnect("c2")
        self.assertEqual(
            [(q["queueKey"], q["switches"]) for q in h.sched.status()], [("z", 1), ("gpu", 0)]
        )
        self.assertEqual(h.sched.counters().forgotten_queues, 0)

    def test_reload_rests_what_it_no_longer_names(self) -> None:
        """
        An empty queue whose entry a reload removed goes; its switches rest, and the key
        used again resumes from them.
        """
        h = Harness(StaticRouter(defaults=ONE, queues={"z": ONE}), forget=True)
        h.sched.acquire("c1", "z", "s1")
        h.sched.acquire("c2", "z", "s2")
        h.sched.disconnect("c1")
        h.sched.disconnect("c2")
        h.reload(StaticRouter(defaults=ONE))
        self.assertEqual(h.sched.status(), [])
        counters = h.sched.counters()
        self.assertEqual((counters.resting_switches, counters.forgotten_switches), (1, 0))
        h.sched.acquire("c1", "z", "s1")
        self.assertEqual(h.queue("z")["switches"], 1)

    def test_reload_merge_folds_the_merged_queue(self) -> None:
        """A queue merged into a group by a reload is gone: its switches stay counted."""
        h = Harness()
        h.sched.acquire("c1", "u1", "s1")
        h.sched.acquire("c2", "u1", "s2")
        h.sched.release("u1", "s1")
        h.reload(StaticRouter(defaults=ONE, groups={"gpu": ("u1",)}))
        counters = h.sched.counters()
        self.assertEqual(h.keys(), ["gpu"])
        self.assertEqual((counters.forgotten_queues, counters.forgotten_switches), (1, 1))

    def test_reload_merge_ends_a_rest(self) -> None:
        """
        A resting queue whose key a reload puts in a group is merged away like a live one:
        its switches are gone for good, and the key split off again starts from 0.
        """
        h = Harness(forget=True)
        h.switch("u1")
        h.reload(StaticRouter(defaults=ONE, groups={"gpu": ("u1",)}))
        counters = h.sched.counters()
        self.assertEqual((counters.resting_queues, counters.resting_switches), (0, 0))
        self.assertEqual((counters.forgotten_queues, counters.forgotten_switches), (1, 1))
        h.reload(StaticRouter(defaults=ONE))
        h.sched.acquire("c1", "u1", "s1")
        self.assertEqual(h.queue("u1")["switches"], 0)
        self.assertTrue(h.balanced())

    def test_twenty_thousand_keys_leave_nothing(self) -> None:
        """
        20,000 distinct keys acquired and released without a switch leave no queue, nothing
        resting and a short status.
        """
        h = Harness(forget=True)
        for n in range(20_000):
            h.sched.acquire("c", f"k{n}", "s")
            h.sched.release(f"k{n}", "s")
        self.assertEqual(h.sched.status(), [])
        counters = h.sched.counters()
        self.assertEqual((counters.forgotten_queues, counters.resting_queues), (20_000, 0))

    def test_twenty_thousand_switched_keys_stay_bounded(self) -> None:
        """
        20,000 distinct keys, each switched once and left idle, leave no queue and the
        resting table at its cap: the 4,096 most recently rested keep their counters, the
        older ones are gone for good; C{forgotten_switches} never falls on the way.
        """
        h = Harness(forget=True)
        seen = 0
        for n in range(20_000):
            h.switch(f"k{n}")
            forgotten = h.sched.counters().forgotten_switches
            self.assertGreaterEqual(forgotten, seen)
            seen = forgotten
        counters = h.sched.counters()
        self.assertEqual(h.sched.status(), [])
        self.assertEqual((counters.resting_queues, counters.resting_switches), (4_096, 4_096))
        self.assertEqual(RESTING_QUEUES, 4_096)
        self.assertEqual((counters.forgotten_queues, counters.forgotten_switches), (15_904, 15_904))
        self.assertTrue(h.balanced())
        h.sched.acquire("c", "k19999", "s")
        h.sched.acquire("c", "k0", "s")
        self.assertEqual((h.queue("k19999")["switches"], h.queue("k0")["switches"]), (1, 0))

    def test_long_keys_bounded_by_characters(self) -> None:
        """
        Keys as long as a protocol line allows rest within a character budget: eleven keys
        of 100,000 characters leave ten resting, the oldest pushed out; a key over the
        budget alone never rests.
        """
        h = Harness(forget=True)
        keys = [chr(ord("a") + n) * 100_000 for n in range(11)]
        for key in keys:
            h.switch(key)
        counters = h.sched.counters()
        self.assertEqual((counters.resting_queues, counters.forgotten_queues), (10, 1))
        h.sched.acquire("c", keys[0], "s")
        h.sched.acquire("c", keys[1], "s")
        self.assertEqual((h.queue(keys[0])["switches"], h.queue(keys[1])["switches"]), (0, 1))
        h.switch("x" * (RESTING_KEY_CHARS + 1))
        counters = h.sched.counters()
        self.assertEqual((counters.forgotten_queues, counters.forgotten_switches), (2, 2))
        self.assertTrue(h.balanced())

    def test_kept_without_a_keep_rule(self) -> None:
        """A scheduler given no keep rule keeps every queue (as embedders had it)."""
        h = Harness()
        h.sched.acquire("c1", "q", "s1")
        h.sched.release("q", "s1")
        self.assertEqual(h.keys(), ["q"])


class WaitingWatchTests(SynchronousTestCase):
    """
    The waiting watcher hears each queue whose waiters changed, after the operation's
    grants; waiting_since says since when the longest waiter waits.
    """

    def watched(self) -> tuple[Harness, list[str]]:
        """A harness whose watcher's calls are listed, a holder s1 on q and nothing told."""
        h = Harness()
        told: list[str] = []
        h.sched.watch_waiting(told.append)
        h.sched.acquire("c1", "q", "s1")
        return h, told

    def test_holder_alone_untold(self) -> None:
        """A direct grant or a release with nobody waiting changes no waiters."""
        h, told = self.watched()
        h.sched.release("q", "s1")
        self.assertEqual((told, h.sched.waiting_since("q")), ([], None))

    def test_queued(self) -> None:
        """A waiter queued at 2.5 s: q is told once; waiting_since is 2.5 s."""
        h, told = self.watched()
        h.advance_ms(2500)
        h.sched.acquire("c2", "q", "s2")
        h.advance_ms(500)
        h.sched.acquire("c3", "q", "s3")
        self.assertEqual((told, h.sched.waiting_since("q")), (["q", "q"], 2.5))

    def test_granted_after_its_grant(self) -> None:
        """The waiter granted on a release: told after its grant was delivered."""
        h, told = self.watched()
        h.sched.acquire("c2", "q", "s2")
        seen: list[tuple[str, list[str]]] = []
        h.sched.watch_waiting(lambda key: seen.append((key, h.sessions())))
        h.sched.release("q", "s1")
        self.assertEqual(seen, [("q", ["s1", "s2"])])
        self.assertIsNone(h.sched.waiting_since("q"))

    def test_cancelled_and_disconnected(self) -> None:
        """A waiter cancelled, another whose connection went: told each time."""
        h, told = self.watched()
        h.sched.acquire("c2", "q", "s2")
        h.sched.acquire("c3", "q", "s3")
        del told[:]
        h.sched.cancel("q", "s2")
        self.assertEqual((told, h.sched.waiting_since("q")), (["q"], 0.0))
        h.sched.disconnect("c3")
        self.assertEqual((told, h.sched.waiting_since("q")), (["q", "q"], None))

    def test_group_member_key(self) -> None:
        """Asked by a member's key, waiting_since reads the group's queue; told its key."""
        h = Harness(StaticRouter(defaults=ONE, groups={"gpu": ("u1", "u2")}))
        told: list[str] = []
        h.sched.watch_waiting(told.append)
        h.sched.acquire("c1", "u1", "s1")
        h.advance_ms(1000)
        h.sched.acquire("c2", "u2", "s2")
        self.assertEqual((told, h.sched.waiting_since("u1")), (["gpu"], 1.0))

    def test_unwatched(self) -> None:
        """watch_waiting(None) stops the telling."""
        h, told = self.watched()
        h.sched.watch_waiting(None)
        h.sched.acquire("c2", "q", "s2")
        self.assertEqual(told, [])


class SchedulerMachineTests(SynchronousTestCase):
    """Runs the state machine."""

    def test_machine(self) -> None:
        """Random operation sequences keep every scheduler invariant."""
        run_state_machine_as_test(
            SchedulerMachine, settings=settings(max_examples=150, stateful_step_count=60)
        )
