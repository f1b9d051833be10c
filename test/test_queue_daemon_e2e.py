"""
C{twist llmqueue} as a child process, driven over its socket: stale and live sockets, the
socket's modes, idle exit, C{bye}, SIGTERM, the config at start, every hot-reload case and the
event log.

Waits are on protocol replies and process output, never on sleeps.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from loopd.test.support.peers import real_reactor
from loopd.test.support.twist import ROOT, TwistProcess, stop_twist

KEY = "http://gpu:8001/v1"
OTHER = "http://gpu:8002/v1"
THIRD = "http://gpu:8003/v1"
READY = b"llmqueue: listening on"
RELOADED = b"llmqueue: reload: "
KEEP_ALIVE = 10**9

Message = dict[str, Any]


class DaemonProcess(TwistProcess):
    """
    A C{twist llmqueue} child that can also be waited on for text in its stdout or stderr.
    """

    def __init__(self) -> None:
        super().__init__(READY)
        self._waits: list[tuple[str, bytes, int, Deferred[None]]] = []

    def outReceived(self, data: bytes) -> None:
        super().outReceived(data)
        self._check()

    def errReceived(self, data: bytes) -> None:
        super().errReceived(data)
        self._check()

    def processEnded(self, reason: Failure) -> None:
        waits, self._waits = self._waits, []
        for stream, marker, _, d in waits:
            d.errback(RuntimeError(f"ended before {marker!r} on {stream}"))
        super().processEnded(reason)

    def mark(self, stream: str = "out") -> int:
        """Return the current length of C{stream}, to wait for what comes after it."""
        return len(self.output if stream == "out" else self.errors)

    def wait_for(self, marker: bytes, after: int = 0, stream: str = "out") -> Deferred[None]:
        """Fire once C{marker} appears in C{stream} past offset C{after}."""
        d: Deferred[None] = Deferred()
        self._waits.append((stream, marker, after, d))
        self._check()
        return d

    def _check(self) -> None:
        pending = []
        for stream, marker, after, d in self._waits:
            text = self.output if stream == "out" else self.errors
            if marker in text[after:]:
                d.callback(None)
            else:
                pending.append((stream, marker, after, d))
        self._waits = pending


class LineClient(Protocol):
    """
    A raw lease-protocol client: writes JSON lines, queues the replies for L{next}.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._unread: list[Message] = []
        self._waits: list[tuple[Callable[[Message], bool], Deferred[Message]]] = []
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._unread.append(json.loads(line))
        self._match()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        waits, self._waits = self._waits, []
        for _, d in waits:
            d.errback(RuntimeError("connection closed"))
        self.closed.callback(None)

    def send(self, **message: Any) -> None:
        assert self.transport is not None
        self.transport.write(json.dumps(message).encode("utf-8") + b"\n")

    def next(self, op: str) -> Deferred[Message]:
        """Fire with the first unread reply whose C{op} is C{op}."""
        d: Deferred[Message] = Deferred()
        self._waits.append((lambda message: message.get("op") == op, d))
        self._match()
        return d

    def acquire(self, session: str, key: str = KEY) -> Deferred[Message]:
        """Ask for a slot; fire with the C{granted} reply."""
        self.send(op="acquire", queueKey=key, sessionKey=session)
        return self.next("granted")

    def status(self) -> Deferred[Message]:
        """Fire with a fresh C{status} reply."""
        self.send(op="status")
        return self.next("status")

    def _match(self) -> None:
        for test, d in list(self._waits):
            found = next((m for m in self._unread if test(m)), None)
            if found is not None:
                self._unread.remove(found)
                self._waits.remove((test, d))
                d.callback(found)


def queue_of(status: Message, key: str) -> Message:
    """Return the entry of C{key} in a C{status} reply."""
    return next(q for q in status["queues"] if q["queueKey"] == key)


class DaemonTestCase(TestCase):
    """
    Runs daemons in a short temporary agent dir and cleans up their processes and clients.
    """

    timeout = 30

    def setUp(self) -> None:
        self.reactor = real_reactor()
        self.root = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.root, True)
        self.agent_dir = os.path.join(self.root, "agent")
        self.socket_path = os.path.join(self.agent_dir, "llm-queue.sock")
        self.config_path = os.path.join(self.agent_dir, "llm-queue.json")

    def config(self, document: object) -> None:
        os.makedirs(self.agent_dir, mode=0o700, exist_ok=True)
        text = document if isinstance(document, str) else json.dumps(document)
        with open(self.config_path, "w", encoding="utf-8") as f:
            f.write(text)

    def spawn(self) -> DaemonProcess:
        process = DaemonProcess()
        argv = [sys.executable, "-m", "twisted", "--log-format=text", "llmqueue"]
        argv += ["--agent-dir", self.agent_dir, "--sweep-ms", "50"]
        self.reactor.spawnProcess(
            process, sys.executable, argv, env=dict(os.environ), path=str(ROOT)
        )
        self.addCleanup(stop_twist, process)
        return process

    @inlineCallbacks
    def start(self) -> Any:
        process = self.spawn()
        yield process.ready
        return process

    @inlineCallbacks
    def connect(self) -> Any:
        client = yield connectProtocol(
            UNIXClientEndpoint(self.reactor, self.socket_path), LineClient()
        )
        self.addCleanup(self.disconnect, client)
        return client

    @inlineCallbacks
    def connect_many(self, count: int) -> Any:
        clients = []
        for _ in range(count):
            client = yield self.connect()
            clients.append(client)
        return clients

    def disconnect(self, client: LineClient) -> Deferred[None]:
        if not client.closed.called and client.transport is not None:
            client.transport.loseConnection()
        return client.closed

    @inlineCallbacks
    def edit(self, process: DaemonProcess, document: object) -> Any:
        """Write the config and wait until the daemon has read it."""
        after = process.mark()
        self.config(document)
        yield process.wait_for(RELOADED, after)


class SocketTests(DaemonTestCase):
    """
    The socket's lifecycle: stale reclaimed, live respected, private modes.
    """

    @inlineCallbacks
    def test_stale_socket_reclaimed(self) -> Any:
        """A socket file nobody accepts on is replaced, and the daemon serves."""
        os.makedirs(self.agent_dir, mode=0o700)
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(self.socket_path)
        stale.close()
        self.config({"defaults": {"daemonIdleExitMs": KEEP_ALIVE}})
        yield self.start()
        client = yield self.connect()
        reply = yield client.status()
        self.assertEqual(reply["queues"], [])

    @inlineCallbacks
    def test_live_socket(self) -> Any:
        """A second daemon exits 0 with one stderr line; the first still serves."""
        self.config({"defaults": {"daemonIdleExitMs": KEEP_ALIVE}})
        yield self.start()
        second = self.spawn()
        second.ready.addErrback(lambda failure: None)
        code = yield second.ended
        self.assertEqual(code, 0)
        lines = second.errors.decode().splitlines()
        self.assertEqual(len(lines), 1)
        self.assertIn("in use", lines[0])
        client = yield self.connect()
        granted = yield client.acquire("a")
        self.assertEqual(granted["sessionKey"], "a")

    @inlineCallbacks
    def test_modes(self) -> Any:
        """The agent dir the daemon creates is 0700 and its socket is 0600."""
        yield self.start()
        self.assertEqual(stat.S_IMODE(os.stat(self.agent_dir).st_mode), 0o700)
        mode = os.stat(self.socket_path).st_mode
        self.assertTrue(stat.S_ISSOCK(mode))
        self.assertEqual(stat.S_IMODE(mode), 0o600)


class ExitTests(DaemonTestCase):
    """
    Idle exit and SIGTERM: status 0 and the socket unlinked.
    """

    @inlineCallbacks
    def test_idle_exit_after_last_client(self) -> Any:
        """The daemon exits 0 after the last counted client; the socket is gone."""
        self.config({"defaults": {"daemonIdleExitMs": 100}})
        process = yield self.start()
        client = yield self.connect()
        yield client.acquire("a")
        yield self.disconnect(client)
        code = yield process.ended
        self.assertEqual(code, 0)
        self.assertFalse(os.path.exists(self.socket_path))

    @inlineCallbacks
    def test_status_only_does_not_keep_alive(self) -> Any:
        """An open status-only connection does not keep the daemon alive."""
        self.config({"defaults": {"daemonIdleExitMs": 0}})
        process = yield self.start()
        observer = yield self.connect()
        yield observer.status()
        worker = yield self.connect()
        yield worker.acquire("w")
        yield self.disconnect(worker)
        code = yield process.ended
        self.assertEqual(code, 0)
        yield observer.closed
        self.assertFalse(os.path.exists(self.socket_path))

    @inlineCallbacks
    def test_bye(self) -> Any:
        """C{bye} is leaving: the daemon exits though the client has not closed its socket."""
        process = yield self.start()
        client = yield self.connect()
        yield client.acquire("a")
        client.send(op="bye")
        code = yield process.ended
        self.assertEqual(code, 0)
        self.assertFalse(os.path.exists(self.socket_path))

    @inlineCallbacks
    def test_sigterm(self) -> Any:
        """SIGTERM stops the daemon with status 0 and removes the socket."""
        self.config({"defaults": {"daemonIdleExitMs": KEEP_ALIVE}})
        process = yield self.start()
        client = yield self.connect()
        yield client.acquire("a")
        process.transport.signalProcess("TERM")
        code = yield process.ended
        self.assertEqual((code, process.signal), (0, None))
        self.assertFalse(os.path.exists(self.socket_path))


class ConfigTests(DaemonTestCase):
    """
    The config at start and every hot-reload case.
    """

    @inlineCallbacks
    def test_invalid_at_start(self) -> Any:
        """An invalid config at start: the violation on stderr, the defaults served."""
        self.config({"defaults": {"maxStreams": 0}})
        process = yield self.start()
        yield process.wait_for(b"defaults.maxStreams must be a positive integer (got 0)", 0, "err")
        client = yield self.connect()
        yield client.acquire("a")
        status = yield client.status()
        self.assertEqual(queue_of(status, KEY)["maxStreams"], 1)

    @inlineCallbacks
    def widened(self, save: Callable[[object], None]) -> Any:
        """
        Hold the one slot, queue a second session, save a config with two slots through
        C{save}: the waiter is granted.
        """
        self.config({"defaults": {"daemonIdleExitMs": KEEP_ALIVE}, "queues": {KEY: {}}})
        yield self.start()
        first, second = yield self.connect_many(2)
        yield first.acquire("a")
        waiting = second.acquire("b")
        status = yield second.status()
        self.assertEqual(len(queue_of(status, KEY)["waiting"]), 1)
        save({"defaults": {"daemonIdleExitMs": KEEP_ALIVE}, "queues": {KEY: {"maxStreams": 2}}})
        granted = yield waiting
        self.assertEqual(granted["sessionKey"], "b")
        status = yield first.status()
        self.assertEqual(queue_of(status, KEY)["maxStreams"], 2)

    def test_widened_edit(self) -> Deferred[None]:
        """An edit in place that widens C{maxStreams} grants the waiter at once."""
        return self.widened(self.config)

    def test_atomic_save(self) -> Deferred[None]:
        """A save by rename (temporary file, then rename over the config) is applied."""

        def save(document: object) -> None:
            temporary = os.path.join(self.agent_dir, ".llm-queue.json.swp")
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump(document, f)
            os.rename(temporary, self.config_path)

        return self.widened(save)

    @inlineCallbacks
    def two_slot_daemon(self) -> Any:
        """
        Start with a two-slot queue at C{KEY} (the default is one) and a client on it.
        """
        good = {"defaults": {"daemonIdleExitMs": KEEP_ALIVE}, "queues": {KEY: {"maxStreams": 2}}}
        self.config(good)
        process = yield self.start()
        client = yield self.connect()
        yield client.acquire("a")
        return process, client

    @inlineCallbacks
    def test_half_written_keeps_last_good(self) -> Any:
        """A half-written file keeps the last good config, with nothing on stderr."""
        process, client = yield self.two_slot_daemon()
        yield self.edit(process, '{"defaults": {"daemonIdle')
        status = yield client.status()
        self.assertEqual(queue_of(status, KEY)["maxStreams"], 2)
        self.assertEqual(process.errors, b"")

    @inlineCallbacks
    def test_invalid_keeps_last_good(self) -> Any:
        """An invalid file keeps the last good config and prints its violation to stderr."""
        process, client = yield self.two_slot_daemon()
        after = process.mark("err")
        self.config({"queues": {KEY: {"maxStreams": 0}}})
        yield process.wait_for(b"maxStreams must be a positive integer (got 0)", after, "err")
        status = yield client.status()
        self.assertEqual(queue_of(status, KEY)["maxStreams"], 2)

    @inlineCallbacks
    def test_deleted_is_defaults(self) -> Any:
        """Deleting the config file puts the defaults in force."""
        process, client = yield self.two_slot_daemon()
        after = process.mark()
        os.unlink(self.config_path)
        yield process.wait_for(RELOADED, after)
        status = yield client.status()
        self.assertEqual(queue_of(status, KEY)["maxStreams"], 1)

    @inlineCallbacks
    def test_merge_over_capacity(self) -> Any:
        """A merge into a one-slot group: 2 holders over 1 and a config event in the log."""
        log = os.path.join(self.root, "queue.log")
        defaults = {"daemonIdleExitMs": KEEP_ALIVE, "logFile": log}
        self.config({"defaults": defaults, "queues": {KEY: {}, OTHER: {}}})
        process = yield self.start()
        a, b, c = yield self.connect_many(3)
        yield a.acquire("a", KEY)
        yield b.acquire("b", OTHER)
        c.send(op="acquire", queueKey=KEY, sessionKey="c", role="child")
        yield c.status()
        group = {"one-gpu": {"match": [KEY, OTHER], "maxStreams": 1}}
        yield self.edit(process, {"defaults": defaults, "queues": group})
        status = yield a.status()
        queue = queue_of(status, "one-gpu")
        self.assertEqual(
            (
                len(queue["holders"]),
                queue["maxStreams"],
                [w["sessionKey"] for w in queue["waiting"]],
            ),
            (2, 1, ["c"]),
        )
        self.assertEqual([q["queueKey"] for q in status["queues"]], ["one-gpu"])
        with open(log, encoding="utf-8") as f:
            events = [json.loads(line) for line in f]
        config = [e for e in events if e["event"] == "config"]
        self.assertEqual(len(config), 1)
        self.assertEqual(
            (config[0]["queueKey"], config[0]["holders"], config[0]["maxStreams"]),
            ("one-gpu", 2, 1),
        )
        self.assertEqual(config[0]["reason"], "over-capacity")


class EventLogTests(DaemonTestCase):
    """
    The C{logFile}: every event kind, and an unwritable path that changes nothing.
    """

    @inlineCallbacks
    def test_every_event(self) -> Any:
        """grant, queued, release, switch, evict and config each reach the log."""
        log = os.path.join(self.root, "queue.log")
        defaults = {"daemonIdleExitMs": KEEP_ALIVE, "logFile": log}
        short = {KEY: {"leaseTtlMs": 1000}}
        self.config({"defaults": defaults, "queues": short})
        process = yield self.start()
        a, b, c = yield self.connect_many(3)
        yield a.acquire("a")
        waiting_b = b.acquire("b")
        yield b.status()
        waiting_c = c.acquire("c")
        yield c.status()
        a.send(op="release", queueKey=KEY, sessionKey="a")
        yield a.next("ok")
        yield waiting_b
        # b never beats: its lease lapses after 1000 ms and the sweep hands the slot to c.
        yield waiting_c
        d, e = yield self.connect_many(2)
        yield d.acquire("d", OTHER)
        yield e.acquire("e", THIRD)
        group = {"g": {"match": [OTHER, THIRD], "maxStreams": 1}}
        yield self.edit(process, {"defaults": defaults, "queues": {**short, **group}})
        with open(log, encoding="utf-8") as f:
            events = [json.loads(line) for line in f]
        kinds = [event["event"] for event in events]
        for kind in ("grant", "switch", "queued", "release", "evict", "config"):
            self.assertIn(kind, kinds)
        evictions = [(ev["sessionKey"], ev["reason"]) for ev in events if ev["event"] == "evict"]
        self.assertIn(("b", "ttl"), evictions)
        (config,) = [event for event in events if event["event"] == "config"]
        self.assertEqual((config["queueKey"], config["holders"], config["maxStreams"]), ("g", 2, 1))
        for event in events:
            self.assertTrue(event["ts"].endswith("Z"))
            self.assertIn(event["queueKey"], (KEY, OTHER, THIRD, "g"))

    @inlineCallbacks
    def test_unwritable_log(self) -> Any:
        """A C{logFile} that cannot be written leaves the daemon serving."""
        log = os.path.join(self.root, "missing", "queue.log")
        self.config({"defaults": {"daemonIdleExitMs": KEEP_ALIVE, "logFile": log}})
        process = yield self.start()
        a, b = yield self.connect_many(2)
        yield a.acquire("a")
        waiting = b.acquire("b")
        yield b.status()
        a.send(op="release", queueKey=KEY, sessionKey="a")
        yield waiting
        status = yield a.status()
        self.assertEqual(queue_of(status, KEY)["switches"], 1)
        self.assertFalse(os.path.exists(os.path.dirname(log)))
        self.assertFalse(process.ended.called)
