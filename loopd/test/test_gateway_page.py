"""
Tests for L{loopd.gateway.page}: C{/} by content negotiation, the page's files and their
headers, and what the files themselves may hold (no inline script, nothing from another
site, every field of the status document drawn).

The gateway runs in memory (L{GatewayHarness}); the files are read from the package.
"""

from __future__ import annotations

import configparser
import fnmatch
import json
import re
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from typing import Any

from twisted.logger import capturedLogs, formatEvent
from twisted.trial.unittest import SynchronousTestCase

import loopd
from loopd.gateway.page import (
    CONTENT_SECURITY_POLICY,
    COOKIE_ROUTES,
    PAGE_FILES,
    PUBLIC_ROUTES,
    page_file,
    route_of,
    wants_html,
)
from loopd.testing.fake_llama import CHAT
from loopd.testing.gateway import HI, GatewayHarness, Response
from loopd.testing.llama_replies import answer

#: What Chromium sends when it opens a page.
BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,*/*;q=0.8"
PAGE_DIR = Path(loopd.__file__).parent / "gateway" / "page"


def ask(harness: GatewayHarness, method: str, target: str, *headers: str) -> Response:
    """One request on a new connection; its one response."""
    connection = harness.connect()
    connection.request(method, target, None, list(headers))
    return connection.response()


class WantsHtmlTests(SynchronousTestCase):
    """
    L{wants_html} tells a browser's C{Accept} from everyone else's.
    """

    def test_table(self) -> None:
        """C{text/html} with a quality above zero is a browser; nothing else is."""
        cases = {
            BROWSER.encode(): True,
            b"text/html": True,
            b"TEXT/HTML; charset=utf-8": True,
            b"application/json, text/html;q=0.1": True,
            b"text/html;q=0": False,
            b"text/html;q=nonsense": False,
            b"*/*": False,
            b"application/json": False,
            b"text/*": False,
            b"": False,
            None: False,
        }
        for accept, expected in cases.items():
            self.assertEqual(wants_html(accept), expected, accept)

    def test_route_of(self) -> None:
        """A trailing slash is dropped as the routes drop it; C{/} stays."""
        self.assertEqual(route_of(b"/"), b"/")
        self.assertEqual(route_of(b"//"), b"/")
        self.assertEqual(route_of(b"/v1/status/"), b"/v1/status")


class IndexTests(SynchronousTestCase):
    """
    C{/}: the page for a browser, the JSON index for everyone else, exactly as before.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness()

    def test_browser_gets_the_page(self) -> None:
        """A browser's C{GET /} is the page, with the page's headers and C{Vary: Accept}."""
        response = ask(self.harness, "GET", "/", f"Accept: {BROWSER}")
        self.assertEqual(response.status, 200)
        self.assertEqual(response.headers["content-type"], "text/html; charset=utf-8")
        self.assertEqual(response.body, page_file("index.html").body)
        self.assertEqual(response.headers["vary"], "Accept")
        self.assertEqual(
            response.headers["content-security-policy"], CONTENT_SECURITY_POLICY.decode()
        )
        self.assertEqual(response.headers["x-content-type-options"], "nosniff")
        self.assertEqual(response.headers["referrer-policy"], "no-referrer")
        self.assertIn("default-src 'self'", response.headers["content-security-policy"])
        self.assertNotIn("unsafe-inline", response.headers["content-security-policy"])

    def test_clients_get_the_index(self) -> None:
        """
        curl, the SDKs and JSON clients get the JSON index, the same body as the gateway's
        own index, whatever C{Accept} they send that does not name C{text/html}.
        """
        expected = self.harness.gateway._index()[1]
        for headers in (
            [],
            ["Accept: */*"],
            ["Accept: application/json"],
            ["Accept: text/html;q=0"],
        ):
            response = ask(self.harness, "GET", "/", *headers)
            self.assertEqual(response.status, 200, headers)
            self.assertEqual(response.headers["content-type"], "application/json")
            self.assertEqual(response.json(), expected)
            self.assertEqual(response.headers["vary"], "Accept")
            self.assertNotIn("content-security-policy", response.headers)

    def test_head_probe_unchanged(self) -> None:
        """
        Claude Code's C{HEAD /} (C{Accept: */*} or none) is the index's 200, its length and
        no body, and logs nothing; a browser's C{HEAD /} has the page's length.
        """
        index = ask(self.harness, "GET", "/")
        with capturedLogs() as events:
            for headers in ([], ["Accept: */*"]):
                head = ask(self.harness, "HEAD", "/", *headers)
                self.assertEqual((head.status, head.body), (200, b""))
                self.assertEqual(head.headers["content-length"], str(len(index.body)))
            page = ask(self.harness, "HEAD", "/", f"Accept: {BROWSER}")
        self.assertEqual((page.status, page.body), (200, b""))
        self.assertEqual(page.headers["content-length"], str(len(page_file("index.html").body)))
        self.assertEqual([formatEvent(event) for event in events], [])

    def test_post_is_405(self) -> None:
        """C{POST /} is a JSON 405 naming GET and HEAD, as for every read-only route."""
        response = ask(self.harness, "POST", "/")
        self.assertEqual(response.status, 405)
        self.assertEqual(response.headers["allow"], "GET, HEAD")


class FileTests(SynchronousTestCase):
    """
    The page's files under C{/ui/}: their types, headers and caching.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness()

    def test_each_file(self) -> None:
        """
        Each file answers with its body, its content type, the page's headers,
        C{Cache-Control: no-cache} and an C{ETag}.
        """
        types = {
            "page.css": "text/css; charset=utf-8",
            "page.js": "text/javascript; charset=utf-8",
            "login.js": "text/javascript; charset=utf-8",
            "icon.svg": "image/svg+xml",
        }
        self.assertEqual(sorted(PAGE_FILES.values()), sorted(types))
        for route, name in PAGE_FILES.items():
            response = ask(self.harness, "GET", route.decode())
            self.assertEqual(response.status, 200, route)
            self.assertEqual(response.body, (PAGE_DIR / name).read_bytes())
            self.assertEqual(response.headers["content-type"], types[name])
            self.assertEqual(response.headers["x-content-type-options"], "nosniff")
            self.assertEqual(
                response.headers["content-security-policy"], CONTENT_SECURITY_POLICY.decode()
            )
            self.assertEqual(response.headers["cache-control"], "no-cache")
            self.assertEqual(response.headers["etag"], page_file(name).etag.decode())

    def test_not_modified(self) -> None:
        """The file's C{ETag} in C{If-None-Match} is a 304 without a body; another is a 200."""
        etag = page_file("page.js").etag.decode()
        response = ask(self.harness, "GET", "/ui/page.js", f"If-None-Match: {etag}")
        self.assertEqual((response.status, response.body), (304, b""))
        response = ask(self.harness, "GET", "/ui/page.js", 'If-None-Match: "old"')
        self.assertEqual(response.status, 200)

    def test_head(self) -> None:
        """C{HEAD} of a file: its headers and length, no body, nothing logged."""
        with capturedLogs() as events:
            response = ask(self.harness, "HEAD", "/ui/page.css")
        self.assertEqual((response.status, response.body), (200, b""))
        self.assertEqual(response.headers["content-length"], str(len(page_file("page.css").body)))
        self.assertEqual([formatEvent(event) for event in events], [])

    def test_unknown_file(self) -> None:
        """A file the page does not have is the JSON 404 of any unknown path."""
        response = ask(self.harness, "GET", "/ui/secret.txt")
        self.assertEqual(response.status, 404)
        self.assertEqual(response.json()["error"]["code"], "not_found")

    def test_routes_are_files(self) -> None:
        """Every public or cookie route is one the site serves."""
        for route in sorted(COOKIE_ROUTES | PUBLIC_ROUTES):
            response = ask(self.harness, "GET", route.decode())
            self.assertEqual(response.status, 200, route)


class _Markup(HTMLParser):
    """The script tags, style sheets, inline handlers and URLs of an HTML file."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.references: list[str] = []
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "script":
            self.scripts.append(found)
            self._in_script = True
        if tag == "style":
            self.inline.append("<style>")
        for name, value in attrs:
            if name.startswith("on") or name == "style":
                self.inline.append(f"{tag} {name}")
            if name in ("src", "href") and value is not None:
                self.references.append(value)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append("inline script")


class FileContentTests(SynchronousTestCase):
    """
    What the page's files hold: only what the Content-Security-Policy allows, nothing from
    another site, and every field of the status document.
    """

    def html_files(self) -> list[Path]:
        return sorted(PAGE_DIR.glob("*.html"))

    def test_no_inline_code(self) -> None:
        """No HTML file has an inline script, a style element or attribute, or a handler."""
        self.assertEqual(len(self.html_files()), 3)
        for path in self.html_files():
            markup = _Markup()
            markup.feed(path.read_text(encoding="utf-8"))
            self.assertEqual(markup.inline, [], path.name)
            for script in markup.scripts:
                self.assertTrue((script.get("src") or "").startswith("/ui/"), path.name)

    def test_nothing_from_another_site(self) -> None:
        """
        Every file the HTML names is one the page serves, and no file names another site
        (no CDN, no font service: the page works offline).
        """
        served = {route.decode() for route in PAGE_FILES}
        for path in self.html_files():
            markup = _Markup()
            markup.feed(path.read_text(encoding="utf-8"))
            self.assertEqual([r for r in markup.references if r not in served], [], path.name)
        for path in sorted(PAGE_DIR.iterdir()):
            text = path.read_text(encoding="utf-8")
            urls = re.findall(r"https?://[^\s\"'<>]+", text)
            self.assertEqual([u for u in urls if u != "http://www.w3.org/2000/svg"], [], path.name)

    def test_script_writes_text(self) -> None:
        """The scripts put the document's values in as text, never as markup."""
        for name in ("page.js", "login.js"):
            text = (PAGE_DIR / name).read_text(encoding="utf-8")
            for unsafe in (
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
            ):
                self.assertNotIn(unsafe, text, name)

    def test_every_field_drawn(self) -> None:
        """
        The page's script reads every field of the status document (a document with an
        endpoint, a session, a finished request, one under way and a lease queue).
        """
        harness = GatewayHarness(leases=True)
        harness.fake.script("POST", CHAT, answer({"content": "a"}), answer({"content": "b"}))
        connection = harness.connect()
        connection.request(
            "POST", CHAT, json.dumps(HI).encode(), ["X-Session-Id: s1", "User-Agent: t/1"]
        )
        harness.advance(1)
        harness.post(HI, "s2")
        document = harness.get("/v1/status").response().json()
        self.assertTrue(document["requests"] and document["in_flight"] and document["leases"])
        script = (PAGE_DIR / "page.js").read_text(encoding="utf-8")
        used = set(re.findall(r"\.([A-Za-z_]+)", script))
        missing = sorted(key for key in _keys(document) if key not in used)
        self.assertEqual(missing, [])


def _keys(value: Any) -> set[str]:
    """Every key of every object in a JSON document."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            found.add(key)
            found |= _keys(item)
    elif isinstance(value, list):
        for item in value:
            found |= _keys(item)
    return found


class PackageDataTests(SynchronousTestCase):
    """
    The page's files go into the package: setup.cfg's package data names each one, and the
    installed package can read them.
    """

    def test_setup_lists_every_file(self) -> None:
        """Each file in loopd/gateway/page/ matches a glob of setup.cfg's package data."""
        parser = configparser.ConfigParser()
        parser.read(PAGE_DIR.parent.parent.parent / "setup.cfg")
        globs = [g.strip() for g in parser["options.package_data"]["loopd.gateway"].split(",")]
        files = sorted(path.name for path in PAGE_DIR.iterdir())
        self.assertEqual(
            [f for f in files if not any(fnmatch.fnmatch(f"page/{f}", g) for g in globs)], []
        )

    def test_readable_as_resources(self) -> None:
        """The files are read through importlib.resources, as an installed package has them."""
        page = resources.files("loopd.gateway") / "page" / "index.html"
        self.assertIn(b"/ui/page.js", page.read_bytes())
