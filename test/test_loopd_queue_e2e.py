"""
The lease scheduler inside C{twist loopd}, end to end: a real llama.cpp server (xllamacpp)
with the project's tiny models, C{twist inferproxy} in front of it, and C{twist loopd} with a
C{[queue]} table. An outside client speaks the lease protocol (raw newline JSON) on loopd's
lease socket while gateway requests arrive on the gateway's socket: both compete for the
endpoint's queue, whose streams are the server's slots.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, TestCase

from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import TwistProcess, spawn_twist, stop_twist

try:
    from loopd.test.support.gateway_stack import RawStream, loopd_toml, serve_behind_proxy
except (ImportError, SkipTest) as e:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the loopd queue end-to-end tests need the test extra: {e}") from None

SLOTS = 2
QUEUED = b': loopd {"event":"queued"'


class LeaseClient(Protocol):
    """
    An outside lease-protocol client: writes one JSON object per line and hands out the
    replies in order.
    """

    def __init__(self) -> None:
        """Start with nothing read."""
        self._buffer = b""
        self._replies: list[Any] = []
        self._readers: list[Deferred[Any]] = []

    def dataReceived(self, data: bytes) -> None:
        """Split the input into lines; each is one reply."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            reply = json.loads(line)
            if self._readers:
                self._readers.pop(0).callback(reply)
            else:
                self._replies.append(reply)

    def send(self, **message: Any) -> None:
        """Write one message."""
        assert self.transport is not None
        self.transport.write(json.dumps(message).encode() + b"\n")

    def reply(self) -> Deferred[Any]:
        """Fire with the next reply."""
        if self._replies:
            return succeed(self._replies.pop(0))
        reader: Deferred[Any] = Deferred()
        self._readers.append(reader)
        return reader


class LoopdQueueEndToEndTests(TestCase):
    """
    Outside leases and gateway requests in the same queue of a running loopd.
    """

    timeout = 180

    @inlineCallbacks
    def start(self, model: str, *extra: str) -> Any:
        """
        Start the server with C{model}, an inferproxy and C{twist loopd} (C{extra} lines
        added to its C{[queue]} table); fire when ready.
        """
        reactor = real_reactor()
        self.directory, self.server, infer = yield serve_behind_proxy(self, model, SLOTS)
        self.socket = os.path.join(self.directory, "loopd.sock")
        self.lease_socket = os.path.join(self.directory, "lease.sock")
        self.slots = (yield self.server.query("/props")).json()["total_slots"]
        config = os.path.join(self.directory, "loopd.toml")
        queue = ["[queue]", f"socket = {json.dumps(self.lease_socket)}"]
        queue += ["grace_ms = 200", "sweep_ms = 50", *extra]
        with open(config, "w") as f:
            f.write(loopd_toml(self.socket, infer, None, long=model != "tiny.gguf"))
            f.write("\n".join(queue) + "\n")
        self.loopd: TwistProcess = spawn_twist(
            reactor, b"loopd serving", "loopd", "--config", config
        )
        self.addCleanup(stop_twist, self.loopd)
        yield self.loopd.ready

    @inlineCallbacks
    def lease_client(self) -> Any:
        """An outside client connected to loopd's lease socket."""
        client = LeaseClient()
        endpoint = UNIXClientEndpoint(real_reactor(), self.lease_socket)
        yield endpoint.connect(Factory.forProtocol(lambda: client))
        self.addCleanup(self.disconnect, client)
        return client

    def disconnect(self, client: LeaseClient) -> None:
        """Drop C{client}'s connection if it is still open."""
        if client.transport is not None:
            client.transport.loseConnection()

    @inlineCallbacks
    def http(self, head: str, body: bytes, marker: bytes) -> Any:
        """
        Send one raw request on the gateway socket (C{Connection: close}); fire with the
        connection once C{marker} has arrived.
        """
        stream = RawStream(marker, 1)
        endpoint = UNIXClientEndpoint(real_reactor(), self.socket)
        yield endpoint.connect(Factory.forProtocol(lambda: stream))
        assert stream.transport is not None
        stream.transport.write(head.encode("latin-1") + body)
        self.addCleanup(stream.transport.loseConnection)
        yield stream.seen
        return stream

    def chat(self, marker: bytes) -> Deferred[Any]:
        """A streamed chat request; fires once C{marker} has arrived."""
        document = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
        }
        encoded = json.dumps(document).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: loopd\r\nConnection: close\r\n"
            "X-Session-Id: gateway-session\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(encoded)}\r\n\r\n"
        )
        return self.http(head, encoded, marker)

    @inlineCallbacks
    def queue_status(self) -> Any:
        """C{GET /v1/queue} over the gateway socket: the status reply."""
        head = "GET /v1/queue HTTP/1.1\r\nHost: loopd\r\nConnection: close\r\n\r\n"
        stream = yield self.http(head, b"", b"\r\n\r\n")
        yield stream.closed
        status_line, _, rest = stream.received.partition(b"\r\n")
        self.assertIn(b" 200 ", status_line)
        return json.loads(rest.partition(b"\r\n\r\n")[2])

    @inlineCallbacks
    def test_gateway_waits_for_outside_client(self) -> Any:
        """An outside client holding every slot: a gateway request waits until it releases."""
        yield self.start("tiny.gguf")
        self.assertEqual(stat.S_IMODE(os.stat(self.lease_socket).st_mode), 0o600)
        self.assertEqual(self.slots, SLOTS)
        client = yield self.lease_client()
        for i in range(self.slots):
            client.send(op="acquire", queueKey="tiny", sessionKey=f"outside-{i}")
            granted = yield client.reply()
            self.assertEqual(
                (granted["op"], granted["queueKey"], granted["sessionKey"]),
                ("granted", "tiny", f"outside-{i}"),
            )
        stream = yield self.chat(QUEUED)
        # Nothing but the role chunk yet: the request has not gone upstream.
        self.assertEqual(stream.received.count(b"data: "), 1)
        (queue,) = (yield self.queue_status())["queues"]
        outside = [
            {"sessionKey": f"outside-{i}", "role": "parent", "group": None}
            for i in range(self.slots)
        ]
        self.assertEqual(queue["holders"], outside)
        self.assertEqual([w["sessionKey"] for w in queue["waiting"]], ["gateway-session"])
        self.assertEqual(queue["maxStreams"], SLOTS)
        client.send(op="release", queueKey="tiny", sessionKey="outside-0")
        self.assertEqual((yield client.reply()), {"op": "ok"})
        yield stream.closed
        self.assertIn(b"data: [DONE]", stream.received)
        self.assertGreater(stream.received.count(b'"content":"'), 2)
        self.assertLess(stream.received.index(QUEUED), stream.received.index(b"[DONE]"))
        (queue,) = (yield self.queue_status())["queues"]
        self.assertEqual(queue["switches"], 1)

    @inlineCallbacks
    def test_outside_client_waits_for_gateway(self) -> Any:
        """An outside waiter behind a gateway stream is granted once that stream ends."""
        yield self.start("tiny-think.gguf")
        stream = yield self.chat(b'"reasoning_content"')
        client = yield self.lease_client()
        client.send(op="acquire", queueKey="tiny", sessionKey="outside-0")
        self.assertEqual((yield client.reply())["sessionKey"], "outside-0")
        client.send(op="acquire", queueKey="tiny", sessionKey="outside-1")
        client.send(op="status")
        status = yield client.reply()
        self.assertEqual(status["op"], "status")
        (queue,) = (yield self.queue_status())["queues"]
        self.assertEqual(queue, status["queues"][0])
        self.assertEqual([w["sessionKey"] for w in queue["waiting"]], ["outside-1"])
        holders = {h["sessionKey"] for h in queue["holders"]}
        self.assertEqual(holders, {"gateway-session", "outside-0"})
        assert stream.transport is not None
        stream.transport.loseConnection()
        yield stream.closed
        granted = yield client.reply()
        self.assertEqual((granted["op"], granted["sessionKey"]), ("granted", "outside-1"))
        (queue,) = (yield self.queue_status())["queues"]
        after = {h["sessionKey"] for h in queue["holders"]}
        self.assertEqual(after, {"outside-0", "outside-1"})

    @inlineCallbacks
    def test_queue_config_reload_and_log(self) -> Any:
        """[queue] config: applied at start, hot-reloaded on an atomic save, logFile written."""
        policy = os.path.join(self.directory_for_config(), "llm-queue.json")
        log = os.path.join(os.path.dirname(policy), "events.log")
        document = {"defaults": {"logFile": log}, "queues": {"tiny": {"maxStreams": 1}}}
        with open(policy, "w") as f:
            json.dump(document, f)
        yield self.start("tiny.gguf", f"config = {json.dumps(policy)}")
        stream = yield self.chat(b"[DONE]")
        yield stream.closed
        (queue,) = (yield self.queue_status())["queues"]
        self.assertEqual(queue["maxStreams"], 1)
        document["queues"]["tiny"]["maxStreams"] = 3
        with open(policy + ".tmp", "w") as f:
            json.dump(document, f)
        os.rename(policy + ".tmp", policy)
        for _ in range(100):
            (queue,) = (yield self.queue_status())["queues"]
            if queue["maxStreams"] == 3:
                break
            yield deferLater(real_reactor(), 0.05, lambda: None)
        self.assertEqual(queue["maxStreams"], 3)
        with open(log) as f:
            events = [json.loads(line) for line in f]
        first = events[0]
        self.assertEqual(
            (first["event"], first["queueKey"], first["sessionKey"], first["role"]),
            ("grant", "tiny", "gateway-session", "parent"),
        )
        self.assertIn("ts", first)

    def directory_for_config(self) -> str:
        """A short temp dir for the queue config, removed after the test."""
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        return directory
