"""
Tests for the pure parts of L{loopd.llama.info}: the cache-loss judgement between two turns,
the reading of a C{/slots} answer (its counters included), whether a slot must wait, and which
slots may be running a request.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import InferError, Protocol
from loopd.llama.info import (
    CacheOutcome,
    SharedRequest,
    SlotState,
    cache_outcome,
    parse_slots,
    slot_busy,
    slots_serving,
)
from loopd.llama.types import Timings

#: A previous turn whose whole context is 1000 tokens (cache_n + prompt_n + predicted_n).
PREVIOUS = Timings(cache_n=600, prompt_n=400, predicted_n=100)

counts = st.integers(min_value=0, max_value=10**7)
timings = st.builds(Timings, cache_n=counts, prompt_n=counts, predicted_n=counts)


class CacheOutcomeTests(SynchronousTestCase):
    """cache_outcome: more than 64 tokens short of the previous prompt is a loss."""

    def test_exactly_threshold_short_is_no_loss(self) -> None:
        """A turn that reused all but exactly 64 tokens of the previous prompt is no loss."""
        outcome = cache_outcome(PREVIOUS, Timings(cache_n=936, prompt_n=80, predicted_n=5))
        self.assertEqual(outcome, CacheOutcome(loss=False, expected=1000, cached=936))
        self.assertEqual(outcome.shortfall, 64)

    def test_one_more_short_is_loss(self) -> None:
        """65 tokens short is a loss, reported with both numbers and the shortfall."""
        outcome = cache_outcome(PREVIOUS, Timings(cache_n=935, prompt_n=80, predicted_n=5))
        self.assertEqual(outcome, CacheOutcome(loss=True, expected=1000, cached=935))
        self.assertEqual(outcome.shortfall, 65)

    def test_whole_cache_lost(self) -> None:
        """A turn that reused nothing is a loss of the whole previous prompt."""
        outcome = cache_outcome(PREVIOUS, Timings(prompt_n=1200))
        self.assertEqual((outcome.loss, outcome.expected, outcome.cached), (True, 1000, 0))
        self.assertEqual(outcome.shortfall, 1000)

    def test_reused_more_than_expected(self) -> None:
        """Reusing more than the previous prompt is no loss and no shortfall."""
        outcome = cache_outcome(PREVIOUS, Timings(cache_n=1010, prompt_n=20))
        self.assertEqual(outcome, CacheOutcome(loss=False, expected=1000, cached=1010))
        self.assertEqual(outcome.shortfall, 0)

    def test_answer_rendered_anew(self) -> None:
        """
        The previous answer is not expected to be reused: a template renders it anew (its
        thinking dropped), so a turn that reused the whole previous prompt and none of the
        answer is a hit.
        """
        outcome = cache_outcome(PREVIOUS, Timings(cache_n=1000, prompt_n=150))
        self.assertEqual(outcome, CacheOutcome(loss=False, expected=1000, cached=1000))

    def test_first_turn(self) -> None:
        """After a turn with no counts at all (all zero) nothing can be lost."""
        outcome = cache_outcome(Timings(), Timings(prompt_n=500, predicted_n=40))
        self.assertEqual(outcome, CacheOutcome(loss=False, expected=0, cached=0))

    def test_threshold_parameter(self) -> None:
        """The threshold is a parameter (Config.cache_loss_tokens): 0 makes any shortfall a loss."""
        current = Timings(cache_n=999)
        self.assertTrue(cache_outcome(PREVIOUS, current, threshold=0).loss)
        self.assertFalse(cache_outcome(PREVIOUS, Timings(cache_n=1000), threshold=0).loss)
        self.assertFalse(cache_outcome(PREVIOUS, Timings(cache_n=900), threshold=100).loss)

    @given(timings, timings, st.integers(min_value=0, max_value=10**4))
    def test_property(self, previous: Timings, current: Timings, threshold: int) -> None:
        """
        A loss is exactly a shortfall of the previous prompt over the threshold; only
        current.cache_n counts.
        """
        outcome = cache_outcome(previous, current, threshold)
        expected = previous.cache_n + previous.prompt_n
        self.assertEqual((outcome.expected, outcome.cached), (expected, current.cache_n))
        self.assertEqual(outcome.shortfall, max(0, expected - current.cache_n))
        self.assertEqual(outcome.loss, outcome.shortfall > threshold)
        same_cache = Timings(cache_n=current.cache_n)
        self.assertEqual(cache_outcome(previous, same_cache, threshold), outcome)


class ParseSlotsTests(SynchronousTestCase):
    """parse_slots reads a /slots answer or fails with Protocol."""

    def test_good(self) -> None:
        """Each entry gives its id and whether it is processing; other fields are ignored."""
        answer = [
            {"id": 0, "n_ctx": 4096, "is_processing": True, "params": {"n_predict": -1}},
            {"id": 1, "n_ctx": 4096, "is_processing": False, "speculative": False},
        ]
        self.assertEqual(parse_slots(answer), (SlotState(0, True), SlotState(1, False)))

    def test_empty(self) -> None:
        """An empty list is a server without slots."""
        self.assertEqual(parse_slots([]), ())

    def test_processing_only_when_true(self) -> None:
        """A missing, null or non-boolean is_processing is read as not processing."""
        answer = [{"id": 0}, {"id": 1, "is_processing": None}, {"id": 2, "is_processing": 1}]
        self.assertEqual([s.is_processing for s in parse_slots(answer)], [False, False, False])

    def test_not_a_list(self) -> None:
        """An answer that is not a list is Protocol, which is an InferError."""
        answers: list[Any] = [{"id": 0}, None, "slots", 3, {"slots": []}]
        for answer in answers:
            error = self.assertRaises(Protocol, parse_slots, answer)
            self.assertIsInstance(error, InferError)

    def test_bad_entries(self) -> None:
        """An entry that is not an object or has no integer id is Protocol."""
        bad: list[Any] = [
            [0],
            [None],
            [[{"id": 0}]],
            [{"is_processing": True}],
            [{"id": "0", "is_processing": False}],
            [{"id": None}],
            [{"id": 0, "is_processing": False}, "slot"],
        ]
        for answer in bad:
            self.assertRaises(Protocol, parse_slots, answer)

    def test_boolean_id(self) -> None:
        """A boolean id is not an integer id (JSON true is not a number): Protocol."""
        self.assertRaises(Protocol, parse_slots, [{"id": True, "is_processing": False}])

    def test_counters(self) -> None:
        """
        A slot that ran a task has its counters: n_prompt_tokens, n_prompt_tokens_processed
        and next_token[0].n_decoded (the shape of llama.cpp's server during a prefill).
        """
        answer = [
            {
                "id": 0,
                "is_processing": True,
                "id_task": 5,
                "n_prompt_tokens": 4096,
                "n_prompt_tokens_processed": 2048,
                "n_prompt_tokens_cache": 0,
                "next_token": [{"has_next_token": True, "n_decoded": 0, "n_remain": 5}],
            },
            {"id": 1, "n_ctx": 4096, "is_processing": False, "speculative": False},
        ]
        self.assertEqual(
            parse_slots(answer), (SlotState(0, True, (4096, 2048, 0)), SlotState(1, False))
        )

    def test_counters_of_other_shapes(self) -> None:
        """
        A next_token object instead of a list of one, an empty list, and counters that are
        not integers (null, a boolean, a float, a string) read as None, never as an error.
        """
        shapes: list[tuple[dict[str, Any], Any]] = [
            ({"n_prompt_tokens": 3, "next_token": {"n_decoded": 7}}, (3, None, 7)),
            ({"n_prompt_tokens_processed": 2, "next_token": []}, (None, 2, None)),
            ({"n_prompt_tokens": None, "n_prompt_tokens_processed": True}, (None, None, None)),
            ({"n_prompt_tokens": 1.5, "next_token": [{"n_decoded": "4"}]}, (None, None, None)),
            ({"next_token": [7]}, (None, None, None)),
        ]
        for fields, counters in shapes:
            (slot,) = parse_slots([{"id": 0, "is_processing": True, **fields}])
            self.assertEqual(slot.counters, counters, fields)


class SlotsServingTests(SynchronousTestCase):
    """slots_serving: the slots that may be running a request for a slot."""

    SLOTS = (SlotState(0, True), SlotState(1, False), SlotState(2, True))

    def test_pinned(self) -> None:
        """A pinned request's own slot, taken modulo the slot count."""
        self.assertEqual(slots_serving(self.SLOTS, 1), (SlotState(1, False),))
        self.assertEqual(slots_serving(self.SLOTS, 5), (SlotState(2, True),))

    def test_any(self) -> None:
        """A request for slot -1 may be on any slot: all of them."""
        self.assertEqual(slots_serving(self.SLOTS, -1), self.SLOTS)

    def test_none(self) -> None:
        """A server that lists no slots runs the request on none."""
        self.assertEqual((slots_serving((), 0), slots_serving((), -1)), ((), ()))


class SlotBusyTests(SynchronousTestCase):
    """slot_busy: whether a request for a slot must wait."""

    SLOTS = (SlotState(0, True), SlotState(1, False), SlotState(2, True))

    def test_pinned_slot(self) -> None:
        """A pinned request waits exactly when its own slot is processing."""
        self.assertEqual([slot_busy(self.SLOTS, n) for n in range(3)], [True, False, True])

    def test_modulo(self) -> None:
        """A slot number past the last slot is taken modulo the slot count, as the server does."""
        self.assertEqual(
            [slot_busy(self.SLOTS, n) for n in (3, 4, 5, 7)], [True, False, True, False]
        )

    def test_any_slot(self) -> None:
        """For slot -1 the request waits only when every slot is processing."""
        self.assertFalse(slot_busy(self.SLOTS, -1))
        self.assertTrue(slot_busy((SlotState(0, True), SlotState(1, True)), -1))
        self.assertFalse(slot_busy((SlotState(0, False),), -1))

    def test_no_slots(self) -> None:
        """A server that lists no slots keeps no request waiting."""
        self.assertFalse(slot_busy((), 0))
        self.assertFalse(slot_busy((), -1))

    @given(st.lists(st.booleans(), min_size=1, max_size=8), st.integers(0, 100))
    def test_pinned_property(self, busy: list[bool], slot: int) -> None:
        """For any slot list and slot number >= 0, the answer is that of slot % count."""
        slots = tuple(SlotState(n, b) for n, b in enumerate(busy))
        self.assertEqual(slot_busy(slots, slot), busy[slot % len(busy)])


class SharedRequestTests(SynchronousTestCase):
    """One request of a kind in flight, shared by its callers, cancelled with the last."""

    def setUp(self) -> None:
        self.started: list[Deferred[Any]] = []
        self.cancelled: list[Deferred[Any]] = []
        self.shared = SharedRequest(self.start)

    def start(self) -> Deferred[Any]:
        """Start one request, answered by hand."""
        running: Deferred[Any] = Deferred(self.cancelled.append)
        self.started.append(running)
        return running

    def test_callers_share_one(self) -> None:
        """Callers while one runs share its answer; the next call after starts a new one."""
        first, second = self.shared(), self.shared()
        self.assertEqual(len(self.started), 1)
        self.assertTrue(self.shared.in_flight)
        self.started[0].callback("slots")
        self.assertEqual(
            (self.successResultOf(first), self.successResultOf(second)), ("slots",) * 2
        )
        self.assertFalse(self.shared.in_flight)
        self.shared()
        self.assertEqual(len(self.started), 2)

    def test_failure_shared(self) -> None:
        """A failure reaches every caller."""
        first, second = self.shared(), self.shared()
        self.started[0].errback(Protocol("bad"))
        self.failureResultOf(first, Protocol)
        self.failureResultOf(second, Protocol)

    def test_last_caller_gone_cancels(self) -> None:
        """One caller leaving keeps the request; the last leaving cancels it."""
        first, second = self.shared(), self.shared()
        first.cancel()
        self.failureResultOf(first, CancelledError)
        self.assertEqual(self.cancelled, [])
        second.cancel()
        self.failureResultOf(second, CancelledError)
        self.assertEqual(self.cancelled, self.started)
        self.assertFalse(self.shared.in_flight)
