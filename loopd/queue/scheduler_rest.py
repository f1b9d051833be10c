# -*- test-case-name: loopd.test.test_queue_scheduler_rest -*-
"""
The counters of queues at rest: what a forgotten queue had counted, kept so that a queue
created again under its key resumes from it, and a client watching C{status} never sees its
C{switches} go backwards.

The scheduler forgets a queue the config does not name once it has no holder and no waiter
(so keys a client invents cost nothing once idle), and puts its counters here. The table is
bounded: at most L{RESTING_QUEUES} entries whose keys hold at most L{RESTING_KEY_CHARS}
characters between them (a key may be as long as a protocol line, 100 KB), the least
recently rested entry pushed out first. A queue with nothing to keep (no switch) is not kept
at all, nor is one whose key alone is over the character budget. What leaves the table, or is
never put in it, is gone for good: L{rest} and L{drop_where} return it as a L{Gone}, which
the scheduler adds to its forgotten totals.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RESTING_KEY_CHARS", "RESTING_QUEUES", "Gone", "RestingQueues"]

#: The most queues whose counters rest at once.
RESTING_QUEUES = 4_096

#: The most characters the keys of the resting queues hold between them (1 Mi).
RESTING_KEY_CHARS = 1_048_576


@dataclass(frozen=True)
class Gone:
    """
    Queues whose counters are gone for good, and the switches they had counted.
    """

    queues: int = 0
    switches: int = 0

    def __add__(self, other: Gone) -> Gone:
        """
        Return both counts together.
        """
        return Gone(self.queues + other.queues, self.switches + other.switches)


class RestingQueues:
    """
    Queue key -> the switches of the forgotten queue of that key, least recently rested first.

    C{switches} is the sum of the resting switches, so the scheduler's accounting reads it
    without a scan, and C{key_chars} the characters their keys hold between them.
    """

    def __init__(
        self, max_queues: int = RESTING_QUEUES, max_key_chars: int = RESTING_KEY_CHARS
    ) -> None:
        """
        @param max_queues: the most entries kept.
        @param max_key_chars: the most characters their keys hold between them.
        """
        self._max_queues = max_queues
        self._max_key_chars = max_key_chars
        self._table: OrderedDict[str, int] = OrderedDict()
        self.key_chars = 0
        self.switches = 0

    def __len__(self) -> int:
        """
        Return the number of resting queues.
        """
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        """
        Return whether the queue C{key} rests here.
        """
        return key in self._table

    def rest(self, key: str, switches: int) -> Gone:
        """
        Keep the counters of the forgotten queue C{key}, pushing out the least recently
        rested entries while the table is over either bound.

        Return what is gone for good: the entries pushed out, or this queue itself when it
        has nothing to keep (no switch) or its key alone is over the character budget.
        """
        gone = Gone()
        if key in self._table:
            # Not reached by the scheduler, which wakes a key before it makes its queue.
            gone += Gone(1, self.wake(key))
        if switches == 0 or len(key) > self._max_key_chars:
            return gone + Gone(1, switches)
        self._table[key] = switches
        self.key_chars += len(key)
        self.switches += switches
        while len(self._table) > self._max_queues or self.key_chars > self._max_key_chars:
            old_key, old = self._table.popitem(last=False)
            self.key_chars -= len(old_key)
            self.switches -= old
            gone += Gone(1, old)
        return gone

    def wake(self, key: str) -> int:
        """
        Take the queue C{key} out of the table, returning the switches it resumes from (0
        when it does not rest here).
        """
        switches = self._table.pop(key, 0)
        if switches:
            self.key_chars -= len(key)
            self.switches -= switches
        return switches

    def drop_where(self, leaves: Callable[[str], bool]) -> Gone:
        """
        Forget for good every resting queue whose key C{leaves} picks (the keys a reload
        merged into a group), returning what went.
        """
        gone = Gone()
        for key in [key for key in self._table if leaves(key)]:
            gone += Gone(1, self.wake(key))
        return gone
