# -*- test-case-name: loopd.test.test_gateway_site,loopd.test.test_gateway_chat -*-
"""
The gateway's twisted.web layer: how its routes write answers (a JSON body with its status;
the head, data events and comment lines of a server-sent event stream, framed by
L{loopd.sse}), and the resources that route by path and method with JSON refusals. The
connection's own limits (body cap, deadlines, malformed HTTP) are L{loopd.gateway.channel}'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Protocol

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from loopd.gateway.errors import GatewayError

__all__ = [
    "Exchange",
    "JsonRoute",
    "Root",
    "open_event_stream",
    "write_json",
]

JsonAnswer = tuple[int, object]
"""A status and the body to send as JSON."""


class Exchange(Protocol):
    """One request under way that the daemon's stop must end (L{shutdown})."""

    def shutdown(self) -> None:
        """The daemon is stopping: answer the client with an error and stop."""


def write_json(request: Request, status: int, body: object) -> bytes:
    """
    Set C{status} and a JSON content type on C{request}; return the encoded C{body}. A
    C{HEAD} request gets the headers alone, its C{Content-Length} that of the body a C{GET}
    would get (twisted.web would log a warning for a body).
    """
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    encoded = json.dumps(body, separators=(",", ":")).encode()
    if request.method == b"HEAD":
        request.setHeader(b"content-length", b"%d" % len(encoded))
        return b""
    return encoded


def open_event_stream(request: Request, content_type: bytes = b"text/event-stream") -> None:
    """
    Answer C{request} with C{200} and the headers of an unbuffered stream of
    C{content_type} (server-sent events unless a door streams another way).
    """
    request.setResponseCode(200)
    request.setHeader(b"content-type", content_type)
    request.setHeader(b"cache-control", b"no-cache")
    request.setHeader(b"x-accel-buffering", b"no")


class JsonRoute(Resource):
    """
    A leaf that answers GET with JSON computed by C{render_json} (a Deferred is fine).
    """

    isLeaf = True

    def __init__(self, render_json: Callable[[], JsonAnswer | Deferred[JsonAnswer]]) -> None:
        """
        @param render_json: gives the status and the body, or a Deferred of them.
        """
        super().__init__()
        self._render_json = render_json

    def render_GET(self, request: Request) -> bytes | int:
        """Answer with C{render_json}'s status and body, now or when its Deferred fires."""
        outcome = self._render_json()
        if not isinstance(outcome, Deferred):
            status, body = outcome
            return write_json(request, status, body)
        gone: list[Failure] = []
        request.notifyFinish().addErrback(gone.append)

        def answer(result: JsonAnswer) -> None:
            # twisted.web refuses to finish a request whose client has left.
            if not gone:
                request.write(write_json(request, *result))
                request.finish()

        outcome.addCallback(answer)
        return NOT_DONE_YET


class Root(Resource):
    """
    Routes by path; an unknown path is 404 and a known path with the wrong method 405,
    both in the OpenAI error shape.
    """

    def __init__(
        self,
        routes: Mapping[bytes, Resource],
        items: Mapping[bytes, Callable[[str], Resource]] | None = None,
    ) -> None:
        """
        @param routes: the resource of each path, such as C{b"/v1/models"}.
        @param items: for a path of collection items such as C{b"/v1/models/"}, what makes
            the resource of one item from the rest of the path (decoded as UTF-8, its
            trailing slash dropped): C{/v1/models/tiny} is C{items[b"/v1/models/"]("tiny")}.
        """
        super().__init__()
        self._routes = routes
        self._items = items or {}

    def getChild(self, path: bytes, request: Request) -> Resource:
        """The route of the whole path (a trailing slash ignored), or a JSON 404."""
        whole = b"/" + b"/".join([path, *(request.postpath or [])])
        route = self._routes.get(whole.rstrip(b"/") or b"/")
        if route is None:
            route = self._item(whole.rstrip(b"/"))
        if route is None:
            return _Refusal(404, f"no route {whole.decode('latin-1')}", "not_found")
        request.postpath = []
        return _MethodGuard(route)

    def _item(self, whole: bytes) -> Resource | None:
        """The resource of one collection item at C{whole}, if a prefix of C{items} names it."""
        for prefix, make in self._items.items():
            if whole.startswith(prefix) and len(whole) > len(prefix):
                return make(whole[len(prefix) :].decode("utf-8", errors="replace"))
        return None


class _Refusal(Resource):
    """A leaf that answers every request with one JSON error."""

    isLeaf = True

    def __init__(self, status: int, message: str, code: str) -> None:
        """The error to answer: C{status} and C{code}, an C{invalid_request_error}."""
        super().__init__()
        self._error = GatewayError(status, message, "invalid_request_error", code)

    def render(self, request: Request) -> bytes:
        """Answer the error."""
        return write_json(request, self._error.status, self._error.body())


class _MethodGuard(Resource):
    """
    Delegates to a route, answering an unsupported method with a JSON 405.
    """

    isLeaf = True

    def __init__(self, route: Resource) -> None:
        """
        @param route: the resource that answers the methods it has.
        """
        super().__init__()
        self._route = route

    def render(self, request: Request) -> bytes | int:
        """Let C{route} answer, or a JSON 405 naming the allowed methods."""
        method = (request.method or b"").decode("latin-1")
        allowed = _methods(self._route)
        if method.encode("latin-1") not in allowed:
            request.setHeader(b"allow", b", ".join(allowed))
            error = GatewayError(
                405, f"{method} is not allowed here", "invalid_request_error", "method_not_allowed"
            )
            return write_json(request, 405, error.body())
        result: bytes | int = self._route.render(request)
        return result


def _methods(route: Resource) -> list[bytes]:
    """
    The methods C{route} answers, sorted. HEAD counts only beside GET: every Resource
    inherits a C{render_HEAD} that calls C{render_GET}.
    """
    methods = [
        name[len("render_") :]
        for name in dir(route)
        if name.startswith("render_") and name[len("render_") :].isupper()
    ]
    if "GET" not in methods and "HEAD" in methods:
        methods.remove("HEAD")
    return [method.encode() for method in methods]
