# -*- test-case-name: loopd.test.test_gateway_page_login -*-
"""
The status page's login on the TCP listener (DESIGN decisions 41 and 48): a browser cannot
send loopd's token, so C{loopd ui} asks the daemon over its Unix socket (whose 0600 mode in
a 0700 directory is its access control) for a one-time login code, and the browser trades
that code for a session cookie that the token guard accepts on the page's read-only routes
alone (L{loopd.gateway.token_guard}).

 - B{The code}: C{POST /v1/ui/login}, served on the Unix socket's site only
   (L{LoginCodeRoute}), answers C{{"code", "url", "expires_in"}}; C{url} is the TCP
   listener's C{/ui/login#CODE}. The code is good once, for L{CODE_SECONDS}; at most
   L{MAX_CODES} wait to be used (the oldest goes first). The code rides in the link's
   fragment, which a browser never sends to a server: it stays out of every request line,
   access log and C{Referer}; the login page's script posts it and replaces the address, so
   it does not stay in the history either.
 - B{The cookie}: C{POST /ui/login} with C{{"code": CODE}} as JSON (L{LoginRoute}) answers
   C{Set-Cookie: loopd_ui=VALUE; HttpOnly; SameSite=Strict; Path=/}: 256 random bits
   (C{secrets}), no script can read it, and no other site's page can make the browser send
   it. It has no C{Secure} flag: the listener is plain HTTP on a loopback address, where a
   C{Secure} cookie would never be sent back. It has no C{Max-Age} either (the browser
   forgets it when it closes); loopd forgets it after L{IDLE_SECONDS} unused, when more than
   L{MAX_SESSIONS} are open (the least recently used first), and when it restarts (it is
   kept in memory only).

Codes and cookies are kept as their SHA-256 digests, so a lookup's timing says nothing of a
value; every time is the reactor's (C{IReactorTime.seconds}), so C{task.Clock} drives the
expiries, and nothing here arms a timer: what has expired is forgotten when next looked at.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict
from collections.abc import Callable

from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import Request

from loopd.gateway.errors import GatewayError
from loopd.gateway.page import page_headers, serve_file
from loopd.gateway.web import write_json

__all__ = [
    "CODE_SECONDS",
    "COOKIE_NAME",
    "IDLE_SECONDS",
    "MAX_CODES",
    "MAX_SESSIONS",
    "LoginCodeRoute",
    "LoginRoute",
    "PageLogins",
    "cookie_header",
]

#: How long a login code may wait to be used, in seconds.
CODE_SECONDS = 60.0
#: How long a session cookie lives unused, in seconds (12 hours).
IDLE_SECONDS = 12 * 3600.0
#: The most login codes waiting at once.
MAX_CODES = 16
#: The most session cookies loopd keeps at once.
MAX_SESSIONS = 64
#: The session cookie's name.
COOKIE_NAME = b"loopd_ui"
#: The most bytes of a code or cookie value worth looking up (both are 43 characters).
_MAX_SECRET = 128
#: The largest login request body read (C{{"code": "..."}}).
_MAX_BODY = 1024


def _digest(secret: str | bytes) -> bytes:
    """The SHA-256 digest a code or cookie value is kept and looked up as."""
    raw = secret.encode("ascii", "replace") if isinstance(secret, str) else secret
    return hashlib.sha256(raw).digest()


def cookie_header(value: str) -> bytes:
    """The C{Set-Cookie} value of a session cookie (see the module docstring)."""
    return COOKIE_NAME + b"=" + value.encode("ascii") + b"; HttpOnly; SameSite=Strict; Path=/"


class PageLogins:
    """
    The login codes waiting to be used and the session cookies given for them, each with
    its expiry on the reactor's clock; see the module docstring.
    """

    def __init__(
        self,
        clock: IReactorTime,
        *,
        code_seconds: float = CODE_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
        max_codes: int = MAX_CODES,
        max_sessions: int = MAX_SESSIONS,
        secret: Callable[[], str] = lambda: secrets.token_urlsafe(32),
    ) -> None:
        """
        @param clock: the reactor whose C{seconds} every expiry is measured on.
        @param code_seconds: how long a code may wait to be used.
        @param idle_seconds: how long a cookie lives unused.
        @param max_codes: the most codes waiting at once (the oldest goes first).
        @param max_sessions: the most cookies kept at once (the least recently used goes
            first).
        @param secret: makes a fresh random code or cookie value (URL-safe text).
        """
        self._clock = clock
        self._code_seconds = code_seconds
        self._idle_seconds = idle_seconds
        self._max_codes = max_codes
        self._max_sessions = max_sessions
        self._secret = secret
        # digest -> when it expires (codes) or when it was last used (sessions), oldest first.
        self._codes: OrderedDict[bytes, float] = OrderedDict()
        self._sessions: OrderedDict[bytes, float] = OrderedDict()

    @property
    def code_seconds(self) -> float:
        """How long a code may wait to be used."""
        return self._code_seconds

    def new_code(self) -> str:
        """A fresh login code, good once within L{code_seconds}."""
        now = self._clock.seconds()
        self._forget_codes(now)
        code = self._secret()
        self._codes[_digest(code)] = now + self._code_seconds
        while len(self._codes) > self._max_codes:
            self._codes.popitem(last=False)
        return code

    def redeem(self, code: str) -> str | None:
        """
        Trade C{code} for a new session cookie's value; C{None} when the code is not one
        given, was used already or has expired. Either way the code is good no more.
        """
        now = self._clock.seconds()
        self._forget_codes(now)
        if not code or len(code) > _MAX_SECRET:
            return None
        if self._codes.pop(_digest(code), None) is None:
            return None
        self._forget_sessions(now)
        value = self._secret()
        self._sessions[_digest(value)] = now
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return value

    def valid(self, cookie: bytes | None) -> bool:
        """
        Whether C{cookie} (a session cookie's value as the request sent it) is one loopd
        gave and still keeps; using it keeps it for L{IDLE_SECONDS} more.
        """
        now = self._clock.seconds()
        self._forget_sessions(now)
        if not cookie or len(cookie) > _MAX_SECRET:
            return False
        key = _digest(cookie)
        if key not in self._sessions:
            return False
        self._sessions[key] = now
        self._sessions.move_to_end(key)
        return True

    @property
    def sessions(self) -> int:
        """How many session cookies loopd keeps now (expired ones not counted)."""
        self._forget_sessions(self._clock.seconds())
        return len(self._sessions)

    def _forget_codes(self, now: float) -> None:
        """Forget the codes that have expired (they are in expiry order)."""
        while self._codes and next(iter(self._codes.values())) <= now:
            self._codes.popitem(last=False)

    def _forget_sessions(self, now: float) -> None:
        """Forget the cookies unused for L{IDLE_SECONDS} (they are in order of use)."""
        while self._sessions and next(iter(self._sessions.values())) + self._idle_seconds <= now:
            self._sessions.popitem(last=False)


class LoginCodeRoute(Resource):
    """
    C{POST /v1/ui/login}: on the Unix socket's site, a fresh login code and the link that
    uses it, or 409 C{no_tcp_listener} when loopd has no TCP listener to reach the page on;
    on any other site (the TCP listener's, even with the token), 403 C{forbidden}.
    """

    isLeaf = True

    def __init__(
        self, logins: PageLogins, page_url: Callable[[], str | None], *, local: bool
    ) -> None:
        """
        @param logins: the codes and cookies.
        @param page_url: the TCP listener's URL as a browser reaches it
            (C{http://127.0.0.1:8421}), C{None} when there is no TCP listener.
        @param local: whether this is the Unix socket's site, the only one that gives codes.
        """
        super().__init__()
        self._logins = logins
        self._page_url = page_url
        self._local = local

    def render_POST(self, request: Request) -> bytes:
        """The code, its link and its lifetime in seconds, as JSON; never cached."""
        request.setHeader(b"cache-control", b"no-store")
        if not self._local:
            error = GatewayError(
                403,
                "login codes are given only on loopd's Unix socket: run `loopd ui` on the "
                "machine loopd runs on, as the user it runs as",
                "invalid_request_error",
                "forbidden",
            )
            return write_json(request, error.status, error.body())
        root = self._page_url()
        if root is None:
            error = GatewayError(
                409,
                "loopd has no TCP listener: the status page is reached over [server] tcp "
                '(add tcp = "127.0.0.1:8421" under [server] in loopd.toml and restart loopd)',
                "invalid_request_error",
                "no_tcp_listener",
            )
            return write_json(request, error.status, error.body())
        code = self._logins.new_code()
        body = {
            "code": code,
            "url": f"{root}/ui/login#{code}",
            "expires_in": round(self._logins.code_seconds),
        }
        return write_json(request, 200, body)


class LoginRoute(Resource):
    """
    C{/ui/login}: C{GET} is the login page (its script posts the link's code), C{POST}
    trades a code for the session cookie. The login needs no token: the code is the proof.
    """

    isLeaf = True

    def __init__(self, logins: PageLogins) -> None:
        """
        @param logins: the codes and cookies.
        """
        super().__init__()
        self._logins = logins

    def render_GET(self, request: Request) -> bytes:
        """The login page."""
        return serve_file(request, "login.html")

    def render_POST(self, request: Request) -> bytes:
        """
        Trade the JSON body's C{code} for the session cookie: 200 C{{"ok": true}} with
        C{Set-Cookie}; 403 C{login_failed} for a code that is not good (used, expired or
        never given), or for a request another site's page made (an C{Origin} that is not
        this listener's, C{Sec-Fetch-Site: cross-site}); 400 for a body that is not
        C{{"code": "..."}} as C{application/json} (which a plain HTML form cannot send).
        """
        page_headers(request)
        request.setHeader(b"cache-control", b"no-store")
        refusal = self._refusal(request)
        if refusal is not None:
            return write_json(request, refusal.status, refusal.body())
        code = _code_of(request)
        if code is None:
            error = GatewayError(
                400,
                'the login takes {"code": "..."} as application/json',
                "invalid_request_error",
                "bad_request",
            )
            return write_json(request, error.status, error.body())
        value = self._logins.redeem(code)
        if value is None:
            error = GatewayError(
                403,
                "this login link has been used or has expired (a link is good once, for "
                f"{round(self._logins.code_seconds)} s): run `loopd ui` again",
                "invalid_request_error",
                "login_failed",
            )
            return write_json(request, error.status, error.body())
        request.setHeader(b"set-cookie", cookie_header(value))
        return write_json(request, 200, {"ok": True})

    def _refusal(self, request: Request) -> GatewayError | None:
        """The 403 of a login that another site's page asked for; C{None} otherwise."""
        origin = request.getHeader(b"origin")
        host = request.getHeader(b"host")
        site = request.getHeader(b"sec-fetch-site")
        foreign = site is not None and site.lower() not in (b"same-origin", b"none")
        if origin is not None and (host is None or origin != b"http://" + host):
            foreign = True
        if not foreign:
            return None
        return GatewayError(
            403,
            "a login must come from loopd's own login page",
            "invalid_request_error",
            "login_failed",
        )


def _code_of(request: Request) -> str | None:
    """The C{code} of a login request's JSON body; C{None} when it has none."""
    content_type = (request.getHeader(b"content-type") or b"").split(b";", 1)[0]
    if content_type.strip().lower() != b"application/json" or request.content is None:
        return None
    raw = request.content.read(_MAX_BODY + 1)
    if len(raw) > _MAX_BODY:
        return None
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None
