# -*- test-case-name: loopd.test.test_gateway_mesh -*-
"""
One C{model: "mesh"} request through the gateway (issue 6, DESIGN §3 decisions 28 to 33):
the worker pool from the configured endpoints, the turn (L{loopd.moa.engine.MeshTurn}) over
it with every worker and reducer call a leased upstream call, its answer in the OpenAI shapes
of reference C{mesh-moa.md} §1.12, and the C{x-moa-*} headers.

B{The pool.} Every configured endpoint that takes the request's images or audio (C{vision},
C{audio}, as for C{auto}) and is not down (L{loopd.gateway.health}: down from a failed call
or probe until its C{/health} probe answers again), deduplicated by canonical name. When
every such endpoint is down the request is 503 C{endpoint_unavailable} with C{Retry-After}.
An endpoint group (replicas of one model) is one worker, as one model is one worker in the
reference (§1.2): the member that L{group_member} picks for the session among the group's
members in the pool, so a session's mesh calls to the group stay on one member while it is up.

B{The calls.} Each worker or reducer call is one L{Upstreams.call} with a C{child}-tier lease
for the session (when the gateway leases), a slot history of its own per endpoint, and the
endpoint's robust llama client, but for a failure that says the endpoint is down: a worker
whose endpoint is down fails at once (decision 29) rather than hold the turn through the
client's backoff, and the endpoint leaves the pool of the next turns. An HTTP 429 fails
the call with L{RateLimited} (and its C{Retry-After}), which the fan-out retries once.
Cancelling a call withdraws its lease wait or aborts its request.

B{The answer.} Not streaming: C{200} with the C{chat.completion} body, or C{502} with the
error body, each with the C{x-moa-*} headers and a C{Content-Length}. Streaming: the turn's
progress goes out as C{: loopd} comment lines while it runs. The stream opens (C{200},
C{text/event-stream}) at the first worker that answers, with the progress so far; before
that nothing is sent, so a turn whose workers all fail is a C{502} with the error body and
the headers, as for a request that does not stream. A failure after the stream has opened
(every reducer failed, or none gave a usable answer) cannot be a status any more: it is one
C{data: {"error": ...}} event and no C{[DONE]}, as every gateway stream error is (decision
18). A successful answer is the chunks of L{stream_chunks}, each with a real C{choices[0]},
then C{[DONE]}; the headers go with it when the stream had not opened yet (a tool-result
turn, whose reducer is its first call).

A client that goes away cancels the turn, which cancels every upstream call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.server import Request

from loopd.errors import Http
from loopd.gateway.doors.door import Answer, Door, comment_line, data_line, done_line, replay
from loopd.gateway.errors import GatewayError
from loopd.gateway.health import HealthBoard, means_down
from loopd.gateway.metrics import GatewayMetrics
from loopd.gateway.request import GatewayRequest, SessionRef
from loopd.gateway.router import AutoRouter, group_member
from loopd.gateway.upstream import CallKeys, Upstreams
from loopd.gateway.web import Exchange, open_event_stream, write_json
from loopd.llama.retry import is_retryable
from loopd.llama.types import ChatRequest, Completion, FinishReason, Timings, ToolCall
from loopd.moa.engine import MeshTimings, MeshTurn, TurnResult
from loopd.moa.fanout import RateLimited
from loopd.moa.knobs import effective_enable_thinking
from loopd.moa.response import (
    MODEL,
    arguments_wire_string,
    call_id,
    chat_response,
    error_response,
    moa_headers,
    moa_id,
    stream_chunks,
    tool_call_response,
)
from loopd.moa.roles import Worker, build_pool
from loopd.moa.turn import read_turn
from loopd.settings import Config

__all__ = ["MeshExchange", "MeshHost", "mesh_pool", "one_per_group"]

CHILD: Final = "child"
"""The lease tier of every mesh call: the session's own requests go first."""


class MeshHost(Protocol):
    """What a mesh request uses of its gateway."""

    @property
    def reactor(self) -> IReactorTime:
        """Every timer's clock."""

    @property
    def config(self) -> Config:
        """The endpoints and C{[mesh] strong_patience_ms}."""

    @property
    def wall_clock(self) -> Callable[[], float]:
        """The time stamp of answers (C{created}, the ids)."""

    @property
    def metrics(self) -> GatewayMetrics:
        """Where each turn's outcome is counted."""

    @property
    def router(self) -> AutoRouter:
        """Which endpoints take which media."""

    @property
    def upstreams(self) -> Upstreams:
        """The leased upstream calls."""

    @property
    def health(self) -> HealthBoard:
        """Which endpoints are down."""

    @property
    def in_flight(self) -> set[Exchange]:
        """The exchanges under way, so stopping can end them."""


def mesh_pool(host: MeshHost, request: GatewayRequest) -> tuple[Worker, ...]:
    """
    The mesh's workers for C{request} now, at least one: see the module docstring.

    @raise loopd.gateway.router.MediaUnsupportedError: no endpoint takes the media (400).
    @raise loopd.gateway.health.EndpointUnavailableError: every endpoint that takes it is
        down (503).
    """
    takes = {c.name for c in host.router.takes_media(request)}
    workers = [Worker(e.name, e.size_b) for e in host.config.endpoints if e.name in takes]
    pool = build_pool(workers, reachable=host.health.eligible)
    if not pool:
        raise host.health.unavailable((w.name for w in workers), host.reactor.seconds())
    return one_per_group(pool, host.config, request.session.id)


def one_per_group(pool: tuple[Worker, ...], config: Config, session: str) -> tuple[Worker, ...]:
    """
    C{pool} with each endpoint group's members in it down to one, L{group_member}'s pick
    for C{session}; workers in no group stay. The order is C{pool}'s.
    """
    groups = {w.name: config.endpoint(w.name).group for w in pool}
    present: dict[str, list[str]] = {}
    for name, group in groups.items():
        if group is not None:
            present.setdefault(group, []).append(name)
    chosen = {group: group_member(names, session) for group, names in present.items()}
    return tuple(w for w in pool if (g := groups[w.name]) is None or chosen[g] == w.name)


class _MeshCalls:
    """The upstream calls of one mesh turn, for one session (L{UpstreamCall} of the engine)."""

    def __init__(self, host: MeshHost, session: SessionRef) -> None:
        """
        @param host: the gateway.
        @param session: the session the turn's leases and slots are kept for.
        """
        self._host = host
        self._session = session

    def call(self, name: str, request: ChatRequest) -> Deferred[Completion]:
        """Send C{request} to endpoint C{name}; see the module docstring."""
        keys = CallKeys(
            self._session.id,
            CHILD,
            self._session.ends,
            # The slot history is kept per endpoint: a mesh session calls several at once.
            slot_key=f"{self._session.id} mesh:{name}",
            anonymous=self._session.anonymous,
        )
        calling = self._host.upstreams.call(name, request, keys, retryable=_retry_unless_down)
        return calling.addErrback(_rate_limited)


def _retry_unless_down(error: BaseException) -> bool:
    """
    The robust client's retries, but not of a failure that says the endpoint is down: such
    a worker has failed at once (DESIGN decision 29), so the turn does not wait on its
    backoff.
    """
    return not means_down(error) and is_retryable(error)


def _rate_limited(reason: Failure) -> Failure:
    """A call's failure, an HTTP 429 made the fan-out's L{RateLimited}."""
    if isinstance(reason.value, Http) and reason.value.status == 429:
        return Failure(RateLimited(reason.value.retry_after))
    return reason


class MeshExchange:
    """
    One mesh request's way through the gateway; see the module docstring.
    """

    def __init__(
        self,
        host: MeshHost,
        request: Request,
        parsed: GatewayRequest,
        pool: tuple[Worker, ...],
        door: Door | None = None,
    ) -> None:
        """
        @param host: the gateway.
        @param request: the client's request.
        @param parsed: what it asks, read once by the front door.
        @param pool: the workers (at least 2).
        @param door: the front door that writes the answer, for a door other than chat
            completions; C{None} answers in the reference's OpenAI shapes (§1.12).
        """
        self._host = host
        self._door = door
        self._request = request
        self._stream = parsed.stream
        self._streaming = False
        self._finished = False
        self._pending: list[bytes] = []
        now_ns = int(host.wall_clock() * 1e9)
        self._id = moa_id(now_ns)
        self._call_id = call_id(now_ns)
        self._created = int(host.wall_clock())
        self._answer = None if door is None else door.answer(parsed, MODEL, self._created)
        calls = _MeshCalls(host, parsed.session)
        patience = host.config.mesh.strong_patience_ms / 1000.0
        self._turn = MeshTurn(
            host.reactor,
            read_turn(parsed.messages, parsed.tools),
            pool,
            calls.call,
            enable_thinking=effective_enable_thinking(parsed.thinking_override),
            timings=MeshTimings(strong_patience=patience),
            progress=self._progress,
        )
        self._running: Deferred[TurnResult] | None = None

    def start(self) -> None:
        """Run the turn; watch for the client leaving."""
        self._host.in_flight.add(self)
        self._request.notifyFinish().addErrback(self._client_gone)
        running = self._turn.run()
        self._running = running
        running.addCallback(self._ended)

    def shutdown(self) -> None:
        """The daemon is stopping: cancel the turn and answer 503 (or an error event)."""
        if self._finished:
            return
        self._cancel_turn()
        error = GatewayError(503, "loopd is shutting down", "server_error", "shutting_down")
        self._fail(error, [])
        self._host.metrics.observe_request(MODEL, error.code)

    def _fail(self, error: GatewayError, headers: list[tuple[bytes, bytes]]) -> None:
        """Answer C{error} in the door's shape: its error event once streaming, else a status."""
        if self._streaming:
            self._flush()
            self._write(self._stream_error(error))
            self._finish()
        elif self._door is not None:
            self._respond(*self._door.error(error), headers)
        else:
            self._respond(error.status, error.body(), headers)

    def _stream_error(self, error: GatewayError) -> bytes:
        """The error event that ends the stream."""
        if self._answer is not None:
            return self._answer.stream_error(error)
        return data_line(error.body())

    # -- while it runs -------------------------------------------------------------------

    def _progress(self, event: Mapping[str, Any]) -> None:
        """

        One progress event of the turn: a C{: loopd} comment for a streaming client, held back
        until the stream opens at the first worker that answered.
        """
        if not self._stream or self._finished:
            return
        self._pending.append(comment_line(dict(event)))
        if not self._streaming and event.get("event") == "mesh_worker" and event.get("ok"):
            self._open_stream([])
        if self._streaming:
            self._flush()

    def _open_stream(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Open the event stream, with C{headers} when the result is already known."""
        self._streaming = True
        open_event_stream(self._request)
        for name, value in headers:
            self._request.setHeader(name, value)
        if self._answer is not None:
            self._write(self._answer.opening())

    def _flush(self) -> None:
        """Write the progress comments held back so far."""
        pending, self._pending = self._pending, []
        for line in pending:
            self._write(line)

    def _write(self, data: bytes) -> None:
        """Write C{data} to the client."""
        self._request.write(data)

    # -- endings -------------------------------------------------------------------------

    def _ended(self, result: TurnResult) -> None:
        """The turn ended: answer its result, its error, or its tool call, as the client asked."""
        self._running = None
        if self._finished:
            return
        headers = moa_headers(result.report)
        if result.error_code is not None:
            self._host.metrics.observe_request(MODEL, result.error_code)
            if self._door is not None:
                error = GatewayError(502, result.error_message, "server_error", result.error_code)
                self._fail(error, headers)
                return
            body = error_response(
                result.error_message,
                result.error_code,
                completion_id=self._id,
                created=self._created,
            )
            if self._streaming:
                self._flush()
                self._write(data_line({"error": body["error"]}))
                self._finish()
            else:
                self._respond(502, body, headers)
            return
        self._host.metrics.observe_request(MODEL, "ok")
        outcome = result.outcome
        assert outcome is not None
        if self._answer is not None:
            self._answer_through_door(self._answer, result, headers)
            return
        if result.tool_call and outcome.tool_name is not None:
            body = tool_call_response(
                outcome.tool_name,
                outcome.tool_arguments,
                completion_id=self._id,
                call_id=self._call_id,
                created=self._created,
            )
        else:
            body = chat_response(outcome.text, completion_id=self._id, created=self._created)
        if not self._stream:
            self._respond(200, body, headers)
            return
        if not self._streaming:
            self._open_stream(headers)
        self._flush()
        for chunk in stream_chunks(body):
            self._write(data_line(chunk))
        self._write(done_line())
        self._finish()

    def _answer_through_door(
        self, answer: Answer, result: TurnResult, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """
        Answer a turn that went well through the door's L{Answer}: its text, or its tool
        call, as one L{Completion} (a mesh turn has no server counts: they are zero), whole
        as a body or replayed as the stream's events.
        """
        outcome = result.outcome
        assert outcome is not None
        if result.tool_call and outcome.tool_name is not None:
            arguments = arguments_wire_string(outcome.tool_arguments)
            call = ToolCall(self._call_id, outcome.tool_name, arguments)
            completion = Completion(
                self._id, None, None, (call,), FinishReason.TOOL_CALLS, Timings()
            )
        else:
            completion = Completion(self._id, outcome.text, None, (), FinishReason.STOP, Timings())
        if not self._stream:
            self._respond(200, answer.body(completion), headers)
            return
        if not self._streaming:
            self._open_stream(headers)
        self._flush()
        for event in replay(completion):
            self._write(answer.during(event))
        self._write(answer.closing(completion))
        self._finish()

    def _respond(self, status: int, body: object, headers: list[tuple[bytes, bytes]]) -> None:
        """Answer C{body} as JSON with C{status}, the C{x-moa-*} C{headers} and its length."""
        data = write_json(self._request, status, body)
        for name, value in headers:
            self._request.setHeader(name, value)
        self._request.setHeader(b"content-length", b"%d" % len(data))
        self._finish(data)

    def _client_gone(self, reason: Failure) -> None:
        """The client left: count it and cancel the turn."""
        if self._finished:
            return
        self._finished = True
        self._host.in_flight.discard(self)
        self._host.metrics.observe_request(MODEL, "client_gone")
        self._cancel_turn()

    def _cancel_turn(self) -> None:
        """Cancel the running turn, which cancels every call and timer of it."""
        running, self._running = self._running, None
        if running is not None:
            running.addErrback(lambda failure: None)
            running.cancel()

    def _finish(self, body: bytes = b"") -> None:
        """End the response, with C{body} when given."""
        self._finished = True
        self._host.in_flight.discard(self)
        if body:
            self._request.write(body)
        self._request.finish()
