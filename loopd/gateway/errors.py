# -*- test-case-name: loopd.test.test_gateway_errors -*-
"""
The gateway's errors: one exception that carries an HTTP status and the OpenAI error body,
and the mapping from the llama client's failures to it (DESIGN §3 decision 18).

Pure: no I/O, no twisted.web.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeGuard

from loopd import strict_json
from loopd.errors import (
    Busy,
    Connect,
    Http,
    InferError,
    LoadTimeout,
    Protocol,
    ProxyRefused,
    Stalled,
    StreamClosedEarly,
    ThinkingOverrun,
    WaitTimeout,
)

__all__ = ["GatewayError", "MeshTurnError", "error_for", "quotes_server"]


class GatewayError(Exception):
    """
    A request the gateway answers with an error status and an OpenAI error body.

    @ivar status: the HTTP status.
    @ivar message: what went wrong, for a person.
    @ivar type: the OpenAI error type (C{invalid_request_error}, C{rate_limit_error}, ...).
    @ivar code: a stable code for programs (C{busy}, C{missing_messages}, ...).
    @ivar details: more fields of the error object, after those three (the server's own
        C{n_prompt_tokens} and C{n_ctx} of a prompt that does not fit).
    @ivar param: the request field the error is about, as its message names it
        (C{messages[1].role}, C{tools[0].type}), for OpenAI's C{param}; C{None} when it is
        about no one field.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        code: str,
        details: Mapping[str, Any] | None = None,
        *,
        param: str | None = None,
    ) -> None:
        """Record the status, the three fields of the error body, any more and the field."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.details: Mapping[str, Any] = details or {}
        self.param = param

    def __repr__(self) -> str:
        """Show every field."""
        more = f", {dict(self.details)!r}" if self.details else ""
        more += f", param={self.param!r}" if self.param is not None else ""
        return (
            f"GatewayError({self.status!r}, {self.message!r}, {self.type!r}, {self.code!r}{more})"
        )

    def body(self) -> dict[str, Any]:
        """
        The JSON error body in OpenAI's shape: C{{"error": {"message", "type", "code",
        "param", ...details}}}, C{param} C{null} when the error is about no one field.
        """
        error = {"message": self.message, "type": self.type, "code": self.code}
        return {"error": {**error, "param": self.param, **self.details}}


_FIXED: tuple[tuple[type[InferError], int, str, str, str], ...] = (
    (Busy, 429, "rate_limit_error", "busy", "the endpoint's queue is full; try again later"),
    (
        LoadTimeout,
        503,
        "server_error",
        "load_timeout",
        "the model server stayed unavailable (loading or restarting) past the load wait",
    ),
    (
        WaitTimeout,
        504,
        "timeout",
        "wait_timeout",
        "the model server's slot stayed busy past the wait limit",
    ),
    (
        Stalled,
        504,
        "timeout",
        "stalled",
        "the model server went silent past the liveness limit",
    ),
)

_UPSTREAM_MESSAGES: dict[type[InferError], str] = {
    StreamClosedEarly: "the model server's stream ended before the answer was finished",
    ThinkingOverrun: "the model kept thinking past the cap and the request was cancelled",
    Protocol: "the model server broke the protocol",
}

INTERNAL_MESSAGE = "loopd failed to handle the request; its log has the details"
"""The message of a 500: it names no internals."""


class MeshTurnError(GatewayError):
    """
    A mesh turn that gave no answer (reference/mesh-moa.md §1.12): a 502 C{server_error}
    with the turn's code (C{all_workers_failed}, C{all_reducers_failed},
    C{no_usable_answer}) and message. Each door answers it in its error shape; chat
    completions in the reference's failure body (L{loopd.gateway.doors.chat_mesh}).
    """

    def __init__(self, message: str, code: str) -> None:
        """
        @param message: what failed, for a person.
        @param code: the turn's failure code.
        """
        super().__init__(502, message, "server_error", code)


def error_for(error: BaseException) -> GatewayError:
    """
    The gateway error that answers a request which failed with C{error}.

      - a L{GatewayError}: itself.
      - L{Busy}: 429 C{rate_limit_error}/C{busy}; L{LoadTimeout}: 503
        C{server_error}/C{load_timeout}; L{WaitTimeout} and L{Stalled}: 504
        C{timeout}/C{wait_timeout} or C{stalled}.
      - L{Connect}: 502 C{upstream_error}/C{connect}, C{endpoint <name> is unreachable:
        <kind of failure>}; the socket's path is never in it (the log has it).
      - L{ProxyRefused}: 503 C{server_error}/C{proxy_refused}, naming the endpoint and the
        inferproxy limit that refused the connection (the server is not down).
      - L{Http} with a 4xx status: the same status and the upstream's own message (its
        C{error.message}, else the body's text), type the upstream's C{error.type} (else
        C{invalid_request_error}), code C{http}; a prompt that does not fit the context
        is 400 with the server's own type (C{exceed_context_size_error}) and its
        C{n_prompt_tokens} and C{n_ctx}, code C{context_exceeded}.
      - any other L{InferError} (L{Http} with another status, C{StreamClosedEarly},
        C{ThinkingOverrun}, C{Protocol}): 502 C{upstream_error},
        the code the kind's name in snake_case (C{stream_closed_early}).
      - anything else: 500 C{server_error}/C{internal_error}, with a message that names no
        internals (the caller logs C{error} itself).
    """
    if isinstance(error, GatewayError):
        return error
    for kind, status, type_, code, message in _FIXED:
        if isinstance(error, kind):
            return GatewayError(status, message, type_, code)
    if isinstance(error, Http):
        return _from_http(error)
    if isinstance(error, Connect):
        return _from_connect(error)
    if isinstance(error, ProxyRefused):
        return GatewayError(503, str(error), "server_error", "proxy_refused")
    if isinstance(error, InferError):
        message = _UPSTREAM_MESSAGES.get(type(error), "the model server failed")
        if str(error):
            message = f"{message}: {error}"
        return GatewayError(502, message, "upstream_error", _snake_case(type(error).__name__))
    return GatewayError(500, INTERNAL_MESSAGE, "server_error", "internal_error")


def quotes_server(error: BaseException) -> bool:
    """
    Whether the message L{error_for} makes of C{error} carries the model server's own text
    (an upstream error body, a protocol failure's detail), which may quote the prompt or the
    model's output; loopd's own messages (connect failures, its fixed ones) do not.
    """
    if isinstance(error, (GatewayError, Connect, ProxyRefused)):
        return False
    if any(isinstance(error, kind) for kind, *_ in _FIXED):
        return False
    return isinstance(error, InferError)


def _from_connect(error: Connect) -> GatewayError:
    """
    A connect failure: the endpoint and the kind of failure, built from the error's parts so
    that the socket's path, which its plain message may carry, never reaches a client.
    """
    who = f"endpoint {error.endpoint}" if error.endpoint is not None else "the model server"
    return GatewayError(502, f"{who} is unreachable: {error.reason}", "upstream_error", "connect")


def _from_http(error: Http) -> GatewayError:
    """Map an upstream error status: 4xx passes through, anything else is a 502."""
    message, upstream_type = _upstream_error(error.body)
    if 400 <= error.status < 500:
        if error.context_exceeded:
            kind = upstream_type or "exceed_context_size_error"
            details = _context_details(error.body)
            return GatewayError(400, message, kind, "context_exceeded", details)
        return GatewayError(error.status, message, upstream_type or "invalid_request_error", "http")
    return GatewayError(
        502,
        f"the model server answered HTTP {error.status}: {message}",
        "upstream_error",
        "http",
    )


def _upstream_error(body: str) -> tuple[str, str | None]:
    """
    The message and type of an upstream error body.

    llama-server sends C{{"error": {"code", "message", "type"}}}; other OpenAI-compatible
    servers send C{{"error": "text"}} or a top-level C{message}. Anything else gives the
    body's own text.
    """
    try:
        parsed = strict_json.decode(body)
    except strict_json.JSONError:
        parsed = None
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict) and _text(inner.get("message")):
            upstream_type = inner.get("type")
            return inner["message"], upstream_type if _text(upstream_type) else None
        if _text(inner):
            return inner, None
        if _text(parsed.get("message")):
            return parsed["message"], None
    text = body.strip()
    return (text or "(no message)"), None


def _context_details(body: str) -> dict[str, Any]:
    """The server's C{n_prompt_tokens} and C{n_ctx} of a context error, those it sent."""
    try:
        parsed = strict_json.decode(body)
    except strict_json.JSONError:
        return {}
    inner = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(inner, dict):
        return {}
    return {key: inner[key] for key in ("n_prompt_tokens", "n_ctx") if key in inner}


def _text(value: object) -> TypeGuard[str]:
    """True for a non-empty string."""
    return isinstance(value, str) and value != ""


def _snake_case(name: str) -> str:
    """C{StreamClosedEarly} → C{stream_closed_early}."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
