# -*- test-case-name: loopd.test.test_gateway_metrics -*-
"""
The lease scheduler's numbers as Prometheus metrics, read from the scheduler at every scrape:
grants, releases, evictions and switches since start, and per queue the holders, the
waiters and the switches.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from loopd.queue.scheduler import Scheduler

__all__ = ["SchedulerCollector"]


class SchedulerCollector(Collector):
    """
    A collector over one L{Scheduler}; it keeps no numbers of its own.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        """
        @param scheduler: the scheduler to read at each scrape.
        """
        self._scheduler = scheduler

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """
        Yield the scheduler's totals and its per-queue gauges.
        """
        counters = self._scheduler.counters()
        status = self._scheduler.status()
        totals = (
            (
                "loopd_lease_grants",
                "Leases granted (a direct grant or a queued waiter's).",
                counters.grants,
            ),
            (
                "loopd_lease_releases",
                "Leases given back (release, cancel, disconnect, idle yield).",
                counters.releases,
            ),
            (
                "loopd_lease_evictions",
                "Leases reclaimed because their TTL lapsed.",
                counters.evictions,
            ),
        )
        for name, documentation, value in totals:
            yield CounterMetricFamily(name, documentation, value=value)
        switches = CounterMetricFamily(
            "loopd_lease_switches",
            "Session switches: grants of a queued waiter, each a KV-cache re-prefill.",
            labels=["queue"],
        )
        holders = GaugeMetricFamily(
            "loopd_lease_holders", "Sessions holding a lease now.", labels=["queue"]
        )
        waiters = GaugeMetricFamily(
            "loopd_lease_waiters", "Sessions waiting for a lease now.", labels=["queue"]
        )
        for queue in status:
            key = [queue["queueKey"]]
            switches.add_metric(key, queue["switches"])
            holders.add_metric(key, len(queue["holders"]))
            waiters.add_metric(key, len(queue["waiting"]))
        yield switches
        yield holders
        yield waiters
