# -*- test-case-name: loopd.test.test_gateway_chat,loopd.test.test_gateway_mesh -*-
"""
C{POST /v1/chat/completions}: an OpenAI request in, the llama client in the middle, an
OpenAI answer out (DESIGN.md §3, decisions 15 to 19).

The request's C{model} names an endpoint, or C{auto} (the router's candidates, in order),
or C{mesh}: with two or more workers reachable a L{MeshExchange} serves it, else the one
model does, as a request for it by name.

A streaming answer starts lazily, at the first thing worth sending (a delta or one of
loopd's own events), so that an error that comes before it (Busy, an upstream 400, ...)
is still an HTTP status with a JSON body; after that, an error is one
C{data: {"error": ...}} event and no C{[DONE]}. loopd's own events travel as SSE comment
lines (C{: loopd {...}}), which OpenAI clients ignore. A client that goes away cancels
the upstream request, and llama-server frees the slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from loopd.errors import Connect, WaitTimeout
from loopd.gateway.errors import GatewayError, error_for
from loopd.gateway.mesh_calls import mesh_pool
from loopd.gateway.mesh_exchange import MeshExchange
from loopd.gateway.render import ChunkStream, completion_json, loopd_comment, new_completion_id
from loopd.gateway.request_body import decode_request
from loopd.gateway.responses import (
    comment_line,
    data_line,
    open_event_stream,
    write_json,
)
from loopd.gateway.slot_choice import pick_slot
from loopd.gateway.translate import GatewayRequest, parse_document
from loopd.llama.types import ChatEvent, Completion, Content, Queued, Reasoning, ToolCallDelta
from loopd.moa.roles import VIRTUAL_MODEL_NAME as MESH_MODEL

__all__ = ["ChatCompletions", "session_end", "session_of", "session_role"]

_log = Logger(namespace="loopd.gateway")

SESSION_HEADER = b"x-session-id"
ROLE_HEADER = b"x-session-role"
END_HEADER = b"x-session-end"
_ENDS = {b"true": True, b"1": True, b"false": False, b"0": False}
T = TypeVar("T")
_ROLES = {b"parent": "parent", b"child": "child"}
_FIRST_TOKEN = (Content, Reasoning, ToolCallDelta)


class ChatCompletions(Resource):
    """
    The chat completions route of one gateway.
    """

    isLeaf = True

    def __init__(self, gateway: Any) -> None:
        """
        @param gateway: the L{loopd.gateway.site.Gateway} whose clients, sessions and
            metrics this route uses.
        """
        super().__init__()
        self._gateway = gateway

    def render_POST(self, request: Request) -> bytes | int:
        """
        Answer one chat completion request.
        """
        content = request.content
        body = content.read() if content is not None else b""
        try:
            role = session_role(request)
            final = session_end(request)
            document = decode_request(body)
            routed = self._gateway.route_auto(document)
            parsed = parse_document(document)
            if parsed.model == MESH_MODEL:
                pool = mesh_pool(self._gateway, document)
                if len(pool) >= 2:
                    session = session_of(self._gateway, request)
                    mesh = MeshExchange(
                        self._gateway,
                        request,
                        document,
                        pool,
                        stream=parsed.stream,
                        session=session,
                        final=final,
                    )
                    mesh.start()
                    return NOT_DONE_YET
                # Fewer than two workers: the one model serves the request alone (v2).
                routed = (self._gateway.config.endpoint(pool[0].name),)
            first, *rest = routed or (self._gateway.endpoint_for(parsed.model),)
        except GatewayError as e:
            self._gateway.metrics.observe_request("-", e.code)
            return write_json(request, e.status, e.body())
        _Exchange(self._gateway, request, parsed, first, role, final, rest).start()
        return NOT_DONE_YET


def session_of(gateway: Any, request: Request) -> str:
    """
    The request's session: its C{X-Session-Id}, else one id per client connection.
    """
    header = request.getHeader(SESSION_HEADER)
    if header:
        return header.decode("utf-8", "backslashreplace")
    return str(gateway.sessions.anonymous_id(request.channel))


def session_end(request: Request) -> bool:
    """
    Whether C{X-Session-End} says this is the session's last request (C{true} or C{1};
    absent, C{false} or C{0}: not).

    @raise GatewayError: 400 for any other value.
    """
    return _header_choice(request, END_HEADER, _ENDS, False, "true or false")


def session_role(request: Request) -> str:
    """
    The request's tier from C{X-Session-Role}: C{parent} (also when absent) or C{child}.

    @raise GatewayError: 400 for any other value.
    """
    return _header_choice(request, ROLE_HEADER, _ROLES, "parent", "parent or child")


def _header_choice(
    request: Request, header: bytes, choices: Mapping[bytes, T], default: T, expected: str
) -> T:
    """
    The value C{header} names among C{choices} (any case), C{default} when it is absent.

    @raise GatewayError: 400 C{invalid_<header name>} for any other value.
    """
    value = request.getHeader(header)
    if value is None:
        return default
    chosen = choices.get(value.strip().lower())
    if chosen is None:
        name = "-".join(part.capitalize() for part in header.decode().split("-"))
        shown = value.decode("utf-8", "backslashreplace")
        code = "invalid_" + header.decode().removeprefix("x-").replace("-", "_")
        raise GatewayError(
            400, f"{name} must be {expected}, got {shown!r}", "invalid_request_error", code
        )
    return chosen


class _Exchange:
    """
    One request's way through the gateway: slot choice, the upstream call, the answer.

    An C{auto} request comes with C{alternatives}, the router's next candidates: when its
    endpoint cannot be connected to before anything went to the client, the exchange gives
    its lease back and tries the next one, each once.
    """

    def __init__(
        self,
        gateway: Any,
        request: Request,
        parsed: GatewayRequest,
        endpoint: Any,
        role: str = "parent",
        final: bool = False,
        alternatives: Sequence[Any] = (),
    ) -> None:
        self._gateway = gateway
        self._alternatives = list(alternatives)
        self._role = role
        self._final = final
        self._hold: Any = None
        self._leasing: Deferred[Any] | None = None
        self._request = request
        self._parsed = parsed
        self._reactor = gateway.reactor
        self._started_at = self._reactor.seconds()
        self._first_token_seen = False
        self._completion_id = new_completion_id()
        self._created = int(gateway.wall_clock())
        self._use(endpoint)
        self._streaming = False
        self._finished = False
        self._call: Deferred[Completion] | None = None
        self._session = session_of(gateway, request)

    def _use(self, endpoint: Any) -> None:
        """Serve the request from C{endpoint} from now on."""
        self._endpoint = endpoint
        self._client = self._gateway.clients[endpoint.name]
        self._chunks = ChunkStream(
            self._completion_id, endpoint.name, self._created, self._parsed.include_usage
        )

    def start(self) -> None:
        """
        Take the session's lease, then choose the slot and send the request upstream;
        watch for the client leaving all along.
        """
        self._gateway.in_flight.add(self)
        self._request.notifyFinish().addErrback(self._client_gone)
        self._acquire()

    def _acquire(self) -> None:
        """Take the session's lease on the endpoint (when leasing), then L{_go}."""
        leases = self._gateway.leases
        if leases is None:
            self._go()
            return
        leasing = leases.acquire(
            self._endpoint.name,
            self._session,
            self._role,
            on_queued=lambda ahead: self._event(Queued(ahead)),
        )
        wait_ms = self._gateway.config.limits.busy_wait_ms
        leasing.addTimeout(wait_ms / 1000.0, self._reactor, _lease_timeout(wait_ms))
        self._leasing = leasing
        leasing.addCallbacks(self._leased, self._failed)

    def _leased(self, hold: Any) -> None:
        self._leasing = None
        self._hold = hold
        if self._finished:
            self._give_back()
            return
        self._go()

    def _go(self) -> None:
        """Choose the slot (L{pick_slot}) and send the request upstream."""
        slot = pick_slot(self._gateway, self._endpoint.name, self._session)
        self._slot = slot
        chat = replace(self._parsed.chat, slot=slot)
        call = self._client.chat_with_retry(chat, self._event)
        self._call = call
        call.addCallbacks(self._completed, self._failed)

    def shutdown(self) -> None:
        """
        The daemon is stopping: end this exchange with an error.
        """
        self._end_with_error(
            GatewayError(503, "loopd is shutting down", "server_error", "shutting_down")
        )

    # -- events --------------------------------------------------------------------------

    def _event(self, event: ChatEvent) -> None:
        if self._finished:
            return
        if isinstance(event, _FIRST_TOKEN) and not self._first_token_seen:
            self._first_token_seen = True
            self._gateway.metrics.observe_first_token(
                self._endpoint.name, self._reactor.seconds() - self._started_at
            )
        if not self._parsed.stream:
            return
        comment = loopd_comment(event)
        chunks = self._chunks.chunks_for(event)
        if comment is None and not chunks:
            return
        self._start_stream()
        if comment is not None:
            self._write(comment_line(comment))
        for chunk in chunks:
            self._write_data(chunk)

    def _start_stream(self) -> None:
        if self._streaming:
            return
        self._streaming = True
        open_event_stream(self._request)
        self._write_data(self._chunks.role_chunk())

    def _write_data(self, payload: object) -> None:
        self._write(data_line(payload))

    def _write(self, data: bytes) -> None:
        self._request.write(data)

    # -- endings -------------------------------------------------------------------------

    def _completed(self, completion: Completion) -> None:
        self._call = None
        if self._finished:
            return
        gateway = self._gateway
        name = self._endpoint.name
        gateway.metrics.observe_request(name, "ok")
        gateway.metrics.observe_completion(name, completion.timings)
        gateway.record_speed(name, completion.timings.predicted_per_second)
        self._note_cache(completion)
        if self._parsed.stream:
            self._start_stream()
            for chunk in self._chunks.finish_chunks(completion):
                self._write_data(chunk)
            self._write(b"data: [DONE]\n\n")
            self._finish()
        else:
            body = completion_json(
                completion, completion_id=self._completion_id, model=name, created=self._created
            )
            self._finish(write_json(self._request, 200, body))

    def _note_cache(self, completion: Completion) -> None:
        outcome = self._gateway.sessions.record(
            self._session, self._slot, completion.timings, self._gateway.config.cache_loss_tokens
        )
        if outcome is None:
            return
        if outcome.loss:
            self._gateway.metrics.observe_cache_loss(self._endpoint.name)
        emit, verdict = (_log.warn, "loss") if outcome.loss else (_log.info, "hit")
        emit(
            "cache " + verdict + " for session {session} on slot {slot}: reused {cached} of "
            "{expected} tokens",
            session=self._session,
            slot=self._slot,
            cached=outcome.cached,
            expected=outcome.expected,
        )

    def _failed(self, reason: Failure) -> None:
        self._call = None
        self._leasing = None
        if self._finished or reason.check(CancelledError):
            return
        if reason.check(Connect) and self._alternatives and not self._streaming:
            self._fail_over(reason)
            return
        self._end_with_error(error_for(reason.value or Exception(reason.getErrorMessage())))

    def _fail_over(self, reason: Failure) -> None:
        """
        The endpoint could not be connected to and the client has seen nothing yet: give
        its lease back and try the router's next candidate.
        """
        failed, self._hold = self._hold, None
        if failed is not None:
            # Nothing of the session is cached there: its lease goes back without grace.
            self._gateway.leases.done(failed, True)
        _log.warn(
            "auto: {endpoint} unreachable ({error}); trying {next}",
            endpoint=self._endpoint.name,
            error=reason.getErrorMessage(),
            next=self._alternatives[0].name,
        )
        self._use(self._alternatives.pop(0))
        self._acquire()

    def _end_with_error(self, error: GatewayError) -> None:
        if self._finished:
            return
        self._gateway.metrics.observe_request(self._endpoint.name, error.code)
        call, self._call = self._call, None
        leasing, self._leasing = self._leasing, None
        if self._streaming:
            self._write_data(error.body())
            self._finish()
        else:
            self._finish(write_json(self._request, error.status, error.body()))
        if call is not None:
            call.cancel()
        if leasing is not None:
            leasing.cancel()

    def _client_gone(self, reason: Failure) -> None:
        if self._finished:
            return
        self._finished = True
        self._gateway.in_flight.discard(self)
        self._gateway.metrics.observe_request(self._endpoint.name, "client_gone")
        call, self._call = self._call, None
        leasing, self._leasing = self._leasing, None
        if call is not None:
            call.cancel()
        if leasing is not None:
            leasing.cancel()
        self._give_back()

    def _give_back(self) -> None:
        """The request is over: its session's lease may start its grace."""
        hold, self._hold = self._hold, None
        if hold is not None:
            self._gateway.leases.done(hold, self._final)

    def _finish(self, body: bytes = b"") -> None:
        self._finished = True
        self._give_back()
        self._gateway.in_flight.discard(self)
        if body:
            self._request.write(body)
        self._request.finish()


def _lease_timeout(wait_ms: int) -> Any:
    """The C{onTimeoutCancel} of a lease wait: it ends as L{WaitTimeout}."""

    def timed_out(result: object, timeout: float) -> object:
        if isinstance(result, Failure) and result.check(CancelledError):
            return Failure(WaitTimeout(f"no lease on the endpoint's queue within {wait_ms} ms"))
        return result

    return timed_out
