# -*- test-case-name: loopd.test.test_moa_fanout -*-
"""
The mesh fan-out: every worker called at once, each with its own timeout and one retry after
a 429 (reference/mesh-moa.md §1.7 dispatch and gather, §1.8 429 handling; DESIGN §3
decision 29).

L{Fanout} owns the timers and the in-flight Deferreds of one turn's workers and nothing else:
it does not normalize, arbitrate or arm the grace timer (the gateway does, from the results it
is given). Each worker's result reaches C{on_result} exactly once, in completion order, unless
L{Fanout.cancel_all} came first.

Departures from v1, on purpose:
  - The 429 test is the typed L{RateLimited} exception the caller raises for an HTTP 429,
    not a substring match on the error text (§7 quirk 2: a port number containing "429"
    retried).
  - The retry runs within the worker's one timeout, which starts when the worker is first
    called; v1 gave the retry a fresh full timeout, so a 429 could stretch a worker to twice
    the timeout plus the Retry-After. A Retry-After that ends after the deadline means the
    timeout is reported, at the deadline.
  - The timeout is enforced here (v1 relied on every backend to honour it, §1.2), and a
    timed-out or cancelled worker's Deferred is cancelled, which closes its upstream
    connection (decision 29).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from loopd.moa.outcome import Outcome

__all__ = [
    "DEFAULT_RETRY_AFTER",
    "WORKER_TIMEOUT",
    "Fanout",
    "RateLimited",
    "WorkerTimedOut",
]

#: Seconds a worker may take, retry included, before it is cancelled (§2 C{worker_timeout}).
WORKER_TIMEOUT = 60.0

#: Seconds to wait before retrying a 429 that names no Retry-After (§1.8).
DEFAULT_RETRY_AFTER = 1.0

W = TypeVar("W")


class RateLimited(Exception):  # noqa: N818 (the name the brief gives it)
    """
    The upstream answered HTTP 429. The caller's C{call} fails with this to get one retry.

    @ivar retry_after: the response's C{Retry-After} in seconds, or C{None} when it had none
        (then L{DEFAULT_RETRY_AFTER} applies).
    """

    def __init__(self, retry_after: float | None = None) -> None:
        """
        @param retry_after: the C{Retry-After} seconds, or C{None} when absent.
        """
        super().__init__(f"HTTP 429 (retry after {retry_after!r} s)")
        self.retry_after = retry_after

    def delay(self) -> float:
        """
        Return the seconds to wait before the retry: the Retry-After (never negative), or
        L{DEFAULT_RETRY_AFTER} when there was none.
        """
        if self.retry_after is None:
            return DEFAULT_RETRY_AFTER
        return max(0.0, float(self.retry_after))


class WorkerTimedOut(Exception):  # noqa: N818 (reads as a state, as RateLimited does)
    """
    A worker gave no result within the worker timeout; its call was cancelled.

    @ivar timeout: the worker timeout in seconds.
    """

    def __init__(self, timeout: float) -> None:
        """
        @param timeout: the worker timeout that ran out, in seconds.
        """
        super().__init__(f"worker timed out after {timeout:g} s")
        self.timeout = timeout


@dataclass(eq=False)
class _Slot(Generic[W]):
    """
    One worker's bookkeeping: its pending call, its timers, and whether it has finished.
    """

    worker: W
    attempts: int = 0
    done: bool = False
    pending: Deferred[Outcome] | None = None
    deadline: IDelayedCall | None = None
    retry: IDelayedCall | None = None


class Fanout(Generic[W]):
    """
    Call every worker at once and report each result once, in completion order.

    A worker's result is C{on_result(worker, outcome, None)} when its call succeeded and
    C{on_result(worker, None, failure)} when it failed: the call raised or its Deferred
    failed (a synchronous exception counts the same), a second 429 (the L{RateLimited}
    failure), or no result within C{worker_timeout} seconds (a L{WorkerTimedOut} failure; the
    call's Deferred is cancelled). A first 429 is not reported: the worker is called again
    after the Retry-After seconds, if that is before its deadline.

    C{on_result} may call L{cancel_all}; it must not raise.

    @ivar worker_timeout: seconds each worker gets, from its first call.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        workers: Sequence[W],
        call: Callable[[W], Deferred[Outcome]],
        on_result: Callable[[W, Outcome | None, Failure | None], None],
        worker_timeout: float = WORKER_TIMEOUT,
    ) -> None:
        """
        @param reactor: the clock every timer goes through.
        @param workers: the workers, opaque to this class; each is passed to C{call}.
        @param call: does one upstream request for a worker; its Deferred fires with the
            L{Outcome} or fails (with L{RateLimited} for an HTTP 429). Cancelling the
            Deferred must abandon the request.
        @param on_result: receives each worker's result, see the class docstring.
        @param worker_timeout: seconds each worker gets, retry included.
        """
        self._reactor = reactor
        self._slots = [_Slot(worker) for worker in workers]
        self._call = call
        self._on_result = on_result
        self.worker_timeout = worker_timeout
        self._started = False
        self._stopped = False

    def start(self) -> None:
        """
        Call every worker and arm each one's timeout. A fan-out starts once only
        (C{RuntimeError} otherwise).
        """
        if self._started:
            raise RuntimeError("this fan-out has already started")
        self._started = True
        for slot in self._slots:
            if self._stopped:
                # on_result cancelled everything while earlier workers were being started.
                slot.done = True
                continue
            slot.deadline = self._reactor.callLater(self.worker_timeout, self._time_out, slot)
            self._attempt(slot)

    def running(self) -> list[W]:
        """
        Return the workers still running (called or waiting for a retry), in worker order.
        Empty before L{start}.
        """
        if not self._started:
            return []
        return [slot.worker for slot in self._slots if not slot.done]

    def cancel_all(self) -> None:
        """
        Cancel every worker still running and its timers; no C{on_result} call follows,
        whatever the cancelled calls do. Safe to call more than once, or from C{on_result}.
        """
        self._stopped = True
        for slot in self._slots:
            if not slot.done:
                self._close(slot)

    def _attempt(self, slot: _Slot[W]) -> None:
        """
        Make one call for C{slot}'s worker and wire its result.
        """
        slot.retry = None
        slot.attempts += 1
        d: Deferred[Outcome] = maybeDeferred(self._call, slot.worker)
        slot.pending = d
        d.addCallbacks(self._succeeded, self._failed, callbackArgs=(slot, d), errbackArgs=(slot, d))

    def _succeeded(self, outcome: Outcome, slot: _Slot[W], d: Deferred[Outcome]) -> None:
        """
        A call fired: report its outcome unless the worker already finished.
        """
        if slot.done or slot.pending is not d:
            return
        slot.pending = None
        self._finish(slot, outcome, None)

    def _failed(self, failure: Failure, slot: _Slot[W], d: Deferred[Outcome]) -> None:
        """
        A call failed: retry a first 429, otherwise report the failure. A failure of a call
        already given up on (timed out or cancelled) is swallowed.
        """
        if slot.done or slot.pending is not d:
            return
        slot.pending = None
        if slot.attempts == 1 and failure.check(RateLimited) is not None:
            limited = failure.value
            assert isinstance(limited, RateLimited)
            # A retry that would start at or after the deadline never runs: the timeout
            # fires first (it was armed first) and closes the slot.
            slot.retry = self._reactor.callLater(limited.delay(), self._attempt, slot)
            return
        self._finish(slot, None, failure)

    def _time_out(self, slot: _Slot[W]) -> None:
        """
        The worker's deadline passed: cancel it and report the timeout.
        """
        slot.deadline = None
        if slot.done:
            return
        self._finish(slot, None, Failure(WorkerTimedOut(self.worker_timeout)))

    def _finish(self, slot: _Slot[W], outcome: Outcome | None, failure: Failure | None) -> None:
        """
        Close C{slot} and report its result, unless everything was cancelled.
        """
        self._close(slot)
        if not self._stopped:
            self._on_result(slot.worker, outcome, failure)

    def _close(self, slot: _Slot[W]) -> None:
        """
        Mark C{slot} finished, stop its timers and cancel its pending call.
        """
        slot.done = True
        for timer in (slot.deadline, slot.retry):
            if timer is not None and timer.active():
                timer.cancel()
        slot.deadline = slot.retry = None
        pending, slot.pending = slot.pending, None
        if pending is not None and not pending.called:
            pending.cancel()
