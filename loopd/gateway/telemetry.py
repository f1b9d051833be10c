# -*- test-case-name: loopd.test.test_gateway_telemetry -*-
"""
OpenTelemetry traces of the gateway's requests (DESIGN decision 48): optional, off by
default (C{[telemetry]} in loopd.toml), and only imported when on, since OpenTelemetry is
an extra (C{pip install 'loopd[telemetry]'}).

L{TelemetryWatcher} is a watcher of the gateway's activity (L{loopd.gateway.activity}) that
turns each request's record into spans when the request ends (so the request path keeps its
one record, and the spans cost nothing while it runs), each with the record's own times (the
reactor's clock, placed on the wall clock by the request's arrival):

 - the request: C{chat {model}} (the model it asked for, its first L{MODEL_NAME_MAX}
   characters; C{chat} when it named none), kind SERVER, from its arrival to the end of its
   answer, with an event C{first_token};
 - under it, each upstream call made for it (the answer's, a fail-over's, each mesh
   worker's and the reducer's): C{chat {model}}, kind CLIENT, from its start (its lease wait
   included) to its end, with an event C{sent} when the request went to the server;
 - under each call that waited for its lease (L{LEASE_WAIT_SPAN_SECONDS} or more), its
   wait: C{lease wait}, from the call's start to the grant. A lease granted at once is no
   wait to trace (the call's C{loopd.lease.wait_seconds} says it): that span would be a
   third of every request's spans, the most of what telemetry costs the gateway.

Their attributes follow OpenTelemetry's GenAI semantic conventions where one fits
(L{GEN_AI_ATTRIBUTES}), and are loopd's own (C{loopd.*}) where none does; docs/telemetry.md
lists them all. No text of a prompt or an answer is ever in a span, nor an error's message
(it may quote the request): an error is its kind (C{error.type}). The session is named by a
pseudonym (the first 16 hex digits of its id's SHA-256) unless C{session_ids = "plain"}.

L{GatewayTelemetry} puts it together for C{twist loopd}: the watcher, whose finished spans
go to a L{SpanQueue} that exports them to the collector's Unix socket
(L{loopd.gateway.span_export}).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import AttributeValue
from twisted.internet.defer import Deferred

import loopd
from loopd.gateway.activity import ActivityWatcher, CallRecord, RequestRecord
from loopd.gateway.span_export import SpanQueue, otlp_sender
from loopd.reactor import IUnixReactor
from loopd.settings import Endpoint, Telemetry

__all__ = [
    "GEN_AI_ATTRIBUTES",
    "LEASE_WAIT_SPAN_SECONDS",
    "GatewayTelemetry",
    "TelemetryWatcher",
    "session_label",
]

#: The GenAI semantic conventions' attributes the spans carry (their names as of
#: opentelemetry-semantic-conventions 0.66b2, checked by the tests against that package).
GEN_AI_ATTRIBUTES: Final = {
    "GEN_AI_OPERATION_NAME": "gen_ai.operation.name",
    "GEN_AI_PROVIDER_NAME": "gen_ai.provider.name",
    "GEN_AI_REQUEST_MODEL": "gen_ai.request.model",
    "GEN_AI_RESPONSE_MODEL": "gen_ai.response.model",
    "GEN_AI_RESPONSE_FINISH_REASONS": "gen_ai.response.finish_reasons",
    "GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK": "gen_ai.response.time_to_first_chunk",
    "GEN_AI_USAGE_INPUT_TOKENS": "gen_ai.usage.input_tokens",
    "GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS": "gen_ai.usage.cache_read.input_tokens",
    "GEN_AI_USAGE_OUTPUT_TOKENS": "gen_ai.usage.output_tokens",
    "GEN_AI_USAGE_REASONING_OUTPUT_TOKENS": "gen_ai.usage.reasoning.output_tokens",
}

#: The shortest lease wait that is a span of its own, in seconds.
LEASE_WAIT_SPAN_SECONDS: Final = 0.001

_OPERATION = GEN_AI_ATTRIBUTES["GEN_AI_OPERATION_NAME"]
_PROVIDER = GEN_AI_ATTRIBUTES["GEN_AI_PROVIDER_NAME"]
_REQUEST_MODEL = GEN_AI_ATTRIBUTES["GEN_AI_REQUEST_MODEL"]
_RESPONSE_MODEL = GEN_AI_ATTRIBUTES["GEN_AI_RESPONSE_MODEL"]
_FINISH_REASONS = GEN_AI_ATTRIBUTES["GEN_AI_RESPONSE_FINISH_REASONS"]
_FIRST_CHUNK = GEN_AI_ATTRIBUTES["GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK"]
_INPUT_TOKENS = GEN_AI_ATTRIBUTES["GEN_AI_USAGE_INPUT_TOKENS"]
_CACHE_READ = GEN_AI_ATTRIBUTES["GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS"]
_OUTPUT_TOKENS = GEN_AI_ATTRIBUTES["GEN_AI_USAGE_OUTPUT_TOKENS"]
_REASONING_TOKENS = GEN_AI_ATTRIBUTES["GEN_AI_USAGE_REASONING_OUTPUT_TOKENS"]
#: The semantic conventions' own attributes of HTTP and of errors.
_HTTP_STATUS = "http.response.status_code"
_ERROR_TYPE = "error.type"

#: The GenAI operation of every span of a model call (each front door is a chat).
CHAT: Final = "chat"
#: The provider name of a llama.cpp server (not among the conventions' well-known values).
LLAMA_CPP: Final = "llama.cpp"
#: How many hex digits of the SHA-256 of a session id name the session in a span.
SESSION_HASH_DIGITS: Final = 16
#: The longest model name a span carries, in characters (a request may name any model).
MODEL_NAME_MAX: Final = 256

_Attributes = dict[str, AttributeValue]


def session_label(session: str, mode: str) -> str:
    """
    How spans name C{session}: the first L{SESSION_HASH_DIGITS} hex digits of the SHA-256
    of its id (C{mode} C{hash}: the same session always gets the same label, the id itself
    stays out of the trace; a pseudonym, not an anonymisation: who knows an id can find its
    spans), or the id itself (C{plain}).
    """
    if mode == "plain":
        return session
    return hashlib.sha256(session.encode("utf-8")).hexdigest()[:SESSION_HASH_DIGITS]


class TelemetryWatcher(ActivityWatcher):
    """
    Turns each finished request's record into its spans; see the module docstring.

    The spans are made finished, as OpenTelemetry's SDK hands a finished span to its
    processors (a L{ReadableSpan}), not through a tracer: the record already holds every
    time and figure, and a tracer's live spans (sampling, attribute checks, a context per
    span) cost the gateway more than all of loopd's own observation (bench/gateway.py part
    4). Every request is traced (no sampling); the attributes are loopd's own values, of
    the types OpenTelemetry takes.
    """

    def __init__(
        self,
        emit: Callable[[ReadableSpan], None],
        endpoints: Sequence[Endpoint] = (),
        session_ids: str = "hash",
        resource: Resource | None = None,
    ) -> None:
        """
        @param emit: takes each finished span (a span processor's C{on_end}, an exporter).
        @param endpoints: the gateway's endpoints (a router's models included), for each
            call's model and provider; a call to an endpoint not named here is described
            by its name alone.
        @param session_ids: C{hash} or C{plain} (L{session_label}).
        @param resource: the spans' resource (default: OpenTelemetry's own, from its
            environment variables).
        """
        self._emit = emit
        self._endpoints: Mapping[str, Endpoint] = {e.name: e for e in endpoints}
        self._session_ids = session_ids
        self._resource = resource if resource is not None else Resource.create({})
        self._scope = InstrumentationScope("loopd", loopd.__version__)
        self._ids = RandomIdGenerator()

    def request_ended(self, record: RequestRecord) -> None:
        """C{record}'s request ended: make its span, its calls' and their lease waits'."""
        ns = _wall_ns(record)
        ended = record.ended if record.ended is not None else record.started
        model = record.model[:MODEL_NAME_MAX] if record.model else None
        trace_id = self._ids.generate_trace_id()
        request = self._context(trace_id)
        for call in record.calls:
            self._call_span(record, call, request, ns, ended)
        events: tuple[Event, ...] = ()
        if record.first_token is not None:
            events = (Event("first_token", timestamp=ns(record.first_token)),)
        self._span(
            f"{CHAT} {model}" if model else CHAT,
            request,
            None,
            SpanKind.SERVER,
            self._request_attributes(record),
            ns(record.started),
            ns(ended),
            _failed(record),
            events,
        )

    def _context(self, trace_id: int) -> SpanContext:
        """A new span's context in trace C{trace_id}, sampled."""
        return SpanContext(
            trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )

    def _span(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: _Attributes,
        start: int,
        end: int,
        failed: bool = False,
        events: Sequence[Event] = (),
    ) -> None:
        """Make one finished span and hand it on."""
        status = Status(StatusCode.ERROR) if failed else Status(StatusCode.UNSET)
        self._emit(
            ReadableSpan(
                name,
                context,
                parent,
                self._resource,
                attributes,
                events,
                kind=kind,
                status=status,
                start_time=start,
                end_time=end,
                instrumentation_scope=self._scope,
            )
        )

    def _request_attributes(self, record: RequestRecord) -> _Attributes:
        """The request span's attributes."""
        totals = record.totals()
        attributes: _Attributes = {
            _OPERATION: CHAT,
            "loopd.request.id": record.id,
            "loopd.door": record.door,
            "loopd.stream": record.stream,
            "loopd.mesh": record.mesh,
            "loopd.calls": len(record.calls),
            "loopd.retries": sum(c.retries for c in record.calls),
            "loopd.thinking_capped": any(c.thinking_capped for c in record.calls),
        }
        if record.model:
            attributes[_REQUEST_MODEL] = record.model[:MODEL_NAME_MAX]
        if record.session:
            attributes["loopd.session"] = session_label(record.session, self._session_ids)
            attributes["loopd.session.anonymous"] = record.anonymous
        if record.agent:
            attributes["loopd.agent"] = record.agent
        if record.outcome is not None:
            attributes["loopd.outcome"] = record.outcome
        if record.status is not None:
            attributes[_HTTP_STATUS] = record.status
        if _failed(record) and record.outcome is not None:
            attributes[_ERROR_TYPE] = record.outcome
        answered = [c for c in record.calls if c.timings is not None]
        if answered and not record.mesh:
            attributes[_RESPONSE_MODEL] = self._model(answered[-1].endpoint)
        if answered:
            attributes.update(_usage(totals.cache_n, totals.prompt_n, totals.predicted_n))
            reasoning = sum(c.reasoning_tokens for c in answered)
            if reasoning:
                attributes[_REASONING_TOKENS] = reasoning
        if record.first_token is not None:
            attributes[_FIRST_CHUNK] = round(record.first_token - record.started, 6)
        return attributes

    def _call_span(
        self,
        record: RequestRecord,
        call: CallRecord,
        request: SpanContext,
        ns: Callable[[float], int],
        request_ended: float,
    ) -> None:
        """One call's span under the request's, and its lease wait's under it."""
        ended = call.ended if call.ended is not None else request_ended
        model = self._model(call.endpoint)
        context = self._context(request.trace_id)
        if call.lease_wait is not None and call.lease_wait >= LEASE_WAIT_SPAN_SECONDS:
            assert call.leased is not None
            self._span(
                "lease wait",
                self._context(request.trace_id),
                context,
                SpanKind.INTERNAL,
                {"loopd.endpoint": call.endpoint},
                ns(call.started),
                ns(call.leased),
            )
        events = () if call.sent is None else (Event("sent", timestamp=ns(call.sent)),)
        self._span(
            f"{CHAT} {model}",
            context,
            request,
            SpanKind.CLIENT,
            self._call_attributes(call, model),
            ns(call.started),
            ns(ended),
            _outcome(call) == "error",
            events,
        )

    def _call_attributes(self, call: CallRecord, model: str) -> _Attributes:
        """A call span's attributes."""
        attributes: _Attributes = {
            _OPERATION: CHAT,
            _REQUEST_MODEL: model,
            "loopd.endpoint": call.endpoint,
            "loopd.call.role": call.role,
            "loopd.retries": call.retries,
            "loopd.thinking_capped": call.thinking_capped,
            "loopd.outcome": _outcome(call),
        }
        endpoint = self._endpoints.get(call.endpoint)
        if endpoint is not None:
            attributes["loopd.endpoint.kind"] = endpoint.kind
            if endpoint.kind != "openai":
                attributes[_PROVIDER] = LLAMA_CPP
        if call.slot is not None:
            attributes["loopd.slot"] = call.slot
        if call.lease_wait is not None:
            attributes["loopd.lease.wait_seconds"] = round(call.lease_wait, 6)
        timings = call.timings
        if timings is not None:
            attributes[_RESPONSE_MODEL] = model
            attributes.update(_usage(timings.cache_n, timings.prompt_n, timings.predicted_n))
            attributes["loopd.llama.cache_n"] = timings.cache_n
            attributes["loopd.llama.prompt_n"] = timings.prompt_n
            attributes["loopd.llama.predicted_n"] = timings.predicted_n
            if timings.prompt_per_second is not None:
                attributes["loopd.llama.prompt_per_second"] = timings.prompt_per_second
            if timings.predicted_per_second is not None:
                attributes["loopd.llama.predicted_per_second"] = timings.predicted_per_second
            if call.reasoning_tokens:
                attributes[_REASONING_TOKENS] = call.reasoning_tokens
        if call.finish_reason is not None:
            attributes[_FINISH_REASONS] = (call.finish_reason,)
        if call.error is not None and call.error != "cancelled":
            attributes[_ERROR_TYPE] = call.error.split(":", 1)[0]
        return attributes

    def _model(self, endpoint: str) -> str:
        """The model a call to C{endpoint} asks for: its configured model id, else its name."""
        settings = self._endpoints.get(endpoint)
        return settings.model if settings is not None and settings.model else endpoint


def _failed(record: RequestRecord) -> bool:
    """
    Whether C{record}'s request failed: it ended with an error's code (a client that left
    is not loopd's failure).
    """
    return record.outcome not in ("ok", "client_gone", None)


def _outcome(call: CallRecord) -> str:
    """
    How a call ended: C{ok}, C{error}, C{cancelled} (abandoned: its client left, or its
    mesh turn was decided without it), or C{unfinished} (still running when its request
    ended).
    """
    if call.error == "cancelled":
        return "cancelled"
    if call.error is not None:
        return "error"
    if call.ended is None:
        return "unfinished"
    return "ok"


def _usage(cache_n: int, prompt_n: int, predicted_n: int) -> _Attributes:
    """
    The GenAI usage attributes of llama.cpp's counts: the input tokens count the cached
    ones too, as the conventions say.
    """
    return {
        _INPUT_TOKENS: cache_n + prompt_n,
        _CACHE_READ: cache_n,
        _OUTPUT_TOKENS: predicted_n,
    }


def _wall_ns(record: RequestRecord) -> Callable[[float], int]:
    """
    The wall clock in nanoseconds of a reactor time of C{record}'s: its arrival on the wall
    clock, plus the reactor's seconds since (each part rounded on its own, so equal
    offsets give equal nanoseconds).
    """
    wall = round(record.wall_started * 1e9)
    started = record.started

    def ns(at: float) -> int:
        return wall + round((at - started) * 1e9)

    return ns


class GatewayTelemetry:
    """
    C{twist loopd}'s telemetry: the L{TelemetryWatcher} that makes the spans (their resource
    has C{service.name} and C{service.version}, and whatever C{OTEL_RESOURCE_ATTRIBUTES}
    adds) and the L{SpanQueue} that exports them to the collector's Unix socket.

    @ivar queue: the spans on their way to the collector.
    @ivar watcher: the watcher to add to the gateway's activity.
    """

    def __init__(
        self, reactor: IUnixReactor, settings: Telemetry, endpoints: Sequence[Endpoint]
    ) -> None:
        """
        @param reactor: the timers of the export and its connections.
        @param settings: C{[telemetry]}; its C{socket} must be set.
        @param endpoints: the gateway's endpoints.
        @raise ValueError: C{settings} names no socket.
        """
        if settings.socket is None:
            raise ValueError("[telemetry] names no socket")
        self._settings = settings
        timeout = settings.export_timeout_ms / 1000.0
        self.queue = SpanQueue(
            reactor,
            otlp_sender(reactor, settings.socket, settings.path, timeout),
            target=settings.socket,
            export_interval=settings.export_interval_ms / 1000.0,
            max_batch=settings.max_batch,
            max_queue=settings.max_queue,
            timeout=timeout,
        )
        resource = Resource.create(
            {"service.name": settings.service_name, "service.version": loopd.__version__}
        )
        self.watcher = TelemetryWatcher(
            self.queue.on_end, endpoints, settings.session_ids, resource
        )

    def start(self) -> None:
        """Start the export's timer."""
        self.queue.start()

    def stop(self) -> Deferred[None]:
        """
        Send the spans left, waiting at most C{stop_wait_ms}; fires when done (never fails).
        """
        return self.queue.stop(self._settings.stop_wait_ms / 1000.0)
