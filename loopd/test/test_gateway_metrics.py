"""Tests for L{loopd.gateway.metrics}: what C{/metrics} renders after observations."""

from __future__ import annotations

import math
from collections import Counter

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import Connect
from loopd.gateway.grace import SwitchCosts
from loopd.gateway.health import HealthBoard, ProbePace
from loopd.gateway.metrics import GatewayMetrics
from loopd.llama.info import CacheOutcome
from loopd.llama.types import Timings
from loopd.queue.protocol import LeaseFactory, deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter

#: A sample's labels, and a family's samples keyed by (sample name, labels).
Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]


def scrape(metrics: GatewayMetrics) -> dict[str, Samples]:
    """Render and parse: family name → (sample name, labels) → value."""
    body, _ = metrics.render()
    families: dict[str, Samples] = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return families


def labels(**values: str) -> Labels:
    """A label set as scrape() keys it."""
    return frozenset(values.items())


class RenderTests(SynchronousTestCase):
    """Each family shows up with the right labels and values."""

    def test_content_type(self) -> None:
        """render() answers bytes and the Prometheus text content type."""
        body, content_type = GatewayMetrics().render()
        self.assertIsInstance(body, bytes)
        self.assertEqual(content_type, CONTENT_TYPE_LATEST)
        self.assertTrue(content_type.startswith("text/plain;"))

    def test_families_declared_before_any_observation(self) -> None:
        """Every loopd family is declared, with its type, even before anything happened."""
        body, _ = GatewayMetrics().render()
        types = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
        self.assertEqual(
            types,
            {
                "loopd_requests": "counter",
                "loopd_time_to_first_token_seconds": "histogram",
                "loopd_tokens": "counter",
                "loopd_cache_losses": "counter",
                "loopd_queue_depth": "gauge",
                "loopd_http_refusals": "counter",
                "loopd_http_connections_open": "gauge",
                "loopd_dropped_tools": "counter",
            },
        )

    def test_no_created_series(self) -> None:
        """
        No C{_created} series doubles the counters and the histogram: no line of the page
        (help, type or sample) names one, also after observations.
        """
        metrics = GatewayMetrics()
        metrics.observe_request("main", "ok")
        metrics.observe_first_token("main", 0.2)
        metrics.observe_completion("main", Timings(cache_n=1, prompt_n=2, predicted_n=3))
        metrics.observe_cache_loss("main")
        body, _ = metrics.render()
        self.assertNotIn(b"_created", body)
        self.assertIn(b'loopd_requests_total{endpoint="main",outcome="ok"} 1.0', body)

    def test_created_left_alone_elsewhere(self) -> None:
        """
        Leaving C{_created} out of loopd's page changes nothing process-wide: a registry of
        the embedding program still renders its own C{_created} series.
        """
        GatewayMetrics().render()
        other = CollectorRegistry()
        PromCounter("other_things", "Things.", registry=other).inc()
        self.assertIn(b"other_things_created", generate_latest(other))

    def test_requests_by_outcome(self) -> None:
        """Requests are counted per endpoint and outcome."""
        metrics = GatewayMetrics()
        metrics.observe_request("main", "ok")
        metrics.observe_request("main", "ok")
        metrics.observe_request("main", "busy")
        metrics.observe_request("other", "context_exceeded")
        samples = scrape(metrics)["loopd_requests"]
        name = "loopd_requests_total"
        self.assertEqual(samples[(name, labels(endpoint="main", outcome="ok"))], 2.0)
        self.assertEqual(samples[(name, labels(endpoint="main", outcome="busy"))], 1.0)
        self.assertEqual(samples[(name, labels(endpoint="other", outcome="context_exceeded"))], 1.0)
        totals = {key for key in samples if key[0] == name}
        self.assertEqual(len(totals), 3)

    def test_time_to_first_token(self) -> None:
        """First-token times land in the histogram's buckets, sum and count."""
        metrics = GatewayMetrics()
        metrics.observe_first_token("main", 0.003)
        metrics.observe_first_token("main", 0.2)
        metrics.observe_first_token("main", 42.0)
        samples = scrape(metrics)["loopd_time_to_first_token_seconds"]
        name = "loopd_time_to_first_token_seconds"
        main = labels(endpoint="main")
        self.assertEqual(samples[(name + "_count", main)], 3.0)
        self.assertAlmostEqual(samples[(name + "_sum", main)], 42.203)

        def bucket(le: str) -> float:
            return samples[(name + "_bucket", labels(endpoint="main", le=le))]

        self.assertEqual(bucket("0.005"), 1.0)
        self.assertEqual(bucket("0.25"), 2.0)
        self.assertEqual(bucket("30.0"), 2.0)
        self.assertEqual(bucket("60.0"), 3.0)
        self.assertEqual(bucket("+Inf"), 3.0)

    def test_tokens_by_kind(self) -> None:
        """A completion's timings add prompt, cached and completion tokens."""
        metrics = GatewayMetrics()
        metrics.observe_completion("main", Timings(cache_n=100, prompt_n=20, predicted_n=7))
        metrics.observe_completion("main", Timings(cache_n=120, prompt_n=5, predicted_n=3))
        samples = scrape(metrics)["loopd_tokens"]
        name = "loopd_tokens_total"
        self.assertEqual(samples[(name, labels(endpoint="main", kind="prompt"))], 25.0)
        self.assertEqual(samples[(name, labels(endpoint="main", kind="cached"))], 220.0)
        self.assertEqual(samples[(name, labels(endpoint="main", kind="completion"))], 10.0)

    def test_cache_losses(self) -> None:
        """Cache losses are counted per endpoint."""
        metrics = GatewayMetrics()
        metrics.observe_cache_loss("main")
        metrics.observe_cache_loss("main")
        metrics.observe_cache_loss("other")
        samples = scrape(metrics)["loopd_cache_losses"]
        name = "loopd_cache_losses_total"
        self.assertEqual(samples[(name, labels(endpoint="main"))], 2.0)
        self.assertEqual(samples[(name, labels(endpoint="other"))], 1.0)

    def test_queue_depth_explicit(self) -> None:
        """An explicitly set queue depth is what the next scrape shows."""
        metrics = GatewayMetrics()
        metrics.set_queue_depth("main", 3)
        metrics.set_queue_depth("main", 5)
        metrics.set_queue_depth("other", 0)
        samples = scrape(metrics)["loopd_queue_depth"]
        self.assertEqual(samples[("loopd_queue_depth", labels(endpoint="main"))], 5.0)
        self.assertEqual(samples[("loopd_queue_depth", labels(endpoint="other"))], 0.0)

    def test_queue_depth_from_callable(self) -> None:
        """A callable source is read afresh at every scrape."""
        metrics = GatewayMetrics()
        depth = [2]
        metrics.set_queue_depth("main", lambda: depth[0])
        key = ("loopd_queue_depth", labels(endpoint="main"))
        self.assertEqual(scrape(metrics)["loopd_queue_depth"][key], 2.0)
        depth[0] = 7
        self.assertEqual(scrape(metrics)["loopd_queue_depth"][key], 7.0)

    def test_queue_depth_callable_then_explicit(self) -> None:
        """Setting a number after a callable replaces the callable."""
        metrics = GatewayMetrics()
        metrics.set_queue_depth("main", lambda: 9)
        metrics.set_queue_depth("main", 4)
        key = ("loopd_queue_depth", labels(endpoint="main"))
        self.assertEqual(scrape(metrics)["loopd_queue_depth"][key], 4.0)
        metrics.set_queue_depth("main", lambda: 6)
        self.assertEqual(scrape(metrics)["loopd_queue_depth"][key], 6.0)

    def test_queue_depth_callable_failing(self) -> None:
        """A source that raises is logged and reads NaN; the rest of the scrape survives."""
        metrics = GatewayMetrics()

        def broken() -> int:
            raise ZeroDivisionError()

        metrics.set_queue_depth("main", broken)
        metrics.observe_request("main", "ok")
        families = scrape(metrics)
        value = families["loopd_queue_depth"][("loopd_queue_depth", labels(endpoint="main"))]
        self.assertTrue(math.isnan(value))
        requests = families["loopd_requests"]
        self.assertEqual(
            requests[("loopd_requests_total", labels(endpoint="main", outcome="ok"))], 1.0
        )
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)


class IsolationTests(SynchronousTestCase):
    """Gateways in one process keep their own counts."""

    def test_two_instances_do_not_share(self) -> None:
        """Observations on one GatewayMetrics never show up in another."""
        first, second = GatewayMetrics(), GatewayMetrics()
        first.observe_request("main", "ok")
        first.observe_cache_loss("main")
        second.observe_request("main", "busy")
        one, two = scrape(first), scrape(second)
        ok = ("loopd_requests_total", labels(endpoint="main", outcome="ok"))
        busy = ("loopd_requests_total", labels(endpoint="main", outcome="busy"))
        self.assertEqual(one["loopd_requests"][ok], 1.0)
        self.assertNotIn(busy, one["loopd_requests"])
        self.assertEqual(two["loopd_requests"][busy], 1.0)
        self.assertNotIn(ok, two["loopd_requests"])
        self.assertEqual(two["loopd_cache_losses"], {})

    def test_not_on_the_global_registry(self) -> None:
        """Nothing of loopd is registered with prometheus_client's process-wide registry."""
        GatewayMetrics().observe_request("main", "ok")
        self.assertIsNot(GatewayMetrics().registry, REGISTRY)
        self.assertIsNone(REGISTRY.get_sample_value("loopd_requests_total", {}))
        self.assertIsNone(
            REGISTRY.get_sample_value("loopd_requests_total", {"endpoint": "main", "outcome": "ok"})
        )


class SchedulerCollectorTests(SynchronousTestCase):
    """
    The lease scheduler's families: totals, per-queue series, resting and forgotten queues.
    """

    def setUp(self) -> None:
        self.router = StaticRouter(defaults=QueuePolicy(), queues={"named": QueuePolicy()})
        self.scheduler = Scheduler(Clock(), self.router, deliver_grant, keep=self.router.names)
        self.metrics = GatewayMetrics()
        self.metrics.watch_scheduler(self.scheduler)

    def totals(self) -> dict[str, float]:
        """The value of each unlabelled lease family of one scrape."""
        families = scrape(self.metrics)
        names = (
            "loopd_lease_grants",
            "loopd_lease_forgotten_queues",
            "loopd_lease_forgotten_switches",
            "loopd_lease_resting_queues",
            "loopd_lease_resting_switches",
        )
        return {name: sum(families[name].values()) for name in names}

    def test_resting_queue_series_vanish_and_return(self) -> None:
        """
        An unnamed queue's series go with it while its switches rest (a gauge; the forgotten
        counters do not count them), and come back with the old count when it is used again.
        """
        for key in ("k1", "named"):
            self.scheduler.acquire("c1", key, "s1")
            self.scheduler.acquire("c2", key, "s2")
            self.scheduler.release(key, "s1")
        families = scrape(self.metrics)
        self.assertEqual(
            families["loopd_lease_switches"],
            {
                ("loopd_lease_switches_total", labels(queue="k1")): 1.0,
                ("loopd_lease_switches_total", labels(queue="named")): 1.0,
            },
        )
        self.scheduler.disconnect("c2")
        families = scrape(self.metrics)
        for name in ("loopd_lease_switches", "loopd_lease_holders", "loopd_lease_waiters"):
            self.assertEqual({dict(key[1])["queue"] for key in families[name]}, {"named"}, name)
        self.assertEqual(
            families["loopd_lease_resting_switches"],
            {("loopd_lease_resting_switches", labels()): 1.0},
        )
        self.assertEqual(
            self.totals(),
            {
                "loopd_lease_grants": 4.0,
                "loopd_lease_forgotten_queues": 0.0,
                "loopd_lease_forgotten_switches": 0.0,
                "loopd_lease_resting_queues": 1.0,
                "loopd_lease_resting_switches": 1.0,
            },
        )
        self.scheduler.acquire("c1", "k1", "s3")
        families = scrape(self.metrics)
        self.assertEqual(
            families["loopd_lease_switches"][("loopd_lease_switches_total", labels(queue="k1"))],
            1.0,
        )
        self.assertEqual(self.totals()["loopd_lease_resting_switches"], 0.0)

    def test_merge_counts_forgotten(self) -> None:
        """
        A resting queue that a reload merges into a group is gone for good: its switches
        move from the resting gauge to the forgotten counter, which only grows.
        """
        self.scheduler.acquire("c1", "k1", "s1")
        self.scheduler.acquire("c2", "k1", "s2")
        self.scheduler.release("k1", "s1")
        self.scheduler.release("k1", "s2")
        self.scheduler.reload(StaticRouter(defaults=QueuePolicy(), groups={"gpu": ("k1",)}))
        totals = self.totals()
        self.assertEqual(
            (
                totals["loopd_lease_resting_switches"],
                totals["loopd_lease_forgotten_switches"],
                totals["loopd_lease_forgotten_queues"],
            ),
            (0.0, 1.0, 1.0),
        )

    def test_lone_surrogate_key_leaves_metrics_working(self) -> None:
        """The issue's acquire with a key that is not text is refused; /metrics still renders."""
        factory = LeaseFactory(self.scheduler)
        connection = factory.buildProtocol(None)
        transport = StringTransport()
        connection.makeConnection(transport)
        connection.dataReceived(b'{"op":"acquire","queueKey":"\\ud800"}\n')
        self.assertIn(b'"op":"error"', transport.value())
        families = scrape(self.metrics)
        self.assertEqual(families["loopd_lease_holders"], {})
        self.assertEqual(
            families["loopd_lease_grants"], {("loopd_lease_grants_total", labels()): 0.0}
        )


class GraceCollectorTests(SynchronousTestCase):
    """The grace's families: what a switch costs per endpoint, and the graces cut short."""

    def test_fresh_endpoint_shows_priors(self) -> None:
        """
        An endpoint with nothing learned shows the prior speed, 1,000 tokens/s, and a loss
        share of NaN: still learning.
        """
        metrics = GatewayMetrics()
        metrics.watch_grace(SwitchCosts(), Counter(), ["tiny"])
        families = scrape(metrics)
        tiny = labels(endpoint="tiny")
        share = families["loopd_grace_cache_loss_share"].pop(("loopd_grace_cache_loss_share", tiny))
        self.assertTrue(math.isnan(share))
        self.assertEqual(
            {name: families[name] for name in families if name.startswith("loopd_grace_")},
            {
                "loopd_grace_prompt_tokens_per_second": {
                    ("loopd_grace_prompt_tokens_per_second", tiny): 1000.0
                },
                "loopd_grace_prompt_speed_samples": {
                    ("loopd_grace_prompt_speed_samples_total", tiny): 0.0
                },
                "loopd_grace_cache_loss_share": {},
                "loopd_grace_returning_sessions": {("loopd_grace_returning_sessions", tiny): 0.0},
                "loopd_grace_cut_short": {("loopd_grace_cut_short_total", tiny): 0.0},
            },
        )

    def test_learned(self) -> None:
        """Learned figures and cuts are read at each scrape, per endpoint."""
        costs = SwitchCosts()
        cut_short: Counter[str] = Counter()
        metrics = GatewayMetrics()
        metrics.watch_grace(costs, cut_short, ["tiny", "big"])
        costs.observe("big", 0, "a", Timings(prompt_n=400, prompt_per_second=800.0), None)
        costs.observe("big", 1, "a", Timings(), CacheOutcome(loss=True, expected=9, cached=0))
        costs.observe("big", 2, "a", Timings(), CacheOutcome(loss=False, expected=9, cached=9))
        cut_short["big"] += 2
        families = scrape(metrics)
        big = labels(endpoint="big")
        self.assertEqual(
            families["loopd_grace_prompt_tokens_per_second"][
                ("loopd_grace_prompt_tokens_per_second", big)
            ],
            800.0,
        )
        self.assertEqual(
            families["loopd_grace_cache_loss_share"][("loopd_grace_cache_loss_share", big)], 0.5
        )
        self.assertEqual(
            families["loopd_grace_returning_sessions"][("loopd_grace_returning_sessions", big)],
            2.0,
        )
        self.assertEqual(
            families["loopd_grace_cut_short"],
            {
                ("loopd_grace_cut_short_total", labels(endpoint="tiny")): 0.0,
                ("loopd_grace_cut_short_total", big): 2.0,
            },
        )


class HealthCollectorTests(SynchronousTestCase):
    """C{loopd_endpoint_up} and C{loopd_endpoint_state} follow the health board."""

    def test_states(self) -> None:
        """Probing and up count as up (1); down is 0; the state's own series is 1."""
        board = HealthBoard(("tiny", "big"), ProbePace(up=5.0, down=1.0), 0.0)
        metrics = GatewayMetrics()
        metrics.watch_health(board)
        board.request_failed("big", Connect("refused"), 0.0)
        families = scrape(metrics)
        self.assertEqual(
            families["loopd_endpoint_up"],
            {
                ("loopd_endpoint_up", labels(endpoint="tiny")): 1.0,
                ("loopd_endpoint_up", labels(endpoint="big")): 0.0,
            },
        )
        states = families["loopd_endpoint_state"]
        for endpoint, now in (("tiny", "probing"), ("big", "down")):
            for state in ("up", "down", "probing"):
                key = ("loopd_endpoint_state", labels(endpoint=endpoint, state=state))
                self.assertEqual(states[key], 1.0 if state == now else 0.0, key)
