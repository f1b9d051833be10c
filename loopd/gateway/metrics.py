# -*- test-case-name: loopd.test.test_gateway_metrics -*-
"""
The gateway's Prometheus metrics, served at C{GET /metrics}: its own counters, histogram and
gauge (L{GatewayMetrics}), and collectors read at every scrape: the lease scheduler's
numbers (L{SchedulerCollector}), what the C{auto} router has measured (L{RouterCollector}),
the pacing of loopd's connections to each endpoint (L{PacingCollector}), what the grace
has learned a switch costs there (L{GraceCollector}) and how its slot-file saves and
restores ended (L{SlotFileCollector}).

Each L{GatewayMetrics} owns its own C{CollectorRegistry}, never the process-wide default, so
several gateways (or tests) in one process keep separate counts. Every metric is labelled by
the endpoint's name (or the lease queue's).

C{prometheus_client} adds a C{*_created} series (a gauge of the creation time) to every
counter, histogram and summary, which doubles every family on the page for nothing a
scraper of loopd needs. Its own switch, C{disable_created_metrics()}, is process-wide and
would change the output of every other registry of a program that embeds loopd, so
L{GatewayMetrics.render} instead leaves those samples out of its own page
(L{WithoutCreated}).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.logger import Logger

from loopd.gateway.errors import GatewayError
from loopd.gateway.grace import SwitchCosts
from loopd.gateway.health import HealthBoard, State
from loopd.gateway.router import AutoRouter, SpeedStats
from loopd.gateway.swap_gate import ModelSwaps
from loopd.llama.pacing import Pacer
from loopd.llama.types import Timings
from loopd.queue.scheduler import Scheduler

__all__ = [
    "TTFT_BUCKETS",
    "GatewayMetrics",
    "GraceCollector",
    "HealthCollector",
    "PacingCollector",
    "RouterCollector",
    "SchedulerCollector",
    "SlotFileCollector",
    "WithoutCreated",
]

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
    @ivar http_refusals_total: C{loopd_http_refusals_total{status, code}}: requests and
        connections the gateway's HTTP channel refused (malformed, too large, too slow, over
        the connection cap) before any route saw them.
    @ivar http_connections_open: C{loopd_http_connections_open}, read from the site.
    @ivar dropped_tools_total: C{loopd_dropped_tools_total{door, tool}}: hosted tools the
        front doors left out of requests (DESIGN decision 43), by door and tool type.
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
        self.http_refusals_total = Counter(
            "loopd_http_refusals_total",
            "Requests and connections refused by the HTTP channel, by status and error code.",
            ["status", "code"],
            registry=self.registry,
        )
        self.http_connections_open = Gauge(
            "loopd_http_connections_open",
            "Client connections open on the gateway's listener.",
            registry=self.registry,
        )
        self.dropped_tools_total = Counter(
            "loopd_dropped_tools_total",
            "Hosted tools (web_search ...) left out of requests, by front door and tool type.",
            ["door", "tool"],
            registry=self.registry,
        )
        # Endpoints whose queue depth is read from a callable at scrape time.
        self._depth_sources: set[str] = set()

    def observe_request(self, endpoint: str, outcome: str) -> None:
        """Count one finished request of C{endpoint}: C{"ok"} or its error code."""
        self.requests_total.labels(endpoint, outcome).inc()

    def observe_refusal(self, error: GatewayError) -> None:
        """Count one refusal of the HTTP channel (its status and code)."""
        self.http_refusals_total.labels(str(error.status), error.code).inc()

    def observe_dropped_tool(self, door: str, tool: str) -> None:
        """Count one hosted tool of type C{tool} that door C{door} left out of a request."""
        self.dropped_tools_total.labels(door, tool).inc()

    def watch_connections(self, count: Callable[[], int]) -> None:
        """Read C{loopd_http_connections_open} from C{count} at every scrape."""
        self.http_connections_open.set_function(count)

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

    def watch_pacing(self, pacers: Mapping[str, Pacer]) -> None:
        """
        Add the pacing of each endpoint's connections (C{loopd_upstream_*}), read at every
        scrape.

        @param pacers: each endpoint's pacer, by name.
        """
        self.registry.register(PacingCollector(pacers))

    def watch_grace(
        self, costs: SwitchCosts, cut_short: Mapping[str, int], endpoints: Iterable[str]
    ) -> None:
        """
        Add what the grace learned of each endpoint's switch cost (C{loopd_grace_*}), read
        at every scrape (decision 37).

        @param costs: the learned switch costs.
        @param cut_short: per endpoint, the graces a waiting request cut short.
        @param endpoints: the endpoints to show, learned or not (a fresh one shows the priors).
        """
        self.registry.register(GraceCollector(costs, cut_short, endpoints))

    def watch_slot_files(self, counts: Mapping[tuple[str, str, str], int]) -> None:
        """
        Add how the slot-file saves and restores ended (C{loopd_slot_files_total}), read at
        every scrape (decision 39).

        @param counts: by C{(endpoint, action, outcome)} (L{loopd.gateway.slot_swap}).
        """
        self.registry.register(SlotFileCollector(counts))

    def watch_swaps(self, swaps: ModelSwaps) -> None:
        """
        Add each router's model swaps (C{loopd_router_swaps_total}), the requests waiting
        for one (C{loopd_router_swap_waiting}) and its learned load time
        (C{loopd_router_load_seconds}), read at every scrape (decision 46).
        """
        self.registry.register(SwapCollector(swaps))

    def watch_health(self, board: HealthBoard) -> None:
        """Add each endpoint's health (C{loopd_endpoint_up}, C{loopd_endpoint_state})."""
        self.registry.register(HealthCollector(board))

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric here, and its content type."""
        return generate_latest(WithoutCreated(self.registry)), CONTENT_TYPE_LATEST


#: The metric types to which C{prometheus_client} adds a C{_created} sample.
_WITH_CREATED = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


class WithoutCreated(Collector):
    """
    A view of a collector (a registry) whose metrics lack their C{<name>_created} samples;
    every other sample, and the collector itself, is left as it is.
    """

    def __init__(self, source: Collector) -> None:
        """
        @param source: the collector (usually a C{CollectorRegistry}) whose metrics are
            shown.
        """
        self._source = source

    def collect(self) -> Iterator[Metric]:
        """C{source}'s metrics, each a copy without its C{_created} samples."""
        for metric in self._source.collect():
            if metric.type not in _WITH_CREATED:
                yield metric
                continue
            created = metric.name + "_created"
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples = [s for s in metric.samples if s.name != created]
            yield kept


def _guarded(endpoint: str, source: Callable[[], int]) -> Callable[[], float]:
    """Wrap a queue-depth source so that one failing source does not fail the scrape."""

    def read() -> float:
        try:
            return float(source())
        except Exception:
            _log.failure("queue depth source for {endpoint} raised", endpoint=endpoint)
            return math.nan

    return read


class SchedulerCollector(Collector):
    """
    A collector over one L{Scheduler}; it keeps no numbers of its own.

    The per-queue series (C{loopd_lease_switches}, C{loopd_lease_holders},
    C{loopd_lease_waiters}) cover the queues that exist now: a queue the config does not name
    is forgotten once idle, and its series go with it while its switches rest
    (C{loopd_lease_resting_switches}, a gauge); used again, its series come back with the
    count it had, never a lower one. Switches whose queue is gone for good (pushed out of the
    bounded resting table, or merged into a group by a reload) are counted in
    C{loopd_lease_forgotten_switches}, a counter that never falls. The per-queue switches, the
    resting ones and the forgotten ones add up to every switch.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        """
        @param scheduler: the scheduler to read at each scrape.
        """
        self._scheduler = scheduler

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """
        Yield the scheduler's totals, the resting queues' gauges and the per-queue series.
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
            (
                "loopd_lease_forgotten_queues",
                "Queues whose counters are gone for good: pushed out of the resting table,"
                " dropped with no switch to keep, or merged away by a reload.",
                counters.forgotten_queues,
            ),
            (
                "loopd_lease_forgotten_switches",
                "Session switches of the queues whose counters are gone for good.",
                counters.forgotten_switches,
            ),
        )
        for name, documentation, value in totals:
            yield CounterMetricFamily(name, documentation, value=value)
        yield GaugeMetricFamily(
            "loopd_lease_resting_queues",
            "Idle unnamed queues whose counters rest until their key is used again.",
            value=counters.resting_queues,
        )
        yield GaugeMetricFamily(
            "loopd_lease_resting_switches",
            "Session switches of the resting queues (their per-queue series return with them).",
            value=counters.resting_switches,
        )
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


class PacingCollector(Collector):
    """
    A collector over the endpoints' L{Pacer}s; it keeps no numbers of its own.
    """

    def __init__(self, pacers: Mapping[str, Pacer]) -> None:
        """
        @param pacers: each endpoint's pacer, by name, read at each scrape.
        """
        self._pacers = dict(pacers)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """
        Yield, per endpoint, the connections loopd opened to it, how many of them waited for
        the pacing and how long in all, how many failed past the wait bound, the refusals
        its inferproxy still gave (by limit), and the connections open and waiting now.
        """
        families = {
            "connections": CounterMetricFamily(
                "loopd_upstream_connections",
                "Connections loopd opened to the endpoint (through its pacing).",
                labels=["endpoint"],
            ),
            "waits": CounterMetricFamily(
                "loopd_upstream_connection_waits",
                "Connections that waited for a token or a free place under the inferproxy's"
                " limits before opening.",
                labels=["endpoint"],
            ),
            "waited": CounterMetricFamily(
                "loopd_upstream_connection_wait_seconds",
                "Seconds those connections waited for the pacing, in all.",
                labels=["endpoint"],
            ),
            "busy": CounterMetricFamily(
                "loopd_upstream_connection_busy",
                "Connections that failed with Busy: the pacing would have passed pacing_wait_ms.",
                labels=["endpoint"],
            ),
        }
        refusals = CounterMetricFamily(
            "loopd_upstream_refusals",
            "Connections the endpoint's inferproxy refused all the same, by limit.",
            labels=["endpoint", "limit"],
        )
        open_now = GaugeMetricFamily(
            "loopd_upstream_connections_open",
            "loopd's connections to the endpoint open now.",
            labels=["endpoint"],
        )
        waiting = GaugeMetricFamily(
            "loopd_upstream_connections_waiting",
            "loopd's connections to the endpoint waiting for the pacing now.",
            labels=["endpoint"],
        )
        for name, pacer in self._pacers.items():
            stats = pacer.stats
            families["connections"].add_metric([name], stats.connections)
            families["waits"].add_metric([name], stats.waits)
            families["waited"].add_metric([name], stats.waited_seconds)
            families["busy"].add_metric([name], stats.busy)
            for limit, count in sorted(stats.refusals.items()):
                refusals.add_metric([name, limit], count)
            open_now.add_metric([name], pacer.open_connections)
            waiting.add_metric([name], pacer.waiting)
        yield from families.values()
        yield refusals
        yield open_now
        yield waiting


class GraceCollector(Collector):
    """
    A collector over the grace's L{SwitchCosts}; it keeps no numbers of its own.
    """

    def __init__(
        self, costs: SwitchCosts, cut_short: Mapping[str, int], endpoints: Iterable[str]
    ) -> None:
        """
        @param costs: the learned switch costs, read at each scrape.
        @param cut_short: per endpoint, the graces a waiting request cut short (read too).
        @param endpoints: the endpoints shown besides those with something learned.
        """
        self._costs = costs
        self._cut_short = cut_short
        self._endpoints = list(endpoints)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """
        Yield, per endpoint, the prompt speed and cache-loss share the grace prices a switch
        with, their sample counts, and the graces cut short by a waiting request.
        """
        speed = GaugeMetricFamily(
            "loopd_grace_prompt_tokens_per_second",
            "Prompt tokens per second the grace prices a re-prefill with (prior before a sample).",
            labels=["endpoint"],
        )
        speed_samples = CounterMetricFamily(
            "loopd_grace_prompt_speed_samples",
            "Completions whose prompt speed was learned from.",
            labels=["endpoint"],
        )
        share = GaugeMetricFamily(
            "loopd_grace_cache_loss_share",
            "Share of returning sessions that lost their cache (NaN while still learning).",
            labels=["endpoint"],
        )
        returning = GaugeMetricFamily(
            "loopd_grace_returning_sessions",
            "Returning sessions the loss share is taken over now (its window).",
            labels=["endpoint"],
        )
        cut = CounterMetricFamily(
            "loopd_grace_cut_short",
            "Graces ended before grace_ms: the slot idled beside a waiter for the re-prefill time.",
            labels=["endpoint"],
        )
        names = dict.fromkeys([*self._endpoints, *self._costs.endpoints(), *self._cut_short])
        for name in names:
            costs = self._costs.costs(name)
            speed.add_metric([name], costs.prompt_tokens_per_second)
            speed_samples.add_metric([name], costs.speed_samples)
            learned = costs.loss_share
            share.add_metric([name], math.nan if learned is None else learned)
            returning.add_metric([name], len(costs.losses))
            cut.add_metric([name], self._cut_short.get(name, 0))
        yield speed
        yield speed_samples
        yield share
        yield returning
        yield cut


class SlotFileCollector(Collector):
    """
    A collector over the slot-file outcome counts of L{loopd.gateway.slot_swap.SlotSwap};
    it keeps no numbers of its own.
    """

    def __init__(self, counts: Mapping[tuple[str, str, str], int]) -> None:
        """
        @param counts: by C{(endpoint, action, outcome)}, read at each scrape.
        """
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        """Yield C{loopd_slot_files_total{endpoint, action, outcome}}."""
        files = CounterMetricFamily(
            "loopd_slot_files",
            "Slot-file saves (saved, failed) and restores (worked, did_nothing, empty, failed).",
            labels=["endpoint", "action", "outcome"],
        )
        for (endpoint, action, outcome), count in sorted(self._counts.items()):
            files.add_metric([endpoint, action, outcome], count)
        yield files


class SwapCollector(Collector):
    """A collector over the swap gates of L{loopd.gateway.swap_gate.ModelSwaps}."""

    def __init__(self, swaps: ModelSwaps) -> None:
        """@param swaps: the gateway's swap gates, read at each scrape."""
        self._swaps = swaps

    def collect(self) -> Iterator[Metric]:
        """Yield the swaps, the waiting requests and the load time of each router."""
        swaps = CounterMetricFamily(
            "loopd_router_swaps",
            "Model swaps loopd let a router make (a load that evicted a model).",
            labels=["router"],
        )
        waiting = GaugeMetricFamily(
            "loopd_router_swap_waiting",
            "Requests waiting at a router's swap gate for their model to be loaded.",
            labels=["router"],
        )
        load = GaugeMetricFamily(
            "loopd_router_load_seconds",
            "A router's model load time as learned from the requests that loaded a model.",
            labels=["router"],
        )
        for router in self._swaps.routers():
            board = self._swaps.board(router)
            swaps.add_metric([router], board.swaps)
            waiting.add_metric([router], len(board.waiting()))
            load.add_metric([router], self._swaps.load_seconds[router])
        yield swaps
        yield waiting
        yield load


class HealthCollector(Collector):
    """
    A collector over one L{HealthBoard}; it keeps no numbers of its own.
    """

    def __init__(self, board: HealthBoard) -> None:
        """
        @param board: the endpoints' health, read at each scrape.
        """
        self._board = board

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """
        Yield C{loopd_endpoint_up} (1 while the endpoint takes requests: up or probing, 0
        while down) and C{loopd_endpoint_state} (1 for the state it is in, 0 for the others).
        """
        up = GaugeMetricFamily(
            "loopd_endpoint_up",
            "1 while the endpoint takes requests (up or probing), 0 while it is down.",
            labels=["endpoint"],
        )
        state = GaugeMetricFamily(
            "loopd_endpoint_state",
            "The endpoint's health state: 1 for the one it is in (up, down, probing).",
            labels=["endpoint", "state"],
        )
        for name, now in self._board.states().items():
            up.add_metric([name], 0 if now is State.DOWN else 1)
            for each in State:
                state.add_metric([name, each.value], 1 if each is now else 0)
        yield up
        yield state
