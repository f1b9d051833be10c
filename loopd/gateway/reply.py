# -*- test-case-name: loopd.test.test_gateway_reply -*-
"""
An exchange's side toward its client, the same for an endpoint's answer
(L{loopd.gateway.exchange}) and a mesh turn's (L{loopd.gateway.mesh}): where the answer
stands with the client (L{Phase}), the event stream opened once, an error answered by phase
(a status with its JSON body before the stream opened, the door's error event after), the
client going away, and the end, which unregisters the exchange from the daemon's list of
exchanges under way and the backpressure producer from the request.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

from twisted.python.failure import Failure
from twisted.web.server import Request

from loopd.gateway.web import Exchange, open_event_stream, write_json
from loopd.llama import Flow

__all__ = ["Phase", "Reply"]

Headers = Iterable[tuple[bytes, bytes]]


class Phase(enum.Enum):
    """Where an exchange stands with its client."""

    QUIET = "nothing sent yet: an error is still a status"
    STREAMING = "the event stream has started: an error is an event"
    DONE = "the answer is complete, or the client has gone"


class Reply:
    """
    One exchange's answer to its client, by L{Phase}.

    @ivar phase: where the answer stands.
    """

    def __init__(
        self,
        request: Request,
        exchange: Exchange,
        in_flight: set[Exchange],
        flow: Flow | None = None,
        stream_type: bytes = b"text/event-stream",
    ) -> None:
        """
        @param request: the client's request.
        @param exchange: the exchange this reply is for, kept in C{in_flight} until the end.
        @param in_flight: the daemon's exchanges under way, which its stop ends.
        @param flow: the producer registered on C{request} for a streaming answer, whose
            upstream read it paces; unregistered before the end.
        @param stream_type: the content type of the stream, the door's.
        """
        self.phase = Phase.QUIET
        self._request = request
        self._exchange = exchange
        self._in_flight = in_flight
        self._flow = flow
        self._stream_type = stream_type

    @property
    def done(self) -> bool:
        """Whether the answer is complete or the client has gone: nothing more is sent."""
        return self.phase is Phase.DONE

    def watch(self, gone: Callable[[], None]) -> None:
        """
        Count the exchange under way and register the flow; when the client goes away
        before the end, the reply is done and C{gone} is called (to cancel the work).
        """
        self._in_flight.add(self._exchange)
        self._request.notifyFinish().addErrback(self._client_gone, gone)
        if self._flow is not None:
            self._request.registerProducer(self._flow, True)

    def _client_gone(self, reason: Failure, gone: Callable[[], None]) -> None:
        """The client left before the end."""
        if self.phase is Phase.DONE:
            return
        self.phase = Phase.DONE
        self._in_flight.discard(self._exchange)
        gone()

    def open_stream(self, opening: bytes, headers: Headers = ()) -> None:
        """
        Open the event stream, once: C{200}, the stream's headers and C{headers}, sent now,
        then C{opening} (the door's role chunk, C{message_start} ...). Nothing once it is
        open.
        """
        if self.phase is not Phase.QUIET:
            return
        self.phase = Phase.STREAMING
        open_event_stream(self._request, self._stream_type)
        for name, value in headers:
            self._request.setHeader(name, value)
        # Written even when empty: the first write sends the headers, and the stream is open
        # for the client only then (a client that waits for headers gives up on none).
        self._request.write(opening)

    def write(self, data: bytes) -> None:
        """Send C{data} on the open stream (C{b""}: nothing)."""
        if data:
            self._request.write(data)

    def respond(
        self, status: int, body: object, headers: Headers = (), *, with_length: bool = False
    ) -> None:
        """
        End the response with the JSON C{body} and C{status} (L{write_json}) and
        C{headers}; with C{with_length}, its C{Content-Length}.
        """
        data = write_json(self._request, status, body)
        for name, value in headers:
            self._request.setHeader(name, value)
        if with_length:
            self._request.setHeader(b"content-length", b"%d" % len(data))
        self.finish(data)

    def fail(
        self,
        stream_error: Callable[[], bytes],
        status: Callable[[], None],
    ) -> None:
        """
        An error by phase: once streaming, the door's error event (C{stream_error}'s bytes)
        ends the stream; before, C{status} answers it (as L{respond} does). Nothing when
        the reply is done.
        """
        if self.phase is Phase.DONE:
            return
        if self.phase is Phase.STREAMING:
            self.finish(stream_error())
        else:
            status()

    def finish(self, body: bytes = b"") -> None:
        """End the response, with C{body} when given; the producer goes before the end."""
        self.phase = Phase.DONE
        self._in_flight.discard(self._exchange)
        if self._flow is not None:
            self._request.unregisterProducer()
        if body:
            self._request.write(body)
        self._request.finish()
