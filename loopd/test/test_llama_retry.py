"""Tests for L{loopd.llama.retry}: what is retried, the backoff schedule, and with_retry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from loopd.errors import (
    Busy,
    Connect,
    Http,
    InferError,
    LoadTimeout,
    Protocol,
    Stalled,
    StreamClosedEarly,
    ThinkingOverrun,
    WaitTimeout,
)
from loopd.llama.gate import IGrant, SlotGate
from loopd.llama.retry import (
    backoff_schedule,
    backoff_wait,
    is_retryable,
    retry_loop,
    with_retry,
)
from loopd.llama.types import ChatEvent, Queued, Retrying
from loopd.settings import Retry

DEFAULT = Retry()

RETRYABLE: list[Callable[[], InferError]] = [
    lambda: Connect("connection refused"),
    lambda: StreamClosedEarly("no finish_reason"),
    lambda: Stalled("silent for 30 s"),
    lambda: LoadTimeout("loading for 3 min"),
    lambda: Http(503, '{"error": "loading model"}'),
]
NOT_RETRYABLE: list[Callable[[], BaseException]] = [
    lambda: Busy("queue full"),
    lambda: WaitTimeout("slot busy for 10 min"),
    lambda: ThinkingOverrun("thinking went on"),
    lambda: Protocol("header block too long"),
    lambda: Http(400, '{"error": {"type": "exceed_context_size_error"}}'),
    lambda: Http(500, "internal"),
    lambda: Http(502, "bad gateway"),
    lambda: ValueError("a bug"),
]


class Attempts:
    """
    An attempt factory the test drives: each call makes a Deferred the test fires later,
    or fires at once with the next entry of C{results} when one is given.
    """

    def __init__(self, results: list[object] | None = None) -> None:
        self.results = list(results or [])
        self.calls: list[Deferred[str]] = []
        self.cancelled: list[int] = []

    def __call__(self) -> Deferred[str]:
        index = len(self.calls)
        d: Deferred[str] = Deferred(lambda _: self.cancelled.append(index))
        self.calls.append(d)
        if self.results:
            result = self.results.pop(0)
            if isinstance(result, BaseException):
                d.errback(Failure(result))
            else:
                d.callback(str(result))
        return d


def constant(r: float) -> Callable[[], float]:
    """A random source that always answers C{r}."""
    return lambda: r


class Run:
    """One with_retry run on a Clock, with its events."""

    def __init__(
        self,
        attempts: Attempts,
        policy: Retry = DEFAULT,
        r: float = 0.5,
        retryable: Callable[[BaseException], bool] = is_retryable,
    ) -> None:
        self.clock = Clock()
        self.events: list[ChatEvent] = []
        self.attempts = attempts
        self.deferred = with_retry(
            attempts,
            clock=self.clock,
            policy=policy,
            on_event=self.events.append,
            random=constant(r),
            retryable=retryable,
        )

    @property
    def retrying(self) -> list[Retrying]:
        """The Retrying events emitted so far."""
        return [e for e in self.events if isinstance(e, Retrying)]


class IsRetryableTests(SynchronousTestCase):
    """is_retryable names exactly the retryable failures."""

    def test_retryable(self) -> None:
        """Connect, StreamClosedEarly, Stalled, LoadTimeout and Http 503 are retryable."""
        for make in RETRYABLE:
            self.assertTrue(is_retryable(make()), make())

    def test_not_retryable(self) -> None:
        """Busy, WaitTimeout, ThinkingOverrun, Protocol, other Http and bugs are not."""
        for make in NOT_RETRYABLE:
            self.assertFalse(is_retryable(make()), make())
        self.assertFalse(is_retryable(CancelledError()))


class BackoffTests(SynchronousTestCase):
    """The pure schedule: 2, 8 and 30 s with +-25 % jitter by default."""

    def test_shortest(self) -> None:
        """r = 0 gives 75 % of each step."""
        self.assertEqual(backoff_schedule(DEFAULT, [0.0] * 3), [1500, 6000, 22500])

    def test_middle(self) -> None:
        """r = 0.5 gives each step exactly."""
        self.assertEqual(backoff_schedule(DEFAULT, [0.5] * 3), [2000, 8000, 30000])

    def test_longest(self) -> None:
        """r = 1 gives 125 % of each step."""
        self.assertEqual(backoff_schedule(DEFAULT, [1.0] * 3), [2500, 10000, 37500])

    def test_one_random_per_retry(self) -> None:
        """Retry i uses the i-th random; there are attempts - 1 waits."""
        self.assertEqual(backoff_schedule(DEFAULT, [0.0, 1.0, 0.5, 0.9]), [1500, 10000, 30000])

    def test_last_step_repeats(self) -> None:
        """With more retries than steps, the last step repeats."""
        policy = Retry(attempts=6, backoff_ms=(100, 200), jitter=0.0)
        self.assertEqual(backoff_schedule(policy, [0.3] * 10), [100, 200, 200, 200, 200])

    def test_single_attempt(self) -> None:
        """One attempt in all means no wait."""
        self.assertEqual(backoff_schedule(Retry(attempts=1), [0.5] * 3), [])

    def test_randoms_run_out(self) -> None:
        """With fewer randoms than retries the schedule is as long as the randoms."""
        self.assertEqual(backoff_schedule(DEFAULT, [0.5]), [2000])

    def test_no_steps(self) -> None:
        """An empty backoff list (only by direct construction) waits nothing."""
        policy = Retry(backoff_ms=())
        self.assertEqual(backoff_schedule(policy, [1.0] * 3), [0, 0, 0])

    def test_bad_arguments(self) -> None:
        """A random outside [0, 1] or a negative retry is a ValueError."""
        self.assertRaises(ValueError, backoff_wait, DEFAULT, 0, 1.5)
        self.assertRaises(ValueError, backoff_wait, DEFAULT, 0, -0.1)
        self.assertRaises(ValueError, backoff_wait, DEFAULT, -1, 0.5)

    @given(
        steps=st.lists(st.integers(0, 10**6), min_size=1, max_size=4),
        jitter=st.floats(0, 0.99),
        randoms=st.lists(st.floats(0, 1), min_size=0, max_size=8),
    )
    def test_within_jitter(self, steps: list[int], jitter: float, randoms: list[float]) -> None:
        """Every wait lies within the jitter band of its step and grows with r."""
        policy = Retry(attempts=9, backoff_ms=tuple(steps), jitter=jitter)
        waits = backoff_schedule(policy, randoms)
        self.assertEqual(len(waits), len(randoms))
        for i, (wait, r) in enumerate(zip(waits, randoms, strict=True)):
            step = steps[min(i, len(steps) - 1)]
            self.assertGreaterEqual(wait, step * (1 - jitter) - 0.5)
            self.assertLessEqual(wait, step * (1 + jitter) + 0.5)
            self.assertLessEqual(backoff_wait(policy, i, 0.0), wait)
            self.assertGreaterEqual(backoff_wait(policy, i, 1.0), wait)
            self.assertEqual(backoff_wait(policy, i, r), wait)


class WithRetryTests(SynchronousTestCase):
    """with_retry on a Clock."""

    def test_success_at_once(self) -> None:
        """A first success is returned at once, with no event and no timer."""
        run = Run(Attempts(["ok"]))
        self.assertEqual(self.successResultOf(run.deferred), "ok")
        self.assertEqual(run.events, [])
        self.assertEqual(run.clock.getDelayedCalls(), [])

    def test_each_retryable_kind_retried(self) -> None:
        """Each retryable failure is retried after the first wait and the retry's result wins."""
        for make in RETRYABLE:
            error = make()
            run = Run(Attempts([error, "second"]))
            self.assertNoResult(run.deferred)
            self.assertEqual(len(run.attempts.calls), 1)
            run.clock.advance(1.5)
            self.assertEqual(len(run.attempts.calls), 1)
            run.clock.advance(0.5)
            self.assertEqual(len(run.attempts.calls), 2)
            self.assertEqual(self.successResultOf(run.deferred), "second")

    def test_each_other_kind_returned_at_once(self) -> None:
        """Each non-retryable failure fails the run at once: one attempt, no event, no timer."""
        for make in NOT_RETRYABLE:
            error = make()
            run = Run(Attempts([error, "never"]))
            failure = self.failureResultOf(run.deferred)
            self.assertIs(failure.value, error)
            self.assertEqual(len(run.attempts.calls), 1)
            self.assertEqual(run.events, [])
            self.assertEqual(run.clock.getDelayedCalls(), [])

    def test_narrowed_retryable(self) -> None:
        """A caller's retryable rule decides: a failure it refuses ends the run at once."""
        refused = Connect("refused")
        run = Run(Attempts([refused, "never"]), retryable=lambda e: not isinstance(e, Connect))
        self.assertIs(self.failureResultOf(run.deferred).value, refused)
        self.assertEqual((len(run.attempts.calls), run.events), (1, []))

    def test_attempt_raising_synchronously(self) -> None:
        """An attempt that raises instead of returning a Deferred counts as a failure."""
        calls: list[int] = []

        def attempt() -> Deferred[str]:
            calls.append(1)
            if len(calls) == 1:
                raise Connect("refused")
            return succeed("ok")

        clock = Clock()
        d = with_retry(attempt, clock=clock, policy=DEFAULT, on_event=lambda e: None)
        clock.advance(2.5)
        self.assertEqual(self.successResultOf(d), "ok")

    def _schedule(self, r: float) -> tuple[list[float], list[Retrying], Failure]:
        """Fail every attempt with Stalled; return when each began, the events, the failure."""
        errors = [Stalled(f"stall {i}") for i in range(1, 6)]
        run = Run(Attempts(list(errors)), r=r)
        starts = [0.0]
        while len(run.attempts.calls) < 4:
            delay = min(c.getTime() for c in run.clock.getDelayedCalls()) - run.clock.seconds()
            run.clock.advance(delay)
            starts.append(run.clock.seconds())
        failure = self.failureResultOf(run.deferred)
        self.assertIs(failure.value, errors[3])
        self.assertEqual(run.clock.getDelayedCalls(), [])
        return starts, run.retrying, failure

    def test_waits_shortest(self) -> None:
        """With r = 0 the attempts start at 0, 1.5, 7.5 and 30 s."""
        starts, _, _ = self._schedule(0.0)
        self.assertEqual(starts, [0.0, 1.5, 7.5, 30.0])

    def test_waits_middle(self) -> None:
        """With r = 0.5 the attempts start at 0, 2, 10 and 40 s."""
        starts, _, _ = self._schedule(0.5)
        self.assertEqual(starts, [0.0, 2.0, 10.0, 40.0])

    def test_waits_longest(self) -> None:
        """With r = 1 the attempts start at 0, 2.5, 12.5 and 50 s."""
        starts, _, _ = self._schedule(1.0)
        self.assertEqual(starts, [0.0, 2.5, 12.5, 50.0])

    def test_four_attempts_then_last_error(self) -> None:
        """Four attempts in all, three Retrying events, then the fourth attempt's error."""
        _, retrying, failure = self._schedule(0.5)
        self.assertEqual(
            retrying,
            [
                Retrying(attempt=1, after_ms=2000, error="stall 1"),
                Retrying(attempt=2, after_ms=8000, error="stall 2"),
                Retrying(attempt=3, after_ms=30000, error="stall 3"),
            ],
        )
        self.assertEqual(str(failure.value), "stall 4")

    def test_retrying_before_wait(self) -> None:
        """Retrying is emitted when the attempt fails, before the wait starts."""
        attempts = Attempts()
        run = Run(attempts)
        attempts.calls[0].errback(Failure(Http(503, "loading")))
        self.assertEqual(
            run.events, [Retrying(attempt=1, after_ms=2000, error="HTTP 503: loading")]
        )
        self.assertEqual(len(attempts.calls), 1)

    def test_error_without_message(self) -> None:
        """An error with no message is named by its kind in Retrying."""
        run = Run(Attempts([StreamClosedEarly()]))
        self.assertEqual(run.retrying[0].error, "StreamClosedEarly")

    def test_total_cap(self) -> None:
        """No wait starts that would end past total_ms after the first attempt started."""
        attempts = Attempts()
        run = Run(attempts)
        # Each attempt hangs 100 s before failing: 0-100, wait 2, 102-202, wait 8, 210-310.
        while not run.deferred.called:
            run.clock.advance(100)
            attempts.calls[-1].errback(Failure(Stalled("silent")))
            if not run.deferred.called:
                run.clock.advance(run.retrying[-1].after_ms / 1000)
        failure = self.failureResultOf(run.deferred)
        failure.trap(Stalled)
        self.assertEqual(len(attempts.calls), 3)
        self.assertEqual(len(run.retrying), 2)
        self.assertEqual(run.clock.seconds(), 310)
        self.assertEqual(run.clock.getDelayedCalls(), [])

    def test_total_cap_boundary(self) -> None:
        """A wait that ends exactly at total_ms is still taken; one that ends later is not."""
        policy = Retry(attempts=10, backoff_ms=(1000,), jitter=0.0, total_ms=3000)
        run = Run(Attempts([Connect("refused")] * 10), policy=policy)
        for _ in range(3):
            run.clock.advance(1)
        self.assertEqual(len(run.attempts.calls), 4)
        self.failureResultOf(run.deferred, Connect)
        self.assertEqual([e.attempt for e in run.retrying], [1, 2, 3])

    def test_cancel_during_wait(self) -> None:
        """Cancelling during a wait stops the timer and fails with CancelledError."""
        run = Run(Attempts([Connect("refused"), "never"]))
        run.clock.advance(1)
        run.deferred.cancel()
        self.failureResultOf(run.deferred, CancelledError)
        self.assertEqual(run.clock.getDelayedCalls(), [])
        run.clock.advance(100)
        self.assertEqual(len(run.attempts.calls), 1)

    def test_cancel_during_attempt(self) -> None:
        """Cancelling during an attempt cancels it and fails with CancelledError."""
        attempts = Attempts()
        run = Run(attempts)
        run.deferred.cancel()
        self.assertEqual(attempts.cancelled, [0])
        self.failureResultOf(run.deferred, CancelledError)
        self.assertEqual(run.clock.getDelayedCalls(), [])

    def test_cancel_attempt_failing_retryably(self) -> None:
        """An attempt that fails retryably when cancelled is not retried."""
        calls: list[Deferred[str]] = []

        def attempt() -> Deferred[str]:
            d: Deferred[str] = Deferred(lambda d: d.errback(Failure(StreamClosedEarly("cut"))))
            calls.append(d)
            return d

        clock = Clock()
        d = with_retry(attempt, clock=clock, policy=DEFAULT, on_event=lambda e: None)
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(len(calls), 1)

    def test_cancel_attempt_succeeding(self) -> None:
        """An attempt that succeeds when cancelled still leaves the run cancelled."""

        def attempt() -> Deferred[str]:
            return Deferred(lambda d: d.callback("late"))

        d = with_retry(attempt, clock=Clock(), policy=DEFAULT, on_event=lambda e: None)
        d.cancel()
        self.failureResultOf(d, CancelledError)

    def test_cancel_from_listener(self) -> None:
        """A listener that cancels on Retrying stops the run before any wait starts."""
        attempts = Attempts()
        clock = Clock()
        holder: list[Deferred[str]] = []
        d = with_retry(attempts, clock=clock, policy=DEFAULT, on_event=lambda e: holder[0].cancel())
        holder.append(d)
        attempts.calls[0].errback(Failure(Connect("refused")))
        self.failureResultOf(d, CancelledError)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_raising_listener(self) -> None:
        """A listener that raises is logged and the retry goes ahead."""

        def bad(event: ChatEvent) -> None:
            raise RuntimeError("listener bug")

        clock = Clock()
        d = with_retry(
            Attempts([Connect("refused"), "ok"]), clock=clock, policy=DEFAULT, on_event=bad
        )
        clock.advance(3)
        self.assertEqual(self.successResultOf(d), "ok")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class RetryLoopTests(SynchronousTestCase):
    """
    L{retry_loop} asks its pause, after each failure, what to do: its policy is the
    caller's (L{with_retry}'s, the self-test's).
    """

    def test_pause_asked(self) -> None:
        """
        The pause gets each failure, the number of attempts made and the seconds since the
        first started; the next attempt starts after the wait it returns.
        """
        asked: list[tuple[str, int, float]] = []

        def pause(error: BaseException, tries: int, elapsed: float) -> float | None:
            asked.append((str(error), tries, elapsed))
            return 2.0

        clock = Clock()
        attempts = Attempts([ValueError("one"), ValueError("two"), "ok"])
        d = retry_loop(attempts, clock=clock, pause=pause)
        clock.advance(1.999)
        self.assertEqual(len(attempts.calls), 1)
        clock.advance(0.001)
        self.assertEqual(len(attempts.calls), 2)
        clock.advance(2)
        self.assertEqual(self.successResultOf(d), "ok")
        self.assertEqual(asked, [("one", 1, 0.0), ("two", 2, 2.0)])

    def test_pause_gives_up(self) -> None:
        """A pause that returns None fails the run with the attempt's failure."""
        d = retry_loop(Attempts([Http(500, "x")]), clock=Clock(), pause=lambda e, t, s: None)
        self.assertEqual(self.failureResultOf(d, Http).value.status, 500)

    def test_pause_raises(self) -> None:
        """A pause that raises fails the run with what it raised, and no attempt follows."""

        def pause(error: BaseException, tries: int, elapsed: float) -> float | None:
            raise WaitTimeout(f"gave up after {error}")

        clock = Clock()
        attempts = Attempts([Connect("refused")])
        d = retry_loop(attempts, clock=clock, pause=pause)
        self.assertIn("gave up after", str(self.failureResultOf(d, WaitTimeout).value))
        self.assertEqual((len(attempts.calls), clock.getDelayedCalls()), (1, []))


class ThroughTheGateTests(SynchronousTestCase):
    """A retrying caller goes back through the slot gate for each attempt."""

    def test_retry_queues_behind_newcomer(self) -> None:
        """A retry waits behind a request that took the slot during the backoff."""
        gate = SlotGate(8)
        clock = Clock()
        events: list[ChatEvent] = []
        outcomes: Iterator[object] = iter([Connect("refused"), "done"])

        def attempt() -> Deferred[str]:
            def use(grant: IGrant) -> str:
                grant.release()
                outcome = next(outcomes)
                if isinstance(outcome, BaseException):
                    raise outcome
                return str(outcome)

            return gate.acquire(0, events.append).addCallback(use)

        d = with_retry(
            attempt, clock=clock, policy=DEFAULT, on_event=events.append, random=constant(0.5)
        )
        other = self.successResultOf(gate.acquire(0, lambda e: None))
        clock.advance(2)
        self.assertNoResult(d)
        self.assertEqual(events[0], Retrying(attempt=1, after_ms=2000, error="refused"))
        self.assertEqual(events[1:], [Queued(ahead=1)])
        other.release()
        self.assertEqual(self.successResultOf(d), "done")
