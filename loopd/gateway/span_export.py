# -*- test-case-name: loopd.test.test_gateway_span_export -*-
"""
The gateway's spans on their way to an OpenTelemetry collector (DESIGN decision 48), without
a thread and without TCP: a L{SpanQueue} keeps the spans that end, and the injected reactor's
timer sends them in batches through a L{SpanSender}; L{otlp_sender} is the one that POSTs a
batch as OTLP/HTTP protobuf (C{application/x-protobuf}, encoded by OpenTelemetry's own
C{encode_spans}) to the collector's Unix socket with L{loopd.http}, the HTTP client loopd
reaches its models with. A collector that listens on TCP gets a C{twist inferproxy} in front
of it, as a model server does: loopd itself opens no TCP connection (DESIGN §1).

What the request path pays is an append: L{SpanQueue.on_end} puts the span at the end of the
queue and returns. Every C{export_interval} seconds the timer takes up to C{max_batch} spans
from its head and sends them, one export at a time; when a batch went and a whole batch
waits, the next goes at once (a burst is not held back by the interval). The queue is
bounded: a span that ends when it holds C{max_queue} drops the oldest, counted in
L{SpanQueue.dropped}.

A failed export that may pass later (the collector's socket is missing or refuses, it does
not answer within C{timeout}, or it answers 429, 502, 503 or 504, as OTLP/HTTP says) puts its
batch back at the head of the queue, so a collector that restarts loses nothing but what the
bound drops meanwhile; any other failure (a 400: the collector will not take these spans)
drops the batch, counted in L{SpanQueue.failed}. Failures are logged once per change of
state, never per batch: the first failure and each different one after it, the first drop of
a full queue, and the return of the collector, with what was lost meanwhile.

At stop (L{SpanQueue.stop}) the timer stops and the spans left are sent in batches, a failed
batch dropped rather than put back, for at most the wait given; what is still unsent then is
dropped, counted and logged once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Final

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, maybeDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from loopd import http
from loopd.errors import Connect, ProxyRefused, StreamClosedEarly
from loopd.reactor import IUnixReactor

__all__ = ["ExportRefusedError", "SpanQueue", "SpanSender", "otlp_sender"]

_log: Final = Logger(namespace="loopd.telemetry")

SpanSender = Callable[[Sequence[ReadableSpan]], Deferred[None]]
"""Sends one batch of spans: fires when the collector took them, fails when it did not."""

#: The content type of an OTLP/HTTP protobuf request.
PROTOBUF: Final = "application/x-protobuf"
#: The statuses of a collector that may take the spans later (OTLP/HTTP's retryable ones).
RETRYABLE_STATUSES: Final = frozenset({429, 502, 503, 504})
#: The most of a collector's answer that is read (an C{ExportTraceServiceResponse}).
ANSWER_BYTES: Final = 64 * 1024


class ExportRefusedError(Exception):
    """
    The collector answered an export with a status other than 2xx.

    @ivar status: that status.
    """

    def __init__(self, status: int) -> None:
        """@param status: the collector's HTTP status."""
        super().__init__(f"the collector answered HTTP {status}")
        self.status = status


def otlp_sender(
    reactor: IUnixReactor, socket: str, path: str = "/v1/traces", connect_timeout: float = 10.0
) -> SpanSender:
    """
    The L{SpanSender} that POSTs each batch, encoded as an OTLP C{ExportTraceServiceRequest},
    to C{path} on the Unix socket C{socket}: it fires once a 2xx answer was read, fails with
    L{ExportRefusedError} for another status, and with L{loopd.http}'s errors (C{Connect},
    C{StreamClosedEarly}, ...) when the exchange fails. Cancelling it closes the connection.

    @param connect_timeout: how long the connection may take to be made, in seconds.
    """

    def send(spans: Sequence[ReadableSpan]) -> Deferred[None]:
        body = encode_spans(spans).SerializeToString()
        posting = http.request(
            reactor,
            socket,
            "POST",
            path,
            body,
            {"Content-Type": PROTOBUF},
            connect_timeout=connect_timeout,
        )
        return posting.addCallback(_read_answer)

    return send


def _read_answer(response: http.HttpResponse) -> Deferred[None]:
    """
    Read a 2xx answer (its body is not looked at: a partial success is still a success
    here); any other status is L{ExportRefusedError}, its connection closed unread. Cancelling
    the reading closes the connection.
    """
    if not 200 <= response.status < 300:
        response.abort()
        raise ExportRefusedError(response.status)
    done: Deferred[None] = Deferred(lambda _: response.abort())

    def read(body: bytes) -> None:
        if not done.called:
            done.callback(None)

    def failed(reason: Failure) -> None:
        if not done.called:
            done.errback(reason)

    response.read_body(ANSWER_BYTES).addCallbacks(read, failed)
    return done


def _retryable(reason: Failure) -> bool:
    """Whether an export that failed with C{reason} may pass when tried again later."""
    if isinstance(reason.value, ExportRefusedError):
        return reason.value.status in RETRYABLE_STATUSES
    return reason.check(Connect, ProxyRefused, StreamClosedEarly, TimeoutError) is not None


def _why(reason: Failure, timeout: float) -> str:
    """A failed export's reason, in one line, the same for every batch that fails alike."""
    if reason.check(TimeoutError):
        return f"no answer within {timeout:g} s"
    if reason.check(ExportRefusedError, Connect, ProxyRefused, StreamClosedEarly):
        return reason.getErrorMessage()
    return f"{type(reason.value).__name__}: {reason.getErrorMessage()}"


class SpanQueue(SpanProcessor):
    """
    OpenTelemetry's span processor for a reactor: the spans that end wait in a bounded
    queue, which the reactor's timer sends in batches; see the module docstring.

    @ivar exported: the spans the collector took.
    @ivar dropped: the spans dropped unsent: the oldest of a full queue, and those left at
        stop (or ended after it).
    @ivar failed: the spans of exports that failed for good (the collector would not take
        them, or they failed at stop).
    """

    def __init__(
        self,
        clock: IReactorTime,
        send: SpanSender,
        *,
        target: str,
        export_interval: float = 5.0,
        max_batch: int = 512,
        max_queue: int = 2048,
        timeout: float = 10.0,
    ) -> None:
        """
        @param clock: the reactor whose timers send the batches and bound each export.
        @param send: sends one batch (L{otlp_sender}).
        @param target: where the spans go, for the log (the collector's socket).
        @param export_interval: the seconds between two exports.
        @param max_batch: the most spans one export carries.
        @param max_queue: the most spans waiting; more drop the oldest.
        @param timeout: the seconds one export may take before it is abandoned.
        @raise ValueError: for a batch larger than the queue, or a bound below 1.
        """
        if not 1 <= max_batch <= max_queue:
            raise ValueError(f"need 1 <= max_batch <= max_queue (got {max_batch}, {max_queue})")
        self._clock = clock
        self._send = send
        self._target = target
        self._interval = export_interval
        self._max_batch = max_batch
        self._max_queue = max_queue
        self._timeout = timeout
        self._spans: deque[ReadableSpan] = deque()
        self._sending: Deferred[None] | None = None
        self._idle: list[Deferred[None]] = []
        self._next: IDelayedCall | None = None
        self._loop = LoopingCall(self._tick)
        self._loop.clock = clock
        self._stopping = False
        # Why exports fail now (None while they pass), what was lost since, and whether a
        # full queue's drop has been told since the last export that passed.
        self._failing: str | None = None
        self._lost = 0
        self._drop_told = False
        self.exported = 0
        self.dropped = 0
        self.failed = 0

    def __len__(self) -> int:
        """The spans waiting."""
        return len(self._spans)

    # -- OpenTelemetry's side ---------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """A span started: nothing to do until it ends."""

    def on_end(self, span: ReadableSpan) -> None:
        """
        C{span} ended: append it; a full queue drops its oldest (told once until an export
        passes again); after L{stop} the span is dropped.
        """
        if self._stopping:
            self._drop(1)
            return
        if len(self._spans) >= self._max_queue:
            self._spans.popleft()
            self._drop(1)
        self._spans.append(span)

    def shutdown(self) -> None:
        """
        The tracer provider shuts down: stop the timer; the spans left stay unsent (loopd
        flushes with L{stop}, which does not block the reactor).
        """
        self._stopping = True
        self._stop_timers()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """
        Start sending now (this cannot wait on the reactor's thread): whether nothing was
        left to send.
        """
        idle = self._sending is None and not self._spans
        self._tick()
        return idle

    # -- the reactor's side -----------------------------------------------------------

    def start(self) -> None:
        """Send a batch every C{export_interval} seconds from now."""
        self._loop.start(self._interval, now=False)

    def stop(self, wait: float) -> Deferred[None]:
        """
        Stop the timer and send what is left, in batches, for at most C{wait} seconds (a
        failed batch is dropped, not put back); then drop the rest. Fires when done; never
        fails.
        """
        self._stopping = True
        self._stop_timers()
        done: Deferred[None] = Deferred()

        def time_out() -> None:
            left = len(self._spans)
            self._spans.clear()
            self.dropped += left
            if self._sending is not None:
                self._sending.cancel()
            lost = left + self._lost
            if lost:
                _log.warn(
                    "telemetry: {lost} spans were not exported to {target} before loopd "
                    "stopped (waited {wait:g} s)",
                    lost=lost,
                    target=self._target,
                    wait=wait,
                )
            done.callback(None)

        timer = self._clock.callLater(wait, time_out)

        def step(ignored: object = None) -> None:
            while timer.active():
                if self._sending is not None:
                    self._when_idle().addCallback(step)
                    return
                if not self._spans:
                    timer.cancel()
                    done.callback(None)
                    return
                self._export()

        step()
        return done

    def _stop_timers(self) -> None:
        """Stop the interval's timer and a pending next batch."""
        if self._loop.running:
            self._loop.stop()
        if self._next is not None and self._next.active():
            self._next.cancel()
        self._next = None

    def _tick(self) -> None:
        """The timer: send a batch, unless one is on its way or nothing waits."""
        self._next = None
        if self._sending is None and self._spans:
            self._export()

    def _export(self) -> None:
        """Send a batch from the head of the queue; L{_sent} or L{_failed} follows."""
        count = min(self._max_batch, len(self._spans))
        batch = [self._spans.popleft() for _ in range(count)]
        sending: Deferred[None] = maybeDeferred(self._send, batch)
        self._sending = sending
        sending.addTimeout(self._timeout, self._clock)
        sending.addCallbacks(self._sent, self._failed, callbackArgs=(batch,), errbackArgs=(batch,))
        sending.addBoth(self._settled)

    def _sent(self, ignored: None, batch: list[ReadableSpan]) -> None:
        """The collector took C{batch}: after failures, say it is back and what was lost."""
        self.exported += len(batch)
        if self._failing is not None or self._drop_told:
            _log.info(
                "telemetry: the collector at {target} takes spans again ({lost} lost meanwhile)",
                target=self._target,
                lost=self._lost,
            )
        self._failing = None
        self._lost = 0
        self._drop_told = False

    def _failed(self, reason: Failure, batch: list[ReadableSpan]) -> None:
        """
        C{batch} did not go: back to the head of the queue when it may go later (not at
        stop), else dropped; the log hears of a new reason only.
        """
        again = not self._stopping and _retryable(reason)
        if again:
            self._spans.extendleft(reversed(batch))
            over = len(self._spans) - self._max_queue
            for _ in range(max(0, over)):
                self._spans.popleft()
            self._drop(max(0, over))
        else:
            self.failed += len(batch)
            self._lost += len(batch)
        if reason.check(CancelledError):
            # Cut short at stop, which tells what it lost.
            return
        why = _why(reason, self._timeout)
        if why != self._failing:
            self._failing = why
            fate = (
                f"the spans wait (the oldest dropped beyond {self._max_queue})"
                if again
                else f"{len(batch)} spans dropped"
            )
            _log.warn(
                "telemetry: exporting spans to {target} failed: {why}; {fate}",
                target=self._target,
                why=why,
                fate=fate,
            )

    def _settled(self, ignored: object) -> None:
        """An export ended: wake who waits for it; a whole batch waiting goes at once."""
        self._sending = None
        waiting, self._idle = self._idle, []
        for d in waiting:
            d.callback(None)
        whole = len(self._spans) >= self._max_batch
        if whole and not self._stopping and self._failing is None and self._next is None:
            self._next = self._clock.callLater(0, self._tick)

    def _when_idle(self) -> Deferred[None]:
        """Fires when no export is on its way."""
        if self._sending is None:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._idle.append(d)
        return d

    def _drop(self, count: int) -> None:
        """Count C{count} spans dropped unsent; a full queue's first drop is told."""
        if not count:
            return
        self.dropped += count
        self._lost += count
        if not self._drop_told and not self._stopping:
            self._drop_told = True
            _log.warn(
                "telemetry: the span queue is full ({max_queue} spans: the collector at "
                "{target} is slow or away): dropping the oldest",
                max_queue=self._max_queue,
                target=self._target,
            )
