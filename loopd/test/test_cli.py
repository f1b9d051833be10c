"""
Tests for L{loopd.cli} and the demo's pure and process-handling parts, in memory: commands
run on a C{MemoryReactorClock} whose Unix connections reach a scripted fake llama-server
(L{FakeLlama}) or a whole gateway (L{GatewayHarness}) on a L{MemoryNet}; and the command's
place in the package, read from the source (nothing imports it). C{loopd status}'s own tests
are in L{loopd.test.test_status_command}. The chat's own tests are in L{loopd.test.test_chatloop}.
"""

from __future__ import annotations

import ast
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

import loopd
from loopd import cli
from loopd.config import ConfigError, parse_config
from loopd.demo import orphan_guard
from loopd.demo.children import Child, ChildFailed, spawn_twist, stop_child
from loopd.demo.run import (
    DemoStack,
    render_config,
    selftest_lines_from_log,
    serving_text,
    tcp_url_from_log,
)
from loopd.digest import sha256_hex
from loopd.reactor import ILoopdReactor
from loopd.service import default_socket_path
from loopd.testing.fake_llama import (
    CHAT,
    PROPS,
    SLOTS,
    FakeLlama,
    RecordedRequest,
    Reply,
    sse_reply,
)
from loopd.testing.llama_replies import props_reply, slots_reply
from loopd.testing.memory_net import MemoryNet
from loopd.testing.reactor import MemoryLoopdReactor

SERVER = "/tmp/ld-memory/cli-server.sock"
TEMPLATE = "{{ messages }}"
TEMPLATE_SHA = sha256_hex(TEMPLATE.encode("utf-8"))
TIMINGS_1 = {"cache_n": 0, "prompt_n": 150, "predicted_n": 20}
TIMINGS_2 = {"cache_n": 168, "prompt_n": 12, "predicted_n": 20}


def chunk(delta: dict[str, Any], finish: str | None = None, timings: Any = None) -> Any:
    """One streamed chat-completion chunk."""
    out: dict[str, Any] = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}]}
    out.update(id="chatcmpl-1", object="chat.completion.chunk")
    if timings is not None:
        out["timings"] = timings
    return out


def config_text(expect_sha: str = TEMPLATE_SHA, selftest: bool = True) -> str:
    """A loopd.toml for one endpoint on L{SERVER}, with one quick retry."""
    return (
        "[retry]\nattempts = 1\n"
        f'[[endpoint]]\nname = "tiny"\nsocket = "{SERVER}"\n'
        f"selftest = {'true' if selftest else 'false'}\n"
        f'[endpoint.expect]\nchat_template_sha256 = "{expect_sha}"\n'
        "n_ctx = 4096\ntotal_slots = 2\n"
    )


@implementer(ILoopdReactor)
class SpawningReactor(MemoryLoopdReactor):
    """
    A memory reactor that records spawnProcess calls: with them, it provides all of
    L{ILoopdReactor}, what the CLI's commands run on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[tuple[Any, ...]] = []

    def spawnProcess(self, protocol, executable, args, **kwargs):  # type: ignore[override]
        process = FakeProcess()
        protocol.makeConnection(process)
        self.spawned.append((protocol, executable, list(args), kwargs))
        return process


class MemoryCase(SynchronousTestCase):
    """A memory reactor and net, a temporary directory, captured stdout and stderr."""

    def setUp(self) -> None:
        self.reactor = SpawningReactor()
        self.net = MemoryNet(self.reactor)
        self.directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.stdout = io.StringIO()
        self.stderr = io.StringIO()
        self.patch(sys, "stdout", self.stdout)
        self.patch(sys, "stderr", self.stderr)

    def write_file(self, name: str, text: str) -> str:
        """Write C{text} to C{name} in the directory; return its path."""
        path = os.path.join(self.directory, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def run_command(self, command: cli.Command) -> int:
        """A runner for L{cli.main}: the command on the memory reactor, to its end."""
        d = command(self.reactor)
        self.net.advance(10)
        return self.successResultOf(d)


class ParserTests(SynchronousTestCase):
    """
    L{cli.build_parser} knows the three commands and their options.
    """

    def test_selftest(self) -> None:
        """selftest takes --config."""
        args = cli.build_parser().parse_args(["selftest", "--config", "x.toml"])
        self.assertEqual((args.command, args.config), ("selftest", "x.toml"))

    def test_chat_defaults(self) -> None:
        """chat has no socket, no model and thinking on by default."""
        args = cli.build_parser().parse_args(["chat"])
        self.assertEqual((args.socket, args.model, args.no_think), (None, None, False))

    def test_chat_options(self) -> None:
        """chat takes --socket, --model and --no-think."""
        argv = ["chat", "--socket", "/s", "--model", "m", "--no-think"]
        args = cli.build_parser().parse_args(argv)
        self.assertEqual((args.socket, args.model, args.no_think), ("/s", "m", True))

    def test_status(self) -> None:
        """status takes --socket, --watch and --json, none of them by default."""
        args = cli.build_parser().parse_args(["status"])
        self.assertEqual((args.socket, args.watch, args.json), (None, False, False))
        args = cli.build_parser().parse_args(["status", "--socket", "/s", "--watch", "--json"])
        self.assertEqual((args.socket, args.watch, args.json), ("/s", True, True))

    def test_replay(self) -> None:
        """replay takes FILE and --session, and --socket and --model."""
        args = cli.build_parser().parse_args(["replay", "cap", "--session", "s1"])
        self.assertEqual(
            (args.file, args.session, args.socket, args.model), ("cap", "s1", None, None)
        )
        argv = ["replay", "cap", "--session", "s1", "--socket", "/s", "--model", "m"]
        args = cli.build_parser().parse_args(argv)
        self.assertEqual((args.socket, args.model), ("/s", "m"))

    def test_demo(self) -> None:
        """demo takes --once and an integer --port (default 0)."""
        self.assertEqual(cli.build_parser().parse_args(["demo"]).port, 0)
        args = cli.build_parser().parse_args(["demo", "--once", "--port", "8081"])
        self.assertEqual((args.once, args.port, args.models), (True, 8081, 0))
        args = cli.build_parser().parse_args(["demo", "--models", "3"])
        self.assertEqual(args.models, 3)

    def test_usage_errors(self) -> None:
        """No command, an unknown one or a bad port is a usage error (status 2)."""
        self.patch(sys, "stderr", io.StringIO())
        bad_models = [["demo", "--models", n] for n in ("1", "10", "x", "-2")]
        replays = [["replay", "cap"], ["replay", "--session", "s1"]]
        for argv in ([], ["nope"], ["demo", "--port", "x"], *bad_models, *replays):
            with self.assertRaises(SystemExit) as caught:
                cli.build_parser().parse_args(argv)
            self.assertEqual(caught.exception.code, 2, argv)


#: Where the in-memory gateway of L{StatusCommandTests} listens.
GATEWAY = "/tmp/ld-memory/cli-loopd.sock"


class SelftestCommandTests(MemoryCase):
    """
    C{loopd selftest} exits 0 only when every check passes, 1 when one fails, 2 for a bad
    config, and prints one line per check.
    """

    def setUp(self) -> None:
        super().setUp()
        self.fake = FakeLlama(self.reactor)
        self.net.listen(SERVER, self.fake)
        self.fake.set_default("GET", PROPS, props_reply(total_slots=2, chat_template=TEMPLATE))
        self.fake.set_default("GET", SLOTS, slots_reply([False, False]))
        self.fake.set_default("POST", CHAT, self.route)

    def route(self, request: RecordedRequest, fake: FakeLlama) -> Reply:
        """The tool check gets a tool call, the cache turns their answers."""
        if "tools" in request.json:
            call = {"index": 0, "id": "c1", "type": "function"}
            call["function"] = {"name": "get_weather", "arguments": '{"city":"Paris"}'}
            return sse_reply([chunk({"tool_calls": [call]}), chunk({}, "tool_calls", TIMINGS_1)])
        first = len(request.json["messages"]) == 2
        timings = TIMINGS_1 if first else TIMINGS_2
        return sse_reply([chunk({"content": "Red."}), chunk({}, "stop", timings)])

    def test_all_pass(self) -> None:
        """With the server's values expected, the exit status is 0 and each check has a line."""
        path = self.write_file("loopd.toml", config_text())
        self.assertEqual(cli.main(["selftest", "--config", path], run=self.run_command), 0)
        lines = self.stdout.getvalue().splitlines()
        self.assertEqual(
            [line.split(" ")[:3] for line in lines],
            [["tiny:", "PASS", "props:"], ["tiny:", "PASS", "tools:"], ["tiny:", "PASS", "cache:"]],
        )
        self.assertIn(f"expected {TEMPLATE_SHA} got {TEMPLATE_SHA}", lines[0])

    def test_wrong_hash(self) -> None:
        """A wrong template hash exits 1, the props line naming both hashes."""
        path = self.write_file("loopd.toml", config_text("f" * 64))
        self.assertEqual(cli.main(["selftest", "--config", path], run=self.run_command), 1)
        output = self.stdout.getvalue()
        self.assertIn(f"tiny: FAIL props: chat_template sha256 expected {'f' * 64} got", output)
        self.assertIn("tiny: PASS tools:", output)

    def test_bad_config(self) -> None:
        """A bad config prints every violation and exits 2 without running anything."""
        path = self.write_file("loopd.toml", "max_tokens = 0\nbogus = 1\n")

        def never(command: cli.Command) -> int:
            raise AssertionError("nothing should run")

        self.assertEqual(cli.main(["selftest", "--config", path], run=never), 2)
        errors = self.stderr.getvalue()
        self.assertIn("invalid configuration", errors)
        self.assertIn(f"{path}: bogus", errors)
        self.assertIn(f"{path}: max_tokens", errors)

    def test_missing_config(self) -> None:
        """A config file that does not exist is a config error too."""
        missing = os.path.join(self.directory, "none.toml")
        self.assertEqual(cli.main(["selftest", "--config", missing], run=self.run_command), 2)
        self.assertIn("cannot read the file", self.stderr.getvalue())

    def test_nothing_to_test(self) -> None:
        """With no endpoint to self-test, it says so and exits 0."""
        path = self.write_file("loopd.toml", config_text(selftest=False))
        self.assertEqual(cli.main(["selftest", "--config", path], run=self.run_command), 0)
        self.assertIn("nothing to check", self.stdout.getvalue())
        self.assertEqual(self.fake.requests, [])

    def test_server_down(self) -> None:
        """An unreachable server fails every check with the error, exit status 1."""
        self.net.stop_listening(SERVER)
        path = self.write_file("loopd.toml", config_text())
        self.assertEqual(cli.main(["selftest", "--config", path], run=self.run_command), 1)
        lines = self.stdout.getvalue().splitlines()
        self.assertEqual(len(lines), 3)
        self.assertTrue(all(" FAIL " in line for line in lines), lines)
        self.assertEqual(
            lines[0],
            "tiny: FAIL props: endpoint tiny is unreachable: no socket (nothing is serving it); "
            "gave up after 10 s",
        )
        progress = self.stderr.getvalue().splitlines()
        self.assertEqual(len(progress), 7)
        self.assertEqual(
            progress[0], "endpoint tiny: no socket (nothing is serving it), retrying 0 of 10 s"
        )


class ChatSocketTests(MemoryCase):
    """
    L{cli.chat_socket_path} finds the socket C{loopd chat} talks to.
    """

    def test_explicit(self) -> None:
        """--socket wins."""
        self.assertEqual(cli.chat_socket_path("/x.sock", "/nonexistent.toml"), "/x.sock")

    def test_from_config(self) -> None:
        """The default config's [server] listen socket, when the file exists."""
        text = f'[server]\nlisten = "unix:{self.directory}/l.sock"\n' + config_text()
        path = self.write_file("loopd.toml", text)
        self.assertEqual(cli.chat_socket_path(None, path), f"{self.directory}/l.sock")

    def test_no_config(self) -> None:
        """Without a config file, the default socket."""
        missing = os.path.join(self.directory, "none.toml")
        self.assertEqual(cli.chat_socket_path(None, missing), default_socket_path())

    def test_tcp_listener(self) -> None:
        """A config whose listen is a TCP description is a config error (it takes [server] tcp)."""
        text = '[server]\nlisten = "tcp:8080:interface=127.0.0.1"\n' + config_text()
        path = self.write_file("loopd.toml", text)
        self.assertRaises(ConfigError, cli.chat_socket_path, None, path)

    def test_tcp_beside(self) -> None:
        """With [server] tcp too, chat still talks to the Unix socket."""
        text = f'[server]\nlisten = "unix:{self.directory}/l.sock"\ntcp = "127.0.0.1:0"\n'
        path = self.write_file("loopd.toml", text + config_text())
        self.assertEqual(cli.chat_socket_path(None, path), f"{self.directory}/l.sock")


class FakeProcess:
    """A process transport that records the signals sent to it."""

    pid = 4242

    def __init__(self) -> None:
        self.signals: list[str] = []

    def signalProcess(self, name: str) -> None:
        self.signals.append(name)


class TokenCommandTests(MemoryCase):
    """
    C{loopd token} prints the TCP listener's token and nothing else, making it if need be.
    """

    def token_config(self, extra: str = 'tcp = "127.0.0.1:0"\n') -> tuple[str, str]:
        """A config whose token file is in the directory; its path and the token file's."""
        token_file = os.path.join(self.directory, "state", "token")
        text = f'[server]\n{extra}token_file = "{token_file}"\n' + config_text()
        return self.write_file("loopd.toml", text), token_file

    def test_prints_and_makes(self) -> None:
        """The first run makes the 0600 file; every run prints the same token alone."""
        config, token_file = self.token_config()
        self.assertEqual(cli.main(["token", "--config", config]), 0)
        token = self.stdout.getvalue()
        self.assertRegex(token, r"^loopd-[A-Za-z0-9_-]{43}\n$")
        self.assertEqual(self.stderr.getvalue(), "")
        self.assertEqual(os.stat(token_file).st_mode & 0o777, 0o600)
        self.assertEqual(cli.main(["token", "--config", config]), 0)
        self.assertEqual(self.stdout.getvalue(), token * 2)

    def test_no_tcp_listener(self) -> None:
        """Without [server] tcp the token is still printed, with a note on stderr."""
        config, _ = self.token_config(extra="")
        self.assertEqual(cli.main(["token", "--config", config]), 0)
        self.assertRegex(self.stdout.getvalue(), r"^loopd-\S+\n$")
        self.assertIn("has no [server] tcp", self.stderr.getvalue())

    def test_bad_config(self) -> None:
        """An invalid config is a usage error naming the key; nothing on stdout."""
        config = self.write_file("bad.toml", '[server]\ntcp = "0.0.0.0:1"\n' + config_text())
        self.assertEqual(cli.main(["token", "--config", config]), cli.USAGE_ERROR)
        self.assertEqual(self.stdout.getvalue(), "")
        self.assertIn("server.tcp", self.stderr.getvalue())

    def test_unusable_file(self) -> None:
        """A token file others may read is refused with status 1; nothing on stdout."""
        config, token_file = self.token_config()
        cli.main(["token", "--config", config])
        os.chmod(token_file, 0o640)
        self.stdout.truncate(0)
        self.stdout.seek(0)
        self.assertEqual(cli.main(["token", "--config", config]), 1)
        self.assertEqual(self.stdout.getvalue(), "")
        self.assertIn("may be read or written by others", self.stderr.getvalue())

    def test_default_config_absent(self) -> None:
        """Without --config and without the default config: the default token file."""
        state = os.path.join(self.directory, "xdg-state")
        self.patch(
            os,
            "environ",
            {
                **os.environ,
                "XDG_STATE_HOME": state,
                "XDG_CONFIG_HOME": os.path.join(self.directory, "none"),
            },
        )
        self.assertEqual(cli.main(["token"]), 0)
        with open(os.path.join(state, "loopd", "token")) as f:
            self.assertEqual(f.read(), self.stdout.getvalue())


class ChildTests(SynchronousTestCase):
    """
    L{spawn_twist} and L{stop_child} handle the demo's twist children.
    """

    def setUp(self) -> None:
        self.reactor = SpawningReactor()
        self.child = spawn_twist(self.reactor, "twist loopd", "loopd serving", ["loopd"])

    def test_command(self) -> None:
        """The child is this Python running twist with text logs, output unbuffered."""
        (_, executable, args, kwargs) = self.reactor.spawned[0]
        self.assertEqual(executable, sys.executable)
        twist = [sys.executable, "-m", "twisted", "--log-format=text", "loopd"]
        self.assertEqual(args, [sys.executable, orphan_guard.SCRIPT, str(os.getpid()), *twist])
        self.assertEqual(kwargs["env"]["PYTHONUNBUFFERED"], "1")

    def test_log_file(self) -> None:
        """With a log path, every output line is also written there as it comes."""
        directory = tempfile.mkdtemp(prefix="ld", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        log = os.path.join(directory, "loopd.log")
        child = spawn_twist(self.reactor, "twist loopd", "serving", ["loopd"], log_path=log)
        child.outReceived(b"one\ntw")
        child.errReceived(b"err\n")
        with open(log) as f:
            self.assertEqual(f.read(), "one\nerr\n")
        child.processEnded(Failure(ProcessDone(0)))
        self.failureResultOf(child.ready, ChildFailed)
        with open(log) as f:
            self.assertEqual(f.read(), "one\nerr\ntw\n")

    def test_ready_line(self) -> None:
        """The marker line, even split across reads, makes the child ready."""
        self.child.outReceived(b"2025 [x] starting\n2025 [loopd] loopd ser")
        self.assertNoResult(self.child.ready)
        self.child.outReceived(b"ving unix:/s for tiny\n")
        self.successResultOf(self.child.ready)
        self.assertEqual(self.child.lines[-1], "2025 [loopd] loopd serving unix:/s for tiny")

    def test_exit_before_ready(self) -> None:
        """A child that exits first fails ready with its status and last output."""
        self.child.errReceived(b"loopd: self-test of endpoint tiny failed: FAIL props")
        self.child.processEnded(Failure(ProcessTerminated(exitCode=1)))
        error = self.failureResultOf(self.child.ready, ChildFailed).value
        self.assertIn("twist loopd exited with status 1", str(error))
        self.assertIn("FAIL props", str(error))
        self.assertEqual(self.successResultOf(self.child.ended), 1)

    def test_start_timeout(self) -> None:
        """A child silent past its start timeout fails ready and is killed."""
        self.reactor.advance(60)
        self.failureResultOf(self.child.ready, ChildFailed)
        process = self.reactor.spawned[0][0].transport
        self.assertEqual(process.signals, ["KILL"])

    def test_stop_grace(self) -> None:
        """Stopping sends TERM, then KILL after the grace, and fires with the status."""
        clock = Clock()
        child = Child("c", "ready")
        process = FakeProcess()
        child.makeConnection(process)
        stopped = stop_child(clock, child, grace=5)
        self.assertEqual(process.signals, ["TERM"])
        clock.advance(5)
        self.assertEqual(process.signals, ["TERM", "KILL"])
        child.processEnded(Failure(ProcessTerminated(signal=9)))
        self.assertEqual(self.successResultOf(stopped), -9)
        self.failureResultOf(child.ready, ChildFailed)

    def test_stop_prompt(self) -> None:
        """A child that ends on TERM is not killed; stopping an ended one does nothing."""
        clock = Clock()
        child = Child("c", "ready")
        process = FakeProcess()
        child.makeConnection(process)
        stopped = stop_child(clock, child, grace=5)
        child.processEnded(Failure(ProcessDone(0)))
        self.assertEqual(self.successResultOf(stopped), 0)
        self.failureResultOf(child.ready, ChildFailed)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(self.successResultOf(stop_child(clock, child)), 0)
        self.assertEqual(process.signals, ["TERM"])


class DemoConfigTests(SynchronousTestCase):
    """
    The demo's generated config and the self-test lines it shows.
    """

    def test_config(self) -> None:
        """The config is valid and expects exactly what /props said."""
        props = {
            "chat_template": TEMPLATE,
            "default_generation_settings": {"n_ctx": 4096},
            "total_slots": 2,
        }
        text = render_config(
            endpoint_socket="/t/infer.sock", listen_socket="/t/l.sock", props=props
        )
        config = parse_config(text)
        (endpoint,) = config.endpoints
        self.assertEqual((endpoint.name, endpoint.socket), ("tiny", "/t/infer.sock"))
        self.assertEqual(endpoint.expect.chat_template_sha256, TEMPLATE_SHA)
        self.assertEqual((endpoint.expect.n_ctx, endpoint.expect.total_slots), (4096, 2))
        self.assertEqual(config.server.listen, "unix:/t/l.sock")
        self.assertEqual(
            (
                endpoint.proxy_burst,
                endpoint.proxy_refill_per_second,
                endpoint.proxy_max_connections,
            ),
            (100, 20.0, 32),
        )

    def test_config_without_props(self) -> None:
        """Values /props lacks are not expected."""
        text = render_config(endpoint_socket="/t/i.sock", listen_socket="/t/l.sock", props={})
        expect = parse_config(text).endpoints[0].expect
        self.assertEqual(
            (expect.chat_template_sha256, expect.n_ctx, expect.total_slots), (None,) * 3
        )

    def test_config_tcp(self) -> None:
        """The demo's config listens on a loopback TCP port too, its token in the directory."""
        text = render_config(
            endpoint_socket="/t/i.sock",
            listen_socket="/t/l.sock",
            props={},
            tcp="127.0.0.1:0",
            token_file="/t/token",
        )
        server = parse_config(text).server
        self.assertEqual((server.tcp, server.token_file), ("127.0.0.1:0", "/t/token"))

    def test_tcp_url(self) -> None:
        """The TCP listener's URL is picked out of twist loopd's text log."""
        log = [
            "x [loopd.service#info] TCP listener on http://127.0.0.1:4321: every request needs",
            "x [loopd.service#info] loopd serving /s and http://127.0.0.1:4321 for tiny",
        ]
        self.assertEqual(tcp_url_from_log(log), "http://127.0.0.1:4321")
        self.assertIsNone(tcp_url_from_log(log[1:]))

    def test_serving_text(self) -> None:
        """
        While serving, the demo names both listeners, the token, the status commands, SDK
        lines and the logs.
        """
        stack = DemoStack(SpawningReactor(), lambda text: None)
        self.addCleanup(shutil.rmtree, stack.directory, True)
        stack.tcp_url, stack.token = "http://127.0.0.1:4321", "loopd-TOKEN"
        text = serving_text(stack)
        self.assertIn(f"on the Unix socket {stack.loopd_socket} (no token)", text)
        self.assertIn("on http://127.0.0.1:4321 (every request needs the token loopd-TOKEN)", text)
        self.assertIn('curl -H "Authorization: Bearer loopd-TOKEN" http://127.0.0.1:4321/', text)
        self.assertIn("OPENAI_BASE_URL=http://127.0.0.1:4321/v1 OPENAI_API_KEY=loopd-TOKEN", text)
        self.assertIn("ANTHROPIC_BASE_URL=http://127.0.0.1:4321 ANTHROPIC_API_KEY=loopd-", text)
        self.assertIn(f"loopd status --watch --socket {stack.loopd_socket}", text)
        self.assertIn(f"loopd ui --open --socket {stack.loopd_socket}", text)
        self.assertIn(f"Logs: loopd {stack.directory}/loopd.log, inferproxy ", text)
        self.assertIn(f"{stack.directory}/inferproxy.log", text)

    def test_selftest_lines(self) -> None:
        """The self-test lines are picked out of twist loopd's text log."""
        log = [
            "2025-01-01T00:00:00+0000 [loopd.service#info] selftest tiny: PASS props: ok",
            "2025-01-01T00:00:00+0000 [loopd.service#info] loopd serving unix:/s for tiny",
            "x selftest a:b: FAIL cache: expected 1 got 0",
        ]
        self.assertEqual(
            selftest_lines_from_log(log),
            ["tiny: PASS props: ok", "a:b: FAIL cache: expected 1 got 0"],
        )


def package_imports() -> dict[str, set[str]]:
    """
    Every module of the package outside C{loopd.test}, with the package's modules it
    imports anywhere in its code (at module level or inside a function).
    """
    root = Path(loopd.__file__).parent
    names = {}
    for path in root.rglob("*.py"):
        parts = ("loopd", *path.relative_to(root).with_suffix("").parts)
        if parts[1:2] != ("test",):
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in found if m in names and m != name}
    return graph


class LayeringTests(SynchronousTestCase):
    """
    L{loopd.cli} is the top of the package, and the command's own modules (the chat loop,
    its rendering, the demo) import each other in one direction only.
    """

    def test_nothing_imports_cli(self) -> None:
        """No module of the package imports L{loopd.cli}, even inside a function."""
        graph = package_imports()
        self.assertIn("loopd.cli", graph)
        self.assertEqual(sorted(name for name, deps in graph.items() if "loopd.cli" in deps), [])

    def test_no_circle(self) -> None:
        """Among cli, chatloop, chatui and loopd.demo, no import leads back to its module."""
        graph = package_imports()
        command = {"loopd.cli", "loopd.chatloop", "loopd.chatui"}
        command.update(name for name in graph if name.split(".")[:2] == ["loopd", "demo"])

        def reachable(start: str) -> set[str]:
            seen: set[str] = set()
            todo = [start]
            while todo:
                for dep in graph[todo.pop()] & command:
                    if dep not in seen:
                        seen.add(dep)
                        todo.append(dep)
            return seen

        self.assertEqual(sorted(name for name in command if name in reachable(name)), [])
