# -*- test-case-name: loopd.test.test_errors -*-
"""
How talking to a model server fails: L{InferError} and its kinds, the ground every layer of
loopd stands on (the wire layer raises them, the llama client retries on them, the gateway
maps them to HTTP answers).

  - L{Busy}: loopd's queue for the slot is full.
  - L{Connect}: the server's socket could not be connected to.
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
    The server's socket could not be connected to; C{reason} says why.
    """

    def __init__(self, reason: str) -> None:
        """
        @param reason: why, in one line; it is the message too.
        """
        super().__init__(reason)
        self.reason = reason


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
    """


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
