"""
L{loopd.queue.client.LeaseClient}'s decisions, in memory on a C{MemoryReactorClock}: the
beat and heartbeat periods from the lease's terms, pause and resume, reply matching, the
queue-wait warning, cancel, and the re-queue after C{granted: false}.

The daemon here is a script (L{ScriptServer}): the tests read what the client sent and
write the replies themselves. L{Harness} is shared with C{test_queue_client_connect}.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import CancelledError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.client import (
    DuplicateLease,
    Lease,
    LeaseClient,
    QueueReplyError,
)
from loopd.queue.terms import LeaseTerms
from loopd.testing.memory_net import MemoryNet

PATH = "/tmp/ld-memory/llm-queue.sock"
KEY = "http://gpu:8001/v1"


class Script(Protocol):
    """
    One daemon-side connection: records each message with the time it arrived.
    """

    def __init__(self, server: ScriptServer) -> None:
        """Record nothing yet."""
        self.server = server
        self.buffer = b""
        self.received: list[tuple[float, dict[str, Any]]] = []

    def connectionMade(self) -> None:
        """Join the server's connections."""
        self.server.connections.append(self)

    def dataReceived(self, data: bytes) -> None:
        """Record every complete line as a message."""
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self.received.append((self.server.clock.seconds(), json.loads(line)))

    def send(self, message: dict[str, Any]) -> None:
        """Write one message as a line."""
        assert self.transport is not None
        self.transport.write(json.dumps(message).encode() + b"\n")


class ScriptServer(Factory):
    """
    The scripted daemon: builds a L{Script} per connection and keeps them.
    """

    def __init__(self, clock: MemoryReactorClock) -> None:
        """Keep C{clock} to time-stamp messages."""
        self.clock = clock
        self.connections: list[Script] = []

    def buildProtocol(self, addr: Any) -> Script:
        """Return a new L{Script}."""
        return Script(self)


class Harness:
    """
    A client on a memory reactor, its scripted daemon listening at L{PATH} (unless
    C{listen=False}), and the warnings it gave.
    """

    def __init__(self, listen: bool = True, **client_options: Any) -> None:
        """Build the reactor, the net, the script and the client."""
        self.reactor = MemoryReactorClock()
        self.net = MemoryNet(self.reactor)
        self.server = ScriptServer(self.reactor)
        if listen:
            self.net.listen(PATH, self.server)
        self.warnings: list[str] = []
        client_options.setdefault("on_warning", self.warnings.append)
        self.client = LeaseClient(self.reactor, PATH, **client_options)

    @property
    def conn(self) -> Script:
        """The latest daemon-side connection."""
        self.net.pump()
        return self.server.connections[-1]

    def sent(self, op: str | None = None, keyed: bool | None = None) -> list[dict[str, Any]]:
        """The messages the daemon got (on every connection), optionally one op's only."""
        self.net.pump()
        messages = [m for c in self.server.connections for _t, m in c.received]
        return [
            m
            for m in messages
            if (op is None or m["op"] == op) and (keyed is None or ("queueKey" in m) == keyed)
        ]

    def times(self, op: str, keyed: bool) -> list[float]:
        """When the daemon got each C{op} message, keyed or bare."""
        self.net.pump()
        return [
            t
            for c in self.server.connections
            for t, m in c.received
            if m["op"] == op and ("queueKey" in m) == keyed
        ]

    def reply(self, message: dict[str, Any]) -> None:
        """The daemon writes C{message} on the latest connection."""
        self.conn.send(message)
        self.net.pump()

    def grant(self, session: str, key: str = KEY, **terms: Any) -> None:
        """The daemon grants C{session}, with C{terms} as extra fields."""
        self.reply({"op": "granted", "queueKey": key, "sessionKey": session, **terms})

    def hold(
        self, test: SynchronousTestCase, session: str = "s1", key: str = KEY, **terms: Any
    ) -> Lease:
        """Acquire and grant at once; return the held lease."""
        d = self.client.acquire(key, session)
        self.net.pump()
        self.grant(session, key, **terms)
        lease: Lease = test.successResultOf(d)
        return lease


class AcquireTests(SynchronousTestCase):
    """
    acquire writes the seed's message and fires only on its own granted reply.
    """

    def test_acquire_message(self) -> None:
        """acquire sends queueKey, sessionKey, role, group and activity."""
        h = Harness()
        h.client.acquire(KEY, "s1", role="child", group="g", activity=False)
        self.assertEqual(
            h.sent(),
            [
                {
                    "op": "acquire",
                    "queueKey": KEY,
                    "sessionKey": "s1",
                    "role": "child",
                    "activity": False,
                    "group": "g",
                }
            ],
        )

    def test_granted_fires_with_terms(self) -> None:
        """The granted reply fires the acquire with a held, queued lease on its terms."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=9000, idleYieldMs=4000)
        self.assertEqual((lease.held, lease.queued), (True, True))
        self.assertEqual(lease.terms, LeaseTerms(9000, 4000))

    def test_missing_terms_use_fallback(self) -> None:
        """A granted reply without terms gives the lease the client's fallback terms."""
        h = Harness(fallback_terms=LeaseTerms(6000, 0))
        lease = h.hold(self)
        self.assertEqual(lease.terms, LeaseTerms(6000, 0))

    def test_unrelated_granted_dropped(self) -> None:
        """A granted naming another session or queue does not fire the acquire."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        h.grant("s2")
        h.grant("s1", key="http://other:1/v1")
        self.assertNoResult(d)
        h.grant("s1")
        self.assertTrue(self.successResultOf(d).held)

    def test_early_granted_not_buffered(self) -> None:
        """A granted that arrives before its acquire is dropped, not kept for it."""
        h = Harness()
        status = h.client.status()
        h.grant("s1")
        h.reply({"op": "status", "queues": []})
        self.assertEqual(self.successResultOf(status), [])
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        self.assertNoResult(d)

    def test_duplicate_acquire(self) -> None:
        """A second acquire of the same keys fails with DuplicateLease."""
        h = Harness()
        h.client.acquire(KEY, "s1")
        self.failureResultOf(h.client.acquire(KEY, "s1"), DuplicateLease)

    def test_cancel_deferred(self) -> None:
        """Cancelling the acquire sends cancel, fails it, and drops its later grant."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(h.sent("cancel"), [{"op": "cancel", "queueKey": KEY, "sessionKey": "s1"}])
        h.grant("s1")
        self.assertEqual(h.sent("renew"), [])

    def test_cancel_before_connected_sends_nothing(self) -> None:
        """An acquire cancelled while still connecting is never sent."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(h.sent(), [])

    def test_client_cancel_op(self) -> None:
        """cancel() ends the client's own waiting lease and sends cancel once."""
        h = Harness()
        d = h.client.acquire(KEY, "s1")
        h.net.pump()
        self.successResultOf(h.client.cancel(KEY, "s1"))
        self.failureResultOf(d, CancelledError)
        self.assertEqual(len(h.sent("cancel")), 1)

    def test_role(self) -> None:
        """role() sends the role op, and the session's lease re-queues with the new role."""
        h = Harness()
        d = h.client.acquire(KEY, "s1", role="child")
        h.net.pump()
        h.grant("s1", leaseTtlMs=3000, idleYieldMs=0)
        self.successResultOf(d)
        self.successResultOf(h.client.role("s1", "parent"))
        self.assertEqual(h.sent("role"), [{"op": "role", "sessionKey": "s1", "role": "parent"}])
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.assertEqual([m["role"] for m in h.sent("acquire")], ["child", "parent"])

    def test_invalid_arguments(self) -> None:
        """An empty queue key or an unknown role is refused before anything is sent."""
        h = Harness()
        self.assertRaises(ValueError, h.client.acquire, "", "s1")
        self.assertRaises(ValueError, h.client.acquire, KEY, "s1", role="boss")
        self.assertEqual(h.sent(), [])

    def test_one_connection_in_order(self) -> None:
        """Ops made while connecting share one connection and go out in call order."""
        h = Harness()
        h.client.acquire(KEY, "s1")
        h.client.status()
        h.client.role("s1", "child")
        self.assertEqual([m["op"] for m in h.sent()], ["acquire", "status", "role"])
        self.assertEqual(len(h.server.connections), 1)


class InOrderReplyTests(SynchronousTestCase):
    """
    ok, status and error replies are matched first-in first-out; strays are dropped.
    """

    def test_status(self) -> None:
        """status() fires with the queues of the status reply."""
        h = Harness()
        d = h.client.status()
        h.reply({"op": "status", "queues": [{"queueKey": KEY}]})
        self.assertEqual(self.successResultOf(d), [{"queueKey": KEY}])

    def test_error_fails_request(self) -> None:
        """An error reply fails the oldest in-order request with QueueReplyError."""
        h = Harness()
        d = h.client.status()
        h.reply({"op": "error", "reason": "nope"})
        self.assertEqual(self.failureResultOf(d, QueueReplyError).value.reason, "nope")

    def test_release_fires_on_its_ok(self) -> None:
        """release() sends release, stops the beats, and fires on the next bare ok."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.reply({"op": "ok"})
        d = h.client.release(lease)
        self.assertEqual(
            h.sent("release"), [{"op": "release", "queueKey": KEY, "sessionKey": "s1"}]
        )
        self.assertNoResult(d)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": True})
        self.assertNoResult(d)
        h.reply({"op": "ok"})
        self.assertIsNone(self.successResultOf(d))
        h.net.advance(10)
        self.assertEqual(h.sent("renew"), [])
        self.assertTrue(lease.ended)

    def test_stray_keyed_ok_dropped(self) -> None:
        """A granted:false for a beat the client never sent leaves the lease held."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.assertTrue(lease.held)
        self.assertEqual(h.sent("acquire")[1:], [])

    @given(
        st.lists(
            st.fixed_dictionaries(
                {
                    "op": st.sampled_from(["granted", "ok", "status", "bogus"]),
                    "queueKey": st.sampled_from([KEY, "other"]),
                    "sessionKey": st.sampled_from(["s2", "s3"]),
                    "granted": st.booleans(),
                }
            ),
            max_size=8,
        )
    )
    def test_unrelated_replies_answer_nothing(self, strays: list[dict[str, Any]]) -> None:
        """No mix of replies for other sessions fires an acquire or ends a held lease."""
        h = Harness()
        held = h.hold(self, session="s1", leaseTtlMs=3000, idleYieldMs=0)
        d = h.client.acquire(KEY, "s4")
        for stray in strays:
            h.reply(stray)
        self.assertNoResult(d)
        self.assertTrue(held.held)


class BeatTests(SynchronousTestCase):
    """
    Keyed beats and the bare heartbeat run on the leases' own terms.
    """

    def test_beat_period_from_ttl(self) -> None:
        """A 9 s TTL beats every 3 s, with the lease's keys."""
        h = Harness()
        h.hold(self, leaseTtlMs=9000, idleYieldMs=0)
        h.net.advance(9.5)
        self.assertEqual(h.times("renew", keyed=True), [3.0, 6.0, 9.0])
        self.assertEqual(
            h.sent("renew", keyed=True)[0], {"op": "renew", "queueKey": KEY, "sessionKey": "s1"}
        )

    def test_short_idle_window(self) -> None:
        """A 1 s idle-yield window caps the beat at 500 ms whatever the TTL."""
        h = Harness()
        h.hold(self, leaseTtlMs=30000, idleYieldMs=1000)
        h.net.advance(1.6)
        self.assertEqual(h.times("renew", keyed=True), [0.5, 1.0, 1.5])

    def test_floor(self) -> None:
        """A TTL of 600 ms beats at the 250 ms floor, not every 200 ms."""
        h = Harness()
        h.hold(self, leaseTtlMs=600, idleYieldMs=0)
        h.net.advance(0.6)
        self.assertEqual(h.times("renew", keyed=True), [0.25, 0.5])

    def test_not_the_client_config(self) -> None:
        """The granted terms, not the fallback, set the period."""
        h = Harness(fallback_terms=LeaseTerms(3000, 0))
        h.hold(self, leaseTtlMs=12000, idleYieldMs=0)
        h.net.advance(4.5)
        self.assertEqual(h.times("renew", keyed=True), [4.0])

    def test_per_queue_ttl_and_heartbeat(self) -> None:
        """Each lease beats on its own queue's TTL; the heartbeat runs at the smallest."""
        h = Harness()
        h.hold(self, "s1", KEY, leaseTtlMs=9000, idleYieldMs=0)
        h.hold(self, "s2", "zen", leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(6.5)
        beats = [(m["queueKey"]) for m in h.sent("renew", keyed=True)]
        self.assertEqual(beats.count(KEY), 2)
        self.assertEqual(beats.count("zen"), 6)
        self.assertEqual(h.times("renew", keyed=False), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])

    def test_heartbeat_recomputed(self) -> None:
        """Releasing the short lease stretches the heartbeat; releasing all stops it."""
        h = Harness()
        long = h.hold(self, "s1", KEY, leaseTtlMs=9000, idleYieldMs=0)
        short = h.hold(self, "s2", "zen", leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(1.0)
        h.client.release(short)
        h.net.advance(6.5)
        self.assertEqual(h.times("renew", keyed=False), [1.0, 4.0, 7.0])
        h.client.release(long)
        h.net.advance(10)
        self.assertEqual(h.times("renew", keyed=False), [1.0, 4.0, 7.0])

    def test_no_heartbeat_without_lease(self) -> None:
        """A connection that holds nothing sends no heartbeat."""
        h = Harness()
        h.client.status()
        h.net.advance(120)
        self.assertEqual(h.sent("renew"), [])

    def test_pause_and_resume(self) -> None:
        """Paused: no keyed beats, heartbeat goes on; resumed: a beat at once, then periodic."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        lease.pause_beats()
        h.net.advance(3.5)
        self.assertEqual(h.times("renew", keyed=True), [])
        self.assertEqual(h.times("renew", keyed=False), [1.0, 2.0, 3.0])
        lease.resume_beats()
        h.net.advance(1.0)
        self.assertEqual(h.times("renew", keyed=True), [3.5, 4.5])


class RequeueTests(SynchronousTestCase):
    """
    A keyed beat answered granted:false re-queues the lease until it is granted again.
    """

    def test_requeue(self) -> None:
        """granted:false: not held, observers told, acquire resent, beats stop until re-grant."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        lost: list[Lease] = []
        lease.add_lost_observer(lost.append)
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.assertFalse(lease.held)
        self.assertEqual(lost, [lease])
        self.assertEqual(len(h.sent("acquire")), 2)
        held = lease.when_held()
        self.assertNoResult(held)
        h.net.advance(5.0)
        self.assertEqual(h.times("renew", keyed=True), [1.0])
        h.grant("s1", leaseTtlMs=6000, idleYieldMs=0)
        self.assertIs(self.successResultOf(held), lease)
        self.assertEqual((lease.held, lease.terms.lease_ttl_ms), (True, 6000))
        h.net.advance(2.0)
        self.assertEqual(h.times("renew", keyed=True), [1.0, 8.0])

    def test_granted_true_keeps(self) -> None:
        """granted:true changes nothing."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": True})
        self.assertTrue(lease.held)
        self.assertEqual(len(h.sent("acquire")), 1)

    def test_release_while_requeued(self) -> None:
        """Releasing a re-queued lease cancels its request and ends it."""
        h = Harness()
        lease = h.hold(self, leaseTtlMs=3000, idleYieldMs=0)
        h.net.advance(1.0)
        h.reply({"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": False})
        self.successResultOf(h.client.release(lease))
        self.assertEqual(len(h.sent("cancel")), 1)
        self.assertTrue(lease.ended)


class WarningTests(SynchronousTestCase):
    """
    queue_timeout_ms warns a waiting parent once; a child never.
    """

    def test_parent_warned_once(self) -> None:
        """A parent still waiting past the timeout is warned once and stays queued."""
        h = Harness(queue_timeout_ms=2000)
        d = h.client.acquire(KEY, "s1")
        h.net.advance(1.9)
        self.assertEqual(h.warnings, [])
        h.net.advance(10)
        self.assertEqual(len(h.warnings), 1)
        self.assertIn("s1", h.warnings[0])
        h.grant("s1")
        self.assertTrue(self.successResultOf(d).held)

    def test_child_never_warned(self) -> None:
        """A child waiting past the timeout is not warned."""
        h = Harness(queue_timeout_ms=2000)
        h.client.acquire(KEY, "c1", role="child")
        h.net.advance(60)
        self.assertEqual(h.warnings, [])

    def test_granted_in_time(self) -> None:
        """A parent granted before the timeout is not warned."""
        h = Harness(queue_timeout_ms=2000)
        h.client.acquire(KEY, "s1")
        h.net.advance(1.0)
        h.grant("s1")
        h.net.advance(60)
        self.assertEqual(h.warnings, [])
