"""
Tests for L{loopd.gateway.page_login}: the one-time login codes and the session cookies
(L{PageLogins}, on a C{task.Clock}), the Unix socket's route that gives codes and the route
that trades one for a cookie (in memory, L{GatewayHarness}).

What the cookie opens on the TCP listener, and what it does not, is the token guard's and
is tested in L{loopd.test.test_gateway_token_guard}.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from loopd.gateway.page import page_file
from loopd.gateway.page_login import (
    CODE_SECONDS,
    IDLE_SECONDS,
    MAX_CODES,
    MAX_SESSIONS,
    PageLogins,
    cookie_header,
)
from loopd.testing.gateway import GatewayHarness, Response

PAGE_URL = "http://127.0.0.1:8421"
JSON = "Content-Type: application/json"


class CodeTests(SynchronousTestCase):
    """
    A login code is good once, for a minute.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.logins = PageLogins(self.clock)

    def test_single_use(self) -> None:
        """A code buys one cookie; the same code again buys nothing."""
        code = self.logins.new_code()
        cookie = self.logins.redeem(code)
        assert cookie is not None
        self.assertTrue(self.logins.valid(cookie.encode()))
        self.assertIsNone(self.logins.redeem(code))

    def test_expiry(self) -> None:
        """A code is good until just before C{CODE_SECONDS} on the reactor's clock, then not."""
        self.assertEqual(CODE_SECONDS, 60)
        early = self.logins.new_code()
        late = self.logins.new_code()
        self.clock.advance(CODE_SECONDS - 0.001)
        self.assertIsNotNone(self.logins.redeem(early))
        self.clock.advance(0.001)
        self.assertIsNone(self.logins.redeem(late))

    def test_forged(self) -> None:
        """A code never given, an empty one or an over-long one buys nothing."""
        self.logins.new_code()
        for forged in ("", "x" * 43, "y" * 10_000):
            self.assertIsNone(self.logins.redeem(forged))

    def test_fresh_and_random(self) -> None:
        """Each code is new: 256 random bits, URL-safe (so it fits a link's fragment)."""
        codes = {self.logins.new_code() for _ in range(MAX_CODES)}
        self.assertEqual(len(codes), MAX_CODES)
        for code in codes:
            self.assertRegex(code, r"^[A-Za-z0-9_-]{43}$")

    def test_bounded(self) -> None:
        """At most C{MAX_CODES} wait: one more and the oldest is good no more."""
        codes = [self.logins.new_code() for _ in range(MAX_CODES + 1)]
        self.assertIsNone(self.logins.redeem(codes[0]))
        self.assertIsNotNone(self.logins.redeem(codes[1]))
        self.assertIsNotNone(self.logins.redeem(codes[-1]))

    def test_kept_as_digests(self) -> None:
        """Neither a code nor a cookie value is kept as it is, only its digest."""
        code = self.logins.new_code()
        cookie = self.logins.redeem(self.logins.new_code())
        assert cookie is not None
        kept = repr(vars(self.logins)).encode()
        self.assertNotIn(code.encode(), kept)
        self.assertNotIn(cookie.encode(), kept)


class CookieTests(SynchronousTestCase):
    """
    A session cookie lives while it is used, within bounds.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.logins = PageLogins(self.clock)

    def cookie(self) -> bytes:
        """A fresh cookie's value."""
        value = self.logins.redeem(self.logins.new_code())
        assert value is not None
        return value.encode()

    def test_idle_expiry(self) -> None:
        """Unused for C{IDLE_SECONDS} (12 h), a cookie is forgotten; each use restarts that."""
        self.assertEqual(IDLE_SECONDS, 12 * 3600)
        cookie = self.cookie()
        self.clock.advance(IDLE_SECONDS - 1)
        self.assertTrue(self.logins.valid(cookie))
        self.clock.advance(IDLE_SECONDS - 1)
        self.assertTrue(self.logins.valid(cookie))
        self.clock.advance(IDLE_SECONDS)
        self.assertFalse(self.logins.valid(cookie))
        self.assertEqual(self.logins.sessions, 0)

    def test_forged(self) -> None:
        """A value never given, empty, missing or over-long is not valid."""
        self.cookie()
        for forged in (b"", None, b"x" * 43, b"y" * 10_000, b"\xff\xfe"):
            self.assertFalse(self.logins.valid(forged))

    def test_bounded(self) -> None:
        """
        At most C{MAX_SESSIONS} cookies are kept; one more and the least recently used goes.
        """
        cookies = [self.cookie() for _ in range(MAX_SESSIONS)]
        self.assertTrue(self.logins.valid(cookies[0]))
        newest = self.cookie()
        self.assertEqual(self.logins.sessions, MAX_SESSIONS)
        self.assertFalse(self.logins.valid(cookies[1]))
        self.assertTrue(self.logins.valid(cookies[0]))
        self.assertTrue(self.logins.valid(newest))

    def test_attributes(self) -> None:
        """
        The cookie is C{HttpOnly}, C{SameSite=Strict} and for the whole site; it has no
        C{Secure} flag (plain HTTP on loopback) and no lifetime of its own.
        """
        self.assertEqual(cookie_header("abc"), b"loopd_ui=abc; HttpOnly; SameSite=Strict; Path=/")


class RouteTests(SynchronousTestCase):
    """
    C{POST /v1/ui/login} on the Unix socket's site, and C{/ui/login}.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness()
        self.harness.gateway.page_url = PAGE_URL

    def ask(self, method: str, target: str, body: Any = None, *headers: str) -> Response:
        """One request on a new connection of the (unguarded, Unix) site; its response."""
        connection = self.harness.connect()
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(method, target, raw, list(headers))
        return connection.response()

    def code(self) -> str:
        """A code from the Unix socket's route."""
        code: str = self.ask("POST", "/v1/ui/login", b"").json()["code"]
        return code

    def test_code(self) -> None:
        """
        The route gives a code, the link that uses it (its fragment) and its lifetime;
        never cached.
        """
        response = self.ask("POST", "/v1/ui/login", b"{}")
        self.assertEqual(response.status, 200)
        self.assertEqual(response.headers["cache-control"], "no-store")
        body = response.json()
        self.assertEqual(sorted(body), ["code", "expires_in", "url"])
        self.assertEqual(body["url"], f"{PAGE_URL}/ui/login#{body['code']}")
        self.assertEqual(body["expires_in"], 60)

    def test_no_tcp_listener(self) -> None:
        """Without a TCP listener, 409 no_tcp_listener naming [server] tcp."""
        self.harness.gateway.page_url = None
        response = self.ask("POST", "/v1/ui/login", b"{}")
        self.assertEqual(response.status, 409)
        error = response.json()["error"]
        self.assertEqual(error["code"], "no_tcp_listener")
        self.assertIn("[server] tcp", error["message"])

    def test_code_route_is_post_only(self) -> None:
        """C{GET /v1/ui/login} is a 405 (a link or an image cannot mint a code)."""
        self.assertEqual(self.ask("GET", "/v1/ui/login").status, 405)

    def test_login_page(self) -> None:
        """C{GET /ui/login} is the login page, with the page's headers."""
        response = self.ask("GET", "/ui/login")
        self.assertEqual(response.status, 200)
        self.assertEqual(response.body, page_file("login.html").body)
        self.assertEqual(response.headers["content-type"], "text/html; charset=utf-8")
        self.assertIn("default-src 'self'", response.headers["content-security-policy"])

    def test_redeem(self) -> None:
        """
        The code as JSON buys the cookie: 200, C{Set-Cookie} with the cookie's attributes,
        never cached; the cookie is one L{PageLogins} keeps.
        """
        response = self.ask("POST", "/ui/login", {"code": self.code()}, JSON)
        self.assertEqual((response.status, response.json()), (200, {"ok": True}))
        self.assertEqual(response.headers["cache-control"], "no-store")
        cookie = response.headers["set-cookie"]
        name_value, *attributes = cookie.split("; ")
        self.assertEqual(attributes, ["HttpOnly", "SameSite=Strict", "Path=/"])
        name, _, value = name_value.partition("=")
        self.assertEqual(name, "loopd_ui")
        self.assertTrue(self.harness.gateway.logins.valid(value.encode()))

    def test_used_or_expired(self) -> None:
        """A used code, or one past its minute, is 403 login_failed saying to run loopd ui."""
        code = self.code()
        self.assertEqual(self.ask("POST", "/ui/login", {"code": code}, JSON).status, 200)
        again = self.ask("POST", "/ui/login", {"code": code}, JSON)
        late = self.code()
        self.harness.advance(60)
        expired = self.ask("POST", "/ui/login", {"code": late}, JSON)
        for response in (again, expired):
            self.assertEqual(response.status, 403)
            self.assertNotIn("set-cookie", response.headers)
            error = response.json()["error"]
            self.assertEqual(error["code"], "login_failed")
            self.assertIn("loopd ui", error["message"])

    def test_malformed(self) -> None:
        """
        A body that is not C{{"code": "..."}} as application/json (a form's, text, a number)
        is a 400, and the code it may carry stays good.
        """
        code = self.code()
        for body, headers in (
            (f"code={code}".encode(), ["Content-Type: application/x-www-form-urlencoded"]),
            (json.dumps({"code": code}).encode(), ["Content-Type: text/plain"]),
            (json.dumps({"code": code}).encode(), []),
            (b"{not json", [JSON]),
            (b'{"code": 7}', [JSON]),
            (b"[]", [JSON]),
        ):
            response = self.ask("POST", "/ui/login", body, *headers)
            self.assertEqual(response.status, 400, body)
            self.assertEqual(response.json()["error"]["code"], "bad_request")
        self.assertEqual(self.ask("POST", "/ui/login", {"code": code}, JSON).status, 200)

    def test_cross_site(self) -> None:
        """
        A login that another site's page asks for (its C{Origin}, or C{Sec-Fetch-Site:
        cross-site}) is 403, and the code stays good; the login page's own request passes.
        """
        code = self.code()
        for headers in (
            ["Origin: http://evil.example"],
            ["Origin: http://127.0.0.1:9999"],
            ["Origin: null"],
            ["Sec-Fetch-Site: cross-site"],
            ["Sec-Fetch-Site: same-site"],
        ):
            response = self.ask("POST", "/ui/login", {"code": code}, JSON, *headers)
            self.assertEqual(response.status, 403, headers)
            self.assertEqual(response.json()["error"]["code"], "login_failed")
        response = self.ask(
            "POST",
            "/ui/login",
            {"code": code},
            JSON,
            "Origin: http://loopd",
            "Sec-Fetch-Site: same-origin",
        )
        self.assertEqual(response.status, 200)
