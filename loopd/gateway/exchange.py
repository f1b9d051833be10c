# -*- test-case-name: loopd.test.test_gateway_exchange,loopd.test.test_gateway_chat -*-
"""
One request through a front door (DESIGN.md §3, decisions 15 to 19 and 40): the door reads
the body once into the gateway's request model, one leased upstream call serves it, and the
door writes the answer in its API's shapes (L{loopd.gateway.doors.door}). Every door (OpenAI chat
completions, Anthropic Messages, OpenAI Responses) goes this one way, so routing, the mesh,
leases and graces, slot affinity, the thinking cap, retries and endpoint health are the same
for all of them.

The request's C{model} names an endpoint or a group, or C{auto} (the router's candidates, in
order), or C{mesh}: with two or more workers in the pool a L{MeshExchange} serves it, else
the one model does, as a request for it by name. Body fields passed to the server as they are
(L{GatewayRequest.fields}) are a 400 naming them where they cannot apply: on C{mesh} (whose
workers and reducer are loopd's own requests) and, for the llama.cpp-only ones, on an
C{openai}-kind endpoint.

A streaming answer starts lazily, at the first thing worth sending (a delta or one of
loopd's own events), so that an error that comes before it (Busy, an upstream 400, ...)
is still an HTTP status with the door's error body; after that, an error is the door's
error event. loopd's own events travel as SSE comment lines (C{: loopd {...}}), which every
SDK ignores. A client that goes away cancels the upstream request, and llama-server frees
the slot.

Endpoint health (DESIGN decision 38, L{loopd.gateway.health}): a request naming an endpoint
that is down is answered 503 C{endpoint_unavailable} with C{Retry-After} at once. When a call
finds its endpoint down (no connection, its inferproxy closing at once, an upstream 502/503
that is not the model loading) while the client has seen nothing and the router has another
candidate that is not down, the call is not retried: the request fails over at once (so a
stream never opens on a C{retrying} comment first). Otherwise the client's retries run as
they always did (a server that restarts under a stream resumes it); a call that still ends
with its endpoint down is answered with the same 503.

A waiting client is kept (issue 24): coding agents give up on a stream that sends no data
event for a while (Codex CLI after 300 s, Qwen Code after 240 s, Claude Code's watchdog
after 300 s) and ignore SSE comments, so until the first token, every C{[server]
keepalive_ms} (15 s) the door's no-op event goes out (its answer's C{keepalive}), opening
the stream first if nothing opened it yet (Qwen Code also gives up after 120 s without
headers). A keep-alive that opened the stream makes a later failure an error event, as any
opening does.

The client side (where the answer stands, the stream opened once, an error by phase, the
client leaving, the end) is L{loopd.gateway.reply}'s, shared with the mesh's exchange.

Backpressure: a streaming exchange registers a L{Flow} as its request's producer, and the
upstream call reads through it, so a client that stops reading pauses the upstream read
and loopd's buffers stay bounded; reading resumes when the client drains them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from loopd.errors import ProxyRefused
from loopd.gateway.activity import MODEL_NAME_MAX, RequestRecord, agent_name
from loopd.gateway.cache_report import cache_header, cache_report
from loopd.gateway.channel import GatewayChannel
from loopd.gateway.doors.door import EVENT_STREAM, Door, comment_line
from loopd.gateway.doors.hosted_tools import DROPPED_HEADER
from loopd.gateway.doors.params import refusal, refused_fields
from loopd.gateway.errors import GatewayError, error_for, quotes_server
from loopd.gateway.health import EndpointUnavailableError, means_down
from loopd.gateway.mesh import MeshExchange, MeshHost, mesh_pool
from loopd.gateway.reply import Phase, Reply
from loopd.gateway.request import GatewayRequest
from loopd.gateway.sessions import Sessions, conversation_key
from loopd.gateway.upstream import CallKeys
from loopd.gateway.web import write_json
from loopd.llama import Flow
from loopd.llama.retry import is_retryable
from loopd.llama.types import ChatEvent, Completion, Content, Reasoning, ToolCallDelta
from loopd.moa.roles import VIRTUAL_MODEL_NAME as MESH_MODEL
from loopd.settings import Endpoint

__all__ = ["DoorRoute", "ExchangeHost", "write_error"]

_log = Logger(namespace="loopd.gateway")

_FIRST_TOKEN = (Content, Reasoning, ToolCallDelta)


class ExchangeHost(MeshHost, Protocol):
    """What a front door's route uses of its gateway, besides what the mesh uses."""

    @property
    def sessions(self) -> Sessions:
        """The session table: anonymous ids, slots, cache outcomes."""

    def endpoint_for(self, model: str | None) -> Endpoint:
        """
        The endpoint a request's C{model} names.

        @raise GatewayError: 404 for a model no endpoint serves.
        """

    def route_auto(self, request: GatewayRequest) -> tuple[Endpoint, ...] | None:
        """
        The endpoints to try, in order, for an C{auto} request; C{None} for any other.

        @raise GatewayError: the router's errors (C{media_unsupported}, C{no_endpoint}).
        """


class DoorRoute(Resource):
    """
    The route of one front door of one gateway: C{POST} reads the request through the door
    and serves it.
    """

    isLeaf = True

    def __init__(self, host: ExchangeHost, door: Door) -> None:
        """
        @param host: the gateway whose upstreams, router, sessions and metrics this route
            uses.
        @param door: how this route's API reads requests and writes answers.
        """
        super().__init__()
        self._host = host
        self._door = door

    def render_POST(self, request: Request) -> bytes | int:
        """
        Answer one request.
        """
        host = self._host
        content = request.content
        body = content.read() if content is not None else b""
        activity = host.activity
        record = activity.begin(self._door.name, body)
        record.agent = agent_name(request.getHeader)
        try:
            parsed = self._door.read(body, request.getHeader, lambda: _anonymous(host, request))
            _describe(record, parsed)
            if parsed.dropped:
                self._tell_dropped(request, parsed)
            pool = mesh_pool(host, parsed) if parsed.model == MESH_MODEL else None
            if pool is not None and len(pool) >= 2:
                refused = refused_fields(parsed.fields, "mesh")
                if refused:
                    raise refusal(refused, "on model mesh")
                record.mesh = True
                activity.started(record)
                try:
                    MeshExchange(host, self._door, request, parsed, pool, record).start()
                except BaseException:
                    activity.end(record, 500, "internal_error")
                    raise
                return NOT_DONE_YET
            parsed = _placed(host, parsed)
            if pool is None:
                routed = host.route_auto(parsed)
            else:
                # Fewer than two workers: the one model serves the request alone (v2).
                routed = (host.config.endpoint(pool[0].name),)
            first, *rest = routed or (host.endpoint_for(parsed.model),)
            _check_media(parsed, first)
            refused = refused_fields(parsed.fields, first.kind)
            if refused:
                raise refusal(refused, f"on endpoint {first.name!r}, an {first.kind} endpoint")
            # A fail-over goes only where every field of the request applies.
            rest = [e for e in rest if not refused_fields(parsed.fields, e.kind)]
            if not host.health.eligible(first.name):
                raise host.health.unavailable([first.name], host.reactor.seconds())
        except GatewayError as e:
            host.metrics.observe_request("-", e.code)
            activity.started(record)
            answer = write_error(request, e, self._door)
            activity.end(record, request.code, e.code, e.message)
            return answer
        activity.started(record)
        try:
            _Exchange(host, self._door, request, parsed, first, rest, record).start()
        except BaseException:
            activity.end(record, 500, "internal_error")
            raise
        return NOT_DONE_YET

    def _tell_dropped(self, request: Request, parsed: GatewayRequest) -> None:
        """
        Say which hosted tools the door left out of C{parsed} (decision 43): in the answer's
        C{X-Loopd-Dropped} header, one log line and C{loopd_dropped_tools_total}.
        """
        names = ", ".join(parsed.dropped)
        request.setHeader(DROPPED_HEADER, names.encode("ascii", "replace"))
        for tool in parsed.dropped:
            self._host.metrics.observe_dropped_tool(self._door.name, tool)
        _log.info(
            "{door} request of session {session}: left out hosted tools {tools} (the local "
            "model cannot run them)",
            door=self._door.name,
            session=parsed.session.id,
            tools=names,
        )


def _describe(record: RequestRecord, parsed: GatewayRequest) -> None:
    """What the door read, on the request's record."""
    record.session = parsed.session.id
    record.anonymous = parsed.session.anonymous
    # A client may name any model: what /v1/status, the traces and the capture keep is cut.
    record.model = parsed.model[:MODEL_NAME_MAX] if parsed.model else parsed.model
    record.stream = parsed.stream


def _placed(host: ExchangeHost, parsed: GatewayRequest) -> GatewayRequest:
    """
    C{parsed} with its session's conversation (DESIGN decision 45,
    L{loopd.gateway.upstream.Upstreams.conversation}): the key its route, lease and slot
    are chosen by, and whether it continues that conversation.
    """
    session = parsed.session
    if not session.id:
        return parsed
    key = conversation_key(parsed.messages)
    ref = host.upstreams.conversation(session.id, key, tools=bool(parsed.tools))
    placed = replace(session, conversation=ref.key, continues=ref.continues)
    return replace(parsed, session=placed)


def _check_media(parsed: GatewayRequest, endpoint: Endpoint) -> None:
    """
    Refuse images or audio for an endpoint whose config does not say it takes them
    (C{vision}, C{audio}); C{auto} has filtered its candidates so already.

    @raise GatewayError: 400 C{media_unsupported} naming the endpoint and what it lacks.
    """
    lacking = [
        kind
        for kind, needed, taken in (
            ("image", "vision" in parsed.modalities, endpoint.vision),
            ("audio", "audio" in parsed.modalities, endpoint.audio),
        )
        if needed and not taken
    ]
    if lacking:
        flags = " and ".join(f"{'vision' if k == 'image' else k} = true" for k in lacking)
        raise GatewayError(
            400,
            f"endpoint {endpoint.name!r} does not take {' or '.join(lacking)} input "
            f"(its config would say {flags})",
            "invalid_request_error",
            "media_unsupported",
        )


def write_error(request: Request, error: GatewayError, door: Door) -> bytes:
    """
    Answer C{error} with the status and JSON body of C{door}'s error shape (L{write_json}),
    and the C{Retry-After} of an L{EndpointUnavailableError}.
    """
    for name, value in retry_after(error):
        request.setHeader(name, value)
    status, body = door.error(error)
    return write_json(request, status, body)


def retry_after(error: GatewayError) -> list[tuple[bytes, bytes]]:
    """The C{Retry-After} header of an L{EndpointUnavailableError}; none for another error."""
    if isinstance(error, EndpointUnavailableError):
        return [(b"retry-after", b"%d" % error.retry_after)]
    return []


def _anonymous(host: ExchangeHost, request: Request) -> str:
    """
    The anonymous session of C{request}'s connection; it ends when the connection closes
    (no grace after it, DESIGN §3 decision 36).
    """
    channel = request.channel

    def end_with_connection(session: str) -> None:
        if isinstance(channel, GatewayChannel):
            channel.when_closed(lambda: host.upstreams.end_session(session))

    return host.sessions.anonymous_id(channel, end_with_connection)


class _Exchange:
    """
    One request's way through the gateway: the leased upstream call, the answer.

    An C{auto} request comes with C{alternatives}, the router's next candidates: when its
    endpoint cannot be reached (down, or its inferproxy refused) before anything went to the
    client, the exchange tries the next one that is not down, each once (the failed call gave
    its lease back at once).
    """

    def __init__(
        self,
        host: ExchangeHost,
        door: Door,
        request: Request,
        parsed: GatewayRequest,
        endpoint: Endpoint,
        alternatives: list[Endpoint],
        record: RequestRecord,
    ) -> None:
        """
        @param host: the gateway.
        @param door: the front door the request came through, which writes the answer.
        @param request: the client's request.
        @param parsed: what it asks, read once by the front door.
        @param endpoint: the endpoint to try first.
        @param alternatives: the router's next candidates, for a fail-over (C{auto} only).
        @param record: the request's record (L{loopd.gateway.activity}), ended here.
        """
        self._host = host
        self._record = record
        self._request = request
        self._door = door
        self._parsed = parsed
        self._alternatives = alternatives
        self._tried: list[str] = []
        session = parsed.session
        self._keys = CallKeys(
            session.key,
            session.tier,
            session.ends,
            anonymous=session.anonymous,
            continues=session.continues,
        )
        self._flow = Flow() if parsed.stream else None
        self._reply = Reply(request, self, host.in_flight, self._flow, door.stream_type)
        self._started_at = host.reactor.seconds()
        self._first_token_seen = False
        self._created = int(host.wall_clock())
        self._call: Deferred[Completion] | None = None
        self._keepalive: IDelayedCall | None = None
        self._use(endpoint)

    def _use(self, endpoint: Endpoint) -> None:
        """Serve the request from C{endpoint} from now on."""
        self._endpoint = endpoint
        self._tried.append(endpoint.name)
        self._answer = self._door.answer(self._parsed, endpoint.name, self._created)

    def start(self) -> None:
        """Send the request upstream; watch for the client leaving all along."""
        self._reply.watch(self._client_gone)
        if self._parsed.stream:
            self._arm_keepalive()
        self._go()

    def _go(self) -> None:
        """One leased call to the current endpoint."""
        call = self._host.upstreams.call(
            self._endpoint.name,
            self._parsed.chat_request(),
            self._keys,
            on_event=self._event,
            retryable=self._retryable,
            flow=self._flow,
            record=self._record,
        )
        self._call = call
        call.addCallbacks(self._completed, self._failed)

    def _retryable(self, error: BaseException) -> bool:
        """
        The client's retries, but not of a failure that says the endpoint is down while
        the request can still fail over (nothing sent yet, a candidate left that is not
        down): it goes there at once instead.
        """
        if means_down(error) and self._reply.phase is Phase.QUIET:
            health = self._host.health
            if any(health.eligible(e.name) for e in self._alternatives):
                return False
        return is_retryable(error)

    def shutdown(self) -> None:
        """
        The daemon is stopping: end this exchange with an error.
        """
        self._end_with_error(
            GatewayError(503, "loopd is shutting down", "server_error", "shutting_down")
        )

    # -- keeping a waiting client -----------------------------------------------------------

    def _arm_keepalive(self) -> None:
        """Send the door's keep-alive event in C{[server] keepalive_ms}."""
        seconds = self._host.config.server.keepalive_ms / 1000.0
        self._keepalive = self._host.reactor.callLater(seconds, self._keep_alive)

    def _keep_alive(self) -> None:
        """
        No token yet and the time is up: open the stream if it is not (a client that waits
        for headers gives up too: Qwen Code after 120 s), send the door's no-op event, and
        arm again.
        """
        self._keepalive = None
        if self._reply.done or self._first_token_seen:
            return
        self._start_stream()
        self._reply.write(self._answer.keepalive())
        self._arm_keepalive()

    def _stop_keepalive(self) -> None:
        """The answer's tokens flow, or it is over: no more keep-alive events."""
        timer, self._keepalive = self._keepalive, None
        if timer is not None and timer.active():
            timer.cancel()

    # -- events --------------------------------------------------------------------------

    def _event(self, event: ChatEvent) -> None:
        """
        One event of the upstream call: the first token's time for the metrics, and for a
        streaming client what the door makes of it (which opens the stream).
        """
        if self._reply.done:
            return
        if isinstance(event, _FIRST_TOKEN) and not self._first_token_seen:
            self._first_token_seen = True
            self._host.activity.first_token(self._record)
            self._stop_keepalive()
            self._host.metrics.observe_first_token(
                self._endpoint.name, self._host.reactor.seconds() - self._started_at
            )
        if not self._parsed.stream:
            return
        data = self._answer.during(event)
        if not data:
            return
        self._start_stream()
        self._reply.write(data)

    def _start_stream(self) -> None:
        """Open the event stream with the door's opening (a role chunk ...), once."""
        if self._reply.phase is Phase.QUIET:
            self._reply.open_stream(self._answer.opening())

    # -- endings -------------------------------------------------------------------------

    def _completed(self, completion: Completion) -> None:
        """The call finished: answer with the completion, as the stream's end or a JSON body."""
        self._call = None
        if self._reply.done:
            return
        self._stop_keepalive()
        name = self._endpoint.name
        self._host.metrics.observe_request(name, "ok")
        report = cache_report(self._record)
        if self._parsed.stream:
            self._start_stream()
            if self._door.stream_type == EVENT_STREAM:
                self._reply.write(comment_line({"event": "cache", **report}))
            self._reply.finish(self._answer.closing(completion))
        else:
            self._reply.respond(200, self._answer.body(completion), [cache_header(report)])
        self._host.activity.end(self._record, 200, "ok", completion=completion)

    def _failed(self, reason: Failure) -> None:
        """

        The call failed: fail over when the endpoint is down (or confirmed down while the
        call waited to retry it) or its inferproxy refused at a limit (nothing reached a
        server) while the client has seen nothing and the router
        has a next candidate that is not down; else answer the error, which for a down
        endpoint is 503 C{endpoint_unavailable} naming every candidate tried. A cancellation
        is this exchange's own doing (the client left, or the daemon stopped) and answers
        nothing.
        """
        self._call = None
        if self._reply.done or reason.check(CancelledError):
            return
        error = reason.value or Exception(reason.getErrorMessage())
        # A call that gave up waiting to retry on an endpoint confirmed down reached nothing.
        down = means_down(error) or isinstance(error, EndpointUnavailableError)
        unreached = down or isinstance(error, ProxyRefused)
        health = self._host.health
        self._alternatives = [e for e in self._alternatives if health.eligible(e.name)]
        if unreached and self._alternatives and self._reply.phase is Phase.QUIET:
            self._fail_over(reason)
            return
        tried = [name for name in self._tried if not health.eligible(name)]
        if down and tried:
            self._end_with_error(health.unavailable(tried, self._host.reactor.seconds()))
            return
        self._end_with_error(error_for(error), from_server=quotes_server(error))

    def _fail_over(self, reason: Failure) -> None:
        """
        The endpoint is down or its inferproxy refused the connection, and the client has
        seen nothing yet: try the router's next candidate, at once.
        """
        _log.warn(
            "auto: {endpoint} unreachable ({error}); trying {next}",
            endpoint=self._endpoint.name,
            error=reason.getErrorMessage(),
            next=self._alternatives[0].name,
        )
        self._use(self._alternatives.pop(0))
        self._go()

    def _end_with_error(self, error: GatewayError, from_server: bool = False) -> None:
        """Answer C{error} as a status or, once streaming, as an error event; stop the call."""
        if self._reply.done:
            return
        self._stop_keepalive()
        self._host.metrics.observe_request(self._endpoint.name, error.code)
        call, self._call = self._call, None
        self._reply.fail(
            lambda: self._answer.stream_error(error),
            lambda: self._reply.respond(*self._answer.error(error), retry_after(error)),
        )
        # The call's record ends (cancelled) before the request's does.
        if call is not None:
            call.cancel()
        self._host.activity.end(
            self._record,
            self._request.code,
            error.code,
            error.message,
            error_from_server=from_server,
        )

    def _client_gone(self) -> None:
        """The client left: count it and cancel the call (which gives its lease back)."""
        self._stop_keepalive()
        self._host.metrics.observe_request(self._endpoint.name, "client_gone")
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        self._host.activity.end(self._record, self._request.code, "client_gone")
