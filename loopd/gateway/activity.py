# -*- test-case-name: loopd.test.test_gateway_activity -*-
"""
What the gateway did for each request, told to whoever watches (DESIGN decision 48): the
status board behind C{/v1/status} and the page, OpenTelemetry's spans and the request
capture are all watchers of the same records, so the hot path keeps one record per request
and one per upstream call, and a watcher that is not configured costs nothing.

A L{RequestRecord} is made when a request reaches a front door (L{Activity.begin}); every
leased upstream call made for it (the answer's call, a fail-over's, each mesh worker's and
the reducer's) adds a L{CallRecord}, which the call fills as it goes: its lease granted, its
slot, its retries, its end (the server's timings, the thinking cap, the error). The
request's record ends with its answer (L{Activity.end}). Times are the reactor's
(C{IReactorTime.seconds}); C{wall_started} is the wall clock's, for people.

A watcher (L{ActivityWatcher}) hears each step; it must not raise, and one that does is
logged and does not disturb the request or the other watchers. Prompt and answer text ride
on the record only when a watcher asks for them (L{Activity.keep_text}): the capture with
C{prompts = true}.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from twisted.logger import Logger

from loopd.llama.types import Completion, Timings

__all__ = [
    "AGENT_NAME_MAX",
    "MODEL_NAME_MAX",
    "Activity",
    "ActivityWatcher",
    "CallRecord",
    "RequestRecord",
    "agent_name",
]

_log = Logger(namespace="loopd.gateway.activity")

#: The longest agent name kept, in characters (a User-Agent can be long).
AGENT_NAME_MAX = 64
#: The longest model name a record keeps, in characters (a request may name any model).
MODEL_NAME_MAX = 256


@dataclass
class CallRecord:
    """
    One leased upstream call made for a request.

    @ivar endpoint: the endpoint called.
    @ivar role: why it was made: C{answer} (the request's own call), C{worker} or
        C{reducer} (a mesh turn's).
    @ivar holder: the key its lease and slot are kept under (the session's, or one of
        its conversations').
    @ivar started: when the call began (its lease wait, if leasing, begins then).
    @ivar leased: when its lease was granted; C{None} without leases or before the grant.
    @ivar slot: the slot it runs on, once chosen.
    @ivar sent: when the request went to the server (after slot files and the template).
    @ivar ended: when the call ended; C{None} while it runs.
    @ivar timings: the server's counts of a completed call.
    @ivar thinking_capped: loopd ended its thinking at the cap.
    @ivar reasoning_tokens: the reasoning tokens of a completed call.
    @ivar finish_reason: why a completed call's answer ended (C{stop}, C{length},
        C{tool_calls}, ...).
    @ivar retries: how many times the client tried again.
    @ivar error: why it failed, if it did.
    @ivar saved_seconds: the prefill time its reused tokens saved, as the status board
        estimates it when the call completes (L{loopd.gateway.status_board}).
    """

    endpoint: str
    role: str
    started: float
    holder: str = ""
    leased: float | None = None
    slot: int | None = None
    sent: float | None = None
    ended: float | None = None
    timings: Timings | None = None
    thinking_capped: bool = False
    reasoning_tokens: int = 0
    finish_reason: str | None = None
    retries: int = 0
    error: str | None = None
    saved_seconds: float = 0.0

    @property
    def lease_wait(self) -> float | None:
        """The seconds the call waited for its lease; C{None} when it took none."""
        return None if self.leased is None else self.leased - self.started


@dataclass
class RequestRecord:
    """
    One request through a front door and what was done for it.

    @ivar id: its number in this gateway's life, from 1.
    @ivar door: the front door's name (C{chat}, C{messages}, C{responses}, ...).
    @ivar started: when it arrived, on the reactor's clock.
    @ivar wall_started: when it arrived, on the wall clock.
    @ivar session: the session it belongs to (its C{X-Session-Id} or its connection's
        anonymous id); empty until the door read it.
    @ivar anonymous: it named no session.
    @ivar agent: the agent that sent it (L{agent_name}); C{None} when nothing names it.
    @ivar model: the model it asked for (its first L{MODEL_NAME_MAX} characters).
    @ivar stream: it asked for a stream.
    @ivar mesh: a mesh turn serves it.
    @ivar calls: its upstream calls, in the order they began.
    @ivar first_token: when the first token went out; C{None} before (or never).
    @ivar ended: when its answer ended; C{None} while it runs.
    @ivar status: the HTTP status answered (200 for a stream that opened, even if an error
        event ended it).
    @ivar outcome: C{ok}, an error code, or C{client_gone}.
    @ivar error: the error's message, if it failed.
    @ivar error_from_server: the message carries the model server's own error text, which
        may quote the prompt or the model's output (the status document leaves it out).
    @ivar body: the request body as it came, kept only when a watcher asks for text.
    @ivar completion: the answer, kept only when a watcher asks for text.
    """

    id: int
    door: str
    started: float
    wall_started: float
    session: str = ""
    anonymous: bool = False
    agent: str | None = None
    model: str | None = None
    stream: bool = False
    mesh: bool = False
    calls: list[CallRecord] = field(default_factory=list)
    first_token: float | None = None
    ended: float | None = None
    status: int | None = None
    outcome: str | None = None
    error: str | None = None
    error_from_server: bool = False
    body: bytes | None = None
    completion: Completion | None = None

    @property
    def endpoint(self) -> str | None:
        """The endpoint of its last call (the one that answered, after a fail-over)."""
        return self.calls[-1].endpoint if self.calls else None

    def totals(self) -> Timings:
        """The sum of its completed calls' counts (a mesh turn's workers and reducer too)."""
        cache_n = prompt_n = predicted_n = 0
        for call in self.calls:
            if call.timings is not None:
                cache_n += call.timings.cache_n
                prompt_n += call.timings.prompt_n
                predicted_n += call.timings.predicted_n
        return Timings(cache_n, prompt_n, predicted_n)


class ActivityWatcher:
    """
    A watcher of the gateway's records: each method is one step, and does nothing here;
    a watcher overrides the steps it cares about.

    @ivar wants_text: the watcher needs the request bodies and answers on the records.
    """

    wants_text = False

    def request_started(self, record: RequestRecord) -> None:
        """C{record}'s request arrived (its door read it, or refused it)."""

    def call_started(self, record: RequestRecord, call: CallRecord) -> None:
        """An upstream call for C{record} began (its lease wait first, if leasing)."""

    def call_sent(self, record: RequestRecord, call: CallRecord) -> None:
        """C{call} has its lease and slot and goes to the server now."""

    def call_ended(self, record: RequestRecord, call: CallRecord) -> None:
        """C{call} ended: completed (its C{timings}), failed (its C{error}) or cancelled."""

    def request_ended(self, record: RequestRecord) -> None:
        """C{record}'s answer ended (its C{outcome} says how)."""


class Activity:
    """
    The gateway's records and their watchers.

    @ivar watchers: who hears each step, in order.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        watchers: Sequence[ActivityWatcher] = (),
    ) -> None:
        """
        @param clock: the reactor's C{seconds}.
        @param wall_clock: the wall clock (C{time.time}).
        @param watchers: the first watchers; L{watch} adds more.
        """
        self._clock = clock
        self._wall_clock = wall_clock
        self.watchers: list[ActivityWatcher] = list(watchers)
        self._serial = itertools.count(1)
        #: Whether a watcher needs the bodies and answers (L{ActivityWatcher.wants_text}).
        self.keep_text = any(w.wants_text for w in self.watchers)

    def watch(self, watcher: ActivityWatcher) -> None:
        """Tell C{watcher} every step from now on."""
        self.watchers.append(watcher)
        self.keep_text = self.keep_text or watcher.wants_text

    def begin(self, door: str, body: bytes) -> RequestRecord:
        """
        A request arrived at C{door}: its record (numbered), with C{body} only when a
        watcher wants text. Watchers hear of it at L{started}, once the door read it.
        """
        return RequestRecord(
            next(self._serial),
            door,
            self._clock(),
            self._wall_clock(),
            body=body if self.keep_text else None,
        )

    def started(self, record: RequestRecord) -> None:
        """The door has read C{record}'s request (or refused it): tell the watchers."""
        self._tell("request_started", record)

    def call(
        self, record: RequestRecord, endpoint: str, role: str = "answer", holder: str = ""
    ) -> CallRecord:
        """An upstream call for C{record} begins now: its record, told to the watchers."""
        call = CallRecord(endpoint, role, self._clock(), holder)
        record.calls.append(call)
        self._tell("call_started", record, call)
        return call

    def leased(self, call: CallRecord) -> None:
        """C{call}'s lease is granted now."""
        call.leased = self._clock()

    def sent(self, record: RequestRecord, call: CallRecord, slot: int) -> None:
        """C{call} goes to the server now, on C{slot}."""
        call.slot = slot
        call.sent = self._clock()
        self._tell("call_sent", record, call)

    def call_completed(
        self, record: RequestRecord, call: CallRecord, completion: Completion
    ) -> None:
        """C{call} completed with C{completion}."""
        call.ended = self._clock()
        call.timings = completion.timings
        call.thinking_capped = completion.thinking_capped
        call.reasoning_tokens = completion.reasoning_tokens
        call.finish_reason = completion.finish_reason.value
        self._tell("call_ended", record, call)

    def call_failed(self, record: RequestRecord, call: CallRecord, error: str) -> None:
        """C{call} failed (or was cancelled) with C{error}."""
        call.ended = self._clock()
        call.error = error
        self._tell("call_ended", record, call)

    def first_token(self, record: RequestRecord) -> None:
        """C{record}'s first token went out now (the first time only)."""
        if record.first_token is None:
            record.first_token = self._clock()

    def end(
        self,
        record: RequestRecord,
        status: int,
        outcome: str,
        error: str | None = None,
        completion: Completion | None = None,
        *,
        error_from_server: bool = False,
    ) -> None:
        """
        C{record}'s answer ended with HTTP C{status} and C{outcome} (and C{error}'s message,
        C{error_from_server} when it carries the model server's text); told once (a record
        already ended is left as it is).
        """
        if record.ended is not None:
            return
        record.ended = self._clock()
        record.status = status
        record.outcome = outcome
        record.error = error
        record.error_from_server = error_from_server
        if completion is not None and self.keep_text:
            record.completion = completion
        self._tell("request_ended", record)

    def _tell(self, step: str, *args: object) -> None:
        """Tell every watcher C{step}; a watcher that raises is logged and passed over."""
        for watcher in self.watchers:
            try:
                getattr(watcher, step)(*args)
            except Exception:
                _log.failure(
                    "activity watcher {watcher} failed at {step}",
                    watcher=type(watcher).__name__,
                    step=step,
                )


def agent_name(header: Callable[[bytes], bytes | None]) -> str | None:
    """
    The agent a request names: its C{X-Loopd-Agent} header, else C{X-Title} (the
    OpenRouter convention some agents send), else C{originator} (Codex CLI's), else the
    first product of its C{User-Agent} (C{claude-cli/2.0.1}, C{opencode/0.15}). At most
    L{AGENT_NAME_MAX} characters, printable ASCII; C{None} when nothing names it.
    """
    for name in (b"x-loopd-agent", b"x-title", b"originator", b"user-agent"):
        value = header(name)
        if not value:
            continue
        text = value.decode("ascii", "replace").strip()
        if name == b"user-agent":
            text = text.split(" ", 1)[0]
        text = "".join(c for c in text if " " <= c <= "~")[:AGENT_NAME_MAX]
        if text:
            return text
    return None
