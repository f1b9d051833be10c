# -*- test-case-name: loopd.test.test_gateway_metrics -*-
"""
The gateway's Prometheus metrics, served at C{GET /metrics}.

Each L{GatewayMetrics} owns its own C{CollectorRegistry}, never the process-wide default, so
several gateways (or tests) in one process keep separate counts. Every metric is labelled by
the endpoint's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from twisted.logger import Logger

from loopd.gateway.auto import AutoRouter
from loopd.gateway.queue_metrics import SchedulerCollector
from loopd.gateway.router_metrics import RouterCollector
from loopd.llama.types import Timings
from loopd.queue.scheduler import Scheduler

__all__ = ["TTFT_BUCKETS", "GatewayMetrics"]

_log = Logger(namespace="loopd.gateway.metrics")

#: Histogram buckets for the time to first token, in seconds: a cached turn answers in
#: milliseconds, a long prompt on a small machine can take minutes.
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    math.inf,
)


class GatewayMetrics:
    """
    The gateway's counters, histogram and gauge on a registry of their own.

    @ivar registry: the registry every metric here is registered with.
    @ivar requests_total: C{loopd_requests_total{endpoint, outcome}}; outcome is C{"ok"} or
        an error code.
    @ivar time_to_first_token_seconds: C{loopd_time_to_first_token_seconds{endpoint}}.
    @ivar tokens_total: C{loopd_tokens_total{endpoint, kind}}; kind C{prompt} counts the
        prompt tokens the server evaluated, C{cached} those it reused from its cache (the two
        together are the whole prompt), C{completion} those it generated.
    @ivar cache_losses_total: C{loopd_cache_losses_total{endpoint}}.
    @ivar queue_depth: C{loopd_queue_depth{endpoint}}, requests waiting at the gate.
    """

    def __init__(self) -> None:
        """Create the metrics on a new registry."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests_total = Counter(
            "loopd_requests_total",
            "Chat completion requests by endpoint and outcome (ok or an error code).",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.time_to_first_token_seconds = Histogram(
            "loopd_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tokens_total = Counter(
            "loopd_tokens_total",
            "Tokens by kind: prompt (evaluated), cached (reused), completion (generated).",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self.cache_losses_total = Counter(
            "loopd_cache_losses_total",
            "Completions that reused less of the session's previous context than expected.",
            ["endpoint"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "loopd_queue_depth",
            "Requests waiting for a slot.",
            ["endpoint"],
            registry=self.registry,
        )
        # Endpoints whose queue depth is read from a callable at scrape time.
        self._depth_sources: set[str] = set()

    def observe_request(self, endpoint: str, outcome: str) -> None:
        """Count one finished request of C{endpoint}: C{"ok"} or its error code."""
        self.requests_total.labels(endpoint, outcome).inc()

    def observe_first_token(self, endpoint: str, seconds: float) -> None:
        """Record how long a request of C{endpoint} took to its first token."""
        self.time_to_first_token_seconds.labels(endpoint).observe(seconds)

    def observe_completion(self, endpoint: str, timings: Timings) -> None:
        """Add a completion's prompt, cached and generated token counts."""
        self.tokens_total.labels(endpoint, "prompt").inc(timings.prompt_n)
        self.tokens_total.labels(endpoint, "cached").inc(timings.cache_n)
        self.tokens_total.labels(endpoint, "completion").inc(timings.predicted_n)

    def observe_cache_loss(self, endpoint: str) -> None:
        """Count one cache loss on C{endpoint}."""
        self.cache_losses_total.labels(endpoint).inc()

    def set_queue_depth(self, endpoint: str, n: int | Callable[[], int]) -> None:
        """
        Set C{endpoint}'s queue depth: a number now, or a callable read at every scrape.

        A callable that raises is logged and reported as NaN for that scrape.
        """
        if endpoint in self._depth_sources:
            # A child backed by a function ignores set(); start the series afresh.
            self.queue_depth.remove(endpoint)
            self._depth_sources.discard(endpoint)
        child = self.queue_depth.labels(endpoint)
        if callable(n):
            child.set_function(_guarded(endpoint, n))
            self._depth_sources.add(endpoint)
        else:
            child.set(n)

    def watch_scheduler(self, scheduler: Scheduler) -> None:
        """
        Add the lease scheduler's metrics (C{loopd_lease_*}), read from it at every scrape.
        """
        self.registry.register(SchedulerCollector(scheduler))

    def watch_router(self, router: AutoRouter, now: Callable[[], float]) -> None:
        """
        Add the C{auto} router's measurements (C{loopd_auto_*}), read at every scrape.
        """
        self.registry.register(RouterCollector(router, now))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric here, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _guarded(endpoint: str, source: Callable[[], int]) -> Callable[[], float]:
    """Wrap a queue-depth source so that one failing source does not fail the scrape."""

    def read() -> float:
        try:
            return float(source())
        except Exception:
            _log.failure("queue depth source for {endpoint} raised", endpoint=endpoint)
            return math.nan

    return read
