"""
Tests for L{loopd.testing.lease_daemon.FakeLeaseDaemon}: the real scheduler behind the real
wire layer on a L{MemoryNet}, as a L{LeaseClient} sees it: grants in order, the lease's
terms, the sweep on the memory clock, the recorded messages, stopping, dying and restarting.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.protocol import ClientFactory, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.client import LeaseClient, QueueUnavailable
from loopd.queue.scheduler_types import QueuePolicy
from loopd.queue.terms import LeaseTerms
from loopd.testing.lease_daemon import DEFAULT_PATH, FakeLeaseDaemon
from loopd.testing.memory_net import MemoryNet

KEY = "http://gpu:8001/v1"


class RawPeer(Protocol):
    """A client that writes lines as told and keeps every message it gets."""

    def __init__(self, net: MemoryNet) -> None:
        """No message yet."""
        self.net = net
        self.messages: list[dict[str, Any]] = []
        self._buffer = b""

    def dataReceived(self, data: bytes) -> None:
        """Keep every complete line as a message."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        self.messages.extend(json.loads(line) for line in lines)

    def write(self, raw: bytes) -> None:
        """Send C{raw} and let the network settle."""
        assert self.transport is not None
        self.transport.write(raw)
        self.net.pump()

    def say(self, message: dict[str, Any]) -> None:
        """Send one message as a line."""
        self.write(json.dumps(message).encode() + b"\n")


class DaemonTestCase(SynchronousTestCase):
    """A memory clock and network per test."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.net = MemoryNet(self.reactor)

    def raw(self, daemon: FakeLeaseDaemon) -> RawPeer:
        """A L{RawPeer} connected to C{daemon}."""
        peer = RawPeer(self.net)
        self.reactor.connectUNIX(daemon.path, ClientFactory.forProtocol(lambda: peer))
        self.net.pump()
        return peer

    def client(self, daemon: FakeLeaseDaemon, **options: object) -> LeaseClient:
        """A lease client of C{daemon} on the same clock."""
        return LeaseClient(self.reactor, daemon.path, **options)  # type: ignore[arg-type]


class GrantTests(DaemonTestCase):
    """The daemon grants, queues and releases as the real scheduler does."""

    def test_grant_and_release(self) -> None:
        """An acquire is granted with the policy's terms; a release frees the slot."""
        daemon = FakeLeaseDaemon(self.net, policy=QueuePolicy(lease_ttl_ms=3000))
        client = self.client(daemon)
        d = client.acquire(KEY, "s1")
        self.net.pump()
        lease = self.successResultOf(d)
        self.assertEqual((lease.held, lease.queued), (True, True))
        self.assertEqual(lease.terms, LeaseTerms(3000, 30_000))
        self.assertEqual(daemon.holders(KEY), ["s1"])
        released = client.release(lease)
        self.net.pump()
        self.successResultOf(released)
        self.assertEqual(daemon.holders(), [])

    def test_second_session_waits(self) -> None:
        """With one slot the second session waits, and is granted when the first releases."""
        daemon = FakeLeaseDaemon(self.net)
        first, second = self.client(daemon), self.client(daemon)
        held = first.acquire(KEY, "s1")
        waiting = second.acquire(KEY, "s2")
        self.net.pump()
        self.assertNoResult(waiting)
        self.assertEqual((daemon.holders(KEY), daemon.waiting(KEY)), (["s1"], ["s2"]))
        first.release(self.successResultOf(held))
        self.net.pump()
        self.assertEqual(self.successResultOf(waiting).session_key, "s2")
        self.assertEqual(daemon.holders(KEY), ["s2"])

    def test_queues_have_their_own_policy(self) -> None:
        """A queue named in C{queues} has its own slot count; the others the default."""
        daemon = FakeLeaseDaemon(self.net, queues={"wide": QueuePolicy(max_streams=2)})
        client = self.client(daemon)
        leases = [client.acquire(key, f"s{n}") for key in ("wide", "narrow") for n in (1, 2)]
        self.net.pump()
        self.assertEqual(daemon.holders("wide"), ["s1", "s2"])
        self.assertEqual((daemon.holders("narrow"), daemon.waiting("narrow")), (["s1"], ["s2"]))
        self.assertNoResult(leases[3])

    def test_groups_share_slots(self) -> None:
        """Two keys of one group share its one slot."""
        daemon = FakeLeaseDaemon(self.net, groups={"gpu": ("a", "b")})
        client = self.client(daemon)
        client.acquire("a", "s1")
        second = client.acquire("b", "s2")
        self.net.pump()
        self.assertNoResult(second)
        self.assertEqual(daemon.waiting("gpu"), ["s2"])

    def test_lapsed_lease_swept(self) -> None:
        """A holder that never beats loses its slot at its TTL, on the memory clock."""
        daemon = FakeLeaseDaemon(self.net, policy=QueuePolicy(lease_ttl_ms=1000))
        peer = self.raw(daemon)
        peer.say({"op": "acquire", "queueKey": KEY, "sessionKey": "s1"})
        self.assertEqual(peer.messages[0]["op"], "granted")
        self.net.advance(0.99)
        self.assertEqual(daemon.holders(KEY), ["s1"])
        self.net.advance(0.05)
        self.assertEqual(daemon.holders(KEY), [])

    def test_only_json_objects_recorded(self) -> None:
        """A line that is not a JSON object is answered as the real daemon does, not kept."""
        daemon = FakeLeaseDaemon(self.net)
        peer = self.raw(daemon)
        peer.write(b"not json\n[1]\n")
        peer.say({"op": "status"})
        self.assertEqual([m["op"] for m in peer.messages], ["error", "error", "status"])
        self.assertEqual(daemon.received, [(0.0, {"op": "status"})])

    def test_beats_recorded(self) -> None:
        """Every message a client sends is recorded with its clock time."""
        daemon = FakeLeaseDaemon(self.net, policy=QueuePolicy(lease_ttl_ms=3000))
        d = self.client(daemon).acquire(KEY, "s1")
        self.net.pump()
        self.successResultOf(d)
        self.net.advance(1.0)
        self.assertEqual(daemon.received[0][0], 0.0)
        self.assertEqual(daemon.ops("acquire")[0]["sessionKey"], "s1")
        beats = [(t, m) for t, m in daemon.received if m["op"] == "renew" and "queueKey" in m]
        self.assertEqual([t for t, _ in beats], [1.0])


class LifeTests(DaemonTestCase):
    """Start, stop, kill and restart, as a client sees them."""

    def test_default_path(self) -> None:
        """Without a path the daemon listens at L{DEFAULT_PATH}."""
        daemon = FakeLeaseDaemon(self.net)
        self.assertEqual((daemon.path, daemon.listening), (DEFAULT_PATH, True))

    def test_not_listening_fails_open(self) -> None:
        """Not started: a fail-open client gets an unqueued lease, a closed one an error."""
        daemon = FakeLeaseDaemon(self.net, listen=False)
        opened = self.client(daemon).acquire(KEY, "s1")
        closed = self.client(daemon, fail_open=False).acquire(KEY, "s2")
        self.net.pump()
        self.assertFalse(self.successResultOf(opened).queued)
        self.failureResultOf(closed, QueueUnavailable)
        self.assertEqual(daemon.received, [])

    def test_spawned(self) -> None:
        """A client whose spawn starts the daemon is granted once it listens."""
        daemon = FakeLeaseDaemon(self.net, listen=False)
        d = self.client(daemon, spawn=daemon.start).acquire(KEY, "s1")
        self.net.advance(0.2)
        self.assertTrue(self.successResultOf(d).queued)
        self.assertEqual(daemon.holders(KEY), ["s1"])

    def test_kill_loses_slot(self) -> None:
        """
        A killed daemon aborts its connections: the holder loses its slot and, the socket
        being stale, goes on unqueued (fail-open).
        """
        daemon = FakeLeaseDaemon(self.net)
        d = self.client(daemon).acquire(KEY, "s1")
        self.net.pump()
        lease = self.successResultOf(d)
        lost: list[object] = []
        lease.add_lost_observer(lost.append)
        daemon.kill()
        self.assertFalse(daemon.listening)
        self.net.pump()
        self.assertEqual((lost, lease.held, lease.queued), ([lease], True, False))
        self.assertEqual(daemon.connections, [])

    def test_stop_closes(self) -> None:
        """A stopped daemon closes its connections and its socket is gone."""
        daemon = FakeLeaseDaemon(self.net)
        client = self.client(daemon, fail_open=False)
        d = client.acquire(KEY, "s1")
        self.net.pump()
        lease = self.successResultOf(d)
        daemon.stop()
        self.net.pump()
        self.assertTrue(lease.ended)
        self.assertEqual(self.net.open_connections(daemon.path), [])
        again = client.acquire(KEY, "s2")
        self.net.pump()
        self.failureResultOf(again, QueueUnavailable)

    def test_restart_is_fresh(self) -> None:
        """
        A daemon killed and started again has a new scheduler; the client re-queues its
        lost lease there and is granted again.
        """
        daemon = FakeLeaseDaemon(self.net)
        client = self.client(daemon)
        d = client.acquire(KEY, "s1")
        self.net.pump()
        lease = self.successResultOf(d)
        old = daemon.scheduler
        daemon.kill()
        daemon.start()
        self.assertIsNot(daemon.scheduler, old)
        self.assertEqual(daemon.holders(KEY), [])
        self.net.pump()
        self.assertEqual(daemon.holders(KEY), ["s1"])
        self.assertTrue(self.successResultOf(lease.when_held()).queued)
        self.assertEqual([m["op"] for m in daemon.ops()], ["acquire", "acquire"])

    def test_start_twice_is_one_daemon(self) -> None:
        """Starting a running daemon changes nothing."""
        daemon = FakeLeaseDaemon(self.net)
        scheduler = daemon.scheduler
        daemon.start()
        self.assertIs(daemon.scheduler, scheduler)
