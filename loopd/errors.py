# -*- test-case-name: loopd.test.test_errors -*-
"""
How talking to a model server fails: L{InferError} and its kinds, the ground every layer of
loopd stands on (the wire layer raises them, the llama client retries on them, the gateway
maps them to HTTP answers).

  - L{Busy}: loopd's queue for the slot is full.
  - L{Connect}: the server's socket could not be connected to.
  - L{ProxyRefused}: the endpoint's inferproxy refused the connection at one of its limits
    (the server itself is not down).
  - L{WaitTimeout}, L{LoadTimeout}, L{Stalled}: a bounded wait ran out.
  - L{StreamClosedEarly}: the answer ended before it was finished.
  - L{ThinkingOverrun}: thinking went past the cap and could not be ended.
  - L{Http}: the server answered with an error status or an error event.
  - L{Protocol}: the server broke the protocol or a size cap.

Each kind is also reachable as an attribute of the base (C{InferError.Http}), as the design
names them. Pure: no I/O.
"""

from __future__ import annotations

from typing import ClassVar

from loopd import strict_json

__all__ = [
    "HTTP_BODY_CAP",
    "Busy",
    "Connect",
    "Http",
    "InferError",
    "LoadTimeout",
    "Protocol",
    "ProxyRefused",
    "Stalled",
    "StreamClosedEarly",
    "ThinkingOverrun",
    "WaitTimeout",
]

#: How much of an error body an L{Http} error keeps.
HTTP_BODY_CAP = 4096


class InferError(Exception):
    """
    Base of every llama client failure. The kinds are reachable as attributes too
    (C{InferError.Http}), as the design names them.
    """

    Busy: ClassVar[type[Busy]]
    Connect: ClassVar[type[Connect]]
    ProxyRefused: ClassVar[type[ProxyRefused]]
    WaitTimeout: ClassVar[type[WaitTimeout]]
    LoadTimeout: ClassVar[type[LoadTimeout]]
    Stalled: ClassVar[type[Stalled]]
    StreamClosedEarly: ClassVar[type[StreamClosedEarly]]
    ThinkingOverrun: ClassVar[type[ThinkingOverrun]]
    Http: ClassVar[type[Http]]
    Protocol: ClassVar[type[Protocol]]


class Busy(InferError):
    """
    loopd's queue for the slot is full.
    """


class Connect(InferError):
    """
    The server's socket could not be connected to.

    The message names the socket's path only where nobody but the local user sees it: once
    the llama client knows the endpoint (C{endpoint} set), the message names the endpoint
    instead and the path stays in L{path}, for the log.

    @ivar reason: the kind of failure, in one line, naming no path (C{"connection refused"}).
    @ivar path: the socket path, or C{None} when not known.
    @ivar endpoint: the endpoint's name, or C{None} when not known.
    """

    def __init__(
        self, reason: str, *, path: str | None = None, endpoint: str | None = None
    ) -> None:
        """
        @param reason: why, in one line, without the path.
        @param path: the socket that could not be connected to.
        @param endpoint: the endpoint the socket belongs to.
        """
        if endpoint is not None:
            message = f"endpoint {endpoint} is unreachable: {reason}"
        elif path is not None:
            message = f"{path}: {reason}"
        else:
            message = reason
        super().__init__(message)
        self.reason = reason
        self.path = path
        self.endpoint = endpoint


class ProxyRefused(InferError):
    """
    The endpoint's inferproxy refused the connection at one of its limits before anything
    reached the server: the server is not down, the proxy is full or asked too often.

    An inferproxy answers such a connection with a fixed HTTP 503 that carries
    L{HEADER} (the limit's name) and C{Retry-After}, and closes it.

    @ivar limit: which limit: L{CONNECTIONS} (the connection cap) or L{ACCEPT_RATE} (the
        token bucket on accept).
    @ivar retry_after: the refusal's C{Retry-After} in seconds, when it gave one.
    @ivar endpoint: the endpoint's name, or C{None} when not known.
    """

    #: The header of an inferproxy's refusal that names the limit.
    HEADER: ClassVar[str] = "X-Inferproxy-Refused"
    #: The connection cap: too many connections open at the same time.
    CONNECTIONS: ClassVar[str] = "connections"
    #: The token bucket on accept: too many connections made in a short time.
    ACCEPT_RATE: ClassVar[str] = "accept-rate"

    def __init__(
        self, limit: str, retry_after: float | None = None, *, endpoint: str | None = None
    ) -> None:
        """
        @param limit: the limit's name as the refusal gave it.
        @param retry_after: its C{Retry-After} in seconds, if any.
        @param endpoint: the endpoint whose inferproxy refused.
        """
        what = {
            self.CONNECTIONS: "its inferproxy's connection limit is reached",
            self.ACCEPT_RATE: "its inferproxy's accept rate limit is reached",
        }.get(limit, f"its inferproxy's limit {limit!r} is reached")
        who = f"endpoint {endpoint}" if endpoint is not None else "the model server"
        message = f"{who} is refusing connections: {what}"
        if retry_after is not None:
            message += f"; retry after {retry_after:g} s"
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after
        self.endpoint = endpoint


class WaitTimeout(InferError):
    """
    The slot stayed busy past C{busy_wait_ms}.
    """


class LoadTimeout(InferError):
    """
    The server stayed unavailable (loading or restarting) past C{load_wait_ms}.
    """


class Stalled(InferError):
    """
    Silence past the liveness limit (or past the idle grace on an idle slot).
    """


class StreamClosedEarly(InferError):
    """
    The stream ended before a chunk carried a C{finish_reason}.

    @ivar before_headers: the connection closed before the response's headers were in:
        nothing answered, as when the inferproxy of a server that is down accepts a
        connection and closes it (an endpoint health signal, DESIGN decision 38).
    """

    def __init__(self, message: str = "", *, before_headers: bool = False) -> None:
        """
        @param message: what ended early.
        @param before_headers: see the class docstring.
        """
        super().__init__(message)
        self.before_headers = before_headers


class ThinkingOverrun(InferError):
    """
    Thinking went on past the cap and the overrun allowance, or the server refused to end
    it; the request was cancelled.
    """


class Http(InferError):
    """
    The server answered with an error status, or sent an error event mid-stream.

    @ivar status: the HTTP status (for a mid-stream error event, the event's C{code}, or
        500 when it has none).
    @ivar body: the error body, at most 4 KiB of it.
    @ivar context_exceeded: the prompt does not fit the slot's context (400 with
        C{exceed_context_size_error}); the caller may compact and try again.
    @ivar retry_after: the response's C{Retry-After} in seconds, when it gave one as a
        number (the mesh retries a 429 after it).
    """

    def __init__(self, status: int, body: str, retry_after: float | None = None) -> None:
        """
        @param status: the status (or an error event's code).
        @param body: the error body, kept up to L{HTTP_BODY_CAP} bytes of UTF-8 (cut at a
            character boundary); C{context_exceeded} is read from the whole body, so a
            long context error is still recognised.
        @param retry_after: the C{Retry-After} in seconds, if given.
        """
        self.context_exceeded = _is_context_exceeded(status, body)
        body = _cap_text(body, HTTP_BODY_CAP)
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body
        self.retry_after = retry_after


class Protocol(InferError):
    """
    The server broke the protocol or a size cap: an over-long header block or SSE line, an
    oversized body, or JSON that is not what llama-server sends.
    """


for _kind in (
    Busy,
    Connect,
    ProxyRefused,
    WaitTimeout,
    LoadTimeout,
    Stalled,
    StreamClosedEarly,
    ThinkingOverrun,
    Http,
    Protocol,
):
    setattr(InferError, _kind.__name__, _kind)


def _cap_text(text: str, limit: int) -> str:
    """
    C{text} cut to at most C{limit} bytes of UTF-8, never in the middle of a character.
    """
    encoded = text.encode("utf-8")
    if len(encoded) <= limit:
        return text
    return encoded[:limit].decode("utf-8", "ignore")


def _is_context_exceeded(status: int, body: str) -> bool:
    """
    Whether a status and body are llama-server's "prompt too long": a 400 whose body is a JSON
    object with C{error.type} C{exceed_context_size_error}.
    """
    if status != 400:
        return False
    try:
        error = strict_json.decode(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("type") == "exceed_context_size_error"
