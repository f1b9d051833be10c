# -*- test-case-name: loopd.test.test_llama_gate -*-
"""
The slot gate: at most one request in flight per server slot, inside loopd.

A request asks the gate for its slot and goes when the returned Deferred fires with a grant;
it gives the slot back with L{IGrant.release}. Waiters go first come first served, at most
C{queue_depth} of them per slot; one more is refused at once with L{Busy}. A waiter hears
L{Queued} when it starts to wait and again each time the number of requests ahead of it
shrinks. Cancelling a waiter's Deferred takes it out of the queue.

L{ISlotGate} is the seam: L{SlotGate} is loopd's own gate, L{NoGate} lets every request go at
once for callers that schedule elsewhere, and a lease scheduler can stand behind the same
interface later. Besides C{acquire}, a gate answers what its callers ask of it (the
gateway's slot choice and metrics): whether a slot is in flight (L{ISlotGate.in_flight}) and
how many requests wait for it (L{ISlotGate.waiting}). Pure: Deferreds only, no reactor, no
I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from zope.interface import Interface, implementer

from loopd.errors import Busy
from loopd.llama.types import ChatEvent, Queued

__all__ = ["IGrant", "ISlotGate", "NoGate", "SlotGate"]

_log = Logger(namespace="loopd.llama.gate")


class IGrant(Interface):
    """
    Permission for one request to use its slot, held until released.
    """

    def release() -> None:
        """
        Give the slot back so that its next waiter may go. Calling it again does nothing.
        """


class ISlotGate(Interface):
    """
    Admission to the server's slots: who may send a request to a slot, and when.
    """

    # zope interface methods are declared without self.
    def acquire(slot: int, on_event: Callable[[ChatEvent], None]) -> Deferred[IGrant]:  # noqa: N805
        """
        Ask to send one request to C{slot}.

        @param on_event: receives L{Queued} events while the request waits.
        @return: a Deferred that fires with an L{IGrant} when the request may go, or fails
            with L{Busy} at once when the slot's queue is full. Cancelling it while the
            request waits takes the request out of the queue; it then fails with
            C{CancelledError}.
        """

    def in_flight(slot: int) -> bool:  # noqa: N805
        """
        Whether a request holds C{slot} now: a grant given and not yet released.
        """

    def waiting(slot: int) -> int:  # noqa: N805
        """
        How many requests wait for C{slot} now.
        """


def _emit(on_event: Callable[[ChatEvent], None], event: ChatEvent) -> None:
    """Deliver an event; a listener that raises is logged, never allowed to wedge the gate."""
    try:
        on_event(event)
    except Exception:
        _log.failure("on_event raised while handling {event!r}", event=event)


@implementer(IGrant)
class _NoGrant:
    """The grant of L{NoGate}: releasing it does nothing."""

    def release(self) -> None:
        """Nothing to give back."""


@implementer(ISlotGate)
class NoGate:
    """
    A gate that lets every request go at once, for callers that schedule elsewhere.
    """

    def acquire(self, slot: int, on_event: Callable[[ChatEvent], None]) -> Deferred[IGrant]:
        """Fire at once with a grant whose release does nothing; never emits an event."""
        return succeed(_NoGrant())

    def in_flight(self, slot: int) -> bool:
        """Always false: this gate holds nothing for anyone."""
        return False

    def waiting(self, slot: int) -> int:
        """Always 0: nobody waits at this gate."""
        return 0


@implementer(IGrant)
class _Grant:
    """A L{SlotGate} grant: the first release hands the slot on, later ones do nothing."""

    def __init__(self, gate: SlotGate, slot: int) -> None:
        """Hold C{slot} of C{gate}, not yet released."""
        self._gate = gate
        self._slot = slot
        self._released = False

    def release(self) -> None:
        """Hand the slot to its next waiter, once."""
        if self._released:
            return
        self._released = True
        self._gate._hand_on(self._slot, self)


@dataclass(eq=False)
class _Waiter:
    """A request waiting for a slot; C{reported} is the last C{ahead} it was told."""

    deferred: Deferred[IGrant]
    on_event: Callable[[ChatEvent], None]
    reported: int


class _Slot:
    """One slot's state: the grant in flight (if any) and the waiters, oldest first."""

    def __init__(self) -> None:
        """Free, with nobody waiting."""
        self.holder: _Grant | None = None
        self.waiters: deque[_Waiter] = deque()


@implementer(ISlotGate)
class SlotGate:
    """
    loopd's own slot gate: per slot one request in flight, first come first served, at most
    C{queue_depth} waiting. Slots are independent of one another.

    C{ahead} in L{Queued} counts every request that will go before the waiter: the one in
    flight and the waiters in front of it, so the first waiter hears C{ahead=1}.
    """

    def __init__(self, queue_depth: int) -> None:
        """
        @param queue_depth: how many requests may wait per slot (C{Limits.queue_depth}).
        """
        if queue_depth < 0:
            raise ValueError(f"queue_depth must be >= 0, got {queue_depth}")
        self._depth = queue_depth
        self._slots: dict[int, _Slot] = {}

    def in_flight(self, slot: int) -> bool:
        """Whether a request holds C{slot} now."""
        state = self._slots.get(slot)
        return state is not None and state.holder is not None

    def waiting(self, slot: int) -> int:
        """How many requests wait for C{slot} now."""
        state = self._slots.get(slot)
        return 0 if state is None else len(state.waiters)

    def acquire(self, slot: int, on_event: Callable[[ChatEvent], None]) -> Deferred[IGrant]:
        """
        Grant C{slot} at once when it is free; otherwise queue the request and emit
        L{Queued}, or fail with L{Busy} when C{queue_depth} requests already wait.
        """
        state = self._slots.setdefault(slot, _Slot())
        if state.holder is None:
            state.holder = _Grant(self, slot)
            return succeed(state.holder)
        if len(state.waiters) >= self._depth:
            return fail(Busy(f"slot {slot}: {len(state.waiters)} requests already waiting"))
        ahead = len(state.waiters) + 1
        waiter = _Waiter(Deferred(lambda d: self._withdraw(slot, waiter)), on_event, ahead)
        state.waiters.append(waiter)
        _emit(on_event, Queued(ahead=ahead))
        return waiter.deferred

    def _withdraw(self, slot: int, waiter: _Waiter) -> None:
        """The canceller of a waiter's Deferred: leave the queue; Deferred.cancel fails it."""
        state = self._slots[slot]
        state.waiters.remove(waiter)
        self._tell_positions(state)

    def _hand_on(self, slot: int, grant: _Grant) -> None:
        """Called by a grant's first release: the oldest waiter goes, or the slot is free."""
        state = self._slots[slot]
        if state.holder is not grant:
            return
        if not state.waiters:
            state.holder = None
            del self._slots[slot]
            return
        waiter = state.waiters.popleft()
        state.holder = _Grant(self, slot)
        # Fire the grant only after the state is whole: its callbacks may re-enter the gate.
        waiter.deferred.callback(state.holder)
        self._tell_positions(state)

    def _tell_positions(self, state: _Slot) -> None:
        """
        Emit L{Queued} to each waiter whose count ahead is now lower than the last it heard.

        Positions are read afresh for each waiter, because a listener may re-enter the gate.
        """
        for waiter in list(state.waiters):
            if waiter not in state.waiters:
                continue
            ahead = state.waiters.index(waiter) + 1
            if ahead < waiter.reported:
                waiter.reported = ahead
                _emit(waiter.on_event, Queued(ahead=ahead))
