# -*- test-case-name: loopd.test.test_http -*-
"""
HTTP/1.1 over a Unix socket: one request per connection, size caps, abort.

L{request} connects to a Unix socket, sends one request with C{Connection: close} and fires
with an L{HttpResponse} once the status line and the headers have arrived. The body is then
streamed (L{HttpResponse.deliver}) or collected under a cap (L{HttpResponse.read_body}), and
the connection closes when the response ends. No pooling, no redirects, no content coding.
It is Twisted's C{HTTP11ClientProtocol} over a C{UNIXClientEndpoint}, without an C{Agent}: the
protocol is subclassed to count header bytes, which Twisted limits per line only (16 KiB).

Requests carry C{Host: llama} (llama-server ignores it), C{Connection: close}, C{Content-Type:
application/json} when there is a body (a caller's C{Content-Type} replaces it) and
C{Content-Length} for a body (C{0} for a body-less POST or PUT, none for a body-less GET).

Caps (L{HttpCaps}), each a L{loopd.errors.Protocol} error when exceeded:
 - the header block: every byte from the first byte of the response up to and including the
   empty line that ends its headers (interim 1xx responses included). C{header_bytes} bytes
   exactly are accepted; one more and the connection is aborted.
 - a body that is not a stream (L{HttpResponse.read_body}): more than C{body_bytes} bytes, or
   a C{Content-Length} above it, aborts the connection.

Failures: L{loopd.errors.Connect} when the socket is missing, refuses, or the connection
is not made within C{connect_timeout} seconds (its C{reason} names the kind of failure, its
C{path} the socket); L{loopd.errors.ProxyRefused} when an inferproxy refused the connection
at one of its limits (a 503 carrying C{X-Inferproxy-Refused}, whose body is not read: the
connection is closed at once); L{loopd.errors.StreamClosedEarly} when
the connection closes before the header block is complete or cuts a body whose end is framed
(chunked or C{Content-Length}); L{loopd.errors.Protocol} for a cap or anything that does
not parse. A body without framing ends at the close of the connection: a clean close is a
clean end, a reset is C{StreamClosedEarly}.

Cancelling the L{request} Deferred, or L{HttpResponse.abort}, aborts the connection at once,
which is what makes llama-server stop generating; the pending Deferred fails with
C{CancelledError}. A response's body must be consumed (C{deliver}, C{read_body}) or the
response aborted: until then the connection is paused and stays open. The connect timeout
is a timer of the injected reactor, not the connector's (which a C{MemoryReactorClock} never
runs), so C{task.Clock} drives it.

Two optional callbacks follow the connection itself: C{on_connected} when it is made (the
request goes out then), C{on_closed} once when it is gone, or when none was made. The
llama client's pacing (L{loopd.llama.pacing}) counts its open connections with them. An
L{Opener} is L{request} bound to one socket; L{opener} makes the plain one.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from typing import Protocol as _TypingProtocol

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import (
    ConnectError,
    ConnectingCancelledError,
    ConnectionClosed,
    ConnectionDone,
    ConnectionRefusedError,
)
from twisted.internet.interfaces import IConsumer, IDelayedCall, IReactorTime, IReactorUNIX
from twisted.internet.protocol import Factory, connectionDone
from twisted.internet.protocol import Protocol as _TwistedProtocol
from twisted.python.failure import Failure
from twisted.web._newclient import (
    HTTP11ClientProtocol,
    Request,
    RequestGenerationFailed,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from zope.interface import implementer

from loopd.errors import Connect, InferError, Protocol, ProxyRefused, StreamClosedEarly

__all__ = ["HOST", "HttpCaps", "HttpResponse", "Opener", "opener", "request"]

#: How Twisted's log lines name loopd's HTTP client (the C{logPrefix} of its protocols and
#: factories), instead of a private class name.
LOG_PREFIX = "loopd.http"

#: The Host header every request carries; llama-server does not look at it.
HOST = "llama"

# Headers this module owns: the caller may not set them.
_RESERVED = frozenset({"host", "connection", "content-length", "transfer-encoding"})


@dataclass(frozen=True)
class HttpCaps:
    """
    Size caps of one exchange; exceeding one is L{loopd.errors.Protocol}.

    @ivar header_bytes: the header block, status line to the empty line, in bytes.
    @ivar body_bytes: a body read whole with L{HttpResponse.read_body}, in bytes.
    """

    header_bytes: int = 16384
    body_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        """@raise ValueError: a cap that is zero or negative."""
        if self.header_bytes <= 0 or self.body_bytes <= 0:
            raise ValueError(f"caps must be positive: {self!r}")


def request(
    reactor: IReactorUNIX,
    socket_path: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    *,
    caps: HttpCaps = HttpCaps(),
    connect_timeout: float = 5.0,
    on_connected: Callable[[], None] | None = None,
    on_closed: Callable[[], None] | None = None,
) -> Deferred[HttpResponse]:
    """
    Send one request over a new connection to the Unix socket C{socket_path}.

    @param reactor: provides C{connectUNIX} and C{callLater}.
    @param path: the request target, starting with C{/}.
    @param body: the request body (sent as JSON), or C{None}.
    @param headers: extra headers; C{Host}, C{Connection}, C{Content-Length} and
        C{Transfer-Encoding} are this module's and refused.
    @param on_connected: called when the connection is made, as the request goes out.
    @param on_closed: called once, when the connection has closed or could not be made.
    @return: fires with the L{HttpResponse} once its headers are in; fails with C{Connect},
        C{ProxyRefused}, C{StreamClosedEarly} or C{Protocol} (see the module docstring) or,
        when cancelled, with C{CancelledError}.
    @raise ValueError: for a target not starting with C{/}, a reserved header or a
        non-positive C{connect_timeout}.
    """
    if connect_timeout <= 0:
        raise ValueError(f"connect_timeout must be positive (got {connect_timeout})")
    built = _build_request(method, path, body, headers or {})
    exchange = _Exchange(reactor, socket_path, built, caps, connect_timeout)
    return exchange.start(on_connected, on_closed)


class Opener(_TypingProtocol):
    """
    L{request} bound to one socket (and reactor): what the llama client opens its exchanges
    with, paced or not.
    """

    def __call__(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        caps: HttpCaps = ...,
        connect_timeout: float = ...,
        on_connected: Callable[[], None] | None = None,
    ) -> Deferred[HttpResponse]:
        """
        Send one request as L{request} does, to the bound socket.
        """


def opener(reactor: IReactorUNIX, socket_path: str) -> Opener:
    """
    The plain L{Opener} of C{socket_path}: every call is a L{request}, unpaced.
    """
    return functools.partial(request, reactor, socket_path)


class HttpResponse:
    """
    A response whose status line and headers have arrived; its body is still on the wire.

    @ivar status: the status code.
    @ivar headers: every header, names in lower case; a repeated header keeps its last value.
    """

    def __init__(
        self, protocol: _CappedClientProtocol, response: IResponse, caps: HttpCaps
    ) -> None:
        """Wrap Twisted's C{response}; the connection stays paused until the body is read."""
        self.status: int = response.code
        self.headers: dict[str, str] = protocol.header_dict(response)
        self._protocol = protocol
        self._response = response
        self._caps = caps
        self._receiver: _BodyReceiver | None = None
        self._aborted = False
        self._paused = False

    def deliver(self, on_data: Callable[[bytes], None]) -> Deferred[None]:
        """
        Stream the body: C{on_data} gets each piece as it arrives, in order.

        @return: fires when the body ended cleanly (the chunked terminator, C{Content-Length}
            bytes, or a clean close for a body without framing); fails with
            C{StreamClosedEarly} when the body is cut, C{Protocol} when its framing is broken,
            C{CancelledError} after L{abort}, or whatever C{on_data} raised (the connection
            is then aborted).
        @raise RuntimeError: when the body was already asked for.
        """
        if self._receiver is not None:
            raise RuntimeError("the body of a response can be read only once")
        receiver = _BodyReceiver(on_data, self._protocol)
        self._receiver = receiver
        if self._aborted:
            receiver.fail(Failure(CancelledError()))
            return receiver.finished
        self._response.deliverBody(receiver)
        if self._paused and not receiver.done:
            # deliverBody resumed the transport that the parser had paused after the headers.
            self._protocol.producer().pauseProducing()
        return receiver.finished

    def read_body(self, limit: int | None = None) -> Deferred[bytes]:
        """
        Read the whole body, at most C{limit} bytes (default: the C{body_bytes} cap).

        @return: fires with the body; fails as L{deliver} does, and with C{Protocol} (the
            connection aborted) when the body is longer than C{limit}.
        """
        cap = self._caps.body_bytes if limit is None else limit
        declared = self._response.length
        if isinstance(declared, int) and declared > cap and self._receiver is None:
            self._receiver = _BodyReceiver(lambda data: None, self._protocol)
            self._receiver.fail(Failure(Protocol(f"response body of {declared} bytes over {cap}")))
            return self._receiver.finished.addCallback(lambda _: b"")
        pieces: list[bytes] = []
        received = 0

        def collect(data: bytes) -> None:
            """
            Keep one piece; one byte past the cap raises L{Protocol}, which aborts the connection.
            """
            nonlocal received
            received += len(data)
            if received > cap:
                raise Protocol(f"response body over {cap} bytes")
            pieces.append(data)

        return self.deliver(collect).addCallback(lambda _: b"".join(pieces))

    def abort(self) -> None:
        """
        Close the connection now. A pending L{deliver} or L{read_body} fails with
        C{CancelledError}; later calls do too. Calling it again does nothing.
        """
        if self._aborted:
            return
        self._aborted = True
        if self._receiver is not None:
            self._receiver.fail(Failure(CancelledError()))
        self._protocol.abort_connection()

    def pause(self) -> None:
        """
        Stop reading from the socket until L{resume}: backpressure for a slow consumer.
        Pieces already read may still be delivered.
        """
        self._paused = True
        if self._receiving():
            self._protocol.producer().pauseProducing()

    def resume(self) -> None:
        """Read from the socket again after L{pause}."""
        self._paused = False
        if self._receiving():
            self._protocol.producer().resumeProducing()

    def _receiving(self) -> bool:
        """Whether the body is being delivered: the only time pausing means anything."""
        return self._receiver is not None and not self._receiver.done and not self._aborted


def _build_request(method: str, path: str, body: bytes | None, extra: Mapping[str, str]) -> Request:
    """The Twisted request for these inputs, with this module's headers."""
    if not path.startswith("/"):
        raise ValueError(f"request target must start with '/' (got {path!r})")
    headers = Headers()
    headers.setRawHeaders(b"Host", [HOST.encode("ascii")])
    if body is not None:
        headers.setRawHeaders(b"Content-Type", [b"application/json"])
    for name, value in extra.items():
        if name.lower() in _RESERVED:
            raise ValueError(f"header {name!r} is set by loopd.http")
        headers.setRawHeaders(name.encode("latin-1"), [value.encode("latin-1")])
    producer = None if body is None else _BytesProducer(body)
    return Request(method.encode("ascii"), path.encode("ascii"), headers, producer, False)


@implementer(IBodyProducer)
class _BytesProducer:
    """
    A request body held in memory, written in one go (Twisted's C{FileBodySender} would use
    the global cooperator, hence the global reactor).
    """

    def __init__(self, body: bytes) -> None:
        """Hold C{body}; its length is the request's C{Content-Length}."""
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        """Write the whole body to C{consumer}; done at once."""
        consumer.write(self._body)
        return succeed(None)

    def stopProducing(self) -> None:
        """Nothing to do: the whole body is written by C{startProducing}."""

    pauseProducing = resumeProducing = stopProducing


class _CappedClientProtocol(HTTP11ClientProtocol):
    """
    C{HTTP11ClientProtocol} with a cap on the whole header block and an immediate abort.

    Until the response Deferred fires, received bytes go to the parser one line at a time
    and are counted; once more than the cap has arrived the connection is aborted and the
    request fails with C{Protocol}. After that, bytes pass through untouched.
    """

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, caps: HttpCaps, on_lost: Callable[[], None] = lambda: None) -> None:
        """
        @param caps: its C{header_bytes} caps the header block (L{HttpResponse} caps bodies).
        @param on_lost: called when the connection is lost.
        """
        super().__init__()
        self._on_lost = on_lost
        self._cap = caps.header_bytes
        self._head_bytes = 0
        self._head_over = False
        self._aborted = False
        self._head_parser: Any = None  # the parser, kept for its connection headers
        self.close_reason: Failure | None = None

    def request(self, request: Request) -> Deferred[IResponse]:
        """Issue C{request}, noting when its response Deferred fires."""
        d = super().request(request)
        if self._parser is not None:
            self._head_parser = self._parser
            # Never let Twisted's per-line limit speak before the total cap does.
            self._parser.MAX_LENGTH = max(self._parser.MAX_LENGTH, self._cap)
        return d.addBoth(self._note_head_over)

    def _note_head_over(self, result: Any) -> Any:
        """
        The response Deferred fired, with headers or a failure: count no more header bytes.
        Passes C{result} on.
        """
        self._head_over = True
        return result

    def dataReceived(self, data: bytes) -> None:
        """Count header bytes line by line, then hand everything to the parser."""
        if self._stopped():
            return
        while data and not self._head_over:
            end = data.find(b"\n") + 1 or len(data)
            self._head_bytes += end
            if self._head_bytes > self._cap:
                self._refuse_head()
                return
            super().dataReceived(data[:end])
            data = data[end:]
            if self._stopped():
                return
        if data:
            super().dataReceived(data)

    def _stopped(self) -> bool:
        """Whether received bytes are to be dropped: aborted, or the response is over."""
        return self._aborted or self._parser is None

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """
        Keep the reason, which tells a clean close from a reset, let Twisted handle it, then
        say the connection is gone.
        """
        self.close_reason = reason
        try:
            super().connectionLost(reason)
        finally:
            self._on_lost()

    def _refuse_head(self) -> None:
        """Abort: the header block is over the cap."""
        self.abort_connection()
        error = Protocol(f"response header block over {self._cap} bytes")
        self._disconnectParser(Failure(error))

    def abort_connection(self) -> None:
        """Close the connection now, dropping whatever else arrives."""
        if not self._aborted:
            self._aborted = True
            self.producer().abortConnection()

    def producer(self) -> Any:
        """The real transport: pause, resume and abort act on the socket itself."""
        return self.transport

    def header_dict(self, response: IResponse) -> dict[str, str]:
        """All headers of C{response}, Twisted's connection-control ones included."""
        found: dict[str, str] = {}
        sources = [response.headers]
        if self._head_parser is not None:
            sources.append(self._head_parser.connHeaders)
        for source in sources:
            for name, values in source.getAllRawHeaders():
                found[name.decode("latin-1").lower()] = values[-1].decode("latin-1")
        return found


class _ClientFactory(Factory):
    """Builds one L{_CappedClientProtocol}."""

    noisy = False

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, caps: HttpCaps, on_lost: Callable[[], None]) -> None:
        """
        @param caps: the caps of the exchange.
        @param on_lost: called when the protocol's connection is lost.
        """
        self._caps = caps
        self._on_lost = on_lost

    def buildProtocol(self, addr: Any) -> _CappedClientProtocol:
        """The one protocol of the exchange, capped by C{caps}."""
        protocol = _CappedClientProtocol(self._caps, self._on_lost)
        protocol.factory = self
        return protocol


class _Exchange:
    """One request from connect to response headers; owns the connect timer and cancellation."""

    def __init__(
        self, reactor: IReactorUNIX, path: str, built: Request, caps: HttpCaps, timeout: float
    ) -> None:
        """
        @param path: the Unix socket to connect to.
        @param built: the request to send once connected.
        @param caps: the size caps of the exchange.
        @param timeout: seconds for the connection to be made.
        """
        self._reactor, self._path, self._request = reactor, path, built
        self._caps, self._timeout = caps, timeout
        self._result: Deferred[HttpResponse] = Deferred(self._cancel)
        self._pending: Deferred[Any] | None = None
        self._timer: IDelayedCall | None = None
        self._timed_out = False
        self._on_connected: Callable[[], None] | None = None
        self._on_closed: Callable[[], None] | None = None

    def start(
        self,
        on_connected: Callable[[], None] | None = None,
        on_closed: Callable[[], None] | None = None,
    ) -> Deferred[HttpResponse]:
        """
        Connect, and send the request once connected.

        @param on_connected: called when the connection is made.
        @param on_closed: called once the connection is gone, or was never made.
        """
        self._on_connected, self._on_closed = on_connected, on_closed
        # timeout=None: the timer below is the one that counts (see the module docstring).
        endpoint = UNIXClientEndpoint(self._reactor, self._path, timeout=None)
        self._timer = IReactorTime(self._reactor).callLater(self._timeout, self._time_out)
        connecting = endpoint.connect(_ClientFactory(self._caps, self._closed))
        self._pending = connecting
        connecting.addCallbacks(self._connected, self._connect_failed)
        return self._result

    def _closed(self) -> None:
        """The connection is gone (or was never made): say so, once."""
        on_closed, self._on_closed = self._on_closed, None
        if on_closed is not None:
            on_closed()

    def _time_out(self) -> None:
        """
        The connection was not made in time: cancel the connect, which
        L{_connect_failed} turns into L{Connect}.
        """
        self._timer = None
        self._timed_out = True
        if self._pending is not None:
            self._pending.cancel()

    def _stop_timer(self) -> None:
        """Cancel the connect timer, if it is pending."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _connected(self, protocol: _CappedClientProtocol) -> None:
        """
        Connected: stop the connect timer and send the request, its headers awaited from now
        on without a time limit. A connection made after the result fired is aborted.
        """
        self._stop_timer()
        if self._result.called:
            protocol.abort_connection()
            return
        if self._on_connected is not None:
            self._on_connected()
        answer = protocol.request(self._request)
        self._pending = answer
        answer.addCallbacks(
            lambda response: self._answered(protocol, response), self._request_failed
        )

    def _connect_failed(self, failure: Failure) -> None:
        """
        No connection: L{Connect} when the timer expired or the socket is missing or refuses,
        C{CancelledError} when the caller cancelled.
        """
        self._stop_timer()
        self._closed()
        if self._result.called:
            return
        if self._timed_out:
            error: Exception = Connect(f"not connected within {self._timeout:g} s", path=self._path)
        elif failure.check(ConnectingCancelledError, CancelledError):
            error = CancelledError()
        else:
            error = Connect(_connect_failure(failure), path=self._path)
        self._result.errback(Failure(error))

    def _answered(self, protocol: _CappedClientProtocol, response: IResponse) -> None:
        """
        The headers are in: fire the result with the L{HttpResponse}, or abort the connection
        if the result has fired already.
        """
        if self._result.called:
            protocol.abort_connection()
            return
        if response.code == 503 and response.headers.hasHeader(ProxyRefused.HEADER):
            refused = _refusal(protocol.header_dict(response))
            protocol.abort_connection()
            self._result.errback(Failure(refused))
            return
        self._result.callback(HttpResponse(protocol, response, self._caps))

    def _request_failed(self, failure: Failure) -> None:
        """
        The request failed before the headers were complete: fail the result with the failure
        as loopd's (L{_translate}).
        """
        if not self._result.called:
            self._result.errback(_translate(failure, _BEFORE))

    def _cancel(self, result: Deferred[HttpResponse]) -> None:
        """
        The canceller of the result: cancel the step in progress, connecting or waiting for the
        headers.
        """
        # Cancelling the pending step fires the result through the handlers above: a
        # cancelled connect stops connecting, a cancelled request aborts its connection.
        if self._pending is not None:
            self._pending.cancel()


class _BodyReceiver(_TwistedProtocol):
    """Receives a response body for L{HttpResponse.deliver} and fires C{finished} once."""

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, on_data: Callable[[bytes], None], owner: _CappedClientProtocol) -> None:
        """
        @param on_data: gets each piece of the body.
        @param owner: the protocol whose connection is aborted on failure, and whose close
            reason tells a clean end of an unframed body from a cut one.
        """
        self._on_data = on_data
        self._owner = owner
        self.finished: Deferred[None] = Deferred()
        self.done = False

    def dataReceived(self, data: bytes) -> None:
        """Pass a piece on; if the consumer raises, abort and fail with its exception."""
        if self.done:
            return
        try:
            self._on_data(data)
        except Exception:
            self.fail(Failure())

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """The body ended; decide whether it ended cleanly."""
        if self.done:
            return
        self.done = True
        if reason.check(ResponseDone):
            self.finished.callback(None)
        elif reason.check(PotentialDataLoss):
            # No framing: only a clean close of the connection is a clean end.
            closed = self._owner.close_reason
            if closed is None or closed.check(ConnectionDone):
                self.finished.callback(None)
            else:
                self.finished.errback(_translate(closed, "during the body"))
        else:
            self.finished.errback(_translate(reason, "during the body"))

    def fail(self, reason: Failure) -> None:
        """End now with C{reason}, aborting the connection."""
        if self.done:
            return
        self.done = True
        self._owner.abort_connection()
        self.finished.errback(reason)


#: The kinds of connect failure by errno, as a client may be told them: no path in them.
_CONNECT_KINDS = {
    errno.ENOENT: "no socket (nothing is serving it)",
    errno.ECONNREFUSED: "connection refused (nothing is listening on the socket)",
    errno.EACCES: "permission denied",
    errno.EAGAIN: "the socket's backlog is full",
    errno.ENOTSOCK: "not a socket",
    errno.ENOTDIR: "no socket (a path component is not a directory)",
}


def _connect_failure(failure: Failure) -> str:
    """
    The kind of a connect failure in a few words that name no path: by errno where Twisted
    kept it, else the OS's own text.
    """
    value = failure.value
    code = value.osError if isinstance(value, ConnectError) else None
    if isinstance(code, int) and code in _CONNECT_KINDS:
        return _CONNECT_KINDS[code]
    if isinstance(code, int):
        return os.strerror(code).lower()
    if isinstance(value, ConnectionRefusedError):
        return _CONNECT_KINDS[errno.ECONNREFUSED]
    if isinstance(value, ConnectionClosed):
        return "the connection was lost while it was being made"
    return "connection failed"


def _refusal(headers: Mapping[str, str]) -> ProxyRefused:
    """
    The L{ProxyRefused} that an inferproxy's refusal headers describe: the limit it names (a
    name loopd does not know is kept as C{"unknown"}) and its C{Retry-After}.
    """
    named = headers.get(ProxyRefused.HEADER.lower(), "").strip()
    known = (ProxyRefused.CONNECTIONS, ProxyRefused.ACCEPT_RATE)
    limit = named if named in known else "unknown"
    retry_after: float | None
    try:
        retry_after = float(headers.get("retry-after", ""))
    except ValueError:
        retry_after = None
    if retry_after is not None and not 0 <= retry_after < 86400:
        retry_after = None
    return ProxyRefused(limit, retry_after)


def _leaves(failure: Failure) -> list[Failure]:
    """The failures inside Twisted's wrapper exceptions, depth first."""
    wrapped = failure.value
    if isinstance(wrapped, (ResponseFailed, RequestTransmissionFailed, RequestGenerationFailed)):
        return [leaf for reason in wrapped.reasons for leaf in _leaves(reason)]
    return [failure]


_BEFORE: Final = "before the response headers"
"""When a failure came, for one that came before the response's headers were in."""


def _translate(failure: Failure, when: str) -> Failure:
    """A Twisted client failure as loopd's: an C{InferError} kind or C{CancelledError}."""
    leaves = _leaves(failure)
    for leaf in leaves:
        if leaf.check(InferError):
            return leaf
    if any(leaf.check(CancelledError) for leaf in leaves):
        return Failure(CancelledError())
    if any(leaf.check(ConnectionClosed) for leaf in leaves):
        closed = StreamClosedEarly(f"connection closed {when}", before_headers=when == _BEFORE)
        return Failure(closed)
    return Failure(Protocol(f"malformed response {when}: {leaves[0].getErrorMessage()}"))
