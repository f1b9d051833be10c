"""
Tests for L{loopd.llama.Client.health}: C{GET /health} through the llama client, in memory
on a clock against the scripted fake llama-server, with C{poll_ms} at 100 ms.

The details are the strings the gateway's C{/health} reports per endpoint.
"""

from __future__ import annotations

import dataclasses
import math

from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase

from loopd.llama import Client, Health
from loopd.settings import Config, Endpoint, EndpointKind, Limits
from loopd.testing.fake_llama import LOADING, NOT_FOUND, FakeLlama, json_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

#: Where the fake listens; MemoryNet never touches the file system.
PATH = "/tmp/ld-memory/llama.sock"
#: A path nobody listens on.
NOWHERE = "/tmp/ld-memory/nobody.sock"

#: A 200 whose head never comes.
SILENT = dataclasses.replace(json_reply(200, {"status": "ok"}), headers_delay=math.inf)


class HealthTests(SynchronousTestCase):
    """Client.health asks /health and says what it found, as the gateway reports it."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)

    def client(self, kind: EndpointKind = "llama-server", socket: str = PATH) -> Client:
        """A client of one endpoint of C{kind} at C{socket}, poll_ms 100."""
        endpoint = Endpoint(name="tiny", socket=socket, model="tiny", kind=kind)
        config = Config(endpoints=(endpoint,), limits=Limits(poll_ms=100))
        return Client(self.reactor, config, endpoint)

    def check(self, client: Client) -> Health:
        """Ask C{client.health()} and let it run to its end."""
        asked = client.health()
        self.net.advance(1)
        health = self.successResultOf(asked)
        self.assert_quiet()
        return health

    def assert_quiet(self) -> None:
        """No timer is left and every connection is closed."""
        self.assertEqual(self.reactor.getDelayedCalls(), [])
        self.assertEqual(self.net.open_connections(), [])

    def test_ok(self) -> None:
        """A 200 is ok; the request is a body-less GET of /health."""
        self.fake.set_default("GET", "/health", json_reply(200, {"status": "ok"}))
        self.assertEqual(self.check(self.client()), Health(True, "ok"))
        [asked] = self.fake.requests
        self.assertEqual((asked.method, asked.target, asked.body), ("GET", "/health", b""))

    def test_other_status(self) -> None:
        """A llama-server answering 503 (loading) or 404 is not ok: HTTP <status>."""
        self.fake.script("GET", "/health", LOADING, NOT_FOUND)
        self.assertEqual(self.check(self.client()), Health(False, "HTTP 503"))
        self.assertEqual(self.check(self.client()), Health(False, "HTTP 404"))

    def test_openai_any_answer(self) -> None:
        """An openai-kind endpoint need not have /health: any answer is ok."""
        self.fake.script("GET", "/health", NOT_FOUND, LOADING)
        self.assertEqual(self.check(self.client("openai")), Health(True, "ok"))
        self.assertEqual(self.check(self.client("openai")), Health(True, "ok"))

    def test_socket_missing(self) -> None:
        """No socket file: unreachable, the kind of failure named and not the path."""
        health = self.check(self.client(socket=NOWHERE))
        self.assertEqual(health, Health(False, "unreachable: no socket (nothing is serving it)"))

    def test_socket_stale(self) -> None:
        """A socket nobody listens on any more: unreachable, refused; also for openai."""
        self.net.stop_listening(PATH, stale=True)
        why = "unreachable: connection refused (nothing is listening on the socket)"
        self.assertEqual(self.check(self.client()), Health(False, why))
        self.assertEqual(self.check(self.client("openai")), Health(False, why))
        self.assertFalse(Health(False, why).refused)

    def test_silent(self) -> None:
        """
        A server that never answers is unreachable after exactly poll_ms, its connection
        closed; the detail says so.
        """
        self.fake.set_default("GET", "/health", SILENT)
        asked = self.client().health()
        self.net.advance(0.099)
        self.assertNoResult(asked)
        self.net.advance(0.001)
        self.assertEqual(
            self.successResultOf(asked), Health(False, "unreachable: no answer in time")
        )
        self.assertFalse(self.fake.connections[0].open)
        self.assert_quiet()

    def test_cancel(self) -> None:
        """Cancelling fails the Deferred with CancelledError and closes the connection."""
        self.fake.set_default("GET", "/health", SILENT)
        asked = self.client().health()
        self.net.advance(0.05)
        self.assertTrue(self.fake.connections[0].open)
        asked.cancel()
        self.failureResultOf(asked, CancelledError)
        self.net.pump()
        self.assertTrue(self.fake.connections[0].client_closed)
        self.assert_quiet()

    def test_cancel_while_connecting(self) -> None:
        """Cancelled before the connection is made, it fails with CancelledError too."""
        asked = self.client().health()
        asked.cancel()
        self.failureResultOf(asked, CancelledError)
        self.net.pump()
        self.assertEqual(self.fake.connections, [])
        self.assert_quiet()

    def test_frozen(self) -> None:
        """A Health is a frozen value."""
        health = Health(True, "ok")
        self.assertRaises(dataclasses.FrozenInstanceError, setattr, health, "ok", False)
