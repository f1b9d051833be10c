# -*- test-case-name: loopd.test.test_queue_client -*-
"""
The values a L{loopd.queue.client.LeaseClient} hands out: the L{Lease} and the error family.

A L{Lease} moves through these states (C{held}, C{queued}, C{ended}):

 - B{waiting} (C{held=False}): the C{acquire} is sent and not yet granted;
 - B{held, queued} (C{held=True, queued=True}): the daemon granted it; its keyed activity
   beats run on the lease's own terms unless paused (L{Lease.pause_beats});
 - B{lost} (C{held=False}): a beat was answered C{granted: false}, or the connection to the
   daemon died. The lost observers are told, and the client has already re-queued it: it is
   waiting again, and L{Lease.when_held} fires on the re-grant;
 - B{held, unqueued} (C{held=True, queued=False}): the daemon was unreachable and the client
   fails open, so the holder proceeds without a slot; no beats run;
 - B{ended} (C{ended=True}, C{held=False}): released, cancelled, or lost for good (the
   daemon unreachable with C{fail_open=False}, or the client closed). It never comes back.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from loopd.queue.scheduler_types import Tier
from loopd.queue.terms import LeaseTerms

__all__ = [
    "ClientClosed",
    "DuplicateLease",
    "Lease",
    "LeaseEnded",
    "QueueError",
    "QueueReplyError",
    "QueueUnavailable",
]


class QueueError(Exception):
    """
    The base of every error a L{loopd.queue.client.LeaseClient} Deferred fails with.
    """


class QueueUnavailable(QueueError):  # noqa: N818 (the name the design gives it)
    """
    The queue daemon cannot be reached, or its connection died, and the client does not fail
    open (or the request, such as C{status}, has no open way through).
    """


class QueueReplyError(QueueError):
    """
    The daemon answered a request with C{{"op": "error", "reason": ...}}.

    @ivar reason: the daemon's reason.
    """

    def __init__(self, reason: str) -> None:
        """
        @param reason: the C{reason} field of the error reply.
        """
        super().__init__(reason)
        self.reason = reason


class ClientClosed(QueueError):  # noqa: N818 (reads as a state, as QueueUnavailable does)
    """
    The client was closed: the request was dropped, or it was made after L{close}.
    """


class DuplicateLease(QueueError):  # noqa: N818
    """
    The client already waits for or holds a lease with the same C{queueKey}/C{sessionKey}.
    """


class LeaseEnded(QueueError):  # noqa: N818
    """
    The lease was released, cancelled or closed: it will never be held again.
    """


class Lease:
    """
    A slot of one queue for one session, as a L{loopd.queue.client.LeaseClient} holds it.

    @ivar queue_key: the key it was acquired with (replies are keyed by it).
    @ivar session_key: the session it is held for.
    @ivar role: the tier it asks with (C{parent} or C{child}); a re-queue uses it too.
    @ivar group: the optional group label.
    @ivar activity: whether it opted into idle yield (and so needs keyed beats).
    @ivar terms: the terms the daemon granted it under (the client's fallback terms until
        the first grant, and for a lease that went through unqueued).
    @ivar queued: C{False} when it went through unqueued because the daemon was unreachable.
    @ivar held: whether its holder may stream now (see the module docstring).
    @ivar ended: whether it is over for good.

    C{held} is what the client knows: a lease whose beats are paused may have been
    idle-yielded meanwhile, and learns so on the beat that L{resume_beats} sends at once.
    The other attributes (C{beats}, C{warning}, C{acquired}, ...) belong to the client.
    """

    def __init__(
        self,
        queue_key: str,
        session_key: str,
        role: Tier,
        group: str | None,
        activity: bool,
        terms: LeaseTerms,
    ) -> None:
        """
        Start waiting; the client that made it drives every later change.
        """
        self.queue_key = queue_key
        self.session_key = session_key
        self.role: Tier = role
        self.group = group
        self.activity = activity
        self.terms = terms
        self.queued = True
        self.held = False
        self.ended = False
        self._paused = False
        self._held_waiters: list[Deferred[Lease]] = []
        self._lost_observers: list[Callable[[Lease], None]] = []
        # Set by the client: the reactor the beats run on and how a beat is sent.
        self.beat_clock: IReactorTime | None = None
        self.send_beat: Callable[[Lease], None] | None = None
        self.beats: LoopingCall | None = None
        self.beats_in_flight = 0
        self.warning: IDelayedCall | None = None
        self.acquired: Deferred[Lease] | None = None
        self.sent_on: object = None

    def __repr__(self) -> str:
        """Name the session, the queue and the state (log lines, test failures)."""
        state = "ended" if self.ended else "held" if self.held else "waiting"
        unqueued = "" if self.queued else " unqueued"
        return f"<Lease {self.session_key!r} on {self.queue_key!r} {state}{unqueued}>"

    @property
    def key(self) -> tuple[str, str]:
        """
        The C{(queueKey, sessionKey)} pair its replies are matched by.
        """
        return (self.queue_key, self.session_key)

    @property
    def paused(self) -> bool:
        """
        Whether its keyed beats are paused (L{pause_beats}).
        """
        return self._paused

    # -- for the holder ----------------------------------------------------------------

    def when_held(self) -> Deferred[Lease]:
        """
        Return a Deferred that fires with this lease at once when it is held, or when it is
        (re-)granted; it fails with L{LeaseEnded} if the lease is over, and with the reason the
        lease ended if that happens first (L{QueueUnavailable}, L{ClientClosed}, ...).
        Cancelling it only stops the wait.
        """
        if self.held:
            return succeed(self)
        if self.ended:
            return fail(LeaseEnded(f"{self!r} is over"))
        waiter: Deferred[Lease] = Deferred(self._held_waiters.remove)
        self._held_waiters.append(waiter)
        return waiter

    def pause_beats(self) -> None:
        """
        Stop the keyed activity beats, for a holder parked in a blocking tool: the daemon
        may then idle-yield the slot to a waiter once the lease's idle-yield window passes.
        The connection's bare heartbeat keeps the TTL alive meanwhile.
        """
        self._paused = True
        self.stop_beats()

    def resume_beats(self) -> None:
        """
        Restart the keyed beats, with one beat at once: if the slot was yielded while they
        were paused, its C{granted: false} answer re-queues the lease before the holder
        streams again (watch L{held} or wait on L{when_held}).
        """
        if not self._paused:
            return
        self._paused = False
        if self.held and self.queued and self.send_beat is not None:
            self.send_beat(self)
            self.start_beats()

    def add_lost_observer(self, observer: Callable[[Lease], None]) -> None:
        """
        Call C{observer(lease)} each time this held lease loses its slot (a C{granted:
        false} beat, or the daemon connection dying); the lease is re-queued by then.
        """
        self._lost_observers.append(observer)

    def remove_lost_observer(self, observer: Callable[[Lease], None]) -> None:
        """
        Stop calling C{observer}.
        """
        self._lost_observers.remove(observer)

    # -- for the client ----------------------------------------------------------------

    def start_beats(self) -> None:
        """
        Run the keyed beat every C{terms.beat_period_ms()} while held and not paused (the
        client calls this on each grant).
        """
        if self._paused or not self.held or self.beats is not None:
            return
        if self.send_beat is None or self.beat_clock is None:
            return
        beats = LoopingCall(self.send_beat, self)
        beats.clock = self.beat_clock
        beats.start(self.terms.beat_period_ms() / 1000.0, now=False)
        self.beats = beats

    def stop_beats(self) -> None:
        """
        Stop the keyed beat timer, if it runs.
        """
        if self.beats is not None:
            if self.beats.running:
                self.beats.stop()
            self.beats = None

    def stop_warning(self) -> None:
        """
        Cancel the pending queue-wait warning, if any.
        """
        if self.warning is not None:
            if self.warning.active():
                self.warning.cancel()
            self.warning = None

    def became_held(self, queued: bool) -> None:
        """
        Mark the lease held (C{queued=False}: unqueued, by fail-open), start its beats if
        queued, and fire the acquire and every L{when_held} waiter.
        """
        self.stop_warning()
        self.held, self.queued = True, queued
        if queued:
            self.start_beats()
        acquired, self.acquired = self.acquired, None
        waiters, self._held_waiters = self._held_waiters, []
        if acquired is not None:
            acquired.callback(self)
        for waiter in waiters:
            waiter.callback(self)

    def became_lost(self) -> None:
        """
        Mark a held lease as no longer held: its slot is gone, and its beats stop.
        """
        self.held = False
        self.beats_in_flight = 0
        self.stop_beats()

    def tell_lost(self) -> None:
        """
        Tell the lost observers (after the client re-queued the lease).
        """
        for observer in list(self._lost_observers):
            observer(self)

    def became_ended(self, reason: Failure | None) -> None:
        """
        End the lease for good: stop its timers, and fail the acquire and every waiter with
        C{reason} (L{LeaseEnded} when C{None}).
        """
        self.held, self.ended = False, True
        self.stop_beats()
        self.stop_warning()
        failure = reason or Failure(LeaseEnded(f"{self!r} is over"))
        acquired, self.acquired = self.acquired, None
        waiters, self._held_waiters = self._held_waiters, []
        if acquired is not None:
            acquired.errback(failure)
        for waiter in waiters:
            waiter.errback(failure)
