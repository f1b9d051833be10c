"""
A tiny OpenTelemetry collector for the telemetry tests: a twisted.web resource that takes
OTLP/HTTP protobuf exports (C{POST /v1/traces}, C{application/x-protobuf}), decodes each with
OpenTelemetry's own C{ExportTraceServiceRequest}, and keeps them; it can answer another
status, or hold its answers (a slow collector). It serves in memory (on a
L{loopd.testing.memory_net.MemoryNet}) and on a real socket alike. It needs the telemetry
extra (C{opentelemetry-proto}).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

#: OTLP's span kinds by their number in the protocol.
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
#: OTLP's status codes by their number.
STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass(frozen=True)
class ReceivedSpan:
    """
    One span as the collector received it.

    @ivar parent_span_id: the parent's span id, hex; empty for a root span.
    @ivar resource: the attributes of the resource it came with.
    @ivar scope: the name of the instrumentation scope it came with.
    """

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: str
    events: tuple[tuple[str, int], ...]
    resource: dict[str, Any]
    scope: str


def value_of(value: AnyValue) -> Any:
    """The Python value of an OTLP C{AnyValue} (an array as a tuple)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(item) for item in value.array_value.values)
    if kind is None:
        return None
    return getattr(value, kind)


def attributes_of(pairs: Any) -> dict[str, Any]:
    """OTLP key-value pairs as a dict."""
    found: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        found[pair.key] = value_of(pair.value)
    return found


def spans_of(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one export, in the order it carried them."""
    found = []
    for resource_spans in request.resource_spans:
        resource = attributes_of(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=KINDS[span.kind],
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=attributes_of(span.attributes),
                        status=STATUS_CODES[span.status.code],
                        events=tuple((e.name, e.time_unix_nano) for e in span.events),
                        resource=resource,
                        scope=scope_spans.scope.name,
                    )
                )
    return found


class OtlpReceiver(Resource):
    """
    An OTLP/HTTP trace collector's one route: each POST's body decoded and kept.

    @ivar status: the status each export is answered with (200 unless set).
    @ivar hold: leave each export unanswered until L{release}.
    @ivar requests: every export decoded, in order.
    @ivar heads: each export's path and content type, in order.
    """

    isLeaf = True

    def __init__(self, status: int = 200, hold: bool = False) -> None:
        """Answer with C{status}, or not at all while C{hold}."""
        super().__init__()
        self.status = status
        self.hold = hold
        self.requests: list[ExportTraceServiceRequest] = []
        self.heads: list[tuple[bytes, bytes | None]] = []
        self._held: list[Request] = []
        self._waiters: list[tuple[int, Deferred[None]]] = []

    def render_POST(self, request: Request) -> bytes | int:
        """Keep the export; answer it (or hold it)."""
        content = request.content
        body = content.read() if content is not None else b""
        self.heads.append((request.path, request.getHeader(b"content-type")))
        self.requests.append(ExportTraceServiceRequest.FromString(body))
        waiting, self._waiters = self._waiters, []
        for count, d in waiting:
            if len(self.requests) >= count:
                d.callback(None)
            else:
                self._waiters.append((count, d))
        if self.hold:
            self._held.append(request)
            request.notifyFinish().addErrback(lambda _: self._held.remove(request))
            return NOT_DONE_YET
        return self._answer(request)

    def _answer(self, request: Request) -> bytes:
        """The answer's status, type and body (an empty C{ExportTraceServiceResponse})."""
        request.setResponseCode(self.status)
        request.setHeader(b"content-type", b"application/x-protobuf")
        answer: bytes = ExportTraceServiceResponse().SerializeToString()
        return answer

    def release(self) -> None:
        """Answer the exports held so far; answer the next ones at once."""
        self.hold = False
        held, self._held = self._held, []
        for request in held:
            request.write(self._answer(request))
            request.finish()

    def received(self, count: int) -> Deferred[None]:
        """Fires once C{count} exports have arrived."""
        d: Deferred[None] = Deferred()
        if len(self.requests) >= count:
            d.callback(None)
        else:
            self._waiters.append((count, d))
        return d

    def spans(self) -> list[ReceivedSpan]:
        """Every span received, in order."""
        return [span for request in self.requests for span in spans_of(request)]

    def batch_sizes(self) -> list[int]:
        """How many spans each export carried, in order."""
        return [len(spans_of(request)) for request in self.requests]
