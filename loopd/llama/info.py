# -*- test-case-name: loopd.test.test_llama_info -*-
"""
What the server says about itself (C{/health}, C{/props}, C{/slots}, C{/tokenize}) and the
pure cache-loss judgement between two requests of a session.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from loopd import http, strict_json
from loopd.config import Endpoint
from loopd.errors import Http, Protocol
from loopd.llama.types import Timings

__all__ = [
    "CacheOutcome",
    "Health",
    "SlotState",
    "cache_outcome",
    "check_health",
    "get_json",
    "parse_slots",
    "slot_busy",
]


@dataclass(frozen=True)
class CacheOutcome:
    """
    How well a request reused the previous request's prompt cache.

    @ivar loss: the cache fell short of the previous request's context by more than the
        threshold.
    @ivar expected: the previous request's whole context (cache_n + prompt_n + predicted_n).
    @ivar cached: what this request reused (its cache_n).
    """

    loss: bool
    expected: int
    cached: int

    @property
    def shortfall(self) -> int:
        """
        How many tokens of the previous context were not reused.
        """
        return max(0, self.expected - self.cached)


def cache_outcome(previous: Timings, current: Timings, threshold: int = 64) -> CacheOutcome:
    """
    Compare C{current.cache_n} with the previous request's total: more than C{threshold}
    tokens short is a loss.
    """
    expected = previous.total
    return CacheOutcome(
        loss=expected - current.cache_n > threshold, expected=expected, cached=current.cache_n
    )


@dataclass(frozen=True)
class SlotState:
    """
    One entry of C{/slots}: the slot's id and whether it is running a task.
    """

    id: int
    is_processing: bool


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
        slots.append(SlotState(ident, entry.get("is_processing") is True))
    return tuple(slots)


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
    reactor: Any,
    socket_path: str,
    method: str,
    path: str,
    body: object = None,
    *,
    caps: http.HttpCaps,
    connect_timeout: float,
) -> Deferred[Any]:
    """
    One JSON request: the decoded answer of a 200, L{Http} for any other status,
    L{Protocol} for a body that is not JSON.
    """
    payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()

    def read(response: http.HttpResponse) -> Deferred[Any]:
        reading = response.read_body()
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

    answer = http.request(
        reactor,
        socket_path,
        method,
        path,
        payload,
        caps=caps,
        connect_timeout=connect_timeout,
    )
    answer.addCallback(read)
    return answer


@dataclass(frozen=True)
class Health:
    """
    How a server answered C{GET /health}.

    @ivar ok: whether it is fit to take requests.
    @ivar detail: C{"ok"}; C{"HTTP <status>"} for a llama-server answering anything but 200;
        C{"unreachable: <why>"} when there was no answer in time or no connection.
    """

    ok: bool
    detail: str


def check_health(
    reactor: Any, endpoint: Endpoint, *, caps: http.HttpCaps, timeout: float
) -> Deferred[Health]:
    """
    Ask C{endpoint}'s C{/health}, reading no body: a 200 is healthy, and so is any answer of
    an C{openai}-kind endpoint, which need not have C{/health} at all.

    @param reactor: provides IReactorTime and IReactorUNIX; the timeout runs on it.
    @param timeout: seconds for the connection, and for the headers of the answer.
    @return: fires with a L{Health}, never fails, except with C{CancelledError} when
        cancelled (which closes the connection).
    """
    probe = http.request(
        reactor, endpoint.socket, "GET", "/health", caps=caps, connect_timeout=timeout
    )
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
        return Health(False, f"unreachable: {reason.getErrorMessage()}")

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
