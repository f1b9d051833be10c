"""
Tests for L{loopd.gateway.swaps}: when a request for a model the router has not loaded may
go, grouping turns of the loaded model while a swap costs more than the wait, and the bound
no request waits past (a hypothesis state machine over asks, ends and time).
"""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.swaps import Go, SwapBoard


def free(victim: str, wanted: str) -> float:
    """A swap that costs nothing."""
    return 0.0


def dear(victim: str, wanted: str) -> float:
    """A swap that costs more than any bound in these tests."""
    return 1e9


def board(capacity: int = 1, loaded: tuple[str, ...] = ("a",)) -> SwapBoard:
    """A board with a 30 s bound and a 5 s grace."""
    return SwapBoard(capacity, bound=30.0, grace=5.0, loaded=loaded)


class RuleTests(SynchronousTestCase):
    """The rules, one by one."""

    def test_loaded_model_goes(self) -> None:
        """A request for a loaded model goes at once, nothing evicted."""
        swaps = board()
        swaps.ask(1, "a", 0.0)
        self.assertEqual(swaps.decide(0.0, dear), [Go(1, "a")])
        self.assertEqual(swaps.in_flight("a"), 1)

    def test_room_to_load(self) -> None:
        """With room under the capacity an unloaded model goes and counts as loaded."""
        swaps = board(capacity=2)
        swaps.ask(1, "b", 0.0)
        self.assertEqual(swaps.decide(0.0, dear), [Go(1, "b")])
        self.assertEqual(swaps.loaded, ("a", "b"))

    def test_waits_while_the_loaded_model_is_mid_task(self) -> None:
        """
        b waits while a's last turn ended less than the grace ago and the swap costs more
        than the wait; a's next turn goes meanwhile; once a is no longer mid-task b goes,
        evicting a.
        """
        swaps = board()
        swaps.ask("a1", "a", 0.0)
        swaps.decide(0.0, dear)
        swaps.ended("a", 1.0)
        swaps.ask("b1", "b", 2.0)
        self.assertEqual(swaps.decide(2.0, dear), [])
        self.assertEqual(swaps.next_decision(2.0, dear), 6.0)
        swaps.ask("a2", "a", 3.0)
        self.assertEqual(swaps.decide(3.0, dear), [Go("a2", "a")])
        swaps.ended("a", 4.0)
        self.assertEqual(swaps.decide(8.0, dear), [])
        self.assertEqual(swaps.decide(9.0, dear), [Go("b1", "b", "a")])
        self.assertEqual((swaps.loaded, swaps.swaps), (("b",), 1))

    def test_a_cheap_swap_does_not_wait(self) -> None:
        """When the swap's price is below the wait so far, the request goes at once."""
        swaps = board()
        swaps.ask("a1", "a", 0.0)
        swaps.decide(0.0, free)
        swaps.ended("a", 1.0)
        swaps.ask("b1", "b", 1.5)
        self.assertEqual(swaps.decide(1.5, free), [Go("b1", "b", "a")])

    def test_priced_wait(self) -> None:
        """The request waits as long as the swap's price, then goes although a is mid-task."""
        swaps = SwapBoard(1, bound=30.0, grace=60.0, loaded=("a",))
        swaps.ask("a1", "a", 0.0)
        swaps.decide(0.0, free)
        swaps.ended("a", 1.0)
        swaps.ask("b1", "b", 2.0)

        def price(victim: str, wanted: str) -> float:
            return 3.0

        self.assertEqual(swaps.decide(4.9, price), [])
        self.assertEqual(swaps.next_decision(4.9, price), 5.0)
        self.assertEqual(swaps.decide(5.0, price), [Go("b1", "b", "a")])

    def test_no_victim_while_in_flight(self) -> None:
        """A model with a request in flight is never evicted: the request waits for it."""
        swaps = board()
        swaps.ask("a1", "a", 0.0)
        swaps.decide(0.0, free)
        swaps.ask("b1", "b", 1.0)
        self.assertEqual(swaps.decide(100.0, free), [])
        swaps.ended("a", 101.0)
        self.assertEqual(swaps.decide(101.0, free), [Go("b1", "b", "a")])

    def test_overdue_blocks_everyone_after_it(self) -> None:
        """
        Once b has waited the bound, a's sessions no longer start turns: a drains and b
        goes. (Before its bound, a's turns pass it.)
        """
        swaps = board()
        swaps.ask("a1", "a", 0.0)
        swaps.decide(0.0, dear)
        swaps.ask("b1", "b", 1.0)
        swaps.ask("a2", "a", 2.0)
        self.assertEqual(swaps.decide(2.0, dear), [Go("a2", "a")])
        swaps.ask("a3", "a", 31.0)
        self.assertEqual(swaps.decide(31.0, dear), [])
        self.assertEqual(swaps.waiting(), ("b1", "a3"))
        swaps.ended("a", 32.0)
        swaps.ended("a", 33.0)
        self.assertEqual(swaps.decide(33.0, dear), [Go("b1", "b", "a")])
        # a3 now asks for a model that is not loaded, behind b's turn.
        self.assertEqual(swaps.waiting(), ("a3",))

    def test_grouped(self) -> None:
        """Several waiting for b all go with the one swap."""
        swaps = board()
        for key in ("b1", "b2", "b3"):
            swaps.ask(key, "b", 0.0)
        self.assertEqual(
            swaps.decide(0.0, free), [Go("b1", "b", "a"), Go("b2", "b"), Go("b3", "b")]
        )
        self.assertEqual(swaps.swaps, 1)

    def test_withdraw_and_unloaded(self) -> None:
        """A withdrawn request waits no more; a model the router dropped is not loaded."""
        swaps = board(capacity=2, loaded=("a", "c"))
        swaps.unloaded("c")
        self.assertEqual(swaps.loaded, ("a",))
        swaps.ask(1, "b", 0.0)
        swaps.withdraw(1)
        self.assertEqual((swaps.waiting(), swaps.decide(0.0, free)), ((), []))
        self.assertRaises(ValueError, SwapBoard, 0, 1.0, 1.0)
        swaps.ask(2, "b", 0.0)
        self.assertRaises(ValueError, swaps.ask, 2, "b", 0.0)


class SwapMachine(RuleBasedStateMachine):
    """
    Any order of asks, ends and time on a router of one or two slots for three models:
    the loaded models never pass the capacity, no request starts while an overdue one
    waits ahead of it, and when nothing is in flight the first waiting request goes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.capacity = 1
        self.swaps = SwapBoard(self.capacity, bound=30.0, grace=5.0, loaded=("a",))
        self.running: list[str] = []
        self.next_key = 0
        self.asked: dict[Hashable, float] = {}

    @rule(model=st.sampled_from("abc"))
    def ask(self, model: str) -> None:
        self.swaps.ask(self.next_key, model, self.now)
        self.asked[self.next_key] = self.now
        self.next_key += 1
        self.decide()

    @precondition(lambda self: bool(self.running))
    @rule(which=st.integers(0, 10))
    def end(self, which: int) -> None:
        model = self.running.pop(which % len(self.running))
        self.swaps.ended(model, self.now)
        self.decide()

    @rule(seconds=st.sampled_from([0.5, 3.0, 10.0, 40.0]))
    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.decide()

    def decide(self) -> None:
        before = list(self.swaps.waiting())
        overdue = [k for k in before if self.now - self.asked[k] >= 30.0]
        going = self.swaps.decide(self.now, lambda victim, wanted: 12.0)
        left = self.swaps.waiting()
        for go in going:
            if overdue and overdue[0] in left:
                # Nothing passes the first overdue request while it still waits.
                assert before.index(go.key) < before.index(overdue[0]), (go, overdue)
            self.running.append(go.model)

    @invariant()
    def within_capacity(self) -> None:
        assert len(self.swaps.loaded) <= self.capacity, self.swaps.loaded

    @invariant()
    def idle_router_serves_the_overdue(self) -> None:
        # decide ran after every step: with nothing in flight, no overdue request is left.
        if not self.running and self.swaps.waiting():
            first = self.swaps.waiting()[0]
            assert self.now - self.asked[first] < 30.0, (first, self.now)


class TwoSlotMachine(SwapMachine):
    """The same on a router that keeps two models loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 2
        self.swaps = SwapBoard(self.capacity, bound=30.0, grace=5.0, loaded=("a", "b"))


class StateMachineTests(SynchronousTestCase):
    """The machine above, run by hypothesis."""

    def test_state_machine(self) -> None:
        """Random asks, ends and waits keep the rules, with room for one model or two."""
        run_state_machine_as_test(SwapMachine)
        run_state_machine_as_test(TwoSlotMachine)
