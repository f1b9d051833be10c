"""
Tests for the lease scheduler's indexes (L{loopd.queue.scheduler_index}), its tier heaps and
parent runs (L{loopd.queue.scheduler_queue}, L{loopd.queue.scheduler_types}): they give the
answers a scan of every queue would, stay bounded, and keep the rules' order.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_index import ConnIndex, LapseHeap
from loopd.queue.scheduler_queue import QueueState, next_waiter
from loopd.queue.scheduler_types import (
    Grant,
    Lease,
    ParentRun,
    QueueEvent,
    QueuePolicy,
    StaticRouter,
    Waiter,
)
from loopd.test.support.scheduler_machine import SchedulerMachine

ONE = QueuePolicy(max_streams=1, lease_ttl_ms=10_000, idle_yield_ms=4_000)


def lease(session_key: str, refreshed_at: float = 0.0, ttl_ms: int = 1_000) -> Lease:
    """A parent lease of queue q."""
    return Lease(
        "c", "q", "q", session_key, "parent", None, False, ttl_ms, 0, 0.0, refreshed_at, 0.0
    )


def waiter(session_key: str, seq: int, role: str = "parent") -> Waiter:
    """A waiter of queue q."""
    return Waiter("c", "q", session_key, role, None, False, seq, 0.0)  # type: ignore[arg-type]


class ConnIndexTests(SynchronousTestCase):
    """ConnIndex bookkeeping."""

    def test_add_and_discard(self) -> None:
        """Pairs are recorded per connection and forgotten one by one."""
        index = ConnIndex()
        index.add("c", "q", "a")
        index.add("c", "r", "b")
        index.add("d", "q", "x")
        index.discard("c", "q", "a")
        index.discard("c", "q", "never")
        self.assertEqual((index.of("c"), index.of("d")), ([("r", "b")], [("q", "x")]))

    def test_empty_connection_is_dropped(self) -> None:
        """A connection left with nothing takes no room, and asking about it finds nothing."""
        index = ConnIndex()
        index.add("c", "q", "a")
        index.discard("c", "q", "a")
        self.assertEqual((index._of, index.of("c")), ({}, []))


class LapseHeapTests(SynchronousTestCase):
    """LapseHeap: lazy deletion and compaction."""

    def test_pops_lapsed_once(self) -> None:
        """A lapsed lease pushed twice at its expiry is returned once; later ones stay."""
        held = {"a": lease("a"), "b": lease("b", ttl_ms=5_000)}
        heap = LapseHeap(lambda le: held.get(le.session_key) is le)
        for item in [held["a"], held["a"], held["b"]]:
            heap.push(item, len(held))
        self.assertEqual(heap.pop_lapsed(999.0), [])
        self.assertEqual(heap.pop_lapsed(1_000.0), [held["a"]])
        self.assertEqual(heap.pop_lapsed(1_000.0), [])

    def test_skips_refreshed_and_gone(self) -> None:
        """An entry whose lease was refreshed later, or is no longer held, is skipped."""
        held = {"a": lease("a"), "b": lease("b")}
        heap = LapseHeap(lambda le: held.get(le.session_key) is le)
        heap.push(held["a"], 2)
        heap.push(held["b"], 2)
        held["a"].refreshed_at = 500.0
        heap.push(held["a"], 2)
        del held["b"]
        self.assertEqual(heap.pop_lapsed(1_200.0), [])
        self.assertEqual(heap.pop_lapsed(1_500.0), [lease("a", 500.0)])

    def test_stays_bounded(self) -> None:
        """Entries of released leases are dropped once they outnumber the held ones."""
        held: dict[str, Lease] = {}
        heap = LapseHeap(lambda le: held.get(le.session_key) is le)
        for i in range(10_000):
            held = {"x": lease(f"s{i}")}
            heap.push(held["x"], 1)
        self.assertLessEqual(len(heap), 2 * 1 + 64)

    def test_rewatch_replaces_entries(self) -> None:
        """rewatch keeps exactly one entry per given lease."""
        kept = lease("a")
        heap = LapseHeap(lambda le: True)
        heap.push(lease("b"), 2)
        heap.rewatch([kept])
        self.assertEqual((len(heap), heap.pop_lapsed(1_000.0)), (1, [kept]))


class ParentRunTests(SynchronousTestCase):
    """Aging by slots read from the queue's run of parent grants."""

    def test_streak_counts_parent_grants_since_enqueue(self) -> None:
        """A waiter counts the parent grants made after it joined, until a child grant."""
        run = ParentRun()
        run.granted("parent")
        w = waiter("w", 1)
        w.join(run)
        run.granted("parent")
        run.granted("parent")
        self.assertEqual(w.parent_streak, 2)
        run.granted("child")
        self.assertEqual(w.parent_streak, 0)
        run.granted("parent")
        self.assertEqual(w.parent_streak, 1)

    def test_streak_survives_moves_and_freezes_on_leave(self) -> None:
        """A waiter moved to another run keeps its count; one that left stops counting."""
        first, second = ParentRun(), ParentRun()
        w = waiter("w", 1)
        w.join(first)
        first.granted("parent")
        w.join(second)
        second.granted("parent")
        self.assertEqual(w.parent_streak, 2)
        w.leave()
        second.granted("parent")
        self.assertEqual((w.parent_streak, w.run), (2, None))


class TierTests(SynchronousTestCase):
    """QueueState's tier heaps."""

    def test_retier_keeps_position(self) -> None:
        """A waiter moved to the other tier is first of it when it queued first."""
        queue = QueueState("q", QueuePolicy(aging_after_ms=0, aging_after_slots=0))
        for seq, key in enumerate(["a", "b", "c"], 1):
            queue.enqueue(waiter(key, seq, "child"))
        queue.enqueue(waiter("p", 4))
        queue.retier(queue.waiting["b"], "parent")
        self.assertEqual(next_waiter(queue, 0.0).session_key, "b")
        queue.remove("b")
        self.assertEqual(next_waiter(queue, 0.0).session_key, "p")

    def test_heaps_stay_bounded(self) -> None:
        """Dead entries of removed and re-tiered waiters do not accumulate."""
        queue = QueueState("q", QueuePolicy())
        queue.enqueue(waiter("keep", 0))
        for seq in range(1, 5_000):
            queue.enqueue(waiter(f"s{seq}", seq))
            queue.retier(queue.waiting[f"s{seq}"], "child")
            queue.retier(queue.waiting[f"s{seq}"], "parent")
            queue.remove(f"s{seq}")
        size = len(queue.tiers["parent"]) + len(queue.tiers["child"])
        self.assertLessEqual(size, 2 * len(queue.waiting) + 32)
        self.assertEqual(next_waiter(queue, 0.0).session_key, "keep")


class Harness:
    """A scheduler on a C{task.Clock} recording its events."""

    def __init__(self, router: StaticRouter) -> None:
        self.clock = Clock()
        self.events: list[QueueEvent] = []
        self.grants: list[Grant] = []
        self.sched = Scheduler(self.clock, router, self.grants.append, self.events.append)

    def evicted(self) -> list[str | None]:
        """Evicted session keys in event order."""
        return [e.session_key for e in self.events if e.event == "evict"]


class OrderTests(SynchronousTestCase):
    """Work found through the indexes is done in status and grant order."""

    def test_evictions_in_status_order(self) -> None:
        """Leases lapsing together are evicted queue by queue, not by expiry."""
        h = Harness(StaticRouter(defaults=ONE))
        h.sched.acquire("c", "q", "a")
        h.sched.acquire("c", "r", "b")
        h.clock.advance(1)
        h.sched.beat("q", "a")
        h.clock.advance(11)
        h.sched.sweep()
        self.assertEqual(h.evicted(), ["a", "b"])

    def test_evictions_in_grant_order(self) -> None:
        """Leases of one queue lapsing together are evicted in grant order."""
        h = Harness(StaticRouter(defaults=QueuePolicy(max_streams=3, lease_ttl_ms=10_000)))
        for session_key in ("a", "b", "c"):
            h.sched.acquire("c", "q", session_key)
        h.clock.advance(1)
        h.sched.beat("q", "a")
        h.clock.advance(11)
        h.sched.status()
        self.assertEqual(h.evicted(), ["a", "b", "c"])

    def test_disconnect_in_status_order(self) -> None:
        """A disconnect releases queue by queue in status order, each refilled in turn."""
        h = Harness(StaticRouter(defaults=ONE))
        h.sched.acquire("d", "q", "x")
        h.sched.acquire("c", "r", "b")
        h.sched.acquire("c", "q", "a")
        h.sched.acquire("d", "r", "y")
        h.sched.release("q", "x")
        h.sched.disconnect("c")
        self.assertEqual(
            [(e.event, e.session_key) for e in h.events[-4:]],
            [("release", "a"), ("release", "b"), ("grant", "y"), ("switch", "y")],
        )

    def test_reacquire_moves_waiter_to_new_conn(self) -> None:
        """A waiter re-queued from a new connection goes with it, not with the old one."""
        h = Harness(StaticRouter(defaults=ONE))
        h.sched.acquire("h", "q", "h")
        h.sched.acquire("old", "q", "w")
        h.sched.acquire("new", "q", "w")
        h.sched.disconnect("old")
        h.sched.release("q", "h")
        self.assertEqual(h.grants[-1].conn, "new")
        h.sched.disconnect("new")
        self.assertEqual(h.sched.status()[0]["holders"], [])

    def test_renew_after_reload_follows_moved_lease(self) -> None:
        """A bare renew refreshes a lease a reload moved into a group."""
        h = Harness(StaticRouter(defaults=ONE))
        h.sched.acquire("c", "u1", "a")
        h.sched.reload(StaticRouter(defaults=ONE, groups={"gpu": ("u1", "u2")}))
        h.clock.advance(9)
        h.sched.renew("c")
        h.clock.advance(9)
        self.assertEqual(h.sched.status()[0]["holders"][0]["sessionKey"], "a")
        h.clock.advance(1)
        self.assertEqual(h.sched.status()[0]["holders"], [])


class IndexedMachine(SchedulerMachine):
    """The scheduler machine, also checking the indexes and streaks against scans."""

    def __init__(self) -> None:
        super().__init__()
        self.streaks: dict[int, int] = {}

    def on_event(self, event: QueueEvent) -> None:
        """Keep each waiter's parent streak the way the rule states it, by a loop."""
        super().on_event(event)
        queue = self.sched._queues.get(event.queue_key)
        if queue is None:
            return  # a release by a reload's merge: the queue is being rebuilt
        if event.event == "queued":
            self.streaks[queue.waiting[str(event.session_key)].seq] = 0
        elif event.event == "grant":
            for w in queue.waiting.values():
                self.streaks[w.seq] = self.streaks[w.seq] + 1 if event.role == "parent" else 0

    @invariant()
    def streaks_match(self) -> None:
        """Every waiter's parent streak is the count of the loop."""
        for queue in self.sched._queues.values():
            for w in queue.waiting.values():
                assert w.parent_streak == self.streaks[w.seq], "parent streak drifted"

    @invariant()
    def index_matches(self) -> None:
        """Each connection's indexed leases and waiters are those a scan finds."""
        for conn in ("c1", "c2", "c3"):
            found = {
                (q.key, le.session_key)
                for q in self.sched._queues.values()
                for le in q.holders.values()
                if le.conn == conn
            } | {
                (q.key, w.session_key)
                for q in self.sched._queues.values()
                for w in q.waiting.values()
                if w.conn == conn
            }
            assert set(self.sched._conns.of(conn)) == found, "connection index drifted"


class IndexedMachineTests(SynchronousTestCase):
    """Runs the indexed state machine."""

    def test_machine(self) -> None:
        """Random operation sequences keep the indexes and streaks equal to scans."""
        run_state_machine_as_test(
            IndexedMachine, settings=settings(max_examples=150, stateful_step_count=60)
        )
