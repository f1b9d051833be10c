"""
Tests for L{loopd.llama.pacing}: the L{Pacer} on a L{task.Clock} (the burst, the refill, the
connection cap, the wait bound, cancellation), the L{PacedOpener} over a L{MemoryNet} in
front of a scripted fake server that refuses as an inferproxy does, and loopd's llama client
through a real inferproxy in front of a frozen server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError, Deferred, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.protocol import Factory
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd import http
from loopd.errors import Busy, Connect, LoadTimeout, ProxyRefused
from loopd.inferproxy import InferProxyService, ProxyLimits, upstream_endpoint
from loopd.llama.client import Client
from loopd.llama.info import Health
from loopd.llama.pacing import PacedOpener, Pacer, Ticket
from loopd.llama.types import ChatRequest, User
from loopd.settings import Config, Endpoint, Limits, Retry
from loopd.test.support.peers import ObservedProxyFactory, Peer, UpstreamFactory, real_reactor
from loopd.testing.fake_llama import FakeLlama, Piece, Reply, json_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

#: Where the fake listens; MemoryNet never touches the file system.
PATH = "/tmp/ld-memory/pace.sock"
#: A path nobody listens on.
NOWHERE = "/tmp/ld-memory/nobody.sock"


def pacer(
    clock: Clock,
    *,
    cap: int = 8,
    burst: int = 10,
    refill: float = 2.0,
    wait_ms: int = 10_000,
) -> Pacer:
    """A pacer with the inferproxy's defaults unless told otherwise."""
    return Pacer(
        clock,
        name="tiny",
        max_connections=cap,
        burst=burst,
        refill_per_second=refill,
        wait_ms=wait_ms,
    )


def refusal(limit: str, retry_after: str = "1") -> Reply:
    """What an inferproxy sends a connection over C{limit}."""
    headers = [(ProxyRefused.HEADER, limit), ("Retry-After", retry_after)]
    return Reply(status=503, headers=headers)


class PacerTests(SynchronousTestCase):
    """The pacer mirrors the inferproxy's bucket and cap, and bounds the wait."""

    def setUp(self) -> None:
        self.clock = Clock()

    def note(self, ticket: Ticket, went: list[tuple[int, float]], index: int) -> None:
        """Note that waiter C{index} went, and when."""
        went.append((index, self.clock.seconds()))

    def test_burst_then_wait_for_token(self) -> None:
        """
        A burst of 10 passes at once; the 11th waits for a token, 0.5 s at 2 a second,
        instead of being refused, and the wait is counted.
        """
        paced = pacer(self.clock, cap=100)
        tickets = [self.successResultOf(paced.acquire()) for _ in range(10)]
        self.assertEqual(len(tickets), 10)
        eleventh = paced.acquire()
        self.assertNoResult(eleventh)
        self.assertEqual(paced.waiting, 1)
        self.clock.advance(0.499)
        self.assertNoResult(eleventh)
        self.clock.advance(0.001)
        self.assertIsInstance(self.successResultOf(eleventh), Ticket)
        self.assertEqual(paced.stats.connections, 11)
        self.assertEqual(paced.stats.waits, 1)
        self.assertAlmostEqual(paced.stats.waited_seconds, 0.5)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_waiters_go_in_turn_at_refill_rate(self) -> None:
        """After the burst, waiters go one per token, oldest first: at 0.5, 1.0, 1.5 s."""
        paced = pacer(self.clock, cap=100)
        for _ in range(10):
            paced.acquire()
        went: list[tuple[int, float]] = []
        for index in range(3):
            paced.acquire().addCallback(self.note, went, index)
        self.clock.pump([0.25] * 8)
        self.assertEqual(went, [(0, 0.5), (1, 1.0), (2, 1.5)])

    def test_cap_holds(self) -> None:
        """
        With 8 open, a 9th waits even with tokens to spare, and goes when one closes; the
        open count never passes 8.
        """
        paced = pacer(self.clock, burst=100)
        tickets = [self.successResultOf(paced.acquire()) for _ in range(8)]
        ninth = paced.acquire()
        self.clock.advance(5)
        self.assertNoResult(ninth)
        self.assertEqual(paced.open_connections, 8)
        tickets[0].release()
        self.assertEqual(paced.open_connections, 8)
        self.successResultOf(ninth)
        tickets[0].release()
        self.assertEqual(paced.open_connections, 8)

    def test_wait_past_bound_fails_at_once(self) -> None:
        """
        When the bucket's schedule shows the wait would pass pacing_wait_ms, the connection
        fails at once with Busy, naming the endpoint and the limits; nothing is left queued.
        """
        paced = pacer(self.clock, cap=100, wait_ms=100)
        for _ in range(10):
            paced.acquire()
        failure = self.failureResultOf(paced.acquire(), Busy)
        message = str(failure.value)
        self.assertIn("endpoint tiny", message)
        self.assertIn("2 connections a second", message)
        self.assertIn("pacing_wait_ms", message)
        self.assertEqual((paced.waiting, paced.stats.busy), (0, 1))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_cap_wait_fails_at_deadline(self) -> None:
        """A connection waiting on a full cap that does not free fails at the bound, not before."""
        paced = pacer(self.clock, cap=1, wait_ms=1000)
        paced.acquire()
        waiting = paced.acquire()
        self.clock.advance(0.999)
        self.assertNoResult(waiting)
        self.clock.advance(0.001)
        self.assertIn("waited 1.0 s", str(self.failureResultOf(waiting, Busy).value))
        self.assertEqual(paced.waiting, 0)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_zero_wait_fails_when_nothing_free(self) -> None:
        """pacing_wait_ms 0: a connection goes at once or fails at once."""
        paced = pacer(self.clock, burst=1, wait_ms=0)
        self.successResultOf(paced.acquire())
        self.failureResultOf(paced.acquire(), Busy)

    def test_cancel_leaves_queue(self) -> None:
        """A waiting connection cancelled leaves the queue; the next in line takes its turn."""
        paced = pacer(self.clock, burst=1)
        paced.acquire()
        first, second = paced.acquire(), paced.acquire()
        first.cancel()
        self.failureResultOf(first, CancelledError)
        self.assertEqual(paced.waiting, 1)
        self.clock.advance(0.5)
        self.successResultOf(second)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_drain(self) -> None:
        """After drain (the proxy refused on its rate) the next connection waits a token's time."""
        paced = pacer(self.clock)
        paced.drain()
        waiting = paced.acquire()
        self.clock.advance(0.49)
        self.assertNoResult(waiting)
        self.clock.advance(0.01)
        self.successResultOf(waiting)

    def test_limits_validated(self) -> None:
        """Limits out of range are refused."""
        for bad in ({"cap": 0}, {"burst": 0}, {"refill": 0.0}, {"wait_ms": -1}):
            with self.assertRaises(ValueError):
                pacer(self.clock, **bad)

    def test_for_endpoint(self) -> None:
        """An endpoint's proxy_* fields make its pacer; the defaults are the inferproxy's."""
        endpoint = Endpoint(name="tiny", socket=PATH, model="tiny")
        self.assertEqual(
            (
                endpoint.proxy_max_connections,
                endpoint.proxy_burst,
                endpoint.proxy_refill_per_second,
            ),
            (8, 10, 2.0),
        )
        paced = Pacer.for_endpoint(self.clock, endpoint)
        self.assertEqual((paced.name, paced.wait_seconds), ("tiny", 10.0))

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(
            st.one_of(
                st.just(("acquire", 0.0)),
                st.just(("release", 0.0)),
                st.tuples(st.just("advance"), st.floats(0.0, 2.0)),
            ),
            max_size=60,
        )
    )
    def test_never_over_the_proxy_limits(self, steps: list[tuple[str, float]]) -> None:
        """
        Whatever the order of asks, closes and time, the pacer never lets more through than
        the inferproxy's bucket would accept (burst + refill x elapsed) nor more than the
        cap open at a time.
        """
        clock = Clock()
        paced = pacer(clock, cap=3, burst=4, refill=2.0, wait_ms=1500)
        held: list[Ticket] = []
        for kind, seconds in steps:
            if kind == "acquire":
                paced.acquire().addCallbacks(held.append, lambda f: f.trap(Busy))
            elif kind == "release" and held:
                held.pop(0).release()
            else:
                clock.advance(seconds)
            self.assertLessEqual(paced.open_connections, 3)
            allowed = 4 + 2.0 * clock.seconds() + 1e-6
            self.assertLessEqual(paced.stats.connections, allowed)


class PacedOpenerTests(SynchronousTestCase):
    """The paced opener of one endpoint, over a memory network."""

    def setUp(self) -> None:
        self.reactor = MemoryLoopdReactor()
        self.fake = FakeLlama(self.reactor)
        self.net = MemoryNet(self.reactor)
        self.net.listen(PATH, self.fake)

    def opener(self, socket: str = PATH, **limits: Any) -> PacedOpener:
        """The paced opener of an endpoint named tiny at C{socket}."""
        endpoint = Endpoint(name="tiny", socket=socket, model="tiny")
        return PacedOpener(self.reactor, endpoint, pacer(self.reactor, **limits))

    def read(self, answer: Deferred[http.HttpResponse]) -> bytes:
        """Run the network until the answer and its body are in; the body."""
        self.net.advance(0)
        response = self.successResultOf(answer)
        body = response.read_body()
        self.net.advance(0)
        return self.successResultOf(body)

    def test_place_held_until_closed(self) -> None:
        """A connection holds its place under the cap until it has closed."""
        self.fake.set_default("GET", "/props", Reply(pieces=[Piece(0.1, b"{}")]))
        opener = self.opener()
        answer = opener("GET", "/props")
        self.net.advance(0.05)
        self.assertEqual(opener.pacer.open_connections, 1)
        self.net.advance(0.05)
        self.assertEqual(self.read(answer), b"{}")
        self.net.advance(0)
        self.assertEqual(opener.pacer.open_connections, 0)
        self.assertEqual(self.net.open_connections(), [])

    def test_rate_refusal_waits_and_sends_again(self) -> None:
        """
        An accept-rate refusal (the proxy's bucket is emptier than the pacer thought) drains
        the pacer's bucket and sends again a token later, 0.5 s, not as a connect error;
        it is counted by limit.
        """
        self.fake.script(
            "GET", "/props", refusal(ProxyRefused.ACCEPT_RATE), json_reply(200, {"ok": 1})
        )
        opener = self.opener()
        answer = opener("GET", "/props")
        self.net.advance(0)
        self.assertNoResult(answer)
        self.assertEqual(len(self.fake.requests_to("GET", "/props")), 1)
        self.net.advance(0.499)
        self.assertNoResult(answer)
        self.net.advance(0.001)
        self.assertEqual(self.read(answer), b'{"ok":1}')
        self.assertEqual(opener.pacer.stats.refusals, {ProxyRefused.ACCEPT_RATE: 1})
        self.assertEqual(len(self.fake.requests_to("GET", "/props")), 2)

    def test_rate_refusals_give_up(self) -> None:
        """Three accept-rate refusals in a row: the exchange fails with ProxyRefused."""
        self.fake.set_default("GET", "/props", refusal(ProxyRefused.ACCEPT_RATE))
        answer = self.opener()("GET", "/props")
        self.net.advance(0)
        self.net.advance(0.5)
        self.net.advance(0.5)
        failure = self.failureResultOf(answer, ProxyRefused)
        self.assertEqual(failure.value.limit, ProxyRefused.ACCEPT_RATE)

    def test_cap_refusal_fails_at_once(self) -> None:
        """
        A refusal at the proxy's connection cap fails at once, typed, naming the endpoint
        and the cap; it is not a Connect (the server is not taken for dead).
        """
        self.fake.set_default("GET", "/props", refusal(ProxyRefused.CONNECTIONS))
        opener = self.opener()
        answer = opener("GET", "/props")
        self.net.advance(0)
        failure = self.failureResultOf(answer, ProxyRefused)
        self.assertNotIsInstance(failure.value, Connect)
        self.assertEqual(failure.value.limit, ProxyRefused.CONNECTIONS)
        self.assertEqual(
            str(failure.value),
            "endpoint tiny is refusing connections: its inferproxy's connection limit is"
            " reached; retry after 1 s",
        )
        self.assertEqual(opener.pacer.stats.refusals, {ProxyRefused.CONNECTIONS: 1})
        self.net.advance(0)
        self.assertEqual(opener.pacer.open_connections, 0)
        self.assertEqual(self.net.open_connections(), [])

    def test_connect_failure_names_endpoint_not_path(self) -> None:
        """
        A socket that is not there: Connect names the endpoint and not the path; the log
        line has the path.
        """
        opener = self.opener(socket=NOWHERE)
        with capturedLogs() as events:
            answer = opener("GET", "/props")
            self.net.advance(0)
        error = self.failureResultOf(answer, Connect).value
        self.assertEqual(
            str(error), "endpoint tiny is unreachable: no socket (nothing is serving it)"
        )
        self.assertNotIn(NOWHERE, str(error))
        self.assertEqual(error.path, NOWHERE)
        logged = [e for e in events if e.get("log_namespace") == "loopd.llama.pacing"]
        self.assertEqual([e["path"] for e in logged], [NOWHERE])
        self.assertEqual(opener.pacer.open_connections, 0)

    def test_cancel_while_waiting(self) -> None:
        """An exchange cancelled while it waits for the pacer leaves its queue, sends nothing."""
        self.fake.set_default("GET", "/props", json_reply(200, {}))
        opener = self.opener(burst=1)
        first = opener("GET", "/props")
        second = opener("GET", "/props")
        self.assertEqual(opener.pacer.waiting, 1)
        second.cancel()
        self.failureResultOf(second, CancelledError)
        self.assertEqual(opener.pacer.waiting, 0)
        self.read(first)
        self.net.advance(1)
        self.assertEqual(len(self.fake.requests_to("GET", "/props")), 1)


class _PeakProxyFactory(ObservedProxyFactory):
    """The forwarder under test, remembering the most pairs it had open at a time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peak = 0

    def buildProtocol(self, addr: Any) -> Any:
        side = super().buildProtocol(addr)
        self.peak = max(self.peak, self.open_pairs)
        return side


def frozen(peer: Peer) -> None:
    """An upstream that reads and never answers, not even an EOF: a hung server."""
    peer.on_eof = lambda p: None


class AgainstInferproxyTests(TestCase):
    """
    loopd's llama client through a real inferproxy on a Unix socket in a short temporary
    directory, in front of a TCP server on 127.0.0.1 that never answers (a frozen server).
    """

    timeout = 15

    def start(self, limits: ProxyLimits) -> UpstreamFactory:
        """Start the frozen upstream and the proxy in front of it."""
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "infer.sock")
        upstream = UpstreamFactory(frozen)
        port = reactor.listenTCP(0, upstream, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        number = port.getHost().port
        self.proxy = _PeakProxyFactory(
            upstream_endpoint(reactor, "127.0.0.1", number, 5.0),
            reactor,
            limits,
            f"127.0.0.1:{number}",
        )
        service = InferProxyService(reactor, self.path, self.proxy)
        service.startService()
        self.addCleanup(service.stopService)
        self.addCleanup(self.close_upstream, upstream)
        return upstream

    def close_upstream(self, upstream: UpstreamFactory) -> Deferred[Any]:
        """Abort what the frozen upstream still holds, and wait for the pairs to go."""
        for peer in upstream.peers:
            if peer.transport is not None and not peer.closed.called:
                peer.transport.abortConnection()
        return self.proxy.all_closed()

    def client(self) -> Client:
        """loopd's llama client of the endpoint tiny at the proxy's socket, poll_ms 100."""
        endpoint = Endpoint(name="tiny", socket=self.path, model="tiny")
        limits = Limits(poll_ms=100, busy_wait_ms=1000, load_wait_ms=1000)
        config = Config(endpoints=(endpoint,), limits=limits, retry=Retry(attempts=1))
        return Client(real_reactor(), config, endpoint)

    @inlineCallbacks
    def test_abandoned_polls_free_their_pairs(self) -> Any:
        """
        Each /health that the frozen server never answers is given up after poll_ms, and
        the proxy's pair goes with it: the open pair count is back to 0 each time.
        """
        upstream = self.start(ProxyLimits(burst=10**6, refill_per_second=1e6))
        client = self.client()
        for _ in range(5):
            health = yield client.health()
            self.assertEqual(health, Health(False, "unreachable: no answer in time"))
            yield self.proxy.all_closed()
            self.assertEqual(self.proxy.open_pairs, 0)
        self.assertEqual(len(upstream.peers), 5)
        self.assertEqual(self.proxy.peak, 1)

    @inlineCallbacks
    def test_chat_polls_do_not_pile_up(self) -> Any:
        """
        A chat to the frozen server polls /slots every poll_ms until load_wait_ms; each
        abandoned poll's pair is freed, so the proxy never holds more than the chat and
        one poll, and nothing once the chat has failed.
        """
        upstream = self.start(ProxyLimits(burst=10**6, refill_per_second=1e6))
        client = self.client()
        chat = client.chat(ChatRequest(slot=0, messages=(User("Hi"),)), lambda event: None)
        yield self.assertFailure(chat, LoadTimeout)
        yield self.proxy.all_closed()
        self.assertGreaterEqual(len(upstream.peers), 5)
        self.assertLessEqual(self.proxy.peak, 2)

    @inlineCallbacks
    def test_cap_held_by_idle_clients(self) -> Any:
        """
        With 8 idle clients holding the inferproxy's cap, a chat fails at once with the
        typed refusal naming the cap (not Connect, not retried), and /health says why.
        """
        upstream = self.start(ProxyLimits())
        idle = []
        for _ in range(8):
            arrived = upstream.next_peer()
            client_peer = yield UNIXClientEndpoint(real_reactor(), self.path).connect(
                Factory.forProtocol(Peer)
            )
            yield arrived
            idle.append(client_peer)
        self.assertEqual(self.proxy.open_pairs, 8)
        client = self.client()
        chat = client.chat_with_retry(
            ChatRequest(slot=0, messages=(User("Hi"),)), lambda event: None
        )
        error = yield self.assertFailure(chat, ProxyRefused)
        self.assertEqual(error.limit, ProxyRefused.CONNECTIONS)
        self.assertEqual(
            str(error),
            "endpoint tiny is refusing connections: its inferproxy's connection limit is"
            " reached; retry after 1 s",
        )
        health = yield client.health()
        self.assertEqual(
            health, Health(False, "refused by its inferproxy: its connection limit is reached")
        )
        self.assertTrue(health.refused)
        self.assertEqual(client.pacer.stats.refusals, {ProxyRefused.CONNECTIONS: 2})
        self.assertEqual(len(upstream.peers), 8)
        for peer in idle:
            peer.transport.abortConnection()
