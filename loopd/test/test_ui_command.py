"""
Tests for L{loopd.ui_command} (C{loopd ui}) and its place in L{loopd.cli}: the gateway's
own Unix site in memory (L{GatewayHarness}, its socket on a L{MemoryNet}) answers the
command on the harness's clock; one test asks a real gateway site on a real Unix socket.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from loopd import cli
from loopd.gateway.channel import GatewaySite
from loopd.gateway.page_login import LoginCodeRoute, PageLogins
from loopd.gateway.web import JsonRoute, Root
from loopd.settings import Server
from loopd.test.support.peers import real_reactor
from loopd.testing.gateway import GatewayHarness
from loopd.ui_command import open_in_browser, ui_command
from loopd.unixsocket import listen_unix

PAGE_URL = "http://127.0.0.1:8421"


class _Output:
    """What a command wrote to stdout and stderr."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.err: list[str] = []

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


class UiCommandTests(SynchronousTestCase):
    """
    C{loopd ui} against the gateway's Unix site, in memory.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness()
        self.harness.gateway.page_url = PAGE_URL
        self.directory = tempfile.mkdtemp(prefix="ldui", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.socket = os.path.join(self.directory, "loopd.sock")
        self.opened: list[str] = []

    def serve(self, site: Any = None) -> None:
        """Serve C{site} (default: the gateway's Unix site) at the socket, in memory."""
        self.harness.net.listen(self.socket, site or self.harness.site)

    def ui(self, browser: bool | None = None) -> tuple[int, _Output]:
        """
        Run the command to its end on the harness's clock; its status and output.

        @param browser: None: no C{--open}; else whether the fake browser opens.
        """
        output = _Output()

        def open_browser(url: str) -> bool:
            self.opened.append(url)
            return bool(browser)

        d = ui_command(
            self.harness.reactor,
            self.socket,
            output.out.append,
            output.err.append,
            open_browser=None if browser is None else open_browser,
        )
        self.harness.advance(1)
        return self.successResultOf(d), output

    def test_link(self) -> None:
        """
        The link, alone, on stdout; on stderr that it is good once, for 60 s; the code in
        the link is one the gateway will take.
        """
        self.serve()
        status, output = self.ui()
        self.assertEqual(status, 0)
        (line,) = output.stdout.splitlines()
        self.assertTrue(line.startswith(f"{PAGE_URL}/ui/login#"), line)
        self.assertIn("within 60 s", output.stderr)
        self.assertEqual(self.opened, [])
        code = line.split("#", 1)[1]
        self.assertIsNotNone(self.harness.gateway.logins.redeem(code))

    def test_open(self) -> None:
        """With C{--open} the link is opened too; a browser that cannot be opened is said."""
        self.serve()
        status, output = self.ui(browser=True)
        self.assertEqual((status, self.opened), (0, [output.stdout.strip()]))
        self.assertNotIn("no browser", output.stderr)
        status, output = self.ui(browser=False)
        self.assertEqual(status, 0)
        self.assertIn("no browser could be opened here: open the link yourself", output.stderr)

    def test_each_link_is_new(self) -> None:
        """Two runs give two codes."""
        self.serve()
        first = self.ui()[1].stdout
        second = self.ui()[1].stdout
        self.assertNotEqual(first, second)

    def test_no_tcp_listener(self) -> None:
        """A loopd without a TCP listener: exit 1, stderr says the page needs [server] tcp."""
        self.harness.gateway.page_url = None
        self.serve()
        status, output = self.ui(browser=True)
        self.assertEqual((status, output.stdout, self.opened), (1, "", []))
        self.assertIn("loopd has no TCP listener", output.stderr)
        self.assertIn("[server] tcp", output.stderr)

    def test_not_running(self) -> None:
        """
        No socket, or a stale one: exit 1, stderr says loopd is not running and how to start
        it.
        """
        status, output = self.ui()
        self.assertEqual((status, output.stdout), (1, ""))
        self.assertIn("loopd is not running", output.stderr)
        self.assertIn(self.socket, output.stderr)
        self.assertIn("twist loopd", output.stderr)
        self.serve()
        self.harness.net.stop_listening(self.socket, stale=True)
        status, output = self.ui()
        self.assertEqual(status, 1)
        self.assertIn("loopd is not running", output.stderr)

    def test_older_loopd(self) -> None:
        """A gateway without the route (404): exit 1, saying it may be an older loopd."""
        self.serve(GatewaySite(Root({}), Server(), reactor=self.harness.reactor))
        status, output = self.ui()
        self.assertEqual(status, 1)
        self.assertIn("no route /v1/ui/login", output.stderr)
        self.assertIn("older version", output.stderr)

    def test_nonsense(self) -> None:
        """An answer that is not a login link: exit 1, naming the status."""
        site = GatewaySite(
            Root({b"/v1/ui/login": _Post(b"<html>")}), Server(), reactor=self.harness.reactor
        )
        self.serve(site)
        status, output = self.ui()
        self.assertEqual(status, 1)
        self.assertIn("loopd answered 200 to /v1/ui/login", output.stderr)

    def test_silent(self) -> None:
        """A socket that accepts and never answers: exit 1 after the command's timeout."""
        self.serve(
            GatewaySite(Root({b"/v1/ui/login": _Never()}), Server(), reactor=self.harness.reactor)
        )
        output = _Output()
        d = ui_command(self.harness.reactor, self.socket, output.out.append, output.err.append)
        self.harness.advance(9)
        self.assertNoResult(d)
        self.harness.advance(1)
        self.assertEqual(self.successResultOf(d), 1)
        self.assertIn("did not answer", output.stderr)

    def test_unsafe_socket(self) -> None:
        """A socket in a directory others may write: not asked, exit 1."""
        os.chmod(self.directory, 0o777)
        status, output = self.ui()
        self.assertEqual(status, 1)
        self.assertIn("loopd ui: not connecting", output.stderr)


class _Post(Resource):
    """A route that answers POST with fixed bytes."""

    isLeaf = True

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self._body = body

    def render_POST(self, request: Any) -> bytes:
        return self._body


class _Never(Resource):
    """A route that never answers."""

    isLeaf = True

    def render_POST(self, request: Any) -> int:
        return NOT_DONE_YET


class RealSocketTests(TestCase):
    """
    C{loopd ui} asks a real gateway route on a real Unix socket.
    """

    @inlineCallbacks
    def test_real_socket(self) -> Any:
        """The link comes over a real socket, 0600 in a 0700 directory."""
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ldui", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "loopd.sock")
        logins = PageLogins(reactor)
        routes: dict[bytes, Resource] = {
            b"/v1/ui/login": LoginCodeRoute(logins, lambda: PAGE_URL, local=True),
            b"/health": JsonRoute(lambda: (200, {})),
        }
        port = listen_unix(reactor, path, GatewaySite(Root(routes), Server(), reactor=reactor))
        self.addCleanup(port.stopListening)
        output = _Output()
        status = yield ui_command(reactor, path, output.out.append, output.err.append)
        self.assertEqual(status, 0, output.stderr)
        code = output.stdout.strip().split("#", 1)[1]
        self.assertIsNotNone(logins.redeem(code))


class CliTests(SynchronousTestCase):
    """
    C{loopd ui} in the C{loopd} command: its options and which socket it asks.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ldui", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.stderr = io.StringIO()
        self.patch(sys, "stderr", self.stderr)
        self.calls: list[tuple[Any, ...]] = []
        self.patch(cli, "ui_command", self.fake_command)

    def fake_command(self, reactor: Any, socket: str, write: Any, err: Any, **kwargs: Any) -> Any:
        self.calls.append((socket, kwargs))
        return 0

    def run_command(self, command: cli.Command) -> int:
        """A runner for L{cli.main}: the (fake) command's status, at once."""
        result: Any = command(None)  # type: ignore[arg-type]
        return int(result)

    def test_socket(self) -> None:
        """C{--socket} is asked; without C{--open} nothing is opened."""
        self.assertEqual(cli.main(["ui", "--socket", "/x/loopd.sock"], run=self.run_command), 0)
        self.assertEqual(self.calls, [("/x/loopd.sock", {"open_browser": None})])

    def test_open(self) -> None:
        """C{--open} opens with the user's browser (L{open_in_browser})."""
        cli.main(["ui", "--open", "--socket", "/x/loopd.sock"], run=self.run_command)
        self.assertEqual(self.calls, [("/x/loopd.sock", {"open_browser": open_in_browser})])

    def test_config(self) -> None:
        """C{--config} asks that config's [server] listen socket."""
        path = os.path.join(self.directory, "loopd.toml")
        with open(path, "w") as f:
            f.write(
                '[server]\nlisten = "unix:/run/x/gw.sock"\ntcp = "127.0.0.1:0"\n'
                '[[endpoint]]\nname = "tiny"\nsocket = "/run/x/tiny.sock"\n'
            )
        self.assertEqual(cli.main(["ui", "--config", path], run=self.run_command), 0)
        self.assertEqual(self.calls[0][0], "/run/x/gw.sock")

    def test_bad_config(self) -> None:
        """A config that cannot be read is a usage error (2), said on stderr."""
        missing = os.path.join(self.directory, "missing.toml")
        self.assertEqual(cli.main(["ui", "--config", missing], run=self.run_command), 2)
        self.assertIn("loopd ui:", self.stderr.getvalue())
        self.assertEqual(self.calls, [])

    def test_parser(self) -> None:
        """C{--config} and C{--socket} exclude each other."""
        with self.assertRaises(SystemExit):
            cli.build_parser().parse_args(["ui", "--config", "a", "--socket", "b"])
