# -*- test-case-name: loopd.test.test_gateway_metrics -*-
"""
What the C{auto} router has measured, as Prometheus gauges read at every scrape: each
endpoint's mean generation speed over its current samples, how many samples count, and the
weight it is drawn with now.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from loopd.gateway.auto import AutoRouter
from loopd.gateway.router import SpeedStats

__all__ = ["RouterCollector"]


class RouterCollector(Collector):
    """
    A collector over one L{AutoRouter}; it keeps no numbers of its own.
    """

    def __init__(self, router: AutoRouter, now: Callable[[], float]) -> None:
        """
        @param router: the router to read at each scrape.
        @param now: the clock the router's samples are stamped with.
        """
        self._router = router
        self._now = now

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """
        Yield C{loopd_auto_speed_tokens_per_second} (endpoints with a current sample
        only), C{loopd_auto_samples} and C{loopd_auto_weight}, per endpoint.
        """
        now = self._now()
        speed = GaugeMetricFamily(
            "loopd_auto_speed_tokens_per_second",
            "Mean predicted_per_second of the endpoint's current samples.",
            labels=["endpoint"],
        )
        samples = GaugeMetricFamily(
            "loopd_auto_samples",
            "Speed samples that count now (3 are needed before the speed weighs).",
            labels=["endpoint"],
        )
        weight = GaugeMetricFamily(
            "loopd_auto_weight",
            "The weight the auto router draws the endpoint with now, before exploration.",
            labels=["endpoint"],
        )
        for candidate in self._router.candidates:
            stats = self._router.speeds.get(candidate.name, SpeedStats())
            current = stats.current(now)
            if current:
                speed.add_metric([candidate.name], math.fsum(current) / len(current))
            samples.add_metric([candidate.name], len(current))
            weight.add_metric([candidate.name], stats.weight(now))
        yield speed
        yield samples
        yield weight
