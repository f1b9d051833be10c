# -*- test-case-name: loopd.test.test_selftest -*-
"""
The startup self-test (seed §5): the server behind an endpoint is the one the config
describes, its tool calls parse, and a second turn reuses the first turn's prompt cache.

Pure orchestration over a L{Client}. The three checks run in order on the endpoint's main
slot (slot 0) and cost about 1,000 tokens; a failing check is recorded and the next one still
runs, except after a C{/props} that never reached the server: then the other two are not run
(they would only wait again) and fail as such.

The self-test has its own short, bounded wait (L{wait_for}), not the llama client's retry
schedule (2 + 8 + 30 s per request, which made an unreachable endpoint silent for ~113 s):
a request that fails because the endpoint cannot be reached (no socket, connection refused,
refused by its inferproxy, closed before any answer, no answer) is tried again after 0.5, 1,
then every 2 s, until the endpoint's C{selftest_wait_ms} (default 10 s) since the first
attempt; a server loading its model (HTTP 503) is waited for up to C{limits.load_wait_ms}
instead. Each failed attempt is reported as it happens, one progress line saying what the
self-test waits for and how long it has waited ("endpoint tiny: connection refused (nothing
is listening on the socket), retrying 1.5 of 10 s"); the check's failure line says what is
wrong in words (L{describe_error}). L{require_selftests} is the gate C{twist loopd} passes
before it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, inlineCallbacks, maybeDeferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd import strict_json
from loopd.digest import sha256_hex
from loopd.errors import Connect, Http, ProxyRefused, StreamClosedEarly
from loopd.llama import (
    ChatEvent,
    ChatMessage,
    ChatRequest,
    Client,
    Completion,
    FinishReason,
    InferError,
    System,
    ToolCall,
    ToolSchema,
    User,
    cache_outcome,
)
from loopd.settings import Config, Expect

__all__ = [
    "RETRY_STEPS_S",
    "CheckResult",
    "NoAnswer",
    "Progress",
    "SelftestFailed",
    "SelftestReport",
    "WEATHER_TOOL",
    "describe_error",
    "judge_cache",
    "judge_props",
    "judge_tool_call",
    "require_selftests",
    "run_selftest",
    "wait_for",
]

_T = TypeVar("_T")

_log = Logger(namespace="loopd.selftest")

#: Where the self-test's progress lines go: one line each, without a newline.
Progress = Callable[[str], None]

#: The waits before each retry of a self-test request, in seconds; the last repeats.
RETRY_STEPS_S = (0.5, 1.0, 2.0)

#: The slot every check runs on: the endpoint's main slot.
MAIN_SLOT = 0
#: Generation budgets; the tool check's call is short, the cache turns' answers shorter.
TOOL_MAX_TOKENS = 256
CACHE_MAX_TOKENS = 128
#: How much of a tool call's arguments a report line shows.
ARGUMENTS_SHOWN = 120

#: The one tool of the tool check.
WEATHER_TOOL = ToolSchema(
    "get_weather",
    "Get the current weather for a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city's name."}},
        "required": ["city"],
    },
)
TOOL_PROMPT: tuple[ChatMessage, ...] = (User("What is the weather like in Paris right now?"),)

# Long enough that turn 1's context is well above cache_loss_tokens on any tokenizer, so a
# lost cache shows as a loss; short enough to keep the whole self-test near 1,000 tokens.
CACHE_SYSTEM = (
    "You are taking part in the start-up check of loopd, a gateway that gives coding agents "
    "bounded access to a local language model server. This conversation checks that the "
    "server keeps a session's prompt in its cache between turns: the second request repeats "
    "this message, the first question and your first answer word for word, then adds one "
    "more question. When the cache works the server reads only what is new. Answer each "
    "question in one short sentence, without tools and without repeating the question."
)
CACHE_TURN_1 = "Name one colour of the rainbow."
CACHE_TURN_2 = "Name another one."


def _ignore(event: ChatEvent) -> None:
    """The self-test's event sink: progress is not reported."""


@dataclass(frozen=True)
class CheckResult:
    """
    The outcome of one check.

    @ivar name: C{props}, C{tools} or C{cache}.
    @ivar expected: what the check required, with its values.
    @ivar actual: what the server did, with its values; the error text when the check
        could not reach the server.
    @ivar detail: for a check that compares several values, each with its own
        expectation, the comparison spelled out value by value; the line shows it in place
        of the plain "expected ... got ...".
    """

    name: str
    passed: bool
    expected: str
    actual: str
    detail: str = ""

    def line(self) -> str:
        """
        One human line: PASS or FAIL, the check's name, what was expected and what came.
        """
        verdict = "PASS" if self.passed else "FAIL"
        comparison = self.detail or f"expected {self.expected} got {self.actual}"
        return f"{verdict} {self.name}: {comparison}"


@dataclass(frozen=True)
class SelftestReport:
    """
    The self-test of one endpoint: its checks, in the order they ran.
    """

    endpoint: str
    checks: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        """
        Whether every check passed.
        """
        return all(check.passed for check in self.checks)

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        """
        The checks that failed, in order.
        """
        return tuple(check for check in self.checks if not check.passed)

    def lines(self) -> list[str]:
        """
        One human line per check (L{CheckResult.line}).
        """
        return [check.line() for check in self.checks]


class SelftestFailed(Exception):  # noqa: N818 - the name the design gives it
    """
    An endpoint failed its self-test, so loopd must not start.

    @ivar report: the first failing endpoint's report.
    @ivar reports: the reports of every endpoint that was tested.
    """

    def __init__(self, report: SelftestReport, reports: tuple[SelftestReport, ...] = ()) -> None:
        """
        @param report: the first failing report; the message names its failing checks.
        @param reports: every report, the failing one included.
        """
        failing = "; ".join(check.line() for check in report.failures)
        super().__init__(f"self-test of endpoint {report.endpoint} failed: {failing}")
        self.report = report
        self.reports = reports or (report,)


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
    return _error_text(error)


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
    return f"endpoint {endpoint}: {_error_text(error)}"


def _log_progress(line: str) -> None:
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
    """One run of L{wait_for}: the attempt in progress or the pause before the next."""

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
        self._tries = 0
        self._last: BaseException | None = None
        self._running: Deferred[Any] | None = None
        self._timer: IDelayedCall | None = None
        self._deadline: IDelayedCall | None = None

    def start(self, bounds: dict[str, float]) -> Deferred[Any]:
        """Start the first attempt, with the bound of an unreachable endpoint in force."""
        self._bounds = bounds
        self._started = self._clock.seconds()
        self._set_bound(bounds[_UNREACHABLE])
        self._try()
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

    def _try(self) -> None:
        """Start one attempt."""
        self._timer = None
        self._tries += 1
        running = maybeDeferred(self._attempt)
        self._running = running
        running.addCallbacks(self._succeeded, self._failed)

    def _succeeded(self, value: object) -> None:
        """An attempt succeeded, and so does the wait (unless it has ended already)."""
        self._running = None
        if not self._result.called:
            self._stop()
            self._result.callback(value)

    def _failed(self, failure: Failure) -> None:
        """An attempt failed: report it and retry before the bound, or end the wait."""
        self._running = None
        if self._result.called:
            return
        error = failure.value
        kind = _waits_for(error) if error is not None else None
        if error is None or kind is None:
            self._stop()
            self._result.errback(failure)
            return
        self._last = error
        if self._bounds[kind] != self._bound:
            self._set_bound(self._bounds[kind])
        elapsed = self._elapsed()
        if elapsed >= self._bound:
            self._give_up()
            return
        steps = RETRY_STEPS_S
        step = steps[min(self._tries - 1, len(steps) - 1)]
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
        if elapsed + step < self._bound:
            self._timer = self._clock.callLater(step, self._try)
        # Otherwise the deadline ends the wait, at the bound.

    def _deadline_reached(self) -> None:
        """The bound is reached: end a pause with the last failure, and a running /props."""
        self._deadline = None
        if self._result.called:
            return
        running = self._running
        if running is None:
            self._give_up()
        elif self._answer_within:
            self._running = None
            self._last = NoAnswer(self._endpoint, self._what, self._bound)
            self._give_up()
            running.cancel()

    def _give_up(self) -> None:
        """Fail the wait with L{GaveUp} of the last failure."""
        self._stop()
        last = self._last or NoAnswer(self._endpoint, self._what, self._bound)
        self._result.errback(Failure(GaveUp(last, self._bound, self._endpoint)))

    def _stop(self) -> None:
        """Cancel the pending retry and the deadline."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        self._deadline = None

    def _cancel(self, result: Deferred[Any]) -> None:
        """The canceller: stop the timers and cancel the running attempt."""
        self._stop()
        running, self._running = self._running, None
        if running is not None:
            running.cancel()


def _error_text(error: BaseException) -> str:
    """An error as a report shows it: its kind and message."""
    message = str(error)
    kind = type(error).__name__
    return f"{kind}: {message}" if message else kind


def _integer(value: object) -> int | None:
    """C{value} if it is a JSON integer (not a boolean), else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _props_values(props: Mapping[str, Any]) -> tuple[str | None, int | None, int | None]:
    """The template's SHA-256, per-slot n_ctx and total_slots of C{/props}; None if absent."""
    template = props.get("chat_template")
    digest = sha256_hex(template.encode("utf-8")) if isinstance(template, str) else None
    settings = props.get("default_generation_settings")
    n_ctx = _integer(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return digest, n_ctx, _integer(props.get("total_slots"))


_PROPS_LABELS = ("chat_template sha256", "n_ctx", "total_slots")


def _expectations(expect: Expect) -> tuple[str | int | None, ...]:
    """The three expectations of the props check, in L{_PROPS_LABELS} order."""
    return (expect.chat_template_sha256, expect.n_ctx, expect.total_slots)


def _shown(value: object) -> str:
    """A value of C{/props} as a report line shows it: "missing" for None."""
    return "missing" if value is None else str(value)


def _props_expected_text(expect: Expect) -> str:
    """The props check's expectations as one text, "not set" for those the config leaves out."""
    pairs = zip(_PROPS_LABELS, _expectations(expect), strict=True)
    return ", ".join(f"{label} {'not set' if v is None else v}" for label, v in pairs)


def judge_props(props: Mapping[str, Any], expect: Expect) -> CheckResult:
    """
    Check 1: C{/props} against C{[endpoint.expect]}. An expectation that is not set is
    shown as "not set" and does not fail; a value missing from C{/props} fails a set one.
    """
    actual = _props_values(props)
    parts = []
    passed = True
    for label, wanted, got in zip(_PROPS_LABELS, _expectations(expect), actual, strict=True):
        if wanted is None:
            parts.append(f"{label} expected not set got {_shown(got)} (not checked)")
            continue
        passed = passed and wanted == got
        parts.append(f"{label} expected {wanted} got {_shown(got)}")
    actual_text = ", ".join(
        f"{label} {_shown(got)}" for label, got in zip(_PROPS_LABELS, actual, strict=True)
    )
    return CheckResult(
        "props", passed, _props_expected_text(expect), actual_text, detail=", ".join(parts)
    )


def _is_json_object(text: str) -> bool:
    """Whether C{text} decodes as a JSON object, read as L{loopd.strict_json} reads JSON."""
    try:
        return isinstance(strict_json.decode(text), dict)
    except ValueError:
        return False


def _describe_call(call: ToolCall) -> str:
    """
    A tool call for the report: its name and arguments, cut to L{ARGUMENTS_SHOWN}
    characters, noting arguments that are not a JSON object.
    """
    arguments = call.arguments
    if len(arguments) > ARGUMENTS_SHOWN:
        arguments = arguments[:ARGUMENTS_SHOWN] + "..."
    note = "" if _is_json_object(call.arguments) else " (arguments not a JSON object)"
    return f"{call.name} {arguments}{note}"


TOOLS_EXPECTED = (
    f"one {WEATHER_TOOL.name} call with JSON-object arguments, "
    f"finish_reason {FinishReason.TOOL_CALLS.value}"
)


def judge_tool_call(completion: Completion) -> CheckResult:
    """
    Check 2: exactly one call of the weather tool, its arguments a JSON object, and
    finish_reason C{tool_calls}.
    """
    calls = completion.tool_calls
    described = "; ".join(_describe_call(call) for call in calls) or "no tool call"
    passed = (
        len(calls) == 1
        and calls[0].name == WEATHER_TOOL.name
        and _is_json_object(calls[0].arguments)
        and completion.finish_reason is FinishReason.TOOL_CALLS
    )
    actual = f"{described}, finish_reason {completion.finish_reason.value}"
    return CheckResult("tools", passed, TOOLS_EXPECTED, actual)


def _cache_expected_text(threshold: int, context: int | None = None) -> str:
    """
    What the cache check expects; with C{context}, turn 1's prompt in tokens, the text
    says how much turn 2 must reuse.
    """
    reused = "turn 1's prompt" if context is None else f"turn 1's {context} tokens"
    return f"turn 2 to reuse {reused}, at most {threshold} short"


def judge_cache(first: Completion, second: Completion, threshold: int) -> CheckResult:
    """
    Check 3: turn 2's cache_outcome is not a loss; the line shows turn 1's prompt and what
    turn 2 reused.
    """
    outcome = cache_outcome(first.timings, second.timings, threshold)
    actual = f"{outcome.cached} reused ({outcome.shortfall} short)"
    expected = _cache_expected_text(threshold, outcome.expected)
    return CheckResult("cache", not outcome.loss, expected, actual)


@dataclass(frozen=True)
class _Asking:
    """
    How the checks ask the server: with a clock, each request through L{wait_for} with the
    endpoint's bounds; without one, each request once.
    """

    client: Client
    clock: IReactorTime | None
    on_progress: Progress

    @property
    def name(self) -> str:
        """The endpoint's name."""
        return self.client.endpoint.name

    def ask(
        self, attempt: Callable[[], Deferred[_T]], what: str, answer_within: bool
    ) -> Deferred[_T]:
        """C{attempt}, within the self-test's bounded wait when there is a clock."""
        if self.clock is None:
            return attempt()
        bound_s = self.client.endpoint.selftest_wait_ms / 1000
        load_bound_s = max(bound_s, self.client.config.limits.load_wait_ms / 1000)
        return wait_for(
            attempt,
            clock=self.clock,
            endpoint=self.name,
            what=what,
            bound_s=bound_s,
            load_bound_s=load_bound_s,
            on_progress=self.on_progress,
            answer_within=answer_within,
        )

    def chat(self, request: ChatRequest, what: str) -> Deferred[Completion]:
        """One chat of a check on the main slot, its events ignored."""
        return self.ask(lambda: self.client.chat(request, _ignore), what, False)


@inlineCallbacks
def _check_props(
    asking: _Asking,
) -> Generator[Deferred[Any], Any, tuple[CheckResult, bool]]:
    """
    Check 1 as a L{CheckResult}; an L{InferError} while asking C{/props} fails it with the
    error in words (L{describe_error}). With it, whether the wait for the endpoint gave up
    (L{GaveUp}).
    """
    expect = asking.client.endpoint.expect
    try:
        props = yield asking.ask(asking.client.props, "/props", True)
    except InferError as error:
        failed = CheckResult(
            "props",
            False,
            _props_expected_text(expect),
            _error_text(error),
            detail=describe_error(error, asking.name),
        )
        return failed, isinstance(error, GaveUp)
    return judge_props(props, expect), False


@inlineCallbacks
def _check_tools(asking: _Asking) -> Generator[Deferred[Any], Any, CheckResult]:
    """
    Check 2: ask for a C{required} call of L{WEATHER_TOOL}, without thinking, and judge the
    completion; an L{InferError} fails the check with the error in words.
    """
    request = ChatRequest(
        slot=MAIN_SLOT,
        messages=TOOL_PROMPT,
        tools=(WEATHER_TOOL,),
        thinking=False,
        max_tokens=TOOL_MAX_TOKENS,
        tool_choice="required",
    )
    try:
        completion = yield asking.chat(request, "the tool request")
    except InferError as error:
        detail = f"the tool request failed: {describe_error(error, asking.name)}"
        return CheckResult("tools", False, TOOLS_EXPECTED, _error_text(error), detail=detail)
    return judge_tool_call(completion)


def _cache_request(messages: tuple[ChatMessage, ...]) -> ChatRequest:
    """A cache-check turn on the main slot: C{messages}, no thinking, L{CACHE_MAX_TOKENS}."""
    return ChatRequest(
        slot=MAIN_SLOT, messages=messages, thinking=False, max_tokens=CACHE_MAX_TOKENS
    )


def _turn_failed(turn: int, error: InferError, expected: str, asking: _Asking) -> CheckResult:
    """The cache check failed because turn C{turn} failed with C{error}."""
    return CheckResult(
        "cache",
        False,
        expected,
        f"turn {turn} failed: {_error_text(error)}",
        detail=f"turn {turn} failed: {describe_error(error, asking.name)}",
    )


@inlineCallbacks
def _check_cache(asking: _Asking) -> Generator[Deferred[Any], Any, CheckResult]:
    """
    Check 3: turn 1 opens a conversation, turn 2 repeats it with turn 1's answer and one
    more question, and L{judge_cache} compares their timings. A turn failing with an
    L{InferError} fails the check, naming the turn.
    """
    threshold = asking.client.config.cache_loss_tokens
    opening = (System(CACHE_SYSTEM), User(CACHE_TURN_1))
    try:
        first = yield asking.chat(_cache_request(opening), "turn 1")
    except InferError as error:
        return _turn_failed(1, error, _cache_expected_text(threshold), asking)
    follow_up = (*opening, first.as_message(), User(CACHE_TURN_2))
    try:
        second = yield asking.chat(_cache_request(follow_up), "turn 2")
    except InferError as error:
        expected = _cache_expected_text(threshold, first.timings.total)
        return _turn_failed(2, error, expected, asking)
    return judge_cache(first, second, threshold)


def _not_run(name: str, expected: str, endpoint: str) -> CheckResult:
    """A check left out because C{/props} never reached the endpoint."""
    detail = f"not run: /props did not reach endpoint {endpoint}"
    return CheckResult(name, False, expected, "not run", detail=detail)


@inlineCallbacks
def _run(asking: _Asking) -> Generator[Deferred[Any], Any, SelftestReport]:
    """
    The three checks in order, each after the previous one has ended; when C{/props} gave
    up waiting for the endpoint, the other two are not run.
    """
    name = asking.name
    props, gave_up = yield _check_props(asking)
    if gave_up:
        threshold = asking.client.config.cache_loss_tokens
        tools = _not_run("tools", TOOLS_EXPECTED, name)
        cache = _not_run("cache", _cache_expected_text(threshold), name)
        return SelftestReport(name, (props, tools, cache))
    tools = yield _check_tools(asking)
    cache = yield _check_cache(asking)
    return SelftestReport(name, (props, tools, cache))


def run_selftest(
    client: Client,
    *,
    clock: IReactorTime | None = None,
    on_progress: Progress = _log_progress,
) -> Deferred[SelftestReport]:
    """
    Run the three checks on C{client}'s endpoint, in order, on slot 0: (1) C{/props}
    against C{[endpoint.expect]}, (2) a forced call of one tool, (3) a two-turn exchange
    whose turn 2 must not be a cache loss. The Deferred fires with the report whatever the
    checks find; a check that cannot reach the server records the error in words.

    @param clock: when given, each request is tried again within the self-test's bounded
        wait (L{wait_for}: the endpoint's C{selftest_wait_ms} while it cannot be reached,
        C{limits.load_wait_ms} while it loads), and when C{/props} gives up the other
        checks are not run; without one, each request is made once.
    @param on_progress: gets one line per failed attempt that will be retried, as it
        happens; by default the log.
    """
    return _run(_Asking(client, clock, on_progress))


@inlineCallbacks
def _require(
    reactor: Any, config: Config, clients: Mapping[str, Client], on_progress: Progress
) -> Generator[Deferred[Any], Any, list[SelftestReport]]:
    """
    The body of L{require_selftests}: the endpoints' self-tests one after the other, each
    with the daemon's client for it when there is one.
    """
    reports: list[SelftestReport] = []
    for endpoint in config.endpoints:
        if not endpoint.selftest or endpoint.kind != "llama-server":
            continue
        client = clients.get(endpoint.name) or Client(reactor, config, endpoint)
        report = yield run_selftest(client, clock=reactor, on_progress=on_progress)
        reports.append(report)
    failed = [report for report in reports if not report.passed]
    if failed:
        raise SelftestFailed(failed[0], tuple(reports))
    return reports


def require_selftests(
    reactor: Any,
    config: Config,
    clients: Mapping[str, Client],
    on_progress: Progress = _log_progress,
) -> Deferred[list[SelftestReport]]:
    """
    Run the self-test of every endpoint whose C{selftest} is true (kind C{llama-server}),
    one after the other in config order, and fire with their reports if all pass.

    @param reactor: provides IReactorTime and IReactorUNIX: the clock of the self-test's
        bounded wait, and the reactor of a client built for an endpoint missing from
        C{clients}.
    @param clients: the daemon's clients by endpoint name, so the self-test passes the
        same slot gates as the sessions that follow.
    @param on_progress: gets the progress lines of the waits (L{run_selftest}).
    @raise SelftestFailed: (as the Deferred's failure) naming the first failing endpoint,
        its failing checks and their numbers.
    """
    return _require(reactor, config, clients, on_progress)
