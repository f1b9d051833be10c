"""
Tests for L{loopd.moa.fanout}: the fan-out with its worker timeout and 429 retry (reference
C{mesh-moa.md} §1.7 dispatch and gather, §1.8 429 handling; DESIGN decision 29), driven by a
L{task.Clock} and fake calls whose Deferreds the tests fire by hand.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from loopd.moa.fanout import (
    DEFAULT_RETRY_AFTER,
    WORKER_TIMEOUT,
    Fanout,
    RateLimited,
    WorkerTimedOut,
)
from loopd.moa.outcome import Kind, Outcome


class Boom(Exception):  # noqa: N818 (a test stand-in)
    """An upstream failure that is not a 429."""


class Upstream:
    """
    A fake C{call}: each call returns a fresh Deferred (recorded per worker), or raises the
    next exception scripted for that worker.
    """

    def __init__(self) -> None:
        self.calls: dict[str, list[Deferred[Outcome]]] = {}
        self.cancelled: list[str] = []
        self.raises: dict[str, list[Exception]] = {}

    def __call__(self, worker: str) -> Deferred[Outcome]:
        self.calls.setdefault(worker, [])
        scripted = self.raises.get(worker)
        if scripted:
            self.calls[worker].append(Deferred())
            raise scripted.pop(0)
        d: Deferred[Outcome] = Deferred(lambda _d: self.cancelled.append(worker))
        self.calls[worker].append(d)
        return d

    def count(self, worker: str) -> int:
        return len(self.calls.get(worker, []))

    def last(self, worker: str) -> Deferred[Outcome]:
        return self.calls[worker][-1]


def answer(text: str) -> Outcome:
    """An answer outcome."""
    return Outcome(Kind.ANSWER, text)


class FanoutTests(SynchronousTestCase):
    """
    L{Fanout} on a L{Clock}.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.upstream = Upstream()
        self.results: list[tuple[str, Outcome | None, Failure | None]] = []

    def record(self, worker: str, outcome: Outcome | None, failure: Failure | None) -> None:
        self.results.append((worker, outcome, failure))

    def fanout(self, *workers: str, timeout: float = WORKER_TIMEOUT) -> Fanout[str]:
        fan = Fanout(self.clock, workers, self.upstream, self.record, worker_timeout=timeout)
        fan.start()
        return fan

    def assert_timed_out(self, index: int) -> None:
        """Result C{index} is a timeout failure."""
        failure = self.results[index][2]
        assert failure is not None
        self.assertIsInstance(failure.value, WorkerTimedOut)

    def assert_idle(self, fan: Fanout[str]) -> None:
        """Nothing runs and no timer is left."""
        self.assertEqual(fan.running(), [])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_all_called_at_once(self) -> None:
        """§1.7: every worker is called at start, before any result."""
        fan = self.fanout("a", "b", "c")
        self.assertEqual([self.upstream.count(w) for w in "abc"], [1, 1, 1])
        self.assertEqual(fan.running(), ["a", "b", "c"])
        self.assertEqual(self.results, [])

    def test_results_in_completion_order(self) -> None:
        """§1.7 gather: each result is reported once, in the order the workers complete."""
        fan = self.fanout("a", "b", "c")
        for worker in ("c", "a", "b"):
            self.clock.advance(1)
            self.upstream.last(worker).callback(answer(worker))
        self.assertEqual(
            [(w, o.text if o else None, f) for w, o, f in self.results],
            [
                ("c", "c", None),
                ("a", "a", None),
                ("b", "b", None),
            ],
        )
        self.assert_idle(fan)

    def test_running_shrinks(self) -> None:
        """running() lists the workers without a result yet, in worker order."""
        fan = self.fanout("a", "b", "c")
        self.upstream.last("b").callback(answer("b"))
        self.assertEqual(fan.running(), ["a", "c"])

    def test_running_before_start(self) -> None:
        """running() is empty before start()."""
        fan = Fanout(self.clock, ["a"], self.upstream, self.record)
        self.assertEqual(fan.running(), [])
        self.assertEqual(self.upstream.count("a"), 0)

    def test_start_twice(self) -> None:
        """A fan-out starts once only."""
        fan = self.fanout("a")
        self.assertRaises(RuntimeError, fan.start)
        self.assertEqual(self.upstream.count("a"), 1)

    def test_failure_reported(self) -> None:
        """§1.7: a failed call is a result with the failure and no outcome."""
        fan = self.fanout("a", "b")
        self.upstream.last("a").errback(Boom("HTTP 503"))
        [(worker, outcome, failure)] = self.results
        self.assertEqual((worker, outcome), ("a", None))
        assert failure is not None
        self.assertIsInstance(failure.value, Boom)
        self.assertEqual(fan.running(), ["b"])

    def test_synchronous_raise_is_failure(self) -> None:
        """A call that raises synchronously is a failed result, and its timer is dropped."""
        self.upstream.raises["a"] = [Boom("connection refused")]
        fan = self.fanout("a", "b")
        [(worker, outcome, failure)] = self.results
        self.assertEqual((worker, outcome), ("a", None))
        assert failure is not None
        self.assertIsInstance(failure.value, Boom)
        self.assertEqual(fan.running(), ["b"])
        self.upstream.last("b").callback(answer("b"))
        self.assert_idle(fan)

    def test_timeout_cancels_and_reports(self) -> None:
        """§2 worker_timeout, decision 29: a worker slower than the timeout is cancelled and
        reported failed with WorkerTimedOut, at the timeout and not before."""
        fan = self.fanout("a", "b", timeout=60)
        self.upstream.last("b").callback(answer("b"))
        self.clock.advance(59.5)
        self.assertEqual(len(self.results), 1)
        self.assertEqual(self.upstream.cancelled, [])
        self.clock.advance(0.5)
        self.assertEqual(self.upstream.cancelled, ["a"])
        worker, outcome, failure = self.results[1]
        self.assertEqual((worker, outcome), ("a", None))
        assert failure is not None
        assert isinstance(failure.value, WorkerTimedOut)
        self.assertEqual(failure.value.timeout, 60)
        self.assertTrue(self.upstream.last("a").called)
        self.assert_idle(fan)

    def test_default_timeout(self) -> None:
        """§2: the worker timeout defaults to 60 s."""
        Fanout(self.clock, ["a"], self.upstream, self.record).start()
        self.assertEqual([c.getTime() for c in self.clock.getDelayedCalls()], [60.0])

    def test_retry_after_429(self) -> None:
        """§1.8: a 429 is retried once after its Retry-After seconds; the retry's success is
        the result, and the first 429 is not reported."""
        fan = self.fanout("a")
        self.upstream.last("a").errback(RateLimited(3))
        self.assertEqual(self.results, [])
        self.assertEqual(fan.running(), ["a"])
        self.clock.advance(2.5)
        self.assertEqual(self.upstream.count("a"), 1)
        self.clock.advance(0.5)
        self.assertEqual(self.upstream.count("a"), 2)
        self.upstream.last("a").callback(answer("ok"))
        [(worker, outcome, failure)] = self.results
        self.assertEqual((worker, outcome, failure), ("a", answer("ok"), None))
        self.assert_idle(fan)

    def test_retry_after_default(self) -> None:
        """§1.8: a 429 without Retry-After waits the default 1 s."""
        self.assertEqual(DEFAULT_RETRY_AFTER, 1.0)
        self.fanout("a")
        self.upstream.last("a").errback(RateLimited())
        self.clock.advance(0.9)
        self.assertEqual(self.upstream.count("a"), 1)
        self.clock.advance(0.1)
        self.assertEqual(self.upstream.count("a"), 2)

    def test_retry_after_negative(self) -> None:
        """A negative Retry-After retries at once rather than failing."""
        self.fanout("a")
        self.upstream.last("a").errback(RateLimited(-5))
        self.clock.advance(0)
        self.assertEqual(self.upstream.count("a"), 2)

    def test_429_raised_synchronously_is_retried(self) -> None:
        """A 429 raised synchronously by the call gets the same one retry."""
        self.upstream.raises["a"] = [RateLimited(2)]
        self.fanout("a")
        self.assertEqual(self.results, [])
        self.clock.advance(2)
        self.assertEqual(self.upstream.count("a"), 2)

    def test_second_429_is_failure(self) -> None:
        """§1.8: the retry's result is final; a second 429 is a failure."""
        fan = self.fanout("a")
        self.upstream.last("a").errback(RateLimited(1))
        self.clock.advance(1)
        self.upstream.last("a").errback(RateLimited(1))
        [(worker, outcome, failure)] = self.results
        self.assertEqual((worker, outcome), ("a", None))
        assert failure is not None
        self.assertIsInstance(failure.value, RateLimited)
        self.clock.advance(5)
        self.assertEqual(self.upstream.count("a"), 2)
        self.assert_idle(fan)

    def test_failure_after_retry_is_final(self) -> None:
        """§1.8: any failure of the retry is reported as is."""
        self.fanout("a")
        self.upstream.last("a").errback(RateLimited(1))
        self.clock.advance(1)
        self.upstream.last("a").errback(Boom("HTTP 500"))
        [(_worker, _outcome, failure)] = self.results
        assert failure is not None
        self.assertIsInstance(failure.value, Boom)

    def test_retry_after_beyond_timeout(self) -> None:
        """The retry runs within the worker timeout: a Retry-After ending after the deadline
        means the timeout is reported at the deadline and no retry is made."""
        fan = self.fanout("a", timeout=10)
        self.clock.advance(4)
        self.upstream.last("a").errback(RateLimited(30))
        self.clock.advance(6)
        [(worker, outcome, failure)] = self.results
        self.assertEqual((worker, outcome), ("a", None))
        assert failure is not None
        self.assertIsInstance(failure.value, WorkerTimedOut)
        self.assert_idle(fan)
        self.clock.advance(60)
        self.assertEqual(self.upstream.count("a"), 1)

    def test_retry_at_deadline(self) -> None:
        """A retry due exactly at the deadline loses to the timeout."""
        fan = self.fanout("a", timeout=10)
        self.upstream.last("a").errback(RateLimited(10))
        self.clock.advance(10)
        self.assertEqual(self.upstream.count("a"), 1)
        self.assert_timed_out(0)
        self.assert_idle(fan)

    def test_timeout_during_retry(self) -> None:
        """The timeout counts from the first call: a slow retry is cancelled at the deadline."""
        fan = self.fanout("a", timeout=10)
        self.upstream.last("a").errback(RateLimited(2))
        self.clock.advance(2)
        self.clock.advance(7.5)
        self.assertEqual(self.results, [])
        self.clock.advance(0.5)
        self.assertEqual(self.upstream.cancelled, ["a"])
        self.assertTrue(self.upstream.last("a").called)
        self.assert_timed_out(0)
        self.assert_idle(fan)

    def test_cancel_all(self) -> None:
        """cancel_all cancels every running call and retry timer; no result follows, ever."""
        fan = self.fanout("a", "b", "c")
        self.upstream.last("a").callback(answer("a"))
        self.upstream.last("b").errback(RateLimited(1))
        fan.cancel_all()
        self.assertEqual(self.upstream.cancelled, ["c"])
        self.assertTrue(self.upstream.last("c").called)
        self.assert_idle(fan)
        self.clock.advance(120)
        self.assertEqual(self.upstream.count("b"), 1)
        self.assertEqual([w for w, _o, _f in self.results], ["a"])

    def test_cancel_all_twice(self) -> None:
        """cancel_all is idempotent, and harmless after every worker finished."""
        fan = self.fanout("a")
        self.upstream.last("a").callback(answer("a"))
        fan.cancel_all()
        fan.cancel_all()
        self.assertEqual(self.upstream.cancelled, [])
        self.assertEqual(len(self.results), 1)

    def test_cancel_all_from_on_result(self) -> None:
        """The arbiter may decide on a result: cancel_all inside on_result silences the rest."""
        fan: Fanout[str]

        def decide(worker: str, outcome: Outcome | None, failure: Failure | None) -> None:
            self.record(worker, outcome, failure)
            fan.cancel_all()

        fan = Fanout(self.clock, ["a", "b"], self.upstream, decide)
        fan.start()
        self.upstream.last("b").callback(answer("b"))
        self.assertEqual(self.upstream.cancelled, ["a"])
        self.assertEqual([w for w, _o, _f in self.results], ["b"])
        self.assert_idle(fan)

    def test_cancel_all_during_start(self) -> None:
        """A synchronous result that makes on_result cancel everything stops start() from
        calling the remaining workers."""
        fan: Fanout[str]

        def decide(worker: str, outcome: Outcome | None, failure: Failure | None) -> None:
            self.record(worker, outcome, failure)
            fan.cancel_all()

        self.upstream.raises["b"] = [Boom("refused")]
        fan = Fanout(self.clock, ["a", "b", "c"], self.upstream, decide)
        fan.start()
        self.assertEqual(self.upstream.cancelled, ["a"])
        self.assertEqual(self.upstream.count("c"), 0)
        self.assertEqual([w for w, _o, _f in self.results], ["b"])
        self.assert_idle(fan)

    def test_late_result_after_timeout_ignored(self) -> None:
        """A call without a canceller is still abandoned at the timeout, reported once, and its
        CancelledError is swallowed rather than logged."""
        late: list[Deferred[Outcome]] = []

        def call(worker: str) -> Deferred[Outcome]:
            d: Deferred[Outcome] = Deferred()
            late.append(d)
            return d

        fan = Fanout(self.clock, ["a"], call, self.record, worker_timeout=1)
        fan.start()
        self.clock.advance(1)
        self.assertEqual(len(self.results), 1)
        self.assertTrue(late[0].called)
        self.assert_idle(fan)

    def test_no_workers(self) -> None:
        """An empty pool starts, reports nothing and leaves no timer."""
        fan = self.fanout()
        self.assertEqual(self.results, [])
        self.assert_idle(fan)
