"""
The startup self-test end to end: a real llama.cpp server (xllamacpp) with the project's
tiny model, an in-process inferproxy in front of it, and L{loopd.selftest} talking to the
inferproxy's Unix socket through the llama client.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import SkipTest, TestCase

from loopd.digest import sha256_hex
from loopd.inferproxy import InferProxyFactory, InferProxyService, ProxyLimits, upstream_endpoint
from loopd.llama import Client
from loopd.selftest import SelftestFailed, require_selftests, run_selftest
from loopd.settings import Config, Endpoint, Expect
from loopd.test.support.peers import real_reactor

try:
    from loopd.demo.real_server import RealServer
    from loopd.demo.tiny_model import write_tiny_model
except ImportError as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the real llama.cpp server needs the test extra: {e}") from None

#: The server's context and slots; each slot gets an equal share of the context.
N_CTX = 8192
SLOTS = 2


class SelftestEndToEndTests(TestCase):
    """
    The self-test against the real thing.
    """

    timeout = 120

    @inlineCallbacks
    def start(self) -> Any:
        """
        Build the tiny model, start the server and an inferproxy in front of it, and return
        C{/props} as read through the proxy.
        """
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        model = os.path.join(directory, "tiny.gguf")
        write_tiny_model(model)
        server = RealServer(reactor, model, n_ctx=N_CTX, parallel=SLOTS)
        self.addCleanup(server.stop)
        port = yield server.start()
        self.socket = os.path.join(directory, "infer.sock")
        factory = InferProxyFactory(
            upstream_endpoint(reactor, "127.0.0.1", port, 10.0),
            reactor,
            ProxyLimits(max_connections=16, burst=100, refill_per_second=100.0),
            f"127.0.0.1:{port}",
        )
        proxy = InferProxyService(reactor, self.socket, factory)
        proxy.startService()
        self.addCleanup(proxy.stopService)
        props = yield self.client(Expect()).props()
        return props

    def config(self, expect: Expect) -> Config:
        """A config with one endpoint, the proxy's socket, expecting C{expect}."""
        return Config(endpoints=(Endpoint(name="tiny", socket=self.socket, expect=expect),))

    def client(self, expect: Expect) -> Client:
        """A client for the endpoint of L{config}."""
        config = self.config(expect)
        return Client(real_reactor(), config, config.endpoints[0])

    @inlineCallbacks
    def test_all_pass(self) -> Any:
        """
        With the server's own template hash, per-slot context and slot count expected, all
        three checks pass, turn 2 reusing most of turn 1.
        """
        props = yield self.start()
        template_sha = sha256_hex(props["chat_template"].encode("utf-8"))
        expect = Expect(chat_template_sha256=template_sha, n_ctx=N_CTX // SLOTS, total_slots=SLOTS)
        report = yield run_selftest(self.client(expect), clock=real_reactor())
        self.assertTrue(report.passed, "\n".join(report.lines()))
        self.assertEqual([c.name for c in report.checks], ["props", "tools", "cache"])
        self.assertIn('get_weather {"city"', report.checks[1].actual)
        self.assertIn(f"expected {template_sha} got {template_sha}", report.lines()[0])

    @inlineCallbacks
    def test_wrong_hash_fails(self) -> Any:
        """
        With a wrong template hash expected, check 1 fails and the gate refuses to start,
        naming the check and both hashes; the other two checks still pass.
        """
        props = yield self.start()
        template_sha = sha256_hex(props["chat_template"].encode("utf-8"))
        wrong = "f" * 64
        config = self.config(Expect(chat_template_sha256=wrong))
        error = yield self.assertFailure(
            require_selftests(real_reactor(), config, {}), SelftestFailed
        )
        self.assertIn(
            f"FAIL props: chat_template sha256 expected {wrong} got {template_sha}", str(error)
        )
        self.assertEqual([c.passed for c in error.report.checks], [False, True, True])
