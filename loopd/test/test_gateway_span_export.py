"""
Tests for L{loopd.gateway.span_export}: the spans' queue and their OTLP/HTTP export to a
collector's Unix socket, on a C{MemoryReactorClock} with the collector in memory
(L{loopd.test.support.otlp_receiver.OtlpReceiver} on a L{MemoryNet}): batches on the timer,
the bound that drops the oldest, a collector that is away, slow or refusing, the log told
once per change, and the last spans sent at stop within a bounded wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SkipTest, SynchronousTestCase
from twisted.web.server import Site

from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

try:
    from opentelemetry.sdk.trace import TracerProvider

    from loopd.gateway.span_export import ExportRefusedError, SpanQueue, otlp_sender
    from loopd.test.support.otlp_receiver import OtlpReceiver
except ImportError as e:  # pragma: no cover - the telemetry extra is not installed
    raise SkipTest(f"the telemetry tests need the telemetry extra: {e}") from None

#: The collector's socket: in memory only, never created on disk.
SOCKET = "/tmp/ld-otel/otlp.sock"


class QueueCase(SynchronousTestCase):
    """A memory reactor and network, a collector that listens when told, and a queue."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.net = MemoryNet(self.reactor)
        self.receiver = OtlpReceiver()

    def listen(self) -> None:
        """The collector listens at L{SOCKET}."""
        self.net.listen(SOCKET, Site(self.receiver, reactor=self.reactor))

    def queue(self, **options: Any) -> SpanQueue:
        """
        A started queue exporting to L{SOCKET}: every second, batches of 2, 4 spans at most,
        half a second per export, unless C{options} say otherwise; its spans come from
        L{end}.
        """
        settings: dict[str, Any] = {
            "export_interval": 1.0,
            "max_batch": 2,
            "max_queue": 4,
            "timeout": 0.5,
        }
        settings.update(options)
        sender = otlp_sender(self.reactor, SOCKET, connect_timeout=settings["timeout"])
        queue = SpanQueue(self.reactor, sender, target=SOCKET, **settings)
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(queue)
        self.tracer = provider.get_tracer("test")
        queue.start()
        return queue

    def end(self, *names: str) -> None:
        """A span of each name starts and ends now."""
        for name in names:
            self.tracer.start_span(name).end()

    def received(self) -> list[str]:
        """The names of the spans the collector received, in order."""
        return [span.name for span in self.receiver.spans()]

    def told(self, events: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
        """The telemetry log's lines: (level, text)."""
        return [
            (event["log_level"].name, formatEvent(event))
            for event in events
            if event.get("log_namespace") == "loopd.telemetry"
        ]


class BatchTests(QueueCase):
    """Spans wait in the queue; the timer sends them in batches, one export at a time."""

    def test_request_path_only_appends(self) -> None:
        """A span that ends is queued: no connection, no timer of its own."""
        queue = self.queue()
        self.end("a", "b")
        self.assertEqual((len(queue), self.reactor.unixClients), (2, []))
        self.assertEqual(len(self.reactor.getDelayedCalls()), 1)

    def test_waits_for_the_interval(self) -> None:
        """Nothing goes before the interval; then one OTLP/HTTP protobuf POST to /v1/traces."""
        self.listen()
        queue = self.queue()
        self.end("a")
        self.net.advance(0.9)
        self.assertEqual(self.receiver.requests, [])
        self.net.advance(0.1)
        self.assertEqual(self.receiver.heads, [(b"/v1/traces", b"application/x-protobuf")])
        self.assertEqual((self.received(), queue.exported, len(queue)), (["a"], 1, 0))

    def test_batches(self) -> None:
        """At most a batch per export; a whole batch waiting goes at once, a part waits."""
        self.listen()
        queue = self.queue(max_queue=8)
        self.end("s0", "s1", "s2", "s3", "s4")
        self.net.advance(1)
        self.assertEqual(self.receiver.batch_sizes(), [2, 2])
        self.net.advance(1)
        self.assertEqual(self.receiver.batch_sizes(), [2, 2, 1])
        self.assertEqual(self.received(), ["s0", "s1", "s2", "s3", "s4"])
        self.assertEqual(queue.exported, 5)

    def test_one_export_at_a_time(self) -> None:
        """While an export waits for its answer, the timer sends no other."""
        self.receiver.hold = True
        self.listen()
        queue = self.queue(timeout=10.0, max_queue=8)
        self.end("a", "b", "c", "d")
        self.net.advance(3)
        self.assertEqual(self.receiver.batch_sizes(), [2])
        self.receiver.release()
        self.net.pump()
        self.assertEqual(self.receiver.batch_sizes(), [2, 2])
        self.assertEqual(queue.exported, 4)

    def test_batch_within_queue(self) -> None:
        """A batch larger than the queue, or an empty one, is refused."""
        sender = otlp_sender(self.reactor, SOCKET)
        for batch, bound in ((5, 4), (0, 4)):
            with self.assertRaises(ValueError):
                SpanQueue(self.reactor, sender, target=SOCKET, max_batch=batch, max_queue=bound)


class BoundTests(QueueCase):
    """The queue is bounded: the oldest span goes first, counted and told once."""

    def test_drops_oldest(self) -> None:
        """Beyond the bound the oldest spans are dropped; the newest are sent."""
        self.listen()
        with capturedLogs() as events:
            queue = self.queue(max_queue=3, max_batch=3)
            self.end("s0", "s1", "s2", "s3", "s4")
            self.assertEqual((len(queue), queue.dropped), (3, 2))
            self.net.advance(1)
        self.assertEqual(self.received(), ["s2", "s3", "s4"])
        told = self.told(events)
        self.assertEqual([level for level, _ in told], ["warn", "info"])
        self.assertIn("the span queue is full (3 spans", told[0][1])
        self.assertIn("takes spans again (2 lost meanwhile)", told[1][1])

    def test_collector_away_bounded(self) -> None:
        """
        With the collector away the spans wait within the bound, every export fails, each
        told once; when it is back, the newest spans go and the loss is told.
        """
        with capturedLogs() as events:
            queue = self.queue()
            self.end("s0", "s1", "s2", "s3", "s4", "s5")
            for _ in range(5):
                self.net.advance(1)
                self.end("late")
            self.assertEqual((len(queue), self.receiver.requests), (4, []))
            self.listen()
            self.net.advance(1)
        self.assertEqual(self.received(), ["late"] * 4)
        self.assertEqual((queue.exported, queue.dropped, queue.failed), (4, 7, 0))
        told = self.told(events)
        self.assertEqual([level for level, _ in told], ["warn", "warn", "info"])
        self.assertIn("the span queue is full", told[0][1])
        self.assertIn(f"exporting spans to {SOCKET} failed: ", told[1][1])
        self.assertIn("the spans wait (the oldest dropped beyond 4)", told[1][1])
        self.assertIn("takes spans again (7 lost meanwhile)", told[2][1])


class FailureTests(QueueCase):
    """A collector that is away, slow or refusing: the spans wait or go, as may pass later."""

    def test_dead_socket(self) -> None:
        """
        No collector: the export fails, told once; the spans wait and go when one listens.
        """
        with capturedLogs() as events:
            queue = self.queue()
            self.end("a", "b")
            self.net.advance(3)
            self.assertEqual(len(queue), 2)
            self.listen()
            self.net.advance(1)
        self.assertEqual(self.received(), ["a", "b"])
        self.assertEqual((queue.exported, queue.dropped, queue.failed), (2, 0, 0))
        told = self.told(events)
        self.assertEqual([level for level, _ in told], ["warn", "info"])
        self.assertIn(f"failed: {SOCKET}: no socket (nothing is serving it)", told[0][1])
        self.assertIn("takes spans again (0 lost meanwhile)", told[1][1])

    def test_stale_socket(self) -> None:
        """A socket file nobody listens on (connection refused) is the same."""
        self.net.stop_listening(SOCKET, stale=True)
        with capturedLogs() as events:
            queue = self.queue()
            self.end("a")
            self.net.advance(2)
        self.assertEqual(len(queue), 1)
        (told,) = self.told(events)
        self.assertIn("refused", told[1])

    def test_refused_batch_dropped(self) -> None:
        """A 400 (the collector will not take these spans) drops the batch; told once."""
        self.receiver.status = 400
        self.listen()
        with capturedLogs() as events:
            queue = self.queue()
            self.end("a", "b", "c")
            self.net.advance(2)
        self.assertEqual(self.receiver.batch_sizes(), [2, 1])
        self.assertEqual((len(queue), queue.failed, queue.exported), (0, 3, 0))
        (told,) = self.told(events)
        self.assertEqual(told[0], "warn")
        self.assertIn("failed: the collector answered HTTP 400; 2 spans dropped", told[1])

    def test_unavailable_retried(self) -> None:
        """A 503 (or 429, 502, 504) keeps the batch; it goes once the collector takes it."""
        self.receiver.status = 503
        self.listen()
        queue = self.queue()
        self.end("a", "b")
        self.net.advance(2)
        self.assertEqual((self.receiver.batch_sizes(), len(queue)), ([2, 2], 2))
        self.receiver.status = 200
        self.net.advance(1)
        self.assertEqual(self.received(), ["a", "b"] * 3)
        self.assertEqual((queue.exported, queue.failed), (2, 0))

    def test_slow_collector(self) -> None:
        """
        No answer within the export's timeout: the connection is closed and the batch waits
        for the next export; meanwhile spans keep ending without waiting on the export.
        """
        self.receiver.hold = True
        self.listen()
        with capturedLogs() as events:
            queue = self.queue()
            self.end("a", "b")
            self.net.advance(1)
            self.assertEqual(len(self.net.open_connections(SOCKET)), 1)
            self.net.advance(0.5)
            self.assertEqual(self.net.open_connections(SOCKET), [])
            self.end("c")
            self.assertEqual(len(queue), 3)
            self.receiver.hold = False
            self.net.advance(1)
        self.assertEqual(self.received(), ["a", "b", "a", "b"])
        self.assertEqual((len(queue), queue.exported), (1, 2))
        told = self.told(events)
        self.assertIn("failed: no answer within 0.5 s; the spans wait", told[0][1])

    def test_told_once_per_change(self) -> None:
        """Away, then refusing, then taking spans: three lines, however many batches."""
        with capturedLogs() as events:
            self.queue(max_queue=16)
            for _ in range(3):
                self.end("a", "b")
                self.net.advance(1)
            self.receiver.status = 400
            self.listen()
            for _ in range(3):
                self.end("c", "d")
                self.net.advance(1)
            self.receiver.status = 200
            self.end("e")
            self.net.advance(8)
        told = self.told(events)
        self.assertEqual([level for level, _ in told], ["warn", "warn", "info"], told)
        self.assertIn(f"failed: {SOCKET}: no socket (nothing is serving it)", told[0][1])
        self.assertIn("HTTP 400", told[1][1])

    def test_refusal_kinds(self) -> None:
        """ExportRefusedError names the status; only OTLP's retryable statuses are kept."""
        self.assertEqual(str(ExportRefusedError(413)), "the collector answered HTTP 413")


class StopTests(QueueCase):
    """At stop the spans left are sent within a bounded wait; what remains is dropped."""

    def test_flushes_what_is_left(self) -> None:
        """Stop sends every span left, in batches, at once; the timer is gone."""
        self.listen()
        queue = self.queue(max_queue=8)
        self.end("s0", "s1", "s2", "s3", "s4")
        stopping = queue.stop(2.0)
        self.net.pump()
        self.assertIsNone(self.successResultOf(stopping))
        self.assertEqual(self.receiver.batch_sizes(), [2, 2, 1])
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_bounded_wait(self) -> None:
        """A collector that does not answer: stop gives up after its wait, telling the loss."""
        self.receiver.hold = True
        self.listen()
        queue = self.queue(timeout=10.0)
        self.end("a", "b", "c")
        with capturedLogs() as events:
            stopping = queue.stop(2.0)
            self.net.advance(1.9)
            self.assertNoResult(stopping)
            self.net.advance(0.1)
        self.assertIsNone(self.successResultOf(stopping))
        self.assertEqual((queue.failed, queue.dropped, len(queue)), (2, 1, 0))
        self.assertEqual(self.net.open_connections(SOCKET), [])
        told = self.told(events)
        self.assertEqual(len(told), 1, told)
        self.assertIn("3 spans were not exported to", told[0][1])
        self.assertIn("before loopd stopped (waited 2 s)", told[0][1])

    def test_dead_collector(self) -> None:
        """No collector at stop: each batch fails once and is dropped; stop ends at once."""
        queue = self.queue()
        self.end("a", "b", "c")
        stopping = queue.stop(2.0)
        while self.reactor.unixClients:
            self.net.pump()
        self.assertIsNone(self.successResultOf(stopping))
        self.assertEqual((queue.failed, len(queue)), (3, 0))

    def test_after_stop(self) -> None:
        """A span that ends after stop is dropped and counted; nothing is sent."""
        self.listen()
        queue = self.queue()
        self.successResultOf(queue.stop(1.0))
        self.end("late")
        self.net.advance(5)
        self.assertEqual((self.receiver.requests, queue.dropped), ([], 1))

    def test_in_flight_at_stop(self) -> None:
        """An export on its way at stop is waited for, then the rest goes."""
        self.receiver.hold = True
        self.listen()
        queue = self.queue(timeout=10.0)
        self.end("a", "b", "c")
        self.net.advance(1)
        stopping = queue.stop(5.0)
        self.assertNoResult(stopping)
        self.receiver.release()
        self.net.pump()
        self.successResultOf(stopping)
        self.assertEqual(self.received(), ["a", "b", "c"])
        self.assertEqual(queue.exported, 3)
