# -*- test-case-name: loopd.test.test_gateway_mesh -*-
"""
One C{model: "mesh"} request through the gateway: the turn (L{loopd.moa.engine.MeshTurn})
over the worker pool, its answer in the OpenAI shapes of reference C{mesh-moa.md} §1.12, the
C{x-moa-*} headers (DESIGN §3 decision 33).

Not streaming: C{200} with the C{chat.completion} body, or C{502} with the error body, each
with the C{x-moa-*} headers and a C{Content-Length}.

Streaming: the turn's progress goes out as C{: loopd} comment lines while it runs. The
stream opens (C{200}, C{text/event-stream}) at the first worker that answers, with the
progress so far; before that nothing is sent, so a turn whose workers all fail is a C{502}
with the error body and the headers, as for a request that does not stream. A failure
after the stream has opened (every reducer failed, or none gave a usable answer) cannot be
a status any more: it is one C{data: {"error": ...}} event and no C{[DONE]}, as every
gateway stream error is (DESIGN decision 18). A successful answer is the chunks of
L{stream_chunks}, each with a real C{choices[0]}, then C{[DONE]}; the headers go with it
when the stream had not opened yet (a tool-result turn, whose reducer is its first call).

A client that goes away cancels the turn, which cancels every upstream call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.server import Request

from loopd.gateway.errors import GatewayError
from loopd.gateway.mesh_calls import MeshCalls
from loopd.gateway.responses import comment_line, data_line, open_event_stream, write_json
from loopd.moa.engine import MeshTimings, MeshTurn, TurnResult
from loopd.moa.knobs import effective_enable_thinking
from loopd.moa.response import (
    MODEL,
    call_id,
    chat_response,
    error_response,
    moa_headers,
    moa_id,
    stream_chunks,
    tool_call_response,
)
from loopd.moa.roles import Worker
from loopd.moa.turn import read_turn

__all__ = ["MeshExchange"]


class MeshExchange:
    """
    One mesh request's way through the gateway; see the module docstring.
    """

    def __init__(
        self,
        gateway: Any,
        request: Request,
        document: Mapping[str, Any],
        pool: tuple[Worker, ...],
        *,
        stream: bool,
        session: str,
        final: bool = False,
    ) -> None:
        """
        @param gateway: the L{loopd.gateway.site.Gateway}.
        @param request: the client's request.
        @param document: its decoded, checked body.
        @param pool: the workers (at least 2).
        @param stream: the client asked for server-sent events.
        @param session: the session the turn's leases are held for.
        @param final: the session said this is its last request.
        """
        self._gateway = gateway
        self._request = request
        self._stream = stream
        self._streaming = False
        self._finished = False
        self._pending: list[bytes] = []
        now_ns = int(gateway.wall_clock() * 1e9)
        self._id = moa_id(now_ns)
        self._call_id = call_id(now_ns)
        self._created = int(gateway.wall_clock())
        calls = MeshCalls(gateway, session, final)
        patience = gateway.config.mesh.strong_patience_ms / 1000.0
        self._turn = MeshTurn(
            gateway.reactor,
            read_turn(document),
            pool,
            calls.call,
            enable_thinking=effective_enable_thinking(document),
            timings=MeshTimings(strong_patience=patience),
            progress=self._progress,
        )
        self._running: Deferred[TurnResult] | None = None

    def start(self) -> None:
        """Run the turn; watch for the client leaving."""
        self._gateway.in_flight.add(self)
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
        if self._streaming:
            self._write(data_line(error.body()))
            self._finish()
        else:
            self._respond(error.status, error.body(), [])
        self._gateway.metrics.observe_request(MODEL, error.code)

    # -- while it runs -------------------------------------------------------------------

    def _progress(self, event: Mapping[str, Any]) -> None:
        if not self._stream or self._finished:
            return
        self._pending.append(comment_line(dict(event)))
        if not self._streaming and event.get("event") == "mesh_worker" and event.get("ok"):
            self._open_stream([])
        if self._streaming:
            self._flush()

    def _open_stream(self, headers: list[tuple[bytes, bytes]]) -> None:
        self._streaming = True
        open_event_stream(self._request)
        for name, value in headers:
            self._request.setHeader(name, value)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for line in pending:
            self._write(line)

    def _write(self, data: bytes) -> None:
        self._request.write(data)

    # -- endings -------------------------------------------------------------------------

    def _ended(self, result: TurnResult) -> None:
        self._running = None
        if self._finished:
            return
        headers = moa_headers(result.report)
        if result.error_code is not None:
            self._gateway.metrics.observe_request(MODEL, result.error_code)
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
        self._gateway.metrics.observe_request(MODEL, "ok")
        outcome = result.outcome
        assert outcome is not None
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
        self._write(b"data: [DONE]\n\n")
        self._finish()

    def _respond(self, status: int, body: object, headers: list[tuple[bytes, bytes]]) -> None:
        data = write_json(self._request, status, body)
        for name, value in headers:
            self._request.setHeader(name, value)
        self._request.setHeader(b"content-length", b"%d" % len(data))
        self._finish(data)

    def _client_gone(self, reason: Failure) -> None:
        if self._finished:
            return
        self._finished = True
        self._gateway.in_flight.discard(self)
        self._gateway.metrics.observe_request(MODEL, "client_gone")
        self._cancel_turn()

    def _cancel_turn(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running.addErrback(lambda failure: None)
            running.cancel()

    def _finish(self, body: bytes = b"") -> None:
        self._finished = True
        self._gateway.in_flight.discard(self)
        if body:
            self._request.write(body)
        self._request.finish()
