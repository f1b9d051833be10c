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

The status page is the one exception (DESIGN decision 48; L{loopd.gateway.page_login}): a
browser cannot send the token, so

 - the session cookie that a one-time login code bought opens the page's read-only routes
   (L{COOKIE_ROUTES}: C{GET} and C{HEAD} of C{/}, the page's script and C{/v1/status}) and
   nothing else: not a front door, not C{/metrics}, never a C{POST};
 - the login page, its script, the style sheet and the icon (L{PUBLIC_ROUTES}) need
   nothing: they hold nothing but the package's files, and the login's C{POST} carries the
   code, which is its own proof;
 - a browser's C{GET} of a cookie route without the token or a good cookie (C{Accept}
   naming C{text/html}) is answered 401 with a small HTML page that says to run
   C{loopd ui}; any other client keeps the JSON 401 of its door.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from twisted.web.resource import Resource
from twisted.web.server import Request

from loopd.access_token import presented_tokens, token_matches
from loopd.gateway.channel import GatewayChannel
from loopd.gateway.errors import GatewayError
from loopd.gateway.page import COOKIE_ROUTES, PUBLIC_ROUTES, route_of, serve_file, wants_html
from loopd.gateway.page_login import COOKIE_NAME, PageLogins
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


class _SignInPage(Resource):
    """A leaf that answers a browser's request 401 with the page that says to run C{loopd ui}."""

    isLeaf = True

    def render(self, request: Request) -> bytes:
        """The sign-in page, 401, with C{WWW-Authenticate: Bearer}."""
        request.setHeader(b"www-authenticate", b'Bearer realm="loopd"')
        return serve_file(request, "signin.html", status=401)


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
        logins: PageLogins | None = None,
    ) -> None:
        """
        @param inner: the gateway's root resource.
        @param token: the token every request must present.
        @param shapes: the error shape of each front door, by path prefix (such as
            C{(b"/v1/messages", anthropic_error)}); the first prefix of the request's path
            wins; a path none of them starts is answered by L{openai_shape}.
        @param on_refusal: told of each 401 (C{/metrics} counts it with the channel's
            refusals).
        @param logins: the status page's session cookies (L{PageLogins}), which open the
            page's read-only routes; C{None}: no cookie opens anything (the page's public
            routes still need nothing).
        """
        super().__init__()
        self._inner = inner
        self._token = token
        self._shapes = tuple(shapes)
        self._on_refusal = on_refusal
        self._logins = logins

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
            answer: bytes = refusal.render(request)
            return answer
        result: bytes = self._inner.render(request)
        return result

    def _check(self, request: Request) -> Resource | None:
        """
        None when the request presents the token, is for a public route of the page, or
        is a read of a cookie route with a good session cookie; else the 401 to answer it
        with (the sign-in page for a browser's read of a cookie route).
        """
        presented = presented_tokens(
            request.getHeader(b"authorization"), request.getHeader(b"x-api-key")
        )
        if token_matches(self._token, presented):
            self._proven(request)
            return None
        route = route_of(request.path or b"/")
        if route in PUBLIC_ROUTES:
            return None
        reading = request.method in (b"GET", b"HEAD") and route in COOKIE_ROUTES
        if reading and self._logins is not None:
            if self._logins.valid(request.getCookie(COOKIE_NAME)):
                self._proven(request)
                return None
        if presented:
            message = f"the API key is not loopd's token: {_HOW}"
        else:
            message = f"this listener needs loopd's token: {_HOW}"
        error = GatewayError(401, message, "invalid_request_error", "invalid_api_key")
        self._on_refusal(error)
        if reading and wants_html(request.getHeader(b"accept")):
            return _SignInPage()
        return _Unauthorized(error, self._shape(request.path))

    def _proven(self, request: Request) -> None:
        """
        The request showed a credential: its connection is never closed to make room for
        another (L{loopd.gateway.channel.GatewaySite.buildProtocol}).
        """
        channel = request.channel
        if isinstance(channel, GatewayChannel):
            channel.shown_token = True

    def _shape(self, path: bytes) -> ErrorShape:
        """The error shape of the door whose prefix C{path} starts with, else OpenAI's."""
        for prefix, shape in self._shapes:
            if path.startswith(prefix):
                return shape
        return openai_shape
