"""
A hypothesis state machine over L{loopd.queue.scheduler.Scheduler}: random acquire, release,
cancel, role, renew, beat, disconnect, reload, sweep and clock steps, with the scheduler's
invariants checked after every step, among them that no counter C{status} or C{counters()}
reports ever falls. L{loopd.test.test_queue_scheduler} runs it, and
L{loopd.test.test_queue_scheduler_index} runs a subclass that also checks the indexes.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
)
from twisted.internet.task import Clock

from loopd.queue.scheduler import Scheduler, SchedulerCounters
from loopd.queue.scheduler_queue import aged
from loopd.queue.scheduler_types import Grant, QueueEvent, QueuePolicy, StaticRouter, Waiter

CONNS = st.sampled_from(["c1", "c2", "c3"])
KEYS = st.sampled_from(["u1", "u2"])
SESSIONS = st.sampled_from(["s1", "s2", "s3", "s4", "s5"])
ROLES = st.sampled_from(["parent", "child"])
POLICIES = st.builds(
    QueuePolicy,
    max_streams=st.integers(1, 3),
    enabled=st.booleans(),
    policy=st.sampled_from(["priority-aging", "fifo"]),
    lease_ttl_ms=st.sampled_from([1_000, 3_000]),
    aging_after_slots=st.integers(0, 3),
    aging_after_ms=st.sampled_from([0, 2_000]),
    idle_yield_ms=st.sampled_from([0, 1_500]),
)
ROUTERS = st.builds(
    StaticRouter,
    defaults=POLICIES,
    queues=st.sampled_from([{}, {"u1": QueuePolicy(max_streams=2, lease_ttl_ms=3_000)}]),
    groups=st.sampled_from([{}, {"gpu": ("u1", "u2")}]),
)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one scheduler and checks its invariants after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.router = StaticRouter(
            defaults=QueuePolicy(
                max_streams=1, lease_ttl_ms=3_000, aging_after_slots=1, aging_after_ms=2_000
            )
        )
        # The daemons' rule: a queue the router does not name is forgotten once empty.
        self.sched = Scheduler(
            self.clock,
            self.router,
            self.on_grant,
            self.on_event,
            keep=lambda key: self.router.names(key),
        )
        self.switches = 0
        self.grants = self.releases = self.evictions = 0
        self.refreshed: dict[tuple[str, str], float] = {}
        self.longest_ttl = 3_000
        self.before: dict[tuple[str, str], Waiter] = {}
        self.over: set[str] = set()
        self.told: set[str] = set()
        self.sched.watch_waiting(self.told.add)
        # the highest switches status showed for each queue key, and the last counters
        self.high: dict[str, int] = {}
        self.last = SchedulerCounters(0, 0, 0, 0)

    def now(self) -> float:
        """The clock in milliseconds."""
        return self.clock.seconds() * 1000.0

    def on_grant(self, grant: Grant) -> None:
        """Record when each lease was last made or refreshed."""
        self.refreshed[(grant.owner_key, grant.session_key)] = self.now()

    def on_event(self, event: QueueEvent) -> None:
        """Count events and check each grant against the queue's order and capacity."""
        queue = self.sched._queues.get(event.queue_key)
        if event.event == "grant":
            self.grants += 1
            assert queue is not None
            if queue.policy.enabled:
                assert len(queue.holders) <= queue.policy.max_streams, "granted past capacity"
        elif event.event == "switch":
            assert queue is not None
            self.switches += 1
            self.check_order(queue, event)
        elif event.event == "release":
            self.releases += 1
        elif event.event == "evict":
            self.evictions += 1
        elif event.event == "config":
            self.over.add(event.queue_key)

    def check_order(self, queue, event: QueueEvent) -> None:
        """A switched-in waiter was first of its tier, and beat parents only by aging."""
        granted = self.before.get((queue.key, str(event.session_key)))
        if granted is None:
            return  # moved in by this step's reload; its order was checked in its old queue
        others = list(queue.waiting.values())
        same_tier = [w for w in others if w.role == granted.role]
        if queue.policy.policy == "fifo":
            assert all(w.seq > granted.seq for w in others), "fifo order broken"
        else:
            assert all(w.seq > granted.seq for w in same_tier), "FIFO within tier broken"
            if granted.role == "child" and any(w.role == "parent" for w in others):
                assert aged(granted, queue.policy, self.now()), "child jumped unaged"
            children = [w for w in others if w.role == "child"]
            if granted.role == "parent" and children:
                first = min(children, key=lambda w: w.seq)
                assert not aged(first, queue.policy, self.now()), "aged child passed over"

    def step(self) -> None:
        """Snapshot the waiters before a scheduler call; nothing told of it yet."""
        self.told.clear()
        self.before = {
            (q.key, w.session_key): w
            for q in self.sched._queues.values()
            for w in q.waiting.values()
        }

    @rule(conn=CONNS, key=KEYS, session=SESSIONS, role=ROLES, activity=st.booleans())
    def acquire(self, conn, key, session, role, activity) -> None:
        """Acquire a slot."""
        self.step()
        self.sched.acquire(conn, key, session, role, None, activity)

    @rule(key=KEYS, session=SESSIONS)
    def release(self, key, session) -> None:
        """Release a slot."""
        self.step()
        self.sched.release(key, session)

    @rule(key=KEYS, session=SESSIONS)
    def cancel(self, key, session) -> None:
        """Cancel a request."""
        self.step()
        self.sched.cancel(key, session)

    @rule(session=SESSIONS, role=ROLES)
    def role(self, session, role) -> None:
        """Re-tier a waiter."""
        self.step()
        self.sched.role(session, role)

    @rule(conn=CONNS)
    def renew(self, conn) -> None:
        """Bare heartbeat."""
        self.step()
        self.sched.renew(conn)
        for q in self.sched._queues.values():
            for lease in q.holders.values():
                if lease.conn == conn:
                    self.refreshed[(q.key, lease.session_key)] = self.now()

    @rule(key=KEYS, session=SESSIONS)
    def beat(self, key, session) -> None:
        """Keyed activity beat."""
        self.step()
        if self.sched.beat(key, session):
            owner = self.router(key).queue_key
            self.refreshed[(owner, session)] = self.now()

    @rule(conn=CONNS)
    def disconnect(self, conn) -> None:
        """Drop a connection."""
        self.step()
        self.sched.disconnect(conn)

    @rule(router=ROUTERS)
    def reload(self, router) -> None:
        """Apply a new policy."""
        self.step()
        self.router = router
        self.longest_ttl = max(self.longest_ttl, router.defaults.lease_ttl_ms)
        self.sched.reload(router)
        # a queue merged into a group is gone for good: its key's count may start again
        self.high = {k: n for k, n in self.high.items() if router(k).queue_key == k}
        # reload moves leases between queues; re-key the refresh record by their new owner
        moved: dict[tuple[str, str], float] = {}
        for q in self.sched._queues.values():
            for lease in q.holders.values():
                old = [t for (k, s), t in self.refreshed.items() if s == lease.session_key]
                moved[(q.key, lease.session_key)] = max(old) if old else self.now()
        self.refreshed = moved

    @rule(ms=st.sampled_from([100, 700, 1_600, 2_500]))
    def advance(self, ms) -> None:
        """Move the clock and sweep."""
        self.clock.advance(ms / 1000.0)
        self.step()
        self.sched.sweep()

    @rule(ms=st.sampled_from([300, 1_200, 3_100]))
    def tick(self, ms) -> None:
        """Move the clock without sweeping: lapsed leases must still not be reported."""
        self.clock.advance(ms / 1000.0)
        self.step()

    @invariant()
    def accounting(self) -> None:
        """grants - releases - evictions = holders; no lapsed lease is reported."""
        status = self.sched.status()
        holders = sum(len(q["holders"]) for q in status)
        assert self.grants - self.releases - self.evictions == holders
        for q in status:
            for h in q["holders"]:
                last = self.refreshed[(q["queueKey"], h["sessionKey"])]
                assert self.now() - last < self.longest_ttl, "lapsed lease reported"

    @invariant()
    def forgetting(self) -> None:
        """
        Every queue status lists has a holder or a waiter or is named; the switches of the
        listed queues, of the resting ones and of those gone for good add up to every switch
        made.
        """
        status = self.sched.status()
        for q in status:
            named = self.router.names(q["queueKey"])
            assert q["holders"] or q["waiting"] or named, "an empty unnamed queue is kept"
            assert q["queueKey"] not in self.sched._resting, "a live queue also rests"
        counters = self.sched.counters()
        listed = sum(q["switches"] for q in status)
        resting, forgotten = counters.resting_switches, counters.forgotten_switches
        assert listed + resting + forgotten == counters.switches == self.switches
        assert counters.resting_queues == len(self.sched._resting)

    @invariant()
    def never_backwards(self) -> None:
        """
        No total of C{counters()} falls but the resting gauges, and no queue's C{switches}
        in C{status} falls, also across its rests (only a reload's merge ends a count).
        """
        counters = self.sched.counters()
        for name in (
            "grants",
            "releases",
            "evictions",
            "switches",
            "forgotten_queues",
            "forgotten_switches",
        ):
            assert getattr(counters, name) >= getattr(self.last, name), f"{name} fell"
        self.last = counters
        for q in self.sched.status():
            key, switches = q["queueKey"], q["switches"]
            assert switches >= self.high.get(key, 0), f"switches of {key} went backwards"
            self.high[key] = switches

    @invariant()
    def waiting_watched(self) -> None:
        """
        Every queue whose waiters changed since the step began was told to the watcher, and
        waiting_since is its longest waiter's enqueue time (None with no waiter).
        """
        before: dict[str, set[str]] = {}
        for key, session in self.before:
            before.setdefault(key, set()).add(session)
        after = {q.key: set(q.waiting) for q in self.sched._queues.values() if q.waiting}
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert changed <= self.told, f"waiters changed untold: {sorted(changed - self.told)}"
        for queue in self.sched._queues.values():
            since = self.sched.waiting_since(queue.key)
            waiters = list(queue.waiting.values())
            oldest = min((w.enqueued_at for w in waiters), default=None)
            assert since == (None if oldest is None else oldest / 1000.0), "waiting_since"

    @invariant()
    def capacity(self) -> None:
        """holders <= maxStreams unless the queue was reported over capacity by a reload."""
        for q in self.sched.status():
            if q["maxStreams"] is not None and len(q["holders"]) <= q["maxStreams"]:
                self.over.discard(q["queueKey"])
            elif q["maxStreams"] is not None:
                assert q["queueKey"] in self.over, "over capacity without a config event"
            if q["maxStreams"] is None:
                assert q["waiting"] == [], "passthrough queue has waiters"

    def teardown(self) -> None:
        """Every waiter is eventually granted once holders stop renewing."""
        for _ in range(40):
            self.clock.advance(10)
            self.sched.sweep()
        assert all(q["waiting"] == [] for q in self.sched.status()), "waiter starved"
