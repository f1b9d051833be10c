# -*- test-case-name: loopd.test.test_gateway_token_guard -*-
"""
The TCP listener's door check (DESIGN decision 41): L{TokenGuard} wraps the gateway's root
resource on the TCP listener's site, and only there (the Unix socket's site has none: its
0600 mode in a 0700 directory is its access control).

Every request on that site, whatever its path (C{/health} and C{/metrics} too), carries
loopd's token as C{Authorization: Bearer TOKEN} or C{x-api-key: TOKEN}; without it, or
with another, it is answered 401 before any route sees it, in the error shape of the front
door its path belongs to (a list of path prefixes and shape functions from the caller;
OpenAI's, L{GatewayError.body}, for every other path). The check runs once per request, at
the first step of twisted.web's resource traversal, after the channel has read the request
within its own limits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from twisted.web.resource import Resource
from twisted.web.server import Request

from loopd.access_token import presented_tokens, token_matches
from loopd.gateway.channel import GatewayChannel
from loopd.gateway.errors import GatewayError
from loopd.gateway.web import write_json

__all__ = ["ErrorShape", "TokenGuard", "openai_shape"]

ErrorShape = Callable[[GatewayError], tuple[int, Any]]
"""A front door's error answer: the status and JSON body of a L{GatewayError}."""

_HOW = (
    "send it as Authorization: Bearer TOKEN or x-api-key: TOKEN (an agent's API key setting "
    "does); `loopd token` prints it"
)


def openai_shape(error: GatewayError) -> tuple[int, Any]:
    """OpenAI's error answer: C{{"error": {"message", "type", "code"}}}."""
    return error.status, error.body()


class _Unauthorized(Resource):
    """A leaf that answers one request 401 in a door's error shape."""

    isLeaf = True

    def __init__(self, error: GatewayError, shape: ErrorShape) -> None:
        """
        @param error: the refusal.
        @param shape: how the door of the request's path spells it.
        """
        super().__init__()
        self._error = error
        self._shape = shape

    def render(self, request: Request) -> bytes:
        """Answer the refusal, with C{WWW-Authenticate: Bearer}."""
        status, body = self._shape(self._error)
        request.setHeader(b"www-authenticate", b'Bearer realm="loopd"')
        return write_json(request, status, body)


class TokenGuard(Resource):
    """
    A root resource that lets a request through to C{inner} only when it presents the
    token; see the module docstring.
    """

    def __init__(
        self,
        inner: Resource,
        token: str,
        shapes: Sequence[tuple[bytes, ErrorShape]] = (),
        on_refusal: Callable[[GatewayError], None] = lambda error: None,
    ) -> None:
        """
        @param inner: the gateway's root resource.
        @param token: the token every request must present.
        @param shapes: the error shape of each front door, by path prefix (such as
            C{(b"/v1/messages", anthropic_error)}); the first prefix of the request's path
            wins; a path none of them starts is answered by L{openai_shape}.
        @param on_refusal: told of each 401 (C{/metrics} counts it with the channel's
            refusals).
        """
        super().__init__()
        self._inner = inner
        self._token = token
        self._shapes = tuple(shapes)
        self._on_refusal = on_refusal

    def getChildWithDefault(self, path: bytes, request: Request) -> Resource:
        """The inner root's child for a request with the token; else the 401."""
        refusal = self._check(request)
        if refusal is not None:
            return refusal
        child: Resource = self._inner.getChildWithDefault(path, request)
        return child

    def render(self, request: Request) -> bytes:
        """The inner root's answer for a request with the token; else the 401."""
        refusal = self._check(request)
        if refusal is not None:
            return refusal.render(request)
        result: bytes = self._inner.render(request)
        return result

    def _check(self, request: Request) -> _Unauthorized | None:
        """None when the request presents the token; else the 401 to answer it with."""
        presented = presented_tokens(
            request.getHeader(b"authorization"), request.getHeader(b"x-api-key")
        )
        if token_matches(self._token, presented):
            channel = request.channel
            if isinstance(channel, GatewayChannel):
                channel.shown_token = True
            return None
        if presented:
            message = f"the API key is not loopd's token: {_HOW}"
        else:
            message = f"this listener needs loopd's token: {_HOW}"
        error = GatewayError(401, message, "invalid_request_error", "invalid_api_key")
        self._on_refusal(error)
        return _Unauthorized(error, self._shape(request.path))

    def _shape(self, path: bytes) -> ErrorShape:
        """The error shape of the door whose prefix C{path} starts with, else OpenAI's."""
        for prefix, shape in self._shapes:
            if path.startswith(prefix):
                return shape
        return openai_shape
