# -*- test-case-name: loopd.test.test_queue_routing -*-
"""
The scheduler's router built from a validated policy: the one place that turns
C{llm-queue.json} (plus the optional models catalog) into "which queue, with which settings"
for a client's C{queueKey}.

Inside C{twist loopd} the gateway's endpoints are queues too: an endpoint's name is its queue
key, and its queue has as many streams as the server has slots, unless the policy names that
key itself (its own entry, or a group that owns it, decides then).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from loopd.queue.policy import (
    EMPTY_CATALOG,
    ModelsCatalog,
    Policy,
    Route,
    address_endpoint,
)

__all__ = ["PolicyRouter"]

#: How many keys' routes a router remembers before it starts afresh.
_MAX_REMEMBERED = 4096


class PolicyRouter:
    """
    A scheduler router over one policy. Build a new one on reload; it is immutable.
    """

    def __init__(
        self,
        policy: Policy,
        catalog: ModelsCatalog = EMPTY_CATALOG,
        slot_counts: Mapping[str, int] | None = None,
    ) -> None:
        """
        @param slot_counts: queue key → the slot count that is its default C{maxStreams}
            (loopd's endpoints); a key the policy names keeps the policy's settings.
        """
        self.policy = policy
        self.catalog = catalog
        self._slot_counts = dict(slot_counts or {})
        self._routes: dict[str, Route] = {}

    def __call__(self, queue_key: str) -> Route:
        """
        Return the queue C{queue_key} leads to and its settings (DESIGN §24).

        Routes are remembered (the router is immutable and every op asks); the memory is
        bounded, since clients choose the keys.
        """
        route = self._routes.get(queue_key)
        if route is None:
            if len(self._routes) >= _MAX_REMEMBERED:
                self._routes.clear()
            route = self._routes[queue_key] = self._resolve(queue_key)
        return route

    def _resolve(self, queue_key: str) -> Route:
        """Work out the route of C{queue_key}."""
        route = address_endpoint(self.policy, queue_key, self.catalog)
        slots = self._slot_counts.get(route.queue_key)
        if slots is None or self.policy.entry(route.queue_key) is not None:
            return route
        return Route(route.queue_key, replace(route.settings, max_streams=slots))
