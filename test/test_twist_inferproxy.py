"""
`twist inferproxy` as a real process: it starts with one line, forwards, keeps its socket at
0600, refuses a live socket with one line, takes over a stale one and removes its socket on
SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase

import loopd
from loopd.test.support.peers import Peer, UpstreamFactory, real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

ROOT = Path(loopd.__file__).parent.parent


class TwistInferproxyTests(TestCase):
    """
    The command as users run it.
    """

    timeout = 60

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = os.path.join(self.directory, "infer.sock")
        reactor = real_reactor()

        def echo(peer: Peer) -> None:
            peer.on_data = lambda p, data: p.transport.write(data)

        port = reactor.listenTCP(0, UpstreamFactory(echo), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.upstream = f"127.0.0.1:{port.getHost().port}"

    def spawn(self) -> TwistProcess:
        """
        Start C{twist inferproxy} from the checkout root, as the README says.
        """
        process = spawn_twist(
            real_reactor(),
            b"inferproxy listening on",
            "inferproxy",
            "--listen",
            self.path,
            "--upstream",
            self.upstream,
        )
        self.addCleanup(stop_twist, process)
        return process

    @inlineCallbacks
    def round_trip(self) -> Any:
        client = Peer()
        answered: Deferred[None] = Deferred()
        client.on_data = lambda peer, data: answered.callback(None)
        endpoint = UNIXClientEndpoint(real_reactor(), self.path)
        yield endpoint.connect(Factory.forProtocol(lambda: client))
        client.transport.write(b"ping")
        yield answered
        client.transport.loseConnection()
        yield client.closed
        return bytes(client.received)

    @inlineCallbacks
    def test_serves_then_sigterm_removes_socket(self) -> Any:
        """
        The process logs one start line naming the path and upstream, forwards through a
        0600 socket, and on SIGTERM ends (by that signal, as twist does) after removing the
        socket.
        """
        process = self.spawn()
        yield process.ready
        start_lines = [line for line in process.output.splitlines() if b"[loopd.inferproxy" in line]
        self.assertEqual(len(start_lines), 1)
        self.assertIn(self.upstream.encode(), start_lines[0])
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)
        reply = yield self.round_trip()
        self.assertEqual(reply, b"ping")
        process.transport.signalProcess("TERM")
        yield process.ended
        self.assertEqual(process.signal, signal.SIGTERM)
        self.assertIn(b"Main loop terminated", process.output)
        self.assertFalse(os.path.exists(self.path))

    @inlineCallbacks
    def test_live_socket_refused(self) -> Any:
        """
        A second inferproxy on a served path exits 1 with a one-line reason, and the first
        goes on serving.
        """
        first = self.spawn()
        yield first.ready
        second = self.spawn()
        second.ready.addErrback(lambda _: None)
        code = yield second.ended
        self.assertEqual(code, 1)
        self.assertEqual(second.errors.strip().count(b"\n"), 0)
        self.assertIn(b"inferproxy: ", second.errors)
        self.assertIn(b"in use", second.errors)
        reply = yield self.round_trip()
        self.assertEqual(reply, b"ping")

    @inlineCallbacks
    def test_stale_socket_replaced(self) -> Any:
        """
        A socket file left by a dead process is replaced.
        """
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(self.path)
        dead.close()
        process = self.spawn()
        yield process.ready
        reply = yield self.round_trip()
        self.assertEqual(reply, b"ping")
