"""
Tests for L{loopd.tap}: the helpers the C{twist} commands share.
"""

from __future__ import annotations

import gc

from twisted.internet.testing import MemoryReactor
from twisted.trial.unittest import SynchronousTestCase

from loopd.tap import freeze_startup_objects, non_negative_float


class FreezeTests(SynchronousTestCase):
    """L{freeze_startup_objects} freezes the collector's objects once the reactor runs."""

    def test_frozen_when_running(self) -> None:
        """Nothing happens before the reactor runs; then what exists is frozen."""
        self.addCleanup(gc.unfreeze)
        gc.unfreeze()
        reactor = MemoryReactor()
        freeze_startup_objects(reactor)
        self.assertEqual(gc.get_freeze_count(), 0)
        ((call, args, kwargs),) = reactor.whenRunningHooks
        call(*args, **kwargs)
        self.assertGreater(gc.get_freeze_count(), 0)


class NonNegativeFloatTests(SynchronousTestCase):
    """L{non_negative_float} takes zero and positive finite numbers only."""

    def test_values(self) -> None:
        """0 and 4.5 are taken; a negative, infinite or NaN value is refused."""
        self.assertEqual((non_negative_float("0"), non_negative_float("4.5")), (0.0, 4.5))
        for bad in ("-1", "inf", "nan", "x"):
            self.assertRaises(ValueError, non_negative_float, bad)
