"""
The security invariant: no module of loopd except C{loopd/inferproxy.py} uses a TCP client
API. loopd reaches every model through a Unix socket; the forwarder is the one way out.
A TCP listener (C{[server] tcp}, behind its token: DESIGN decision 41) is not a connection,
so server endpoints are not counted; a test that asks that listener as a client is allowed
by name below.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import loopd

PACKAGE = Path(loopd.__file__).parent

#: Modules allowed to open TCP connections, relative to the package, and why.
ALLOWED = {
    "inferproxy.py": "the forwarder: the only component that speaks TCP upstream",
    # The harness that runs a real llama.cpp server for tests stands where the model host
    # stands; its readiness probe runs inside the server's own child process.
    "demo/real_server.py": "the real llama.cpp server's own test harness",
    "test/test_gateway_token_guard.py": "a test: the client of the TCP listener it tests",
}

#: Names whose use means a TCP (or TLS over TCP) client connection.
CLIENT_NAMES = frozenset(
    {
        "connectTCP",
        "connectSSL",
        "TCP4ClientEndpoint",
        "TCP6ClientEndpoint",
        "HostnameEndpoint",
        "SSL4ClientEndpoint",
        "create_connection",
        "HTTPConnection",
        "HTTPSConnection",
        "urlopen",
    }
)

#: Client endpoint description strings (clientFromString) for TCP or TLS.
CLIENT_STRING = re.compile(r"^(tcp6?|tls|ssl):", re.IGNORECASE)


def tcp_client_uses(source: str) -> list[str]:
    """
    Every use of a TCP client API in Python C{source}, as C{"line: what"} strings.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if CLIENT_STRING.match(node.value):
                found.append(f"{node.lineno}: client string {node.value!r}")
            continue
        if name in CLIENT_NAMES:
            found.append(f"{getattr(node, 'lineno', '?')}: {name}")
    return found


class ScannerTests(SynchronousTestCase):
    """
    L{tcp_client_uses} finds each form of TCP client use, and nothing else.
    """

    def test_finds_each_form(self) -> None:
        """
        Calls, imports, endpoint classes and endpoint strings are all found.
        """
        samples = [
            "reactor.connectTCP('h', 1, f)",
            "from twisted.internet.endpoints import TCP4ClientEndpoint",
            "e = endpoints.TCP6ClientEndpoint(r, '::1', 1)",
            "e = HostnameEndpoint(r, b'h', 1)",
            "clientFromString(reactor, 'tcp:host=h:port=1')",
            "clientFromString(reactor, 'tls:h:443')",
            "socket.create_connection(('h', 1))",
            "from http.client import HTTPConnection",
            "urllib.request.urlopen('http://h/')",
        ]
        for sample in samples:
            self.assertNotEqual(tcp_client_uses(sample), [], sample)

    def test_unix_is_fine(self) -> None:
        """
        Unix client endpoints, servers and plain strings are not TCP client use.
        """
        source = (
            "e = UNIXClientEndpoint(reactor, '/run/x.sock')\n"
            "reactor.listenTCP(0, f)\n"
            "TCP4ServerEndpoint(reactor, 0, interface='127.0.0.1').listen(f)\n"
            "TCP6ServerEndpoint(reactor, 0, interface='::1')\n"
            "clientFromString(reactor, 'unix:/run/x.sock')\n"
            "text = 'see tcp: below'\n"
        )
        self.assertEqual(tcp_client_uses(source), [])


class InvariantTests(SynchronousTestCase):
    """
    The package as it stands keeps the invariant.
    """

    def test_only_inferproxy_uses_tcp(self) -> None:
        """
        No module of loopd other than the allowed ones uses a TCP client API.
        """
        offenders = []
        for path in sorted(PACKAGE.rglob("*.py")):
            relative = path.relative_to(PACKAGE).as_posix()
            if relative in ALLOWED or relative == "test/test_tcp_invariant.py":
                continue
            for use in tcp_client_uses(path.read_text(encoding="utf-8")):
                offenders.append(f"loopd/{relative}:{use}")
        self.assertEqual(offenders, [])

    def test_allowed_modules_exist(self) -> None:
        """
        Every allowed module exists and does use a TCP client, so no stale or needless entry
        widens the allowance.
        """
        for relative in ALLOWED:
            source = (PACKAGE / relative).read_text(encoding="utf-8")
            self.assertNotEqual(tcp_client_uses(source), [], relative)

    def test_inferproxy_is_scanned_as_tcp(self) -> None:
        """
        The scanner does see the forwarder's own TCP client, so a clean result elsewhere
        means something.
        """
        source = (PACKAGE / "inferproxy.py").read_text(encoding="utf-8")
        self.assertNotEqual(tcp_client_uses(source), [])
