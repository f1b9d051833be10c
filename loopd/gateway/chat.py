# -*- test-case-name: loopd.test.test_gateway_chat,loopd.test.test_gateway_mesh -*-
"""
C{POST /v1/chat/completions}: an OpenAI request in, one leased upstream call in the middle,
an OpenAI answer out (DESIGN.md §3, decisions 15 to 19).

The body is read once (L{parse_request}) into the gateway's request model. Its C{model}
names an endpoint, or C{auto} (the router's candidates, in order), or C{mesh}: with two or
more workers in the pool a L{MeshExchange} serves it, else the one model does, as a request
for it by name.

A streaming answer starts lazily, at the first thing worth sending (a delta or one of
loopd's own events), so that an error that comes before it (Busy, an upstream 400, ...)
is still an HTTP status with a JSON body; after that, an error is one
C{data: {"error": ...}} event and no C{[DONE]}. loopd's own events travel as SSE comment
lines (C{: loopd {...}}), which OpenAI clients ignore. A client that goes away cancels
the upstream request, and llama-server frees the slot.

Endpoint health (DESIGN decision 38, L{loopd.gateway.health}): a request naming an endpoint
that is down is answered 503 C{endpoint_unavailable} with C{Retry-After} at once. When a call
finds its endpoint down (no connection, its inferproxy closing at once, an upstream 502/503
that is not the model loading) while the client has seen nothing and the router has another
candidate that is not down, the call is not retried: the request fails over at once (so a
stream never opens on a C{retrying} comment first). Otherwise the client's retries run as
they always did (a server that restarts under a stream resumes it); a call that still ends
with its endpoint down is answered with the same 503.

Backpressure: a streaming exchange registers a L{Flow} as its request's producer, and the
upstream call reads through it, so a client that stops reading pauses the upstream read
and loopd's buffers stay bounded; reading resumes when the client drains them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from loopd.errors import ProxyRefused
from loopd.gateway.channel import GatewayChannel
from loopd.gateway.errors import GatewayError, error_for
from loopd.gateway.health import EndpointUnavailableError, means_down
from loopd.gateway.mesh import MeshExchange, MeshHost, mesh_pool
from loopd.gateway.render import ChunkStream, completion_json, loopd_comment, new_completion_id
from loopd.gateway.request import GatewayRequest, read_session
from loopd.gateway.sessions import Sessions
from loopd.gateway.translate import parse_request
from loopd.gateway.upstream import CallKeys
from loopd.gateway.web import comment_line, data_line, done_line, open_event_stream, write_json
from loopd.llama import Flow
from loopd.llama.retry import is_retryable
from loopd.llama.types import ChatEvent, Completion, Content, Reasoning, ToolCallDelta
from loopd.moa.roles import VIRTUAL_MODEL_NAME as MESH_MODEL
from loopd.settings import Endpoint

__all__ = ["ChatCompletions", "ChatHost", "write_error"]

_log = Logger(namespace="loopd.gateway")

_FIRST_TOKEN = (Content, Reasoning, ToolCallDelta)

#: The body fields of a chat request that name its session, after the headers (decision 36).
_BODY_SESSION_IDS = ("user",)


class ChatHost(MeshHost, Protocol):
    """What the chat completions route uses of its gateway, besides what the mesh uses."""

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


class ChatCompletions(Resource):
    """
    The chat completions route of one gateway.
    """

    isLeaf = True

    def __init__(self, host: ChatHost) -> None:
        """
        @param host: the gateway whose upstreams, router, sessions and metrics this route
            uses.
        """
        super().__init__()
        self._host = host

    def render_POST(self, request: Request) -> bytes | int:
        """
        Answer one chat completion request.
        """
        host = self._host
        content = request.content
        body = content.read() if content is not None else b""
        try:
            parsed = parse_request(body)
            session = read_session(
                request.getHeader,
                lambda: _anonymous(host, request),
                [(name, parsed.extras.get(name)) for name in _BODY_SESSION_IDS],
            )
            parsed = dataclasses.replace(parsed, session=session)
            routed = host.route_auto(parsed)
            if parsed.model == MESH_MODEL:
                pool = mesh_pool(host, parsed)
                if len(pool) >= 2:
                    MeshExchange(host, request, parsed, pool).start()
                    return NOT_DONE_YET
                # Fewer than two workers: the one model serves the request alone (v2).
                routed = (host.config.endpoint(pool[0].name),)
            first, *rest = routed or (host.endpoint_for(parsed.model),)
            if not host.health.eligible(first.name):
                raise host.health.unavailable([first.name], host.reactor.seconds())
        except GatewayError as e:
            host.metrics.observe_request("-", e.code)
            return write_error(request, e)
        _ChatExchange(host, request, parsed, first, rest).start()
        return NOT_DONE_YET


def write_error(request: Request, error: GatewayError) -> bytes:
    """
    Answer C{error} with its status and JSON body (L{write_json}), and the C{Retry-After}
    of an L{EndpointUnavailableError}.
    """
    if isinstance(error, EndpointUnavailableError):
        request.setHeader(b"retry-after", b"%d" % error.retry_after)
    return write_json(request, error.status, error.body())


def _anonymous(host: ChatHost, request: Request) -> str:
    """
    The anonymous session of C{request}'s connection; it ends when the connection closes
    (no grace after it, DESIGN §3 decision 36).
    """
    channel = request.channel

    def end_with_connection(session: str) -> None:
        if isinstance(channel, GatewayChannel):
            channel.when_closed(lambda: host.upstreams.end_session(session))

    return host.sessions.anonymous_id(channel, end_with_connection)


class _Phase(enum.Enum):
    """Where an exchange stands with its client."""

    QUIET = "nothing sent yet: an error is still a status"
    STREAMING = "the event stream has started: an error is an event"
    DONE = "the answer is complete, or the client has gone"


class _ChatExchange:
    """
    One request's way through the gateway: the leased upstream call, the answer.

    An C{auto} request comes with C{alternatives}, the router's next candidates: when its
    endpoint cannot be reached (down, or its inferproxy refused) before anything went to the
    client, the exchange tries the next one that is not down, each once (the failed call gave
    its lease back at once).
    """

    def __init__(
        self,
        host: ChatHost,
        request: Request,
        parsed: GatewayRequest,
        endpoint: Endpoint,
        alternatives: list[Endpoint],
    ) -> None:
        """
        @param host: the gateway.
        @param request: the client's request.
        @param parsed: what it asks, read once by the front door.
        @param endpoint: the endpoint to try first.
        @param alternatives: the router's next candidates, for a fail-over (C{auto} only).
        """
        self._host = host
        self._request = request
        self._parsed = parsed
        self._alternatives = alternatives
        self._tried: list[str] = []
        session = parsed.session
        self._keys = CallKeys(session.id, session.tier, session.ends, anonymous=session.anonymous)
        self._phase = _Phase.QUIET
        self._started_at = host.reactor.seconds()
        self._first_token_seen = False
        self._completion_id = new_completion_id()
        self._created = int(host.wall_clock())
        self._call: Deferred[Completion] | None = None
        self._flow: Flow | None = None
        self._use(endpoint)

    def _use(self, endpoint: Endpoint) -> None:
        """Serve the request from C{endpoint} from now on."""
        self._endpoint = endpoint
        self._tried.append(endpoint.name)
        self._chunks = ChunkStream(
            self._completion_id, endpoint.name, self._created, self._parsed.include_usage
        )

    def start(self) -> None:
        """Send the request upstream; watch for the client leaving all along."""
        self._host.in_flight.add(self)
        self._request.notifyFinish().addErrback(self._client_gone)
        if self._parsed.stream:
            self._flow = Flow()
            self._request.registerProducer(self._flow, True)
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
        )
        self._call = call
        call.addCallbacks(self._completed, self._failed)

    def _retryable(self, error: BaseException) -> bool:
        """
        The client's retries, but not of a failure that says the endpoint is down while
        the request can still fail over (nothing sent yet, a candidate left that is not
        down): it goes there at once instead.
        """
        if means_down(error) and self._phase is _Phase.QUIET:
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

    # -- events --------------------------------------------------------------------------

    def _event(self, event: ChatEvent) -> None:
        """
        One event of the upstream call: the first token's time for the metrics, and for a
        streaming client its chunks or a C{: loopd} comment (which open the stream).
        """
        if self._phase is _Phase.DONE:
            return
        if isinstance(event, _FIRST_TOKEN) and not self._first_token_seen:
            self._first_token_seen = True
            self._host.metrics.observe_first_token(
                self._endpoint.name, self._host.reactor.seconds() - self._started_at
            )
        if not self._parsed.stream:
            return
        comment = loopd_comment(event)
        chunks = self._chunks.chunks_for(event)
        if comment is None and not chunks:
            return
        self._start_stream()
        if comment is not None:
            self._request.write(comment_line(comment))
        for chunk in chunks:
            self._request.write(data_line(chunk))

    def _start_stream(self) -> None:
        """Open the event stream with the role chunk, once."""
        if self._phase is not _Phase.QUIET:
            return
        self._phase = _Phase.STREAMING
        open_event_stream(self._request)
        self._request.write(data_line(self._chunks.role_chunk()))

    # -- endings -------------------------------------------------------------------------

    def _completed(self, completion: Completion) -> None:
        """The call finished: answer with the completion, as the closing chunks or a JSON body."""
        self._call = None
        if self._phase is _Phase.DONE:
            return
        name = self._endpoint.name
        self._host.metrics.observe_request(name, "ok")
        if self._parsed.stream:
            self._start_stream()
            for chunk in self._chunks.finish_chunks(completion):
                self._request.write(data_line(chunk))
            self._request.write(done_line())
            self._finish()
        else:
            body = completion_json(
                completion, completion_id=self._completion_id, model=name, created=self._created
            )
            self._finish(write_json(self._request, 200, body))

    def _failed(self, reason: Failure) -> None:
        """

        The call failed: fail over when the endpoint is down or its inferproxy refused at a
        limit (nothing reached a server) while the client has seen nothing and the router
        has a next candidate that is not down; else answer the error, which for a down
        endpoint is 503 C{endpoint_unavailable} naming every candidate tried. A cancellation
        is this exchange's own doing (the client left, or the daemon stopped) and answers
        nothing.
        """
        self._call = None
        if self._phase is _Phase.DONE or reason.check(CancelledError):
            return
        error = reason.value or Exception(reason.getErrorMessage())
        down = means_down(error)
        unreached = down or isinstance(error, ProxyRefused)
        health = self._host.health
        self._alternatives = [e for e in self._alternatives if health.eligible(e.name)]
        if unreached and self._alternatives and self._phase is _Phase.QUIET:
            self._fail_over(reason)
            return
        tried = [name for name in self._tried if not health.eligible(name)]
        if down and tried:
            self._end_with_error(health.unavailable(tried, self._host.reactor.seconds()))
            return
        self._end_with_error(error_for(error))

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

    def _end_with_error(self, error: GatewayError) -> None:
        """Answer C{error} as a status or, once streaming, as an error event; stop the call."""
        if self._phase is _Phase.DONE:
            return
        self._host.metrics.observe_request(self._endpoint.name, error.code)
        call, self._call = self._call, None
        if self._phase is _Phase.STREAMING:
            self._request.write(data_line(error.body()))
            self._finish()
        else:
            self._finish(write_error(self._request, error))
        if call is not None:
            call.cancel()

    def _client_gone(self, reason: Failure) -> None:
        """The client left: count it and cancel the call (which gives its lease back)."""
        if self._phase is _Phase.DONE:
            return
        self._phase = _Phase.DONE
        self._host.in_flight.discard(self)
        self._host.metrics.observe_request(self._endpoint.name, "client_gone")
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    def _finish(self, body: bytes = b"") -> None:
        """End the response, with C{body} when given; the producer goes before the end."""
        self._phase = _Phase.DONE
        self._host.in_flight.discard(self)
        if self._flow is not None:
            self._request.unregisterProducer()
        if body:
            self._request.write(body)
        self._request.finish()
