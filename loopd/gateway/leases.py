# -*- test-case-name: loopd.test.test_gateway_leases -*-
"""
Gateway requests as lease holders of the shared scheduler (DESIGN §3 decision 16).

Each chat request takes a lease on its endpoint's queue for its session before it goes
upstream, competing with the leases outside clients take over the lease socket. A session's
lease outlives its request by a grace, so its next turn starts without a switch and finds its
slot's KV cache warm, but only while the grace is worth its cost (decision 37,
L{loopd.gateway.grace}): while nobody waits for the queue, the grace lasts C{[queue]
grace_ms}; while a request waits (the gateway's own or an outside client's), it ends once the
slot has idled beside the longest waiter (from the later of the grace's start and the
wait's) for the holder's expected re-prefill time, learned per endpoint from the
completions the gateway accounts (L{GatewayLeases.observe}). The release is rescheduled
whenever the queue's waiters change; the freed slot goes to the waiter the scheduler's tiers
and aging choose. Concurrent requests of one session share its lease; the grace starts when
the last of them ends. The gateway's session key is that of one conversation of a session
(decision 45, L{loopd.gateway.sessions}): a side conversation holds a lease of its own, so
its grace holds its own slot and never the main conversation's. A session that is gone
(L{GatewayLeases.end}: an anonymous session whose connection closed) has no grace.

While a request runs its lease gets keyed activity beats on the lease's own terms; during the
grace it gets bare TTL refreshes only, so an idle-yield window shorter than the grace can hand
the slot to a waiter early. A beat answered "not held" (the lease was cancelled from outside,
or yielded) drops the record: the running request finishes (no preemption) and the session's
next request queues afresh.

Timers go through the injected reactor; no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from loopd.gateway.grace import SwitchCosts, release_at
from loopd.llama.info import CacheOutcome
from loopd.llama.types import Timings
from loopd.queue.protocol import deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import Grant, Tier
from loopd.queue.terms import LeaseTerms

__all__ = ["GatewayLeases", "LeaseHold", "queue_status"]

_log = Logger(namespace="loopd.gateway.leases")


class LeaseHold:
    """
    One session's lease on one queue, as the gateway holds it.

    It is its own scheduler connection key, so L{Scheduler.renew} refreshes exactly it.

    @ivar users: the requests of the session that hold or wait for this lease.
    @ivar granted: whether the scheduler granted it.
    @ivar final: whether one of its requests ended the session (no grace).
    @ivar terms: the lease's terms, once granted.
    @ivar context: the context tokens of the session's last completion on the endpoint
        while it held this lease (what a switch would make the server evaluate again);
        C{None} before one (nothing cached to protect).
    @ivar grace_began: when its grace began, while it is in one.
    @ivar grace_ends: when its grace ends, while it is in one.
    """

    def __init__(self, queue_key: str, session_key: str, role: Tier) -> None:
        """
        @param queue_key: the key the gateway acquires with (the endpoint's name).
        """
        self.queue_key = queue_key
        self.session_key = session_key
        self.role = role
        self.users = 0
        self.granted = False
        self.final = False
        self.terms: LeaseTerms | None = None
        self.context: int | None = None
        self.grace_began: float | None = None
        self.grace_ends: float | None = None
        self.waiters: list[Deferred[LeaseHold]] = []
        self.beats: LoopingCall | None = None
        self.grace: IDelayedCall | None = None

    def __repr__(self) -> str:
        """Name the session and queue (log lines)."""
        return f"<LeaseHold {self.session_key!r} on {self.queue_key!r}>"


class GatewayLeases:
    """
    The gateway's side of the lease scheduler: acquire per request, release after a grace.

    Its L{on_grant} must be the scheduler's C{on_grant}: it answers the gateway's own grants
    and passes every other one to the socket layer.

    @ivar costs: what a switch costs on each endpoint, as learned so far.
    @ivar cut_short: per endpoint, the graces a waiting request ended before C{grace_ms}.
    """

    def __init__(
        self, reactor: IReactorTime, grace_ms: int, costs: SwitchCosts | None = None
    ) -> None:
        """
        @param grace_ms: how long a session keeps its lease after its last request ended,
            while nobody waits.
        @param costs: the learned switch costs; C{None}: a fresh L{SwitchCosts}.
        """
        self._reactor = reactor
        self._grace = grace_ms / 1000.0
        self._holds: dict[tuple[str, str], LeaseHold] = {}
        # The holds in their grace, in the order it began.
        self._graced: dict[LeaseHold, None] = {}
        self.costs = SwitchCosts() if costs is None else costs
        self.cut_short: Counter[str] = Counter()
        self.scheduler: Scheduler | None = None

    def bind(self, scheduler: Scheduler) -> None:
        """
        Use C{scheduler} (whose C{on_grant} is this object's L{on_grant}), and hear from it
        when a queue's waiters change.
        """
        self.scheduler = scheduler
        scheduler.watch_waiting(self._waiting_changed)

    def _scheduler(self) -> Scheduler:
        """The bound scheduler; using the leases before L{bind} is a programming error."""
        if self.scheduler is None:
            raise RuntimeError("GatewayLeases.bind() was not called")
        return self.scheduler

    # -- the scheduler's callback ---------------------------------------------------------

    def on_grant(self, grant: Grant) -> None:
        """
        Deliver a grant: the gateway's own to its waiting requests, others to the socket.
        """
        hold = grant.conn
        if not isinstance(hold, LeaseHold):
            deliver_grant(grant)
            return
        if self._holds.get((hold.queue_key, hold.session_key)) is not hold:
            return
        hold.granted = True
        hold.terms = grant.terms()
        self._start_beats(hold)
        waiters, hold.waiters = hold.waiters, []
        for waiter in waiters:
            waiter.callback(hold)

    # -- requests ----------------------------------------------------------------------

    def acquire(
        self,
        queue_key: str,
        session_key: str,
        role: Tier,
        on_queued: Callable[[int], None] | None = None,
    ) -> Deferred[LeaseHold]:
        """
        Take (or share) C{session_key}'s lease on C{queue_key} for one request.

        @param on_queued: told how many sessions wait ahead when the request has to wait.
        @return: fires with the hold when the lease is granted; cancelling it while it
            waits withdraws the request (and the session's queued acquire, if it was the
            only one waiting). Every hold that fired must be given back with L{done}.
        """
        scheduler = self._scheduler()
        key = (queue_key, session_key)
        hold = self._holds.get(key)
        if hold is not None and hold.granted and not scheduler.beat(queue_key, session_key):
            self._drop(hold)
            hold = None
        if hold is None:
            hold = LeaseHold(queue_key, session_key, role)
            self._holds[key] = hold
        hold.users += 1
        self._end_grace(hold)
        if hold.granted:
            return _fired(hold)
        waiter: Deferred[LeaseHold] = Deferred(lambda d: self._withdraw(hold, d))
        hold.waiters.append(waiter)
        if len(hold.waiters) == 1 and hold.users == 1:
            scheduler.acquire(hold, queue_key, session_key, role, None, True)
        if not hold.granted and on_queued is not None:
            on_queued(self._ahead(hold))
        return waiter

    def done(self, hold: LeaseHold, final: bool = False) -> None:
        """
        One request of the hold's session ended; the last one starts the grace.

        @param final: the session said it is over (C{X-Session-End}): no grace, the slot
            goes back as soon as no request of the session runs, as the seed's session
            shutdown does.
        """
        if self._holds.get((hold.queue_key, hold.session_key)) is not hold:
            return
        hold.users -= 1
        if final:
            hold.final = True
        if hold.users > 0:
            return
        if self._grace > 0 and not hold.final:
            hold.grace_began = self._reactor.seconds()
            hold.grace_ends = hold.grace_began + self._grace
            self._graced[hold] = None
            self._schedule(hold)
        else:
            self._release(hold)

    def observe(
        self,
        endpoint: str,
        session_key: str,
        slot: int,
        history: str,
        timings: Timings,
        outcome: CacheOutcome | None,
    ) -> None:
        """
        A completion of C{session_key} on C{endpoint}'s C{slot} was accounted: learn the
        endpoint's costs from it (L{SwitchCosts.observe}), and price the session's lease
        there by its context from now on.

        Call it before the request's L{done}, so that its grace is priced by this completion.

        @param history: the key of the session's slot history (its own key, or a mesh
            session's per-endpoint key).
        @param outcome: its cache outcome against the session's previous completion.
        """
        self.costs.observe(endpoint, slot, history, timings, outcome)
        hold = self._holds.get((endpoint, session_key))
        if hold is not None and hold.granted:
            hold.context = timings.total
            if hold in self._graced:
                self._schedule(hold)

    def end(self, session_key: str) -> None:
        """
        C{session_key} is gone (its connection closed, for an anonymous session): every
        lease of it goes back with no grace, at once when no request of it runs, else when
        the last one ends (as L{done} with C{final}).
        """
        for hold in [h for (_, s), h in self._holds.items() if s == session_key]:
            hold.final = True
            if hold.users == 0:
                self._release(hold)

    def held_sessions(self, queue_key: str) -> set[str]:
        """
        Return the sessions whose gateway lease on C{queue_key} is granted (running a
        request or in their grace).
        """
        return {h.session_key for (q, _), h in self._holds.items() if q == queue_key and h.granted}

    def graced_contexts(self, queue_key: str) -> list[int]:
        """
        The context tokens of each session in its grace on C{queue_key} (its last
        completion's): what those sessions would evaluate again if the endpoint lost its
        caches now (a router's model swapped out).
        """
        return [h.context or 0 for h in self._graced if h.queue_key == queue_key]

    def stop(self) -> None:
        """
        Give every lease back and stop every timer (the daemon is stopping).
        """
        holds = list(self._holds.values())
        for hold in holds:
            for waiter in list(hold.waiters):
                waiter.cancel()
        for hold in holds:
            self._drop(hold)
            if self.scheduler is not None:
                self.scheduler.disconnect(hold)

    # -- internals ---------------------------------------------------------------------

    def _waiting_changed(self, queue_key: str) -> None:
        """
        Some queue's waiters changed: reprice every grace (they are few: at most one per
        slot, and a hold's asked key may lead to a group's queue).
        """
        for hold in list(self._graced):
            if hold in self._graced:
                self._schedule(hold)

    def _schedule(self, hold: LeaseHold) -> None:
        """
        Set the release of a hold in its grace to what the rule says now
        (L{release_at}): at once when that moment has passed.
        """
        assert hold.grace_began is not None and hold.grace_ends is not None
        scheduler = self._scheduler()
        waiting_since = scheduler.waiting_since(hold.queue_key)
        reprefill = self.costs.reprefill_seconds(hold.queue_key, hold.context or 0)
        at = release_at(hold.grace_began, hold.grace_ends, waiting_since, reprefill)
        now = self._reactor.seconds()
        if at <= now:
            if at < hold.grace_ends:
                self.cut_short[hold.queue_key] += 1
            self._release(hold)
        elif hold.grace is None:
            hold.grace = self._reactor.callLater(at - now, self._grace_over, hold)
        elif hold.grace.getTime() != at:
            hold.grace.reset(at - now)

    def _grace_over(self, hold: LeaseHold) -> None:
        """The release time of a grace came."""
        hold.grace = None
        self._schedule(hold)

    def _end_grace(self, hold: LeaseHold) -> None:
        """C{hold} is no longer in a grace: its session is back, or it is gone."""
        self._graced.pop(hold, None)
        hold.grace_began = hold.grace_ends = None
        if hold.grace is not None:
            hold.grace.cancel()
            hold.grace = None

    def _ahead(self, hold: LeaseHold) -> int:
        """How many sessions wait ahead of C{hold} in its queue (enqueue order)."""
        for queue in self._scheduler().status():
            names = [w["sessionKey"] for w in queue["waiting"]]
            if hold.session_key in names:
                return names.index(hold.session_key)
        return 0

    def _withdraw(self, hold: LeaseHold, waiter: Deferred[LeaseHold]) -> None:
        """A waiting request was cancelled (its client left, or its wait timed out)."""
        if waiter in hold.waiters:
            hold.waiters.remove(waiter)
            hold.users -= 1
        if hold.users == 0 and not hold.granted:
            self._drop(hold)
            self._scheduler().cancel(hold.queue_key, hold.session_key)

    def _start_beats(self, hold: LeaseHold) -> None:
        """Keep the granted lease alive on its own terms."""
        if hold.beats is not None or hold.terms is None:
            return
        hold.beats = LoopingCall(self._beat, hold)
        hold.beats.clock = self._reactor
        hold.beats.start(hold.terms.beat_period_ms() / 1000.0, now=False)

    def _beat(self, hold: LeaseHold) -> None:
        """An activity beat while a request runs; a TTL refresh during the grace."""
        scheduler = self._scheduler()
        if hold.users == 0:
            scheduler.renew(hold)
        elif not scheduler.beat(hold.queue_key, hold.session_key):
            _log.warn("{hold} lost its lease while a request ran", hold=hold)
            self._drop(hold)

    def _release(self, hold: LeaseHold) -> None:
        """The grace ended: give the slot back."""
        self._drop(hold)
        self._scheduler().release(hold.queue_key, hold.session_key)

    def _drop(self, hold: LeaseHold) -> None:
        """Forget C{hold} and stop its timers (the scheduler is told by the caller)."""
        if self._holds.get((hold.queue_key, hold.session_key)) is hold:
            del self._holds[(hold.queue_key, hold.session_key)]
        hold.granted = False
        if hold.beats is not None and hold.beats.running:
            hold.beats.stop()
        hold.beats = None
        self._end_grace(hold)


def _fired(hold: LeaseHold) -> Deferred[LeaseHold]:
    """A Deferred that has already fired with C{hold}."""
    d: Deferred[LeaseHold] = Deferred()
    d.callback(hold)
    return d


def queue_status(scheduler: Scheduler) -> dict[str, Any]:
    """
    Return the lease protocol's C{status} reply (what C{GET /v1/queue} serves).
    """
    return {"op": "status", "queues": scheduler.status()}
