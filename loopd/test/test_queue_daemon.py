"""
L{loopd.queue.daemon} in process: start and its failures, each idle-exit rule on a clock, hot
reload through a fake notifier, the event log; and the C{twist llmqueue} plugin and options.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import tempfile
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.application.service import IServiceMaker
from twisted.internet.testing import StringTransport
from twisted.plugin import getPlugins
from twisted.python.usage import UsageError
from twisted.trial.unittest import SynchronousTestCase

from loopd.queue.daemon import (
    MAX_IDLE_EXIT_MS,
    NO_CLIENT_FLOOR_MS,
    LlmQueueService,
    idle_exit_delay_ms,
)
from loopd.queue.policy import DEFAULT_POLICY
from loopd.queue.protocol import LeaseProtocol
from loopd.queue.watch import IN_CLOSE_WRITE
from loopd.tap.llmqueue import Options, makeService
from loopd.test.support.notifier import FakeNotifier
from loopd.testing.reactor import MemoryLoopdReactor

KEY = "http://gpu:8001/v1"
OTHER = "http://gpu:8002/v1"


class Client:
    """
    One in-memory connection to the daemon's factory.
    """

    def __init__(self, service: LlmQueueService) -> None:
        self.protocol: LeaseProtocol = service.factory.buildProtocol(None)
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)

    def send(self, **message: Any) -> None:
        self.protocol.dataReceived(json.dumps(message).encode("utf-8") + b"\n")

    def acquire(self, session: str, key: str = KEY) -> None:
        self.send(op="acquire", queueKey=key, sessionKey=session)

    def replies(self) -> list[Any]:
        data = self.transport.value()
        self.transport.clear()
        return [json.loads(line) for line in data.split(b"\n") if line]

    def close(self) -> None:
        self.protocol.connectionLost()


class Daemon:
    """
    A daemon on a C{MemoryReactorClock} in a temporary agent dir, with fake notifiers.
    """

    def __init__(self, case: SynchronousTestCase, agent_dir: str | None = None) -> None:
        self.root = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        case.addCleanup(shutil.rmtree, self.root, True)
        self.agent_dir = agent_dir or os.path.join(self.root, "agent")
        self.reactor = MemoryLoopdReactor()
        self.stdout = io.StringIO()
        self.stderr = io.StringIO()
        self.exits: list[int] = []
        self.notifiers: list[FakeNotifier] = []
        self.case = case
        self.service: LlmQueueService | None = None

    def config(self, document: object) -> None:
        os.makedirs(self.agent_dir, exist_ok=True)
        with open(os.path.join(self.agent_dir, "llm-queue.json"), "w", encoding="utf-8") as f:
            f.write(document if isinstance(document, str) else json.dumps(document))

    def make_notifier(self) -> FakeNotifier:
        notifier = FakeNotifier(None)
        self.notifiers.append(notifier)
        return notifier

    def start(self, models_json: str | None = None) -> LlmQueueService:
        service = LlmQueueService(
            self.reactor,
            self.agent_dir,
            1000,
            models_json,
            self.stderr,
            self.exits.append,
            stdout=self.stdout,
            notifier_factory=self.make_notifier,
            wall_time=lambda: 1_800_000_000.0,
        )
        service.startService()
        self.case.addCleanup(service.stopService)
        self.service = service
        return service

    def client(self) -> Client:
        assert self.service is not None
        return Client(self.service)

    def status(self) -> list[dict[str, Any]]:
        assert self.service is not None
        return self.service.scheduler.status()


class StartTests(SynchronousTestCase):
    """
    Starting: the socket, the start line, the config and catalog read, and the two ways a
    start fails.
    """

    def test_listens(self) -> None:
        """It listens 0600 on llm-queue.sock in the agent dir (made 0700) and prints its line."""
        d = Daemon(self)
        service = d.start()
        ((address, factory, _, mode, _),) = d.reactor.unixServers
        self.assertEqual(address, os.path.join(d.agent_dir, "llm-queue.sock"))
        self.assertIs(factory, service.factory)
        self.assertEqual(mode, 0o600)
        self.assertEqual(os.stat(d.agent_dir).st_mode & 0o777, 0o700)
        self.assertEqual(d.stdout.getvalue(), f"llmqueue: listening on {address}\n")
        self.assertEqual((d.stderr.getvalue(), d.exits), ("", []))
        self.assertTrue(service.running)

    def test_missing_config(self) -> None:
        """Without a config file the daemon serves the defaults and prints nothing to stderr."""
        d = Daemon(self)
        self.assertEqual(d.start().policy, DEFAULT_POLICY)
        self.assertEqual(d.stderr.getvalue(), "")

    def test_invalid_config(self) -> None:
        """An invalid config at start is the defaults as a whole, with every violation on stderr."""
        d = Daemon(self)
        d.config({"defaults": {"maxStreams": 0, "daemonIdleExitMs": 5}, "queues": {"z": 1}})
        service = d.start()
        self.assertEqual(service.policy, DEFAULT_POLICY)
        errors = d.stderr.getvalue()
        self.assertIn("defaults.maxStreams must be a positive integer (got 0)", errors)
        self.assertIn("queues.z", errors)
        d.client().acquire("a")
        self.assertEqual(d.status()[0]["maxStreams"], 1)

    def test_models_catalog(self) -> None:
        """With --models-json a provider key is queued at its baseUrl, with its entry's settings."""
        d = Daemon(self)
        catalog = os.path.join(d.root, "models.json")
        with open(catalog, "w", encoding="utf-8") as f:
            json.dump({"providers": {"llamacpp": {"baseUrl": KEY}}}, f)
        d.config({"queues": {"llamacpp": {"maxStreams": 3}}})
        d.start(models_json=catalog)
        d.client().acquire("a", key="llamacpp")
        ((queue,),) = [d.status()]
        self.assertEqual((queue["queueKey"], queue["maxStreams"]), (KEY, 3))

    def test_bad_models_catalog(self) -> None:
        """An invalid models.json is an empty catalog plus its problem on stderr."""
        d = Daemon(self)
        catalog = os.path.join(d.root, "models.json")
        with open(catalog, "w", encoding="utf-8") as f:
            f.write("[1]")
        service = d.start(models_json=catalog)
        self.assertTrue(service.running)
        self.assertIn("models.json", d.stderr.getvalue())

    def test_live_socket(self) -> None:
        """A live socket: one line on stderr, exit status 0, nothing listened on."""
        d = Daemon(self)
        os.makedirs(d.agent_dir)
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(live.close)
        live.bind(os.path.join(d.agent_dir, "llm-queue.sock"))
        live.listen(1)
        service = d.start()
        self.assertEqual(d.exits, [0])
        lines = d.stderr.getvalue().splitlines()
        self.assertEqual(len(lines), 1)
        self.assertIn("in use", lines[0])
        self.assertEqual((d.reactor.unixServers, d.stdout.getvalue()), ([], ""))
        self.assertFalse(service.running)

    def test_path_too_long(self) -> None:
        """A socket path too long: a non-zero exit with the reason, no dir or socket made."""
        root = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, root, True)
        agent = os.path.join(root, "a" * 120)
        d = Daemon(self, agent_dir=agent)
        d.start()
        self.assertEqual(d.exits, [1])
        self.assertIn("longer than the platform's limit", d.stderr.getvalue())
        self.assertFalse(os.path.exists(agent))
        self.assertEqual(d.reactor.unixServers, [])


class IdleExitTests(SynchronousTestCase):
    """
    The seed's idle-exit rules, one test each, on the reactor's clock.
    """

    def daemon(self, idle_ms: int | None = None) -> Daemon:
        d = Daemon(self)
        if idle_ms is not None:
            d.config({"defaults": {"daemonIdleExitMs": idle_ms}})
        d.start()
        return d

    def idle_delay(self, d: Daemon) -> float | None:
        assert d.service is not None
        idle_exit = d.service._idle_exit
        calls = [c for c in d.reactor.getDelayedCalls() if getattr(c, "func", None) == idle_exit]
        return None if not calls else calls[0].getTime() - d.reactor.seconds()

    def test_no_client_floor(self) -> None:
        """A daemon no client reaches exits after the 30 s floor, though the delay is 0."""
        d = self.daemon()
        d.reactor.advance(29.999)
        self.assertFalse(d.reactor.hasStopped)
        d.reactor.advance(0.001)
        self.assertTrue(d.reactor.hasStopped)

    def test_no_client_longer_delay(self) -> None:
        """A configured delay above the floor applies to a daemon no client reaches."""
        d = self.daemon(50_000)
        d.reactor.advance(49.999)
        self.assertFalse(d.reactor.hasStopped)
        d.reactor.advance(0.001)
        self.assertTrue(d.reactor.hasStopped)

    def test_last_client_leaves_at_once(self) -> None:
        """With the default 0 the daemon exits at once after its last counted client closes."""
        d = self.daemon()
        a, b = d.client(), d.client()
        a.acquire("a")
        b.acquire("b")
        self.assertIsNone(self.idle_delay(d))
        a.close()
        d.reactor.advance(0)
        self.assertFalse(d.reactor.hasStopped)
        b.close()
        self.assertEqual(self.idle_delay(d), 0)
        d.reactor.advance(0)
        self.assertTrue(d.reactor.hasStopped)

    def test_delay_after_last_client(self) -> None:
        """A configured C{daemonIdleExitMs} is waited after the last counted client leaves."""
        d = self.daemon(500)
        c = d.client()
        c.send(op="renew")
        c.close()
        d.reactor.advance(0.499)
        self.assertFalse(d.reactor.hasStopped)
        d.reactor.advance(0.001)
        self.assertTrue(d.reactor.hasStopped)

    def test_counted_client_cancels(self) -> None:
        """A counted client cancels the pending exit: the start timer and a leaver's."""
        d = self.daemon(1000)
        first = d.client()
        first.send(op="role", sessionKey="s", role="child")
        self.assertIsNone(self.idle_delay(d))
        first.close()
        d.reactor.advance(0.5)
        second = d.client()
        second.send(op="cancel", queueKey=KEY, sessionKey="s")
        d.reactor.advance(3600)
        self.assertFalse(d.reactor.hasStopped)
        second.close()
        d.reactor.advance(1.0)
        self.assertTrue(d.reactor.hasStopped)

    def test_status_only_not_counted(self) -> None:
        """A status-only connection neither cancels the timer nor keeps the daemon."""
        d = self.daemon()
        observer = d.client()
        observer.send(op="status")
        self.assertEqual(observer.replies()[0]["op"], "status")
        self.assertEqual(self.idle_delay(d), NO_CLIENT_FLOOR_MS / 1000)
        worker = d.client()
        worker.acquire("w")
        worker.close()
        observer.send(op="status")
        d.reactor.advance(0)
        self.assertTrue(d.reactor.hasStopped)

    def test_bye_is_leaving(self) -> None:
        """C{bye} arms the exit at the word, before the socket closes."""
        d = self.daemon()
        c = d.client()
        c.acquire("a")
        c.send(op="bye")
        self.assertFalse(c.transport.disconnecting)
        d.reactor.advance(0)
        self.assertTrue(d.reactor.hasStopped)

    def test_clamped(self) -> None:
        """A delay beyond 2^31-1 ms is clamped to it, at start and after a client."""
        d = self.daemon(10**12)
        self.assertEqual(self.idle_delay(d), MAX_IDLE_EXIT_MS / 1000)
        c = d.client()
        c.acquire("a")
        c.close()
        self.assertEqual(self.idle_delay(d), MAX_IDLE_EXIT_MS / 1000)

    def test_delay_read_when_armed(self) -> None:
        """The delay is read when the timer is armed: a reload changes the next one."""
        d = self.daemon(40_000)
        assert d.service is not None
        d.config({"defaults": {"daemonIdleExitMs": 2000}})
        d.service.reload()
        self.assertEqual(self.idle_delay(d), 40.0)
        c = d.client()
        c.acquire("a")
        c.close()
        self.assertEqual(self.idle_delay(d), 2.0)

    def test_exit_stops_listening_first(self) -> None:
        """The exit stops listening, then stops the reactor."""
        d = self.daemon()
        assert d.service is not None
        c = d.client()
        c.acquire("a")
        c.close()
        d.reactor.advance(0)
        self.assertTrue(d.reactor.hasStopped)
        self.assertIsNone(d.service._port)

    @given(st.integers(min_value=0, max_value=10**15), st.booleans())
    def test_delay_rule(self, configured: int, fresh: bool) -> None:
        """The delay is the configured one, floored at 30 s when fresh, capped at 2^31-1."""
        delay = idle_exit_delay_ms(configured, fresh)
        self.assertLessEqual(delay, MAX_IDLE_EXIT_MS)
        if fresh:
            self.assertGreaterEqual(delay, NO_CLIENT_FLOOR_MS)
        expected = max(configured, NO_CLIENT_FLOOR_MS) if fresh else configured
        self.assertEqual(delay, min(expected, MAX_IDLE_EXIT_MS))


class ReloadTests(SynchronousTestCase):
    """
    Hot reload: the watcher's call re-reads the config and moves the live queues.
    """

    def setUp(self) -> None:
        self.d = Daemon(self)
        self.log = os.path.join(self.d.root, "queue.log")
        self.d.config(
            {
                "defaults": {"daemonIdleExitMs": 10**9, "logFile": self.log},
                "queues": {KEY: {"maxStreams": 1}},
            }
        )
        self.service = self.d.start()

    def edit(self, document: object) -> None:
        """Write the config and let the watcher's debounce run out."""
        self.d.config(document)
        self.d.notifiers[-1].send("llm-queue.json", IN_CLOSE_WRITE)
        self.d.reactor.advance(0.25)

    def events(self) -> list[dict[str, Any]]:
        with open(self.log, encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def test_widened_grants_at_once(self) -> None:
        """A widened C{maxStreams} grants the waiter as soon as the edit is read."""
        a, b = self.d.client(), self.d.client()
        a.acquire("a")
        b.acquire("b")
        self.assertEqual(b.replies(), [])
        self.edit({"defaults": {"logFile": self.log}, "queues": {KEY: {"maxStreams": 2}}})
        self.assertEqual(b.replies()[0]["op"], "granted")
        self.assertEqual(self.d.status()[0]["maxStreams"], 2)

    def test_invalid_keeps_last_good(self) -> None:
        """An invalid edit keeps the config in force and prints its violations to stderr."""
        before = self.service.policy
        self.edit({"queues": {KEY: {"maxStreams": -1}}})
        self.assertIs(self.service.policy, before)
        self.assertIn(
            f'queues["{KEY}"].maxStreams must be a positive integer (got -1)',
            self.d.stderr.getvalue(),
        )

    def test_half_written_silent(self) -> None:
        """A half-written file (not JSON yet) keeps the config in force and prints nothing."""
        before = self.service.policy
        self.edit('{"defaults": {"maxStr')
        self.assertIs(self.service.policy, before)
        self.assertEqual(self.d.stderr.getvalue(), "")

    def test_deleted_is_defaults(self) -> None:
        """Deleting the config file is the defaults."""
        os.unlink(os.path.join(self.d.agent_dir, "llm-queue.json"))
        self.d.notifiers[-1].send("llm-queue.json", IN_CLOSE_WRITE)
        self.d.reactor.advance(0.25)
        self.assertEqual(self.service.policy, DEFAULT_POLICY)

    def test_merge_over_capacity(self) -> None:
        """A merge into a one-slot group moves holders and waiters: 2 over 1, a config event."""
        a, b, c = self.d.client(), self.d.client(), self.d.client()
        a.acquire("a", KEY)
        b.acquire("b", OTHER)
        c.acquire("c", KEY)
        self.edit(
            {
                "defaults": {"daemonIdleExitMs": 10**9, "logFile": self.log},
                "queues": {"one-gpu": {"match": [KEY, OTHER], "maxStreams": 1}},
            }
        )
        (queue,) = self.d.status()
        self.assertEqual((queue["queueKey"], queue["maxStreams"]), ("one-gpu", 1))
        self.assertEqual([h["sessionKey"] for h in queue["holders"]], ["a", "b"])
        self.assertEqual([w["sessionKey"] for w in queue["waiting"]], ["c"])
        config = [e for e in self.events() if e["event"] == "config"]
        self.assertEqual(len(config), 1)
        self.assertEqual(
            {k: config[0][k] for k in ("queueKey", "reason", "holders", "maxStreams")},
            {"queueKey": "one-gpu", "reason": "over-capacity", "holders": 2, "maxStreams": 1},
        )

    def test_log_follows_reload(self) -> None:
        """Events go to the C{logFile} in force: moved by a reload, and off when it is unset."""
        a = self.d.client()
        a.acquire("a")
        moved = os.path.join(self.d.root, "moved.log")
        self.edit({"defaults": {"logFile": moved}, "queues": {KEY: {"maxStreams": 1}}})
        a.send(op="release", queueKey=KEY, sessionKey="a")
        self.edit({"queues": {KEY: {"maxStreams": 1}}})
        a.acquire("a")
        self.assertEqual([e["event"] for e in self.events()], ["grant"])
        with open(moved, encoding="utf-8") as f:
            self.assertEqual([json.loads(line)["event"] for line in f], ["release"])
        self.assertEqual(self.events()[0]["ts"], "2027-01-15T08:00:00.000Z")


class StatusTests(SynchronousTestCase):
    """
    The C{status} op over the wire: a queue the config does not name leaves it once idle,
    and its C{switches} resume when its key is used again (issue 26, item 8).
    """

    def test_switches_never_go_backwards(self) -> None:
        """Used, left idle (forgotten), used again: C{switches} goes on from 1, not 0."""
        d = Daemon(self)
        d.config({"defaults": {"maxStreams": 1, "daemonIdleExitMs": 10**9}, "queues": {KEY: {}}})
        d.start()
        a, b = d.client(), d.client()
        a.acquire("a", OTHER)
        b.acquire("b", OTHER)
        a.send(op="release", queueKey=OTHER, sessionKey="a")
        b.send(op="release", queueKey=OTHER, sessionKey="b")
        a.replies()
        a.send(op="status")
        (reply,) = a.replies()
        self.assertEqual([q["queueKey"] for q in reply["queues"]], [])
        a.acquire("a", OTHER)
        a.send(op="status")
        granted, reply = a.replies()
        self.assertEqual(granted["op"], "granted")
        self.assertEqual([(q["queueKey"], q["switches"]) for q in reply["queues"]], [(OTHER, 1)])


class OptionsTests(SynchronousTestCase):
    """
    C{twist llmqueue}'s plugin and options.
    """

    def test_discovered(self) -> None:
        """C{getPlugins(IServiceMaker)} lists C{llmqueue}, pointing at L{loopd.tap.llmqueue}."""
        makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}
        self.assertEqual(getattr(makers["llmqueue"], "module", None), "loopd.tap.llmqueue")

    def test_defaults(self) -> None:
        """Without options the sweep is 1000 ms and there is no agent dir or catalog given."""
        options = Options()
        options.parseOptions([])
        self.assertEqual(options["sweep-ms"], 1000)
        self.assertIsNone(options["agent-dir"])
        self.assertIsNone(options["models-json"])

    def test_bad_sweep(self) -> None:
        """A sweep that is not a positive integer is a usage error."""
        for value in ("0", "-5", "x", "1.5"):
            self.assertRaises(UsageError, Options().parseOptions, ["--sweep-ms", value])

    def test_make_service(self) -> None:
        """The service's socket and config sit in C{--agent-dir}, with C{~} expanded."""
        options = Options()
        options.parseOptions(["--agent-dir", "~/agent-x", "--sweep-ms", "50"])
        service = makeService(options, reactor=MemoryLoopdReactor())
        assert isinstance(service, LlmQueueService)
        home = os.path.expanduser("~")
        self.assertEqual(service.socket_path, os.path.join(home, "agent-x", "llm-queue.sock"))
        self.assertEqual(service.config_path, os.path.join(home, "agent-x", "llm-queue.json"))
