# -*- test-case-name: loopd.test.test_selftest -*-
"""
The self-test's own short, bounded wait (part of L{loopd.selftest}, whose docstring says
its rules): L{wait_for} tries a request again while the endpoint cannot be reached or loads
its model, reports each failed attempt as a progress line, and gives up at its bound with
L{GaveUp}; L{describe_error} says in words what is wrong.

The attempts and the pauses between them are L{loopd.llama.retry.retry_loop}'s, the llama
client's retry loop; what is the self-test's own is the policy (its L{Pause
<loopd.llama.retry.Pause>}: which failures wait, the steps of L{RETRY_STEPS_S}, a progress
line per retry) and the deadline at the bound, which ends a pause, or a running request
that must answer within it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd import strict_json
from loopd.errors import Connect, Http, ProxyRefused, StreamClosedEarly
from loopd.llama import InferError
from loopd.llama.retry import retry_loop

__all__ = [
    "RETRY_STEPS_S",
    "GaveUp",
    "NoAnswer",
    "Progress",
    "describe_error",
    "error_text",
    "log_progress",
    "wait_for",
]

_T = TypeVar("_T")

_log = Logger(namespace="loopd.selftest")

#: Where the self-test's progress lines go: one line each, without a newline.
Progress = Callable[[str], None]

#: The waits before each retry of a self-test request, in seconds; the last repeats.
RETRY_STEPS_S = (0.5, 1.0, 2.0)


class NoAnswer(InferError):  # noqa: N818 - named like the kinds of loopd.errors
    """
    A self-test request was sent but had no answer by the end of the self-test's wait.
    """

    def __init__(self, endpoint: str, what: str, seconds: float) -> None:
        """
        @param endpoint: the endpoint's name.
        @param what: the request, as a report names it (C{/props}).
        @param seconds: how long it was waited for.
        """
        super().__init__(f"endpoint {endpoint} did not answer {what} within {seconds:g} s")


class GaveUp(InferError):  # noqa: N818 - named like the kinds of loopd.errors
    """
    The self-test's bounded wait (L{wait_for}) ran out while the endpoint kept failing.

    @ivar error: the last failure, an L{InferError}.
    @ivar seconds: the bound that ran out.
    @ivar endpoint: the endpoint's name.
    """

    def __init__(self, error: BaseException, seconds: float, endpoint: str) -> None:
        """
        @param error: the last failure before the bound.
        @param seconds: the bound, in seconds.
        @param endpoint: the endpoint's name.
        """
        text = describe_error(error, endpoint)
        if not isinstance(error, NoAnswer):
            text += f"; gave up after {seconds:g} s"
        super().__init__(text)
        self.error = error
        self.seconds = seconds
        self.endpoint = endpoint


_UNREACHABLE = "unreachable"
_LOADING = "loading"
_SERVICE_UNAVAILABLE = 503
#: How much of an HTTP error's message a failure line shows.
MESSAGE_SHOWN = 200


def _waits_for(error: BaseException) -> str | None:
    """
    What a failure of a self-test request means for the wait: C{"unreachable"} (tried again
    within C{selftest_wait_ms}), C{"loading"} (tried again within C{load_wait_ms}), or None
    (the request has failed).
    """
    if isinstance(error, (Connect, ProxyRefused, StreamClosedEarly)):
        return _UNREACHABLE
    if isinstance(error, Http) and error.status == _SERVICE_UNAVAILABLE:
        return _LOADING
    return None


def _http_message(error: Http) -> str:
    """The message of an HTTP error: llama-server's C{error.message}, else the body, cut."""
    message = error.body.strip()
    try:
        decoded = strict_json.decode(error.body)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        inner = decoded.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            message = inner["message"]
        elif isinstance(inner, str):
            message = inner
    if len(message) > MESSAGE_SHOWN:
        message = message[:MESSAGE_SHOWN] + "..."
    return message


_REFUSALS = {
    ProxyRefused.CONNECTIONS: "refused by its inferproxy (its connection limit is reached)",
    ProxyRefused.ACCEPT_RATE: "refused by its inferproxy (its accept rate limit is reached)",
}


def _waiting_text(error: BaseException) -> str:
    """A retried failure as a progress line names it: what the self-test waits for."""
    if isinstance(error, Connect):
        return error.reason
    if isinstance(error, ProxyRefused):
        return _REFUSALS.get(error.limit, f"refused by its inferproxy (limit {error.limit!r})")
    if isinstance(error, StreamClosedEarly):
        return "the connection closed without an answer (is the server behind it down?)"
    if isinstance(error, Http):
        message = _http_message(error)
        return f"not ready (HTTP {error.status}{': ' + message if message else ''})"
    return error_text(error)


def describe_error(error: BaseException, endpoint: str) -> str:
    """
    A failed self-test request in words, naming the endpoint and what is wrong with it
    ("endpoint tiny is unreachable: no socket (nothing is serving it)"), without the
    socket's path.
    """
    if isinstance(error, (GaveUp, NoAnswer)):
        return str(error)
    if isinstance(error, Connect):
        return f"endpoint {endpoint} is unreachable: {error.reason}"
    if isinstance(error, ProxyRefused):
        return str(ProxyRefused(error.limit, endpoint=endpoint))
    if isinstance(error, StreamClosedEarly):
        return (
            f"endpoint {endpoint} closed the connection without a complete answer ({error}); "
            "is the server behind its inferproxy down?"
        )
    if isinstance(error, Http):
        message = _http_message(error)
        return (
            f"endpoint {endpoint} answered HTTP {error.status}{': ' + message if message else ''}"
        )
    return f"endpoint {endpoint}: {error_text(error)}"


def log_progress(line: str) -> None:
    """The default progress sink: the line goes to the log."""
    _log.info("selftest: {line}", line=line)


def wait_for(
    attempt: Callable[[], Deferred[_T]],
    *,
    clock: IReactorTime,
    endpoint: str,
    what: str,
    bound_s: float,
    load_bound_s: float,
    on_progress: Progress,
    answer_within: bool = False,
) -> Deferred[_T]:
    """
    Run C{attempt()} and, while it fails because the endpoint cannot be reached or is
    loading, report it on C{on_progress} and run it again after L{RETRY_STEPS_S}, until
    the bound of that failure since the first attempt: C{bound_s} for an endpoint that
    cannot be reached (L{Connect}, L{ProxyRefused} (after its C{Retry-After} when that is
    longer), L{StreamClosedEarly}), C{load_bound_s} for HTTP 503. No retry starts after the
    bound; at the bound the wait fails with L{GaveUp} carrying the last failure. Any other
    failure fails it at once.

    @param what: the request as a line names it (C{/props}).
    @param answer_within: an attempt still running at the bound is cancelled and the wait
        fails with L{GaveUp} of L{NoAnswer}; otherwise (a chat, which may take its time
        generating) it runs on.
    @return: a Deferred with the first success. Cancelling it cancels the running attempt
        or the pending retry.
    """
    wait = _Wait(attempt, clock, endpoint, what, on_progress, answer_within)
    return wait.start({_UNREACHABLE: bound_s, _LOADING: load_bound_s})


class _Wait:
    """
    One run of L{wait_for}: L{retry_loop}'s attempts and pauses, under the self-test's
    bounds: a deadline at the bound of the last failure's kind, and a progress line and a
    step of L{RETRY_STEPS_S} per retry.
    """

    def __init__(
        self,
        attempt: Callable[[], Deferred[Any]],
        clock: IReactorTime,
        endpoint: str,
        what: str,
        on_progress: Progress,
        answer_within: bool,
    ) -> None:
        """Nothing tried yet; L{start} begins."""
        self._attempt = attempt
        self._clock = clock
        self._endpoint = endpoint
        self._what = what
        self._on_progress = on_progress
        self._answer_within = answer_within
        self._result: Deferred[Any] = Deferred(self._cancel)
        self._bounds: dict[str, float] = {}
        self._bound = 0.0
        self._started = 0.0
        self._last: BaseException | None = None
        self._attempting = False
        self._loop: Deferred[Any] | None = None
        self._deadline: IDelayedCall | None = None

    def start(self, bounds: dict[str, float]) -> Deferred[Any]:
        """Start the first attempt, with the bound of an unreachable endpoint in force."""
        self._bounds = bounds
        self._started = self._clock.seconds()
        self._set_bound(bounds[_UNREACHABLE])
        loop = retry_loop(self._one_attempt, clock=self._clock, pause=self._pause)
        self._loop = loop
        loop.addCallbacks(self._succeeded, self._failed)
        return self._result

    def _elapsed(self) -> float:
        """Seconds since the first attempt started."""
        return self._clock.seconds() - self._started

    def _set_bound(self, bound: float) -> None:
        """Put the deadline at C{bound} seconds after the first attempt started."""
        self._bound = bound
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = self._clock.callLater(
            max(0.0, bound - self._elapsed()), self._deadline_reached
        )

    def _one_attempt(self) -> Deferred[Any]:
        """Start one attempt, knowing while it runs."""
        self._attempting = True

        def ended(result: object) -> object:
            """The attempt is over, whichever way."""
            self._attempting = False
            return result

        return maybeDeferred(self._attempt).addBoth(ended)

    def _pause(self, error: BaseException, tries: int, elapsed: float) -> float | None:
        """
        The L{Pause} of the loop: what the failure means for the wait (L{_waits_for}); the
        bound of its kind; past the bound, L{GaveUp}; else a progress line and the step.
        """
        kind = _waits_for(error)
        if kind is None:
            return None
        self._last = error
        if self._bounds[kind] != self._bound:
            self._set_bound(self._bounds[kind])
        if elapsed >= self._bound:
            raise GaveUp(error, self._bound, self._endpoint)
        steps = RETRY_STEPS_S
        step = steps[min(tries - 1, len(steps) - 1)]
        if isinstance(error, ProxyRefused) and error.retry_after is not None:
            step = max(step, error.retry_after)
        line = (
            f"endpoint {self._endpoint}: {_waiting_text(error)}, "
            f"retrying {round(elapsed, 1):g} of {self._bound:g} s"
        )
        try:
            self._on_progress(line)
        except Exception:
            _log.failure("the self-test's progress sink raised on {line!r}", line=line)
        # A step reaching past the bound is never taken: the deadline, set before it,
        # ends the wait first and cancels it.
        return step

    def _succeeded(self, value: object) -> None:
        """The loop succeeded, and so does the wait (unless it has ended already)."""
        if not self._result.called:
            self._stop()
            self._result.callback(value)

    def _failed(self, failure: Failure) -> None:
        """The loop failed (at once, or with L{GaveUp}): so does the wait, unless ended."""
        if not self._result.called:
            self._stop()
            self._result.errback(failure)

    def _deadline_reached(self) -> None:
        """The bound is reached: end a pause with the last failure, and a running /props."""
        self._deadline = None
        if self._result.called:
            return
        if not self._attempting:
            self._give_up()
        elif self._answer_within:
            self._last = NoAnswer(self._endpoint, self._what, self._bound)
            self._give_up()

    def _give_up(self) -> None:
        """Fail the wait with L{GaveUp} of the last failure, and stop the loop."""
        self._stop()
        last = self._last or NoAnswer(self._endpoint, self._what, self._bound)
        self._result.errback(Failure(GaveUp(last, self._bound, self._endpoint)))
        self._stop_loop()

    def _stop(self) -> None:
        """Cancel the deadline."""
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _stop_loop(self) -> None:
        """Cancel the loop: its pending retry, or its running attempt."""
        loop, self._loop = self._loop, None
        if loop is not None:
            # The wait has ended, or ends with the loop's CancelledError (L{_failed}).
            loop.cancel()

    def _cancel(self, result: Deferred[Any]) -> None:
        """The canceller: stop the deadline and cancel the loop."""
        self._stop()
        self._stop_loop()


def error_text(error: BaseException) -> str:
    """An error as a report shows it: its kind and message."""
    message = str(error)
    kind = type(error).__name__
    return f"{kind}: {message}" if message else kind
