# -*- test-case-name: loopd.test.test_queue_terms -*-
"""
A lease's terms: the one place that owns their shape, their wire encoding, the refresh period
they imply and the rule by which they grow (the seed's "The Lease's terms", its ADR 0009).

The daemon writes terms through L{LeaseTerms.to_wire}, and the client reads them back through
L{LeaseTerms.from_wire}; both derive refresh periods through L{LeaseTerms.beat_period_ms} and
L{heartbeat_period_ms}. The TTL term only ever grows (L{LeaseTerms.grown}); the idle-yield
window is the one the lease was granted under.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

__all__ = ["BEAT_FLOOR_MS", "LeaseTerms", "heartbeat_period_ms"]

#: The shortest keyed-beat period a TTL implies, in milliseconds.
BEAT_FLOOR_MS = 250


def _wire_ms(value: object) -> int | None:
    """
    A wire field read as a whole, non-negative number of milliseconds (JavaScript number
    rules: C{2.0} is 2, booleans are not numbers), or C{None}.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if value >= 0 else None


@dataclass(frozen=True)
class LeaseTerms:
    """
    The TTL and the idle-yield window a lease is held under, in milliseconds
    (C{idle_yield_ms=0}: never idle-yielded).
    """

    lease_ttl_ms: int
    idle_yield_ms: int

    def grown(self, queue_ttl_ms: int) -> LeaseTerms:
        """
        Return the terms after a refresh under a queue whose TTL is now C{queue_ttl_ms}: the
        TTL becomes the longer of the two, the idle-yield window stays.
        """
        if queue_ttl_ms <= self.lease_ttl_ms:
            return self
        return replace(self, lease_ttl_ms=queue_ttl_ms)

    def beat_period_ms(self) -> float:
        """
        Return the keyed activity beat's period: C{leaseTtlMs / 3} (floor 250 ms), and at
        most C{idleYieldMs / 2} so a live holder is never idle-yielded between beats.
        """
        period = max(float(BEAT_FLOOR_MS), self.lease_ttl_ms / 3)
        if self.idle_yield_ms > 0:
            period = min(period, self.idle_yield_ms / 2)
        return period

    def to_wire(self) -> dict[str, int]:
        """
        Return the terms as the C{granted} reply's fields.
        """
        return {"leaseTtlMs": self.lease_ttl_ms, "idleYieldMs": self.idle_yield_ms}

    @classmethod
    def from_wire(cls, message: Mapping[str, object], fallback: LeaseTerms) -> LeaseTerms:
        """
        Read the terms of a C{granted} reply; a field the daemon did not send (an older
        daemon) or sent malformed comes from C{fallback}, the client's copy of the config.
        """
        ttl = _wire_ms(message.get("leaseTtlMs"))
        idle = _wire_ms(message.get("idleYieldMs"))
        return cls(
            fallback.lease_ttl_ms if ttl is None or ttl == 0 else ttl,
            fallback.idle_yield_ms if idle is None else idle,
        )


def heartbeat_period_ms(terms: Iterable[LeaseTerms], fallback: LeaseTerms) -> float:
    """
    Return the bare heartbeat's period: the smallest beat period across the leases it
    covers, or the fallback's when it covers none.
    """
    return min((t.beat_period_ms() for t in terms), default=fallback.beat_period_ms())
