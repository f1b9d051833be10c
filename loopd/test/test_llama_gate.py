"""Tests for L{loopd.llama.gate}: the slot gate and its interface."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.exceptions import Invalid
from zope.interface.verify import verifyObject

from loopd.errors import Busy, InferError
from loopd.llama.gate import IGrant, ISlotGate, NoGate, SlotGate
from loopd.llama.types import ChatEvent, Queued


class Request:
    """One caller of the gate: its Deferred, the events it heard and how it ended."""

    def __init__(self, gate: SlotGate | NoGate, slot: int) -> None:
        self.slot = slot
        self.events: list[ChatEvent] = []
        self.grant: IGrant | None = None
        self.failure: Failure | None = None
        self.deferred = gate.acquire(slot, self.events.append)
        self.deferred.addCallbacks(self._granted, self._failed)

    def _granted(self, grant: IGrant) -> None:
        self.grant = grant

    def _failed(self, failure: Failure) -> None:
        self.failure = failure

    @property
    def aheads(self) -> list[int]:
        """The C{ahead} of every Queued event heard, in order."""
        return [e.ahead for e in self.events if isinstance(e, Queued)]

    def release(self) -> None:
        """Release the grant this request holds."""
        assert self.grant is not None
        self.grant.release()


class InterfaceTests(SynchronousTestCase):
    """The gates and their grants provide the interfaces."""

    def test_slot_gate_provides(self) -> None:
        """SlotGate provides ISlotGate and its grants provide IGrant."""
        gate = SlotGate(2)
        self.assertTrue(verifyObject(ISlotGate, gate))
        grant = self.successResultOf(gate.acquire(0, lambda e: None))
        self.assertTrue(verifyObject(IGrant, grant))

    def test_no_gate_provides(self) -> None:
        """NoGate provides ISlotGate and its grants provide IGrant."""
        gate = NoGate()
        self.assertTrue(verifyObject(ISlotGate, gate))
        self.assertTrue(verifyObject(IGrant, self.successResultOf(gate.acquire(0, print))))

    def test_declares_what_callers_ask(self) -> None:
        """
        ISlotGate declares in_flight and waiting beside acquire: a gate with acquire alone
        does not provide it.
        """
        self.assertEqual(sorted(ISlotGate.names()), ["acquire", "in_flight", "waiting"])

        class AcquireOnly:
            def acquire(self, slot: int, on_event: object) -> Deferred[IGrant]:
                return NoGate().acquire(slot, print)

        self.assertRaises(Invalid, verifyObject, ISlotGate, AcquireOnly(), tentative=True)

    def test_negative_depth_refused(self) -> None:
        """A negative queue depth is a ValueError."""
        self.assertRaises(ValueError, SlotGate, -1)


class NoGateTests(SynchronousTestCase):
    """NoGate lets everything through."""

    def test_everything_goes_at_once(self) -> None:
        """Any number of acquires on one slot all fire at once, with no event."""
        gate = NoGate()
        requests = [Request(gate, 0) for _ in range(20)]
        self.assertTrue(all(r.grant is not None for r in requests))
        self.assertEqual([e for r in requests for e in r.events], [])
        for r in requests:
            r.release()
            r.release()

    def test_holds_nothing(self) -> None:
        """NoGate reports no slot in flight and nobody waiting, grants outstanding or not."""
        gate = NoGate()
        Request(gate, 0)
        Request(gate, 0)
        self.assertEqual([(gate.in_flight(s), gate.waiting(s)) for s in (0, 1)], [(False, 0)] * 2)


class SlotGateTests(SynchronousTestCase):
    """SlotGate: one in flight per slot, FIFO, bounded queue, Queued events, cancel."""

    def test_free_slot_goes_at_once(self) -> None:
        """The first acquire of a slot fires at once and emits nothing."""
        gate = SlotGate(8)
        first = Request(gate, 0)
        self.assertIsNotNone(first.grant)
        self.assertEqual(first.events, [])
        self.assertTrue(gate.in_flight(0))
        self.assertEqual(gate.waiting(0), 0)

    def test_one_in_flight_per_slot(self) -> None:
        """A second acquire of a held slot waits until the first is released."""
        gate = SlotGate(8)
        first = Request(gate, 0)
        second = Request(gate, 0)
        self.assertNoResult(second.deferred)
        self.assertEqual(gate.waiting(0), 1)
        first.release()
        self.assertIsNotNone(second.grant)
        self.assertEqual(gate.waiting(0), 0)
        self.assertTrue(gate.in_flight(0))

    def test_release_of_last_frees_slot(self) -> None:
        """Releasing the only request leaves the slot free for the next acquire."""
        gate = SlotGate(8)
        Request(gate, 3).release()
        self.assertFalse(gate.in_flight(3))
        self.assertIsNotNone(Request(gate, 3).grant)

    def test_fifo(self) -> None:
        """Waiters are granted in the order they asked, one per release."""
        gate = SlotGate(8)
        holder = Request(gate, 0)
        waiters = [Request(gate, 0) for _ in range(5)]
        order: list[int] = []
        current = holder
        for _ in waiters:
            current.release()
            granted = [i for i, w in enumerate(waiters) if w.grant is not None]
            order.append(granted[-1])
            self.assertEqual(granted, order)
            current = waiters[granted[-1]]
        self.assertEqual(order, [0, 1, 2, 3, 4])

    def test_slots_independent(self) -> None:
        """A held slot does not delay another slot, and queues are per slot."""
        gate = SlotGate(1)
        zero = Request(gate, 0)
        Request(gate, 0)
        one = Request(gate, 1)
        self.assertIsNotNone(one.grant)
        self.assertIsNone(Request(gate, 1).grant)
        self.assertEqual((gate.waiting(0), gate.waiting(1)), (1, 1))
        one.release()
        self.assertEqual((gate.waiting(0), gate.waiting(1)), (1, 0))
        zero.release()
        self.assertEqual(gate.waiting(0), 0)

    def test_busy_beyond_depth(self) -> None:
        """With queue_depth waiting, one more fails with Busy at once and the queue is kept."""
        gate = SlotGate(3)
        holder = Request(gate, 0)
        waiters = [Request(gate, 0) for _ in range(3)]
        extra = Request(gate, 0)
        assert extra.failure is not None
        self.assertIsInstance(extra.failure.value, Busy)
        self.assertIsInstance(extra.failure.value, InferError)
        self.assertEqual(extra.events, [])
        self.assertEqual(gate.waiting(0), 3)
        holder.release()
        self.assertIsNotNone(waiters[0].grant)
        self.assertIsNone(waiters[1].grant)
        self.assertEqual(gate.waiting(0), 2)

    def test_depth_zero(self) -> None:
        """With queue_depth 0 nothing waits: a held slot answers Busy."""
        gate = SlotGate(0)
        Request(gate, 0)
        second = Request(gate, 0)
        assert second.failure is not None
        second.failure.trap(Busy)
        self.assertEqual(gate.waiting(0), 0)

    def test_queued_ahead(self) -> None:
        """Each waiter hears how many go before it, then each time that shrinks."""
        gate = SlotGate(8)
        holder = Request(gate, 0)
        a, b, c = Request(gate, 0), Request(gate, 0), Request(gate, 0)
        self.assertEqual((a.aheads, b.aheads, c.aheads), ([1], [2], [3]))
        holder.release()
        self.assertEqual((a.aheads, b.aheads, c.aheads), ([1], [2, 1], [3, 2]))
        a.release()
        self.assertEqual((a.aheads, b.aheads, c.aheads), ([1], [2, 1], [3, 2, 1]))
        b.release()
        self.assertEqual(c.aheads, [3, 2, 1])
        self.assertIsNotNone(c.grant)

    def test_cancel_leaves_queue(self) -> None:
        """A cancelled waiter fails with CancelledError, leaves, and the rest go in order."""
        gate = SlotGate(8)
        holder = Request(gate, 0)
        a, b, c = Request(gate, 0), Request(gate, 0), Request(gate, 0)
        b.deferred.cancel()
        assert b.failure is not None
        b.failure.trap(CancelledError)
        self.assertEqual(gate.waiting(0), 2)
        self.assertEqual(c.aheads, [3, 2])
        self.assertEqual(a.aheads, [1])
        holder.release()
        self.assertIsNotNone(a.grant)
        self.assertIsNone(c.grant)
        self.assertEqual(c.aheads, [3, 2, 1])
        a.release()
        self.assertIsNotNone(c.grant)
        self.assertIsNone(b.grant)

    def test_cancel_frees_a_place(self) -> None:
        """After a waiter of a full queue is cancelled, a new request may wait again."""
        gate = SlotGate(1)
        Request(gate, 0)
        waiter = Request(gate, 0)
        waiter.deferred.cancel()
        self.assertIsNone(Request(gate, 0).failure)
        self.assertEqual(gate.waiting(0), 1)

    def test_cancel_after_grant_is_noop(self) -> None:
        """Cancelling an already granted request changes nothing."""
        gate = SlotGate(8)
        holder = Request(gate, 0)
        waiter = Request(gate, 0)
        holder.deferred.cancel()
        self.assertTrue(gate.in_flight(0))
        self.assertIsNone(holder.failure)
        holder.release()
        self.assertIsNotNone(waiter.grant)

    def test_release_idempotent(self) -> None:
        """A second release of the same grant does not let a second waiter go."""
        gate = SlotGate(8)
        holder = Request(gate, 0)
        a, b = Request(gate, 0), Request(gate, 0)
        holder.release()
        holder.release()
        self.assertIsNotNone(a.grant)
        self.assertIsNone(b.grant)
        self.assertEqual(gate.waiting(0), 1)

    def test_stale_release_after_free(self) -> None:
        """Releasing an old grant again does not free a slot now held by someone else."""
        gate = SlotGate(8)
        first = Request(gate, 0)
        first.release()
        second = Request(gate, 0)
        waiter = Request(gate, 0)
        first.release()
        self.assertIsNone(waiter.grant)
        second.release()
        self.assertIsNotNone(waiter.grant)

    def test_release_from_grant_callback(self) -> None:
        """A waiter that releases inside its grant callback passes the slot straight on."""
        gate = SlotGate(8)
        holder = Request(gate, 0)
        reentrant = gate.acquire(0, lambda e: None)
        reentrant.addCallback(lambda grant: grant.release())
        last = Request(gate, 0)
        holder.release()
        self.assertIsNotNone(last.grant)
        self.assertEqual(last.aheads, [2])

    def test_raising_listener_does_not_wedge(self) -> None:
        """A listener that raises is logged and the gate carries on."""
        gate = SlotGate(8)
        holder = Request(gate, 0)

        def bad(event: ChatEvent) -> None:
            raise RuntimeError("listener bug")

        first = gate.acquire(0, bad)
        second = gate.acquire(0, bad)
        holder.release()
        grant = self.successResultOf(first)
        grant.release()
        self.successResultOf(second)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 3)


@dataclass(eq=False)
class Ticket:
    """The model's view of one acquire."""

    slot: int
    seq: int
    request: Request
    state: str = "waiting"


class GateMachine(RuleBasedStateMachine):
    """Random acquire, release and cancel sequences against a model of the gate."""

    SLOTS = 3

    def __init__(self) -> None:
        super().__init__()
        self.gate = SlotGate(0)
        self.depth = 0
        self.tickets: list[Ticket] = []
        self.granted: dict[int, list[int]] = {s: [] for s in range(self.SLOTS)}

    @initialize(depth=st.integers(0, 3))
    def make(self, depth: int) -> None:
        """Start with an empty gate of the drawn depth."""
        self.gate = SlotGate(depth)
        self.depth = depth

    def _of(self, slot: int, state: str) -> list[Ticket]:
        return [t for t in self.tickets if t.slot == slot and t.state == state]

    def _sync(self) -> None:
        """Move tickets whose Deferred fired to their new state, recording grants."""
        for t in self.tickets:
            if t.state == "waiting" and t.request.grant is not None:
                t.state = "held"
                self.granted[t.slot].append(t.seq)

    @rule(slot=st.integers(0, SLOTS - 1))
    def acquire(self, slot: int) -> None:
        """Acquire: go at once when free, Busy when the queue is full, else wait."""
        held = self._of(slot, "held")
        waiting_before = self.gate.waiting(slot)
        ticket = Ticket(slot, len(self.tickets), Request(self.gate, slot))
        self.tickets.append(ticket)
        if not held:
            assert ticket.request.grant is not None
            assert ticket.request.events == []
            ticket.state = "held"
            self.granted[slot].append(ticket.seq)
        elif waiting_before >= self.depth:
            assert ticket.request.failure is not None
            assert ticket.request.failure.check(Busy)
            assert self.gate.waiting(slot) == waiting_before
            ticket.state = "busy"
        else:
            assert ticket.request.grant is None and ticket.request.failure is None
            assert ticket.request.aheads == [waiting_before + 1]

    @precondition(lambda self: any(t.state in ("held", "released") for t in self.tickets))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Release a granted request (perhaps again); the oldest waiter goes."""
        choices = [t for t in self.tickets if t.state in ("held", "released")]
        ticket = data.draw(st.sampled_from(choices))
        waiters = self._of(ticket.slot, "waiting")
        ticket.request.release()
        if ticket.state == "held" and waiters:
            assert waiters[0].request.grant is not None
        ticket.state = "released"
        self._sync()

    @precondition(lambda self: bool(self.tickets))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """Cancel any request; only a waiting one is affected: it fails and leaves."""
        ticket = data.draw(st.sampled_from(self.tickets))
        before = self.gate.waiting(ticket.slot)
        ticket.request.deferred.cancel()
        if ticket.state == "waiting":
            assert ticket.request.failure is not None
            assert ticket.request.failure.check(CancelledError)
            assert self.gate.waiting(ticket.slot) == before - 1
            ticket.state = "cancelled"
        else:
            assert self.gate.waiting(ticket.slot) == before

    @invariant()
    def one_in_flight(self) -> None:
        """At most one held grant per slot, and the gate agrees."""
        for slot in range(self.SLOTS):
            held = self._of(slot, "held")
            assert len(held) <= 1
            assert self.gate.in_flight(slot) == bool(held)

    @invariant()
    def bounded_queue(self) -> None:
        """At most depth waiting per slot; nobody waits for a free slot."""
        for slot in range(self.SLOTS):
            waiting = self._of(slot, "waiting")
            assert len(waiting) == self.gate.waiting(slot) <= self.depth
            assert not waiting or self._of(slot, "held")

    @invariant()
    def fifo(self) -> None:
        """Grants per slot follow acquire order among requests that neither failed."""
        for slot in range(self.SLOTS):
            order = self.granted[slot]
            assert order == sorted(order)
            if order:
                skipped = [
                    t
                    for t in self.tickets
                    if t.slot == slot and t.seq < order[-1] and t.state == "waiting"
                ]
                assert skipped == []

    @invariant()
    def queued_events(self) -> None:
        """Each waiter last heard its true position; the counts it heard only shrink."""
        for t in self.tickets:
            aheads = t.request.aheads
            assert all(x > y for x, y in zip(aheads, aheads[1:], strict=False))
            if t.state == "waiting":
                position = self._of(t.slot, "waiting").index(t)
                assert aheads[-1] == position + 1


class GatePropertyTests(SynchronousTestCase):
    """The gate keeps its invariants under random sequences of operations."""

    def test_state_machine(self) -> None:
        """Random acquire, release and cancel sequences match the model."""
        run_state_machine_as_test(GateMachine)
