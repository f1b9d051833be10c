"""
Tests of L{loopd.demo.router_server}: the router's command line, its models dir, and
L{RouterServer}'s start, readiness, stop and restart against fake processes on a
C{task.Clock} (its listening line, then the query children it spawns for C{/health} and
C{/v1/models}). The genuine binary runs in L{test.test_router_e2e}.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase

from loopd.demo import orphan_guard, real_server
from loopd.demo.real_server import RealServerError, ServerExitedError, ServerStartTimeoutError
from loopd.demo.router_server import (
    POLL_INTERVAL,
    RouterOptions,
    RouterServer,
    model_statuses,
    write_models_dir,
)
from loopd.test.support.fake_processes import FakeProcess, FakeProcessReactor

MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny1", "status": {"value": "unloaded", "args": []}},
        {"id": "tiny2", "status": {"value": "loaded", "args": []}},
    ],
}


def _listening(port: int) -> bytes:
    """The log line of a router listening on C{port}."""
    return f"0.00.005.144 I srv  llama_server: listening on http://127.0.0.1:{port}\n".encode()


def _answer(child: FakeProcess, status: int, body: Any) -> None:
    """A query child's answer: C{status} and C{body} (JSON-encoded), then its end."""
    text = body if isinstance(body, str) else json.dumps(body)
    child.protocol.outReceived(json.dumps({"status": status, "body": text}).encode())
    child.end(0 if status < 400 else 1)


class CommandTests(SynchronousTestCase):
    """
    The router's argv: llama-server in router mode on the loopback, with its options.
    """

    def test_defaults(self) -> None:
        """No model, the models dir and its maximum, port 0, 8192 tokens and 2 slots."""
        argv = RouterOptions("/b/llama-server", "/m").command()
        self.assertEqual(argv[0], "/b/llama-server")
        self.assertNotIn("-m", argv)
        self.assertNotIn("--model", argv)
        for flag, value in [
            ("--host", "127.0.0.1"),
            ("--port", "0"),
            ("--models-dir", "/m"),
            ("--models-max", "1"),
            ("--ctx-size", "8192"),
            ("-np", "2"),
            ("--threads", "2"),
        ]:
            self.assertEqual(argv[argv.index(flag) + 1], value)
        for absent in ("--cache-ram", "--slot-save-path", "--no-models-autoload"):
            self.assertNotIn(absent, argv)

    def test_options(self) -> None:
        """Every option is passed on; None leaves llama.cpp's default out of the argv."""
        options = RouterOptions(
            "/b",
            "/m",
            models_max=3,
            port=4000,
            n_ctx=None,
            parallel=1,
            threads=None,
            cache_ram_mib=0,
            slot_save_path="/s",
            autoload=False,
        )
        argv = options.command()
        for flag, value in [
            ("--models-max", "3"),
            ("--port", "4000"),
            ("-np", "1"),
            ("--cache-ram", "0"),
            ("--slot-save-path", "/s"),
        ]:
            self.assertEqual(argv[argv.index(flag) + 1], value)
        self.assertIn("--no-models-autoload", argv)
        self.assertNotIn("--ctx-size", argv)
        self.assertNotIn("--threads", argv)


class ModelsDirTests(SynchronousTestCase):
    """
    The models dir: one tiny model per name, a flat C{NAME.gguf} each.
    """

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.directory, True)

    def _files(self) -> list[str]:
        """The paths in the directory."""
        return [os.path.join(self.directory, n) for n in os.listdir(self.directory)]

    def test_one_file_per_name(self) -> None:
        """Each name gets C{NAME.gguf}; a C{-think} name the model that thinks forever."""
        paths = write_models_dir(self.directory, ["tiny1", "deep-think"])
        self.assertEqual(sorted(os.listdir(self.directory)), ["deep-think.gguf", "tiny1.gguf"])
        self.assertEqual(paths, [os.path.join(self.directory, "tiny1.gguf"), paths[1]])
        with open(paths[0], "rb") as plain, open(paths[1], "rb") as thinking:
            self.assertNotEqual(plain.read(), thinking.read())

    def test_companion_names_refused(self) -> None:
        """Names the router takes for a projector or a draft model, or no name, are refused."""
        for name in (
            "mmproj-x",
            "x-mmproj",
            "mtp-x",
            "dspark-x",
            "dflash-x",
            "",
            "a/b",
            ".x",
            "x.gguf",
        ):
            self.assertRaises(ValueError, write_models_dir, self.directory, [name])
        self.assertEqual(self._files(), [])

    def test_statuses(self) -> None:
        """C{/v1/models} becomes C{{id: status}}; a model without a status has C{""}."""
        models = {"data": [*MODELS["data"], {"id": "plain"}]}
        self.assertEqual(
            model_statuses(models), {"tiny1": "unloaded", "tiny2": "loaded", "plain": ""}
        )


class RouterServerTests(SynchronousTestCase):
    """
    L{RouterServer} against fake processes: ready only once the router listens and both
    C{/health} and C{/v1/models} answer; failures typed like L{RealServer}'s.
    """

    def setUp(self) -> None:
        self.reactor = FakeProcessReactor()
        self.server = RouterServer(self.reactor, "/b/llama-server", "/m", start_timeout=60.0)

    def _ready(self, port: int = 40123) -> FakeProcess:
        """Start the router and answer its readiness queries; the router's fake child."""
        d = self.server.start()
        router = self.reactor.spawned[-1]
        router.protocol.errReceived(_listening(port))
        _answer(self.reactor.spawned[-1], 200, {"status": "ok"})
        _answer(self.reactor.spawned[-1], 200, MODELS)
        self.assertEqual(self.successResultOf(d), port)
        return router

    def test_guarded_command(self) -> None:
        """The router runs behind the orphan guard: it dies with this process."""
        self.server.start()
        args = self.reactor.spawned[0].args
        self.assertEqual(args[1:3], [orphan_guard.SCRIPT, str(os.getpid())])
        self.assertEqual(args[3:], self.server.options.command())

    def test_ready_after_health_and_models(self) -> None:
        """
        The listening line gives the port; C{/health} then C{/v1/models} are asked through
        query children; start fires with the port once both answered 200.
        """
        d = self.server.start()
        router = self.reactor.spawned[0]
        router.protocol.errReceived(b"loading...\n0.00 I srv  llama_server: listen")
        self.assertEqual(len(self.reactor.spawned), 1)
        router.protocol.errReceived(_listening(40500)[30:])
        health = self.reactor.spawned[1]
        self.assertEqual(health.args[1], real_server.SCRIPT)
        self.assertEqual(health.args[3], "http://127.0.0.1:40500/health")
        _answer(health, 200, {"status": "ok"})
        models = self.reactor.spawned[2]
        self.assertEqual(models.args[3], "http://127.0.0.1:40500/v1/models")
        self.assertNoResult(d)
        _answer(models, 200, MODELS)
        self.assertEqual(self.successResultOf(d), 40500)
        self.assertEqual(self.server.base_url, "http://127.0.0.1:40500")
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_asks_again_until_healthy(self) -> None:
        """A 503 (or a refused query) is asked again after L{POLL_INTERVAL}."""
        d = self.server.start()
        self.reactor.spawned[0].protocol.errReceived(_listening(40600))
        _answer(self.reactor.spawned[1], 503, {"error": "loading"})
        self.assertEqual(len(self.reactor.spawned), 2)
        self.reactor.advance(POLL_INTERVAL)
        refused = self.reactor.spawned[2]
        refused.protocol.outReceived(b'{"error": "ConnectionRefusedError"}')
        refused.end(2)
        self.reactor.advance(POLL_INTERVAL)
        _answer(self.reactor.spawned[3], 200, {"status": "ok"})
        _answer(self.reactor.spawned[4], 200, "not json")
        self.assertNoResult(d)
        self.reactor.advance(POLL_INTERVAL)
        _answer(self.reactor.spawned[5], 200, {"status": "ok"})
        _answer(self.reactor.spawned[6], 200, MODELS)
        self.assertEqual(self.successResultOf(d), 40600)

    def test_models_forwarded_listening_lines_ignored(self) -> None:
        """Once ready, lines the router forwards from its models' servers change nothing."""
        router = self._ready(40123)
        router.protocol.errReceived(b"[41000] 0.00 I srv listening on http://127.0.0.1:41000\n")
        self.assertEqual((self.server.port, len(self.reactor.spawned)), (40123, 3))

    def test_models(self) -> None:
        """L{RouterServer.models} asks C{/v1/models}: each model's status."""
        self._ready()
        d = self.server.models()
        _answer(self.reactor.spawned[-1], 200, MODELS)
        self.assertEqual(self.successResultOf(d), {"tiny1": "unloaded", "tiny2": "loaded"})

    def test_exit_before_ready(self) -> None:
        """A router that ends while starting fails start with its log's tail."""
        d = self.server.start()
        router = self.reactor.spawned[0]
        router.protocol.errReceived(b"error: '/m' does not exist or is not a directory\n")
        router.end(1)
        failure = self.failureResultOf(d, ServerExitedError)
        self.assertIn("does not exist", str(failure.value))
        self.assertIn("exit code 1", str(failure.value))
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_exit_while_asking(self) -> None:
        """A router that ends while a query runs fails start; the query's answer is ignored."""
        d = self.server.start()
        router = self.reactor.spawned[0]
        router.protocol.errReceived(_listening(40700))
        router.end(None, 11)
        self.failureResultOf(d, ServerExitedError)
        _answer(self.reactor.spawned[1], 200, {"status": "ok"})
        self.assertEqual(len(self.reactor.spawned), 2)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_start_timeout(self) -> None:
        """Not ready within start_timeout: SIGKILL, then ServerStartTimeoutError."""
        d = self.server.start()
        router = self.reactor.spawned[0]
        router.protocol.errReceived(_listening(40800))
        _answer(self.reactor.spawned[1], 503, {})
        self.reactor.advance(59.9)
        self.assertNoResult(d)
        self.reactor.advance(0.1)
        self.assertEqual(router.signals, ["KILL"])
        router.end(None, 9)
        self.failureResultOf(d, ServerStartTimeoutError)
        asked = len(self.reactor.spawned)
        for child in self.reactor.spawned[1:]:
            if not child.ended:
                child.end(2)
        self.reactor.advance(100)
        self.assertEqual((len(self.reactor.spawned), self.reactor.getDelayedCalls()), (asked, []))

    def test_cancel_start(self) -> None:
        """Cancelling start kills the router and fails with CancelledError."""
        d = self.server.start()
        d.cancel()
        self.assertEqual(self.reactor.spawned[0].signals, ["KILL"])
        self.failureResultOf(d, CancelledError)
        self.reactor.spawned[0].end(None, 9)
        self.assertFalse(self.server.running)

    def test_start_twice(self) -> None:
        """Starting a running router fails instead of spawning a second one."""
        self._ready()
        self.failureResultOf(self.server.start(), RealServerError)
        self.assertEqual(len(self.reactor.spawned), 3)

    def test_stop_escalates_to_kill(self) -> None:
        """stop sends SIGTERM, SIGKILL after stop_timeout, and fires at the end."""
        router = self._ready()
        d = self.server.stop()
        self.assertEqual(router.signals, ["TERM"])
        self.reactor.advance(self.server.stop_timeout)
        self.assertEqual(router.signals, ["TERM", "KILL"])
        router.end(None, 9)
        self.assertIsNone(self.successResultOf(d))
        self.assertEqual(self.server.last_end, "signal 9")
        self.assertIsNone(self.successResultOf(self.server.stop()))

    def test_restart_on_the_same_port(self) -> None:
        """After a kill, restart starts a router on the port the last one had."""
        router = self._ready(40900)
        self.server.kill()
        self.assertEqual(router.signals, ["KILL"])
        router.end(None, 9)
        d = self.server.restart()
        args = self.reactor.spawned[-1].args
        self.assertEqual(args[args.index("--port") + 1], "40900")
        self.reactor.spawned[-1].protocol.errReceived(_listening(40900))
        _answer(self.reactor.spawned[-1], 200, {"status": "ok"})
        _answer(self.reactor.spawned[-1], 200, MODELS)
        self.assertEqual(self.successResultOf(d), 40900)
