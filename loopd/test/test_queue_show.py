"""
L{loopd.queue.show}: C{loopd queue status}'s rendering, its round trip over a real lease
socket, and the command line that picks the socket.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.error import ConnectError
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import Request, Site
from zope.interface import implementer

from loopd import cli
from loopd.gateway.channel import GatewaySite
from loopd.queue.protocol import LeaseFactory, LeaseProtocol, deliver_grant
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter
from loopd.queue.show import (
    NotLeaseSocketError,
    QueueStatusError,
    fetch_endpoints,
    fetch_status,
    queue_status_command,
    render_endpoints,
    render_status,
)
from loopd.reactor import IUnixReactor
from loopd.settings import Server
from loopd.test.support.peers import Peer, real_reactor
from loopd.unixsocket import listen_unix


def entry(session: str, role: str = "parent", group: str | None = None) -> dict[str, Any]:
    """One holder or waiter of a status reply."""
    return {"sessionKey": session, "role": role, "group": group}


class RenderTests(SynchronousTestCase):
    """
    The text of a status reply.
    """

    def test_empty(self) -> None:
        """No queue used yet says so."""
        self.assertIn("no queues yet", render_status([]))

    def test_holders_waiters_depth_switches(self) -> None:
        """Slots in use, switches, each entry as C{sessionKey tier [group]}, depth per tier."""
        queue = {
            "queueKey": "gpu",
            "maxStreams": 1,
            "switches": 4,
            "holders": [entry("s1", "child", "team")],
            "waiting": [entry("s2"), entry("s3", "child"), entry("s4")],
        }
        self.assertEqual(
            render_status([queue]),
            "gpu: 1/1 slots, switches 4\n"
            "  holding  s1 child [team]\n"
            "  waiting  3 (parent 2, child 1), in enqueue order:\n"
            "    1. s2 parent\n"
            "    2. s3 child\n"
            "    3. s4 parent\n",
        )

    def test_passthrough(self) -> None:
        """A disabled queue prints as passthrough."""
        queue = {
            "queueKey": "free",
            "maxStreams": None,
            "switches": 0,
            "holders": [entry("a"), entry("b")],
            "waiting": [],
        }
        self.assertEqual(
            render_status([queue]),
            "free: passthrough, 2 holding, switches 0\n  holding  a parent\n  holding  b parent\n",
        )

    def test_over_capacity(self) -> None:
        """More holders than streams after a reload reads C{2/1}."""
        queue = {
            "queueKey": "g",
            "maxStreams": 1,
            "switches": 0,
            "holders": [entry("a"), entry("b")],
            "waiting": [],
        }
        self.assertIn("g: 2/1 slots (over capacity", render_status([queue]))


STATES = {
    "tiny": {"state": "up", "detail": "/health: ok"},
    "big": {"state": "down", "detail": "no socket (nothing is serving it)"},
}
"""A gateway's C{endpoints}: one up, one down."""


class EndpointRenderTests(SynchronousTestCase):
    """The text of the gateway's endpoint states."""

    def test_states(self) -> None:
        """One line per endpoint, aligned; why only for one that is not up."""
        self.assertEqual(
            render_endpoints(STATES),
            "endpoints:\n  tiny  up\n  big   down: no socket (nothing is serving it)\n",
        )

    def test_none(self) -> None:
        """No endpoints: nothing."""
        self.assertEqual(render_endpoints({}), "")


class _QueueRoute(Resource):
    """A stand-in for loopd's gateway: C{GET /v1/queue} answers C{body}."""

    isLeaf = True

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self.body = body

    def render_GET(self, request: Request) -> bytes:
        """The body, as JSON."""
        request.setHeader(b"content-type", b"application/json")
        return self.body


class FetchTests(TestCase):
    """
    The round trip against a real lease socket.
    """

    def setUp(self) -> None:
        """A short temp dir for the socket."""
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.path = os.path.join(self.directory, "llm-queue.sock")

    @inlineCallbacks
    def test_status_of_a_live_socket(self) -> Any:
        """The queues with their holders come back, and asking counts no client."""
        reactor = real_reactor()
        scheduler = Scheduler(reactor, StaticRouter(defaults=QueuePolicy()), deliver_grant)
        holder = LeaseProtocol()
        scheduler.acquire(holder, "gpu", "s1", "child")
        factory = LeaseFactory(scheduler)
        port = listen_unix(reactor, self.path, factory)
        self.addCleanup(port.stopListening)
        queues = yield fetch_status(reactor, self.path)
        self.assertEqual([q["queueKey"] for q in queues], ["gpu"])
        self.assertEqual(queues[0]["holders"], [entry("s1", "child")])
        self.assertEqual(factory.clients, 0)

    @inlineCallbacks
    def test_status_after_a_key_that_is_not_text(self) -> Any:
        """
        The issue's acquire with a lone-surrogate key is an error reply on its connection,
        and C{loopd queue status} still answers afterwards.
        """
        reactor = real_reactor()
        scheduler = Scheduler(reactor, StaticRouter(defaults=QueuePolicy()), deliver_grant)
        port = listen_unix(reactor, self.path, LeaseFactory(scheduler))
        self.addCleanup(port.stopListening)
        peer = Peer()
        peer.on_connect = lambda p: p.transport.write(b'{"op":"acquire","queueKey":"\\ud800"}\n')
        replied: Deferred[None] = Deferred()
        peer.on_data = lambda p, data: None if replied.called else replied.callback(None)
        yield connectProtocol(UNIXClientEndpoint(reactor, self.path), peer)
        yield DeferredList([replied, peer.closed], fireOnOneCallback=True)
        self.assertEqual(
            json.loads(bytes(peer.received)),
            {"op": "error", "reason": "queueKey must be Unicode text (got a lone surrogate)"},
        )
        queues = yield fetch_status(reactor, self.path)
        self.assertEqual(queues, [])
        peer.transport.loseConnection()
        yield peer.closed

    def serve_gateway(self, body: bytes) -> str:
        """A stand-in gateway answering C{body} on a socket in the temp dir; its path."""
        path = os.path.join(self.directory, "loopd.sock")
        port = listen_unix(real_reactor(), path, Site(_QueueRoute(body)))
        self.addCleanup(port.stopListening)
        return path

    @inlineCallbacks
    def test_command_with_gateway(self) -> Any:
        """
        With loopd's gateway beside the lease socket, the queues are followed by each
        endpoint's state; a gateway that answers nonsense is said on stderr, exit 0.
        """
        reactor = real_reactor()
        scheduler = Scheduler(reactor, StaticRouter(defaults=QueuePolicy()), deliver_grant)
        port = listen_unix(reactor, self.path, LeaseFactory(scheduler))
        self.addCleanup(port.stopListening)
        gateway = self.serve_gateway(json.dumps({"op": "status", "endpoints": STATES}).encode())
        out: list[str] = []
        err: list[str] = []
        status = yield queue_status_command(reactor, self.path, out.append, err.append, gateway)
        self.assertEqual((status, err), (0, []))
        self.assertEqual("".join(out), render_status([]) + render_endpoints(STATES))

    @inlineCallbacks
    def test_gateway_without_states(self) -> Any:
        """A gateway answer without C{endpoints} is a QueueStatusError saying so."""
        gateway = self.serve_gateway(b'{"op": "status"}')
        error = yield self.assertFailure(fetch_endpoints(real_reactor(), gateway), QueueStatusError)
        self.assertEqual(str(error), "the gateway's /v1/queue has no endpoints")

    @inlineCallbacks
    def test_gateway_unreachable(self) -> Any:
        """A gateway socket nobody serves is a QueueStatusError naming it."""
        gateway = os.path.join(self.directory, "loopd.sock")
        error = yield self.assertFailure(fetch_endpoints(real_reactor(), gateway), QueueStatusError)
        self.assertIn(gateway, str(error))

    @inlineCallbacks
    def test_gateway_socket_is_told_at_once(self) -> Any:
        """
        Asked for C{status}, loopd's real gateway channel (on a real socket) answers HTTP at
        once, and that is a L{NotLeaseSocketError} naming the socket: no timer ran (every
        timer, the 5 s timeout and the gateway's own deadlines, is on a C{Clock} that never
        advances).
        """
        clock = Clock()
        reactor = _RealSocketsClockTime(real_reactor(), clock)
        path = os.path.join(self.directory, "loopd.sock")
        site = GatewaySite(Resource(), Server(), reactor=reactor)
        port = listen_unix(real_reactor(), path, site)
        self.addCleanup(port.stopListening)
        asking = fetch_status(reactor, path)
        error = yield self.assertFailure(asking, NotLeaseSocketError)
        self.assertIn(path, str(error))
        self.assertIn("HTTP/1.1 400", str(error))
        self.assertIn("not a lease socket", str(error))
        self.assertEqual(clock.seconds(), 0)

    @inlineCallbacks
    def test_command_names_the_lease_socket(self) -> Any:
        """
        C{loopd queue status --socket GATEWAY} exits 1 saying it is an HTTP socket, and names
        the lease socket to ask instead.
        """
        clock = Clock()
        reactor = _RealSocketsClockTime(real_reactor(), clock)
        path = os.path.join(self.directory, "loopd.sock")
        port = listen_unix(real_reactor(), path, GatewaySite(Resource(), Server(), reactor=reactor))
        self.addCleanup(port.stopListening)
        out: list[str] = []
        err: list[str] = []
        status = yield queue_status_command(
            reactor, path, out.append, err.append, lease_socket=self.path
        )
        self.assertEqual((status, out), (1, []))
        text = "".join(err)
        self.assertIn(f"{path} is an HTTP socket", text)
        self.assertIn(f"the lease socket is {self.path}", text)

    @inlineCallbacks
    def test_no_socket(self) -> Any:
        """A socket nobody listens on is a QueueStatusError naming the path."""
        error = yield self.assertFailure(fetch_status(real_reactor(), self.path), QueueStatusError)
        self.assertIn(self.path, str(error))


class CommandLineTests(SynchronousTestCase):
    """
    C{loopd queue status} picks its socket and reports failure with status 1.
    """

    def test_explicit_socket(self) -> None:
        """C{--socket} is used as given, C{~} expanded."""
        self.assertEqual(cli.queue_socket("~/q.sock", None), os.path.expanduser("~/q.sock"))

    def test_agent_dir(self) -> None:
        """C{--agent-dir} asks that dir's daemon."""
        self.assertEqual(cli.queue_socket(None, "/a"), "/a/llm-queue.sock")

    def test_own_gateway(self) -> None:
        """
        loopd's own lease socket (from the config) comes with its gateway socket, when that
        exists; another lease socket with none.
        """
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        gateway = os.path.join(directory, "loopd.sock")
        config = os.path.join(directory, "loopd.toml")
        with open(config, "w") as f:
            f.write(f'[server]\nlisten = "unix:{gateway}"\n')
            f.write('[[endpoint]]\nname = "tiny"\nsocket = "/tmp/ld/infer.sock"\n')
        lease = os.path.join(directory, "llm-queue.sock")
        self.assertIsNone(cli.own_gateway(lease, config))
        open(gateway, "w").close()
        self.assertEqual(cli.own_gateway(lease, config), gateway)
        self.assertIsNone(cli.own_gateway("/a/llm-queue.sock", config))

    def test_unreachable_exits_one(self) -> None:
        """An unreachable socket prints why on stderr and exits 1."""
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "none.sock")
        clock = Clock()
        errors: list[str] = []
        self.patch(cli, "_writer", lambda stream: errors.append)

        def run(command: Any) -> int:
            fake = _NoUnix(clock)
            results: list[int] = []
            command(fake).addCallback(results.append)
            return results[0]

        self.assertEqual(cli.main(["queue", "status", "--socket", path], run=run), 1)
        self.assertIn("cannot reach " + path, "".join(errors))


@implementer(IUnixReactor)
class _RealSocketsClockTime:
    """
    A reactor whose sockets are the real reactor's and whose timers are a C{Clock}'s: a
    test over real sockets in which no timeout can fire.
    """

    def __init__(self, real: Any, clock: Clock) -> None:
        self._real = real
        self._clock = clock

    def callLater(self, *args: Any, **kwargs: Any) -> Any:
        """Schedule on the clock."""
        return self._clock.callLater(*args, **kwargs)

    def seconds(self) -> float:
        """The clock's time."""
        return self._clock.seconds()

    def __getattr__(self, name: str) -> Any:
        """Everything else (C{connectUNIX}, C{listenUNIX}, ...) from the real reactor."""
        return getattr(self._real, name)


class _NoUnix:
    """A reactor whose Unix connections all fail at once, on a C{Clock}."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    def callLater(self, *args: Any, **kwargs: Any) -> Any:
        """Schedule on the clock."""
        return self._clock.callLater(*args, **kwargs)

    def seconds(self) -> float:
        """The clock's time."""
        return self._clock.seconds()

    def connectUNIX(self, address: str, factory: Any, timeout: float = 30, **_: Any) -> Any:
        """Fail the connection attempt at once."""
        memory = MemoryReactor()
        connector = memory.connectUNIX(address, factory, timeout)
        factory.clientConnectionFailed(connector, Failure(ConnectError("no such file")))
        return connector
