# -*- test-case-name: loopd.test.test_queue_scheduler_index -*-
"""
The lease scheduler's indexes, so that no operation scans every queue: which leases and
waiters each connection has (L{ConnIndex}), and which lease lapses next (L{LapseHeap}).

Both are pure bookkeeping; the scheduler keeps them in step with its queues.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from heapq import heapify, heappop, heappush

from loopd.queue.scheduler_types import Lease

__all__ = ["ConnIndex", "LapseHeap"]

#: Superseded heap entries tolerated beyond the live leases before the heap is rebuilt.
_SLACK = 64


class ConnIndex:
    """
    Connection -> the C{(owner queue key, session key)} pairs it holds or waits for.

    A session is either a holder or a waiter of a queue, never both, so one index serves
    both; a waiter's pair stays when it is granted, as its lease is held by the same
    connection.
    """

    def __init__(self) -> None:
        """
        Start empty.
        """
        # conn -> queue key -> session keys: no tuple per pair, as there is one per waiter
        self._of: dict[Hashable, dict[str, set[str]]] = {}

    def add(self, conn: Hashable, queue_key: str, session_key: str) -> None:
        """
        Record that C{conn} has C{session_key} in the queue C{queue_key}.
        """
        queues = self._of.get(conn)
        if queues is None:
            queues = self._of[conn] = {}
        keys = queues.get(queue_key)
        if keys is None:
            keys = queues[queue_key] = set()
        keys.add(session_key)

    def discard(self, conn: Hashable, queue_key: str, session_key: str) -> None:
        """
        Forget one pair of C{conn}'s, if recorded; a connection left with none is dropped.
        """
        queues = self._of.get(conn)
        keys = None if queues is None else queues.get(queue_key)
        if queues is not None and keys is not None:
            keys.discard(session_key)
            if not keys:
                del queues[queue_key]
                if not queues:
                    del self._of[conn]

    def of(self, conn: Hashable) -> list[tuple[str, str]]:
        """
        Return C{conn}'s pairs, in no particular order.
        """
        queues = self._of.get(conn, {})
        return [(queue_key, key) for queue_key, keys in queues.items() for key in keys]

    def clear(self) -> None:
        """
        Forget everything.
        """
        self._of.clear()


class LapseHeap:
    """
    Held leases by expiry, so finding the lapsed ones costs nothing while none has lapsed.

    Every time a held lease's expiry changes the scheduler L{push}es it again; a refresh only
    moves an expiry later, so an entry whose lease has gone, or now expires later than the
    entry says, is stale and is skipped when it reaches the top. The heap is rebuilt from its
    current entries once stale ones outnumber the live leases.
    """

    def __init__(self, held: Callable[[Lease], bool]) -> None:
        """
        @param held: whether a lease is still held (released and evicted ones are not).
        """
        self._held = held
        self._heap: list[tuple[float, int, Lease]] = []
        self._seq = 0

    def push(self, lease: Lease, live: int) -> None:
        """
        Watch C{lease} at its current expiry; C{live} is the number of held leases.
        """
        self._seq += 1
        heappush(self._heap, (lease.expires_at(), self._seq, lease))
        if len(self._heap) > 2 * live + _SLACK:
            self._rebuild()

    def pop_lapsed(self, now: float) -> list[Lease]:
        """
        Remove and return every held lease that has lapsed at C{now}, each once.
        """
        heap = self._heap
        if not heap or heap[0][0] > now:
            return []
        lapsed: dict[int, Lease] = {}
        while heap and heap[0][0] <= now:
            lease = heappop(heap)[2]
            if lease.expires_at() <= now and self._held(lease):
                lapsed[id(lease)] = lease
        return list(lapsed.values())

    def _rebuild(self) -> None:
        """
        Keep one entry per held lease, the one at its current expiry.
        """
        current: dict[int, tuple[float, int, Lease]] = {}
        for entry in self._heap:
            lease = entry[2]
            if entry[0] == lease.expires_at() and self._held(lease):
                current[id(lease)] = entry
        self._heap = list(current.values())
        heapify(self._heap)

    def rewatch(self, leases: Iterable[Lease]) -> None:
        """
        Replace every entry by one per lease of C{leases}, at its current expiry.
        """
        self._heap = []
        for lease in leases:
            self._seq += 1
            self._heap.append((lease.expires_at(), self._seq, lease))
        heapify(self._heap)

    def __len__(self) -> int:
        """
        Return the number of entries, stale ones included.
        """
        return len(self._heap)
