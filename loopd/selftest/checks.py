# -*- test-case-name: loopd.test.test_selftest -*-
"""
The self-test's three checks (part of L{loopd.selftest}, whose docstring says what they
are): the judges (pure: what the server answered against what the config expects), the
checks that ask the endpoint through L{wait_for}, L{run_selftest} for one endpoint and
L{require_selftests}, the gate C{twist loopd} passes before it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.interfaces import IReactorTime

from loopd import strict_json
from loopd.digest import sha256_hex
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
from loopd.reactor import IUnixReactor
from loopd.selftest.report import CheckResult, SelftestFailed, SelftestReport
from loopd.selftest.wait import (
    GaveUp,
    Progress,
    describe_error,
    error_text,
    log_progress,
    wait_for,
)
from loopd.settings import Config, Expect

_T = TypeVar("_T")

__all__ = [
    "WEATHER_TOOL",
    "judge_cache",
    "judge_props",
    "judge_tool_call",
    "require_selftests",
    "run_selftest",
]

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
            error_text(error),
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
        return CheckResult("tools", False, TOOLS_EXPECTED, error_text(error), detail=detail)
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
        f"turn {turn} failed: {error_text(error)}",
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
    on_progress: Progress = log_progress,
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
    reactor: IUnixReactor, config: Config, clients: Mapping[str, Client], on_progress: Progress
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
    reactor: IUnixReactor,
    config: Config,
    clients: Mapping[str, Client],
    on_progress: Progress = log_progress,
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
