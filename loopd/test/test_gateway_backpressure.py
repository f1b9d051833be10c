"""
Backpressure end to end through the gateway, over real Unix sockets on the real reactor: a
streaming client that stops reading pauses loopd's read of the upstream answer, so what
loopd holds stays bounded; when the client reads again every byte arrives.

The upstream is a push producer (L{StreamingUpstream}): it writes only while its own
transport takes more, so its pause shows that the whole chain stood still, from the
client's socket back through the gateway and the llama client to the model server.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import ClientFactory, Factory, Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from loopd.gateway.site import Gateway
from loopd.llama import Client
from loopd.settings import Config, Endpoint, Limits
from loopd.test.support.peers import buffered, real_reactor
from loopd.test.support.streaming import ReadCounter, StreamingUpstream
from loopd.testing.fake_llama import sse_reply

#: The upstream answer: 512 content deltas of 16 KiB, 8 MiB of text in all.
PIECES = 512
PIECE_CHARS = 16 * 1024
#: What loopd may hold in its own buffers while the client does not read.
BOUND = 1024 * 1024


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """One upstream chunk as llama-server streams it."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    sent: dict[str, Any] = {"id": "chatcmpl-up", "object": "chat.completion.chunk"}
    sent["choices"] = [choice]
    if finish is not None:
        sent["timings"] = {"cache_n": 0, "prompt_n": 5, "predicted_n": PIECES}
    return sent


class StalledReader(Protocol):
    """
    A streaming client that sends its request and then does not read, until told to; it
    keeps what it reads and fires C{done} when the connection closes.
    """

    transport: Any

    def __init__(self, request: bytes, done: Deferred[bytes]) -> None:
        self._request = request
        self._done = done
        self.received: list[bytes] = []

    def connectionMade(self) -> None:
        """Send the request, then stop reading."""
        self.transport.write(self._request)
        self.transport.pauseProducing()

    def read_again(self) -> None:
        """Read everything from now on."""
        self.transport.resumeProducing()

    def dataReceived(self, data: bytes) -> None:
        """Keep it."""
        self.received.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """The answer is complete (HTTP/1.0: it ends with the connection)."""
        self._done.callback(b"".join(self.received))


def sse_contents(raw: bytes) -> tuple[str, list[str]]:
    """The concatenated content deltas of a raw HTTP/1.0 event stream, and its data payloads."""
    head, _, body = raw.partition(b"\r\n\r\n")
    payloads = [
        event[len("data: ") :]
        for event in body.decode("utf-8").split("\n\n")
        if event.startswith("data: ")
    ]
    text = "".join(
        choice["delta"].get("content") or ""
        for payload in payloads
        if payload != "[DONE]"
        for choice in json.loads(payload)["choices"]
    )
    return text, payloads


async def _settled(*waits: Deferred[Any]) -> None:
    """Wait for every one of C{waits}, whatever it fires with."""
    for wait in waits:
        try:
            await wait
        except Exception:
            pass


class GatewayBackpressureTests(TestCase):
    """A streaming client that stops reading, over real sockets."""

    timeout = 120

    @inlineCallbacks
    def test_stalled_reader_pauses_the_upstream(self) -> Any:
        """
        While the client does not read, the upstream is paused with most of its answer
        unsent and loopd holds under 1 MiB; once the client reads, every byte arrives and
        the stream ends with [DONE].
        """
        reactor = real_reactor()
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        upstream_path = os.path.join(directory, "llama.sock")
        gateway_path = os.path.join(directory, "loopd.sock")

        texts = [os.urandom(PIECE_CHARS // 2).hex() for _ in range(PIECES)]
        reply = sse_reply([chunk({"content": text}) for text in texts] + [chunk({}, "stop")])
        wire = [reply.render_head(), *(reply.frame(p.data) for p in reply.pieces), b"0\r\n\r\n"]
        upstream_paused: Deferred[None] = Deferred()
        upstream_closed: Deferred[None] = Deferred()
        upstream = StreamingUpstream(reactor, wire, upstream_paused, upstream_closed)
        port = reactor.listenUNIX(upstream_path, Factory.forProtocol(lambda: upstream))
        self.addCleanup(port.stopListening)

        endpoint = Endpoint(name="tiny", socket=upstream_path, selftest=False)
        config = Config(endpoints=(endpoint,), limits=Limits())
        gateway = Gateway(reactor, config, {"tiny": Client(reactor, config, endpoint)})
        site = gateway.site()
        channels: list[Any] = []
        build = site.buildProtocol

        def recording(addr: Any) -> Any:
            channel = build(addr)
            channels.append(channel)
            return channel

        site.buildProtocol = recording  # type: ignore[method-assign]
        listening = reactor.listenUNIX(gateway_path, site)
        self.addCleanup(listening.stopListening)
        self.assertIsInstance(site, Site)

        counter = ReadCounter(self.patch)

        body = json.dumps(
            {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "Go"}]}
        ).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.0\r\nHost: loopd\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        done: Deferred[bytes] = Deferred()
        reader = StalledReader(request, done)
        reactor.connectUNIX(gateway_path, ClientFactory.forProtocol(lambda: reader))

        def close_all() -> Deferred[Any]:
            # A failing test leaves no connection behind: close both ends and wait.
            for protocol in (reader, upstream):
                if protocol.transport is not None and not protocol.transport.disconnected:
                    protocol.transport.abortConnection()
            return Deferred.fromCoroutine(_settled(done, upstream_closed))

        self.addCleanup(close_all)

        def too_early(result: object) -> object:
            # A gateway without backpressure lets the whole answer through unpaused.
            if not upstream_paused.called:
                upstream_paused.errback(Failure(AssertionError("the upstream never paused")))
            return result

        upstream_closed.addBoth(too_early)
        yield upstream_paused
        (channel,) = channels
        held = buffered(channel.transport)
        self.assertLess(held, BOUND)
        self.assertLess(upstream.sent, upstream.total // 2)
        # What loopd read and did not yet hand to the kernel is at most what it read.
        self.assertLess(counter.read, upstream.sent)

        reader.read_again()
        raw = yield done
        yield upstream_closed
        self.assertEqual(upstream.sent, upstream.total)
        self.assertTrue(raw.startswith(b"HTTP/1.0 200 "))
        text, payloads = sse_contents(raw)
        self.assertEqual(payloads[-1], "[DONE]")
        self.assertEqual(len(text), PIECES * PIECE_CHARS)
        # Compared by digest: a failing assertEqual would print 8 MiB twice.
        self.assertEqual(
            hashlib.sha256(text.encode()).hexdigest(),
            hashlib.sha256("".join(texts).encode()).hexdigest(),
        )
        self.assertEqual(gateway.in_flight, set())
