"""
Tests for L{loopd.llama.discovery}: a config's routers asked for their models against the
fake server on the memory network, the config expanded and each model given a client that
shares its router's pacing; a router that never answers; the router's capacity.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from loopd.llama import Client
from loopd.llama.discovery import ROUTER_ASK_PAUSE, discover_routers, router_capacity
from loopd.llama.router import RouterError
from loopd.settings import Config, Endpoint
from loopd.testing.fake_llama import FakeLlama, json_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

PATH = "/tmp/ld-memory/router.sock"
ROUTER = Endpoint(name="gpu", socket=PATH, kind="llama-server-router", selftest_wait_ms=2000)
PLAIN = Endpoint(name="big", socket="/tmp/ld-memory/big.sock")
LISTED = {"data": [{"id": "m1", "status": {"value": "loaded"}}, {"id": "m2"}]}


class DiscoveryCase(SynchronousTestCase):
    """A fake router on the memory network."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)

    def clients(self, config: Config) -> dict[str, Client]:
        """A client per endpoint of C{config}."""
        return {e.name: Client(self.reactor, config, e) for e in config.endpoints}


class DiscoverTests(DiscoveryCase):
    """The config's routers expanded."""

    def test_no_router(self) -> None:
        """A config without a router is served as it is, with its clients."""
        config = Config(endpoints=(PLAIN,))
        clients = self.clients(config)
        found = self.successResultOf(discover_routers(self.reactor, config, clients))
        self.assertEqual((found.config, found.clients, found.routers), (config, clients, {}))

    def test_models_served(self) -> None:
        """Each model an endpoint with a client of its own, sharing the router's pacing."""
        self.fake.script("GET", "/v1/models", json_reply(200, LISTED))
        config = Config(endpoints=(PLAIN, ROUTER))
        clients = self.clients(config)
        finding = discover_routers(self.reactor, config, clients)
        self.net.pump()
        found = self.successResultOf(finding)
        self.assertEqual([e.name for e in found.config.endpoints], ["big", "m1", "m2"])
        self.assertIs(found.clients["big"], clients["big"])
        for model in ("m1", "m2"):
            self.assertEqual(found.clients[model].endpoint.router, "gpu")
            self.assertIs(found.clients[model].pacer, clients["gpu"].pacer)
        self.assertEqual(list(found.routers), ["gpu"])
        self.assertEqual([m.id for m in found.listed["gpu"]], ["m1", "m2"])

    def test_waits_for_the_router(self) -> None:
        """A router not up yet is asked again every half second until it answers."""
        self.net.stop_listening(PATH)
        config = Config(endpoints=(ROUTER,))
        finding = discover_routers(self.reactor, config, self.clients(config))
        self.net.advance(ROUTER_ASK_PAUSE * 2)
        self.assertNoResult(finding)
        self.net.listen(PATH, self.fake)
        self.fake.script("GET", "/v1/models", json_reply(200, LISTED))
        self.net.advance(ROUTER_ASK_PAUSE)
        self.assertEqual(len(self.successResultOf(finding).config.endpoints), 2)

    def test_never_answers(self) -> None:
        """A router that does not answer within its selftest_wait_ms: RouterError, saying so."""
        self.net.stop_listening(PATH)
        config = Config(endpoints=(ROUTER,))
        finding = discover_routers(self.reactor, config, self.clients(config))
        self.net.advance(3.0)
        error = self.failureResultOf(finding, RouterError).value
        self.assertIn("router gpu: /v1/models did not answer within 2000 ms", str(error))


class CapacityTests(DiscoveryCase):
    """How many models a router keeps loaded, from its /props."""

    def capacity(self, props: object, status: int = 200) -> int:
        """The capacity a router whose /props answers C{props} has, with 3 models."""
        self.fake.script("GET", "/props", json_reply(status, props))
        client = Client(self.reactor, Config(endpoints=(ROUTER,)), ROUTER)
        asking = router_capacity(client, 3)
        self.net.pump()
        result: int = self.successResultOf(asking)
        return result

    def test_capacity(self) -> None:
        """max_instances as said; 0 (no limit) all the models; missing or unanswered 1."""
        self.assertEqual(self.capacity({"role": "router", "max_instances": 2}), 2)
        self.assertEqual(self.capacity({"role": "router", "max_instances": 0}), 3)
        self.assertEqual(self.capacity({"role": "router"}), 1)
        self.assertEqual(self.capacity({"error": {"message": "x"}}, 500), 1)
