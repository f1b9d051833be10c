# -*- test-case-name: loopd.test.test_gateway_page -*-
"""
The status page (DESIGN decision 48): plain HTML, CSS and JavaScript shipped in the package
(C{loopd/gateway/page/}), with no build step and nothing from another site, so it works
offline. Its script polls C{GET /v1/status} (L{loopd.gateway.status}) every two seconds and
draws the document: endpoints and their slots, sessions, lease queues, the requests under
way and the last ones, the totals and a plot of the last hour.

C{/} answers by content negotiation (L{IndexRoute}): a client whose C{Accept} names
C{text/html} (a browser) gets the page, any other (curl, the SDKs, Claude Code's C{HEAD /}
probe) the JSON index as before; both say C{Vary: Accept}. The page's files are under
C{/ui/} (L{PAGE_FILES}). Every answer of the page carries L{page_headers}: a strict
Content-Security-Policy (C{default-src 'self'}, no inline script or style, no framing),
C{X-Content-Type-Options: nosniff} and C{Referrer-Policy: no-referrer}. A file answers
with C{Cache-Control: no-cache} and an C{ETag}, so the browser asks again each time and an
unchanged file costs a 304, and a new loopd's page is never mixed with an old one's.

Which routes a browser's session cookie opens on the TCP listener, and which need nothing,
is decided here too (L{COOKIE_ROUTES}, L{PUBLIC_ROUTES}), for the token guard
(L{loopd.gateway.token_guard}) to apply.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request

from loopd.gateway.web import JsonRoute

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "COOKIE_ROUTES",
    "PAGE_FILES",
    "PUBLIC_ROUTES",
    "IndexRoute",
    "PageFile",
    "page_file",
    "page_headers",
    "page_routes",
    "route_of",
    "serve_file",
    "wants_html",
]

#: The policy of every page answer: only loopd's own scripts, styles, images and
#: connections; no plugin, no C{<base>}, no form target, no framing by another page.
CONTENT_SECURITY_POLICY = (
    b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    b"connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    b"frame-ancestors 'none'"
)

#: The content type of each kind of file the page has.
_TYPES = {
    "html": b"text/html; charset=utf-8",
    "css": b"text/css; charset=utf-8",
    "js": b"text/javascript; charset=utf-8",
    "svg": b"image/svg+xml",
}

#: The page's files by route; the page itself is served at C{/} (L{IndexRoute}) and the
#: login page at C{/ui/login} (L{loopd.gateway.page_login.LoginRoute}).
PAGE_FILES = {
    b"/ui/page.css": "page.css",
    b"/ui/page.js": "page.js",
    b"/ui/login.js": "login.js",
    b"/ui/icon.svg": "icon.svg",
}

#: The routes a session cookie opens on the TCP listener, for C{GET} and C{HEAD} only:
#: the page, its script and the status document; never a front door, C{/metrics} or a POST.
COOKIE_ROUTES = frozenset({b"/", b"/ui/page.js", b"/v1/status"})

#: The routes the TCP listener serves without the token or a cookie: the login page and
#: its script (and the code it posts: the code is the proof), the style sheet and the icon
#: that the login page and the "run loopd ui" page use. Nothing here says anything of loopd
#: but what its package holds.
PUBLIC_ROUTES = frozenset({b"/ui/login", b"/ui/login.js", b"/ui/page.css", b"/ui/icon.svg"})


@dataclass(frozen=True)
class PageFile:
    """
    One file of the page, read from the package.

    @ivar name: its file name in C{loopd/gateway/page/}.
    @ivar body: its bytes.
    @ivar content_type: its C{Content-Type}.
    @ivar etag: its entity tag (a digest of the body).
    """

    name: str
    body: bytes
    content_type: bytes
    etag: bytes


@functools.cache
def page_file(name: str) -> PageFile:
    """
    The page's file C{name}, read from the package once.

    @raise FileNotFoundError: the package has no such file (an install without its data).
    """
    body = (resources.files("loopd.gateway") / "page" / name).read_bytes()
    kind = name.rsplit(".", 1)[-1]
    etag = b'"' + hashlib.sha256(body).hexdigest()[:20].encode("ascii") + b'"'
    return PageFile(name, body, _TYPES[kind], etag)


def route_of(path: bytes) -> bytes:
    """A request path as the routes name it: its trailing slashes dropped (C{/} stays)."""
    return path.rstrip(b"/") or b"/"


def wants_html(accept: bytes | None) -> bool:
    """
    Whether a request's C{Accept} header names C{text/html} (with a quality above zero): a
    browser asking for a page. C{*/*} alone does not count: that is curl, an SDK or a probe.
    """
    if not accept:
        return False
    for item in accept.split(b","):
        media, *parameters = (part.strip() for part in item.split(b";"))
        if media.lower() != b"text/html":
            continue
        quality = 1.0
        for parameter in parameters:
            name, _, value = parameter.partition(b"=")
            if name.strip().lower() == b"q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality > 0:
            return True
    return False


def page_headers(request: Request) -> None:
    """Set the headers every answer of the page carries (see the module docstring)."""
    request.setHeader(b"content-security-policy", CONTENT_SECURITY_POLICY)
    request.setHeader(b"x-content-type-options", b"nosniff")
    request.setHeader(b"referrer-policy", b"no-referrer")
    request.setHeader(b"x-frame-options", b"DENY")


def serve_file(request: Request, name: str, status: int = 200) -> bytes:
    """
    Answer C{request} with the page's file C{name}: its type, L{page_headers}, C{no-cache}
    with its C{ETag} (304 when the browser has it; not for an error C{status}), the body
    but for C{HEAD}.
    """
    found = page_file(name)
    page_headers(request)
    request.setHeader(b"content-type", found.content_type)
    if status != 200:
        request.setResponseCode(status)
        request.setHeader(b"cache-control", b"no-store")
    else:
        request.setHeader(b"cache-control", b"no-cache")
        if request.setETag(found.etag) == http.CACHED:
            return b""
    if request.method == b"HEAD":
        request.setHeader(b"content-length", b"%d" % len(found.body))
        return b""
    return found.body


class _FileRoute(Resource):
    """A leaf that answers C{GET} (and C{HEAD}) with one of the page's files."""

    isLeaf = True

    def __init__(self, name: str) -> None:
        """
        @param name: the file's name in C{loopd/gateway/page/}.
        """
        super().__init__()
        self._name = name

    def render_GET(self, request: Request) -> bytes:
        """The file (L{serve_file})."""
        return serve_file(request, self._name)


class IndexRoute(Resource):
    """
    C{GET /} (and C{HEAD /}): the status page for a browser (L{wants_html}), the JSON index
    for everyone else.
    """

    isLeaf = True

    def __init__(self, index: Callable[[], tuple[int, object]]) -> None:
        """
        @param index: the JSON index's status and body.
        """
        super().__init__()
        self._json = JsonRoute(index)

    def render_GET(self, request: Request) -> bytes | int:
        """The page or the JSON index, by C{Accept}."""
        request.setHeader(b"vary", b"Accept")
        if wants_html(request.getHeader(b"accept")):
            return serve_file(request, "index.html")
        return self._json.render_GET(request)


def page_routes() -> dict[bytes, Resource]:
    """The routes of the page's files (L{PAGE_FILES}); C{/} and C{/ui/login} are apart."""
    return {route: _FileRoute(name) for route, name in PAGE_FILES.items()}
