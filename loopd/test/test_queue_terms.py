"""
Tests for L{loopd.queue.terms}: the lease terms' wire shape, refresh periods and growth.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.terms import BEAT_FLOOR_MS, LeaseTerms, heartbeat_period_ms

FALLBACK = LeaseTerms(30_000, 30_000)


class BeatPeriodTests(SynchronousTestCase):
    """
    The keyed beat runs at TTL/3 with a 250 ms floor, and at most half the idle window.
    """

    def test_third_of_ttl(self) -> None:
        """A 30 s TTL without idle yield beats every 10 s."""
        self.assertEqual(LeaseTerms(30_000, 0).beat_period_ms(), 10_000)

    def test_idle_window_caps(self) -> None:
        """A 10 s idle window caps a 60 s TTL's 20 s period at 5 s."""
        self.assertEqual(LeaseTerms(60_000, 10_000).beat_period_ms(), 5_000)

    def test_floor(self) -> None:
        """A TTL whose third is under 250 ms beats at 250 ms."""
        self.assertEqual(LeaseTerms(600, 0).beat_period_ms(), BEAT_FLOOR_MS)

    def test_short_idle_window_beats_within_it(self) -> None:
        """A 300 ms idle window beats at 150 ms, under the floor, so it never lapses."""
        self.assertEqual(LeaseTerms(30_000, 300).beat_period_ms(), 150)

    @given(st.integers(1000, 10**9), st.integers(0, 10**9))
    def test_never_lapses(self, ttl: int, idle: int) -> None:
        """The period is shorter than the TTL and at most half a non-zero idle window."""
        period = LeaseTerms(ttl, idle).beat_period_ms()
        self.assertLess(period, ttl)
        if idle:
            self.assertLessEqual(period, idle / 2)

    def test_heartbeat_smallest(self) -> None:
        """The bare heartbeat runs at the smallest period of the leases it covers."""
        terms = [LeaseTerms(30_000, 0), LeaseTerms(3_000, 0), LeaseTerms(60_000, 4_000)]
        self.assertEqual(heartbeat_period_ms(terms, FALLBACK), 1_000)

    def test_heartbeat_without_leases(self) -> None:
        """With no lease the heartbeat follows the fallback terms."""
        self.assertEqual(heartbeat_period_ms([], FALLBACK), 10_000)


class GrowthTests(SynchronousTestCase):
    """
    The TTL term only grows; the idle window is the one granted.
    """

    def test_longer_queue_ttl_applies(self) -> None:
        """A lengthened queue TTL applies at once."""
        self.assertEqual(LeaseTerms(10_000, 500).grown(20_000), LeaseTerms(20_000, 500))

    def test_shorter_queue_ttl_ignored(self) -> None:
        """A shortened queue TTL leaves the held term alone."""
        terms = LeaseTerms(10_000, 500)
        self.assertIs(terms.grown(2_000), terms)


class WireTests(SynchronousTestCase):
    """
    The granted reply's C{leaseTtlMs} and C{idleYieldMs} fields.
    """

    def test_round_trip(self) -> None:
        """Terms written to the wire read back equal."""
        terms = LeaseTerms(12_000, 0)
        self.assertEqual(terms.to_wire(), {"leaseTtlMs": 12_000, "idleYieldMs": 0})
        self.assertEqual(LeaseTerms.from_wire(terms.to_wire(), FALLBACK), terms)

    def test_missing_fields_fall_back(self) -> None:
        """A daemon that sends no terms leaves the client's config in charge."""
        self.assertEqual(LeaseTerms.from_wire({"op": "granted"}, FALLBACK), FALLBACK)

    def test_malformed_fields_fall_back(self) -> None:
        """Booleans, strings, fractions, negatives and a zero TTL are not terms."""
        for ttl, idle in [(True, False), ("9", "9"), (1.5, -1), (0, None)]:
            message = {"leaseTtlMs": ttl, "idleYieldMs": idle}
            self.assertEqual(LeaseTerms.from_wire(message, FALLBACK), FALLBACK, message)

    def test_integral_float(self) -> None:
        """C{2000.0} is the integer 2000, as in JavaScript."""
        message = {"leaseTtlMs": 2000.0, "idleYieldMs": 0.0}
        self.assertEqual(LeaseTerms.from_wire(message, FALLBACK), LeaseTerms(2000, 0))
