"""
L{loopd.queue.protocol}: the lease protocol's framing, ops, replies and error replies, in
memory over C{StringTransport}, and 50 clients over a real Unix socket.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, DeferredList, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from loopd.queue.protocol import (
    MAX_LINE_BYTES,
    MAX_OUTPUT_BYTES,
    LeaseFactory,
    LeaseProtocol,
    deliver_grant,
    encode_message,
)
from loopd.queue.scheduler import Scheduler
from loopd.queue.scheduler_types import QueuePolicy, StaticRouter
from loopd.test.support.peers import real_reactor
from loopd.unixsocket import listen_unix

KEY = "http://gpu:8001/v1"


class Harness:
    """
    A scheduler on a C{Clock} and a factory that builds in-memory connections.
    """

    def __init__(self, policy: QueuePolicy | None = None) -> None:
        self.clock = Clock()
        self.counts: list[int] = []
        self.scheduler = Scheduler(
            self.clock, StaticRouter(defaults=policy or QueuePolicy()), deliver_grant
        )
        self.factory = LeaseFactory(self.scheduler, on_clients=self.counts.append)

    def connect(self) -> tuple[LeaseProtocol, StringTransport]:
        connection = self.factory.buildProtocol(None)
        transport = StringTransport()
        connection.makeConnection(transport)
        return connection, transport


def send(connection: LeaseProtocol, *messages: Any) -> None:
    """Write each message as one line."""
    for message in messages:
        connection.dataReceived(json.dumps(message).encode("utf-8") + b"\n")


def replies(transport: StringTransport) -> list[Any]:
    """Decode every line written so far, and clear the transport."""
    data = transport.value()
    transport.clear()
    return [json.loads(line) for line in data.split(b"\n") if line]


def acquire(session: str, key: str = KEY, **fields: Any) -> dict[str, Any]:
    return {"op": "acquire", "queueKey": key, "sessionKey": session, **fields}


class OpTests(SynchronousTestCase):
    """
    Every op maps to the scheduler and writes the seed's reply shape.
    """

    def setUp(self) -> None:
        self.h = Harness(QueuePolicy(lease_ttl_ms=5000, idle_yield_ms=2000))
        self.conn, self.out = self.h.connect()

    def test_acquire_granted_at_once(self) -> None:
        """A free slot answers acquire with granted, keyed and with the lease's terms."""
        send(self.conn, acquire("s1"))
        self.assertEqual(
            replies(self.out),
            [
                {
                    "op": "granted",
                    "queueKey": KEY,
                    "sessionKey": "s1",
                    "leaseTtlMs": 5000,
                    "idleYieldMs": 2000,
                }
            ],
        )

    def test_queued_grant_reaches_its_connection(self) -> None:
        """A queued acquire stays unanswered; its grant reaches that connection on release."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1"))
        send(other, acquire("s2"))
        self.assertEqual(replies(other_out), [])
        replies(self.out)
        send(self.conn, {"op": "release", "queueKey": KEY, "sessionKey": "s1"})
        self.assertEqual(replies(self.out), [{"op": "ok"}])
        self.assertEqual([r["sessionKey"] for r in replies(other_out)], ["s2"])

    def test_release_not_held_is_ok(self) -> None:
        """release of a lease that is not held still replies ok."""
        send(self.conn, {"op": "release", "queueKey": KEY, "sessionKey": "nobody"})
        self.assertEqual(replies(self.out), [{"op": "ok"}])

    def test_cancel_drops_waiter_without_reply(self) -> None:
        """cancel drops a queued request and writes nothing."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1"))
        send(other, acquire("s2"), {"op": "cancel", "queueKey": KEY, "sessionKey": "s2"})
        self.assertEqual(replies(other_out), [])
        self.assertEqual(self.h.scheduler.status()[0]["waiting"], [])

    def test_cancel_releases_held_slot(self) -> None:
        """cancel of a granted session releases its slot to the next waiter."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1"))
        send(other, acquire("s2"))
        send(self.conn, {"op": "cancel", "queueKey": KEY, "sessionKey": "s1"})
        self.assertEqual([r["op"] for r in replies(self.out)], ["granted"])
        self.assertEqual([r["sessionKey"] for r in replies(other_out)], ["s2"])

    def test_role_retiers_waiter(self) -> None:
        """role re-tiers a live waiter, with no reply; absent role in acquire is parent."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1"))
        send(other, acquire("s2", role="child"), {"op": "role", "sessionKey": "s2"})
        waiting = self.h.scheduler.status()[0]["waiting"]
        self.assertEqual(waiting[0]["role"], "child")
        send(other, {"op": "role", "sessionKey": "s2", "role": "parent"})
        self.assertEqual(replies(other_out), [])
        self.assertEqual(self.h.scheduler.status()[0]["waiting"][0]["role"], "parent")
        self.assertEqual(self.h.scheduler.status()[0]["holders"][0]["role"], "parent")

    def test_bare_renew_heartbeats(self) -> None:
        """A bare renew replies ok and keeps the connection's leases past their TTL."""
        send(self.conn, acquire("s1"))
        replies(self.out)
        for _ in range(3):
            self.h.clock.advance(4)
            send(self.conn, {"op": "renew"})
        self.assertEqual(replies(self.out), [{"op": "ok"}] * 3)
        self.assertEqual(len(self.h.scheduler.status()[0]["holders"]), 1)

    def test_keyed_renew_reports_granted(self) -> None:
        """A keyed renew replies ok with its keys and whether the slot is still held."""
        send(self.conn, acquire("s1"))
        beat = {"op": "renew", "queueKey": KEY, "sessionKey": "s1"}
        send(self.conn, beat, {**beat, "sessionKey": "s9"})
        self.assertEqual(
            replies(self.out)[1:],
            [
                {"op": "ok", "queueKey": KEY, "sessionKey": "s1", "granted": True},
                {"op": "ok", "queueKey": KEY, "sessionKey": "s9", "granted": False},
            ],
        )

    def test_status(self) -> None:
        """status reports every queue with holders and waiters as sessionKey, role, group."""
        other, _ = self.h.connect()
        send(self.conn, acquire("s1", group="g"))
        send(other, acquire("s2", role="child"))
        replies(self.out)
        send(self.conn, {"op": "status"})
        self.assertEqual(
            replies(self.out),
            [
                {
                    "op": "status",
                    "queues": [
                        {
                            "queueKey": KEY,
                            "maxStreams": 1,
                            "switches": 0,
                            "holders": [{"sessionKey": "s1", "role": "parent", "group": "g"}],
                            "waiting": [{"sessionKey": "s2", "role": "child", "group": None}],
                        }
                    ],
                }
            ],
        )

    def test_bye_releases_and_uncounts(self) -> None:
        """bye releases the connection's slot to a waiter and stops counting it; no reply."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1"))
        send(other, acquire("s2"))
        replies(self.out)
        send(self.conn, {"op": "bye"})
        self.assertEqual(replies(self.out), [])
        self.assertEqual([r["sessionKey"] for r in replies(other_out)], ["s2"])
        self.assertEqual(self.h.counts, [1, 2, 1])

    def test_connection_lost_disconnects(self) -> None:
        """Losing the connection releases its lease and drops its waiters."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1"))
        send(other, acquire("s2"))
        self.conn.connectionLost(Failure(Exception("gone")))
        self.assertEqual([r["sessionKey"] for r in replies(other_out)], ["s2"])
        other.connectionLost(Failure(Exception("gone")))
        self.assertEqual(self.h.scheduler.status()[0]["holders"], [])
        self.assertEqual(self.h.counts, [1, 2, 1, 0])

    def test_status_only_is_not_counted(self) -> None:
        """A status-only connection is never a counted client."""
        send(self.conn, {"op": "status"})
        self.conn.connectionLost(connectionDone)
        self.assertEqual(self.h.counts, [])

    def test_activity_only_true(self) -> None:
        """Only JSON true in activity opts a lease into idle yield."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1", activity=1))
        send(other, acquire("s2"))
        self.h.clock.advance(3)
        self.h.scheduler.sweep()
        self.assertEqual(replies(other_out), [])


class ErrorTests(SynchronousTestCase):
    """
    Bad messages get an error reply and the connection stays usable.
    """

    def setUp(self) -> None:
        self.h = Harness()
        self.conn, self.out = self.h.connect()

    def assert_error(self, line: bytes, reason: str) -> None:
        self.conn.dataReceived(line + b"\n")
        send(self.conn, {"op": "status"})
        got = replies(self.out)
        self.assertEqual(got[0], {"op": "error", "reason": reason})
        self.assertEqual(got[1]["op"], "status")
        self.assertFalse(self.out.disconnecting)

    def test_invalid_json(self) -> None:
        """Invalid JSON is an error reply."""
        self.assert_error(b'{"op": "status"', "invalid JSON")

    def test_nan_and_infinity(self) -> None:
        """NaN and Infinity are invalid JSON, as for JavaScript's JSON.parse."""
        self.assert_error(b'{"op":"status","x":NaN}', "invalid JSON")
        self.assert_error(b'{"op":"status","x":-Infinity}', "invalid JSON")

    def test_non_object(self) -> None:
        """A JSON value that is not an object is an error reply."""
        self.assert_error(b'["status"]', "message must be a JSON object")

    def test_unknown_op(self) -> None:
        """An unknown or missing op is an error reply naming it."""
        self.assert_error(b'{"op":"steal"}', 'unknown op: "steal"')
        self.assert_error(b"{}", "unknown op: null")

    def test_keyless(self) -> None:
        """acquire, release and cancel without queueKey are refused by name."""
        for op in ("acquire", "release", "cancel"):
            self.assert_error(json.dumps({"op": op}).encode(), f"{op} requires queueKey")
        self.assertEqual(self.h.scheduler.status(), [])

    def test_blank_lines_ignored(self) -> None:
        """Blank lines are skipped with no reply."""
        self.conn.dataReceived(b"\n \r\n")
        self.assertEqual(replies(self.out), [])


class TextTests(SynchronousTestCase):
    """
    A string field that is not Unicode text (a lone surrogate, which JSON may spell as an
    escape but UTF-8 cannot carry) is an error reply naming the field, and nothing is stored.
    """

    def setUp(self) -> None:
        self.h = Harness()
        self.conn, self.out = self.h.connect()

    def test_lone_surrogate_key_then_status(self) -> None:
        """The issue's exact input: an error naming queueKey; a later status works."""
        self.conn.dataReceived(b'{"op":"acquire","queueKey":"\\ud800"}\n')
        self.assertEqual(
            replies(self.out),
            [{"op": "error", "reason": "queueKey must be Unicode text (got a lone surrogate)"}],
        )
        self.conn.dataReceived(b'{"op":"status"}\n')
        self.assertEqual(replies(self.out), [{"op": "status", "queues": []}])
        self.assertEqual(self.h.scheduler.status(), [])
        self.assertEqual(self.h.counts, [])
        self.assertFalse(self.out.disconnecting)

    def test_every_field_is_named(self) -> None:
        """sessionKey, role, group and op are refused by name, for every op that reads them."""
        bad = "\\udc00"
        cases = [
            ('{"op":"acquire","queueKey":"k","sessionKey":"%s"}', "sessionKey"),
            ('{"op":"acquire","queueKey":"k","role":"%s"}', "role"),
            ('{"op":"acquire","queueKey":"k","group":"x%s"}', "group"),
            ('{"op":"release","queueKey":"%s"}', "queueKey"),
            ('{"op":"cancel","queueKey":"k","sessionKey":"%s"}', "sessionKey"),
            ('{"op":"renew","queueKey":"%s","sessionKey":"s"}', "queueKey"),
            ('{"op":"role","sessionKey":"s","role":"%s"}', "role"),
            ('{"op":"%s"}', "op"),
        ]
        for template, field in cases:
            self.conn.dataReceived((template % bad).encode() + b"\n")
            reason = f"{field} must be Unicode text (got a lone surrogate)"
            self.assertEqual(replies(self.out), [{"op": "error", "reason": reason}], template)
        self.assertEqual(self.h.scheduler.status(), [])
        self.assertEqual(self.h.counts, [])

    def test_paired_surrogates_are_text(self) -> None:
        """A surrogate pair written as escapes is one character, and is accepted."""
        self.conn.dataReceived(b'{"op":"acquire","queueKey":"k","sessionKey":"\\ud83d\\ude42"}\n')
        self.assertEqual(replies(self.out)[0]["sessionKey"], "\U0001f642")

    def test_reply_escapes_what_utf8_cannot_carry(self) -> None:
        """A reply quoting a non-text value is still one valid line, the value escaped."""
        self.conn.dataReceived(b'{"op":["\\ud800"]}\n')
        self.assertEqual(
            self.out.value(), b'{"op":"error","reason":"unknown op: [\\"\\ud800\\"]"}\n'
        )
        self.assertEqual(encode_message({"k": "\ud800\u00e9"}), b'{"k":"\\ud800\\u00e9"}\n')

    def test_unread_field_is_ignored(self) -> None:
        """A lone surrogate in a field no op reads stores nothing and is not an error."""
        self.conn.dataReceived(b'{"op":"status","note":"\\ud800"}\n')
        self.assertEqual(replies(self.out), [{"op": "status", "queues": []}])

    @given(st.text(alphabet=st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010)))
    def test_any_key_leaves_status_working(self, key: str) -> None:
        """Whatever the key, status still encodes as UTF-8 and the connection stays up."""
        h = Harness()
        conn, out = h.connect()
        conn.dataReceived(json.dumps(acquire("s", key or "k")).encode() + b"\n")
        conn.dataReceived(b'{"op":"status"}\n')
        status = replies(out)[-1]
        self.assertEqual(status["op"], "status")
        self.assertFalse(out.disconnecting)
        json.dumps(h.scheduler.status(), ensure_ascii=False).encode("utf-8")


class OutputBoundTests(SynchronousTestCase):
    """
    A connection whose transport is full stops handling its lines until the output drains;
    grants it must still be sent are bounded by L{MAX_OUTPUT_BYTES}, past which it is dropped.
    """

    def setUp(self) -> None:
        self.h = Harness()
        self.conn, self.out = self.h.connect()

    def test_registered_as_streaming_producer(self) -> None:
        """The connection is its transport's streaming producer."""
        self.assertIs(self.out.producer, self.conn)
        self.assertTrue(self.out.streaming)

    def test_paused_holds_lines_and_stops_reading(self) -> None:
        """Lines read while paused wait, in order, and are all answered on resume."""
        self.conn.pauseProducing()
        self.assertEqual(self.out.producerState, "paused")
        send(self.conn, {"op": "status"}, acquire("s1"), {"op": "renew"})
        self.assertEqual(self.out.value(), b"")
        self.assertEqual(self.h.scheduler.status(), [])
        self.conn.resumeProducing()
        self.assertEqual(self.out.producerState, "producing")
        self.assertEqual([r["op"] for r in replies(self.out)], ["status", "granted", "ok"])

    def test_pause_inside_a_batch(self) -> None:
        """A pause raised by one reply's write stops the batch at that line."""
        written: list[bytes] = []

        def write(data: bytes) -> None:
            written.append(data)
            if len(written) == 2:
                self.conn.pauseProducing()

        self.out.write = write  # type: ignore[method-assign]
        self.conn.dataReceived(b'{"op":"status"}\n' * 5)
        self.assertEqual(len(written), 2)
        self.conn.resumeProducing()
        self.assertEqual(len(written), 5)

    def test_grants_past_the_bound_drop_the_peer(self) -> None:
        """A paused peer sent more than the bound in grants is aborted; its leases go."""
        h = Harness(QueuePolicy(max_streams=1))
        holder, _ = h.connect()
        send(holder, *[acquire("h", f"k{n}") for n in range(200)])
        waiter, out = h.connect()
        session = "w" + "x" * 8000
        send(waiter, *[acquire(session, f"k{n}") for n in range(200)])
        waiter.pauseProducing()
        self.assertGreater(200 * len(session), MAX_OUTPUT_BYTES)
        releases = [{"op": "release", "queueKey": f"k{n}", "sessionKey": "h"} for n in range(200)]
        send(holder, *releases)
        self.assertTrue(out.disconnecting)
        self.assertLessEqual(len(out.value()), MAX_OUTPUT_BYTES)
        for queue in h.scheduler.status():
            self.assertEqual((queue["holders"], queue["waiting"]), ([], []))


class FramingTests(SynchronousTestCase):
    """
    Lines are split on bytes and decoded whole; over-long lines disconnect.
    """

    def setUp(self) -> None:
        self.h = Harness()
        self.conn, self.out = self.h.connect()

    def test_split_utf8(self) -> None:
        """A message split inside a multi-byte character is decoded whole."""
        line = json.dumps(acquire("sé🙂"), ensure_ascii=False).encode("utf-8") + b"\n"
        cut = line.index("🙂".encode()) + 2
        self.conn.dataReceived(line[:cut])
        self.conn.dataReceived(line[cut:])
        self.assertEqual(replies(self.out)[0]["sessionKey"], "sé🙂")

    def test_limit_exactly_stays(self) -> None:
        """Exactly 102,400 bytes buffered without a newline keep the connection."""
        self.conn.dataReceived(b"x" * MAX_LINE_BYTES)
        self.assertFalse(self.out.disconnecting)
        self.conn.dataReceived(b"\n")
        self.assertEqual(replies(self.out), [{"op": "error", "reason": "invalid JSON"}])

    def test_limit_exceeded_disconnects(self) -> None:
        """102,401 bytes without a newline disconnect, release the peer, parse nothing."""
        other, other_out = self.h.connect()
        send(self.conn, acquire("s1"))
        send(other, acquire("s2"))
        replies(self.out)
        self.conn.dataReceived(b"x" * MAX_LINE_BYTES)
        self.conn.dataReceived(b'x"}\n{"op":"status"}\n')
        self.assertTrue(self.out.disconnecting)
        self.assertEqual(replies(self.out), [])
        self.assertEqual([r["sessionKey"] for r in replies(other_out)], ["s2"])

    def test_long_complete_line_disconnects(self) -> None:
        """An over-long line is refused even when its newline arrives in the same read."""
        self.conn.dataReceived(b'{"op":"status"}\n' + b" " * (MAX_LINE_BYTES + 1) + b"\n")
        self.assertEqual([r["op"] for r in replies(self.out)], ["status"])
        self.assertTrue(self.out.disconnecting)


_messages = st.one_of(
    st.builds(
        acquire,
        st.sampled_from(["a", "é", "🙂x", "b"]),
        st.sampled_from([KEY, "zen", "ключ"]),
    ),
    st.sampled_from(
        [
            {"op": "status"},
            {"op": "renew"},
            {"op": "release", "queueKey": "zen", "sessionKey": "🙂x"},
            {"op": "cancel", "queueKey": KEY, "sessionKey": "a"},
            {"op": "acquire"},
            {"op": "nope"},
        ]
    ),
)
_lines = st.one_of(
    _messages.map(lambda m: json.dumps(m, ensure_ascii=False).encode("utf-8")),
    st.sampled_from([b"{bad", b"[1]", b'"\xc3\xa9"', b"\xff\xfe"]),
)


def _run(chunks: list[bytes]) -> bytes:
    """Feed chunks to a fresh connection; return everything it wrote."""
    harness = Harness()
    connection, transport = harness.connect()
    for chunk in chunks:
        connection.dataReceived(chunk)
    return bytes(transport.value())


class SplitPropertyTests(SynchronousTestCase):
    """
    The replies do not depend on how the stream is split into reads.
    """

    @given(st.lists(_lines, max_size=12), st.lists(st.integers(0, 10_000), max_size=8))
    def test_any_split_same_replies(self, lines: list[bytes], cuts: list[int]) -> None:
        """Any split of a valid stream of lines into reads gives the same replies."""
        stream = b"".join(line + b"\n" for line in lines)
        points = sorted({c % (len(stream) + 1) for c in cuts})
        bounds = [0, *points, len(stream)]
        chunks = [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        self.assertEqual(_run(chunks), _run([stream]))


class SweepTests(SynchronousTestCase):
    """
    The factory runs the scheduler's sweep on its clock while started.
    """

    def test_sweep_evicts_lapsed(self) -> None:
        """A lapsed lease is evicted by the sweep and its waiter granted."""
        h = Harness(QueuePolicy(lease_ttl_ms=1000))
        factory = LeaseFactory(h.scheduler, reactor=h.clock, sweep_ms=100)
        factory.doStart()
        self.addCleanup(factory.doStop)
        first = factory.buildProtocol(None)
        first.makeConnection(StringTransport())
        second = factory.buildProtocol(None)
        out = StringTransport()
        second.makeConnection(out)
        send(first, acquire("s1"))
        send(second, acquire("s2"))
        h.clock.pump([0.1] * 11)
        self.assertEqual([r["sessionKey"] for r in replies(out)], ["s2"])


class _Client(Protocol):
    """Sends an acquire and a status, then leaves once the status reply arrives."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.received = b""
        self.lost: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.write(json.dumps(acquire(self.session)).encode() + b'\n{"op":"status"}\n')

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if b'"op":"status"' in self.received and self.transport is not None:
            self.transport.loseConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(None)


class _Silent(Protocol):
    """
    Writes its lines at once and reads nothing until told to; C{complete} fires once
    C{expected} bytes have arrived.
    """

    transport: Any

    def __init__(self, data: bytes, expected: int) -> None:
        self.data = data
        self.expected = expected
        self.received = bytearray()
        self.complete: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.pauseProducing()
        self.transport.write(self.data)

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if len(self.received) >= self.expected and not self.complete.called:
            self.complete.callback(None)


def unwritten(transport: Any) -> int:
    """
    The bytes a Twisted socket transport holds that the kernel has not taken yet (the
    daemon's own output buffer; private attributes of C{FileDescriptor}, read for the test).
    """
    held: int = len(transport.dataBuffer) - transport.offset + transport._tempDataLen
    return held


class UnreadRepliesTests(TestCase):
    """
    Issue 12 item 3: a client that sends C{status} requests and never reads the replies
    makes the daemon stop reading it, not buffer every reply; once it reads, every reply
    arrives.
    """

    @inlineCallbacks
    def test_status_flood_without_reading(self) -> Any:
        """1.6 MB of status requests, unread: the daemon's buffers stay bounded; nothing lost."""
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "q.sock")
        scheduler = Scheduler(reactor, StaticRouter(), deliver_grant)
        for n in range(4):
            scheduler.acquire(object(), f"queue-{n}", "s", "parent", None, False)
        factory = _TrackingFactory(scheduler)
        servers: list[LeaseProtocol] = []
        build = factory.buildProtocol

        count = 100_000
        read: list[int] = [0]
        # Fires once the daemon stops reading the client, or has read every request.
        settled: Deferred[None] = Deferred()

        def settle() -> None:
            if not settled.called:
                settled.callback(None)

        def record(addr: Any) -> LeaseProtocol:
            server = build(addr)
            original, pause = server.dataReceived, server.pauseProducing

            def counting(data: bytes) -> None:
                read[0] += len(data)
                original(data)
                if read[0] >= 16 * count:
                    settle()

            def pausing() -> None:
                pause()
                settle()

            server.dataReceived = counting  # type: ignore[method-assign]
            server.pauseProducing = pausing  # type: ignore[method-assign]
            servers.append(server)
            return server

        factory.buildProtocol = record  # type: ignore[method-assign]
        port = listen_unix(reactor, path, factory)
        self.addCleanup(port.stopListening)
        reply = len(encode_message({"op": "status", "queues": scheduler.status()}))
        client = _Silent(b'{"op":"status"}\n' * count, expected=count * reply)
        yield connectProtocol(UNIXClientEndpoint(reactor, path), client)
        yield settled
        server: Any = servers[0]
        # A paused daemon stops reading at once: what it read is all it will read.
        self.assertLess(read[0], 16 * count)
        self.assertLessEqual(unwritten(server.transport), 65_536 + reply)
        self.assertLessEqual(len(server._buffer), 2 * 65_536)
        client.transport.resumeProducing()
        yield client.complete
        lines = bytes(client.received).split(b"\n")
        self.assertEqual(len(lines) - 1, count)
        self.assertEqual(
            set(lines[:-1]), {encode_message({"op": "status", "queues": scheduler.status()})[:-1]}
        )
        client.transport.loseConnection()
        yield DeferredList(factory.lost)
        self.assertEqual(unwritten(server.transport), 0)


class _TrackingFactory(LeaseFactory):
    """Fires a Deferred per server-side connection when it is lost."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.lost: list[Deferred[None]] = []

    def buildProtocol(self, addr: Any) -> LeaseProtocol:
        connection = super().buildProtocol(addr)
        done: Deferred[None] = Deferred()
        self.lost.append(done)
        original = connection.connectionLost

        def lost(reason: Failure = connectionDone) -> None:
            original(reason)
            done.callback(None)

        connection.connectionLost = lost  # type: ignore[method-assign]
        return connection


class RealSocketTests(TestCase):
    """
    Over a real Unix socket, clients come and go without leaking file descriptors.
    """

    @inlineCallbacks
    def round_of_clients(self, reactor: Any, path: str, factory: _TrackingFactory) -> Any:
        """Run 50 clients through acquire, status and leaving; wait for both sides to close."""
        factory.lost = []
        clients = [_Client(f"s{n}") for n in range(50)]
        yield DeferredList(
            [connectProtocol(UNIXClientEndpoint(reactor, path), c) for c in clients],
            fireOnOneErrback=True,
        )
        yield DeferredList([c.lost for c in clients])
        yield DeferredList(factory.lost)
        self.assertEqual(len(factory.lost), 50)
        self.assertTrue(all(b'"op":"status"' in c.received for c in clients))

    @inlineCallbacks
    def test_fifty_clients_no_fd_growth(self) -> Any:
        """50 clients connect, acquire and leave: no fd growth and no state left behind."""
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "q.sock")
        scheduler = Scheduler(reactor, StaticRouter(), deliver_grant)
        factory = _TrackingFactory(scheduler)
        port = listen_unix(reactor, path, factory)
        self.addCleanup(port.stopListening)
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        # A first round warms the reactor up (it opens some descriptors lazily).
        yield self.round_of_clients(reactor, path, factory)
        before = len(os.listdir("/proc/self/fd"))
        yield self.round_of_clients(reactor, path, factory)
        self.assertEqual(len(os.listdir("/proc/self/fd")), before)
        queue = scheduler.status()[0]
        self.assertEqual((queue["holders"], queue["waiting"]), ([], []))
        self.assertEqual(factory.clients, 0)
