# -*- test-case-name: loopd.test.test_gateway_mesh -*-
"""
One C{model: "mesh"} request through the gateway (issue 6, DESIGN §3 decisions 28 to 33):
the worker pool from the configured endpoints, the turn (L{loopd.moa.engine.MeshTurn}) over
it with every worker and reducer call a leased upstream call, its answer through the front
door it came in by, and the C{x-moa-*} headers (reference C{mesh-moa.md} §1.12).

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

B{The answer.} The front door the request came through writes it (L{Door.mesh_answer}):
chat completions in the reference's own shapes (L{loopd.gateway.doors.chat_mesh}), Messages
and Responses as any answer of theirs from the model C{mesh}. The turn's answer is one
L{Completion} (its text, or its tool call with the reference's wire arguments; no server
counts), its failure a L{MeshTurnError} (502, the turn's code). Not streaming: the door's
body, or its error body, each with the C{x-moa-*} headers and a C{Content-Length}.
Streaming: the turn's progress goes out as C{: loopd} comment lines while it runs. The stream
opens (C{200}, C{text/event-stream}, the door's opening) at the first worker that answers,
with the progress so far; before that nothing is sent, so a turn whose workers all fail is a
C{502} with the error body and the headers, as for a request that does not stream. A failure
after the stream has opened (every reducer failed, or none gave a usable answer) cannot be a
status any more: it is the door's error event, as every gateway stream error is (decision
18). A successful answer is the completion replayed through the door's answer and its
closing; the headers go with it when the stream had not opened yet (a tool-result turn, whose
reducer is its first call). The client side (phase, opening, error by phase, the end) is
L{loopd.gateway.reply}'s, as for an endpoint's answer.

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
from loopd.gateway.activity import Activity, RequestRecord
from loopd.gateway.cache_report import cache_header, cache_report
from loopd.gateway.doors.chat_mesh import arguments_wire_string
from loopd.gateway.doors.door import EVENT_STREAM, Door, comment_line, replay
from loopd.gateway.errors import GatewayError, MeshTurnError
from loopd.gateway.health import HealthBoard, means_down
from loopd.gateway.metrics import GatewayMetrics
from loopd.gateway.reply import Phase, Reply
from loopd.gateway.request import GatewayRequest, SessionRef
from loopd.gateway.router import AutoRouter, group_member
from loopd.gateway.status_board import StatusBoard
from loopd.gateway.upstream import CallKeys, Upstreams
from loopd.gateway.web import Exchange
from loopd.llama.retry import is_retryable
from loopd.llama.types import ChatRequest, Completion, FinishReason, Timings, ToolCall
from loopd.moa.engine import MeshTimings, MeshTurn, TurnResult
from loopd.moa.fanout import RateLimited
from loopd.moa.knobs import effective_enable_thinking
from loopd.moa.report import call_id, moa_headers, moa_id
from loopd.moa.roles import VIRTUAL_MODEL_NAME as MODEL
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
    def activity(self) -> Activity:
        """Every request's record and who watches them (L{loopd.gateway.activity})."""

    @property
    def board(self) -> StatusBoard:
        """What the gateway kept of its past: the endpoints' measured speeds too."""

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

    def __init__(self, host: MeshHost, session: SessionRef, record: RequestRecord) -> None:
        """
        @param host: the gateway.
        @param session: the session the turn's leases and slots are kept for.
        @param record: the turn's request record, which each call adds its own to.
        """
        self._host = host
        self._session = session
        self._record = record
        #: What the next calls are: C{worker}s until the turn starts its reducer.
        self.role = "worker"

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
        calling = self._host.upstreams.call(
            name,
            request,
            keys,
            retryable=_retry_unless_down,
            record=self._record,
            role=self.role,
        )
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
        door: Door,
        request: Request,
        parsed: GatewayRequest,
        pool: tuple[Worker, ...],
        record: RequestRecord,
    ) -> None:
        """
        @param host: the gateway.
        @param door: the front door the request came through, which writes the answer
            (L{Door.mesh_answer}).
        @param request: the client's request.
        @param parsed: what it asks, read once by the front door.
        @param pool: the workers (at least 2).
        @param record: the request's record (L{loopd.gateway.activity}), ended here.
        """
        self._host = host
        self._record = record
        self._request = request
        self._stream = parsed.stream
        self._stream_type = door.stream_type
        self._reply = Reply(request, self, host.in_flight, stream_type=door.stream_type)
        self._pending: list[bytes] = []
        now_ns = int(host.wall_clock() * 1e9)
        self._id = moa_id(now_ns)
        self._call_id = call_id(now_ns)
        self._answer = door.mesh_answer(parsed, self._id, int(host.wall_clock()))
        calls = self._calls = _MeshCalls(host, parsed.session, record)
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
        self._reply.watch(self._client_gone)
        running = self._turn.run()
        self._running = running
        running.addCallback(self._ended)

    def shutdown(self) -> None:
        """The daemon is stopping: cancel the turn and answer 503 (or an error event)."""
        if self._reply.done:
            return
        self._cancel_turn()
        error = GatewayError(503, "loopd is shutting down", "server_error", "shutting_down")
        self._fail(error, [])
        self._host.metrics.observe_request(MODEL, error.code)
        self._host.activity.end(self._record, self._request.code, error.code, error.message)

    def _fail(self, error: GatewayError, headers: list[tuple[bytes, bytes]]) -> None:
        """
        Answer C{error} in the door's shape: once streaming, the progress held back and
        its error event; else a status with C{headers}.
        """
        answer = self._answer

        def stream_error() -> bytes:
            self._flush()
            return answer.stream_error(error)

        self._reply.fail(
            stream_error,
            lambda: self._reply.respond(*answer.error(error), headers, with_length=True),
        )

    # -- while it runs -------------------------------------------------------------------

    def _progress(self, event: Mapping[str, Any]) -> None:
        """
        One progress event of the turn: a C{: loopd} comment for a streaming client, held back
        until the stream opens at the first worker that answered. The turn says it calls a
        reducer just before it does: the calls from then on are the reducer's.
        """
        if event.get("event") == "mesh_reducer":
            self._calls.role = "reducer"
        if not self._stream or self._reply.done:
            return
        self._pending.append(comment_line(dict(event)))
        if event.get("event") == "mesh_worker" and event.get("ok"):
            self._reply.open_stream(self._answer.opening())
        if self._reply.phase is Phase.STREAMING:
            self._flush()

    def _flush(self) -> None:
        """Write the progress comments held back so far."""
        pending, self._pending = self._pending, []
        for line in pending:
            self._reply.write(line)

    # -- endings -------------------------------------------------------------------------

    def _ended(self, result: TurnResult) -> None:
        """
        The turn ended: answer its failure, or its answer (its text, or its tool call, as
        one L{Completion}: a mesh turn has no server counts, they are zero), whole as a body
        or replayed as the stream's events, with the C{x-moa-*} headers when they can go.
        """
        self._running = None
        if self._reply.done:
            return
        headers = moa_headers(result.report)
        activity = self._host.activity
        if result.error_code is not None:
            self._host.metrics.observe_request(MODEL, result.error_code)
            error = MeshTurnError(result.error_message, result.error_code)
            self._fail(error, headers)
            activity.end(self._record, self._request.code, error.code, error.message)
            return
        self._host.metrics.observe_request(MODEL, "ok")
        completion = self._completion(result)
        answer = self._answer
        report = cache_report(self._record)
        if not self._stream:
            headers.append(cache_header(report))
            self._reply.respond(200, answer.body(completion), headers, with_length=True)
        else:
            self._reply.open_stream(answer.opening(), headers)
            self._flush()
            for event in replay(completion):
                self._reply.write(answer.during(event))
            if self._stream_type == EVENT_STREAM:
                self._reply.write(comment_line({"event": "cache", **report}))
            self._reply.finish(answer.closing(completion))
        activity.end(self._record, 200, "ok", completion=completion)

    def _completion(self, result: TurnResult) -> Completion:
        """The turn's answer as a completion: its tool call, else its text."""
        outcome = result.outcome
        assert outcome is not None
        if result.tool_call and outcome.tool_name is not None:
            arguments = arguments_wire_string(outcome.tool_arguments)
            call = ToolCall(self._call_id, outcome.tool_name, arguments)
            return Completion(self._id, None, None, (call,), FinishReason.TOOL_CALLS, Timings())
        return Completion(self._id, outcome.text, None, (), FinishReason.STOP, Timings())

    def _client_gone(self) -> None:
        """The client left: count it and cancel the turn."""
        self._host.metrics.observe_request(MODEL, "client_gone")
        self._cancel_turn()
        self._host.activity.end(self._record, self._request.code, "client_gone")

    def _cancel_turn(self) -> None:
        """Cancel the running turn, which cancels every call and timer of it."""
        running, self._running = self._running, None
        if running is not None:
            running.addErrback(lambda failure: None)
            running.cancel()
