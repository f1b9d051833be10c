"""
Tests for L{loopd.tap}: the helpers the C{twist} commands share.
"""

from __future__ import annotations

import gc

from twisted.internet.testing import MemoryReactor
from twisted.trial.unittest import SynchronousTestCase

from loopd.tap import freeze_startup_objects


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
