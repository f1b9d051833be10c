"""
C{twist inferproxy}: the plugin is found, its options parse and validate, and the service it
builds exits with one line when the socket cannot be listened on.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins
from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase

from loopd.inferproxy import InferProxyService
from loopd.tap import ExitOnListenError
from loopd.tap.inferproxy import Options, makeService
from loopd.testing.reactor import MemoryLoopdReactor


class PluginTests(SynchronousTestCase):
    """
    The C{inferproxy} command is a Twisted plugin.
    """

    def test_discovered(self) -> None:
        """
        C{getPlugins(IServiceMaker)} lists C{inferproxy}, pointing at L{loopd.tap.inferproxy}.
        """
        makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}
        self.assertIn("inferproxy", makers)
        self.assertEqual(getattr(makers["inferproxy"], "module", None), "loopd.tap.inferproxy")


class OptionsTests(SynchronousTestCase):
    """
    L{Options} has the seed's defaults and refuses bad values.
    """

    def parse(self, *extra: str) -> Options:
        options = Options()
        options.parseOptions(["--listen", "/tmp/x.sock", "--upstream", "127.0.0.1:8080", *extra])
        return options

    def test_defaults(self) -> None:
        """
        Without options the limits are 8 connections, burst 10 and refill 2 per second, all
        numbers (not strings).
        """
        options = self.parse()
        self.assertEqual(options["max-connections"], 8)
        self.assertEqual(options["burst"], 10)
        self.assertEqual(options["refill"], 2.0)
        self.assertEqual(options["upstream_address"], ("127.0.0.1", 8080))

    def test_overrides(self) -> None:
        """
        Each limit can be set.
        """
        options = self.parse("--max-connections", "3", "--burst", "4", "--refill", "0.5")
        self.assertEqual((options["max-connections"], options["burst"]), (3, 4))
        self.assertEqual(options["refill"], 0.5)

    def test_required(self) -> None:
        """
        --listen and --upstream are required.
        """
        for argv in (["--listen", "/tmp/x"], ["--upstream", "h:1"], []):
            error = self.assertRaises(UsageError, Options().parseOptions, argv)
            self.assertIn("is required", str(error))

    def test_bad_values(self) -> None:
        """
        Limits that are not positive numbers and malformed upstreams are usage errors.
        """
        for extra in (
            ["--max-connections", "0"],
            ["--burst", "-1"],
            ["--burst", "x"],
            ["--refill", "0"],
            ["--refill", "inf"],
            ["--connect-timeout", "0"],
        ):
            self.assertRaises(UsageError, self.parse, *extra)
        options = Options()
        self.assertRaises(
            UsageError, options.parseOptions, ["--listen", "/tmp/x", "--upstream", "nohost"]
        )


class MakeServiceTests(SynchronousTestCase):
    """
    L{makeService} builds the forwarder from the options.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = os.path.join(self.directory, "s.sock")

    def build(self) -> ExitOnListenError:
        options = Options()
        options.parseOptions(
            ["--listen", self.path, "--upstream", "localhost:9", "--max-connections", "5"]
        )
        service = makeService(options, reactor=MemoryLoopdReactor())
        assert isinstance(service, ExitOnListenError)
        return service

    def test_limits_applied(self) -> None:
        """
        The service listens on --listen with the limits given.
        """
        service = self.build()
        (child,) = list(service)
        assert isinstance(child, InferProxyService)
        self.assertEqual(child.listen_path, self.path)
        self.assertEqual(child.factory.limits.max_connections, 5)
        self.assertEqual(child.factory.upstream_label, "localhost:9")

    def test_live_socket_exits_with_one_line(self) -> None:
        """
        When another process serves the socket, starting raises C{SystemExit} with a
        one-line message naming the command and the path.
        """
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(live.close)
        live.bind(self.path)
        live.listen(1)
        error = self.assertRaises(SystemExit, self.build().startService)
        message = str(error.code)
        self.assertTrue(message.startswith("inferproxy: "))
        self.assertIn(self.path, message)
        self.assertNotIn("\n", message)
