# -*- test-case-name: loopd.test.test_queue_scheduler -*-
"""
The lease scheduler: who holds each queue's slots, who waits, and who is next.

Pure and clock-injected: time comes from C{clock.seconds()} (an C{IReactorTime}, a
C{task.Clock} in tests), grants are delivered to the injected C{on_grant} callback and log
events to C{on_event}; a watcher (L{Scheduler.watch_waiting}) hears which queues' waiters
changed, and L{Scheduler.waiting_since} says since when a queue's longest waiter waits.
The protocol layer calls the public methods and runs L{Scheduler.sweep} on its own timer.

Rules (the seed's, with DESIGN §3 decisions 10 and 20-23):
 - a queue is created on first use; an unknown key gets the defaults;
 - with a C{keep} rule, a queue it does not keep (one the config does not name) is forgotten
   as soon as it has no holder and no waiter, so keys a client invents cost nothing once
   they are idle; its switches rest in a bounded table (L{loopd.queue.scheduler_rest}), and
   a queue created again under its key resumes from them, so no client sees its count fall
   while the key rests there;
 - a grant is a lease whose terms (TTL, idle-yield window) are fixed at grant, except that
   the TTL term only ever grows to the queue's current TTL;
 - waiters are granted by tier (parent over child, FIFO inside a tier); the longest-waiting
   child jumps ahead once it waited C{agingAfterMs}, or after C{agingAfterSlots} consecutive
   parent grants made while it waited; C{policy: "fifo"} ignores tiers;
 - every grant of a queued waiter is a switch; a direct grant into a free slot is not;
 - a lapsed lease is evicted whenever the scheduler is asked anything, so no lapsed lease is
   ever reported; the sweep's second pass yields idle activity-flagged holders to waiters;
 - passthrough (C{enabled: false}) grants at once; a reload never preempts a holder.

No operation scans every queue or every waiter: lapses come off a heap by expiry, each
connection's leases and waiters are indexed, and the next waiter of a queue is the top of
its tier's heap (L{loopd.queue.scheduler_index}, L{loopd.queue.scheduler_queue}).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from loopd.queue.scheduler_index import ConnIndex, LapseHeap
from loopd.queue.scheduler_queue import (
    QueueState,
    by_enqueue,
    by_grant,
    in_grant_order,
    in_order,
    next_waiter,
    status_entries,
)
from loopd.queue.scheduler_rest import Gone, RestingQueues
from loopd.queue.scheduler_types import (
    Clock,
    Grant,
    Keep,
    Lease,
    QueueEvent,
    Route,
    Router,
    SchedulerCounters,
    Tier,
    Waiter,
)

__all__ = ["Clock", "Scheduler", "SchedulerCounters"]


def _ignore(event: QueueEvent) -> None:
    """
    Drop a log event (the default sink).
    """


class Scheduler:
    """
    Every queue's slots, leases and waiters. Not thread-safe; call it from the reactor thread.

    Grants are collected while an operation runs and delivered to C{on_grant} when it ends,
    so a callback that calls back into the scheduler sees a consistent state.
    """

    def __init__(
        self,
        clock: Clock,
        router: Router,
        on_grant: Callable[[Grant], None],
        on_event: Callable[[QueueEvent], None] = _ignore,
        keep: Keep | None = None,
    ) -> None:
        """
        @param clock: the time source (C{seconds()}).
        @param router: resolves a client's queue key to its queue and settings; L{reload}
            replaces it.
        @param on_grant: receives every grant, direct or queued, once per grant.
        @param on_event: receives the seed's log events in order.
        @param keep: which queues stay when empty (asked each time one empties, so it may
            follow a reloaded config); C{None} keeps every queue.
        """
        self._clock = clock
        self._router = router
        self._on_grant = on_grant
        self._on_event = on_event
        self._keep = keep
        self._queues: dict[str, QueueState] = {}
        self._pending: deque[Grant] = deque()
        self._seq = 0
        self._grants = self._releases = self._evictions = self._switches = 0
        self._forgotten_queues = self._forgotten_switches = 0
        self._resting = RestingQueues()
        self._conns = ConnIndex()
        self._lapses = LapseHeap(self._holds)
        self._waiting_watcher: Callable[[str], None] | None = None
        # The queues whose waiters changed in the operation that is running (a dict for order).
        self._waiting_changed: dict[str, None] = {}

    def watch_waiting(self, watcher: Callable[[str], None] | None) -> None:
        """
        Tell C{watcher} the key of each queue whose waiters changed (one queued, granted,
        withdrawn or moved by a reload), once per operation, after its grants are delivered;
        C{None} stops telling.
        """
        self._waiting_watcher = watcher

    def waiting_since(self, queue_key: str) -> float | None:
        """
        Return when the longest-waiting waiter of the queue C{queue_key} leads to was
        enqueued (the clock's seconds), or C{None} when nobody waits there.
        """
        queue = self._queues.get(self._router(queue_key).queue_key)
        if queue is None or not queue.waiting:
            return None
        # C{waiting} is in enqueue order.
        return next(iter(queue.waiting.values())).enqueued_at / 1000.0

    # -- public operations -------------------------------------------------------------

    def acquire(
        self,
        conn: Hashable,
        queue_key: str,
        session_key: str,
        role: Tier = "parent",
        group: str | None = None,
        activity: bool = False,
    ) -> Grant | None:
        """
        Ask for a slot of the queue C{queue_key} owns for C{session_key}.

        Returns the grant when it was made at once (it is also delivered to C{on_grant}), or
        C{None} when the request waits. A session that already holds the slot is granted
        again with its lease refreshed; a session that already waits keeps its place, with
        this request's connection, role, group and activity flag.
        """
        now = self._now()
        self._evict_lapsed(now)
        queue = self._queue(self._router(queue_key))
        grant: Grant | None = None
        lease = queue.holders.get(session_key)
        waiter = queue.waiting.get(session_key)
        if lease is not None:
            self._refresh(queue, lease, now)
            lease.active_at = now
            grant = lease.grant(queue_key, conn)
            self._pending.append(grant)
        elif waiter is not None:
            self._conns.discard(waiter.conn, queue.key, session_key)
            self._conns.add(conn, queue.key, session_key)
            waiter.conn, waiter.queue_key = conn, queue_key
            waiter.group, waiter.activity = group, activity
            queue.retier(waiter, role)
        elif queue.has_room() and not queue.waiting:
            self._conns.add(conn, queue.key, session_key)
            grant = self._grant(queue, conn, queue_key, session_key, role, group, activity, now)
        else:
            self._seq += 1
            waiter = Waiter(conn, queue_key, session_key, role, group, activity, self._seq, now)
            queue.enqueue(waiter)
            self._waiting_changed[queue.key] = None
            self._conns.add(conn, queue.key, session_key)
            self._emit(QueueEvent("queued", queue.key, session_key, role))
        self._flush()
        return grant

    def release(self, queue_key: str, session_key: str) -> None:
        """
        Return C{session_key}'s slot; a lease that is not held changes nothing (§20).
        """
        now = self._now()
        self._evict_lapsed(now)
        queue = self._queues.get(self._router(queue_key).queue_key)
        if queue is not None and session_key in queue.holders:
            self._drop_lease(queue, session_key, None)
            self._fill(queue, now)
            self._settle(queue)
        self._flush()

    def cancel(self, queue_key: str, session_key: str) -> None:
        """
        Drop C{session_key}'s queued request, and release the slot it holds, if any.
        """
        now = self._now()
        self._evict_lapsed(now)
        queue = self._queues.get(self._router(queue_key).queue_key)
        if queue is not None:
            waiter = queue.remove(session_key)
            if waiter is not None:
                self._waiting_changed[queue.key] = None
                self._conns.discard(waiter.conn, queue.key, session_key)
            if session_key in queue.holders:
                self._drop_lease(queue, session_key, "cancel")
            self._fill(queue, now)
            self._settle(queue)
        self._flush()

    def role(self, session_key: str, role: Tier) -> None:
        """
        Re-tier C{session_key}'s live waiters in every queue in place (§21); holders keep the
        tier they were granted with.
        """
        self._evict_lapsed(self._now())
        for queue in self._queues.values():
            waiter = queue.waiting.get(session_key)
            if waiter is not None:
                queue.retier(waiter, role)
        self._flush()

    def renew(self, conn: Hashable) -> None:
        """
        Bare heartbeat: refresh the TTL of every lease C{conn} holds, never its activity (§22).
        """
        now = self._now()
        self._evict_lapsed(now)
        for queue_key, session_key in self._conns.of(conn):
            queue = self._queues[queue_key]
            lease = queue.holders.get(session_key)
            if lease is not None:
                self._refresh(queue, lease, now)
        self._flush()

    def beat(self, queue_key: str, session_key: str) -> bool:
        """
        Keyed activity beat: refresh the lease's TTL and idle clock.

        Returns whether the session still holds the slot; C{False} means it must re-queue.
        """
        now = self._now()
        self._evict_lapsed(now)
        queue = self._queues.get(self._router(queue_key).queue_key)
        lease = None if queue is None else queue.holders.get(session_key)
        if queue is not None and lease is not None:
            self._refresh(queue, lease, now)
            lease.active_at = now
        self._flush()
        return lease is not None

    def disconnect(self, conn: Hashable) -> None:
        """
        Forget C{conn}: drop its queued requests, then release every lease it held.
        """
        now = self._now()
        self._evict_lapsed(now)
        held: dict[str, set[str]] = {}
        touched: set[str] = set()
        for queue_key, session_key in self._conns.of(conn):
            touched.add(queue_key)
            if self._queues[queue_key].remove(session_key) is None:
                held.setdefault(queue_key, set()).add(session_key)
            else:
                self._waiting_changed[queue_key] = None
                self._conns.discard(conn, queue_key, session_key)
        # a queue C{conn} had nothing in is as full as before: no room, or no waiter
        for queue in in_order(self._queues, touched):
            for session_key in in_grant_order(queue, held.get(queue.key, set())):
                self._drop_lease(queue, session_key, "disconnect")
            self._fill(queue, now)
            self._settle(queue)
        self._flush()

    def sweep(self) -> None:
        """
        Run both passes: evict every lapsed lease, then yield idle activity-flagged holders
        of queues with a waiter (ADR 0003).
        """
        now = self._now()
        self._evict_lapsed(now)
        for queue in self._queues.values():
            for lease in list(queue.holders.values()):
                if not queue.waiting:
                    break
                window = lease.idle_yield_ms
                if lease.activity and window > 0 and now - lease.active_at >= window:
                    self._drop_lease(queue, lease.session_key, "idle")
                    self._fill(queue, now)
        self._flush()

    def reload(self, router: Router) -> None:
        """
        Apply a new policy: every lease and waiter moves to the queue its key now leads to
        (groups merge and split), keeping grant and enqueue order. Holders are never
        preempted: a queue left over capacity logs a C{config} event and grants nothing until
        it drains. A lengthened TTL applies to held leases at once, a shortened one at the
        next grant. A session met twice in one merged queue keeps its earlier lease (the
        other is released) or its earlier place; a waiter that meets its own lease is granted.
        A queue merged away, live or resting, is forgotten for good; one left empty and no
        longer kept rests.
        """
        now = self._now()
        self._evict_lapsed(now)
        self._router = router
        old, self._queues = self._queues, {}
        leases = sorted((le for q in old.values() for le in q.holders.values()), key=by_grant)
        waiters = sorted((w for q in old.values() for w in q.waiting.values()), key=by_enqueue)
        for key, queue in old.items():
            queue.clear()
            route = router(key)
            if route.queue_key == key:
                queue.policy = route.settings
                self._queues[key] = queue
        # a resting queue whose key now leads to a group is merged away like a live one
        self._gone(self._resting.drop_where(lambda key: router(key).queue_key != key))
        for lease in leases:
            queue = self._rehome(router(lease.asked_key), old)
            if lease.session_key in queue.holders:
                self._releases += 1
                self._emit(
                    QueueEvent("release", lease.queue_key, lease.session_key, lease.role, "merge")
                )
                continue
            lease.queue_key = queue.key
            lease.ttl_ms = lease.terms().grown(queue.policy.lease_ttl_ms).lease_ttl_ms
            queue.holders[lease.session_key] = lease
        for waiter in waiters:
            queue = self._rehome(router(waiter.queue_key), old)
            held = queue.holders.get(waiter.session_key)
            if held is not None:
                self._pending.append(held.grant(waiter.queue_key, waiter.conn))
            elif waiter.session_key not in queue.waiting:
                queue.enqueue(waiter)
        self._reindex()
        for key in [*old, *self._queues]:
            self._waiting_changed[key] = None
        for queue in self._queues.values():
            limit = queue.policy.max_streams
            if queue.policy.enabled and len(queue.holders) > limit:
                self._emit(
                    QueueEvent(
                        "config",
                        queue.key,
                        reason="over-capacity",
                        holders=len(queue.holders),
                        max_streams=limit,
                    )
                )
            self._fill(queue, now)
        live = {id(queue) for queue in self._queues.values()}
        for queue in old.values():
            if id(queue) not in live:
                self._fold(queue)
        for queue in list(self._queues.values()):
            self._settle(queue)
        self._flush()

    def _reindex(self) -> None:
        """
        Rebuild the connection indexes and the lapse heap after leases and waiters moved.
        """
        self._conns.clear()
        for queue in self._queues.values():
            for lease in queue.holders.values():
                self._conns.add(lease.conn, queue.key, lease.session_key)
            for waiter in queue.waiting.values():
                self._conns.add(waiter.conn, queue.key, waiter.session_key)
        self._lapses.rewatch(le for q in self._queues.values() for le in q.holders.values())

    def _rehome(self, route: Route, old: dict[str, QueueState]) -> QueueState:
        """
        Return the reloaded queue C{route} leads to, reusing the old one of that key.
        """
        queue = self._queues.get(route.queue_key)
        if queue is None:
            queue = old.get(route.queue_key) or self._new_queue(route)
            queue.policy = route.settings
            self._queues[route.queue_key] = queue
        return queue

    def status(self) -> list[dict[str, Any]]:
        """
        Return the C{queues} list of the C{status} reply: per queue C{queueKey},
        C{maxStreams} (C{None} for passthrough), C{switches}, C{holders} and C{waiting} (each
        C{[{sessionKey, role, group}]}, waiters in enqueue order).
        """
        self._evict_lapsed(self._now())
        self._flush()
        return [
            {
                "queueKey": queue.key,
                "maxStreams": queue.policy.max_streams if queue.policy.enabled else None,
                "switches": queue.switches,
                "holders": status_entries(queue.holders.values()),
                "waiting": status_entries(queue.waiting.values()),
            }
            for queue in self._queues.values()
        ]

    def counters(self) -> SchedulerCounters:
        """
        Return the grant, release, eviction and switch totals, those of the queues gone
        for good and those of the resting queues (for C{/metrics}).
        """
        return SchedulerCounters(
            self._grants,
            self._releases,
            self._evictions,
            self._switches,
            self._forgotten_queues,
            self._forgotten_switches,
            len(self._resting),
            self._resting.switches,
        )

    # -- internals ---------------------------------------------------------------------

    def _now(self) -> float:
        """
        Return the clock's time in milliseconds.
        """
        return self._clock.seconds() * 1000.0

    def _queue(self, route: Route) -> QueueState:
        """
        Return the queue C{route} leads to, creating it on first use.
        """
        queue = self._queues.get(route.queue_key)
        if queue is None:
            queue = self._new_queue(route)
            self._queues[route.queue_key] = queue
        return queue

    def _new_queue(self, route: Route) -> QueueState:
        """
        Return a new queue for C{route}, resuming the switches of the queue that rests under
        its key, if one does.
        """
        switches = self._resting.wake(route.queue_key)
        return QueueState(route.queue_key, route.settings, switches=switches)

    def _settle(self, queue: QueueState) -> None:
        """
        Forget C{queue} if it is empty and the keep rule does not keep it: its counters rest.
        """
        if queue.holders or queue.waiting or self._keep is None or self._keep(queue.key):
            return
        if self._queues.get(queue.key) is queue:
            del self._queues[queue.key]
            self._gone(self._resting.rest(queue.key, queue.switches))

    def _fold(self, queue: QueueState) -> None:
        """
        Count a queue merged away by a reload, and its switches, as gone for good.
        """
        self._gone(Gone(1, queue.switches))

    def _gone(self, gone: Gone) -> None:
        """
        Add queues whose counters are gone for good to the forgotten totals.
        """
        self._forgotten_queues += gone.queues
        self._forgotten_switches += gone.switches

    def _holds(self, lease: Lease) -> bool:
        """
        Return whether C{lease} is still held (not released, evicted or merged away).
        """
        queue = self._queues.get(lease.queue_key)
        return queue is not None and queue.holders.get(lease.session_key) is lease

    def _refresh(self, queue: QueueState, lease: Lease, now: float) -> None:
        """
        Restart the lease's TTL on the longer of its term and the queue's current TTL.
        """
        expires_at = lease.expires_at()
        lease.ttl_ms = lease.terms().grown(queue.policy.lease_ttl_ms).lease_ttl_ms
        lease.refreshed_at = now
        if lease.expires_at() != expires_at:
            self._lapses.push(lease, self._grants - self._releases - self._evictions)

    def _grant(
        self,
        queue: QueueState,
        conn: Hashable,
        queue_key: str,
        session_key: str,
        role: Tier,
        group: str | None,
        activity: bool,
        now: float,
        switch: bool = False,
    ) -> Grant:
        """
        Make a lease on the queue's current terms and queue its grant for delivery.
        """
        terms = queue.policy
        lease = Lease(
            conn,
            queue.key,
            queue_key,
            session_key,
            role,
            group,
            activity,
            terms.lease_ttl_ms,
            terms.idle_yield_ms,
            now,
            now,
            now,
        )
        queue.holders[session_key] = lease
        self._grants += 1
        self._lapses.push(lease, self._grants - self._releases - self._evictions)
        self._emit(QueueEvent("grant", queue.key, session_key, role))
        if switch:
            queue.switches += 1
            self._switches += 1
            self._emit(QueueEvent("switch", queue.key, session_key, role))
        queue.granted(role)
        grant = lease.grant(queue_key, conn)
        self._pending.append(grant)
        return grant

    def _fill(self, queue: QueueState, now: float) -> None:
        """
        Grant waiters while the queue has room; each such grant is a switch.
        """
        while queue.waiting and queue.has_room():
            w = next_waiter(queue, now)
            queue.remove(w.session_key)
            self._waiting_changed[queue.key] = None
            self._grant(
                queue, w.conn, w.queue_key, w.session_key, w.role, w.group, w.activity, now, True
            )

    def _drop_lease(self, queue: QueueState, session_key: str, reason: str | None) -> None:
        """
        Remove a held lease and log its release.
        """
        lease = queue.holders.pop(session_key)
        self._conns.discard(lease.conn, queue.key, session_key)
        self._releases += 1
        self._emit(QueueEvent("release", queue.key, session_key, lease.role, reason))

    def _evict_lapsed(self, now: float) -> None:
        """
        The sweep's first pass: evict every lapsed lease, waiter or not, then refill; queue
        by queue in status order, holders in grant order.
        """
        leases = self._lapses.pop_lapsed(now)
        if not leases:
            return
        lapsed: dict[str, set[str]] = {}
        for lease in leases:
            lapsed.setdefault(lease.queue_key, set()).add(lease.session_key)
        for queue in in_order(self._queues, lapsed):
            for session_key in in_grant_order(queue, lapsed[queue.key]):
                lease = queue.holders.pop(session_key)
                self._conns.discard(lease.conn, queue.key, session_key)
                self._evictions += 1
                self._emit(QueueEvent("evict", queue.key, session_key, lease.role, "ttl"))
            self._fill(queue, now)
            self._settle(queue)

    def _emit(self, event: QueueEvent) -> None:
        """
        Hand one log event to the sink.
        """
        self._on_event(event)

    def _flush(self) -> None:
        """
        Deliver the grants made by the operation that is ending, in order, then tell the
        waiting watcher which queues' waiters changed.
        """
        while self._pending:
            self._on_grant(self._pending.popleft())
        while self._waiting_changed:
            key = next(iter(self._waiting_changed))
            del self._waiting_changed[key]
            if self._waiting_watcher is not None:
                self._waiting_watcher(key)
