"""
Tests for L{loopd.status_command}: C{loopd status} against a gateway in memory (with
leases) and once over a real Unix socket: the document printed for a terminal or as JSON,
C{--watch} on the clock, and one line for each way the status cannot be had.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd import cli
from loopd.gateway.site import Gateway
from loopd.reactor import ILoopdReactor, global_reactor
from loopd.status_command import CLEAR_SCREEN, INTERRUPTED, status_command
from loopd.status_show import render_document
from loopd.testing.fake_llama import CHAT, FakeLlama
from loopd.testing.gateway import HI, NOW, GatewayHarness, make_config
from loopd.testing.llama_replies import answer
from loopd.unixsocket import listen_unix

GATEWAY = "/tmp/ld-memory/cli-loopd.sock"


class StatusCommandTests(SynchronousTestCase):
    """
    C{loopd status} asks a gateway (in memory, with leases) for C{/v1/status} and prints
    it, once or every 2 s, or says in one line why it cannot.
    """

    def setUp(self) -> None:
        self.harness = GatewayHarness(leases=True)
        self.harness.net.listen(GATEWAY, self.harness.site)
        self.harness.fake.script("POST", CHAT, answer({"content": "Hi"}))
        self.harness.post(HI, session="s1")
        self.harness.advance(1)
        self.out: list[str] = []
        self.err: list[str] = []

    def status(self, socket_path: str = GATEWAY, **kwargs: Any) -> Any:
        """Run the command on the harness's clock; its Deferred."""
        d = status_command(
            self.harness.reactor, socket_path, self.out.append, self.err.append, **kwargs
        )
        self.harness.advance(0.01)
        return d

    def document(self) -> Any:
        """The gateway's status document now."""
        return self.harness.get("/v1/status").response().json()

    def test_prints(self) -> None:
        """The document as L{render_document} prints it; status 0."""
        self.assertEqual(self.successResultOf(self.status()), 0)
        self.assertEqual("".join(self.out), render_document(self.document()))
        self.assertIn("  s1  ", "".join(self.out))
        self.assertEqual(self.err, [])

    def test_json(self) -> None:
        """--json prints the document as loopd sent it, one line."""
        self.assertEqual(self.successResultOf(self.status(as_json=True)), 0)
        [text] = self.out
        self.assertTrue(text.endswith("\n"))
        self.assertEqual(json.loads(text)["sessions"][0]["id"], "s1")

    def test_watch(self) -> None:
        """
        --watch clears the screen and prints again every 2 s on the reactor's clock, the
        latest state each time, until cancelled (which stops the asking).
        """
        d = self.status(watch=True)
        self.assertEqual(len(self.out), 1)
        self.assertTrue(self.out[0].startswith(CLEAR_SCREEN + "every 2 s; Ctrl-C to stop\n"))
        self.harness.advance(1.9)
        self.assertEqual(len(self.out), 1)
        self.harness.fake.script("POST", CHAT, answer({"content": "Hi"}))
        self.harness.post(HI, session="s2")
        self.harness.advance(0.2)
        self.assertEqual(len(self.out), 2)
        self.assertIn("  s2  ", self.out[1])
        self.assertNoResult(d)
        d.cancel()
        self.assertEqual(self.successResultOf(d), INTERRUPTED)
        self.harness.advance(10)
        self.assertEqual(len(self.out), 2)

    def test_watch_not_a_terminal(self) -> None:
        """Not on a terminal, --watch clears nothing: a blank line between the frames."""
        d = self.status(watch=True, clear=False)
        self.harness.advance(2)
        d.cancel()
        self.assertNotIn("\x1b", "".join(self.out))
        self.assertTrue(self.out[1].startswith("\nevery 2 s"))

    def test_watch_json(self) -> None:
        """--watch --json prints one document a line."""
        d = self.status(watch=True, as_json=True)
        self.harness.advance(2)
        d.cancel()
        self.assertEqual(len(self.out), 2)
        for line in self.out:
            self.assertEqual(line.count("\n"), 1)
            self.assertEqual(json.loads(line)["loopd"]["now"], NOW)

    def test_watch_goes_on(self) -> None:
        """--watch shows a failure in place, and shows the status again once loopd is back."""
        d = self.status(watch=True)
        self.harness.net.stop_listening(GATEWAY)
        self.harness.advance(2)
        self.assertIn("loopd status: cannot reach loopd: ", self.out[1])
        self.harness.net.listen(GATEWAY, self.harness.site)
        self.harness.advance(2)
        self.assertIn("sessions (1)", self.out[2])
        d.cancel()

    def test_not_running(self) -> None:
        """Nothing at the socket: one line saying so, status 1."""
        self.assertEqual(self.successResultOf(self.status("/tmp/ld-memory/none.sock")), 1)
        [line] = self.err
        self.assertTrue(line.startswith("loopd status: cannot reach loopd: /tmp/ld-memory/"))
        self.assertTrue(line.endswith("is twist loopd running? (or pass --socket)\n"))
        self.assertEqual(self.out, [])

    def test_not_loopd(self) -> None:
        """An HTTP server without /v1/status (a llama-server, say) is named as not loopd."""
        self.harness.net.listen("/tmp/ld-memory/other.sock", FakeLlama(self.harness.reactor))
        self.assertEqual(self.successResultOf(self.status("/tmp/ld-memory/other.sock")), 1)
        self.assertEqual(
            self.err,
            [
                "loopd status: /tmp/ld-memory/other.sock is not a loopd gateway with a status "
                "document: GET /v1/status answered HTTP 404\n"
            ],
        )

    def test_not_a_socket(self) -> None:
        """A path that is not a socket is not connected to."""
        self.assertEqual(self.successResultOf(self.status("/etc/hostname")), 1)
        self.assertIn("loopd status: not connecting to /etc/hostname: ", self.err[0])

    def test_main(self) -> None:
        """C{loopd status --socket} runs the command with the socket given."""
        self.patch(sys, "stdout", io.StringIO())

        # The status command uses only what the memory reactor has: timers, Unix sockets.
        reactor = cast(ILoopdReactor, self.harness.reactor)

        def run(command: cli.Command) -> int:
            d = command(reactor)
            self.harness.advance(0.01)
            return self.successResultOf(d)

        self.assertEqual(cli.main(["status", "--socket", GATEWAY], run=run), 0)
        stdout = sys.stdout
        assert isinstance(stdout, io.StringIO)
        self.assertIn("lease queues", stdout.getvalue())


class RealSocketStatusTests(TestCase):
    """C{loopd status} against a gateway listening on a real Unix socket."""

    def test_real_socket(self) -> Deferred[None]:
        """The status of a real gateway's socket, over the real reactor."""
        reactor = global_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        gateway = Gateway(reactor, make_config(), {})
        path = os.path.join(directory, "loopd.sock")
        port = listen_unix(reactor, path, gateway.site())
        self.addCleanup(port.stopListening)
        out: list[str] = []
        d = status_command(reactor, path, out.append, out.append)

        def printed(status: int) -> None:
            self.assertEqual(status, 0)
            self.assertIn("tiny  llama-server  model tiny", "".join(out))

        return d.addCallback(printed)
