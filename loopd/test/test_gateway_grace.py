"""
Tests for the grace's cost rule and what it learns (L{loopd.gateway.grace}): the release
time (idling beside a waiter), a fresh endpoint still learning, the prompt speed, the loss
share of returning sessions and which completions count as those.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.grace import (
    LEARN_SAMPLES,
    LOSS_WINDOW,
    MIN_PROMPT_TOKENS,
    PRIOR_PROMPT_TOKENS_PER_SECOND,
    EndpointCosts,
    SwitchCosts,
    release_at,
)
from loopd.llama.info import CacheOutcome
from loopd.llama.types import Timings

HIT = CacheOutcome(loss=False, expected=100, cached=100)
LOSS = CacheOutcome(loss=True, expected=100, cached=0)

times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


class ReleaseAtTests(SynchronousTestCase):
    """
    L{release_at}: the grace's end while nobody waits, else no later than the moment the
    slot has idled beside the longest waiter for the expected re-prefill.
    """

    def test_nobody_waits(self) -> None:
        """No waiter: the whole grace, whatever the re-prefill costs."""
        self.assertEqual(release_at(12.0, 13.0, None, 0.0), 13.0)
        self.assertEqual(release_at(12.0, 13.0, None, 99.0), 13.0)

    def test_waiter_cuts(self) -> None:
        """A waiter since 12.2 (in the grace) and a 0.5 s re-prefill: released at 12.7."""
        self.assertEqual(release_at(12.0, 13.0, 12.2, 0.5), 12.7)

    def test_waited_through_the_turn(self) -> None:
        """A waiter since 10.0, before the grace began at 12.0: the idling counts from 12.0."""
        self.assertEqual(release_at(12.0, 13.0, 10.0, 0.5), 12.5)

    def test_costly_keeps_grace(self) -> None:
        """A re-prefill dearer than the rest of the grace: the grace's end."""
        self.assertEqual(release_at(12.0, 13.0, 12.2, 5.0), 13.0)

    def test_free_switch(self) -> None:
        """A re-prefill of nothing: released when the grace or the wait began."""
        self.assertEqual(release_at(12.0, 13.0, 10.0, 0.0), 12.0)
        self.assertEqual(release_at(12.0, 13.0, 12.4, 0.0), 12.4)

    @given(times, times, st.none() | times, times)
    def test_never_past_the_grace(
        self, began: float, length: float, since: float | None, reprefill: float
    ) -> None:
        """
        Never later than the grace's end; with a waiter, never later than its idle
        deadline, and never before the grace began.
        """
        grace_ends = began + length
        at = release_at(began, grace_ends, since, reprefill)
        self.assertLessEqual(at, grace_ends)
        self.assertGreaterEqual(at, began)
        if since is not None:
            self.assertLessEqual(at, max(began, since) + reprefill)


class LearningTests(SynchronousTestCase):
    """
    A fresh endpoint: the prior prompt speed, and a loss share that is unknown until
    LEARN_SAMPLES returning sessions were seen, a switch priced at nothing meanwhile.
    """

    def test_fresh_endpoint(self) -> None:
        """Nothing observed: 1,000 tokens/s, the share unknown, a switch free."""
        costs = SwitchCosts()
        fresh = costs.costs("tiny")
        self.assertEqual(fresh.prompt_tokens_per_second, PRIOR_PROMPT_TOKENS_PER_SECOND)
        self.assertIsNone(fresh.loss_share)
        self.assertEqual((fresh.speed_samples, len(fresh.losses)), (0, 0))
        self.assertEqual(costs.reprefill_seconds("tiny", 2000), 0.0)
        self.assertEqual(costs.endpoints(), [])

    def test_learned_after_samples(self) -> None:
        """
        Losses only: unknown until the LEARN_SAMPLES-th, then 1; 2,000 tokens then cost 2 s
        at the prior speed.
        """
        costs = EndpointCosts()
        shares = []
        for _ in range(LEARN_SAMPLES + 1):
            shares.append(costs.loss_share)
            costs.losses.append(True)
        shares.append(costs.loss_share)
        self.assertEqual(shares, [None] * LEARN_SAMPLES + [1.0, 1.0])
        self.assertEqual(costs.reprefill_seconds(2000), 2.0)

    def test_mixed_samples(self) -> None:
        """One loss and one hit: a share of a half, so half the re-prefill."""
        costs = EndpointCosts()
        costs.losses.extend([True, False])
        self.assertEqual(costs.loss_share, 0.5)
        self.assertEqual(costs.reprefill_seconds(2000), 1.0)

    def test_negative_context(self) -> None:
        """A negative context is a programming error, named."""
        error = self.assertRaises(ValueError, EndpointCosts().reprefill_seconds, -1)
        self.assertEqual(str(error), "context_tokens must be >= 0, got -1")


class SpeedTests(SynchronousTestCase):
    """
    The prompt speed: token-weighted, fading, from completions that evaluated enough tokens.
    """

    def test_first_sample_replaces_prior(self) -> None:
        """One completion of 500 tokens at 5,000 tokens/s: the speed is 5,000."""
        costs = SwitchCosts()
        costs.observe("tiny", 0, "a", Timings(prompt_n=500, prompt_per_second=5000.0), None)
        self.assertAlmostEqual(costs.costs("tiny").prompt_tokens_per_second, 5000.0)
        self.assertEqual(costs.costs("tiny").speed_samples, 1)
        self.assertEqual(costs.endpoints(), ["tiny"])

    def test_weighted_by_tokens(self) -> None:
        """1,000 tokens in 1 s and then 1,000 in 0.25 s: nearer the newer, by the fading."""
        costs = EndpointCosts()
        costs.observe_speed(Timings(prompt_n=1000, prompt_per_second=1000.0))
        costs.observe_speed(Timings(prompt_n=1000, prompt_per_second=4000.0))
        # (0.8 * 1000 + 1000) tokens / (0.8 * 1 + 0.25) s
        self.assertAlmostEqual(costs.prompt_tokens_per_second, 1800 / 1.05)

    def test_not_samples(self) -> None:
        """Too few tokens, no speed, a zero, infinite or NaN speed: no sample."""
        costs = EndpointCosts()
        few = MIN_PROMPT_TOKENS - 1
        for timings in (
            Timings(prompt_n=few, prompt_per_second=10.0),
            Timings(prompt_n=500),
            Timings(prompt_n=500, prompt_per_second=0.0),
            Timings(prompt_n=500, prompt_per_second=float("inf")),
            Timings(prompt_n=500, prompt_per_second=float("nan")),
        ):
            costs.observe_speed(timings)
        self.assertEqual(costs.speed_samples, 0)
        self.assertEqual(costs.prompt_tokens_per_second, PRIOR_PROMPT_TOKENS_PER_SECOND)

    @given(
        st.lists(
            st.tuples(st.integers(0, 100_000), st.floats(1e-3, 1e7, allow_nan=False)),
            max_size=20,
        )
    )
    def test_between_samples(self, samples: list[tuple[int, float]]) -> None:
        """The learned speed always lies between the slowest and fastest sample taken."""
        costs = EndpointCosts()
        taken = []
        for tokens, speed in samples:
            costs.observe_speed(Timings(prompt_n=tokens, prompt_per_second=speed))
            if tokens >= MIN_PROMPT_TOKENS:
                taken.append(speed)
        learned = costs.prompt_tokens_per_second
        if taken:
            self.assertGreaterEqual(learned, min(taken) * (1 - 1e-9))
            self.assertLessEqual(learned, max(taken) * (1 + 1e-9))
        else:
            self.assertEqual(learned, PRIOR_PROMPT_TOKENS_PER_SECOND)


class ReturningSessionTests(SynchronousTestCase):
    """
    Only a session that comes back to a slot whose last completion was not its own is a
    sample of the loss share.
    """

    def test_first_completion_no_sample(self) -> None:
        """A session's first completion (no outcome) is no sample."""
        costs = SwitchCosts()
        costs.observe("tiny", 0, "a", Timings(), None)
        self.assertEqual(list(costs.costs("tiny").losses), [])

    def test_kept_slot_no_sample(self) -> None:
        """A session that kept its slot always hits: no sample."""
        costs = SwitchCosts()
        costs.observe("tiny", 0, "a", Timings(), None)
        costs.observe("tiny", 0, "a", Timings(), HIT)
        self.assertEqual(list(costs.costs("tiny").losses), [])

    def test_switched_out(self) -> None:
        """a, then b on a's slot, then a again: a's outcome is a sample."""
        costs = SwitchCosts()
        costs.observe("tiny", 0, "a", Timings(), None)
        costs.observe("tiny", 0, "b", Timings(), None)
        costs.observe("tiny", 0, "a", Timings(), HIT)
        self.assertEqual(list(costs.costs("tiny").losses), [False])

    def test_moved_slot(self) -> None:
        """A session that moved to a slot it did not run on last is a sample."""
        costs = SwitchCosts()
        costs.observe("tiny", 0, "a", Timings(), None)
        costs.observe("tiny", 1, "a", Timings(), LOSS)
        self.assertEqual(list(costs.costs("tiny").losses), [True])

    def test_per_endpoint(self) -> None:
        """Each endpoint learns apart: a RAM-cached one's hits leave the other unknown."""
        costs = SwitchCosts()
        for _ in range(LEARN_SAMPLES):
            costs.observe("ram", 0, "a", Timings(), None)
            costs.observe("ram", 0, "b", Timings(), HIT)
            costs.observe("plain", 0, "a", Timings(), None)
            costs.observe("plain", 0, "b", Timings(), LOSS)
        self.assertEqual(costs.costs("ram").loss_share, 0.0)
        self.assertEqual(costs.reprefill_seconds("ram", 10_000), 0.0)
        self.assertEqual(costs.costs("plain").loss_share, 1.0)
        self.assertEqual(costs.reprefill_seconds("plain", 10_000), 10.0)
        self.assertIsNone(costs.costs("fresh").loss_share)

    @given(st.lists(st.booleans(), min_size=1, max_size=3 * LOSS_WINDOW))
    def test_share_of_window(self, outcomes: list[bool]) -> None:
        """Unknown below LEARN_SAMPLES; from then, the losses among the latest window."""
        costs = SwitchCosts()
        for n, loss in enumerate(outcomes):
            costs.observe("tiny", 0, f"s{n}", Timings(), LOSS if loss else HIT)
        share = costs.costs("tiny").loss_share
        window = outcomes[-LOSS_WINDOW:]
        if len(window) < LEARN_SAMPLES:
            self.assertIsNone(share)
        else:
            assert share is not None
            self.assertAlmostEqual(share, sum(window) / len(window))
