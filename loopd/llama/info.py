# -*- test-case-name: loopd.test.test_llama_info -*-
"""
What the server says about itself (C{/health}, C{/props}, C{/slots}, C{/tokenize}) and the
pure cache-loss judgement between two requests of a session.

Every request here goes through an L{loopd.http.Opener}, the endpoint's paced one when the
llama client makes it. L{SharedRequest} keeps one request of a kind in flight per endpoint:
the C{/slots} polls of every chat waiting on an endpoint share the poll that is running, and
so do concurrent C{/health} checks, so that waiting requests never pile up connections (and
an abandoned poll is aborted once nobody waits for it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.defer import TimeoutError as DeferredTimeout
from twisted.python.failure import Failure

from loopd import http, strict_json
from loopd.errors import Connect, Http, Protocol, ProxyRefused
from loopd.llama.token_list import TokenListCounter
from loopd.llama.types import Timings
from loopd.reactor import IUnixReactor
from loopd.settings import Endpoint

__all__ = [
    "count_tokens",
    "CacheOutcome",
    "Health",
    "SharedRequest",
    "SlotState",
    "cache_outcome",
    "check_health",
    "get_json",
    "parse_slots",
    "slot_busy",
    "slots_serving",
]


@dataclass(frozen=True)
class CacheOutcome:
    """
    How well a request reused the previous request's prompt cache.

    @ivar loss: the cache fell short of the previous request's prompt by more than the
        threshold.
    @ivar expected: the previous request's prompt (cache_n + prompt_n). Its answer is not
        counted: a chat template renders an earlier answer again its own way (Qwen3's drops
        its thinking once a new user turn follows, a tool call's JSON is spaced anew), so
        those tokens are read again whatever loopd does, and counting them made every turn
        of every agent look like a loss.
    @ivar cached: what this request reused (its cache_n).
    """

    loss: bool
    expected: int
    cached: int

    @property
    def shortfall(self) -> int:
        """
        How many tokens of the previous prompt were not reused.
        """
        return max(0, self.expected - self.cached)


def cache_outcome(previous: Timings, current: Timings, threshold: int = 64) -> CacheOutcome:
    """
    Compare C{current.cache_n} with the previous request's prompt (its answer aside, see
    L{CacheOutcome.expected}): more than C{threshold} tokens short is a loss.
    """
    expected = previous.cache_n + previous.prompt_n
    return CacheOutcome(
        loss=expected - current.cache_n > threshold, expected=expected, cached=current.cache_n
    )


#: The C{/slots} counters of a slot (L{SlotState.counters}); None where the entry has none.
Counters = tuple[int | None, int | None, int | None]
_NO_COUNTERS: Counters = (None, None, None)


@dataclass(frozen=True)
class SlotState:
    """
    One entry of C{/slots}: the slot's id, whether it is running a task, and how far the task
    has got.

    @ivar counters: the entry's C{n_prompt_tokens}, C{n_prompt_tokens_processed} and
        C{next_token[0].n_decoded}, each None when the entry lacks it (a slot that never ran
        a task) or it is not an integer. They move as the server works, never within one
        batch: on llama.cpp's server the first moves when a batch of the prompt starts and
        the second when it ends (together with that batch's progress event), the third with
        each generated token. Two answers with different counters show the slot advancing.
    """

    id: int
    is_processing: bool
    counters: Counters = _NO_COUNTERS


def parse_slots(value: object) -> tuple[SlotState, ...]:
    """
    Read a C{/slots} answer.

    @raise Protocol: it is not a list of slot objects.
    """
    if not isinstance(value, list):
        raise Protocol(f"/slots is not a list: {type(value).__name__}")
    slots = []
    for entry in value:
        ident = entry.get("id") if isinstance(entry, dict) else None
        # JSON booleans are not numbers, though Python's bool is an int.
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise Protocol("/slots entry without an integer id")
        slots.append(SlotState(ident, entry.get("is_processing") is True, _counters(entry)))
    return tuple(slots)


def _counters(entry: dict[str, Any]) -> Counters:
    """The counters of one C{/slots} entry (L{SlotState.counters})."""
    next_token = entry.get("next_token")
    # next_token is a list of one object (older servers: the object itself).
    if isinstance(next_token, list) and next_token:
        next_token = next_token[0]
    decoded = next_token.get("n_decoded") if isinstance(next_token, dict) else None
    values = (entry.get("n_prompt_tokens"), entry.get("n_prompt_tokens_processed"), decoded)
    first, second, third = (_integer(value) for value in values)
    return (first, second, third)


def _integer(value: object) -> int | None:
    """C{value} when it is an integer (a JSON boolean is not), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def slots_serving(slots: Sequence[SlotState], slot: int) -> tuple[SlotState, ...]:
    """
    The slots that may be running a request for C{slot}: that slot, taken modulo the number
    of slots as llama-server does, or every slot for C{slot} -1 (the server chose one and
    did not say which).
    """
    if not slots:
        return ()
    if slot < 0:
        return tuple(slots)
    return (slots[slot % len(slots)],)


def slot_busy(slots: Sequence[SlotState], slot: int) -> bool:
    """
    Whether a request for C{slot} must wait: that slot (taken modulo the number of slots,
    as llama-server does) is processing, or, for C{slot} -1, every slot is.
    """
    if not slots:
        return False
    if slot < 0:
        return all(s.is_processing for s in slots)
    return slots[slot % len(slots)].is_processing


def get_json(
    open_http: http.Opener,
    method: str,
    path: str,
    body: object = None,
    *,
    caps: http.HttpCaps,
    connect_timeout: float,
    answer_bytes: Callable[[int], int] | None = None,
) -> Deferred[Any]:
    """
    One JSON request through C{open_http}: the decoded answer of a 200, L{Http} for any
    other status, L{Protocol} for a body that is not JSON, or longer than C{answer_bytes}
    says for the size of the body sent
    (default: the C{body_bytes} cap).
    """
    payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()

    def read(response: http.HttpResponse) -> Deferred[Any]:
        sent = 0 if payload is None else len(payload)
        reading = response.read_body(None if answer_bytes is None else answer_bytes(sent))
        reading.addCallback(decode, response.status)
        return reading

    def decode(raw: bytes, status: int) -> Any:
        """
        The decoded body of a 200 (strict JSON); L{Http} with the body's text for any other
        status, L{Protocol} for a 200 whose body is not JSON.
        """
        text = raw.decode("utf-8", "replace")
        if status != 200:
            raise Http(status, text)
        try:
            return strict_json.decode(text)
        except strict_json.JSONError:
            raise Protocol(f"{path} answered with a body that is not JSON") from None

    answer = open_http(method, path, payload, caps=caps, connect_timeout=connect_timeout)
    answer.addCallback(read)
    return answer


def count_tokens(
    open_http: http.Opener,
    body: object,
    *,
    caps: http.HttpCaps,
    connect_timeout: float,
) -> Deferred[int]:
    """
    C{POST /tokenize} with C{body}: how many ids the answer of a 200 lists, counted as the
    answer arrives (L{TokenListCounter}: the ids of a long prompt are never held);
    L{Http} for any other status, L{Protocol} for an answer of another shape.
    """
    payload = json.dumps(body, separators=(",", ":")).encode()

    def read(response: http.HttpResponse) -> Deferred[int]:
        if response.status != 200:
            failing = response.read_body()

            def refuse(raw: bytes) -> int:
                raise Http(response.status, raw.decode("utf-8", "replace"))

            return failing.addCallback(refuse)
        counter = TokenListCounter()
        return response.deliver(counter.feed).addCallback(lambda _: counter.count())

    answer = open_http("POST", "/tokenize", payload, caps=caps, connect_timeout=connect_timeout)
    return answer.addCallback(read)


@dataclass(frozen=True)
class Health:
    """
    How a server answered C{GET /health}.

    @ivar ok: whether it is fit to take requests.
    @ivar detail: C{"ok"}; C{"HTTP <status>"} for a llama-server answering anything but 200;
        C{"refused by its inferproxy: <limit>"} when the inferproxy in front of it refused
        the connection at a limit (the server may well be up); C{"unreachable: <why>"} when
        there was no answer in time or no connection. No detail names a socket path.
    """

    ok: bool
    detail: str

    @property
    def refused(self) -> bool:
        """
        Whether the endpoint's inferproxy refused the check at a limit: the server's health
        is unknown then (busy, not down).
        """
        return self.detail.startswith(_REFUSED)


def check_health(
    reactor: IUnixReactor,
    endpoint: Endpoint,
    *,
    caps: http.HttpCaps,
    timeout: float,
    open_http: http.Opener | None = None,
) -> Deferred[Health]:
    """
    Ask C{endpoint}'s C{/health}, reading no body: a 200 is healthy, and so is any answer of
    an C{openai}-kind endpoint, which need not have C{/health} at all.

    @param reactor: provides IReactorTime and IReactorUNIX; the timeout runs on it.
    @param timeout: seconds for the connection, and for the headers of the answer.
    @param open_http: how the request is opened; the endpoint's plain L{http.opener} by
        default.
    @return: fires with a L{Health}, never fails, except with C{CancelledError} when
        cancelled (which closes the connection).
    """
    if open_http is None:
        open_http = http.opener(reactor, endpoint.socket)
    probe = open_http("GET", "/health", caps=caps, connect_timeout=timeout)
    probe.addTimeout(timeout, reactor)
    cancelled = False

    def cancel(result: Deferred[Health]) -> None:
        """
        Note the cancellation, so that C{failed} passes it on instead of calling it
        unreachable, and close the connection.
        """
        nonlocal cancelled
        cancelled = True
        probe.cancel()

    result: Deferred[Health] = Deferred(cancel)

    def answered(response: http.HttpResponse) -> Health:
        """
        Headers are enough: close the connection unread and judge the status.
        """
        response.abort()
        if response.status == 200 or endpoint.kind == "openai":
            return Health(True, "ok")
        return Health(False, f"HTTP {response.status}")

    def failed(reason: Failure) -> Health | Failure:
        """
        No connection or no headers in time: unhealthy. A cancellation passes through.
        """
        if cancelled:
            return reason
        return Health(False, _unhealthy(reason))

    def settle(outcome: Health | Failure) -> None:
        """
        Fire the result with the outcome, unless it has fired already.
        """
        if result.called:
            return
        if isinstance(outcome, Failure):
            result.errback(outcome)
        else:
            result.callback(outcome)

    probe.addCallbacks(answered, failed).addBoth(settle)
    return result


#: How the detail of a check that the inferproxy refused begins.
_REFUSED = "refused by its inferproxy: "


def _unhealthy(reason: Failure) -> str:
    """
    The detail of a health check that got no answer: a refusal by the inferproxy names its
    limit; a connect failure names its kind, never the socket's path.
    """
    error = reason.value
    if isinstance(error, ProxyRefused):
        limit = {
            ProxyRefused.CONNECTIONS: "its connection limit is reached",
            ProxyRefused.ACCEPT_RATE: "its accept rate limit is reached",
        }.get(error.limit, f"limit {error.limit}")
        return f"{_REFUSED}{limit}"
    if isinstance(error, Connect):
        return f"unreachable: {error.reason}"
    if isinstance(error, (DeferredTimeout, CancelledError)):
        return "unreachable: no answer in time"
    return f"unreachable: {reason.getErrorMessage()}"


class SharedRequest:
    """
    One request of a kind in flight at a time, its outcome shared by everyone who asked
    while it ran.

    Each caller gets a Deferred of its own. Cancelling it takes that caller out; when the
    last caller has gone, the request itself is cancelled (which aborts its connection), so
    an abandoned request never lingers. The next call after the outcome starts a new one.
    """

    def __init__(self, start: Callable[[], Deferred[Any]]) -> None:
        """
        @param start: starts the request; called once per request in flight.
        """
        self._start = start
        self._running: Deferred[Any] | None = None
        self._callers: list[Deferred[Any]] = []

    @property
    def in_flight(self) -> bool:
        """Whether a request is running now."""
        return self._running is not None

    def __call__(self) -> Deferred[Any]:
        """
        Join the request in flight, or start one.

        @return: fires or fails as the request does (C{CancelledError} when cancelled).
        """
        caller: Deferred[Any] = Deferred(self._leave)
        self._callers.append(caller)
        if self._running is None:
            running = self._start()
            self._running = running
            running.addBoth(self._settled, running)
        return caller

    def _settled(self, outcome: object, running: Deferred[Any]) -> None:
        """The request ended: hand its outcome to every caller still waiting."""
        if self._running is running:
            self._running = None
        callers, self._callers = self._callers, []
        for caller in callers:
            if isinstance(outcome, Failure):
                caller.errback(outcome)
            else:
                caller.callback(outcome)

    def _leave(self, caller: Deferred[Any]) -> None:
        """
        The canceller of a caller's Deferred: take it out, and cancel the request once
        nobody waits for it.
        """
        if caller in self._callers:
            self._callers.remove(caller)
        if not self._callers and self._running is not None:
            running, self._running = self._running, None
            running.cancel()
