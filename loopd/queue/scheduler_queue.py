# -*- test-case-name: loopd.test.test_queue_scheduler -*-
"""
One queue's state and the pure rules over it: which waiter a freed slot goes to (tiers,
FIFO inside a tier, aging), and the entries C{status} reports.

Choosing a waiter costs O(log n) amortised in the number of waiters: each tier keeps a heap
of its waiters in enqueue order with lazy deletion (an entry whose waiter is gone or was
re-tiered is skipped when it reaches the top), compacted once it holds more dead entries than
live ones. Aging by slots reads the queue's L{ParentRun}.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

from loopd.queue.scheduler_types import Lease, ParentRun, Settings, Tier, Waiter

__all__ = [
    "QueueState",
    "aged",
    "by_enqueue",
    "by_grant",
    "in_grant_order",
    "in_order",
    "next_waiter",
    "status_entries",
]

#: Dead heap entries tolerated beyond the live ones before the tiers are rebuilt.
_SLACK = 32


def _tiers() -> dict[Tier, list[Waiter]]:
    """
    Return empty tier heaps.
    """
    return {"parent": [], "child": []}


@dataclass
class QueueState:
    """
    One queue's live state: holders in grant order, waiters in enqueue order.

    C{waiting} is read freely but changed only through L{enqueue}, L{retier}, L{remove} and
    L{clear}, which keep the tier heaps and the waiters' streak marks in step.
    """

    key: str
    policy: Settings
    holders: dict[str, Lease] = field(default_factory=dict)
    waiting: dict[str, Waiter] = field(default_factory=dict)
    switches: int = 0
    run: ParentRun = field(default_factory=ParentRun)
    tiers: dict[Tier, list[Waiter]] = field(default_factory=_tiers, repr=False)

    def has_room(self) -> bool:
        """
        Return whether one more session may be granted now.
        """
        return not self.policy.enabled or len(self.holders) < self.policy.max_streams

    def enqueue(self, waiter: Waiter) -> None:
        """
        Add C{waiter} after every waiter already queued (its C{seq} must be the largest),
        keeping the parent streak it counted elsewhere.
        """
        self.waiting[waiter.session_key] = waiter
        waiter.join(self.run)
        heappush(self.tiers[waiter.role], waiter)

    def retier(self, waiter: Waiter, role: Tier) -> None:
        """
        Move a queued C{waiter} to the tier C{role}, keeping its enqueue position.
        """
        if waiter.role != role:
            waiter.role = role
            heappush(self.tiers[role], waiter)
            self._compact()

    def remove(self, session_key: str) -> Waiter | None:
        """
        Drop C{session_key}'s waiter and return it, or C{None} when it does not wait here.
        """
        waiter = self.waiting.pop(session_key, None)
        if waiter is not None:
            waiter.leave()
            self._compact()
        return waiter

    def clear(self) -> None:
        """
        Forget every holder and waiter (a reload re-adds them).
        """
        self.holders, self.waiting, self.tiers = {}, {}, _tiers()

    def granted(self, role: Tier) -> None:
        """
        Count a grant of tier C{role} towards the waiters' parent streaks.
        """
        self.run.granted(role)

    def first(self, role: Tier) -> Waiter | None:
        """
        Return the longest-waiting waiter of tier C{role}, dropping dead entries on the way.
        """
        heap = self.tiers[role]
        while heap:
            waiter = heap[0]
            if waiter.role == role and self.waiting.get(waiter.session_key) is waiter:
                return waiter
            heappop(heap)
        return None

    def _compact(self) -> None:
        """
        Rebuild the tier heaps once dead entries outnumber the live waiters.
        """
        if len(self.tiers["parent"]) + len(self.tiers["child"]) > 2 * len(self.waiting) + _SLACK:
            self.tiers = _tiers()
            # C{waiting} is in enqueue order, so each list is already a heap
            for waiter in self.waiting.values():
                self.tiers[waiter.role].append(waiter)


def aged(waiter: Waiter, policy: Settings, now: float) -> bool:
    """
    Return whether a waiting child has earned the next slot ahead of the parents.
    """
    slots, after_ms = policy.aging_after_slots, policy.aging_after_ms
    if slots > 0 and waiter.parent_streak >= slots:
        return True
    return after_ms > 0 and now - waiter.enqueued_at >= after_ms


def next_waiter(queue: QueueState, now: float) -> Waiter:
    """
    Return the waiter a freed slot of C{queue} goes to (the queue must have a waiter).
    """
    first_child = queue.first("child")
    first_parent = queue.first("parent")
    if queue.policy.policy == "fifo":
        if first_child is None or (first_parent is not None and first_parent.seq < first_child.seq):
            assert first_parent is not None
            return first_parent
        return first_child
    if first_child is not None and aged(first_child, queue.policy, now):
        return first_child
    if first_parent is not None:
        return first_parent
    assert first_child is not None
    return first_child


def in_order(queues: Mapping[str, QueueState], keys: Collection[str]) -> list[QueueState]:
    """
    Return the queues of C{keys} in the order of C{queues}, which is the order C{status}
    lists them; few keys cost little however many queues there are.
    """
    if len(keys) <= 1:
        return [queues[key] for key in keys if key in queues]
    return [queue for key, queue in queues.items() if key in keys]


def in_grant_order(queue: QueueState, session_keys: Collection[str]) -> list[str]:
    """
    Return the holders C{session_keys} of C{queue} in grant order.
    """
    if len(session_keys) <= 1:
        return list(session_keys)
    return [key for key in queue.holders if key in session_keys]


def status_entries(items: Iterable[Lease | Waiter]) -> list[dict[str, Any]]:
    """
    Return the status entries C{{sessionKey, role, group}} of holders or waiters.
    """
    return [{"sessionKey": i.session_key, "role": i.role, "group": i.group} for i in items]


def by_grant(lease: Lease) -> float:
    """
    Sort key: grant time.
    """
    return lease.granted_at


def by_enqueue(waiter: Waiter) -> int:
    """
    Sort key: enqueue order.
    """
    return waiter.seq
