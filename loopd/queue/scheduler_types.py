# -*- test-case-name: loopd.test.test_queue_scheduler -*-
"""
The values the lease scheduler reads and hands out: queue policy, grants, log events, and the
lease and waiter records it keeps.

Times inside the scheduler are monotonic milliseconds taken from the injected clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from loopd.queue.terms import LeaseTerms

__all__ = [
    "Clock",
    "EventName",
    "Grant",
    "Keep",
    "Lease",
    "ParentRun",
    "QueueEvent",
    "QueuePolicy",
    "Route",
    "Router",
    "SchedulerCounters",
    "Settings",
    "StaticRoute",
    "StaticRouter",
    "Tier",
    "Waiter",
]

Tier = Literal["parent", "child"]
EventName = Literal["grant", "switch", "queued", "release", "evict", "config"]


class Clock(Protocol):
    """
    The part of C{IReactorTime} the scheduler reads.
    """

    def seconds(self) -> float:
        """
        Return the current time in seconds.
        """


@dataclass(frozen=True)
class SchedulerCounters:
    """
    Totals since the scheduler started: C{grants - releases - evictions} is the holder count.

    A queue the config does not name is dropped once it has no holder and no waiter; its
    counters then rest (L{loopd.queue.scheduler_rest}), and a queue created again under its
    key resumes from them. C{resting_queues} and C{resting_switches} are the queues resting
    now and their switches: gauges, which fall when a queue resumes or leaves the table.
    C{forgotten_queues} counts the queues whose counters are gone for good, and
    C{forgotten_switches} their switches: a dropped queue with no switch (nothing to keep),
    one pushed out of the resting table (or whose key alone is over its character budget),
    and a queue, live or resting, that a reload merged into another. Both only ever grow,
    since counters that are gone for good never come back. So at every moment::

        sum of the live queues' switches + resting_switches + forgotten_switches == switches

    and a live queue's C{switches} never falls while its key rests between uses, only when
    its counters were gone for good before the key came back.
    """

    grants: int
    releases: int
    evictions: int
    switches: int
    forgotten_queues: int = 0
    forgotten_switches: int = 0
    resting_queues: int = 0
    resting_switches: int = 0


@dataclass(frozen=True)
class QueuePolicy:
    """
    One queue's resolved policy, in the seed's units (milliseconds).

    C{enabled=False} is passthrough: every acquire is granted at once. C{policy="fifo"}
    ignores tiers; C{"priority-aging"} grants parents first with aging for children. An aging
    threshold of 0 disables that kind of aging; C{idle_yield_ms=0} disables idle yield.
    """

    max_streams: int = 1
    enabled: bool = True
    policy: str = "priority-aging"
    lease_ttl_ms: int = 30_000
    aging_after_slots: int = 3
    aging_after_ms: int = 60_000
    idle_yield_ms: int = 30_000


class Settings(Protocol):
    """
    One queue's settings as the scheduler reads them; C{loopd.queue.policy.QueueSettings}
    and L{QueuePolicy} both fit.
    """

    @property
    def max_streams(self) -> int:
        """The slot count (ignored while not C{enabled})."""

    @property
    def enabled(self) -> bool:
        """False is passthrough."""

    @property
    def policy(self) -> str:
        """C{"priority-aging"} or C{"fifo"}."""

    @property
    def lease_ttl_ms(self) -> int:
        """The TTL a new lease is granted with."""

    @property
    def aging_after_slots(self) -> int:
        """Consecutive parent grants after which a waiting child goes next (0: never)."""

    @property
    def aging_after_ms(self) -> int:
        """A child's wait after which it goes next (0: never)."""

    @property
    def idle_yield_ms(self) -> int:
        """The idle-yield window a new lease is granted with (0: never yielded)."""


class Route(Protocol):
    """
    Where a client's queue key leads: the queue owning its slots, and that queue's settings.
    C{loopd.queue.policy.Route} fits.
    """

    @property
    def queue_key(self) -> str:
        """The owning queue's key (a group's name for a member key)."""

    @property
    def settings(self) -> Settings:
        """The owning queue's settings."""


Router = Callable[[str], Route]
"""Resolves a client's queue key; C{loopd.queue.policy.address_endpoint} curried fits."""

Keep = Callable[[str], bool]
"""Whether a queue (by its owner key) stays when it has no holder and no waiter: the queues
the config names do, the others are forgotten."""


@dataclass(frozen=True)
class StaticRoute:
    """
    A L{Route} value.
    """

    queue_key: str
    settings: QueuePolicy


@dataclass(frozen=True)
class StaticRouter:
    """
    A small L{Router}: per-key policies over C{defaults}, and merge groups (C{groups} maps a
    group name to the keys it owns; the first group naming a key owns it).

    A key with no entry gets a queue with the defaults (DESIGN §10).
    """

    defaults: QueuePolicy = QueuePolicy()
    queues: Mapping[str, QueuePolicy] = field(default_factory=dict)
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __call__(self, queue_key: str) -> StaticRoute:
        """
        Return the route of C{queue_key}.
        """
        owner = next((g for g, keys in self.groups.items() if queue_key in keys), queue_key)
        return StaticRoute(owner, self.queues.get(owner, self.defaults))

    def names(self, queue_key: str) -> bool:
        """
        Return whether C{queue_key} is a queue this router names (an entry or a group): a
        L{Keep} rule.
        """
        return queue_key in self.queues or queue_key in self.groups


@dataclass(frozen=True)
class Grant:
    """
    A lease handed to a session: what the protocol layer turns into a C{granted} reply.

    C{queue_key} is the key the client asked with (replies are keyed by it);
    C{owner_key} is the queue that owns the slot. C{lease_ttl_ms} and C{idle_yield_ms} are the
    lease's terms.
    """

    conn: Hashable
    queue_key: str
    owner_key: str
    session_key: str
    lease_ttl_ms: int
    idle_yield_ms: int

    def terms(self) -> LeaseTerms:
        """
        Return the lease's terms.
        """
        return LeaseTerms(self.lease_ttl_ms, self.idle_yield_ms)


@dataclass(frozen=True)
class QueueEvent:
    """
    One scheduler event in the seed's log vocabulary (C{grant}, C{switch}, C{queued},
    C{release}, C{evict}, C{config}); the log writer adds C{ts}.
    """

    event: EventName
    queue_key: str
    session_key: str | None = None
    role: Tier | None = None
    reason: str | None = None
    holders: int | None = None
    max_streams: int | None = None


@dataclass
class Lease:
    """
    A held slot of the queue C{queue_key}, acquired with the key C{asked_key}. Its clocks
    start at its grant; C{ttl_ms} is its term, which only grows.
    """

    conn: Hashable
    queue_key: str
    asked_key: str
    session_key: str
    role: Tier
    group: str | None
    activity: bool
    ttl_ms: int
    idle_yield_ms: int
    granted_at: float
    refreshed_at: float
    active_at: float

    def expires_at(self) -> float:
        """
        Return the monotonic millisecond at which this lease lapses.
        """
        return self.refreshed_at + self.ttl_ms

    def terms(self) -> LeaseTerms:
        """
        Return the terms this lease is held under.
        """
        return LeaseTerms(self.ttl_ms, self.idle_yield_ms)

    def grant(self, queue_key: str, conn: Hashable) -> Grant:
        """
        Return the grant of this lease and its terms for C{conn}, keyed by the key it used.
        """
        return Grant(
            conn, queue_key, self.queue_key, self.session_key, self.ttl_ms, self.idle_yield_ms
        )


@dataclass
class ParentRun:
    """
    A queue's run of consecutive parent grants, for aging by slots: C{length} parent grants
    since the last child grant, which started run number C{epoch}.

    A waiter keeps a mark into its queue's run instead of a count of its own, so a grant
    costs the same whatever the number of waiters.
    """

    epoch: int = 0
    length: int = 0

    def granted(self, role: Tier) -> None:
        """
        Count a grant: a parent lengthens the run, a child ends it.
        """
        if role == "parent":
            self.length += 1
        else:
            self.epoch += 1
            self.length = 0

    def streak(self, epoch: int, base: int) -> int:
        """
        Return the consecutive parent grants since the mark C{(epoch, base)} was taken (or
        since the run that follows it began, when a child grant came between).
        """
        return self.length - base if epoch == self.epoch else self.length


@dataclass(slots=True)
class Waiter:
    """
    A queued C{acquire}, with the key it asked with. C{seq} is its enqueue order, and
    waiters order by it (C{<}), so a heap of them yields the longest-waiting first.

    While queued it follows its queue's C{run}, marked at C{(run_epoch, run_base)}; out of
    a queue (C{run} is C{None}) C{run_base} is its streak. Its queue sets them
    (L{loopd.queue.scheduler_queue.QueueState.enqueue}); change C{role} through the queue's
    C{retier}, which keeps the tiers in step.
    """

    conn: Hashable
    queue_key: str
    session_key: str
    role: Tier
    group: str | None
    activity: bool
    seq: int
    enqueued_at: float
    run: ParentRun | None = field(default=None, repr=False, compare=False)
    run_epoch: int = 0
    run_base: int = 0

    def __lt__(self, other: Waiter) -> bool:
        """
        Return whether this waiter queued before C{other}.
        """
        return self.seq < other.seq

    @property
    def parent_streak(self) -> int:
        """
        The consecutive parent grants made while it waited (aging by slots).
        """
        run = self.run
        if run is None:
            return self.run_base
        return run.streak(self.run_epoch, self.run_base)

    def join(self, run: ParentRun) -> None:
        """
        Follow C{run} from now on, keeping the streak counted so far.
        """
        streak = self.parent_streak
        self.run, self.run_epoch, self.run_base = run, run.epoch, run.length - streak

    def leave(self) -> None:
        """
        Stop following the queue's run: the streak stays what it is now.
        """
        self.run, self.run_epoch, self.run_base = None, 0, self.parent_streak
