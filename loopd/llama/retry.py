# -*- test-case-name: loopd.test.test_llama_retry -*-
"""
Retrying a failed request: what is retryable, the backoff schedule, and the retry loop.

A request that failed because the server was away or went quiet (L{Connect},
L{StreamClosedEarly}, L{Stalled}, L{LoadTimeout}, or L{Http} 503) is tried again: at most
C{Retry.attempts} attempts in all, waiting C{backoff_ms[i]} scaled by a random factor in
C{[1 - jitter, 1 + jitter]} before retry C{i + 1}, and never starting a wait that would end
more than C{total_ms} after the first attempt started. Everything else is returned at once:
L{WaitTimeout} has already waited, HTTP 400 may ask the caller to compact, and the rest are
bugs. Retrying is safe because nothing is recorded before a completion is final; what was
already streamed to a consumer is the caller's to judge through C{retryable} (the llama
client retries a partly delivered answer only as its continuation, L{loopd.llama.resume}).

The timers run on an injected C{IReactorTime}, the random source is injectable, and the
schedule itself is pure (L{backoff_wait}, L{backoff_schedule}). The loop itself,
L{retry_loop}, takes what to do after a failure as a L{Pause}: L{with_retry} is the loop
with this module's policy, and the startup self-test's bounded wait
(L{loopd.selftest.wait}) is the same loop with its own.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd.errors import Connect, Http, LoadTimeout, Stalled, StreamClosedEarly
from loopd.llama.types import ChatEvent, Retrying
from loopd.settings import Retry

__all__ = ["Pause", "backoff_schedule", "backoff_wait", "is_retryable", "retry_loop", "with_retry"]

_T = TypeVar("_T")

_log = Logger(namespace="loopd.llama.retry")

#: What a L{retry_loop} does after a failed attempt: given the error, the number of attempts
#: made so far and the seconds since the first one started, the seconds to wait before the
#: next attempt, or None to fail the run with that failure. What it raises fails the run.
Pause = Callable[[BaseException, int, float], float | None]

_RETRYABLE = (Connect, StreamClosedEarly, Stalled, LoadTimeout)
_SERVICE_UNAVAILABLE = 503


def is_retryable(error: BaseException) -> bool:
    """
    Whether a request that failed with C{error} may be tried again: L{Connect},
    L{StreamClosedEarly}, L{Stalled}, L{LoadTimeout}, and L{Http} with status 503.
    """
    if isinstance(error, Http):
        return error.status == _SERVICE_UNAVAILABLE
    return isinstance(error, _RETRYABLE)


def backoff_wait(policy: Retry, retry: int, r: float) -> int:
    """
    The wait in milliseconds before retry C{retry + 1} (so C{retry} counts from 0):
    C{backoff_ms[retry]} (the last entry repeating) times C{1 + jitter * (2r - 1)}, rounded.

    @param r: a random number in C{[0, 1]}; 0 gives the shortest wait, 1 the longest.
    @raise ValueError: when C{retry} is negative or C{r} is outside C{[0, 1]}.
    """
    if retry < 0:
        raise ValueError(f"retry must be >= 0, got {retry}")
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"r must be in [0, 1], got {r!r}")
    steps = policy.backoff_ms
    base = steps[min(retry, len(steps) - 1)] if steps else 0
    return round(base * (1 + policy.jitter * (2 * r - 1)))


def backoff_schedule(policy: Retry, randoms: Iterable[float]) -> list[int]:
    """
    The waits in milliseconds before each retry of C{policy}: C{attempts - 1} of them,
    retry C{i} drawing the C{i}-th number of C{randoms} (fewer when C{randoms} runs out).
    """
    retries = range(policy.attempts - 1)
    return [backoff_wait(policy, retry, r) for retry, r in zip(retries, randoms, strict=False)]


def with_retry(
    attempt: Callable[[], Deferred[_T]],
    *,
    clock: IReactorTime,
    policy: Retry,
    on_event: Callable[[ChatEvent], None],
    random: Callable[[], float] = _random.random,
    retryable: Callable[[BaseException], bool] = is_retryable,
) -> Deferred[_T]:
    """
    Run C{attempt()} and, while it fails retryably, wait and run it again.

    Before each wait L{Retrying} is emitted with the number of the attempt that failed, the
    wait, and the error. The caller's C{attempt} goes back through the slot gate itself.

    @param attempt: starts one attempt; called once per attempt.
    @param clock: the timers of the waits, and the time since the first attempt started.
    @param random: draws the jitter of each wait, a number in C{[0, 1]}.
    @param retryable: which failures are tried again (L{is_retryable} unless given).
    @return: a Deferred with the first success, or the failure of the last attempt (at once
        for one that is not retryable). Cancelling it cancels the running attempt or the
        pending wait and fails it with C{CancelledError}.
    """
    return retry_loop(attempt, clock=clock, pause=_backoff(policy, on_event, random, retryable))


def _backoff(
    policy: Retry,
    on_event: Callable[[ChatEvent], None],
    random: Callable[[], float],
    retryable: Callable[[BaseException], bool],
) -> Pause:
    """
    L{with_retry}'s L{Pause}: a retryable failure is tried again after L{backoff_wait},
    within C{policy}'s attempts and C{total_ms}, L{Retrying} emitted before the wait.
    """

    def pause(error: BaseException, tries: int, elapsed: float) -> float | None:
        """The wait before the next attempt, in seconds, or None to give up."""
        if not retryable(error) or tries >= policy.attempts:
            return None
        wait = backoff_wait(policy, tries - 1, random())
        if elapsed * 1000 + wait > policy.total_ms:
            return None
        event = Retrying(attempt=tries, after_ms=wait, error=str(error) or type(error).__name__)
        try:
            on_event(event)
        except Exception:
            _log.failure("on_event raised while handling {event!r}", event=event)
        return wait / 1000

    return pause


def retry_loop(
    attempt: Callable[[], Deferred[_T]], *, clock: IReactorTime, pause: Pause
) -> Deferred[_T]:
    """
    Run C{attempt()} and, after each failure, ask C{pause} how long to wait before running
    it again (L{Pause}); stop at the first success, or when C{pause} says no more.

    @param attempt: starts one attempt; called once per attempt.
    @param clock: the timers of the waits, and the time since the first attempt started.
    @param pause: after each failed attempt, the wait before the next (None: give up). It
        may cancel the run's Deferred; then no attempt follows.
    @return: a Deferred with the first success, or the failure C{pause} ended the run with.
        Cancelling it cancels the running attempt or the pending wait and fails it with
        C{CancelledError}.
    """
    return _Retrier(attempt, clock, pause).start()


class _Retrier(Generic[_T]):
    """One run of L{retry_loop}: the attempt in progress or the wait before the next."""

    def __init__(
        self, attempt: Callable[[], Deferred[_T]], clock: IReactorTime, pause: Pause
    ) -> None:
        """Nothing tried yet; L{start} begins the run."""
        self._attempt = attempt
        self._clock = clock
        self._pause = pause
        self._result: Deferred[_T] = Deferred(self._cancel)
        self._cancelled = False
        self._started = 0.0
        self._tries = 0
        self._running: Deferred[_T] | None = None
        self._timer: IDelayedCall | None = None

    def start(self) -> Deferred[_T]:
        """Start the first attempt and return the Deferred of the whole run."""
        self._started = self._clock.seconds()
        self._try()
        return self._result

    def _try(self) -> None:
        """Start one attempt."""
        self._timer = None
        self._tries += 1
        running = maybeDeferred(self._attempt)
        self._running = running
        running.addCallbacks(self._succeeded, self._failed)

    def _succeeded(self, value: _T) -> None:
        """An attempt succeeded: so does the run, unless it was cancelled."""
        self._running = None
        if not self._cancelled:
            self._result.callback(value)

    def _failed(self, failure: Failure) -> None:
        """An attempt failed: retry it after the pause, or fail the run."""
        self._running = None
        if self._cancelled:
            return
        error = failure.value
        if error is None:
            self._result.errback(failure)
            return
        try:
            wait = self._pause(error, self._tries, self._clock.seconds() - self._started)
        except Exception:
            if not self._result.called:
                self._result.errback(Failure())
            return
        if self._result.called:
            # The pause cancelled the run.
            return
        if wait is None:
            self._result.errback(failure)
            return
        self._timer = self._clock.callLater(wait, self._try)

    def _cancel(self, result: Deferred[_T]) -> None:
        """
        The canceller of the run: stop the wait or cancel the attempt. Deferred.cancel then
        fails the run with C{CancelledError}, whatever the attempt does on cancellation.
        """
        self._cancelled = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._running is not None:
            self._running.cancel()
