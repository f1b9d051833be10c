# -*- test-case-name: loopd.test.test_llama_chat -*-
"""
One chat request from send to completion: the first-byte wait, liveness and the thinking
cap (seed section 4, steps 2 to 5). The slot gate and retries wrap this from outside.

 - Waiting. llama-server sends nothing, not even headers, while a request waits for its
   slot. Every C{poll_ms} without the headers the call asks C{/slots} on a second
   connection and reports L{Waiting}: a busy slot may keep it waiting up to
   C{busy_wait_ms} (then L{WaitTimeout}); a failing C{/slots} or a 503 means the server is
   loading or restarting, up to C{load_wait_ms} (then L{LoadTimeout}); an idle slot and
   still nothing for C{idle_grace_ms} is L{Stalled}. Each limit counts from when its state
   was first seen, and the state is judged at each poll.
 - Streaming. After the headers, silence longer than C{liveness_ms} is L{Stalled};
   progress events, deltas and pings all count as signs of life. There is no total
   deadline.
 - Prompt processing (DESIGN.md decision 44). Until the first delta (a piece of reasoning,
   content or a tool call) the server is reading the prompt, and llama-server reports that
   only once per batch (a progress event per C{n_batch} tokens, 2,048 by default): a batch
   may well take longer than C{liveness_ms} on a loaded machine, and that is not a stall.
   So before the first delta the server's own evidence of work counts as life too. When
   the stream has been silent for C{liveness_ms} less C{poll_ms} (less a quarter of
   C{liveness_ms} when C{poll_ms} is longer), the call asks C{/slots}, through the same
   poll as the first-byte wait; an answer showing the request's slot processing (any slot
   for a request not pinned to one) counts as life, and the next poll comes as long again
   after it. The slot must also advance: with no byte and none of its C{/slots} counters
   (C{n_prompt_tokens}, C{n_prompt_tokens_processed}, C{next_token[0].n_decoded}) moving
   for C{prefill_stall_ms}, the call is L{Stalled} at the next poll that finds it so, so a
   server that says "processing" forever is still caught. Everything else is no evidence,
   and the liveness limit stands: an idle slot, a C{/slots} that fails, answers something
   that is not slots or has not answered by the limit. A C{/slots} that is not there (404,
   or 501 from a server started with C{--no-slots}) is not asked again by the call, which
   keeps the plain liveness limit from then on. On llama.cpp's server (xllamacpp
   2026.10) C{/slots} answers during a batch and shows the slot processing, but none of
   its counters moves within a batch: they move when a batch starts and ends, with its
   progress event. A ping counts as life as before, though it shows only that the
   server's HTTP side is alive.
 - Thinking cap. At C{thinking.cap} reasoning tokens the call asks the server to end the
   reasoning (C{reasoning_end} on a second connection, for the completion's id: never before
   a chunk has shown it), reports L{ThinkingCapped} and reads on. C{thinking.overrun} more
   reasoning tokens, or a control reply without C{success: true}, cancels the request:
   L{ThinkingOverrun}.
 - Done. The chunk with a C{finish_reason} and then C{[DONE]} (or the end of the body)
   give the L{Completion}; a body that ends before a C{finish_reason} is
   L{StreamClosedEarly}.

An endpoint of kind C{openai} has no C{/slots} and no control: the wait is a plain
first-byte timeout of C{busy_wait_ms} (L{WaitTimeout}), only C{max_tokens} bounds
thinking (DESIGN.md §3.6), and after the headers the plain liveness limit applies from the
first byte on, prompt processing included: such a server gives no evidence that would tell
a long prompt from a frozen server, and C{liveness_ms} is the silence its user accepts (an
engine that sends its headers only with the first token is waited for up to
C{busy_wait_ms} instead).

Cancelling the returned Deferred closes every connection of the call, which makes
llama-server stop generating.

Connections. The call opens its connections with the L{http.Opener} it is given (the
llama client's is paced under the endpoint's inferproxy limits) and asks C{/slots} through
the poll it is given (the client's is one poll in flight per endpoint, shared by its
waiting calls); without them, plain ones of its own. The first-byte wait counts from when
the request's connection is made, so a wait for the pacing is not taken for a slow server.

Backpressure. Given a L{Flow}, the call attaches to it when a stream's headers arrive
(an error body is read whole under its cap: nothing of it reaches the consumer) and
detaches when the call ends, however it ends. While the flow is paused the call stops
reading its socket and its liveness limit is suspended: a consumer that reads slowly never
makes the call L{Stalled}, and liveness counts afresh from the resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure
from zope.interface import implementer

from loopd import http
from loopd.errors import (
    Http,
    InferError,
    LoadTimeout,
    Protocol,
    Stalled,
    StreamClosedEarly,
    ThinkingOverrun,
    WaitTimeout,
)
from loopd.llama.assemble import Assembler, parse_chunk
from loopd.llama.flow import Flow, IFlowReader
from loopd.llama.info import Counters, get_json, parse_slots, slot_busy, slots_serving
from loopd.llama.request import affinity_headers, chat_body, encode
from loopd.llama.router import model_path
from loopd.llama.types import (
    ChatEvent,
    ChatRequest,
    Completion,
    Content,
    Reasoning,
    ThinkingCapped,
    ToolCallDelta,
    Waiting,
)
from loopd.reactor import IUnixReactor
from loopd.settings import Config, Endpoint
from loopd.sse import SSEDecoder, SSEError, SSEEvent

__all__ = ["CHAT_PATH", "CONTROL_PATH", "ChatCall", "retry_after_seconds"]

CHAT_PATH = "/v1/chat/completions"
CONTROL_PATH = "/v1/chat/completions/control"

EventSink = Callable[[ChatEvent], None]

#: The events that are pieces of the answer: the first of them ends prompt processing.
_DELTAS = (Reasoning, Content, ToolCallDelta)
#: What a C{/slots} answer says of the slots serving a request: each processing one's id
#: and counters.
_Work = tuple[tuple[int, Counters], ...]


@implementer(IFlowReader)
class ChatCall:
    """
    One request's life; L{run} starts it once. As an L{IFlowReader} it is paused, resumed
    and cancelled by the L{Flow} it was given, if any.
    """

    def __init__(
        self,
        reactor: IUnixReactor,
        config: Config,
        endpoint: Endpoint,
        request: ChatRequest,
        on_event: EventSink,
        flow: Flow | None = None,
        *,
        open_http: http.Opener | None = None,
        poll_slots: Callable[[], Deferred[Any]] | None = None,
    ) -> None:
        """
        @param reactor: provides IReactorTime and IReactorUNIX.
        @param config: limits, caps and request settings.
        @param endpoint: the server to ask.
        @param request: what to ask.
        @param on_event: receives the call's events as they happen.
        @param flow: the consumer's flow control, which the stream attaches to; C{None}
            reads as fast as the server sends.
        @param open_http: opens the call's connections; plain ones to the endpoint's socket
            by default.
        @param poll_slots: asks C{/slots} once (the decoded answer, or a failure, within
            C{poll_ms}); a request of the call's own by default.
        """
        self._reactor = reactor
        self._open = open_http or http.opener(reactor, endpoint.socket)
        self._poll_slots = poll_slots or self._own_slots_poll
        self._config = config
        self._endpoint = endpoint
        self._request = request
        self._on_event = on_event
        self._flow = flow
        self._paused = False
        self._llama = endpoint.kind == "llama-server"
        self._caps = http.HttpCaps(config.caps.header_bytes, config.caps.body_bytes)
        self._decoder = SSEDecoder(config.caps.sse_line_bytes)
        self._assembler = Assembler()
        self._result: Deferred[Completion] = Deferred(lambda d: self._fail(CancelledError()))
        self._pending: list[Deferred[Any]] = []
        self._response: http.HttpResponse | None = None
        self._timer: IDelayedCall | None = None
        self._timer_action: Callable[[], None] | None = None
        self._state_since: dict[str, float] = {}
        self._capped_at: int | None = None
        self._finished = False
        # Prompt processing (see the module docstring): whether a 200 stream is being read
        # and whether an answer's piece has come; then, while the stream is silent before
        # that, when it fell silent, when life was last seen and when the slot last
        # advanced, the poll out, what the last processing answer showed, what the last
        # poll found, and whether /slots is not there.
        self._streaming = False
        self._answering = False
        self._quiet_since: float | None = None
        self._life_at = 0.0
        self._advanced_at = 0.0
        self._prefill_poll: Deferred[Any] | None = None
        self._work_seen: _Work | None = None
        self._finding = ""
        self._no_slots = False

    # -- starting and ending -------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """
        Whether the call has ended, with a completion or a failure.
        """
        return self._finished

    def run(self) -> Deferred[Completion]:
        """
        Send the request; the Deferred fires with the completion or fails with an
        L{InferError} (or C{CancelledError} when cancelled, or when the flow was already
        stopped: then nothing is sent).
        """
        if self._flow is not None and self._flow.stopped:
            self._fail(CancelledError())
            return self._result
        body = encode(chat_body(self._request, self._config, self._endpoint))
        sending = self._track(
            self._open(
                "POST",
                CHAT_PATH,
                body,
                affinity_headers(self._request, self._endpoint),
                caps=self._caps,
                connect_timeout=self._seconds(self._config.limits.poll_ms),
                on_connected=self._sent,
            )
        )
        sending.addCallbacks(self._headers_arrived, self._fail)
        return self._result

    def _sent(self) -> None:
        """
        The request's connection is made: the first-byte wait starts.
        """
        if not self._finished and self._response is None:
            self._arm(self._first_byte_limit(), self._poll)

    def _fail(self, reason: BaseException | Failure) -> None:
        """
        End the call with C{reason} (wrapped in a L{Failure} when it is a bare exception); does
        nothing once the call has ended.
        """
        self._end(reason if isinstance(reason, Failure) else Failure(reason))

    def _end(self, outcome: Completion | Failure) -> None:
        """
        End the call, once: stop the timer, detach from the flow, abort the response and cancel
        every request still out (a C{/slots} poll, the control), then fire the result with
        C{outcome}. Whichever end comes first wins; later ones do nothing.
        """
        if self._finished:
            return
        self._finished = True
        self._disarm()
        if self._flow is not None:
            self._flow.detach(self)
        response, self._response = self._response, None
        if response is not None:
            response.abort()
        pending, self._pending = self._pending, []
        for d in pending:
            d.cancel()
        if isinstance(outcome, Failure):
            self._result.errback(outcome)
        else:
            self._result.callback(outcome)

    def _track(self, d: Deferred[Any]) -> Deferred[Any]:
        """
        Keep C{d} so that ending the call cancels it; it leaves the list when it fires.
        """
        self._pending.append(d)

        def forget(result: Any) -> Any:
            if d in self._pending:
                self._pending.remove(d)
            return result

        d.addBoth(forget)
        return d

    # -- timers --------------------------------------------------------------------------

    @staticmethod
    def _seconds(ms: int) -> float:
        """
        C{ms} milliseconds as the seconds that reactor timers take.
        """
        return ms / 1000.0

    def _arm(self, ms: int, action: Callable[[], None]) -> None:
        """
        Run C{action} in C{ms} milliseconds, in place of whatever the call's one timer was set
        to do. The same action still pending is postponed rather than replaced.
        """
        self._arm_in(self._seconds(ms), action)

    def _arm_at(self, when: float, action: Callable[[], None]) -> None:
        """
        Run C{action} at clock time C{when} (at once if it has passed), as L{_arm} does.
        A limit counted from an earlier time is armed so: the difference of two clock times
        is exact where adding two delays would not be.
        """
        self._arm_in(max(0.0, when - self._reactor.seconds()), action)

    def _arm_in(self, seconds: float, action: Callable[[], None]) -> None:
        """
        L{_arm} in C{seconds}.
        """
        timer = self._timer
        if timer is not None and timer.active() and self._timer_action == action:
            # Postponing a pending call is cheaper than a new one for every chunk.
            timer.reset(seconds)
            return
        self._disarm()
        self._timer = self._reactor.callLater(seconds, action)
        self._timer_action = action

    def _disarm(self) -> None:
        """
        Cancel the timer, if one is pending.
        """
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _first_byte_limit(self) -> int:
        """
        How long the headers may take before L{_poll} acts, in milliseconds: C{poll_ms} for a
        llama-server (which is then asked about its slots), C{busy_wait_ms} in all for an
        C{openai} endpoint.
        """
        limits = self._config.limits
        return limits.poll_ms if self._llama else limits.busy_wait_ms

    # -- before the first byte -----------------------------------------------------------

    def _poll(self) -> None:
        """
        No headers within the interval. A llama-server is asked for its C{/slots} on a second
        connection, allowed C{poll_ms} to answer, and the answer is judged by L{_observe}; no
        timer runs meanwhile, so the next poll is armed only once this one is judged. For an
        C{openai} endpoint the first-byte wait is over: L{WaitTimeout}.
        """
        self._timer = None
        if not self._llama:
            self._fail(WaitTimeout(f"no answer within {self._config.limits.busy_wait_ms} ms"))
            return
        polling = self._track(self._poll_slots())
        polling.addCallbacks(self._slots_answered, self._slots_failed)

    def _own_slots_poll(self) -> Deferred[Any]:
        """
        One C{/slots} request of this call's own, allowed C{poll_ms} in all.
        """
        seconds = self._seconds(self._config.limits.poll_ms)
        path = "/slots"
        if self._endpoint.router and self._endpoint.model:
            path = model_path(path, self._endpoint.model)
        polling = get_json(self._open, "GET", path, caps=self._caps, connect_timeout=seconds)
        # A /slots that hangs is a server in trouble, as good as a failing one.
        polling.addTimeout(seconds, self._reactor)
        return polling

    def _slots_answered(self, value: object) -> None:
        """
        Judge a C{/slots} answer as C{busy} or C{idle} for the request's slot. An answer that
        does not parse as slots ends the call with L{Protocol}. Ignored once the headers have
        arrived or the call has ended.
        """
        if self._finished or self._response is not None:
            return
        try:
            busy = slot_busy(parse_slots(value), self._request.slot)
        except Protocol as e:
            self._fail(e)
            return
        self._observe("busy" if busy else "idle")

    def _slots_failed(self, reason: Failure) -> None:
        """
        C{/slots} could not be asked, answered a status other than 200 or a body that is not
        JSON, or took longer than C{poll_ms}: the server counts as loading or restarting.
        """
        if self._finished:
            return
        self._observe("loading")

    def _observe(self, state: str) -> None:
        """
        Judge one poll's finding: report it, end the wait past its limit, else poll again.
        """
        if self._finished or self._response is not None:
            return
        now = self._reactor.seconds()
        for other in list(self._state_since):
            if other != state:
                del self._state_since[other]
        since = self._state_since.setdefault(state, now)
        self._on_event(Waiting(slot_busy=state == "busy", loading=state == "loading"))
        limits = self._config.limits
        # Clock times are float sums (0.05 * 3 is 0.15000000000000002): a difference can fall
        # a hair short of a limit, so compare whole nanoseconds.
        waited = round((now - since) * 1000, 6)
        if state == "busy" and waited >= limits.busy_wait_ms:
            self._fail(WaitTimeout(f"slot {self._request.slot} busy for {waited:.0f} ms"))
        elif state == "loading" and waited >= limits.load_wait_ms:
            self._fail(LoadTimeout(f"server unavailable for {waited:.0f} ms"))
        elif state == "idle" and waited >= limits.idle_grace_ms:
            self._fail(Stalled(f"slot idle and no answer for {waited:.0f} ms"))
        else:
            self._arm(limits.poll_ms, self._poll)

    # -- the answer ----------------------------------------------------------------------

    def _headers_arrived(self, response: http.HttpResponse) -> None:
        """
        The headers are in, which ends the wait (later C{/slots} answers are ignored). A status
        other than 200 has its body read as the error (L{_read_error}). A 200 attaches to the
        flow, if any, and streams its body into L{_data_received}, the liveness limit replacing
        the first-byte timer. Headers that arrive after the call has ended are aborted.
        """
        if self._finished:
            response.abort()
            return
        self._response = response
        if response.status != 200:
            self._alive()
            self._read_error(response)
            return
        self._streaming = True
        if self._flow is not None:
            # Attaching pauses the call at once if the flow is paused, or ends it if stopped.
            self._flow.attach(self)
            if self._result.called:
                return
        self._alive()
        streaming = self._track(response.deliver(self._data_received))
        streaming.addCallbacks(self._body_ended, self._fail)

    def _read_error(self, response: http.HttpResponse) -> None:
        """
        Read an error body under the body cap, with the liveness limit between reads, then
        fail with L{Http}.
        """
        pieces: list[bytes] = []
        cap = self._config.caps.body_bytes
        received = 0

        def collect(data: bytes) -> None:
            """
            Keep one piece of the error body, a sign of life; past the body cap, raising
            L{Protocol} aborts the read and fails the call with it.
            """
            nonlocal received
            self._alive()
            received += len(data)
            if received > cap:
                raise Protocol(f"error body over {cap} bytes")
            pieces.append(data)

        def failed(_: object) -> None:
            """
            The whole error body is in: fail the call with L{Http}, its status, text and
            C{Retry-After}.
            """
            text = b"".join(pieces).decode("utf-8", "replace")
            self._fail(Http(response.status, text, retry_after_seconds(response.headers)))

        reading = self._track(response.deliver(collect))
        reading.addCallbacks(failed, self._fail)

    def _alive(self) -> None:
        """
        A sign of life: the liveness limit counts from now, unless the flow has paused the
        call (then it counts from the resume). While the prompt is processed the slot has
        advanced too, and the timer is the poll that comes before the limit
        (L{_prefill_poll_due}); a poll still out is dropped.
        """
        if self._watching_prefill():
            now = self._reactor.seconds()
            self._quiet_since = self._life_at = self._advanced_at = now
            self._finding = ""
            self._drop_prefill_poll()
            if not self._paused:
                self._arm(self._until_prefill_poll(), self._prefill_poll_due)
            return
        self._quiet_since = None
        if not self._paused:
            self._arm(self._config.limits.liveness_ms, self._silent)

    def _silent(self) -> None:
        """
        The liveness limit passed without a sign of life: L{Stalled}, saying what the last
        C{/slots} poll found, if one was asked.
        """
        self._timer = None
        waited = self._config.limits.liveness_ms
        if self._quiet_since is not None:
            waited = round((self._reactor.seconds() - self._quiet_since) * 1000)
        finding = "/slots has not answered" if self._prefill_poll is not None else self._finding
        self._fail(Stalled(f"no data for {waited} ms" + (f"; {finding}" if finding else "")))

    # -- while the prompt is processed (decision 44) --------------------------------------

    def _watching_prefill(self) -> bool:
        """
        Whether C{/slots} may show life: a llama-server stream before the first delta, and
        C{/slots} not found missing.
        """
        return self._llama and self._streaming and not self._answering and not self._no_slots

    def _poll_lead(self) -> int:
        """
        How long before the liveness limit a poll goes out, in milliseconds: C{poll_ms},
        the time a poll is allowed, or a quarter of the limit when that is shorter (a
        stream silent for less than three quarters of its limit is not asked about).
        """
        limits = self._config.limits
        return min(limits.poll_ms, limits.liveness_ms // 4)

    def _until_prefill_poll(self) -> int:
        """
        How long after a sign of life the next poll goes out, in milliseconds.
        """
        return self._config.limits.liveness_ms - self._poll_lead()

    def _prefill_poll_due(self) -> None:
        """
        The stream has been silent until shortly before the liveness limit: the limit is
        armed for the rest, and C{/slots} is asked (L{_prefill_answered}). When the first
        delta has come meanwhile, only the limit is armed.
        """
        self._timer = None
        # Armed first: an answer that shows life replaces it, whenever it comes.
        self._arm_at(self._life_at + self._seconds(self._config.limits.liveness_ms), self._silent)
        if not self._watching_prefill():
            return
        polling = self._track(self._poll_slots())
        self._prefill_poll = polling
        polling.addCallbacks(
            self._prefill_answered,
            self._prefill_failed,
            callbackArgs=(polling,),
            errbackArgs=(polling,),
        )

    def _drop_prefill_poll(self) -> None:
        """
        Cancel the C{/slots} poll of the silence, if one is out (its outcome is ignored).
        """
        polling, self._prefill_poll = self._prefill_poll, None
        if polling is not None:
            polling.cancel()

    def _prefill_answered(self, value: object, polling: Deferred[Any]) -> None:
        """
        Judge a C{/slots} answer during prompt processing. The request's slot processing is
        life: the next poll comes C{liveness_ms} less the lead after it, in place of the
        limit; and when its counters differ from the last processing answer's, the slot has
        advanced. A slot processing without advancing for C{prefill_stall_ms} is
        L{Stalled}. Anything else is no evidence: the limit stands.
        """
        if polling is not self._prefill_poll or self._finished:
            return
        self._prefill_poll = None
        try:
            serving = slots_serving(parse_slots(value), self._request.slot)
        except Protocol as e:
            self._finding = f"/slots answered badly: {e}"
            return
        work: _Work = tuple((slot.id, slot.counters) for slot in serving if slot.is_processing)
        if not work:
            self._finding = "/slots shows the slot idle"
            return
        now = self._reactor.seconds()
        if self._work_seen is not None and work != self._work_seen:
            self._advanced_at = now
        self._work_seen = work
        # Whole nanoseconds, as in _observe: clock times are float sums.
        stuck = round((now - self._advanced_at) * 1000, 6)
        if stuck >= self._config.limits.prefill_stall_ms:
            self._fail(Stalled(f"slot processing but not advancing for {stuck:.0f} ms"))
            return
        self._finding = ""
        self._life_at = now
        self._arm(self._until_prefill_poll(), self._prefill_poll_due)

    def _prefill_failed(self, reason: Failure, polling: Deferred[Any]) -> None:
        """
        C{/slots} could not be asked, answered a status other than 200 or a body that is not
        JSON, or took longer than C{poll_ms}: no evidence, the limit stands. A 404 or 501
        says the server has no C{/slots}: the call does not ask it again.
        """
        if polling is not self._prefill_poll or self._finished:
            return
        self._prefill_poll = None
        error = reason.value
        if isinstance(error, Http) and error.status in (404, 501):
            self._no_slots = True
            self._finding = f"/slots is not available (HTTP {error.status})"
        else:
            self._finding = f"/slots failed: {reason.getErrorMessage()}"

    def _data_received(self, data: bytes) -> None:
        """
        A piece of the stream: a sign of life, pings included. Its SSE events are handled in
        order until one ends the call; bytes that are not a valid event stream (a line over
        C{sse_line_bytes} included) fail it with L{Protocol}.
        """
        if self._finished:
            return
        self._alive()
        try:
            items = self._decoder.feed(data)
        except SSEError as e:
            self._fail(Protocol(f"bad event stream: {e}"))
            return
        for item in items:
            # An event can end the call (done, an error, the thinking overrun).
            if isinstance(item, SSEEvent) and not self.finished:
                self._event(item)

    def _event(self, event: SSEEvent) -> None:
        """
        Handle one SSE event: C{[DONE]} completes the call; any other is a chunk for the
        assembler, whose events go to C{on_event}, after which the thinking cap is checked. A
        chunk that does not parse or does not fit the stream so far fails the call with its
        L{InferError}.
        """
        if event.done:
            self._complete()
            return
        try:
            events = self._assembler.feed(parse_chunk(event.data), event.data)
        except InferError as e:
            self._fail(e)
            return
        if not self._answering and any(isinstance(e, _DELTAS) for e in events):
            # Prompt processing is over: the plain liveness limit from the next byte on.
            self._answering = True
        for chat_event in events:
            self._on_event(chat_event)
        self._check_thinking()

    def _body_ended(self, _: object) -> None:
        """
        The body ended cleanly without C{[DONE]}: complete the call all the same.
        """
        self._complete()

    def _complete(self) -> None:
        """
        End the call with the assembled L{Completion}, marked as thinking-capped if the cap
        fired, or with L{StreamClosedEarly} if no chunk carried a C{finish_reason}.
        """
        if self._finished:
            return
        try:
            completion = self._assembler.completion(thinking_capped=self._capped_at is not None)
        except StreamClosedEarly as e:
            self._fail(e)
            return
        self._end(completion)

    # -- flow control (IFlowReader) ------------------------------------------------------

    def pause(self) -> None:
        """
        Stop reading the answer and suspend the liveness limit, until L{resume}.
        """
        if self._finished or self._paused:
            return
        self._paused = True
        self._disarm()
        self._drop_prefill_poll()
        if self._response is not None:
            self._response.pause()

    def resume(self) -> None:
        """
        Read the answer again; the liveness limit counts from now.
        """
        if self._finished or not self._paused:
            return
        self._paused = False
        # Armed before reading resumes, so that an end reached at once also disarms it.
        self._alive()
        if self._response is not None:
            self._response.resume()

    def cancel(self) -> None:
        """
        End the call as cancelling its Deferred does.
        """
        self._result.cancel()

    # -- the thinking cap ----------------------------------------------------------------

    def _check_thinking(self) -> None:
        """
        Apply the thinking cap after a chunk, for a llama-server request with thinking on while
        the answer is still in its reasoning: at C{thinking.cap} reasoning tokens (or the
        request's own C{thinking_cap}, when lower) ask the server
        to end the reasoning (L{_cap}); C{thinking.overrun} more tokens after that fail the call
        with L{ThinkingOverrun}. Once the answer has left its reasoning nothing is checked.
        """
        if not (self._llama and self._request.thinking):
            return
        assembler = self._assembler
        if not assembler.in_reasoning:
            return
        tokens = assembler.reasoning_tokens
        thinking = self._config.thinking
        cap = thinking.cap
        if self._request.thinking_cap is not None:
            cap = min(cap, self._request.thinking_cap)
        if self._capped_at is None:
            # The control names the completion by its id: until a chunk has shown one, the
            # cap waits (a null id would be refused, and the overrun counts from the cap).
            if tokens >= cap and assembler.id is not None:
                self._cap(tokens, assembler.id)
        elif tokens >= self._capped_at + thinking.overrun:
            self._fail(
                ThinkingOverrun(f"still thinking {tokens - self._capped_at} tokens after the cap")
            )

    def _cap(self, tokens: int, completion_id: str) -> None:
        """
        Ask the server to end the reasoning: a C{reasoning_end} control for C{completion_id},
        the completion's id, on a second connection. Reports L{ThinkingCapped}; C{tokens}, the
        count reached, is where the overrun is measured from.
        """
        self._capped_at = tokens
        control: dict[str, object] = {"id": completion_id, "action": "reasoning_end"}
        if self._endpoint.model:
            control["model"] = self._endpoint.model
        ending = self._track(
            get_json(
                self._open,
                "POST",
                CONTROL_PATH,
                control,
                caps=self._caps,
                connect_timeout=self._seconds(self._config.limits.poll_ms),
            )
        )
        ending.addCallbacks(self._control_answered, self._control_failed)
        self._on_event(ThinkingCapped(tokens))

    def _control_answered(self, value: object) -> None:
        """
        The control's answer: anything but C{success: true} means the server will not end the
        reasoning, so the call fails with L{ThinkingOverrun}.
        """
        if isinstance(value, dict) and value.get("success") is True:
            return
        self._fail(ThinkingOverrun(f"the server did not end the reasoning: {value!r}"))

    def _control_failed(self, reason: Failure) -> None:
        """
        The control could not be sent, or answered a status other than 200: L{ThinkingOverrun},
        unless the call has already ended (which cancels the control).
        """
        if self._finished:
            return
        self._fail(ThinkingOverrun(f"the reasoning_end control failed: {reason.value}"))


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """
    A response's C{Retry-After} as seconds: a finite number that is not negative; None when
    the header is missing or not a number (the HTTP-date form included).
    """
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
