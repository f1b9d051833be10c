# -*- test-case-name: loopd.test.test_gateway_channel -*-
"""
The gateway's HTTP connection, hardened against careless and hostile clients:
L{GatewayChannel} (a twisted.web C{HTTPChannel}, through the private names that
L{loopd.gateway.web_internals} lists) and the L{GatewaySite} that makes it.

What twisted.web leaves open and the channel closes:
 - every protocol-level refusal is one JSON error in the shape of the front door the
   request's path belongs to (OpenAI's, or Anthropic's under C{/v1/messages}) (400; 431 for a
   header line or block too large; 413 as soon as a body's declared or received length
   passes C{[server] body_bytes}; 408 past a deadline), then the connection closes;
 - a header block has C{header_timeout_ms} from its first byte, and a body must keep a rate
   floor (C{body_min_bytes_per_s} over each C{body_timeout_ms} window);
 - a client that pipelines requests and does not read its answers is not read from either
   while the transport holds a full buffer of unsent answers, so what loopd holds for one
   connection stays bounded (twisted.web goes on parsing and answering);
 - C{Transfer-Encoding} other than C{chunked}, and both C{Transfer-Encoding} and
   C{Content-Length}, are refused (request smuggling), and a C{Content-Length} of any number
   of digits is read without Python's integer-digits limit;
 - a listener keeps at most C{max_connections} open; a newer connection is answered 503.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

from twisted.internet.interfaces import IDelayedCall, ITCPTransport
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from loopd.gateway.errors import GatewayError
from loopd.gateway.web import write_json
from loopd.gateway.web_internals import ChunkedTransferDecoder, IdentityTransferDecoder
from loopd.settings import Server

__all__ = [
    "ErrorShape",
    "GatewayChannel",
    "GatewayWebRequest",
    "GatewaySite",
    "error_response",
    "origin_form",
]

#: How Twisted's log lines name the gateway's HTTP listener (the C{logPrefix} of its protocols and
#: factories), instead of a private class name.
LOG_PREFIX = "loopd.gateway"

_DIGITS = re.compile(rb"[0-9]+")
#: Reason phrases twisted.web's table lacks.
_REASONS = {431: b"Request Header Fields Too Large"}


ErrorShape = Callable[[GatewayError], tuple[int, Any]]
"""A front door's error answer: the status and JSON body of a L{GatewayError}."""


def _openai_shape(error: GatewayError) -> tuple[int, Any]:
    """OpenAI's error answer, the gateway's default: C{{"error": {"message", "type", "code"}}}."""
    return error.status, error.body()


def error_response(error: GatewayError, shape: ErrorShape = _openai_shape) -> bytes:
    """
    A whole HTTP/1.1 response carrying C{error} in a front door's error C{shape} (OpenAI's
    unless told), which closes the connection.
    """
    status, document = shape(error)
    body = json.dumps(document, separators=(",", ":")).encode()
    reason = _REASONS.get(status) or RESPONSES.get(status, b"Error")
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
    )


def origin_form(target: bytes) -> bytes:
    """
    A request target as the path and query the routes read: an absolute-form target
    (C{http://host/v1/models?x}, RFC 9112 §3.2.2, which a server must accept and a proxy
    sends) as its path and query (C{/}: none), any other target as it is.
    """
    scheme, found, rest = target.partition(b"://")
    if not found or scheme.lower() not in (b"http", b"https") or b"/" in scheme:
        return target
    slash = rest.find(b"/")
    query = rest.find(b"?")
    if slash < 0 or 0 <= query < slash:
        return b"/" + (rest[query:] if query >= 0 else b"")
    return rest[slash:]


class GatewayWebRequest(Request):
    """
    A request of the gateway's site: its target in origin form (L{origin_form}), and the
    asterisk-form target C{*}, which only C{OPTIONS} may use (RFC 9112 §3.2.4), a JSON 400
    for any other method instead of twisted.web's empty 405.
    """

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        """Take the request with its target in origin form."""
        super().requestReceived(command, origin_form(path), version)

    def process(self) -> None:
        """Refuse C{*} but for C{OPTIONS}; else route as twisted.web does."""
        if self.path == b"*" and self.method != b"OPTIONS":
            error = GatewayError(
                400,
                f"the request target * is for OPTIONS only, not {self.method.decode('latin-1')}",
                "invalid_request_error",
                "bad_request_target",
            )
            body = write_json(self, *_openai_shape(error))
            self.setHeader(b"content-length", b"%d" % len(body))
            self.write(body)
            self.finish()
            return
        super().process()


def _bad_request(message: str) -> GatewayError:
    """A 400 for a request that is not well-formed HTTP."""
    return GatewayError(400, message, "invalid_request_error", "bad_request")


class GatewayChannel(HTTPChannel):
    """
    One client connection of the gateway: twisted.web's HTTP/1.1 parsing with the refusals,
    deadlines and bounds the module docstring lists. Every timer comes from the site's
    reactor (C{callLater}, set by the factory).
    """

    site: GatewaySite
    _refused = False
    #: The path of the request being read, once its request line is in.
    _request_path: bytes | None = None
    _header_call: IDelayedCall | None = None
    _header_started = False
    #: Whether a request on this connection showed the listener's token (always, on a
    #: listener that asks none): such a connection is never closed to make room for another.
    shown_token = False
    #: Whether a request was answered on this connection (after one, silence is keep-alive).
    _answered = False
    _body_call: IDelayedCall | None = None
    _body_received = 0
    _window_start = 0
    _held = False
    _parsing = "the request line"

    # --- refusals ---

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def _refuse(self, error: GatewayError) -> bool:
        """
        Answer C{error}, stop reading and close (forcibly after C{abortTimeout} if the
        client does not take the answer). Returns C{False}, the "stop" of header parsing.
        """
        if self._refused:
            return False
        self._refused = True
        self._cancel_timers()
        self.site.on_refusal(error)
        assert self.transport is not None
        self.transport.write(error_response(error, self.site.shape_for(self._request_path)))
        self.loseConnection()
        if self.abortTimeout is not None and self._abortingCall is None:
            self._abortingCall = self.callLater(self.abortTimeout, self.forceAbortClient)
        return False

    def timeoutConnection(self) -> None:
        """
        The connection stayed idle past the site's timeout: close it as twisted.web does
        (forcibly after C{abortTimeout}), without twisted.web's "Timing out client" line.
        Agents leave idle keep-alive connections open as a matter of course (Claude Code's
        C{HEAD /} probe leaves one), so that line said nothing worth a log.
        """
        if self.abortTimeout is not None and self._abortingCall is None:
            self._abortingCall = self.callLater(self.abortTimeout, self.forceAbortClient)
        self.loseConnection()

    def _respondToBadRequestAndDisconnect(self) -> None:
        """Every refusal twisted.web itself detects: a JSON 400 instead of a bare one."""
        self._refuse(_bad_request(f"malformed HTTP: {self._parsing} is not valid"))

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request or header line past C{MAX_LENGTH}: 431."""
        self._refuse(self._header_too_large(f"a header line is over {self.MAX_LENGTH} bytes"))

    def _header_too_large(self, message: str) -> GatewayError:
        """A 431 with C{message}."""
        return GatewayError(431, message, "invalid_request_error", "header_too_large")

    def _too_large(self) -> GatewayError:
        """The 413 of a body over C{body_bytes}."""
        cap = self.site.server.body_bytes
        return GatewayError(
            413, f"request body over {cap} bytes", "invalid_request_error", "too_large"
        )

    # --- input ---

    def dataReceived(self, data: bytes) -> None:
        """
        Read nothing after a refusal; start the header deadline at a request's first byte
        (the first request's runs from the accept, L{connectionMade}).
        """
        if self._refused:
            return
        if self.line_mode and not self._handlingRequest and self._header_call is None:
            self._arm_header_deadline()
        super().dataReceived(data)

    def _arm_header_deadline(self) -> None:
        """The header block has C{header_timeout_ms} from now."""
        timeout = self.site.server.header_timeout_ms / 1000
        self._header_call = self.callLater(timeout, self._header_deadline)

    def lineReceived(self, line: bytes) -> None:
        """
        Refuse a header block past C{totalHeadersSize} with 431; else parse the line, and
        note the request's path once its request line is read, so that a refusal of its
        headers or body answers in the error shape of the front door it was for.
        """
        if self._refused:
            return
        if line:
            self._header_started = True
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._refuse(
                self._header_too_large(f"the header block is over {self.totalHeadersSize} bytes")
            )
            return
        super().lineReceived(line)
        path = getattr(self, "_path", None)
        if isinstance(path, bytes):
            self._request_path = path

    def headerReceived(self, line: bytes) -> bool:
        """Refuse a header past C{maxHeaders} with 431; else parse it."""
        if self._refused:
            return False
        if self._receivedHeaderCount >= self.maxHeaders:
            return self._refuse(self._header_too_large(f"over {self.maxHeaders} header lines"))
        self._parsing = "a header line"
        try:
            accepted: bool = super().headerReceived(line)
        finally:
            self._parsing = "the request line"
        return accepted

    def _maybeChooseTransferDecoder(self, header: bytes, data: bytes) -> bool:
        """
        Choose the body's decoder from C{Content-Length} or C{Transfer-Encoding: chunked};
        refuse any other coding, both headers, either twice, a length that is not digits
        (400) and one over C{body_bytes} (413), without converting a huge digit string.
        """
        if header == b"Content-Length":
            if not _DIGITS.fullmatch(data):
                return self._refuse(_bad_request("Content-Length is not a number"))
            if self._transferDecoder is not None:
                return self._refuse(
                    _bad_request("more than one Content-Length or Transfer-Encoding")
                )
            digits = data.lstrip(b"0") or b"0"
            cap = self.site.server.body_bytes
            if len(digits) > len(str(cap)) or int(digits) > cap:
                return self._refuse(self._too_large())
            self.length = int(digits)
            self._transferDecoder = IdentityTransferDecoder(
                self.length, self._body_chunk, self._finishRequestBody
            )
            return True
        if header == b"Transfer-Encoding":
            if data.lower() != b"chunked":
                coding = data.decode("latin-1")
                return self._refuse(_bad_request(f"Transfer-Encoding {coding!r} is not supported"))
            if self._transferDecoder is not None:
                return self._refuse(
                    _bad_request("more than one Content-Length or Transfer-Encoding")
                )
            self.length = None
            self._transferDecoder = ChunkedTransferDecoder(
                self._body_chunk, self._finishRequestBody
            )
            return True
        return True

    def allHeadersReceived(self) -> None:
        """End the header deadline; a body starts its first rate window."""
        self._cancel_header_deadline()
        super().allHeadersReceived()
        if self.length != 0 and not self._refused:
            self._body_received = self._window_start = 0
            self._body_call = self.callLater(self._window(), self._body_window_ended)

    def _body_chunk(self, data: bytes) -> None:
        """Count body bytes; refuse past C{body_bytes}, else hand them to the request."""
        if self._refused:
            return
        self._body_received += len(data)
        if self._body_received > self.site.server.body_bytes:
            self._refuse(self._too_large())
            return
        self.requests[-1].handleContentChunk(data)

    def allContentReceived(self) -> None:
        """End the body's rate windows and process the request, unless refused already."""
        if self._refused:
            return
        if self._body_call is not None and self._body_call.active():
            self._body_call.cancel()
        self._body_call = None
        self._header_started = False
        super().allContentReceived()

    def rawDataReceived(self, data: bytes) -> None:
        """
        Buffer pipelined bytes while a request is handled and stop reading once the buffer
        passes twisted.web's eager-read size, whether or not the transport is full (twisted.web
        itself forgets to stop in that case).
        """
        if self._refused:
            return
        if self._handlingRequest:
            self._dataBuffer.append(data)
            if sum(map(len, self._dataBuffer)) > self._optimisticEagerReadSize:
                self._networkProducer.pauseProducing()
            return
        self._parsing = "the chunked body"
        try:
            super().rawDataReceived(data)
        finally:
            self._parsing = "the request line"

    # --- deadlines ---

    def _window(self) -> float:
        """The body's rate window, in seconds."""
        return self.site.server.body_timeout_ms / 1000

    def _header_deadline(self) -> None:
        """
        The header block ran out of time: 408. Nothing of a request yet: a connection that
        never sent a request is closed quietly (it holds a connection of the cap for
        nothing); one that did is kept alive, the site's idle timeout ruling.
        """
        self._header_call = None
        if not self._header_started and not self._buffer.strip():
            if not self._answered and not self._handlingRequest:
                self.timeoutConnection()
            return
        timeout = self.site.server.header_timeout_ms
        self._refuse(
            GatewayError(
                408,
                f"the request's header block took over {timeout} ms",
                "invalid_request_error",
                "request_timeout",
            )
        )

    def _body_window_ended(self) -> None:
        """One rate window ended: 408 if the body grew by less than the floor, else go on."""
        self._body_call = None
        server = self.site.server
        floor = max(1, math.ceil(server.body_min_bytes_per_s * self._window()))
        grown = self._body_received - self._window_start
        if grown < floor:
            self._refuse(
                GatewayError(
                    408,
                    f"the request body arrived too slowly: {grown} bytes in "
                    f"{server.body_timeout_ms} ms, under the floor of "
                    f"{server.body_min_bytes_per_s} bytes per second",
                    "invalid_request_error",
                    "request_timeout",
                )
            )
            return
        self._window_start = self._body_received
        self._body_call = self.callLater(self._window(), self._body_window_ended)

    def _cancel_header_deadline(self) -> None:
        """Cancel the header deadline, if it runs."""
        if self._header_call is not None and self._header_call.active():
            self._header_call.cancel()
        self._header_call = None

    def _cancel_timers(self) -> None:
        """Cancel the header deadline and the body's window."""
        self._cancel_header_deadline()
        if self._body_call is not None and self._body_call.active():
            self._body_call.cancel()
        self._body_call = None

    # --- output bound ---

    def requestDone(self, request: Any) -> None:
        """
        A request was answered. While the transport holds a full buffer (it asked this
        channel to pause), hold the next pipelined request, and stop reading, until the
        buffer drains (L{resumeProducing}); else go on as twisted.web does.
        """
        self._header_started = False
        self._answered = True
        if not (self.persistent and self._waitingForTransport):
            super().requestDone(request)
            return
        if request != self.requests[0]:
            raise TypeError(request)
        del self.requests[0]
        self._held = True
        self._networkProducer.pauseProducing()
        # The idle timeout runs while held: a client that never reads is dropped by it.
        if self._savedTimeOut:
            self.setTimeout(self._savedTimeOut)

    def resumeProducing(self) -> None:
        """The transport's buffer drained: parse the requests held, and read again."""
        super().resumeProducing()
        if not self._held or self._refused:
            return
        self._held = False
        self._handlingRequest = False
        self._networkProducer.resumeProducing()
        data = b"".join(self._dataBuffer)
        self._dataBuffer = []
        self.setLineMode(data)

    # --- the site's count ---

    def connectionMade(self) -> None:
        """
        Count this connection on the site; its first request's header deadline runs from
        now, so a connection that sends nothing is closed at C{header_timeout_ms}, not held
        to the idle timeout.
        """
        self._on_close: list[Callable[[], None]] = []
        self.site.open_channels[self] = None
        self.shown_token = not self.site.guarded
        super().connectionMade()
        self._arm_header_deadline()

    def when_closed(self, callback: Callable[[], None]) -> None:
        """
        Call C{callback} once when this connection is lost, after its requests heard of it
        (an anonymous session ends with its connection).
        """
        self._on_close.append(callback)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Uncount it, stop every timer, then tell those who asked (L{when_closed})."""
        self.site.open_channels.pop(self, None)
        self._cancel_timers()
        super().connectionLost(reason)
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()


class GatewaySite(Site):
    """
    The gateway's twisted.web site: its connections are L{GatewayChannel}s under the limits
    of C{[server]}, at most C{max_connections} of them open at once.

    @ivar server: the limits (C{[server]}).
    @ivar open_channels: the channels connected now, oldest first.
    @ivar guarded: whether requests here must show a token (the TCP listener): then, at the
        cap, the oldest connection that has not shown one is closed to make room.
    @ivar on_refusal: told of every refusal the channels and the cap make, for C{/metrics}.
    @ivar shapes: the error shapes of the front doors, by path prefix (L{shape_for}).
    """

    protocol = GatewayChannel  # type: ignore[assignment]
    requestFactory = GatewayWebRequest

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(
        self,
        root: Resource,
        server: Server,
        on_refusal: Callable[[GatewayError], None] = lambda error: None,
        shapes: Sequence[tuple[bytes, ErrorShape]] = (),
        guarded: bool = False,
        **kwargs: Any,
    ) -> None:
        """
        @param server: the limits: C{body_bytes}, the deadlines, the rate floor and
            C{max_connections}.
        @param on_refusal: told of each refusal (its error) as it is answered.
        @param shapes: (path prefix, error shape) of each front door whose errors are not
            OpenAI's, such as C{(b"/v1/messages", anthropic_error)}.
        @param guarded: whether requests here must show a token (L{buildProtocol}).
        @param kwargs: as for C{Site} (C{reactor}, ...).
        """
        # Every body is JSON read by a door: Twisted's form parsing would only cost each
        # POST a trip through the email package for its Content-Type (40 % of what the
        # channel spent on a request, by py-spy), and answer a malformed multipart body
        # with a bare 400 of its own instead of the door's error.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(root, **kwargs)
        self.server = server
        self.on_refusal = on_refusal
        self.shapes = tuple(shapes)
        self.guarded = guarded
        self.open_channels: dict[GatewayChannel, None] = {}
        self.displayTracebacks = False
        self.noisy = False

    def shape_for(self, path: bytes | None) -> ErrorShape:
        """
        The error shape of the front door C{path} belongs to (its query ignored): the first
        of L{shapes} whose prefix it starts with, else OpenAI's (also when the path is not
        known yet).
        """
        if path is not None:
            path = origin_form(path).split(b"?", 1)[0]
            for prefix, shape in self.shapes:
                if path.startswith(prefix):
                    return shape
        return _openai_shape

    def buildProtocol(self, addr: Any) -> Any:
        """
        A L{GatewayChannel}, or, past C{max_connections} open, a protocol that answers 503
        and closes (the open connections are not disturbed). On a guarded listener a
        connection that has not shown the token cannot crowd out one that has: at the cap,
        the oldest connection that has not shown it is closed (aborted: it holds nothing
        of a request past the guard) and the new one takes its place; only when every open
        connection has shown the token is the new one refused.
        """
        if len(self.open_channels) >= self.server.max_connections:
            unproven = next((c for c in self.open_channels if not c.shown_token), None)
            if unproven is None:
                return _Overloaded(self.server.max_connections, self.on_refusal)
            self.open_channels.pop(unproven)
            self.on_refusal(
                GatewayError(
                    503,
                    "closed to make room: no token shown yet, the listener at its cap",
                    "server_error",
                    "displaced",
                )
            )
            # TCP and Unix transports both abort (an unproven client may not read a reply).
            cast(ITCPTransport, unproven.transport).abortConnection()
        return super().buildProtocol(addr)


class _Overloaded(Protocol):
    """A connection past the listener's cap: answered 503 at once, then closed."""

    def logPrefix(self) -> str:
        """The component that Twisted's log lines of this connection name: L{LOG_PREFIX}."""
        return LOG_PREFIX

    def __init__(self, cap: int, on_refusal: Callable[[GatewayError], None]) -> None:
        """
        @param cap: the cap, named in the answer.
        @param on_refusal: told of the refusal.
        """
        self._cap = cap
        self._on_refusal = on_refusal

    def connectionMade(self) -> None:
        """Answer and close."""
        error = GatewayError(
            503,
            f"the gateway has its maximum of {self._cap} connections open; try again later",
            "server_error",
            "too_many_connections",
        )
        self._on_refusal(error)
        assert self.transport is not None
        self.transport.write(error_response(error))
        self.transport.loseConnection()
