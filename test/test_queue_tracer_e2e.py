"""
The seed's two-session tracer bullet: two client processes, each streaming several requests
to one stub endpoint with one slot, take their turns through C{twist llmqueue}; the stub
sees their requests one at a time, never overlapping.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, gatherResults, inlineCallbacks
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import ROOT, spawn_twist, stop_twist
from loopd.unixsocket import listen_unix

CHUNKS = 5
CHUNK_GAP = 0.02
REQUESTS = 4


class OneSlotStub(Resource):
    """
    A streaming chat endpoint that records how many requests it runs at once.

    @ivar log: C{("start"|"end", session)} in the order they happened.
    """

    isLeaf = True

    def __init__(self, reactor: Any) -> None:
        """Nothing running yet."""
        super().__init__()
        self._reactor = reactor
        self.running = 0
        self.most = 0
        self.log: list[tuple[str, str]] = []

    def render_POST(self, request: Request) -> int:
        """Stream C{CHUNKS} events C{CHUNK_GAP} seconds apart, then C{[DONE]}."""
        session = (request.getHeader(b"x-session-id") or b"?").decode()
        self.running += 1
        self.most = max(self.most, self.running)
        self.log.append(("start", session))
        request.setHeader(b"content-type", b"text/event-stream")
        self._next(request, session, 0)
        return NOT_DONE_YET

    def _next(self, request: Request, session: str, sent: int) -> None:
        """Send the next event, or end the answer."""
        if sent == CHUNKS:
            request.write(b"data: [DONE]\n\n")
            self.running -= 1
            self.log.append(("end", session))
            request.finish()
            return
        request.write(b"data: " + json.dumps({"n": sent}).encode() + b"\n\n")
        self._reactor.callLater(CHUNK_GAP, self._next, request, session, sent + 1)


class _Session(ProcessProtocol):
    """A lease_session child: its output, and its exit code."""

    def __init__(self) -> None:
        """Nothing received yet."""
        self.output = b""
        self.ended: Deferred[int] = Deferred()

    def outReceived(self, data: bytes) -> None:
        """Keep the output (for the failure message)."""
        self.output += data

    errReceived = outReceived

    def processEnded(self, reason: Failure) -> None:
        """Fire C{ended} with the exit code."""
        ended: Any = reason.value
        self.ended.callback(0 if reason.check(ProcessDone) else ended.exitCode)


class TwoSessionTests(TestCase):
    """
    Two sessions, one slot, one daemon.
    """

    timeout = 120

    @inlineCallbacks
    def test_requests_never_overlap(self) -> Any:
        """Each process streams all its requests; the stub never runs two at once."""
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        with open(os.path.join(directory, "llm-queue.json"), "w") as config:
            json.dump({"defaults": {"daemonIdleExitMs": 60000}}, config)
        daemon = spawn_twist(
            reactor,
            b"llmqueue: listening",
            *("llmqueue", "--agent-dir", directory, "--sweep-ms", "50"),
        )
        self.addCleanup(stop_twist, daemon)
        yield daemon.ready
        stub = OneSlotStub(reactor)
        endpoint = os.path.join(directory, "stub.sock")
        port = listen_unix(reactor, endpoint, Site(stub))
        self.addCleanup(port.stopListening)
        sessions = []
        for name in ("alpha", "beta"):
            child = _Session()
            argv = [
                sys.executable,
                "-m",
                "loopd.test.support.lease_session",
                *("--socket", os.path.join(directory, "llm-queue.sock")),
                *("--endpoint", endpoint, "--queue-key", "stub", "--session", name),
                *("--requests", str(REQUESTS)),
            ]
            reactor.spawnProcess(child, sys.executable, argv, env=dict(os.environ), path=str(ROOT))
            sessions.append(child)
        codes = yield gatherResults([s.ended for s in sessions])
        self.assertEqual(codes, [0, 0], [s.output for s in sessions])
        self.assertEqual(len(stub.log), 2 * 2 * REQUESTS)
        self.assertEqual(stub.most, 1)
        starts = [session for event, session in stub.log if event == "start"]
        self.assertEqual(sorted(starts), ["alpha"] * REQUESTS + ["beta"] * REQUESTS)
