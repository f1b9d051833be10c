"""
Tests for L{loopd.gateway.token_guard}: the TCP listener's token check.

The gateway's own site, guarded as C{twist loopd} guards its TCP listener, runs in memory
in L{GatewayHarness} (every route, the 401's shapes, C{/metrics}); then a real TCP listener
on 127.0.0.1 port 0 and a real Unix socket are asked with twisted.web's C{Agent}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint
from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from loopd.gateway.channel import GatewaySite
from loopd.gateway.doors.messages import anthropic_error
from loopd.gateway.token_guard import TokenGuard, openai_shape
from loopd.gateway.web import JsonRoute, Root
from loopd.settings import Server
from loopd.test.support.peers import real_reactor
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import HI, GatewayHarness, Response, make_config
from loopd.testing.llama_replies import answer
from loopd.unixsocket import listen_unix

TOKEN = "loopd-" + "t" * 43
ANTHROPIC_KEYS = ["error", "type"]


class GuardedGatewayTests(SynchronousTestCase):
    """
    The gateway's site behind the guard, as on the TCP listener, beside its unguarded site.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness()
        gateway = self.harness.gateway
        self.open_site = self.harness.site
        self.harness.site = gateway.site(
            guard=lambda root: TokenGuard(
                root, TOKEN, gateway.error_shapes(), on_refusal=gateway.metrics.observe_refusal
            )
        )

    def ask(self, method: str, target: str, headers: list[str], body: Any = None) -> Response:
        """One request on the guarded site; its response."""
        connection = self.harness.connect()
        raw = None if body is None else json.dumps(body).encode()
        connection.request(method, target, raw, ["Content-Type: application/json", *headers])
        return connection.response()

    def refused(self, response: Response) -> dict[str, Any]:
        """Assert a 401 in the OpenAI shape; return its error object."""
        self.assertEqual(response.status, 401)
        self.assertEqual(response.headers["www-authenticate"], 'Bearer realm="loopd"')
        error: dict[str, Any] = response.json()["error"]
        self.assertEqual(sorted(error), ["code", "message", "param", "type"])
        self.assertEqual(
            (error["type"], error["code"]), ("invalid_request_error", "invalid_api_key")
        )
        self.assertIn("loopd token", error["message"])
        return error

    def test_no_token(self) -> None:
        """Without a token the chat route is 401 and nothing goes upstream."""
        error = self.refused(self.ask("POST", CHAT, [], {**HI, "model": "local"}))
        self.assertIn("needs loopd's token", error["message"])
        self.assertEqual(self.harness.fake.requests, [])

    def test_wrong_token(self) -> None:
        """Another token, as Bearer or x-api-key, is 401; other schemes are no token."""
        for header in ("Authorization: Bearer nope", "x-api-key: nope"):
            error = self.refused(self.ask("POST", CHAT, [header], HI))
            self.assertIn("not loopd's token", error["message"])
        self.refused(self.ask("POST", CHAT, [f"Authorization: Basic {TOKEN}"], HI))
        self.assertEqual(self.harness.fake.requests, [])

    def test_bearer(self) -> None:
        """The token as Bearer reaches the chat route and the model."""
        self.harness.fake.script("POST", CHAT, answer({"content": "ok"}, delay_s=0))
        response = self.ask("POST", CHAT, [f"Authorization: Bearer {TOKEN}"], HI)
        self.assertEqual(response.status, 200)
        self.assertEqual(len(self.harness.fake.requests), 1)

    def test_api_key(self) -> None:
        """The token as x-api-key (Anthropic's clients) does too."""
        self.harness.fake.script("POST", CHAT, answer({"content": "ok"}, delay_s=0))
        response = self.ask("POST", CHAT, [f"x-api-key: {TOKEN}"], HI)
        self.assertEqual(response.status, 200)

    def test_every_path(self) -> None:
        """/health, /metrics, /v1/models and an unknown path all need the token too."""
        for target in ("/health", "/metrics", "/v1/models", "/v1/models/local", "/", "/nope"):
            self.refused(self.ask("GET", target, []))
        response = self.ask("GET", "/v1/models", [f"authorization: bearer {TOKEN}"])
        self.assertEqual(response.status, 200)
        self.assertEqual(self.ask("GET", "/nope", [f"x-api-key: {TOKEN}"]).status, 404)

    def test_head_probe(self) -> None:
        """
        Claude Code's C{HEAD /} connectivity probe without the token: a 401 with no body
        and nothing logged; with the token, the index's 200.
        """
        with capturedLogs() as events:
            response = self.ask("HEAD", "/", [])
        self.assertEqual((response.status, response.body), (401, b""))
        self.assertEqual([formatEvent(event) for event in events], [])
        response = self.ask("HEAD", "/", [f"x-api-key: {TOKEN}"])
        self.assertEqual((response.status, response.body), (200, b""))

    def test_anthropic_shape(self) -> None:
        """/v1/messages (and its count_tokens, and ?beta=true) answers in Anthropic's shape."""
        for target in ("/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"):
            for headers in ([], ["x-api-key: wrong"]):
                response = self.ask("POST", target, headers, {"max_tokens": 1})
                self.assertEqual(response.status, 401, target)
                body = response.json()
                self.assertEqual(sorted(body), ANTHROPIC_KEYS)
                self.assertEqual(body["type"], "error")
                self.assertEqual(body["error"]["type"], "authentication_error")
                self.assertIn("loopd token", body["error"]["message"])

    def test_unguarded_site(self) -> None:
        """The Unix socket's site, built by the same gateway, needs no token."""
        self.harness.site, guarded = self.open_site, self.harness.site
        connection = self.harness.connect()
        connection.request("GET", "/v1/models")
        self.assertEqual(connection.response().status, 200)
        self.harness.site = guarded

    def test_refusals_counted(self) -> None:
        """/metrics counts the 401s with the channel's refusals, and both sites' connections."""
        self.ask("GET", "/health", [])
        self.ask("GET", "/health", ["x-api-key: nope"])
        open_connection = self.harness.connect()
        self.harness.site = self.open_site
        samples = self.harness.scrape()
        refusals = frozenset({("status", "401"), ("code", "invalid_api_key")})
        self.assertEqual(samples[("loopd_http_refusals_total", refusals)], 2)
        self.assertGreaterEqual(samples[("loopd_http_connections_open", frozenset())], 2)
        del open_connection


#: What Chromium sends when it opens a page.
BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,*/*;q=0.8"


class PageCookieTests(SynchronousTestCase):
    """
    On the guarded site, the status page's session cookie (bought with a login code from
    the Unix socket's site) opens the page's read-only routes and nothing else; the login
    needs nothing; a browser without a sign-in is told to run C{loopd ui}.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness(leases=True)
        gateway = self.harness.gateway
        gateway.page_url = "http://127.0.0.1:8421"
        self.unix_site = self.harness.site
        self.harness.site = gateway.site(
            guard=lambda root: TokenGuard(
                root,
                TOKEN,
                gateway.error_shapes(),
                on_refusal=gateway.metrics.observe_refusal,
                logins=gateway.logins,
            )
        )

    def ask(self, method: str, target: str, *headers: str, body: Any = None) -> Response:
        """One request on the guarded site; its response."""
        connection = self.harness.connect()
        raw = None if body is None else json.dumps(body).encode()
        connection.request(method, target, raw, list(headers))
        return connection.response()

    def sign_in(self) -> str:
        """A code from the Unix socket's site, traded on the guarded one; the Cookie header."""
        guarded, self.harness.site = self.harness.site, self.unix_site
        code = self.ask("POST", "/v1/ui/login", body={}).json()["code"]
        self.harness.site = guarded
        response = self.ask(
            "POST", "/ui/login", "Content-Type: application/json", body={"code": code}
        )
        self.assertEqual(response.status, 200)
        return "Cookie: " + response.headers["set-cookie"].split(";", 1)[0]

    def test_login_without_token(self) -> None:
        """
        The login page, its script, the style sheet and the icon need no token; the page,
        its script and the status document do.
        """
        for target in ("/ui/login", "/ui/login.js", "/ui/page.css", "/ui/icon.svg"):
            self.assertEqual(self.ask("GET", target).status, 200, target)
        for target in ("/", "/ui/page.js", "/v1/status"):
            self.assertEqual(self.ask("GET", target).status, 401, target)

    def test_cookie_opens_the_page(self) -> None:
        """
        With the cookie: the page, its script, the status document, C{HEAD /}, and the
        JSON index for a client that does not ask for HTML.
        """
        cookie = self.sign_in()
        page = self.ask("GET", "/", cookie, f"Accept: {BROWSER}")
        self.assertEqual(page.status, 200)
        self.assertEqual(page.headers["content-type"], "text/html; charset=utf-8")
        self.assertEqual(self.ask("GET", "/ui/page.js", cookie).status, 200)
        status = self.ask("GET", "/v1/status", cookie, "Accept: application/json")
        self.assertEqual(status.status, 200)
        self.assertEqual(status.json()["endpoints"][0]["name"], "tiny")
        self.assertEqual(self.ask("HEAD", "/", cookie).status, 200)
        self.assertEqual(self.ask("GET", "/", cookie).json()["service"], "loopd")

    def test_cookie_opens_nothing_else(self) -> None:
        """
        The cookie is refused on the front doors, /metrics, /health, /v1/models, /v1/queue,
        the code route, and on any POST (of a read-only route too): the door's JSON 401, and
        nothing goes upstream.
        """
        cookie = self.sign_in()
        for method, target in (
            ("POST", CHAT),
            ("POST", "/v1/responses"),
            ("POST", "/v1/messages/count_tokens"),
            ("GET", "/metrics"),
            ("GET", "/health"),
            ("GET", "/v1/models"),
            ("GET", "/v1/queue"),
            ("POST", "/v1/ui/login"),
            ("POST", "/"),
            ("POST", "/v1/status"),
            ("DELETE", "/v1/status"),
        ):
            body = HI if method == "POST" else None
            response = self.ask(method, target, cookie, f"Accept: {BROWSER}", body=body)
            self.assertEqual(response.status, 401, (method, target))
            self.assertEqual(response.headers["content-type"], "application/json")
        response = self.ask("POST", "/v1/messages", cookie, body={"max_tokens": 1})
        self.assertEqual((response.status, response.json()["type"]), (401, "error"))
        self.assertEqual(self.harness.fake.requests, [])

    def test_forged_or_expired_cookie(self) -> None:
        """
        A cookie loopd never gave, one of another name, and one unused for twelve hours are
        refused.
        """
        cookie = self.sign_in()
        value = cookie.split("=", 1)[1]
        for forged in (
            "Cookie: loopd_ui=" + "A" * 43,
            f"Cookie: other={value}",
            "Cookie: loopd_ui=",
        ):
            self.assertEqual(self.ask("GET", "/v1/status", forged).status, 401, forged)
        self.assertEqual(self.ask("GET", "/v1/status", cookie).status, 200)
        self.harness.advance(12 * 3600)
        self.assertEqual(self.ask("GET", "/v1/status", cookie).status, 401)

    def test_sign_in_page(self) -> None:
        """
        A browser's GET of the page (or of the status document) without the token or a
        cookie is a 401 HTML page saying to run loopd ui, with the page's headers; a
        client that does not ask for HTML keeps the JSON 401, and HEAD has no body.
        """
        for target in ("/", "/v1/status"):
            response = self.ask("GET", target, f"Accept: {BROWSER}")
            self.assertEqual(response.status, 401)
            self.assertEqual(response.headers["content-type"], "text/html; charset=utf-8")
            self.assertEqual(response.headers["www-authenticate"], 'Bearer realm="loopd"')
            self.assertEqual(response.headers["cache-control"], "no-store")
            self.assertIn("default-src 'self'", response.headers["content-security-policy"])
            self.assertIn(b"loopd ui", response.body)
        response = self.ask("GET", "/", "Accept: */*")
        self.assertEqual(
            (response.status, response.json()["error"]["code"]), (401, "invalid_api_key")
        )
        head = self.ask("HEAD", "/")
        self.assertEqual((head.status, head.body), (401, b""))
        self.assertEqual(head.headers["content-type"], "application/json")

    def test_code_route_refused(self) -> None:
        """
        On the guarded site, the code route is 401 without the token and 403 with it:
        codes come from the Unix socket only.
        """
        self.assertEqual(self.ask("POST", "/v1/ui/login", body={}).status, 401)
        response = self.ask("POST", "/v1/ui/login", f"x-api-key: {TOKEN}", body={})
        self.assertEqual(response.status, 403)
        self.assertEqual(response.json()["error"]["code"], "forbidden")
        self.assertIn("loopd ui", response.json()["error"]["message"])

    def test_token_still_opens_everything(self) -> None:
        """The token opens the page and the status document too, as every route."""
        page = self.ask("GET", "/", f"Authorization: Bearer {TOKEN}", f"Accept: {BROWSER}")
        self.assertEqual(page.headers["content-type"], "text/html; charset=utf-8")
        self.assertEqual(self.ask("GET", "/v1/status", f"x-api-key: {TOKEN}").status, 200)

    def test_cookie_counts_as_shown(self) -> None:
        """
        A connection that showed a good cookie is, like one that showed the token, never
        closed to make room at the cap; a public route's is not proof.
        """
        cookie = self.sign_in()
        connection = self.harness.connect()
        connection.request("GET", "/ui/login")
        self.assertFalse(connection.channel.shown_token)
        connection.request("GET", "/v1/status", None, [cookie])
        self.assertTrue(connection.channel.shown_token)


class ShapeTests(SynchronousTestCase):
    """
    The guard picks the error shape by path prefix.
    """

    def test_first_prefix_wins(self) -> None:
        """The first prefix that the path starts with wins; none: OpenAI's."""
        first = lambda error: (error.status, "first")  # noqa: E731
        second = lambda error: (error.status, "second")  # noqa: E731
        guard = TokenGuard(Root({}), TOKEN, [(b"/a/b", first), (b"/a", second)])
        self.assertIs(guard._shape(b"/a/b/c"), first)
        self.assertIs(guard._shape(b"/a/x"), second)
        self.assertIs(guard._shape(b"/x"), openai_shape)


@implementer(IAgentEndpointFactory)
class _UnixEndpoints:
    """Every URL's endpoint is one Unix socket."""

    def __init__(self, reactor: Any, path: str) -> None:
        self._reactor, self._path = reactor, path

    def endpointForURI(self, uri: Any) -> Any:
        return UNIXClientEndpoint(self._reactor, self._path)


@implementer(IAgentEndpointFactory)
class _TcpEndpoints:
    """Every URL's endpoint is 127.0.0.1 at one port (explicit, for the TCP invariant's test)."""

    def __init__(self, reactor: Any, port: int) -> None:
        self._reactor, self._port = reactor, port

    def endpointForURI(self, uri: Any) -> Any:
        return TCP4ClientEndpoint(self._reactor, "127.0.0.1", self._port, timeout=10)


class RealListenerTests(TestCase):
    """
    A guarded site on a real TCP listener on 127.0.0.1 port 0, an unguarded one on a real
    Unix socket, asked with twisted.web's Agent.
    """

    def setUp(self) -> None:
        self.reactor = real_reactor()
        routes = {b"/health": JsonRoute(lambda: (200, {"status": "ok"}))}
        guarded = GatewaySite(
            TokenGuard(Root(routes), TOKEN, [(b"/v1/messages", anthropic_error)]),
            Server(),
            reactor=self.reactor,
        )
        self.port = self.reactor.listenTCP(0, guarded, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        directory = tempfile.mkdtemp(prefix="ldg", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.socket = os.path.join(directory, "loopd.sock")
        unix = listen_unix(self.reactor, self.socket, GatewaySite(Root(routes), Server()))
        self.addCleanup(unix.stopListening)

    @inlineCallbacks
    def get(self, agent: Agent, path: bytes, headers: dict[bytes, list[bytes]]) -> Any:
        """GET C{path}; fire with the status and the decoded JSON body."""
        response = yield agent.request(b"GET", b"http://loopd" + path, Headers(headers))
        body = yield readBody(response)
        return response.code, json.loads(body)

    def tcp_agent(self) -> Agent:
        """An Agent whose every connection goes to the TCP listener."""
        endpoints = _TcpEndpoints(self.reactor, self.port.getHost().port)
        agent: Agent = Agent.usingEndpointFactory(self.reactor, endpoints)
        return agent

    @inlineCallbacks
    def test_tcp(self) -> Any:
        """No token, a wrong one: 401 (OpenAI shape); Bearer and x-api-key: 200."""
        agent = self.tcp_agent()
        status, body = yield self.get(agent, b"/health", {})
        self.assertEqual((status, body["error"]["code"]), (401, "invalid_api_key"))
        status, body = yield self.get(agent, b"/health", {b"x-api-key": [b"wrong"]})
        self.assertEqual((status, body["error"]["code"]), (401, "invalid_api_key"))
        bearer = {b"authorization": [b"Bearer " + TOKEN.encode()]}
        self.assertEqual((yield self.get(agent, b"/health", bearer)), (200, {"status": "ok"}))
        api_key = {b"x-api-key": [TOKEN.encode()]}
        self.assertEqual((yield self.get(agent, b"/health", api_key)), (200, {"status": "ok"}))

    @inlineCallbacks
    def test_tcp_anthropic(self) -> Any:
        """/v1/messages without the token: 401 in Anthropic's shape."""
        status, body = yield self.get(self.tcp_agent(), b"/v1/messages?beta=true", {})
        self.assertEqual(status, 401)
        self.assertEqual((body["type"], body["error"]["type"]), ("error", "authentication_error"))

    @inlineCallbacks
    def test_unix_without_token(self) -> Any:
        """The Unix socket answers without a token."""
        agent = Agent.usingEndpointFactory(self.reactor, _UnixEndpoints(self.reactor, self.socket))
        self.assertEqual((yield self.get(agent, b"/health", {})), (200, {"status": "ok"}))


class FloodTests(SynchronousTestCase):
    """
    On the guarded listener, connections that have not shown the token cannot crowd out
    those that have (issue 26, item 1): at the cap the oldest of them is closed for the
    newcomer, and only connections that showed the token are never displaced.
    """

    CAP = 4

    def setUp(self) -> None:
        config = make_config()
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, max_connections=self.CAP)
        )
        self.harness = GatewayHarness(config)
        gateway = self.harness.gateway
        self.harness.site = gateway.site(
            guard=lambda root: TokenGuard(
                root, TOKEN, gateway.error_shapes(), on_refusal=gateway.metrics.observe_refusal
            )
        )
        replies = [answer({"content": "ok"}, delay_s=0) for _ in range(self.CAP)]
        self.harness.fake.script("POST", CHAT, *replies)

    def holder(self) -> Any:
        """A connection of the token holder that asks once and stays open (kept alive)."""
        connection = self.harness.connect()
        headers = ["Content-Type: application/json", f"Authorization: Bearer {TOKEN}"]
        connection.request("POST", CHAT, json.dumps(HI).encode(), headers)
        self.harness.advance(0.1)
        return connection

    def test_holder_served_through_a_flood(self) -> None:
        """
        A cap's worth of silent connections without the token, then the token holder: its
        connection displaces the oldest silent one and is answered; the flood goes on, and
        the holder is served again.
        """
        flood = [self.harness.connect() for _ in range(self.CAP)]
        first = self.holder()
        self.assertEqual([r.status for r in first.responses()], [200])
        self.assertTrue(flood[0].transport.disconnecting)
        self.assertEqual([c.transport.disconnecting for c in flood[1:]], [False] * 3)
        more = [self.harness.connect() for _ in range(self.CAP)]
        self.assertFalse(first.transport.disconnecting)
        second = self.holder()
        self.assertEqual([r.status for r in second.responses()], [200])
        self.assertEqual(sum(not c.transport.disconnecting for c in flood + more), 2)

    def test_proven_connections_kept(self) -> None:
        """When every open connection has shown the token, a newcomer is refused 503."""
        holders = [self.holder() for _ in range(self.CAP)]
        refused = self.harness.connect()
        self.assertEqual([r.status for r in refused.responses()], [503])
        self.assertEqual([h.transport.disconnecting for h in holders], [False] * self.CAP)
