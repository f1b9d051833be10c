# -*- test-case-name: loopd.test.test_queue_scheduler -*-
"""
One queue's state and the pure rules over it: which waiter a freed slot goes to (tiers,
FIFO inside a tier, aging), and the entries C{status} reports.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loopd.queue.scheduler_types import Lease, Settings, Waiter

__all__ = ["QueueState", "aged", "by_enqueue", "by_grant", "next_waiter", "status_entries"]


@dataclass
class QueueState:
    """
    One queue's live state: holders in grant order, waiters in enqueue order.
    """

    key: str
    policy: Settings
    holders: dict[str, Lease] = field(default_factory=dict)
    waiting: dict[str, Waiter] = field(default_factory=dict)
    switches: int = 0

    def has_room(self) -> bool:
        """
        Return whether one more session may be granted now.
        """
        return not self.policy.enabled or len(self.holders) < self.policy.max_streams


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
    waiters = queue.waiting.values()
    if queue.policy.policy == "fifo":
        return next(iter(waiters))
    first_child: Waiter | None = None
    first_parent: Waiter | None = None
    for waiter in waiters:
        if waiter.role == "child" and first_child is None:
            first_child = waiter
        elif waiter.role == "parent" and first_parent is None:
            first_parent = waiter
        if first_child is not None and first_parent is not None:
            break
    if first_child is not None and aged(first_child, queue.policy, now):
        return first_child
    if first_parent is not None:
        return first_parent
    assert first_child is not None
    return first_child


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
