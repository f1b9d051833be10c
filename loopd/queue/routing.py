# -*- test-case-name: loopd.test.test_queue_routing -*-
"""
Queue addressing: the one place that turns C{llm-queue.json} (plus the optional models
catalog) into "which queue, with which settings" for a queue key (ADR 0005, DESIGN §24).

L{address_model} is the client's side (the key a model's requests queue under) and
L{address_endpoint} the daemon's (the queue a client's C{queueKey} names); L{PolicyRouter}
is the scheduler's router over the latter.

Inside C{twist loopd} the gateway's endpoints are queues too: an endpoint's name is its queue
key, and its queue has as many streams as the server has slots, unless the policy names that
key itself (its own entry, or a group that owns it, decides then). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from loopd.queue.catalog import EMPTY_CATALOG, ModelsCatalog
from loopd.queue.policy import Policy, QueueEntry, QueueSettings

__all__ = ["PolicyRouter", "Route", "address_endpoint", "address_model"]


@dataclass(frozen=True)
class Route:
    """Where a queue key leads: the queue that owns its slots, and that queue's settings."""

    queue_key: str
    settings: QueueSettings


def _group_naming(policy: Policy, name: str) -> QueueEntry | None:
    """The first enabled group whose C{match} names C{name} exactly."""
    return next((e for e in policy.queues if e.is_group and name in (e.match or ())), None)


def address_model(policy: Policy, provider: str, base_url: str) -> str:
    """
    The queue key a client acquires with for a model: the group naming its provider
    (split), else the group naming its endpoint (merge), else its baseUrl.
    """
    group = _group_naming(policy, provider) or _group_naming(policy, base_url)
    return group.key if group is not None else base_url


def address_endpoint(policy: Policy, key: str, catalog: ModelsCatalog = EMPTY_CATALOG) -> Route:
    """
    The queue a daemon client's C{queueKey} names (DESIGN §24).

    A group's own name is that group; a key that a group's C{match} names exactly belongs
    to the first such group, ahead of the key's own entry. A provider name reaches its
    endpoint only through C{catalog}, and the endpoint then belongs to the group naming
    it, else to its own queue. An endpoint's queue takes its own entry's settings, else
    those of the first entry of a provider serving it (a baseUrl key wins), else the
    defaults; a key nothing names is a queue of its own with the defaults.
    """
    base = policy.defaults.queue
    own = policy.entry(key)
    group = own if own is not None and own.match is not None else _group_naming(policy, key)
    url = catalog.base_url(key)
    if group is None and url is not None:
        group = _group_naming(policy, url)
    if group is not None:
        return Route(group.key, group.settings(base))
    endpoint = key if url is None else url
    serving = set(catalog.providers_at(endpoint))
    entry = policy.entry(endpoint) or next(
        (e for e in policy.queues if e.match is None and e.key in serving), None
    )
    return Route(endpoint, base if entry is None else entry.settings(base))


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
