"""
The C{loopd} command end to end, with processes: C{loopd demo --once}; C{loopd chat} in a
pseudo-terminal for a two-turn conversation, and C{loopd selftest}, both against a demo
stack (a real tiny llama.cpp server, C{twist inferproxy}, C{twist loopd}) started here with
the demo's own orchestration.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.error import ProcessDone
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest, TestCase

from loopd.demo.run import DemoStack
from loopd.test.support.gateway_stack import BUILD_TEST_TIMEOUT, ensure_binary
from loopd.test.support.peers import real_reactor

_MISSING = [name for name in ("gguf", "xllamacpp") if importlib.util.find_spec(name) is None]
if _MISSING:  # pragma: no cover - the test extra is not installed
    raise SkipTest(f"the real llama.cpp server needs the test extra: {', '.join(_MISSING)}")

ANSWER = b"Hello from the tiny model!"
#: Seconds any one expected output may take to show.
WAIT = 60.0
_BIN = os.path.join(os.path.dirname(sys.executable), "loopd")
#: The installed console script, else the module (an install without the entry point).
LOOPD = [_BIN] if os.path.exists(_BIN) else [sys.executable, "-m", "loopd.cli"]


class Command(ProcessProtocol):
    """
    A C{loopd} child: its output so far, Deferreds for output still to come, its end.
    """

    def __init__(self) -> None:
        self.output = b""
        self.cursor = 0
        self.ended: Deferred[int] = Deferred()
        self._waiting: tuple[bytes, Deferred[bytes]] | None = None

    def childDataReceived(self, fd: int, data: bytes) -> None:
        self.output += data
        self._check()

    def expect(self, text: bytes, timeout: float = WAIT) -> Deferred[bytes]:
        """
        Fire with the output from the last match up to and including the next C{text};
        fail with a timeout error after C{timeout} seconds.
        """
        d: Deferred[bytes] = Deferred()
        self._waiting = (text, d)
        self._check()
        return d.addTimeout(timeout, real_reactor())

    def _check(self) -> None:
        if self._waiting is None:
            return
        text, d = self._waiting
        found = self.output.find(text, self.cursor)
        if found >= 0:
            self._waiting = None
            start, self.cursor = self.cursor, found + len(text)
            d.callback(self.output[start : self.cursor])

    def type(self, text: bytes) -> None:
        """Type C{text} on the child's terminal (or write it to its input)."""
        assert self.transport is not None
        self.transport.write(text)

    def processEnded(self, reason: Failure) -> None:
        value: Any = reason.value
        self.ended.callback(0 if reason.check(ProcessDone) else value.exitCode)


def run_loopd(*args: str, pty: bool = False, **environ: str) -> Command:
    """Start C{loopd ARGS...}, in a pseudo-terminal if C{pty}, C{environ} added."""
    command = Command()
    argv = [*LOOPD, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **environ)
    real_reactor().spawnProcess(command, argv[0], argv, env=env, usePTY=pty)
    return command


def stop(command: Command) -> Deferred[int]:
    """Kill the child if it still runs; fire when it is gone."""
    if not command.ended.called and command.transport is not None:
        command.transport.signalProcess("KILL")
    return command.ended


class CommandEndToEndTests(TestCase):
    """
    The loopd command against the real thing.
    """

    timeout = 180

    def spawn(self, *args: str, pty: bool = False, **environ: str) -> Command:
        """Start C{loopd ARGS...}, killed at cleanup if still running."""
        command = run_loopd(*args, pty=pty, **environ)
        self.addCleanup(stop, command)
        return command

    @inlineCallbacks
    def start_stack(self) -> Any:
        """Start a demo stack here (steps 1 to 5), stopped and removed at cleanup."""
        self.steps: list[str] = []
        stack = DemoStack(real_reactor(), self.steps.append)
        self.addCleanup(stack.stop)
        yield stack.start()
        return stack

    @inlineCallbacks
    def test_demo_once(self) -> Any:
        """C{loopd demo --once} tells six steps, streams the answer, exits 0, removes its dir."""
        demo = self.spawn("demo", "--once")
        status = yield demo.ended.addTimeout(120, real_reactor())
        output = demo.output.decode("utf-8", "replace")
        self.assertEqual(status, 0, output)
        for step in range(1, 7):
            self.assertIn(f"{step}/6 ", output)
        self.assertIn(ANSWER.decode(), output)
        self.assertIn("PASS props", output)
        directory = re.search(r"building the tiny model in (\S+)", output)
        assert directory is not None
        self.assertFalse(os.path.exists(directory.group(1)))

    @inlineCallbacks
    def test_demo_router_once(self) -> Any:
        """
        C{loopd demo --once --models 2}: the genuine llama-server in router mode (the kit's
        binary), loopd serving both tiny models, each self-tested, a chat with each (the
        second one a swap), loopd's /v1/models showing the second loaded; exit 0.
        """
        binary = yield ensure_binary()
        demo = self.spawn("demo", "--once", "--models", "2", LOOPD_LLAMA_SERVER=binary)
        status = yield demo.ended.addTimeout(120, real_reactor())
        output = demo.output.decode("utf-8", "replace")
        self.assertEqual(status, 0, output)
        self.assertIn("starting llama-server in router mode (--models-max 1)", output)
        for model in ("tiny1", "tiny2"):
            self.assertIn(f"{model}: PASS cache", output)
            self.assertIn(f"(each one a swap): {model}", output)
        self.assertEqual(output.count(ANSWER.decode()), 2)
        self.assertIn("loopd's /v1/models: tiny1 unloaded, tiny2 loaded", output)

    test_demo_router_once.timeout = BUILD_TEST_TIMEOUT  # type: ignore[attr-defined]

    @inlineCallbacks
    def test_chat_in_a_terminal(self) -> Any:
        """In a pty, two turns show progress, dim thinking and the answer; /quit exits 0."""
        stack = yield self.start_stack()
        chat = self.spawn("chat", "--socket", stack.loopd_socket, pty=True)
        yield chat.expect(b"you> ")
        chat.type(b"Hi there\n")
        first = yield chat.expect(b"you> ")
        chat.type(b"And once more?\n")
        second = yield chat.expect(b"you> ")
        chat.type(b"/quit\n")
        status = yield chat.ended.addTimeout(WAIT, real_reactor())
        self.assertEqual(status, 0, chat.output)
        for turn in (first, second):
            self.assertIn(ANSWER, turn)
            self.assertIn(b"\x1b[2mLet me think about this...\x1b[0m", turn)
            self.assertIn(b"\rprompt [", turn)
        self.assertGreater(prompt_total(second), prompt_total(first))

    @inlineCallbacks
    def test_selftest(self) -> Any:
        """C{loopd selftest} exits 0 on the stack's config, 1 naming props with a wrong hash."""
        stack = yield self.start_stack()
        passing = self.spawn("selftest", "--config", stack.config_path)
        status = yield passing.ended.addTimeout(WAIT, real_reactor())
        lines = passing.output.decode().splitlines()
        self.assertEqual(status, 0, lines)
        self.assertEqual([line.split(" ")[1] for line in lines], ["PASS"] * 3)
        with open(stack.config_path, encoding="utf-8") as f:
            text = f.read()
        right = re.search(r'chat_template_sha256 = "([0-9a-f]{64})"', text)
        assert right is not None
        wrong_path = os.path.join(stack.directory, "wrong.toml")
        with open(wrong_path, "w", encoding="utf-8") as f:
            f.write(text.replace(right.group(1), "0" * 64))
        failing = self.spawn("selftest", "--config", wrong_path)
        status = yield failing.ended.addTimeout(WAIT, real_reactor())
        output = failing.output.decode()
        self.assertEqual(status, 1, output)
        self.assertIn(
            f"tiny: FAIL props: chat_template sha256 expected {'0' * 64} got {right.group(1)}",
            output,
        )


def prompt_total(turn: bytes) -> int:
    """The prompt size the last progress line of a turn's output shows."""
    totals = re.findall(rb"(\d+)/(\d+) tokens", turn)
    assert totals, turn
    return int(totals[-1][1])
