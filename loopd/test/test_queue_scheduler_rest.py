"""
Tests for L{loopd.queue.scheduler_rest}: the bounded table of the counters of forgotten
queues, by example and by random sequences of rests and wakes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.scheduler_rest import (
    RESTING_KEY_CHARS,
    RESTING_QUEUES,
    Gone,
    RestingQueues,
)


class RestingQueuesTests(SynchronousTestCase):
    """Resting, waking, pushing out and dropping."""

    def test_rest_and_wake(self) -> None:
        """A rested queue's switches come back once, then it rests no more."""
        table = RestingQueues()
        self.assertEqual(table.rest("q", 3), Gone())
        self.assertEqual((len(table), table.switches, table.key_chars), (1, 3, 1))
        self.assertIn("q", table)
        self.assertEqual(table.wake("q"), 3)
        self.assertEqual(table.wake("q"), 0)
        self.assertEqual((len(table), table.switches, table.key_chars), (0, 0, 0))

    def test_nothing_to_keep(self) -> None:
        """A queue with no switch is gone at once and takes no room."""
        table = RestingQueues()
        self.assertEqual(table.rest("q", 0), Gone(1, 0))
        self.assertEqual(len(table), 0)

    def test_least_recently_rested_out_first(self) -> None:
        """Past the entry cap the entry rested longest ago goes; a wake and rest renews one."""
        table = RestingQueues(max_queues=2)
        table.rest("a", 1)
        table.rest("b", 2)
        table.rest("a", table.wake("a") + 4)
        self.assertEqual(table.rest("c", 8), Gone(1, 2))
        self.assertEqual((table.wake("a"), table.wake("b"), table.wake("c")), (5, 0, 8))

    def test_character_budget(self) -> None:
        """Past the character budget the oldest keys go; a key over it alone never rests."""
        table = RestingQueues(max_key_chars=10)
        table.rest("aaaa", 1)
        table.rest("bbbb", 1)
        self.assertEqual(table.rest("cccc", 1), Gone(1, 1))
        self.assertEqual((len(table), table.key_chars), (2, 8))
        self.assertEqual(table.rest("x" * 11, 5), Gone(1, 5))
        self.assertEqual((len(table), table.switches), (2, 2))

    def test_rest_twice(self) -> None:
        """Resting a key that already rests replaces it; the old entry is gone for good."""
        table = RestingQueues()
        table.rest("q", 2)
        self.assertEqual(table.rest("q", 3), Gone(1, 2))
        self.assertEqual((len(table), table.switches), (1, 3))

    def test_drop_where(self) -> None:
        """The picked keys go for good, the others stay in order."""
        table = RestingQueues()
        for key, switches in (("u1", 1), ("u2", 2), ("u3", 4)):
            table.rest(key, switches)
        self.assertEqual(table.drop_where(lambda key: key != "u2"), Gone(2, 5))
        self.assertEqual((len(table), table.switches, table.wake("u2")), (1, 2, 2))

    def test_bounds(self) -> None:
        """The documented bounds."""
        self.assertEqual((RESTING_QUEUES, RESTING_KEY_CHARS), (4_096, 1_048_576))


KEYS = st.sampled_from(["a", "bb", "ccc", "dddd", "eeeee"])
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("rest"), KEYS, st.integers(0, 5)),
        st.tuples(st.just("wake"), KEYS, st.just(0)),
    ),
    max_size=60,
)


class RestingQueuesPropertyTests(SynchronousTestCase):
    """Random rests and wakes against a small table."""

    @settings(max_examples=200)
    @given(STEPS, st.integers(1, 3), st.integers(1, 8))
    def test_accounting(self, steps: list[tuple[str, str, int]], cap: int, chars: int) -> None:
        """
        What rests plus what is gone for good is everything rested and not woken; the
        bounds hold after every step; and the gone totals never fall.
        """
        table = RestingQueues(max_queues=cap, max_key_chars=chars)
        rested = woken = 0
        gone = Gone()
        for op, key, switches in steps:
            if op == "rest":
                if key not in table:
                    rested += switches
                    left = table.rest(key, switches)
                    self.assertGreaterEqual(min(left.queues, left.switches), 0)
                    gone += left
            else:
                woken += table.wake(key)
            self.assertLessEqual(len(table), cap)
            self.assertLessEqual(table.key_chars, chars)
            self.assertEqual(table.switches + gone.switches, rested - woken)
